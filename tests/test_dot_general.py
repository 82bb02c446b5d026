"""`s3req.dot_general`: jax.lax.dot_general's signature, qdot's maths."""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import s3req
from policies import Independent, Nearest, Phi2D, PhiBcast, Policy, TwoWayEC


POLICY = Policy(Phi2D(), TwoWayEC())

# (lhs shape, rhs shape, dimension numbers): a dense layer, DenseGeneral / einsum attention
# projections, a weight stored (d_out, d_in), and batch dimensions in several positions.
CASES = {
    "dense": ((2, 6, 8), (8, 5), (((2,), (0,)), ((), ()))),
    "qkv_proj_btd,dnh": ((2, 6, 8), (8, 2, 3), (((2,), (0,)), ((), ()))),
    "out_proj_btnh,nhd": ((2, 6, 2, 4), (2, 4, 5), (((2, 3), (0, 1)), ((), ()))),
    "weight_out_in": ((3, 8), (5, 8), (((1,), (1,)), ((), ()))),
    "batch_bnqh,bnkh": ((2, 2, 6, 4), (2, 2, 5, 4), (((3,), (3,)), ((0, 1), (0, 1)))),
    "batch_moved": ((6, 3, 8), (8, 3, 5), (((2,), (0,)), ((1,), (1,)))),
}


def _canonical_perms(lhs_ndim, rhs_ndim, dn):
    (lc, rc), (lb, rb) = dn
    lf = tuple(a for a in range(lhs_ndim) if a not in lc + lb)
    rf = tuple(a for a in range(rhs_ndim) if a not in rc + rb)
    return tuple(lb) + lf + tuple(lc), tuple(rb) + tuple(rc) + rf


def _exact_operands(key, lhs_shape, rhs_shape, dn):
    """Integer operands whose every token (lhs) and output channel (rhs) has max |.| = 127
    over the contracting axes: the INT8 forward is then exact."""
    lp, rp = _canonical_perms(len(lhs_shape), len(rhs_shape), dn)
    (lc, _), (lb, _) = dn
    h = math.prod(lhs_shape[a] for a in lc)
    nb = math.prod(lhs_shape[a] for a in lb)
    k1, k2 = jr.split(key)
    # canonical layouts: lhs (batch, free, contract), rhs (batch, contract, free)
    lcan = tuple(lhs_shape[a] for a in lp)
    rcan = tuple(rhs_shape[a] for a in rp)
    lhs = jr.randint(k1, lcan, -126, 127).astype(jnp.float32)
    lhs = lhs.reshape(-1, h).at[:, 0].set(127.0).reshape(lcan)
    rhs = jr.randint(k2, rcan, -126, 127).astype(jnp.float32)
    rhs = rhs.reshape(nb, h, -1).at[:, 0, :].set(127.0).reshape(rcan)
    return jnp.transpose(lhs, tuple(np.argsort(lp))), jnp.transpose(rhs, tuple(np.argsort(rp)))


def _exact_cotangent(key, out_shape, n_batch):
    """An integer cotangent whose every batch element (an independent product) has
    max |.| = 127: the gradient step is 1 and every rounding is exact."""
    g = jr.randint(key, out_shape, -126, 127).astype(jnp.float32)
    nb = math.prod(out_shape[:n_batch])
    return g.reshape(nb, -1).at[:, 0].set(127.0).reshape(out_shape)


def _vjp(fn, lhs, rhs, g):
    """The output and both gradients, compiled (eager op-by-op dispatch is slow)."""

    @jax.jit
    def run(lhs, rhs, g):
        y, pull = jax.vjp(fn, lhs, rhs)
        return (y,) + pull(g)

    return run(lhs, rhs, g)


def test_canonical_case_is_bitwise_qdot(getkey):
    x = jr.normal(getkey(), (2, 16, 24))
    w = jr.normal(getkey(), (24, 12))
    g = jr.normal(getkey(), (2, 16, 12))
    key = getkey()
    dn = (((2,), (0,)), ((), ()))
    ours = _vjp(lambda a, b: s3req.dot_general(a, b, dn, policy=POLICY, key=key), x, w, g)
    ref = _vjp(lambda a, b: s3req.qdot(a, b, policy=POLICY, key=key), x, w, g)
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)
    # one example (seq, d_in), as qdot reads a 2-D x
    dn2 = (((1,), (0,)), ((), ()))
    ours = _vjp(lambda a, b: s3req.dot_general(a, b, dn2, policy=POLICY, key=key), x[0], w, g[0])
    ref = _vjp(lambda a, b: s3req.qdot(a, b, policy=POLICY, key=key), x[0], w, g[0])
    for a, b in zip(ours, ref):
        np.testing.assert_array_equal(a, b)


def test_attention_projections_are_qdot_on_the_flattened_layout(getkey):
    key = getkey()
    x = jr.normal(getkey(), (2, 6, 8))
    w = jr.normal(getkey(), (8, 2, 3))
    g = jr.normal(getkey(), (2, 6, 2, 3))
    dn = (((2,), (0,)), ((), ()))
    ours = _vjp(lambda a, b: s3req.dot_general(a, b, dn, policy=POLICY, key=key), x, w, g)
    flat = lambda a, b: s3req.qdot(a, b.reshape(8, 6), policy=POLICY, key=key).reshape(2, 6, 2, 3)
    for a, b in zip(ours, _vjp(flat, x, w, g)):
        np.testing.assert_array_equal(a, b)
    # the output projection contracts (heads, head_dim)
    x = jr.normal(getkey(), (2, 6, 2, 4))
    w = jr.normal(getkey(), (2, 4, 5))
    g = jr.normal(getkey(), (2, 6, 5))
    dn = (((2, 3), (0, 1)), ((), ()))
    ours = _vjp(lambda a, b: s3req.dot_general(a, b, dn, policy=POLICY, key=key), x, w, g)
    flat = lambda a, b: s3req.qdot(a.reshape(2, 6, 8), b.reshape(8, 5), policy=POLICY, key=key)
    for a, b in zip(ours, _vjp(flat, x, w, g)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("policy", [Policy(Nearest()), POLICY, Policy(Independent())], ids=str)
def test_exact_rounding_equals_float_dot_general(case, policy, getkey):
    lhs_shape, rhs_shape, dn = CASES[case]
    lhs, rhs = _exact_operands(getkey(), lhs_shape, rhs_shape, dn)
    ref_fn = lambda a, b: jax.lax.dot_general(a, b, dn)
    out_shape = jax.eval_shape(ref_fn, lhs, rhs).shape
    g = _exact_cotangent(getkey(), out_shape, len(dn[1][0]))
    key = getkey()
    ours = _vjp(lambda a, b: s3req.dot_general(a, b, dn, policy=policy, key=key), lhs, rhs, g)
    for a, b in zip(ours, _vjp(ref_fn, lhs, rhs, g)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["out_proj_btnh,nhd", "weight_out_in", "batch_bnqh,bnkh"])
@pytest.mark.parametrize("policy", [POLICY, Policy(PhiBcast(), TwoWayEC())], ids=str)
def test_gradients_are_unbiased_over_keys(case, policy, getkey):
    """Exact operands, a random cotangent: E over keys of both gradients is the float
    gradient; 5 sigma per element from the sample variance."""
    lhs_shape, rhs_shape, dn = CASES[case]
    lhs, rhs = _exact_operands(getkey(), lhs_shape, rhs_shape, dn)
    ref_fn = lambda a, b: jax.lax.dot_general(a, b, dn)
    out_shape = jax.eval_shape(ref_fn, lhs, rhs).shape
    g = jr.normal(getkey(), out_shape)
    _, dl_ref, dr_ref = _vjp(ref_fn, lhs, rhs, g)

    @jax.jit
    @jax.vmap
    def grads(key):
        f = lambda a, b: s3req.dot_general(a, b, dn, policy=policy, key=key)
        return jax.vjp(f, lhs, rhs)[1](g)

    n = 512
    dl, dr = grads(jr.split(getkey(), n))
    for sample, ref in ((dl, dl_ref), (dr, dr_ref)):
        mean, std = jnp.mean(sample, 0), jnp.std(sample, 0, ddof=1)
        assert float(jnp.max(std)) > 0  # the rounding really is stochastic
        tol = 5 * std / math.sqrt(n) + 1e-5 * jnp.max(jnp.abs(ref))
        assert bool(jnp.all(jnp.abs(mean - ref) <= tol)), float(jnp.max(jnp.abs(mean - ref) / tol))


def test_batch_elements_draw_their_own_thresholds(getkey):
    """Two batch elements with identical operands get different gradients (own keys)."""
    x = jnp.broadcast_to(jr.normal(getkey(), (6, 8)), (2, 6, 8))
    w = jnp.broadcast_to(jr.normal(getkey(), (8, 5)), (2, 8, 5))
    g = jnp.broadcast_to(jr.normal(getkey(), (6, 5)), (2, 6, 5))
    dn = (((2,), (1,)), ((0,), (0,)))
    key = getkey()
    _, dx, dw = _vjp(lambda a, b: s3req.dot_general(a, b, dn, policy=POLICY, key=key), x, w, g)
    assert not np.array_equal(dx[0], dx[1])
    assert not np.array_equal(dw[0], dw[1])


def test_float_policy_and_dtypes(getkey):
    x = jr.normal(getkey(), (2, 6, 8))
    w = jr.normal(getkey(), (8, 5))
    dn = (((2,), (0,)), ((), ()))
    np.testing.assert_array_equal(
        s3req.dot_general(x, w, dn, policy=None), jax.lax.dot_general(x, w, dn)
    )
    y = s3req.dot_general(
        x.astype(jnp.bfloat16),
        w.astype(jnp.bfloat16),
        dn,
        preferred_element_type=jnp.float32,
        policy=Policy(Nearest()),
    )
    assert y.dtype == jnp.float32 and y.shape == (2, 6, 5)


def test_errors(getkey):
    x = jr.normal(getkey(), (2, 6, 8))
    w = jr.normal(getkey(), (8, 5))
    with pytest.raises(ValueError, match="key"):
        s3req.dot_general(x, w, (((2,), (0,)), ((), ())), policy=POLICY)
    with pytest.raises(ValueError, match="differ in size"):
        s3req.dot_general(x, w, (((1,), (0,)), ((), ())), policy=POLICY, key=getkey())
    with pytest.raises(ValueError, match="out of range"):
        s3req.dot_general(x, w, (((3,), (0,)), ((), ())), policy=POLICY, key=getkey())
    with pytest.raises(ValueError, match="invalid dimension_numbers"):
        s3req.dot_general(x, w, (((2,), ()), ((), ())), policy=POLICY, key=getkey())
    with pytest.raises(ValueError, match="out_sharding"):
        s3req.dot_general(
            x, w, (((2,), (0,)), ((), ())), policy=POLICY, key=getkey(), out_sharding=object()
        )
    with pytest.raises(TypeError):  # jaxtyping in the suite, else qdot's dtype check
        s3req.dot_general(
            x.astype(jnp.int32), w, (((2,), (0,)), ((), ())), policy=POLICY, key=getkey()
        )
