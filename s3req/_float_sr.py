"""Stochastic rounding of float32 values onto the grids of narrow float formats.

Supported targets: `bfloat16`, `float16`, `float8_e4m3fn`, `float8_e5m2` and `float4_e2m1fn`.
Inputs are float32, bfloat16 or float16; narrower inputs are upcast to float32 first (exactly).

**The grid.** Let a target format have `m` explicit mantissa bits and smallest normal exponent
`emin`. For $|x| \\ge 2^{\\text{emin}}$ with $2^e \\le |x| < 2^{e+1}$ the spacing is
$\\mathrm{ulp}(x) = 2^{e-m}$; below $2^{\\text{emin}}$ (the subnormals) it is the constant
$2^{\\text{emin}-m}$.
The two grid points bracketing $x$ are `lo`, $x$ rounded toward zero onto the grid, and
`hi = lo + ulp(x)` (away from zero). Stochastic rounding returns `hi` with probability
$p = (|x| - |lo|) / \\mathrm{ulp}(x)$ and `lo` otherwise, so $E[\\mathrm{SR}(x)] = x$.

**Exact arithmetic.** Everything is integer arithmetic on the float32 bit pattern. Within one
binade the magnitude pattern `P` (sign bit cleared) is an integer multiple of the float32 ulp,
and the target grid is every multiple of $2^s$ in pattern units, with
$s = 23 - m + \\max(0, \\text{emin} - e)$: the low `s` bits of `P` are the residual and
clearing them gives `lo` (a carry out of the mantissa of `lo + 2**s` lands exactly on the next
power of two).
Inputs below the smallest target subnormal have `lo = 0` and `hi` = that subnormal. The residual
is held as a 32-bit fixed-point fraction `f` ($p = f / 2^{32}$).

**Thresholds.** A threshold is an integer `t` of `b` bits. For `b < 32` it stands for the real
threshold $(t + 1/2) / 2^b$ (a grid shifted half a step, as in S3R) and the rounding goes up iff
$p + (t + 1/2)/2^b \\ge 1$; for `b = 32` it goes up iff $p + t/2^{32} \\ge 1$. Over a uniform `t`,

- `b < 32`: $P(\\text{up}) = \\lfloor p\\,2^b + 1/2 \\rfloor / 2^b$, so the bias is at most
  $\\mathrm{ulp}(x)/2^{b+1}$, and zero when the residual has at most `b` bits;
- `b = 32`: $P(\\text{up}) = \\lfloor p\\,2^{32} \\rfloor / 2^{32}$: exactly unbiased for every
  input whose residual fits in 32 bits (all of them except values more than $2^9$ times
  smaller than the smallest subnormal of the target); below that the bias is under
  $\\mathrm{ulp}/2^{32}$.

A float32 value has `23 - m` residual bits in the normal range (16 for bfloat16, 13 for float16,
20 for e4m3, 21 for e5m2, 22 for e2m1), so 32-bit thresholds are exact everywhere that matters,
16-bit thresholds are exact for bfloat16, and 8-bit thresholds are biased by at most ulp/512.

**Special values** (see [`s3req.float_format`][]):

- finite values beyond the largest finite value saturate to $\\pm$max (also when the rounding
  would go up past it), in every format: a finite input never becomes Inf or NaN;
- NaN stays NaN; $\\pm$Inf stays $\\pm$Inf in formats with an infinity (bfloat16, float16,
  e5m2) and becomes NaN in `float8_e4m3fn` (no infinity, non-finite stays non-finite);
- `float4_e2m1fn` has neither NaN nor Inf: a non-finite input is an error (`eqx.error_if`).
"""

import dataclasses
import functools as ft
import typing
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Integer, PRNGKeyArray, Shaped, UInt32

from ._threefry import random_bits
from ._thresholds import _words_at


_U32 = jnp.uint32
_F32 = jnp.float32

FLOAT_FORMATS: tuple[jnp.dtype, ...] = tuple(
    jnp.dtype(d)
    for d in (
        jnp.bfloat16,
        jnp.float16,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
        jnp.float4_e2m1fn,
    )
)
"""The target formats of [`s3req.stochastic_round`][]."""

THRESHOLD_BITS = (8, 16, 32)
"""Threshold widths [`s3req.stochastic_round`][] accepts: `32 // bits` thresholds per word."""


@typing.final
@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """The facts about a float format that rounding onto its grid needs.

    **Arguments:**

    - `dtype`: the format.
    - `mantissa_bits`: explicit mantissa bits `m`.
    - `min_exponent`: exponent `emin` of the smallest normal value $2^{\\text{emin}}$.
    - `max_finite`: the largest finite value.
    - `has_inf`: whether the format has an infinity.
    - `has_nan`: whether the format has a NaN.
    """

    dtype: jnp.dtype
    mantissa_bits: int
    min_exponent: int
    max_finite: float
    has_inf: bool
    has_nan: bool

    @property
    def smallest_subnormal(self) -> float:
        """$2^{\\text{emin} - m}$: the grid spacing below the smallest normal value."""
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    def ulp(self, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """The grid spacing at finite `x` (float32): $2^{\\max(e, \\text{emin}) - m}$ with
        $2^e \\le |x| < 2^{e+1}$ (beyond the largest finite value: the spacing the binade
        would have)."""
        e = _exponent(_magnitude(x.astype(_F32)))
        k = jnp.maximum(e, self.min_exponent) - self.mantissa_bits
        # 2**k as a float32 pattern (normal for k >= -126, subnormal below).
        normal = (jnp.maximum(k, -126) + 127).astype(_U32) << _U32(23)
        sub = _U32(1) << jnp.clip(k + 149, 0, 22).astype(_U32)
        return jax.lax.bitcast_convert_type(jnp.where(k >= -126, normal, sub), _F32)


@ft.cache
def float_format(dtype: typing.Any) -> FloatFormat:
    """The [`s3req.FloatFormat`][] of a supported target dtype.

    | dtype            | m  | emin | max finite  | Inf | NaN |
    |------------------|----|------|-------------|-----|-----|
    | `bfloat16`       | 7  | -126 | 3.39e38     | yes | yes |
    | `float16`        | 10 | -14  | 65504       | yes | yes |
    | `float8_e4m3fn`  | 3  | -6   | 448         | no  | yes |
    | `float8_e5m2`    | 2  | -14  | 57344       | yes | yes |
    | `float4_e2m1fn`  | 1  | 0    | 6           | no  | no  |

    **Arguments:**

    - `dtype`: one of `s3req.FLOAT_FORMATS`.

    **Returns:**

    Its `FloatFormat`.
    """
    dt = jnp.dtype(dtype)
    if dt not in FLOAT_FORMATS:
        names = ", ".join(d.name for d in FLOAT_FORMATS)
        raise ValueError(f"Cannot round onto {dt.name}: supported target formats are {names}.")
    fi = jnp.finfo(dt)
    probe = np.array([np.inf, np.nan], np.float32).astype(dt).astype(np.float32)
    return FloatFormat(
        dtype=dt,
        mantissa_bits=int(fi.nmant),
        min_exponent=int(fi.minexp),
        max_finite=float(fi.max),
        has_inf=bool(np.isinf(probe[0])),
        has_nan=bool(np.isnan(probe[1])),
    )


def _as_f32(x: Array) -> Array:
    if x.dtype not in (
        jnp.dtype(_F32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        raise TypeError(
            f"Stochastic rounding takes float32, bfloat16 or float16 input, got {x.dtype}."
            " Cast it to float32 first."
        )
    return x.astype(_F32)


def _magnitude(x32: Array) -> Array:
    return jax.lax.bitcast_convert_type(x32, _U32) & _U32(0x7FFFFFFF)


def _exponent(mag: Array) -> Array:
    """Unbiased exponent of a float32 magnitude pattern (-126 for float32 subnormals)."""
    return jnp.maximum((mag >> _U32(23)).astype(jnp.int32), 1) - 127


def _split(x32: Array, fmt: FloatFormat) -> tuple[Array, Array, Array, Array]:
    """`(sign, lo, hi, frac)`: the sign bit, the magnitude patterns of the two bracketing grid
    points (`lo` toward zero) and the 32-bit fixed-point fraction $p \\cdot 2^{32}$ (truncated).

    Meaningful for finite `x32` only; `hi` may exceed the largest finite value (callers clip).
    """
    m, emin = fmt.mantissa_bits, fmt.min_exponent
    bits = jax.lax.bitcast_convert_type(x32, _U32)
    sign = bits & _U32(0x80000000)
    mag = bits & _U32(0x7FFFFFFF)
    biased = (mag >> _U32(23)).astype(jnp.int32)
    e = jnp.maximum(biased, 1) - 127
    # Residual bits: the target ulp is 2**s float32 ulps at this exponent.
    s = (23 - m) + jnp.maximum(emin - e, 0)
    # Significand as an integer: |x| = sig * 2**(e - 23) (float32 subnormals included).
    sig = jnp.where(biased > 0, (mag & _U32(0x7FFFFF)) | _U32(0x800000), mag)
    left = (32 - jnp.minimum(s, 32)).astype(_U32)
    right = jnp.clip(s - 32, 0, 31).astype(_U32)
    frac = jnp.where(s <= 32, sig << left, sig >> right)
    in_grid = s <= 23
    step = _U32(1) << jnp.minimum(s, 23).astype(_U32)
    lo = jnp.where(in_grid, mag & ~(step - _U32(1)), _U32(0))
    hi = jnp.where(in_grid, lo + step, _U32(_pattern(fmt.smallest_subnormal)))
    return sign, lo, hi, frac


def _from_pattern(sign: Array, mag: Array) -> Array:
    return jax.lax.bitcast_convert_type(sign | mag, _F32)


def _finish(sign: Array, mag: Array, x32: Array, fmt: FloatFormat) -> Array:
    """Saturate, apply the special-value rules and cast the pattern `sign | mag` to the target.

    Saturation compares bit patterns, not floats: XLA flushes float32 subnormals to zero in
    float arithmetic (a `clip` would lose the bfloat16 subnormals), but not in a select or a
    conversion.
    """
    r = _from_pattern(sign, jnp.minimum(mag, _U32(_pattern(fmt.max_finite))))
    r = jnp.where(jnp.isnan(x32), jnp.asarray(jnp.nan, _F32), r)
    inf = x32 if fmt.has_inf else jnp.full_like(x32, jnp.nan)
    r = jnp.where(jnp.isinf(x32), inf, r)
    return r.astype(fmt.dtype)


def _pattern(value: float) -> int:
    """The float32 bit pattern of a Python float (exact for the grid values used here)."""
    return int(np.array(value, np.float32).view(np.uint32))


def _check_finite(x32: Array, fmt: FloatFormat) -> Array:
    if fmt.has_nan:
        return x32
    return eqx.error_if(
        x32,
        ~jnp.all(jnp.isfinite(x32)),
        f"Rounding onto {fmt.dtype.name}: the input contains NaN or Inf, which "
        f"{fmt.dtype.name} cannot represent.",
    )


def grid_neighbours(
    x: Float[Array, "..."], dtype: typing.Any
) -> tuple[Float[Array, "..."], Float[Array, "..."]]:
    """The two points of the `dtype` grid that bracket `x`, as float32.

    `lo` is `x` rounded toward zero onto the grid and `hi = lo + ulp(x)` is the next grid point
    away from zero (`lo = x`, `hi = x + ulp` when `x` is on the grid). Both are clipped to
    $\\pm$ the largest finite value, so beyond it `lo = hi = ` $\\pm$max. NaN and $\\pm$Inf are
    returned unchanged in both. Exact (bit manipulation of the float32 pattern), elementwise.

    Stochastic rounding picks `hi` with probability `(x - lo) / (hi - lo)`.

    **Arguments:**

    - `x`: float32, bfloat16 or float16 values.
    - `dtype`: the target format, one of `s3req.FLOAT_FORMATS`.

    **Returns:**

    `(lo, hi)`, float32 arrays of the shape of `x`.
    """
    fmt = float_format(dtype)
    x32 = _as_f32(x)
    sign, lo, hi, _ = _split(x32, fmt)
    big = _U32(_pattern(fmt.max_finite))
    out = []
    for mag in (lo, hi):
        r = _from_pattern(sign, jnp.minimum(mag, big))
        out.append(jnp.where(jnp.isfinite(x32), r, x32))
    return out[0], out[1]


def sr_float(
    x: Float[Array, "..."],
    dtype: typing.Any,
    t: Integer[Array, "..."] | None,
    *,
    bits: int = 32,
) -> Shaped[Array, "..."]:
    """Round `x` onto the grid of `dtype` with given threshold indices (or to nearest).

    The deterministic core of [`s3req.stochastic_round`][], the float analogue of
    [`s3req.sr_codes`][]: any threshold topology (per element, per row, the S3R per-token
    thresholds of [`s3req.token_thresholds`][], ...) supplies `t`. With `t` uniform on
    `[0, 2**bits)` the result rounds up (away from zero) with probability
    $\\lfloor p 2^b + 1/2 \\rfloor / 2^b$ for `bits < 32` and $\\lfloor p 2^{32} \\rfloor / 2^{32}$
    for `bits = 32`, where `p` is the position of `x` between its grid neighbours
    (see [`s3req.grid_neighbours`][]). Pure integer arithmetic on the float32 pattern: no
    fused multiply-add can change a rounding between two compilations.

    **Arguments:**

    - `x`: float32, bfloat16 or float16 values (upcast to float32, exactly).
    - `dtype`: the target format, one of `s3req.FLOAT_FORMATS`.
    - `t`: non-negative integer thresholds below `2**bits`, broadcastable to `x` (same rank), or
      `None` for round-to-nearest-even.
    - `bits`: bit width of `t`, 1 to 32. (Keyword only argument.)

    **Returns:**

    An array of dtype `dtype` and the shape of `x`. Saturation and NaN/Inf follow the module
    rules: beyond the largest finite value $\\pm$max; NaN stays NaN; Inf stays Inf where the
    format has one (NaN in `float8_e4m3fn`); `float4_e2m1fn` raises on NaN/Inf.
    """
    fmt = float_format(dtype)
    return unchecked_sr_float(_check_finite(_as_f32(x), fmt), fmt, t, bits)


def unchecked_sr_float(x32: Array, fmt: FloatFormat, t: Array | None, bits: int) -> Array:
    """[`s3req.sr_float`][] of float32 `x32` without its check of non-finite inputs (a NaN or
    Inf gives an arbitrary value in `float4_e2m1fn`): for callers that check their inputs
    themselves."""
    if t is None:
        # Saturate first (on the pattern), then the conversion rounds to nearest even.
        bits_x = jax.lax.bitcast_convert_type(x32, _U32)
        sign = bits_x & _U32(0x80000000)
        return _finish(sign, bits_x & _U32(0x7FFFFFFF), x32, fmt)
    if not 1 <= bits <= 32:
        raise ValueError(f"Threshold bit width must be in [1, 32], got {bits}.")
    if t.ndim != x32.ndim:
        raise ValueError(
            f"Thresholds of shape {t.shape} must have the rank of x {x32.shape} (use size-1 "
            "axes to share a threshold)."
        )
    sign, lo, hi, frac = _split(x32, fmt)
    tu = t.astype(_U32)
    if bits < 32:
        tu = (tu << _U32(32 - bits)) | _U32(1 << (31 - bits))
    # Up iff p + threshold >= 1, i.e. tu >= 2**32 - frac, i.e. tu > ~frac (uint32, no overflow).
    up = tu > ~frac
    return _finish(sign, jnp.where(up, hi, lo), x32, fmt)


def float_thresholds(
    key: PRNGKeyArray,
    shape: tuple[int, ...],
    *,
    topology: Literal["element", "row"] = "element",
    bits: int = 32,
) -> UInt32[Array, "..."]:
    """Threshold indices for [`s3req.sr_float`][], from partitionable Threefry.

    A *unit* is an element (`topology="element"`) or a row of the last axis (`"row"`, one
    threshold shared by the whole row, as S3R's per-token thresholds). With `N` units in
    row-major order, unit `n` takes the `bits`-bit chunk number `n % (32 // bits)` (from the
    least significant end) of word `n // (32 // bits)` of `jax.random.bits(key, (ceil(N*bits/32),),
    jnp.uint32)`. The words depend only on the key and the global index, so the same thresholds
    come out under any sharding (each block can be computed on its own).

    **Arguments:**

    - `key`: a Threefry key.
    - `shape`: the shape of the tensor to round.
    - `topology`: `"element"` or `"row"`. (Keyword only argument.)
    - `bits`: 8, 16 or 32. (Keyword only argument.)

    **Returns:**

    uint32 thresholds below `2**bits`, of shape `shape` (element) or `shape[:-1] + (1,)` (row).
    """
    shape = tuple(int(n) for n in shape)
    if bits not in THRESHOLD_BITS:
        raise ValueError(f"bits must be one of {THRESHOLD_BITS}, got {bits}.")
    if topology == "element" or len(shape) == 0:
        units, out = shape, shape
    elif topology == "row":
        units, out = shape[:-1], shape[:-1] + (1,)
    else:
        raise ValueError(f'topology must be "element" or "row", got {topology!r}.')
    per_word = 32 // bits
    if per_word == 1:
        return random_bits(key, units).reshape(out)
    mask = _U32((1 << bits) - 1)
    if len(units) > 0 and units[-1] % per_word == 0:
        # Aligned: the words of row-major units are exactly the words of this shape.
        words = random_bits(key, units[:-1] + (units[-1] // per_word,))
        shifts = jnp.arange(per_word, dtype=_U32) * _U32(bits)
        t = (words[..., None] >> shifts.reshape((1,) * words.ndim + (per_word,))) & mask
        return t.reshape(out)
    n_units = int(np.prod(units, dtype=np.int64))
    if n_units >= 2**32:
        raise ValueError("Unaligned threshold tensors need fewer than 2**32 units.")
    n = jnp.arange(n_units, dtype=_U32).reshape(units)
    log2 = per_word.bit_length() - 1
    words = _words_at(key, n >> _U32(log2))
    shift = (n & _U32(per_word - 1)) * _U32(bits)
    return ((words >> shift) & mask).reshape(out)


def stochastic_round(
    x: Float[Array, "..."],
    dtype: typing.Any,
    *,
    key: PRNGKeyArray,
    topology: Literal["element", "row"] = "element",
    bits: int = 32,
) -> Shaped[Array, "..."]:
    """Stochastically round `x` onto the grid of a narrow float format, unbiased.

    Each value goes to one of its two grid neighbours `lo`, `hi` (see
    [`s3req.grid_neighbours`][]): `hi` with probability `(x - lo) / (hi - lo)`, computed from
    the ulp of that value (subnormals included), so $E[\\mathrm{SR}(x)] = x$. The randomness
    is partitionable Threefry indexed by global position ([`s3req.float_thresholds`][]).

    Bias: at most $\\mathrm{ulp}(x)/2^{\\text{bits}+1}$ for 8 and 16 bits (none when the
    residual of `x` has at most `bits` bits: float32 to bfloat16 is exact with 16); with 32 bits
    exactly unbiased except far below the smallest subnormal of the target, where it is under
    $\\mathrm{ulp}/2^{32}$.

    Special values: finite values beyond the largest finite value saturate to $\\pm$max; NaN
    stays NaN; $\\pm$Inf stays $\\pm$Inf where the format has an infinity and becomes NaN in
    `float8_e4m3fn`; `float4_e2m1fn` (no NaN, no Inf) raises on non-finite input.

    !!! Example

        ```python
        w = jnp.full((4096,), 256.0, jnp.bfloat16)
        for step in range(10):
            k = jax.random.fold_in(key, step)
            w = stochastic_round(w.astype(jnp.float32) + 0.3, jnp.bfloat16, key=k)
        w.astype(jnp.float32).mean()  # ~259; plain bf16 arithmetic stays at 256
        ```

    **Arguments:**

    - `x`: float32 values (bfloat16 and float16 are upcast to float32 first, exactly).
    - `dtype`: the target format: `jnp.bfloat16`, `jnp.float16`, `jnp.float8_e4m3fn`,
      `jnp.float8_e5m2` or `jnp.float4_e2m1fn`.
    - `key`: a Threefry key; use a fresh one (e.g. `fold_in` the step) for every rounding.
      (Keyword only argument.)
    - `topology`: `"element"` (an independent threshold per element) or `"row"` (one threshold
      shared by every element of a row of the last axis, like S3R's `Phi2D`: still unbiased,
      cheaper in random bits, correlated along the row). (Keyword only argument.)
    - `bits`: threshold width, 8, 16 or 32 (`32 // bits` thresholds are cut from each Threefry
      word). (Keyword only argument.)

    **Returns:**

    An array of dtype `dtype` and the shape of `x`.
    """
    float_format(dtype)  # validate before drawing any bits
    t = float_thresholds(key, x.shape, topology=topology, bits=bits)
    return sr_float(x, dtype, t, bits=bits)
