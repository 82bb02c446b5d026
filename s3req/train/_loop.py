"""The training loop, the policy comparison and sampling."""

import dataclasses
import functools
import json
import pathlib
import sys
import time
import typing
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._checkpoint import has_checkpoint, load_checkpoint, load_meta, save_checkpoint
from ._data import load_data, TokenData
from ._sharding import batch_sharding, make_mesh, replicated, shard_model
from ._tokenizer import AbstractTokenizer, load_tokenizer


METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
COMPUTE_DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("byte", "bpe")


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


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult:
    """What [`s3req.train.train`][] returns.

    **Arguments:**

    - `model`: the trained model.
    - `metrics`: the metrics records of the run (the lines of `metrics.jsonl`).
    - `step`: the number of optimizer steps applied.
    - `out`: the run folder, or `None`.
    - `tokens_per_s`: training throughput (excluding compilation and validation).
    - `wall_s`: wall-clock time of the call.
    """

    model: typing.Any
    metrics: list[dict[str, typing.Any]]
    step: int
    out: pathlib.Path | None
    tokens_per_s: float = 0.0
    wall_s: float = 0.0


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


def make_optimizer(
    config: TrainConfig,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup, cosine decay and global-norm clipping.

    Weight decay applies to parameters with two or more axes (not to norms or biases).

    **Returns:**

    `(optimizer, learning-rate schedule)`.
    """
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=config.warmup,
        decay_steps=max(config.steps, config.warmup + 1),
        end_value=config.lr * config.min_lr_ratio,
    )

    def decay_mask(params):
        return jtu.tree_map(lambda p: p.ndim >= 2, params)

    adamw = optax.adamw(
        schedule,
        b1=config.beta1,
        b2=config.beta2,
        weight_decay=config.weight_decay,
        mask=decay_mask,
    )
    if config.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(config.grad_clip), adamw), schedule
    return adamw, schedule


def _forward(model, tokens, key):
    logits, aux = model.forward(tokens, key=key)
    return logits.astype(jnp.float32), jnp.asarray(aux, jnp.float32)


def _loss(model, tokens, key):
    logits, aux = _forward(model, tokens[:, :-1], key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + aux, (ce, aux)


def _global_norm(tree) -> Float[Array, ""]:
    leaves = [x for x in jtu.tree_leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


_OPT_FIELDS = (
    "lr",
    "min_lr_ratio",
    "warmup",
    "steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
)


@functools.lru_cache(maxsize=16)
def _optimizer_and_step(opt_fields: tuple[typing.Any, ...]):
    """One optimizer and one jitted step per optimizer setting, so that runs in the same
    process (compare, resume, tests) share compilations."""
    config = TrainConfig(**dict(zip(_OPT_FIELDS, opt_fields)))
    optimizer, schedule = make_optimizer(config)
    return optimizer, schedule, _make_step(optimizer)


def _make_step(optimizer: optax.GradientTransformation):
    @eqx.filter_jit
    def step(model, opt_state, tokens, key):
        grad_fn = eqx.filter_value_and_grad(_loss, has_aux=True)
        (_, (ce, aux)), grads = grad_fn(model, tokens, key)
        params = eqx.filter(model, eqx.is_inexact_array)
        # optax mixes Python floats with int32 step counts: allow standard promotion here
        # even when the caller runs JAX with jax_numpy_dtype_promotion="strict".
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        return model, opt_state, ce, aux, _global_norm(grads)

    return step


@eqx.filter_jit
def _eval_step(
    model,
    tokens: Int[Array, "batch seq1"],
    mask: Bool[Array, " batch"],
    key: PRNGKeyArray,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    logits, _ = _forward(model, tokens[:, :-1], key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    keep = jnp.broadcast_to(mask[:, None], ce.shape)
    return jnp.sum(jnp.where(keep, ce, 0.0)), jnp.sum(keep.astype(jnp.float32))


def evaluate(
    model: eqx.Module,
    data: TokenData,
    *,
    batch: int,
    seq_len: int,
    max_batches: int | None = None,
    key: PRNGKeyArray,
) -> float:
    """Mean next-token cross-entropy (nats) over fixed validation windows.

    **Arguments:**

    - `model`: the model.
    - `data`: the data; its validation stream is read.
    - `batch`, `seq_len`: the window shape.
    - `max_batches`: `None` for the whole validation stream, else that many batches spread
      evenly over it.
    - `key`: passed to the model's forward pass (which is deterministic). (Keyword only
      argument.)

    **Returns:**

    The validation loss.
    """
    total, count = 0.0, 0.0
    for tokens, mask in data.val_batches(batch, seq_len, max_batches):
        s, c = _eval_step(model, jnp.asarray(tokens), jnp.asarray(mask), key)
        total += float(s)
        count += float(c)
    return total / count


def _data_for(config: TrainConfig) -> TokenData:
    return load_data(
        config.data,
        tokenizer=config.tokenizer,
        bpe_vocab=config.bpe_vocab,
        cache=config.cache,
    )


# Config fields that fix the shapes and the data of a run: a resume must not change them.
_RESUME_FIXED = (
    "preset",
    "policy",
    "batch",
    "seq_len",
    "seed",
    "data",
    "tokenizer",
    "bpe_vocab",
    "model",
    "compute_dtype",
)


def _read_metrics(path: pathlib.Path, before: int) -> list[dict[str, typing.Any]]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before]


def train(
    config: TrainConfig,
    *,
    data: TokenData | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    mesh: "str | dict[str, int] | Mesh | None" = None,
    progress: bool = True,
) -> TrainResult:
    """Train a model: the loop behind `s3req train`.

    One `eqx.filter_jit` step: forward, INT8 backward under the config's rounding policy,
    global-norm clipping, AdamW with warmup + cosine decay. The step key is
    `fold_in(train_key, step)` with `train_key` split from `jr.key(config.seed)`, so thresholds
    are fresh every step and a run is a pure function of its config.

    Writes into `config.out` (when set): `config.json`, `tokenizer.json`, `metrics.jsonl` (one
    object per logged step with `step`, `train_loss`, `lr`, `grad_norm`, `tokens`, `time_s`, and
    `val_loss` when evaluated) and `checkpoint/` (model, optimizer state, step and data-RNG
    state). A run stopped at step `k` (`stop_at`, or Ctrl-C, which saves a checkpoint) and
    resumed with `resume=True` equals an uninterrupted run bit for bit.

    The losses in a record of step `s` are those of the parameters after `s` updates:
    `train_loss` on the batch of update `s + 1` (for the last record, on a fresh batch).

    **Arguments:**

    - `config`: the [`s3req.train.TrainConfig`][].
    - `data`: pre-loaded [`s3req.train.TokenData`][]; default: load `config.data`.
    - `resume`: continue from the checkpoint in `config.out`.
    - `stop_at`: stop after this many steps (saving a checkpoint) without finishing.
    - `mesh`: train sharded on a `fsdp` x `tp` device mesh: `"fsdp=4,tp=2"`, a dict of axis
      sizes or a `jax.sharding.Mesh` (see [`s3req.train.make_mesh`][]). Parameters and optimizer
      state are FSDP- and tensor-parallel-sharded, the batch is split on `fsdp`; the losses
      equal the unsharded run's to float tolerance. `None`: one device.
    - `progress`: show a progress bar (tokens/s, loss) on stderr.

    **Returns:**

    A [`s3req.train.TrainResult`][].
    """
    if mesh is not None:
        mesh = make_mesh(mesh)
        if config.batch % mesh.shape["fsdp"]:
            raise ValueError(
                f"--batch {config.batch} must be divisible by the mesh's fsdp size "
                f"{mesh.shape['fsdp']}."
            )
    if stop_at is not None and not 0 <= stop_at <= config.steps:
        raise ValueError(f"stop_at must lie in [0, steps={config.steps}], got {stop_at}.")
    out = None if config.out is None else pathlib.Path(config.out)
    if resume and out is None:
        raise ValueError("resume=True needs a run folder: set config.out (--out DIR).")
    if resume:
        assert out is not None
        if not has_checkpoint(out):
            raise FileNotFoundError(
                f"--resume: no checkpoint in {out}. Drop --resume to start a new run there."
            )
        saved = load_meta(out)["config"]
        changed = [k for k in _RESUME_FIXED if saved.get(k) != config.to_dict()[k]]
        if changed:
            raise ValueError(
                f"--resume: the checkpoint in {out} was made with different {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); use the same values "
                "or a new --out."
            )
    model_config(config, 256)  # Fail fast on a bad preset or seq_len, before loading data.
    if data is None:
        data = _data_for(config)

    init_key, train_key, eval_key = jr.split(jr.key(config.seed), 3)
    model = build_model(config, data.vocab_size, key=init_key)
    if mesh is not None:
        model = shard_model(model, mesh)
    optimizer, schedule, train_step = _optimizer_and_step(
        tuple(getattr(config, f) for f in _OPT_FIELDS)
    )
    with jax.numpy_dtype_promotion("standard"):
        opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    rng = np.random.default_rng(config.seed)
    start = 0
    metrics: list[dict[str, typing.Any]] = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / METRICS_FILE
        if resume:
            model, opt_state, meta = load_checkpoint(out, model, opt_state)
            if mesh is not None:  # the checkpoint holds whole arrays: place them again
                model = shard_model(model, mesh)
                opt_state = eqx.filter_shard(opt_state, replicated(mesh))
            start = int(meta["step"])
            rng.bit_generator.state = meta["data_rng"]
            metrics = _read_metrics(metrics_path, before=start)
            if start > config.steps:
                raise ValueError(
                    f"--resume: the checkpoint is at step {start}, past --steps {config.steps}."
                )
        elif has_checkpoint(out):
            print(
                f"note: {out} holds the checkpoint of an earlier run; starting a new run there "
                "(the checkpoint is replaced at the next save). Use --resume to continue it.",
                file=sys.stderr,
            )
        (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=1))
        if data.tokenizer is not None:
            data.tokenizer.save(out / TOKENIZER_FILE)
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in metrics))

    def save(state: tuple[typing.Any, ...]) -> None:
        if out is not None:
            meta = {
                "step": state[2],
                "data_rng": state[3],
                "config": config.to_dict(),
                "vocab_size": data.vocab_size,
            }
            save_checkpoint(out, state[0], state[1], meta)

    def log(record: dict[str, typing.Any]) -> None:
        metrics.append(record)
        if out is not None:
            with open(out / METRICS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")

    def val_loss(model) -> float:
        return evaluate(
            model,
            data,
            batch=config.batch,
            seq_len=config.seq_len,
            max_batches=config.eval_batches,
            key=eval_key,
        )

    end = config.steps if stop_at is None else stop_at
    tokens_per_step = config.batch * config.seq_len
    bar = _progress_bar(config.steps, start, progress)
    last_val: float | None = None
    clock = time.perf_counter()
    timed_steps, timed_s = 0, 0.0
    # (model, opt_state, steps done, data-RNG state): replaced by one assignment per step, so a
    # Ctrl-C anywhere saves a consistent checkpoint.
    state = (model, opt_state, start, rng.bit_generator.state)
    saved_at = start if resume else None
    try:
        for step in range(start, end):
            model, opt_state = state[0], state[1]
            evaluated = bool(config.eval_every) and step % config.eval_every == 0
            if evaluated:
                last_val = val_loss(model)
            tokens = data.sample_batch(rng, config.batch, config.seq_len)
            t0 = time.perf_counter()
            tokens = jnp.asarray(tokens)
            if mesh is not None:
                tokens = jax.device_put(tokens, batch_sharding(mesh))
            new = train_step(model, opt_state, tokens, jr.fold_in(train_key, step))
            loss = float(new[2])
            state = (new[0], new[1], step + 1, rng.bit_generator.state)
            if step > start:  # The first step of a process includes compilation.
                timed_steps += 1
                timed_s += time.perf_counter() - t0
            tok_s = tokens_per_step * timed_steps / timed_s if timed_s > 0 else 0.0
            if evaluated or step % config.log_every == 0:
                record: dict[str, typing.Any] = {
                    "step": step,
                    "train_loss": loss,
                    "lr": _lr(schedule, step),
                    "grad_norm": float(new[4]),
                    "tokens": step * tokens_per_step,
                    "time_s": round(time.perf_counter() - clock, 3),
                }
                if float(new[3]) != 0.0:
                    record["aux_loss"] = float(new[3])
                if evaluated:
                    record["val_loss"] = last_val
                log(record)
            _bar_update(bar, loss, last_val, tok_s)
            if config.ckpt_every and (step + 1) % config.ckpt_every == 0:
                save(state)
                saved_at = step + 1
    except KeyboardInterrupt:
        save(state)
        _bar_close(bar)
        if out is not None:
            print(
                f"\nInterrupted after step {state[2]}: checkpoint saved in {out}. Continue with "
                "the same command plus --resume.",
                file=sys.stderr,
            )
        raise
    model, opt_state = state[0], state[1]
    if stop_at is None:
        # The last record: losses of the final parameters (a fresh batch drawn from its own
        # generator, so the data-RNG state of the checkpoint does not depend on it).
        final_rng = np.random.default_rng([config.seed, config.steps])
        tokens = data.sample_batch(final_rng, config.batch, config.seq_len)
        s, c = _eval_step(model, jnp.asarray(tokens), jnp.ones(config.batch, dtype=bool), eval_key)
        last_val = val_loss(model)
        log(
            {
                "step": config.steps,
                "train_loss": float(s) / float(c),
                "lr": _lr(schedule, config.steps),
                "tokens": config.steps * tokens_per_step,
                "time_s": round(time.perf_counter() - clock, 3),
                "val_loss": last_val,
            }
        )
        _bar_update(bar, float(s) / float(c), last_val, None)
    if saved_at != end:
        save(state)
    _bar_close(bar)
    return TrainResult(
        model=model,
        metrics=metrics,
        step=end,
        out=out,
        tokens_per_s=tokens_per_step * timed_steps / timed_s if timed_s > 0 else 0.0,
        wall_s=time.perf_counter() - clock,
    )


def _lr(schedule: optax.Schedule, step: int) -> float:
    with jax.numpy_dtype_promotion("standard"):
        return float(jnp.asarray(schedule(step)))


def _progress_bar(total: int, initial: int, enabled: bool) -> typing.Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)


def _bar_update(bar: typing.Any, loss: float, val: float | None, tok_s: float | None) -> None:
    if bar is None:
        return
    post = {"loss": f"{loss:.3f}"}
    if val is not None:
        post["val"] = f"{val:.3f}"
    if tok_s:
        post["tok/s"] = f"{tok_s:,.0f}"
    bar.set_postfix(post, refresh=False)
    if tok_s is not None:
        bar.update(1)
    else:
        bar.refresh()


def _bar_close(bar: typing.Any) -> None:
    if bar is not None:
        bar.close()


def _val_curve(metrics: list[dict[str, typing.Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in metrics if r.get("val_loss") is not None]


def compare(
    config: TrainConfig,
    policies: Sequence[str],
    *,
    data: TokenData | None = None,
    progress: bool = True,
) -> dict[str, typing.Any]:
    """Train the same model on the same data and seed under several rounding policies.

    Each policy trains into `config.out/<policy>/`; then `config.out` receives
    `compare.md` (a table), `compare.json` (the table, the config and every run's metrics) and
    `loss_curves.png` (training and validation loss against step).

    **Arguments:**

    - `config`: the shared [`s3req.train.TrainConfig`][]; its `policy` is ignored and its
      `out` (required) is the comparison folder.
    - `policies`: preset names, e.g. `["bf16", "rtne", "sr", "s3r", "s3r-ec-2way"]`.
    - `data`: pre-loaded [`s3req.train.TokenData`][]; default: load `config.data` once.
    - `progress`: show progress bars.

    **Returns:**

    The content of `compare.json`.
    """
    from policies import PRESETS

    from ._plot import plot_curves

    if config.out is None:
        raise ValueError("compare: set config.out (--out DIR) for the table and the plot.")
    policies = list(policies)
    if not policies:
        raise ValueError("compare: name at least one policy, e.g. --policies bf16,s3r-ec-2way.")
    unknown = [p for p in policies if p not in PRESETS]
    if unknown:
        raise ValueError(
            f"compare: unknown policy {unknown[0]!r}; choose from: {', '.join(PRESETS)}."
        )
    if len(set(policies)) != len(policies):
        raise ValueError(f"compare: policies are repeated in {policies}.")
    out = pathlib.Path(config.out)
    model_config(config, 256)
    if data is None:
        data = _data_for(config)
    rows, curves = [], {}
    for name in policies:
        run = dataclasses.replace(config, policy=name, out=str(out / name))
        if progress:
            print(f"== {name}", file=sys.stderr)
        result = train(run, data=data, progress=progress)
        vals = _val_curve(result.metrics)
        rows.append(
            {
                "policy": name,
                "val_loss_start": vals[0][1],
                "val_loss_final": vals[-1][1],
                "val_loss_best": min(v for _, v in vals),
                "train_loss_final": result.metrics[-1]["train_loss"],
                "tokens_per_s": result.tokens_per_s,
                "wall_s": result.wall_s,
            }
        )
        curves[name] = result.metrics
    summary = {
        "config": config.to_dict(),
        "data": data.name,
        "results": rows,
        "curves": curves,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(summary, indent=1))
    (out / "compare.md").write_text(_compare_table(config, data, rows))
    plot_curves(
        curves,
        out / "loss_curves.png",
        title=f"{config.preset} on {pathlib.Path(data.name).name}, {config.steps} steps, "
        f"seed {config.seed}",
    )
    return summary


def _compare_table(config: TrainConfig, data: TokenData, rows: list[dict[str, typing.Any]]) -> str:
    base = rows[0]
    lines = [
        f"# Policy comparison: {config.preset} on {pathlib.Path(data.name).name}",
        "",
        f"{config.steps} steps, batch {config.batch} x {config.seq_len} tokens, lr {config.lr}, "
        f"seed {config.seed}, tokenizer {config.tokenizer}, compute {config.compute_dtype}. "
        "Losses in nats/token; the same data windows and initialisation for every policy.",
        "",
        f"| policy | val loss start | val loss final | best | vs {base['policy']} "
        "| train loss final | tokens/s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        delta = r["val_loss_final"] - base["val_loss_final"]
        lines.append(
            f"| {r['policy']} | {r['val_loss_start']:.4f} | {r['val_loss_final']:.4f} "
            f"| {r['val_loss_best']:.4f} | {delta:+.4f} | {r['train_loss_final']:.4f} "
            f"| {r['tokens_per_s']:,.0f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def load_run(
    out: str | pathlib.Path,
) -> tuple[eqx.Module, AbstractTokenizer | None, TrainConfig]:
    """Load the model, tokenizer and config of a run folder written by `train`.

    **Arguments:**

    - `out`: the run folder (or its `checkpoint/` subfolder).

    **Returns:**

    `(model, tokenizer or None for pre-tokenized data, config)`.
    """
    out = pathlib.Path(out)
    if out.name == "checkpoint" and not has_checkpoint(out):
        out = out.parent
    meta = load_meta(out)
    config = TrainConfig.from_dict(meta["config"])
    init_key = jr.split(jr.key(config.seed), 3)[0]
    like = eqx.filter_eval_shape(build_model, config, meta["vocab_size"], key=init_key)
    model, _, _ = load_checkpoint(out, like)
    tok_file = out / TOKENIZER_FILE
    tokenizer = load_tokenizer(tok_file) if tok_file.is_file() else None
    return model, tokenizer, config


@eqx.filter_jit
def _next_token(model, buf, pos, key, temperature):
    logits = model(buf, key=key)[0, pos]
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    return jr.categorical(key, logits / temperature).astype(jnp.int32)


def sample(
    model: eqx.Module,
    tokenizer: AbstractTokenizer | None,
    prompt: str,
    *,
    tokens: int = 200,
    temperature: float = 0.8,
    context: int | None = None,
    key: PRNGKeyArray,
) -> str:
    """Generate a continuation of `prompt`.

    **Arguments:**

    - `model`: a trained model (`models.Llama`).
    - `tokenizer`: the run's tokenizer; `None` for pre-tokenized data, in which case `prompt`
      and the result are whitespace-separated token ids.
    - `prompt`: the text to continue (an empty prompt starts from a newline).
    - `tokens`: how many tokens to generate.
    - `temperature`: softmax temperature; `0` is greedy (argmax) decoding.
    - `context`: the window the model sees (default: its `max_seq_len`); use the training
      `seq_len`.
    - `key`: sampling key; token `i` uses `fold_in(key, i)`. (Keyword only argument.)

    **Returns:**

    The generated continuation (without the prompt).
    """
    if tokens < 0:
        raise ValueError(f"sample: tokens must be >= 0, got {tokens}.")
    if temperature < 0:
        raise ValueError(f"sample: temperature must be >= 0 (0 is greedy), got {temperature}.")
    max_len = model.config.max_seq_len  # pyright: ignore[reportAttributeAccessIssue]
    context = max_len if context is None else min(context, max_len)
    if tokenizer is None:
        ids = [int(t) for t in prompt.split()]
    else:
        ids = [int(t) for t in tokenizer.encode(prompt if prompt else "\n")]
    if not ids:
        raise ValueError("sample: give a prompt (token ids for pre-tokenized data).")
    n_prompt = len(ids)
    buf = np.zeros((1, context), np.int32)
    for i in range(tokens):
        window = ids[-context:]
        buf[0, :] = 0
        buf[0, : len(window)] = window
        t = _next_token(
            model,
            jnp.asarray(buf),
            jnp.asarray(len(window) - 1, jnp.int32),
            jr.fold_in(key, i),
            float(temperature),
        )
        ids.append(int(t))
    new = ids[n_prompt:]
    if tokenizer is None:
        return " ".join(str(t) for t in new)
    full = tokenizer.decode(np.asarray(ids))
    head = tokenizer.decode(np.asarray(ids[:n_prompt]))
    return full[len(head) :] if full.startswith(head) else tokenizer.decode(np.asarray(new))
