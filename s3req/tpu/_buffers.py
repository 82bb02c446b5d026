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

    On TPU v5p (libtpu of jax 0.10.2) the reported `MemoryAnalysis.temporaries` exceeds
    `heap` by the hole again, `temporaries = heap + hole` to within 0.1 MiB on the programs
    measured (`docs/results/tpu_packing.md`): a hole counts twice in `temporaries`, and not
    at all in `live`.
    """

    heap: int
    live: int
    live_at: str

    @property
    def hole(self) -> int:
        """`heap - live`: bytes of the block never occupied at the busiest instruction."""
        return self.heap - self.live


_ALLOCATION = re.compile(r"allocation \d+: size (\d+)(.*)")
_VALUE = re.compile(
    r" value: <\d+ ([^{ ]+)(\{[0-9,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)"
)
_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")
_STEP = re.compile(r"\s+(\d+):(\S+)$")


def _heap_values(assignment: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """The size of the HBM temporary block and its values, `name: (offset, size)`."""
    heap, values, inside = 0, {}, False
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            # Memory space 0 is written without a color; other spaces (VMEM, SMEM) with one.
            inside = "preallocated-temp" in m[2] and "color" not in m[2]
            if inside:
                heap = int(m[1])
            continue
        m = _VALUE.match(line) if inside else None
        if m and int(m[3]) > 0:
            values[m[1] + (m[2] or "{}")] = (int(m[4]), int(m[3]))
    return heap, values


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


def buffer_packing(assignment: str, live_range: str) -> BufferPacking:
    """The packing facts of one program from the text of its
    `*after_optimizations-buffer-assignment.txt` and `*after_optimizations-live-range.txt`
    dumps. A value's live range includes both ends (a buffer defined at the step where
    another dies does not share its bytes unless the compiler placed it there)."""
    heap, values = _heap_values(assignment)
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
    return BufferPacking(heap=heap, live=live, live_at=steps[live_at] if steps else "")


def read_dump(directory: str | pathlib.Path, module: str) -> BufferPacking:
    """`buffer_packing` of the module whose name contains `module` in an XLA dump folder."""
    root = pathlib.Path(directory)
    found = {}
    for kind in ("buffer-assignment", "live-range"):
        files = sorted(root.glob(f"*{module}*after_optimizations-{kind}.txt"))
        if len(files) != 1:
            raise RuntimeError(
                f"expected one {kind} dump of module {module!r} in {root}, found "
                f"{[f.name for f in files]}"
            )
        found[kind] = files[0].read_text()
    return buffer_packing(found["buffer-assignment"], found["live-range"])
