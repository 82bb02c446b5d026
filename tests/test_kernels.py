"""The XLA:CPU kernel of the dense layer's statistics against the reference path.

Both compute the same maths (`s3req/_backward.py`); the CPU kernel (`s3req/_kernels_cpu.py`)
writes the sums of the codes as thin int8 GEMMs (exact), the sums of `G'` as mat-vecs and
the error-correction products with `Wq` and `Xq` as int8 GEMMs on base-128 digits. So:
without error correction they are the same arithmetic and agree bit for bit; with it, the
reference sums the error `E = Delta Q - G'` element by element and the kernel sums the codes
(exactly) and `G'` apart, float32 sums of `n` terms in another order (each below `(n + 1)
2**-24 sum|G'|` from the exact sum, the `+ 1` the rounding of each `Delta Q - G'`), and the
digit products carry a remainder below `2**-21` of each factor's largest entry, so the
corrected float32 gradients agree to within `2**-16` of their largest entry (a bound with a
wide margin over both effects: the measured gap is near `2**-22`); a bf16 dX may in addition
differ by one bf16 ulp (`2**-7` of the element) where that float difference flips its final
rounding.
"""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import s3req._backward as backward
from policies import MXFP4, NoEC, Phi2D, Policy, TwoWayEC
from s3req import qdot
from s3req._kernels_cpu import code_sums, SUM_ALIGN
from s3req._qdot import qdot_t

from .helpers import ALL_POLICIES, dot_eqns, policy_id


def _grads(policy, x, w, g, key, kernels, transposed=False):
    """(y, dX, dW) of qdot traced with the given statistics kernel."""
    old = backward.KERNELS
    backward.KERNELS = kernels
    try:
        f = jax.jit(
            lambda x, w, g, key: _vjp(policy, x, w, g, key, transposed),
        )
        return f(x, w, g, key)
    finally:
        backward.KERNELS = old


def _vjp(policy, x, w, g, key, transposed):
    fn = (lambda x, w: qdot_t(x, w, policy=policy, key=key)) if transposed else None
    fn = fn or (lambda x, w: qdot(x, w, policy=policy, key=key))
    y, pull = jax.vjp(fn, x, w)
    return (y, *pull(g))


POLICIES = ALL_POLICIES + [Policy(Phi2D(), TwoWayEC(), fmt=MXFP4)]


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
@pytest.mark.parametrize("shape", [(3, 16, 48, 64), (1, 32, 32, 64)], ids=str)
def test_cpu_kernel_agrees_with_reference(policy, shape, getkey):
    B, S, H, D = shape
    x = jr.normal(getkey(), (B, S, H), jnp.bfloat16)
    w = jr.normal(getkey(), (H, D))
    g = (jr.normal(getkey(), (B, S, D)) * jnp.exp(jr.normal(getkey(), (B, S, D)))).astype(
        jnp.bfloat16
    )
    key = getkey()
    ref = _grads(policy, x, w, g, key, "reference")
    cpu = _grads(policy, x, w, g, key, "cpu")
    np.testing.assert_array_equal(ref[0], cpu[0])  # the forward has no kernel
    for a, b in zip(ref[1:], cpu[1:]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if isinstance(policy.correction, NoEC):
            np.testing.assert_array_equal(a, b)
        else:  # and one bf16 ulp (2**-7 relative) where the float difference flips its rounding
            ulp = 2.0**-7 * np.abs(a)  # dX is bf16 here, dW float32
            bound = 2.0**-16 * np.abs(a).max() + (ulp if a.shape == x.shape else 0)
            assert np.all(np.abs(a - b) <= bound), np.abs(a - b).max()
    # On this CPU, "auto" lowers the CPU kernel: bit for bit the same program's values.
    auto = _grads(policy, x, w, g, key, "auto")
    for a, b in zip(auto, cpu):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("transposed", [False, True])
def test_reference_statistic_products_are_float32(transposed):
    """The reference path (what a TPU program runs for the dense layer) takes the products of
    the error means with `Wq`, `Xq` and the code sums at `Precision.HIGHEST`: at TPU's
    default precision a float32 operand is rounded to bf16 (XLA:CPU computes float32 either
    way, so only the traced precision can be checked here). The layer GEMMs are int8."""
    policy = Policy(Phi2D(), TwoWayEC())
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    w = jax.ShapeDtypeStruct((48, 32) if transposed else (32, 48), jnp.float32)
    g = jax.ShapeDtypeStruct((2, 16, 48), jnp.float32)
    key = jax.ShapeDtypeStruct((), jr.key(0).dtype)
    eqns = dot_eqns(
        lambda x, w, g, k: _grads(policy, x, w, g, k, "reference", transposed), x, w, g, key
    )
    floats = [e for e in eqns if any(v.aval.dtype != jnp.int8 for v in e.invars)]
    assert len(eqns) - len(floats) == 3 and len(floats) == 3  # channel dX, token dW, channel dW
    highest = jax.lax.Precision.HIGHEST
    for e in floats:
        assert e.params["precision"] in (highest, (highest, highest)), e


def test_kernels_agree_for_transposed_weights(getkey):
    """The (d_out, d_in) weight layout of QuantLinear, two-way EC, both kernels."""
    policy = Policy(Phi2D(), TwoWayEC())
    x = jr.normal(getkey(), (2, 16, 32))
    w = jr.normal(getkey(), (48, 32))
    g = jr.normal(getkey(), (2, 16, 48))
    key = getkey()
    ref = _grads(policy, x, w, g, key, "reference", transposed=True)
    cpu = _grads(policy, x, w, g, key, "cpu", transposed=True)
    for a, b in zip(ref[1:], cpu[1:]):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 2.0**-16 * np.abs(a).max()


@pytest.mark.parametrize("batch", [SUM_ALIGN, SUM_ALIGN + 1])
def test_code_sums_over_tokens_exact(batch):
    """The token sums of int8 codes are exact in both forms: one one-hot GEMM over all
    tokens (up to SUM_ALIGN examples) and the batched ones rows (more examples)."""
    q = np.random.default_rng(batch).integers(-127, 128, (batch, 37, 11)).astype(np.int8)
    got = jax.jit(lambda q: code_sums(q, 1))(q)
    assert got.dtype == jnp.float32 and got.shape == (batch, 11)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(q, np.int64).sum(axis=1))
