"""Stochastic-rounding thresholds from partitionable Threefry, computed from global indices.

A threshold is an integer index `t` with `bits` bits; it stands for the real threshold
$r = (t + 1/2) / 2^{\\text{bits}}$, which is uniform on a grid shifted half a step, so
rounding with it has a bias of at most $\\Delta / 2^{\\text{bits}+1}$. Seven-bit thresholds (the
S3R default) are cut four per 32-bit Threefry word; 23-bit thresholds (independent SR) take one
word per element.

Every function takes a [`s3req.Block`][] that says which block of the global gradient tensor the
caller holds, so a shard computes exactly its own thresholds (see the scaling-out guide).
"""

import typing

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from ._threefry import _mul_wide, key_words, random_bits, threefry2x32


SHARED_BITS = 7
"""Bits of a shared (per-token / per-example) threshold: four are cut from each 32-bit word."""

ELEMENT_BITS = 23
"""Bits of a per-element threshold (the top 23 bits of one 32-bit word per element)."""


@typing.final
class Block(eqx.Module):
    """Which block of the global `(batch, seq, d_out)` gradient tensor a computation holds.

    Unsharded code uses the whole tensor (`Block.whole(shape)`); inside `jax.shard_map` the
    start offsets come from `jax.lax.axis_index`, so every shard derives its thresholds from
    global element indices and all shards together reproduce the unsharded thresholds bit for
    bit.

    **Arguments:**

    - `global_shape`: `(batch, seq, d_out)` of the whole logical tensor.
    - `start`: global index of the block's first element along each of the three axes.
    - `shape`: the block's `(batch, seq, d_out)`.
    """

    global_shape: tuple[int, int, int] = eqx.field(static=True)
    start: tuple[Array | int, Array | int, Array | int]
    shape: tuple[int, int, int] = eqx.field(static=True)

    @staticmethod
    def whole(shape: tuple[int, int, int]) -> "Block":
        """The block that is the whole tensor."""
        shape = tuple(int(n) for n in shape)  # pyright: ignore
        return Block(shape, (0, 0, 0), shape)  # pyright: ignore


@typing.final
class Rows(eqx.Module):
    """A ragged layout: rows of a gradient identified by global ids (MoE expert GEMMs).

    Expert GEMMs run on rows sorted by expert. Their thresholds are keyed by each row's
    **global** `(token, slot)` id, never by its sorted position, so they do not depend on the
    routing order or on sharding.

    **Arguments:**

    - `row_id`: global id of every row, e.g. `token_index * top_k + slot` (int32, `(n,)`).
    - `example_id`: the example (batch index) of every row (int32, `(n,)`).
    - `d`: number of channels of the gradient rows this computation holds.
    - `d_start`: global index of its first channel (inside `jax.shard_map` with the channels
      sharded; default 0).
    - `d_global`: number of channels of the whole gradient (default `d`).
    """

    row_id: Int[Array, " n"]
    example_id: Int[Array, " n"]
    d: int = eqx.field(static=True)
    d_start: Array | int = 0
    d_global: int | None = eqx.field(default=None, static=True)


Layout = Block | Rows
"""The part of the gradient `G'` a computation holds: a dense [`s3req.Block`][] or expert
[`s3req.Rows`][]."""

Thresholds = tuple[Int[Array, "..."], int]
"""Threshold indices `t` and their bit width `bits`: the real threshold is
$(t + 1/2)/2^{\\text{bits}}$. `t` broadcasts against the layout's block of `G'`."""


def _cut_7bit(words: Array, byte: Array) -> Array:
    """Threshold index number `byte` (0..3) of each 32-bit word: 7 bits of that byte."""
    shift = (byte * 8).astype(jnp.uint32)
    return ((words >> shift) & jnp.uint32(0x7F)).astype(jnp.int32)


def token_thresholds(key: PRNGKeyArray, block: Layout) -> Int[Array, "..."]:
    """Phi2D: one 7-bit threshold per token, shape `(b, s, 1)` (broadcast over channels).

    Token `n = batch_index * seq + seq_index` takes byte `n % 4` of word `n // 4` of
    `jax.random.bits(key, (ceil(B*S/4),))`: `B*S/4` Threefry words for the whole tensor.
    For [`s3req.Rows`][] the token number is the row's global id and the result has shape
    `(n, 1)`.
    """
    if isinstance(block, Rows):
        return _ids_7bit(key, block.row_id)[:, None]
    B, S, _ = block.global_shape
    b, s, _ = block.shape
    b0, s0, _ = block.start
    if isinstance(s0, int) and S % 4 == 0 and s0 % 4 == 0 and s % 4 == 0:
        # Aligned block: hash each word once and unpack its four bytes.
        words = random_bits(key, (B, S // 4), start=(b0, s0 // 4), shape=(b, s // 4))
        t = _cut_7bit(words[..., None], jnp.arange(4, dtype=jnp.uint32)[None, None, :])
        return t.reshape(b, s, 1)
    # General block: the word of each token (a word may be hashed up to four times).
    rows = jnp.arange(b, dtype=jnp.uint32)[:, None] + jnp.asarray(b0, jnp.uint32)
    cols = jnp.arange(s, dtype=jnp.uint32)[None, :] + jnp.asarray(s0, jnp.uint32)
    n = rows * jnp.uint32(S) + cols
    words = _words_at(key, n >> jnp.uint32(2))
    return _cut_7bit(words, n & jnp.uint32(3))[..., None]


def example_thresholds(key: PRNGKeyArray, block: Layout) -> Int[Array, "..."]:
    """PhiBcast: one 7-bit threshold per example, shape `(b, 1, 1)` (`(n, 1)` for `Rows`).

    Example `n` takes byte `n % 4` of word `n // 4` of `jax.random.bits(key, (ceil(B/4),))`.
    """
    if isinstance(block, Rows):
        return _ids_7bit(key, block.example_id)[:, None]
    n = jnp.arange(block.shape[0], dtype=jnp.int32) + jnp.asarray(block.start[0], jnp.int32)
    return _ids_7bit(key, n)[:, None, None]


def _ids_7bit(key: PRNGKeyArray, ids: Int[Array, "..."]) -> Int[Array, "..."]:
    """The 7-bit threshold of every id: byte `id % 4` of word `id // 4`."""
    n = ids.astype(jnp.uint32)
    return _cut_7bit(_words_at(key, n >> jnp.uint32(2)), n & jnp.uint32(3))


def element_thresholds(key: PRNGKeyArray, block: Layout) -> Int[Array, "..."]:
    """Independent SR: one 32-bit Threefry word per element; its top 23 bits are the threshold.

    The words are `jax.random.bits(key, (B, S, D))[block]`; for [`s3req.Rows`][] the counter of
    element `(row, c)` is `row_id * d_global + c`, `c` the global channel.
    """
    if isinstance(block, Rows):
        d_global = block.d if block.d_global is None else block.d_global
        hi, lo = _mul_wide(block.row_id.astype(jnp.uint32)[:, None], d_global)
        c = jnp.arange(block.d, dtype=jnp.uint32)[None, :] + jnp.asarray(block.d_start, jnp.uint32)
        lo2 = lo + c
        hi = hi + (lo2 < c).astype(jnp.uint32)
        k0, k1 = key_words(key)
        b0, b1 = threefry2x32(k0, k1, hi, lo2)
        words = b0 ^ b1
    else:
        words = random_bits(key, block.global_shape, start=block.start, shape=block.shape)
    return (words >> jnp.uint32(32 - ELEMENT_BITS)).astype(jnp.int32)


def _words_at(key: PRNGKeyArray, index: Array) -> Array:
    """Words `index` (uint32, any shape) of `jax.random.bits(key, (n,))` for any `n > index`.

    The counter of element `i` of a 1-D tensor is `i` itself (high word zero below 2**32).
    """
    k0, k1 = key_words(key)
    b0, b1 = threefry2x32(k0, k1, jnp.zeros_like(index), index)
    return b0 ^ b1
