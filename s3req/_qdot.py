"""The quantized matmul `qdot` and its custom VJP (DESIGN.md section 3)."""

import functools as ft
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int8, PRNGKeyArray, Shaped

from ._formats import BlockFloatGrad, IntGrad
from ._interfaces import AbstractPolicy
from ._quantize import (
    absmax_scale,
    finite_absmax,
    gradient_step,
    QMAX,
    round_to_int8,
)
from ._sharding import NO_AXES, ShardAxes
from ._thresholds import Layout


MAX_TERMS = (2**31 - 1) // (QMAX * QMAX)
"""Most int8 x int8 products an int32 accumulator can sum without overflow (133143)."""

DW_CHUNK = 2**17
"""Tokens per int32 partial sum when the dW contraction exceeds `MAX_TERMS`."""

_F32 = jnp.float32
_I32 = jnp.int32


def _int_dot(a: Array, b: Array, contract: tuple, batch: tuple = ((), ())) -> Array:
    return jax.lax.dot_general(a, b, (contract, batch), preferred_element_type=_I32)


def _token_contraction(xq: Int8[Array, "b s h"], q: Int8[Array, "b s d"]) -> Float[Array, "h d"]:
    """`Xq^T Q` summed over batch and tokens, without int32 overflow.

    Up to `MAX_TERMS` tokens this is one int8 GEMM with int32 accumulation. Beyond it, the
    tokens are split into chunks of `DW_CHUNK`, each chunk's int32 partial is split into a high
    and a low 16-bit part, the parts are summed in int32 (exact), and the result is
    `hi * 2**16 + lo` rounded once to float32.
    """
    B, S, H = xq.shape
    D = q.shape[-1]
    n = B * S
    if n <= MAX_TERMS:
        return _int_dot(xq, q, ((0, 1), (0, 1))).astype(_F32)
    k = -(-n // DW_CHUNK)
    pad = k * DW_CHUNK - n
    xc = jnp.pad(xq.reshape(n, H), ((0, pad), (0, 0))).reshape(k, DW_CHUNK, H)
    qc = jnp.pad(q.reshape(n, D), ((0, pad), (0, 0))).reshape(k, DW_CHUNK, D)
    part = _int_dot(xc, qc, ((1,), (1,)), ((0,), (0,)))
    hi = jnp.sum(part >> 16, axis=0)
    lo = jnp.sum(part & 0xFFFF, axis=0)
    return hi.astype(_F32) * 65536.0 + lo.astype(_F32)


def _check_finite(scale: Array, ax: ShardAxes, roles: tuple, msg: str) -> Array:
    """Raise (at run time) if a scale is not finite: `absmax_scale` gives `+inf` to every
    slice holding a NaN or an Inf, so this checks every element. The flag is reduced over the
    shards first, so inside `shard_map` the check runs on a value that is the same on every
    shard."""
    bad = ax.pmax(jnp.any(~jnp.isfinite(scale)).astype(jnp.int32), *roles)
    one = eqx.error_if(jnp.ones((), scale.dtype), bad > 0, msg)
    return scale * one


def _in_axis(transposed: bool) -> int:
    """The axis of the weight array that holds the input features `d_in`: 0 for a weight
    stored `(d_in, d_out)` (`qdot`), 1 for one stored `(d_out, d_in)` (`QuantLinear`)."""
    return 1 if transposed else 0


def _forward(x, w, policy: AbstractPolicy, ax: ShardAxes, transposed: bool):
    ia = _in_axis(transposed)
    h_all, d_all = w.shape[ia] * ax.size("d_in"), w.shape[1 - ia] * ax.size("d_out")
    if max(h_all, d_all) > MAX_TERMS:
        raise ValueError(
            f"s3req.qdot: feature dimensions above {MAX_TERMS} would overflow int32 "
            f"accumulation, got a global weight of shape {(h_all, d_all)}."
        )
    # Global scales: the per-token max runs over all of d_in, the per-channel max too.
    sx = ax.pmax(absmax_scale(x, axis=-1), "d_in")  # (B, S, 1)
    sw = ax.pmax(absmax_scale(w, axis=ia), "d_in")  # (1, D) or (D, 1)
    sx = _check_finite(sx, ax, ("batch", "seq", "d_in"), "s3req.qdot: x contains NaN or Inf.")
    sw = _check_finite(sw, ax, ("d_in", "d_out"), "s3req.qdot: w contains NaN or Inf.")
    xq = round_to_int8(x, sx)
    wq = round_to_int8(w, sw)
    ec = policy.correction
    xsum = _code_sums(xq, 1, ax, "seq") if ec.dw else None  # (B, H): per-example token sums
    acc = ax.psum(_int_dot(xq, wq, ((2,), (ia,))), "d_in")  # exact int32 partial sums
    sw = sw.reshape(-1)  # (D,)
    y = (acc.astype(_F32) * sx * sw[None, None, :]).astype(x.dtype)
    return y, (xq, wq, sx, sw, xsum)


SUM_ALIGN = 8
"""Width of the thin int8 GEMM operands that return the sums of int8 codes: a ones column
(row) padded with zero columns (rows), and the one-hot example columns appended to `Xq`.
(With a single ones column XLA CPU rewrites the product as a reduction over a full-size
int32 copy of the codes; odd widths ran slower in earlier A/B runs.)"""


def _code_sums(q: Int8[Array, "b s n"], axis: int, ax: ShardAxes, *roles) -> Float[Array, "..."]:
    """Exact sums of int8 codes over the tokens of every example (`axis=1`, `(b, n)`) or over
    the last axis (`axis=2`, `(b, s)`), summed over the shards of `roles`, as float32.

    A thin int8 GEMM with a ones column (row) padded to `SUM_ALIGN`, exact in int32. As
    reductions XLA CPU fused these sums into their consumers: the sums of `Xq` into the dW
    rescaling (for one example), which then read full-size float32 operands written for
    it; the sums of `Q` into passes that held extra full-size buffers. (A row of ones
    appended to `Wq`, with the dX GEMM returning `sum_d Q` as an extra output column, made
    the forward and the dX GEMM slower, A/B in one process, when it took `d_in` past a
    multiple of 64.)"""
    B, S, N = q.shape
    terms = q.shape[axis] * math.prod(ax.size(r) for r in roles)
    if QMAX * terms >= 2**31:
        raise ValueError(
            f"s3req.qdot: the error correction sums {terms} int8 codes per row, which would "
            "overflow int32; split the sequence into shorter examples."
        )
    ones = (jnp.arange(SUM_ALIGN) == 0).astype(jnp.int8)
    if axis == 2:
        sums = _int_dot(q, jnp.broadcast_to(ones, (N, SUM_ALIGN)), ((2,), (0,)))[..., 0]
    else:
        ones = jnp.broadcast_to(ones[:, None], (B, SUM_ALIGN, S))
        sums = _int_dot(ones, q, ((2,), (1,)), ((0,), (0,)))[:, 0, :]
    return ax.psum(sums, *roles).astype(_F32)


def _needs_row_sums(ec) -> bool:
    return ec.dx_token or ec.dx_channel or ec.dw


def _needs_col_sums(ec) -> bool:
    return ec.dx_channel or ec.dw


def _with_example_columns(xq: Int8[Array, "b s h"]) -> Int8[Array, "b s _"]:
    """`Xq` with one one-hot column per example appended (and zero columns up to a multiple
    of `SUM_ALIGN`), so that the dW GEMM `Xq^T Q` also returns `sum_s Q` of every example as
    `b` extra rows (this shard's tokens): `n / h` more work in that GEMM, `n` the padded
    number of examples, instead of another pass over `Q`."""
    B, S, _ = xq.shape
    n = -(-B // SUM_ALIGN) * SUM_ALIGN
    onehot = jnp.broadcast_to(jnp.eye(B, n, dtype=jnp.int8)[:, None, :], (B, S, n))
    return jnp.concatenate([xq, onehot], axis=-1)


DIGITS = 3
"""Signed base-128 digits per float in `_digits_dot` (remainder below 2**-21 of a row's max)."""


def _digits_dot(a: Float[Array, "r ..."], m: Int8[Array, "..."], m_contract: tuple) -> Array:
    """`a . m` over the trailing axes of the float `a` and the axes `m_contract` of the int8
    `m`, float32 `(r, *rest of m)`, without converting `m` to float.

    Each row of `a` is written as `scale * sum_j digit_j / 128**j` with `DIGITS` int8 digits
    in [-64, 64] (the remainder is below `2**-21` of the row's largest entry, less than a
    float32 rounding of a sum of many terms), and the digits run as one small int8 GEMM with
    exact int32 sums. A row of ones is represented exactly (one digit 64). Past
    `2**31 / (64 * 127)` contracted terms it falls back to a float32 product.
    """
    r, k = a.shape[0], a.shape[1:]
    if 64 * QMAX * math.prod(k) >= 2**31:  # int32 sums could overflow: float32 instead
        contract = (tuple(range(1, 1 + len(k))), m_contract)
        return jax.lax.dot_general(a, m.astype(_F32), (contract, ((), ())))
    amax = jnp.max(jnp.abs(a.reshape(r, -1)), axis=1)
    scale = jnp.where(amax == 0, 1.0, amax / 64.0)
    c = a / scale.reshape((r,) + (1,) * len(k))
    digits = []
    for _ in range(DIGITS):
        d = jnp.round(c)
        digits.append(d)
        c = (c - d) * 128.0
    dig = jnp.stack(digits).astype(jnp.int8).reshape((DIGITS * r,) + k)
    prod = _int_dot(dig, m, (tuple(range(1, 1 + len(k))), m_contract)).astype(_F32)
    prod = prod.reshape((DIGITS, r) + prod.shape[1:])
    weights = 128.0 ** -jnp.arange(DIGITS, dtype=_F32)
    total = jnp.tensordot(weights, prod, axes=1)
    return scale.reshape((r,) + (1,) * (total.ndim - 1)) * total


@ft.partial(jax.custom_jvp, nondiff_argnums=(0,))
def first_order_only(name: str, arrays):
    """The identity on `arrays`, whose derivative raises (at trace time).

    The backward passes of `qdot` and `qragged_dot` pass their float inputs (the upstream
    gradient and the scales) through it. First-order autodiff only calls a backward pass;
    differentiating through one (`jax.grad` of `jax.grad`, `jax.jvp` of `jax.grad`,
    `jax.hessian`) differentiates its rounding, whose derivative is zero almost everywhere,
    and would return finite, wrong numbers: this raises instead."""
    return arrays


@first_order_only.defjvp
def _first_order_only_jvp(name, primals, tangents):
    raise NotImplementedError(
        f"{name}: higher-order derivatives (jax.grad of jax.grad, jax.jvp of jax.grad, "
        "jax.hessian) are not defined: the backward pass rounds the gradient to a low-precision "
        "grid, whose derivative is zero almost everywhere, so they would be wrong. Take "
        "second-order quantities of the float model (policy=None)."
    )


@ft.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _qdot3(policy: AbstractPolicy, ax: ShardAxes, transposed: bool, x, w, key):
    return _forward(x, w, policy, ax, transposed)[0]


def _qdot3_fwd(policy: AbstractPolicy, ax: ShardAxes, transposed: bool, x, w, key):
    y, res = _forward(x, w, policy, ax, transposed)
    # Dtypes travel as zero-size arrays (numpy dtype objects cannot be residuals).
    return y, (res, key, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def quantize_gradient(
    policy: AbstractPolicy,
    y: Float[Array, "..."],
    key: PRNGKeyArray | None,
    block: Layout,
) -> tuple[Shaped[Array, "..."], Shaped[Array, "..."]]:
    """The codes of the scaled gradient `y` for the dX and the dW GEMM.

    For integer formats `y = G'/delta` and the codes are int8; for block-float formats `y` is
    `G'` divided by its block scales and the codes are float32 values on the format's grid.

    `y` is a `(b, s, d)` block of the dense gradient described by a [`s3req.Block`][], or the
    `(n, d)` expert-sorted rows described by a [`s3req.Rows`][].

    For topologies that quantize once both are the same array (one int8 tensor feeds both
    GEMMs); otherwise they are rounded with two independent threshold tensors.
    """
    topology = policy.topology
    fmt = policy.fmt

    def rnd(th):
        t, bits = (None, 0) if th is None else th
        if isinstance(fmt, IntGrad):
            return fmt.codes(y, t, bits)
        return fmt.round(y, t, bits)  # pyright: ignore[reportAttributeAccessIssue]

    if topology.quantizes_once():
        q = rnd(topology.thresholds(key, block, "dx"))  # pyright: ignore[reportArgumentType]
        return q, q
    assert key is not None
    kx, kw = jr.split(key)
    return rnd(topology.thresholds(kx, block, "dx")), rnd(topology.thresholds(kw, block, "dw"))


def _global_amax(gp: Array, ax: ShardAxes) -> Array:
    """`max|G'|` over the whole logical tensor; raises (at run time) on NaN or Inf (a NaN is
    counted as `+inf`, see `finite_absmax`)."""
    amax = ax.pmax(finite_absmax(gp), "batch", "seq", "d_out")
    return eqx.error_if(
        amax,
        ~jnp.isfinite(amax),
        "s3req.qdot: the upstream gradient contains NaN or Inf (check the loss and the "
        "layers above this one).",
    )


def _float_gradient(policy: AbstractPolicy, gp, key, ax: ShardAxes):
    """Block-float formats: scale, round onto the float grid, dequantize (dX and dW copies)."""
    fmt = policy.fmt
    assert isinstance(fmt, BlockFloatGrad)
    B, S, D = gp.shape
    amax = _global_amax(gp, ax)
    if fmt.block is None:
        s = fmt.scales(amax)
        y, unscale = gp / s, lambda q: q * s
    else:
        if D % fmt.block:
            raise ValueError(
                f"s3req.qdot: {fmt.describe()} needs the gradient's channels ({D} per shard) to "
                f"be a multiple of the block size {fmt.block}."
            )
        g4 = gp.reshape(B, S, D // fmt.block, fmt.block)
        # A block's max never exceeds the global one: the minimum keeps the block maxima and
        # makes them depend on the checked `amax` (an unused `error_if` result is dropped).
        s = fmt.scales(jnp.minimum(jnp.max(jnp.abs(g4), axis=-1, keepdims=True), amax))
        y = (g4 / s).reshape(B, S, D)
        unscale = lambda q: (q.reshape(g4.shape) * s).reshape(B, S, D)
    q_dx, q_dw = quantize_gradient(policy, y, key, ax.block(gp.shape))  # pyright: ignore
    if q_dx is q_dw:
        deq = unscale(q_dx)
        return deq, deq
    return unscale(q_dx), unscale(q_dw)


def _direct_error_means(e, ax: ShardAxes, *, channel: bool) -> tuple[Array, Array | None]:
    """`eps` and `a - m` of a dequantized gradient's error `e = deq - G'` (absolute units)."""
    _, S, D = e.shape
    D_all, S_all = D * ax.size("d_out"), S * ax.size("seq")
    eps = ax.psum(jnp.sum(e, axis=2), "d_out") / D_all
    if not channel:
        return eps, None
    a = ax.psum(jnp.sum(e, axis=1), "seq") / S_all
    m = ax.psum(jnp.sum(eps, axis=1), "seq") / S_all
    return eps, a - m[:, None]


def gradient_codes(
    policy: AbstractPolicy,
    gp: Float[Array, "b s d"],
    key: PRNGKeyArray | None,
    axes: ShardAxes | None = None,
) -> tuple[Float[Array, ""], Float[Array, ""], Int8[Array, "b s d"], Int8[Array, "b s d"]]:
    """Quantize the scale-folded gradient `G'` as the backward pass of `qdot` does.

    One per-tensor step `delta = max|G'| / 127` over the whole logical tensor (a `pmax` over
    the sharded axes inside `shard_map`), then the int8 codes for the dX and the dW GEMM with
    the thresholds of the policy's topology for this block of `G'`.

    **Arguments:**

    - `policy`: the rounding policy.
    - `gp`: `G' = s_x G s_w`, float32, `(b, s, d)` (a shard's block inside `shard_map`).
    - `key`: the key of this backward pass (as given to `qdot`).
    - `axes`: the mesh axes sharding `gp` inside `shard_map` (`None`: unsharded or `jit`).

    **Returns:**

    `(delta, inv, q_dx, q_dw)`; `q_dx is q_dw` for policies that quantize once.
    """
    ax = NO_AXES if axes is None else axes
    fmt = policy.fmt
    if not isinstance(fmt, IntGrad):
        raise TypeError(f"gradient_codes: integer gradient formats only, got {fmt}.")
    delta, inv = gradient_step(_global_amax(gp, ax), fmt.qmax)
    y = jnp.clip(gp * inv, -fmt.qmax, fmt.qmax)
    q_dx, q_dw = quantize_gradient(policy, y, key, ax.block(gp.shape))  # pyright: ignore
    return delta, inv, q_dx, q_dw


def _example_view(a: Array) -> Array:
    """`a` `(b, s, ...)` with its examples as the batch axis of the `_sums` mat-vecs: itself,
    or for one example of an even number of tokens, the two halves of its tokens `(2, s/2,
    ...)`. XLA drops a batch axis of size 1, and the mat-vecs then read `G'` in another shape
    than `max|G'|` does, for which XLA wrote `G'` to memory twice."""
    B, S = a.shape[:2]
    if B == 1 and S % 2 == 0:
        return a.reshape((2, S // 2) + a.shape[2:])
    return a


def _fold_scales(g: Array, sx: Array, sw: Array) -> Array:
    """`G' = s_x G s_w` in float32, formed in the `_example_view` shape that the sums of `G'`
    read (bitwise the same values), so that `G'` is written to memory once."""
    gp = _example_view(sx) * _example_view(g).astype(_F32) * sw[None, None, :]
    return gp.reshape(g.shape)


DOT_SUM_MAX = 16384
"""Most terms `_sums` adds with one float32 mat-vec (sequentially, so its rounding error
grows like the number of terms); longer sums run as a (pairwise) reduction."""


def _sums(gp: Float[Array, "b s d"], axis: int) -> Float[Array, "b n"]:
    """`jnp.sum(gp, axis)` over the tokens (`axis=1`) or the channels (`axis=2`) of `G'`, as
    a mat-vec with a ones vector batched over the examples.

    XLA CPU fuses a reduction into its consumer. For these sums the consumers also read the
    outputs of the backward GEMMs, so a reduction ran after them and kept the float32 `G'`
    in memory across both GEMMs (twice S3R's temporary memory for two-way EC at
    `(4, 256, 1024) @ (1024, 4096)`), or it was fused into the rescaling of dX, where a fused
    reduction needs its broadcast operands materialized at full size. A dot is not fused into
    its consumer: it reads the `(b, s, d)` `G'` already written for `max|G'|`, right after
    that reduction, and `G'` is freed before the GEMMs. Batched over the examples, the dot
    reads that `G'` in place (as one `(b*s, d)` mat-vec XLA wrote a second, reshaped copy of
    `G'` for it; one example is batched as two halves, see `_example_view`). Past
    `DOT_SUM_MAX` terms the sum is a reduction: more accurate, and `G'` is then held in
    memory longer."""
    B, S, _ = gp.shape
    n = gp.shape[axis]
    if n > DOT_SUM_MAX:
        return jnp.sum(gp, axis=axis)
    v = _example_view(gp)
    ones = jnp.ones((v.shape[0], v.shape[axis]), gp.dtype)
    if axis == 2:  # (b, s)
        return jax.lax.dot_general(v, ones, (((2,), (1,)), ((0,), (0,)))).reshape(B, S)
    sums = jax.lax.dot_general(ones, v, (((1,), (1,)), ((0,), (0,))))  # (b, d)
    return jnp.sum(sums, axis=0, keepdims=True) if v.shape[0] != B else sums


OUTER_UNROLL = 8
"""Up to this many examples per shard, the rank-B dW term is written out as a sum of outer
products, which XLA fuses into the dW rescaling; past it, one small GEMM."""


def _outer_sum(u: Float[Array, "b h"], v: Float[Array, "b d"]) -> Float[Array, "h d"]:
    """`u^T v`, a rank-B update of the weight gradient.

    As a dot with a contraction of B terms XLA CPU writes the whole `(h, d)` product to memory
    and reads it back in the epilogue; for few examples the unrolled sum of outer products is
    computed inside the epilogue instead."""
    if u.shape[0] > OUTER_UNROLL:
        return jnp.dot(u.T, v)
    total = u[0][:, None] * v[0][None, :]
    for b in range(1, u.shape[0]):
        total = total + u[b][:, None] * v[b][None, :]
    return total


def _error_means(qrow, qcol, gp, inv, delta, ax: ShardAxes) -> tuple[Array, Array | None]:
    """Token means `eps` and, if `qcol` is given, centred channel means `a - m` of the error,
    in units of `G'` (integer formats).

    The error in units of the step is `e = q - y` with `y = G' * inv`. Its sums are taken as
    `sum(q) - inv * sum(G')`: the sums of the int8 codes (`qrow`: over all channels, from
    `_code_sums`; `qcol`: over this shard's tokens, from the dW GEMM, or `_code_sums` for the
    other codes of a gradient quantized twice; all exact), and the sums of `G'` (`_sums`) read
    the tensor the step size was already computed from, so the quantizer is not recomputed and
    no full-size error tensor is formed. (`y` is clipped to [-127, 127] before
    rounding; only the largest element can be clipped, by a float rounding, so the means
    agree with `error_stats(q, y)` to float precision.) Inside `shard_map` the sums run over
    the global token and channel axes (`psum`).
    """
    _, S, D = gp.shape
    D_all, S_all = D * ax.size("d_out"), S * ax.size("seq")
    eps = (qrow.astype(_F32) - inv * ax.psum(_sums(gp, 2), "d_out")) / D_all
    if qcol is None:
        return delta * eps, None
    a = ax.psum(qcol.astype(_F32) - inv * _sums(gp, 1), "seq") / S_all
    m = ax.psum(jnp.sum(eps, axis=1), "seq") / S_all
    return delta * eps, delta * (a - m[:, None])


def _qdot3_bwd(policy: AbstractPolicy, ax: ShardAxes, transposed: bool, residuals, g):
    (xq, wq, sx, sw, xsum), key, x_like, w_like = residuals
    g, sx, sw = first_order_only("s3req.qdot", (g, sx, sw))
    ec = policy.correction
    ia = _in_axis(transposed)
    H = wq.shape[ia]

    # Fold both scales into the gradient (float32 even for bf16 G).
    gp = _fold_scales(g, sx, sw)

    # The two GEMMs, and the error means (eps, a - m) of the dX and dW codes, all in units of
    # G' (one implementation of the correction below serves every format).
    if isinstance(policy.fmt, IntGrad):
        delta, inv, q_dx, q_dw = gradient_codes(policy, gp, key, ax)
        dx = ax.psum(_int_dot(q_dx, wq, ((2,), (1 - ia,))), "d_out")  # (B, S, H)
        # dW as (H [+ example rows], D) in either weight layout: XLA CPU copies the left
        # operand of a token contraction into a transposed layout, and an int8 transpose of
        # Xq (tokens x H) costs less than one of Q (tokens x D) for the wide layers; for a
        # (d_out, d_in) weight the float result is transposed inside its rescaling pass.
        col_sums = _needs_col_sums(ec)
        dw = _token_contraction(_with_example_columns(xq) if col_sums else xq, q_dw)
        qrow = _code_sums(q_dx, 2, ax, "d_out") if _needs_row_sums(ec) else None  # all channels
        qcol = dw[H : H + xq.shape[0]] if col_sums else None  # sum_s q_dw, this shard's tokens
        dx, dw = delta * dx.astype(_F32), delta * dw[:H]

        def means_dx():
            qcol_dx = qcol
            if ec.dx_channel and q_dx is not q_dw:  # twice quantized: the other codes' sums
                qcol_dx = _code_sums(q_dx, 1, ax)
            return _error_means(qrow, qcol_dx if ec.dx_channel else None, gp, inv, delta, ax)

        def means_dw():
            qrow_dw = qrow if q_dx is q_dw else _code_sums(q_dw, 2, ax, "d_out")
            return _error_means(qrow_dw, qcol, gp, inv, delta, ax)

    else:
        deq_dx, deq_dw = _float_gradient(policy, gp, key, ax)
        # No FP8/FP4 GEMM on this hardware: the GEMMs run on the dequantized values.
        wf = wq.astype(_F32)
        dx = ax.psum(jax.lax.dot_general(deq_dx, wf, (((2,), (1 - ia,)), ((), ()))), "d_out")
        dw = jnp.einsum("bsh,bsd->hd", xq.astype(_F32), deq_dw)

        def means_dx():
            return _direct_error_means(deq_dx - gp, ax, channel=ec.dx_channel)

        def means_dw():
            return _direct_error_means(deq_dw - gp, ax, channel=True)

    # S3R-EC: subtract the image of the structured error P = a + eps - m.
    if ec.dx_token or ec.dx_channel:
        eps, am = means_dx()
        # Wq 1_D and (a - m) Wq^T, from one small int8 GEMM on the digits of [1; a - m].
        rows = [jnp.ones((1, wq.shape[1 - ia]), _F32)] if ec.dx_token else []
        if ec.dx_channel:
            assert am is not None
            rows.append(am)
        prod = ax.psum(_digits_dot(jnp.concatenate(rows), wq, (1 - ia,)), "d_out")
        if ec.dx_token:
            dx = dx - eps[..., None] * prod[0][None, None, :]
        if ec.dx_channel:
            dx = dx - prod[int(ec.dx_token) :][:, None, :]
    if ec.dw:
        eps, am = means_dw()
        assert am is not None
        # Xq^T eps, from the digits of eps against the int8 Xq.
        token_term = _digits_dot(eps[None], xq, (0, 1))[0]
        # xsum and am are already sums over all tokens: this term sums over examples only.
        channel_term = ax.psum(_outer_sum(xsum, am), "batch")
        dw = ax.psum(dw - token_term[:, None], "batch", "seq") - channel_term
    else:
        dw = ax.psum(dw, "batch", "seq")  # w is replicated over the token axes

    dx = (dx / sx).astype(x_like.dtype)
    dw = (dw / sw[None, :]).astype(w_like.dtype)
    if transposed:  # back to the weight's (d_out, d_in) layout, inside the rescaling pass
        dw = dw.T
    return dx, dw, None


_qdot3.defvjp(_qdot3_fwd, _qdot3_bwd)


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_key(name: str, key) -> None:
    """A `TypeError` naming the fix unless `key` is `None` or a JAX key array (a typed
    `jax.random.key` or a raw uint32 `jax.random.PRNGKey`), and a `ValueError` for a batch of
    keys (raised while tracing the forward, for every topology)."""
    if key is None:
        return
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = isinstance(key, jax.Array) and key.dtype == jnp.uint32
    if not (typed or raw):
        raise TypeError(
            f"{name}: `key` must be a JAX PRNG key, got {type(key).__name__} {key!r:.40}. Use "
            "`jax.random.key(seed)` and split it for every call (`jax.random.split`)."
        )
    if key.shape != (() if typed else (2,)):
        raise ValueError(
            f"{name}: needs a single Threefry key, got a key array of shape {key.shape}. Use "
            "`jax.random.key(seed)` and split it per call, not a batch of keys."
        )


def _check(x: Array, w: Array, policy: AbstractPolicy | None, key, transposed: bool) -> None:
    check_key("s3req.qdot", key)
    layout = "(d_out, d_in)" if transposed else "(d_in, d_out)"
    d_in = w.shape[_in_axis(transposed)] if w.ndim == 2 else None
    for name, arr in (("x", x), ("w", w)):
        if not any(arr.dtype == d for d in _FLOATS):
            raise TypeError(
                f"s3req.qdot: `{name}` must be float32, bfloat16 or float16, got {arr.dtype}."
            )
    if w.ndim != 2:
        raise ValueError(f"s3req.qdot: `w` must have shape {layout}, got {w.shape}.")
    if not 1 <= x.ndim <= 3:
        raise ValueError(
            "s3req.qdot: `x` must have shape (batch, seq, d_in), (seq, d_in) or (d_in,), got "
            f"{x.shape}. Fold extra leading axes into batch or seq, or use jax.vmap."
        )
    if x.shape[-1] != d_in:
        raise ValueError(
            f"s3req.qdot: x has {x.shape[-1]} input features but w expects {d_in} "
            f"(x: {x.shape}, w: {w.shape})."
        )
    if any(n == 0 for n in x.shape + w.shape):
        raise ValueError(f"s3req.qdot: empty operand (x: {x.shape}, w: {w.shape}).")
    if policy is not None:
        if max(w.shape) > MAX_TERMS:
            raise ValueError(
                f"s3req.qdot: feature dimensions above {MAX_TERMS} would overflow int32 "
                f"accumulation, got w of shape {w.shape}."
            )
        if policy.stochastic and key is None:
            raise ValueError(
                f"s3req.qdot: policy {policy} rounds stochastically and needs a fresh "
                "`key=` for every call (e.g. split the step key per layer)."
            )


def qdot(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "d_in d_out"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    axes: ShardAxes | None = None,
) -> Float[Array, "*batch d_out"]:
    """Quantized `x @ w` with an INT8 forward and an INT8 backward (DESIGN.md section 3).

    Forward: per-token scales for `x`, per-output-channel scales for `w`, round to nearest even,
    int8 x int8 GEMM with int32 accumulation, rescale. Only the int8 operands and the scales
    are saved for the backward pass.

    Backward: both scales are folded into the upstream gradient, which is rounded with one
    per-tensor step and the thresholds of `policy.topology`; for every topology except
    `Independent()` one int8 gradient feeds both the dX and the dW GEMM. `policy.correction`
    then subtracts the structured part of the known rounding error (S3R-EC).

    **Arguments:**

    - `x`: activations `(batch, seq, d_in)`; `(seq, d_in)` is one example and `(d_in,)` one
      token. float32, bfloat16 or float16.
    - `w`: weights `(d_in, d_out)`.
    - `policy`: a rounding policy, e.g. `Policy(Phi2D(), TwoWayEC())`, or `None` for a plain
      float matmul (`w` is cast to the dtype of `x`).
    - `key`: a fresh PRNG key for the backward thresholds. Keyword only; required when the
      policy is stochastic.
    - `axes`: inside `jax.shard_map`, the mesh axes that shard the operands (a
      [`s3req.ShardAxes`][]); `None` under `jax.jit` sharding or unsharded. Keyword only.

    **Returns:**

    `x @ w` with the leading shape of `x` and the dtype of `x`.

    Non-finite values in `x`, `w` or the upstream gradient raise an error (under `jax.jit`, an
    `equinox` runtime error).
    """
    return qdot_t(x, w, policy=policy, key=key, axes=axes, transposed=False)


def qdot_t(
    x: Float[Array, "*batch d_in"],
    w: Float[Array, "n m"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    axes: ShardAxes | None = None,
    transposed: bool = True,
) -> Float[Array, "*batch d_out"]:
    """`qdot` for a weight stored `(d_out, d_in)` (as in `equinox.nn.Linear` and
    [`s3req.QuantLinear`][]) when `transposed=True`: `x @ w.T`, and its weight gradient in the
    same layout.

    The same computation as `qdot(x, w.T, ...)`, with every reduction, quantization and GEMM
    reading `w` in its own layout: XLA CPU would otherwise copy the float weight into the
    transposed layout (or quantize it with strided reads) on every call. `transposed=False` is
    `qdot` itself.
    """
    _check(x, w, policy, key, transposed)
    if policy is None:
        y = jnp.matmul(x, (w.T if transposed else w).astype(x.dtype))
        return y if axes is None else axes.psum(y, "d_in")
    lead = x.shape[:-1]
    x3 = x.reshape((1,) * (3 - x.ndim) + x.shape)
    ax = NO_AXES if axes is None else axes
    y: Array = _qdot3(policy, ax, transposed, x3, w, key)  # pyright: ignore
    return y.reshape(lead + (w.shape[1 - _in_axis(transposed)],))
