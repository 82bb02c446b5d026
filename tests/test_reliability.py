"""Reliability guarantees of the public API (docs/guides/reliability.md): non-finite inputs
raise for every policy, tiny and huge magnitudes give the float result, higher-order
derivatives, key and bias checks."""

import functools as ft
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jaxtyping
import numpy as np
import pytest

from policies import Nearest, NoEC, Policy
from s3req import FP8_E5M2, INT4, MXFP4, qdot, qragged_dot, QuantLinear

from .helpers import ALL_CORRECTIONS, ALL_TOPOLOGIES, policy_id


# Every topology x correction (round-to-nearest takes no correction: Policy refuses it).
EVERY_POLICY = [
    Policy(t, c)
    for t, c in itertools.product(ALL_TOPOLOGIES, ALL_CORRECTIONS)
    if not (isinstance(t, Nearest) and not isinstance(c, NoEC))
]

B, S, H, D = 2, 64, 128, 384


def _dense(key):
    kx, kw, kg = jr.split(key, 3)
    x = jr.normal(kx, (B, S, H))
    w = jr.normal(kw, (H, D)) / np.sqrt(H)
    g = jr.normal(kg, (B, S, D))
    return x, w, g


def _qdot_vjp(policy):
    """`(y, dx, dw)` of `qdot` as one compiled program (positions of bad values are data)."""

    @eqx.filter_jit
    def run(x, w, g, key):
        y, pull = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
        return (y, *pull(g))

    return run


# One position per tensor at the start, inside and at the end of a row (XLA CPU's max
# reduction dropped a single NaN at every position of a (64, 128) row block).
X_AT = [(0, 0, 0), (1, 37, 77), (1, 63, 127)]
W_AT = [(0, 0), (70, 201), (127, 383)]
G_AT = [(0, 0, 0), (0, 41, 250), (1, 63, 383)]


@pytest.mark.parametrize("policy", EVERY_POLICY, ids=policy_id)
def test_qdot_one_nan_or_inf_anywhere_raises(policy, getkey):
    x, w, g = _dense(getkey())
    run = _qdot_vjp(policy)
    key = getkey()
    for y in run(x, w, g, key):  # the clean problem runs and is finite
        assert np.all(np.isfinite(np.asarray(y)))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        for i in X_AT:
            with pytest.raises(RuntimeError, match="x contains NaN or Inf"):
                jax.block_until_ready(run(x.at[i].set(bad), w, g, key))
        for i in W_AT:
            with pytest.raises(RuntimeError, match="w contains NaN or Inf"):
                jax.block_until_ready(run(x, w.at[i].set(bad), g, key))
        for i in G_AT:
            with pytest.raises(RuntimeError, match="upstream gradient contains NaN or Inf"):
                jax.block_until_ready(run(x, w, g.at[i].set(bad), key))


@pytest.mark.parametrize("fmt", [INT4, FP8_E5M2, MXFP4], ids=lambda f: f.describe())
def test_qdot_nan_in_gradient_raises_for_every_format(fmt, getkey):
    x, w, g = _dense(getkey())
    run = _qdot_vjp(Policy(ALL_TOPOLOGIES[3], ALL_CORRECTIONS[2], fmt))
    for i in G_AT:
        with pytest.raises(RuntimeError, match="upstream gradient contains NaN or Inf"):
            jax.block_until_ready(run(x, w, g.at[i].set(jnp.nan), getkey()))


def _ragged(key, n_examples=2, seq=64, top_k=2, E=4):
    """Expert-sorted rows of a random routing at a realistic size, with their global ids."""
    kr, kx, kw, kg = jr.split(key, 4)
    T = n_examples * seq
    experts = jnp.stack([jr.permutation(k, E)[:top_k] for k in jr.split(kr, T)])
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    gs = jnp.bincount(flat, length=E).astype(jnp.int32)
    n = T * top_k
    x = jr.normal(kx, (n, H))
    w = jr.normal(kw, (E, H, D)) / np.sqrt(H)
    g = jr.normal(kg, (n, D))
    return x, w, gs, g, order, (order // top_k) // seq, n_examples


@pytest.mark.parametrize("policy", EVERY_POLICY, ids=policy_id)
def test_qragged_dot_one_nan_anywhere_raises(policy, getkey):
    x, w, gs, g, row_id, example_id, n_ex = _ragged(getkey())

    @eqx.filter_jit
    def run(x, w, g, key):
        f = lambda x, w: qragged_dot(
            x,
            w,
            gs,
            policy=policy,
            key=key,
            row_id=row_id,
            example_id=example_id,
            num_examples=n_ex,
        )
        y, pull = jax.vjp(f, x, w)
        return (y, *pull(g))

    key = getkey()
    for y in run(x, w, g, key):
        assert np.all(np.isfinite(np.asarray(y)))
    n = x.shape[0]
    for i in [(0, 0), (n // 2, 77), (n - 1, H - 1)]:
        with pytest.raises(RuntimeError, match="x contains NaN or Inf"):
            jax.block_until_ready(run(x.at[i].set(jnp.nan), w, g, key))
    for i in [(0, 0, 0), (2, 70, 201), (3, H - 1, D - 1)]:
        with pytest.raises(RuntimeError, match="w contains NaN or Inf"):
            jax.block_until_ready(run(x, w.at[i].set(jnp.nan), g, key))
    for i in [(0, 0), (n // 2, 250), (n - 1, D - 1)]:
        with pytest.raises(RuntimeError, match="upstream gradient contains NaN or Inf"):
            jax.block_until_ready(run(x, w, g.at[i].set(jnp.nan), key))


HIGHER_ORDER = {
    "grad_of_grad": lambda f, a: jax.grad(lambda a: jnp.sum(jax.grad(f)(a) ** 2))(a),
    "jvp_of_grad": lambda f, a: jax.jvp(jax.grad(f), (a,), (jnp.ones_like(a),)),
    "hessian": lambda f, a: jax.hessian(f)(a),
    "jacfwd_of_grad": lambda f, a: jax.jacfwd(jax.grad(f))(a),
}


@pytest.mark.parametrize("order", HIGHER_ORDER)
@pytest.mark.parametrize("policy", [EVERY_POLICY[0], EVERY_POLICY[-1]], ids=policy_id)
def test_higher_order_derivatives_raise(order, policy, getkey):
    """Second derivatives through the quantized backward would differentiate its rounding
    (before the guard: finite numbers, relative error 1.3 against float): they raise at trace
    time, for `qdot` (with respect to x and to w), `QuantLinear` and `qragged_dot`. First
    derivatives of the same functions still work."""
    x, w, _ = _dense(getkey())
    key = getkey()
    lin = QuantLinear(H, D, policy=policy, key=getkey())
    xr, wr, gs, _, row_id, example_id, n_ex = _ragged(getkey())
    # (loss, argument); jax.hessian / jax.jacfwd build one tangent per input element, so their
    # argument is small: two tokens, or the bias of a layer whose weight gradient is taken.
    small = order in ("hessian", "jacfwd_of_grad")
    losses = {
        "qdot(x)": (lambda x: jnp.sum(jnp.sin(qdot(x, w, policy=policy, key=key))), x),
        "qdot(w)": (
            lambda w: jnp.sum(jnp.sin(qdot(x, w, policy=policy, key=key))),
            w[:, :2] if small else w,
        ),
        "QuantLinear": (lambda x: jnp.sum(jnp.sin(lin(x, key=key))), x),
        "qragged_dot": (
            lambda w: jnp.sum(
                jnp.sin(
                    qragged_dot(
                        xr,
                        w,
                        gs,
                        policy=policy,
                        key=key,
                        row_id=row_id,
                        example_id=example_id,
                        num_examples=n_ex,
                    )
                )
            ),
            wr[:, :, :2] if small else wr,
        ),
    }
    if small:  # under vmap, jax.lax.ragged_dot raises its own NotImplementedError first
        del losses["qragged_dot"]
    for name, (loss, arg) in losses.items():
        if small and name in ("qdot(x)", "QuantLinear"):
            arg = arg[0, :2]
        with pytest.raises(NotImplementedError, match="higher-order derivatives"):
            jax.eval_shape(ft.partial(HIGHER_ORDER[order], loss), arg)
        if order == "grad_of_grad":
            assert np.all(np.isfinite(np.asarray(jax.jit(jax.grad(loss))(arg)))), name


def test_forward_mode_of_qdot_is_a_jax_type_error(getkey):
    """`jax.jvp` of `qdot` itself (forward mode, first order) is refused by JAX: a custom VJP
    defines reverse mode only."""
    x, w, _ = _dense(getkey())
    with pytest.raises(TypeError, match="forward-mode autodiff"):
        jax.jvp(lambda x: qdot(x, w, policy=EVERY_POLICY[-1], key=jr.key(0)), (x,), (x,))


@pytest.mark.parametrize("topology", ALL_TOPOLOGIES[1:], ids=lambda t: policy_id(Policy(t)))
def test_bad_keys_raise_our_errors(topology, getkey, monkeypatch):
    """A Python int (or any non-key) as `key` is a TypeError naming `jax.random.key`; a batch
    of keys is our ValueError, for every stochastic topology (Independent included)."""
    x, w, _ = _dense(getkey())
    policy = Policy(topology)
    # The suite type-checks public signatures (jaxtyping's import hook), which would refuse a
    # non-key first; users without that hook get the error below.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    for bad in (0, 1234, "seed"):
        with pytest.raises(TypeError, match=r"jax\.random\.key\(seed\)"):
            qdot(x, w, policy=policy, key=bad)  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError, match=r"jax\.random\.key\(seed\)"):
            QuantLinear(H, D, policy=policy, key=getkey())(x, key=bad)  # pyright: ignore
    xr, wr, gs, _, row_id, example_id, n_ex = _ragged(getkey())
    with pytest.raises(TypeError, match=r"s3req.qragged_dot: `key` must be a JAX PRNG key"):
        qragged_dot(xr, wr, gs, policy=policy, key=7, row_id=row_id, example_id=example_id)  # pyright: ignore
    keys = jr.split(getkey(), 2)
    with pytest.raises(ValueError, match="single Threefry key"):
        jax.grad(lambda x: jnp.sum(qdot(x, w, policy=policy, key=keys)))(x)


def test_nan_bias_raises_and_plain_jit_message(getkey):
    """A NaN or Inf bias of `QuantLinear` raises. Under `eqx.filter_jit` the error is an
    `EquinoxRuntimeError` with our message; under plain `jax.jit` it is a `JaxRuntimeError`
    (`INTERNAL: CpuCallback error ...`) whose text contains the same message."""
    x, _, _ = _dense(getkey())
    layer = QuantLinear(H, D, policy=EVERY_POLICY[-1], key=getkey())
    key = getkey()
    for bad in (jnp.nan, jnp.inf):
        nan_bias = eqx.tree_at(lambda m: m.bias, layer, layer.bias.at[5].set(bad))  # pyright: ignore
        with pytest.raises(eqx.EquinoxRuntimeError, match="bias contains NaN or Inf"):
            jax.block_until_ready(eqx.filter_jit(lambda m, x: m(x, key=key))(nan_bias, x))
        with pytest.raises(jax.errors.JaxRuntimeError, match="bias contains NaN or Inf"):
            jax.block_until_ready(jax.jit(lambda m, x: m(x, key=key))(nan_bias, x))
    with pytest.raises(jax.errors.JaxRuntimeError, match="x contains NaN or Inf"):
        jax.block_until_ready(
            jax.jit(lambda m, x: m(x, key=key))(layer, x.at[0, 0, 0].set(jnp.nan))
        )
