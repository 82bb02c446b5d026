"""The dense layer's CUDA kernel against the reference path and two other forms, on a GPU.

The SwiGLU FFN block's forward + backward (`experiments/table3_ffn_speed.py`'s timing) at
one of the paper's shapes, per policy and per form of the dX GEMM `Q Wq^T`:

- `reference`: the reference path (`s3req._backward.KERNELS = "reference"`);
- `kernel`: the CUDA kernel, codes and weight codes behind one `optimization_barrier`
  (`s3req/_kernels_gpu.py`; `KERNELS = "cuda"`, what `"auto"` lowers on CUDA);
- `result`: a barrier on the GEMM's int32 result instead;
- `weight codes`: a barrier on the weight codes alone;
- `kernel and result`: both barriers;
- `kernel, no checks`: the kernel with the run-time checks (`eqx.branched_error_if`) removed,
  to measure what they cost: each is an XLA conditional, whose predicate XLA:GPU copies to
  the host before it runs the branch.

For each compiled program it counts the cuBLAS calls and the Triton GEMM fusions of its
optimized HLO, times it (median of `--repeats` round-robin rounds, one process) and checks
that its gradients are the reference's bit for bit (the barriers are identities).

    python benchmarks/gpu_kernels.py                  # W2 and W9, 8192 tokens (a GPU)
    python benchmarks/gpu_kernels.py --shapes W2,W9
    python benchmarks/gpu_kernels.py --pages          # the page from gpu_kernels.json

Writes `gpu_kernels.{json,md}` into `--out` (default `docs/results/`).
"""

import argparse
import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_qdot import run_meta  # noqa: E402
from table3_ffn_speed import fwd_bwd  # noqa: E402

import models  # noqa: E402
import s3req._backward as backward  # noqa: E402
from policies import PRESETS  # noqa: E402
from s3req._gemms import dot  # noqa: E402


def _result_barrier(self, q, wq):
    i32 = dot(q, wq, ((2,), (1 - self._h_axis,)))
    return jax.lax.optimization_barrier(i32).astype(jnp.float32)


def _weight_barrier(self, q, wq):
    wq = jax.lax.optimization_barrier(wq)
    return dot(q, wq, ((2,), (1 - self._h_axis,))).astype(jnp.float32)


def _both_barriers(self, q, wq):
    q, wq = jax.lax.optimization_barrier((q, wq))
    return _result_barrier(self, q, wq)


class _NoChecks:
    """`equinox` with `branched_error_if` an identity (for the `no checks` form)."""

    def __getattr__(self, name):
        return getattr(eqx, name)

    @staticmethod
    def branched_error_if(x, pred, index, msgs):
        return x


FORMS = {
    # form: (KERNELS, replacement of `Dense.gemm_dx` or None, whether the checks run)
    "reference": ("reference", None, True),
    "kernel": ("cuda", None, True),
    "result": ("reference", _result_barrier, True),
    "weight codes": ("reference", _weight_barrier, True),
    "kernel and result": ("reference", _both_barriers, True),
    "kernel, no checks": ("cuda", None, False),
}
RUNS = {
    "bf16": ("reference",),
    "sr": ("reference", "kernel"),
    "rtne": (
        "reference",
        "kernel",
        "result",
        "weight codes",
        "kernel and result",
        "kernel, no checks",
    ),
    "s3r": ("reference", "kernel", "result", "kernel and result", "kernel, no checks"),
    "s3r-ec-dx": ("reference", "kernel"),
    "s3r-ec-2way": ("reference", "kernel"),
}
"""The forms measured per policy."""


def compile_form(ffn, args, form: str):
    """The FFN block's forward + backward compiled with the dX GEMM in `form`."""
    kernels, gemm_dx, checks = FORMS[form]
    params, static = eqx.partition(ffn, eqx.is_array)
    f = jax.jit(lambda p, *a: fwd_bwd(eqx.combine(p, static), *a))
    old = backward.KERNELS, backward.Dense.gemm_dx, backward.eqx
    backward.KERNELS = kernels
    if gemm_dx is not None:
        backward.Dense.gemm_dx = gemm_dx
    if not checks:
        backward.eqx = _NoChecks()
    try:
        return f.lower(params, *args).compile(), (params, *args)
    finally:
        backward.KERNELS, backward.Dense.gemm_dx, backward.eqx = old


def measure(shape: str, tokens: int, repeats: int) -> list[dict]:
    h, d = models.PAPER_FFN_SHAPES[shape]
    kx, kg, kw = jr.split(jr.key(0), 3)
    x = jr.normal(kx, (2, tokens // 2, h), jnp.bfloat16)
    g = jr.normal(kg, (2, tokens // 2, h), jnp.bfloat16)
    base = models.FFN(h, d, None, key=kw)
    compiled, outs, rows = {}, {}, []
    for policy, forms in RUNS.items():
        ffn = eqx.tree_at(
            lambda m: (m.gate.policy, m.up.policy, m.down.policy),
            base,
            (PRESETS[policy],) * 3,
            is_leaf=lambda n: n is None,
        )
        for form in forms:
            c, args = compile_form(ffn, (x, g, jr.key(1)), form)
            text = c.as_text() or ""
            out = jax.block_until_ready(c(*args))
            ref = outs.setdefault(policy, out)
            same = all(
                bool(jnp.array_equal(a, b))
                for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref))
            )
            compiled[(policy, form)] = (c, args)
            rows.append(
                {
                    "shape": shape,
                    "h": h,
                    "d_ffn": d,
                    "tokens": tokens,
                    "policy": policy,
                    "form": form,
                    "cublas": text.count('custom_call_target="__cublas$lt$matmul"'),
                    "triton_gemm": text.count("kind=kCustom, calls=%gemm_fusion"),
                    "conditionals": text.count(" conditional("),
                    "same_as_reference": same,
                }
            )
            print(f"[gpu_kernels] {shape} {policy} {form}: {rows[-1]}", file=sys.stderr)
    times = {k: [] for k in compiled}
    for _ in range(repeats):
        for k, (c, args) in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[k].append(time.perf_counter() - t0)
    for r in rows:
        r["median_s"] = float(np.median(times[(r["policy"], r["form"])]))
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shapes", default="W2,W9")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--pages", action="store_true", help="rewrite the page from the JSON")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.pages:
        summary = json.loads((out / "gpu_kernels.json").read_text())
    else:
        rows = [r for s in args.shapes.split(",") for r in measure(s, args.tokens, args.repeats)]
        meta = run_meta(__file__, argv) | {"repeats": args.repeats}
        summary = {"meta": meta, "rows": rows}
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_kernels.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_kernels.md").write_text(markdown(summary))
    print(markdown(summary))
    return summary


def markdown(s: dict) -> str:
    meta = s["meta"]
    lines = [
        "# The dense layer's CUDA kernel: the FFN block on a GPU",
        "",
        f"Generated by `{meta['command']}` on engine commit "
        f"`{meta.get('engine_commit', 'unknown')}`, {meta['device']} ({meta['platform']}, jax "
        f"{meta['jax']})"
        + (f"; {meta['note']}" if "note" in meta else "")
        + f". The SwiGLU FFN block's forward + backward, median of {meta['repeats']} "
        "round-robin repeats in one process, per policy and form of the dX GEMM: `reference` "
        "(the reference path), `kernel` (codes and weight codes behind one "
        "`optimization_barrier`, `s3req/_kernels_gpu.py`), `result` (a barrier on the int32 "
        "result), `weight codes` (a barrier on the weight codes alone), `kernel and result` "
        "(both), `kernel, no checks` (the kernel without the run-time checks, each an XLA "
        "conditional whose predicate a GPU copies to the host). cuBLAS calls, Triton GEMM "
        "fusions and conditionals are counted in the optimized HLO; "
        "`bit for bit`: the gradients equal those of the reference form.",
        "",
        "| shape, tokens | policy | form | cuBLAS calls | Triton GEMM fusions | conditionals "
        "| ms | BF16 time / time | bit for bit |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    bf16 = {r["shape"]: r["median_s"] for r in s["rows"] if r["policy"] == "bf16"}
    for r in s["rows"]:
        lines.append(
            f"| {r['shape']} ({r['h']}, {r['d_ffn']}), {r['tokens']} | {r['policy']} | "
            f"{r['form']} | {r['cublas']} | {r['triton_gemm']} | {r.get('conditionals', 'n/a')} | "
            f"{1e3 * r['median_s']:.1f} | "
            f"{bf16[r['shape']] / r['median_s']:.2f} | "
            f"{_same(r['same_as_reference'])} |"
        )
    return "\n".join(lines) + "\n"


def _same(v) -> str:
    """`yes` / `no`, or the statistic an earlier run compared (e.g. `sum |dX|` equal)."""
    return v + " equal" if isinstance(v, str) else ("yes" if v else "no")


if __name__ == "__main__":
    main()
