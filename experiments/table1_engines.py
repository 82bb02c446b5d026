"""Are the Table I runs of different engine commits comparable? One `qdot` per policy, bitwise.

The runs of `docs/results/table1_cpu_runs.jsonl` were trained by engines of several commits
(see `UNRECORDED_ENGINE` and the `commit` field in `table1_quality.py`). This script runs one
`qdot` forward and VJP per Table I policy preset at the shape of the `tiny` model's MLP
(16 x 128 tokens, 128 -> 512), with fixed inputs and one fixed key, under each engine: the
checkout's own and every `--commits` commit (by default every engine that the stored runs
and reruns name, other than the checkout's; each exported with `git archive` into a temporary
folder and imported from there, in a subprocess). It reports, per preset and output
(`out`, `dx`, `dw`), whether the result is bitwise equal to the checkout's and otherwise the
relative difference (`||a - b|| / ||b||`, and the largest elementwise difference over the
largest magnitude).

    python experiments/table1_engines.py            # ~2 min on 2 CPU cores

Writes `table1_cpu_engines.json` into `--out` (default `docs/results/`), which
`table1_quality.py --scale cpu` quotes on its page.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_FILES = ("table1_cpu_runs.jsonl", "table1_cpu_recheck.jsonl")
"""The stored runs (and reruns) whose engines the probe compares, in `--out`."""
PRESETS = (
    "rtne",
    "sr",
    "s3r",
    "s3r-ec-dx",
    "s3r-ec-2way",
    "s3r-bcast",
    "s3r-bcast-ec-dx",
    "s3r-bcast-ec-2way",
)
"""The quantized policies of Table I (BF16 does not call the engine)."""


def run_engines(out: pathlib.Path, checkout: str) -> list[str]:
    """Every engine commit that the runs of `RUN_FILES` in `out` were trained with (a run's
    `commit`, else `UNRECORDED_ENGINE`), in first-seen order, without the checkout's own and
    without a commit named twice (by abbreviations of different lengths). Runs whose engine
    names no commit (`not recorded`, `unknown`, or uncommitted `+dirty` changes) cannot be
    exported and are left out."""
    from table1_quality import engine_of

    def full(commit: str) -> str:
        got = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", commit + "^{commit}"],
            capture_output=True,
            text=True,
        )
        if got.returncode != 0:
            raise ValueError(f"table1_engines: no commit {commit!r} in {ROOT} (a shallow clone?)")
        return got.stdout.strip()

    seen, commits = {full(checkout.removesuffix("+dirty"))}, []
    for name in RUN_FILES:
        path = out / name
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            commit = engine_of(json.loads(line))
            if commit.endswith("+dirty") or commit in ("unknown", "not recorded"):
                continue  # no commit to export (the page's engine table names these runs)
            if full(commit) not in seen:
                seen.add(full(commit))
                commits.append(commit)
    return commits


def probe(path: str) -> None:
    """One `qdot` forward and VJP per preset with the engine on `sys.path`; saved to `path`."""
    import jax
    import jax.random as jr

    import s3req
    from policies import preset

    kx, kw, kg, kk = jr.split(jr.key(0), 4)
    x = jr.normal(kx, (16, 128, 128))
    w = jr.normal(kw, (128, 512)) * 0.05
    g = jr.normal(kg, (16, 128, 512))
    res = {}
    for name in PRESETS:
        policy = preset(name)
        out, vjp = jax.vjp(jax.jit(lambda x, w: s3req.qdot(x, w, policy=policy, key=kk)), x, w)
        dx, dw = vjp(g)
        for part, a in (("out", out), ("dx", dx), ("dw", dw)):
            res[f"{name}/{part}"] = np.asarray(a)
    np.savez(path, **res)


def run_probe(tree: pathlib.Path, path: pathlib.Path) -> dict[str, np.ndarray]:
    """`probe` in a subprocess that imports `s3req` and `policies` from `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, __file__, "--probe", str(path)], env=env, check=True)
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float | bool]:
    d = a.astype(np.float64) - b.astype(np.float64)
    return {
        "identical": bool(np.array_equal(a, b)),
        "frac_elements_differing": float(np.mean(d != 0)),
        "rel_norm": float(np.linalg.norm(d) / np.linalg.norm(b)),
        "rel_max": float(np.max(np.abs(d)) / np.max(np.abs(b))),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--commits",
        default=None,
        help="comma-separated engine commits to compare with the checkout (default: every "
        "engine of the stored runs and reruns in --out)",
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        probe(args.probe)
        return {}

    from table1_quality import engine_commit

    result = {"checkout": engine_commit(), "presets": list(PRESETS)}
    out = pathlib.Path(args.out)
    if args.commits is None:
        commits = run_engines(out, result["checkout"])
    else:
        commits = [c for c in args.commits.split(",") if c]
    with tempfile.TemporaryDirectory() as tmp:
        mine = run_probe(ROOT, pathlib.Path(tmp) / "checkout.npz")
        result["engines"] = {}
        for commit in commits:
            tree = pathlib.Path(tmp) / commit
            tree.mkdir()
            tar = subprocess.run(
                ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=tar, check=True)
            theirs = run_probe(tree, pathlib.Path(tmp) / f"{commit}.npz")
            result["engines"][commit] = {k: compare(theirs[k], mine[k]) for k in mine}
    out.mkdir(parents=True, exist_ok=True)
    (out / "table1_cpu_engines.json").write_text(json.dumps(result, indent=1))
    for commit, parts in result["engines"].items():
        print(f"{commit} vs {result['checkout']}:")
        for k, c in parts.items():
            same = "identical" if c["identical"] else f"rel {c['rel_norm']:.1e}"
            print(f"  {k:26s} {same}")
    return result


if __name__ == "__main__":
    main()
