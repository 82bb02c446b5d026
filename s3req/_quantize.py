"""The quantizers: per-row scales, round-to-nearest-even, stochastic rounding, error statistics.

One implementation of the maths serves every policy: a topology only changes the threshold
indices `t` handed to [`s3req.sr_codes`][], and a correction only changes which statistics of
the known rounding error are subtracted after the GEMMs.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Int8


QMAX = 127
"""Largest int8 code used (the grid is symmetric: codes lie in [-127, 127])."""


def finite_absmax(
    x: Float[Array, "..."], axis: int | None = None, keepdims: bool = False
) -> Float[Array, "..."]:
    """`max |x|` along `axis` (all axes for `None`) in float32, and `+inf` for every slice that
    holds a NaN or an Inf.

    XLA CPU's max reduction can drop a NaN (openxla/xla#21461), but no max drops an Inf: the
    NaNs are found by their own `isnan` reduction (an `or` beside the max; XLA:CPU runs it as
    a second pass over `x`), so a finiteness test of the result checks every element on every
    backend.
    (Replacing each NaN by `+inf` inside the max, or testing `isnan` of `|x|` rather than of
    `x`, changes how XLA CPU fuses the backward: EC then holds a float32 copy of `G'` across
    the GEMMs, see `tests/test_qdot.py::test_ec_temporary_memory`.)
    """
    nan = jnp.any(jnp.isnan(x), axis=axis, keepdims=keepdims)
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=keepdims)
    return jnp.where(nan, jnp.inf, amax)


def absmax_scale(x: Float[Array, "..."], axis: int) -> Float[Array, "..."]:
    """`max |x| / 127` along `axis` (kept as a size-1 axis), in float32; zero slices get 1.

    A zero row or column gets scale 1, never 0, because the backward pass divides by it.
    A slice holding a NaN or an Inf gets scale `+inf` (see `finite_absmax`), so checking the
    scales for finiteness checks every element.
    """
    amax = finite_absmax(x, axis=axis, keepdims=True)
    return jnp.where(amax == 0, jnp.ones_like(amax), amax / QMAX)


SCALE_EXPONENT = 27
"""`normalizing_shift` puts the largest `max|x|` of an operand in `[2**27, 2**28)`, so its
largest scale lies in `[2**20, 2**21)`: far from both ends of the float32 range, with room for
the int32 sums of the GEMMs (below `2**31`) on one side and tokens or channels up to `2**146`
times smaller on the other."""


def pow2(e: Int[Array, "..."]) -> Float[Array, "..."]:
    """`2.0 ** e` in float32, exact, for integers `e` in `[-126, 127]` (the normal range),
    built from its exponent bits."""
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def ceil_pow2(s: Float[Array, "..."]) -> Float[Array, "..."]:
    """The smallest power of two `>= s` for normal positive float32 `s` below `2**127`,
    exact (from the exponent and mantissa bits)."""
    bits = jax.lax.bitcast_convert_type(s.astype(jnp.float32), jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return pow2(jnp.clip(exponent, -126, 127))


def normalizing_shift(amax: Float[Array, ""], target: int = 0) -> Int[Array, ""]:
    """The power of two `a` that puts `amax * 2**a` in `[2**target, 2**(target+1))` (for a
    normal float32 `amax`), clipped to `[-126, 126]` so that `2**a` and `2**-a` are normal
    floats. Read from the exponent bits of `amax`: a zero or subnormal `amax` counts as
    `2**-127` (the clip then applies), Inf and NaN as `2**128`."""
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127  # floor(log2 amax) for a normal amax
    return jnp.clip(target - exponent, -126, 126)


def unshift(v: Float[Array, "..."], shift: Int[Array, ""]) -> Float[Array, "..."]:
    """`v * 2**-shift` for a `shift` in `[-252, 252]`, as two multiplies by normal powers of
    two (exact wherever the result is a normal float: the intermediate lies between `v` and
    the result)."""
    half = shift >> 1
    return v * pow2(-half) * pow2(half - shift)


def shifted_scale(amax: Float[Array, "..."], shift: Int[Array, ""]) -> Float[Array, "..."]:
    """`absmax_scale` times `2**shift` from the maxima `amax`: `(amax * 2**shift) / 127`, and
    `2**shift` (scale 1) for a zero slice. Bitwise `absmax_scale(x) * 2**shift` wherever
    that scale is a normal float; also representable where it is not (tiny or huge `x`)."""
    p = pow2(shift)
    return jnp.where(amax == 0, p, (amax * p) / QMAX)


def round_to_int8(x: Float[Array, "..."], scale: Float[Array, "..."]) -> Int8[Array, "..."]:
    """Round-to-nearest-even of `x / scale` to int8 codes (clipped to [-127, 127])."""
    y = x.astype(jnp.float32) / scale
    return jnp.clip(jnp.round(y), -QMAX, QMAX).astype(jnp.int8)


def gradient_step(
    g: Float[Array, "..."], qmax: int = QMAX
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """The per-tensor step `delta = max|g| / qmax` and the multiplier `inv = qmax / max|g|`.

    For an all-zero gradient `delta = 0` and `inv = 0`: every code is 0 and nothing is NaN.
    (`g` may also be a precomputed maximum.)
    """
    amax = finite_absmax(g)
    safe = jnp.where(amax > 0, amax, jnp.ones_like(amax))
    inv = jnp.where(amax > 0, qmax / safe, jnp.zeros_like(amax))
    return amax / qmax, inv


def sr_codes(
    y: Float[Array, "..."], t: Int[Array, "..."] | None, bits: int, *, qmax: int = QMAX
) -> Int8[Array, "..."]:
    """Round `y` (in units of the step, |y| <= 127) to int8 codes.

    With `t=None` this is round-to-nearest-even. Otherwise it is
    $q = \\lfloor y + (t + 1/2)/2^{\\text{bits}} \\rfloor$, computed in exact integer arithmetic:
    with $z = \\lfloor 2^{\\text{bits}+1} y \\rfloor$, $q = (z + 2t + 1) \\gg (\\text{bits} + 1)$.
    The only float operation is one multiply by a power of two, so no fused multiply-add can
    change a rounding between two compilations (bitwise identical under any sharding).

    **Arguments:**

    - `y`: float32 values in units of the step, already clipped to [-qmax, qmax].
    - `t`: integer threshold indices in `[0, 2**bits)`, broadcastable to `y`, or `None`.
    - `bits`: bit width of `t` (7 for shared thresholds, 23 for per-element ones).
    - `qmax`: the largest code (127 for int8, 7 for int4). (Keyword only argument.)

    **Returns:**

    int8 codes in [-qmax, qmax].
    """
    if t is None:
        return jnp.clip(jnp.round(y), -qmax, qmax).astype(jnp.int8)
    if not 1 <= bits <= 23:
        raise ValueError(f"Threshold bit width must be in [1, 23], got {bits}.")
    shift = bits + 1
    z = jnp.floor(y * float(2**shift)).astype(jnp.int32)
    q = (z + 2 * t.astype(jnp.int32) + 1) >> shift
    return jnp.clip(q, -qmax, qmax).astype(jnp.int8)


def error_stats(
    q: Int8[Array, "b s d"], y: Float[Array, "b s d"]
) -> tuple[Float[Array, "b s"], Float[Array, "b d"], Float[Array, " b"]]:
    """Means of the rounding error `e = q - y` (in units of the step) of every example.

    **Returns:**

    `(eps, a, m)`: token means `eps[b, s] = mean_d e`, channel means `a[b, d] = mean_s e` and the
    grand mean `m[b] = mean_{s, d} e`. The structured part of the error is
    `P = a[:, None, :] + eps[..., None] - m[:, None, None]`, the orthogonal projection of `e_b`
    onto row-constant plus column-constant matrices.
    """
    e = q.astype(jnp.float32) - y
    eps = jnp.mean(e, axis=2)
    a = jnp.mean(e, axis=1)
    m = jnp.mean(eps, axis=1)
    return eps, a, m
