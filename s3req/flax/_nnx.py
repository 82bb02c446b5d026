"""Flax NNX adapters: a `dot_general` for `nnx.Linear` / `nnx.LinearGeneral` and an
`einsum_op` for `nnx.Einsum`, drawing keys from an `nnx.Rngs` stream."""

import functools as ft
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from .._dot_general import dot_general
from .._interfaces import AbstractPolicy
from ._stream import RNG_STREAM


def _stream(policy: AbstractPolicy | None, rngs: nnx.Rngs, name: str) -> Any:
    if policy is None or not policy.stochastic:
        return None
    try:
        return rngs[name]
    except (AttributeError, KeyError) as e:
        raise ValueError(
            f"s3req.flax: policy {policy} draws its keys from the NNX RNG stream {name!r}: "
            f"create the model with `nnx.Rngs(..., {name}=seed)`."
        ) from e


class NnxDotGeneral(nnx.Module):
    """The `dot_general` argument of `flax.nnx.Linear` (and `nnx.LinearGeneral`): a module
    with `jax.lax.dot_general`'s call signature that runs [`s3req.dot_general`][] with a new
    key from the RNG stream `rng_stream` of `rngs` on every call.

    The stream's counter is model state: it advances on every call (every layer and every
    step draws its own key) and `nnx.jit` carries it from step to step. Layers may share one
    `rngs`.

    **Arguments:**

    - `policy`: the rounding policy (`None`: `jax.lax.dot_general`).
    - `rngs`: an `nnx.Rngs` with the stream `rng_stream` (or a `default` stream).
    - `rng_stream`: the stream's name (default `"s3req"`). (Keyword only argument.)

    !!! Example

        ```python
        rngs = nnx.Rngs(params=0, s3req=1)
        layer = nnx.Linear(16, 32, dot_general=NnxDotGeneral(policy, rngs), rngs=rngs)
        ```
    """

    def __init__(
        self, policy: AbstractPolicy | None, rngs: nnx.Rngs, *, rng_stream: str = RNG_STREAM
    ):
        self.policy = policy
        self.stream = _stream(policy, rngs, rng_stream)

    def __call__(
        self,
        lhs: Float[Array, "..."],
        rhs: Float[Array, "..."],
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Float[Array, "..."]:
        key = None if self.stream is None else self.stream()
        return dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            policy=self.policy,
            key=key,
            out_sharding=out_sharding,
        )


class NnxEinsum(nnx.Module):
    """The `einsum_op` argument of `flax.nnx.Einsum`: `jnp.einsum` whose products run
    through [`s3req.flax.NnxDotGeneral`][] (a new key from the stream on every call).

    **Arguments:** as for [`s3req.flax.NnxDotGeneral`][].
    """

    def __init__(
        self, policy: AbstractPolicy | None, rngs: nnx.Rngs, *, rng_stream: str = RNG_STREAM
    ):
        self.dot_general = NnxDotGeneral(policy, rngs, rng_stream=rng_stream)

    def __call__(
        self,
        subscripts: str,
        lhs: Float[Array, "..."],
        rhs: Float[Array, "..."],
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Float[Array, "..."]:
        # jnp.einsum compiles with its `_dot_general` as a static argument: draw the key
        # here and pass a plain function of the lax arguments.
        inner = self.dot_general
        key = None if inner.stream is None else inner.stream()
        return jnp.einsum(
            subscripts,
            lhs,
            rhs,
            precision=precision,
            preferred_element_type=preferred_element_type,
            _dot_general=ft.partial(dot_general, policy=inner.policy, key=key),
            out_sharding=out_sharding,
        )
