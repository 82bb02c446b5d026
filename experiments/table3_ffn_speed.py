"""Table III of the paper: forward + backward of one SwiGLU FFN block per rounding policy.

One `models.FFN` block (gate, up, down: three `QuantLinear`s) at the paper's shapes W1..W9
(`models.PAPER_FFN_SHAPES`), bf16 activations and upstream gradient, float32 weights, timed
as `y, vjp = eqx.filter_vjp(ffn, x); vjp(g)` under `jax.jit`. All policies of a shape are
compiled first and then timed round-robin in one process (the median of the repeats), with
the timing helper of `benchmarks/bench_qdot.py`; only ratios measured side by side are
reported, never absolute CPU times (the machine is shared and noisy).

CPU scaling (default): the relative cost of the gradient quantizer against the GEMMs scales
as 1/H, but the weight-sized work of every call (quantizing W in the forward pass, the row
sums and rank-1 terms of the corrections) scales as 1/T, T = batch x seq tokens: with few
tokens the GEMMs are bound by reading the weights and any extra weight-sized pass costs as
much as a GEMM (a first run with 64 tokens showed S3R-EC at +100-190% over S3R for that
reason). So the CPU runs keep at least 256 tokens: they use the true (H, D_ffn) with
T = min(2048, 3e9 / (H D_ffn)) tokens (rounded down to a multiple of 128) when that is at
least 256 (W1, W2), and otherwise 256 tokens with H and D_ffn scaled down by a common factor
(keeping D_ffn / H, multiples of 128) so that T x H x D_ffn <= 3e9 (W3..W9: those rows
measure a smaller H than the paper's and are marked; their float32 weights would also not
fit the machine at W9).
`--full` runs the exact shapes with `--tokens` tokens (default 8192 = 4 x 2048), for a GPU.

    python experiments/table3_ffn_speed.py                 # CPU, ~15 min on 2 shared cores
    python experiments/table3_ffn_speed.py --full          # exact W1..W9 (GPU)
    python experiments/table3_ffn_speed.py --smoke --out /tmp/t3   # smoke test
    python experiments/table3_ffn_speed.py --full --pages          # rewrite a page from its JSON

Runs under the `warm` allocator unless `--allocator` says otherwise (see
`benchmarks/bench_qdot.py`: without it glibc page-faults large temporaries in on every call).
Writes `table3_ffn_speed[_full].{json,md}` into `--out` (default `docs/results/`).
"""

import argparse
import json
import math
import os
import pathlib
import platform
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_qdot import (  # noqa: E402
    _commit,
    _time,
    allocator_mode,
    allocator_note,
    command_line,
    cpu_gemms,
    gemm_text,
    load_text,
    machine_load,
    run_with_allocator,
)

import models  # noqa: E402
from policies import PRESETS  # noqa: E402


POLICIES = ("bf16", "rtne", "sr", "s3r", "s3r-ec-2way", "s3r-ec-dx")
# The paper's Table III (TPU v5p): speedup over BF16 for RTNE, SR, S3R; EC overhead (%) over S3R.
PAPER = {
    "W1": (1.12, 0.58, 1.08, 13.0, 14.8),
    "W2": (1.45, 0.91, 1.44, 7.3, 9.6),
    "W3": (1.73, 1.29, 1.73, -0.6, 1.7),
    "W4": (1.92, 1.54, 1.92, 4.8, 4.1),
    "W5": (1.84, 1.53, 1.83, 2.8, 3.3),
    "W6": (1.89, 1.60, 1.90, 2.7, 3.1),
    "W7": (1.87, 1.56, 1.87, 3.4, 3.1),
    "W8": (1.82, 1.58, 1.81, 0.7, 2.7),
    "W9": (1.81, 1.66, 1.81, 3.8, 2.2),
}
BUDGET = 3e9  # T * H * D_ffn on the CPU
MIN_TOKENS = 256
MAX_TOKENS = 2048


def cpu_shape(h: int, d: int, budget: float = BUDGET, min_tokens: int = MIN_TOKENS):
    """`(H, D_ffn, tokens, scaled)` of the CPU run of a paper shape `(h, d)`."""
    tokens = int(min(MAX_TOKENS, budget / (h * d)) // 128 * 128)
    if tokens >= min_tokens:
        return h, d, tokens, False
    s = math.sqrt(budget / (min_tokens * h * d))
    h2 = max(128, int(round(h * s / 128)) * 128)
    d2 = max(128, int(round(h2 * d / h / 128)) * 128)
    return h2, d2, min_tokens, True


def fwd_bwd(ffn, x, g, key):
    y, vjp = eqx.filter_vjp(lambda m, x: m(x, key=key), ffn, x)
    return y, vjp(g)


def bench(h: int, d: int, tokens: int, repeats: int, policies=POLICIES) -> dict[str, float]:
    batch = 2 if tokens >= 128 else 1
    seq = tokens // batch
    kx, kg, kw = jr.split(jr.key(0), 3)
    x = jr.normal(kx, (batch, seq, h), jnp.bfloat16)
    g = jr.normal(kg, (batch, seq, h)) * jnp.exp(jr.normal(jr.fold_in(kg, 1), (batch, seq, h)))
    g = g.astype(jnp.bfloat16)
    key = jr.key(1)
    base = models.FFN(h, d, None, key=kw)
    fns, args = {}, {}
    for name in policies:
        # The same weights under every policy (QuantLinear's policy is an ordinary field).
        ffn = eqx.tree_at(
            lambda m: (m.gate.policy, m.up.policy, m.down.policy),
            base,
            (PRESETS[name],) * 3,
            is_leaf=lambda n: n is None,
        )
        fns[name] = eqx.filter_jit(fwd_bwd)
        args[name] = (ffn, x, g, key)
    return _time(fns, args, repeats)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--full", action="store_true", help="exact W1..W9 shapes (for a GPU)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per block with --full")
    ap.add_argument("--smoke", action="store_true", help="W1 at 1/8 width, 16 tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", default=",".join(models.PAPER_FFN_SHAPES))
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--suffix", default="", help="added to the page's file name, e.g. _cublas")
    ap.add_argument(
        "--allocator",
        choices=("warm", "default", "current"),
        default="warm",
        help="glibc malloc settings (see benchmarks/bench_qdot.py); restarts the script",
    )
    ap.add_argument("--pages", action="store_true", help="rewrite the page from its JSON")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    stem = "table3_ffn_speed" + ("_full" if args.full else "") + args.suffix
    if args.pages:
        summary = json.loads((out / f"{stem}.json").read_text())
        (out / f"{stem}.md").write_text(markdown(summary))
        return summary
    run_with_allocator(args.allocator, __file__)
    names = args.shapes.split(",")
    if args.smoke:
        names = names[:1]
    rows = []
    for name in names:
        h, d = models.PAPER_FFN_SHAPES[name]
        if args.full:
            shape = (h, d, args.tokens, False)
        elif args.smoke:
            shape = cpu_shape(h // 8, d // 8, budget=2e6, min_tokens=16)
            shape = (shape[0], shape[1], shape[2], True)
        else:
            shape = cpu_shape(h, d)
        times = bench(shape[0], shape[1], shape[2], args.repeats)
        rows.append(
            {
                "name": name,
                "paper_shape": [h, d],
                "h": shape[0],
                "d_ffn": shape[1],
                "tokens": shape[2],
                "scaled": shape[3],
                "median_s": times,
                "load": machine_load(),
            }
        )
        t = times
        print(
            f"[table3] {name} {shape}: "
            + ", ".join(f"{p} {t['bf16'] / t[p]:.2f}x" for p in POLICIES),
            file=sys.stderr,
            flush=True,
        )
    meta = {
        "mode": "full" if args.full else ("smoke" if args.smoke else "cpu"),
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "allocator": allocator_mode(),
        "engine_commit": _commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        **({"gemms": cpu_gemms()} if jax.default_backend() == "cpu" else {}),
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
    }
    out.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta, "rows": rows}
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    (out / f"{stem}.md").write_text(markdown(summary))
    print((out / f"{stem}.md").read_text())
    return summary


def markdown(s: dict) -> str:
    meta = s["meta"]
    cmd = (
        "python experiments/table3_ffn_speed.py"
        + {"full": " --full", "smoke": " --smoke", "cpu": ""}[meta["mode"]]
    )
    on_cpu = meta["device"].lower() == "cpu"
    flags = meta.get("xla_flags", "")
    lines = [
        f"# Table III: SwiGLU FFN block forward + backward ({meta['mode']})",
        "",
        f"Generated by `{meta.get('command', cmd)}` on engine commit "
        f"`{meta.get('engine_commit', 'unknown')}`, {meta['device']} ({meta['platform']}, "
        f"jax {meta['jax']}"
        + (f", `XLA_FLAGS={flags}`" if flags else "")
        + f"); median of {meta['repeats']} round-robin repeats after compiling every policy"
        + (
            f" ({load_text([r['load'] for r in s['rows']])})"
            if on_cpu and "load" in s["rows"][0]
            else ""
        )
        + ", bf16 "
        "activations and gradients, float32 weights. Speedups are BF16 time / policy time "
        "(higher is faster); the S3R-EC columns are the extra time over S3R (Phi2D) in %. "
        "Times were measured side by side in one process"
        + (" on a shared machine; differences of a few % are within its noise" if on_cpu else "")
        + ". In brackets: the paper's TPU v5p value."
        + (f" Allocator: {allocator_note(meta.get('allocator', 'default'))}." if on_cpu else ""),
        "",
    ]
    if on_cpu and meta["mode"] != "full":
        lines += [
            gemm_text(meta.get("gemms")) + " The speedups over BF16 are therefore not "
            "evidence for or against the paper's; the claims that transfer are the ratios "
            "between INT8 policies: S3R vs RTNE, Independent SR vs S3R, and the EC overheads. "
            "No vector-operation count per element is derived: the CPU has no separate vector "
            "unit to attribute time to. Rows marked * ran at a reduced H (see the script's "
            "docstring).",
            "",
        ]
    lines += [
        "| shape | paper (H, D_ffn) | run (H, D_ffn), tokens | INT8 RTNE | Indep. SR "
        "| S3R (Phi2D) | S3R-EC two-way | S3R-EC dX-only | S3R / RTNE time | SR / S3R time |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in s["rows"]:
        t = r["median_s"]
        p = PAPER[r["name"]]
        sp = lambda n, pv: f"{t['bf16'] / t[n]:.2f} ({pv:.2f})"
        ov = lambda n, pv: f"{100 * (t[n] / t['s3r'] - 1):+.1f} ({pv:+.1f})"
        star = "*" if r["scaled"] and meta["mode"] == "cpu" else ""
        lines.append(
            f"| {r['name']}{star} | {tuple(r['paper_shape'])} | ({r['h']}, {r['d_ffn']}), "
            f"{r['tokens']} | {sp('rtne', p[0])} | {sp('sr', p[1])} | {sp('s3r', p[2])} | "
            f"{ov('s3r-ec-2way', p[3])} | {ov('s3r-ec-dx', p[4])} | "
            f"{t['s3r'] / t['rtne']:.3f} | {t['sr'] / t['s3r']:.2f} |"
        )
    if not on_cpu:  # absolute times only from an accelerator
        lines += [
            "",
            f"Median times on {meta['device']} (ms):",
            "",
            "| shape | " + " | ".join(POLICIES) + " |",
            "| --- |" + " ---: |" * len(POLICIES),
        ]
        for r in s["rows"]:
            t = r["median_s"]
            lines.append(
                f"| {r['name']} | " + " | ".join(f"{1e3 * t[p]:.3f}" for p in POLICIES) + " |"
            )
    lines += ["", _reading(s["rows"], None if on_cpu else meta["device"])]
    return "\n".join(lines) + "\n"


def _reading(rows: list[dict], accelerator: str | None) -> str:
    """The generated reading of the table; `accelerator` names the device, `None` on CPU."""
    r = lambda row, a, b: row["median_s"][a] / row["median_s"][b]
    pct = lambda row, p: 100 * (r(row, p, "s3r") - 1)
    s3r_rtne = [r(x, "s3r", "rtne") for x in rows]
    sr_s3r = [r(x, "sr", "s3r") for x in rows]
    ec = ", ".join(
        f"{x['name']} ({x['tokens']} tokens): {pct(x, 's3r-ec-2way'):+.0f}% / "
        f"{pct(x, 's3r-ec-dx'):+.0f}%"
        for x in rows
    )
    text = (
        f"Reading (generated): S3R takes {min(s3r_rtne):.3f}-{max(s3r_rtne):.3f} times the "
        f"time of INT8 RTNE (paper: within 1% from W2 on, 4.3% slower at W1); Independent SR "
        f"takes {min(sr_s3r):.2f}-{max(sr_s3r):.2f} times the time of S3R (paper: "
        f"1.09-1.86): on {accelerator or 'this CPU'} "
        + (
            "the per-element Threefry words of the FFN gradients cost "
            + ("little" if max(sr_s3r) < 1.2 else "much")
            + " next to the GEMMs."
            if max(sr_s3r) < 1.2 or min(sr_s3r) >= 1.2
            else "Independent SR ran faster than S3R at some shapes, so more than the "
            "randomness differs between the two programs (how their GEMMs were compiled)."
        )
        + " The S3R-EC overheads over S3R (two-way / dX-only) are "
        f"{ec}."
    )
    most = max(rows, key=lambda x: x["tokens"])
    several = len({x["tokens"] for x in rows}) > 1
    if several and all(
        pct(most, p) <= min(pct(x, p) for x in rows) for p in ("s3r-ec-2way", "s3r-ec-dx")
    ):
        text += (
            f" Both are smallest where a call has the most tokens ({most['name']}; H differs "
            "too, so the two are confounded here; a first run with 64 tokens per call gave "
            "+100-190%): part of the corrections' cost is weight-sized work per call, which "
            "does not scale with the tokens."
        )
    late = [x for x in rows if x["name"] not in ("W1", "W2")]
    if late:
        span = lambda v: f"{min(v):+.1f}%" + (f" to {max(v):+.1f}%" if len(v) > 1 else "")
        paper = [PAPER[x["name"]] for x in late]
        text += (
            f" {'From W3 on' if len(late) > 1 else 'At ' + late[0]['name']} they are "
            f"{span([pct(x, 's3r-ec-2way') for x in late])} (two-way) "
            f"and {span([pct(x, 's3r-ec-dx') for x in late])} (dX-only) here, against the "
            f"paper's {span([p[3] for p in paper])} and {span([p[4] for p in paper])}"
            + (" with many more tokens per chip." if accelerator is None else ".")
        )
    return text


if __name__ == "__main__":
    main()
