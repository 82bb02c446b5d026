"""The run configuration: `TrainConfig` (the one definition behind the CLI flags and the
`--config FILE.json` keys), its typed model overrides, and the model it builds."""

import dataclasses
import typing
from collections.abc import Mapping

import equinox as eqx
from jaxtyping import PRNGKeyArray

from ._data import load_data, TokenData


COMPUTE_DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("byte", "bpe")
# Fields that change nothing a training step computes: a resume may change them freely. Any
# other change makes the resumed run differ from every uninterrupted run.
FREE_ON_RESUME = ("out", "cache", "eval_every", "eval_batches", "log_every", "ckpt_every")
# Fields of `models.LlamaConfig` that a run sets itself rather than through `model`.
_RUN_SETS = {
    "vocab_size": "it is the tokenizer's vocabulary (set --tokenizer, --bpe-vocab)",
    "compute_dtype": "set the run's compute_dtype (--compute-dtype) instead",
    "rope_scaling": "the training presets use none; change it in a models.LlamaConfig",
}


def _float_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}


def _overrides_from_dict(cls, values: Mapping[str, typing.Any], where: str) -> dict:
    """Keyword arguments of `cls` from a JSON-style dict: dashes or underscores, integers
    accepted for float fields, unknown keys a `ValueError` that lists the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    floats = _float_fields(cls)
    kwargs = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in _RUN_SETS and where == "model":
            raise ValueError(f"Model option {key!r} cannot be overridden: {_RUN_SETS[name]}.")
        if name not in names:
            raise ValueError(f"Unknown {where} option {key!r}; valid: {', '.join(sorted(names))}.")
        if name in floats and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        kwargs[name] = value
    return kwargs


def _set_fields(obj) -> dict[str, typing.Any]:
    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if getattr(obj, f.name) is not None
    }


@dataclasses.dataclass(frozen=True)
class MoEOverrides:
    """Overrides of the preset's `models.MoEConfig` (`None`: keep the preset's value; a dense
    preset needs `n_experts`, `top_k` and `d_expert` to become a mixture of experts).
    Command line: `--model.moe.FIELD VALUE`; `--config` key: `{"model": {"moe": {...}}}`."""

    n_experts: int | None = None
    """Routed experts per layer."""
    top_k: int | None = None
    """Experts per token."""
    d_expert: int | None = None
    """Hidden width of each routed expert."""
    n_shared_experts: int | None = None
    """Shared experts (see every token)."""
    aux_loss_coef: float | None = None
    """Weight of the load-balancing loss."""
    z_loss_coef: float | None = None
    """Weight of the router z-loss."""
    norm_topk_prob: bool | None = None
    """Renormalise the chosen top-k probabilities."""
    n_dense_layers: int | None = None
    """The first this many layers keep a dense FFN."""


@dataclasses.dataclass(frozen=True)
class ModelOverrides:
    """Overrides of the model preset: the fields of `models.LlamaConfig` a run may change
    (`None`: keep the preset's value). Command line: `--model.FIELD VALUE`, e.g.
    `--model.d-model 192`; `--config` key: `{"model": {"d_model": 192}}`. The vocabulary
    comes from the tokenizer and the activation dtype from `TrainConfig.compute_dtype`."""

    max_seq_len: int | None = None
    """The longest sequence the model accepts."""
    d_model: int | None = None
    """Width of the residual stream."""
    n_layers: int | None = None
    """Decoder layers."""
    n_heads: int | None = None
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (divides n_heads)."""
    d_ff: int | None = None
    """Hidden width of the SwiGLU FFN."""
    head_dim: int | None = None
    """Width of a head (preset default: d_model // n_heads)."""
    rope_theta: float | None = None
    """RoPE base."""
    qk_norm: bool | None = None
    """RMSNorm on every query and key head (Qwen3)."""
    tie_embeddings: bool | None = None
    """The output head reuses the embedding matrix."""
    norm_eps: float | None = None
    """RMSNorm epsilon."""
    remat: bool | None = None
    """Rematerialise every layer in the backward pass."""
    moe: MoEOverrides = MoEOverrides()
    """Mixture-of-experts overrides."""

    @classmethod
    def from_dict(cls, values: Mapping[str, typing.Any]) -> "ModelOverrides":
        """The overrides of a dict such as `{"d_model": 192, "moe": {"top_k": 4}}` (the
        `model` key of a `--config` file); unknown keys raise a `ValueError` naming the
        valid ones."""
        if not isinstance(values, Mapping):
            raise ValueError(f"model: expected a dict of model options, got {values!r}.")
        kwargs = _overrides_from_dict(cls, values, "model")
        moe = kwargs.get("moe", {})
        if isinstance(moe, Mapping):
            kwargs["moe"] = MoEOverrides(**_overrides_from_dict(MoEOverrides, moe, "model.moe"))
        elif not isinstance(moe, MoEOverrides):
            raise ValueError(f"model.moe: expected a dict of MoE options, got {moe!r}.")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, typing.Any]:
        """The overrides that are set, as a JSON-serialisable dict (`moe` only when one of
        its fields is set)."""
        out = _set_fields(self)
        moe = _set_fields(self.moe)
        if moe:
            out["moe"] = moe
        else:
            out.pop("moe")
        return out

    def apply(self, cfg: typing.Any) -> typing.Any:
        """`cfg` (a `models.LlamaConfig`) with these overrides; its own checks then run
        (`ValueError`)."""
        import models

        kwargs = {k: v for k, v in _set_fields(self).items() if k != "moe"}
        moe = _set_fields(self.moe)
        if moe:
            if cfg.moe is not None:
                kwargs["moe"] = dataclasses.replace(cfg.moe, **moe)
            else:
                need = [n for n in ("n_experts", "top_k", "d_expert") if n not in moe]
                if need:
                    raise ValueError(
                        f"The preset has no mixture of experts: to add one, set model.moe "
                        f"{', '.join(need)} as well (--model.moe.n-experts, --model.moe.top-k, "
                        "--model.moe.d-expert)."
                    )
                kwargs["moe"] = models.MoEConfig(**moe)
        return dataclasses.replace(cfg, **kwargs)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run: the one definition of the options, from which
    the `s3req train` and `s3req compare` flags are generated (`--seq-len` sets `seq_len`,
    `--model.d-model` sets `model.d_model`) and whose fields are the keys of a
    `--config FILE.json`. Each field's description below is also its `--help` line.

    Every value is checked when the config is built (a `ValueError` that says what is
    allowed), the model preset and overrides included.

    The defaults train the `tiny` Llama with S3R-EC (two-way) on the Shakespeare plays, byte
    tokens, in a few minutes on two CPU cores.
    """

    preset: str = "tiny"
    """Model preset of models.get_config: tiny, tiny-moe, small, ..."""
    policy: str = "s3r-ec-2way"
    """Rounding preset: bf16, rtne, sr, s3r, s3r-ec-dx, s3r-ec-2way, ... (policies.PRESETS)."""
    steps: int = 300
    """Optimizer steps (0 only evaluates the initial model)."""
    batch: int = 16
    """Sequences per step."""
    seq_len: int = 128
    """Tokens per sequence, at most the model's max_seq_len."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup: int = 30
    """Linear warmup steps from 0 to lr."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, on matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    grad_clip: float = 1.0
    """Global-norm gradient clipping threshold (0 disables it)."""
    seed: int = 0
    """The seed of the run: model init, step keys and data windows derive from it."""
    data: str | None = None
    """Text file, folder of *.txt/*.md, or tokens .npy/.bin (None: Shakespeare's plays)."""
    tokenizer: str = "byte"
    """byte (vocabulary 256) or bpe (trained on the train split)."""
    bpe_vocab: int = 4096
    """BPE vocabulary size (257 to 65536)."""
    cache: str | None = None
    """Token-cache folder (None: $S3REQ_CACHE or ~/.cache/s3req)."""
    out: str | None = None
    """Run folder (None: write nothing; s3req train uses runs/PRESET-POLICY)."""
    eval_every: int = 100
    """Validate every this many steps and at the end (0: only at the end)."""
    eval_batches: int | None = 32
    """Validation batches per evaluation, spread over the stream (0 or None: all of it)."""
    log_every: int = 10
    """Write a metrics line every this many steps."""
    ckpt_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    compute_dtype: str = "float32"
    """Activation dtype, float32 or bfloat16 (parameters stay float32)."""
    model: ModelOverrides | Mapping[str, typing.Any] = ModelOverrides()
    """Overrides of the model preset (a dict such as {"d_model": 128} is converted)."""

    def __post_init__(self):
        from policies import PRESETS

        if not isinstance(self.model, ModelOverrides):
            object.__setattr__(self, "model", ModelOverrides.from_dict(self.model))
        if self.eval_batches == 0:
            object.__setattr__(self, "eval_batches", None)

        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        need(
            self.policy in PRESETS,
            f"Unknown policy {self.policy!r}; choose one of: {', '.join(PRESETS)}.",
        )
        need(self.steps >= 0, f"steps must be >= 0, got {self.steps}.")
        need(self.batch >= 1, f"batch must be >= 1, got {self.batch}.")
        need(self.seq_len >= 1, f"seq_len must be >= 1, got {self.seq_len}.")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}.")
        need(
            0 <= self.min_lr_ratio <= 1,
            f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}.",
        )
        need(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}.")
        need(
            self.weight_decay >= 0,
            f"weight_decay must be >= 0, got {self.weight_decay}.",
        )
        need(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            "beta1 and beta2 must lie in [0, 1).",
        )
        need(
            self.grad_clip >= 0,
            f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}.",
        )
        need(
            self.tokenizer in TOKENIZERS,
            f"Unknown tokenizer {self.tokenizer!r}; choose one of: {', '.join(TOKENIZERS)}.",
        )
        need(
            257 <= self.bpe_vocab <= 65536,
            f"bpe_vocab must lie in [257, 65536], got {self.bpe_vocab}.",
        )
        need(
            self.eval_every >= 0,
            f"eval_every must be >= 0 (0: only at the end), got {self.eval_every}.",
        )
        need(
            self.eval_batches is None or self.eval_batches >= 1,
            f"eval_batches must be >= 1 (0 or None: the whole stream), got {self.eval_batches}.",
        )
        need(self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}.")
        need(
            self.ckpt_every >= 0,
            f"ckpt_every must be >= 0 (0: only at the end), got {self.ckpt_every}.",
        )
        need(
            self.compute_dtype in COMPUTE_DTYPES,
            f"Unknown compute_dtype {self.compute_dtype!r}; choose one of: "
            f"{', '.join(COMPUTE_DTYPES)}.",
        )
        model_config(self, 256)  # the preset, the overrides and seq_len against the model

    def to_dict(self) -> dict[str, typing.Any]:
        """The config as a JSON-serialisable dict (the format of `--config FILE.json`; `model`
        holds only the overrides that are set)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = typing.cast(ModelOverrides, self.model).to_dict()
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, typing.Any]) -> "TrainConfig":
        """Build a config from a dict such as a parsed `--config FILE.json`.

        Keys may use dashes or underscores (`seq-len` or `seq_len`); integers are accepted
        for float fields; `model` is a dict of [`s3req.train.ModelOverrides`][] fields.
        Unknown keys raise a `ValueError` that lists the valid ones.
        """
        return cls(**_overrides_from_dict(cls, values, "training"))


def model_config(config: TrainConfig, vocab_size: int) -> typing.Any:
    """The `models.LlamaConfig` of a run: the preset with the run's vocabulary and overrides.

    **Arguments:**

    - `config`: the run config (`preset`, `compute_dtype`, `model` overrides, `seq_len`).
    - `vocab_size`: the tokenizer's vocabulary size.

    **Returns:**

    The model config; raises a `ValueError` for an unknown preset, a bad override or a
    `seq_len` longer than the model allows.
    """
    import models

    try:
        cfg = models.get_config(config.preset)
    except (KeyError, ValueError):
        raise ValueError(
            f"Unknown model preset {config.preset!r}; choose one of: {', '.join(models.PRESETS)}."
        ) from None
    cfg = dataclasses.replace(cfg, vocab_size=vocab_size, compute_dtype=config.compute_dtype)
    try:
        cfg = typing.cast(ModelOverrides, config.model).apply(cfg)
    except TypeError as e:  # a wrong type in a --config file, e.g. {"d_model": "wide"}
        raise ValueError(f"model: {e}") from None
    if config.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"seq_len {config.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len} "
            f"(preset {config.preset!r}). Use --seq-len {cfg.max_seq_len} or less, or raise it "
            "with --model.max-seq-len N."
        )
    return cfg


def build_model(config: TrainConfig, vocab_size: int, *, key: PRNGKeyArray) -> eqx.Module:
    """A fresh `models.Llama` for the run, with the run's rounding policy.

    **Arguments:**

    - `config`: the run config.
    - `vocab_size`: the tokenizer's vocabulary size.
    - `key`: initialisation key. (Keyword only argument.)

    **Returns:**

    The model.
    """
    import models
    from policies import preset

    return models.Llama(model_config(config, vocab_size), preset(config.policy), key=key)


def data_for(config: TrainConfig) -> TokenData:
    """Load the data of a run (`config.data`, tokenizer, cache)."""
    return load_data(
        config.data,
        tokenizer=config.tokenizer,
        bpe_vocab=config.bpe_vocab,
        cache=config.cache,
    )
