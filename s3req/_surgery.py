"""Model surgery: swap the `equinox.nn.Linear` layers of any model for `QuantLinear`s."""

from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from ._interfaces import AbstractPolicy
from ._linear import QuantLinear


_M = TypeVar("_M")


def _is_linear(node: Any) -> bool:
    return isinstance(node, eqx.nn.Linear)


def quantize(
    model: _M,
    policy: AbstractPolicy | None,
    *,
    where: Callable[[_M], Any] | None = None,
) -> _M:
    """Replace `equinox.nn.Linear` layers of `model` by `QuantLinear`s with the same weights.

    **Arguments:**

    - `model`: any pytree (usually an `equinox.Module`).
    - `policy`: the rounding policy of the new layers (`None`: plain float `QuantLinear`s).
    - `where`: as in `equinox.tree_at`, a function from the model to the layer or a sequence of
      layers to replace. Default: every `equinox.nn.Linear` in the model. (Keyword only argument.)

    **Returns:**

    The new model. The replaced layers must now be called with activations shaped
    `(batch, seq, d)`, `(seq, d)` or `(d,)`, and with `key=` when the policy is stochastic.

    !!! Example

        ```python
        mlp = eqx.nn.MLP(8, 4, 32, 2, key=jr.key(seed := 0))
        qmlp = s3req.quantize(mlp, Policy(Nearest()))
        ```
    """

    def swap(node):
        if not _is_linear(node):
            raise TypeError(f"quantize: `where` selected {type(node).__name__}, not a Linear.")
        return QuantLinear.from_linear(node, policy)

    if where is None:
        return jtu.tree_map(
            lambda n: QuantLinear.from_linear(n, policy) if _is_linear(n) else n,
            model,
            is_leaf=_is_linear,
        )
    return eqx.tree_at(where, model, replace_fn=swap)
