"""Table I of the paper at CPU scale: final validation loss of the nine rounding configurations.

Trains the `tiny` Llama of `s3req.train` (4 layers, width 128, byte tokens) on the default
corpus (Shakespeare) under each configuration of the paper's Table I, with the same data order
and initialisation for every configuration of a seed. Like the paper, each configuration gets
a short learning-rate sweep on seed 0 and then the remaining seeds at its best rate; the table
reports the mean and sample standard deviation of the final validation loss over seeds, the gap
to BF16 and Welch's t against Independent SR.

The runner is resumable: every finished run is appended as one JSON line to
`<out>/table1_<scale>_runs.jsonl`, and a rerun skips the runs already there (stop it any time
and start the same command again). Scales:

- `smoke`: a one-layer width-32 model, a few steps (seconds; for the tests).
- `quick`: 120 steps of 8 x 128 tokens, one learning rate (3e-3), 3 seeds: about 30-40 min
  on 2 shared CPU cores. The published page adds two seeds with `--seeds 5` (the finished
  runs are reused; another 10-15 min).
- `cpu`: 400 steps of 16 x 128 tokens, learning rates {1e-3, 3e-3, 6e-3} on seed 0, 3 seeds:
  45 runs, a few hours on 2 CPU cores.

    python experiments/table1_quality.py --scale quick
    python experiments/table1_quality.py --scale quick --seeds 5   # the published page
    python experiments/table1_quality.py --scale cpu            # the full CPU table
    python experiments/table1_quality.py --scale smoke --out /tmp/t1   # smoke test

Writes `table1_<scale>.md`, `table1_<scale>.json` and `table1_<scale>.png` (validation-loss
curves, mean over seeds with the min-max band) into `--out` (default `docs/results/`).
"""

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import sys
import time
import typing

import jax
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent

CONFIGS: dict[str, str] = {
    "bf16": "BF16",
    "rtne": "INT8 RTNE",
    "sr": "Independent SR",
    "s3r": "S3R (Phi2D)",
    "s3r-ec-dx": "S3R-EC, dX-only (Phi2D)",
    "s3r-ec-2way": "S3R-EC, two-way (Phi2D)",
    "s3r-bcast": "S3R (PhiBcast)",
    "s3r-bcast-ec-dx": "S3R-EC, dX-only (PhiBcast)",
    "s3r-bcast-ec-2way": "S3R-EC, two-way (PhiBcast)",
}
"""Preset name -> the row label of the paper's Table I."""

# The paper's Table I (12-layer Llama, C4, 2000 steps, TPU v5p): (best LR, mean, std).
PAPER: dict[str, tuple[str, float, float]] = {
    "bf16": ("6e-4", 4.892, 0.015),
    "rtne": ("6e-4", 5.106, 0.013),
    "sr": ("6e-4", 4.929, 0.019),
    "s3r": ("3e-4", 5.055, 0.017),
    "s3r-ec-dx": ("6e-4", 4.924, 0.021),
    "s3r-ec-2way": ("6e-4", 4.919, 0.022),
    "s3r-bcast": ("3.75e-5", 6.239, 0.026),
    "s3r-bcast-ec-dx": ("6e-4", 5.094, 0.018),
    "s3r-bcast-ec-2way": ("6e-4", 5.002, 0.024),
}


@dataclasses.dataclass(frozen=True)
class Scale:
    preset: str
    steps: int
    batch: int
    seq_len: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    warmup: int
    eval_every: int
    eval_batches: int
    model: tuple[tuple[str, typing.Any], ...] = ()


SCALES: dict[str, Scale] = {
    "smoke": Scale(
        "tiny",
        steps=4,
        batch=2,
        seq_len=16,
        lrs=(3e-3,),
        seeds=(0, 1),
        warmup=1,
        eval_every=2,
        eval_batches=2,
        model=(("d_model", 32), ("n_layers", 1), ("n_heads", 2), ("n_kv_heads", 1), ("d_ff", 64)),
    ),
    "quick": Scale(
        "tiny",
        steps=120,
        batch=8,
        seq_len=128,
        lrs=(3e-3,),
        seeds=(0, 1, 2),
        warmup=12,
        eval_every=20,
        eval_batches=16,
    ),
    "cpu": Scale(
        "tiny",
        steps=400,
        batch=16,
        seq_len=128,
        lrs=(1e-3, 3e-3, 6e-3),
        seeds=(0, 1, 2),
        warmup=40,
        eval_every=50,
        eval_batches=32,
    ),
}


def run_key(config: str, lr: float, seed: int) -> str:
    return f"{config}|{lr:g}|{seed}"


def read_runs(path: pathlib.Path) -> dict[str, dict[str, typing.Any]]:
    if not path.is_file():
        return {}
    runs = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            runs[run_key(r["config"], r["lr"], r["seed"])] = r
    return runs


def train_one(scale: Scale, config: str, lr: float, seed: int, data) -> dict[str, typing.Any]:
    """One training run; returns its JSONL record (final val loss and the loss curves)."""
    from s3req.train import train, TrainConfig

    cfg = TrainConfig(
        preset=scale.preset,
        policy=config,
        steps=scale.steps,
        batch=scale.batch,
        seq_len=scale.seq_len,
        lr=lr,
        warmup=scale.warmup,
        seed=seed,
        eval_every=scale.eval_every,
        eval_batches=scale.eval_batches,
        log_every=max(1, scale.steps // 40),
        model=dict(scale.model),
    )
    t0 = time.perf_counter()
    result = train(cfg, data=data, progress=False)
    val = [(r["step"], r["val_loss"]) for r in result.metrics if r.get("val_loss") is not None]
    tr = [(r["step"], r["train_loss"]) for r in result.metrics]
    return {
        "config": config,
        "lr": lr,
        "seed": seed,
        "final_val_loss": val[-1][1],
        "val_curve": val,
        "train_curve": tr,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def best_lr(runs: dict, config: str, scale: Scale) -> float | None:
    """The learning rate with the lowest final validation loss on the first seed (None until
    every rate of the sweep has run). Non-finite losses count as worst."""
    seed0 = scale.seeds[0]
    got = [runs.get(run_key(config, lr, seed0)) for lr in scale.lrs]
    if any(r is None for r in got):
        return None

    def score(r):
        v = r["final_val_loss"]
        return v if math.isfinite(v) else float("inf")

    return min(zip(got, scale.lrs), key=lambda p: score(p[0]))[1]


def get_scale(scale_name: str, seeds: int | None = None) -> Scale:
    """The settings of a scale, with `seeds` seeds (0..seeds-1) instead of its own if given."""
    scale = SCALES[scale_name]
    if seeds is not None:
        scale = dataclasses.replace(scale, seeds=tuple(range(seeds)))
    return scale


def run_all(
    scale_name: str, configs: list[str], out: pathlib.Path, seeds: int | None = None
) -> dict:
    from s3req.train import load_data

    scale = get_scale(scale_name, seeds)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"table1_{scale_name}_runs.jsonl"
    runs = read_runs(path)
    data = None

    def ensure(config, lr, seed):
        nonlocal data
        k = run_key(config, lr, seed)
        if k in runs:
            return
        if data is None:
            data = load_data(None)
        print(f"[table1 {scale_name}] {config} lr={lr:g} seed={seed}", file=sys.stderr, flush=True)
        rec = train_one(scale, config, lr, seed, data)
        print(
            f"    final val {rec['final_val_loss']:.4f} ({rec['wall_s']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        runs[k] = rec

    # Phase 1: the learning-rate sweep on the first seed, every configuration.
    for config in configs:
        for lr in scale.lrs:
            ensure(config, lr, scale.seeds[0])
    # Phase 2: the other seeds at each configuration's best rate.
    for seed in scale.seeds[1:]:
        for config in configs:
            lr = best_lr(runs, config, scale)
            assert lr is not None
            ensure(config, lr, seed)
    summary = summarize(scale_name, configs, runs, seeds)
    (out / f"table1_{scale_name}.json").write_text(json.dumps(summary, indent=1))
    (out / f"table1_{scale_name}.md").write_text(markdown(summary))
    plot(summary, runs, out / f"table1_{scale_name}.png")
    return summary


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t of mean(a) - mean(b) and its Welch-Satterthwaite degrees of freedom."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return float("nan"), float("nan")
    va, vb = np.var(a, ddof=1) / na, np.var(b, ddof=1) / nb
    se2 = va + vb
    if se2 == 0:
        return float("nan"), float("nan")
    t = (np.mean(a) - np.mean(b)) / math.sqrt(se2)
    dof = se2**2 / (va**2 / (na - 1) + vb**2 / (nb - 1))
    return float(t), float(dof)


def summarize(scale_name: str, configs: list[str], runs: dict, seeds: int | None = None) -> dict:
    scale = get_scale(scale_name, seeds)
    rows = {}
    for config in configs:
        lr = best_lr(runs, config, scale)
        vals = [runs[run_key(config, lr, s)]["final_val_loss"] for s in scale.seeds]
        rows[config] = {
            "label": CONFIGS[config],
            "best_lr": lr,
            "sweep": {
                f"{x:g}": runs[run_key(config, x, scale.seeds[0])]["final_val_loss"]
                for x in scale.lrs
            },
            "val_losses": vals,
            "mean": float(np.mean(vals)),
            "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else float("nan"),
        }
    for config, row in rows.items():
        if "bf16" in rows:
            row["gap_bf16"] = row["mean"] - rows["bf16"]["mean"]
        if "sr" in rows and config != "sr":
            row["welch_t_vs_sr"], row["welch_dof_vs_sr"] = welch(
                row["val_losses"], rows["sr"]["val_losses"]
            )
    return {
        "scale": scale_name,
        "seeds_override": seeds,
        "settings": dataclasses.asdict(scale),
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "rows": rows,
        "claims": claims(rows),
    }


# The paper's orderings: (worse, better, statement). "worse" should have the higher loss.
CLAIMS = [
    ("rtne", "sr", "SR is still needed at 8 bits: INT8 RTNE ends above Independent SR"),
    ("sr", "bf16", "Independent SR ends above BF16"),
    ("s3r", "sr", "Uncorrected sharing hurts: S3R (Phi2D) ends above Independent SR"),
    ("s3r", "s3r-ec-2way", "Two-way S3R-EC (Phi2D) improves on S3R (Phi2D)"),
    ("s3r", "s3r-ec-dx", "dX-only S3R-EC (Phi2D) improves on S3R (Phi2D)"),
    ("s3r-bcast", "s3r", "PhiBcast is worse than Phi2D (uncorrected)"),
    ("s3r-bcast", "s3r-bcast-ec-2way", "Two-way S3R-EC (PhiBcast) improves on S3R (PhiBcast)"),
    ("s3r-bcast-ec-dx", "s3r-bcast-ec-2way", "For PhiBcast, dX-only stays above two-way"),
    ("s3r-bcast-ec-2way", "sr", "Two-way S3R-EC (PhiBcast) stays above Independent SR"),
]
# Pairs the paper reports as equal within seed noise.
TIES = [
    ("s3r-ec-2way", "sr", "Two-way S3R-EC (Phi2D) matches Independent SR"),
    ("s3r-ec-dx", "s3r-ec-2way", "For Phi2D, dX-only matches two-way"),
]


def _verdict(t: float, expect_positive: bool) -> str:
    if not math.isfinite(t):
        return "undetermined (one seed)"
    if abs(t) < 2.0:
        return "within seed noise (|t| < 2)"
    if (t > 0) == expect_positive:
        return "holds (|t| >= 2)"
    return "REVERSED (|t| >= 2)"


def claims(rows: dict) -> list[dict[str, typing.Any]]:
    out = []
    for a, b, text in CLAIMS + TIES:
        if a not in rows or b not in rows:
            continue
        t, dof = welch(rows[a]["val_losses"], rows[b]["val_losses"])
        diff = rows[a]["mean"] - rows[b]["mean"]
        if (a, b, text) in TIES:
            if not math.isfinite(t):
                verdict = "undetermined (one seed)"
            else:
                verdict = (
                    "consistent (no resolved difference)" if abs(t) < 2 else "DIFFERS (|t| >= 2)"
                )
        else:
            verdict = _verdict(t, True)
        pd = np.subtract(rows[a]["val_losses"], rows[b]["val_losses"])
        sd = float(np.std(pd, ddof=1)) if pd.size > 1 else 0.0
        paired_t = float(pd.mean() / (sd / math.sqrt(pd.size))) if sd > 0 else float("nan")
        out.append(
            {
                "claim": text,
                "a": a,
                "b": b,
                "diff": diff,
                "t": t,
                "dof": dof,
                "verdict": verdict,
                "paired_t": paired_t,
                "tie": (a, b, text) in TIES,
                "paper_sign": None if (a, b, text) in TIES else bool(diff > 0),
            }
        )
    return out


def _fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if math.isfinite(x) else "n/a"


def markdown(summary: dict) -> str:
    s, rows = summary["settings"], summary["rows"]
    n_seeds = len(s["seeds"])
    cmd = f"python experiments/table1_quality.py --scale {summary['scale']}"
    if summary.get("seeds_override") is not None:
        cmd += f" --seeds {summary['seeds_override']}"
    lines = [
        f"# Table I at CPU scale: model quality (`{summary['scale']}` scale)",
        "",
        f"Generated by `{cmd}`"
        + (
            " (the full CPU table: `python experiments/table1_quality.py --scale cpu`, a few "
            "hours on 2 cores)."
            if summary["scale"] != "cpu"
            else "."
        ),
        "",
        f"Setup: preset `{s['preset']}`"
        + (f" with overrides {dict(s['model'])}" if s["model"] else " (4 layers, width 128)")
        + f", byte tokens, Shakespeare (the default corpus), {s['steps']} steps of "
        f"{s['batch']} x {s['seq_len']} tokens ({s['steps'] * s['batch'] * s['seq_len']:,} "
        f"tokens), AdamW, warmup {s['warmup']} + cosine decay, learning rates "
        f"{', '.join(f'{x:g}' for x in s['lrs'])} swept on seed {s['seeds'][0]}, "
        f"{n_seeds} seeds (same data order and initialisation per seed for every "
        f"configuration). Final validation loss over {s['eval_batches']} batches, nats/token, "
        f"mean +- sample std over seeds. Welch t against Independent SR (positive: higher loss "
        f"than SR). {summary['device']}, jax {summary['jax']}.",
        "",
        "| configuration | best LR | val loss | gap to BF16 | Welch t vs SR | paper: best LR "
        "| paper: val loss | paper: gap |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pbf = PAPER["bf16"][1]
    for config, r in rows.items():
        p_lr, p_mean, p_std = PAPER[config]
        gap = "—" if config == "bf16" else f"{r.get('gap_bf16', float('nan')):+.3f}"
        pgap = "—" if config == "bf16" else f"{p_mean - pbf:+.3f}"
        t = r.get("welch_t_vs_sr")
        ts = "—" if t is None else _fmt(t, "+.1f")
        lines.append(
            f"| {r['label']} | {r['best_lr']:g} | {r['mean']:.3f} +- {_fmt(r['std'])} | {gap} "
            f"| {ts} | {p_lr} | {p_mean:.3f} +- {p_std:.3f} | {pgap} |"
        )
    lines += [
        "",
        "Per-seed final validation losses:",
        "",
        "| configuration | " + " | ".join(f"seed {x}" for x in s["seeds"]) + " |",
        "| --- | " + " | ".join("---:" for _ in s["seeds"]) + " |",
    ]
    for r in rows.values():
        lines.append(f"| {r['label']} | " + " | ".join(f"{v:.4f}" for v in r["val_losses"]) + " |")
    if len(s["lrs"]) > 1:
        lines += [
            "",
            f"Learning-rate sweep (seed {s['seeds'][0]}, final validation loss):",
            "",
            "| configuration | " + " | ".join(f"lr {x:g}" for x in s["lrs"]) + " |",
            "| --- | " + " | ".join("---:" for _ in s["lrs"]) + " |",
        ]
        for r in rows.values():
            lines.append(
                f"| {r['label']} | "
                + " | ".join(_fmt(v, ".4f") for v in r["sweep"].values())
                + " |"
            )
    lines += [
        "",
        "## Which orderings of the paper hold at this scale",
        "",
        "Each line compares two configurations by Welch's t over the seeds (|t| >= 2 counts as "
        f"resolved; with {n_seeds} seeds per side this is a rough screen, not a significance "
        "test at a stated level: the two-sided 5% critical value of t with 2-4 degrees of "
        "freedom is 2.8-4.3).",
        "",
        "| paper's claim | difference (A - B) | Welch t | verdict here (Welch) | paired t |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for c in summary["claims"]:
        lines.append(
            f"| {c['claim']} ({c['a']} vs {c['b']}) | {c['diff']:+.4f} | {_fmt(c['t'], '+.1f')} "
            f"| {c['verdict']} | {_fmt(c.get('paired_t', float('nan')), '+.1f')} |"
        )
    orders = [c for c in summary["claims"] if not c.get("tie")]
    if orders:
        same = sum(bool(c["paper_sign"]) for c in orders)
        held = sum(c["verdict"].startswith("holds") for c in orders)
        rev = sum(c["verdict"].startswith("REVERSED") for c in orders)
        paired = sum(
            math.isfinite(c["paired_t"]) and c["paired_t"] >= 2 and bool(c["paper_sign"])
            for c in orders
        )
        lines += [
            "",
            f"Summary (generated): of the paper's {len(orders)} orderings, {same} have the "
            f"paper's sign here, {held} are resolved in the paper's direction by Welch's t "
            f"(|t| >= 2) and {rev} are resolved against it; {paired} reach a paired t >= 2 in "
            "the paper's direction. Orderings that are not resolved are within seed noise at "
            "this scale: they neither confirm nor contradict the paper.",
        ]
    lines += [
        "",
        "Welch's t treats the seeds of two configurations as independent samples, as the "
        "paper does. But a seed fixes the initialisation and the data order for every "
        "configuration, and much of the seed-to-seed spread is shared by all of them, so the "
        "paired t (mean over seeds of the per-seed difference over its standard error, "
        f"{n_seeds - 1} degrees of freedom) resolves smaller differences; it is given for "
        "information only, the verdicts use Welch's t.",
    ]
    lines += [
        "",
        f"![validation loss curves](table1_{summary['scale']}.png)",
        "",
        "The paper trains a 12-layer model for 2000 steps of 8 x 2048 tokens; this model is "
        "far smaller and trains far shorter, so the absolute losses are not comparable and "
        "only the orderings are. Differences smaller than about twice the seed standard "
        f"deviation are not resolved by {n_seeds} seeds.",
    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, runs: dict, path: pathlib.Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = summary["settings"]
    fig = Figure(figsize=(14, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_all, ax_diff = fig.subplots(1, 2)

    def curves(config):
        row = summary["rows"][config]
        cs = [runs[run_key(config, row["best_lr"], seed)]["val_curve"] for seed in s["seeds"]]
        return np.array([p[0] for p in cs[0]]), np.array([[p[1] for p in c] for c in cs])

    base = "bf16" if "bf16" in summary["rows"] else next(iter(summary["rows"]))
    _, base_vals = curves(base)
    for config, row in summary["rows"].items():
        steps, vals = curves(config)
        (line,) = ax_all.plot(steps, vals.mean(axis=0), marker=".", label=row["label"])
        ax_all.fill_between(
            steps, vals.min(axis=0), vals.max(axis=0), alpha=0.12, color=line.get_color()
        )
        diff = vals - base_vals  # per seed: same initialisation and data order
        ax_diff.plot(steps, diff.mean(axis=0), marker=".", color=line.get_color())
        ax_diff.fill_between(
            steps, diff.min(axis=0), diff.max(axis=0), alpha=0.10, color=line.get_color()
        )
    ax_all.set_title("validation loss (mean over seeds, min-max band)")
    ax_all.set_ylabel("nats/token")
    ax_diff.set_title(
        f"validation loss minus {summary['rows'][base]['label']}, per seed (mean, min-max band)"
    )
    ax_diff.set_ylabel("difference, nats/token")
    ax_diff.set_xlim(s["steps"] // 4, s["steps"] * 1.02)
    late = [i for i, st in enumerate(curves(base)[0]) if st >= s["steps"] // 4]
    spread = [np.abs(curves(c)[1][:, late] - base_vals[:, late]).max() for c in summary["rows"]]
    lim = 1.1 * max(spread + [1e-3])
    ax_diff.set_ylim(-lim, lim)
    ax_diff.axhline(0, color="k", lw=0.8)
    for ax in (ax_all, ax_diff):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_all.legend(fontsize=7)
    fig.suptitle(f"Table I, {summary['scale']} scale: {s['preset']}, {s['steps']} steps")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=list(SCALES), default="quick")
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated subset of the nine configurations (default: all)",
    )
    ap.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="run seeds 0..N-1 instead of the scale's own (finished runs are reused)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    summary = run_all(args.scale, configs, pathlib.Path(args.out), args.seeds)
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
