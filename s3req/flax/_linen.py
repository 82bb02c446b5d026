"""Flax linen adapters: a `dot_general_cls` for `nn.Dense` / `nn.DenseGeneral`, and an
`Einsum` layer with `nn.Einsum`'s parameters."""

import functools as ft
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from jaxtyping import Array, Float

from .._dot_general import dot_general
from .._interfaces import AbstractPolicy
from ._stream import RNG_STREAM


def _draw_key(module: nn.Module, policy: AbstractPolicy | None, stream: str) -> Any:
    """A new key from the RNG stream for a stochastic policy (at `init` Flax falls back to
    the `params` stream), else `None`."""
    if policy is None or not policy.stochastic:
        return None
    if not (module.has_rng(stream) or module.is_initializing()):
        raise ValueError(
            f"s3req.flax: policy {policy} rounds stochastically and draws its keys from the "
            f"Flax RNG stream {stream!r}: pass `rngs={{{stream!r}: step_key}}` to `apply`, a "
            "new key every step."
        )
    return module.make_rng(stream)


class DotGeneral(nn.Module):
    """A linen module with `jax.lax.dot_general`'s call signature that runs
    [`s3req.dot_general`][] with a fresh key from the Flax RNG stream `rng_stream` on every
    call (each layer and each call draws its own: Flax folds in the module path and a call
    counter).

    Use it through [`s3req.flax.dot_general_cls`][]; a layer creates it as its submodule.
    At `init` the key comes from the `params` stream when `rng_stream` is not given; at
    `apply` a stochastic policy needs `rngs={rng_stream: step_key}`, a new key every step.

    **Arguments:**

    - `policy`: the rounding policy (`None`: `jax.lax.dot_general`).
    - `rng_stream`: the name of the RNG stream (default `"s3req"`).
    """

    policy: AbstractPolicy | None
    rng_stream: str = RNG_STREAM

    def __call__(
        self,
        lhs: Float[Array, "..."],
        rhs: Float[Array, "..."],
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
    ) -> Float[Array, "..."]:
        key = _draw_key(self, self.policy, self.rng_stream)
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


def dot_general_cls(
    policy: AbstractPolicy | None, *, rng_stream: str = RNG_STREAM
) -> Callable[[], DotGeneral]:
    """The `dot_general_cls` argument of `flax.linen.Dense` and `flax.linen.DenseGeneral` that
    makes the layer quantize with `policy`.

    **Arguments:**

    - `policy`: the rounding policy, e.g. `Policy(Phi2D(), TwoWayEC())`.
    - `rng_stream`: the RNG stream the keys come from (default `"s3req"`). (Keyword only
      argument.)

    **Returns:**

    A callable without arguments returning a [`s3req.flax.DotGeneral`][].

    !!! Example

        ```python
        layer = nn.Dense(64, dot_general_cls=s3req.flax.dot_general_cls(policy))
        params = layer.init(jr.key(0), x)
        y = layer.apply(params, x, rngs={"s3req": step_key})
        ```
    """
    return ft.partial(DotGeneral, policy, rng_stream)


class Einsum(nn.Module):
    """`flax.linen.Einsum` with its product quantized by [`s3req.dot_general`][].

    The same fields, parameters (`kernel` of `shape`, `bias` over the kernel's output axes)
    and initialisers as `flax.linen.Einsum` (which has no `dot_general` argument), plus
    `policy` and `rng_stream`; the keys come from the RNG stream as in
    [`s3req.flax.DotGeneral`][]. `einsum_str` is the equation `"inputs,kernel->output"`.
    """

    shape: Sequence[int]
    einsum_str: str
    policy: AbstractPolicy | None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.linear.default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    rng_stream: str = RNG_STREAM

    @nn.compact
    def __call__(self, inputs: Float[Array, "..."]) -> Float[Array, "..."]:
        spec = self.einsum_str.replace(" ", "")
        operands, out = spec.split("->")
        lhs_spec, rhs_spec = operands.split(",")
        if len(rhs_spec) != len(self.shape) or "." in spec:
            raise ValueError(
                f"s3req.flax.Einsum: explicit equation with a kernel of {len(self.shape)} axes "
                f"expected, got {self.einsum_str!r}."
            )
        kernel = self.param("kernel", self.kernel_init, tuple(self.shape), self.param_dtype)
        bias_axes = [c for c in out if c in rhs_spec]
        bias = None
        if self.use_bias:
            bshape = tuple(self.shape[rhs_spec.index(c)] for c in bias_axes)
            bias = self.param("bias", self.bias_init, bshape, self.param_dtype)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        # jnp.einsum compiles with its `_dot_general` as a static argument: draw the key
        # here and pass a plain function of the lax arguments.
        key = _draw_key(self, self.policy, self.rng_stream)
        dg = ft.partial(dot_general, policy=self.policy, key=key)
        y = jnp.einsum(spec, inputs, kernel, _dot_general=dg)
        if bias is not None:
            shape = tuple(self.shape[rhs_spec.index(c)] if c in rhs_spec else 1 for c in out)
            y = y + jnp.reshape(bias, shape)
        return y
