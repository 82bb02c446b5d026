"""Keep the activations of a sharded step split over the batch axes of the ambient mesh.

Under `jax.jit` with `NamedSharding` inputs, XLA's SPMD partitioner (GSPMD) chooses how to
split every intermediate. With FSDP weights (`d_model` split over `fsdp`) and a batch split
over `fsdp` it can choose to split the features of an activation instead of its batch, and
then every chip holds the whole batch (the attention scores of all sequences, all routed
rows of an MoE layer). The models pin the batch axis of their activations to the mesh's
batch axes with `jax.lax.with_sharding_constraint`, read from the ambient (abstract) mesh
that `jax.set_mesh` or `jax.sharding.use_abstract_mesh` sets (`s3req.train.make_train_step`
sets it when given a mesh). Without a mesh, or on a mesh without batch axes, nothing changes.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P


BATCH_AXES = ("data", "fsdp")
"""Mesh axes that split the batch when the ambient mesh has them, major to minor."""
TENSOR_AXIS = "tp"
"""The mesh axis that splits the features of the weights (tensor parallelism)."""


def _auto_mesh():
    """The ambient abstract mesh, or `None` without one or when an axis is not `Auto`
    (inside `shard_map` the manual axes are already split; explicit axes carry their
    shardings in the types)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
        return None
    return mesh


def batch_axes(batch: int) -> tuple[str, ...]:
    """The axes of the ambient mesh that split a batch of `batch` examples: those of
    `BATCH_AXES` it has, of size above 1, or `()` when there is no (all-`Auto`) mesh or the
    batch does not divide."""
    mesh = _auto_mesh()
    if mesh is None:
        return ()
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or batch % math.prod(mesh.shape[a] for a in axes):
        return ()
    return axes


def tensor_axis(features: int) -> str | None:
    """`TENSOR_AXIS` if the ambient mesh has it with a size above 1 that divides
    `features`, else `None`."""
    mesh = _auto_mesh()
    if mesh is None or TENSOR_AXIS not in mesh.axis_names:
        return None
    n = mesh.shape[TENSOR_AXIS]
    return TENSOR_AXIS if n > 1 and features % n == 0 else None


def shard_batch(x: jax.Array) -> jax.Array:
    """`x` with its leading (batch) axis constrained to the ambient mesh's batch axes and
    its other axes left to the partitioner; `x` itself when there are none."""
    axes = batch_axes(x.shape[0])
    if not axes:
        return x
    spec = P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def embed_tokens(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """`jnp.take(table, tokens, axis=0)` (rows of a `(vocab, d)` table), split over the batch
    on a mesh.

    Left to the partitioner, the lookup in a table split over its vocabulary gathers every
    token of the batch on every chip. On a mesh it runs inside `jax.shard_map`: the table is
    gathered over the batch axes (FSDP) and stays split over `tp`, each chip looks up its
    own tokens in its vocabulary slice (zero rows elsewhere) and the slices are summed over
    `tp` (one nonzero term: the rows themselves). A token outside `[0, vocab)` gives NaN
    rows, as `jnp.take` does."""
    axes = batch_axes(tokens.shape[0])
    if not axes:
        return jnp.take(table, tokens, axis=0)
    vocab = table.shape[0]
    tp = tensor_axis(vocab)

    def lookup(table, tokens):
        if tp is None:
            return jnp.take(table, tokens, axis=0)
        n = table.shape[0]
        local = tokens - jax.lax.axis_index(tp) * n
        mine = (local >= 0) & (local < n)
        rows = jnp.take(table, jnp.where(mine, local, 0), axis=0)
        rows = jax.lax.psum(jnp.where(mine[..., None], rows, 0), tp)
        valid = (tokens >= 0) & (tokens < vocab)
        return jnp.where(valid[..., None], rows, jnp.nan)

    batch = P(axes)
    return jax.shard_map(
        lookup,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(P(tp, None), batch),
        out_specs=batch,
    )(table, tokens)
