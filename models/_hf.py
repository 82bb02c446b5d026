"""Local Hugging Face checkpoints (Llama, Qwen3, Qwen3-MoE): `load_hf` and `save_hf`.

Only `config.json` and `*.safetensors` files are read; nothing is downloaded. Both
generations of `config.json` are understood: transformers 5 (`rope_parameters`,
`num_local_experts`) and older ones (`rope_theta` / `rope_scaling`, `num_experts`). Every key
the transformers config classes of these architectures define has a row in `_KEYS`: read,
accepted only at the value s3req implements, or ignored because it does not change the maths.

The safetensors files are read and written here, tensor by tensor (row chunks of at most
`_CHUNK_BYTES`), with NumPy (bfloat16 as JAX's `ml_dtypes` type): the `safetensors`
package's NumPy backend cannot hold bfloat16, and reading into preallocated parameters keeps
the peak memory of `load_hf` at one copy of the parameters plus a few chunks.

Weight layouts: a Hugging Face `nn.Linear` weight is `(out, in)`, as [`s3req.QuantLinear`][];
expert weights are stacked as `(n_experts, in, out)`.
"""

import dataclasses
import functools as ft
import json
import math
import operator
import pathlib
import typing
from collections.abc import Callable, Iterator

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
_ALL = ("llama", "qwen3", "qwen3_moe")
_QWEN = ("qwen3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class _Key:
    """How `config_from_hf` treats one key of a `config.json`.

    `classes`: the model types whose transformers config class defines the key as a field
    (empty for keys of older generations, keys transformers 5 writes under another name, and
    s3req's own). `kind`: `read` (sets part of the `LlamaConfig`), `checked` (accepted only at
    the value s3req implements; any other value raises `NotImplementedError` naming the key)
    or `ignored` (does not change the logits or the training maths). `example`: a value that
    changes the configuration (`read` keys); `refused`: a value that raises (tests).
    """

    classes: tuple[str, ...]
    kind: typing.Literal["read", "checked", "ignored"]
    note: str
    example: typing.Any = None
    refused: typing.Any = None


_LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)

_KEYS: dict[str, _Key] = {
    "model_type": _Key(
        (), "read", "the architecture: `llama`, `qwen3` or `qwen3_moe`", refused="gemma"
    ),
    # Fields of transformers' `PreTrainedConfig`, the base of every config class.
    "transformers_version": _Key(_ALL, "ignored", "metadata"),
    "architectures": _Key(_ALL, "ignored", "metadata; the model follows `model_type`"),
    "output_hidden_states": _Key(_ALL, "ignored", "what transformers returns"),
    "return_dict": _Key(_ALL, "ignored", "what transformers returns"),
    "dtype": _Key(_ALL, "ignored", "the parameters get `load_hf`'s `dtype`"),
    "chunk_size_feed_forward": _Key(_ALL, "ignored", "not read by these models"),
    "is_encoder_decoder": _Key(_ALL, "checked", "must be `false`", refused=True),
    "id2label": _Key(_ALL, "ignored", "classification heads only"),
    "label2id": _Key(_ALL, "ignored", "classification heads only"),
    "problem_type": _Key(_ALL, "ignored", "classification heads only"),
    # Fields of the three architectures.
    "vocab_size": _Key(_ALL, "read", "`vocab_size`", example=41),
    "hidden_size": _Key(_ALL, "read", "`d_model`", example=48),
    "intermediate_size": _Key(_ALL, "read", "`d_ff` (of the dense layers)", example=40),
    "num_hidden_layers": _Key(_ALL, "read", "`n_layers`", example=3),
    "num_attention_heads": _Key(_ALL, "read", "`n_heads`", example=8),
    "num_key_value_heads": _Key(
        _ALL, "read", "`n_kv_heads` (null: `num_attention_heads`)", example=4
    ),
    "head_dim": _Key(
        ("llama", "qwen3"),
        "read",
        "`head_dim`; absent or null: `hidden_size // num_attention_heads` (llama, qwen3_moe, "
        "whose modeling code reads it too), 128 (qwen3)",
        example=16,
    ),
    "hidden_act": _Key(_ALL, "checked", 'must be `"silu"`', refused="gelu"),
    "max_position_embeddings": _Key(
        _ALL,
        "read",
        "`max_seq_len`; also the default `original_max_position_embeddings` of `llama3` rope",
        example=32,
    ),
    "initializer_range": _Key(_ALL, "ignored", "initialisation only"),
    "rms_norm_eps": _Key(_ALL, "read", "`norm_eps` (every RMSNorm, QK-norm included)", 1e-5),
    "use_cache": _Key(_ALL, "ignored", "inference cache"),
    "pad_token_id": _Key(_ALL, "ignored", "tokenizer id (marks an embedding row at init)"),
    "bos_token_id": _Key(_ALL, "ignored", "tokenizer id"),
    "eos_token_id": _Key(_ALL, "ignored", "tokenizer id"),
    "tie_word_embeddings": _Key(
        _ALL,
        "read",
        "`tie_embeddings`; a stored `lm_head.weight` is then unused, as in transformers",
        example=True,
    ),
    "rope_parameters": _Key(
        _ALL,
        "read",
        "`rope_theta`, `rope_scaling`: `rope_type` `default` or `llama3`, with the keys "
        "`rope_theta`, `factor`, `low_freq_factor`, `high_freq_factor`, "
        "`original_max_position_embeddings` and `partial_rotary_factor` = 1; other rope "
        "types, other keys and dicts per layer type are refused",
        example=dict(rope_type="default", rope_theta=5e5),
        refused=dict(rope_type="yarn", factor=4.0),
    ),
    "attention_bias": _Key(_ALL, "checked", "must be `false`", refused=True),
    "attention_dropout": _Key(_ALL, "checked", "must be 0 (no dropout)", refused=0.1),
    "pretraining_tp": _Key(
        ("llama",),
        "ignored",
        "not read by transformers 5; older versions split the same products into slices",
    ),
    "mlp_bias": _Key(("llama",), "checked", "must be `false`", refused=True),
    "use_sliding_window": _Key(_QWEN, "checked", "must be `false`", refused=True),
    "sliding_window": _Key(_QWEN, "ignored", "used only with `use_sliding_window`"),
    "max_window_layers": _Key(("qwen3",), "ignored", "used only with `use_sliding_window`"),
    "layer_types": _Key(
        ("qwen3",),
        "checked",
        'every entry must be `"full_attention"`',
        refused=["full_attention", "sliding_attention"],
    ),
    "num_experts": _Key(
        ("qwen3_moe",),
        "read",
        "`moe.n_experts` (older name; transformers 5 writes `num_local_experts`); 0 is refused",
        example=8,
        refused=0,
    ),
    "num_experts_per_tok": _Key(("qwen3_moe",), "read", "`moe.top_k`", example=1),
    "moe_intermediate_size": _Key(("qwen3_moe",), "read", "`moe.d_expert`", example=24),
    "norm_topk_prob": _Key(
        ("qwen3_moe",), "read", "`moe.norm_topk_prob` (default `false`)", example=False
    ),
    "router_aux_loss_coef": _Key(("qwen3_moe",), "read", "`moe.aux_loss_coef`", example=0.01),
    "output_router_logits": _Key(
        ("qwen3_moe",),
        "ignored",
        "whether transformers adds the auxiliary loss; `Llama.forward` always returns it",
    ),
    "decoder_sparse_step": _Key(
        ("qwen3_moe",),
        "read",
        "with `mlp_only_layers`, which layers are MoE (`moe.n_dense_layers`): the dense layers "
        "must come first",
        example=3,
        refused=2,
    ),
    "mlp_only_layers": _Key(
        ("qwen3_moe",),
        "read",
        "dense layers (`moe.n_dense_layers`); they must be the first ones",
        example=[0, 1],
        refused=[1],
    ),
    # Keys of older generations, and names transformers 5 writes that are not fields.
    "num_local_experts": _Key(
        (), "read", "`moe.n_experts` (transformers 5's name; must agree with `num_experts`)", 6
    ),
    "rope_theta": _Key((), "read", "older place of `rope_parameters.rope_theta`", 5e5),
    "rope_scaling": _Key(
        (),
        "read",
        "older name of `rope_parameters` (it wins when both are given, as in transformers; "
        "they must agree)",
        example=_LLAMA3,
        refused=dict(type="linear", factor=2.0),
    ),
    "partial_rotary_factor": _Key((), "checked", "older place; must be 1", refused=0.5),
    "original_max_position_embeddings": _Key(
        (),
        "read",
        "top-level place of the `llama3` pre-training length; wins over the one in "
        "`rope_parameters`, as in transformers",
        16,
    ),
    "torch_dtype": _Key((), "ignored", "older name of `dtype`"),
    "output_attentions": _Key((), "ignored", "what transformers returns"),
    "_name_or_path": _Key((), "ignored", "metadata"),
    "quantization_config": _Key(
        (), "checked", "must be absent (quantized weights)", refused={"quant_method": "fp8"}
    ),
    "per_layer_config": _Key((), "checked", "must be absent (layers differ)", refused={"0": {}}),
    # Keys `save_hf` adds for models transformers has no class for.
    "qk_norm": _Key((), "read", "s3req: `qk_norm` (default: false for llama, else true)", True),
    "n_shared_experts": _Key((), "read", "s3req: `moe.n_shared_experts`", example=1),
    "router_z_loss_coef": _Key((), "read", "s3req: `moe.z_loss_coef`", example=1e-3),
}

# The defaults of the transformers config classes, for keys a `config.json` may omit.
_DEFAULTS: dict[str, dict[str, typing.Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=None,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        moe_intermediate_size=768,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
        mlp_only_layers=None,
    ),
}
_DEFAULT_THETA = 10_000.0
_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
}


def _keys_markdown() -> str:
    """The table of `_KEYS` for the models guide (checked against the page by a test)."""
    kinds = {"read": "read", "checked": "checked", "ignored": "ignored"}
    rows = ["| key | field of the transformers 5 class of | treatment | what s3req does |"]
    rows.append("| --- | --- | --- | --- |")
    for name, k in _KEYS.items():
        classes = ", ".join(k.classes) if k.classes else "—"
        rows.append(f"| `{name}` | {classes} | {kinds[k.kind]} | {k.note} |")
    return "\n".join(rows)


def _refuse(key: str, value: typing.Any, why: str) -> typing.NoReturn:
    raise NotImplementedError(f"load_hf: `{key}: {json.dumps(value)}` is not supported: {why}.")


def _check(hf: dict[str, typing.Any]) -> None:
    """Raise for every `checked` key whose value s3req does not implement."""
    ok: dict[str, Callable[[typing.Any], bool]] = {
        "is_encoder_decoder": lambda v: not v,
        "hidden_act": lambda v: v == "silu",
        "attention_bias": lambda v: not v,
        "attention_dropout": lambda v: not v,
        "mlp_bias": lambda v: not v,
        "use_sliding_window": lambda v: not v,
        "layer_types": lambda v: v is None or all(t == "full_attention" for t in v),
        "partial_rotary_factor": lambda v: v is None or v == 1,
        "quantization_config": lambda v: v is None,
        "per_layer_config": lambda v: v is None,
    }
    assert set(ok) == {n for n, k in _KEYS.items() if k.kind == "checked"}
    for key, accept in ok.items():
        if key in hf and not accept(hf[key]):
            _refuse(key, hf[key], _KEYS[key].note)


def _rope(hf: dict[str, typing.Any]) -> tuple[float, RopeScaling | None]:
    """`rope_theta` and the scaling, from `rope_parameters` or the older `rope_theta` /
    `rope_scaling`, with transformers' precedence (`rope_scaling` over `rope_parameters`, a
    `rope_theta` inside the dict over the top-level one)."""
    params, legacy = hf.get("rope_parameters"), hf.get("rope_scaling")

    def resolve(d: typing.Any, key: str) -> tuple[str, float, tuple]:
        if not isinstance(d, dict):
            raise ValueError(f"load_hf: `{key}` must be a dict, got {d!r}.")
        if d and all(isinstance(v, dict) or v is None for v in d.values()):
            _refuse(key, d, "rope parameters per layer type")
        kind = d.get("rope_type", d.get("type", "default"))
        if kind not in _ROPE_KEYS:
            _refuse(key, d, f"rope type {kind!r} (only `default` and `llama3`)")
        extra = sorted(set(d) - _ROPE_KEYS[kind])
        if extra:
            _refuse(key, d, f"the key {extra[0]!r} is not implemented for rope type {kind!r}")
        if d.get("partial_rotary_factor", 1) != 1:
            _refuse(key, d, "partial rotary embeddings")
        theta = next((t for t in (d.get("rope_theta"), hf.get("rope_theta")) if t), None)
        orig = hf.get("original_max_position_embeddings")
        if orig is None:
            orig = d.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        scale = tuple(d.get(k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        return kind, float(theta or _DEFAULT_THETA), scale + (orig,) if kind != "default" else ()

    if legacy is None:
        kind, theta, scale = resolve(params or {}, "rope_parameters")
    else:
        kind, theta, scale = resolve(legacy, "rope_scaling")
    if legacy is not None and params is not None:
        if resolve(params, "rope_parameters") != (kind, theta, scale):
            raise ValueError(
                f"load_hf: `rope_scaling` {legacy} and `rope_parameters` {params} disagree."
            )
    if kind == "default":
        return theta, None
    if any(v is None for v in scale):
        raise ValueError(f"load_hf: llama3 rope parameters are incomplete: {legacy or params}.")
    factor, low, high, orig = scale
    return theta, RopeScaling(float(factor), float(low), float(high), int(orig))


def _moe(hf: dict[str, typing.Any], n_layers: int) -> MoEConfig:
    new, old = hf.get("num_local_experts"), hf.get("num_experts")
    if new is not None and old is not None and new != old:
        raise ValueError(
            f"load_hf: `num_local_experts` ({new}) and `num_experts` ({old}) disagree."
        )
    n_experts = int(next((n for n in (new, old) if n is not None), 128))  # the class default
    if n_experts < 1:
        _refuse("num_experts", n_experts, "a Qwen3-MoE without experts")
    step = int(hf["decoder_sparse_step"])
    if step < 1:
        raise ValueError(f"load_hf: `decoder_sparse_step` must be >= 1, got {step}.")
    dense = set(hf["mlp_only_layers"] or [])
    sparse = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    n_dense = n_layers - len(sparse)
    if not sparse or sparse != list(range(n_dense, n_layers)):
        why = f"MoE layers {sparse} of {n_layers}; the dense layers must come first"
        key = "mlp_only_layers" if step == 1 else "decoder_sparse_step"
        _refuse(key, hf[key], why)
    return MoEConfig(
        n_experts=n_experts,
        top_k=int(hf["num_experts_per_tok"]),
        d_expert=int(hf["moe_intermediate_size"]),
        n_shared_experts=int(hf.get("n_shared_experts", 0)),
        aux_loss_coef=float(hf["router_aux_loss_coef"]),
        z_loss_coef=float(hf.get("router_z_loss_coef", 0.0)),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        n_dense_layers=n_dense,
    )


def config_from_hf(hf: dict[str, typing.Any], **overrides: typing.Any) -> LlamaConfig:
    """A [`models.LlamaConfig`][] from the dict of a Hugging Face `config.json`.

    Supports `model_type` `llama`, `qwen3` and `qwen3_moe`, in the form transformers 5 writes
    (`rope_parameters`, `num_local_experts`) and the older one (`rope_theta`,
    `rope_scaling`, `num_experts`), plus the extra keys `save_hf` writes for models Hugging
    Face has no class for. Keys a `config.json` omits take the defaults of the transformers
    config class. Every key that changes the maths and is not implemented (biases, rope
    types other than Llama-3, sliding windows, interleaved sparse layers, quantized weights,
    ...) raises `NotImplementedError` naming the key; the models guide lists every key.

    **Arguments:**

    - `hf`: the parsed `config.json`.
    - `overrides`: fields to replace afterwards, e.g. `compute_dtype="bfloat16"`.

    **Returns:**

    The configuration.
    """
    mt = hf.get("model_type")
    if mt not in _ARCH:
        _refuse("model_type", mt, f"use one of {', '.join(_ARCH)}")
    _check(hf)
    hf = {**_DEFAULTS[mt], **hf}
    n_heads = int(hf["num_attention_heads"])
    n_layers = int(hf["num_hidden_layers"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads == int(hf["hidden_size"]):
        head_dim = None  # the default, d_model // n_heads
    theta, scaling = _rope(hf)
    cfg = LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        max_seq_len=int(hf["max_position_embeddings"]),
        d_model=int(hf["hidden_size"]),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        d_ff=int(hf["intermediate_size"]),
        head_dim=None if head_dim is None else int(head_dim),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=bool(hf.get("qk_norm", mt != "llama")),
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        norm_eps=float(hf["rms_norm_eps"]),
        moe=_moe(hf, n_layers) if mt == "qwen3_moe" else None,
    )
    return dataclasses.replace(cfg, **overrides)


def config_to_hf(config: LlamaConfig) -> dict[str, typing.Any]:
    """The Hugging Face `config.json` dict of a configuration (inverse of `config_from_hf`).

    Dense models become `llama` (or `qwen3` with QK-norm), MoE models `qwen3_moe`. The rope
    parameters and the expert count are written in both generations' keys
    (`rope_parameters` and `rope_theta` / `rope_scaling`; `num_local_experts` and
    `num_experts`), so transformers 5 and older versions read the same model. Options
    Qwen3-MoE lacks (shared experts, no QK-norm, z-loss) are written as extra keys that
    `load_hf` reads back; `transformers` cannot load such a checkpoint faithfully.
    """
    c = config
    mt = "qwen3_moe" if c.moe is not None else ("qwen3" if c.qk_norm else "llama")
    rope: dict[str, typing.Any] = dict(rope_type="default", rope_theta=c.rope_theta)
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_seq_len,
        )
    legacy = {k: v for k, v in rope.items() if k != "rope_theta"}
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
        rope_parameters=rope,
        rope_theta=c.rope_theta,
        rope_scaling=None if c.rope_scaling is None else legacy,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
    )
    if mt == "llama":
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
    if c.moe is not None:
        m = c.moe
        hf.update(
            num_local_experts=m.n_experts,
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


# ---------------------------------------------------------------------------------------------
# safetensors files, read and written tensor by tensor.

_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(jnp.bfloat16),
}
_CODES = {v: k for k, v in _DTYPES.items()}
_CHUNK_BYTES = 1 << 22  # rows read (and converted) per step: 4 MiB
_INPLACE_BYTES = 1 << 24  # larger parameters are filled in place on the device: 16 MiB


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of the first byte, from the start of the file


def _read_header(file: pathlib.Path) -> dict[str, _Entry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, 1 << 27):
            raise ValueError(f"load_hf: {file} is not a safetensors file.")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        if code not in _DTYPES:
            raise ValueError(
                f"load_hf: tensor {name!r} in {file.name} has dtype {code}; only float tensors "
                f"({', '.join(_DTYPES)}) are supported."
            )
        nbytes = math.prod(shape) * _DTYPES[code].itemsize
        if end - begin != nbytes or 8 + n + end > size:
            raise ValueError(f"load_hf: tensor {name!r} in {file.name} is truncated or corrupt.")
        out[name] = _Entry(file, _DTYPES[code], shape, 8 + n + begin)
    return out


def _rows(entry: _Entry) -> Iterator[tuple[int, np.ndarray]]:
    """`(first row, rows)` chunks of a tensor of at most `_CHUNK_BYTES`, read from disk."""
    shape = entry.shape
    row = math.prod(shape[1:]) * entry.dtype.itemsize
    step = max(1, _CHUNK_BYTES // max(row, 1))
    with open(entry.file, "rb") as f:
        for start in range(0, shape[0], step):
            n = min(step, shape[0] - start)
            f.seek(entry.offset + start * row)
            chunk = np.fromfile(f, entry.dtype, count=n * (row // entry.dtype.itemsize))
            yield start, chunk.reshape((n,) + shape[1:])


@ft.partial(jax.jit, static_argnames="transpose", donate_argnums=0)
def _write_into(buf: jax.Array, starts: tuple, value: jax.Array, transpose: bool) -> jax.Array:
    """`buf` with `value` (of its dtype; transposed if asked) written at `starts`, in place."""
    v = value.T if transpose else value
    v = v.reshape((1,) * (buf.ndim - v.ndim) + v.shape)
    return jax.lax.dynamic_update_slice(buf, v, starts)


# XLA's CPU backend computes a bfloat16 dynamic_update_slice in float32 over the whole
# buffer (a full copy per chunk), so bfloat16 parameters are filled as their uint16 bits
# and reinterpreted once at the end (a donated bitcast, in place).
_BF16_BITS = np.dtype(np.uint16)


@ft.partial(jax.jit, donate_argnums=0)
def _bits_to_bf16(buf: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(buf, jnp.bfloat16)


_Buffer = np.ndarray | jax.Array


class _Reader:
    """The tensors of one or several safetensors files, by name."""

    def __init__(self, folder: pathlib.Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"load_hf: no *.safetensors file in {folder}.")
        self.entries: dict[str, _Entry] = {}
        for name in files:
            for tensor, entry in _read_header(folder / name).items():
                if tensor in self.entries:
                    raise ValueError(f"load_hf: tensor {tensor!r} is stored twice.")
                self.entries[tensor] = entry
        self.used: set[str] = set()

    def unused(self) -> list[str]:
        ignored = lambda n: n.endswith("rotary_emb.inv_freq")
        return sorted(n for n in self.entries if n not in self.used and not ignored(n))

    def __call__(self, name: str) -> _Entry:
        if name not in self.entries:
            raise KeyError(f"load_hf: tensor {name!r} is missing from the checkpoint.")
        self.used.add(name)
        return self.entries[name]

    def fill(self, buf: _Buffer, index: tuple[int, ...], name: str, transpose: bool = False):
        """Write tensor `name` into `buf[index]` (a 2-D one transposed if asked), chunk by
        chunk of rows."""
        entry = self(name)
        want = tuple(buf.shape[len(index) :])
        have = entry.shape[::-1] if transpose else entry.shape
        if have != want or not want:
            raise ValueError(
                f"load_hf: {name} has shape {entry.shape}, the config expects "
                f"{want[::-1] if transpose else want}."
            )
        return _fill_rows(buf, index, entry, transpose)


def _fill_rows(buf: _Buffer, index: tuple[int, ...], entry: _Entry, transpose: bool) -> _Buffer:
    for start, chunk in _rows(entry):
        at = (0, start) if transpose else (start,) + (0,) * (chunk.ndim - 1)
        if isinstance(buf, np.ndarray):
            v = chunk.T if transpose else chunk
            buf[index + tuple(slice(a, a + n) for a, n in zip(at, v.shape))] = v
        else:  # one chunk at a time: no queue of pending chunks builds up
            bits = buf.dtype == _BF16_BITS
            v = chunk.astype(_DTYPES["BF16"] if bits else buf.dtype)
            v = v.view(_BF16_BITS) if bits else v
            buf = _write_into(buf, index + at, v, transpose).block_until_ready()
    return buf


def _new_buffer(shape_dtype: jax.ShapeDtypeStruct, dtype: typing.Any) -> _Buffer:
    """A parameter to fill: a NumPy array when small (filled on the host, then copied to the
    device once), otherwise a device array filled in place by `_write_into`."""
    dt = np.dtype(jnp.dtype(dtype))
    if math.prod(shape_dtype.shape) * dt.itemsize <= _INPLACE_BYTES:
        return np.empty(shape_dtype.shape, dt)
    return jnp.zeros(shape_dtype.shape, _BF16_BITS if dt == _DTYPES["BF16"] else dt)


def _finish(buf: _Buffer) -> jax.Array:
    """The device array of a filled parameter."""
    if isinstance(buf, np.ndarray):
        return jnp.asarray(buf)
    return _bits_to_bf16(buf) if buf.dtype == _BF16_BITS else buf


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


def _fill_fused_experts(read: _Reader, buf: _Buffer, proj: str, prefix: str, j: int) -> _Buffer:
    """Expert weights in transformers 5's fused layout (`save_pretrained(...,
    save_original_format=False)`): `gate_up_proj` `(E, 2F, D)` (the gate rows first) and
    `down_proj` `(E, D, F)`, each expert's block an `(out, in)` weight."""
    fused = "down_proj" if proj == "down" else "gate_up_proj"
    name = f"{prefix}mlp.experts.{fused}"
    entry = read(name)
    E, n_in, n_out = buf.shape[1:]
    rows = n_out if proj == "down" else 2 * n_out
    if entry.shape != (E, rows, n_in):
        raise ValueError(f"load_hf: {name} has shape {entry.shape}, expected {(E, rows, n_in)}.")
    first = n_out if proj == "up" else 0
    for e in range(E):
        offset = entry.offset + (e * rows + first) * n_in * entry.dtype.itemsize
        block = _Entry(entry.file, entry.dtype, (n_out, n_in), offset)
        buf = _fill_rows(buf, (j, e), block, True)
    return buf


def load_hf(
    path: str | pathlib.Path,
    *,
    policy: AbstractPolicy | None = None,
    dtype: typing.Any = jnp.float32,
    **config_overrides: typing.Any,
) -> Llama:
    """Load a local Hugging Face Llama / Qwen3 / Qwen3-MoE checkpoint into a [`models.Llama`][].

    Reads `config.json` (either generation, see `config_from_hf`) and the weights from
    `model.safetensors`, from the shards listed in `model.safetensors.index.json`, or from
    every `*.safetensors` file of the folder; tensors may be float32, bfloat16, float16 or
    float64. Nothing is downloaded. Every parameter is allocated once in `dtype` and filled
    from the files in chunks of rows, so the peak memory is one copy of the parameters plus a
    few chunks (the models guide gives the measured figure).

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
    read = _Reader(folder)
    new = lambda shape_dtype: _new_buffer(shape_dtype, dtype)

    getters: list[Callable] = [lambda m: m.embed, lambda m: m.norm.weight]
    values = [
        _finish(read.fill(new(abstract.embed), (), "model.embed_tokens.weight")),
        _finish(read.fill(new(abstract.norm.weight), (), "model.norm.weight")),
    ]
    if not config.tie_embeddings:
        getters.append(lambda m: m.head)
        values.append(_finish(read.fill(new(abstract.head), (), "lm_head.weight")))
    for s, (moe, layer_ids) in enumerate(_stacks(config)):
        for field, names, experts in _layer_spec(config, moe):
            get = lambda m, s=s, field=field: operator.attrgetter(field)(m.layers[s])
            buf = new(get(abstract))
            for j, i in enumerate(layer_ids):
                prefix = f"model.layers.{i}."
                fused = prefix + "mlp.experts.gate_up_proj" in read.entries
                if experts and fused:
                    buf = _fill_fused_experts(read, buf, field[len("mlp.w_") :], prefix, j)
                    continue
                for e, name in enumerate(names(prefix)):
                    buf = read.fill(buf, (j, e) if experts else (j,), name, transpose=experts)
            getters.append(get)
            values.append(_finish(buf))
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


def _write_file(file: pathlib.Path, tensors: dict[str, Callable[[], np.ndarray]], specs) -> None:
    """A safetensors file from `name -> (dtype, shape)` specs and `name -> array` thunks,
    one tensor in memory at a time."""
    header: dict[str, typing.Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dt, shape) in specs.items():
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = dict(
            dtype=_CODES[dt], shape=list(shape), data_offsets=[offset, offset + nbytes]
        )
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in specs:
            f.write(np.ascontiguousarray(tensors[name]()).tobytes())


def save_hf(model: Llama, path: str | pathlib.Path, *, shards: int = 1) -> None:
    """Write `model` as a Hugging Face checkpoint: `config.json` and `model.safetensors`.

    Parameters are written in their own dtype (float32 by default, bfloat16 after
    `load_hf(..., dtype=jnp.bfloat16)`), so `load_hf` gives back the same model bit for bit,
    and `transformers`' `AutoModelForCausalLM.from_pretrained` reads Llama, Qwen3 and
    Qwen3-MoE models. Dense models are written as `llama` or `qwen3`, MoE models as
    `qwen3_moe` (see `config_to_hf`).

    **Arguments:**

    - `model`: the model.
    - `path`: the folder to write (created if needed).
    - `shards`: split the tensors over this many files `model-0000i-of-0000n.safetensors`
      with a `model.safetensors.index.json`, as large Hugging Face checkpoints are.
      (Keyword only argument.)
    """
    config = model.config
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Callable[[], np.ndarray]] = {
        "model.embed_tokens.weight": lambda: np.asarray(model.embed),
        "model.norm.weight": lambda: np.asarray(model.norm.weight),
    }
    specs = {
        "model.embed_tokens.weight": (np.dtype(model.embed.dtype), model.embed.shape),
        "model.norm.weight": (np.dtype(model.norm.weight.dtype), model.norm.weight.shape),
    }
    if model.head is not None:
        head = model.head
        tensors["lm_head.weight"] = lambda: np.asarray(head)
        specs["lm_head.weight"] = (np.dtype(head.dtype), head.shape)
    for s, (moe, layer_ids) in enumerate(_stacks(config)):
        stack = model.layers[s]
        if isinstance(stack.mlp, MoE) != moe:
            raise ValueError("save_hf: the model's layers do not match its config.")
        for field, names, experts in _layer_spec(config, moe):
            stacked = operator.attrgetter(field)(stack)
            per = stacked.shape[3:1:-1] if experts else stacked.shape[1:]
            for j, i in enumerate(layer_ids):
                for e, name in enumerate(names(f"model.layers.{i}.")):
                    if experts:
                        get = lambda a=stacked, j=j, e=e: np.asarray(a[j, e]).T
                    else:
                        get = lambda a=stacked, j=j: np.asarray(a[j])
                    tensors[name] = get
                    specs[name] = (np.dtype(stacked.dtype), tuple(per))
    hf = config_to_hf(config)
    hf["dtype"] = hf["torch_dtype"] = str(np.dtype(model.embed.dtype))
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if shards <= 1:
        _write_file(folder / "model.safetensors", tensors, specs)
        return
    names = list(tensors)
    weight_map = {}
    total = sum(math.prod(shape) * dt.itemsize for dt, shape in specs.values())
    for k in range(shards):
        part = names[k * len(names) // shards : (k + 1) * len(names) // shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        _write_file(folder / fname, tensors, {n: specs[n] for n in part})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
