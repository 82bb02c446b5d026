"""Local Hugging Face checkpoints (Llama, Qwen3, Qwen3-MoE): `load_hf` and `save_hf`.

Only `config.json` and `*.safetensors` files are read (with `safetensors`' NumPy backend);
nothing is downloaded. Weight layouts: a Hugging Face `nn.Linear` weight is `(out, in)`, as
[`s3req.QuantLinear`][]; expert weights are stacked as `(n_experts, in, out)`.
"""

import contextlib
import dataclasses
import json
import operator
import pathlib
import typing
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from s3req import AbstractPolicy

from ._config import LlamaConfig, MoEConfig, RopeScaling
from ._llama import Llama
from ._moe import MoE


_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def config_from_hf(hf: dict[str, typing.Any], **overrides: typing.Any) -> LlamaConfig:
    """A [`models.LlamaConfig`][] from the dict of a Hugging Face `config.json`.

    Supports `model_type` `llama`, `qwen3` and `qwen3_moe` (plus the extra keys `save_hf`
    writes for models Hugging Face has no class for). Options this library does not
    implement (attention or MLP biases, rope types other than Llama-3, sliding windows,
    interleaved sparse layers) raise `NotImplementedError`.

    **Arguments:**

    - `hf`: the parsed `config.json`.
    - `overrides`: fields to replace afterwards, e.g. `compute_dtype="bfloat16"`.

    **Returns:**

    The configuration.
    """
    mt = hf.get("model_type")
    if mt not in _ARCH:
        raise NotImplementedError(
            f"load_hf: model_type {mt!r} is not supported; use one of {sorted(_ARCH)}."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise NotImplementedError(f"load_hf: `{flag}: true` is not supported.")
    if hf.get("use_sliding_window"):
        raise NotImplementedError("load_hf: sliding-window attention is not supported.")
    if hf.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"load_hf: hidden_act {hf['hidden_act']!r} is not supported.")
    rs = hf.get("rope_scaling")
    scaling = None
    if rs is not None:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "llama3":
            scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_seq_len=int(rs["original_max_position_embeddings"]),
            )
        elif kind != "default":
            raise NotImplementedError(f"load_hf: rope_scaling type {kind!r} is not supported.")
    moe = None
    if mt == "qwen3_moe":
        if hf.get("decoder_sparse_step", 1) != 1:
            raise NotImplementedError("load_hf: decoder_sparse_step != 1 is not supported.")
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            raise NotImplementedError(
                f"load_hf: dense (mlp_only) layers must be the first ones, got {dense}."
            )
        moe = MoEConfig(
            n_experts=int(hf["num_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            d_expert=int(hf["moe_intermediate_size"]),
            n_shared_experts=int(hf.get("n_shared_experts", 0)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            z_loss_coef=float(hf.get("router_z_loss_coef", 0.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            n_dense_layers=len(dense),
        )
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] == hf["hidden_size"]:
        head_dim = None  # the default, d_model // n_heads
    cfg = LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        d_ff=int(hf["intermediate_size"]),
        head_dim=head_dim,
        rope_theta=float(hf.get("rope_theta", 10_000.0)),
        rope_scaling=scaling,
        qk_norm=bool(hf.get("qk_norm", mt != "llama")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        moe=moe,
    )
    return dataclasses.replace(cfg, **overrides)


def config_to_hf(config: LlamaConfig) -> dict[str, typing.Any]:
    """The Hugging Face `config.json` dict of a configuration (inverse of `config_from_hf`).

    Dense models become `llama` (or `qwen3` with QK-norm), MoE models `qwen3_moe`. Options
    Qwen3-MoE lacks (shared experts, no QK-norm, z-loss) are written as extra keys that
    `load_hf` reads back; `transformers` cannot load such a checkpoint faithfully.
    """
    c = config
    mt = "qwen3_moe" if c.moe is not None else ("qwen3" if c.qk_norm else "llama")
    hf: dict[str, typing.Any] = dict(
        architectures=[_ARCH[mt]],
        model_type=mt,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_seq_len,
        hidden_size=c.d_model,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        intermediate_size=c.d_ff,
        head_dim=c.d_head,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        torch_dtype="float32",
    )
    if mt == "llama":
        hf["mlp_bias"] = False
    if c.rope_scaling is not None:
        s = c.rope_scaling
        hf["rope_scaling"] = dict(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )
    if c.moe is not None:
        m = c.moe
        hf.update(
            num_experts=m.n_experts,
            num_experts_per_tok=m.top_k,
            moe_intermediate_size=m.d_expert,
            norm_topk_prob=m.norm_topk_prob,
            router_aux_loss_coef=m.aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=list(range(m.n_dense_layers)),
            output_router_logits=False,
        )
        if m.n_shared_experts:
            hf["n_shared_experts"] = m.n_shared_experts
        if m.z_loss_coef:
            hf["router_z_loss_coef"] = m.z_loss_coef
        if not c.qk_norm:
            hf["qk_norm"] = False
    return hf


# Each entry: (path inside a DecoderLayer, Hugging Face names of one layer, stacked experts?)
# An expert entry maps the (n_experts, in, out) array to n_experts transposed (out, in) tensors.
_Spec = list[tuple[str, Callable[[str], list[str]], bool]]


def _layer_spec(config: LlamaConfig, moe: bool) -> _Spec:
    one = lambda suffix: lambda p: [p + suffix]
    spec: _Spec = [
        ("attn_norm.weight", one("input_layernorm.weight"), False),
        ("mlp_norm.weight", one("post_attention_layernorm.weight"), False),
    ]
    for proj in ("q", "k", "v", "o"):
        spec.append((f"attn.{proj}_proj.weight", one(f"self_attn.{proj}_proj.weight"), False))
    if config.qk_norm:
        spec.append(("attn.q_norm.weight", one("self_attn.q_norm.weight"), False))
        spec.append(("attn.k_norm.weight", one("self_attn.k_norm.weight"), False))
    if not moe:
        for proj in ("gate", "up", "down"):
            spec.append((f"mlp.{proj}.weight", one(f"mlp.{proj}_proj.weight"), False))
        return spec
    assert config.moe is not None
    E = config.moe.n_experts
    spec.append(("mlp.router", one("mlp.gate.weight"), False))
    for proj in ("gate", "up", "down"):
        names = lambda p, proj=proj: [f"{p}mlp.experts.{e}.{proj}_proj.weight" for e in range(E)]
        spec.append((f"mlp.w_{proj}", names, True))
    if config.moe.n_shared_experts:
        for proj in ("gate", "up", "down"):
            spec.append(
                (f"mlp.shared.{proj}.weight", one(f"mlp.shared_experts.{proj}_proj.weight"), False)
            )
    return spec


def _stacks(config: LlamaConfig) -> list[tuple[bool, range]]:
    """(is MoE, global layer indices) of every layer stack of `Llama.layers`, in order."""
    n_dense = config.n_dense_layers
    out = []
    if n_dense:
        out.append((False, range(0, n_dense)))
    if config.n_layers > n_dense:
        out.append((True, range(n_dense, config.n_layers)))
    return out


class _Reader:
    """Tensors by name from one or several safetensors files (a context manager)."""

    def __init__(self, folder: pathlib.Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
            self.files = sorted(set(self.weight_map.values()))
        else:
            self.files = sorted(p.name for p in folder.glob("*.safetensors"))
            self.weight_map = None
        if not self.files:
            raise FileNotFoundError(f"load_hf: no *.safetensors file in {folder}.")
        self.folder = folder
        self.used: set[str] = set()

    def __enter__(self) -> "_Reader":
        from safetensors import safe_open

        self.exit = contextlib.ExitStack()
        self.handles = {
            f: self.exit.enter_context(safe_open(str(self.folder / f), framework="np"))
            for f in self.files
        }
        if self.weight_map is None:
            self.weight_map = {k: f for f, h in self.handles.items() for k in h.keys()}
        return self

    def __exit__(self, *exc) -> None:
        self.exit.close()

    def unused(self) -> list[str]:
        assert self.weight_map is not None
        ignored = lambda n: n.endswith("rotary_emb.inv_freq")
        return sorted(n for n in self.weight_map if n not in self.used and not ignored(n))

    def __call__(self, name: str) -> np.ndarray:
        assert self.weight_map is not None
        if name not in self.weight_map:
            raise KeyError(f"load_hf: tensor {name!r} is missing from the checkpoint.")
        self.used.add(name)
        return self.handles[self.weight_map[name]].get_tensor(name)


def load_hf(
    path: str | pathlib.Path,
    *,
    policy: AbstractPolicy | None = None,
    dtype: typing.Any = jnp.float32,
    **config_overrides: typing.Any,
) -> Llama:
    """Load a local Hugging Face Llama / Qwen3 / Qwen3-MoE checkpoint into a [`models.Llama`][].

    Reads `config.json` and the weights from `model.safetensors`, from the shards listed in
    `model.safetensors.index.json`, or from every `*.safetensors` file of the folder. Nothing
    is downloaded.

    **Arguments:**

    - `path`: the checkpoint folder.
    - `policy`: the rounding policy of the model, or `None` (float). (Keyword only.)
    - `dtype`: parameter dtype (default float32). (Keyword only.)
    - `config_overrides`: config fields to set, e.g. `compute_dtype="bfloat16"`,
      `remat=True`, `max_seq_len=4096`. (Keyword only.)

    **Returns:**

    The model; `model(tokens)` with int tokens `(batch, seq)` gives logits
    `(batch, seq, vocab)`.

    !!! Example

        ```python
        from models import load_hf
        from policies import Policy, Phi2D, TwoWayEC

        model = load_hf("/data/Llama-3.2-1B", policy=Policy(Phi2D(), TwoWayEC()))
        ```
    """
    folder = pathlib.Path(path)
    hf = json.loads((folder / "config.json").read_text())
    config = config_from_hf(hf, **config_overrides)
    abstract = eqx.filter_eval_shape(
        Llama, config, policy, key=jax.ShapeDtypeStruct((2,), jnp.uint32)
    )

    with _Reader(folder) as read:

        def put(shape_dtype, array: np.ndarray, name: str) -> jax.Array:
            if tuple(array.shape) != tuple(shape_dtype.shape):
                raise ValueError(
                    f"load_hf: {name} has shape {array.shape}, the config expects "
                    f"{shape_dtype.shape}."
                )
            return jnp.asarray(array, dtype=dtype)

        getters, values = [], []
        getters.append(lambda m: m.embed)
        values.append(put(abstract.embed, read("model.embed_tokens.weight"), "embed_tokens"))
        getters.append(lambda m: m.norm.weight)
        values.append(put(abstract.norm.weight, read("model.norm.weight"), "norm"))
        if not config.tie_embeddings:
            getters.append(lambda m: m.head)
            values.append(put(abstract.head, read("lm_head.weight"), "lm_head"))
        for s, (moe, layer_ids) in enumerate(_stacks(config)):
            for field, names, experts in _layer_spec(config, moe):
                per_layer = []
                for i in layer_ids:
                    tensors = [read(n) for n in names(f"model.layers.{i}.")]
                    per_layer.append(np.stack([t.T for t in tensors]) if experts else tensors[0])
                get = lambda m, s=s, field=field: operator.attrgetter(field)(m.layers[s])
                getters.append(get)
                values.append(put(get(abstract), np.stack(per_layer), f"layers.{field}"))
        if config.tie_embeddings:
            read.used.add("lm_head.weight")  # some tied checkpoints store the copy
        unused = read.unused()
        if unused:
            more = " ..." if len(unused) > 5 else ""
            raise ValueError(
                f"load_hf: the checkpoint has tensors this model does not use: {unused[:5]}{more}"
            )
    model = eqx.tree_at(lambda m: [g(m) for g in getters], abstract, values)
    missed = [x for x in jax.tree.leaves(model) if isinstance(x, jax.ShapeDtypeStruct)]
    assert not missed, f"load_hf: internal error, {len(missed)} parameters were not loaded."
    return model


def save_hf(model: Llama, path: str | pathlib.Path, *, shards: int = 1) -> None:
    """Write `model` as a Hugging Face checkpoint: `config.json` and `model.safetensors`.

    Parameters are written in their own dtype (float32 by default), so `load_hf` gives back
    the same model bit for bit. Dense models are written as `llama` or `qwen3`, MoE models as
    `qwen3_moe` (see `config_to_hf`).

    **Arguments:**

    - `model`: the model.
    - `path`: the folder to write (created if needed).
    - `shards`: split the tensors over this many files `model-0000i-of-0000n.safetensors`
      with a `model.safetensors.index.json`, as large Hugging Face checkpoints are.
      (Keyword only argument.)
    """
    from safetensors.numpy import save_file

    config = model.config
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(model.embed),
        "model.norm.weight": np.asarray(model.norm.weight),
    }
    if model.head is not None:
        tensors["lm_head.weight"] = np.asarray(model.head)
    for s, (moe, layer_ids) in enumerate(_stacks(config)):
        stack = model.layers[s]
        if isinstance(stack.mlp, MoE) != moe:
            raise ValueError("save_hf: the model's layers do not match its config.")
        for field, names, experts in _layer_spec(config, moe):
            stacked = np.asarray(operator.attrgetter(field)(stack))
            for j, i in enumerate(layer_ids):
                for e, name in enumerate(names(f"model.layers.{i}.")):
                    tensors[name] = stacked[j, e].T if experts else stacked[j]
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    total = sum(v.nbytes for v in tensors.values())
    for k in range(shards):
        part = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
