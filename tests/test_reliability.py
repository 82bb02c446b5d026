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

from policies import Nearest, NoEC, Policy, PRESETS, TwoWayEC
from s3req import FP8_E5M2, INT4, MXFP4, qdot, qragged_dot, QuantLinear

from .helpers import ALL_CORRECTIONS, ALL_TOPOLOGIES, policy_id, ragged_vjp


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


def _ragged_vjp(policy, gs, row_id, example_id, n_ex):
    @eqx.filter_jit
    def run(x, w, g, key):
        return ragged_vjp(policy, x, w, gs, g, key, row_id, example_id, num_examples=n_ex)

    return run


@pytest.mark.parametrize("policy", EVERY_POLICY, ids=policy_id)
def test_qragged_dot_one_nan_anywhere_raises(policy, getkey):
    x, w, gs, g, row_id, example_id, n_ex = _ragged(getkey())
    run = _ragged_vjp(policy, gs, row_id, example_id, n_ex)
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


@pytest.mark.parametrize("layer", ["qdot", "qragged_dot"])
def test_bad_x_raises_when_only_the_weight_gradient_is_used(layer, getkey):
    """A program that returns only dW (its forward output is dead code) still checks `x`: the
    backward reads the checked scales."""
    policy = Policy(ALL_TOPOLOGIES[3], ALL_CORRECTIONS[2])
    key = getkey()
    if layer == "qdot":
        x, w, _ = _dense(getkey())
        bad_row = (1, 2)
        f = ft.partial(qdot, policy=policy, key=key)
    else:
        x, w, gs, _, row_id, example_id, n_ex = _ragged(getkey())
        bad_row = (1,)
        ids = dict(row_id=row_id, example_id=example_id, num_examples=n_ex)
        f = ft.partial(qragged_dot, group_sizes=gs, policy=policy, key=key, **ids)
    dw = eqx.filter_jit(jax.grad(lambda w, x: jnp.sum(f(x, w))))
    assert np.all(np.isfinite(np.asarray(dw(w, x))))
    with pytest.raises(RuntimeError, match="x contains NaN or Inf"):
        jax.block_until_ready(dw(w, x.at[bad_row + (5,)].set(jnp.nan)))
    tiny = x.at[0].multiply(2.0**100).at[bad_row].multiply(2.0**-60)
    with pytest.raises(RuntimeError, match="the tokens of x span more than float32"):
        jax.block_until_ready(dw(w, tiny))


@pytest.mark.parametrize("layer", ["qdot", "qragged_dot"])
@pytest.mark.parametrize("name", ["rtne", "s3r", "s3r-ec-2way"])
def test_checks_are_one_conditional_per_output(name, layer, getkey):
    """A quantized matmul's run-time checks are one conditional in the forward and one per
    gradient (a GPU copies each conditional's predicate to the host), and a program that uses
    only dW has no dX check; `qragged_dot` adds one for its `group_sizes` and `example_id`. A
    NaN gradient still raises its own message there."""
    policy = PRESETS[name]
    key = getkey()
    if layer == "qdot":
        x, w, g = _dense(getkey())
        ids = {}
        f = ft.partial(qdot, policy=policy, key=key)
    else:
        # The routing is an argument, not a constant the compiler could check ahead of time.
        x, w, gs, g, row_id, example_id, n_ex = _ragged(getkey())
        ids = dict(group_sizes=gs, row_id=row_id, example_id=example_id)
        f = ft.partial(qragged_dot, policy=policy, key=key, num_examples=n_ex)

    def everything(x, w, g, ids):
        y, pull = jax.vjp(lambda x, w: f(x, w, **ids), x, w)
        return (y, *pull(g))

    programs = {"y, dX, dW": everything, "dW": lambda *a: everything(*a)[2]}
    hlo = {
        k: jax.jit(p).lower(x, w, g, ids).compile().as_text() or "" for k, p in programs.items()
    }
    own = {"qdot": 0, "qragged_dot": 1}[layer]
    assert {k: t.count(" conditional(") for k, t in hlo.items()} == {
        "y, dX, dW": 3 + own,
        "dW": 2 + own,
    }
    nan = g.at[0, 5].set(jnp.nan)
    with pytest.raises(RuntimeError, match="upstream gradient contains NaN or Inf"):
        jax.block_until_ready(eqx.filter_jit(programs["dW"])(x, w, nan, ids))


@pytest.mark.parametrize("name", ["rtne", "s3r", "s3r-ec-2way"])
def test_qragged_dot_bad_routing_raises(name, getkey):
    """`group_sizes` (non-negative, summing to the rows) and `example_id` (in `[0,
    num_examples)`) are checked at run time for every policy, also where the backward never
    reads the example ids (RTNE, S3R); with both wrong the `group_sizes` message wins."""
    x, w, gs, g, row_id, example_id, n_ex = _ragged(getkey())
    run = eqx.filter_jit(ft.partial(ragged_vjp, PRESETS[name], num_examples=n_ex))
    key = getkey()
    jax.block_until_ready(run(x, w, gs, g, key, row_id, example_id))
    bad_groups = {
        "short": gs.at[0].add(-1),
        "negative": gs.at[0].set(-1).at[1].add(gs[0] + 1),  # the sum is still right
    }
    bad_examples = {"too large": example_id.at[-1].set(n_ex), "negative": example_id.at[3].set(-1)}
    for groups in bad_groups.values():
        with pytest.raises(RuntimeError, match="group_sizes must be non-negative and sum"):
            jax.block_until_ready(run(x, w, groups, g, key, row_id, example_id))
    for examples in bad_examples.values():
        with pytest.raises(RuntimeError, match=r"example_id must lie in \[0, num_examples=2\)"):
            jax.block_until_ready(run(x, w, gs, g, key, row_id, examples))
    with pytest.raises(RuntimeError, match="group_sizes must be"):
        jax.block_until_ready(
            run(x, w, bad_groups["short"], g, key, row_id, bad_examples["negative"])
        )


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


# --- tiny and huge magnitudes ----------------------------------------------------------------

# Every preset (topology x correction); one of them runs by default, the others with -m slow.
_FAST_PRESETS = ("s3r-ec-2way",)
PRESET_PARAMS = [
    pytest.param(p, id=n, marks=() if n in _FAST_PRESETS else pytest.mark.slow)
    for n, p in PRESETS.items()
    if p is not None
]

# (k_x, k_w, k_g): x, w and G multiplied by 2**k. Every input element stays a normal float
# (the smallest |element| of a Gaussian sample of this size is about 2**-20 of the largest).
SCALINGS = [(0, 0, -100), (0, 0, 100), (-100, 0, 0), (0, -100, 0), (100, -60, 0), (-60, 100, -100)]


def _both_layers(policy, key, shape=(B, S, H, D)):
    """`{name: (make, x, w, g)}` of `qdot` and of `qragged_dot` at a realistic size; `make()`
    traces a fresh compiled `(y, dx, dw)` program."""
    b, s, h, d = shape
    kx, kw, kg, kr = jr.split(key, 4)
    dense = (
        lambda: _qdot_vjp(policy),
        jr.normal(kx, (b, s, h)),
        jr.normal(kw, (h, d)) / np.sqrt(h),
        jr.normal(kg, (b, s, d)),
    )
    xr, wr, gs, gr, row_id, example_id, n_ex = _ragged(kr)
    ragged = (lambda: _ragged_vjp(policy, gs, row_id, example_id, n_ex), xr, wr, gr)
    return {"qdot": dense, "qragged_dot": ragged}


def _assert_scaled(got, want, k):
    """`got == want * 2**k` bitwise where that is a normal float (with a margin of 2**8);
    elsewhere both are below `2**-118` in magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64) * 2.0**k
    normal = np.abs(want) >= 2.0**-118
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.all(np.abs(got[~normal]) < 2.0**-117)


@pytest.mark.parametrize("policy", PRESET_PARAMS)
def test_power_of_two_scaling_is_exact(policy, getkey):
    """Scaling x, w or G by a power of two scales y, dX and dW by the same powers of two,
    bitwise, from G ~ 1e-30 or 1e30 to operands of 2**-100 or 2**100: the scales are kept
    normalized by exact powers of two. (Before: G * 2**-100 gave dX = dW = 0, tiny x or w gave
    NaN.) An all-zero gradient gives zero gradients."""
    key = getkey()
    for name, (make, x, w, g) in _both_layers(policy, getkey()).items():
        run = make()
        y0, dx0, dw0 = run(x, w, g, key)
        for kx, kw, kg in SCALINGS:
            y, dx, dw = run(x * 2.0**kx, w * 2.0**kw, g * 2.0**kg, key)
            for got, want, k in ((y, y0, kx + kw), (dx, dx0, kw + kg), (dw, dw0, kx + kg)):
                _assert_scaled(got, want, k)
        _, dx, dw = run(x, w, jnp.zeros_like(g), key)
        assert np.all(np.asarray(dx) == 0) and np.all(np.asarray(dw) == 0), name


@pytest.mark.parametrize("policy", PRESET_PARAMS)
def test_normalization_changes_no_bit_in_normal_ranges(policy, getkey, monkeypatch):
    """With the power-of-two normalization switched off (every shift 0: the plain scales of
    DESIGN.md section 3), y, dX and dW of a normal-range problem are bitwise the same: the
    normalization only changes results where plain scales or products leave float32's normal
    range."""
    import s3req._backward as backward

    key = getkey()
    layers = _both_layers(policy, getkey())
    outputs = {name: make()(x, w, g, key) for name, (make, x, w, g) in layers.items()}
    monkeypatch.setattr(backward, "normalizing_shift", lambda *_: jnp.zeros((), jnp.int32))
    for name, (make, x, w, g) in layers.items():
        for a, b in zip(outputs[name], make()(x, w, g, key)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _pick(outputs, index, which: int):
    """`(y[index], outputs[which])` of the `(y, dX, dW)` of a vjp."""
    return outputs[0][index], outputs[which]


def _close_or_overflow(policy, outputs, wanted, bounds):
    """`outputs()` (a tuple) within `bounds` of `wanted` in relative error; or, for a policy
    with error correction only, the clear overflow error of the backward pass. Returns
    whether it raised."""
    try:
        got = jax.block_until_ready(outputs())
    except RuntimeError as e:
        assert not isinstance(policy.correction, NoEC), e
        assert "is not finite (beyond the range of its dtype)" in str(e)
        return True
    for a, b, bound in zip(got, wanted, bounds):
        assert np.all(np.isfinite(np.asarray(a)))
        assert _rel(a, b) <= bound
    return False


@pytest.mark.parametrize("policy", PRESET_PARAMS)
def test_tiny_and_huge_operands_match_float(policy, getkey):
    """The cases of issue 14 at (2, 64, 128) @ (128, 384): G * 1e-33, one output channel of w
    with max|w| = 1e-37 and one token of x with max|x| = 1e-36 (plain scales below the
    smallest normal float32, 1.2e-38), one element of x of 3e38. The outputs that the
    per-tensor gradient step can resolve are as close to the float ones as on the unscaled
    problem (at most 1.5 times its relative error); before, they were NaN, Inf or 0. With
    error correction, whose terms spread the large tokens' (channels') rounding error over
    the small ones, the tiny channel and token may instead raise the backward's overflow
    error, never return a non-finite gradient; `TwoWayEC` does raise on both."""
    run = _qdot_vjp(policy)
    x, w, g = _dense(getkey())
    key = getkey()

    def float_vjp(x, w, g):
        x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
        return x @ w, g @ w.T, np.einsum("bsh,bsd->hd", x, g)

    clean = [_rel(a, b) for a, b in zip(run(x, w, g, key), float_vjp(x, w, g))]
    # G * 1e-33: dX and dW
    _, dx, dw = run(x, w, g * 1e-33, key)
    _, fdx, fdw = float_vjp(x, w, g * 1e-33)
    assert _rel(dx, fdx) <= 1.5 * clean[1] and _rel(dw, fdw) <= 1.5 * clean[2]
    # a tiny output channel: y (all channels, and that one) and dX
    wt = w.at[:, 5].set(w[:, 5] / jnp.max(jnp.abs(w[:, 5])) * 1e-37)
    fy, fdx, _ = float_vjp(x, wt, g)
    raised = [
        _close_or_overflow(
            policy,
            lambda: _pick(run(x, wt, g, key), (..., 5), 1),
            (fy[..., 5], fdx),
            (1.5 * clean[0], 1.5 * clean[1]),
        )
    ]
    # a tiny token: y (that token) and dW
    xt = x.at[0, 3].set(x[0, 3] / jnp.max(jnp.abs(x[0, 3])) * 1e-36)
    fy, _, fdw = float_vjp(xt, w, g)
    raised.append(
        _close_or_overflow(
            policy,
            lambda: _pick(run(xt, w, g, key), (0, 3), 2),
            (fy[0, 3], fdw),
            (1.5 * clean[0], 1.5 * clean[2]),
        )
    )
    # one huge element: the forward (before, acc * s_x overflowed before the * s_w) is close;
    # its true dW exceeds float32, so the backward raises the overflow error for every policy
    xh = x.at[0, 3, 5].set(3e38)
    fy, _, fdw = float_vjp(xh, w, g)
    assert np.max(np.abs(fdw)) > np.finfo(np.float32).max
    y = qdot(xh, w, policy=policy, key=key)
    assert np.all(np.isfinite(np.asarray(y))) and _rel(y, fy) <= 1.5 * clean[0]
    with pytest.raises(RuntimeError, match="dW is not finite"):
        jax.block_until_ready(run(xh, w, g, key))
    if isinstance(policy.correction, TwoWayEC):
        assert raised == [True, True]


@pytest.mark.parametrize(
    "name", [pytest.param("s3r", marks=pytest.mark.slow), pytest.param("s3r-ec-2way")]
)
def test_qragged_dot_tiny_token_and_channel(name, getkey):
    """`qragged_dot` with one token (row) of x at max|x| = 1e-36 and one output channel of one
    expert at max|w| = 1e-37 (plain scales below the smallest normal float32): without error
    correction the gradients stay finite and as close to the float ones as on the unscaled
    problem (at most 1.5 times its relative error); `TwoWayEC`, whose terms spread the rounding
    error of the other rows (channels) of a segment over the tiny one, raises the backward's
    overflow error instead of returning a non-finite gradient."""
    policy = PRESETS[name]
    assert policy is not None
    x, w, gs, g, row_id, example_id, n_ex = _ragged(getkey())
    run = _ragged_vjp(policy, gs, row_id, example_id, n_ex)
    key = getkey()
    starts = np.cumsum(np.asarray(gs)) - np.asarray(gs)

    def float_vjp(x, w, g):
        x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
        e = np.repeat(np.arange(len(starts)), np.asarray(gs))
        y = np.einsum("nh,nhd->nd", x, w[e])
        dx = np.einsum("nd,nhd->nh", g, w[e])
        dw = np.stack([x[e == k].T @ g[e == k] for k in range(len(starts))])
        return y, dx, dw

    clean = [_rel(a, b) for a, b in zip(run(x, w, g, key), float_vjp(x, w, g))]
    r = int(starts[1]) + 3  # a row of expert 1: y of that row, and dW
    xt = x.at[r].set(x[r] / jnp.max(jnp.abs(x[r])) * 1e-36)
    fy, _, fdw = float_vjp(xt, w, g)
    raised = [
        _close_or_overflow(
            policy,
            lambda: (lambda out: (out[0][r], out[2]))(run(xt, w, g, key)),
            (fy[r], fdw),
            (1.5 * clean[0], 1.5 * clean[2]),
        )
    ]
    rows = slice(int(starts[2]), int(starts[3]))  # output channel 5 of expert 2, and dX
    wt = w.at[2, :, 5].set(w[2, :, 5] / jnp.max(jnp.abs(w[2, :, 5])) * 1e-37)
    fy, fdx, _ = float_vjp(x, wt, g)
    raised.append(
        _close_or_overflow(
            policy,
            lambda: (lambda out: (out[0][rows, 5], out[1]))(run(x, wt, g, key)),
            (fy[rows, 5], fdx),
            (1.5 * clean[0], 1.5 * clean[1]),
        )
    )
    assert raised == ([True, True] if isinstance(policy.correction, TwoWayEC) else [False, False])


def test_unrepresentable_scales_raise(getkey):
    """Scales float32 cannot hold next to each other raise a clear error: a token (or an
    output channel) more than 2**146 below the largest, and a gradient that is nonzero only
    where the scales are so small that its step would be below 2**-118."""
    run = _qdot_vjp(EVERY_POLICY[-1])
    x, w, g = _dense(getkey())
    key = getkey()
    with pytest.raises(RuntimeError, match="the tokens of x span more than float32"):
        jax.block_until_ready(
            run(x.at[0, 1].multiply(2.0**100).at[1, 2].multiply(2.0**-60), w, g, key)
        )
    with pytest.raises(RuntimeError, match="the output channels of w span more than float32"):
        jax.block_until_ready(
            run(x, w.at[:, 1].multiply(2.0**100).at[:, 2].multiply(2.0**-60), g, key)
        )
    # tokens and channels within range, but G lives only on a tiny token x a tiny channel
    xt, wt = x.at[1, 2].multiply(2.0**-100), w.at[:, 7].multiply(2.0**-60)
    gt = jnp.zeros_like(g).at[1, 2, 7].set(1.0)
    with pytest.raises(RuntimeError, match="gradient step max|s_x G s_w| / 127 is below"):
        jax.block_until_ready(run(xt, wt, gt, key))
    for out in run(xt, wt, g, key):  # the same operands with an ordinary gradient work
        assert np.all(np.isfinite(np.asarray(out)))
