"""`s3req.tpu.BufferPacking`: the reader of XLA's buffer-assignment dumps (no libtpu needed)
and `compile_for_tpu(..., buffers=True)` on TPU v5p (skipped without libtpu)."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from policies import PRESETS
from s3req import qdot
from s3req.tpu import BufferPacking, compile_for_tpu, HeapBuffer, HeapTop, tpu_mesh
from s3req.tpu._buffers import buffer_packing, read_dump


MiB = 2**20

# A program of four steps. HBM block of 3 MiB: `a` (1 MiB at 0) lives 0-1, `b` (2 MiB at
# 1 MiB) 1-3, `c` reuses `a`'s bytes at 2-3, `d` (1 MiB at 0, a tuple element) shares them
# at step 3 (counted once); the VMEM allocation (color 1) and zero-size values are not HBM.
_ASSIGNMENT = f"""BufferAssignment:
allocation 0: size 512, parameter 0, shape |f32[128]| at ShapeIndex {{}}:
 value: <0 p @0> (size=512,offset=0): f32[128]
allocation 1: size {3 * MiB}, preallocated-temp:
 value: <1 a @0> (size={MiB},offset=0): f32[262144]
 value: <2 b{{}} @0> (size={2 * MiB},offset={MiB}): f32[524288]
 value: <3 c @0> (size={MiB},offset=0): f32[262144]
 value: <4 d{{1}} @0> (size={MiB},offset=0): f32[262144]
 value: <5 t (phi) @0> (size=0,offset=0): token[]
allocation 2: size {8 * MiB}, color 1, preallocated-temp:
 value: <6 v @0> (size={8 * MiB},offset=0): f32[2097152]
"""
_LIVE = """HloLiveRange (max 3):
  InstructionSequence:
    0:a
    1:b
    2:c
    3:d
  BufferLiveRange:
    a{}:0-1
    b{}:1-3
    c{}:2-3
    d{1}:3-3
    v{}:0-3
  Live ranges at 1 (peak):
    a{}: 1048576 bytes
"""


def test_buffer_packing_reads_heap_live_and_hole():
    pk = buffer_packing(_ASSIGNMENT, _LIVE)
    assert isinstance(pk, BufferPacking)
    assert pk.heap == 3 * MiB
    # Steps 1 (a + b), 2 and 3 (b + c; d shares c's bytes) all occupy the whole block.
    assert (pk.live, pk.live_at) == (3 * MiB, "b")
    assert pk.hole == 0


def test_buffer_packing_sees_a_hole():
    """`b` moved to 2 MiB: bytes 1-2 MiB are never occupied, the block is 4 MiB."""
    text = _ASSIGNMENT.replace(f"size {3 * MiB}, pre", f"size {4 * MiB}, pre")
    text = text.replace(f"offset={MiB}): f32[524288]", f"offset={2 * MiB}): f32[524288]")
    pk = buffer_packing(text, _LIVE)
    assert (pk.heap, pk.live, pk.hole) == (4 * MiB, 3 * MiB, MiB)


def test_buffer_packing_counts_the_temporaries_in_the_outputs_buffers():
    """An output's buffer (allocation 3) holds the temporary `e` until the output `o` is
    written: `e` is live at the busiest step (1) beside the block's `a` and `b`; `f`, a tuple
    element sharing `e`'s bytes, counts once, `g` is dead by then. The output `r`, written
    early and live to the end, and the parameter's `q` are not temporaries."""
    text = _ASSIGNMENT + (
        f"allocation 3: size {4 * MiB}, maybe-live-out:\n"
        f" value: <7 e @0> (size={4 * MiB},offset=0): f32[1048576]\n"
        f" value: <8 f{{0}} @0> (size={MiB},offset=0): f32[262144]\n"
        f" value: <9 g @0> (size={2 * MiB},offset=0): f32[524288]\n"
        f" value: <10 o @0> (size={4 * MiB},offset=0): f32[1048576]\n"
        f"allocation 4: size 512, parameter 1, maybe-live-out:\n"
        f" value: <11 q @0> (size=512,offset=0): f32[128]\n"
        f"allocation 5: size {MiB}, maybe-live-out:\n"
        f" value: <12 r @0> (size={MiB},offset=0): f32[262144]\n"
    )
    ranges = "    e{}:1-2\n    f{0}:1-1\n    g{}:0-0\n    o{}:3-4\n    q{}:0-4\n    r{}:0-4\n"
    pk = buffer_packing(text, _LIVE.replace("    v{}:0-3\n", "    v{}:0-3\n" + ranges))
    assert (pk.live, pk.live_at) == (3 * MiB, "b")
    assert pk.in_outputs == 4 * MiB
    assert buffer_packing(_ASSIGNMENT, _LIVE).in_outputs == 0
    # with the HLO, which temporaries those are (`e`; `f` shares its bytes, counted once)
    hlo = "".join(f'  %{n} = f32[8] add(), metadata={{op_name="jit(f)/{n}"}}\n' for n in "efgor")
    pk = buffer_packing(text, _LIVE.replace("    v{}:0-3\n", "    v{}:0-3\n" + ranges), hlo)
    assert pk.in_outputs == 4 * MiB
    assert [(b.name, b.size, b.offset, b.op_name) for b in pk.busiest_in_outputs] == [
        ("e{}", 4 * MiB, 0, "jit(f)/e"),
        ("f{0}", MiB, 0, "jit(f)/f"),
    ]
    assert "e{}" not in {b.name for b in pk.busiest}


# A hole made by a small buffer: `a` (2 MiB at 0) dies at step 0, `s` (64 KiB) is placed at
# 1 MiB inside the range `a` freed and lives on, so `t` (2 MiB, steps 2-3) goes on top of the
# long-lived `k` (1 MiB at 3 MiB): a block of 6 MiB for at most 3 MiB + 64 KiB live.
_K = 2**16
_HOLE_ASSIGNMENT = f"""BufferAssignment:
allocation 0: size {6 * MiB}, preallocated-temp:
 value: <1 a @0> (size={2 * MiB},offset=0): f32[524288]
 value: <2 k @0> (size={MiB},offset={3 * MiB}): s8[1048576]
 value: <3 s @0> (size={_K},offset={MiB}): f32[16384]
 value: <4 t @0> (size={2 * MiB},offset={4 * MiB}): bf16[1048576]
"""
_HOLE_LIVE = """HloLiveRange (max 3):
  InstructionSequence:
    0:a
    1:s
    2:t
    3:out
  BufferLiveRange:
    a{}:0-0
    k{}:0-3
    s{}:1-3
    t{}:2-3
"""
_HOLE_HLO = """ENTRY %main {
  %a = f32[524288]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/jvp()/mul"}
  %k = s8[1048576]{0} copy(%q)
  %s = f32[16384]{0} fusion(%a), metadata={op_name="jit(f)/transpose(dot_general)" id=3}
  ROOT %t = bf16[1048576]{0} fusion(%k, %s), metadata={op_name="jit(f)/transpose(max)"}
}
"""


def test_buffer_packing_names_what_keeps_a_buffer_off_the_bottom(tmp_path):
    for suffix, text in (("-buffer-assignment", _HOLE_ASSIGNMENT), ("-live-range", _HOLE_LIVE)):
        (tmp_path / f"m.jit_f.after_optimizations{suffix}.txt").write_text(text)
    (tmp_path / "m.jit_f.after_optimizations.txt").write_text(_HOLE_HLO)
    pk = read_dump(tmp_path, "jit_f")
    assert pk == buffer_packing(_HOLE_ASSIGNMENT, _HOLE_LIVE, _HOLE_HLO)
    assert (pk.heap, pk.live, pk.live_at) == (6 * MiB, 3 * MiB + _K, "t")
    # The buffers reaching above the live bytes, highest first: t, then k (3-4 MiB).
    assert [t.buffer.name for t in pk.top] == ["t{}", "k{}"]
    top = pk.top[0]
    assert isinstance(top, HeapTop) and isinstance(top.buffer, HeapBuffer)
    t = top.buffer
    assert (t.offset, t.size, t.end, t.first, t.last) == (4 * MiB, 2 * MiB, 6 * MiB, 2, 3)
    assert (t.first_instruction, t.last_instruction) == ("t", "out")
    assert t.op_name == "jit(f)/transpose(max)" and t.shape == "bf16[1048576]"
    # Below it at its first step: k (s is under the 1 MiB floor); it would fit at 0-2 MiB
    # but for s, which the compiler's copy k does not share (no op_name).
    assert [b.name for b in top.below] == ["k{}"] and top.below[0].op_name == ""
    assert top.gap == (0, 2 * MiB)
    (s,) = top.blockers
    assert (s.name, s.offset, s.size, s.first, s.last) == ("s{}", MiB, _K, 1, 3)
    assert s.op_name == "jit(f)/transpose(dot_general)"
    # Without the HLO, or without a hole, nothing to explain.
    assert buffer_packing(_HOLE_ASSIGNMENT, _HOLE_LIVE).top == ()
    assert buffer_packing(_ASSIGNMENT, _LIVE, _HOLE_HLO).top == ()


def test_buffer_packing_lists_the_buffers_live_at_the_busiest_instruction():
    """`busiest`: the buffers live at `live_at`, largest first; their sizes add up to `live`
    where none share bytes; empty without the HLO."""
    pk = buffer_packing(_HOLE_ASSIGNMENT, _HOLE_LIVE, _HOLE_HLO)
    # The busiest instruction is t (step 2): k, s and t live there, a died at step 0.
    assert pk.live_at == "t"
    assert [b.name for b in pk.busiest] == ["t{}", "k{}", "s{}"]
    assert sum(b.size for b in pk.busiest) == pk.live
    assert pk.busiest[0].op_name == "jit(f)/transpose(max)"
    assert buffer_packing(_HOLE_ASSIGNMENT, _HOLE_LIVE).busiest == ()
    # At step 1 of the first program a and b live (c and d come later).
    pk = buffer_packing(_ASSIGNMENT, _LIVE, _HOLE_HLO)
    assert [b.name for b in pk.busiest] == ["b{}", "a{}"]


def test_buffer_packing_rejects_dumps_of_two_programs(tmp_path):
    with pytest.raises(ValueError, match="same module"):
        buffer_packing(_ASSIGNMENT, _LIVE.replace("    c{}:2-3\n", ""))
    with pytest.raises(RuntimeError, match="expected one buffer-assignment dump"):
        read_dump(tmp_path, "jit_traced")
    (tmp_path / "m.jit_f.after_optimizations-buffer-assignment.txt").write_text(_ASSIGNMENT)
    (tmp_path / "m.jit_f.after_optimizations-live-range.txt").write_text(_LIVE)
    assert read_dump(tmp_path, "jit_f").heap == 3 * MiB


@pytest.mark.slow  # two compiles for v5p, 20-170 s
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "s3req[tpu]"): no TPU compiles',
)
def test_v5p_packing_of_a_layer():
    """Reading the buffer assignment does not change the program (the same memory analysis
    as without); its block holds what is live, and on v5p the reported temporaries are the
    block plus its hole again (the claim of the tpu_packing page); `busiest` holds the live
    bytes of the busiest instruction."""
    mesh = tpu_mesh()
    batch = NamedSharding(mesh, PartitionSpec("data"))
    B, S, H, D = 8, 512, 256, 512
    x = jax.ShapeDtypeStruct((B, S, H), jnp.bfloat16, sharding=batch)
    g = jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16, sharding=batch)
    w = jax.ShapeDtypeStruct((H, D), jnp.float32)
    key = jax.ShapeDtypeStruct((), jr.key(0).dtype)

    def f(x, w, g, key):
        y, vjp = jax.vjp(lambda x, w: qdot(x, w, policy=PRESETS["s3r-ec-2way"], key=key), x, w)
        return y, vjp(g)

    plain = compile_for_tpu(f, x, w, g, key, mesh=mesh)
    read = compile_for_tpu(f, x, w, g, key, mesh=mesh, buffers=True)
    assert plain.packing is None and read.packing is not None
    assert read.memory == plain.memory
    pk, m = read.packing, read.memory
    assert 0 < pk.live <= pk.heap <= m.temporaries
    assert abs(m.temporaries - pk.heap - pk.hole) <= MiB // 10, (m, pk)
    assert read.summary()["packing"]["hole"] == pk.hole
    # Temporaries placed in the outputs' buffers fit in them.
    assert 0 <= pk.in_outputs <= m.outputs
    # The buffers live at the busiest instruction hold its live bytes (values of one tuple
    # may share bytes, so their sizes may add to more), largest first, each live there.
    sizes = [b.size for b in pk.busiest]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) >= pk.live
    assert max(b.first for b in pk.busiest) <= min(b.last for b in pk.busiest)  # one step


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "s3req[tpu]"): no TPU compiles',
)
def test_v5p_training_step_holds_temporaries_in_its_outputs():
    """A training step (the tiny preset's, Table IV's step builder) holds temporaries in the
    buffers of its outputs at the busiest instruction: `busiest_in_outputs` lists them,
    largest first, each live there, none of them in the block's `busiest`, their sizes
    adding up to at least `in_outputs` (values of one tuple may share bytes)."""
    tc = _packing_page_module().tc
    mesh = tpu_mesh({"fsdp": 2, "tp": 2})
    prog, _, _ = tc.compile_step("s3r-ec-2way", mesh, "tiny", 1, 40, 3, buffers=True)
    pk = prog.packing
    assert pk is not None and 0 < pk.in_outputs <= prog.memory.outputs
    held = pk.busiest_in_outputs
    sizes = [b.size for b in held]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) >= pk.in_outputs
    step = max(b.first for b in pk.busiest)  # the busiest instruction's step
    assert all(b.first <= step <= b.last for b in held)
    assert not {b.name for b in held} & {b.name for b in pk.busiest}


def _packing_page_module():
    import pathlib
    import sys

    benchmarks = str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import tpu_packing

    return tpu_packing


def test_packing_page_names_what_sits_on_top():
    """The page's top table lists a program whose hole is at least `SHOWN_HOLE` of its heap,
    with the lowest range the top buffer fits in and its largest blockers, and leaves out
    one whose packing has no such hole."""
    tp = _packing_page_module()
    MiB = 2**20

    def buf(name, shape, size, first, last, op=""):
        return {
            "name": name,
            "shape": shape + "{0}",
            "offset": 0,
            "size": size * MiB,
            "first": first,
            "last": last,
            "first_instruction": name,
            "last_instruction": name,
            "op_name": op,
        }

    def row(heap, live, top):
        hole = heap - live
        return {
            "temporaries": (heap + hole) * MiB,
            "peak": (live + 10) * MiB,
            "heap": heap * MiB,
            "live": live * MiB,
            "hole": hole * MiB,
            "live_at": "fusion.1",
            "top": top,
            "commit": "abc1234",
        }

    grad = buf("g{1}", "bf16[4,4096,2048]", 64, 800, 1000, "reduce_max")
    small = buf("u{}", "f32[2048]", 1, 700, 1100, "dot_general")
    big = buf("q{}", "s8[4,4096,2048]", 32, 950, 1200)
    top = [{"buffer": grad, "below": [], "gap": [70 * MiB, 134 * MiB], "blockers": [small, big]}]
    data = {
        "ffn": {
            "W1": {
                "s3r": row(270, 266, [{"buffer": grad, "below": [], "gap": None, "blockers": []}]),
                "s3r-ec-2way": row(334, 270, top),
            }
        },
        "meta": {"jax": "0", "topology": "v5p:2x2x1"},
    }
    page = tp.markdown(data)
    section = page.split("## What sits on top of the block")[1]
    lines = [line for line in section.splitlines() if line.startswith("| W1")]
    assert len(lines) == 1 and "| s3r-ec-2way |" in lines[0]
    assert "`bf16[4,4096,2048]` 64.000 MiB, steps 800-1000" in lines[0]
    assert "| 70.0-134.0 |" in lines[0]
    # the blockers by size, largest first, and their count
    assert lines[0].index("`s8[4,4096,2048]`") < lines[0].index("`f32[2048]`")
    assert "| 2: " in lines[0]


def _heap_buffer(name, shape, size, first, last, op=""):
    return HeapBuffer(
        name=name,
        shape=shape,
        offset=0,
        size=size,
        first=first,
        last=last,
        first_instruction=name,
        last_instruction=name,
        op_name=op,
    )


def test_busiest_groups_and_their_changes_add_up():
    """The page's groups of the buffers live at a step's busiest instruction: by shape and
    what made them (the op name without the step's prefix, or the compiler instruction's
    kind), small groups summed; the changes between two programs add up to the change of
    the buffers' total size, a group absent from one program counting 0 there; the page
    compares the temporaries in the outputs' buffers the same way."""
    tp = _packing_page_module()
    step = "jit(traced)/jit(step)/transpose(jvp())/"
    small = tp.GROUP_FLOOR // 4
    a = [
        _heap_buffer("x.1{}", "s8[8,4096,2048]{2,1,0}", 64 * MiB, 10, 90, step + "dot_general"),
        _heap_buffer(
            "x.2{}", "s8[8,4096,2048]{2,1,0:T(8,128)}", 64 * MiB, 12, 80, step + "dot_general"
        ),
        _heap_buffer("copy-start.29{0}", "bf16[1024]{0}", small, 5, 50),
        _heap_buffer("w.3{}", "f32[16]{0}", small, 5, 50, step + "shard_map/mul"),
    ]
    b = [
        *a[:3],
        _heap_buffer("x.4{}", "s8[8,4096,2048]{2,1,0}", 64 * MiB, 30, 95, step + "dot_general"),
        _heap_buffer(
            "r.5{1}", "s8[64,2048,704]{1,2,0}", 88 * MiB, 20, 99, step + "shard_map/reduce_sum"
        ),
    ]
    ga, gb = tp.busiest_groups(a), tp.busiest_groups(b)
    (codes, *_) = ga["groups"]
    assert (codes["shape"], codes["made_by"]) == (
        "s8[8,4096,2048]",
        "transpose(jvp())/dot_general",
    )
    assert (codes["count"], codes["bytes"], codes["first"], codes["last"]) == (
        2,
        128 * MiB,
        10,
        90,
    )
    # the two small groups (a compiler copy, named by its instruction's kind, and an op)
    assert ga["rest"] == {"count": 2, "bytes": 2 * small}
    assert tp.made_by(a[2]) == "(compiler) copy-start"
    # an op_name the compiler took from another instruction loses its number too
    assert tp.made_by(_heap_buffer("f.7{}", "bf16[8]{0}", 16, 0, 1, "reshape.571")) == "reshape"
    changes, rest = tp.group_changes(ga, gb)
    assert [(c["shape"], c["change"], c["counts"]) for c in changes] == [
        ("s8[64,2048,704]", 88 * MiB, (0, 1)),
        ("s8[8,4096,2048]", 64 * MiB, (2, 3)),
    ]
    assert rest == -small
    total = sum(x.size for x in b) - sum(x.size for x in a)
    assert sum(c["change"] for c in changes) + rest == total

    def row(groups, live, held=None, held_buffers=()):
        return {
            "temporaries": 3 * live,
            "peak": live + 100 * MiB,
            "heap": 2 * live,
            "live": live,
            "hole": live,
            "live_at": "fusion.1",
            "top": [],
            "commit": "abc1234",
            "busiest": groups,
        } | (
            {}
            if held is None
            else {"in_outputs": held, "busiest_in_outputs": tp.busiest_groups(held_buffers)}
        )

    codes = _heap_buffer(
        "c.6{}", "s8[64,2048,704]{1,2,0}", 88 * MiB, 15, 99, step + "shard_map/convert"
    )

    live = sum(x.size for x in a)
    data = {
        "steps": {
            "DeepSeek-V2-Lite": {
                "preset": "deepseek-v2-lite",
                "n_layers": 1,
                # S3R holds the 88 MiB group in an output's buffer, two-way in the block
                "policies": {
                    "s3r": row(ga, live, 88 * MiB, [codes]),
                    "s3r-ec-2way": row(gb, live + total, 0),
                },
            },
            "Qwen3-30B-A3B": {
                "preset": "qwen3-30b-a3b",
                "n_layers": 1,
                "policies": {"s3r": row(ga, live), "s3r-ec-2way": row(ga, live)},
            },
        },
        "meta": {"jax": "0", "topology": "v5p:2x2x1"},
    }
    page = tp.markdown(data)
    assert "## The FFN block" not in page
    section = page.split("## Training steps")[1]
    assert (
        "**Qwen3-30B-A3B, s3r-ec-2way over S3R**: live +0.0 MiB, peak +0.0 MiB; the same "
        "buffers (shapes and operations) are live at the busiest instruction." in section
    )
    # rows compiled before `in_outputs` was recorded show none
    cells = section.split("| Qwen3-30B-A3B | 1 | s3r | ")[1].split(" | ")
    assert cells[4] == "—"  # in outputs
    section = section.split("**Qwen3-30B-A3B")[0]
    assert (
        "**DeepSeek-V2-Lite, s3r-ec-2way over S3R**: live +151.9 MiB, peak +151.9 MiB; in the "
        "outputs' buffers -88.0 MiB, so the temporaries live at the busiest instruction (block "
        "and outputs' buffers) +63.9 MiB;" in section
    )
    # 88 MiB of a group S3R does not hold there, made inside the expert GEMMs' shard_map
    assert "+88.0 MiB of it in groups that only one of the two holds there" in section
    assert "+88.0 MiB made inside the MoE block's `shard_map` (routing and expert" in section
    section, outputs = section.split("In the outputs' buffers there:")
    assert outputs.split("\n\n")[1].splitlines()[2:] == [
        "| -88.0 | 1, 0 | `s8[64,2048,704]` | transpose(jvp())/shard_map/convert | 15-99 |",
        "| +0.0 | | the rest | | |",
    ]
    rows = [line for line in section.splitlines() if re.match(r"\| [+-]\d", line)]
    assert rows[0].startswith(
        "| +88.0 | 0, 1 | `s8[64,2048,704]` | transpose(jvp())/shard_map/reduce_sum"
    )
    assert rows[1].startswith("| +64.0 | 2, 3 | `s8[8,4096,2048]`")
    assert rows[-1].startswith("| -0.1 | | groups under 256 KiB")
