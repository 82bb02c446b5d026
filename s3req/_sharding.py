"""`ShardAxes`: which mesh axes shard the operands of a quantized matmul inside `shard_map`."""

import typing

import equinox as eqx
import jax
from jaxtyping import Array

from ._thresholds import Block


AxisNames = str | tuple[str, ...] | None
Role = typing.Literal["batch", "seq", "d_in", "d_out"]


def _names(axes: AxisNames) -> tuple[str, ...]:
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
            for n in _names(getattr(self, role)):
                if n in seen:
                    raise ValueError(f"ShardAxes: mesh axis {n!r} is used for two dimensions.")
                seen.append(n)

    def names(self, *roles: Role) -> tuple[str, ...]:
        """The mesh axis names of the given roles, in order."""
        return tuple(n for r in roles for n in _names(getattr(self, r)))

    def size(self, role: Role) -> int:
        """How many shards split `role` (1 if unsharded)."""
        n = 1
        for name in _names(getattr(self, role)):
            n *= jax.lax.axis_size(name)
        return n

    def index(self, role: Role) -> Array | int:
        """This shard's index along `role`, axes linearized major to minor (0 if unsharded)."""
        idx: Array | int = 0
        for name in _names(getattr(self, role)):
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
