"""SR parameter updates and the 8-bit AdamW (s3req/_optim.py)."""

import io
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from s3req._float_sr import grid_neighbours
from s3req._optim import (
    Adam8bitState,
    adam_8bit,
    apply_updates_sr,
    BlockQuantized,
    dequantize_blockwise,
    quantize_blockwise,
    tree_bytes,
)


_apply = eqx.filter_jit(apply_updates_sr)


def _params(key, dtype=jnp.float32):
    k1, k2, k3 = jr.split(key, 3)
    return {
        "w1": (jr.normal(k1, (64, 96)) / 8).astype(dtype),
        "b1": jnp.zeros((96,), dtype),
        "w2": (jr.normal(k2, (96, 16)) / 10).astype(dtype),
        "scale": (1 + 0.1 * jr.normal(k3, (16,))).astype(dtype),
    }


# ---------------------------------------------------------------------------------------------
# apply_updates_sr


def test_swamping_bf16_params(getkey):
    """The second paper's example as a parameter tree: bf16 weights at 256, updates of 0.3."""
    n = 4096
    params = {"w": jnp.full((n,), 256.0, jnp.bfloat16)}
    rtn = params
    u = {"w": jnp.full((n,), 0.3, jnp.float32)}
    key = getkey()
    step = jax.jit(lambda p, k: apply_updates_sr(p, u, key=k))
    for i in range(10):
        params = step(params, jr.fold_in(key, i))
        rtn = jax.tree.map(lambda p, d: (p.astype(jnp.float32) + d).astype(p.dtype), rtn, u)
    assert params["w"].dtype == jnp.bfloat16
    assert np.all(np.asarray(rtn["w"], np.float64) == 256.0)
    w = np.asarray(params["w"], np.float64)
    sigma = np.sqrt(10 * 0.15 * 0.85 * 4 / n)  # ulp 2 at 256, p = 0.15 per step
    assert abs(w.mean() - 259.0) <= 5 * sigma


def test_apply_updates_sr_unbiased(getkey):
    """E[p_new] = p + u for every leaf, within 5 sigma of the analytic variance."""
    n = 2**13
    p = jnp.broadcast_to(jnp.asarray([0.7, -3.3, 100.0, 1e-3], jnp.bfloat16), (n, 4))
    u = jnp.broadcast_to(jnp.asarray([1e-4, 3e-3, 0.07, -1.3e-6], jnp.float32), (n, 4))
    new = _apply({"p": p}, {"p": u}, key=getkey())["p"]
    exact = np.asarray(p[0], np.float64) + np.asarray(u[0], np.float64)
    total = p.astype(jnp.float32) + u
    lo, hi = (np.asarray(a[0], np.float64) for a in grid_neighbours(total, jnp.bfloat16))
    ulp = np.abs(hi - lo)
    q = np.abs(exact - lo) / ulp
    sigma = np.sqrt(q * (1 - q)) * ulp / np.sqrt(n)
    mean = np.asarray(new, np.float64).mean(axis=0)
    assert np.all(np.abs(mean - exact) <= 5 * sigma)
    # Plain bf16 arithmetic loses the first and last updates entirely.
    naive = np.asarray((p[0] + u[0].astype(jnp.bfloat16)), np.float64)
    p0 = np.asarray(p[0], np.float64)
    assert naive[0] == p0[0] and naive[3] == p0[3]


def test_apply_updates_sr_tree_and_dtypes(getkey):
    params = _params(getkey(), jnp.bfloat16)
    params["f32"] = jnp.ones((3,), jnp.float32)
    updates = jax.tree.map(lambda p: jnp.full(p.shape, 1e-2, jnp.float32), params)
    new = _apply(params, updates, key=getkey())
    assert jax.tree.structure(new) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
        assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(new["f32"]), np.full((3,), 1.01, np.float32))


def test_apply_updates_sr_equinox_model(getkey):
    """None updates (non-array leaves of a model) leave those leaves alone, like
    eqx.apply_updates."""
    model = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) else x, model)
    grads = eqx.filter_grad(lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32) ** 2))(
        model, jnp.ones((3, 4), jnp.bfloat16)
    )
    opt = optax.sgd(1e-2)
    params = eqx.filter(model, eqx.is_array)
    updates, _ = opt.update(grads, opt.init(params), params)
    new = _apply(model, updates, key=getkey())
    assert isinstance(new, eqx.nn.MLP) and new.activation is model.activation
    assert new.layers[0].weight.dtype == jnp.bfloat16


def test_apply_updates_sr_keys(getkey):
    params = {"a": jnp.ones((256,), jnp.bfloat16), "b": jnp.ones((256,), jnp.bfloat16)}
    u = jax.tree.map(lambda p: jnp.full(p.shape, 2.0**-9, jnp.float32), params)  # p = 1/2
    k = getkey()
    x, y = _apply(params, u, key=k), apply_updates_sr(params, u, key=k)
    bits = lambda t: np.asarray(t).view(np.uint16)
    assert np.array_equal(bits(x["a"]), bits(y["a"]))  # reproducible per key
    assert not np.array_equal(bits(x["a"]), bits(x["b"]))  # leaves draw different thresholds
    z = _apply(params, u, key=getkey())
    assert not np.array_equal(bits(x["a"]), bits(z["a"]))  # keys differ
    r = _apply(
        {"m": jnp.ones((8, 64), jnp.bfloat16)},
        {"m": jnp.full((8, 64), 2.0**-9, jnp.float32)},
        key=k,
        topology="row",
    )["m"]
    r = np.asarray(r, np.float64)
    assert np.all(r == r[:, :1])  # one threshold per row


def test_apply_updates_sr_rejects_integer_params(getkey):
    with pytest.raises(TypeError, match="dtype int32"):
        apply_updates_sr({"i": jnp.ones((3,), jnp.int32)}, {"i": jnp.ones((3,))}, key=getkey())


# ---------------------------------------------------------------------------------------------
# Blockwise 8-bit storage


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_blockwise_roundtrip_and_unbiased(dtype, getkey):
    x = jr.normal(getkey(), (1000,)) * jnp.exp(jr.normal(getkey(), (1000,)))
    if dtype == jnp.uint8:
        x = jnp.abs(x)
    q = quantize_blockwise(x, dtype, key=None)
    assert q.codes.dtype == jnp.dtype(dtype) and q.codes.shape == x.shape
    assert q.scale.shape == (4,)  # ceil(1000 / 256)
    err = np.abs(np.asarray(dequantize_blockwise(q)) - np.asarray(x))
    step = np.repeat(np.asarray(q.scale), 256)[:1000]
    if dtype in (jnp.int8, jnp.uint8):
        assert np.all(err <= 0.5 * step * (1 + 1e-6))
    # Stochastic rounding: mean over keys -> x. The analytic law: each value sits between two
    # codes `step_i` apart at fraction p_i, so the mean of n draws has variance
    # p_i (1 - p_i) step_i^2 / n.
    n = 512
    keys = jr.split(getkey(), n)
    deq = jax.vmap(lambda k: dequantize_blockwise(quantize_blockwise(x, dtype, key=k)))(keys)
    mean = np.asarray(deq, np.float64).mean(axis=0)
    y = np.asarray(x, np.float64) / step  # in code units
    if dtype in (jnp.int8, jnp.uint8):
        lo, width = np.floor(y), np.ones_like(y)
    else:
        a, b = grid_neighbours(jnp.asarray(y, jnp.float32), dtype)
        lo, width = np.asarray(a, np.float64), np.abs(np.asarray(b, np.float64) - np.asarray(a))
    p = np.clip(np.abs(y - lo) / width, 0, 1)
    var = p * (1 - p) * (width * step) ** 2 / n
    err = mean - np.asarray(x, np.float64)
    # Aggregate over all values (a sum of independent errors), 5 sigma ...
    assert abs(err.sum()) <= 5 * np.sqrt(var.sum())
    # ... and per value where the binomial count is in its normal regime (n p (1-p) >= 25).
    normal = n * p * (1 - p) >= 25
    assert normal.sum() > 100
    assert np.all(np.abs(err[normal]) <= 5 * np.sqrt(var[normal]))


def test_blockwise_zero_and_bad_dtype(getkey):
    q = quantize_blockwise(jnp.zeros((300,)), jnp.int8, key=getkey())
    assert np.all(np.asarray(q.scale) == 1.0) and np.all(np.asarray(q.codes) == 0)
    with pytest.raises(ValueError, match="8-bit state"):
        quantize_blockwise(jnp.zeros((3,)), jnp.bfloat16, key=None)


# ---------------------------------------------------------------------------------------------
# adam_8bit


def _loss(p, x, y):
    p = jax.tree.map(lambda a: a.astype(jnp.float32), p)
    h = jnp.tanh(x @ p["w1"] + p["b1"][None])
    return jnp.mean((h @ p["w2"] * p["scale"][None] - y) ** 2)


def _data():
    x = jr.normal(jr.key(1), (256, 64))
    return x, jnp.sin(x[:, :16] * 2)


def _train(opt, params, steps, key, sr):
    x, y = _data()

    @jax.jit
    def step(p, s, k):
        g = jax.grad(_loss)(p, x, y)
        with jax.numpy_dtype_promotion("standard"):  # optax.adamw mixes int32 and floats
            u, s = opt.update(g, s, p)
        if sr:
            return apply_updates_sr(p, u, key=k), s
        # Round to nearest: p + u in float32, cast back to the parameter dtype.
        rtn = lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)
        return jax.tree.map(rtn, p, u), s

    state = opt.init(params)
    for i in range(steps):
        params, state = step(params, state, jr.fold_in(key, i))
    return float(_loss(params, x, y)), params, state


def test_adam_8bit_tracks_adamw():
    """On a small regression the 8-bit AdamW follows float32 AdamW closely."""
    params = _params(jr.key(0))
    steps = 200
    l0 = float(_loss(params, *_data()))
    l_ref, p_ref, _ = _train(optax.adamw(3e-3, weight_decay=1e-2), params, steps, jr.key(2), False)
    opt = adam_8bit(3e-3, weight_decay=1e-2, key=jr.key(3))
    l_8, p_8, _ = _train(opt, params, steps, jr.key(2), False)
    assert l_8 < 0.5 * l0
    assert abs(l_8 - l_ref) <= 0.05 * l_ref, (l_8, l_ref)
    # Parameters stay close too (relative to how far they moved).
    moved = np.linalg.norm(np.asarray(p_ref["w1"] - params["w1"]))
    diff = np.linalg.norm(np.asarray(p_8["w1"] - p_ref["w1"]))
    assert diff <= 0.25 * moved


def test_adam_8bit_with_bf16_params_and_sr():
    """bf16 weights + SR updates + 8-bit moments: converges; bf16 + round-to-nearest lags."""
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params(jr.key(0)))
    opt = adam_8bit(3e-4, key=jr.key(3))
    l_sr, p_sr, _ = _train(opt, params, 300, jr.key(4), True)
    l_rtn, _, _ = _train(opt, params, 300, jr.key(4), False)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(p_sr))
    assert l_sr < l_rtn


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_adam_8bit_state_is_smaller(param_dtype, getkey):
    params = _params(getkey(), param_dtype)
    n = sum(p.size for p in jax.tree.leaves(params))
    ours = tree_bytes(adam_8bit(1e-3, key=getkey()).init(params))
    ref = tree_bytes(optax.adamw(1e-3).init(params))
    # Two bytes per parameter plus a float32 scale per block of 256 (per leaf, rounded up),
    # a count and the key.
    blocks = sum(-(-p.size // 256) for p in jax.tree.leaves(params))
    assert ours == 2 * n + 2 * 4 * blocks + 4 + 8
    per_param = 8 if param_dtype == jnp.float32 else 4
    assert ref >= per_param * n
    assert ours < ref / (3.5 if param_dtype == jnp.float32 else 1.8)


def test_adam_8bit_state_contents_and_serialisation(getkey):
    params = _params(getkey())
    opt = adam_8bit(1e-3, key=getkey(), mu_dtype=jnp.float8_e5m2)
    state = opt.init(params)
    assert isinstance(state, Adam8bitState)
    assert state.key.dtype == jnp.uint32 and state.key.shape == (2,)
    assert all(
        isinstance(q, BlockQuantized)
        for q in jax.tree.leaves(state.mu, is_leaf=lambda x: isinstance(x, BlockQuantized))
    )
    g = jax.tree.map(jnp.ones_like, params)
    _, state = jax.jit(opt.update)(g, state, params)
    # float8 codes are held as uint8 bit patterns (np.save cannot write float8).
    assert state.mu["w1"].codes.dtype == jnp.uint8
    assert state.nu["w1"].codes.dtype == jnp.uint8
    mu = jax.lax.bitcast_convert_type(state.mu["w1"].codes, jnp.float8_e5m2)
    np.testing.assert_allclose(
        np.asarray(dequantize_blockwise(state.mu["w1"]._replace(codes=mu))), 0.1, rtol=0.13
    )
    # Only arrays: Equinox serialisation round-trips it.
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, state)
    buf.seek(0)
    back = eqx.tree_deserialise_leaves(buf, state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.dtype == b.dtype
        a8, b8 = (np.asarray(z).reshape(-1).view(np.uint8) for z in (a, b))
        assert np.array_equal(a8, b8)


def test_adam_8bit_keys(getkey):
    """Reproducible per seed; fresh thresholds every step and for every seed."""
    params = _params(getkey())
    g = jax.tree.map(lambda p: 1e-3 * jnp.cos(jnp.arange(p.size).reshape(p.shape)), params)
    seed = getkey()

    def codes(state):
        return np.asarray(state.nu["w1"].codes).view(np.uint8)

    opt = adam_8bit(1e-3, key=seed)
    s0 = typing.cast(Adam8bitState, opt.init(params))
    update = jax.jit(opt.update)
    _, a = update(g, s0, params)
    _, b = eqx.filter_jit(opt.update)(g, s0, params)  # another compilation
    assert np.array_equal(codes(a), codes(b))
    # The same inputs at another step count draw other thresholds.
    _, c = update(g, s0._replace(count=jnp.asarray(5, jnp.int32)), params)
    assert not np.array_equal(codes(a), codes(c))
    _, d = update(g, s0._replace(key=jr.key_data(getkey())), params)
    assert not np.array_equal(codes(a), codes(d))


def test_adam_8bit_zero_grads_and_errors(getkey):
    params = _params(getkey())
    opt = adam_8bit(1e-3, key=getkey())
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = jax.jit(opt.update)(zeros, opt.init(params), params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    with pytest.raises(ValueError, match="needs `params`"):
        wd = adam_8bit(1e-3, weight_decay=0.1, key=getkey())
        wd.update(params, wd.init(params))
    with pytest.raises(ValueError, match="float8"):
        adam_8bit(1e-3, key=getkey(), nu_dtype=jnp.uint8)
    with pytest.raises(ValueError, match="negative"):
        adam_8bit(1e-3, key=getkey(), mu_dtype=jnp.uint8)


def test_adam_8bit_schedule(getkey):
    params = _params(getkey())
    sched = optax.linear_schedule(1e-3, 0.0, 10)
    opt = adam_8bit(sched, key=getkey())
    g = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):  # optax schedules mix Python and int32
        u, _ = jax.jit(opt.update)(g, opt.init(params), params)
    # First step: bias-corrected m / sqrt(v) = 1, so the update is -lr(0) = -1e-3.
    np.testing.assert_allclose(np.asarray(u["w1"]), -1e-3, rtol=1e-4)


def test_adam_8bit_weight_decay_mask(getkey):
    params = _params(getkey())
    zeros = jax.tree.map(jnp.zeros_like, params)
    mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    opt = adam_8bit(1.0, weight_decay=0.5, mask=mask, key=getkey())
    u, _ = jax.jit(opt.update)(zeros, opt.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w1"]), -0.5 * np.asarray(params["w1"]), rtol=1e-6)
    assert np.all(np.asarray(u["scale"]) == 0) and np.all(np.asarray(u["b1"]) == 0)
