"""How the TPU compiler packs the temporaries of the FFN block: block size, live bytes, holes.

Compiles the SwiGLU FFN block of `benchmarks/tpu_compile.py` (`compile_ffn`: Table III's
shapes, 16 x 4096 tokens batch-split over v5p 2x2x1) with `compile_for_tpu(...,
buffers=True)` and reads the compiler's buffer assignment (`s3req.tpu.BufferPacking`): the
size of the block of temporaries (`heap`), the most bytes of it occupied at one instruction
(`live`) and the hole between them, beside XLA's `temporaries` and `peak`, and which buffers sit
above the live bytes with the buffers that kept them lower down (`BufferPacking.top`, printed
and kept in the JSON).

`--steps` compiles Table IV's training step (`compile_step`, fsdp=2 x tp=2, a cut of
`--layers` layers) of the given model presets the same way and records which buffers are live
at its busiest instruction (`BufferPacking.busiest`, grouped by shape and the JAX operation
that made them): the page lists, per policy, the groups that make its live bytes (and so its
peak) differ from S3R's. Results merge into `tpu_packing.json` under `--out` after every
compile; the page `tpu_packing.md` is rewritten.

    python benchmarks/tpu_packing.py --shapes W1,W4 --policies rtne,s3r,s3r-ec-dx,s3r-ec-2way
    python benchmarks/tpu_packing.py --shapes= --steps deepseek-v2-lite --policies s3r,s3r-ec-2way
    python benchmarks/tpu_packing.py --pages                     # the page from the JSON
"""

import argparse
import dataclasses
import pathlib
import sys


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tpu_compile as tc  # noqa: E402
from tpu_compile import made_by, STEP_PREFIX  # noqa: E402

import models  # noqa: E402
from s3req.tpu import tpu_mesh  # noqa: E402


POLICIES = ("rtne", "s3r", "s3r-ec-dx", "s3r-ec-2way")
MiB = 2**20


def _buffer(b) -> str:
    return (
        f"{b.name} {b.shape.split('{')[0]} at {_mib(b.offset)}+{b.size / MiB:.3f} MiB, "
        f"steps {b.first}-{b.last} ({b.first_instruction}..{b.last_instruction}) "
        f"{b.op_name or '(compiler copy)'}"
    )


def _explain(pk) -> list[str]:
    """What sits above the live bytes and what kept it lower down (`BufferPacking.top`)."""
    lines = []
    for t in pk.top:
        lines.append(f"  above live: {_buffer(t.buffer)}")
        if t.gap is not None:
            lines.append(f"    would fit at {_mib(t.gap[0])}-{_mib(t.gap[1])} MiB but for:")
        lines += [f"      {_buffer(b)}" for b in t.blockers]
    return lines


def _row(prog) -> dict:
    pk = prog.packing
    return {
        "temporaries": prog.memory.temporaries,
        "peak": prog.memory.peak,
        "heap": pk.heap,
        "live": pk.live,
        "hole": pk.hole,
        "live_at": pk.live_at,
        "in_outputs": pk.in_outputs,
        "top": [dataclasses.asdict(t) for t in pk.top],
        "commit": tc._commit(),
        "compile_seconds": prog.compile_seconds,
    }


def _mib(b: float) -> str:
    return f"{b / MiB:.1f}"


def _signed(b: float) -> str:
    return f"{b / MiB:+.1f}"


def _pct(a: dict, b: dict, key: str) -> str:
    return f"{100 * (a[key] / b[key] - 1):+.1f}%"


# The targets of the TPU issue on one FFN block, as fractions over S3R (S3R = RTNE: 1%).
TARGETS = {"rtne": 0.01, "s3r-ec-dx": 0.05, "s3r-ec-2way": 0.14}


def _verdicts(pairs: list, key: str) -> str:
    """Which (shape, policy) pairs exceed their target on `key` (S3R = RTNE both ways)."""
    over = [
        f"{p} at {w}"
        for w, p, a, b in pairs
        if (abs if p == "rtne" else float)(a[key] / b[key] - 1) > TARGETS[p]
    ]
    return "met by every pair" if not over else "missed by " + ", ".join(over)


def _table(rows: dict) -> list[str]:
    out = [
        "| shape | policy | temporaries | heap | live | hole | temporaries - heap | peak | "
        "busiest instruction | commit |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for w in models.PAPER_FFN_SHAPES:
        for p in POLICIES:
            r = rows.get(w, {}).get(p)
            if r is None:
                continue
            out.append(
                f"| {w} | {p} | {_mib(r['temporaries'])} | {_mib(r['heap'])} | "
                f"{_mib(r['live'])} | {_mib(r['hole'])} | {_mib(r['temporaries'] - r['heap'])} "
                f"| {_mib(r['peak'])} | `{r['live_at']}` | `{r['commit']}` |"
            )
    return out


def _surplus_table(rows: dict) -> list[str]:
    out = [
        "| shape | policy | over | temporaries | heap | live | hole | peak | live over S3R | "
        "temporaries over S3R |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for w in models.PAPER_FFN_SHAPES:
        R = rows.get(w, {})
        for p, base in (("rtne", "s3r"), ("s3r-ec-dx", "s3r"), ("s3r-ec-2way", "s3r")):
            if p not in R or base not in R:
                continue
            a, b = R[p], R[base]
            cells = [_signed(a[k] - b[k]) for k in ("temporaries", "heap", "live", "hole", "peak")]
            cells += [_pct(a, b, "live"), _pct(a, b, "temporaries")]
            out.append(f"| {w} | {p} | {base} | " + " | ".join(cells) + " |")
    return out


def _reading(rows: dict) -> str:
    flat = [(w, p, r) for w, R in rows.items() for p, r in R.items()]
    gap = max(abs(r["temporaries"] - r["heap"] - r["hole"]) for _, _, r in flat)
    pairs = [
        (w, p, R[p], R["s3r"])
        for w, R in rows.items()
        for p in ("rtne", "s3r-ec-dx", "s3r-ec-2way")
        if p in R and "s3r" in R
    ]
    same = {w: {r["peak"] - r["live"] for r in R.values()} for w, R in rows.items()}
    spread = max(max(v) - min(v) for v in same.values())
    parts = [
        f"on all {len(flat)} programs, temporaries = heap + hole = live + 2 x hole to within "
        f"{gap / MiB:.2f} MiB: XLA's `temporaries` counts the hole of the packing twice (once "
        "inside the block, once on top of it); peak - live is the same for every policy of "
        f"a shape to within {spread / MiB:.2f} MiB (the arguments and outputs), so the peak "
        "and the live bytes rank policies alike"
    ]
    if pairs:
        live = [a["live"] - b["live"] for _, _, a, b in pairs]
        temp = [a["temporaries"] - b["temporaries"] for _, _, a, b in pairs]
        w, p, a, b = max(pairs, key=lambda t: t[2]["temporaries"] - t[3]["temporaries"])
        parts.append(
            f"against S3R, the other policies' live bytes differ by {min(live) / MiB:+.1f} to "
            f"{max(live) / MiB:+.1f} MiB and their temporaries by {min(temp) / MiB:+.1f} to "
            f"{max(temp) / MiB:+.1f} MiB; the largest, {p} at {w}, has "
            f"{_signed(a['temporaries'] - b['temporaries'])} MiB of temporaries over S3R, of "
            f"which {_signed(a['live'] - b['live'])} MiB are live bytes and "
            f"{_signed(a['hole'] - b['hole'])} MiB hole (counted twice)"
        )
        parts.append(
            "the targets (S3R = RTNE within 1%, dX-only <= +5%, two-way <= +14% over S3R) "
            f"on the live bytes: {_verdicts(pairs, 'live')}; on temporaries: "
            f"{_verdicts(pairs, 'temporaries')}"
        )
    return "Reading (generated): " + "; ".join(parts) + "."


SHOWN_BLOCKERS = 3
"""Blockers listed per buffer on the page (the largest; all are in the JSON)."""
SHOWN_HOLE = 0.05
"""The page explains the programs whose hole is at least this share of their heap."""


def _cell(b: dict) -> str:
    shape = b["shape"].split("{")[0]
    return (
        f"`{shape}` {b['size'] / MiB:.3f} MiB, steps {b['first']}-{b['last']}, "
        f"{b['op_name'] or '(compiler copy)'}"
    )


def _top_table(rows: dict) -> list[str]:
    """What sits above the live bytes and what kept it lower down, per program whose hole is
    at least `SHOWN_HOLE` of its heap (`BufferPacking.top`, kept in the JSON)."""
    out = [
        "| shape | policy | above the live bytes | would fit at (MiB) | kept out by "
        f"(blockers; the {SHOWN_BLOCKERS} largest) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for w, R in rows.items():
        for p, r in R.items():
            if r["hole"] < SHOWN_HOLE * r["heap"]:
                continue
            for t in r.get("top", []):
                gap = "—" if t["gap"] is None else f"{_mib(t['gap'][0])}-{_mib(t['gap'][1])}"
                big = sorted(t["blockers"], key=lambda b: -b["size"])[:SHOWN_BLOCKERS]
                kept = f"{len(t['blockers'])}: " + "; ".join(_cell(b) for b in big)
                out.append(f"| {w} | {p} | {_cell(t['buffer'])} | {gap} | {kept} |")
    return out if len(out) > 2 else []


GROUP_FLOOR = 2**18
"""Groups of buffers live at a step's busiest instruction with fewer bytes than this are
kept in the JSON as one sum (`rest`)."""
SHOWN_GROUPS = 10
"""Groups listed per policy on the page (the largest changes over S3R)."""


def busiest_groups(busiest) -> dict:
    """The buffers live at the busiest instruction (`BufferPacking.busiest`) grouped by
    shape (without layout) and `made_by`: every group of at least `GROUP_FLOOR` bytes with
    its count, bytes and the steps its buffers span, largest first, and the count and bytes
    of the rest."""
    groups: dict[tuple[str, str], dict] = {}
    for b in busiest:
        key = (b.shape.split("{")[0], made_by(b))
        g = groups.setdefault(
            key,
            {
                "shape": key[0],
                "made_by": key[1],
                "count": 0,
                "bytes": 0,
                "first": b.first,
                "last": b.last,
            },
        )
        g["count"] += 1
        g["bytes"] += b.size
        g["first"], g["last"] = min(g["first"], b.first), max(g["last"], b.last)
    kept = sorted(
        (g for g in groups.values() if g["bytes"] >= GROUP_FLOOR),
        key=lambda g: (-g["bytes"], g["shape"], g["made_by"]),
    )
    rest = [g for g in groups.values() if g["bytes"] < GROUP_FLOOR]
    return {
        "groups": kept,
        "rest": {"count": sum(g["count"] for g in rest), "bytes": sum(g["bytes"] for g in rest)},
    }


def group_changes(a: dict, b: dict) -> tuple[list[dict], int]:
    """The groups of `busiest_groups` whose bytes differ between programs `a` and `b` (a
    group absent from one counts 0 there), by the size of the change, largest first, and the
    change of the rest; together they add up to the change of the buffers' total size."""
    key = lambda g: (g["shape"], g["made_by"])
    ga, gb = {key(g): g for g in a["groups"]}, {key(g): g for g in b["groups"]}
    out = []
    for k in sorted(set(ga) | set(gb)):
        x, y = ga.get(k, {"bytes": 0, "count": 0}), gb.get(k, {"bytes": 0, "count": 0})
        spans = y if k in gb else x  # the steps of the second program's buffers if it has any
        if y["bytes"] != x["bytes"]:
            out.append(
                {
                    "shape": k[0],
                    "made_by": k[1],
                    "change": y["bytes"] - x["bytes"],
                    "counts": (x["count"], y["count"]),
                    "steps": spans["first"],
                    "to": spans["last"],
                }
            )
    out.sort(key=lambda c: (-abs(c["change"]), c["shape"], c["made_by"]))
    return out, b["rest"]["bytes"] - a["rest"]["bytes"]


def _step_label(preset: str) -> str:
    return {v: k for k, v in tc.TABLE4_MODELS.items()}.get(preset, preset)


def _steps_table(steps: dict) -> list[str]:
    out = [
        "| model | layers | policy | temporaries | heap | live | hole | in outputs | peak | "
        "peak - live | busiest instruction | commit |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for m, R in steps.items():
        for p, r in R["policies"].items():
            held = _mib(r["in_outputs"]) if "in_outputs" in r else "—"
            out.append(
                f"| {m} | {R['n_layers']} | {p} | {_mib(r['temporaries'])} | {_mib(r['heap'])} "
                f"| {_mib(r['live'])} | {_mib(r['hole'])} | {held} | {_mib(r['peak'])} | "
                f"{_mib(r['peak'] - r['live'])} | `{r['live_at']}` | `{r['commit']}` |"
            )
    return out


def _inside(c: dict) -> bool:
    """Whether a group was made inside the MoE block's `shard_map` (its routing and expert
    GEMMs)."""
    return "shard_map" in c["made_by"]


def _change_row(c: dict) -> str:
    """A row of a table of `group_changes`."""
    return (
        f"| {_signed(c['change'])} | {c['counts'][0]}, {c['counts'][1]} | `{c['shape']}` "
        f"| {c['made_by']} | {c['steps']}-{c['to']} |"
    )


def _changes_section(m: str, p: str, a: dict, b: dict) -> list[str]:
    changes, rest = group_changes(a["busiest"], b["busiest"])
    shown = changes[:SHOWN_GROUPS]
    others = sum(c["change"] for c in changes[SHOWN_GROUPS:])
    total = sum(c["change"] for c in changes) + rest
    new = sum(c["change"] for c in changes if 0 in c["counts"])
    inside = sum(c["change"] for c in changes if _inside(c))
    head = (
        f"**{m}, {p} over S3R**: live {_signed(b['live'] - a['live'])} MiB, peak "
        f"{_signed(b['peak'] - a['peak'])} MiB; "
    )
    if "in_outputs" in a and "in_outputs" in b:
        held = b["in_outputs"] - a["in_outputs"]
        head += (
            f"in the outputs' buffers {_signed(held)} MiB, so the temporaries live at the "
            f"busiest instruction (block and outputs' buffers) "
            f"{_signed(b['live'] + b['in_outputs'] - a['live'] - a['in_outputs'])} MiB; "
        )
    if not changes and not rest:
        return [
            head + "the same buffers (shapes and operations) are live at the busiest instruction."
        ]
    lines = [
        head + f"the block's buffers live there {_signed(total)} MiB in size, "
        f"{_signed(new)} MiB of it in groups that only one of the two holds there, "
        f"{_signed(inside)} MiB made inside the MoE block's `shard_map` (routing and expert "
        "GEMMs), "
        "the rest by the layer's other parts.",
        "",
        "| change (MiB) | buffers (S3R, " + p + ") | shape | made by | steps |",
        "| ---: | ---: | --- | --- | --- |",
    ]
    lines += [_change_row(c) for c in shown]
    if len(changes) > SHOWN_GROUPS:
        lines.append(f"| {_signed(others)} | | {len(changes) - SHOWN_GROUPS} other groups | | |")
    lines.append(f"| {_signed(rest)} | | groups under {GROUP_FLOOR // 1024} KiB | | |")
    if "busiest_in_outputs" in a and "busiest_in_outputs" in b:
        moved, moved_rest = group_changes(a["busiest_in_outputs"], b["busiest_in_outputs"])
        if moved or moved_rest:
            lines += [
                "",
                "In the outputs' buffers there:",
                "",
                "| change (MiB) | buffers (S3R, " + p + ") | shape | made by | steps |",
                "| ---: | ---: | --- | --- | --- |",
                *(_change_row(c) for c in moved[:SHOWN_GROUPS]),
                f"| {_signed(moved_rest + sum(c['change'] for c in moved[SHOWN_GROUPS:]))} "
                "| | the rest | | |",
            ]
    return lines


def _steps_section(steps: dict) -> list[str]:
    extra = [{r["peak"] - r["live"] for r in R["policies"].values()} for R in steps.values()]
    spread = max(max(v) - min(v) for v in extra)
    lines = [
        "## Training steps: which buffers make a policy's live bytes",
        "",
        "Table IV's training step (`compile_step` of `benchmarks/tpu_compile.py`: loss, "
        "backward, clipping, AdamW, fsdp=2 x tp=2 over v5p:2x2x1, 16 x 4096 tokens, full "
        "rematerialisation; the layers column is the cut compiled) with its buffer "
        "assignment read. MiB per chip. peak - live is the arguments and outputs, the same "
        f"for every policy of a model to within {spread / MiB:.2f} MiB here, so a policy's "
        "surplus of peak over S3R is its surplus "
        "of bytes live at the busiest instruction (`BufferPacking.busiest`), grouped below "
        "by shape and the JAX operation that made them (op names without `"
        + STEP_PREFIX
        + "`; steps are positions in XLA's schedule, which differs between "
        "policies). in outputs: the temporaries live there that the compiler placed in "
        "buffers of the program's outputs not yet written (`BufferPacking.in_outputs`; — "
        "for rows compiled before it was recorded): they take no bytes of the block, so a "
        "buffer that one policy's program holds there and another's in the block raises "
        "the other's live bytes and peak without more temporaries being live.",
        "",
        *_steps_table(steps),
        "",
    ]
    for m, R in steps.items():
        P_ = R["policies"]
        for p in P_:
            if p != "s3r" and "s3r" in P_:
                lines += [*_changes_section(m, p, P_["s3r"], P_[p]), ""]
    return lines


def markdown(data: dict) -> str:
    rows = data.get("ffn", {})
    steps = data.get("steps", {})
    meta = data.get("meta", {})
    commits = sorted(
        {r["commit"] for R in rows.values() for r in R.values()}
        | {r["commit"] for R in steps.values() for r in R["policies"].values()}
    )
    lines = [
        "# TPU v5p compile: how the temporaries are packed, and which buffers are live",
        "",
        "Generated by `python benchmarks/tpu_packing.py` with `s3req.tpu.compile_for_tpu(..., "
        f"buffers=True)` (libtpu's XLA TPU compiler, jax {meta.get('jax', '?')}) on a CPU "
        f"machine, engine at {', '.join(f'`{c}`' for c in commits)}: the SwiGLU FFN block of "
        "[the TPU compile page](tpu_compile.md) (forward + backward, 16 x 4096 tokens "
        f"batch-split over {meta.get('topology', 'v5p:2x2x1')})"
        + (" and [Table IV's training steps](tpu_table4.md) (last section)" if steps else "")
        + ", compiled ahead of time; nothing ran on a TPU. MiB per chip.",
        "",
        "XLA places every temporary buffer at an offset of one block of HBM so that buffers "
        "live at the same time do not overlap (its buffer assignment, dumped with "
        "`xla_dump_to`). **heap**: the size of that block; **live**: the most bytes of it "
        "occupied at one instruction (the buffers live there, shared bytes counted once; "
        "the instruction is named); **hole** = heap - live, bytes the packing could not "
        "reuse. **temporaries** (`temp_size_in_bytes`) and **peak** "
        "(`peak_memory_in_bytes`, arguments and outputs included) are XLA's memory "
        "analysis, as on the TPU compile page.",
        "",
    ]
    if rows:
        lines += [
            "## The FFN block",
            "",
            *_table(rows),
            "",
            "Differences to S3R of the same shape (MiB; the targets of the TPU issue compare "
            "temporaries):",
            "",
            *_surplus_table(rows),
            "",
            _reading(rows),
            "",
            "So where a policy's temporaries exceed S3R's with the same live bytes and peak, "
            "the excess is holes of the packing, twice: what the program needs at its busiest "
            "instruction is `live` (and the peak). Any buffer that shifts the packing can open "
            "such a hole (a small buffer that lives long, placed inside the range a large "
            "dead one freed, keeps a later large one out of it); RTNE, whose program is S3R's "
            "without the thresholds, gets one too.",
            "",
        ]
    top = _top_table(rows)
    if top:
        lines += [
            "### What sits on top of the block",
            "",
            f"For the programs whose hole is {SHOWN_HOLE:.0%} of their heap or more (and whose "
            "buffer assignment was read, "
            "`BufferPacking.top`): the buffers placed above the live bytes, the lowest range "
            "of the block they would fit in, and the buffers that overlap that range while "
            "they live (the steps are the positions in XLA's schedule).",
            "",
            *top,
            "",
        ]
    if steps:
        lines += _steps_section(steps)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--shapes", default="W1,W4")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tokens", default="16,4096", help="batch,seq (default: Table III's)")
    ap.add_argument("--out", default=str(tc.ROOT / "docs" / "results"))
    ap.add_argument(
        "--steps", default="", help="model presets whose training step to compile (Table IV's)"
    )
    ap.add_argument("--layers", type=int, default=1, help="layers of the training steps' cut")
    ap.add_argument("--pages", action="store_true", help="only rewrite the page from the JSON")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tpu_packing.json"
    data = tc._load(path)
    if not args.pages:
        mesh = tpu_mesh(topology=tc.TOPOLOGY)
        batch, seq = map(int, args.tokens.split(","))
        for w in filter(None, args.shapes.split(",")):
            h, d = models.PAPER_FFN_SHAPES[w]
            for p in args.policies.split(","):
                prog = tc.compile_ffn(p, mesh, h, d, batch, seq, buffers=True)
                data.setdefault("ffn", {}).setdefault(w, {})[p] = _row(prog)
                data["meta"] = tc._meta(prog.device_kind)
                tc._save(out, "tpu_packing", data, markdown)
                r = data["ffn"][w][p]
                print(
                    f"{w} {p}: temporaries {_mib(r['temporaries'])} heap {_mib(r['heap'])} "
                    f"live {_mib(r['live'])} hole {_mib(r['hole'])} MiB",
                    flush=True,
                )
                print("\n".join(_explain(prog.packing)), flush=True)
        mesh2 = tpu_mesh({"fsdp": 2, "tp": 2}, topology=tc.TOPOLOGY)
        for preset in filter(None, args.steps.split(",")):
            label = _step_label(preset)
            for p in args.policies.split(","):
                prog, cfg, _ = tc.compile_step(
                    p, mesh2, preset, args.layers, 4096, 4, buffers=True
                )
                m = data.setdefault("steps", {}).setdefault(label, {})
                if m.get("n_layers") != cfg.n_layers:
                    m.clear()  # rows of another cut are not comparable with this one
                m.update({"preset": preset, "n_layers": cfg.n_layers})
                assert prog.packing is not None
                # `top` is left out: the page shows the busiest buffers of a step, not its hole
                r: dict = _row(prog) | {
                    "busiest": busiest_groups(prog.packing.busiest),
                    "busiest_in_outputs": busiest_groups(prog.packing.busiest_in_outputs),
                }
                del r["top"]
                m.setdefault("policies", {})[p] = r
                data["meta"] = tc._meta(prog.device_kind)
                tc._save(out, "tpu_packing", data, markdown)
                print(
                    f"{label} {p}: temporaries {_mib(r['temporaries'])} live {_mib(r['live'])} "
                    f"hole {_mib(r['hole'])} peak {_mib(r['peak'])} MiB",
                    flush=True,
                )
                print("\n".join(_explain(prog.packing)), flush=True)
    if data:
        tc._save(out, "tpu_packing", data, markdown)
    return data


if __name__ == "__main__":
    main()
