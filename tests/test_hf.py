"""Local Hugging Face checkpoints: reading HF naming, bit-exact round trips, transformers."""

import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from safetensors.numpy import save_file

from models import _hf, config_from_hf, count_params, Llama, LlamaConfig, load_hf, MoE, save_hf
from policies import Phi2D, Policy, TwoWayEC

from .test_models import np_forward
from .test_moe import np_moe


def _hf_config(kind: str) -> dict:
    base = dict(
        vocab_size=40,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
    )
    if kind == "llama":
        rs = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8,
        )
        return dict(base, model_type="llama", rope_theta=500.0, rope_scaling=rs)
    if kind == "qwen3":
        return dict(base, model_type="qwen3", head_dim=12, tie_word_embeddings=True)
    return dict(
        base,
        model_type="qwen3_moe",
        num_hidden_layers=3,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )


def _hf_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under Hugging Face names (written out independently here)."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)
    D, V, F = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim", D // H)
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D)}
    if not hf.get("tie_word_embeddings", False):
        t["lm_head.weight"] = r(V, D)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + r(D)
        t[p + "post_attention_layernorm.weight"] = 1 + r(D)
        t[p + "self_attn.q_proj.weight"] = r(H * hd, D)
        t[p + "self_attn.k_proj.weight"] = r(K * hd, D)
        t[p + "self_attn.v_proj.weight"] = r(K * hd, D)
        t[p + "self_attn.o_proj.weight"] = r(D, H * hd)
        if hf["model_type"] != "llama":
            t[p + "self_attn.q_norm.weight"] = 1 + r(hd)
            t[p + "self_attn.k_norm.weight"] = 1 + r(hd)
        if hf["model_type"] == "qwen3_moe" and i not in hf["mlp_only_layers"]:
            E, Fe = hf["num_experts"], hf["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = 3 * r(E, D)
            for e in range(E):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = r(Fe, D)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = r(Fe, D)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = r(D, Fe)
        else:
            t[p + "mlp.gate_proj.weight"] = r(F, D)
            t[p + "mlp.up_proj.weight"] = r(F, D)
            t[p + "mlp.down_proj.weight"] = r(D, F)
    return t


def _write(folder, hf: dict, tensors: dict, shards: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names = sorted(tensors)
    wm = {}
    for k in range(shards):
        f = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, str(folder / f))
        wm.update({n: f for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


def _np_params_from_hf(hf: dict, t: dict) -> dict:
    """The reference forward's parameter dict, straight from the HF tensors."""
    f = lambda a: np.asarray(a, np.float64)
    layers = []
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        d = dict(
            attn_norm=f(t[p + "input_layernorm.weight"]),
            mlp_norm=f(t[p + "post_attention_layernorm.weight"]),
            **{k: f(t[p + f"self_attn.{k}_proj.weight"]) for k in "qkvo"},
        )
        if p + "self_attn.q_norm.weight" in t:
            d["q_norm"] = f(t[p + "self_attn.q_norm.weight"])
            d["k_norm"] = f(t[p + "self_attn.k_norm.weight"])
        if p + "mlp.gate.weight" in t:
            E = hf["num_experts"]
            d["router"] = f(t[p + "mlp.gate.weight"])
            for proj in ("gate", "up", "down"):
                d[f"w_{proj}"] = np.stack(
                    [f(t[p + f"mlp.experts.{e}.{proj}_proj.weight"]).T for e in range(E)]
                )
        else:
            d.update({k: f(t[p + f"mlp.{k}_proj.weight"]) for k in ("gate", "up", "down")})
        layers.append(d)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return dict(
        embed=f(t["model.embed_tokens.weight"]),
        layers=layers,
        norm=f(t["model.norm.weight"]),
        head=f(head),
    )


@pytest.mark.parametrize(
    "kind,shards,in_place",
    [("llama", 1, False), ("qwen3", 2, True), ("qwen3_moe", 3, False), ("qwen3_moe", 1, True)],
)
def test_load_hf_naming_and_logits(kind, shards, in_place, tmp_path, monkeypatch):
    if in_place:  # every parameter filled on the device, in chunks of a few rows
        monkeypatch.setattr(_hf, "_INPLACE_BYTES", 0)
        monkeypatch.setattr(_hf, "_CHUNK_BYTES", 200)
    hf = _hf_config(kind)
    tensors = _hf_tensors(hf)
    _write(tmp_path, hf, tensors, shards)
    model = load_hf(tmp_path)
    cfg = model.config
    assert cfg == config_from_hf(hf)
    if kind == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_seq_len == 8
    np.testing.assert_array_equal(
        np.asarray(model.layers[-1].attn.q_proj.weight[-1]),
        tensors[f"model.layers.{cfg.n_layers - 1}.self_attn.q_proj.weight"],
    )
    if kind == "qwen3_moe":
        assert cfg.moe is not None and cfg.moe.n_dense_layers == 1
        mlp = model.layers[1].mlp
        assert isinstance(mlp, MoE)
        np.testing.assert_array_equal(
            np.asarray(mlp.w_down[1, 2]),
            tensors["model.layers.2.mlp.experts.2.down_proj.weight"].T,
        )
    tokens = jr.randint(jr.key(0), (2, 10), 0, cfg.vocab_size)
    logits = eqx.filter_jit(lambda m, t: m(t))(model, tokens)
    moe_fn = np_moe(cfg.moe) if cfg.moe is not None else None
    want = np_forward(_np_params_from_hf(hf, tensors), cfg, np.asarray(tokens), moe_fn=moe_fn)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_bit_exact(kind, dtype, tmp_path, monkeypatch):
    if dtype == jnp.bfloat16:  # bfloat16 parameters filled in place, as their bits
        monkeypatch.setattr(_hf, "_INPLACE_BYTES", 0)
        monkeypatch.setattr(_hf, "_CHUNK_BYTES", 200)
    hf = _hf_config(kind)
    _write(tmp_path / "a", hf, _hf_tensors(hf, seed=1))
    policy = Policy(Phi2D(), TwoWayEC())
    model = load_hf(tmp_path / "a", policy=policy, dtype=dtype)
    save_hf(model, tmp_path / "b")
    save_hf(model, tmp_path / "c", shards=2)
    header = _hf._read_header(tmp_path / "b" / "model.safetensors")
    assert {e.dtype for e in header.values()} == {np.dtype(dtype)}
    for folder in ("b", "c"):
        again = load_hf(tmp_path / folder, policy=policy, dtype=dtype)
        assert again.config == model.config
        a, b = eqx.filter(model, eqx.is_array), eqx.filter(again, eqx.is_array)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    assert (tmp_path / "c" / "model.safetensors.index.json").exists()


def test_round_trip_random_model_with_shared_experts(tmp_path, getkey):
    """A model Hugging Face has no class for (shared experts, no QK-norm) still round-trips."""
    from .test_moe import MICRO_DS

    model = Llama(MICRO_DS, None, key=getkey())
    save_hf(model, tmp_path)
    again = load_hf(tmp_path)
    assert again.config == model.config
    for x, y in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_options_and_errors(tmp_path):
    hf = _hf_config("qwen3")
    tensors = _hf_tensors(hf)
    _write(tmp_path / "ok", hf, tensors)
    m = load_hf(tmp_path / "ok", dtype=jnp.bfloat16, compute_dtype="bfloat16", remat=True)
    assert m.embed.dtype == jnp.bfloat16 and m.config.remat
    logits = eqx.filter_jit(lambda m, t: m(t))(m, jnp.zeros((1, 4), jnp.int32))
    assert logits.dtype == jnp.float32
    with pytest.raises(NotImplementedError, match="model_type"):
        config_from_hf(dict(hf, model_type="gemma"))
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        config_from_hf(dict(hf, rope_scaling=dict(rope_type="yarn", factor=4.0)))
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    _write(tmp_path / "missing", hf, missing)
    with pytest.raises(KeyError, match="k_norm"):
        load_hf(tmp_path / "missing")
    _write(
        tmp_path / "extra", hf, dict(tensors, **{"model.layers.9.foo": np.zeros(2, np.float32)})
    )
    with pytest.raises(ValueError, match="does not use"):
        load_hf(tmp_path / "extra")
    _write(tmp_path / "shape", dict(hf, intermediate_size=40), tensors)
    with pytest.raises(ValueError, match="shape"):
        load_hf(tmp_path / "shape")


def _bases() -> dict[str, dict]:
    return {mt: _hf_config(mt) for mt in ("llama", "qwen3", "qwen3_moe")}


# Keys that replace one another: testing one drops the other from the base config.
_TWINS = {
    "num_local_experts": "num_experts",
    "num_experts": "num_local_experts",
    "rope_parameters": "rope_scaling",
    "rope_scaling": "rope_parameters",
}


def _with(base: dict, key: str, value) -> dict:
    out = {k: v for k, v in base.items() if k != _TWINS.get(key)}
    out[key] = value
    return out


@pytest.mark.parametrize("key", sorted(_hf._KEYS))
def test_every_config_key_is_read_checked_or_ignored(key):
    """`read` keys change the configuration, `checked` ones raise naming the key at a value
    s3req does not implement, `ignored` ones change nothing (the table of the models guide)."""
    spec = _hf._KEYS[key]
    bases = {mt: b for mt, b in _bases().items() if not spec.classes or mt in spec.classes}
    if spec.kind == "read" and key != "model_type":
        changed = []
        for mt, base in bases.items():
            try:
                changed.append(
                    config_from_hf(_with(base, key, spec.example)) != config_from_hf(base)
                )
            except (ValueError, NotImplementedError):
                pass
        assert any(changed), f"{key}: {spec.example!r} changes no configuration"
    if spec.refused is not None:
        for base in bases.values():
            with pytest.raises(NotImplementedError, match=f"`{key}: "):
                config_from_hf(_with(base, key, spec.refused))
    if spec.kind == "checked":
        assert spec.refused is not None
    if spec.kind == "ignored":
        for base in bases.values():
            assert config_from_hf(dict(base, **{key: ["junk"]})) == config_from_hf(base)


def test_guide_lists_every_config_key():
    """The table in docs/guides/models.md is `_hf._keys_markdown()` (regenerate it with
    `python -c "from models._hf import _keys_markdown; print(_keys_markdown())"`)."""
    page = (pathlib.Path(__file__).resolve().parent.parent / "docs/guides/models.md").read_text()
    start, end = "<!-- hf-keys:start -->\n", "\n<!-- hf-keys:end -->"
    assert start in page and end in page
    assert page.split(start)[1].split(end)[0] == _hf._keys_markdown()


def test_older_and_newer_config_forms_agree():
    """The same model written by transformers 5 and by older versions: one configuration."""
    new = dict(
        _hf_config("qwen3_moe"),
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        num_local_experts=4,
        dtype="bfloat16",
    )
    del new["num_experts"]
    old = dict(_hf_config("qwen3_moe"), rope_theta=1e6, rope_scaling=None, torch_dtype="bfloat16")
    assert config_from_hf(new) == config_from_hf(old)
    moe = config_from_hf(new).moe
    assert config_from_hf(new).rope_theta == 1e6 and moe is not None and moe.n_experts == 4
    both = dict(new, num_experts=5)
    with pytest.raises(ValueError, match="disagree"):
        config_from_hf(both)
    llama = _hf_config("llama")  # older form: rope_theta 500 and llama3 rope_scaling
    moved = dict(llama, rope_parameters=dict(llama["rope_scaling"], rope_theta=500.0))
    del moved["rope_scaling"], moved["rope_theta"]
    assert config_from_hf(moved) == config_from_hf(llama)
    assert config_from_hf(dict(llama, rope_parameters=moved["rope_parameters"])) == config_from_hf(
        llama
    )
    with pytest.raises(ValueError, match="disagree"):
        config_from_hf(dict(llama, rope_parameters=dict(rope_type="default", rope_theta=500.0)))


def test_load_holds_one_copy_of_the_parameters(tmp_path):
    """The peak resident memory of a fresh process loading a 420 MB float32 model from a
    bfloat16 checkpoint stays below 1.5 copies of the parameters: a loader that held the
    parameters twice (say, all tensors read, then converted) would need 2 copies."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parent.parent / "experiments/hf_load_memory.py"
    spec = importlib.util.spec_from_file_location("hf_load_memory", path)
    assert spec is not None and spec.loader is not None
    mem = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mem)
    config = LlamaConfig(
        vocab_size=4096, max_seq_len=64, d_model=1024, n_layers=6, n_heads=8, n_kv_heads=2,
        d_ff=4096,
    )  # fmt: skip
    mem.write_checkpoint(config, tmp_path, shards=3)
    r = mem.measure_load(tmp_path, "float32")
    assert r["params"] == 4 * count_params(config)
    assert r["transient"] < r["params"] / 2, r
