"""`qragged_dot`: the quantized expert (ragged) matmul of mixture-of-experts layers.

The same maths as [`s3req.qdot`][] (DESIGN.md section 3), the same implementation
(`_backward.py`), on expert-sorted rows: the rows of `x` are grouped by expert
(`group_sizes`), expert `e` multiplies its rows by its own weight `w[e]`. Thresholds are
keyed by the global `(token, slot)` id of every row (a [`s3req.Rows`][] layout), never by its
sorted position, and the error correction runs over `(example, expert)` segments instead of
examples.
"""

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._backward import Check, MAX_TERMS, passed, quantized_matmul, Ragged
from ._gemms import chunk_group_sizes
from ._interfaces import AbstractPolicy
from ._qdot import check_key
from ._sharding import (
    axis_names,
    explicit_axes,
    NO_AXES,
    on_auto_axes,
    ShardAxes,
    sharded_contraction,
)


_I32 = jnp.int32


_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(x, w, group_sizes, policy, key, row_id, example_id, num_examples) -> None:
    name = "s3req.qragged_dot"
    check_key(name, key)
    for arg, arr in (("x", x), ("w", w)):
        if not any(arr.dtype == d for d in _FLOATS):
            raise TypeError(
                f"{name}: `{arg}` must be float32, bfloat16 or float16, got {arr.dtype}."
            )
    if x.ndim != 2:
        raise ValueError(f"{name}: `x` must have shape (rows, d_in), got {x.shape}.")
    if w.ndim != 3:
        raise ValueError(f"{name}: `w` must have shape (n_experts, d_in, d_out), got {w.shape}.")
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{name}: x has {x.shape[1]} input features but w expects {w.shape[1]} "
            f"(x: {x.shape}, w: {w.shape})."
        )
    if any(n == 0 for n in x.shape + w.shape):
        raise ValueError(f"{name}: empty operand (x: {x.shape}, w: {w.shape}).")
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"{name}: `group_sizes` must be integer with shape (n_experts,) = ({w.shape[0]},), "
            f"got {group_sizes.dtype}{list(group_sizes.shape)}."
        )
    if policy is None:
        return
    if policy.stochastic:
        if key is None:
            raise ValueError(
                f"{name}: policy {policy} rounds stochastically and needs a fresh `key=` for "
                "every call (e.g. split the step key per layer)."
            )
        if row_id is None or example_id is None or num_examples is None:
            raise ValueError(
                f"{name}: policy {policy} rounds stochastically: pass `row_id` (the global "
                "(token, slot) id of every row, e.g. token * top_k + slot), `example_id` "
                "(the batch index of every row) and `num_examples` (the batch size), so "
                "thresholds do not depend on the order and the error correction can average "
                "over (example, expert) segments."
            )
        if num_examples < 1:
            raise ValueError(f"{name}: num_examples must be positive, got {num_examples}.")
    for arg, ids in (("row_id", row_id), ("example_id", example_id)):
        if ids is not None and (
            ids.shape != (x.shape[0],) or not jnp.issubdtype(ids.dtype, jnp.integer)
        ):
            raise ValueError(
                f"{name}: `{arg}` must be integer with shape (rows,) = ({x.shape[0]},), got "
                f"{ids.dtype}{list(ids.shape)}."
            )


def qragged_dot(
    x: Float[Array, "n d_in"],
    w: Float[Array, "n_experts d_in d_out"],
    group_sizes: Int[Array, " n_experts"],
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    row_id: Int[Array, " n"] | None = None,
    example_id: Int[Array, " n"] | None = None,
    num_examples: int | None = None,
    axes: ShardAxes | None = None,
) -> Float[Array, "n d_out"]:
    """Quantized expert matmul: rows `group_sizes[e]` of `x` (sorted by expert) times `w[e]`.

    Forward: per-row scales for `x`, per-expert per-output-channel scales for `w`, round to
    nearest even, one int8 `jax.lax.ragged_dot` with int32 accumulation, rescale.

    Backward, as [`s3req.qdot`][]: both scales are folded into the upstream gradient, which is
    rounded once with one per-tensor step and the thresholds of `policy.topology`, keyed by
    `row_id` (the global `(token, slot)` id, so they do not depend on the routing order or on
    sharding). One int8 gradient feeds both ragged GEMMs (dX: `Q_e Wq_e^T`; dW: the rows of
    each group contracted with `ragged_dot_general`). `policy.correction` subtracts the
    structured rounding error with `(example, expert)` segments in place of examples.

    **Arguments:**

    - `x`: `(n, d_in)` rows sorted by expert.
    - `w`: `(n_experts, d_in, d_out)` expert weights.
    - `group_sizes`: rows of every expert, summing to `n`.
    - `policy`: a rounding policy, or `None` for a plain float `jax.lax.ragged_dot`.
    - `key`: a fresh key for the backward thresholds; required when the policy is stochastic.
    - `row_id`: global id of every row (e.g. `token * top_k + slot`); required when the policy
      is stochastic.
    - `example_id`: batch index of every row; required when the policy is stochastic.
    - `num_examples`: number of examples (`example_id < num_examples`); required when the
      policy is stochastic (the error correction averages over `(example, expert)`
      segments).
    - `axes`: inside `jax.shard_map`, the mesh axes that shard the operands (a
      [`s3req.ShardAxes`][]): `batch` and `seq` split the rows (each shard passes its own
      rows, their `group_sizes` and their global ids), `d_in` the columns of `x` and axis 1
      of `w`, `d_out` axis 2 of `w`. `None` under `jax.jit` sharding or unsharded. On a
      mesh of `AxisType.Explicit` axes the product is sharded as `x`'s rows and `w`'s last
      axis: where `x`'s rows are split (in equal blocks) and neither the contracted
      dimension nor the experts are, `qragged_dot` runs inside `jax.shard_map` with these
      `ShardAxes` itself, each shard taking its block of the global `group_sizes`;
      elsewhere with the mesh's axes `Auto` (docs/guides/scaling.md).

    (All but `x`, `w`, `group_sizes` are keyword only.)

    **Returns:**

    `(n, d_out)` in the dtype of `x`.

    `group_sizes` that do not sum to `n` or are negative, and non-finite `x`, `w` or upstream
    gradients raise an error (under `jax.jit`, an `equinox` runtime error); operands with a
    zero dimension (no rows, features or experts) a `ValueError`.
    """
    _check(x, w, group_sizes, policy, key, row_id, example_id, num_examples)
    args = (x, w, group_sizes, key, row_id, example_id)
    split = _rows_split(x, w) if axes is None else None
    if split is not None:
        return _per_shard(split, policy, num_examples, *args)
    ax = NO_AXES if axes is None else axes

    def product(x, w, group_sizes, key, row_id, example_id):
        return _product(x, w, group_sizes, policy, key, row_id, example_id, num_examples, ax)

    return on_auto_axes("s3req.qragged_dot", product, _explicit_plain, *args)


def _specs(x, w) -> tuple[tuple, tuple]:
    """The partition specs of `x` `(n, d_in)` and `w` `(n_experts, d_in, d_out)` on a mesh of
    Explicit axes, one entry per dimension (`None`: not split)."""
    xs = tuple(jax.typeof(x).sharding.spec) + (None,) * 2
    ws = tuple(jax.typeof(w).sharding.spec) + (None,) * 3
    return xs[:2], ws[:3]


def _rows_split(x, w) -> ShardAxes | None:
    """On a mesh of Explicit axes, the `ShardAxes` that run the expert GEMM per shard where
    `x`'s rows are split over Explicit axes (into equal blocks) and neither the contracted
    dimension nor `w`'s experts are (the rows as `batch`, `w`'s output axis as `d_out`);
    `None` elsewhere (`jax.jit` partitions the program there)."""
    explicit = explicit_axes()
    if not explicit:
        return None
    xs, ws = _specs(x, w)
    rows, cols = axis_names(xs[0]), axis_names(ws[2])
    mesh = jax.sharding.get_abstract_mesh()
    if (
        not rows
        or xs[1] is not None
        or ws[0] is not None
        or ws[1] is not None
        or not set(rows + cols) <= set(explicit)
        or set(rows) & set(cols)
        or x.shape[0] % math.prod(mesh.shape[a] for a in rows)
    ):
        return None
    return ShardAxes(batch=xs[0], d_out=ws[2])


def _per_shard(axes: ShardAxes, policy, num_examples, *args) -> Array:
    """The expert GEMM of `args` (`x, w, group_sizes, key, row_id, example_id`) inside
    `jax.shard_map` over the ambient mesh, split as `axes` (`_rows_split`) says: each shard
    multiplies its own block of rows, where `jax.jit`'s partitioner gathers every row to
    every chip for a ragged GEMM."""
    rows = P(axes.batch)

    def local(x, w, group_sizes, key, row_id, example_id):
        lo = axes.index("batch") * x.shape[0]
        return _product(
            x, w, group_sizes, policy, key, row_id, example_id, num_examples, axes, lo=lo
        )

    specs = (rows, P(None, None, axes.d_out), P(), P(), rows, rows)
    # On Explicit axes `shard_map` takes each input only as its `in_specs` entry shards it.
    args = tuple(a if a is None else jax.sharding.reshard(a, s) for a, s in zip(args, specs))
    mesh, out = jax.sharding.get_abstract_mesh(), P(axes.batch, axes.d_out)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out)(*args)


def _explicit_plain(x, w, group_sizes, *_) -> Array:
    """The float product on a mesh with Explicit axes, for its sharding: JAX infers none for
    `ragged_dot`; the rows are sharded as `x`'s rows, the columns as `w`'s output axis."""
    xs, ws = _specs(x, w)
    if xs[1] is not None or ws[1] is not None:
        raise sharded_contraction("s3req.qragged_dot", x, w)
    return jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, out_sharding=P(xs[0], ws[2]))


def _product(
    x, w, group_sizes, policy, key, row_id, example_id, num_examples, ax, lo=None
) -> Array:
    """`qragged_dot` after its trace-time checks: the routing checks and the engine. With
    `lo`, `x` is the block of rows from `lo` on of the rows `group_sizes` counts, split over
    `ax`'s `batch` axes in equal blocks (`_per_shard`)."""
    n = x.shape[0]
    total = n if lo is None else n * ax.size("batch")
    roles = ("batch", "seq", "d_in", "d_out")
    # The checks go on `group_sizes` and `example_id`, not on `x`: expert GEMMs of one `x`
    # then quantize it once (see `forward`).
    group_sizes = group_sizes.astype(_I32)
    checks = [
        Check(
            (jnp.sum(group_sizes) != total) | jnp.any(group_sizes < 0),
            roles,
            f"s3req.qragged_dot: group_sizes must be non-negative and sum to the {total} rows "
            "of x.",
        )
    ]
    if lo is not None:
        group_sizes = chunk_group_sizes(group_sizes, lo, lo + n)
    if policy is None:
        y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes * passed(checks, ax, _I32))
        return ax.psum(y, "d_in")
    if max(w.shape[1] * ax.size("d_in"), w.shape[2] * ax.size("d_out")) > MAX_TERMS:
        raise ValueError(
            f"s3req.qragged_dot: feature dimensions above {MAX_TERMS} would overflow int32 "
            f"accumulation, got w of shape {w.shape} per shard."
        )
    zeros = jnp.zeros((n,), _I32)
    rows = zeros if row_id is None else row_id.astype(_I32)
    examples = zeros if example_id is None else example_id.astype(_I32)
    if num_examples is not None:
        checks.append(
            Check(
                jnp.any((examples < 0) | (examples >= num_examples)),
                roles,
                f"s3req.qragged_dot: example_id must lie in [0, num_examples={num_examples}).",
            )
        )
    # One conditional for both: each is a host round trip on a GPU.
    one = passed(checks, ax, _I32)
    group_sizes, examples = group_sizes * one, examples * one
    layer = Ragged(
        group_sizes=group_sizes,
        row_id=rows,
        example_id=examples,
        axes=ax,
        num_examples=num_examples or 1,
    )
    return quantized_matmul(policy, layer, x, w, key)  # pyright: ignore
