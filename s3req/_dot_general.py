"""`dot_general`: `jax.lax.dot_general`'s signature with the maths of `qdot`, for models that
contract through `dot_general` or `einsum` (Flax layers, attention projections)."""

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ._interfaces import AbstractPolicy
from ._qdot import qdot
from ._sharding import explicit_axes, on_auto_axes


def _axes(dims: Sequence[int], ndim: int, side: str) -> tuple[int, ...]:
    out = []
    for a in dims:
        a = int(a)
        if not -ndim <= a < ndim:
            raise ValueError(f"s3req.dot_general: {side} axis {a} out of range for {ndim} dims.")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"s3req.dot_general: repeated {side} axes {tuple(dims)}.")
    return tuple(out)


def dot_general(
    lhs: Float[Array, "..."],
    rhs: Float[Array, "..."],
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    policy: AbstractPolicy | None,
    key: PRNGKeyArray | None = None,
    out_sharding: Any = None,
) -> Float[Array, "..."]:
    """`jax.lax.dot_general` with the INT8 forward and backward of [`s3req.qdot`][].

    The operands are transposed and reshaped to `qdot`'s layout and `qdot` does the maths:

    - the contracting axes (in `lhs`'s order, `rhs`'s matched pairwise) are `d_in`;
    - `rhs`'s other (free) axes are the output channels `d_out` (one weight scale each);
    - `lhs`'s free axes are the tokens (one scale and, for `Phi2D`, one threshold each): with
      two or more of them the leading one is the example (one threshold for `PhiBcast`, one
      error-correction group for S3R-EC) and the rest are its tokens; one free axis is one
      example of that many tokens, none is one token (as `qdot` reads 2-D and 1-D `x`);
    - batch axes (`dimension_numbers[1]`) are independent products: each batch element has
      its own scales, gradient step, error correction and key (split from `key`).

    On `qdot`'s own layout, `lhs` `(b, s, d_in)` contracting its last axis with axis 0 of
    `rhs` `(d_in, d_out)`, it is `qdot(lhs, rhs, policy=policy, key=key)` exactly.

    `precision` is accepted for compatibility and unused (the products are int8 with int32
    accumulation); `preferred_element_type` sets the output dtype (default: `lhs`'s).
    For a layer that calls its `dot_general` with the lax arguments only (Flax's
    `dot_general=`), bind the policy and a key with `functools.partial`, a new key per layer
    and per step; the adapters in `s3req.flax` draw them from a Flax RNG stream.

    **Arguments:**

    - `lhs`, `rhs`, `dimension_numbers`, `precision`, `preferred_element_type`: as in
      `jax.lax.dot_general`.
    - `policy`: a rounding policy, or `None` for `jax.lax.dot_general` itself. (Keyword only
      argument.)
    - `key`: a fresh key for the backward thresholds; required when the policy is stochastic.
      (Keyword only argument.)
    - `out_sharding`: the product's sharding on a mesh with `AxisType.Explicit` axes, as in
      `jax.lax.dot_general` (needed where the contracted axes are sharded); with a quantizing
      policy the maths runs with those axes `Auto` and the result is resharded to it (see
      [`s3req.qdot`][]). (Keyword only argument.)

    **Returns:**

    The product in `jax.lax.dot_general`'s layout: batch axes, then `lhs`'s free axes, then
    `rhs`'s free axes.
    """
    if policy is None:
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            out_sharding=out_sharding,
        )
    if out_sharding is not None and not explicit_axes():
        raise ValueError(
            "s3req.dot_general: `out_sharding` applies on a mesh with Explicit axes only (as in "
            "`jax.lax.dot_general`); on Auto axes shard the operands under `jax.jit` instead."
        )
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb = _axes(lc, lhs.ndim, "lhs"), _axes(lb, lhs.ndim, "lhs")
    rc, rb = _axes(rc, rhs.ndim, "rhs"), _axes(rb, rhs.ndim, "rhs")
    if len(lc) != len(rc) or len(lb) != len(rb) or set(lc) & set(lb) or set(rc) & set(rb):
        raise ValueError(
            f"s3req.dot_general: invalid dimension_numbers {dimension_numbers} for shapes "
            f"{lhs.shape} and {rhs.shape}."
        )
    for side_l, side_r, what in ((lc, rc, "contracting"), (lb, rb, "batch")):
        ls, rs = [lhs.shape[a] for a in side_l], [rhs.shape[a] for a in side_r]
        if ls != rs:
            raise ValueError(
                f"s3req.dot_general: {what} axes differ in size: lhs {ls} vs rhs {rs} "
                f"(shapes {lhs.shape} and {rhs.shape})."
            )

    def product(lhs, rhs, key):
        return _product(lhs, rhs, (lc, rc, lb, rb), policy, key)

    def plain(lhs, rhs, key):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers)

    y = on_auto_axes("s3req.dot_general", product, plain, lhs, rhs, key, out_sharding=out_sharding)
    return y if preferred_element_type is None else y.astype(preferred_element_type)


def _product(lhs, rhs, dims, policy, key) -> Array:
    """`qdot` on the operands transposed and reshaped to its layout, in `dot_general`'s."""
    lc, rc, lb, rb = dims
    lf = tuple(a for a in range(lhs.ndim) if a not in lc + lb)
    rf = tuple(a for a in range(rhs.ndim) if a not in rc + rb)
    batch = tuple(lhs.shape[a] for a in lb)
    free_l = tuple(lhs.shape[a] for a in lf)
    free_r = tuple(rhs.shape[a] for a in rf)
    h = math.prod(lhs.shape[a] for a in lc)
    d = math.prod(free_r)
    b = free_l[0] if len(free_l) >= 2 else 1
    s = math.prod(free_l) // b if free_l else 1
    # Identity permutations and unchanged shapes are no-ops (no copy in the jaxpr).
    x = jnp.transpose(lhs, lb + lf + lc)
    w = jnp.transpose(rhs, rb + rc + rf)
    if not batch:
        y = qdot(x.reshape(b, s, h), w.reshape(h, d), policy=policy, key=key)
    else:
        n = math.prod(batch)
        x4, w3 = x.reshape(n, b, s, h), w.reshape(n, h, d)
        if key is None:  # qdot raises for stochastic policies; deterministic ones need none
            y = jax.vmap(lambda xi, wi: qdot(xi, wi, policy=policy))(x4, w3)
        else:
            prod = lambda xi, wi, ki: qdot(xi, wi, policy=policy, key=ki)
            y = jax.vmap(prod)(x4, w3, jr.split(key, n))
    return y.reshape(batch + free_l + free_r)
