"""Which GEMMs the compiled qdot forward + backward runs, and in which dtypes.

`qdot` asks for int8 x int8 -> int32 `dot_general`s; what runs is whatever XLA's backend makes
of them after all its passes: on CPU a YNNPACK fusion around an `s8 x s8 -> s32` dot, on a GPU
a cuBLAS call or a Triton fusion. A backend that cannot run an int8 GEMM (an unsupported
layout or shape) may convert the operands to float first, and the INT8 speed is lost without
an error. This script compiles one qdot forward + backward per policy, parses the optimized
HLO (`jax.jit(...).lower(...).compile().as_text()`) and lists every GEMM with its operand and
result dtypes and its size in multiply-adds. The three layer GEMMs (forward, dX, dW) must
read two int8 operands into int32; the error correction adds only thin int8 GEMMs and
float32 mat-vecs.

    python benchmarks/hlo_gemms.py                                  # the qdot page's shapes
    python benchmarks/hlo_gemms.py --shapes 4x2048x8192x28672       # W9 (on a GPU)
    python benchmarks/hlo_gemms.py --out /tmp/h                     # elsewhere

Writes `hlo_gemms_<backend>.{json,md}` into `--out` (default `docs/results/`) and exits with
status 1 if a layer GEMM of an INT8 policy is not int8 x int8 -> int32.
"""

import argparse
import json
import math
import pathlib
import platform
import re
import sys

import jax
import jax.numpy as jnp
import jax.random as jr
from bench_qdot import _fwd_bwd, POLICIES


ROOT = pathlib.Path(__file__).resolve().parent.parent
CHECKED = ("rtne", "sr", "s3r", "s3r-ec-dx", "s3r-ec-2way", "s3r-bcast")
"""The policies whose three layer GEMMs must be int8 (the float `bf16` layer is listed only)."""

_TYPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"(?:([a-z]+[0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?\s+)?(%[\w.\-]+)")


def _split_type(text: str) -> tuple[str, str]:
    """`(type, rest)` of an instruction's right-hand side; the type may be a tuple."""
    if text.startswith("("):
        depth = 0
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            if depth == 0:
                return text[: i + 1], text[i + 1 :].lstrip()
    head, _, rest = text.partition(" ")
    return head, rest


def _first_array(type_text: str) -> tuple[str, tuple[int, ...]]:
    m = _TYPE.search(type_text)
    if m is None:
        return "?", ()
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def _call(rest: str) -> tuple[str, str, str]:
    """`(op, operands, attributes)` of `op(operands), attributes`."""
    op, _, tail = rest.partition("(")
    depth = 1
    for i, c in enumerate(tail):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return op.strip(), tail[:i], tail[i + 1 :]
    return op.strip(), tail, ""


def _contracting(attrs: str) -> list[int]:
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
    if m is None:  # a cuBLAS custom call keeps its dimension numbers in backend_config
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs)
    if m is None:
        return []
    return [int(d) for d in re.findall(r"\d+", m.group(1))]


def parse_gemms(hlo: str) -> list[dict]:
    """Every GEMM of an HLO module's text: `dot`s (also inside fusions), `convolution`s and
    custom calls to a GEMM library (cuBLAS, cuBLASLt). Each as a dict with `op`, `result`
    (dtype of the result, the first element of a tuple result), `operands` (their dtypes),
    `shape` (of the result) and `macs` (multiply-adds, `None` where the contraction is not
    known)."""
    gemms = []
    types: dict[str, tuple[str, tuple[int, ...]]] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$", line)
        if m is None:
            if line.rstrip().endswith("{"):  # a new computation: names are local to it
                types = {}
            continue
        name, rhs = m.groups()
        type_text, rest = _split_type(rhs)
        types[name] = _first_array(type_text)
        op, operands, attrs = _call(rest)
        target = re.search(r'custom_call_target="([^"]*)"', attrs)
        library = target.group(1) if op == "custom-call" and target else ""
        if op not in ("dot", "convolution") and not re.search("gemm|matmul", library):
            continue
        ins = []
        for dtype, dims, ref in _OPERAND.findall(operands):
            if dtype:
                ins.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
            else:
                ins.append(types.get(ref, ("?", ())))
        dtype, shape = types[name]
        contract = _contracting(attrs)
        macs = None
        if op != "convolution" and contract and ins and ins[0][1]:
            macs = math.prod(shape) * math.prod(ins[0][1][d] for d in contract)
        gemms.append(
            {
                "op": f"custom-call {library}" if library else op,
                "result": dtype,
                "operands": [t for t, _ in ins[:2]],
                "shape": list(shape),
                "macs": macs,
            }
        )
    return gemms


def program_gemms(policy, B: int, S: int, H: int, D: int) -> list[dict]:
    """The GEMMs of one compiled qdot forward + backward (bf16 activations and gradient,
    float32 weights), traced from shapes only: nothing is allocated."""
    args = (
        jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((H, D), jnp.float32),
        jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jr.key(0).dtype),
    )
    hlo = jax.jit(lambda x, w, g, k: _fwd_bwd(policy, x, w, g, k)).lower(*args).compile()
    return parse_gemms(hlo.as_text())


def layer_gemms(gemms: list[dict], B: int, S: int, H: int, D: int) -> list[dict]:
    """The GEMMs at least as large as the layer's `B S H D` multiply-adds."""
    return [g for g in gemms if g["macs"] is not None and g["macs"] >= B * S * H * D]


def _signature(g: dict) -> str:
    return " x ".join(g["operands"]) + f" -> {g['result']}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4x256x1024x4096,4x256x512x2048,8x512x1024x1024")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = ap.parse_args(argv)
    backend = jax.default_backend()
    rows, ok = [], True
    for spec in args.shapes.split(","):
        B, S, H, D = (int(v) for v in spec.split("x"))
        for name, policy in POLICIES.items():
            if name not in CHECKED + ("bf16",):
                continue
            gemms = program_gemms(policy, B, S, H, D)
            big = layer_gemms(gemms, B, S, H, D)
            small = [g for g in gemms if g not in big]
            int8 = len(big) == 3 and all(_signature(g) == "s8 x s8 -> s32" for g in big)
            if name in CHECKED and not int8:
                ok = False
            rows.append(
                {
                    "shape": [B, S, H, D],
                    "policy": name,
                    "layer_gemms": [_signature(g) for g in big],
                    "ops": sorted({g["op"] for g in big}),
                    "small_gemms": [_signature(g) for g in small],
                    "small_macs": sum(g["macs"] or 0 for g in small) / (B * S * H * D),
                    "int8": int8,
                }
            )
            print(f"[hlo_gemms] {spec} {name}: {rows[-1]['layer_gemms']}", file=sys.stderr)
    meta = {
        "backend": backend,
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "jax": jax.__version__,
        "all_int8": ok,
    }
    summary = {"meta": meta, "rows": rows}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hlo_gemms_{backend}.json").write_text(json.dumps(summary, indent=1))
    (out / f"hlo_gemms_{backend}.md").write_text(markdown(summary))
    print(markdown(summary))
    if not ok:
        sys.exit(1)
    return summary


def markdown(s: dict) -> str:
    meta = s["meta"]
    lines = [
        f"# Compiled GEMMs of one qdot forward + backward ({meta['backend']})",
        "",
        f"Generated by `python benchmarks/hlo_gemms.py` on {meta['device']} ({meta['platform']}, "
        f"jax {meta['jax']}) from the optimized HLO of each compiled program (bf16 activations "
        "and gradient, float32 weights). Layer GEMMs: those with at least B S H D "
        "multiply-adds (forward, dX, dW), as operand and result dtypes. Small GEMMs: the "
        "error correction's thin int8 GEMMs and float32 mat-vecs, with their multiply-adds "
        "relative to one layer GEMM. "
        + (
            "Every INT8 policy's three layer GEMMs read int8 into int32."
            if meta["all_int8"]
            else "**Some INT8 policy's layer GEMMs are not int8 x int8 -> int32 (see the table).**"
        ),
        "",
        "| shape (B, S, H, D) | policy | layer GEMMs | HLO op | small GEMMs "
        "| small / layer GEMM |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    for r in s["rows"]:
        counts: dict[str, int] = {}
        for sig in r["small_gemms"]:
            counts[sig] = counts.get(sig, 0) + 1
        small = ", ".join(f"{n} x ({sig})" for sig, n in counts.items()) or "none"
        lines.append(
            f"| {tuple(r['shape'])} | {r['policy']} | {'; '.join(r['layer_gemms'])} | "
            f"{', '.join(r['ops'])} | {small} | {r['small_macs']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
