"""`QuantLinear`: a linear layer whose matmul is `qdot`."""

import math
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ._backward import guard
from ._interfaces import AbstractPolicy
from ._qdot import qdot_t
from ._sharding import NO_AXES, ShardAxes


@typing.final
class QuantLinear(eqx.Module):
    """A linear layer `y = x W^T + b` whose matmul runs in INT8 forward and backward.

    Drop-in for `equinox.nn.Linear`: the same initialisation and the same weight layout
    `(out_features, in_features)`, but it acts on whole `(batch, seq, in_features)` activations
    (so per-token scales, per-token thresholds and the per-example error correction see the
    token structure) and takes a `key` for the stochastic rounding of its backward pass. The
    quantized matmul reads the weight in this `(out_features, in_features)` layout directly (it
    is `qdot(x, weight.T)` without materializing the transpose) and returns its gradient in it.
    Its field `key` is `None` except inside a training step, where [`s3req.bind_keys`][] binds
    a key for the step to a model that calls its layers without one.

    **Arguments:**

    - `in_features`, `out_features`: the layer's sizes.
    - `policy`: a rounding policy such as `Policy(Phi2D(), TwoWayEC())`, or `None` for a plain
      float layer. An ordinary field: swap it with `eqx.tree_at`.
    - `use_bias`: whether to add a (float) bias. Default `True`, as in `equinox.nn.Linear`.
    - `dtype`: parameter dtype (default float32).
    - `key`: initialisation key. (Keyword only argument.)

    !!! Example

        ```python
        import jax.random as jr
        from policies import Policy, Phi2D, TwoWayEC
        from s3req import QuantLinear

        init_key, data_key, step_key = jr.split(jr.key(seed := 0), 3)
        layer = QuantLinear(64, 128, policy=Policy(Phi2D(), TwoWayEC()), key=init_key)
        y = layer(jr.normal(data_key, (2, 16, 64)), key=step_key)   # (2, 16, 128)
        ```
    """

    weight: Float[Array, "out_features in_features"]
    bias: Float[Array, " out_features"] | None
    policy: AbstractPolicy | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    key: PRNGKeyArray | None = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        policy: AbstractPolicy | None,
        use_bias: bool = True,
        dtype: typing.Any = None,
        key: PRNGKeyArray,
    ):
        dtype = jnp.float32 if dtype is None else dtype
        wkey, bkey = jr.split(key)
        lim = 1 / math.sqrt(in_features)
        self.weight = jr.uniform(wkey, (out_features, in_features), dtype, -lim, lim)
        self.bias = jr.uniform(bkey, (out_features,), dtype, -lim, lim) if use_bias else None
        self.policy = policy
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.key = None

    def __check_init__(self):
        if self.policy is not None and not isinstance(self.policy, AbstractPolicy):
            raise TypeError(
                "QuantLinear: `policy` must be a Policy (e.g. Policy(Phi2D())) or None, got "
                f"{self.policy!r}. For a preset name use policies.preset(name)."
            )

    def __call__(
        self,
        x: Float[Array, "*batch in_features"],
        *,
        key: PRNGKeyArray | None = None,
        axes: ShardAxes | None = None,
    ) -> Float[Array, "*batch out_features"]:
        """Apply the layer.

        **Arguments:**

        - `x`: activations `(batch, seq, in_features)`, `(seq, in_features)` (one example) or
          `(in_features,)` (one token).
        - `key`: a fresh key for the backward thresholds; required when the policy is
          stochastic, unless a key was bound for this step with [`s3req.bind_keys`][] (an
          explicit `key` takes precedence). (Keyword only argument.)
        - `axes`: inside `jax.shard_map`, the mesh axes sharding `x` and the weight (see
          [`s3req.ShardAxes`][]); the local `in_features`/`out_features` are then the
          layer's shard. `None` under `jax.jit` or unsharded. (Keyword only argument.)

        **Returns:**

        `(..., out_features)` in the dtype of `x`.
        """
        if x.shape[-1:] != (self.weight.shape[1],):
            raise ValueError(
                f"QuantLinear expects inputs with last axis {self.weight.shape[1]}, got shape "
                f"{x.shape}."
            )
        key = self.key if key is None else key
        if key is None and self.policy is not None and self.policy.stochastic:
            raise ValueError(
                f"QuantLinear: policy {self.policy} rounds stochastically and needs a fresh key "
                "for every call: pass `key=`, or, for a model that calls its layers without "
                "keys, bind one step key inside the training step with "
                "`model = s3req.bind_keys(model, step_key)`."
            )
        y = qdot_t(x, self.weight, policy=self.policy, key=key, axes=axes)
        if self.bias is not None:
            # Inside `shard_map` the bias is a `d_out` shard: the flag is reduced over those
            # shards so that every shard raises together.
            bias = guard(
                self.bias,
                ~jnp.all(jnp.isfinite(self.bias)),
                NO_AXES if axes is None else axes,
                ("d_out",),
                "QuantLinear: bias contains NaN or Inf.",
            )
            y = y + jnp.broadcast_to(bias.astype(y.dtype), y.shape)
        return y

    @staticmethod
    def from_linear(linear: eqx.nn.Linear, policy: AbstractPolicy | None) -> "QuantLinear":
        """A `QuantLinear` holding the weights (and bias) of an `equinox.nn.Linear`."""
        if linear.in_features == "scalar" or linear.out_features == "scalar":
            raise ValueError("QuantLinear.from_linear: 'scalar' Linear layers are not supported.")
        abstract = eqx.filter_eval_shape(
            QuantLinear,
            linear.in_features,
            linear.out_features,
            policy=policy,
            use_bias=linear.use_bias,
            dtype=linear.weight.dtype,
            key=jax.ShapeDtypeStruct((2,), jnp.uint32),
        )
        return eqx.tree_at(
            lambda m: (m.weight, m.bias),
            abstract,
            (linear.weight, linear.bias),
            is_leaf=lambda n: n is None,
        )
