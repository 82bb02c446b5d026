"""The run configuration: `TrainConfig`, the model it builds."""

import dataclasses
import typing

import equinox as eqx
from jaxtyping import PRNGKeyArray

from ._data import load_data, TokenData


COMPUTE_DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("byte", "bpe")
# Fields that change nothing a training step computes: a resume may change them freely. Any
# other change makes the resumed run differ from every uninterrupted run.
FREE_ON_RESUME = ("out", "cache", "eval_every", "eval_batches", "log_every", "ckpt_every")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (the CLI flags and `--config FILE.json` keys).

    The defaults train the `tiny` Llama with S3R-EC (two-way) on the Shakespeare plays, byte
    tokens, in a few minutes on two CPU cores.

    **Arguments:**

    - `preset`: the model preset of `models.get_config` (`tiny`, `tiny-moe`, `small`, ...).
    - `policy`: a rounding preset of `policies.PRESETS` (`bf16`, `rtne`, `sr`, `s3r`,
      `s3r-ec-2way`, ...).
    - `steps`: optimizer steps.
    - `batch`: sequences per step.
    - `seq_len`: tokens per sequence (at most the preset's `max_seq_len`).
    - `lr`: peak learning rate (AdamW).
    - `min_lr_ratio`: the cosine decay ends at `lr * min_lr_ratio`.
    - `warmup`: linear warmup steps from 0 to `lr`.
    - `weight_decay`: AdamW decoupled weight decay, applied to matrices only.
    - `beta1`, `beta2`: AdamW moment decays.
    - `grad_clip`: global-norm gradient clipping threshold (`0` disables it).
    - `seed`: the one seed of the run: model init, step keys and data windows derive from it.
    - `data`: `None` (Shakespeare), a text file or folder, or a pre-tokenized `.npy`/`.bin`.
    - `tokenizer`: `byte` (vocabulary 256) or `bpe` (trained on the train split).
    - `bpe_vocab`: BPE vocabulary size.
    - `cache`: token-cache folder (default `$S3REQ_CACHE` or `~/.cache/s3req`).
    - `out`: run folder for `metrics.jsonl`, `config.json` and the checkpoint; `None` writes
      nothing.
    - `eval_every`: validate every this many steps (and always at the end; `0`: only at the end).
    - `eval_batches`: validation batches per evaluation, spread over the whole validation
      stream; `None` walks every window of it.
    - `log_every`: write a metrics line every this many steps.
    - `ckpt_every`: save a checkpoint every this many steps (`0`: only at the end).
    - `compute_dtype`: `float32` or `bfloat16` activations (parameters stay float32).
    - `model`: overrides of the model config, e.g. `{"d_model": 128, "n_layers": 2}`.
    """

    preset: str = "tiny"
    policy: str = "s3r-ec-2way"
    steps: int = 300
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    data: str | None = None
    tokenizer: str = "byte"
    bpe_vocab: int = 4096
    cache: str | None = None
    out: str | None = None
    eval_every: int = 100
    eval_batches: int | None = 32
    log_every: int = 10
    ckpt_every: int = 0
    compute_dtype: str = "float32"
    model: dict[str, typing.Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        from policies import PRESETS

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
            f"eval_batches must be >= 1 (or None for the whole stream), got {self.eval_batches}.",
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

    def to_dict(self) -> dict[str, typing.Any]:
        """The config as a JSON-serialisable dict (the format of `--config FILE.json`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, typing.Any]) -> "TrainConfig":
        """Build a config from a dict such as a parsed `--config FILE.json`.

        Keys may use dashes or underscores (`seq-len` or `seq_len`); integers are accepted
        for float fields. Unknown keys raise a `ValueError` that lists the valid ones.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise ValueError(
                    f"Unknown training option {key!r}; valid keys: {', '.join(fields)}."
                )
            if (
                fields[name].type is float
                and isinstance(value, int)
                and not isinstance(value, bool)
            ):
                value = float(value)
            kwargs[name] = value
        return cls(**kwargs)


def model_config(config: TrainConfig, vocab_size: int) -> typing.Any:
    """The `models.LlamaConfig` of a run: the preset with the run's vocabulary and overrides.

    **Arguments:**

    - `config`: the run config (`preset`, `compute_dtype`, `model` overrides, `seq_len`).
    - `vocab_size`: the tokenizer's vocabulary size.

    **Returns:**

    The model config; raises a `ValueError` for an unknown preset or a `seq_len` longer than
    the model allows.
    """
    import models

    try:
        cfg = models.get_config(config.preset)
    except (KeyError, ValueError):
        raise ValueError(
            f"Unknown model preset {config.preset!r}; choose one of: {', '.join(models.PRESETS)}."
        ) from None
    names = {f.name for f in dataclasses.fields(cfg)}
    overrides = {"vocab_size": vocab_size, "compute_dtype": config.compute_dtype}
    overrides.update(config.model)
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"Unknown model option(s) {unknown} for preset {config.preset!r}; valid: "
            f"{', '.join(sorted(names))}."
        )
    cfg = dataclasses.replace(cfg, **overrides)
    if config.seq_len > cfg.max_seq_len:
        raise ValueError(
            f"seq_len {config.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len} "
            f"(preset {config.preset!r}). Use --seq-len {cfg.max_seq_len} or less, or raise it "
            'with {"model": {"max_seq_len": N}} in --config.'
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
