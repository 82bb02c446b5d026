"""Unmodified Equinox models after `s3req.quantize`, trained with one step key
(`s3req.bind_keys`)."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import s3req
from policies import Nearest, Phi2D, PhiBcast, Policy, TwoWayEC
from s3req import QuantLinear
from s3req._keys import _check_key


POLICY = Policy(Phi2D(), TwoWayEC())


def _key_leaves(tree) -> list:
    return [
        l
        for l in jax.tree_util.tree_leaves(tree)
        if isinstance(l, jax.Array) and jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key)
    ]


def _train(model, loss, data, steps, key, lr=3e-3):
    """Adam steps on an unmodified model; the keys are bound inside the loss."""
    opt = optax.adam(lr)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, key):
        def bound_loss(model):
            return loss(s3req.bind_keys(model, key), *data)

        value, grads = eqx.filter_value_and_grad(bound_loss)(model)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
            updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    losses = []
    for k in jr.split(key, steps):
        model, state, value = step(model, state, k)
        losses.append(float(value))
    return model, losses


def test_missing_key_names_the_fix(getkey):
    mlp = s3req.quantize(eqx.nn.MLP(8, 4, 16, 1, key=getkey()), POLICY)
    with pytest.raises(ValueError, match=r"s3req\.bind_keys\(model, step_key\)"):
        mlp(jnp.ones((2, 3, 8)))
    # round-to-nearest needs no key
    s3req.quantize(eqx.nn.MLP(8, 4, 16, 1, key=getkey()), Policy(Nearest()))(jnp.ones(8))


def test_bind_keys_rejects_a_batch_of_keys(getkey):
    mlp = s3req.quantize(eqx.nn.MLP(8, 4, 16, 1, key=getkey()), POLICY)
    # (the suite's jaxtyping checks raise a TypeError first; without them, this ValueError)
    with pytest.raises((TypeError, ValueError)):
        s3req.bind_keys(mlp, jr.split(getkey(), 3))
    with pytest.raises(ValueError, match="one PRNG key"):
        _check_key(jr.split(getkey(), 3))
    with pytest.raises(ValueError, match="one PRNG key"):
        _check_key(jnp.zeros((3,), jnp.uint32))
    # legacy uint32 keys work
    bound = s3req.bind_keys(mlp, jr.PRNGKey(0))
    assert bound(jnp.ones((1, 2, 8))).shape == (1, 2, 4)


def test_mlp_trains_and_saved_model_holds_no_key(getkey):
    mlp = s3req.quantize(eqx.nn.MLP(16, 4, 64, 2, key=getkey()), POLICY)
    x = jr.normal(getkey(), (8, 16, 16))
    y = jnp.tanh(x[..., :4] * 2.0)

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)  # MLP called on (batch, seq, d) directly

    trained, losses = _train(mlp, loss, (x, y), 30, getkey())
    assert losses[-1] < 0.5 * losses[0], losses
    assert not _key_leaves(trained)
    assert all(l.key is None for l in trained.layers)  # pyright: ignore[reportAttributeAccessIssue]
    # serialise and load back: parameters only
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, trained)
    buf.seek(0)
    loaded = eqx.tree_deserialise_leaves(buf, mlp)
    for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(trained)):
        np.testing.assert_array_equal(a, b)
    # a model bound outside the step is cleaned with unbind_keys
    bound = s3req.bind_keys(trained, getkey())
    assert len(_key_leaves(bound)) == 3
    assert not _key_leaves(s3req.unbind_keys(bound))


def test_multihead_attention_trains(getkey):
    d, heads, B, S = 16, 2, 4, 8
    mha = eqx.nn.MultiheadAttention(heads, d, key=getkey())
    qmha = s3req.quantize(mha, Policy(PhiBcast(), TwoWayEC()))
    assert isinstance(qmha.query_proj, QuantLinear)
    x = jr.normal(getkey(), (B, S, d))
    target = jnp.roll(x, 1, axis=1)

    def loss(model, x, target, key):
        # eqx.nn.MultiheadAttention acts on one example; a key per example.
        out = jax.vmap(lambda xi, ki: s3req.bind_keys(model, ki)(xi, xi, xi))(
            x, jr.split(key, x.shape[0])
        )
        return jnp.mean((out - target) ** 2)

    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(qmha, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, key):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, target, key)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = opt.update(grads, state)
        return eqx.apply_updates(model, updates), state, value

    losses = []
    model = qmha
    for k in jr.split(getkey(), 25):
        model, state, value = step(model, state, k)
        losses.append(float(value))
    assert losses[-1] < 0.7 * losses[0], losses
    assert not _key_leaves(model)


class _Twin(eqx.Module):
    """A user's block: two layers with the same weights, applied to the same input."""

    a: eqx.nn.Linear
    b: eqx.nn.Linear

    def __init__(self, key):
        self.a = eqx.nn.Linear(32, 24, key=key)
        self.b = eqx.nn.Linear(32, 24, key=key)

    def __call__(self, x):
        return self.a(x), self.b(x)


@eqx.filter_jit
def _twin_grads(model, x, g, key):
    def f(model):
        ya, yb = s3req.bind_keys(model, key)(x)
        return jnp.sum(ya * g) + jnp.sum(yb * g)

    return eqx.filter_grad(f)(model)


def test_layers_and_steps_draw_different_thresholds(getkey):
    block = s3req.quantize(_Twin(getkey()), POLICY)
    np.testing.assert_array_equal(block.a.weight, block.b.weight)
    x = jr.normal(getkey(), (2, 8, 32))
    g = jr.normal(getkey(), (2, 8, 24))
    k1, k2 = getkey(), getkey()
    g1 = _twin_grads(block, x, g, k1)
    # the two layers see identical inputs, weights and cotangents: only their keys differ
    assert not np.array_equal(g1.a.weight, g1.b.weight)
    # the same step key again gives the same gradients; another step's key other ones
    again = _twin_grads(block, x, g, k1)
    np.testing.assert_array_equal(g1.a.weight, again.a.weight)
    g2 = _twin_grads(block, x, g, k2)
    assert not np.array_equal(g1.a.weight, g2.a.weight)
    assert not np.array_equal(g1.b.weight, g2.b.weight)
    # gradients are None at the keys, so they apply to the unbound model
    assert g1.a.key is None


def test_scanned_stack_draws_different_thresholds_per_layer_and_trains(getkey):
    L, d = 4, 16
    init = getkey()
    # eqx.filter_vmap builds the stack; all layers start from the same weights
    stack = eqx.filter_vmap(lambda k: eqx.nn.Linear(d, d, key=init))(jr.split(getkey(), L))
    stack = s3req.quantize(stack, POLICY)
    assert stack.weight.shape == (L, d, d)
    x = jr.normal(getkey(), (2, 8, d))
    g = jr.normal(getkey(), (2, 8, d))

    def each_layer(stack, x):
        """Every stacked layer applied to the same x, under jax.lax.scan."""
        dynamic, static = eqx.partition(stack, eqx.is_array)

        def body(carry, layer):
            return carry, eqx.combine(layer, static)(x)

        return jax.lax.scan(body, None, dynamic)[1]

    @eqx.filter_jit
    def grads(stack, key):
        f = lambda s: jnp.sum(each_layer(s3req.bind_keys(s, key), x) * g[None])
        return eqx.filter_grad(f)(stack)

    w = grads(stack, getkey()).weight
    for i in range(L):
        for j in range(i):
            assert not np.array_equal(w[i], w[j]), (i, j)

    # a residual stack run by scan trains
    def forward(stack, x):
        dynamic, static = eqx.partition(stack, eqx.is_array)

        def body(h, layer):
            return h + jnp.tanh(eqx.combine(layer, static)(h)), None

        return jax.lax.scan(body, x, dynamic)[0]

    target = jnp.sin(x)
    loss = lambda s, x, t: jnp.mean((forward(s, x) - t) ** 2)
    trained, losses = _train(stack, loss, (x, target), 30, getkey(), lr=1e-2)
    assert losses[-1] < 0.5 * losses[0], losses
    assert not _key_leaves(trained)
