"""The integer GEMMs of the quantized matmul and their overflow bounds.

`dot_general` and `ragged_dot_general` of int8 codes with int32 sums (exact), the token
contractions of the weight gradient, cut into chunks whose int32 partial sums cannot overflow,
and the float32 fallbacks for float operands. Shared by the reference path (`_backward.py`)
and the backend kernels (`_kernels_cpu.py`, `_kernels_tpu.py`).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8, Shaped

from ._quantize import QMAX


_F32 = jnp.float32
_I32 = jnp.int32
HIGHEST = jax.lax.Precision.HIGHEST  # float32 products (TPU's default rounds them to bf16)

MAX_TERMS = (2**31 - 1) // (QMAX * QMAX)
"""Most int8 x int8 products an int32 accumulator can sum without overflow (133143)."""

DW_CHUNK = 2**17
"""Tokens per int32 partial sum when the dW contraction exceeds `MAX_TERMS`."""


def check_sum_terms(n: int) -> None:
    """The error correction sums `n` int8 codes in int32: raise if that could overflow."""
    if QMAX * n >= 2**31:
        raise ValueError(
            f"s3req: the error correction sums {n} int8 codes per row, which would overflow "
            "int32; split the sequence into shorter examples."
        )


def dot(
    a: Array,
    b: Array,
    contract: tuple,
    batch: tuple = ((), ()),
    precision: jax.lax.Precision | None = None,
) -> Array:
    """`dot_general` of codes as their dtypes say: int8 x int8 with int32 sums (exact), else
    float32 (an int8 operand converted) at `precision`: the backend's default for the GEMMs
    of low-precision codes (exact in bf16), `HIGHEST` for float32 statistics."""
    if a.dtype == b.dtype == jnp.int8:
        return jax.lax.dot_general(a, b, (contract, batch), preferred_element_type=_I32)
    dims = (contract, batch)
    return jax.lax.dot_general(a.astype(_F32), b.astype(_F32), dims, precision=precision)


def int8_digits(a: Float[Array, "r ..."], count: int) -> tuple[Int8[Array, "k r ..."], Array]:
    """Every row of `a` as `count` signed base-128 int8 digits and a float32 scale,
    `a[i] ~ scale[i] * sum_j digits[j, i] * digit_weights(count)[j]`: a float factor of a
    product with int8 codes then runs as an int8 product of its digits with exact int32 sums.

    The row is divided by `scale = max|a[i]| / 64` (1 for a zero row; one float32 rounding,
    within `2**-24 |a|`), which puts it in [-64, 64]; each digit is the nearest integer to
    what the digits before it left, times 128 (exact), so every digit lies in [-64, 64] and
    the remainder is below `2**(-7 count)` of the row's largest entry. A row of ones is one
    digit, 64."""
    r = a.shape[0]
    amax = jnp.max(jnp.abs(a.reshape(r, -1)), axis=1)
    scale = jnp.where(amax == 0, 1.0, amax / 64.0)
    c = a / scale.reshape((r,) + (1,) * (a.ndim - 1))
    digits = []
    for _ in range(count):
        d = jnp.round(c)
        digits.append(d)
        c = (c - d) * 128.0
    return jnp.stack(digits).astype(jnp.int8), scale


def digit_weights(count: int) -> Float[Array, " k"]:
    """The weights `128**-j` of the digits of `int8_digits`."""
    return 128.0 ** -jnp.arange(count, dtype=_F32)


def split_sum(parts: Int[Array, "k ..."]) -> Float[Array, "..."]:
    """The sum over the first axis of int32 partial sums, exact: their high and low 16-bit
    parts are summed in int32, and `hi * 2**16 + lo` is rounded once to float32."""
    hi = jnp.sum(parts >> 16, axis=0)
    lo = jnp.sum(parts & 0xFFFF, axis=0)
    return hi.astype(_F32) * 65536.0 + lo.astype(_F32)


def token_contraction(xq: Int8[Array, "b s h"], q: Shaped[Array, "b s d"]) -> Float[Array, "h d"]:
    """`Xq^T Q` summed over batch and tokens. For int8 codes past `MAX_TERMS` tokens, an int32
    accumulator could overflow: the tokens are cut into chunks of `DW_CHUNK` and the chunks'
    int32 partial sums added exactly (`split_sum`)."""
    B, S, H = xq.shape
    D = q.shape[-1]
    n = B * S
    if q.dtype != jnp.int8 or n <= MAX_TERMS:
        return dot(xq, q, ((0, 1), (0, 1))).astype(_F32)
    k = -(-n // DW_CHUNK)
    pad = k * DW_CHUNK - n
    xc = jnp.pad(xq.reshape(n, H), ((0, pad), (0, 0))).reshape(k, DW_CHUNK, H)
    qc = jnp.pad(q.reshape(n, D), ((0, pad), (0, 0))).reshape(k, DW_CHUNK, D)
    return split_sum(dot(xc, qc, ((1,), (1,)), ((0,), (0,))))


def ragged(lhs: Array, rhs: Array, group_sizes: Array, dims, rhs_group: bool) -> Array:
    """`ragged_dot_general` with the rows of `lhs` grouped by `group_sizes`: against the
    expert's slice of `rhs` (`rhs_group`), or contracting the rows of each group (dW). Int8
    codes with int32 sums, else float32 products."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(dims, ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0] if rhs_group else [],
    )
    if lhs.dtype == rhs.dtype == jnp.int8:
        return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dn, preferred_element_type=_I32)
    return jax.lax.ragged_dot_general(
        lhs.astype(_F32), rhs.astype(_F32), group_sizes, dn, precision=HIGHEST
    )


def ragged_rows(lhs: Array, rhs: Array, group_sizes: Array) -> Array:
    """`lhs_e^T rhs_e` for every group of rows (`ragged_dot_general` contracting the rows):
    int32 sums for int8 codes, else float32."""
    return ragged(lhs, rhs, group_sizes, ((0,), (0,)), False)


def chunk_group_sizes(group_sizes: Int[Array, " e"], lo, hi) -> Int[Array, " e"]:
    """The group sizes of the rows `[lo, hi)` of rows grouped by `group_sizes` (every
    group clipped to the chunk; `lo` and `hi` static or traced)."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    return jnp.clip(jnp.minimum(ends, hi) - jnp.maximum(starts, lo), 0).astype(group_sizes.dtype)


def ragged_row_chunks(
    lhs: Shaped[Array, "n a"],
    rhs: Shaped[Array, "n b"],
    group_sizes: Int[Array, " e"],
    chunk: int,
    contract: Callable[[Array, Array, Array], Array] = ragged_rows,
) -> Float[Array, "e a b"]:
    """`lhs_e^T rhs_e` for every group, float32, with the rows cut into chunks of `chunk`
    (each group clipped to the chunk) contracted by `contract` (`ragged_rows`, or a
    backend's form of it): the int32 sums of int8 codes are added exactly (`split_sum`),
    float32 ones in float32. XLA:TPU computes a ragged contraction over all groups masked by
    an `(e, rows, 1)` boolean array, which its layout pads to `128 e rows` bytes: chunks
    bound that buffer."""
    n = lhs.shape[0]
    if n <= chunk:
        return contract(lhs, rhs, group_sizes).astype(_F32)
    parts = []
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        sizes = chunk_group_sizes(group_sizes, lo, hi)
        parts.append(contract(lhs[lo:hi], rhs[lo:hi], sizes))
    stacked = jnp.stack(parts)
    return split_sum(stacked) if stacked.dtype == _I32 else jnp.sum(stacked, axis=0)


def ragged_token_contraction(
    xq: Int8[Array, "n h"],
    q: Shaped[Array, "n d"],
    group_sizes: Int[Array, " e"],
    contract: Callable[[Array, Array, Array], Array] = ragged_rows,
) -> Float[Array, "e h d"]:
    """`Xq_e^T Q_e` for every expert (`contract`: `ragged_rows` or a backend's form of it);
    past `MAX_TERMS` rows of int8 codes the rows are cut into chunks of `DW_CHUNK`
    (`ragged_row_chunks`)."""
    if q.dtype != jnp.int8 or xq.shape[0] <= MAX_TERMS:
        return contract(xq, q, group_sizes).astype(_F32)
    return ragged_row_chunks(xq, q, group_sizes, DW_CHUNK, contract)
