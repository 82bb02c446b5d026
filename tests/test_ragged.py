"""The quantized ragged (expert) matmul: dense equivalence, EC segments, unbiasedness, jaxpr."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import s3req._backward as backward
from policies import DxOnlyEC, Nearest, NoEC, Phi2D, PhiBcast, Policy, TwoWayEC
from s3req import absmax_scale, MAX_TERMS, qdot, qragged_dot, round_to_int8
from s3req._kernels_tpu import EPS_DIGITS

from .helpers import ALL_POLICIES, iter_eqns, policy_id, quantizations, STOCHASTIC_POLICIES


def _problem(key, n_examples=3, seq=8, top_k=2, E=4, H=16, D=12):
    """Expert-sorted rows of a random routing, with their global ids."""
    kr, kx, kw, kg = jr.split(key, 4)
    T = n_examples * seq
    experts = jnp.stack(
        [jr.permutation(k, E)[:top_k] for k in jr.split(kr, T)]
    )  # (T, k), distinct
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    token = order // top_k
    n = T * top_k
    x = jr.normal(kx, (n, H))
    w = jr.normal(kw, (E, H, D))
    g = jr.normal(kg, (n, D))
    ids: dict[str, Any] = dict(row_id=order, example_id=token // seq, num_examples=n_examples)
    return x, w, gs, g, ids


def _vjp(policy, x, w, gs, g, key, ids):
    """Value, dX and dW of `qragged_dot`, as one compiled program (eager JAX compiles every
    operation on its own, which is slow)."""
    n = ids.get("num_examples")
    arrays = {k: v for k, v in ids.items() if k != "num_examples"}

    @jax.jit
    def run(x, w, gs, g, key, arrays):
        f = lambda x, w: qragged_dot(x, w, gs, policy=policy, key=key, num_examples=n, **arrays)
        y, pull = jax.vjp(f, x, w)
        return (y, *pull(g))

    return run(x, w, gs, g, key, arrays)


@pytest.mark.parametrize("policy", [Policy(Nearest()), Policy(Phi2D(), TwoWayEC())], ids=policy_id)
def test_a_gradient_not_asked_for_is_the_same(policy, getkey):
    """Differentiating the rows alone (frozen experts) or the experts alone gives the
    gradient that differentiating both gives (the VJP computes only what is asked for)."""
    x, w, gs, _, ids = _problem(getkey())
    key = getkey()
    f = lambda x, w: qragged_dot(x, w, gs, policy=policy, key=key, **ids)
    loss = lambda x, w: jnp.sum(jnp.tanh(f(x, w)))
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(jax.grad(loss, argnums=0)(x, w), dx)
    np.testing.assert_array_equal(jax.grad(loss, argnums=1)(x, w), dw)


def test_float_path_is_ragged_dot(getkey):
    x, w, gs, _, _ = _problem(getkey())
    y = jax.jit(lambda x, w, gs: qragged_dot(x, w, gs, policy=None))(x, w, gs)
    ends = np.cumsum(np.asarray(gs))
    for e, (a, b) in enumerate(zip(ends - np.asarray(gs), ends)):
        np.testing.assert_allclose(y[a:b], x[a:b] @ w[e], rtol=1e-5, atol=1e-5)


def test_forward_equals_per_expert_qdot(getkey):
    """Per-row and per-expert per-channel scales: each group is one dense qdot forward."""
    x, w, gs, _, _ = _problem(getkey())
    y = jax.jit(lambda x, w, gs: qragged_dot(x, w, gs, policy=Policy(Nearest())))(x, w, gs)
    ends = np.cumsum(np.asarray(gs))
    dense = jax.jit(lambda x, w: qdot(x, w, policy=Policy(Nearest())))
    for e, (a, b) in enumerate(zip(ends - np.asarray(gs), ends)):
        want = dense(x[a:b], w[e])
        np.testing.assert_array_equal(np.asarray(y[a:b]), np.asarray(want))


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_single_expert_equals_qdot(policy, getkey):
    """One expert, rows in token order, row id = token index, example id = batch index: the
    ragged layout is the dense one, so values, thresholds, gradients and EC all coincide."""
    B, S, H, D = 3, 8, 16, 12
    x, w, g = (
        jr.normal(getkey(), (B, S, H)),
        jr.normal(getkey(), (H, D)),
        jr.normal(getkey(), (B, S, D)),
    )
    key = getkey()

    @jax.jit
    def dense(x, w, g, key):
        y, pull = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
        return (y, *pull(g))

    y, dx, dw = dense(x, w, g, key)
    n = B * S
    ids: dict[str, Any] = dict(
        row_id=jnp.arange(n, dtype=jnp.int32),
        example_id=jnp.arange(n, dtype=jnp.int32) // S,
        num_examples=B,
    )
    gs = jnp.array([n], jnp.int32)
    ry, rdx, rdw = _vjp(policy, x.reshape(n, H), w[None], gs, g.reshape(n, D), key, ids)
    np.testing.assert_array_equal(np.asarray(ry), np.asarray(y.reshape(n, D)))
    np.testing.assert_allclose(rdx, dx.reshape(n, H), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rdw[0], dw, rtol=1e-5, atol=1e-4)


def _codes_problem(key, E=3, B=2, seq=6, top_k=2, D=8):
    """Identity expert weights (H = D): dX = delta / s_x * 127 * codes reveals the codes."""
    x, _, gs, g, ids = _problem(key, n_examples=B, seq=seq, top_k=top_k, E=E, H=D, D=D)
    w = jnp.broadcast_to(jnp.eye(D), (E, D, D))
    return x, w, gs, g, ids


@pytest.mark.parametrize("topology", [Phi2D(), PhiBcast()], ids=["phi2d", "bcast"])
@pytest.mark.parametrize("correction", [DxOnlyEC(), TwoWayEC()], ids=["dx", "2way"])
def test_error_correction_over_example_expert_segments(topology, correction, getkey):
    """The corrected gradients equal the dense EC maths with "example" replaced by
    "(example, expert) segment", recomputed here in NumPy from the uncorrected codes."""
    x, w, gs, g, ids = _codes_problem(getkey())
    key = getkey()
    _, dx0, _ = _vjp(Policy(topology, NoEC()), x, w, gs, g, key, ids)
    _, dx1, dw1 = _vjp(Policy(topology, correction), x, w, gs, g, key, ids)
    E, D = w.shape[0], w.shape[2]
    sx = np.asarray(absmax_scale(x, axis=-1), np.float64)  # (n, 1)
    expert = np.repeat(np.arange(E), np.asarray(gs))
    sw = np.full((E, D), 1 / 127)
    gp = sx * np.asarray(g, np.float64) * sw[expert]
    delta = np.abs(gp).max() / 127
    y = gp / delta
    q = np.round(np.asarray(dx0, np.float64) * sx / (127 * delta))  # the codes
    assert np.all(np.abs(q - y) < 1)
    e = q - y
    seg = np.asarray(ids["example_id"]) * E + expert
    P = np.zeros_like(e)
    eps = e.mean(axis=1)
    for s in np.unique(seg):
        rows = seg == s
        a = e[rows].mean(axis=0)
        m = e[rows].mean()
        P[rows] = a[None, :] + eps[rows, None] - m
    wq = 127 * np.eye(D)
    if isinstance(correction, DxOnlyEC):
        want_dx = delta / sx * (q @ wq - eps[:, None] * wq.sum(axis=1)[None, :])
        np.testing.assert_allclose(dx1, want_dx, rtol=1e-4, atol=1e-4 * np.abs(want_dx).max())
        return
    want_dx = delta / sx * ((q - P) @ wq)
    np.testing.assert_allclose(dx1, want_dx, rtol=1e-4, atol=1e-4 * np.abs(want_dx).max())
    xq = np.asarray(round_to_int8(x, absmax_scale(x, axis=-1)), np.float64)
    for k in range(E):
        rows = expert == k
        want_dw = delta * xq[rows].T @ (q - P)[rows] / sw[k][None, :]
        np.testing.assert_allclose(dw1[k], want_dw, rtol=1e-4, atol=1e-4 * np.abs(want_dw).max())


@pytest.mark.parametrize("policy", STOCHASTIC_POLICIES, ids=policy_id)
def test_unbiased(policy, getkey):
    """Mean over 500 keys vs the exact gradient of the dequantized operands (5 sigma from the
    measured variance, plus the bound 4/256 step per element on the 7-bit threshold bias)."""
    x, w, gs, g, ids = _problem(getkey(), n_examples=2, seq=4, E=3, H=8, D=12)
    keys = jr.split(getkey(), 500)
    grads = jax.jit(lambda ks: jax.lax.map(lambda k: _vjp(policy, x, w, gs, g, k, ids)[1:], ks))(
        keys
    )
    sx = absmax_scale(x, axis=-1)
    sw = absmax_scale(w, axis=1)
    xq = np.asarray(round_to_int8(x, sx), np.float64)
    xhat = xq * np.asarray(sx, np.float64)
    wq = np.asarray(round_to_int8(w, sw), np.float64)
    what = wq * np.asarray(sw, np.float64)
    expert = np.repeat(np.arange(w.shape[0]), np.asarray(gs))
    g64 = np.asarray(g, np.float64)
    exact_dx = np.einsum("nd,nhd->nh", g64, what[expert])
    exact_dw = np.stack([xhat[expert == e].T @ g64[expert == e] for e in range(w.shape[0])])
    gp = np.asarray(sx, np.float64) * g64 * np.asarray(sw, np.float64)[expert, 0]
    delta = np.abs(gp).max() / 127
    bias_dx = 4 / 256 * delta / np.asarray(sx, np.float64) * np.abs(wq).sum(axis=2)[expert]
    bias_dw = np.stack(
        [
            4
            / 256
            * delta
            * np.abs(xq[expert == e]).sum(0)[:, None]
            / np.asarray(sw, np.float64)[e]
            for e in range(w.shape[0])
        ]
    )
    for got, exact, bias in ((grads[0], exact_dx, bias_dx), (grads[1], exact_dw, bias_dw)):
        got = np.asarray(got, np.float64)
        sem = got.std(axis=0) / np.sqrt(got.shape[0])
        err = np.abs(got.mean(axis=0) - exact)
        assert np.all(err <= 5 * sem + bias + 1e-6), (err - 5 * sem - bias).max()


def test_thresholds_follow_row_ids_not_positions(getkey):
    """Shuffling the rows inside each expert group (ids travel with them) permutes dX and
    leaves dW unchanged: thresholds depend on the global (token, slot) id only."""
    policy = Policy(Phi2D())
    x, w, gs, g, ids = _problem(getkey())
    key = getkey()
    _, dx, dw = _vjp(policy, x, w, gs, g, key, ids)
    ends = np.cumsum(np.asarray(gs))
    perm = np.concatenate(
        [
            a + np.random.default_rng(e).permutation(b - a)
            for e, (a, b) in enumerate(zip(ends - np.asarray(gs), ends))
        ]
    )
    ids2: dict[str, Any] = dict(
        ids, row_id=ids["row_id"][perm], example_id=ids["example_id"][perm]
    )
    _, dx2, dw2 = _vjp(policy, x[perm], w, gs, g[perm], key, ids2)
    np.testing.assert_array_equal(np.asarray(dx2), np.asarray(dx)[perm])
    np.testing.assert_allclose(dw2, dw, rtol=1e-6)
    # ... while the same rows with other ids round differently.
    ids3 = dict(ids, row_id=ids["row_id"] + 1000)
    _, dx3, _ = _vjp(policy, x, w, gs, g, key, ids3)
    assert not np.array_equal(np.asarray(dx3), np.asarray(dx))


@pytest.mark.parametrize("kernels", ["reference", "tpu"])
@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_jaxpr_int8_ragged_gemms(policy, kernels, monkeypatch):
    """The three ragged GEMMs of forward + backward take int8 operands and accumulate in
    int32, and (policies that quantize once) one int8 gradient feeds both backward GEMMs.
    The reference's error correction adds no ragged contraction (its segment sums are
    `segment_sum`s); the TPU kernel's only thin ones over the rows (against the one-hot of
    the examples, in three bfloat16 pieces for a bfloat16 gradient, or the digits of the
    token means) and one float32 product of rows with every expert's terms: `(n, 1 + B)`
    with `(1 + B, h)` for two-way EC (both dX terms), `(n, 1)` with `(1, h)` for dX-only EC
    (its token term); and no scatter-add of a full-size array (on TPU a scatter writes its
    operand to memory)."""
    monkeypatch.setattr(backward, "KERNELS", kernels)
    n, E, H, D, B = 24, 3, 16, 12, 2
    sds = jax.ShapeDtypeStruct
    args = (sds((n, H), jnp.float32), sds((E, H, D), jnp.float32), sds((n, D), jnp.float32))
    gs = jnp.array([8, 10, 6], jnp.int32)
    ids: dict[str, Any] = dict(
        row_id=jnp.arange(n), example_id=jnp.arange(n) // 12, num_examples=B
    )

    def f(x, w, g):
        y, pull = jax.vjp(
            lambda x, w: qragged_dot(x, w, gs, policy=policy, key=jr.key(0), **ids), x, w
        )
        return pull(g)

    all_eqns = list(iter_eqns(jax.make_jaxpr(f)(*args).jaxpr))
    eqns = [e for e in all_eqns if e.primitive.name == "ragged_dot_general"]
    shape = lambda v: v.aval.shape  # pyright: ignore
    layer = {(n, D): "forward", (n, H): "dx", (E, H, D): "dw"}
    gemms = {
        layer[shape(e.outvars[0])]: e
        for e in eqns
        if shape(e.outvars[0]) in layer and e.invars[0].aval.dtype == jnp.int8  # pyright: ignore
    }
    assert sorted(gemms) == ["dw", "dx", "forward"]
    for e in gemms.values():
        assert [v.aval.dtype for v in e.invars[:2]] == [jnp.int8, jnp.int8]  # pyright: ignore
        assert e.params["preferred_element_type"] == jnp.int32
        assert e.outvars[0].aval.dtype == jnp.int32  # pyright: ignore
    if policy.topology.quantizes_once():
        assert gemms["dx"].invars[0] is gemms["dw"].invars[1]  # one int8 gradient for both
    statistics = [e for e in eqns if e not in gemms.values()]
    if isinstance(policy.correction, NoEC) or kernels == "reference":
        assert statistics == []
        return
    structured = [
        e for e in statistics if e.params["ragged_dot_dimension_numbers"].rhs_group_dimensions
    ]
    if isinstance(policy.correction, (TwoWayEC, DxOnlyEC)):
        (e,) = structured  # the dX terms in one product
        k = 1 + B if isinstance(policy.correction, TwoWayEC) else 1
        assert [shape(v) for v in e.invars[:2]] == [(n, k), (E, k, H)]
        assert [v.aval.dtype for v in e.invars[:2]] == [jnp.float32] * 2  # pyright: ignore
    else:
        assert structured == []
    for e in statistics:
        if e in structured:
            continue
        dn = e.params["ragged_dot_dimension_numbers"]
        assert list(dn.lhs_ragged_dimensions) == [0] and not dn.rhs_group_dimensions
        thin = max(3 * B, EPS_DIGITS)  # the example one-hot (pieces), or the token means' digits
        assert min(shape(v)[1] if len(shape(v)) == 2 else 1 for v in e.invars[:2]) <= thin
    for e in all_eqns:
        if e.primitive.name.startswith("scatter"):
            assert len(shape(e.invars[0])) <= 1  # e.g. the row counts of jnp.repeat


@pytest.mark.parametrize("policy", [Policy(Nearest()), Policy(Phi2D(), TwoWayEC())], ids=policy_id)
def test_expert_gemms_of_one_x_quantize_it_once(policy, getkey):
    """Two expert GEMMs of one `x` (an MoE's gate and up projections) share its int8 codes: the
    compiled step rounds `x` once, where a check per call would make XLA round it once per
    GEMM."""
    x, w, gs, g, ids = _problem(getkey(), seq=40, H=24)
    w2 = jr.normal(getkey(), w.shape)

    def loss(x, w, w2, key):
        k1, k2 = jr.split(key)
        y1 = qragged_dot(x, w, gs, policy=policy, key=k1, **ids)
        y2 = qragged_dot(x, w2, gs, policy=policy, key=k2, **ids)
        return jnp.sum(y1 * y2 * g)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert len(quantizations(step.lower(x, w, w2, getkey()).compile(), x.size)) == 1


def test_dw_contraction_past_int32_range():
    """More rows in one group than an int32 accumulator of 127*127 products can hold."""
    n = MAX_TERMS + 5000
    x = jnp.ones((n, 2))
    w = jnp.ones((2, 2, 2))
    gs = jnp.array([n - 3, 3], jnp.int32)
    g = jnp.ones((n, 2))
    _, _, dw = _vjp(Policy(Nearest()), x, w, gs, g, None, {})
    np.testing.assert_allclose(np.asarray(dw[0]), np.full((2, 2), n - 3.0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dw[1]), np.full((2, 2), 3.0), rtol=1e-6)


def test_bad_input(getkey):
    x, w, gs, g, ids = _problem(getkey())
    p = Policy(Phi2D(), TwoWayEC())
    with pytest.raises((ValueError, TypeError)):
        qragged_dot(x[None], w, gs, policy=p, key=getkey(), **ids)
    with pytest.raises((ValueError, TypeError)):
        qragged_dot(x, w[0], gs, policy=p, key=getkey(), **ids)
    with pytest.raises((ValueError, TypeError)):
        qragged_dot(x, w, gs[:-1], policy=p, key=getkey(), **ids)
    with pytest.raises((ValueError, TypeError)):
        qragged_dot(x[:, :-1], w, gs, policy=p, key=getkey(), **ids)
    empty = {k: v[:0] if k != "num_examples" else v for k, v in ids.items()}
    for pol in (p, None):  # no rows (e.g. a shard without tokens), no features, no experts
        with pytest.raises(ValueError, match="empty operand"):
            qragged_dot(x[:0], w, jnp.zeros_like(gs), policy=pol, key=getkey(), **empty)
        with pytest.raises(ValueError, match="empty operand"):
            qragged_dot(x[:, :0], w[:, :0], gs, policy=pol, key=getkey(), **ids)
        with pytest.raises(ValueError, match="empty operand"):
            qragged_dot(x, w[:0], gs[:0], policy=pol, key=getkey(), **ids)
    with pytest.raises(ValueError, match="key"):
        qragged_dot(x, w, gs, policy=p, **ids)
    with pytest.raises(ValueError, match="row_id"):
        qragged_dot(x, w, gs, policy=p, key=getkey())
    with pytest.raises(ValueError, match="num_examples"):
        qragged_dot(
            x, w, gs, policy=p, key=getkey(), row_id=ids["row_id"], example_id=ids["example_id"]
        )
    with pytest.raises(Exception, match="sum to"):
        jax.jit(lambda gs: qragged_dot(x, w, gs, policy=p, key=jr.key(0), **ids))(gs + 1)
    with pytest.raises(Exception, match="sum to"):
        qragged_dot(x, w, gs.at[0].add(-1), policy=None)
    with pytest.raises(Exception, match="NaN"):
        qragged_dot(x.at[0, 0].set(jnp.nan), w, gs, policy=p, key=getkey(), **ids)
    with pytest.raises(Exception, match="upstream gradient"):
        _vjp(p, x, w, gs, g.at[0, 0].set(jnp.inf), getkey(), ids)
    # Zero rows and a zero gradient are fine: no NaN.
    _, dx, dw = _vjp(p, x.at[0].set(0.0), w, gs, jnp.zeros_like(g), getkey(), ids)
    assert not np.any(np.isnan(dx)) and not np.any(np.abs(dw) > 0)
    eqx.filter_jit(lambda: None)()
