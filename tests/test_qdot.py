"""The quantized matmul: forward, backward maths, unbiasedness, EC, jaxpr, keys, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from policies import (
    DxOnlyEC,
    Independent,
    Nearest,
    NoEC,
    Phi2D,
    PhiBcast,
    Policy,
    TwoWayEC,
)
from s3req import (
    absmax_scale,
    Block,
    error_stats,
    gradient_step,
    MAX_TERMS,
    qdot,
    quantize_gradient,
    round_to_int8,
)
from s3req._backward import _token_contraction
from s3req._kernels_cpu import code_sums, DIGITS, digits_dot, DOT_SUM_MAX, float_sums, SUM_ALIGN
from s3req._qdot import qdot_t
from s3req._quantize import QMAX

from .helpers import (
    ALL_POLICIES,
    dot_eqns,
    exact_problem,
    iter_eqns,
    policy_id,
    quantizations,
    STOCHASTIC_POLICIES,
    with_kernels,
)


def _grads(policy, x, w, g, key):
    """(dX, dW) of qdot for upstream gradient g."""
    y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
    return vjp(g)


def _executed(x, w):
    """Dequantized operands of the executed forward graph."""
    sx, sw = absmax_scale(x, -1), absmax_scale(w, 0)
    f32 = jnp.float32
    return round_to_int8(x, sx).astype(f32) * sx, round_to_int8(w, sw).astype(f32) * sw


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_forward_is_int8_rtne(policy, getkey):
    x = jr.normal(getkey(), (2, 8, 16))
    w = jr.normal(getkey(), (16, 32))
    xh, wh = _executed(x, w)
    y = qdot(x, w, policy=policy, key=getkey())
    np.testing.assert_allclose(y, xh @ wh, rtol=1e-5, atol=1e-5)
    # and it is close to the float product
    assert jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.02


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_exact_when_representable(policy, getkey):
    x, w, g = exact_problem(getkey())
    dx, dw = _grads(policy, x, w, g, getkey())
    np.testing.assert_allclose(dx, g @ w.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, jnp.einsum("bsh,bsd->hd", x, g), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(qdot(x, w, policy=policy, key=getkey()), x @ w)


@pytest.mark.parametrize("policy", ALL_POLICIES + [None], ids=policy_id)
def test_weight_layouts_agree(policy, getkey):
    """`qdot_t` on a weight stored (d_out, d_in), as QuantLinear holds it, computes exactly
    what `qdot` computes on the transposed array: output and both gradients, bit for bit."""
    x = jr.normal(getkey(), (2, 8, 16), jnp.bfloat16)
    w = jr.normal(getkey(), (16, 32))
    g = jr.normal(getkey(), (2, 8, 32), jnp.bfloat16)
    key = getkey()
    y1, dx1, dw1 = _value_and_grads(lambda x, w: qdot(x, w, policy=policy, key=key), x, w, g)
    y2, dx2, dw2 = _value_and_grads(lambda x, w: qdot_t(x, w.T, policy=policy, key=key), x, w, g)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(dx1, dx2)
    np.testing.assert_array_equal(dw1, dw2)


def _value_and_grads(f, x, w, g):
    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y, *vjp(g))


def test_float_policy_is_plain_matmul(getkey):
    x = jr.normal(getkey(), (2, 8, 16))
    w = jr.normal(getkey(), (16, 32))
    np.testing.assert_array_equal(qdot(x, w, policy=None), x @ w)
    dx, dw = _grads(None, x, w, jnp.ones((2, 8, 32)), None)
    np.testing.assert_allclose(dx, jnp.ones((2, 8, 32)) @ w.T, rtol=1e-6)


N_KEYS = 2000


@pytest.mark.parametrize("policy", STOCHASTIC_POLICIES, ids=policy_id)
def test_unbiased(policy, getkey):
    """Mean over 2000 keys equals the exact gradient of the executed forward graph.

    Tolerance per element: 5 standard errors (from the measured variance over keys) plus the
    deterministic bias bound of the threshold grid: |E[e]| <= 2**-(bits+1) steps per element
    of G', so |bias of dX| <= delta * 2**-(bits+1) * sum_d |Wq| / s_x (dW alike). An error
    correction subtracts a projection of the error, whose bias is at most 3x that bound, so
    corrected gradients get 4x the bound.
    """
    B, S, H, D = 2, 8, 16, 24
    x = jr.normal(getkey(), (B, S, H))
    w = jr.normal(getkey(), (H, D))
    g = jr.normal(getkey(), (B, S, D)) * jnp.exp(jr.normal(getkey(), (B, S, D)))
    keys = jr.split(getkey(), N_KEYS)
    dx, dw = jax.jit(jax.vmap(lambda k: _grads(policy, x, w, g, k)))(keys)
    xh, wh = _executed(x, w)
    dx_exact, dw_exact = g @ wh.T, jnp.einsum("bsh,bsd->hd", xh, g)

    sx, sw = absmax_scale(x, -1), absmax_scale(w, 0)
    delta, _ = gradient_step(sx * g * sw[None])
    xq, wq = round_to_int8(x, sx), round_to_int8(w, sw)
    bits = 23 if isinstance(policy.topology, Independent) else 7
    factor = 1.0 if isinstance(policy.correction, NoEC) else 4.0
    xq, wq = xq.astype(jnp.float32), wq.astype(jnp.float32)
    bias_dx = factor * delta * 2.0 ** -(bits + 1) * jnp.sum(jnp.abs(wq), 1)[None, None] / sx
    bias_dw = factor * delta * 2.0 ** -(bits + 1) * jnp.sum(jnp.abs(xq), (0, 1))[:, None] / sw

    for est, exact, bias in ((dx, dx_exact, bias_dx), (dw, dw_exact, bias_dw)):
        se = jnp.std(est, axis=0) / np.sqrt(N_KEYS)
        err = jnp.abs(jnp.mean(est, axis=0) - exact)
        assert jnp.all(err <= 5 * se + bias + 1e-6 * jnp.abs(exact)), float(
            jnp.max(err / (5 * se + bias))
        )
    # the estimator really is random
    assert float(jnp.max(jnp.std(dx, axis=0))) > 0


def test_seven_bit_bias_bound_exact():
    """Over all 128 thresholds the mean code is within 1/256 step of y, for every residual."""
    y = jnp.linspace(-3.0, 3.0, 30001, dtype=jnp.float32)
    t = jnp.arange(128, dtype=jnp.int32)
    from s3req import sr_codes

    q = jax.vmap(lambda ti: sr_codes(y, ti, 7))(t).astype(jnp.float32)
    bias = jnp.mean(q, axis=0) - y
    assert float(jnp.max(jnp.abs(bias))) <= 1 / 256 + 1e-6
    # and the bound is attained (it is the true worst case, not a loose one)
    assert float(jnp.max(jnp.abs(bias))) > 0.9 / 256
    # codes are floor(y) or floor(y) + 1 only
    fl = jnp.floor(y)[None]
    assert jnp.all((q == fl) | (q == fl + 1))


def _exact_error_covariance(p):
    """Exact covariance of SR errors of residuals p under one shared 7-bit threshold."""
    from s3req import sr_codes

    t = jnp.arange(128, dtype=jnp.int32)
    e = jax.vmap(lambda ti: sr_codes(p, ti, 7).astype(jnp.float32) - p)(t)
    e = e - jnp.mean(e, axis=0, keepdims=True)
    return e.T @ e / 128


def test_shared_threshold_covariance_exact():
    """Lemma 2: evenly spread residuals, one shared threshold: var ~ 1/6, cov ~ 1/12 (steps^2)."""
    n = 64
    p = (jnp.arange(n, dtype=jnp.float32) + 0.5) / n
    c = _exact_error_covariance(p)
    var = jnp.mean(jnp.diag(c))
    cov = (jnp.sum(c) - jnp.sum(jnp.diag(c))) / (n * (n - 1))
    # The 7-bit grid moves each moment by at most 1/128; the mean over p of p(1-p) for this
    # grid of p is 1/6 - 1/(12 n^2) and of min - product is 1/12 + O(1/n).
    assert abs(float(var) - 1 / 6) < 1 / 128
    assert abs(float(cov) - 1 / 12) < 1 / 128 + 1 / n
    # Every pair's covariance is min(p_i, p_j) - p_i p_j (to the grid)
    ref = jnp.minimum(p[:, None], p[None, :]) - p[:, None] * p[None, :]
    assert float(jnp.max(jnp.abs(c - ref))) < 2 / 128


@pytest.mark.parametrize("topology", [Phi2D(), Independent()], ids=["Phi2D", "Independent"])
def test_covariance_sampled(topology, getkey):
    """Through the engine's own thresholds: shared per-token thresholds correlate the channels
    of a token (~1/12 step^2), independent ones do not (~0). Tolerance: 5 standard errors of
    the mean pair covariance, estimated from 20 batches of keys."""
    D, n_keys, n_batches = 32, 4000, 20
    p = (jnp.arange(D, dtype=jnp.float32) + 0.5) / D
    y = (3.0 + p)[None, None, :]  # one token, residuals evenly spread
    policy = Policy(topology)
    keys = jr.split(getkey(), n_keys)
    q = jax.vmap(lambda k: quantize_gradient(policy, y, k, Block.whole((1, 1, D)))[0])(keys)
    e = q[:, 0, 0, :].astype(jnp.float32) - y[0]

    def mean_pair_cov(eb):
        eb = eb - jnp.mean(eb, 0, keepdims=True)
        c = eb.T @ eb / (eb.shape[0] - 1)
        return (jnp.sum(c) - jnp.trace(c)) / (D * (D - 1)), jnp.trace(c) / D

    covs, vars_ = jax.vmap(mean_pair_cov)(e.reshape(n_batches, -1, D))
    cov, se = jnp.mean(covs), jnp.std(covs) / np.sqrt(n_batches)
    expected = 1 / 12 if isinstance(topology, Phi2D) else 0.0
    assert abs(float(cov) - expected) < 5 * float(se) + 1 / 128, (cov, se)
    assert abs(float(jnp.mean(vars_)) - 1 / 6) < 0.01


@pytest.mark.parametrize("topology", [Phi2D(), PhiBcast(), Independent(shared=True)])
@pytest.mark.parametrize("correction", [DxOnlyEC(), TwoWayEC()])
def test_error_correction_is_the_projection(topology, correction, getkey):
    """qdot's corrected gradients equal the GEMMs of (Q - P), and E - P has zero row sums
    (both corrections) and zero column sums per example (two-way)."""
    B, S, H, D = 3, 8, 16, 24
    x = jr.normal(getkey(), (B, S, H))
    w = jr.normal(getkey(), (H, D))
    g = jr.normal(getkey(), (B, S, D))
    key = getkey()
    policy = Policy(topology, correction)
    dx, dw = _grads(policy, x, w, g, key)

    sx, sw = absmax_scale(x, -1), absmax_scale(w, 0)
    xq, wq = round_to_int8(x, sx), round_to_int8(w, sw)
    gp = sx * g * sw[None]
    delta, inv = gradient_step(gp)
    y = jnp.clip(gp * inv, -127, 127)
    q, _ = quantize_gradient(policy, y, key, Block.whole((B, S, D)))
    eps, a, m = error_stats(q, y)
    e = q.astype(jnp.float32) - y
    two_way = isinstance(correction, TwoWayEC)
    P = eps[..., None] + ((a - m[:, None])[:, None, :] if two_way else 0.0)
    r = e - P
    assert float(jnp.max(jnp.abs(jnp.sum(r, axis=2)))) < 1e-4  # every token
    if two_way:
        assert float(jnp.max(jnp.abs(jnp.sum(r, axis=1)))) < 1e-4  # every channel
    qc = q.astype(jnp.float32) - P
    dx_ref = delta * (qc @ wq.T.astype(jnp.float32)) / sx
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(dx))))
    qw = qc if two_way else q.astype(jnp.float32)
    dw_ref = delta * jnp.einsum("bsh,bsd->hd", xq.astype(jnp.float32), qw) / sw
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(dw))))


@pytest.mark.parametrize("kernels", ["reference", "cpu", "tpu", "cuda"])
@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_jaxpr_int8_gemms(policy, kernels):
    """The three GEMMs take int8 operands into int32; the gradient is quantized once (both
    backward GEMMs read the same int8 tensor, seen through the `optimization_barrier`s of the
    TPU and CUDA kernels) except for Independent(shared=False); the error correction adds only
    small products (int8 digits of the ones row and the channel means against Wq, of the token
    means against Xq; the codes against a few selector columns; rank-B updates), never a third
    full GEMM. On every path."""
    B, S, H, D = 2, 64, 64, 32
    x = jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((H, D), jnp.float32)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    def f(x, w, k):
        return jnp.sum(qdot(x, w, policy=policy, key=k).astype(jnp.float32))

    def flops(e):
        (contract, _), _ = e.params["dimension_numbers"]
        shape = e.invars[0].aval.shape
        return np.prod(e.outvars[0].aval.shape) * np.prod([shape[i] for i in contract])

    grad = with_kernels(kernels, jax.grad(f, argnums=(0, 1)))
    eqns = dot_eqns(grad, x, w, key)
    barriers = [
        e
        for e in iter_eqns(jax.make_jaxpr(grad)(x, w, key).jaxpr)
        if e.primitive.name == "optimization_barrier"
    ]
    behind = {o: i for e in barriers for i, o in zip(e.invars, e.outvars)}

    def source(v):  # the array a barrier's output passes through
        while v in behind:
            v = behind[v]
        return v

    # the GEMMs (with EC, Xq carries B one-hot columns and zero padding in the dW GEMM)
    gemms = [e for e in eqns if flops(e) >= B * S * H * D]
    assert len(gemms) == 3
    for e in gemms:
        assert [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]  # pyright: ignore
        assert e.outvars[0].aval.dtype == jnp.int32  # pyright: ignore
        assert e.params["preferred_element_type"] == jnp.int32
    # a few int8 digit rows per example (against Wq) or per token row (against Xq), and the
    # codes against SUM_ALIGN ones-and-zeros columns (their sums over a token or channel axis)
    small = max(DIGITS * H * max((1 + B) * D, B * S), B * S * max(H, D) * SUM_ALIGN)
    assert small <= B * S * H * D / 4
    for e in eqns:
        if e not in gemms:
            assert flops(e) <= small, e
    if isinstance(policy.correction, NoEC):
        assert len(eqns) == 3
    fwd, bdx, bdw = gemms
    g_dx = source(bdx.invars[0])  # Q in Q @ Wq^T
    g_dw = source(bdw.invars[1])  # Q in Xq^T @ Q
    twice = isinstance(policy.topology, Independent) and not policy.topology.shared
    assert (g_dx is g_dw) != twice


@pytest.mark.parametrize("policy", [Policy(Nearest()), Policy(Phi2D(), TwoWayEC())], ids=policy_id)
def test_projections_of_one_x_quantize_it_once(policy, getkey):
    """Three projections of one `x` (an attention block's q, k and v) share its int8 codes: the
    compiled step rounds `x` once, where a check per call would make XLA round it once per
    projection."""
    x = jr.normal(getkey(), (2, 48, 40))
    ws = [jr.normal(getkey(), (40, 24)) for _ in range(3)]

    def loss(x, ws, key):
        ys = [qdot(x, w, policy=policy, key=k) for w, k in zip(ws, jr.split(key, 3))]
        return jnp.sum(ys[0] * ys[1] * ys[2])

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    assert len(quantizations(step.lower(x, ws, getkey()).compile(), x.size)) == 1


def test_keys(getkey):
    x = jr.normal(getkey(), (2, 8, 16))
    w = jr.normal(getkey(), (16, 32))
    g = jr.normal(getkey(), (2, 8, 32))
    policy = Policy(Phi2D())
    with pytest.raises(ValueError, match="key"):
        qdot(x, w, policy=policy)
    k = getkey()
    a = _grads(policy, x, w, g, k)
    b = _grads(policy, x, w, g, k)
    c = _grads(policy, x, w, g, getkey())
    assert all(jnp.array_equal(u, v) for u, v in zip(a, b))
    assert not jnp.array_equal(a[0], c[0])
    # deterministic policy needs no key
    qdot(x, w, policy=Policy(Nearest()))


def test_bad_input(getkey):
    x = jr.normal(getkey(), (2, 8, 16))
    w = jr.normal(getkey(), (16, 32))
    p = Policy(Phi2D())
    k = getkey()
    with pytest.raises((ValueError, TypeError)):
        qdot(x[None], w, policy=p, key=k)  # rank 4
    with pytest.raises((ValueError, TypeError)):
        qdot(x, w[:8], policy=p, key=k)  # d_in mismatch
    with pytest.raises(TypeError):
        qdot(x.astype(jnp.int32), w, policy=p, key=k)
    with pytest.raises((ValueError, TypeError)):
        qdot(x, w[None], policy=p, key=k)
    with pytest.raises((ValueError, TypeError)):
        qdot(x[:, :0], w, policy=p, key=k)  # zero tokens
    f = eqx.filter_jit(lambda x, w, g: _grads(p, x, w, g, k))
    g = jr.normal(getkey(), (2, 8, 32))
    with pytest.raises(RuntimeError, match="x contains NaN"):
        f(x.at[0, 1, 2].set(jnp.nan), w, g)
    with pytest.raises(RuntimeError, match="w contains NaN"):
        f(x, w.at[0, 1].set(jnp.inf), g)
    with pytest.raises(RuntimeError, match="upstream gradient contains NaN"):
        f(x, w, g.at[1, 1, 1].set(jnp.nan))


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_zero_gradient_and_zero_tokens(policy, getkey):
    x = jr.normal(getkey(), (2, 8, 16)).at[0, 3].set(0.0)
    w = jr.normal(getkey(), (16, 32))
    dx, dw = _grads(policy, x, w, jnp.zeros((2, 8, 32)), getkey())
    assert jnp.all(dx == 0) and jnp.all(dw == 0)
    # An all-zero token: scale 1, finite gradients, and with an exactly representable G the
    # exact dX (G W^T) for that token.
    xe, we, ge = exact_problem(getkey())
    xe = xe.at[1, 2].set(0.0)
    ge = ge * jnp.where(jnp.arange(8)[None, :, None] == 2, 1.0, 0.0)  # only the zero token
    ge = ge.at[0].set(0.0)
    dx, dw = _grads(policy, xe, we, ge, getkey())
    assert jnp.all(jnp.isfinite(dx)) and jnp.all(jnp.isfinite(dw))
    np.testing.assert_allclose(dx[1, 2], ge[1, 2] @ we.T, rtol=1e-6)
    assert jnp.all(dw == 0)


@pytest.mark.parametrize(
    "shape",
    [(3, 40, 300), (1, 4096, 5), (1, 7, 9), (2, 5, DOT_SUM_MAX + 8), (1, DOT_SUM_MAX + 8, 3)],
)
def test_sums_of_gp(shape, getkey):
    """The sums of G' for the error means (mat-vecs up to DOT_SUM_MAX terms, reductions past
    it; one example of an even number of tokens as two halves) are float32 sums of the right
    terms: within the sequential-summation bound `n * 2**-24 * sum|g|` of the float64 sums,
    along the tokens and along the channels."""
    g = jr.normal(getkey(), shape) * jnp.exp(jr.normal(getkey(), shape))
    g64 = np.asarray(g, np.float64)
    for axis in (1, 2):
        got = np.asarray(float_sums(g, axis), np.float64)
        assert got.shape == tuple(int(n) for n in np.delete(shape, axis))
        bound = shape[axis] * 2.0**-24 * np.abs(g64).sum(axis=axis)
        assert np.all(np.abs(got - g64.sum(axis=axis)) <= bound)


@pytest.mark.parametrize(
    "shape, corrections",
    [
        ((4, 64, 256, 1024), (DxOnlyEC(), TwoWayEC())),
        ((4, 128, 256, 2048), (DxOnlyEC(), TwoWayEC())),
        ((1, 1024, 512, 1024), (DxOnlyEC(), TwoWayEC())),
    ],
)
def test_ec_temporary_memory(shape, corrections):
    """S3R-EC adds no float32 copy of G' to the temporaries of a forward + backward (XLA's
    compile-time estimate on this backend): its sums of G' run before the backward GEMMs, so
    G' is freed as in S3R. (When they were reductions fused after the GEMMs, two-way EC held
    G' across them: 8.7 MiB of temporaries against S3R's 4.6 MiB at (4, 128, 256, 2048); with
    one example XLA wrote G' twice, 8.0 against 5.0 MiB for dX-only at (1, 1024, 512, 1024);
    while the token sums of Xq were a reduction, XLA fused them into the dW rescaling of
    two-way EC with one example, which then took 7.6 MiB there.)"""
    B, S, H, D = shape
    args = (
        jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((H, D), jnp.float32),
        jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jr.key(0).dtype),
    )

    def temp(policy):
        def f(x, w, g, key):
            y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
            return y, vjp(g)

        stats = jax.jit(f).lower(*args).compile().memory_analysis()
        assert stats is not None
        return stats.temp_size_in_bytes

    base = temp(Policy(Phi2D()))
    gp_bytes = B * S * D * 4
    for correction in corrections:
        assert temp(Policy(Phi2D(), correction)) - base < gp_bytes / 2, correction


def test_code_sums(getkey):
    """The sums of int8 codes (thin int8 GEMMs) are exact over either axis, for every batch
    size; more terms than int32 holds is a clear error, raised while tracing."""
    for shape in ((1, 300, 40), (3, 17, 9)):
        q = jr.randint(getkey(), shape, -127, 128).astype(jnp.int8)
        q64 = np.asarray(q, np.int64)
        for axis in (1, 2):
            got = code_sums(q, axis)
            assert got.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(got), q64.sum(axis=axis))
    too_many = jax.ShapeDtypeStruct((1, 2**31 // QMAX + 1, 1), jnp.int8)
    with pytest.raises(ValueError, match="overflow int32"):
        jax.eval_shape(lambda q: code_sums(q, 1), too_many)


def test_int32_overflow_chunked(getkey):
    """A dW contraction over more than 133k tokens of +-127 codes is still exact."""
    n = MAX_TERMS + 20_000
    assert n > 133_000
    xq = jnp.full((1, n, 2), 127, jnp.int8).at[0, :5000, 1].set(-127)
    q = jnp.full((1, n, 3), 127, jnp.int8).at[0, 7:1000, 2].set(-3)
    got = _token_contraction(xq, q)
    ref = np.einsum("bsh,bsd->hd", np.asarray(xq, np.int64), np.asarray(q, np.int64)).astype(
        np.float32
    )
    assert np.abs(ref).max() > 2**31  # an int32 accumulator would have overflowed
    np.testing.assert_array_equal(np.asarray(got), ref)
    # and through qdot: constant inputs give the float result
    x = jnp.ones((1, n, 2))
    w = jnp.ones((2, 3))
    for policy in (Policy(Phi2D()), Policy(Phi2D(), TwoWayEC())):  # EC: int32 token sums
        _, dw = _grads(policy, x, w, jnp.ones((1, n, 3)), getkey())
        np.testing.assert_allclose(dw, jnp.full((2, 3), float(n)), rtol=1e-6)


def test_digits_dot_precision(getkey):
    """The EC products with Wq and Xq run on int8 digits of the float factor: the result is
    within 2**-21 of each row's largest entry times sum|m| of the float64 product, a row of
    ones is exact, and past the int32 bound the float fallback gives the same product."""
    r, D, H = 5, 300, 7
    # rows over a wide dynamic range, one all-zero row
    a = jr.normal(getkey(), (r, D)) * 10.0 ** jr.randint(getkey(), (r, 1), -6, 4).astype(
        jnp.float32
    )
    a = jnp.concatenate([a, jnp.zeros((1, D)), jnp.ones((1, D))])
    m = jr.randint(getkey(), (H, D), -127, 128).astype(jnp.int8)
    got = np.asarray(digits_dot(a, m, (1,)), np.float64)
    a64, m64 = np.asarray(a, np.float64), np.asarray(m, np.float64)
    want = a64 @ m64.T
    bound = 2.0**-21 * np.abs(a64).max(axis=1, keepdims=True) * np.abs(m64).sum(axis=1)
    bound += 2.0**-23 * np.abs(a64) @ np.abs(m64).T  # the float32 sum of three digit products
    assert np.all(np.abs(got - want) <= bound)
    np.testing.assert_array_equal(got[-2], 0.0)
    np.testing.assert_array_equal(got[-1], m64.sum(axis=1))  # Wq 1_D, exact
    # a contraction over tokens (Xq^T eps), and the float fallback past 2**31 / (64 * 127)
    for n in (1000, 2**31 // (64 * 127) + 1):
        eps = jr.normal(getkey(), (1, 1, n))
        xq = jnp.broadcast_to(jnp.arange(-2, 2, dtype=jnp.int8), (1, n, 4))
        got = np.asarray(digits_dot(eps, xq, (0, 1)), np.float64)
        want = np.einsum("bs,bsh->h", np.asarray(eps[0], np.float64), np.asarray(xq, np.float64))
        bound = 2.0**-20 * np.abs(np.asarray(eps)).sum() * 2
        assert np.all(np.abs(got[0] - want) <= bound), (n, got, want)


@pytest.mark.parametrize("policy", [Policy(Nearest()), Policy(Phi2D(), TwoWayEC())], ids=policy_id)
def test_a_gradient_not_asked_for_is_not_computed(policy, getkey):
    """Differentiating x alone (frozen weights) or w alone gives the gradient that
    differentiating both gives, and traces no GEMM for the other one: the VJP is told which
    inputs are differentiated (`symbolic_zeros`). (On TPU two-way EC hands dX on only once
    dW exists, `_kernels_tpu.together`, so XLA would not drop an unused dW there.)"""
    x, w, key = jr.normal(getkey(), (2, 8, 16)), jr.normal(getkey(), (16, 32)), getkey()
    loss = lambda x, w: jnp.sum(jnp.tanh(qdot(x, w, policy=policy, key=key)))
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(jax.grad(loss, argnums=0)(x, w), dx)
    np.testing.assert_array_equal(jax.grad(loss, argnums=1)(x, w), dw)

    def products(argnums) -> set:
        eqns = dot_eqns(jax.grad(loss, argnums), x, w)
        return {tuple(v.aval.shape) for e in eqns for v in e.outvars}  # pyright: ignore

    assert {(2, 8, 16), (16, 32)} <= products((0, 1))
    assert (16, 32) not in products(0) and (2, 8, 16) not in products(1)


# float32 activations run with -m slow (24 s here); bfloat16 runs the same transforms.
@pytest.mark.parametrize(
    "dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16]
)
def test_transforms(dtype, getkey):
    policy = Policy(Phi2D(), TwoWayEC())
    x = jr.normal(getkey(), (2, 8, 16), dtype)
    w = jr.normal(getkey(), (16, 32))
    key = getkey()

    def loss(x, w, key):
        return jnp.sum(jnp.tanh(qdot(x, w, policy=policy, key=key).astype(jnp.float32)))

    ref = jax.grad(loss, argnums=(0, 1))(x, w, key)
    assert ref[0].dtype == dtype and ref[1].dtype == jnp.float32
    for out in (
        jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, key),
        eqx.filter_jit(eqx.filter_grad(lambda xw, k: loss(xw[0], xw[1], k)))((x, w), key),
        jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, w, key),
    ):
        for a, b in zip(out, ref):
            np.testing.assert_allclose(
                np.asarray(a, np.float32),
                np.asarray(b, np.float32),
                rtol=2e-2,
                atol=1e-3,
            )
    # vmap over examples with one key each
    keys = jr.split(key, 2)
    vg = jax.vmap(lambda xi, k: jax.grad(loss)(xi, w, k))(x, keys)
    assert vg.shape == x.shape and jnp.all(jnp.isfinite(vg.astype(jnp.float32)))


def test_bf16_gradient_quantized_in_f32(getkey):
    """bf16 upstream gradients are scaled and rounded in float32: same codes as f32 input."""
    policy = Policy(Phi2D())
    x = jr.normal(getkey(), (2, 8, 16)).astype(jnp.bfloat16).astype(jnp.float32)
    w = jr.normal(getkey(), (16, 32))
    g = jr.normal(getkey(), (2, 8, 32)).astype(jnp.bfloat16)
    k = getkey()
    _, vjp32 = jax.vjp(lambda w: qdot(x, w, policy=policy, key=k), w)
    _, vjp16 = jax.vjp(lambda w: qdot(x.astype(jnp.bfloat16), w, policy=policy, key=k), w)
    np.testing.assert_array_equal(vjp32(g.astype(jnp.float32))[0], vjp16(g)[0])
