"""The training loop: `train`, evaluation, metrics, checkpoints, preemption, progress."""

import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import signal
import sys
import threading
import time
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._checkpoint import (
    checkpoint_path,
    clean_checkpoint_temps,
    has_checkpoint,
    load_checkpoint,
    load_meta,
    save_checkpoint,
)
from ._config import build_model, data_for, FREE_ON_RESUME, model_config, TrainConfig
from ._data import TokenData
from ._sample import TOKENIZER_FILE
from ._sharding import batch_sharding, make_mesh, place, replicated, shard_model
from ._state import init_state, make_optimizer, make_train_step, TrainState


METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
PLOT_FILE = "loss_curve.png"
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


class Preempted(KeyboardInterrupt):
    """Raised out of [`s3req.train.train`][] after `SIGTERM` (a preemption), once the
    checkpoint is saved; a `KeyboardInterrupt` so that code handling Ctrl-C handles it too."""


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


@functools.lru_cache(maxsize=16)
def _optimizer_and_step(opt_fields: tuple[typing.Any, ...], mesh: Mesh | None):
    """One optimizer and one jitted step per optimizer setting and mesh, so that runs in the
    same process (compare, resume, tests) share compilations."""
    config = TrainConfig(**dict(zip(_OPT_FIELDS, opt_fields)))
    optimizer, schedule = make_optimizer(config)
    return optimizer, schedule, make_train_step(optimizer, mesh=mesh)


@eqx.filter_jit
def _eval_step(
    model,
    tokens: Int[Array, "batch seq1"],
    mask: Bool[Array, " batch"],
    key: PRNGKeyArray,
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    logits, _ = model.forward(tokens[:, :-1], key=key)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
    keep = jnp.broadcast_to(mask[:, None], ce.shape)
    return jnp.sum(jnp.where(keep, ce, 0.0)), jnp.sum(keep.astype(jnp.float32))


def _to_devices(x: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """A host batch as a device array, split over `fsdp` on a mesh. Every process holds the
    whole host batch and hands each of its devices only that device's rows."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.make_array_from_callback(x.shape, batch_sharding(mesh), lambda idx: x[idx])


def _eval_batch(model, tokens: np.ndarray, mask: np.ndarray, key, mesh: Mesh | None):
    """`_eval_step` on one host batch, traced under `mesh` (the activations stay split)."""
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        return _eval_step(model, _to_devices(tokens, mesh), _to_devices(mask, mesh), key)


def evaluate(
    model: eqx.Module,
    data: TokenData,
    *,
    batch: int,
    seq_len: int,
    max_batches: int | None = None,
    key: PRNGKeyArray,
    mesh: Mesh | None = None,
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
    - `mesh`: the mesh of a sharded model (the windows are split over `fsdp`, and the
      forward pass runs under it, so the activations stay split), or `None`.

    **Returns:**

    The validation loss.
    """
    total, count = 0.0, 0.0
    for tokens, mask in data.val_batches(batch, seq_len, max_batches):
        s, c = _eval_batch(model, tokens, mask, key, mesh)
        total += float(s)
        count += float(c)
    return total / count


def _read_metrics(path: pathlib.Path, before: int) -> list[dict[str, typing.Any]]:
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before]


def _on_mesh(tree: typing.Any, mesh: Mesh) -> typing.Any:
    """Arrays without a mesh sharding (step counters) replicated over `mesh`."""

    def put(x):
        if eqx.is_array(x) and not isinstance(x.sharding, NamedSharding):
            return place(x, replicated(mesh))
        return x

    return jtu.tree_map(put, tree)


def _check_resume(out: pathlib.Path, config: TrainConfig, allow_changes: bool) -> None:
    if not has_checkpoint(out):
        raise FileNotFoundError(
            f"--resume: no checkpoint in {out}. Drop --resume to start a new run there."
        )
    saved = load_meta(out)["config"]
    now = config.to_dict()
    changed = [k for k in now if k not in FREE_ON_RESUME and saved.get(k) != now[k]]
    if not changed:
        return
    diff = ", ".join(f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in changed)
    if not allow_changes:
        raise ValueError(
            f"--resume: the checkpoint in {out} was made with different {', '.join(changed)} "
            f"({diff}). Use the same values (the run's config.json holds them), a new --out, "
            "or add --allow-changes to continue with the new values (the run is then no "
            "longer equal to an uninterrupted one)."
        )
    print(f"note: resuming {out} with changed settings: {diff}.", file=sys.stderr)


def _prepare_out(out: pathlib.Path, overwrite: bool) -> None:
    """Refuse to start a new run over an earlier one unless asked to replace it."""
    metrics = out / METRICS_FILE
    if not (has_checkpoint(out) or metrics.is_file()):
        return
    if not overwrite:
        raise FileExistsError(
            f"{out} holds an earlier run. Continue it with --resume, replace it with "
            "--overwrite, or choose another --out."
        )
    if jax.process_index() == 0:
        shutil.rmtree(checkpoint_path(out), ignore_errors=True)
        for name in (METRICS_FILE, PLOT_FILE):
            (out / name).unlink(missing_ok=True)


class _Signals:
    """SIGINT and SIGTERM raise (KeyboardInterrupt, Preempted) in the main thread, except
    while a checkpoint is being written: then they wait until it is committed."""

    def __init__(self):
        self.saving = False
        self.pending: type[BaseException] | None = None

    def handler(self, signum, frame):
        exc = Preempted if signum == signal.SIGTERM else KeyboardInterrupt
        if self.saving:
            self.pending = exc
            return
        raise exc()

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    @contextlib.contextmanager
    def deferred(self):
        self.saving = True
        try:
            yield
        finally:
            self.saving = False
        if self.pending is not None:
            exc, self.pending = self.pending, None
            raise exc()


def _header(config: TrainConfig, data: TokenData, out: pathlib.Path | None, mesh) -> str:
    import models

    cfg = model_config(config, data.vocab_size)
    n = models.count_params(cfg)
    tokens = config.steps * config.batch * config.seq_len
    epochs = tokens / max(data.train.shape[0], 1)
    tok = "pre-tokenized" if data.tokenizer is None else config.tokenizer
    where = f" on mesh {dict(mesh.shape)}" if mesh is not None else ""
    return (
        f"model   {config.preset}: {n / 1e6:.2f}M parameters, {cfg.n_layers} layers, width "
        f"{cfg.d_model}; policy {config.policy}; compute {config.compute_dtype}{where}\n"
        f"data    {data.name} ({tok}, vocabulary {data.vocab_size}): "
        f"{data.train.shape[0]:,} training and {data.val.shape[0]:,} validation tokens\n"
        f"plan    {config.steps} steps x {config.batch} x {config.seq_len} tokens = "
        f"{tokens:,} tokens ({epochs:.2f} epochs), lr {config.lr:g}, seed {config.seed}"
        + (f"\nout     {out}" if out is not None else "")
    )


def train(
    config: TrainConfig,
    *,
    data: TokenData | None = None,
    resume: bool = False,
    overwrite: bool = False,
    allow_changes: bool = False,
    stop_at: int | None = None,
    mesh: "str | dict[str, int] | Mesh | None" = None,
    progress: bool = True,
) -> TrainResult:
    """Train a model: the loop behind `s3req train`.

    One jitted step ([`s3req.train.make_train_step`][]): forward, INT8 backward under the
    config's rounding policy, global-norm clipping, AdamW with warmup + cosine decay. The step
    key is `fold_in(train_key, step)` with `train_key` split from `jr.key(config.seed)`, so
    thresholds are fresh every step and a run is a pure function of its config.

    Writes into `config.out` (when set): `config.json`, `tokenizer.json`, `metrics.jsonl` (one
    object per logged step with `step`, `train_loss`, `lr`, `grad_norm`, `tokens`, `time_s`, and
    `val_loss` when evaluated), `loss_curve.png` and `checkpoint/` (model, optimizer state,
    step and data-RNG state; see [`s3req.train.save_checkpoint`][]). A run stopped at step `k`
    (`stop_at`, Ctrl-C or `SIGTERM`, which save a checkpoint) and resumed with `resume=True`
    equals an uninterrupted run bit for bit.

    The losses in a record of step `s` are those of the parameters after `s` updates:
    `train_loss` on the batch of update `s + 1` (for the last record, on a fresh batch).

    **Arguments:**

    - `config`: the [`s3req.train.TrainConfig`][].
    - `data`: pre-loaded [`s3req.train.TokenData`][]; default: load `config.data`.
    - `resume`: continue from the checkpoint in `config.out`.
    - `overwrite`: start a new run in a `config.out` that holds an earlier run (its checkpoint
      and metrics are deleted). Without it such a folder raises `FileExistsError`.
    - `allow_changes`: resume although settings that change the arithmetic (learning rate,
      steps, ...) differ from the checkpoint's; without it that raises a `ValueError`.
    - `stop_at`: stop after this many steps (saving a checkpoint) without finishing.
    - `mesh`: train sharded on a `fsdp` x `tp` device mesh: `"fsdp=4,tp=2"`, a dict of axis
      sizes or a `jax.sharding.Mesh` (see [`s3req.train.make_mesh`][]). Parameters and the
      optimizer state are FSDP- and tensor-parallel-sharded, the batch is split on `fsdp`; the
      losses equal the unsharded run's to float tolerance. `None`: one device.
    - `progress`: print a header and a progress bar (tokens/s, loss) on stderr.

    **Returns:**

    A [`s3req.train.TrainResult`][].
    """
    if mesh is None and jax.process_count() > 1:  # several processes: FSDP over all devices
        mesh = {"fsdp": len(jax.devices()), "tp": 1}
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
        _check_resume(out, config, allow_changes)
    if out is not None and not resume:
        _prepare_out(out, overwrite)
    if data is None:
        data = data_for(config)
    data.check_fits(config.seq_len)
    primary = jax.process_index() == 0

    init_key, train_key, eval_key = jr.split(jr.key(config.seed), 3)
    model = build_model(config, data.vocab_size, key=init_key)
    if mesh is not None:
        model = shard_model(model, mesh)
    optimizer, schedule, train_step = _optimizer_and_step(
        tuple(getattr(config, f) for f in _OPT_FIELDS), mesh
    )
    state = init_state(model, optimizer)
    if mesh is not None:
        state = _on_mesh(state, mesh)
    rng = np.random.default_rng(config.seed)
    start = 0
    metrics: list[dict[str, typing.Any]] = []
    if out is not None:
        if primary:
            out.mkdir(parents=True, exist_ok=True)
        clean_checkpoint_temps(out)
        metrics_path = out / METRICS_FILE
        if resume:
            model, opt_state, meta = load_checkpoint(out, state.model, state.opt_state)
            start = int(meta["step"])
            step0 = place(jnp.asarray(start, jnp.int32), state.step.sharding)
            state = TrainState(model, opt_state, step0)
            rng.bit_generator.state = meta["data_rng"]
            metrics = _read_metrics(metrics_path, before=start)
            if start > config.steps:
                raise ValueError(
                    f"--resume: the checkpoint is at step {start}, past --steps {config.steps}."
                )
        if primary:
            (out / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=1))
            if data.tokenizer is not None:
                data.tokenizer.save(out / TOKENIZER_FILE)
            metrics_path.write_text("".join(json.dumps(r) + "\n" for r in metrics))

    signals = _Signals()

    def save(run: tuple[TrainState, int, typing.Any]) -> None:
        if out is not None:
            meta = {
                "step": run[1],
                "data_rng": run[2],
                "config": config.to_dict(),
                "vocab_size": data.vocab_size,
            }
            with signals.deferred():
                save_checkpoint(out, run[0].model, run[0].opt_state, meta)

    def log(record: dict[str, typing.Any]) -> None:
        metrics.append(record)
        if out is not None and primary:
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
            mesh=mesh,
        )

    end = config.steps if stop_at is None else stop_at
    tokens_per_step = config.batch * config.seq_len
    show = progress and primary
    if show:
        print(_header(config, data, out, mesh), file=sys.stderr)
        if resume:
            print(f"resuming at step {start}", file=sys.stderr)
    bar = None
    last_val: float | None = None
    clock = time.perf_counter()
    timed_steps, timed_s = 0, 0.0
    # (train state, steps done, data-RNG state): replaced by one assignment per step, so an
    # interrupt anywhere saves a consistent checkpoint.
    run = (state, start, rng.bit_generator.state)
    saved_at = start if resume else None
    with signals.installed():
        try:
            for step in range(start, end):
                evaluated = bool(config.eval_every) and step % config.eval_every == 0
                if evaluated:
                    last_val = val_loss(run[0].model)
                tokens = data.sample_batch(rng, config.batch, config.seq_len)
                if show and step == start:
                    print("compiling the training step ...", end="", file=sys.stderr, flush=True)
                t0 = time.perf_counter()
                new, info = train_step(
                    run[0], _to_devices(tokens, mesh), jr.fold_in(train_key, step)
                )
                loss = float(info["loss"])
                run = (new, step + 1, rng.bit_generator.state)
                if step > start:  # The first step of a process includes compilation.
                    timed_steps += 1
                    timed_s += time.perf_counter() - t0
                elif show:
                    print(f" done in {time.perf_counter() - clock:.1f} s", file=sys.stderr)
                    bar = _progress_bar(config.steps, start, True)
                tok_s = tokens_per_step * timed_steps / timed_s if timed_s > 0 else 0.0
                if evaluated or step % config.log_every == 0:
                    record: dict[str, typing.Any] = {
                        "step": step,
                        "train_loss": loss,
                        "lr": _lr(schedule, step),
                        "grad_norm": float(info["grad_norm"]),
                        "tokens": step * tokens_per_step,
                        "time_s": round(time.perf_counter() - clock, 3),
                    }
                    if float(info["aux_loss"]) != 0.0:
                        record["aux_loss"] = float(info["aux_loss"])
                    if evaluated:
                        record["val_loss"] = last_val
                    log(record)
                _bar_update(bar, loss, last_val, tok_s)
                if config.ckpt_every and (step + 1) % config.ckpt_every == 0:
                    save(run)
                    saved_at = step + 1
        except KeyboardInterrupt as e:
            save(run)
            _bar_close(bar)
            if out is not None and show:
                what = "SIGTERM" if isinstance(e, Preempted) else "Interrupted"
                print(
                    f"\n{what} after step {run[1]}: checkpoint saved in {out}. Continue with "
                    "the same command plus --resume.",
                    file=sys.stderr,
                )
            raise
        state = run[0]
        if stop_at is None:
            # The last record: losses of the final parameters (a fresh batch drawn from its own
            # generator, so the data-RNG state of the checkpoint does not depend on it).
            final_rng = np.random.default_rng([config.seed, config.steps])
            tokens = data.sample_batch(final_rng, config.batch, config.seq_len)
            s, c = _eval_batch(
                state.model, tokens, np.ones(config.batch, dtype=bool), eval_key, mesh
            )
            last_val = val_loss(state.model)
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
            save(run)
    _bar_close(bar)
    if out is not None and primary:
        _plot_run(config, data, metrics, out)
    return TrainResult(
        model=state.model,
        metrics=metrics,
        step=end,
        out=out,
        tokens_per_s=tokens_per_step * timed_steps / timed_s if timed_s > 0 else 0.0,
        wall_s=time.perf_counter() - clock,
    )


def _plot_run(config, data, metrics, out: pathlib.Path) -> None:
    try:
        from ._plot import plot_curves

        plot_curves(
            {config.policy: metrics},
            out / PLOT_FILE,
            title=f"{config.preset}, {config.policy} on {pathlib.Path(data.name).name}",
        )
    except ImportError:  # matplotlib is an extra; the metrics are all written already
        print(f"note: no {PLOT_FILE} (pip install matplotlib)", file=sys.stderr)


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
