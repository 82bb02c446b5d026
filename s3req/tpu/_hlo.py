"""Reading XLA's optimized HLO text: computations, GEMMs, materialized tensors, vector work.

Pure text parsing, no JAX backend needed: the same functions read the HLO of a CPU, GPU or
TPU program (`jax.jit(f).lower(...).compile().as_text()`).
"""

import dataclasses
import math
import re
import typing


_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_OPERAND = re.compile(r"(?:([a-z]+[0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?\s+)?(%[\w.\-]+)")
_INSTRUCTION = re.compile(r"\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$")
_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}

# Instructions that move, reinterpret or schedule data, or run on the matrix unit: not vector
# arithmetic. Everything else in a fused computation counts as one vector operation per
# element of its result (a reduction: per element of its input).
_NOT_VECTOR = frozenset(
    {
        "parameter",
        "constant",
        "broadcast",
        "reshape",
        "bitcast",
        "bitcast-convert",
        "transpose",
        "copy",
        "copy-start",
        "copy-done",
        "slice",
        "dynamic-slice",
        "dynamic-update-slice",
        "concatenate",
        "pad",
        "reverse",
        "get-tuple-element",
        "tuple",
        "convolution",
        "dot",
        "fusion",
        "custom-call",
        "call",
        "conditional",
        "while",
        "partition-id",
        "replica-id",
        "after-all",
        "all-reduce",
        "all-reduce-start",
        "all-reduce-done",
        "all-gather",
        "all-gather-start",
        "all-gather-done",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-permute-start",
        "collective-permute-done",
        "send",
        "send-done",
        "recv",
        "recv-done",
        "async-start",
        "async-update",
        "async-done",
        "optimization-barrier",
    }
)


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    types: tuple[tuple[str, tuple[int, ...]], ...]  # every array of the result type
    op: str
    operands: str
    attrs: str


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


def _arrays(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(
        (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in _ARRAY.finditer(type_text)
    )


def _call(rest: str) -> tuple[str, str, str]:
    """`(op, operands, attributes)` of `op(operands), attributes`."""
    op, _, tail = rest.partition("(")
    depth = 1
    for i, c in enumerate(tail):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return op.strip(), tail[:i], tail[i + 1 :]
    return op.strip(), tail, ""


def _computations(hlo: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """Every computation of an HLO module as a list of instructions, and the entry's name."""
    comps: dict[str, list[_Instruction]] = {}
    current: list[_Instruction] = []
    entry = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            current = comps.setdefault(header.group(2), [])
            if header.group(1):
                entry = header.group(2)
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rhs = m.groups()
        type_text, rest = _split_type(rhs)
        op, operands, attrs = _call(rest)
        current.append(_Instruction(name, _arrays(type_text), op, operands, attrs))
    return comps, entry


def _called(ins: _Instruction) -> list[str]:
    """The computations an instruction calls (fusion bodies, reducers, branches, loops)."""
    names = re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)", ins.attrs)
    for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.attrs):
        names += re.findall(r"%[\w.\-]+", group)
    return names


def _fused(comps: dict[str, list[_Instruction]]) -> set[str]:
    """Computations that run inside another instruction's kernel (fusion bodies and the
    reducers of reductions, with everything they call): their values are never buffers."""
    inner: set[str] = set()
    todo = [
        c
        for instrs in comps.values()
        for ins in instrs
        for c in re.findall(r"(?:calls|to_apply)=(%[\w.\-]+)", ins.attrs)
    ]
    while todo:
        c = todo.pop()
        if c in inner or c not in comps:
            continue
        inner.add(c)
        todo += [n for ins in comps[c] for n in _called(ins)]
    return inner


def _op_name(ins: _Instruction) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


@typing.final
@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix product of a compiled program, read from its optimized HLO.

    **Fields:**

    - `name`: the HLO instruction, e.g. `%convolution.9`.
    - `op`: `"dot"`, `"convolution"` (how TPU HLO writes a GEMM, int8 ones included) or
      `"custom-call <target>"` (a GEMM library call such as cuBLAS).
    - `operands`: the dtypes of the two operands, e.g. `("s8", "s8")`.
    - `operand_shapes`: their shapes (as the program sees them: per device under SPMD).
    - `result`: the result dtype (of the first element of a tuple result), e.g. `"s32"`.
    - `shape`: the result shape.
    - `macs`: multiply-adds, or `None` where the contraction cannot be read from the text.
    - `backward`: whether JAX's metadata puts it in a transposed (VJP) computation.
    """

    name: str
    op: str
    operands: tuple[str, ...]
    operand_shapes: tuple[tuple[int, ...], ...]
    result: str
    shape: tuple[int, ...]
    macs: int | None
    backward: bool

    @property
    def signature(self) -> str:
        """`"s8 x s8 -> s32"`: operand dtypes and result dtype."""
        return " x ".join(self.operands) + f" -> {self.result}"


def _dot_macs(attrs: str, shape: tuple[int, ...], lhs: tuple[int, ...]) -> int | None:
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
    if m is None:  # a cuBLAS custom call keeps its dimension numbers in backend_config
        m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs)
    if m is None or not lhs:
        return None
    contract = [int(d) for d in re.findall(r"\d+", m.group(1))]
    if not contract:
        return None
    return math.prod(shape) * math.prod(lhs[d] for d in contract)


def _conv_macs(
    attrs: str, shape: tuple[int, ...], lhs: tuple[int, ...], rhs: tuple[int, ...]
) -> int | None:
    """Multiply-adds of a convolution: result elements x the lhs feature dimension x the
    kernel's spatial (window) dimensions, from `dim_labels=lhs_rhs->out`."""
    m = re.search(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->", attrs)
    if m is None or len(m.group(1)) != len(lhs) or len(m.group(2)) != len(rhs):
        return None
    lhs_labels, rhs_labels = m.groups()
    window = math.prod(rhs[i] for i, c in enumerate(rhs_labels) if c.isdigit())
    groups = re.search(r"feature_group_count=(\d+)", attrs)
    feature = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    return math.prod(shape) * feature * window


def parse_gemms(hlo: str) -> list[Gemm]:
    """Every GEMM of an HLO module's text, in program order.

    Finds `dot`s and `convolution`s (also inside fusions, where TPU and GPU backends put
    them) and custom calls to a GEMM library (`custom_call_target` naming a gemm or matmul,
    e.g. cuBLAS). Works on the optimized HLO of any backend.

    **Arguments:**

    - `hlo`: the module's text, e.g. `jax.jit(f).lower(...).compile().as_text()`.

    **Returns:**

    A list of [`s3req.tpu.Gemm`][].
    """
    gemms = []
    comps, _ = _computations(hlo)
    for instrs in comps.values():
        types = {ins.name: ins.types[0] if ins.types else ("?", ()) for ins in instrs}
        for ins in instrs:
            target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
            library = target.group(1) if ins.op == "custom-call" and target else ""
            if ins.op not in ("dot", "convolution") and not re.search("gemm|matmul", library):
                continue
            operands = []
            for dtype, dims, ref in _OPERAND.findall(ins.operands):
                if dtype:
                    operands.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
                else:
                    operands.append(types.get(ref, ("?", ())))
            operands = operands[:2]
            dtype, shape = types[ins.name]
            lhs = operands[0][1] if operands else ()
            if ins.op == "convolution":
                rhs = operands[1][1] if len(operands) > 1 else ()
                macs = _conv_macs(ins.attrs, shape, lhs, rhs)
            else:
                macs = _dot_macs(ins.attrs, shape, lhs)
            gemms.append(
                Gemm(
                    name=ins.name,
                    op=f"custom-call {library}" if library else ins.op,
                    operands=tuple(t for t, _ in operands),
                    operand_shapes=tuple(s for _, s in operands),
                    result=dtype,
                    shape=shape,
                    macs=macs,
                    backward="transpose(" in _op_name(ins),
                )
            )
    return gemms


@typing.final
@dataclasses.dataclass(frozen=True)
class HloTensor:
    """A buffer of a compiled program: one array that an instruction outside any fusion
    writes to memory.

    **Fields:**

    - `name`: the HLO instruction that produces it.
    - `dtype`: its HLO element type, e.g. `"u32"`.
    - `shape`: its shape (per device under SPMD).
    - `op_name`: JAX's name for the operation that produced it (HLO metadata), or `""`.
    - `op`: the HLO opcode of the producing instruction (`"fusion"`, `"all-gather"`,
      `"custom-call"`, ...), or `""`.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    op_name: str
    op: str = ""

    @property
    def elements(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes (sub-byte types rounded up to one byte per element)."""
        return self.elements * _BYTES.get(self.dtype, 4)


@dataclasses.dataclass(frozen=True)
class _Structure:
    gemms: list[Gemm]
    largest_u32: HloTensor | None
    fusions: int
    backward_vector_ops: int


def _vector_ops(comps: dict[str, list[_Instruction]], comp: str, seen: tuple[str, ...]) -> int:
    """Vector operations of one execution of a fused computation (nested fusions included)."""
    total = 0
    for ins in comps.get(comp, []):
        if ins.op == "fusion":
            for c in re.findall(r"calls=(%[\w.\-]+)", ins.attrs):
                if c not in seen:
                    total += _vector_ops(comps, c, seen + (c,))
        elif ins.op not in _NOT_VECTOR:
            total += _instruction_ops(ins, comps[comp])
    return total


def _instruction_ops(ins: _Instruction, scope: list[_Instruction]) -> int:
    """One operation per result element; a reduction: one per element of its inputs."""
    if ins.op in ("reduce", "reduce-window"):
        names = {i.name: i for i in scope}
        refs = [r for _, _, r in _OPERAND.findall(ins.operands)]
        inputs = refs[: max(1, len(refs) // 2)]  # (inputs..., init values...)
        return sum(math.prod(names[r].types[0][1]) for r in inputs if r in names)
    return sum(math.prod(shape) for _, shape in ins.types)


# Instructions whose result is (a view of) buffers that other instructions wrote.
_ALIASES = frozenset(
    {
        "bitcast",
        "add-dependency",
        "get-tuple-element",
        "tuple",
        "while",
        "conditional",
        "call",
        "optimization-barrier",
        "async-done",
        "copy-done",
        "all-gather-done",
        "all-reduce-done",
        "collective-permute-done",
    }
)


def hlo_buffers(hlo: str) -> list[HloTensor]:
    """Every array that an instruction outside fusions writes, largest (in bytes) first.

    Covers the entry computation and the non-fused computations it calls (loop bodies,
    branches); fusion bodies and reducers run inside one kernel and write nothing. Views
    (`bitcast`, `add-dependency`, `get-tuple-element`, `tuple`, `while`, ...) and the
    completions of asynchronous copies and collectives (whose buffer the `-start` wrote)
    are left out; an
    asynchronous start counts its largest result (the destination). Per device under SPMD.
    """
    comps, _ = _computations(hlo)
    inner = _fused(comps)
    out = []
    for comp, instrs in comps.items():
        if comp in inner:
            continue
        for ins in instrs:
            if ins.op in _ALIASES:
                continue
            arrays = [
                HloTensor(ins.name, t, shape, _op_name(ins), ins.op) for t, shape in ins.types
            ]
            if ins.op.endswith("-start") and arrays:  # (source, destination, contexts...)
                arrays = [max(arrays, key=lambda t: t.nbytes)]
            out += arrays
    out.sort(key=lambda t: -t.nbytes)
    return out


def program_structure(hlo: str) -> _Structure:
    """GEMMs, the largest materialized u32 buffer, the kernel count and the backward's
    vector operations of an optimized HLO module (see `s3req.tpu.TPUProgram`)."""
    comps, _ = _computations(hlo)
    inner = _fused(comps)
    largest = None
    fusions = 0
    backward_ops = 0
    for comp, instrs in comps.items():
        if comp in inner:
            continue
        for ins in instrs:
            backward = "transpose(" in _op_name(ins)
            if ins.op == "fusion":
                fusions += 1
                if backward:
                    for c in re.findall(r"calls=(%[\w.\-]+)", ins.attrs):
                        backward_ops += _vector_ops(comps, c, (c,))
            elif backward and ins.op not in _NOT_VECTOR:
                backward_ops += _instruction_ops(ins, instrs)
            for dtype, shape in ins.types:
                if dtype == "u32" and (largest is None or math.prod(shape) > largest.elements):
                    largest = HloTensor(ins.name, dtype, shape, _op_name(ins))
    return _Structure(parse_gemms(hlo), largest, fusions, backward_ops)
