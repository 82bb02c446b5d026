"""Keys for models that call their layers without `key=`: bind one step key to every
`QuantLinear` of a model for one step (DESIGN.md section 4)."""

from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray

from ._linear import QuantLinear


_M = TypeVar("_M")


def _is_quant_linear(node: Any) -> bool:
    return isinstance(node, QuantLinear)


def _check_key(key: Any) -> None:
    if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        ok = key.shape == ()
    else:
        ok = getattr(key, "shape", None) == (2,) and getattr(key, "dtype", None) == "uint32"
    if not ok:
        raise ValueError(
            "bind_keys: `key` must be one PRNG key (e.g. `jax.random.key(0)`, or a key split "
            f"from the step key), got {getattr(key, 'shape', key)!r}."
        )


def _set_key(layer: QuantLinear, key: Any) -> QuantLinear:
    return eqx.tree_at(lambda l: l.key, layer, key, is_leaf=lambda n: n is None)


def bind_keys(model: _M, key: PRNGKeyArray) -> _M:
    """Give every [`s3req.QuantLinear`][] of `model` its own key for one step.

    Models that call their layers without `key=` (`equinox.nn.MLP`,
    `equinox.nn.MultiheadAttention`, a block of your own after [`s3req.quantize`][]) can then
    train with a stochastic policy: call this inside the training step, on the model you are
    differentiating, with a new key every step, as `equinox.nn.inference_mode` returns a model
    with a flag set. The `i`-th `QuantLinear` (in the order of `jax.tree_util.tree_leaves`)
    gets `fold_in(key, i)`; a layer stacked with `equinox.filter_vmap` (its weight has leading
    axes) gets one key per stacked layer, split from that, so the layers run by
    `jax.lax.scan` over the stack draw different thresholds too.

    The keys live in the returned model only: gradients with respect to it are `None` at the
    keys (so they apply to the unbound model), and the model the step returns, built from the
    unbound one, holds no key. A layer called with an explicit `key=` uses that key instead.

    A layer applied under `jax.vmap` (as `equinox.nn.MultiheadAttention` applies its
    projections to the tokens of one example) uses its bound key for every mapped row, so the
    rows share their thresholds, as `PhiBcast` shares them over an example. To draw per-token
    thresholds call the layer on whole `(batch, seq, d)` activations; when you `jax.vmap` a
    model over examples, bind a key per example inside the mapped function.

    **Arguments:**

    - `model`: any pytree holding `QuantLinear`s.
    - `key`: one PRNG key, new every step (e.g. `jax.random.fold_in(key, step)`).

    **Returns:**

    `model` with a key bound to every `QuantLinear`.

    !!! Example

        ```python
        @eqx.filter_value_and_grad
        def loss_fn(model, x, y, key):
            model = s3req.bind_keys(model, key)
            return jnp.mean((model(x) - y) ** 2)
        ```
    """
    _check_key(key)
    count = iter(range(1 << 31))

    def bind(node):
        if not _is_quant_linear(node):
            return node
        layer_key = jr.fold_in(key, next(count))
        stack = node.weight.shape[:-2]
        return _set_key(node, jr.split(layer_key, stack) if stack else layer_key)

    return jtu.tree_map(bind, model, is_leaf=_is_quant_linear)


def unbind_keys(model: _M) -> _M:
    """Remove the keys that [`s3req.bind_keys`][] bound to the `QuantLinear`s of `model`.

    Needed only for a model bound outside the step (for example to save it): the model a
    training step returns holds no key when the step binds its keys inside the loss.

    **Arguments:**

    - `model`: any pytree holding `QuantLinear`s.

    **Returns:**

    `model` with every `QuantLinear.key` set to `None`.
    """
    return jtu.tree_map(
        lambda n: _set_key(n, None) if _is_quant_linear(n) else n,
        model,
        is_leaf=_is_quant_linear,
    )
