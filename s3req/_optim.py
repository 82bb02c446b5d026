"""Low-precision optimizer pieces built on stochastic rounding.

- [`s3req.apply_updates_sr`][]: keep parameters in bfloat16 (or float16, float8) with no
  float32 master copy. `p + u` is formed in float32 and rounded back to the parameter's dtype
  stochastically, so small updates are not swamped: $E[p_{t+1}] = p_t + u_t$.
- [`s3req.adam_8bit`][]: AdamW whose two moments are stored as 8-bit codes (int8/uint8 or
  float8) with one float32 scale per block of 256 values, every state write stochastically
  rounded, as an `optax.GradientTransformation`.

Both are plain functions of arrays and keys: they work inside `jax.jit`, `eqx.filter_jit` and
with any optax optimizer or chain.
"""

import typing
from collections.abc import Callable
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree, Shaped, UInt32

from ._float_sr import float_format, FLOAT_FORMATS, float_thresholds, sr_float
from ._threefry import key_words


_F32 = jnp.float32

STATE_DTYPES: tuple[jnp.dtype, ...] = tuple(
    jnp.dtype(d) for d in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn, jnp.float8_e5m2)
)
"""Storage formats of the [`s3req.adam_8bit`][] moments."""


# ---------------------------------------------------------------------------------------------
# Stochastically rounded parameter updates


def apply_updates_sr(
    params: PyTree,
    updates: PyTree,
    *,
    key: PRNGKeyArray,
    topology: Literal["element", "row"] = "element",
    bits: int = 32,
) -> PyTree:
    """`optax.apply_updates` / `eqx.apply_updates` with stochastic rounding into the
    parameter dtype: parameters can live in bfloat16 with no float32 master copy.

    Every array leaf `p` whose dtype is a narrow float (`bfloat16`, `float16`, `float8_*`;
    see [`s3req.stochastic_round`][]) becomes `stochastic_round(p + u, p.dtype)`, with
    `p + u` formed exactly in float32. Updates smaller than half an ulp of `p` are then kept
    in expectation instead of being swamped (plain `p + u` in bfloat16 rounds them away).
    float32 leaves get `p + u` in float32 (round to nearest). Leaves whose update is `None`
    (e.g. the non-array leaves of an Equinox model, as with `eqx.apply_updates`) are returned
    unchanged.

    Leaf number `i` (in `jax.tree_util` order of `updates`) draws its thresholds from
    `jax.random.fold_in(key, i)`; pass a fresh `key` every step.

    !!! Example

        ```python
        params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        opt = optax.adamw(1e-3)           # or s3req.adam_8bit(1e-3, key=seed_key)
        state = opt.init(params)
        for step in range(n):
            grads = jax.grad(loss)(params, batch)
            updates, state = opt.update(grads, state, params)
            params = apply_updates_sr(params, updates, key=jax.random.fold_in(key, step))
        ```

    **Arguments:**

    - `params`: a pytree of parameters (an Equinox model works as is).
    - `updates`: a pytree of updates with the structure of `params` (or a prefix of it with
      `None` where nothing changes), any float dtype; they are cast to float32 first.
    - `key`: the step's key. (Keyword only argument.)
    - `topology`: `"element"` (one threshold per element) or `"row"` (one per row of the last
      axis of each leaf, shared). (Keyword only argument.)
    - `bits`: threshold width, 8, 16 or 32. (Keyword only argument.)

    **Returns:**

    The new parameters: the structure and dtypes of `params`.
    """
    is_none = lambda x: x is None
    leaves, treedef = jtu.tree_flatten(updates, is_leaf=is_none)
    p_leaves = treedef.flatten_up_to(params)
    out = []
    for i, (u, p) in enumerate(zip(leaves, p_leaves)):
        if u is None:
            out.append(p)
            continue
        p_arr = jnp.asarray(p)
        total = p_arr.astype(_F32) + jnp.asarray(u).astype(_F32)
        if p_arr.dtype in FLOAT_FORMATS:
            t = float_thresholds(jr.fold_in(key, i), p_arr.shape, topology=topology, bits=bits)
            out.append(sr_float(total, p_arr.dtype, t, bits=bits))
        elif p_arr.dtype == jnp.dtype(_F32):
            out.append(total)
        else:
            raise TypeError(
                f"apply_updates_sr: parameter leaf {i} has dtype {p_arr.dtype}; expected "
                "float32 or one of " + ", ".join(d.name for d in FLOAT_FORMATS) + "."
            )
    return jtu.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------
# Blockwise 8-bit storage


class BlockQuantized(NamedTuple):
    """A float32 array stored as 8-bit codes with one float32 scale per block.

    The array is flattened, padded to whole blocks, and block `j` is `codes * scale[j]`
    (codes keep the array's own shape, so the padding costs nothing).

    **Arguments:**

    - `codes`: int8, uint8 or float8 codes, in the shape of the array.
    - `scale`: one positive float32 scale per block.
    """

    codes: Shaped[Array, "..."]
    scale: Float[Array, " blocks"]


def _code_max(dtype: jnp.dtype) -> float:
    if dtype == jnp.dtype(jnp.int8):
        return 127.0
    if dtype == jnp.dtype(jnp.uint8):
        return 255.0
    return float_format(dtype).max_finite


def _blocks(x: Array, block_size: int) -> Array:
    flat = x.reshape(-1)
    n_blocks = -(-flat.size // block_size)
    return jnp.pad(flat, (0, n_blocks * block_size - flat.size)).reshape(n_blocks, block_size)


def _unblocks(b: Array, shape: tuple[int, ...]) -> Array:
    size = 1
    for n in shape:
        size *= n
    return b.reshape(-1)[:size].reshape(shape)


def quantize_blockwise(
    x: Float[Array, "..."],
    dtype: typing.Any,
    *,
    key: PRNGKeyArray | None,
    block_size: int = 256,
    topology: Literal["element", "row"] = "element",
    bits: int = 16,
) -> BlockQuantized:
    """Store `x` as 8-bit codes with an absmax scale per block, stochastically rounded.

    The scale of a block maps its largest magnitude to the largest code (127 for int8, 255 for
    uint8, the largest finite value for float8); an all-zero block gets scale 1. Codes are
    stochastically rounded, so `dequantize_blockwise` is unbiased: $E[\\hat x] = x$ (up to the
    threshold bias of `bits`, at most a code step / $2^{\\text{bits}+1}$, and one float32
    rounding in `x / scale`). uint8 requires `x >= 0`; negative values clip to 0.

    **Arguments:**

    - `x`: float32 values.
    - `dtype`: one of `s3req.STATE_DTYPES`: `int8`, `uint8`, `float8_e4m3fn`, `float8_e5m2`.
    - `key`: thresholds key, or `None` for round to nearest. (Keyword only argument.)
    - `block_size`: values per scale. (Keyword only argument.)
    - `topology`: `"element"` or `"row"` (one threshold per block). (Keyword only argument.)
    - `bits`: threshold width (8 or 16 for integer codes; 8, 16 or 32 for float8).
      (Keyword only argument.)

    **Returns:**

    A [`s3req.BlockQuantized`][].
    """
    dt = jnp.dtype(dtype)
    if dt not in STATE_DTYPES:
        raise ValueError(
            f"Cannot store 8-bit state as {dt.name}: use one of "
            + ", ".join(d.name for d in STATE_DTYPES)
            + "."
        )
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    x32 = x.astype(_F32)
    b = _blocks(x32, block_size)
    amax = jnp.max(jnp.abs(b), axis=1, keepdims=True)
    qmax = _code_max(dt)
    scale = jnp.where(amax > 0, amax / qmax, jnp.ones_like(amax))
    y = b / scale
    t = None
    if key is not None:
        t = float_thresholds(key, b.shape, topology=topology, bits=bits)
    if dt in FLOAT_FORMATS:
        codes = sr_float(y, dt, t, bits=bits)
    else:
        lo = -int(qmax) if dt == jnp.dtype(jnp.int8) else 0
        y = jnp.clip(y, float(lo), qmax)
        if t is None:
            q = jnp.round(y)
        else:
            if bits > 23:
                raise ValueError("Integer codes take 8- or 16-bit thresholds, got 32.")
            # floor(y + (t + 1/2) / 2**bits) in exact integer arithmetic (y < 2**8).
            shift = bits + 1
            z = jnp.floor(y * float(2**shift)).astype(jnp.int32)
            q = (z + 2 * t.astype(jnp.int32) + 1) >> shift
        codes = jnp.clip(q.astype(jnp.int32), lo, int(qmax)).astype(dt)
    return BlockQuantized(_unblocks(codes, x.shape), scale[:, 0])


def dequantize_blockwise(q: BlockQuantized, block_size: int = 256) -> Float[Array, "..."]:
    """float32 values of a [`s3req.BlockQuantized`][] array.

    **Arguments:**

    - `q`: the codes and scales.
    - `block_size`: values per scale (as when quantizing).

    **Returns:**

    A float32 array in the shape of `q.codes`.
    """
    b = _blocks(q.codes.astype(_F32), block_size)
    return _unblocks(b * q.scale[:, None], q.codes.shape)


# ---------------------------------------------------------------------------------------------
# 8-bit AdamW


def _to_bits(codes: Array) -> Array:
    """float8 codes as their uint8 bit patterns (`np.save`, hence Equinox serialisation,
    cannot write float8 arrays); integer codes unchanged."""
    if codes.dtype in FLOAT_FORMATS:
        return jax.lax.bitcast_convert_type(codes, jnp.uint8)
    return codes


def _from_bits(codes: Array, dtype: jnp.dtype) -> Array:
    if dtype in FLOAT_FORMATS:
        return jax.lax.bitcast_convert_type(codes, dtype)
    return codes


class Adam8bitState(NamedTuple):
    """State of [`s3req.adam_8bit`][]: only arrays, so it serialises like any pytree.

    **Arguments:**

    - `count`: steps taken (int32).
    - `key`: the raw data (`jax.random.key_data`) of the seed key given to `adam_8bit`; step
      `count` draws its thresholds from `fold_in(key, count)`.
    - `mu`: first moments, a pytree of [`s3req.BlockQuantized`][] like the parameters.
    - `nu`: second moments, likewise.

    float8 codes are held as their uint8 bit patterns (the format is a setting of the
    optimizer), because `np.save`, and so `eqx.tree_serialise_leaves`, cannot write float8.
    """

    count: Int[Array, ""]  # pyright: ignore[reportIncompatibleMethodOverride]
    key: UInt32[Array, " 2"]
    mu: PyTree[BlockQuantized]
    nu: PyTree[BlockQuantized]


def adam_8bit(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: PyTree | Callable[[PyTree], PyTree] | None = None,
    *,
    key: PRNGKeyArray,
    block_size: int = 256,
    mu_dtype: typing.Any = jnp.int8,
    nu_dtype: typing.Any = jnp.float8_e4m3fn,
    topology: Literal["element", "row"] = "element",
    bits: int = 16,
) -> optax.GradientTransformation:
    """AdamW with both moments stored in 8 bits, blockwise scaled, stochastically rounded.

    Each step dequantizes the moments to float32, applies the usual AdamW recursions
    $m \\leftarrow \\beta_1 m + (1-\\beta_1) g$, $v \\leftarrow \\beta_2 v + (1-\\beta_2) g^2$,
    computes the update from these float32 values (bias-corrected, with decoupled weight
    decay), and stores the new moments with [`s3req.quantize_blockwise`][]. Stochastic
    rounding keeps the stored moments unbiased, so long exponential averages of small terms
    are not swamped the way round-to-nearest would swamp them.

    Memory: one byte per moment and parameter plus one float32 scale per `block_size` values,
    about 2.03 bytes per parameter against 8 for float32 AdamW (4 for bfloat16 moments).

    Defaults: the first moment is signed and fairly flat within a block, so int8 codes suffice;
    the second moment spans the squared dynamic range of the gradients, so it is stored as
    `float8_e4m3fn` (a relative grid: small entries next to a large one in the same block
    are not rounded to zero as often as with linear codes).

    **Randomness.** `key` is a seed, not a per-step key: `init` stores its raw key data in the
    optimizer *state* (state is data, checkpointed with the run, never a module field or a
    constant), and step `count` uses `fold_in(fold_in(key, count), leaf_index)`, so every
    step and every parameter draws fresh thresholds and a restored state continues the same
    stream. This keeps the optax signature `update(grads, state, params)`.

    **Arguments:**

    - `learning_rate`: a float or an optax schedule (evaluated at the step count).
    - `b1`, `b2`: moment decays.
    - `eps`: added to $\\sqrt{\\hat v}$.
    - `weight_decay`: decoupled weight decay (needs `params` in `update`).
    - `mask`: where to apply the weight decay, as in `optax.adamw`: a pytree of bools like the
      parameters, or a function of the parameters returning one; `None` decays everything.
    - `key`: seed of the stochastic rounding of the state. (Keyword only argument.)
    - `block_size`: values per scale. (Keyword only argument.)
    - `mu_dtype`: storage of the first moment: `int8`, `float8_e4m3fn` or `float8_e5m2`.
      (Keyword only argument.)
    - `nu_dtype`: storage of the second moment: `float8_e4m3fn` or `float8_e5m2`. Linear
      integer codes are refused: they round the small second moments of a block to zero and
      the update divides by their square root (uint8 second moments diverged in our test).
      (Keyword only argument.)
    - `topology`, `bits`: thresholds of the state rounding, see
      [`s3req.quantize_blockwise`][]. (Keyword only arguments.)

    **Returns:**

    An `optax.GradientTransformation`. Its updates are float32; apply them with
    [`s3req.apply_updates_sr`][] (low-precision parameters) or `optax.apply_updates`
    (float32 parameters).
    """
    for name, dt in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
        if jnp.dtype(dt) not in STATE_DTYPES:
            raise ValueError(
                f"{name} must be one of " + ", ".join(d.name for d in STATE_DTYPES) + "."
            )
    if jnp.dtype(nu_dtype) not in FLOAT_FORMATS:
        raise ValueError(
            "nu_dtype must be a float8 format (float8_e4m3fn or float8_e5m2): linear integer "
            "codes round the small second moments of a block to zero, and the update divides "
            "by their square root (measured: uint8 second moments diverge)."
        )
    if jnp.dtype(mu_dtype) == jnp.dtype(jnp.uint8):
        raise ValueError("mu_dtype=uint8 cannot hold negative first moments: use int8.")
    k0, k1 = key_words(key)
    seed = jnp.stack([k0, k1])

    mu_dt, nu_dt = jnp.dtype(mu_dtype), jnp.dtype(nu_dtype)

    def store(x, dtype, k):
        q = quantize_blockwise(
            x, dtype, key=k, block_size=block_size, topology=topology, bits=bits
        )
        return q._replace(codes=_to_bits(q.codes))

    def load(q, dtype):
        return dequantize_blockwise(q._replace(codes=_from_bits(q.codes, dtype)), block_size)

    def init_fn(params: PyTree) -> Adam8bitState:
        def zeros(p, dt):
            n_blocks = -(-jnp.size(p) // block_size)
            codes = _to_bits(jnp.zeros(jnp.shape(p), dt))
            return BlockQuantized(codes, jnp.ones((n_blocks,), _F32))

        return Adam8bitState(
            count=jnp.zeros((), jnp.int32),
            key=seed,
            mu=jtu.tree_map(lambda p: zeros(p, mu_dtype), params),
            nu=jtu.tree_map(lambda p: zeros(p, nu_dtype), params),
        )

    def update_fn(updates: PyTree, state: Adam8bitState, params: PyTree | None = None):
        if weight_decay != 0.0 and params is None:
            raise ValueError("adam_8bit with weight_decay needs `params` in update().")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        count = jnp.asarray(optax.safe_increment(state.count))
        t = count.astype(_F32)
        c1 = 1 - jnp.asarray(b1, _F32) ** t
        c2 = 1 - jnp.asarray(b2, _F32) ** t
        step_key = jr.fold_in(jax.random.wrap_key_data(state.key), state.count)
        g_leaves, treedef = jtu.tree_flatten(updates)
        mu_leaves = treedef.flatten_up_to(state.mu)
        nu_leaves = treedef.flatten_up_to(state.nu)
        p_leaves = [None] * len(g_leaves) if params is None else treedef.flatten_up_to(params)
        decay = [True] * len(g_leaves)
        if weight_decay != 0.0 and mask is not None:
            m_tree = mask(params) if callable(mask) else mask
            decay = [bool(m) for m in treedef.flatten_up_to(m_tree)]
        out_u, out_mu, out_nu = [], [], []
        for i, (g, mq, vq, p) in enumerate(zip(g_leaves, mu_leaves, nu_leaves, p_leaves)):
            g32 = jnp.asarray(g).astype(_F32)
            mu = b1 * load(mq, mu_dt) + (1 - b1) * g32
            nu = b2 * load(vq, nu_dt) + (1 - b2) * jnp.square(g32)
            u = (mu / c1) / (jnp.sqrt(nu / c2) + eps)
            if weight_decay != 0.0 and decay[i]:
                u = u + weight_decay * jnp.asarray(p).astype(_F32)
            out_u.append(-jnp.asarray(lr, _F32) * u)
            k = jr.fold_in(step_key, i)
            out_mu.append(store(mu, mu_dt, jr.fold_in(k, 0)))
            out_nu.append(store(nu, nu_dt, jr.fold_in(k, 1)))
        new_state = Adam8bitState(
            count=count,
            key=state.key,
            mu=jtu.tree_unflatten(treedef, out_mu),
            nu=jtu.tree_unflatten(treedef, out_nu),
        )
        return jtu.tree_unflatten(treedef, out_u), new_state

    return optax.GradientTransformation(init_fn, update_fn)  # pyright: ignore


def tree_bytes(tree: PyTree) -> int:
    """Total bytes of the array leaves of a pytree (e.g. an optimizer state).

    **Arguments:**

    - `tree`: any pytree; non-array leaves count zero.

    **Returns:**

    The sum of `nbytes` over array leaves (float4 counts one byte per element, as stored).
    """
    total = 0
    for leaf in jtu.tree_leaves(tree):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            total += int(leaf.nbytes)
    return total
