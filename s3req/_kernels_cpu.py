"""The XLA:CPU kernels: the dense layer's error correction and scale folding, and the
expert GEMMs.

`_backward.py` holds the reference path: plain reductions and float32 products, written as
the maths. On XLA:CPU a reduction is fused into its consumer, and for the error-correction
statistics that cost memory and time: a reduction of `G'` consumed after the backward GEMMs
kept the float32 `G'` alive across them, one fused into the dX rescaling needed its broadcast
operands materialized at full size, and a float32 product with `Wq` or `Xq` converts the int8
operand to a full-size float32 copy. The functions here compute the same quantities in forms
XLA:CPU does not fuse into their consumers (dots) and on the int8 operands directly (int8
GEMMs with exact int32 sums). `_backward.Dense` chooses between the two per backend with
`jax.lax.platform_dependent`; `tests/test_kernels.py` checks that they agree.

XLA:CPU has no grouped GEMM. JAX lowers `ragged_dot_general` there as one dense GEMM over
`E` copies of the ragged operand, each with the other experts' rows masked (both operands
when the rows are contracted, as int32), and XLA fuses the producer of that operand into the
copies: for the codes of `G'` the quantizer, random thresholds included, runs once per
expert. `ragged_gemm` and `ragged_rows` do the same multiply-adds with the codes as plain
GEMM operands, computed once; `_backward.Ragged` chooses them per backend.

Every function takes and returns local (per-shard) values: the engine adds the shard sums.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Int8, Shaped

from ._gemms import check_sum_terms, digit_weights, dot, HIGHEST, int8_digits
from ._quantize import QMAX


_F32 = jnp.float32
_I32 = jnp.int32


def _int_dot(a: Array, b: Array, contract: tuple, batch: tuple = ((), ())) -> Array:
    return jax.lax.dot_general(a, b, (contract, batch), preferred_element_type=_I32)


SUM_ALIGN = 8
"""Width of the thin int8 GEMM operands that return the sums of int8 codes: a ones column
(row) padded with zero columns (rows). With a single ones column XLA CPU rewrites the
product as a reduction over a full-size int32 copy of the codes."""


def code_sums(q: Int8[Array, "b s n"], axis: int) -> Float[Array, "..."]:
    """Exact sums of int8 codes over the tokens of every example (`axis=1`, `(b, n)`) or over
    the last axis (`axis=2`, `(b, s)`), as float32: a thin int8 GEMM with a ones column (row)
    padded to `SUM_ALIGN`, exact in int32. (As a reduction, XLA CPU fuses the sum into its
    consumer; the sums of `Xq` then read full-size float32 operands written for them.)

    Over the tokens of up to `SUM_ALIGN` examples the GEMM is one `(SUM_ALIGN, b s)` one-hot
    matrix of the examples against the codes as `(b s, n)`, the layout the backward GEMMs
    read: as many multiply-adds as the batched form, whose 3-D operand XLA writes in a second
    buffer, quantizing the codes a second time (for `Q`, its random thresholds too)."""
    B, S, N = q.shape
    check_sum_terms(q.shape[axis])
    ones = (jnp.arange(SUM_ALIGN) == 0).astype(jnp.int8)
    if axis == 2:
        sums = _int_dot(q, jnp.broadcast_to(ones, (N, SUM_ALIGN)), ((2,), (0,)))[..., 0]
    elif B <= SUM_ALIGN:
        example = jnp.arange(B * S) // S
        onehot = (jnp.arange(SUM_ALIGN)[:, None] == example[None, :]).astype(jnp.int8)
        sums = _int_dot(onehot, q.reshape(B * S, N), ((1,), (0,)))[:B]
    else:
        ones = jnp.broadcast_to(ones[:, None], (B, SUM_ALIGN, S))
        sums = _int_dot(ones, q, ((2,), (1,)), ((0,), (0,)))[:, 0, :]
    return sums.astype(_F32)


def _example_view(a: Array) -> Array:
    """`a` `(b, s, ...)` with its examples as the batch axis of the `float_sums` mat-vecs:
    itself, or for one example of an even number of tokens, the two halves of its tokens
    `(2, s/2, ...)`. XLA drops a batch axis of size 1, and the mat-vecs then read `G'` in
    another shape than `max|G'|` does, for which XLA writes `G'` to memory twice."""
    B, S = a.shape[:2]
    if B == 1 and S % 2 == 0:
        return a.reshape((2, S // 2) + a.shape[2:])
    return a


def fold_scales(g: Array, sx: Array, sw: Array) -> Array:
    """`G' = s_x G s_w` in float32, formed in the `_example_view` shape that the sums of `G'`
    read (bitwise the reference's values), so that `G'` is written to memory once."""
    gp = _example_view(sx) * _example_view(g).astype(_F32) * sw[None, None, :]
    return gp.reshape(g.shape)


DOT_SUM_MAX = 16384
"""Most terms `float_sums` adds with one float32 mat-vec (sequentially, so its rounding error
grows like the number of terms); longer sums run as a (pairwise) reduction."""


def float_sums(gp: Float[Array, "b s d"], axis: int) -> Float[Array, "b n"]:
    """`jnp.sum(gp, axis)` over the tokens (`axis=1`) or the channels (`axis=2`) of `G'`, as
    a mat-vec with a ones vector batched over the examples.

    A dot is not fused into its consumer: it reads the `(b, s, d)` `G'` already written for
    `max|G'|`, right after that reduction, and `G'` is freed before the backward GEMMs.
    Batched over the examples, the dot reads that `G'` in place (one `(b*s, d)` mat-vec made
    XLA write a reshaped copy of `G'`; one example is batched as two halves, see
    `_example_view`). Past `DOT_SUM_MAX` terms the sum is a reduction: more accurate, and
    `G'` is then held in memory longer."""
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


def sums(v: Array, axis: int) -> Float[Array, "..."]:
    """Sums of int8 codes (`code_sums`) or of float32 `G'` (`float_sums`) along `axis`."""
    return code_sums(v, axis) if v.dtype == jnp.int8 else float_sums(v, axis)


DIGITS = 3
"""Signed base-128 digits per float in `digits_dot` (remainder below 2**-21 of a row's max)."""


def digits_dot(a: Float[Array, "r ..."], m: Int8[Array, "..."], m_contract: tuple) -> Array:
    """`a . m` over the trailing axes of the float `a` and the axes `m_contract` of the int8
    `m`, float32 `(r, *rest of m)`, without converting `m` to float.

    Each row of `a` is written as `DIGITS` int8 digits in [-64, 64] (`int8_digits`; the
    remainder is below `2**-21` of the row's largest entry, less than a float32 rounding of
    a sum of many terms), and the digits run as one small int8 GEMM with exact int32 sums.
    A row of ones is represented exactly (one digit 64). Past
    `2**31 / (64 * 127)` contracted terms it falls back to a float32 product.
    """
    r, k = a.shape[0], a.shape[1:]
    if 64 * QMAX * math.prod(k) >= 2**31:  # int32 sums could overflow: float32 instead
        contract = (tuple(range(1, 1 + len(k))), m_contract)
        return jax.lax.dot_general(a, m.astype(_F32), (contract, ((), ())))
    digits, scale = int8_digits(a, DIGITS)
    dig = digits.reshape((DIGITS * r,) + k)
    prod = _int_dot(dig, m, (tuple(range(1, 1 + len(k))), m_contract)).astype(_F32)
    prod = prod.reshape((DIGITS, r) + prod.shape[1:])
    total = jnp.tensordot(digit_weights(DIGITS), prod, axes=1)
    return scale.reshape((r,) + (1,) * (total.ndim - 1)) * total


def weight_row_sums(wq: Int8[Array, "..."], d_axis: int) -> Float[Array, "1 1 h"]:
    """`Wq 1_D`, exact: the digits of a row of ones (one digit, 64) against `Wq`."""
    ones = jnp.ones((1, wq.shape[d_axis]), _F32)
    return digits_dot(ones, wq, (d_axis,))[:, None, :]


def channel_dx(am: Float[Array, "b d"], wq: Int8[Array, "..."], d_axis: int) -> Array:
    """`(a - m) Wq^T` of every example, `(b, 1, h)`, from the int8 digits of `a - m`."""
    return digits_dot(am, wq, (d_axis,))[:, None, :]


def token_dw(xq: Int8[Array, "b s h"], eps: Float[Array, "b s"]) -> Float[Array, "h 1"]:
    """`Xq^T eps`, `(h, 1)`, from the int8 digits of `eps` against `Xq`."""
    return digits_dot(eps[None], xq, (0, 1))[0][:, None]


OUTER_UNROLL = 8
"""Up to this many examples per shard, the rank-B dW term is written out as a sum of outer
products, which XLA fuses into the dW rescaling; past it, one small GEMM."""


def channel_dw(xsum: Float[Array, "b h"], am: Float[Array, "b d"]) -> Float[Array, "h d"]:
    """`xsum^T (a - m)`, a rank-B update of the weight gradient. As a dot with a contraction
    of B terms XLA CPU writes the whole `(h, d)` product to memory and reads it back in the
    rescaling; for few examples the unrolled sum of outer products is computed inside it."""
    if xsum.shape[0] > OUTER_UNROLL:
        return jnp.dot(xsum.T, am)
    total = xsum[0][:, None] * am[0][None, :]
    for b in range(1, xsum.shape[0]):
        total = total + xsum[b][:, None] * am[b][None, :]
    return total


def _in_group(group_sizes: Int[Array, " e"], n: int) -> Bool[Array, "n e"]:
    """Whether row `i` belongs to group `e` (the groups are consecutive runs of rows; rows
    past the last group belong to none)."""
    ends = jnp.cumsum(group_sizes)
    row = jnp.arange(n, dtype=ends.dtype)[:, None]
    return (row >= (ends - group_sizes)[None, :]) & (row < ends[None, :])


def ragged_gemm(
    lhs: Shaped[Array, "n k"],
    rhs: Shaped[Array, "e ..."],
    group_sizes: Int[Array, " e"],
    axis: int,
) -> Shaped[Array, "n m"]:
    """`lhs[i] . rhs[e(i)]` for every row `i` of group `e(i)`, contracting the last axis of
    `lhs` with axis `axis` of `rhs` (int32 sums for int8 codes, else float32); rows past
    the groups give 0.

    Every row is multiplied by the weights of a chunk of experts in one GEMM and keeps its
    own expert's result. A chunk holds as many experts as keep its `(n, chunk, m)` result
    within the size of the `E` masked copies of `lhs` of JAX's lowering (at least one
    expert; the multiply-adds are the same); `lhs` is read as it is."""
    E, (n, k) = rhs.shape[0], lhs.shape
    m = rhs.shape[3 - axis]
    chunk = max(1, min(E, E * k * lhs.dtype.itemsize // (4 * m)))
    mask = _in_group(group_sizes, n)
    parts = []
    for lo in range(0, E, chunk):
        part = dot(lhs, rhs[lo : lo + chunk], ((1,), (axis,)), precision=HIGHEST)
        parts.append(jnp.sum(jnp.where(mask[:, lo : lo + chunk, None], part, 0), axis=1))
    return sum(parts[1:], start=parts[0])


def ragged_rows(
    lhs: Shaped[Array, "n a"], rhs: Shaped[Array, "n b"], group_sizes: Int[Array, " e"]
) -> Shaped[Array, "e a b"]:
    """`lhs_e^T rhs_e` for every group of rows (int32 sums for int8 codes, else float32):
    the rows of `lhs` masked per group, `(E, n, a)`, against `rhs` read once, one GEMM."""
    mask = _in_group(group_sizes, lhs.shape[0]).T[:, :, None]
    masked = jnp.where(mask, lhs[None], jnp.zeros((), lhs.dtype))
    return dot(masked, rhs, ((1,), (0,)), precision=HIGHEST)
