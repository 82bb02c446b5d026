"""A pure-`jax.numpy` Threefry-2x32 that reproduces partitionable `jax.random.bits`.

`jax.random.bits(key, shape, jnp.uint32)` with `jax_threefry_partitionable` (the default) hashes
the row-major linear index `n` of every element with Threefry-2x32 and returns `b1 ^ b2`, where
`(b1, b2) = threefry2x32(key_data(key), (hi(n), lo(n)))`. Computing the same hash ourselves from
*global* indices lets any block of the tensor (a shard, a chunk) be produced on its own, bit for
bit equal to the corresponding slice of `jax.random.bits` over the whole tensor, and lets XLA fuse
the hash with its consumer (the built-in CPU lowering is a rolled loop that cannot fuse).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray, UInt32


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x: Array, r: int) -> Array:
    return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def threefry2x32(
    k0: Array, k1: Array, x0: Array, x1: Array
) -> tuple[UInt32[Array, "..."], UInt32[Array, "..."]]:
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011), elementwise over broadcast arrays.

    **Arguments:**

    - `k0`, `k1`: the two key words (uint32).
    - `x0`, `x1`: the two counter words (uint32).

    **Returns:**

    The two output words.
    """
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(0x1BD11BDA))
    x0 = x0 + ks[0]
    x1 = x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r)
            x1 = x1 ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def key_words(key: PRNGKeyArray) -> tuple[Array, Array]:
    """The two uint32 words of a Threefry key (typed `jax.random.key` or raw `PRNGKey`)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(key)
    else:
        data = key
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ValueError(
            "s3req needs a single Threefry key (key data of shape (2,) uint32), got key data "
            f"of shape {data.shape} and dtype {data.dtype}. Use `jax.random.key(seed)` (the "
            "default threefry2x32 implementation) and split it per call, not a batch of keys."
        )
    return data[0], data[1]


def _mul_wide(a: Array, b: int) -> tuple[Array, Array]:
    """Full 64-bit product of uint32 `a` and a Python int `b < 2**32`, as (hi, lo) uint32."""
    a_lo, a_hi = a & jnp.uint32(0xFFFF), a >> jnp.uint32(16)
    b_lo, b_hi = jnp.uint32(b & 0xFFFF), jnp.uint32(b >> 16)
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> jnp.uint32(16)) + (lh & jnp.uint32(0xFFFF)) + (hl & jnp.uint32(0xFFFF))
    lo = (ll & jnp.uint32(0xFFFF)) | (mid << jnp.uint32(16))
    hi = hh + (lh >> jnp.uint32(16)) + (hl >> jnp.uint32(16)) + (mid >> jnp.uint32(16))
    return hi, lo


def linear_index(
    global_shape: Sequence[int], start: Sequence[Array | int], shape: Sequence[int]
) -> tuple[UInt32[Array, "..."], UInt32[Array, "..."]]:
    """Row-major linear indices (as a 64-bit (hi, lo) pair) of a block of a global array.

    **Arguments:**

    - `global_shape`: the shape of the whole logical tensor.
    - `start`: the global index of the block's first element along every axis (ints or traced
      scalars, e.g. built from `jax.lax.axis_index` inside `jax.shard_map`).
    - `shape`: the shape of the block.

    **Returns:**

    `(hi, lo)`, uint32 arrays of shape `shape`.
    """
    if not (len(global_shape) == len(start) == len(shape)):
        raise ValueError("global_shape, start and shape must have the same length.")
    hi = jnp.zeros(tuple(shape), jnp.uint32)
    lo = jnp.zeros(tuple(shape), jnp.uint32)
    for axis, (n, s, m) in enumerate(zip(global_shape, start, shape)):
        if n >= 2**32:
            raise ValueError(f"Axis {axis} has {n} >= 2**32 elements; not supported.")
        # (hi, lo) <- (hi, lo) * n + index
        p_hi, p_lo = _mul_wide(lo, n)
        hi = hi * jnp.uint32(n) + p_hi
        idx = jax.lax.broadcasted_iota(jnp.uint32, tuple(shape), axis) + jnp.asarray(s, jnp.uint32)
        lo = p_lo + idx
        hi = hi + (lo < idx).astype(jnp.uint32)
    return hi, lo


def random_bits(
    key: PRNGKeyArray,
    global_shape: Sequence[int],
    *,
    start: Sequence[Array | int] | None = None,
    shape: Sequence[int] | None = None,
) -> UInt32[Array, "..."]:
    """A block of `jax.random.bits(key, global_shape, jnp.uint32)`, computed on its own.

    Bitwise equal to `jax.random.bits(key, global_shape, jnp.uint32)[block]` (with the default,
    partitionable Threefry), where `block` starts at `start` and has shape `shape` (default: the
    whole tensor). Only the block's words are hashed, so a shard inside `jax.shard_map` computes
    exactly its own part with no communication.

    **Arguments:**

    - `key`: a Threefry key.
    - `global_shape`: the shape of the whole logical tensor.
    - `start`: global index of the block's first element (default: all zeros).
    - `shape`: the block's shape (default: `global_shape`).

    **Returns:**

    A uint32 array of shape `shape`.
    """
    global_shape = tuple(int(n) for n in global_shape)
    shape = global_shape if shape is None else tuple(int(n) for n in shape)
    start = (0,) * len(global_shape) if start is None else tuple(start)
    k0, k1 = key_words(key)
    hi, lo = linear_index(global_shape, start, shape)
    b0, b1 = threefry2x32(k0, k1, hi, lo)
    return b0 ^ b1
