"""Compile for TPU v5p on this machine (ahead of time, no TPU) and report what the compiler did.

Uses `s3req.tpu` (needs libtpu: `pip install "s3req[tpu]"`) for every policy preset:

- `layer`: one qdot forward + backward, x (16, 4096, 1024) @ w (1024, 4096), bf16 activations
  and gradient, float32 weights, the batch split over the 4 chips of v5p 2x2x1;
- `ffn`: the SwiGLU FFN block (`models.FFN`, the builder of `experiments/table3_ffn_speed.py`)
  forward + backward at the paper's W1..W9 shapes, 16 x 4096 tokens batch-split over 2x2x1;
- `table4`: the full training step of `experiments/table4_full_step.py`
  (`s3req.train.make_train_step`: loss, INT8 backward, clipping, AdamW) of Llama 3.1-8B,
  Qwen3-8B, Qwen3-30B-A3B and DeepSeek-V2-Lite at their real depth (`--layers N`: a cut to
  N layers, real widths and vocabulary), full remat, bf16 activations, 4 x 4096 tokens per
  chip, parameters and optimizer state FSDP x TP sharded (`s3req.train`'s rules) on a
  2 x 2 mesh of v5p 2x2x1;
- `full`: the same step of every model among `--models` at its real depth with
  `FULL_DEPTH_PER_CHIP` sequence per chip (at 4 the compiler refuses the MoE models; the dense
  ones at this batch give the MoE steps' EC surplus a like-for-like scale), a section of the
  Table IV page of its own.

Per program: XLA's memory analysis, the GEMMs of the optimized HLO with their dtypes, the
largest materialized u32 buffer, fusions, backward vector operations per upstream-gradient
element, and the compiler's cost model (a model, never a time). Results merge into
`tpu_compile.json` / `tpu_table4.json` under `--out` after every compile (a rerun fills gaps
and replaces the rows it recompiles), and the pages `tpu_compile.md` / `tpu_table4.md` are
rewritten from them.

    python benchmarks/tpu_compile.py                                # everything (~1-2 h)
    python benchmarks/tpu_compile.py --parts layer,ffn --shapes W2,W4
    python benchmarks/tpu_compile.py --parts table4 --models llama3.1-8b
    python benchmarks/tpu_compile.py --parts full --models deepseek-v2-lite,qwen3-30b-a3b
    python benchmarks/tpu_compile.py --smoke --out /tmp/tpu            # small shapes
    python benchmarks/tpu_compile.py --pages                           # pages from the JSON
"""

import argparse
import dataclasses
import json
import pathlib
import platform
import re
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec as P


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import table3_ffn_speed as t3  # noqa: E402
import table4_full_step as t4  # noqa: E402

import models  # noqa: E402
from policies import PRESETS  # noqa: E402
from s3req import qdot  # noqa: E402
from s3req._kernels_tpu import row_chunk  # noqa: E402
from s3req.tpu import compile_for_tpu, HloTensor, tpu_mesh, TPUProgram  # noqa: E402
from s3req.train import (  # noqa: E402
    make_optimizer,
    make_train_step,
    param_shardings,
    TrainConfig,
    TrainState,
)


TOPOLOGY = "v5p:2x2x1"
POLICIES = (
    "bf16",
    "rtne",
    "sr",
    "s3r",
    "s3r-bcast",
    "s3r-ec-dx",
    "s3r-ec-2way",
    "s3r-bcast-ec-dx",
    "s3r-bcast-ec-2way",
)
LAYER = (16, 4096, 1024, 4096)  # B, S, H, D
FFN_TOKENS = (16, 4096)
TABLE4_MODELS = {
    "Llama 3.1-8B": "llama3.1-8b",
    "Qwen3-8B": "qwen3-8b",
    "Qwen3-30B-A3B": "qwen3-30b-a3b",
    "DeepSeek-V2-Lite": "deepseek-v2-lite",
}
DENSE = ("Llama 3.1-8B", "Qwen3-8B")
# The paper (TPU v5p): on one FFN block both S3R-EC variants add 8-14% temporary memory;
# S3R needs RTNE's full-step memory; two-way S3R-EC at most 0.4 GB more on the dense models.
PAPER_EC_BLOCK = (8.0, 14.0)
PAPER_TWO_WAY_STEP_GB = 0.4
# The paper's full-model memory statements (XLA's compile-time estimate on v5p), per model:
# S3R - RTNE and two-way S3R-EC - S3R in GB; None where the paper gives no figure.
PAPER_STEP_GB = {
    "Llama 3.1-8B": ("0 (same)", "<= +0.4"),
    "Qwen3-8B": ("0 (same)", "<= +0.4"),
    "Qwen3-30B-A3B": ("+0.4", None),
    "DeepSeek-V2-Lite": ("+0.7", None),
}
# Targets on these compiles (the TPU and engine issues): S3R = RTNE; on one FFN block dX-only
# <= +5% and two-way <= +14% temporaries over S3R; on a dense step two-way <= +0.4 GB; the
# MoE steps' EC surplus within 2x of the dense steps'.
TARGET_DX_PCT, TARGET_TWO_WAY_PCT, TARGET_MOE_RATIO = 5.0, 14.0, 2.0
FULL_DEPTH_PER_CHIP = 1
"""Sequences per chip of the steps at their real depth (`--parts full`): at Table IV's 4 the
compiler refuses the MoE models (the page says so and compiles a layer cut)."""
FULL_DEPTH_MESHES = {"qwen3-30b-a3b": ("v5p:2x2x2", {"fsdp": 4, "tp": 2})}
"""The topology and mesh of `--parts full` for the models whose real depth does not fit the
tables' 4 chips even at `FULL_DEPTH_PER_CHIP` sequences per chip (Qwen3-30B-A3B: the
compiler asked for 171.4G there at engine `4231300`): the same sequences per chip and `tp`,
twice the `fsdp` shards."""
SMOKE_PER_CHIP, SMOKE_SEQ = 2, 40
"""Sequences per chip and tokens per sequence of `--smoke`'s steps: a global batch of 8 x 40,
whose sizes match no other dimension of the tiny presets' buffers, so `check_split` cannot
take another array for the global batch (with 1 x 64 a stacked residual of the 4-layer scan
`(4, 2, 64, ...)` passed for a batch of 4, and `tiny-moe`'s expert codes `(8, 64, 128)` for a
batch of 8)."""
# Table III (measured on v5p): speed-up over BF16 of INT8 RTNE, Independent SR and S3R, and
# the device-time overhead (%) of two-way and dX-only S3R-EC over S3R, per shape.
PAPER_TABLE3 = {
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
# Section IV-D: vector operations per upstream-gradient element over INT8 RTNE.
PAPER_OPS = {"sr": "120 to 133", "s3r": "-2 to +6", "ec": "15 to 23 (most shapes)"}


def _policy(name: str):
    return None if name == "bf16" else PRESETS[name]


def _facts(prog: TPUProgram, layer_macs: int | None = None) -> dict:
    """The JSON row of one program; `layer_macs`: per-chip MACs of one layer GEMM."""
    s = prog.summary()
    gemms = s.pop("gemms")
    big = [g for g in gemms if layer_macs and g["macs"] is not None and g["macs"] >= layer_macs]
    s["layer_gemms"] = [g["signature"] for g in big]
    s["n_gemms"] = len(gemms)
    s["n_integer_gemms"] = len(prog.integer_gemms())
    s["commit"] = _commit()
    s["small_gemms"] = [
        {"signature": g["signature"], "shape": g["shape"], "macs": g["macs"]}
        for g in gemms
        if g not in big
    ]
    return s


def compile_layer(
    name: str, mesh, B: int, S: int, H: int, D: int, frozen: bool = False
) -> TPUProgram:
    """One qdot forward + backward, the batch split over `mesh`; `frozen`: the VJP in `x`
    alone (the weights not differentiated)."""
    policy = _policy(name)
    batch = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16, sharding=batch)
    w = jax.ShapeDtypeStruct((H, D), jnp.float32)
    g = jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16, sharding=batch)
    key = jax.ShapeDtypeStruct((), jr.key(0).dtype)

    def fwd_bwd(x, w, g, key):
        if frozen:
            y, vjp = jax.vjp(lambda x: qdot(x, w, policy=policy, key=key), x)
        else:
            y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
        return y, vjp(g)

    return compile_for_tpu(fwd_bwd, x, w, g, key, mesh=mesh, upstream=[g])


def compile_ffn(
    name: str, mesh, h: int, d: int, batch: int, seq: int, buffers: bool = False
) -> TPUProgram:
    """Table III's block (`table3_ffn_speed.fwd_bwd` on `models.FFN`), abstract weights;
    `buffers`: read the buffer assignment too (`TPUProgram.packing`)."""
    ffn = eqx.filter_eval_shape(models.FFN, h, d, _policy(name), key=jr.key(0))
    split = NamedSharding(mesh, P("data"))
    x = jax.ShapeDtypeStruct((batch, seq, h), jnp.bfloat16, sharding=split)
    g = jax.ShapeDtypeStruct((batch, seq, h), jnp.bfloat16, sharding=split)
    key = jax.ShapeDtypeStruct((), jr.key(0).dtype)
    # Upstream gradients of the three projections: down's (tokens, h), gate's and up's
    # (tokens, d) each.
    inner = jax.ShapeDtypeStruct((batch, seq, d), jnp.bfloat16, sharding=split)
    return compile_for_tpu(
        t3.fwd_bwd, ffn, x, g, key, mesh=mesh, upstream=[g, inner, inner], buffers=buffers
    )


def _shard(tree, mesh):
    """Give every `ShapeDtypeStruct` of a model or optimizer-state tree the FSDP x TP
    sharding that `s3req.train.param_shardings` gives the same parameter."""
    return jtu.tree_map(
        lambda x, s: x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        param_shardings(tree, mesh),
        is_leaf=lambda x: x is None,
    )


def compile_step(
    name: str,
    mesh,
    preset: str,
    n_layers: int,
    seq: int,
    per_chip: int,
    overrides: dict | None = None,
    pin: bool = True,
    buffers: bool = False,
):
    """Table IV's training step, abstract and sharded FSDP x TP over `mesh` (the step
    traced under the mesh, as `s3req train --mesh` runs it); `overrides`: more
    `LlamaConfig` fields (small widths for a test). Returns `(program, config, batch)`:
    `batch` is the global batch, `per_chip * chips` sequences (MaxText's
    `per_device_batch_size`), split over `fsdp` only. `pin=False` traces the step without
    the mesh, leaving the split of every activation to the SPMD partitioner alone (what
    `unsplit_activations` catches); `buffers`: read the buffer assignment too
    (`TPUProgram.packing`)."""
    optimizer, _ = make_optimizer(TrainConfig())
    step = make_train_step(optimizer, mesh=mesh if pin else None)
    cfg = t4.config(preset, {"n_layers": n_layers, **(overrides or {})})
    model = eqx.filter_eval_shape(models.Llama, cfg, _policy(name), key=jr.key(0))
    is_sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    dyn, static = eqx.partition(model, is_sds)
    opt = jax.eval_shape(
        lambda d: optimizer.init(eqx.filter(eqx.combine(d, static), eqx.is_inexact_array)), dyn
    )
    model, opt = _shard(model, mesh), _shard(opt, mesh)
    batch = per_chip * mesh.devices.size
    tokens = jax.ShapeDtypeStruct(
        (batch, seq + 1), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))
    )
    key = jax.ShapeDtypeStruct((), jr.key(0).dtype)

    def f(m, o, t, k):
        new, info = step(TrainState(m, o, jnp.zeros((), jnp.int32)), t, k)
        return eqx.filter(new.model, eqx.is_array), new.opt_state, info["loss"]

    with jax.numpy_dtype_promotion("standard"):
        return compile_for_tpu(f, model, opt, tokens, key, mesh=mesh, buffers=buffers), cfg, batch


def unsplit_activations(prog: TPUProgram, cfg, batch: int, seq: int) -> list[HloTensor]:
    """The buffers of a compiled training step that hold the global batch on one chip.

    A buffer is flagged when its leading dimension is the global batch with the sequence
    length among its other dimensions (e.g. attention scores `(batch, heads, seq, seq)`),
    or the global token count `batch * seq` (the flattened tokens of an MoE block), or the
    global count of routed rows `batch * seq * top_k` (the expert-sorted rows). On a mesh
    that splits the batch over `fsdp` every chip should hold `batch / fsdp` sequences of
    each activation instead. Buffers made inside `jax.shard_map` are left out: there every
    shape is one shard's by construction, and a count can only match by coincidence (the
    TPU segment sums slice a chip's rows into chunks of 65536, DeepSeek-V2-Lite's global
    token count), and so are the compiler's own copies (no JAX metadata): a copy is judged by
    the buffer it copies (the EC's per-row sums of such a chunk, `f32[65536,1]`, are copied
    outside the `shard_map` scope). The expert GEMMs' own outputs (the `ragged-dot` custom
    calls, which carry no JAX scope) are left out where they lead with the engine's chunk of
    a chip's routed rows (`_kernels_tpu.row_chunk`): on 8 chips with 1 sequence each the
    global token count, 32768, is that chunk."""
    tokens = batch * seq
    flat = {tokens} | ({tokens * cfg.moe.top_k} if cfg.moe is not None else set())
    fsdp = prog.mesh.get("fsdp", 1)
    top_k = cfg.moe.top_k if cfg.moe is not None else 0
    chunk = row_chunk(batch // fsdp * seq * top_k) if top_k else None
    return [
        b
        for b in prog.buffers()
        if b.shape
        and b.op_name
        and "shard_map" not in b.op_name
        and not (b.op_name.startswith("ragged-dot") and b.shape[0] == chunk)
        and ((b.shape[0] == batch and seq in b.shape[1:]) or b.shape[0] in flat)
    ]


def check_split(prog: TPUProgram, cfg, batch: int, seq: int, label: str) -> None:
    """Raise if the compiled step holds the global batch on one chip (`unsplit_activations`)."""
    bad = unsplit_activations(prog, cfg, batch, seq)
    if bad:
        shown = "; ".join(
            f"{b.dtype}[{','.join(map(str, b.shape))}] ({b.op}: {b.op_name[-80:]})"
            for b in bad[:6]
        )
        raise RuntimeError(
            f"{label}: the compiled step holds the global batch of {batch} x {seq} tokens on "
            f"one chip in {len(bad)} buffers, e.g. {shown}. The activations must stay split "
            "over fsdp (models pin them under the step's mesh: make_train_step(..., mesh=...))."
        )


def split_facts(prog: TPUProgram, cfg, batch: int, seq: int) -> dict:
    """What `check_split` asserted on a step, for the page: the global counts no buffer may
    lead with, and the per-chip shapes of the largest attention-score buffer (float32 with
    the sequence length twice) and of the largest buffer of expert-sorted rows (leading
    with a chip's routed rows), or None."""
    fsdp = prog.mesh.get("fsdp", 1)
    local_rows = batch // fsdp * seq * (cfg.moe.top_k if cfg.moe is not None else 0)
    bufs = prog.buffers()
    scores = [b for b in bufs if b.dtype == "f32" and b.shape.count(seq) == 2]
    rows = [b for b in bufs if local_rows and b.shape and b.shape[0] == local_rows]
    return {
        "batch": batch,
        "seq": seq,
        "refused_leading": sorted(
            {batch * seq} | ({batch * seq * cfg.moe.top_k} if cfg.moe else set())
        ),
        "scores": list(scores[0].shape) if scores else None,
        "rows": [rows[0].dtype, list(rows[0].shape)] if rows else None,
    }


STEP_PREFIX = "jit(traced)/jit(step)/"
"""The `op_name` prefix of every JAX operation of a training step (`compile_step`)."""


def made_by(b) -> str:
    """What made a buffer: the JAX `op_name` of its instruction without the training step's
    common prefix, or, for a buffer the compiler made, `(compiler)` and the kind of its
    instruction (`copy-start`, `all-gather`, ...). Instruction numbers are dropped (the
    compiler names some instructions' `op_name` after another instruction, `reshape.571`),
    so the same buffer of two programs gets the same name."""
    if b.op_name:
        return re.sub(r"\.\d+$", "", b.op_name.removeprefix(STEP_PREFIX))
    return "(compiler) " + re.sub(r"\.\d+$", "", b.name.split("{")[0])


BUSIEST_FLOOR = 2**20
"""Buffers live at a step's busiest instruction that its JSON row lists (`_step_row`): the
ones of at least this many bytes, as `[shape, made_by, bytes]`."""


def _step_row(prog: TPUProgram, cfg, batch: int, seq: int) -> dict:
    """A compiled training step's JSON row: memory, program facts, engine commit, split check,
    and where the step's buffers were read (`buffers=True`) the live temporaries at the
    block's busiest instruction, in the block and in the outputs' buffers."""
    packing = prog.packing
    return {
        "memory": prog.summary()["memory"],
        "fusions": prog.fusions,
        "n_integer_gemms": len(prog.integer_gemms()),
        "largest_u32": prog.summary()["largest_u32"],
        "compile_seconds": prog.compile_seconds,
        "commit": _commit(),
        "split_check": split_facts(prog, cfg, batch, seq),
    } | (
        {}
        if packing is None
        else {
            "packing": {
                "heap": packing.heap,
                "live": packing.live,
                "in_outputs": packing.in_outputs,
                "live_at": packing.live_at,
                "busiest": [
                    [b.shape.split("{")[0], made_by(b), b.size]
                    for b in packing.busiest
                    if b.size >= BUSIEST_FLOOR
                ],
            }
        }
    )


def _refused(e: Exception) -> str | None:
    """The compiler's sentence if `e` is its refusal of a program too large for a chip's HBM."""
    if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e):
        return _exhausted(str(e))
    return None


def _exhausted(message: str) -> str:
    """The compiler's sentence on the memory a refused program needs, from its error."""
    for line in message.splitlines():
        if "Ran out of memory" in line:
            return line[line.index("Ran out of memory") :].strip()
    return message.splitlines()[0]


def _commit() -> str:
    """The commit of the engine (`+dirty` when `s3req`, `policies` or `models` differ)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "s3req", "policies", "models"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def _drop_rows(data: dict, commits: set[str], parts: list[str]) -> dict:
    """`data` without the policy rows of `parts` compiled at one of `commits` (and without
    tables left empty); `data["dropped"]` records which rows went, for the pages to say."""
    dropped = data.setdefault("dropped", {})

    def keep(P_: dict, where: str) -> dict:
        for p, r in P_.items():
            if r.get("commit") in commits:
                dropped.setdefault(r["commit"], []).append(f"{where} {p}")
        return {p: r for p, r in P_.items() if r.get("commit") not in commits}

    if "layer" in data and "layer" in parts:
        data["layer"] = keep(data["layer"], "layer")
    for group, part in (("ffn", "ffn"), ("models", "table4"), ("full_depth", "full")):
        if part not in parts:
            continue
        for name in list(data.get(group, {})):
            data[group][name]["policies"] = keep(data[group][name].get("policies", {}), name)
            if not data[group][name]["policies"] and not data[group][name].get("refused"):
                del data[group][name]
    if not dropped:
        del data["dropped"]
    return data


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(out: pathlib.Path, stem: str, data: dict, page) -> None:
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(page(data))


def _meta(device_kind: str) -> dict:
    return {
        "topology": TOPOLOGY,
        "device_kind": device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "commit": _commit(),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--parts", default="layer,ffn,table4,full")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--shapes", default=",".join(models.PAPER_FFN_SHAPES))
    ap.add_argument("--models", default=",".join(TABLE4_MODELS.values()))
    ap.add_argument(
        "--layers",
        type=int,
        default=0,
        help="layers of the Table IV presets (0: each preset's real depth)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a test of the script)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--pages", action="store_true", help="only rewrite the pages from the JSON")
    ap.add_argument(
        "--drop-commit",
        default="",
        help="with --pages: first remove the rows compiled at these engine commits (comma-"
        "separated; rows of a superseded engine) from the parts of --drop-parts; the pages "
        "name the removed rows until they are recompiled",
    )
    ap.add_argument(
        "--drop-parts", default="layer,ffn,table4,full", help="parts --drop-commit prunes"
    )
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.pages:
        drop = set(filter(None, args.drop_commit.split(",")))
        for stem, page in (("tpu_compile", markdown), ("tpu_table4", markdown_table4)):
            if (out / f"{stem}.json").is_file():
                data = _drop_rows(_load(out / f"{stem}.json"), drop, args.drop_parts.split(","))
                _save(out, stem, data, page)
        return {}
    parts = args.parts.split(",")
    pols = args.policies.split(",")
    mesh = tpu_mesh(topology=TOPOLOGY)
    kind = mesh.devices.flat[0].device_kind
    layer = (8, 256, 256, 512) if args.smoke else LAYER
    tokens = (8, 128) if args.smoke else FFN_TOKENS

    data = _load(out / "tpu_compile.json")
    data.setdefault("layer", {})
    data.setdefault("ffn", {})
    data["smoke"] = args.smoke
    log = lambda msg: print(f"[tpu_compile] {msg}", file=sys.stderr, flush=True)
    if "layer" in parts:
        B, S, H, D = layer
        for p in pols:
            prog = compile_layer(p, mesh, B, S, H, D)
            data["layer"][p] = _facts(prog, B * S * H * D // mesh.devices.size)
            data["layer_shape"] = list(layer)
            data["meta"] = _meta(kind)
            _save(out, "tpu_compile", data, markdown)
            log(f"layer {p}: temp {prog.memory.temporaries / 2**20:.1f} MiB")
    if "ffn" in parts:
        for w in args.shapes.split(","):
            h, d = models.PAPER_FFN_SHAPES[w]
            if args.smoke:
                h, d = h // 8, d // 8
            row = data["ffn"].setdefault(w, {"h": h, "d_ff": d, "tokens": list(tokens)})
            row.update({"h": h, "d_ff": d, "tokens": list(tokens)})
            for p in pols:
                prog = compile_ffn(p, mesh, h, d, *tokens)
                macs = tokens[0] * tokens[1] * h * d // mesh.devices.size
                row.setdefault("policies", {})[p] = _facts(prog, macs)
                data["meta"] = _meta(kind)
                _save(out, "tpu_compile", data, markdown)
                log(f"ffn {w} {p}: temp {prog.memory.temporaries / 2**20:.1f} MiB")
    mesh2 = tpu_mesh({"fsdp": 2, "tp": 2}, topology=TOPOLOGY)
    t4data = _load(out / "tpu_table4.json")
    names = {v: k for k, v in TABLE4_MODELS.items()}
    if {"table4", "full"} & set(parts):
        t4data["smoke"] = args.smoke
    if "table4" in parts:
        t4data.setdefault("models", {})
        presets = ["tiny"] if args.smoke else args.models.split(",")
        for preset in presets:
            label = names.get(preset, preset)
            seq, per_chip = (SMOKE_SEQ, SMOKE_PER_CHIP) if args.smoke else (4096, 4)
            for p in pols:
                t0 = time.perf_counter()
                depth = args.layers or models.get_config(preset).n_layers
                try:
                    prog, cfg, batch = compile_step(p, mesh2, preset, depth, seq, per_chip)
                except jax.errors.JaxRuntimeError as e:
                    if (why := _refused(e)) is None:
                        raise
                    # The compiler refuses a program that needs more than a chip's HBM:
                    # the page says so, and a layer cut (`--layers`) is compiled instead.
                    t4data.setdefault("refused", {})[label] = {
                        "n_layers": depth,
                        "policy": p,
                        "message": why,
                        "commit": _commit(),
                    }
                    _save(out, "tpu_table4", t4data, markdown_table4)
                    log(f"table4 {label} at {depth} layers refused: {why}")
                    break
                check_split(prog, cfg, batch, seq, f"table4 {label} {p}")
                m = t4data["models"].setdefault(label, {})
                if m.get("n_layers", cfg.n_layers) != cfg.n_layers or m.get("seq", seq) != seq:
                    # Rows of another cut are not comparable with this one: start afresh.
                    log(f"table4 {label}: dropping the rows of the {m['n_layers']}-layer cut")
                    m.pop("policies", None)
                m.update(
                    {
                        "preset": preset,
                        "n_layers": cfg.n_layers,
                        "moe_layers": cfg.n_layers - cfg.moe.n_dense_layers if cfg.moe else 0,
                        "seq": seq,
                        "batch": batch,
                        "params": models.count_params(cfg),
                    }
                )
                m.setdefault("policies", {})[p] = _step_row(prog, cfg, batch, seq)
                t4data["meta"] = _meta(kind) | {"mesh": dict(mesh2.shape)}
                _save(out, "tpu_table4", t4data, markdown_table4)
                log(
                    f"table4 {label} {p}: total {prog.memory.total / 2**30:.2f} GiB, temp "
                    f"{prog.memory.temporaries / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s)"
                )
    if "full" in parts:
        presets = ["tiny", "tiny-moe"] if args.smoke else args.models.split(",")
        seq, per_chip = (SMOKE_SEQ, SMOKE_PER_CHIP) if args.smoke else (4096, FULL_DEPTH_PER_CHIP)
        for preset in presets:
            label, cfg = names.get(preset, preset), models.get_config(preset)
            topology, shape = FULL_DEPTH_MESHES.get(preset, (TOPOLOGY, dict(mesh2.shape)))
            full_mesh = tpu_mesh(shape, topology=topology)
            depth, batch = cfg.n_layers, per_chip * full_mesh.devices.size
            # --smoke: top-3 routing, so a chip's routed rows (batch / 2 x seq x 3) match no
            # global count for `check_split` (with top-2 over fsdp=2 they equal the tokens).
            overrides = (
                {"moe": dataclasses.replace(cfg.moe, top_k=3)} if args.smoke and cfg.moe else None
            )
            m = t4data.setdefault("full_depth", {}).setdefault(label, {})
            m.update(
                {
                    "preset": preset,
                    "n_layers": depth,
                    "moe_layers": depth - cfg.moe.n_dense_layers if cfg.moe else 0,
                    "per_chip": per_chip,
                    "seq": seq,
                    "batch": batch,
                    "topology": topology,
                    "mesh": shape,
                }
            )
            for p in pols:
                try:
                    prog, cfg, _ = compile_step(
                        p, full_mesh, preset, depth, seq, per_chip, overrides, buffers=True
                    )
                except jax.errors.JaxRuntimeError as e:
                    if (why := _refused(e)) is None:
                        raise
                    m.setdefault("policies", {}).pop(p, None)
                    m.setdefault("refused", {})[p] = {"message": why, "commit": _commit()}
                    log(f"full {label} {p} refused: {why}")
                else:
                    check_split(prog, cfg, batch, seq, f"full {label} {p}")
                    m.setdefault("refused", {}).pop(p, None)
                    m.setdefault("policies", {})[p] = _step_row(prog, cfg, batch, seq)
                    log(f"full {label} {p}: temp {prog.memory.temporaries / 2**30:.2f} GiB")
                t4data["meta"] = _meta(kind) | {"mesh": dict(mesh2.shape)}
                _save(out, "tpu_table4", t4data, markdown_table4)
    return {"compile": data} | ({"table4": t4data} if {"table4", "full"} & set(parts) else {})


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.1f}%"


# The two memory metrics the pages compare policies on (`MemoryAnalysis` fields): the packed
# block of temporaries, and the peak of buffers live at once.
METRICS = ("temporaries", "peak")
# S3R = RTNE counts as met within this many percent (the packing of equal programs jitters).
SAME_PCT = 1.0


def _mem(P: dict, p: str, metric: str) -> int | None:
    """Policy `p`'s memory figure `metric` in the rows `P`, or None (not compiled, or a row
    compiled before `MemoryAnalysis` had the field)."""
    return P.get(p, {}).get("memory", {}).get(metric)


def _surplus(P: dict, p: str, base: str, metric: str = "temporaries") -> float | None:
    """Percent of `p`'s `metric` over `base`'s, or None."""
    a, b = _mem(P, p, metric), _mem(P, base, metric)
    return None if a is None or b is None or b == 0 else 100 * (a / b - 1)


def _over(P: dict, p: str, base: str, metric: str = "temporaries") -> str:
    v = _surplus(P, p, base, metric)
    return "—" if v is None else f"{v:+.1f}%"


def _ops(P: dict, p: str) -> str:
    v = P.get(p, {}).get("vector_ops_per_upstream_element")
    r = P.get("rtne", {}).get("vector_ops_per_upstream_element")
    if v is None:
        return "—"
    return f"{v:.1f}" + (f" ({v - r:+.1f})" if r is not None and p != "rtne" else "")


def _u32(P: dict, p: str) -> str:
    u = P[p].get("largest_u32")
    if u is None or not u["shape"]:
        return "scalars only" if u is not None else "none"
    return f"{tuple(u['shape'])} ({u['bytes'] / 2**10:.0f} KiB)"


def _policy_table(P: dict) -> list[str]:
    lines = [
        "| policy | temporaries (MiB) | over RTNE | over its S3R | peak (MiB) | over RTNE "
        "| over its S3R | arguments + outputs (MiB) | layer GEMMs | integer GEMMs | fusions "
        "| largest u32 buffer | backward vector ops / element (over RTNE) "
        "| cost model: optimal_seconds (a model) |",
        "| --- |" + " ---: |" * 7 + " --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for p in POLICIES:
        if p not in P:
            continue
        r = P[p]
        base = "s3r-bcast" if p.startswith("s3r-bcast-") else "s3r"
        mem = r["memory"]
        sigs = r["layer_gemms"]
        layer = f"{len(sigs)} x ({sigs[0]})" if sigs and len(set(sigs)) == 1 else "; ".join(sigs)
        cells = []
        for metric in METRICS:
            v = _mem(P, p, metric)
            cells += [
                "—" if v is None else _mib(v),
                _over(P, p, "rtne", metric),
                _over(P, p, base, metric) if "ec" in p else "—",
            ]
        lines.append(
            f"| {p} | {' | '.join(cells)} | {_mib(mem['arguments'] + mem['outputs'])} | "
            f"{layer} | {r['n_integer_gemms']} | {r['fusions']} | {_u32(P, p)} | "
            f"{_ops(P, p)} | {r['cost_model']['optimal_seconds']:.2e} |"
        )
    return lines


def _engines(rows: dict[str, dict]) -> str:
    """`commit (rows), ...`: which engine commit compiled which rows."""
    by: dict[str, list[str]] = {}
    for label, r in rows.items():
        by.setdefault(r.get("commit", "unknown"), []).append(label)
    if len(by) == 1:
        return f"engine at commit `{next(iter(by))}`"
    text = "engine at commits " + "; ".join(
        f"`{c}` ({', '.join(labels)})" for c, labels in by.items()
    )
    return text + _same_engines(list(by))


def _same_engines(commits: list[str]) -> str:
    """` (`a`, `b` hold the same engine: ...)` for the commits whose engine trees are
    identical, and `; N different engines, ...` where there are several."""
    engines: dict[str | None, list[str]] = {}
    for c in commits:
        engines.setdefault(_engine_tree(c), []).append(c)
    same = [cs for tree, cs in engines.items() if tree is not None and len(cs) > 1]
    text = ""
    if same:
        text += (
            " ("
            + "; ".join(
                f"`{'`, `'.join(cs)}` hold the same engine: identical `s3req/` (outside the "
                "compile tool `s3req/tpu/`), `policies/`, `models/`"
                for cs in same
            )
            + ")"
        )
    if len(engines) > 1:
        text += (
            f"; {len(engines)} different engines, so a difference between two rows of "
            "different engines measures the engine change as well as the policy"
        )
    return text


def _engine_tree(commit: str) -> str | None:
    """The files of the engine at `commit`: `s3req/` (less `s3req/tpu/`, the compile tool,
    which reads a program and does not change it), `policies/` and `models/`, as git's
    `(path, blob)` listing (None if unknown)."""
    if commit.endswith("+dirty"):
        return None
    try:
        out = subprocess.run(
            ["git", "ls-tree", "-r", commit, "--", *ENGINE_DIRS],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if out.returncode != 0:
        return None
    files = [line for line in out.stdout.splitlines() if "\ts3req/tpu/" not in line]
    return "\n".join(files)


ENGINE_DIRS = ("s3req", "policies", "models")


def _header(
    meta: dict,
    cmd: str,
    title: str,
    rows: dict[str, dict],
    dropped: dict[str, list[str]],
    ops: bool = True,
) -> list[str]:
    lines = [
        f"# {title}",
        "",
        f"Generated by `{cmd}` with `s3req.tpu` (libtpu's XLA TPU compiler, jax "
        f"{meta['jax']}) on a CPU machine ({meta['platform']}), {_engines(rows)}: "
        f"compiled ahead of time for {meta['topology']} "
        f"({meta['device_kind']}, 4 chips); nothing ran on a TPU. Memory is per chip, from "
        "XLA's compile-time buffer assignment (the paper's Table IV method); GEMMs, buffers "
        "and fusions are read from the optimized HLO. The cost model's `optimal_seconds` is "
        "the compiler's estimate, **not a measured time** (it prices neither int8 GEMMs at "
        "twice bf16 nor Threefry's vector work)."
        + (
            " Vector ops / element: HLO operations on elements in the backward fusions per "
            "element of the upstream gradients the quantizer rounds (a static count, see "
            "`s3req.tpu.TPUProgram`); in brackets the difference to INT8 RTNE."
            if ops
            else ""
        ),
        "",
    ]
    # A row recompiled since it was removed is back in `rows`.
    dropped = {c: [x for x in xs if x not in rows] for c, xs in dropped.items()}
    dropped = {c: xs for c, xs in dropped.items() if xs}
    return lines + (
        [
            "Rows removed as compiled on a superseded engine (to be recompiled): "
            + "; ".join(f"`{c}`: {', '.join(labels)}" for c, labels in dropped.items())
            + ".",
            "",
        ]
        if dropped
        else []
    )


# The S3R-EC checks on one FFN block: (policy, its label, the S3R row it is measured
# against, the target in percent).
EC_CHECKS = (
    ("s3r-ec-dx", "dX-only", "s3r", TARGET_DX_PCT),
    ("s3r-ec-2way", "two-way", "s3r", TARGET_TWO_WAY_PCT),
)


def _block_verdicts(P: dict, metric: str) -> str:
    """`S3R = RTNE yes, dX-only yes, two-way **no**` for one FFN block on `metric`."""
    out = []
    checks = [("S3R = RTNE", "s3r", "rtne", None)] + [
        (label, p, base, t) for p, label, base, t in EC_CHECKS
    ]
    for label, p, base, target in checks:
        v = _surplus(P, p, base, metric)
        if v is None:
            ok = "—"
        else:
            ok = "yes" if (abs(v) <= SAME_PCT if target is None else v <= target) else "**no**"
        out.append(f"{label} {ok}")
    return ", ".join(out)


def _ffn_memory_table(done: dict, metric: str) -> list[str]:
    lines = [
        "| shape | (H, D_ffn) | "
        + " | ".join(POLICIES)
        + " | S3R / RTNE | dX-only / S3R | two-way / S3R | bcast dX-only / bcast "
        "| bcast two-way / bcast |",
        "| --- | --- |" + " ---: |" * (len(POLICIES) + 5),
    ]
    for w, r in done.items():
        P_ = r["policies"]
        cells = [_mib(v) if (v := _mem(P_, p, metric)) is not None else "—" for p in POLICIES]
        ratios = [
            ("s3r", "rtne"),
            ("s3r-ec-dx", "s3r"),
            ("s3r-ec-2way", "s3r"),
            ("s3r-bcast-ec-dx", "s3r-bcast"),
            ("s3r-bcast-ec-2way", "s3r-bcast"),
        ]
        lines.append(
            f"| {w} | ({r['h']}, {r['d_ff']}) | "
            + " | ".join(cells + [_over(P_, a, b, metric) for a, b in ratios])
            + " |"
        )
    return lines


def _other_gemms(r: dict, layer_macs: int, each: bool = True) -> str:
    """The GEMMs of one program besides its layer GEMMs, then their multiply-adds as a share
    of the layer GEMMs': each with signature, per-chip result shape and multiply-adds, or
    (`each=False`) their count."""
    small = r.get("small_gemms")
    if small is None:
        return "—"
    if not small:
        return "none" if each else "0"
    share = (
        f"{100 * sum(g['macs'] or 0 for g in small) / (len(r['layer_gemms']) * layer_macs):.2f}%"
    )
    if not each:
        return f"{len(small)} ({share})"
    listed = "; ".join(
        f"{g['signature']} `{tuple(g['shape'])}` ({(g['macs'] or 0) / 1e6:.1f} M)" for g in small
    )
    return f"{listed}: {share}"


def _other_gemms_table(P: dict, layer_macs: int) -> list[str]:
    """Per policy, the GEMMs the error correction (or anything else) adds to the layer's."""
    lines = [
        "",
        "GEMMs besides the layer GEMMs (signature, per-chip result shape, multiply-adds; then "
        "their total as a share of the layer GEMMs' multiply-adds): the error correction's "
        "products.",
        "",
        "| policy | other GEMMs |",
        "| --- | --- |",
    ]
    for p in POLICIES:
        if p in P:
            lines.append(f"| {p} | {_other_gemms(P[p], layer_macs)} |")
    return lines


def markdown(s: dict) -> str:
    meta = s["meta"]
    cmd = "python benchmarks/tpu_compile.py" + (" --smoke" if s.get("smoke") else "")
    rows = {f"layer {p}": r for p, r in s["layer"].items()}
    for w, r in s["ffn"].items():
        rows |= {f"{w} {p}": x for p, x in r.get("policies", {}).items()}
    lines = _header(
        meta,
        cmd,
        "TPU v5p compile: one layer and the FFN blocks of Table III",
        rows,
        s.get("dropped", {}),
    )
    lines += [
        "Two memory figures per program, both XLA's: **temporaries** "
        "(`temp_size_in_bytes`), the size of the one block the compiler packs all temporary "
        "buffers into, holes included; and **peak** (`peak_memory_in_bytes`), the largest "
        "total of buffers live at one time in the compiler's simulation of the program, "
        "arguments and outputs included. Two programs with the same live buffers can get "
        "temporaries that differ by how the buffers pack; the peak does not see packing, but "
        "it is not bounded by arguments + outputs + temporaries either (on small programs it "
        "exceeds that sum), so it is reported as it is and compared only between policies. "
        "Rows compiled before the peak was recorded show — for it. How much of the "
        "temporaries are holes, read from the compiler's buffer assignment (on v5p "
        "`temporaries` = block + hole, the hole counted twice): "
        "[packing of the FFN block](tpu_packing.md) (`benchmarks/tpu_packing.py`).",
        "",
    ]
    if s["layer"]:
        B, S, H, D = s["layer_shape"]
        lines += [
            f"## One layer: x ({B}, {S}, {H}) @ w ({H}, {D})",
            "",
            "qdot forward + backward, bf16 activations and gradient, float32 weights, the "
            f"batch split over the 4 chips ({B // 4} x {S} tokens per chip). Layer GEMMs: those "
            "with "
            "at least one layer GEMM's multiply-adds (forward, dX, dW); integer GEMMs "
            "include the error correction's thin int8 products.",
            "",
        ]
        lines += _policy_table(s["layer"])
        lines += _other_gemms_table(s["layer"], B * S * H * D // 4)
        L = s["layer"]
        temp = lambda P_, p: P_[p]["memory"]["temporaries"]
        if "sr" in L and "rtne" in L:
            u = L["sr"].get("largest_u32") or {"bytes": 0}
            elems = B * S * D // 4
            lines += [
                "",
                f"Independent SR: {_mib(L['sr']['memory']['temporaries'])} MiB of temporaries "
                f"against RTNE's {_mib(L['rtne']['memory']['temporaries'])}, but its largest "
                f"u32 buffer is {_u32(L, 'sr')}"
                + (
                    f", not the {elems * 4 / 2**20:.0f} MiB of one word per gradient element "
                    "on a chip: the compiler fuses the per-element Threefry into the quantizer "
                    "fusions (its cost is vector work, the ops column). The extra "
                    f"{_mib(temp(L, 'sr') - temp(L, 'rtne'))}"
                    f" MiB are about {elems / 2**20:.0f} MiB, one byte per gradient element, "
                    "as a second int8 code tensor (Independent SR quantizes G twice) would be."
                    if u["bytes"] < elems * 4
                    else ": one word per gradient element is written to memory."
                ),
            ]
    if s["ffn"]:
        done = {
            w: s["ffn"][w] for w in models.PAPER_FFN_SHAPES if s["ffn"].get(w, {}).get("policies")
        }
        missing = [w for w in models.PAPER_FFN_SHAPES if w not in done]
        targets = (
            f"paper: both variants add {PAPER_EC_BLOCK[0]:.0f}-{PAPER_EC_BLOCK[1]:.0f}% on one "
            f"block; targets: S3R = RTNE, dX-only <= +{TARGET_DX_PCT:.0f}%, two-way <= "
            f"+{TARGET_TWO_WAY_PCT:.0f}%"
        )
        lines += [
            "",
            "## SwiGLU FFN block (Table III shapes)",
            "",
            "`models.FFN` (gate, up, down) forward + backward as in "
            "`experiments/table3_ffn_speed.py`, at the paper's exact (H, D_ffn), "
            f"{' x '.join(map(str, next(iter(done.values()))['tokens']))} tokens batch-split "
            "over the 4 chips. Vector ops per element of the three projections' upstream "
            "gradients (tokens x (H + 2 D_ffn)). Shapes compiled: "
            + ", ".join(done)
            + (f" (not compiled: {', '.join(missing)})" if missing else "")
            + ".",
            "",
            f"Temporaries (MiB) per policy, and the ratios between policies ({targets}):",
            "",
            *_ffn_memory_table(done, "temporaries"),
            "",
            "Peak (MiB) per policy, and the same ratios on it:",
            "",
            *_ffn_memory_table(done, "peak"),
            "",
            "Backward vector operations per upstream-gradient element (in brackets: over "
            f"INT8 RTNE; paper, from measured time: Independent SR {PAPER_OPS['sr']}, S3R "
            f"{PAPER_OPS['s3r']}, S3R-EC {PAPER_OPS['ec']}):",
            "",
            "| shape | " + " | ".join(p for p in POLICIES if p != "bf16") + " |",
            "| --- |" + " ---: |" * (len(POLICIES) - 1),
        ]
        for w, r in done.items():
            lines.append(
                f"| {w} | "
                + " | ".join(_ops(r["policies"], p) for p in POLICIES if p != "bf16")
                + " |"
            )
        lines += [
            "",
            "For reference, the paper's Table III beside our memory ratios (the paper's "
            "columns are times measured on v5p; this compile gives no times, and the paper "
            "gives its block memory only as the +8-14% range), with the targets checked on "
            f"each metric (S3R = RTNE within {SAME_PCT:.0f}%):",
            "",
            "| shape | paper: RTNE / SR / S3R speed-up over BF16 | paper: two-way / dX-only "
            "time over S3R | ours, temporaries: S3R / RTNE, two-way / S3R, dX-only / S3R "
            "| targets met on temporaries | ours, peak: the same | targets met on peak |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for w, r in done.items():
            P_ = r["policies"]
            rt, sr, s3, tw, dx = PAPER_TABLE3[w]
            ours = [
                " / ".join(
                    _over(P_, a, b, metric)
                    for a, b in (("s3r", "rtne"), ("s3r-ec-2way", "s3r"), ("s3r-ec-dx", "s3r"))
                )
                + f" | {_block_verdicts(P_, metric)}"
                for metric in METRICS
            ]
            lines.append(
                f"| {w} | {rt:.2f} / {sr:.2f} / {s3:.2f} | {tw:+.1f}% / {dx:+.1f}% | "
                + " | ".join(ours)
                + " |"
            )
        lines += [
            "",
            "Program structure (integer GEMMs / fusions / largest u32 buffer / GEMMs besides "
            "the layer GEMMs, and their multiply-adds as a share of the layer GEMMs'):",
            "",
            "| shape | " + " | ".join(POLICIES) + " |",
            "| --- |" + " --- |" * len(POLICIES),
        ]
        for w, r in done.items():
            P_ = r["policies"]
            macs = r["tokens"][0] * r["tokens"][1] * r["h"] * r["d_ff"] // 4
            lines.append(
                f"| {w} | "
                + " | ".join(
                    f"{P_[p]['n_integer_gemms']} / {P_[p]['fusions']} / {_u32(P_, p)} / "
                    f"{_other_gemms(P_[p], macs, each=False)}"
                    if p in P_
                    else "—"
                    for p in POLICIES
                )
                + " |"
            )
        lines += ["", _reading(s)]
    return "\n".join(lines) + "\n"


def _range(values: list[float]) -> str:
    return f"{min(values):+.1f}%" + (
        f" to {max(values):+.1f}%" if max(values) - min(values) >= 0.05 else ""
    )


def _reading_metric(rows: dict[str, dict], metric: str) -> str | None:
    """The generated verdicts on one metric over the FFN rows, or None if it has no rows."""
    parts = []
    eq = [w for w, P_ in rows.items() if _surplus(P_, "s3r", "rtne", metric) is not None]
    if eq:
        d = [_surplus(rows[w], "s3r", "rtne", metric) or 0.0 for w in eq]
        off = [f"{w} ({v:+.1f}%)" for w, v in zip(eq, d) if abs(v) > SAME_PCT]
        parts.append(
            f"S3R {_range(d)} over RTNE at {', '.join(eq)} (target and paper: the same; "
            + (
                f"not within {SAME_PCT:.0f}% at {', '.join(off)})"
                if off
                else f"within {SAME_PCT:.0f}% everywhere)"
            )
        )
    for p, label, base, target in EC_CHECKS:
        ws = [w for w, P_ in rows.items() if _surplus(P_, p, base, metric) is not None]
        if ws:
            d = [_surplus(rows[w], p, base, metric) or 0.0 for w in ws]
            over = [w for w, v in zip(ws, d) if v > target]
            where = f"above it at {', '.join(over)}" if over else f"within it at {', '.join(ws)}"
            parts.append(
                f"{label} {_range(d)} over S3R (target +{target:.0f}%: {where}; paper: "
                f"+{PAPER_EC_BLOCK[0]:.0f}% to +{PAPER_EC_BLOCK[1]:.0f}%)"
            )
    return f"on {metric}, " + "; ".join(parts) if parts else None


def _packing(rows: dict[str, dict]) -> str | None:
    """How far the ratios on temporaries stray from the same ratios on the peak."""
    gaps = []
    for w, P_ in rows.items():
        for p, label in (("rtne", "RTNE"), ("s3r-ec-dx", "dX-only"), ("s3r-ec-2way", "two-way")):
            t, k = _surplus(P_, p, "s3r", "temporaries"), _surplus(P_, p, "s3r", "peak")
            if t is not None and k is not None:
                gaps.append((abs(t - k), w, p, label, t, k))
    if not gaps:
        return None
    gaps.sort()
    g, w, p, label, t, k = gaps[-1]
    small = sum(x[0] <= SAME_PCT for x in gaps)
    mib = lambda q, m: _mib(_mem(rows[w], q, m) or 0)
    return (
        "packing: the ratios over S3R of the RTNE, dX-only and two-way rows differ between "
        f"the two metrics by {gaps[0][0]:.1f} to {g:.1f} percentage points ({small} of "
        f"{len(gaps)} within {SAME_PCT:.0f} point); the largest is {label} at {w}, "
        f"{t:+.1f}% on temporaries ({mib(p, 'temporaries')} against S3R's "
        f"{mib('s3r', 'temporaries')} MiB) but {k:+.1f}% on the peak ({mib(p, 'peak')} "
        f"against {mib('s3r', 'peak')} MiB)"
    )


def _bytes(rows: dict[str, dict]) -> str | None:
    """The EC surplus over S3R in MiB on both metrics (a percentage of the peak is of a base
    that holds the arguments and outputs too, so it reads smaller for the same bytes)."""
    spans = []
    for p, label, base, _ in EC_CHECKS:
        have = [
            P_
            for P_ in rows.values()
            if all(_mem(P_, q, m) is not None for q in (p, base) for m in METRICS)
        ]
        if have:
            d = {
                m: [(_mem(P_, p, m) or 0) - (_mem(P_, base, m) or 0) for P_ in have]
                for m in METRICS
            }
            span = lambda v: f"{min(v) / 2**20:+.1f} to {max(v) / 2**20:+.1f}"
            spans.append(
                f"{label} {span(d['peak'])} MiB on the peak ({span(d['temporaries'])} on "
                "temporaries)"
            )
    if not spans:
        return None
    return (
        "in bytes over S3R, "
        + " and ".join(spans)
        + "; a percentage of the peak is of a base that also holds the arguments and outputs, "
        "so the same bytes read smaller on it than on temporaries"
    )


def _reading(s: dict) -> str:
    rows = {
        w: s["ffn"][w]["policies"]
        for w in models.PAPER_FFN_SHAPES
        if s["ffn"].get(w, {}).get("policies")
    }
    parts = [x for m in METRICS if (x := _reading_metric(rows, m)) is not None]
    if (x := _packing(rows)) is not None:
        parts.append(x)
    if (x := _bytes(rows)) is not None:
        parts.append(x)
    u32 = [
        (w, p)
        for w, P_ in rows.items()
        for p in ("s3r", "s3r-bcast", "s3r-ec-dx", "s3r-ec-2way")
        if p in P_ and P_[p].get("largest_u32") and P_[p]["largest_u32"]["bytes"] > 2**22
    ]
    parts.append(
        "no shared-threshold policy writes a u32 buffer above 4 MiB"
        if not u32
        else f"large u32 buffers at {u32}"
    )
    sr = [P_["sr"] for P_ in rows.values() if "sr" in P_]
    if sr and all((r.get("largest_u32") or {}).get("bytes", 0) <= 2**22 for r in sr):
        parts.append(
            "nor does Independent SR: the TPU compiler fuses its per-element Threefry into "
            "the quantizer fusions, so its cost shows as vector operations, not as memory"
        )
    int8 = [
        P_[p]["layer_gemms"] == ["s8 x s8 -> s32"] * 9
        for P_ in rows.values()
        for p in P_
        if p != "bf16"
    ]
    if int8:
        parts.append(
            "every INT8 policy's nine layer GEMMs (three per projection) read s8 x s8 into s32"
            if all(int8)
            else "**some INT8 policy's layer GEMMs are not s8 x s8 -> s32**"
        )
    return "Reading (generated): " + "; ".join(parts) + "."


# Table IV compares policies on the step's total memory (arguments + outputs + temporaries,
# the figure the paper's GB statements are about) and on XLA's peak.
STEP_METRICS = ("total", "peak")


def _gb(P_: dict, a: str, b: str, metric: str = "total") -> float | None:
    """`metric` of policy `a` minus policy `b`, GB (1e9 bytes), or None."""
    x, y = _mem(P_, a, metric), _mem(P_, b, metric)
    return None if x is None or y is None else (x - y) / 1e9


def _fmt_gb(v: float | None) -> str:
    return "—" if v is None else f"{v:+.3f}"


def _row_engines(P_: dict) -> str:
    """Which engine commit compiled which of one model's rows."""
    by: dict[str, list[str]] = {}
    for p in POLICIES:
        if p in P_:
            by.setdefault(P_[p].get("commit", "unknown"), []).append(p)
    if len(by) == 1:
        return f"`{next(iter(by))}`"
    return "; ".join(f"`{c}` ({', '.join(ps)})" for c, ps in by.items())


def _step_table(s: dict, pols: list[str], metric: str, engines: bool = False) -> list[str]:
    lines = [
        "| model | layers | " + " | ".join(pols) + (" | engine commit |" if engines else " |"),
        "| --- | --- |" + " ---: |" * len(pols) + (" --- |" if engines else ""),
    ]
    for name, m in s["models"].items():
        P_ = m["policies"]
        cells = [
            f"{v / 2**30:.3f}" if (v := _mem(P_, p, metric)) is not None else "—" for p in pols
        ]
        if engines:
            cells.append(_row_engines(P_))
        lines.append(f"| {name} | {m['n_layers']} ({m['moe_layers']} MoE) | {' | '.join(cells)} |")
    return lines


def markdown_table4(s: dict) -> str:
    if not s.get("models"):
        return "# TPU v5p compile: Table IV full-step memory\n\nNo step compiled yet.\n"
    meta = s["meta"]
    cmd = "python benchmarks/tpu_compile.py --parts table4" + (" --smoke" if s["smoke"] else "")
    rows = {f"{n} {p}": r for n, m in s["models"].items() for p, r in m["policies"].items()}
    lines = _header(
        meta,
        cmd,
        "TPU v5p compile: Table IV full-step memory",
        rows,
        s.get("dropped", {}),
        ops=False,
    )
    first = next(iter(s["models"].values()))
    chips = 1
    for v in meta["mesh"].values():
        chips *= v
    fsdp = meta["mesh"].get("fsdp", 1)
    cut = {n: m for n, m in s["models"].items() if not _full_depth(m)}
    lines += [
        f"The training step of `experiments/table4_full_step.py` (loss, INT8 backward under "
        "the policy, global-norm clipping, AdamW) compiled for a "
        f"{' x '.join(f'{k}={v}' for k, v in meta['mesh'].items())} mesh of the 4 chips: "
        "parameters and optimizer state FSDP x TP sharded with `s3req.train`'s rules, a "
        f"global batch of {first['batch']} sequences of {first['seq']} tokens "
        f"({first['batch'] // chips} per chip in MaxText's `per_device_batch_size` "
        f"convention: {first['batch']} = {first['batch'] // chips} x {chips} chips) split "
        f"over `fsdp` only, so each chip holds {first['batch'] // fsdp} sequences with their "
        "features and heads split over `tp`; full rematerialisation, bf16 activations. "
        + _depth_text(s["models"], cut, s.get("refused", {}))
        + " Memory per chip; the paper's figures are for the full models on v5p (XLA's "
        "compile-time estimate, as here).",
        "",
    ]
    if len({m["n_layers"] for m in cut.values()}) > 1:
        secs = {
            n: max(r.get("compile_seconds", 0) for r in m["policies"].values())
            for n, m in cut.items()
        }
        lines += [
            "The cuts differ between models ("
            + ", ".join(
                f"{n}: {m['n_layers']} layers, compiled in up to {secs[n] / 60:.0f} min"
                for n, m in cut.items()
            )
            + "; the deeper cut of a model did not fit the time of the session that compiled "
            "it). The step rematerialises every layer, so its backward recomputes and "
            "differentiates one layer at a time, and what error correction adds (the thin "
            "int8 GEMMs, the per-token and per-channel sums, the correction terms) is live "
            "within one layer's backward: the EC surplus over S3R of cuts of different depth "
            "compare, their totals do not.",
            "",
        ]
    pols = [p for p in POLICIES if any(p in m["policies"] for m in s["models"].values())]
    absent = [n for n in TABLE4_MODELS if n not in s["models"]] + [
        f"{n}: {', '.join(p for p in POLICIES if p not in m['policies'])}"
        for n, m in s["models"].items()
        if any(p not in m["policies"] for p in POLICIES)
    ]
    if absent and not s["smoke"]:
        lines += ["Not compiled: " + "; ".join(absent) + ".", ""]
    lines += _split_lines(s, fsdp)
    lines += [
        "Total step memory per chip (GiB; arguments + outputs + temporaries - aliased), and "
        "the engine commit of each row:",
        "",
        *_step_table(s, pols, "total", engines=True),
        "",
        "Peak per chip (GiB; XLA's `peak_memory_in_bytes`, see the "
        "[compile page](tpu_compile.md); — for rows compiled before it was recorded):",
        "",
        *_step_table(s, pols, "peak"),
        "",
        "Temporaries alone (GiB):",
        "",
        *_step_table(s, pols, "temporaries"),
        "",
        "Differences (GB), each as total / peak, ours beside the paper's for the full model "
        f"(targets: S3R = RTNE; two-way - S3R <= +{PAPER_TWO_WAY_STEP_GB} GB on a "
        f"dense step; an MoE step's EC surplus within {TARGET_MOE_RATIO:.0f}x of the dense "
        "steps'):",
        "",
        *_differences_table(s["models"]),
    ]
    if (reading := _reading_table4(s)) is not None:
        lines += ["", reading]
    if any(m.get("moe_layers") for m in s["models"].values()):
        lines += [
            "",
            "Which buffers make an MoE step's surplus of live bytes (and peak) over S3R, "
            "grouped by shape and the operation that made them: the last section of the "
            "[packing page](tpu_packing.md) (`python benchmarks/tpu_packing.py --steps "
            "...`).",
        ]
    if s.get("full_depth"):
        dense = {n: m for n, m in s["models"].items() if n in DENSE}
        lines += ["", *_full_depth_section(s["full_depth"], dense, chips)]
    return "\n".join(lines) + "\n"


def _both(P_: dict, a: str, b: str) -> str:
    """`a - b` in GB on every `STEP_METRICS` (total / peak) from one model's rows `P_`."""
    return " / ".join(_fmt_gb(_gb(P_, a, b, m)) for m in STEP_METRICS)


def _differences_table(models_: dict) -> list[str]:
    """Per model, the differences between policies' step memory (GB, total / peak)."""
    lines = [
        "| model | S3R - RTNE | paper | two-way - S3R | paper | dX-only - S3R "
        "| bcast two-way - bcast | SR - RTNE | RTNE - BF16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, m in models_.items():
        P_ = m["policies"]
        paper = PAPER_STEP_GB.get(name, (None, None))
        lines.append(
            f"| {name} | {_both(P_, 's3r', 'rtne')} | {paper[0] or '—'} | "
            f"{_both(P_, 's3r-ec-2way', 's3r')} | {paper[1] or '—'} | "
            f"{_both(P_, 's3r-ec-dx', 's3r')} | {_both(P_, 's3r-bcast-ec-2way', 's3r-bcast')} | "
            f"{_both(P_, 'sr', 'rtne')} | {_both(P_, 'rtne', 'bf16')} |"
        )
    return lines


def _full_depth_section(full: dict, dense: dict, chips: int) -> list[str]:
    """The page's section on the MoE models compiled at their real depth with
    `FULL_DEPTH_PER_CHIP` sequences per chip (`--parts full`); `dense`: the tables' rows of
    the dense models, for the reading, over `chips` chips."""
    first = next(iter(full.values()))
    here = [m for m in full.values() if m.get("topology", TOPOLOGY) == TOPOLOGY]
    moved = [
        f"{n} on {m['topology']} as {' x '.join(f'{k}={v}' for k, v in m['mesh'].items())} "
        f"(a global batch of {m['batch']})"
        for n, m in full.items()
        if m.get("topology", TOPOLOGY) != TOPOLOGY
    ]
    refused = [
        f"{n}: "
        + ", ".join(f"{p} ({_needed(r['message'])})" for p, r in m["refused"].items())
        + " (engine "
        + ", ".join(sorted({f"`{r['commit']}`" for r in m["refused"].values()}))
        + ")"
        for n, m in full.items()
        if m.get("refused")
    ]
    compiled = {n: m for n, m in full.items() if m.get("policies")}
    lines = [
        "## The models at their real depth with fewer sequences per chip",
        "",
        f"`python benchmarks/tpu_compile.py --parts full`: the same step at the models' real "
        f"depth with {first['per_chip']} sequence(s) of {first['seq']} tokens per chip"
        + (f" (on the tables' mesh a global batch of {here[0]['batch']})" if here else "")
        + ": the compiler refuses the MoE models' full depth at the tables' batch above, and "
        "the dense models are compiled at this batch too, so that an MoE step's EC surplus is "
        "compared with a dense step's at the same batch. The rows are comparable with each "
        "other, not with the tables above."
        + (
            " On more chips, where the real depth does not fit 4 even at this batch (the same "
            "sequences per chip and `tp`, memory per chip; `FULL_DEPTH_MESHES`): "
            + "; ".join(moved)
            + "."
            if moved
            else ""
        )
        + (
            " Refused by the compiler (the HBM it asked for; a v5p chip has 95.74G): "
            + "; ".join(refused)
            + "."
            if refused
            else ""
        ),
        "",
    ]
    if not compiled:
        return lines
    pols = [p for p in POLICIES if any(p in m["policies"] for m in compiled.values())]
    cut = {"models": compiled}
    commits = list(
        dict.fromkeys(
            r.get("commit", "unknown") for m in compiled.values() for r in m["policies"].values()
        )
    )
    return lines + [
        "Total step memory per chip (GiB), and the engine commit of each row"
        + (f"{_same_engines(commits)}:" if len(commits) > 1 else ":"),
        "",
        *_step_table(cut, pols, "total", engines=True),
        "",
        "Peak per chip (GiB):",
        "",
        *_step_table(cut, pols, "peak"),
        "",
        "Temporaries alone (GiB):",
        "",
        *_step_table(cut, pols, "temporaries"),
        "",
        "Differences (GB), each as total / peak:",
        "",
        *_differences_table(compiled),
        "",
        *_placement_lines(compiled),
        _full_depth_reading(compiled, dense, chips),
    ]


PLACEMENT_POLICIES = ("s3r", "s3r-ec-dx", "s3r-ec-2way")
"""The rows whose temporaries' placement the real-depth section shows (`_placement_lines`)."""


def _live_mib(r: dict) -> tuple[float, float] | None:
    """A step row's temporaries live at the busiest instruction of the block, MiB: in the
    block and in the outputs' buffers (`BufferPacking.in_outputs`), or None unread."""
    pk = r.get("packing")
    return None if pk is None else (pk["live"] / 2**20, pk["in_outputs"] / 2**20)


def _placement_lines(compiled: dict) -> list[str]:
    """Where the temporaries of the real-depth rows sit at the block's busiest instruction
    (rows compiled with `buffers=True`): in the block or in the outputs' buffers, and the
    two together over S3R's, beside the reported temporaries and the block's size; empty
    where no row has them."""
    rows = [
        (n, p, m["policies"][p])
        for n, m in compiled.items()
        for p in PLACEMENT_POLICIES
        if p in m["policies"] and "packing" in m["policies"][p]
    ]
    if not rows:
        return []
    lines = [
        "Temporaries live at the busiest instruction of the block of temporaries (MiB): in "
        "the block (`BufferPacking.live`), in the buffers of the step's outputs before the "
        "outputs are written (`in_outputs`: the compiler places temporaries there too), both "
        "together, and the difference of the two together from S3R's; beside them XLA's "
        "`temporaries` and the block's size (`heap`): `temporaries - heap` are bytes the "
        "compiler counts twice, on most programs the block's hole `heap - live`. Two programs "
        "with the same sum hold as many temporaries there: a difference of the block alone "
        "is where the compiler placed them.",
        "",
        "| model | policy | temporaries | block | in the block | in the outputs' buffers "
        "| together | together - S3R |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n, p, r in rows:
        live, out = _live_mib(r) or (0.0, 0.0)
        base = _live_mib(compiled[n]["policies"].get("s3r", {}))
        diff = "—" if base is None else f"{live + out - sum(base):+.1f}"
        lines.append(
            f"| {n} | {p} | {r['memory']['temporaries'] / 2**20:.1f} | "
            f"{r['packing']['heap'] / 2**20:.1f} | {live:.1f} | {out:.1f} | {live + out:.1f} "
            f"| {diff} |"
        )
    return lines + [""]


def _needed(message: str) -> str:
    """The memory a refused program asked for, from the compiler's sentence (`_exhausted`)."""
    found = re.search(r"HLO temporaries \(([^)]+)\)", message)
    return found.group(1) if found else message


def _full_depth_reading(compiled: dict, dense: dict, chips: int) -> str:
    """The generated reading of the real-depth rows: the verdicts of the tables' reading on
    them where dense models are among them, else the MoE rows' S3R - RTNE and EC surplus
    beside the largest two-way surplus of `dense` (the tables' dense rows, another batch)."""
    if any(n in DENSE for n in compiled):
        per_chip = next(iter(compiled.values()))["per_chip"]
        verdicts = [x for m in STEP_METRICS if (x := _reading_step_metric(compiled, m))]
        placed = _placement_reading(compiled)
        return (
            f"Reading (generated): at the real depth with {per_chip} sequence(s) per chip, "
            + "; ".join(verdicts)
            + "."
            + (f" {placed}" if placed else "")
        )
    parts = [
        f"{n}: S3R - RTNE {_both(m['policies'], 's3r', 'rtne')} GB, two-way - S3R "
        f"{_both(m['policies'], 's3r-ec-2way', 's3r')} GB, dX-only - S3R "
        f"{_both(m['policies'], 's3r-ec-dx', 's3r')} GB (total / peak)"
        for n, m in compiled.items()
    ]
    ref = [
        (n, v)
        for n, m in dense.items()
        if (v := _gb(m["policies"], "s3r-ec-2way", "s3r")) is not None
    ]
    text = "Reading (generated): at the real depth, " + "; ".join(parts)
    if ref:
        n, v = max(ref, key=lambda t: t[1])
        first = next(iter(dense.values()))
        text += (
            f"; the largest two-way surplus of the dense steps above is {v:+.3f} GB ({n}, "
            f"total, at {first['batch'] // chips} sequences per chip)"
        )
    return text + "."


def _busiest_changes(a: dict, b: dict, shown: int = 3) -> str:
    """The buffers of at least `BUSIEST_FLOOR` bytes in the block at the busiest instruction
    whose bytes differ between rows `a` and `b`, grouped by shape and `made_by`, the
    largest changes first: `+32.0 MiB `bf16[2,4096,2048]` (compiler) wide.param, ...`."""
    totals: dict[tuple[str, str], int] = {}
    for sign, r in ((-1, a), (1, b)):
        for shape, by, size in r["packing"].get("busiest", []):
            totals[(shape, by)] = totals.get((shape, by), 0) + sign * size
    changed = sorted(((k, v) for k, v in totals.items() if v), key=lambda kv: (-abs(kv[1]), kv[0]))
    return ", ".join(f"{v / 2**20:+.1f} MiB `{shape}` {by}" for (shape, by), v in changed[:shown])


def _placement_reading(compiled: dict) -> str | None:
    """For the MoE rows whose EC adds to the temporaries' block, how much of that the EC
    holds live (the block and the outputs' buffers together) and how much is placement."""
    parts = []
    for n, m in compiled.items():
        if n in DENSE or (base := _live_mib(m["policies"].get("s3r", {}))) is None:
            continue
        for p, label in (("s3r-ec-dx", "dX-only"), ("s3r-ec-2way", "two-way")):
            live = _live_mib(m["policies"].get(p, {}))
            if live is None or live[0] <= base[0]:
                continue
            moved = _busiest_changes(m["policies"]["s3r"], m["policies"][p])
            parts.append(
                f"{n} {label} holds {live[0] - base[0]:+.1f} MiB over S3R in the block of "
                f"temporaries at its busiest instruction"
                + (f" ({moved})" if moved else "")
                + f" and {sum(live) - sum(base):+.1f} MiB in the block and the outputs' "
                "buffers together"
            )
    if not parts:
        return None
    return (
        "Where the temporaries sit (the table above): "
        + "; ".join(parts)
        + ". What the block holds over S3R beyond the second figure are temporaries the "
        "compiler placed in the block where for S3R it placed them in an output's buffer: "
        "they count in the peak (the arguments, the outputs and the block's live bytes) and "
        "in `temporaries`."
    )


def _full_depth(m: dict) -> bool:
    """Whether a Table IV row set was compiled at its preset's real depth."""
    return m["n_layers"] == models.get_config(m["preset"]).n_layers


def _depth_text(models_: dict, cut: dict, refused: dict) -> str:
    """The page's account of the depth each model was compiled at, and of the full depths
    the compiler refused (`refused`: model -> its layers and the compiler's message)."""
    full = [n for n in models_ if n not in cut]
    text = (
        f"**Full models:** {', '.join(full)} at their real depth (the layers column: the "
        "layers run as one `jax.lax.scan`, so the compile time does not grow with it)"
        if full
        else ""
    )
    depths = sorted({m["n_layers"] for m in cut.values()})
    if cut:
        text += ("; **layer cut:** " if text else "**Layer cut:** ") + (
            f"{', '.join(cut)} keep their real widths and vocabulary but only "
            f"{' or '.join(map(str, depths))} layer{'s' if depths != [1] else ''} "
            "(an MoE model keeps its dense first layer if it has one and the cut has room for "
            "it, and the column counts its MoE layers), so their totals are not the full "
            "models' and only differences between policies transfer"
        )
    why = [
        f"{n} at its {r['n_layers']} layers ({r['policy']}, engine `{r['commit']}`): "
        f'"{r["message"].rstrip(".")}"'
        for n, r in refused.items()
        if n in cut
    ]
    if why:
        text += ". The compiler refused the full depth on this mesh: " + "; ".join(why)
    return text + "."


def _split_lines(s: dict, fsdp: int) -> list[str]:
    """The page's account of the split check (`check_split`) per model."""
    lines = [
        "**Split check.** Every row compiled with the check passed `check_split`: no "
        "per-chip buffer of the optimized HLO (`s3req.tpu.TPUProgram.buffers`) leads with "
        "the global batch with the sequence length among its other dimensions, nor with the "
        "global token count or the global count of routed rows (MoE). The per-chip shapes "
        "it found, from each model's RTNE row (else its first checked row):",
        "",
        "| model | refused leading dims | attention scores (f32, per chip) "
        "| largest expert-sorted rows buffer (per chip) | rows not checked |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, m in s["models"].items():
        P_ = m["policies"]
        # INT8 RTNE first: its expert rows are the int8 engine's, as every quantized policy's.
        order = ["rtne"] + [p for p in POLICIES if p != "rtne"]
        checked = [r["split_check"] for p in order if (r := P_.get(p, {})).get("split_check")]
        unchecked = [p for p in POLICIES if p in P_ and not P_[p].get("split_check")]
        c = checked[0] if checked else None
        lead = (
            f"{c['batch']} (with {c['seq']}), " + ", ".join(map(str, c["refused_leading"]))
            if c
            else "—"
        )
        scores = f"`f32[{','.join(map(str, c['scores']))}]`" if c and c["scores"] else "—"
        rows = f"`{c['rows'][0]}[{','.join(map(str, c['rows'][1]))}]`" if c and c["rows"] else "—"
        lines.append(f"| {name} | {lead} | {scores} | {rows} | {', '.join(unchecked) or 'none'} |")
    first = next(iter(s["models"].values()))
    lines += ["", f"A chip's share is {first['batch'] // fsdp} sequences of each activation."]
    if any(not r.get("split_check") for m in s["models"].values() for r in m["policies"].values()):
        lines[-1] += (
            " Rows not checked were compiled before the models pinned their activations to "
            "the step's mesh: on the MoE steps GSPMD then held the global batch on every chip "
            "(Qwen3-30B-A3B: scores `f32[16,2,4096,4096,8]`, all 524288 sorted rows), and on a "
            "small dense step compiled the same way the forward projections held the whole "
            "batch (`tests/test_tpu.py` compiles both ways), so their totals are not one "
            "chip's share of the batch."
        )
    lines.append("")
    return lines


def _within(over: list[str], target: str) -> str:
    """` (target: above it for A, B)` or ` (target: within it)`."""
    return f" ({target}: " + (f"above it for {', '.join(over)}" if over else "within it") + ")"


def _reading_step_metric(models_: dict, metric: str) -> str | None:
    """The generated verdicts on one metric over the Table IV rows, or None if it has none."""
    parts = []
    eq = {n: _gb(m["policies"], "s3r", "rtne", metric) for n, m in models_.items()}
    eq = {n: v for n, v in eq.items() if v is not None}
    if eq:
        parts.append(
            "S3R - RTNE "
            + ", ".join(f"{v:+.3f} GB ({n})" for n, v in eq.items())
            + " (target and paper on the dense models: the same; paper on the MoE models: "
            "+0.4 and +0.7 GB)"
        )
    surplus = {n: _gb(m["policies"], "s3r-ec-2way", "s3r", metric) for n, m in models_.items()}
    surplus = {n: v for n, v in surplus.items() if v is not None}
    dense = {n: v for n, v in surplus.items() if n in DENSE}
    if dense:
        over = [n for n, v in dense.items() if v > PAPER_TWO_WAY_STEP_GB]
        parts.append(
            "two-way S3R-EC - S3R on the dense steps "
            + ", ".join(f"{v:+.3f} GB ({n})" for n, v in dense.items())
            + _within(over, f"target and paper: at most +{PAPER_TWO_WAY_STEP_GB} GB")
        )
    moe = {n: v for n, v in surplus.items() if n not in DENSE}
    if moe and dense:
        ref = max(dense.values())
        if ref > 0:
            over = [n for n, v in moe.items() if v > TARGET_MOE_RATIO * ref]
            parts.append(
                "on the MoE steps "
                + ", ".join(f"{v:+.3f} GB ({n}, {v / ref:.1f}x)" for n, v in moe.items())
                + " the largest dense surplus"
                + _within(over, f"target: within {TARGET_MOE_RATIO:.0f}x")
            )
        else:
            parts.append(
                "on the MoE steps "
                + ", ".join(f"{v:+.3f} GB ({n})" for n, v in moe.items())
                + " (the dense surplus is not positive, so the 2x target has no scale)"
            )
    label = {"total": "the total", "peak": "the peak"}[metric]
    return f"on {label}, " + "; ".join(parts) if parts else None


def _reading_table4(s: dict) -> str | None:
    parts = [x for m in STEP_METRICS if (x := _reading_step_metric(s["models"], m)) is not None]
    if not parts:
        return None
    cut = [n for n, m in s["models"].items() if not _full_depth(m)]
    deep = [n for n in cut if s.get("full_depth", {}).get(n, {}).get("policies")]
    return (
        "Reading (generated): "
        + "; ".join(parts)
        + "."
        + (
            " With full rematerialisation one layer's backward temporaries are live at a "
            "time, so a correction's surplus need not grow with the depth; "
            + (
                f"the last section compiles {', '.join(deep)} at the real depth, with fewer "
                "sequences per chip."
                if deep
                else "this page does not check that for the layer cuts, so a full model's "
                "difference may be larger."
            )
            if cut
            else ""
        )
    )


if __name__ == "__main__":
    main()
