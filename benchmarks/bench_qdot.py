"""Time one qdot forward+backward (and the gradient quantizer alone) per policy.

All policies are compiled first, then timed round-robin in one process (machines here are
shared and noisy), and reported as the median of repeats and as ratios against INT8 RTNE and
against the float (bf16) matmul. Writes `docs/results/qdot_speed.{json,md}`.

    python benchmarks/bench_qdot.py [--shapes 4x256x1024x4096,...] [--repeats 15]
"""

import argparse
import json
import os
import pathlib
import platform
import time
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from policies import AbstractTopology, Independent, Policy, PRESETS
from s3req import Block, gradient_step, qdot, quantize_gradient


ROOT = pathlib.Path(__file__).resolve().parent.parent


@typing.final
class JaxRandomIndependent(AbstractTopology):
    """Independent SR drawing its words with `jax.random.bits`, as AQT and Qwix do.

    The same 23-bit thresholds as `Independent()` (bitwise, unsharded), from JAX's own
    Threefry lowering instead of s3req's pure-jnp one. A benchmark-only topology: the peers'
    cost of per-element randomness. Unsharded (`Block.whole`) layouts only.
    """

    stochastic: typing.ClassVar[bool] = True

    def quantizes_once(self) -> bool:
        return False

    def thresholds(self, key, block, product):
        assert isinstance(block, Block) and block.shape == block.global_shape
        words = jax.random.bits(key, block.shape, jnp.uint32)
        return (words >> jnp.uint32(9)).astype(jnp.int32), 23


POLICIES = {
    "bf16": None,
    "rtne": PRESETS["rtne"],
    "sr": PRESETS["sr"],
    "sr-jax": Policy(JaxRandomIndependent()),
    "sr-shared": Policy(Independent(shared=True)),
    "s3r": PRESETS["s3r"],
    "s3r-ec-dx": PRESETS["s3r-ec-dx"],
    "s3r-ec-2way": PRESETS["s3r-ec-2way"],
    "s3r-bcast": PRESETS["s3r-bcast"],
}
# (name, numerator, denominator, target)  -- the targets of the core issue
TARGETS = [
    ("S3R / RTNE", "s3r", "rtne", "<= 1.03"),
    ("S3R-EC dX-only / S3R", "s3r-ec-dx", "s3r", "<= 1.05"),
    ("S3R-EC two-way / S3R", "s3r-ec-2way", "s3r", "<= 1.08"),
    ("Independent SR / S3R", "sr", "s3r", ">= 1.5"),
    ("Independent SR, jax.random.bits / S3R", "sr-jax", "s3r", ">= 1.5"),
]


def _fwd_bwd(policy, x, w, g, key):
    y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
    return y, vjp(g)


def _quantizer(policy, g, key):
    delta, inv = gradient_step(g)
    y = jnp.clip(g * inv, -127, 127)
    return quantize_gradient(policy, y, key, Block.whole(g.shape))


def _time(fns: dict, args: dict, repeats: int, raw: dict | None = None) -> dict:
    for name, f in fns.items():  # compile + warm up
        jax.block_until_ready(f(*args[name]))
        jax.block_until_ready(f(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(repeats):  # round-robin: every policy sees the same machine load
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[name]))
            times[name].append(time.perf_counter() - t0)
    if raw is not None:  # every repeat's time, in round order
        raw.update({name: [float(v) for v in t] for name, t in times.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


def bench_shape(B, S, H, D, repeats, dtype=jnp.bfloat16):
    k = jr.split(jr.key(0), 4)
    x = jr.normal(k[0], (B, S, H), dtype)
    w = jr.normal(k[1], (H, D), jnp.float32) / np.sqrt(H)
    g = (jr.normal(k[2], (B, S, D)) * jnp.exp(jr.normal(k[3], (B, S, D)))).astype(dtype)
    key = jr.key(1)
    full = {
        n: eqx.filter_jit(lambda x, w, g, key, p=p: _fwd_bwd(p, x, w, g, key))
        for n, p in POLICIES.items()
    }
    raw = {}
    step = _time(full, {n: (x, w, g, key) for n in POLICIES}, repeats, raw)
    gq = g.astype(jnp.float32)
    # EC does not change the quantizer: time each distinct quantizer once
    quant_names = ["rtne", "sr", "sr-jax", "sr-shared", "s3r", "s3r-bcast"]
    quant = {
        n: eqx.filter_jit(lambda g, key, p=POLICIES[n]: _quantizer(p, g, key)) for n in quant_names
    }
    qtime = _time(quant, {n: (gq, key) for n in quant_names}, repeats)
    return step, qtime, raw


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x256x1024x4096,4x256x512x2048,8x512x1024x1024")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "qdot_speed"))
    args = ap.parse_args()
    rows = []
    for spec in args.shapes.split(","):
        B, S, H, D = (int(v) for v in spec.split("x"))
        step, qtime, raw = bench_shape(B, S, H, D, args.repeats)
        rows.append(
            {"shape": [B, S, H, D], "fwd_bwd_s": step, "quantizer_s": qtime, "fwd_bwd_all_s": raw}
        )
        print(spec, {n: round(t * 1e3, 2) for n, t in step.items()}, flush=True)
    meta = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "dtype": "bfloat16 x, f32 w",
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(_markdown(meta, rows))
    print(out.with_suffix(".md").read_text())


def _markdown(meta, rows) -> str:
    names = list(rows[0]["fwd_bwd_s"])
    lines = [
        "# qdot speed (CPU)",
        "",
        "Generated by `python benchmarks/bench_qdot.py` "
        f"({meta['device']}, jax {meta['jax']}, median of {meta['repeats']} round-robin repeats, "
        f"load average {meta['load_average_1min']} on a shared 2-core machine, "
        "bf16 activations and gradients, f32 weights). Ratios of times measured side by side in "
        "one process; lower is faster. On CPU the int8 GEMM is not faster than bf16, so these "
        "ratios measure the randomness and vector work around the GEMMs. `sr` is Independent "
        "SR with s3req's pure-jnp Threefry; `sr-jax` draws the same words with "
        "`jax.random.bits`, as AQT and Qwix do (the peers' cost of per-element randomness); "
        "`sr-shared` quantizes once with one threshold tensor.",
        "",
        "## One qdot forward + backward, time relative to INT8 RTNE",
        "",
        "| shape (B, S, H, D) | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for r in rows:
        t = r["fwd_bwd_s"]
        lines.append(
            f"| {tuple(r['shape'])} | "
            + " | ".join(f"{t[n] / t['rtne']:.3f}" for n in names)
            + " |"
        )
    qn = list(rows[0]["quantizer_s"])
    lines += [
        "",
        "## The gradient quantizer alone (thresholds + rounding), relative to RTNE",
        "",
        "| shape (B, S, H, D) | " + " | ".join(qn) + " |",
        "| --- | " + " | ".join("---" for _ in qn) + " |",
    ]
    for r in rows:
        t = r["quantizer_s"]
        lines.append(
            f"| {tuple(r['shape'])} | " + " | ".join(f"{t[n] / t['rtne']:.2f}" for n in qn) + " |"
        )
    lines += [
        "",
        "## Targets (fwd+bwd ratios)",
        "",
        "The ratio of the medians, and in brackets the interquartile range of the per-round "
        "ratios (numerator and denominator timed in the same round-robin round): how much the "
        "shared machine moved the ratio during the run. The EC ratios also moved between runs "
        "of this script on the same code by more than that range.",
        "",
        "| ratio | target | " + " | ".join(str(tuple(r["shape"])) for r in rows) + " |",
        "| --- | --- | " + " | ".join("---" for _ in rows) + " |",
    ]
    for label, num, den, target in TARGETS:
        vals = []
        for r in rows:
            v = r["fwd_bwd_s"][num] / r["fwd_bwd_s"][den]
            bound = float(target.split()[1])
            ok = v <= bound if target.startswith("<=") else v >= bound
            per = np.asarray(r["fwd_bwd_all_s"][num]) / np.asarray(r["fwd_bwd_all_s"][den])
            q1, q3 = np.percentile(per, [25, 75])
            vals.append(f"{v:.3f} [{q1:.2f}-{q3:.2f}] {'met' if ok else 'MISSED'}")
        lines.append(f"| {label} | {target} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
