"""`load_hf` / `save_hf` against the real `transformers` (torch, CPU): random tiny checkpoints
saved by transformers itself, in its own config form and in the older one, float32 and
bfloat16, sharded; our model saved by `save_hf` and read by `AutoModelForCausalLM`; the table
of config keys against the transformers config classes. No hub access: every model is built
locally with random weights."""

import dataclasses
import importlib
import inspect
import json
import re
import shutil
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from models import config_from_hf, Llama, LlamaConfig, load_hf, MoEConfig, RopeScaling, save_hf
from models._hf import _KEYS


transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
)
torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[hf]')")

TOL = 2e-4  # max |ours - transformers| / max |transformers| over all logits
SEQ = 24

_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}
_BASE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
_HF_KINDS = {
    "llama": ("llama", dict(_BASE)),
    # Llama 3 rope: a large theta and the frequency scaling, with a pre-training length short
    # enough that the scaling changes the logits at SEQ tokens.
    "llama3": (
        "llama",
        dict(
            _BASE,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500_000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3": (
        "qwen3",
        dict(
            _BASE,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            _BASE,
            num_hidden_layers=3,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[0],
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        ),
    ),
}


def _randomize(model, seed: int) -> None:
    """Weights large enough that attention is far from uniform and routing decisive, so that a
    wrong rope or routing option shows in the logits (transformers' 0.02 init hides them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_(1 + 0.2 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / np.sqrt(p.shape[-1]))


def _old_form(hf: dict) -> dict:
    """The config.json of a transformers 5 checkpoint as transformers 4 wrote it: top-level
    `rope_theta` and `rope_scaling`, `num_experts`, `torch_dtype`."""
    old = dict(hf)
    rope = dict(old.pop("rope_parameters"))
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if "num_local_experts" in old:
        old["num_experts"] = old.pop("num_local_experts")
    old["torch_dtype"] = old.pop("dtype")
    old["transformers_version"] = "4.51.3"
    return old


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """`(kind, dtype) -> (folder of the transformers 5 form, folder of the older form)`."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, (mt, kwargs) in _HF_KINDS.items():
        model = transformers.AutoModelForCausalLM.from_config(_CLASSES[mt](**kwargs))
        _randomize(model, seed=len(out))
        for dtype in ("float32", "bfloat16"):
            new, old = root / f"{kind}-{dtype}", root / f"{kind}-{dtype}-old"
            model.to(getattr(torch, dtype)).save_pretrained(new, max_shard_size="40KB")
            shutil.copytree(new, old)
            hf = json.loads((new / "config.json").read_text())
            (old / "config.json").write_text(json.dumps(_old_form(hf)))
            out[kind, dtype] = new, old
    return out


def _tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, SEQ))


def _hf_logits(folder, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@eqx.filter_jit
def _logits(model, tokens):
    return model(tokens)


def _ours(model: Llama, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_logits(model, jnp.asarray(tokens, jnp.int32)))


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(_HF_KINDS))
def test_transformers_checkpoints_both_config_forms(checkpoints, kind, dtype):
    new, old = checkpoints[kind, dtype]
    assert len(list(new.glob("model-*.safetensors"))) > 1  # sharded, with an index
    assert (new / "model.safetensors.index.json").exists()
    hf = json.loads((new / "config.json").read_text())
    assert "rope_parameters" in hf and "rope_theta" not in hf  # the transformers 5 form
    tokens = _tokens(hf["vocab_size"])
    want = _hf_logits(new, tokens)
    # transformers reads the older form as the same model.
    np.testing.assert_array_equal(_hf_logits(old, tokens), want)
    config = config_from_hf(hf)
    assert config_from_hf(json.loads((old / "config.json").read_text())) == config
    for folder in (new, old):
        model = load_hf(folder)
        assert model.config == config and model.embed.dtype == jnp.float32
        assert _rel(_ours(model, tokens), want) < TOL
    # The options under test change the logits far beyond the tolerance, so a loader that
    # dropped them would fail above.
    wrong: dict[str, typing.Any]
    if config.moe is not None:
        wrong = dict(moe=dataclasses.replace(config.moe, norm_topk_prob=True))
    else:
        wrong = {
            "llama": dict(rope_theta=1e6),
            "llama3": dict(rope_scaling=None),
            "qwen3": dict(rope_theta=10_000.0),
        }[kind]
    assert _rel(_ours(load_hf(new, **wrong), tokens), want) > 50 * TOL


def test_fused_expert_layout(tmp_path):
    """transformers 5's in-memory expert layout (`save_original_format=False`) loads too."""
    mt, kwargs = _HF_KINDS["qwen3_moe"]
    model = transformers.AutoModelForCausalLM.from_config(_CLASSES[mt](**kwargs))
    _randomize(model, seed=7)
    model.save_pretrained(tmp_path, save_original_format=False)
    tokens = _tokens(kwargs["vocab_size"], seed=1)
    names = json.dumps(list(model.state_dict()))
    assert "experts.gate_up_proj" in names
    assert _rel(_ours(load_hf(tmp_path), tokens), _hf_logits(tmp_path, tokens)) < TOL


def _random_model(config: LlamaConfig, seed: int) -> Llama:
    """`Llama(config)` with random norms and unit-variance embeddings (the other weights keep
    their uniform +-1/sqrt(fan_in) initialisation)."""
    model = Llama(config, None, key=jr.key(seed))
    leaves, treedef = jax.tree.flatten(model)
    keys = jr.split(jr.key(seed + 1), len(leaves))
    out = []
    for x, k in zip(leaves, keys):
        if bool(jnp.all(x == 1)):  # a norm weight
            x = 1 + 0.2 * jr.normal(k, x.shape, x.dtype)
        out.append(x)
    model = jax.tree.unflatten(treedef, out)
    return eqx.tree_at(lambda m: m.embed, model, jr.normal(jr.key(seed + 2), model.embed.shape))


_OURS = {
    "llama3-rope": LlamaConfig(
        vocab_size=64,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16),
    ),
    "qwen3-tied": LlamaConfig(
        vocab_size=64,
        max_seq_len=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        head_dim=24,
        rope_theta=1e6,
        qk_norm=True,
        tie_embeddings=True,
        norm_eps=1e-6,
    ),
    "qwen3-moe": LlamaConfig(
        vocab_size=64,
        max_seq_len=64,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        head_dim=16,
        rope_theta=1e6,
        qk_norm=True,
        norm_eps=1e-6,
        moe=MoEConfig(n_experts=8, top_k=2, d_expert=32, n_dense_layers=1),
    ),
}


@pytest.mark.parametrize("name", list(_OURS))
def test_save_hf_read_by_transformers(name, tmp_path):
    """Our model -> `save_hf` -> `AutoModelForCausalLM.from_pretrained` -> the same logits,
    with float32 parameters (one file) and bfloat16 ones (two shards)."""
    config = _OURS[name]
    model = _random_model(config, seed=3)
    tokens = _tokens(config.vocab_size, seed=2)
    save_hf(model, tmp_path / "f32")
    assert _rel(_ours(model, tokens), _hf_logits(tmp_path / "f32", tokens)) < TOL
    half = load_hf(tmp_path / "f32", dtype=jnp.bfloat16)
    save_hf(half, tmp_path / "bf16", shards=2)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    want = _hf_logits(tmp_path / "bf16", tokens)
    assert _rel(_ours(load_hf(tmp_path / "bf16"), tokens), want) < TOL


def _class_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("mt", list(_CLASSES))
def test_keys_table_matches_the_transformers_classes(mt):
    """Every field of the transformers config class has a row, and the rows say which class
    defines them; every key transformers writes and every config attribute its modeling code
    reads has a row; a config.json that omits every key means the class defaults."""
    cls = _CLASSES[mt]
    listed = {k for k, v in _KEYS.items() if mt in v.classes}
    assert _class_fields(cls) == listed, (
        f"fields of {cls.__name__} without a row: {sorted(_class_fields(cls) - listed)}; "
        f"rows naming it that are not fields: {sorted(listed - _class_fields(cls))}"
    )
    written = set(cls().to_dict())
    assert written <= set(_KEYS), sorted(written - set(_KEYS))
    source = inspect.getsource(importlib.import_module(f"transformers.models.{mt}.modeling_{mt}"))
    reads = set(re.findall(r"config\.([a-z][a-z0-9_]*)", source))
    reads |= set(re.findall(r"getattr\((?:self\.)?config, \"([a-z][a-z0-9_]*)\"", source))
    assert reads <= set(_KEYS), sorted(reads - set(_KEYS))
    assert config_from_hf({"model_type": mt}) == config_from_hf(cls().to_dict())
