"""The mixture-of-experts block and MoE decoders: routing, reference maths, int8 GEMMs, aux."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import policies
from models import Llama, LlamaConfig, MoE, MoEConfig, sort_by_expert
from policies import Nearest, Phi2D, Policy, TwoWayEC
from s3req._kernels_tpu import EPS_DIGITS

from .helpers import iter_eqns
from .test_models import _randomize_norms, np_forward, np_params


MICRO_MOE = LlamaConfig(
    vocab_size=32,
    max_seq_len=12,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
    qk_norm=True,
    moe=MoEConfig(n_experts=4, top_k=2, d_expert=24, z_loss_coef=1e-3),
)
# DeepSeek-like: shared experts, un-normalised top-k weights, a dense first layer.
MICRO_DS = dataclasses.replace(
    MICRO_MOE,
    n_layers=3,
    qk_norm=False,
    moe=MoEConfig(
        n_experts=5,
        top_k=3,
        d_expert=16,
        n_shared_experts=2,
        norm_topk_prob=False,
        n_dense_layers=1,
    ),
)


def _softmax(z):
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _swiglu(x, wg, wu, wd):  # weights (in, out) layout
    g = x @ wg
    return (g / (1 + np.exp(-g)) * (x @ wu)) @ wd


def np_moe(mcfg: MoEConfig):
    """Token by token: softmax router, top-k, weighted sum of expert SwiGLUs (+ shared)."""

    def moe(h, lp):
        p = _softmax(h @ lp["router"].T)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = np.argsort(-p[t])[: mcfg.top_k]
            wts = p[t, top] / (p[t, top].sum() if mcfg.norm_topk_prob else 1.0)
            for e, wt in zip(top, wts):
                out[t] += wt * _swiglu(h[t], lp["w_gate"][e], lp["w_up"][e], lp["w_down"][e])
        if "shared" in lp:
            s = lp["shared"]
            out += _swiglu(h, s["gate"].T, s["up"].T, s["down"].T)
        return out

    return moe


@pytest.mark.parametrize("cfg", [MICRO_MOE, MICRO_DS], ids=["qwen3-moe", "deepseek-like"])
def test_float_moe_model_matches_numpy(cfg, getkey):
    model = _randomize_norms(Llama(cfg, None, key=getkey()), getkey())
    # Larger router weights: decisive routing, so float rounding cannot flip a top-k choice.
    model = jtu.tree_map(lambda x: x, model)
    for i, stack in enumerate(model.layers):
        if isinstance(stack.mlp, MoE):
            r = stack.mlp.router
            model = eqx.tree_at(lambda m: m.layers[i].mlp.router, model, 8 * r)
    tokens = jr.randint(getkey(), (2, 12), 0, cfg.vocab_size)
    logits, aux = eqx.filter_jit(lambda m, t: m.forward(t))(model, tokens)
    assert cfg.moe is not None
    want = np_forward(np_params(model), cfg, np.asarray(tokens), moe_fn=np_moe(cfg.moe))
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-5)
    assert aux.shape == () and float(aux) > 0


def test_routing_is_a_permutation(getkey):
    moe = MoE(16, MoEConfig(n_experts=6, top_k=3, d_expert=8), None, key=getkey())
    x = jr.normal(getkey(), (40, 16))
    weights, experts, _ = eqx.filter_jit(lambda m, x: m.route(x))(moe, x)
    assert experts.shape == (40, 3)
    # Each token reaches exactly k distinct experts.
    assert all(len(set(row)) == 3 for row in np.asarray(experts).tolist())
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
    order, gs = sort_by_expert(experts, 6)
    order, gs = np.asarray(order), np.asarray(gs)
    assert sorted(order.tolist()) == list(range(120))  # a permutation of the (token, slot) ids
    assert gs.sum() == 120
    np.testing.assert_array_equal(np.bincount(order // 3, minlength=40), 3)  # k rows per token
    flat = np.asarray(experts).reshape(-1)
    ends = np.cumsum(gs)
    for e, (a, b) in enumerate(zip(ends - gs, ends)):
        assert np.all(flat[order[a:b]] == e)
        assert np.all(np.diff(order[a:b]) > 0)  # stable: token order within an expert


def test_no_token_dropped_under_collapsed_routing(getkey):
    """Every token picks experts 0 and 1: no capacity limit, nothing dropped."""
    cfg = MoEConfig(n_experts=4, top_k=2, d_expert=8)
    moe = MoE(16, cfg, Policy(Nearest()), key=getkey())
    router = jnp.concatenate([10 * jnp.ones((1, 16)), 5 * jnp.ones((1, 16)), -jnp.ones((2, 16))])
    moe = eqx.tree_at(lambda m: m.router, moe, router)
    x = jnp.abs(jr.normal(getkey(), (2, 10, 16))) + 0.1
    _, experts, _ = eqx.filter_jit(lambda m, x: m.route(x))(moe, x.reshape(20, 16))
    assert np.all(np.sort(np.asarray(experts), axis=1) == [0, 1])
    y = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    lp = {
        k: np.asarray(getattr(moe, k), np.float64) for k in ("router", "w_gate", "w_up", "w_down")
    }
    want = np.stack([np_moe(cfg)(np.asarray(xb, np.float64), lp) for xb in x])
    np.testing.assert_allclose(np.asarray(y), want, rtol=0.05, atol=0.02 * np.abs(want).max())
    assert np.all(np.abs(np.asarray(y)).sum(-1) > 0)


def test_aux_loss_formula(getkey):
    cfg = MoEConfig(n_experts=5, top_k=2, d_expert=8, aux_loss_coef=0.3, z_loss_coef=0.07)
    moe = MoE(16, cfg, None, key=getkey())
    x = jr.normal(getkey(), (3, 7, 16))
    _, aux = eqx.filter_jit(lambda m, x: m.forward(x))(moe, x)
    z = np.asarray(x, np.float64).reshape(21, 16) @ np.asarray(moe.router, np.float64).T
    p = _softmax(z)
    top = np.argsort(-p, axis=1)[:, :2]
    f = np.bincount(top.reshape(-1), minlength=5) / 21  # fraction of tokens per expert
    balance = 5 * np.sum(f * p.mean(0))
    lse = np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(float(aux), 0.3 * balance + 0.07 * np.mean(lse**2), rtol=1e-5)
    # Router gradient flows through the probabilities (the counts are constants).
    g = eqx.filter_jit(eqx.filter_grad(lambda m: m.forward(x)[1]))(moe)
    assert float(jnp.abs(g.router).max()) > 0
    # A dense model's auxiliary loss is exactly zero.
    dense = Llama(dataclasses.replace(MICRO_MOE, moe=None), None, key=getkey())
    aux = eqx.filter_jit(lambda m, t: m.forward(t)[1])(dense, jnp.zeros((1, 4), jnp.int32))
    assert float(aux) == 0.0


def test_moe_ragged_gemms_are_int8(getkey):
    """Walk the jaxpr of the gradient of an MoE decoder: every ragged GEMM (3 per expert
    SwiGLU, forward + dX + dW) takes int8 operands and accumulates in int32."""
    model = Llama(MICRO_MOE, Policy(Phi2D(), TwoWayEC()), key=getkey())
    tokens = jax.ShapeDtypeStruct((2, 12), jnp.int32)

    def loss(m, t, k):
        logits, aux = m.forward(t, key=k)
        return jnp.mean(logits**2) + aux

    dyn, static = eqx.partition(model, eqx.is_array)
    f = lambda d, t, k: jax.grad(lambda d: loss(eqx.combine(d, static), t, k))(d)
    jaxpr = jax.make_jaxpr(f)(dyn, tokens, getkey())
    eqns = [e for e in iter_eqns(jaxpr.jaxpr) if e.primitive.name == "ragged_dot_general"]
    # The TPU kernel's error-correction segment sums and token terms (traced beside the
    # reference) are thin ragged contractions over the rows (one operand of at most
    # EPS_DIGITS + batch columns, `xq_sums`' `[digits of eps, one-hot]`): not GEMMs of the
    # layer.
    thin = EPS_DIGITS + tokens.shape[0]
    eqns = [e for e in eqns if min(v.aval.shape[-1] for v in e.invars[:2]) > thin]  # pyright: ignore
    # One MoE stack (scanned): 3 GEMMs x (forward, dX, dW), and each dW once more in the TPU
    # kernel's branch (`ragged_dw`; `jax.lax.platform_dependent` traces every backend's).
    assert len(eqns) == 12
    for e in eqns:
        assert [v.aval.dtype for v in e.invars[:2]] == [jnp.int8, jnp.int8]  # pyright: ignore
        assert e.params["preferred_element_type"] == jnp.int32
        assert e.outvars[0].aval.dtype == jnp.int32  # pyright: ignore


DS_BLOCK = MoEConfig(
    n_experts=5, top_k=3, d_expert=16, n_shared_experts=1, norm_topk_prob=False, z_loss_coef=1e-3
)


@pytest.mark.parametrize("policy_name", list(policies.PRESETS))
def test_moe_block_forward_backward_every_policy(policy_name, getkey):
    moe = MoE(32, DS_BLOCK, policies.preset(policy_name), key=jr.key(0))
    x = jr.normal(jr.key(1), (2, 12, 32))

    @eqx.filter_jit
    def step(m, x, k):
        def loss(mx):
            y, aux = mx[0].forward(mx[1], key=k)
            return jnp.mean(y**2) + aux

        return eqx.filter_value_and_grad(loss)((m, x))

    loss, (grads, dx) = step(moe, x, jr.key(2))
    assert np.isfinite(float(loss)) and dx.shape == x.shape
    leaves = jtu.tree_leaves(eqx.filter(grads, eqx.is_array)) + [dx]
    assert all(bool(jnp.all(jnp.isfinite(g))) and g.dtype == jnp.float32 for g in leaves)
    for g in (grads.router, grads.w_gate, grads.w_up, grads.w_down, grads.shared.gate.weight, dx):
        assert float(jnp.abs(g).max()) > 0


def test_quantized_moe_gradient_close_to_float(getkey):
    x = jr.normal(getkey(), (2, 12, 32))
    key = getkey()

    def grads(policy):
        loss = lambda mx: jnp.mean(mx[0](mx[1]) ** 2)
        m = MoE(32, DS_BLOCK, policy, key=key)
        return eqx.filter_jit(eqx.filter_grad(loss))((m, x))

    (ref, ref_dx), (q, q_dx) = grads(None), grads(Policy(Nearest()))
    for a, b in ((q.w_down, ref.w_down), (q.w_gate, ref.w_gate), (q_dx, ref_dx)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.1
