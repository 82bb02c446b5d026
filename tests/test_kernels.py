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

The expert GEMMs' CPU forms (`ragged_gemm`, `ragged_rows`) do the multiply-adds of JAX's
lowering of `ragged_dot_general` with the codes as plain GEMM operands: int32 sums of int8
codes are exact in both, so every int8 policy's gradients agree bit for bit; float32 sums of
`k` products in two orders differ by at most `2 (k - 1) 2**-24` of the sum of their
magnitudes. For a correction that uses no segment sums (dX-only) the expert GEMM's CPU kernel
takes the row sums of `E` from the codes and `G'` apart, as the dense one does: dX then
agrees within the dense layer's bound.

The CUDA kernel of the dense layer (`s3req/_kernels_gpu.py`) only puts the dX GEMM's operands
behind an `optimization_barrier`: the same arithmetic, so the same gradients bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import s3req._backward as backward
import s3req._gemms as gemms
from policies import DxOnlyEC, FP8_E5M2, MXFP4, NoEC, Phi2D, Policy, TwoWayEC
from s3req import qdot
from s3req._kernels_cpu import code_sums, ragged_gemm, ragged_rows, SUM_ALIGN
from s3req._qdot import qdot_t

from .helpers import ALL_POLICIES, dot_eqns, iter_eqns, policy_id, ragged_vjp, with_kernels


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


SHAPES = [(3, 16, 48, 64), (1, 32, 32, 64)]


@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
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
    # On this CPU, "auto" lowers the CPU kernel: bit for bit the same program's values (at
    # one shape: the choice of kernel does not depend on it).
    if shape == SHAPES[0]:
        auto = _grads(policy, x, w, g, key, "auto")
        for a, b in zip(auto, cpu):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w_t"])
@pytest.mark.parametrize("policy", POLICIES, ids=policy_id)
def test_cuda_kernel_agrees_with_reference_bit_for_bit(policy, transposed, getkey):
    x = jr.normal(getkey(), (2, 16, 48), jnp.bfloat16)
    w = jr.normal(getkey(), (64, 48) if transposed else (48, 64))
    g = jr.normal(getkey(), (2, 16, 64), jnp.bfloat16)
    key = getkey()
    ref = _grads(policy, x, w, g, key, "reference", transposed)
    cuda = _grads(policy, x, w, g, key, "cuda", transposed)
    for a, b in zip(ref, cuda):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def barriers(kernels):  # the optimization barriers of the traced program
        f = lambda x, w, g, key: _grads(policy, x, w, g, key, kernels, transposed)
        jaxpr = jax.make_jaxpr(f)(x, w, g, key)
        return sum(e.primitive.name == "optimization_barrier" for e in iter_eqns(jaxpr.jaxpr))

    assert barriers("cuda") == barriers("reference") + 1  # the dX GEMM's operands


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
    floats = [e for e in eqns if any(v.aval.dtype != jnp.int8 for v in e.invars)]  # pyright: ignore
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


# Expert-sorted rows: 5 experts (expert 2 gets none), 3 rows past the last group.
GROUPS = np.array([7, 4, 0, 9, 5], np.int32)
ROWS = int(GROUPS.sum()) + 3


def _ints(rng, shape):
    return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)


def _floats(rng, shape):
    return jnp.asarray(
        rng.standard_normal(shape) * np.exp(rng.standard_normal(shape)), jnp.float32
    )


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float32])
@pytest.mark.parametrize("axis", [1, 2])
@pytest.mark.parametrize("k, m", [(4, 10), (24, 10), (64, 2)], ids=["1", "3", "all"])
def test_ragged_gemm_matches_ragged_dot(dtype, axis, k, m):
    """`ragged_gemm` (one GEMM per chunk of experts, each row keeping its expert's result)
    against `jax.lax.ragged_dot_general`: exact for int8 codes, within the bound of two
    summation orders of `k` terms for float32; the rows past the groups are 0. The widths
    give chunks of one expert, of three and (for int8) of all five."""
    rng = np.random.default_rng(axis)
    make = _ints if dtype == jnp.int8 else _floats
    lhs = make(rng, (ROWS, k))
    rhs = make(rng, (5, k, m) if axis == 1 else (5, m, k))
    gs = jnp.asarray(GROUPS)
    want = gemms.ragged(lhs, rhs, gs, ((1,), (axis,)), True)
    got = jax.jit(lambda l, r: ragged_gemm(l, r, gs, axis))(lhs, rhs)
    assert got.dtype == want.dtype and got.shape == (ROWS, m)
    assert not np.any(np.asarray(got)[-3:])
    if dtype == jnp.int8:
        np.testing.assert_array_equal(got, want)
    else:
        mag = gemms.ragged(jnp.abs(lhs), jnp.abs(rhs), gs, ((1,), (axis,)), True)
        assert np.all(np.abs(got - want) <= 2 * (k - 1) * 2.0**-24 * np.asarray(mag))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float32])
def test_ragged_rows_matches_ragged_dot(dtype):
    """`ragged_rows` (the rows masked per expert against the other operand read once) against
    the reference contraction of the rows: exact for int8 codes (the empty expert gets 0)."""
    rng = np.random.default_rng(7)
    make = _ints if dtype == jnp.int8 else _floats
    lhs, rhs = make(rng, (ROWS, 6)), make(rng, (ROWS, 5))
    gs = jnp.asarray(GROUPS)
    got = jax.jit(lambda l, r: ragged_rows(l, r, gs))(lhs, rhs)
    want = gemms.ragged_rows(lhs, rhs, gs)
    assert got.dtype == want.dtype and got.shape == (5, 6, 5)
    assert not np.any(np.asarray(got)[2])
    if dtype == jnp.int8:
        np.testing.assert_array_equal(got, want)
    else:
        k = int(GROUPS.max())
        mag = gemms.ragged_rows(jnp.abs(lhs), jnp.abs(rhs), gs)
        assert np.all(np.abs(got - want) <= 2 * (k - 1) * 2.0**-24 * np.asarray(mag))


def _ragged_grads(policy, kernels, *args):
    fn = with_kernels(kernels, functools.partial(ragged_vjp, policy, num_examples=2))
    return jax.jit(fn)(*args)


def _assert_float_sums_agree(a, b):
    """The dense kernels' bound for a float32 gradient (module docstring): `2**-16` of the
    largest entry."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.abs(a - b).max() <= 2.0**-16 * np.abs(a).max(), np.abs(a - b).max()


@pytest.mark.parametrize(
    "policy",
    [
        Policy(Phi2D()),
        Policy(Phi2D(), TwoWayEC()),
        Policy(Phi2D(), DxOnlyEC()),
        Policy(Phi2D(), TwoWayEC(), fmt=FP8_E5M2),
    ],
    ids=["int8", "int8-two-way", "int8-dx-only", "fp8-two-way"],
)
def test_qragged_dot_cpu_gemms_agree_with_reference(policy, getkey, monkeypatch):
    """`qragged_dot` with the CPU expert GEMMs against the reference: y, dX and dW bit for
    bit for int8 codes (also with dW's rows in chunks of 8, `DW_CHUNK`), but dX-only's dX
    within the dense kernels' bound (its row sums of `E` are taken from the codes and `G'`
    apart), within the float32 bound for FP8 values (their GEMMs are float32 products of
    `k <= 24` terms)."""
    rng = np.random.default_rng(0)
    n = int(GROUPS.sum())
    x, w, g = _floats(rng, (n, 24)), _floats(rng, (5, 24, 16)), _floats(rng, (n, 16))
    row_id = jnp.asarray(rng.permutation(n), jnp.int32)
    example_id = row_id // (n // 2 + 1)
    key = getkey()
    args = (x, w, jnp.asarray(GROUPS), g, key, row_id, example_id)
    ref = _ragged_grads(policy, "reference", *args)
    cpu = _ragged_grads(policy, "cpu", *args)
    monkeypatch.setattr(gemms, "MAX_TERMS", 8)
    monkeypatch.setattr(gemms, "DW_CHUNK", 8)
    chunked = _ragged_grads(policy, "cpu", *args)
    for name, a, b, c in zip(("y", "dX", "dW"), ref, cpu, chunked):
        a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
        if policy.fmt is FP8_E5M2 and name != "y":
            assert np.abs(a - b).max() <= 2.0**-16 * np.abs(a).max(), name
        elif isinstance(policy.correction, DxOnlyEC) and name == "dX":
            _assert_float_sums_agree(a, b)
            _assert_float_sums_agree(a, c)
            assert not np.array_equal(a, b)  # the kernel's own sums ran
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)
            np.testing.assert_array_equal(a, c, err_msg=name)


@pytest.mark.parametrize("correction", [TwoWayEC(), DxOnlyEC()], ids=["two-way", "dx-only"])
def test_qragged_dot_cpu_gemms_agree_at_a_realistic_shape(correction, getkey):
    """The same agreement on Qwen3-30B-A3B's routing (128 experts, top-8) of 512 tokens, 4096
    expert-sorted rows, widths 128 (the qdot page's expert GEMM): many empty or small groups,
    the experts in several chunks of `ragged_gemm`; bit for bit but dX-only's dX."""
    policy = Policy(Phi2D(), correction)
    tokens, k, E, H, D = 512, 8, 128, 128, 128
    rng = np.random.default_rng(1)
    experts = np.argsort(rng.standard_normal((tokens, E)), axis=1)[:, :k].reshape(-1)
    order = np.argsort(experts, kind="stable").astype(np.int32)
    gs = np.bincount(experts, minlength=E).astype(np.int32)
    n = tokens * k
    x, w, g = _floats(rng, (n, H)), _floats(rng, (E, H, D)) / np.sqrt(H), _floats(rng, (n, D))
    row_id = jnp.asarray(order)
    args = (x, w, jnp.asarray(gs), g, getkey(), row_id, row_id // (k * 256))
    ref = _ragged_grads(policy, "reference", *args)
    cpu = _ragged_grads(policy, "cpu", *args)
    for name, a, b in zip(("y", "dX", "dW"), ref, cpu):
        if isinstance(correction, DxOnlyEC) and name == "dX":
            _assert_float_sums_agree(a, b)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
