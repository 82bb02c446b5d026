"""`ShardAxes`: which mesh axes shard the operands of a quantized matmul inside `shard_map`;
`on_auto_axes`: the quantized matmuls on a mesh with `AxisType.Explicit` axes."""

import typing
from collections.abc import Callable

import equinox as eqx
import jax
from jax.sharding import AxisType
from jaxtyping import Array

from ._thresholds import Block


AxisNames = str | tuple[str, ...] | None
Role = typing.Literal["batch", "seq", "d_in", "d_out"]


def axis_names(axes: AxisNames) -> tuple[str, ...]:
    """The mesh axis names of one entry of a `PartitionSpec` or `ShardAxes` role, in order."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@typing.final
class ShardAxes(eqx.Module):
    """The mesh axes that shard a quantized matmul's operands inside `jax.shard_map`.

    Under `jax.jit` with `NamedSharding` nothing is needed: XLA partitions the computation
    and the thresholds, computed from global indices, are the same on every layout. Inside
    `jax.shard_map` each shard holds a block, and `qdot` must know which axes split which
    dimension to compute global scales and steps (`pmax`, a scalar or a vector), exactly its
    own block of thresholds (`lax.axis_index`, no gather of random bits) and the global sums of
    the GEMMs and of the error correction (`psum`).

    `x` is `(batch, seq, d_in)`, `w` is `(d_in, d_out)` and the output `(batch, seq, d_out)`.

    **Arguments:**

    - `batch`: axis (or tuple of axes, major to minor) sharding the batch of `x` (FSDP/DP).
    - `seq`: axis sharding the tokens of `x` (sequence/context parallelism).
    - `d_in`: axis sharding the contraction dimension (row-parallel TP: `x` on its last axis,
      `w` on its first; the output is summed over it).
    - `d_out`: axis sharding the output features (column-parallel TP: `w` on its last axis).

    !!! Example

        ```python
        axes = ShardAxes(batch="fsdp", d_out="tp")      # column-parallel layer
        f = jax.shard_map(
            lambda x, w, k: qdot(x, w, policy=policy, key=k, axes=axes), mesh=mesh,
            in_specs=(P("fsdp"), P(None, "tp"), P()), out_specs=P("fsdp", None, "tp"))
        ```
    """

    batch: AxisNames = eqx.field(default=None, static=True)
    seq: AxisNames = eqx.field(default=None, static=True)
    d_in: AxisNames = eqx.field(default=None, static=True)
    d_out: AxisNames = eqx.field(default=None, static=True)

    def __check_init__(self):
        seen: list[str] = []
        for role in ("batch", "seq", "d_in", "d_out"):
            for n in axis_names(getattr(self, role)):
                if n in seen:
                    raise ValueError(f"ShardAxes: mesh axis {n!r} is used for two dimensions.")
                seen.append(n)

    def names(self, *roles: Role) -> tuple[str, ...]:
        """The mesh axis names of the given roles, in order."""
        return tuple(n for r in roles for n in axis_names(getattr(self, r)))

    def size(self, role: Role) -> int:
        """How many shards split `role` (1 if unsharded)."""
        n = 1
        for name in axis_names(getattr(self, role)):
            n *= jax.lax.axis_size(name)
        return n

    def index(self, role: Role) -> Array | int:
        """This shard's index along `role`, axes linearized major to minor (0 if unsharded)."""
        idx: Array | int = 0
        for name in axis_names(getattr(self, role)):
            idx = idx * jax.lax.axis_size(name) + jax.lax.axis_index(name)
        return idx

    def psum(self, x: Array, *roles: Role) -> Array:
        """Sum `x` over the axes of `roles` (identity if none)."""
        names = self.names(*roles)
        return jax.lax.psum(x, names) if names else x

    def pmax(self, x: Array, *roles: Role) -> Array:
        """Maximum of `x` over the axes of `roles` (identity if none)."""
        names = self.names(*roles)
        return jax.lax.pmax(x, names) if names else x

    def block(self, local_shape: tuple[int, int, int]) -> Block:
        """The global block of a local `(b, s, d_out)` gradient shard."""
        b, s, d = local_shape
        nb, ns, nd = self.size("batch"), self.size("seq"), self.size("d_out")
        start = (
            self.index("batch") * b,
            self.index("seq") * s,
            self.index("d_out") * d,
        )
        if nb == ns == nd == 1:
            return Block.whole(local_shape)
        return Block((b * nb, s * ns, d * nd), start, local_shape)  # pyright: ignore


NO_AXES = ShardAxes()
"""No sharded axes: the unsharded (or `jax.jit`-partitioned) computation."""


def explicit_axes() -> tuple[str, ...]:
    """The ambient mesh's `AxisType.Explicit` axes: none outside a mesh, on `Auto` axes, and
    inside `jax.shard_map` over them (there they are `Manual`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)


def sharded_contraction(name: str, *operands: Array) -> ValueError:
    """The error of a product whose contracted dimension is sharded on a mesh of Explicit
    axes, naming the operands' shardings."""
    specs = ", ".join(str(jax.typeof(a).sharding.spec) for a in operands)
    return ValueError(
        f"{name}: on a mesh with Explicit axes the contracted dimension is sharded (operands "
        f"{specs}), so the product's sharding is ambiguous. Reshard an operand "
        "(`jax.sharding.reshard`), or call it inside "
        "`jax.sharding.auto_axes(..., out_sharding=...)`."
    )


def on_auto_axes(
    name: str, fn: Callable[..., Array], plain: Callable[..., Array], *args, out_sharding=None
) -> Array:
    """`fn(*args)`; on a mesh with `Explicit` axes, run with those axes `Auto`
    (`jax.sharding.auto_axes`) and the result sharded as `out_sharding`, by default as
    `plain(*args)`'s (the float product the quantized one stands for).

    Explicit sharding types every intermediate, and a contraction over a sharded dimension
    must then be told its output's sharding: the engine's GEMMs, sums and reshapes would each
    need one. On `Auto` axes XLA's partitioner chooses them, as under `jax.jit` with
    `NamedSharding` inputs, and the gradients come back with the operands' shardings (the
    transpose of `auto_axes`). Where `plain` itself has no defined output sharding (the
    contracted dimension sharded), `name` raises a `ValueError` that says what to do; the
    first two of `args` are the operands.
    """
    axes = explicit_axes()
    if not axes:
        return fn(*args)
    if out_sharding is None:
        try:
            out_sharding = jax.eval_shape(plain, *args).sharding
        except Exception as e:  # jax's ShardingTypeError, which jax does not export
            if type(e).__name__ != "ShardingTypeError":
                raise
            raise sharded_contraction(name, *args[:2]) from e
    auto = jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding)
    return typing.cast(Array, auto(*args))
