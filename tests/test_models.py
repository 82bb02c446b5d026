"""The Llama-style decoder: shapes, reference maths, causality, keys, training, presets."""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import models
import policies
import s3req._linear
from models import (
    count_params,
    FFN,
    flops_per_token,
    get_config,
    Llama,
    LlamaConfig,
    PAPER_FFN_SHAPES,
    PRESETS,
    RopeScaling,
)
from policies import Nearest, Phi2D, Policy, TwoWayEC


POLICY_NAMES = list(policies.PRESETS)

# A very small dense model for the per-policy tests (compiles and trains in seconds).
MICRO = LlamaConfig(
    vocab_size=32,
    max_seq_len=16,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=64,
)


def _stacked_layer(stack, i):
    return jtu.tree_map(lambda x: x[i] if eqx.is_array(x) else x, stack)


# --------------------------------------------------------------------------------------------
# An independent NumPy forward of the same maths (float64).


def _np_rope_freqs(hd, theta, scaling):
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    if scaling is None:
        return inv
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        lo = scaling.original_max_seq_len / scaling.low_freq_factor
        hi = scaling.original_max_seq_len / scaling.high_freq_factor
        if wl < hi:
            out.append(f)
        elif wl > lo:
            out.append(f / scaling.factor)
        else:
            t = (scaling.original_max_seq_len / wl - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            out.append((1 - t) * f / scaling.factor + t * f)
    return np.array(out)


def _np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _np_rope(x, pos, freqs):  # x (S, heads, hd)
    ang = pos[:, None] * freqs[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    cos = np.concatenate([cos, cos], -1)
    sin = np.concatenate([sin, sin], -1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def _np_ffn(x, p):
    g, u = x @ p["gate"].T, x @ p["up"].T
    return (g / (1 + np.exp(-g)) * u) @ p["down"].T


def np_forward(params: dict, cfg: LlamaConfig, tokens: np.ndarray, moe_fn=None) -> np.ndarray:
    """Logits of `tokens` (B, S), example by example, token by token where it matters."""
    H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    freqs = _np_rope_freqs(hd, cfg.rope_theta, cfg.rope_scaling)
    out = []
    for seq in tokens:
        S = len(seq)
        pos = np.arange(S, dtype=np.float64)
        x = params["embed"][seq]
        for lp in params["layers"]:
            h = _np_rms(x, lp["attn_norm"], cfg.norm_eps)
            q = (h @ lp["q"].T).reshape(S, H, hd)
            k = (h @ lp["k"].T).reshape(S, K, hd)
            v = (h @ lp["v"].T).reshape(S, K, hd)
            if cfg.qk_norm:
                q = _np_rms(q, lp["q_norm"], cfg.norm_eps)
                k = _np_rms(k, lp["k_norm"], cfg.norm_eps)
            q, k = _np_rope(q, pos, freqs), _np_rope(k, pos, freqs)
            att = np.zeros((S, H, hd))
            for head in range(H):
                kv = head // (H // K)
                for t in range(S):
                    s = q[t, head] @ k[: t + 1, kv].T / math.sqrt(hd)
                    p = np.exp(s - s.max())
                    att[t, head] = (p / p.sum()) @ v[: t + 1, kv]
            x = x + att.reshape(S, H * hd) @ lp["o"].T
            h = _np_rms(x, lp["mlp_norm"], cfg.norm_eps)
            x = x + (moe_fn(h, lp) if moe_fn is not None and "router" in lp else _np_ffn(h, lp))
        x = _np_rms(x, params["norm"], cfg.norm_eps)
        out.append(x @ params["head"].T)
    return np.stack(out)


def np_params(model: Llama) -> dict:
    """The parameters of `model` as float64 NumPy, layer by layer."""
    f = lambda a: np.asarray(a, np.float64)
    layers = []
    for stack in model.layers:
        n = stack.attn_norm.weight.shape[0]
        for i in range(n):
            L = _stacked_layer(stack, i)
            d: dict[str, Any] = dict(
                attn_norm=f(L.attn_norm.weight),
                mlp_norm=f(L.mlp_norm.weight),
                q=f(L.attn.q_proj.weight),
                k=f(L.attn.k_proj.weight),
                v=f(L.attn.v_proj.weight),
                o=f(L.attn.o_proj.weight),
            )
            if L.attn.q_norm is not None:
                d["q_norm"], d["k_norm"] = f(L.attn.q_norm.weight), f(L.attn.k_norm.weight)
            if isinstance(L.mlp, FFN):
                d.update(
                    gate=f(L.mlp.gate.weight), up=f(L.mlp.up.weight), down=f(L.mlp.down.weight)
                )
            else:
                d.update(
                    router=f(L.mlp.router),
                    w_gate=f(L.mlp.w_gate),
                    w_up=f(L.mlp.w_up),
                    w_down=f(L.mlp.w_down),
                )
                if L.mlp.shared is not None:
                    s = L.mlp.shared
                    d["shared"] = dict(
                        gate=f(s.gate.weight), up=f(s.up.weight), down=f(s.down.weight)
                    )
            layers.append(d)
    head = model.embed if model.head is None else model.head
    return dict(embed=f(model.embed), layers=layers, norm=f(model.norm.weight), head=f(head))


def _randomize_norms(model, key):
    """Give every norm weight a non-trivial value so the reference test sees them."""
    is_norm = lambda n: isinstance(n, models.RMSNorm)
    norms = [n for n in jtu.tree_leaves(model, is_leaf=is_norm) if is_norm(n)]
    keys = jr.split(key, len(norms))
    new = [1 + 0.3 * jr.normal(k, n.weight.shape) for k, n in zip(keys, norms)]
    return eqx.tree_at(
        lambda m: [n.weight for n in jtu.tree_leaves(m, is_leaf=is_norm) if is_norm(n)], model, new
    )


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(qk_norm=True, tie_embeddings=True, head_dim=12),
        dict(rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=8), rope_theta=500.0),
    ],
    ids=["llama", "qwen3-tied", "llama3-rope"],
)
def test_float_model_matches_numpy(overrides, getkey):
    cfg = dataclasses.replace(MICRO, max_seq_len=12, **overrides)
    model = _randomize_norms(Llama(cfg, None, key=getkey()), getkey())
    tokens = jr.randint(getkey(), (2, 12), 0, cfg.vocab_size)
    got = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, tokens))
    want = np_forward(np_params(model), cfg, np.asarray(tokens))
    assert got.dtype == np.float32 and got.shape == (2, 12, cfg.vocab_size)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_rope_scaling_changes_only_low_frequencies():
    plain = models._llama.rope_frequencies(128, 500_000.0)
    scaled = models._llama.rope_frequencies(128, 500_000.0, RopeScaling())
    assert scaled[0] == plain[0]  # highest frequency kept
    np.testing.assert_allclose(scaled[-1], plain[-1] / 8, rtol=1e-6)  # lowest divided by 8
    np.testing.assert_allclose(scaled, _np_rope_freqs(128, 500_000.0, RopeScaling()), rtol=1e-6)


@pytest.mark.parametrize("policy_name", ["bf16", "s3r-ec-2way"])
def test_causal(policy_name, getkey):
    model = Llama(MICRO, policies.preset(policy_name), key=getkey())
    tokens = jr.randint(getkey(), (2, 16), 0, MICRO.vocab_size)
    t = 7
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 5) % MICRO.vocab_size)
    f = eqx.filter_jit(lambda m, tok: m(tok, key=jr.key(3)))
    a, b = f(model, tokens), f(model, changed)
    np.testing.assert_array_equal(np.asarray(a[:, : t + 1]), np.asarray(b[:, : t + 1]))
    assert not np.allclose(np.asarray(a[:, t + 1 :]), np.asarray(b[:, t + 1 :]))


def test_bfloat16_compute(getkey):
    cfg32 = MICRO
    cfg16 = dataclasses.replace(MICRO, compute_dtype="bfloat16")
    key = getkey()
    m32, m16 = Llama(cfg32, None, key=key), Llama(cfg16, Policy(Phi2D()), key=key)
    assert all(x.dtype == jnp.float32 for x in jtu.tree_leaves(eqx.filter(m16, eqx.is_array)))
    tokens = jr.randint(getkey(), (2, 16), 0, MICRO.vocab_size)
    call = eqx.filter_jit(lambda m: m(tokens, key=jr.key(0)))
    ref = call(m32)

    def loss(m):
        return jnp.mean(m(tokens, key=jr.key(0)) ** 2)

    logits = call(m16)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=0.05)
    grads = eqx.filter_jit(eqx.filter_grad(loss))(m16)
    leaves = jtu.tree_leaves(eqx.filter(grads, eqx.is_array))
    assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))) for g in leaves)


def test_quantized_forward_close_to_float(getkey):
    key = getkey()
    tokens = jr.randint(getkey(), (2, 16), 0, MICRO.vocab_size)
    call = eqx.filter_jit(lambda m: m(tokens))
    ref = call(Llama(MICRO, None, key=key))
    q = call(Llama(MICRO, Policy(Nearest()), key=key))
    err = float(jnp.max(jnp.abs(q - ref)) / jnp.max(jnp.abs(ref)))
    assert 0 < err < 0.05


def test_missing_key_and_bad_tokens(getkey):
    model = Llama(MICRO, Policy(Phi2D()), key=getkey())
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="key"):
        model(tokens)
    Llama(MICRO, Policy(Nearest()), key=getkey())(tokens)  # deterministic: no key needed
    with pytest.raises((ValueError, TypeError), match="batch.*seq"):
        model(jnp.zeros((8,), jnp.int32), key=getkey())
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32), key=getkey())
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(MICRO, n_kv_heads=3)


# --------------------------------------------------------------------------------------------
# Keys: every layer and every projection gets its own thresholds.


def test_projections_get_distinct_keys(getkey, monkeypatch):
    """Every projection of a layer gets its own key (recorded from an eager call)."""
    seen = []
    qdot_t = s3req._linear.qdot_t

    def recording_qdot(x, w, *, policy, key=None, **kwargs):
        assert key is not None
        seen.append(tuple(np.asarray(jr.key_data(key)).tolist()))
        return qdot_t(x, w, policy=policy, key=key, **kwargs)

    monkeypatch.setattr(s3req._linear, "qdot_t", recording_qdot)
    model = Llama(MICRO, Policy(Phi2D()), key=getkey())
    layer = _stacked_layer(model.layers[0], 0)
    x = jr.normal(getkey(), (2, 8, MICRO.d_model))
    cos, sin = models._llama._rope_tables(MICRO, 8)
    layer(x, cos, sin, key=getkey())
    assert len(seen) == 7 and len(set(seen)) == 7


def _same_layers_zero_outputs(model):
    """Both layers get the weights of layer 0, with o_proj and down set to zero: the residual
    stream then passes unchanged, so both layers see identical inputs and gradients."""
    stack = model.layers[0]
    stack = jtu.tree_map(lambda x: jnp.stack([x[0]] * x.shape[0]) if eqx.is_array(x) else x, stack)
    stack = eqx.tree_at(
        lambda s: (s.attn.o_proj.weight, s.mlp.down.weight),
        stack,
        (jnp.zeros_like(stack.attn.o_proj.weight), jnp.zeros_like(stack.mlp.down.weight)),
    )
    return eqx.tree_at(lambda m: m.layers, model, (stack,))


@pytest.mark.parametrize("policy", [Policy(Nearest()), Policy(Phi2D())], ids=["rtne", "s3r"])
def test_layers_draw_fresh_thresholds(policy, getkey):
    model = _same_layers_zero_outputs(Llama(MICRO, policy, key=getkey()))
    tokens = jr.randint(getkey(), (2, 16), 0, MICRO.vocab_size)

    def loss(m):
        return jnp.sum(m(tokens, key=jr.key(11)) ** 2)

    g = eqx.filter_jit(eqx.filter_grad(loss))(model).layers[0]
    for w in (g.attn.o_proj.weight, g.mlp.down.weight):
        assert float(jnp.max(jnp.abs(w[0]))) > 0
        same = bool(jnp.array_equal(w[0], w[1]))
        # Identical inputs and gradients: only the thresholds can tell the layers apart.
        assert same == (not policy.stochastic)


# --------------------------------------------------------------------------------------------
# Every policy: forward + backward under jit, and training on a fixed batch.


def _xent(model, tokens, key):
    logits, aux = model.forward(tokens[:, :-1], key=key)
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)
    return jnp.mean(nll) + aux


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_loss_falls(policy_name, getkey):
    policy = policies.preset(policy_name)
    model = Llama(MICRO, policy, key=jr.key(0))
    tokens = jr.randint(jr.key(1), (4, 17), 0, MICRO.vocab_size)
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state, key):
        loss, grads = eqx.filter_value_and_grad(_xent)(model, tokens, key)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
            updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for i in range(30):
        model, state, loss = step(model, state, jr.fold_in(jr.key(2), i))
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


# --------------------------------------------------------------------------------------------
# FFN block, configs and presets.


def test_ffn_block(getkey):
    assert PAPER_FFN_SHAPES["W1"] == (512, 2048) and PAPER_FFN_SHAPES["W9"] == (8192, 28672)
    assert len(PAPER_FFN_SHAPES) == 9
    ffn = FFN(16, 48, Policy(Phi2D(), TwoWayEC()), key=getkey())
    x = jr.normal(getkey(), (2, 8, 16))
    y, g = eqx.filter_jit(eqx.filter_value_and_grad(lambda f, k: jnp.sum(f(x, key=k) ** 2)))(
        ffn, getkey()
    )
    assert y.shape == () and g.gate.weight.shape == (48, 16) and g.down.weight.shape == (16, 48)
    # The float block is SwiGLU.
    f = FFN(16, 48, None, key=getkey())
    silu = lambda v: v * jax.nn.sigmoid(v)
    want = (silu(x @ f.gate.weight.T) * (x @ f.up.weight.T)) @ f.down.weight.T
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_config_is_hashable_and_replaceable():
    cfg = get_config("tiny")
    assert hash(cfg) == hash(get_config("tiny"))
    cfg2 = dataclasses.replace(cfg, vocab_size=100, max_seq_len=64)
    assert cfg2.vocab_size == 100 and cfg2.d_model == cfg.d_model
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3  # pyright: ignore
    with pytest.raises(ValueError, match="Unknown model preset"):
        get_config("nope")


@pytest.mark.parametrize("name", ["tiny"])
def test_count_params_matches_model(name, getkey):
    cfg = get_config(name)
    model = eqx.filter_eval_shape(Llama, cfg, Policy(Phi2D()), key=getkey())
    n = sum(x.size for x in jtu.tree_leaves(model))
    assert n == count_params(cfg)
    assert flops_per_token(cfg) > 6 * (count_params(cfg) - cfg.vocab_size * cfg.d_model)


def _abstract_step(cfg, policy, batch=2, seq=8):
    """Abstract model, tokens and key, and the loss-and-grad step of a training loop."""
    model = eqx.filter_eval_shape(Llama, cfg, policy, key=jr.key(0))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    key = jax.eval_shape(lambda: jr.key(0))

    def loss(m, t, k):
        logits, aux = m.forward(t, key=k)
        return jnp.mean(jax.nn.logsumexp(logits, -1)) + aux

    step = eqx.filter_value_and_grad(loss)
    return model, tokens, key, step


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes(name):
    """Every preset builds abstractly, and forward + backward have the right shapes/dtypes."""
    cfg = get_config(name)
    model, tokens, key, step = _abstract_step(cfg, Policy(Phi2D(), TwoWayEC()))
    leaves = jtu.tree_leaves(model)  # all ShapeDtypeStructs
    assert sum(x.size for x in leaves) == count_params(cfg)
    assert all(x.dtype == jnp.float32 for x in leaves)
    logits, aux = eqx.filter_eval_shape(lambda m, t, k: m.forward(t, key=k), model, tokens, key)
    assert logits.shape == (2, 8, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux.shape == () and aux.dtype == jnp.float32
    loss, grads = eqx.filter_eval_shape(step, model, tokens, key)
    assert loss.shape == ()
    g_leaves = jtu.tree_leaves(grads)
    assert [g.shape for g in g_leaves] == [x.shape for x in leaves]
    assert all(g.dtype == jnp.float32 for g in g_leaves)


def test_known_parameter_counts():
    """The shape-exact presets have the parameter counts of the real checkpoints."""
    assert count_params(get_config("llama3.1-8b")) == 8_030_261_248
    assert count_params(get_config("qwen3-8b")) == 8_190_735_360
    assert count_params(get_config("qwen3-30b-a3b")) == 30_532_122_624
    assert count_params(get_config("qwen3-30b-a3b"), active=True) == 3_353_032_704


def _compile_memory(cfg, policy, batch, seq):
    model, tokens, key, step = _abstract_step(cfg, policy, batch, seq)
    dynamic, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    f = jax.jit(lambda d, t, k: step(eqx.combine(d, static), t, k))
    return f.lower(dynamic, tokens, key).compile().memory_analysis()


@pytest.mark.parametrize("name", ["tiny-moe"])
def test_compile_only_memory_analysis(name):
    mem = _compile_memory(get_config(name), Policy(Phi2D(), TwoWayEC()), 2, 32)
    if mem is None:  # not every backend reports it
        pytest.skip("memory_analysis() not available on this backend")
    assert mem.argument_size_in_bytes >= 4 * count_params(get_config(name))
    assert mem.temp_size_in_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_compile_only_big_presets(name):
    """Compile one training step of a real-size model on abstract inputs (no memory used)."""
    mem = _compile_memory(get_config(name), Policy(Phi2D(), TwoWayEC()), 1, 256)
    if mem is not None:
        assert mem.argument_size_in_bytes >= 4 * count_params(get_config(name))
