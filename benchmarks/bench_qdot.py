"""Time one qdot forward+backward (and the gradient quantizer alone) per policy, and one
qragged_dot forward+backward on the expert GEMM of each MoE preset.

All policies are compiled first, then timed round-robin in one process (machines here are
shared and noisy), and reported as the median of repeats and as ratios against INT8 RTNE and
against the float (bf16) matmul, with each program's temporary memory (XLA's compile-time
estimate) and its minor page faults per call. Writes `docs/results/qdot_speed.{json,md}`.

**Allocators.** XLA CPU allocates each call's temporaries with `malloc` and frees them at
its end. glibc serves blocks above its mmap threshold (at most 32 MiB) with a fresh `mmap`, so
a program whose temporaries exceed it page-faults them in again on every call (~1 fault per
4 KiB), and smaller ones do too after glibc trims its heap (or a worker thread's arena gives
them back). Accelerator runtimes keep freed
device memory in a pool instead. By default the script therefore runs twice, each run in a
child process: `warm`, glibc told to keep freed memory (`WARM_ALLOCATOR`; what a device
allocator does), and `default`, glibc as it comes. The two tables show what the allocator
adds to each policy's time.

**MoE.** `qragged_dot` runs on the gate/up expert GEMM (`d_model -> d_expert`) of each
MoE preset (`--moe`) with the preset's experts and top-k, tokens in examples of 512 routed by
the top-k of random logits, rows sorted by expert as `models.MoE` sorts them. XLA:CPU has no
grouped GEMM: an expert GEMM runs as a dense GEMM of every row against every expert's weights
(`s3req/_kernels_cpu.py`, `experts` times the multiply-adds), so the size is set by the
executed work (`MOE_BUDGET`, `--moe-budget`): the most tokens (up to 8192) at the preset's
widths, or 512 tokens with `d_model` and `d_expert` scaled down by a common factor (keeping
their ratio, multiples of 128; the page marks the row).

    python benchmarks/bench_qdot.py [--shapes 4x256x1024x4096,...] [--repeats 15]
        [--moe tiny-moe,qwen3-30b-a3b,deepseek-v2-lite | none] [--moe-budget 1.7e10]
        [--allocator both|warm|default|current]
"""

import argparse
import json
import os
import pathlib
import platform
import resource
import subprocess
import sys
import tempfile
import time
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import models
from policies import AbstractTopology, Independent, Policy, PRESETS
from s3req import Block, gradient_step, qdot, qragged_dot, quantize_gradient, Rows


ROOT = pathlib.Path(__file__).resolve().parent.parent


@typing.final
class JaxRandomIndependent(AbstractTopology):
    """Independent SR drawing its words with `jax.random.bits`, as AQT and Qwix do.

    On a dense layer the same 23-bit thresholds as `Independent()` (bitwise, unsharded),
    from JAX's own Threefry lowering instead of s3req's pure-jnp one; on the expert-sorted
    rows of `qragged_dot` (`Rows`), one word per element of the rows in their sorted order
    (a per-position draw, not keyed by the token ids as `Independent()` is). A
    benchmark-only topology: the peers' cost of per-element randomness. Unsharded layouts
    only.
    """

    stochastic: typing.ClassVar[bool] = True

    def quantizes_once(self) -> bool:
        return False

    def thresholds(self, key, layout, product):
        assert key is not None
        if isinstance(layout, Rows):
            assert layout.d_global in (None, layout.d)
            shape = (layout.row_id.shape[0], layout.d)
        else:
            assert isinstance(layout, Block) and layout.shape == layout.global_shape
            shape = layout.shape
        words = jax.random.bits(key, shape, jnp.uint32)
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
# (name, numerator, denominator, target or None)  -- the targets of the engine issue; the
# Independent SR ratios are reported without one.
TARGETS = [
    ("S3R / RTNE", "s3r", "rtne", "<= 1.03"),
    ("S3R-EC dX-only / S3R", "s3r-ec-dx", "s3r", "<= 1.05"),
    ("S3R-EC two-way / S3R", "s3r-ec-2way", "s3r", "<= 1.08"),
    ("Independent SR / S3R", "sr", "s3r", None),
    ("Independent SR, jax.random.bits / S3R", "sr-jax", "s3r", None),
]
MOE_PRESETS = "tiny-moe,qwen3-30b-a3b,deepseek-v2-lite"
MOE_POLICIES = ("bf16", "rtne", "sr", "sr-jax", "s3r", "s3r-ec-dx", "s3r-ec-2way")
MOE_BUDGET = 4 * (4 * 256 * 1024 * 4096)
"""Most multiply-adds XLA:CPU executes for one benchmarked expert GEMM (`experts x rows x
d_in x d_out`: an expert GEMM is a dense GEMM of every row against all experts' weights):
four times the GEMM of the first dense shape."""
MOE_MAX_TOKENS = 8192
MOE_SEQ = 512
"""Tokens per example of the MoE runs (the examples are the EC segments' other half)."""


def _fwd_bwd(policy, x, w, g, key):
    y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
    return y, vjp(g)


def _quantizer(policy, g, key):
    delta, inv = gradient_step(g)
    y = jnp.clip(g * inv, -127, 127)
    return quantize_gradient(policy, y, key, Block.whole(g.shape))


WARM_ALLOCATOR = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_ARENA_MAX": "1",
}
"""glibc malloc settings that keep freed memory for reuse: no `mmap`ed blocks, no trimming,
and one arena (the per-thread arenas of XLA's worker threads give large blocks back to the
system when they are freed, whatever the trim threshold)."""


def allocator_mode() -> str:
    """`"warm"` if this process runs with `WARM_ALLOCATOR`, else `"default"`."""
    return "warm" if all(os.environ.get(k) == v for k, v in WARM_ALLOCATOR.items()) else "default"


def allocator_env(mode: str) -> dict:
    """This process's environment with glibc malloc configured for `mode`."""
    env = {k: v for k, v in os.environ.items() if k not in WARM_ALLOCATOR}
    if mode == "warm":
        env.update(WARM_ALLOCATOR)
    elif mode != "default":
        raise ValueError(f"allocator mode must be 'warm' or 'default', got {mode!r}")
    return env


def run_with_allocator(mode: str, script: str) -> None:
    """Make sure the running script (`script`, its `__file__`) uses the allocator `mode`.

    `"current"` keeps the process as it is. Otherwise, if the mode differs, the script is
    started again in place (`os.execve`) with the same arguments: glibc reads its settings at
    start-up. Only a script run from the command line can be restarted."""
    if mode == "current" or allocator_mode() == mode:
        return
    if pathlib.Path(sys.argv[0]).resolve() != pathlib.Path(script).resolve():
        raise RuntimeError(
            f"allocator {mode!r} needs a fresh process: run {script} as a script, or pass "
            "--allocator current"
        )
    os.execve(sys.executable, [sys.executable, *sys.argv], allocator_env(mode))


def allocator_note(mode: str) -> str:
    """One sentence for a results page on the allocator `mode` its times were taken under."""
    if mode == "warm":
        return (
            "`warm`, glibc malloc keeping freed memory as a device allocator does (as it comes, "
            "glibc page-faults temporaries above 32 MiB in again on every call; see the "
            "[qdot speed](qdot_speed.md) page)"
        )
    return "glibc malloc as it comes (it page-faults temporaries above 32 MiB in on every call)"


def _time(
    fns: dict,
    args: dict,
    repeats: int,
    raw: dict | None = None,
    faults: dict | None = None,
    cpu: dict | None = None,
) -> dict:
    """Median seconds per call of each `fns[name](*args[name])`, compiled first, then timed
    round-robin. `raw` receives every repeat's time, `faults` the median minor page faults
    per call (of the whole process, so of XLA's threads too), `cpu` every repeat's CPU
    seconds of the process (all its threads): on a shared machine a call's wall time also
    counts the time other processes hold the cores, its CPU time mostly does not."""
    for name, f in fns.items():  # compile + warm up
        jax.block_until_ready(f(*args[name]))
        jax.block_until_ready(f(*args[name]))
    times = {name: [] for name in fns}
    cpus = {name: [] for name in fns}
    minflt = {name: [] for name in fns}
    for _ in range(repeats):  # round-robin: every policy sees the same machine load
        for name, f in fns.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(*args[name]))
            times[name].append(time.perf_counter() - t0)
            cpus[name].append(time.process_time() - c0)
            minflt[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if raw is not None:  # every repeat's time, in round order
        raw.update({name: [float(v) for v in t] for name, t in times.items()})
    if cpu is not None:
        cpu.update({name: [float(v) for v in t] for name, t in cpus.items()})
    if faults is not None:
        faults.update({name: float(np.median(v)) for name, v in minflt.items()})
    return {name: float(np.median(t)) for name, t in times.items()}


GEMM_SHAPE = (4096, 1024, 4096)
"""`(M, K, N)` of the GEMMs `cpu_gemms` times: the first dense shape's forward GEMM."""
CPU_FLAGS = ("amx_int8", "amx_bf16", "avx512_vnni", "avx_vnni", "avx512_bf16")
"""The x86 features (of `/proc/cpuinfo`) that give a CPU int8 or bf16 matrix instructions."""


def cpu_gemms(repeats: int = 7) -> dict:
    """The CPU this process runs on and how fast XLA's GEMMs are on it, timed round-robin
    here at `GEMM_SHAPE`: `{"cpu", "flags", "shape", "gops"}`, `gops` in 10**9 operations
    (2 per multiply-add) per second of `int8` (int8 x int8, int32 sums), `bf16_f32` (bf16 x
    bf16, float32 result) and `bf16` (bf16 x bf16 with a bf16 result: `jnp.matmul` of bf16
    arrays, the BF16 policy's GEMM). Whether an int8 GEMM beats a bf16 one depends on the
    CPU (AMX or VNNI int8 instructions) and on XLA's kernels for it."""
    M, K, N = GEMM_SHAPE
    dot = lambda out: jax.jit(lambda a, b: jax.lax.dot(a, b, preferred_element_type=out))
    fns = {"int8": dot(jnp.int32), "bf16_f32": dot(jnp.float32), "bf16": dot(jnp.bfloat16)}
    ka, kb = jr.split(jr.key(0))
    ints = lambda k, shape: jr.randint(k, shape, -127, 128, jnp.int32).astype(jnp.int8)
    args = {
        "int8": (ints(ka, (M, K)), ints(kb, (K, N))),
        "bf16_f32": (jr.normal(ka, (M, K), jnp.bfloat16), jr.normal(kb, (K, N), jnp.bfloat16)),
    }
    args["bf16"] = args["bf16_f32"]
    seconds = _time(fns, args, repeats)
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                cpu = value.strip()
            elif name.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "flags": [f for f in CPU_FLAGS if f in flags],
        "shape": [M, K, N],
        "gops": {name: 2 * M * K * N / t / 1e9 for name, t in seconds.items()},
    }


def gemm_text(gemms: dict | None) -> str:
    """The sentences a CPU results page says of the GEMMs on its machine (`cpu_gemms`):
    their speeds, and so what its speedups over BF16 measure."""
    if gemms is None:
        return "XLA's GEMM speeds on this CPU were not recorded."
    g = gemms["gops"]
    flags = ", ".join(gemms["flags"]) or "no AMX, VNNI or AVX512-BF16"
    M, K, N = gemms["shape"]
    text = (
        f"XLA's GEMMs on this CPU ({gemms['cpu']}: {flags}), timed in the same process at "
        f"{M} x {K} x {N}: int8 with int32 sums {g['int8']:.0f} GOP/s, bf16 with a float32 "
        f"result {g['bf16_f32']:.0f}, bf16 with a bf16 result (`jnp.matmul` of bf16 arrays, "
        f"the BF16 policy's GEMM) {g['bf16']:.0f}. "
    )
    ratio = g["int8"] / max(g["bf16_f32"], g["bf16"])
    text += f"Here the int8 GEMM runs at {ratio:.2f}x the speed of the fastest bf16 one: "
    if ratio > 1.05:
        return text + (
            "a speedup over BF16 holds a GEMM speedup of this CPU's size (not a TPU's) besides "
            "the vector work."
        )
    return text + "a speedup over BF16 is the vector work alone."


def temp_bytes(f, *args) -> int:
    """XLA's compile-time estimate of the temporaries of one call of `jax.jit(f)(*args)`."""
    stats = jax.jit(f).lower(*args).compile().memory_analysis()
    return int(stats.temp_size_in_bytes) if stats is not None else -1


def bench_shape(B, S, H, D, repeats, dtype=jnp.bfloat16):
    k = jr.split(jr.key(0), 4)
    x = jr.normal(k[0], (B, S, H), dtype)
    w = jr.normal(k[1], (H, D), jnp.float32) / np.sqrt(H)
    g = (jr.normal(k[2], (B, S, D)) * jnp.exp(jr.normal(k[3], (B, S, D)))).astype(dtype)
    key = jr.key(1)
    fwd_bwd = {
        n: (lambda x, w, g, key, p=p: _fwd_bwd(p, x, w, g, key)) for n, p in POLICIES.items()
    }
    full = {n: eqx.filter_jit(f) for n, f in fwd_bwd.items()}
    raw, faults, cpu = {}, {}, {}
    step = _time(full, {n: (x, w, g, key) for n in POLICIES}, repeats, raw, faults, cpu)
    temp = {n: temp_bytes(f, x, w, g, key) for n, f in fwd_bwd.items()}
    gq = g.astype(jnp.float32)
    # EC does not change the quantizer: time each distinct quantizer once
    quant_names = ["rtne", "sr", "sr-jax", "sr-shared", "s3r", "s3r-bcast"]
    quant = {
        n: eqx.filter_jit(lambda g, key, p=POLICIES[n]: _quantizer(p, g, key)) for n in quant_names
    }
    qtime = _time(quant, {n: (gq, key) for n in quant_names}, repeats)
    return {
        "fwd_bwd_s": step,
        "quantizer_s": qtime,
        "fwd_bwd_all_s": raw,
        "fwd_bwd_cpu_all_s": cpu,
        "minor_faults_per_call": faults,
        "temp_bytes": temp,
    }


def moe_shape(preset: str, budget: float = MOE_BUDGET) -> dict:
    """The gate/up expert GEMM of an MoE preset as benchmarked: the preset's experts `E`,
    top-k, `d_model` (`h`) and `d_expert` (`d`), and the most tokens (a multiple of 512, at
    most `MOE_MAX_TOKENS`) for which the executed multiply-adds `E x rows x h x d` stay
    within `budget` (XLA:CPU multiplies every row by all experts' weights); if even 512 tokens
    exceed it, 512 tokens with `h` and `d` scaled down by a common factor (keeping `d / h`,
    multiples of 128, rounded down)."""
    cfg = models.get_config(preset).moe
    if cfg is None:
        raise ValueError(f"--moe: preset {preset!r} has no MoE layers")
    E, k = cfg.n_experts, cfg.top_k
    h, d = models.get_config(preset).d_model, cfg.d_expert
    tokens = min(MOE_MAX_TOKENS, int(budget / (E * k * h * d)) // 512 * 512)
    scaled = tokens < 512
    if scaled:
        tokens = 512
        f = (budget / (E * k * tokens * h * d)) ** 0.5
        h2 = max(128, int(h * f) // 128 * 128)
        d = max(128, int(round(h2 * d / h / 128)) * 128)
        h = h2
    return {"experts": E, "top_k": k, "h": h, "d": d, "tokens": tokens, "scaled": scaled}


def _ragged_fwd_bwd(policy, x, w, g, key, group_sizes, row_id, example_id, num_examples):
    def f(x, w):
        return qragged_dot(
            x,
            w,
            group_sizes,
            policy=policy,
            key=key,
            row_id=row_id,
            example_id=example_id,
            num_examples=num_examples,
        )

    y, vjp = jax.vjp(f, x, w)
    return y, vjp(g)


def bench_moe(preset: str, repeats: int, budget: float = MOE_BUDGET, dtype=jnp.bfloat16):
    """fwd+bwd of `qragged_dot` per policy on the expert GEMM of `preset` (`moe_shape`),
    its tokens in examples of `MOE_SEQ` routed to the top-k of random logits and sorted by
    expert."""
    shape = moe_shape(preset, budget)
    k, E, H, D = shape["top_k"], shape["experts"], shape["h"], shape["d"]
    S = min(MOE_SEQ, shape["tokens"])
    B = shape["tokens"] // S
    ks = jr.split(jr.key(0), 5)
    experts = jax.lax.top_k(jr.normal(ks[0], (B * S, E)), k)[1]
    order, group_sizes = models.sort_by_expert(experts, E)
    example = order // k // S
    n = B * S * k
    x = jr.normal(ks[1], (n, H), dtype)
    w = jr.normal(ks[2], (E, H, D), jnp.float32) / np.sqrt(H)
    g = (jr.normal(ks[3], (n, D)) * jnp.exp(jr.normal(ks[4], (n, D)))).astype(dtype)
    args = (x, w, g, jr.key(1), group_sizes, order, example)
    fns = {
        p: (lambda *a, p=p: _ragged_fwd_bwd(POLICIES[p], *a, num_examples=B)) for p in MOE_POLICIES
    }
    raw, faults, cpu = {}, {}, {}
    jitted = {p: jax.jit(f) for p, f in fns.items()}
    step = _time(jitted, {p: args for p in fns}, repeats, raw, faults, cpu)
    return {
        "preset": preset,
        "batch_seq": [B, S],
        "rows": n,
        **shape,
        "group_sizes_min_max": [int(group_sizes.min()), int(group_sizes.max())],
        "fwd_bwd_s": step,
        "fwd_bwd_all_s": raw,
        "fwd_bwd_cpu_all_s": cpu,
        "minor_faults_per_call": faults,
        "temp_bytes": {p: temp_bytes(f, *args) for p, f in fns.items()},
    }


def measure(shapes: str, repeats: int, moe: str = "none", moe_budget: float = MOE_BUDGET):
    """Time every policy at every shape (`"BxSxHxD,..."`, or `"none"`) and on every MoE
    preset's expert GEMM (`"preset,..."` or `"none"`, sized by `moe_budget`) in this
    process."""
    rows = []
    for spec in [] if shapes == "none" else shapes.split(","):
        B, S, H, D = (int(v) for v in spec.split("x"))
        rows.append({"shape": [B, S, H, D], **bench_shape(B, S, H, D, repeats)})
        t = rows[-1]["fwd_bwd_s"]
        print(allocator_mode(), spec, {n: round(v * 1e3, 2) for n, v in t.items()}, flush=True)
    moe_rows = []
    for preset in [] if moe == "none" else moe.split(","):
        moe_rows.append(bench_moe(preset, repeats, moe_budget))
        t = moe_rows[-1]["fwd_bwd_s"]
        print(allocator_mode(), preset, {n: round(v * 1e3, 2) for n, v in t.items()}, flush=True)
    return {
        "allocator": allocator_mode(),
        **machine_load(),
        "gemms": cpu_gemms(),
        "rows": rows,
        "moe_rows": moe_rows,
    }


def _measure_in_child(mode: str, shapes: str, repeats: int, moe: str, moe_budget: float):
    with tempfile.TemporaryDirectory() as tmp:
        raw = pathlib.Path(tmp) / "run.json"
        cmd = [sys.executable, __file__, "--allocator", "current", "--shapes", shapes]
        cmd += ["--repeats", str(repeats), "--raw", str(raw), "--moe", moe]
        cmd += ["--moe-budget", str(moe_budget)]
        subprocess.run(cmd, env=allocator_env(mode), check=True)
        run = json.loads(raw.read_text())
    if run["allocator"] != mode:
        raise RuntimeError(
            f"the child process ran with allocator {run['allocator']!r}, not {mode!r}"
        )
    return run


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shapes", default="4x256x1024x4096,4x256x512x2048,8x512x1024x1024")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--moe", default=MOE_PRESETS, help="MoE presets (comma separated) or none")
    ap.add_argument(
        "--moe-budget", type=float, default=MOE_BUDGET, help="executed MACs per expert GEMM"
    )
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "qdot_speed"))
    ap.add_argument(
        "--allocator",
        choices=("both", "warm", "default", "current"),
        default="both",
        help="glibc malloc settings: a child process per mode, or this process as it is",
    )
    ap.add_argument("--raw", help=argparse.SUPPRESS)  # a child's measurement goes here
    args = ap.parse_args(argv)
    if args.allocator == "current":
        runs = [measure(args.shapes, args.repeats, args.moe, args.moe_budget)]
    else:
        modes = ("warm", "default") if args.allocator == "both" else (args.allocator,)
        runs = [
            _measure_in_child(m, args.shapes, args.repeats, args.moe, args.moe_budget)
            for m in modes
        ]
    if args.raw:
        pathlib.Path(args.raw).write_text(json.dumps(runs[0]))
        return runs[0]
    meta = {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "repeats": args.repeats,
        "dtype": "bfloat16 x, f32 w",
        "warm_allocator": WARM_ALLOCATOR,
        "engine_commit": _commit(),
        "moe_budget": args.moe_budget,
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
    }
    summary = {"meta": meta, "runs": runs}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    out.with_suffix(".md").write_text(_markdown(meta, runs))
    print(out.with_suffix(".md").read_text())
    return summary


ENGINE_PATHS = ("s3req", "policies", "models")


def machine_load() -> dict:
    """The 1-minute load average now and, where Linux groups processes by session
    (`sched_autogroup_enabled`), this process's autogroup nice: the CPUs are then shared
    between the groups first and `nice` orders threads only within one, so another session's
    `nice -n 19` job takes an equal share unless this group's nice is lower."""
    out: dict = {"load_average_1min": round(os.getloadavg()[0], 2)}
    try:
        if pathlib.Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
            group = pathlib.Path("/proc/self/autogroup").read_text().split()
            out["autogroup_nice"] = int(group[-1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def load_text(samples: list[dict]) -> str:
    """`load average A` (or `A-B` over several samples) `on a shared 2-core machine`, with
    the autogroup nice of the timing process where it was set (see `machine_load`)."""
    loads = [d["load_average_1min"] for d in samples]
    text = f"load average {min(loads)}" + (f"-{max(loads)}" if max(loads) > min(loads) else "")
    text += " on a shared 2-core machine"
    nice = {d["autogroup_nice"] for d in samples if "autogroup_nice" in d}
    if nice:
        text += ", the timing process at autogroup nice " + "/".join(map(str, sorted(nice)))
        text += " so that the other sessions' jobs yield to it"
    return text


def _commit() -> str:
    """The engine a run measures: the last commit that changed `s3req/`, `policies/` or
    `models/` (it survives rebases of later commits), with `+changes` if those are modified
    in the working tree."""
    try:
        run = lambda *a: subprocess.run(
            ["git", "-C", str(ROOT), *a], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", *ENGINE_PATHS)
        return run("log", "-1", "--format=%h", "--", *ENGINE_PATHS) + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(script: str, argv: list[str]) -> str:
    """`python <script relative to the repository> <argv>`, without `--out` and its value
    (for a results page to name the command that generated it)."""
    args, skip = [], False
    for a in argv:
        if skip or a == "--out" or a.startswith("--out="):
            skip = a == "--out"
            continue
        args.append(a)
    rel = pathlib.Path(script).resolve().relative_to(ROOT)
    return " ".join(["python", str(rel), *args])


def run_meta(script: str, argv: list[str] | None) -> dict:
    """What a results page says of its run: device, platform, jax, the engine commit and
    the command (`argv` as given to `main`, or the process's when `None`)."""
    return {
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "engine_commit": _commit(),
        "command": command_line(script, sys.argv[1:] if argv is None else argv),
    }


def _table(header: list, rows: list) -> list:
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(str(c) for c in r) + " |" for r in rows),
    ]


def _ratio_table(runs, field: str, names: list, spec: str) -> list:
    """Times of `field` relative to RTNE, a row per allocator mode and shape."""
    return _table(
        ["allocator", "shape (B, S, H, D)", *names],
        [
            [run["allocator"], tuple(r["shape"])]
            + [format(r[field][n] / r[field]["rtne"], spec) for n in names]
            for run in runs
            for r in run["rows"]
        ],
    )


def _target_table(runs, field: str, columns: list) -> list:
    """Every `TARGETS` ratio per allocator mode and clock, a column per row of `run[field]`:
    the ratio of the medians (wall time: the targets; process CPU time: the work, less moved
    by other processes) and the interquartile range of the per-round ratios."""
    body = []
    for label, num, den, target in TARGETS:
        if num not in runs[0][field][0]["fwd_bwd_s"]:
            continue
        for run in runs:
            for clock, key in (("wall", "fwd_bwd_all_s"), ("cpu", "fwd_bwd_cpu_all_s")):
                if key not in run[field][0]:
                    continue
                vals = []
                for r in run[field]:
                    a, b = np.asarray(r[key][num]), np.asarray(r[key][den])
                    v = float(np.median(a) / np.median(b))
                    q1, q3 = np.percentile(a / b, [25, 75])
                    verdict = ""
                    if target is not None and clock == "wall":
                        bound = float(target.split()[1])
                        ok = v <= bound if target.startswith("<=") else v >= bound
                        verdict = " met" if ok else " MISSED"
                    vals.append(f"{v:.3f} [{q1:.2f}-{q3:.2f}]{verdict}")
                body.append([label, target or "none", run["allocator"], clock, *vals])
    return _table(["ratio", "target", "allocator", "clock", *columns], body)


def _dense_markdown(runs) -> list:
    """The qdot sections of the page: times, temporaries, quantizer, targets."""
    names = list(runs[0]["rows"][0]["fwd_bwd_s"])
    lines = [
        "## One qdot forward + backward, time relative to INT8 RTNE",
        "",
    ]
    lines += _ratio_table(runs, "fwd_bwd_s", names, ".3f")
    lines += [
        "",
        "## Temporaries (MiB, XLA's compile-time estimate) and minor page faults per call",
        "",
    ]
    first = runs[0]["rows"]
    body = [
        ["temporaries (MiB)", tuple(r["shape"])]
        + [f"{r['temp_bytes'][n] / 2**20:.1f}" for n in names]
        for r in first
    ]
    body += [
        [f"page faults, {run['allocator']}", tuple(r["shape"])]
        + [f"{r['minor_faults_per_call'][n]:.0f}" for n in names]
        for run in runs
        for r in run["rows"]
    ]
    lines += _table(["", "shape (B, S, H, D)", *names], body)
    qn = list(first[0]["quantizer_s"])
    lines += [
        "",
        "## The gradient quantizer alone (thresholds + rounding), relative to RTNE",
        "",
    ]
    lines += _ratio_table(runs, "quantizer_s", qn, ".2f")
    lines += [
        "",
        "## Targets (fwd+bwd ratios)",
        "",
        "The ratio of the medians, and in brackets the interquartile range of the per-round "
        "ratios (numerator and denominator timed in the same round-robin round): how much the "
        "shared machine moved the ratio during the run. `wall` rows are the targets; `cpu` "
        "rows are the same ratio of the process's CPU seconds per call (all threads), which "
        "counts less of the time other processes hold the cores. The Independent SR rows have "
        "no target: they state what per-element randomness costs here.",
        "",
    ]
    lines += _target_table(runs, "rows", [str(tuple(r["shape"])) for r in first])
    return lines


def _markdown(meta, runs) -> str:
    loads = ", ".join(f"{r['allocator']} {r['load_average_1min']}" for r in runs)
    nice = {r["autogroup_nice"] for r in runs if "autogroup_nice" in r}
    if nice:
        loads += " (the timing processes at autogroup nice " + "/".join(map(str, sorted(nice)))
        loads += ", so that the other sessions' jobs yield to them)"
    warm = " ".join(f"`{k}={v}`" for k, v in meta["warm_allocator"].items())
    lines = [
        "# qdot speed (CPU)",
        "",
        f"Generated by `{meta.get('command', 'python benchmarks/bench_qdot.py')}` on engine "
        "commit "
        f"`{meta.get('engine_commit', 'unknown')}` ({meta['device']}, jax {meta['jax']}, "
        f"median of {meta['repeats']} round-robin repeats, "
        f"load average {loads} on a shared 2-core machine, "
        "bf16 activations and gradients, f32 weights). Ratios of times measured side by side in "
        "one process; lower is faster. "
        + gemm_text(runs[0].get("gemms"))
        + " The ratios between INT8 policies measure the randomness, rounding and correction "
        "work around the GEMMs. `sr` is Independent SR with s3req's pure-jnp Threefry; "
        "`sr-jax` draws the same words with `jax.random.bits`, as AQT and Qwix do (the peers' "
        "cost of per-element randomness); `sr-shared` quantizes once with one threshold "
        "tensor.",
        "",
        "Each allocator mode is one process. XLA CPU `malloc`s a call's temporaries and frees "
        "them at its end; glibc maps blocks above its mmap threshold (at most 32 MiB) afresh "
        "and trims its heap (and the arenas of worker threads give large blocks back), so a "
        "program page-faults its temporaries in again on every call (one fault per 4 KiB, or "
        "per 2 MiB huge page). `warm`: glibc keeps freed memory for reuse "
        f"({warm}), as an accelerator's pooling allocator does; `default`: glibc as it comes. "
        "The page faults are the allocator's cost, not the policy's arithmetic; the "
        "temporaries are the policy's.",
        "",
    ]
    if runs[0]["rows"]:
        lines += _dense_markdown(runs)
    moe = runs[0].get("moe_rows") or []
    if moe:
        mn = list(moe[0]["fwd_bwd_s"])
        lines += [
            "",
            "## qragged_dot on the MoE presets (expert GEMM forward + backward)",
            "",
            "The gate/up expert GEMM `(rows, d_model) x (experts, d_model, d_expert)` of each "
            "preset: its experts and top-k, examples of up to 512 tokens routed to the top-k "
            "of random logits (rows sorted by expert as `models.MoE` sorts them; the "
            "smallest and largest expert group are given), EC over (example, expert) "
            "segments. XLA:CPU has no grouped GEMM: the expert GEMM runs as a dense GEMM of "
            "every row against all experts' weights, each row keeping its own expert's result "
            "(`s3req/_kernels_cpu.py`), `experts` times the multiply-adds of the expert GEMM "
            "(so the GEMMs dominate more here than on an accelerator, where they are "
            "grouped); the sizes keep that executed work within "
            f"{meta.get('moe_budget', MOE_BUDGET):.2g} multiply-adds per GEMM: the most "
            "tokens (up to 8192) at the preset's widths, or 512 tokens with the widths "
            "marked * scaled down by a common factor (ratio kept).",
            "",
        ]
        lines += _table(
            [
                "preset",
                "experts, top-k",
                "examples x tokens",
                "rows",
                "d_model x d_expert",
                "groups min-max",
            ],
            [
                [
                    m["preset"],
                    f"{m['experts']}, {m['top_k']}",
                    " x ".join(str(v) for v in m["batch_seq"]),
                    m["rows"],
                    f"{m['h']} x {m['d']}{' *' if m['scaled'] else ''}",
                    "-".join(str(v) for v in m["group_sizes_min_max"]),
                ]
                for m in moe
            ],
        )
        lines += ["", "Time relative to INT8 RTNE:", ""]
        lines += _table(
            ["allocator", "preset", *mn],
            [
                [run["allocator"], m["preset"]]
                + [f"{m['fwd_bwd_s'][n] / m['fwd_bwd_s']['rtne']:.3f}" for n in mn]
                for run in runs
                for m in run["moe_rows"]
            ],
        )
        lines += ["", "Temporaries (MiB, XLA's compile-time estimate):", ""]
        lines += _table(
            ["preset", *mn],
            [[m["preset"]] + [f"{m['temp_bytes'][n] / 2**20:.1f}" for n in mn] for m in moe],
        )
        lines += ["", "Targets (as for qdot; interquartile range of the per-round ratios):", ""]
        lines += _target_table(runs, "moe_rows", [m["preset"] for m in moe])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
