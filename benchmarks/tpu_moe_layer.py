"""Compile one MoE expert GEMM (`qragged_dot` forward + backward) for TPU v5p and report its
memory and the largest buffers the backward writes.

The expert GEMMs of Qwen3-30B-A3B (128 experts, top-8, `d_model` 2048, `d_expert` 768):
`up` is the gate/up GEMM `(n, 2048) @ w (128, 2048, 768)`, `down` the down projection
`(n, 768) @ w (128, 768, 2048)`, with 4 x 4096 tokens per chip (n = 131072 rows per chip),
the rows of every chip routed to the top-8 of random logits and sorted by expert, bf16
activations and upstream gradient, float32 weights, compiled ahead of time for the 4 chips of
v5p 2x2x1 (no TPU is used; needs libtpu, `pip install "s3req[tpu]"`). The layouts (`--mode`):

- `shard_map` (default): each chip holds its own rows inside `jax.shard_map`
  (`ShardAxes(batch="data")`; the error-correction sums over `(example, expert)` segments are
  `psum`med over the chips);
- `jit`: the rows sharded over the chips by `jax.jit` (`NamedSharding`), one global
  `group_sizes` (XLA then computes the ragged GEMMs on all rows on every chip);
- `explicit`: as `jit`, on a mesh of `AxisType.Explicit` axes (`jax.make_mesh`'s default),
  where `qragged_dot` itself runs the GEMMs per chip inside `jax.shard_map`;
- `shard_map_tp`: the chips as `data=2 x tp=2`, each `data` shard holding the rows of two
  chips inside `shard_map`, the features split over `tp` as the FFN splits them (`up`
  column-parallel, `ShardAxes(batch="data", d_out="tp")`; `down` row-parallel, `d_in="tp"`),
  as Table IV's step lays out the MoE block.

Per policy: XLA's `temporaries` and `peak` (MiB per chip), with `--packing` the heap of
temporaries and the most of it live at one instruction (`s3req.tpu.BufferPacking`), and
with `--buffers K` the `K` largest buffers of the optimized HLO outside fusions (shape,
dtype, the JAX op that made them). `--kernels reference` traces the reference forms of the
error-correction statistics in place of the TPU ones (`s3req._backward.KERNELS`); `--seq`
sets fewer tokens per sequence for quicker compiles.

    python benchmarks/tpu_moe_layer.py                        # up and down, shard_map
    python benchmarks/tpu_moe_layer.py --gemms up --policies rtne,s3r-ec-2way --buffers 12
    python benchmarks/tpu_moe_layer.py --mode shard_map_tp --policies s3r,s3r-ec-2way --packing
    python benchmarks/tpu_moe_layer.py --smoke                # small shapes (a test)
"""

import argparse
import json
import pathlib
import sys
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import s3req._backward as backward  # noqa: E402
from policies import PRESETS  # noqa: E402
from s3req import qragged_dot, ShardAxes  # noqa: E402
from s3req.tpu import compile_for_tpu, tpu_mesh  # noqa: E402


TOPOLOGY = "v5p:2x2x1"
POLICIES = ("rtne", "s3r", "s3r-ec-dx", "s3r-ec-2way")
EXPERTS, TOP_K, D_MODEL, D_EXPERT = 128, 8, 2048, 768  # Qwen3-30B-A3B
PER_CHIP, SEQ = 4, 4096  # sequences per chip, tokens per sequence
GEMMS = {"up": (D_MODEL, D_EXPERT), "down": (D_EXPERT, D_MODEL)}
KEY_DTYPE = jr.key(0).dtype  # made here, outside the TPU mesh context


def compile_gemm(
    policy_name: str,
    mesh,
    h: int,
    d: int,
    per_chip: int,
    seq: int,
    experts: int,
    mode: str,
    packing: bool = False,
    tp_role: str = "d_out",
):
    """The `TPUProgram` of `qragged_dot` fwd + bwd on `per_chip * seq * TOP_K` rows per chip
    (`shard_map`, `jit`), or on twice that per `data` shard with the features split over
    `tp` in the role `tp_role` (`shard_map_tp`, a mesh `{"data": 2, "tp": 2}`)."""
    policy = PRESETS[policy_name]
    chips = mesh.devices.size
    total = per_chip * chips * seq * TOP_K  # rows of all chips
    B = per_chip * chips
    key = jax.ShapeDtypeStruct((), KEY_DTYPE)
    tp = "tp" if mode == "shard_map_tp" else None
    x_cols = tp if tp_role == "d_in" else None
    w_spec = P(None, tp, None) if tp_role == "d_in" else P(None, None, tp)
    g_cols = tp if tp_role == "d_out" else None
    sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(mesh, spec)
    )
    x = sds((total, h), jnp.bfloat16, P("data", x_cols))
    g = sds((total, d), jnp.bfloat16, P("data", g_cols))
    w = sds((experts, h, d), jnp.float32, w_spec if tp else P())
    ids = sds((total,), jnp.int32, P("data"))

    def fwd_bwd(x, w, g, gs, row_id, key, axes=None):
        def f(x, w):
            return qragged_dot(
                x,
                w,
                gs,
                policy=policy,
                key=key,
                row_id=row_id,
                example_id=row_id // (seq * TOP_K),
                num_examples=B,
                axes=axes,
            )

        y, vjp = jax.vjp(f, x, w)
        return y, vjp(g)

    run = lambda fn, gs: compile_for_tpu(
        fn, x, w, g, gs, ids, key, mesh=mesh, upstream=[g], buffers=packing
    )
    if mode in ("jit", "explicit"):
        return run(fwd_bwd, jax.ShapeDtypeStruct((experts,), jnp.int32))
    shards = mesh.shape["data"]
    gs = sds((experts * shards,), jnp.int32, P("data"))
    axes = ShardAxes(batch="data", **({tp_role: tp} if tp else {}))
    rows = P("data")
    xs, gsp, ws = P("data", x_cols), P("data", g_cols), w_spec if tp else P()
    inner = jax.shard_map(
        lambda x, w, g, gs, r, k: fwd_bwd(x, w, g, gs, r, k, axes),
        mesh=mesh,
        in_specs=(xs, ws, gsp, rows, rows, P()),
        out_specs=(gsp, (xs, ws)),
    )
    return run(inner, gs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--gemms", default="up,down")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument(
        "--mode", choices=("shard_map", "jit", "explicit", "shard_map_tp"), default="shard_map"
    )
    ap.add_argument(
        "--kernels",
        choices=("auto", "reference", "tpu"),
        default="auto",
        help="the statistics forms traced (s3req._backward.KERNELS; auto: the TPU ones)",
    )
    ap.add_argument("--buffers", type=int, default=0, help="list the K largest buffers")
    ap.add_argument("--smoke", action="store_true", help="small shapes (a test of the script)")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (fewer rows)")
    ap.add_argument(
        "--packing", action="store_true", help="also read the heap and its busiest instruction"
    )
    ap.add_argument("--hlo", default="", help="write each optimized HLO under this folder")
    ap.add_argument("--json", default="", help="write the results to this file")
    args = ap.parse_args(argv)
    backward.KERNELS = args.kernels
    axes = {"data": 2, "tp": 2} if args.mode == "shard_map_tp" else None
    mesh = tpu_mesh(axes, topology=TOPOLOGY)
    explicit = args.mode == "explicit"
    if explicit:
        types = (AxisType.Explicit,) * len(mesh.axis_names)
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=types)
    per_chip, seq, experts = (1, 256, 16) if args.smoke else (PER_CHIP, args.seq, EXPERTS)
    results = {}
    for gemm in args.gemms.split(","):
        h, d = (256, 128) if args.smoke else GEMMS[gemm]
        for p in args.policies.split(","):
            role = "d_out" if gemm == "up" else "d_in"  # column / row parallel, as the FFN
            # `explicit`: the ambient mesh, whose axis types `qragged_dot` reads
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if explicit else nullcontext():
                prog = compile_gemm(
                    p, mesh, h, d, per_chip, seq, experts, args.mode, args.packing, role
                )
            m = prog.memory
            row = {
                "temporaries_mib": m.temporaries / 2**20,
                "peak_mib": m.peak / 2**20,
                "fusions": prog.fusions,
                "integer_gemms": len(prog.integer_gemms()),
                "compile_s": prog.compile_seconds,
            }
            if prog.packing is not None:
                row["heap_mib"] = prog.packing.heap / 2**20
                row["live_mib"] = prog.packing.live / 2**20
                row["live_at"] = prog.packing.live_at
            results[f"{gemm}/{p}"] = row
            print(
                f"{gemm:5s} {p:12s} temporaries {row['temporaries_mib']:9.1f} MiB  "
                f"peak {row['peak_mib']:9.1f} MiB  fusions {prog.fusions:4d}  "
                f"int GEMMs {row['integer_gemms']}  ({prog.compile_seconds:.0f} s)",
                flush=True,
            )
            if prog.packing is not None:
                print(
                    f"      heap {row['heap_mib']:9.1f} MiB  live {row['live_mib']:9.1f} MiB "
                    f"at {row['live_at']}",
                    flush=True,
                )
            if args.hlo:
                folder = pathlib.Path(args.hlo)
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{gemm}_{p}_{args.mode}.hlo").write_text(prog.hlo)
            for b in prog.buffers()[: args.buffers]:
                kind = f"{b.dtype}[{','.join(map(str, b.shape))}]"
                print(f"    {b.nbytes / 2**20:8.1f} MiB {kind:22s} {b.op:14s} {b.op_name[-110:]}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
