"""Gradient formats as a policy axis: int4, fp8-e5m2, MXFP4- and NVFP4-style block floats."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from policies import (
    BlockFloatGrad,
    FP8_E5M2,
    Independent,
    INT4,
    IntGrad,
    MXFP4,
    NoEC,
    NVFP4,
    Phi2D,
    Policy,
    TwoWayEC,
)
from s3req import (
    absmax_scale,
    Block,
    gradient_codes,
    grid_neighbours,
    qdot,
    qragged_dot,
    round_to_int8,
)


FORMATS = [INT4, FP8_E5M2, MXFP4, NVFP4]
B, S, H, D = 2, 4, 16, 32
N_KEYS = 1000


def _problem(key):
    k1, k2, k3, k4 = jr.split(key, 4)
    x = jr.normal(k1, (B, S, H))
    w = jr.normal(k2, (H, D))
    g = jr.normal(k3, (B, S, D)) * jnp.exp(jr.normal(k4, (B, S, D)))
    return x, w, g


def _vjp(policy, x, w, g, key):
    _, f = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
    return f(g)


def _gp(x, w, g):
    return absmax_scale(x, -1) * g * absmax_scale(w, 0)[None]


def _grid(fmt, gp):
    """`(lo, hi)`: the two grid points of the format that bracket every element of `G'`
    (`(b, s, d)`), in units of `G'`."""
    if isinstance(fmt, IntGrad):
        step = jnp.max(jnp.abs(gp)) / fmt.qmax
        lo = jnp.floor(gp / step)
        return lo * step, (lo + 1) * step
    Bg, Sg, Dg = gp.shape
    blk = fmt.block or Dg
    g4 = gp.reshape(Bg, Sg, Dg // blk, blk)
    amax = jnp.max(jnp.abs(g4), -1, keepdims=True) if fmt.block else jnp.max(jnp.abs(gp))
    s = fmt.scales(amax)
    lo, hi = grid_neighbours((g4 / s).reshape(gp.shape), jnp.dtype(fmt.dtype))
    return (lo.reshape(g4.shape) * s).reshape(gp.shape), (hi.reshape(g4.shape) * s).reshape(
        gp.shape
    )


def _step_bound(fmt, gp, bits):
    """Per-element bound on the rounding bias, in units of G': (grid spacing) / 2**(bits+1)."""
    lo, hi = _grid(fmt, gp)
    if isinstance(fmt, IntGrad):
        return jnp.full(gp.shape, jnp.max(jnp.abs(gp)) / fmt.qmax * 2.0 ** -(bits + 1))
    return jnp.abs(hi - lo) * 2.0 ** -(bits + 1)


def _sr_variance(fmt, gp):
    """Per-element variance of unbiased stochastic rounding of `G'` onto the format's grid,
    `(hi - G')(G' - lo)`, in units of `G'` squared."""
    lo, hi = _grid(fmt, gp)
    return jnp.abs(hi - gp) * jnp.abs(gp - lo)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe())
@pytest.mark.parametrize("topology", [Phi2D(), Independent()], ids=["Phi2D", "Independent"])
@pytest.mark.parametrize("correction", [NoEC(), TwoWayEC()], ids=["NoEC", "TwoWayEC"])
def test_unbiased_every_format(fmt, topology, correction, getkey):
    """Mean over 1000 keys equals the exact gradient of the executed graph: tolerance 5
    standard errors plus the threshold grid's bias bound (x4 with EC, as in test_qdot)."""
    x, w, g = _problem(getkey())
    policy = Policy(topology, correction, fmt=fmt)
    dx, dw = jax.jit(jax.vmap(lambda k: _vjp(policy, x, w, g, k)))(jr.split(getkey(), N_KEYS))
    sx, sw = absmax_scale(x, -1), absmax_scale(w, 0)
    xq = round_to_int8(x, sx).astype(jnp.float32)
    wq = round_to_int8(w, sw).astype(jnp.float32)
    dx_exact = g @ (wq * sw).T
    dw_exact = jnp.einsum("bsh,bsd->hd", xq * sx, g)
    bits = 23 if isinstance(topology, Independent) else 7
    factor = 1.0 if isinstance(correction, NoEC) else 4.0
    bias = factor * _step_bound(fmt, _gp(x, w, g), bits)
    if isinstance(correction, TwoWayEC):  # the correction spreads any element's bias
        bias = jnp.broadcast_to(jnp.max(bias), bias.shape)
    bias_dx = jnp.einsum("bsd,hd->bsh", bias, jnp.abs(wq)) / sx
    bias_dw = jnp.einsum("bsh,bsd->hd", jnp.abs(xq), bias) / sw
    for est, exact, b in ((dx, dx_exact, bias_dx), (dw, dw_exact, bias_dw)):
        se = jnp.std(est, axis=0) / np.sqrt(N_KEYS)
        err = jnp.abs(jnp.mean(est, axis=0) - exact)
        assert jnp.all(err <= 5 * se + b + 1e-5 * jnp.abs(exact)), float(
            jnp.max(err / (5 * se + b + 1e-12))
        )


def _ragged_problem(key, n_examples=2, seq=4, top_k=2, E=3):
    """Expert-sorted rows `(n, H)`, expert weights `(E, H, D)`, an upstream gradient
    `(n, D)`, `group_sizes` and the global ids of a random routing (distinct experts)."""
    kr, kx, kw, kg, ks = jr.split(key, 5)
    T = n_examples * seq
    experts = jnp.stack([jr.permutation(k, E)[:top_k] for k in jr.split(kr, T)]).reshape(-1)
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    gs = jnp.bincount(experts, length=E).astype(jnp.int32)
    n = T * top_k
    x = jr.normal(kx, (n, H))
    w = jr.normal(kw, (E, H, D))
    g = jr.normal(kg, (n, D)) * jnp.exp(jr.normal(ks, (n, D)))
    ids = dict(row_id=order, example_id=order // top_k // seq)
    return x, w, g, gs, ids, n_examples


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.describe())
@pytest.mark.parametrize(
    "topology, correction",
    [
        (Phi2D(), TwoWayEC()),
        pytest.param(Independent(), NoEC(), marks=pytest.mark.slow),
    ],
    ids=["Phi2D-TwoWayEC", "Independent-NoEC"],
)
def test_ragged_unbiased_every_format(fmt, topology, correction, getkey):
    """`qragged_dot` with every non-int8 gradient format: the mean over 1000 keys equals the
    exact gradient of the dequantized operands, within 5 standard errors (from the measured
    variance) plus the threshold grid's bias bound (x4 and spread over the tensor with EC,
    whose (example, expert) segments average the errors, as in the dense test)."""
    x, w, g, gs, ids, n_examples = _ragged_problem(getkey())
    policy = Policy(topology, correction, fmt=fmt)

    def grads(key):
        f = lambda x, w: qragged_dot(
            x,
            w,
            gs,
            policy=policy,
            key=key,
            row_id=ids["row_id"],
            example_id=ids["example_id"],
            num_examples=n_examples,
        )
        return jax.vjp(f, x, w)[1](g)

    dx, dw = jax.jit(lambda ks: jax.lax.map(grads, ks))(jr.split(getkey(), N_KEYS))
    expert = np.repeat(np.arange(w.shape[0]), np.asarray(gs))
    sx = np.asarray(absmax_scale(x, -1), np.float64)
    sw = np.asarray(absmax_scale(w, 1), np.float64)[:, 0]  # (E, D)
    xq = np.asarray(round_to_int8(x, absmax_scale(x, -1)), np.float64)
    wq = np.asarray(round_to_int8(w, absmax_scale(w, 1)), np.float64)
    g64 = np.asarray(g, np.float64)
    dx_exact = np.einsum("nd,nhd->nh", g64, (wq * sw[:, None, :])[expert])
    dw_exact = np.stack([(xq * sx)[expert == e].T @ g64[expert == e] for e in range(len(sw))])
    gp = sx * g64 * sw[expert]
    bits = 23 if isinstance(topology, Independent) else 7
    factor = 1.0 if isinstance(correction, NoEC) else 4.0
    bias = factor * np.asarray(_step_bound(fmt, jnp.asarray(gp, jnp.float32)[None], bits))[0]
    if isinstance(correction, TwoWayEC):
        bias = np.full(bias.shape, bias.max())
    bias_dx = np.einsum("nd,nhd->nh", bias, np.abs(wq)[expert]) / sx
    bias_dw = np.stack(
        [np.abs(xq[expert == e]).T @ bias[expert == e] / sw[e] for e in range(len(sw))]
    )
    # Independent without EC rounds every element on its own: the variance of each gradient
    # entry is known exactly. It bounds the standard error from below where the keys rarely
    # (or never) see an unlikely rounding of a small element (block floats near zero).
    var_dx = var_dw = 0.0
    if isinstance(topology, Independent) and isinstance(correction, NoEC):
        v = np.asarray(_sr_variance(fmt, jnp.asarray(gp, jnp.float32)[None]), np.float64)[0]
        var_dx = np.einsum("nd,nhd->nh", v, wq[expert] ** 2) / sx**2
        var_dw = np.stack(
            [(xq[expert == e] ** 2).T @ v[expert == e] / sw[e] ** 2 for e in range(len(sw))]
        )
    for est, exact, b, var in ((dx, dx_exact, bias_dx, var_dx), (dw, dw_exact, bias_dw, var_dw)):
        est = np.asarray(est, np.float64)
        se = np.sqrt(np.maximum(est.var(axis=0), var) / N_KEYS)
        err = np.abs(est.mean(axis=0) - exact)
        bound = 5 * se + b + 1e-5 * np.abs(exact)
        assert np.all(err <= bound), float(np.max(err / bound))


@pytest.mark.parametrize("fmt", [FP8_E5M2, MXFP4, NVFP4], ids=lambda f: f.describe())
def test_float_codes_on_grid(fmt, getkey):
    x, w, g = _problem(getkey())
    gp = _gp(x, w, g)
    thresholds = Phi2D().thresholds(getkey(), Block.whole((B, S, D)), "dx")
    q, step = fmt.quantize(gp, jnp.max(jnp.abs(gp)), thresholds)
    deq = q * step
    blk = fmt.block or D
    g4 = gp.reshape(B, S, D // blk, blk)
    amax = jnp.max(jnp.abs(g4), -1, keepdims=True) if fmt.block else jnp.max(jnp.abs(gp))
    s = fmt.scales(amax)
    q = (deq.reshape(g4.shape) / s).reshape(gp.shape)
    on_grid = q.astype(jnp.dtype(fmt.dtype)).astype(jnp.float32)
    if fmt.pow2:  # power-of-two scales: dequantization is exact, so q is recovered exactly
        np.testing.assert_array_equal(on_grid, q)
    else:  # float32 scales: q * s / s is q up to one float32 rounding
        np.testing.assert_allclose(on_grid, q, rtol=2e-7)
    if fmt.pow2:  # exact powers of two: mantissa 1/2 (XLA's exp2 is not exact, not a test)
        np.testing.assert_array_equal(np.frexp(np.asarray(s))[0], 0.5)
    # relative error of the dequantized gradient is that of the format's few mantissa bits
    rel = jnp.linalg.norm(deq - gp) / jnp.linalg.norm(gp)
    assert rel < (0.2 if "float4" in fmt.dtype else 0.1)


def test_int4_codes(getkey):
    x, w, g = _problem(getkey())
    delta, _, q, _ = gradient_codes(Policy(Phi2D(), fmt=INT4), _gp(x, w, g), getkey())
    assert int(jnp.max(jnp.abs(q))) <= 7 and q.dtype == jnp.int8
    np.testing.assert_allclose(delta, jnp.max(jnp.abs(_gp(x, w, g))) / 7, rtol=1e-6)


def test_gradient_codes_checks_the_gradient(getkey):
    """`gradient_codes` raises where `qdot`'s backward would: a NaN, or a step below float32's
    range."""
    x, w, g = _problem(getkey())
    gp, key = _gp(x, w, g), getkey()
    run = eqx.filter_jit(lambda gp: gradient_codes(Policy(Phi2D()), gp, key)[0])
    assert np.isfinite(float(run(gp)))
    with pytest.raises(RuntimeError, match="upstream gradient contains NaN or Inf"):
        jax.block_until_ready(run(gp.at[1, 2, 3].set(jnp.nan)))
    with pytest.raises(RuntimeError, match="below float32's range"):
        jax.block_until_ready(run(gp / jnp.max(jnp.abs(gp)) * 2.0**-120))


def test_formats_errors(getkey):
    with pytest.raises(ValueError, match="bits"):
        IntGrad(9)
    with pytest.raises(ValueError, match="dtype"):
        BlockFloatGrad("float16")
    with pytest.raises(TypeError, match="fmt"):
        Policy(Phi2D(), fmt="int8")  # pyright: ignore
    x, w, _ = _problem(getkey())
    with pytest.raises(ValueError, match="block size"):
        _vjp(
            Policy(Phi2D(), fmt=BlockFloatGrad("float4_e2m1fn", 24)),
            x,
            w,
            jnp.ones((B, S, D)),
            getkey(),
        )
    with pytest.raises(TypeError, match="integer"):
        gradient_codes(Policy(Phi2D(), fmt=MXFP4), jnp.ones((B, S, D)), getkey())
    from s3req import qragged_dot

    def ragged(x, w):
        return qragged_dot(
            x,
            w,
            jnp.array([2, 2], jnp.int32),
            policy=Policy(Phi2D(), fmt=BlockFloatGrad("float4_e2m1fn", 24)),
            key=getkey(),
            row_id=jnp.arange(4, dtype=jnp.int32),
            example_id=jnp.zeros(4, jnp.int32),
            num_examples=1,
        )

    with pytest.raises(ValueError, match="block size"):
        jax.vjp(ragged, jnp.ones((4, 8)), jnp.ones((2, 8, 8)))[1](jnp.ones((4, 8)))


def test_zero_gradient_every_format(getkey):
    x, w, _ = _problem(getkey())
    for fmt in FORMATS:
        dx, dw = _vjp(Policy(Phi2D(), TwoWayEC(), fmt=fmt), x, w, jnp.zeros((B, S, D)), getkey())
        assert jnp.all(dx == 0) and jnp.all(dw == 0)
