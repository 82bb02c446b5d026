"""Read how XLA packed a program's temporary buffers, from its buffer-assignment dump."""

import dataclasses
import pathlib
import re
import typing


@typing.final
@dataclasses.dataclass(frozen=True)
class BufferPacking:
    """How the TPU compiler packed the temporary buffers of a program into device memory.

    Read from the compiler's own buffer assignment and buffer live ranges (the files XLA
    writes with `xla_dump_to`): XLA places every temporary buffer at an offset of one
    block of device memory (HBM), the *heap*, so that buffers live at the same time do not
    overlap. Where a buffer cannot reuse the space of dead ones (they were freed in pieces
    of the wrong size, or something small and long-lived sits in the middle of a large
    freed range), the heap grows past what is ever occupied at once: a *hole*.

    **Fields:**

    - `heap`: bytes of the block of temporaries in device memory (the buffer assignment's
      preallocated temporary allocation of memory space 0, HBM).
    - `live`: the most bytes of that block occupied at one instruction (the union of the
      byte ranges of the buffers live there, so buffers that share bytes count once).
    - `live_at`: the instruction where `live` is reached.
    - `in_outputs`: the bytes of temporary values live at `live_at` that the compiler
      placed in the buffers of the program's outputs rather than in the block: a buffer
      that will hold an output is free until the output is written, and the compiler puts
      temporaries there (a value that is itself an output, live to the end, is not
      counted). `live + in_outputs` are the temporaries live at `live_at`; two programs
      with the same sum hold as many temporaries there, whatever their `live`.

    On TPU v5p (libtpu of jax 0.10.2) the reported `MemoryAnalysis.temporaries` exceeds
    `heap` by the hole again, `temporaries = heap + hole` to within 0.1 MiB on the FFN
    blocks measured (`docs/results/tpu_packing.md`): a hole counts twice in `temporaries`,
    and not at all in `live`. It can exceed it by more: on Qwen3-30B-A3B's real-depth
    training step with dX-only EC (`docs/results/tpu_table4.md`), whose layer scan's
    carried residual stream the compiler placed in the block, by that buffer's 32 MiB too.
    """

    heap: int
    live: int
    live_at: str
    in_outputs: int = 0
    top: tuple["HeapTop", ...] = ()
    """The buffers that sit above `live` bytes, highest first (at most `TOP_BUFFERS`), each
    with what kept it from a lower place (a [`s3req.tpu.HeapTop`][]); empty without a hole
    or without the program's HLO."""
    busiest: tuple["HeapBuffer", ...] = ()
    """The buffers live at `live_at`, largest first; empty without the program's HLO. Their
    sizes add up to `live` where no two of them share bytes (values of one tuple may), so
    two programs' `busiest` say which buffers make the difference of their live bytes."""
    busiest_in_outputs: tuple["HeapBuffer", ...] = ()
    """The temporaries `in_outputs` counts, largest first (each `offset` is in its output's
    buffer, not in the block); empty without the program's HLO. A buffer that one program
    holds here and another in the block (`busiest`) is a difference of placement, not of
    bytes live."""

    @property
    def hole(self) -> int:
        """`heap - live`: bytes of the block never occupied at the busiest instruction."""
        return self.heap - self.live


@typing.final
@dataclasses.dataclass(frozen=True)
class HeapBuffer:
    """One buffer of the block of temporaries, as the compiler placed it.

    **Fields:**

    - `name`: the HLO value (instruction name, and the tuple index of a multi-output one).
    - `shape`: its HLO shape with layout.
    - `offset`, `size`: its bytes in the block (in its output's buffer, for
      `BufferPacking.busiest_in_outputs`).
    - `first`, `last`: the steps of the program where it is defined and last used (both
      included), with `first_instruction` and `last_instruction` the instructions there.
    - `op_name`: the JAX operation it comes from (the `op_name` of the HLO metadata of the
      instruction that defines it), or `""` for buffers the compiler made (copies).
    """

    name: str
    shape: str
    offset: int
    size: int
    first: int
    last: int
    first_instruction: str
    last_instruction: str
    op_name: str

    @property
    def end(self) -> int:
        """`offset + size`."""
        return self.offset + self.size


@typing.final
@dataclasses.dataclass(frozen=True)
class HeapTop:
    """A buffer placed above the live bytes of the block, and what kept it lower down.

    **Fields:**

    - `buffer`: the buffer (a [`s3req.tpu.HeapBuffer`][]).
    - `below`: the buffers of at least `min_size` bytes live at its first step and placed
      below it, by offset: what filled the block when it was defined.
    - `gap`: `(lo, hi)`, the range of `buffer.size` bytes below it that the fewest bytes of
      other buffers overlap while it lives, or `None` where no such range is below it.
    - `blockers`: the buffers (of any size) that overlap `gap` in bytes and `buffer`'s live
      range in steps, by offset: with them elsewhere it would fit in `gap`. A small buffer
      among them that lives long is what splits the range a large dead buffer freed.
    """

    buffer: HeapBuffer
    below: tuple[HeapBuffer, ...]
    gap: tuple[int, int] | None
    blockers: tuple[HeapBuffer, ...]


_ALLOCATION = re.compile(r"allocation \d+: size (\d+)(.*)")
_VALUE = re.compile(
    r" value: <\d+ ([^{ ]+)(\{[0-9,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)"
)
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")
_STEP = re.compile(r"\s+(\d+):(\S+)$")
_OP_NAME = re.compile(r"\s*(?:ROOT )?%?(\S+) = .*?\bop_name=\"([^\"]*)\"")


class _Allocation(typing.NamedTuple):
    """One allocation of a buffer-assignment dump: its size, attributes (`preallocated-temp`,
    `maybe-live-out`, `parameter N`, `color N`, ...) and values, `name: (offset, size,
    shape)` (zero-size values left out)."""

    size: int
    attrs: str
    values: dict[str, tuple[int, int, str]]


def _allocations(assignment: str) -> list[_Allocation]:
    """The allocations of a buffer-assignment dump, in its order."""
    out: list[_Allocation] = []
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            out.append(_Allocation(int(m[1]), m[2], {}))
            continue
        m = _VALUE.match(line) if out else None
        if m and int(m[3]) > 0:
            shape = line.split("): ", 1)[1].strip() if "): " in line else ""
            out[-1].values[m[1] + (m[2] or "{}")] = (int(m[4]), int(m[3]), shape)
    return out


def _heap_values(allocations: list[_Allocation]) -> tuple[int, dict[str, tuple[int, int, str]]]:
    """The size of the HBM temporary block and its values, `name: (offset, size, shape)`.
    Memory space 0 (HBM) is written without a color; other spaces (VMEM, SMEM) with one."""
    for a in allocations:
        if "preallocated-temp" in a.attrs and "color" not in a.attrs:
            return a.size, a.values
    return 0, {}


def _output_buffers(allocations: list[_Allocation]) -> list[_Allocation]:
    """The HBM allocations of the program's outputs (`maybe-live-out`, other than
    parameters'): their values are the outputs and the temporaries placed there before."""
    return [
        a
        for a in allocations
        if "maybe-live-out" in a.attrs and not ("color" in a.attrs or "parameter" in a.attrs)
    ]


def _live_ranges(live_range: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """The instruction sequence and every value's live range (first and last step)."""
    steps, ranges, section = [], {}, None
    for line in live_range.splitlines():
        if "InstructionSequence:" in line:
            section = "steps"
        elif "BufferLiveRange:" in line:
            section = "ranges"
        elif line.strip().startswith("Live ranges at"):
            break
        elif section == "steps" and (m := _STEP.match(line)):
            steps.append(m[2])
        elif section == "ranges" and (m := _RANGE.match(line)):
            ranges[m[1]] = (int(m[2]), int(m[3]))
    return steps, ranges


def _occupied(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


TOP_BUFFERS = 3
"""Most buffers `BufferPacking.top` describes."""


def _op_names(hlo: str) -> dict[str, str]:
    """The JAX `op_name` of every HLO instruction that has one."""
    return {m[1]: m[2] for line in hlo.splitlines() if (m := _OP_NAME.match(line))}


def _top(buffers: list[HeapBuffer], live: int, min_size: int) -> tuple[HeapTop, ...]:
    """`HeapTop` of the (at most `TOP_BUFFERS`) buffers of `min_size` bytes or more whose
    bytes reach above `live`, highest end first."""
    high = [b for b in buffers if b.size >= min_size and b.end > live]
    out = []
    for top in sorted(high, key=lambda b: -b.end)[:TOP_BUFFERS]:
        during = [
            b for b in buffers if b is not top and b.first <= top.last and b.last >= top.first
        ]
        below = [
            b
            for b in during
            if b.first <= top.first <= b.last and b.size >= min_size and b.end <= top.offset
        ]
        starts = {0} | {b.end for b in during} | {b.offset for b in during}
        gap, blockers, least = None, [], None
        for lo in sorted(x for x in starts if x + top.size <= top.offset):
            hi = lo + top.size
            inside = [b for b in during if b.offset < hi and b.end > lo]
            taken = _occupied([(max(b.offset, lo), min(b.end, hi)) for b in inside])
            if least is None or taken < least:
                gap, blockers, least = (lo, hi), inside, taken
        out.append(
            HeapTop(
                buffer=top,
                below=tuple(sorted(below, key=lambda b: b.offset)),
                gap=gap,
                blockers=tuple(sorted(blockers, key=lambda b: b.offset)),
            )
        )
    return tuple(out)


def buffer_packing(
    assignment: str, live_range: str, hlo: str = "", min_size: int = 2**20
) -> BufferPacking:
    """The packing facts of one program from the text of its
    `*after_optimizations-buffer-assignment.txt` and `*after_optimizations-live-range.txt`
    dumps. A value's live range includes both ends (a buffer defined at the step where
    another dies does not share its bytes unless the compiler placed it there); a value live
    to the program's last step is an output (`BufferPacking.in_outputs`). With the
    optimized HLO text (`*after_optimizations.txt`), `BufferPacking.top` says which buffers
    of at least `min_size` bytes sit above the live bytes and what kept them lower down, and
    `BufferPacking.busiest` which buffers are live at the busiest instruction."""
    allocations = _allocations(assignment)
    heap, values = _heap_values(allocations)
    steps, ranges = _live_ranges(live_range)
    missing = sorted(set(values) - set(ranges))
    if not values or missing:
        raise ValueError(
            "the buffer-assignment and live-range dumps do not describe one program "
            f"({len(values)} temporary values, {len(missing)} without a live range, e.g. "
            f"{missing[:3]}): pass the two files of the same module"
        )
    starts: dict[int, list[str]] = {}
    for name in values:
        starts.setdefault(ranges[name][0], []).append(name)
    live, live_at, alive = 0, 0, set()
    for t in range(len(steps)):
        alive = {n for n in alive if ranges[n][1] >= t} | set(starts.get(t, ()))
        occupied = _occupied([(values[n][0], values[n][0] + values[n][1]) for n in alive])
        if occupied > live:
            live, live_at = occupied, t
    # Temporaries in the outputs' buffers at `live_at` (each buffer's bytes counted once).
    held = [
        {
            name: v
            for name, v in a.values.items()
            if name in ranges and ranges[name][0] <= live_at <= ranges[name][1] < len(steps)
        }
        for a in _output_buffers(allocations)
    ]
    in_outputs = sum(_occupied([(o, o + n) for o, n, _ in h.values()]) for h in held)
    top, busiest, busiest_in_outputs = (), (), ()
    if hlo:
        ops = _op_names(hlo)
        step = lambda t: steps[t] if t < len(steps) else ""
        by_size = lambda bs: tuple(sorted(bs, key=lambda b: (-b.size, b.offset)))

        def buffer(name: str, offset: int, size: int, shape: str) -> HeapBuffer:
            return HeapBuffer(
                name=name,
                shape=shape,
                offset=offset,
                size=size,
                first=ranges[name][0],
                last=ranges[name][1],
                first_instruction=step(ranges[name][0]),
                last_instruction=step(ranges[name][1]),
                op_name=ops.get(name.split("{")[0], ""),
            )

        buffers = [buffer(name, *v) for name, v in values.items()]
        busiest = by_size(b for b in buffers if b.first <= live_at <= b.last)
        busiest_in_outputs = by_size(buffer(name, *v) for h in held for name, v in h.items())
        if heap > live:
            top = _top(buffers, live, min_size)
    return BufferPacking(
        heap=heap,
        live=live,
        live_at=steps[live_at] if steps else "",
        in_outputs=in_outputs,
        top=top,
        busiest=busiest,
        busiest_in_outputs=busiest_in_outputs,
    )


def read_dump(directory: str | pathlib.Path, module: str) -> BufferPacking:
    """`buffer_packing` of the module whose name contains `module` in an XLA dump folder
    (with its optimized HLO where the folder holds it)."""
    root = pathlib.Path(directory)
    found = {}
    for kind in ("-buffer-assignment", "-live-range", ""):
        files = sorted(root.glob(f"*{module}*after_optimizations{kind}.txt"))
        if len(files) != 1 and kind:
            raise RuntimeError(
                f"expected one {kind[1:]} dump of module {module!r} in {root}, found "
                f"{[f.name for f in files]}"
            )
        found[kind] = files[0].read_text() if len(files) == 1 else ""
    return buffer_packing(found["-buffer-assignment"], found["-live-range"], found[""])
