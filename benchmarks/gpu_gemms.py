"""Bare layer GEMMs on a GPU: bf16 against int8 (into int32), per XLA GEMM backend.

Table III on an accelerator times whole FFN blocks, quantizers included. This script times
the GEMMs alone: for each FFN shape (W1..W9, `--tokens` tokens) the three GEMMs of one
linear layer, forward `(T, H) @ (H, D)`, dX `(T, D) @ (H, D)^T` and dW `(T, H)^T @ (T, D)`,
once with bf16 operands and once with int8 operands into int32, and names what each compiled
to: a cuBLAS(Lt) call or an XLA-generated (Triton) GEMM fusion. XLA reads its flags once per
process, so every flag set of `FLAG_SETS` runs in a fresh child process: `default` (XLA as it
comes, which lets its autotuner pick Triton GEMM fusions) and `cublas`
(`--xla_gpu_enable_triton_gemm=false`: every GEMM goes to cuBLAS).

Each time is the median over `--repeats` round-robin rounds of `--calls` calls issued back to
back (one sync at the end), divided by the calls, so that dispatch overlaps the GPU's work.

    python benchmarks/gpu_gemms.py                        # W1, W2, W9 at 8192 tokens
    python benchmarks/gpu_gemms.py --shapes W1,W2,W3,W4,W5,W6,W7,W8,W9

Writes `gpu_gemms.{json,md}` into `--out` (default `docs/results/`). Meant for a GPU; on a
CPU it runs but measures nothing the project claims.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_qdot import run_meta  # noqa: E402

import models  # noqa: E402
from s3req.tpu import parse_gemms  # noqa: E402


FLAG_SETS = {"default": "", "cublas": "--xla_gpu_enable_triton_gemm=false"}
"""The XLA flag sets compared, each added to the `XLA_FLAGS` of a child process."""

GEMMS = {
    # name: (lhs shape, rhs shape, contracting dims), from tokens T, H and D.
    "forward": (lambda t, h, d: ((t, h), (h, d)), ((1,), (0,))),
    "dX": (lambda t, h, d: ((t, d), (h, d)), ((1,), (1,))),
    "dW": (lambda t, h, d: ((t, h), (t, d)), ((0,), (0,))),
}
DTYPES = {"bf16": (jnp.bfloat16, jnp.bfloat16), "int8": (jnp.int8, jnp.int32)}


def gemm(contract, out_dtype):
    """The jitted `dot_general` contracting `contract` into `out_dtype`."""
    dims = (contract, ((), ()))
    return jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype))


def operand(key, shape, dtype):
    if dtype == jnp.int8:
        return jr.randint(key, shape, -127, 128, jnp.int8)
    return jr.normal(key, shape, dtype)


def kernel(f, a, b) -> str:
    """What the compiled GEMM runs as: `cuBLAS`, `Triton` or the HLO op."""
    text = f.lower(a, b).compile().as_text() or ""
    if "__cublas" in text:
        return "cuBLAS"
    if "triton" in text:
        return "Triton"
    return ", ".join(sorted({g.op for g in parse_gemms(text)})) or "?"


def measure(shapes: list[str], tokens: int, repeats: int, calls: int) -> list[dict]:
    """Median seconds per GEMM of every (shape, GEMM, dtype), timed round-robin."""
    cases = {}
    for name in shapes:
        h, d = models.PAPER_FFN_SHAPES[name]
        for g, (shape_of, contract) in GEMMS.items():
            sa, sb = shape_of(tokens, h, d)
            for dt, (in_dtype, out_dtype) in DTYPES.items():
                ka, kb = jr.split(jr.key(len(cases)))
                a, b = operand(ka, sa, in_dtype), operand(kb, sb, in_dtype)
                f = gemm(contract, out_dtype)
                jax.block_until_ready(f(a, b))
                cases[(name, g, dt)] = (f, a, b, kernel(f, a, b))
    times = {k: [] for k in cases}
    for _ in range(repeats):
        for k, (f, a, b, _) in cases.items():
            t0 = time.perf_counter()
            out = [f(a, b) for _ in range(calls)]
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls)
            del out
    rows = []
    for (name, g, dt), (_, a, b, kern) in cases.items():
        h, d = models.PAPER_FFN_SHAPES[name]
        rows.append(
            {
                "shape": name,
                "h": h,
                "d_ffn": d,
                "tokens": tokens,
                "gemm": g,
                "dtype": dt,
                "kernel": kern,
                "median_s": float(np.median(times[(name, g, dt)])),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shapes", default="W1,W2,W9")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shapes = args.shapes.split(",")
    if args.child:  # one flag set: print the rows as JSON for the parent
        print(json.dumps(measure(shapes, args.tokens, args.repeats, args.calls)))
        return None
    runs = {}
    for label, flags in FLAG_SETS.items():
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        child = [sys.executable, __file__, "--child", "--shapes", args.shapes]
        child += ["--tokens", str(args.tokens), "--repeats", str(args.repeats)]
        child += ["--calls", str(args.calls)]
        done = subprocess.run(child, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"[gpu_gemms] {label} failed:\n{done.stderr[-4000:]}")
        runs[label] = {"xla_flags": flags, "rows": json.loads(done.stdout.splitlines()[-1])}
        print(f"[gpu_gemms] {label} done", file=sys.stderr, flush=True)
    meta = run_meta(__file__, argv) | {"repeats": args.repeats, "calls": args.calls}
    summary = {"meta": meta, "runs": runs}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemms.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_gemms.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def markdown(s: dict) -> str:
    meta = s["meta"]
    lines = [
        "# Bare layer GEMMs: bf16 against int8, per XLA GEMM backend",
        "",
        f"Generated by `{meta['command']}` on {meta['device']} ({meta['platform']}, jax "
        f"{meta['jax']}): median of {meta['repeats']} round-robin rounds of {meta['calls']} "
        "back-to-back calls per GEMM. bf16 GEMMs read bf16 into bf16, int8 GEMMs int8 into "
        "int32; `kernel` is what XLA compiled each to. TOPS: 2 T H D operations per second.",
    ]
    for label, run in s["runs"].items():
        lines += [
            "",
            f"## {label}" + (f" (`XLA_FLAGS={run['xla_flags']}`)" if run["xla_flags"] else ""),
            "",
            "| shape (H, D_ffn), tokens | GEMM | bf16 ms | bf16 kernel | bf16 TFLOPS | int8 ms "
            "| int8 kernel | int8 TOPS | int8 / bf16 time |",
            "| --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: |",
        ]
        by = {(r["shape"], r["gemm"], r["dtype"]): r for r in run["rows"]}
        for (name, g, dt), r in by.items():
            if dt != "bf16":
                continue
            q = by[(name, g, "int8")]
            ops = 2 * r["tokens"] * r["h"] * r["d_ffn"]
            lines.append(
                f"| {name} ({r['h']}, {r['d_ffn']}), {r['tokens']} | {g} | "
                f"{1e3 * r['median_s']:.3f} | {r['kernel']} | {ops / r['median_s'] / 1e12:.0f} | "
                f"{1e3 * q['median_s']:.3f} | {q['kernel']} | {ops / q['median_s'] / 1e12:.0f} | "
                f"{q['median_s'] / r['median_s']:.2f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
