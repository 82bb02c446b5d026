"""Are the Table I runs of different engine commits comparable? One `qdot` per policy, bitwise.

The runs of `docs/results/table1_cpu_runs.jsonl` were trained by engines of several commits
(see `UNRECORDED_ENGINE` and the `commit` field in `table1_quality.py`). This script runs one
`qdot` forward and VJP per Table I policy preset at the shape of the `tiny` model's MLP
(16 x 128 tokens, 128 -> 512), with fixed inputs and one fixed key, under each engine: the
checkout's own and every `--commits` commit (exported with `git archive` into a temporary
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
COMMITS = ("05a59a9", "e002f7f")
"""The engines of the stored runs that predate recorded commits (`UNRECORDED_ENGINE`)."""
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
    ap.add_argument("--commits", default=",".join(COMMITS))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        probe(args.probe)
        return {}

    from table1_quality import engine_commit

    result = {"checkout": engine_commit(), "presets": list(PRESETS)}
    with tempfile.TemporaryDirectory() as tmp:
        mine = run_probe(ROOT, pathlib.Path(tmp) / "checkout.npz")
        result["engines"] = {}
        for commit in [c for c in args.commits.split(",") if c]:
            tree = pathlib.Path(tmp) / commit
            tree.mkdir()
            tar = subprocess.run(
                ["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(tree)], input=tar, check=True)
            theirs = run_probe(tree, pathlib.Path(tmp) / f"{commit}.npz")
            result["engines"][commit] = {k: compare(theirs[k], mine[k]) for k in mine}
    out = pathlib.Path(args.out)
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
