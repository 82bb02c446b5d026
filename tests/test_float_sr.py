"""Stochastic rounding onto float grids (s3req/_float_sr.py).

Statistical checks use fixed seeds and a 5-sigma tolerance from the analytic variance
p(1-p) ulp^2 / n, plus the stated threshold bias bound where it is not zero.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from s3req._float_sr import (
    float_format,
    FLOAT_FORMATS,
    float_thresholds,
    grid_neighbours,
    sr_float,
    stochastic_round,
)
from s3req._thresholds import Block, token_thresholds


_sr = jax.jit(stochastic_round, static_argnames=("dtype", "topology", "bits"))
_sr_float = jax.jit(sr_float, static_argnames=("dtype", "bits"))

FORMATS = [pytest.param(d, id=d.name) for d in FLOAT_FORMATS]
WITH_NAN = [pytest.param(d, id=d.name) for d in FLOAT_FORMATS if float_format(d).has_nan]


# ---------------------------------------------------------------------------------------------
# Independent references (numpy, float64)


def _grid(dtype) -> np.ndarray:
    """Every finite non-negative value of `dtype`, sorted, by enumerating all bit patterns."""
    nbits = jnp.dtype(dtype).itemsize * 8
    n = 16 if dtype == jnp.float4_e2m1fn else 2**nbits
    codes = np.arange(n, dtype=np.uint16 if nbits == 16 else np.uint8)
    with np.errstate(invalid="ignore"):
        vals = codes.view(dtype).astype(np.float64)
    return np.unique(vals[np.isfinite(vals) & (vals >= 0)])


def _ref_neighbours(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """`lo` toward zero and the next grid point away from zero, clipped to +-max."""
    g = _grid(dtype)
    a = np.abs(x.astype(np.float64))
    i = np.searchsorted(g, a, side="right") - 1
    lo = g[i]
    hi = g[np.minimum(i + 1, len(g) - 1)]
    s = np.where(np.signbit(x), -1.0, 1.0)
    return s * lo, s * hi


def _inputs(dtype, n: int, seed: int) -> np.ndarray:
    """Random float32 values spread over every binade of the format, down to well below its
    smallest subnormal and up to beyond its largest value, plus edge cases."""
    rng = np.random.default_rng(seed)
    fmt = float_format(dtype)
    emax = int(np.floor(np.log2(fmt.max_finite)))
    lo_e = max(fmt.min_exponent - fmt.mantissa_bits - 12, -149)
    e = rng.integers(lo_e, min(emax + 3, 128), size=n)
    mant = rng.random(n) + 1.0
    x = (mant * np.exp2(e.astype(np.float64))).astype(np.float32)
    x = np.where(rng.random(n) < 0.5, -x, x)
    g64 = _grid(dtype)
    if g64.size > 2000:  # 16-bit formats: both ends and a random sample of the middle
        mid = rng.choice(g64[200:-200], 1600, replace=False)
        g64 = np.sort(np.concatenate([g64[:200], mid, g64[-200:]]))
    g = g64.astype(np.float32)
    edge = np.concatenate(
        [
            g,  # every grid point (or all 65536 for 16-bit formats)
            ((g64[:-1] + g64[1:]) / 2).astype(np.float32),  # midpoints
            np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40], np.float32),
            np.array([min(fmt.max_finite * 1.01, float(np.finfo(np.float32).max))], np.float32),
            np.nextafter(np.float32(fmt.max_finite), np.float32(np.inf))[None],
            np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max], np.float32),
        ]
    ).astype(np.float32)
    return np.concatenate([x, edge, -edge]).astype(np.float32)


def _p_up_law(p: np.ndarray, bits: int) -> np.ndarray:
    """Probability of rounding away from zero for residual fraction `p` (the documented law)."""
    if bits == 32:
        return np.floor(p * 2.0**32) / 2.0**32
    return np.floor(p * 2.0**bits + 0.5) / 2.0**bits


# ---------------------------------------------------------------------------------------------
# Formats and the grid


def test_float4_exists_and_format_table():
    assert hasattr(jnp, "float4_e2m1fn")
    table = {
        jnp.bfloat16: (7, -126, 3.3895313892515355e38, True, True),
        jnp.float16: (10, -14, 65504.0, True, True),
        jnp.float8_e4m3fn: (3, -6, 448.0, False, True),
        jnp.float8_e5m2: (2, -14, 57344.0, True, True),
        jnp.float4_e2m1fn: (1, 0, 6.0, False, False),
    }
    for d, row in table.items():
        f = float_format(d)
        assert (f.mantissa_bits, f.min_exponent, f.max_finite, f.has_inf, f.has_nan) == row
        assert f.smallest_subnormal == float(np.min(_grid(d)[1:]))
    with pytest.raises(ValueError, match="supported target formats"):
        float_format(jnp.float32)
    with pytest.raises(ValueError, match="supported target formats"):
        float_format(jnp.int8)


@pytest.mark.parametrize("dtype", FORMATS)
def test_grid_neighbours_match_enumeration(dtype):
    x = _inputs(dtype, 20_000, seed=1)
    lo, hi = grid_neighbours(jnp.asarray(x), dtype)
    rlo, rhi = _ref_neighbours(x, dtype)
    np.testing.assert_array_equal(np.asarray(lo, np.float64), rlo)
    np.testing.assert_array_equal(np.asarray(hi, np.float64), rhi)
    # The spacing: hi - lo is the ulp wherever hi did not saturate.
    ulp = np.asarray(float_format(dtype).ulp(jnp.asarray(x)), np.float64)
    ok = np.abs(rhi) < float_format(dtype).max_finite
    np.testing.assert_array_equal(np.abs(rhi - rlo)[ok], ulp[ok])


@pytest.mark.parametrize("dtype", FORMATS)
def test_nearest_matches_ml_dtypes(dtype):
    x = _inputs(dtype, 20_000, seed=2)
    big = np.float32(float_format(dtype).max_finite)
    want = np.clip(x, -big, big).astype(dtype)  # ml_dtypes: round to nearest even
    got = _sr_float(jnp.asarray(x), dtype, None)
    assert got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("topology", ["element", "row"])
@pytest.mark.parametrize("bits", [8, 16, 32])
@pytest.mark.parametrize("dtype", FORMATS)
def test_outputs_on_grid(dtype, bits, topology, getkey):
    x = _inputs(dtype, 4_000, seed=3).reshape(-1, 2)
    y = _sr(jnp.asarray(x), dtype, key=getkey(), topology=topology, bits=bits)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    # Round trip through float32 and back is the identity, bit for bit.
    back = y.astype(jnp.float32).astype(dtype)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(y).view(np.uint8))
    # Every output is one of the two neighbours (or the saturated value).
    rlo, rhi = _ref_neighbours(x, dtype)
    yv = np.asarray(y).astype(np.float64)
    assert np.all((yv == rlo) | (yv == rhi))
    # Sign (incl. -0) is kept.
    assert np.array_equal(np.signbit(yv), np.signbit(x))


# ---------------------------------------------------------------------------------------------
# Unbiasedness


def _check_unbiased(x, samples, dtype, bits, label):
    """Per value: mean of the samples vs the documented law (5 sigma) and vs x (5 sigma +
    the stated bias bound ulp / 2**(bits+1), zero for 32 bits on these inputs)."""
    x64 = x.astype(np.float64)
    lo, hi = _ref_neighbours(x, dtype)
    ulp = np.abs(hi - lo)
    p = np.abs(x64 - lo) / ulp
    law = _p_up_law(p, bits)
    n = samples.shape[0]
    mean = samples.astype(np.float64).mean(axis=0)
    sigma = np.sqrt(law * (1 - law)) * ulp / np.sqrt(n)
    expected = lo + np.sign(x64) * law * ulp
    assert np.all(np.abs(mean - expected) <= 5 * sigma), label
    bound = 0.0 if bits == 32 else ulp / 2.0 ** (bits + 1)
    assert np.all(np.abs(expected - x64) <= bound), label
    assert np.all(np.abs(mean - x64) <= 5 * sigma + bound), label


def _unbiased_inputs(dtype, n, seed):
    """Off-grid values in range: normal and subnormal binades, below the smallest subnormal."""
    x = _inputs(dtype, 50 * n, seed)
    x = x[np.isfinite(x) & (np.abs(x) < float_format(dtype).max_finite)]
    lo, hi = _ref_neighbours(x, dtype)
    p = np.abs(x - lo) / np.abs(hi - lo)
    keep = (p > 0.02) & (p < 0.98)
    rng = np.random.default_rng(seed)
    return rng.choice(x[keep], n, replace=False)


@pytest.mark.parametrize("topology", ["element", "row"])
@pytest.mark.parametrize("bits", [8, 16, 32])
@pytest.mark.parametrize("dtype", FORMATS)
def test_unbiased(dtype, bits, topology, getkey):
    x = _unbiased_inputs(dtype, 32, seed=4)
    n = 2**14
    xs = jnp.broadcast_to(jnp.asarray(x), (n, x.size))
    y = _sr(xs, dtype, key=getkey(), topology=topology, bits=bits)
    _check_unbiased(x, np.asarray(y), dtype, bits, f"{dtype} bits={bits} {topology}")


def test_unbiased_tiny_values():
    """Below the smallest subnormal (lo = 0) and float32 subnormals into bfloat16."""
    key = jr.key(11)
    n = 2**14
    for dtype, x in [
        (jnp.float8_e4m3fn, np.array([1e-4, 7e-4, -3e-4, 1.5e-3], np.float32)),
        (jnp.float16, np.array([1e-8, 3e-8, -4.5e-8], np.float32)),
        (jnp.float4_e2m1fn, np.array([0.1, 0.3, -0.45, 0.01], np.float32)),
        (jnp.bfloat16, np.array([1e-40, 3e-41, -2e-40, 7e-39], np.float32)),
    ]:
        xs = jnp.broadcast_to(jnp.asarray(x), (n, x.size))
        y = _sr(xs, dtype, key=key)
        _check_unbiased(x, np.asarray(y), dtype, 32, str(dtype))


def test_bias_law_for_8_bits():
    """8-bit thresholds: P(up) = floor(p*256 + 1/2)/256 exactly, checked over all 256
    thresholds (not sampled): a value with a long residual has the stated bias."""
    x = jnp.full((256,), 1.0 + 2.0**-7 / 3, jnp.float32)  # p = 1/3 of a bfloat16 ulp
    t = jnp.arange(256, dtype=jnp.uint32)
    y = np.asarray(_sr_float(x, jnp.bfloat16, t, bits=8)).astype(np.float64)
    frac_up = np.mean(y > 1.0)
    assert frac_up == np.floor(256 / 3 + 0.5) / 256  # 85/256
    assert abs(frac_up - 1 / 3) <= 2.0**-9
    # With 16 bits the residual (16 bits for float32 -> bfloat16) is represented exactly.
    x16 = jnp.full((2**16,), 1.0 + 12345 * 2.0**-23, jnp.float32)
    t16 = jnp.arange(2**16, dtype=jnp.uint32)
    y16 = np.asarray(_sr_float(x16, jnp.bfloat16, t16, bits=16)).astype(np.float64)
    assert np.sum(y16 > 1.0) == 12345


def test_bf16_input_unbiased_where_bf16_arithmetic_is_not(getkey):
    """bfloat16 input: the rounding works on the exact (upcast) value. Doing the SR arithmetic
    in bfloat16, `floor(x/ulp + u)`, rounds `x/ulp + u` to 8 significant bits first: biased."""
    dtype = jnp.float8_e4m3fn
    x = jnp.asarray(np.array([1.0 + 2**-6, 1.0 + 3 * 2**-7, -(40.0 + 1.0)], np.float32))
    x_bf = x.astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(x_bf.astype(jnp.float32)), np.asarray(x))  # exact in bf16
    n = 2**16
    xs = jnp.broadcast_to(x_bf, (n, 3))
    y = np.asarray(_sr(xs, dtype, key=getkey()))
    x_np = np.asarray(x)
    _check_unbiased(x_np, y, dtype, 32, "bf16 input")

    # Naive: the same rounding written in bfloat16 arithmetic.
    ulp = float_format(dtype).ulp(x).astype(jnp.bfloat16)
    u = jr.uniform(getkey(), (n, 3), jnp.float32).astype(jnp.bfloat16)
    ulp, sgn = ulp[None], jnp.sign(x_bf)[None]
    naive = (jnp.floor(jnp.abs(xs) / ulp + u) * ulp * sgn).astype(jnp.float32)
    naive = np.asarray(naive, np.float64)
    lo, hi = _ref_neighbours(x_np, dtype)
    p = np.abs(x_np - lo) / np.abs(hi - lo)
    sigma = np.sqrt(p * (1 - p)) * np.abs(hi - lo) / np.sqrt(n)
    assert np.any(np.abs(naive.mean(axis=0) - x_np) > 10 * sigma)


# ---------------------------------------------------------------------------------------------
# The swamping example of the second paper


def _run_updates(w0, g, steps, dtype, key, n):
    w = jnp.full((n,), w0, dtype)
    w_rtn = w
    for step in range(steps):
        k = jr.fold_in(key, step)
        w = _sr(w.astype(jnp.float32) + g, dtype, key=k)
        w_rtn = w_rtn + jnp.asarray(g, dtype)  # plain low-precision arithmetic (RTNE)
    return np.asarray(w, np.float64), np.asarray(w_rtn, np.float64)


def test_swamping_bf16():
    """w = 256, g = 0.3 in bfloat16 (ulp 2 at 256, so p = 0.15 per step): RTN stays at 256,
    SR drifts to 259 on average after 10 steps."""
    n = 4096
    w, w_rtn = _run_updates(256.0, 0.3, 10, jnp.bfloat16, jr.key(0), n)
    assert np.all(w_rtn == 256.0)
    sigma = np.sqrt(10 * 0.15 * 0.85 * 2.0**2 / n)
    assert abs(w.mean() - 259.0) <= 5 * sigma, w.mean()
    assert set(np.unique(w)) <= set(256.0 + 2.0 * np.arange(11))
    # The RTN of sr_float agrees with bf16 arithmetic.
    x = jnp.full((4,), 256.3, jnp.float32)
    assert np.all(np.asarray(sr_float(x, jnp.bfloat16, None), np.float64) == 256.0)


def test_swamping_float16_ulp_one():
    """The paper's exact grid: float16 has ulp 1 on [1024, 2048); w = 1024, g = 0.3."""
    n = 4096
    w, w_rtn = _run_updates(1024.0, 0.3, 10, jnp.float16, jr.key(1), n)
    assert np.all(w_rtn == 1024.0)
    sigma = np.sqrt(10 * 0.3 * 0.7 / n)
    assert abs(w.mean() - 1027.0) <= 5 * sigma, w.mean()


# ---------------------------------------------------------------------------------------------
# Special values


@pytest.mark.parametrize("dtype", FORMATS)
def test_saturation(dtype, getkey):
    fmt = float_format(dtype)
    big = fmt.max_finite
    f32max = float(np.finfo(np.float32).max)
    x = np.minimum(np.array([big, big * 1.001, big * 1.2, big * 3, f32max]), f32max)
    x = np.concatenate([x, -x]).astype(np.float32)
    xs = jnp.broadcast_to(jnp.asarray(x), (512, x.size))
    for t in [None, "sr"]:
        if t is None:
            y = sr_float(xs, dtype, None)
        else:
            y = _sr(xs, dtype, key=getkey())
        yv = np.asarray(y).astype(np.float64)
        assert np.all(np.isfinite(yv))
        np.testing.assert_array_equal(yv, np.broadcast_to(np.sign(x) * big, yv.shape))


@pytest.mark.parametrize("dtype", WITH_NAN)
def test_nan_and_inf(dtype, getkey):
    fmt = float_format(dtype)
    x = jnp.asarray(np.array([np.nan, np.inf, -np.inf, 1.0], np.float32))
    for y in [sr_float(x, dtype, None), stochastic_round(x, dtype, key=getkey())]:
        yv = np.asarray(y).astype(np.float64)
        assert np.isnan(yv[0])
        if fmt.has_inf:
            assert yv[1] == np.inf and yv[2] == -np.inf
        else:  # float8_e4m3fn: no infinity, non-finite stays non-finite
            assert np.isnan(yv[1]) and np.isnan(yv[2])
        assert yv[3] == 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_float4_rejects_nonfinite(bad, getkey):
    x = jnp.asarray(np.array([1.0, bad], np.float32))
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot represent"):
        stochastic_round(x, jnp.float4_e2m1fn, key=getkey())
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot represent"):
        eqx.filter_jit(lambda x, k: stochastic_round(x, jnp.float4_e2m1fn, key=k))(x, getkey())
    with pytest.raises(eqx.EquinoxRuntimeError, match="cannot represent"):
        sr_float(x, jnp.float4_e2m1fn, None)


def test_bad_arguments(getkey):
    x = jnp.ones((4, 8), jnp.float32)
    # Integer input: the annotation (jaxtyping) or the function's own check refuses it.
    with pytest.raises(TypeError, match="float32, bfloat16 or float16|Float"):
        stochastic_round(jnp.ones((4,), jnp.int32), jnp.bfloat16, key=getkey())  # pyright: ignore
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        stochastic_round(x.astype(jnp.float8_e4m3fn), jnp.float4_e2m1fn, key=getkey())
    with pytest.raises(ValueError, match="bits must be one of"):
        stochastic_round(x, jnp.bfloat16, key=getkey(), bits=7)
    with pytest.raises((ValueError, TypeError), match="topology"):  # annotation or own check
        stochastic_round(x, jnp.bfloat16, key=getkey(), topology="col")  # pyright: ignore
    with pytest.raises(ValueError, match="supported target formats"):
        stochastic_round(x, jnp.float32, key=getkey())
    with pytest.raises(ValueError, match="rank"):
        sr_float(x, jnp.bfloat16, jnp.zeros((8,), jnp.uint32))
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        sr_float(x, jnp.bfloat16, jnp.zeros((4, 8), jnp.uint32), bits=33)


# ---------------------------------------------------------------------------------------------
# Keys and thresholds


@pytest.mark.parametrize("topology", ["element", "row"])
def test_reproducible_and_fresh(topology, getkey):
    x = jr.normal(getkey(), (16, 64), jnp.float32)
    k1, k2 = getkey(), getkey()
    f = lambda x, k: stochastic_round(x, jnp.float8_e4m3fn, key=k, topology=topology)
    a, b, c = f(x, k1), f(x, k1), jax.jit(f)(x, k1)
    bits = lambda y: np.asarray(y).view(np.uint8)
    assert np.array_equal(bits(a), bits(b)) and np.array_equal(bits(a), bits(c))
    assert not np.array_equal(bits(a), bits(f(x, k2)))
    s0, s1 = f(x, jr.fold_in(k1, 0)), f(x, jr.fold_in(k1, 1))  # two steps
    assert not np.array_equal(bits(s0), bits(s1))


@pytest.mark.parametrize("bits", [8, 16, 32])
@pytest.mark.parametrize("shape", [(3, 8), (5, 7), (6,), ()])
def test_threshold_layout(shape, bits, getkey):
    """Unit n takes chunk n % (32//bits) of word n // (32//bits) of jax.random.bits."""
    key = getkey()
    per = 32 // bits
    for topology in ("element", "row"):
        t = np.asarray(float_thresholds(key, shape, topology=topology, bits=bits))
        units = shape if (topology == "element" or not shape) else shape[:-1]
        n = int(np.prod(units, dtype=np.int64))
        words = np.asarray(jax.random.bits(key, (-(-n // per),), jnp.uint32))
        idx = np.arange(n)
        want = (words[idx // per] >> ((idx % per) * bits).astype(np.uint32)) & np.uint32(
            (1 << bits) - 1
        )
        out = shape if (topology == "element" or not shape) else shape[:-1] + (1,)
        assert t.shape == out and t.dtype == np.uint32
        np.testing.assert_array_equal(t.reshape(-1), want)


def test_row_shares_thresholds(getkey):
    # Every element of a row at p = 1/2: a shared threshold sends the whole row the same way.
    x = jnp.full((256, 32), 1.0 + 2.0**-8, jnp.float32)  # halfway between bf16 grid points
    y = np.asarray(_sr(x, jnp.bfloat16, key=getkey(), topology="row"))
    y = y.astype(np.float64)
    assert np.all(y == y[:, :1])
    assert 0 < np.mean(y[:, 0] > 1.0) < 1  # rows differ
    y_el = np.asarray(_sr(x, jnp.bfloat16, key=getkey())).astype(np.float64)
    assert not np.all(y_el == y_el[:, :1])
    # Row topology on a 1-D vector: one threshold for the whole vector.
    v = np.asarray(_sr(x[0], jnp.bfloat16, key=getkey(), topology="row")).astype(np.float64)
    assert np.all(v == v[0])


def test_sr_float_with_s3r_token_thresholds(getkey):
    """Part-2 reuse: 7-bit per-token S3R thresholds drive the float rounding (block-scaled
    fp4 gradients), unbiased up to the 7-bit bound ulp/256."""
    B, S, D = 64, 64, 4
    x = np.array([0.3, 1.2, -2.7, 4.4], np.float32)
    xs = jnp.broadcast_to(jnp.asarray(x), (B, S, D))
    t = token_thresholds(getkey(), Block.whole((B, S, D)))
    y = np.asarray(_sr_float(xs, jnp.float4_e2m1fn, t, bits=7)).reshape(B * S, D)
    _check_unbiased(x, y, jnp.float4_e2m1fn, 7, "fp4 with token thresholds")
    # Every row (token) shares its threshold: equal positions within the grid round alike.
    assert y.shape == (B * S, D)
