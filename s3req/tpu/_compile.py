"""Compile a JAX function for a TPU topology on a machine without a TPU (ahead of time)."""

import dataclasses
import importlib.util
import math
import os
import tempfile
import time
import typing
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._buffers import BufferPacking, read_dump
from ._hlo import Gemm, hlo_buffers, HloTensor, program_structure


DEFAULT_TOPOLOGY = "v5p:2x2x1"
"""The topology compiled for by default: 4 chips of TPU v5p (libtpu refuses single-chip
topologies such as `"v5p:1x1x1"`)."""
_INSTALL = (
    'pip install "s3req[tpu]" (or pip install "jax[tpu]=={v}", the libtpu of your jax); '
    "no TPU is needed to compile"
)


def _topology_devices(topology: str) -> list:
    if importlib.util.find_spec("libtpu") is None:
        raise ImportError(
            "compiling for a TPU needs libtpu, which is not installed: "
            + _INSTALL.format(v=jax.__version__)
        )
    # Several processes of one machine may load libtpu; without a TPU each only compiles.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu's errors name neither the topology nor the fix
        raise RuntimeError(
            f"libtpu refused the topology {topology!r} ({type(e).__name__}: {e}). Use a "
            "name such as 'v5p:2x2x1', 'v5p:2x2x2' or 'v4:2x2x1' (single-chip topologies such "
            "as 'v5p:1x1x1' are refused), with a libtpu that matches jax "
            f"{jax.__version__} ({_INSTALL.format(v=jax.__version__)})."
        ) from e
    return list(desc.devices)


def tpu_mesh(
    axes: dict[str, int] | None = None, *, topology: str = DEFAULT_TOPOLOGY
) -> jax.sharding.Mesh:
    """A device mesh over the chips of a TPU topology that need not exist on this machine.

    Needs `libtpu` (`pip install "s3req[tpu]"`), not a TPU: the devices can be compiled
    for, not run on. Build input shardings on it with `jax.sharding.NamedSharding(mesh,
    PartitionSpec(...))` and pass them to [`s3req.tpu.compile_for_tpu`][].

    **Arguments:**

    - `axes`: mesh axis names and sizes, major to minor, e.g. `{"fsdp": 2, "tp": 2}`; their
      product must be the topology's chip count. Default: one axis `"data"` over all chips.
    - `topology`: a TPU topology name as libtpu spells it (`"v5p:2x2x1"`: 4 chips of TPU
      v5p). (Keyword only argument.)

    **Returns:**

    A `jax.sharding.Mesh` of TPU devices.
    """
    devices = _topology_devices(topology)
    if axes is None:
        axes = {"data": len(devices)}
    if math.prod(axes.values()) != len(devices) or any(n < 1 for n in axes.values()):
        raise ValueError(
            f"mesh axes {axes} hold {math.prod(axes.values())} devices, but topology "
            f"{topology!r} has {len(devices)} chips: make the sizes multiply to {len(devices)}."
        )
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes))


@typing.final
@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """XLA's compile-time memory analysis of a program, per device, in bytes.

    This is the TPU compiler's own buffer assignment (what the paper's Table IV reports):
    exact for the compiled program, but it excludes the runtime's own reservations and any
    fragmentation.

    **Fields:**

    - `arguments`: input buffers.
    - `outputs`: output buffers.
    - `temporaries`: every other buffer live at some point (activations, residuals, the
      int8 codes, random words, ...), after XLA's reuse of memory. It grows with the holes
      of the packing: on TPU v5p it is the block of temporaries plus its hole again (see
      [`s3req.tpu.BufferPacking`][], `compile_for_tpu(..., buffers=True)`).
    - `aliased`: bytes of outputs that reuse (donated) input buffers.
    - `generated_code`: the program's code.
    - `peak`: XLA's `peak_memory_in_bytes`, the largest total size of the buffers live at
      one time in the compiler's simulation of the program, arguments and outputs
      included. It is not bounded by `total` (for small programs it exceeds it), and two
      programs whose live buffers match can still get `temporaries` that differ by the
      holes of their packing, so the pages report both.
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    generated_code: int
    peak: int

    @property
    def total(self) -> int:
        """`arguments + outputs + temporaries - aliased`: the device memory the step needs."""
        return self.arguments + self.outputs + self.temporaries - self.aliased


@typing.final
@dataclasses.dataclass(frozen=True)
class CostModel:
    """The TPU compiler's cost **model** of a program (`compiled.cost_analysis()`).

    A static estimate, never a measured time: it does not price int8 GEMMs at twice the
    bf16 rate of the matrix unit, nor the vector-unit cost of hashing random words, so
    it cannot rank rounding policies by speed. Reported for completeness only.

    **Fields:**

    - `flops`: modelled floating-point (and integer) operations.
    - `bytes_accessed`: modelled memory traffic in bytes.
    - `transcendentals`: modelled transcendental operations.
    - `optimal_seconds`: the model's time estimate (not a measurement).
    """

    flops: float
    bytes_accessed: float
    transcendentals: float
    optimal_seconds: float


@typing.final
@dataclasses.dataclass(frozen=True)
class TPUProgram:
    """What the TPU compiler made of a function: memory, program structure, cost model.

    Returned by [`s3req.tpu.compile_for_tpu`][]. Sizes and shapes are per device (the
    compiled SPMD program of one chip).

    **Fields:**

    - `device_kind`: e.g. `"TPU v5"`; `mesh`: the mesh axes and sizes compiled for.
    - `memory`: the [`s3req.tpu.MemoryAnalysis`][] (arguments, outputs, temporaries).
    - `gemms`: every matrix product of the optimized HLO ([`s3req.tpu.Gemm`][], in program
      order). TPU HLO writes GEMMs as `convolution`s: an INT8 GEMM reads `s8` operands into
      an `s32` result.
    - `largest_u32`: the largest `u32` buffer (an [`s3req.tpu.HloTensor`][]) the program
      writes to memory, or `None`. Random words that stay inside a fusion never become
      buffers: for Phi2D/PhiBcast this is a few words per token or example. On TPU v5p the
      compiler also fuses Independent SR's per-element Threefry into the quantizer, so its
      words are not stored either (its cost is vector work); a program that keeps random
      words (returns them, or feeds them to two kernels) shows them here.
    - `fusions`: the number of fusion instructions outside fusions (kernels of the program).
    - `backward_vector_ops`: vector operations of the backward pass, counted as follows.
      The backward is every instruction whose JAX metadata (`op_name`) contains
      `transpose(`, i.e. the VJP (`jax.vjp`, `jax.grad`, `eqx.filter_vjp`; a fusion is
      attributed by its own metadata). For a backward fusion, every instruction of its fused
      computation (nested fusions included) other than data movement and layout
      (`parameter`, `constant`, `broadcast`, `reshape`, `bitcast`, `transpose`, `copy`,
      `slice`, `concatenate`, `pad`, `get-tuple-element`, `tuple`, ...), GEMMs (`dot`,
      `convolution`), calls and collectives counts one operation per element of its result
      (a `reduce`: per element of its input); a backward instruction outside any fusion
      counts the same way. Instructions inside loop bodies count once, not per iteration.
      This counts HLO operations on elements, not machine instructions (it ignores vector
      register packing of bf16/int8 and the compiler's lowering below HLO).
    - `upstream_elements`: elements (per device) of the upstream gradients passed as
      `upstream=`, or `None`.
    - `vector_ops_per_upstream_element`: `backward_vector_ops / upstream_elements`, the unit
      of the paper's Section IV-D (vector operations per upstream-gradient element), or
      `None`. The paper converts measured time into operations; this is a static count.
    - `cost_model`: the compiler's [`s3req.tpu.CostModel`][], a model and never a time.
    - `compile_seconds`: wall time of lowering and compiling here.
    - `hlo`: the optimized HLO text.
    - `packing`: how the compiler packed the temporaries (a [`s3req.tpu.BufferPacking`][]:
      the block's size, the most bytes occupied at once, the hole between them), or `None`
      unless compiled with `buffers=True`.
    """

    device_kind: str
    mesh: dict[str, int]
    memory: MemoryAnalysis
    gemms: tuple[Gemm, ...]
    largest_u32: HloTensor | None
    fusions: int
    backward_vector_ops: int
    upstream_elements: int | None
    vector_ops_per_upstream_element: float | None
    cost_model: CostModel
    compile_seconds: float
    hlo: str = dataclasses.field(repr=False)
    packing: BufferPacking | None = None

    def buffers(self) -> tuple[HloTensor, ...]:
        """Every array the program writes outside fusions, largest (in bytes) first: its
        per-device shapes show how the SPMD partitioner split each activation (e.g. whether
        a chip holds only its share of the batch). Read from the optimized HLO (see
        `s3req.tpu.hlo_buffers`): activations, gradients, collective results, parameter
        copies; views and the ends of asynchronous copies are left out."""
        return tuple(hlo_buffers(self.hlo))

    def integer_gemms(self) -> tuple[Gemm, ...]:
        """The GEMMs with two integer (`s8`, `s4`, `u8`, ...) operands."""
        return tuple(
            g for g in self.gemms if len(g.operands) == 2 and all(t[0] in "su" for t in g.operands)
        )

    def summary(self) -> dict[str, typing.Any]:
        """The facts as plain JSON-serialisable values (the HLO text left out)."""
        out = dataclasses.asdict(self)
        del out["hlo"]
        out["memory"]["total"] = self.memory.total
        for g, d in zip(self.gemms, out["gemms"]):
            d["signature"] = g.signature
        if self.largest_u32 is not None:
            out["largest_u32"]["bytes"] = self.largest_u32.nbytes
        if self.packing is not None:
            out["packing"]["hole"] = self.packing.hole
        return out


def _is_spec(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _abstract(leaf, mesh: Mesh):
    """A `ShapeDtypeStruct` on TPU devices for an array-like leaf; other leaves unchanged."""
    if not (_is_spec(leaf) or eqx.is_array(leaf)):
        return leaf
    sharding = leaf.sharding if _is_spec(leaf) else None
    if sharding is None:
        sharding = NamedSharding(mesh, PartitionSpec())
    elif any(d.platform != "tpu" for d in sharding.device_set):
        raise ValueError(
            f"an input of shape {leaf.shape} is sharded over non-TPU devices "
            f"({sorted({d.platform for d in sharding.device_set})}): build its sharding on "
            "s3req.tpu.tpu_mesh(...), or give no sharding to replicate it."
        )
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def compile_for_tpu(
    fn: Callable[..., typing.Any],
    *args: typing.Any,
    mesh: jax.sharding.Mesh | None = None,
    upstream: Sequence[jax.ShapeDtypeStruct] = (),
    buffers: bool = False,
) -> TPUProgram:
    """Compile `fn(*args)` for TPU chips ahead of time, on any machine, and read the facts.

    Lowers and compiles with XLA's TPU compiler from libtpu (`pip install "s3req[tpu]"`); no
    TPU is used and nothing is allocated. The memory analysis and the program structure
    (GEMM dtypes, fusions, materialized buffers) are the TPU compiler's own; the cost
    estimate is a model, not a time: measure speed on a TPU.

    **Arguments:**

    - `fn`: the function; it may take and return Equinox modules (only their arrays are
      traced; other fields are static).
    - `*args`: its arguments as pytrees whose array leaves are `jax.ShapeDtypeStruct`s (or
      arrays, which stand for their shape and dtype). A leaf with a sharding keeps it (it
      must be on `mesh`'s devices); a leaf without one is replicated over `mesh`. A typed
      PRNG key is `jax.ShapeDtypeStruct((), jax.random.key(0).dtype)`.
    - `mesh`: a mesh from [`s3req.tpu.tpu_mesh`][]. Default: `tpu_mesh()`, one axis
      `"data"` over the 4 chips of `"v5p:2x2x1"`. (Keyword only argument.)
    - `upstream`: the upstream gradients of the backward, as sharded `ShapeDtypeStruct`s
      (e.g. the cotangents a VJP is called with); their per-device elements are the
      denominator of `vector_ops_per_upstream_element`. (Keyword only argument.)
    - `buffers`: also read the compiler's buffer assignment (XLA dumps it to a temporary
      folder, deleted afterwards) into `TPUProgram.packing`: whether the temporaries hold
      holes. (Keyword only argument.)

    **Returns:**

    A [`s3req.tpu.TPUProgram`][].
    """
    if mesh is None:
        mesh = tpu_mesh()
    if any(d.platform != "tpu" for d in mesh.devices.flat):
        raise ValueError("mesh must hold TPU devices: build it with s3req.tpu.tpu_mesh(...)")
    tree = jax.tree_util.tree_map(lambda x: _abstract(x, mesh), args, is_leaf=_is_spec)
    dynamic, static = eqx.partition(tree, _is_spec, is_leaf=_is_spec)

    def traced(dynamic):
        out = fn(*eqx.combine(dynamic, static, is_leaf=_is_spec))
        return eqx.filter(out, eqx.is_array)

    with tempfile.TemporaryDirectory(prefix="s3req-tpu-") as dump:
        options = None
        if buffers:  # the module of `traced` only
            options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
            options["xla_dump_hlo_module_re"] = "jit_traced"
        t0 = time.perf_counter()
        compiled = jax.jit(traced).lower(dynamic).compile(compiler_options=options)
        seconds = time.perf_counter() - t0
        packing = read_dump(dump, "jit_traced") if buffers else None
    text = compiled.as_text()
    ma = compiled.memory_analysis()
    if text is None or ma is None:
        raise RuntimeError("the TPU compiler returned no HLO text or memory analysis")
    memory = MemoryAnalysis(
        arguments=int(ma.argument_size_in_bytes),
        outputs=int(ma.output_size_in_bytes),
        temporaries=int(ma.temp_size_in_bytes),
        aliased=int(ma.alias_size_in_bytes),
        generated_code=int(ma.generated_code_size_in_bytes),
        peak=int(ma.peak_memory_in_bytes),
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    structure = program_structure(text)
    elements = None
    for g in upstream:
        if not _is_spec(g):
            raise TypeError(f"upstream takes jax.ShapeDtypeStructs, got {type(g).__name__}")
        shard = g.sharding.shard_shape(g.shape) if g.sharding is not None else g.shape
        elements = (elements or 0) + math.prod(shard)
    return TPUProgram(
        device_kind=mesh.devices.flat[0].device_kind,
        mesh=dict(mesh.shape),
        memory=memory,
        gemms=tuple(structure.gemms),
        largest_u32=structure.largest_u32,
        fusions=structure.fusions,
        backward_vector_ops=structure.backward_vector_ops,
        upstream_elements=elements,
        vector_ops_per_upstream_element=(
            structure.backward_vector_ops / elements if elements else None
        ),
        cost_model=CostModel(
            flops=float(cost.get("flops", math.nan)),
            bytes_accessed=float(cost.get("bytes accessed", math.nan)),
            transcendentals=float(cost.get("transcendentals", math.nan)),
            optimal_seconds=float(cost.get("optimal_seconds", math.nan)),
        ),
        compile_seconds=round(seconds, 2),
        hlo=text,
        packing=packing,
    )
