"""QuantLinear and model surgery."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import s3req
from policies import Nearest, Phi2D, Policy, TwoWayEC
from s3req import QuantLinear

from .helpers import ALL_POLICIES, policy_id


def test_float_layer_matches_equinox_linear(getkey):
    key = getkey()
    ql = QuantLinear(16, 8, policy=None, key=key)
    lin = eqx.nn.Linear(16, 8, key=key)
    np.testing.assert_array_equal(ql.weight, lin.weight)
    np.testing.assert_array_equal(ql.bias, lin.bias)
    x = jr.normal(getkey(), (3, 5, 16))
    ref = jax.vmap(jax.vmap(lin))(x)
    np.testing.assert_allclose(ql(x), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ql(x[0, 0]), lin(x[0, 0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_layer_grad(policy, getkey):
    layer = QuantLinear(16, 8, policy=policy, use_bias=False, key=getkey())
    x = jr.normal(getkey(), (2, 4, 16))

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(layer, x, key):
        return jnp.sum(layer(x, key=key) ** 2)

    g = grad(layer, x, getkey())
    ref = eqx.filter_grad(lambda l, x: jnp.sum((x @ l.weight.T) ** 2))(layer, x)
    rel = jnp.linalg.norm(g.weight - ref.weight) / jnp.linalg.norm(ref.weight)
    assert rel < 0.1


def test_layer_errors(getkey):
    layer = QuantLinear(16, 8, policy=Policy(Phi2D()), key=getkey())
    with pytest.raises(ValueError, match="last axis 16"):
        layer(jnp.ones((2, 3, 15)), key=getkey())
    with pytest.raises(ValueError, match="key"):
        layer(jnp.ones((2, 3, 16)))
    with pytest.raises(TypeError, match="Policy"):
        QuantLinear(4, 4, policy="s3r", key=getkey())  # pyright: ignore


def test_policy_is_swappable(getkey):
    layer = QuantLinear(16, 8, policy=None, key=getkey())
    q = eqx.tree_at(
        lambda l: l.policy, layer, Policy(Phi2D(), TwoWayEC()), is_leaf=lambda x: x is None
    )
    assert q.policy == Policy(Phi2D(), TwoWayEC())
    assert q(jnp.ones((1, 2, 16)), key=getkey()).shape == (1, 2, 8)


def test_quantize_surgery(getkey):
    mlp = eqx.nn.MLP(8, 4, 32, 2, key=getkey())
    qmlp = s3req.quantize(mlp, Policy(Nearest()))
    assert all(isinstance(l, QuantLinear) for l in qmlp.layers)
    for l, q in zip(mlp.layers, qmlp.layers):
        np.testing.assert_array_equal(l.weight, q.weight)
        np.testing.assert_array_equal(l.bias, q.bias)
    x = jr.normal(getkey(), (8,))
    # round-to-nearest INT8 is close to the float MLP
    np.testing.assert_allclose(qmlp(x), mlp(x), rtol=0.05, atol=0.05)
    # `where` selects a subset
    part = s3req.quantize(mlp, Policy(Nearest()), where=lambda m: m.layers[0])
    assert isinstance(part.layers[0], QuantLinear)
    assert isinstance(part.layers[1], eqx.nn.Linear)
    with pytest.raises(TypeError, match="not a Linear"):
        s3req.quantize(mlp, None, where=lambda m: m.layers[0].weight)
