"""The XLA:TPU kernels against the reference path: those of the dense layer (the factors
of the dW terms summed over the chips before the GEMMs, `sum_first`; the code sums over the
tokens as an int8 product), bit for bit, and those of the expert GEMM's statistics.

The dense layer's forms take the same values as the reference (an int8 product with a ones
vector sums the codes exactly in int32, as the reference's int32 sum does; the product of an
identity matrix with a float32 factor at `HIGHEST` adds only zeros to it), so its gradients
agree bit for bit, with every policy, unsharded and under `jax.jit` sharding of the batch
over 4 devices, but for one sum: sharded, the reference sums the channel term of dW
`sum_b xsum_b (a - m)_b^T` as one partial product per device added by the partitioner, the
TPU form as one product over the examples on every device, another order of the same float32
sum over the 4 examples (within `6 2**-24` of the sum of its terms' magnitudes). That term is
an image of the error through the dW GEMM, at most half a step per element of the gradient,
so the test asserts `2**-16` of dW's largest entry there, as for the expert GEMM below.

The expert GEMM's forms:

`KERNELS="tpu"` traces the TPU forms on this CPU (`s3req/_kernels_tpu.py`): segment sums as
ragged contractions with the one-hot of the examples, `Xq_e^T eps_e` from int8 digits of
`eps`, both dX terms as one float32 ragged product. Where the statistics are not used (no
error correction) or only the row sums are (`DxOnlyEC`: `eps` comes from the same row sums
in both, and its term `eps * rw` is one product of one row and one expert in both), the
arithmetic is the same and the gradients agree bit for bit. Two-way EC differs
in three places:

- the segment sums of `E` and of `eps` are float32 sums of the `k` rows of a segment in
  another order: each is within `(k - 1) 2**-24` of the sum of its terms' magnitudes from
  the exact sum (here `k <= 8` rows per segment, so below `2**-21`), two orders within
  twice that;
- `Xq_e^T eps_e` takes `eps` to within `2**-24 |eps| + 2**-28 max|eps|` (`int8_digits`),
  against one float32 rounding per product and the same sum bound in the reference;
- the dX terms `eps rw + (a - m) Wq^T` are one product of `[eps, one-hot]` with `[rw; ...]`
  (at most two roundings of `2**-24`, of the product and of the sum) where the reference
  rounds the product and the sum apart.

Each correction term is a product of these statistics with int8 codes (`Wq`, `Xq`), so it
differs by at most `2**-18` of the same product taken with magnitudes, and the magnitudes of
the corrections are at most that of the error they remove, at most half a gradient step per
element: below the gradient's largest entry. So the corrected gradients agree to within
`2**-18` of their largest entry; the test asserts `2**-16` (a 4x margin for the float32
rescaling of the sums and the final `1 / s_x`, `1 / s_w`).

The segment sums of `E` are one more difference: the kernel takes them as `Delta` times
the exact sums of the codes minus the sums of `G'` (`folded_segment_sums`, whose own bound
`test_folded_segment_sums_error_bound` checks), so their rounding is a few `2**-24` of the
segment's sum of `|G'|` rather than of `|E|`. `|G'|` is up to `127` steps where `|E|` is at
most one, so in the worst case (every rounding of a segment in one direction, every `|G'|`
at the maximum) this adds up to `2**-11` of the largest entry; the roundings of different
terms are not aligned in practice, and the measured gap is near `2**-24` for dX and dW,
float32 and bfloat16 alike, so the test keeps `2**-16`. With bfloat16 activations dX is
rounded to bfloat16 too, which may move the two by one bfloat16 unit (`2**-7` of an entry).
"""

import functools

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import s3req._gemms as gemms
import s3req._kernels_tpu as kernels_tpu
from policies import (
    DwOnlyEC,
    DxOnlyEC,
    FP8_E5M2,
    Independent,
    NoEC,
    Phi2D,
    PhiBcast,
    Policy,
    TwoWayEC,
)
from s3req import qdot, ShardAxes
from s3req._backward import asked_terms
from s3req._gemms import digit_weights, int8_digits
from s3req._kernels_tpu import EPS_DIGITS

from .helpers import ALL_CORRECTIONS, ALL_POLICIES, policy_id, ragged_vjp, with_kernels


B, SEQ, TOP_K, E, H, D = 2, 8, 2, 4, 16, 12
EMPTY = 2  # an expert no row is routed to


def _routing(seed: int, tokens: int) -> np.ndarray:
    """The experts of every (token, slot), `(tokens * TOP_K,)`: `TOP_K` distinct ones per
    token, never `EMPTY`."""
    rng = np.random.default_rng(seed)
    used = np.array([e for e in range(E) if e != EMPTY])
    return np.stack([rng.permutation(used)[:TOP_K] for _ in range(tokens)]).reshape(-1)


def _operands(seed: int, n: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H), np.float32)
    w = rng.standard_normal((E, H, D), np.float32)
    g = rng.standard_normal((n, D)) * np.exp(rng.standard_normal((n, D)))  # spread out
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g, jnp.float32)


def _problem(seed: int):
    """Expert-sorted rows of a random top-2 routing that never picks expert `EMPTY`."""
    flat = _routing(seed, B * SEQ)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    gs = np.bincount(flat, minlength=E).astype(np.int32)
    x, w, g = _operands(seed, flat.shape[0])
    return x, w, jnp.asarray(gs), g, jnp.asarray(order), jnp.asarray((order // TOP_K) // SEQ)


_vjp = functools.partial(ragged_vjp, num_examples=B)


def _assert_agree(policy, ref, tpu):
    name = policy_id(policy)
    np.testing.assert_array_equal(ref[0], tpu[0], err_msg=name)  # the forward has no kernel
    for which, a, b in zip(("dX", "dW"), ref[1:], tpu[1:]):
        unit = 2.0**-7 if a.dtype == jnp.bfloat16 else 0.0  # one unit of a bfloat16 result
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if isinstance(policy.correction, (NoEC, DxOnlyEC)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} {which}")
        else:
            bound = 2.0**-16 * np.abs(a).max() + unit * np.abs(a)
            assert np.all(np.abs(a - b) <= bound), (name, which, np.abs(a - b).max())


def _agree(policies, key, dtype=jnp.float32):
    """y, dX, dW of `policies`, the reference and the TPU kernel traced into one program
    (one compile for all of them), with an expert that gets no rows; `dtype`: of the
    activations and the upstream gradient."""
    x, w, gs, g, row_id, example_id = _problem(0)
    x, g = x.astype(dtype), g.astype(dtype)
    assert int(gs[EMPTY]) == 0

    def both(x, w, gs, g, key):
        out = []
        for p in policies:
            args = (p, x, w, gs, g, key, row_id, example_id)
            out.append((with_kernels("reference", _vjp)(*args), with_kernels("tpu", _vjp)(*args)))
        return out

    results = jax.jit(both)(x, w, gs, g, key)
    for policy, (ref, tpu) in zip(policies, results):
        _assert_agree(policy, ref, tpu)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_tpu_kernel_agrees_with_reference(getkey, dtype):
    """Two-way EC, which uses every statistic the kernels compute (the topology only sets
    the codes; every policy, incl. those that quantize dX and dW apart: the slow test
    below), float32 and bfloat16 (the sums of `G'` read bfloat16 `g` as it is)."""
    _agree([Policy(Phi2D(), TwoWayEC())], getkey(), dtype)


@pytest.mark.slow
def test_ragged_tpu_kernel_agrees_with_reference_every_policy(getkey):
    _agree(ALL_POLICIES, getkey())


@pytest.mark.slow
def test_ragged_tpu_kernel_agrees_inside_shard_map(getkey):
    """Two-way EC inside `shard_map`, the rows split over two shards of the batch axis (each
    shard one example, its own `group_sizes`; the segment sums are added over the shards)."""
    policy = Policy(Phi2D(), TwoWayEC())
    flat = _routing(1, B * SEQ)
    x, w, g = _operands(1, flat.shape[0])
    key = getkey()
    # Shard b holds the rows of example b, sorted by expert within the shard.
    per = flat.shape[0] // B
    parts = [np.arange(i * per, (i + 1) * per) for i in range(B)]
    order = np.concatenate([p[np.argsort(flat[p], kind="stable")] for p in parts])
    gs = np.concatenate([np.bincount(flat[order[p]], minlength=E) for p in parts])
    order, gs = jnp.asarray(order, jnp.int32), jnp.asarray(gs, jnp.int32)
    row_id = jnp.arange(flat.shape[0], dtype=jnp.int32)
    mesh = jax.make_mesh((B,), ("data",), devices=jax.devices()[:B])
    axes = ShardAxes(batch="data")
    d, r = P("data"), P()

    def mapped(kernels):
        fn = with_kernels(
            kernels,
            lambda x, w, g, gs, o, k: _vjp(policy, x, w, gs, g, k, o, o // (SEQ * TOP_K), axes),
        )
        return jax.shard_map(fn, mesh=mesh, in_specs=(d, r, d, d, d, r), out_specs=(d, d, r))

    f = jax.jit(lambda *a: (mapped("reference")(*a), mapped("tpu")(*a)))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    args = (x[order], w, g[order], gs, row_id[order])
    ref, tpu = f(*[put(a, s) for a, s in zip(args, (d, r, d, d, d))], key)
    _assert_agree(policy, ref, tpu)


@pytest.mark.parametrize("h, d", [(128, 72), (72, 128)], ids=["h-minor", "d-minor"])
def test_expert_dw_in_the_weights_layout(monkeypatch, getkey, h, d):
    """`ragged_dw`, the expert dW in the orientation of the weight's TPU layout (`(Q_e^T
    Xq_e)^T` where `h` is a multiple of 128 and `d` is not), against the reference's `Xq_e^T
    Q_e`: int8 codes bit for bit, in one contraction and past the int32 bound in chunks
    (the bound lowered to 100 rows here), float codes within a float32 reordering of each
    sum; and through `qragged_dot`, S3R's and two-way EC's gradients with the TPU kernels
    against the reference as `test_ragged_tpu_kernel_agrees_with_reference`."""
    assert kernels_tpu.h_minor(h, d) == (h == 128)
    rng = np.random.default_rng(7)
    n = 300
    gs = jnp.asarray([90, 0, 150, 60], jnp.int32)  # one expert without rows
    xq = jnp.asarray(rng.integers(-127, 128, (n, h)), jnp.int8)
    q = jnp.asarray(rng.integers(-127, 128, (n, d)), jnp.int8)
    ref = lambda xq, q: gemms.ragged_token_contraction(xq, q, gs)
    tpu = lambda xq, q: kernels_tpu.ragged_dw(xq, q, gs)
    np.testing.assert_array_equal(jax.jit(ref)(xq, q), jax.jit(tpu)(xq, q))
    monkeypatch.setattr(gemms, "MAX_TERMS", 100)
    monkeypatch.setattr(gemms, "DW_CHUNK", 64)
    np.testing.assert_array_equal(jax.jit(ref)(xq, q), jax.jit(tpu)(xq, q))
    qf = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    a, b = jax.jit(ref)(xq, qf), jax.jit(tpu)(xq, qf)
    magnitudes = jax.jit(ref)(jnp.abs(xq), jnp.abs(qf))
    assert np.all(np.abs(a - b) <= 2 * n * 2.0**-24 * magnitudes)
    monkeypatch.undo()

    rows = 48
    x = jnp.asarray(rng.standard_normal((rows, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, h, d)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    sizes = jnp.asarray([20, 0, 16, 12], jnp.int32)
    row_id = jnp.arange(rows, dtype=jnp.int32)
    example_id = row_id % B
    key = getkey()
    both = jax.jit(
        lambda *a: [with_kernels(k, _vjp)(*a) for k in ("reference", "tpu")], static_argnums=0
    )
    for policy in (Policy(Phi2D(), NoEC()), Policy(Phi2D(), TwoWayEC())):
        _assert_agree(policy, *both(policy, x, w, sizes, g, key, row_id, example_id))


def test_row_chunk():
    """The rows per chunk of an expert GEMM's output: the largest divisor of the rows at most
    `ROW_CHUNK`, unless it is below `ROW_CHUNK / 8` (then one chunk), against a search over
    all divisors."""
    c = kernels_tpu.ROW_CHUNK
    for n in (100, c, c + 1, 3 * c + 3, 6 * c + 6, 8 * c, 200000, 2**31 - 1):
        best = max(k for k in range(1, min(n, c) + 1) if n % k == 0)
        assert kernels_tpu.row_chunk(n) == (best if 8 * best >= c else n), n
    assert kernels_tpu.row_chunk(8 * c) == c  # Table IV's 262144 rows per shard


def _assert_same_rows(u, v, which: str, msg: str, policy=None):
    """A GEMM's output computed in chunks of rows (`v`) against one chunk (`u`): the same
    arithmetic row by row, so equal bit for bit, except that inside the loop of chunks
    XLA:CPU computes dX's division by `s_x` as a product with `1 / s_x` (two roundings, the
    quotient one): float32 within `2**-22 |u|`, and a bfloat16 result within one unit of
    its rounding, `2**-7 |u|`. And with an error correction (`policy`): inside the loop
    XLA:CPU computes `E = Delta Q - G'` for its row sums as one fused multiply-add (one
    rounding fewer), so the corrected dX and dW agree as `_assert_agree`'s do (the
    statistics within a few roundings of the sums of `|E|`)."""
    if which == "y" or policy is None or isinstance(policy.correction, NoEC):
        if which != "dX":
            np.testing.assert_array_equal(u, v, err_msg=msg)
            return
        rel = 2.0**-7 if u.dtype == jnp.bfloat16 else 2.0**-22
        bound = rel * np.abs(np.asarray(u, np.float64))
    else:
        unit = 2.0**-7 if u.dtype == jnp.bfloat16 else 2.0**-22
        a = np.abs(np.asarray(u, np.float64))
        bound = 2.0**-16 * a.max() + unit * a
    diff = np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))
    assert np.all(diff <= bound), (msg, diff.max())


@pytest.mark.parametrize("sharded", [False, True], ids=["jit", "shard_map-d_out"])
def test_expert_gemms_in_row_chunks(monkeypatch, getkey, sharded):
    """The TPU kernel's expert GEMMs computing `Y`, and in the backward `max|G'|`, the codes,
    the row sums of `E` and dX with its correction, in chunks of 8 rows (groups straddle the
    chunks, one expert has no rows; sharded: inside `shard_map` with the features split
    over 2 shards of `d_out`, the sum over them taken per chunk) against one chunk
    (`_assert_same_rows`: every row's GEMM, codes, terms and sum are the same arithmetic),
    and one chunk against the reference as `test_ragged_tpu_kernel_agrees_with_reference`,
    with every correction, and for codes per chunk with thresholds per element (quantized
    twice) and float codes."""
    x, w, gs, g, row_id, example_id = _problem(4)
    n, key = x.shape[0], getkey()
    policies = [Policy(Phi2D(), c) for c in ALL_CORRECTIONS] + [
        Policy(Independent(), NoEC()),  # quantizes twice, a threshold per element
        Policy(PhiBcast(), NoEC(), fmt=FP8_E5M2),  # float codes, a per-tensor scale
    ]
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    axes = ShardAxes(d_out="tp") if sharded else None
    w_spec, g_spec, r = P(None, None, "tp"), P(None, "tp"), P()

    def run(kernels, chunk):
        monkeypatch.setattr(kernels_tpu, "ROW_CHUNK", chunk)

        def fn(x, w, g, key):
            return [
                with_kernels(kernels, _vjp)(p, x, w, gs, g, key, row_id, example_id, axes)
                for p in policies
            ]

        if sharded:
            specs = (r, w_spec, g_spec)
            outs = [(g_spec, r, w_spec) for _ in policies]
            fn = jax.shard_map(fn, mesh=mesh, in_specs=(*specs, r), out_specs=outs)
            args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, g), specs)]
            return jax.jit(fn)(*args, key)
        return jax.jit(fn)(x, w, g, key)

    assert kernels_tpu.row_chunk(n) == n
    whole, ref = run("tpu", kernels_tpu.ROW_CHUNK), run("reference", kernels_tpu.ROW_CHUNK)
    chunked = run("tpu", 8)
    assert kernels_tpu.row_chunk(n) == 8 and n > 8
    for policy, a, b, c in zip(policies, whole, chunked, ref):
        for which, u, v in zip(("y", "dX", "dW"), a, b):
            _assert_same_rows(u, v, which, f"{policy_id(policy)} {which}", policy)
        _assert_agree(policy, c, a)
    # Chosen per backend (`auto`), the chunked forms are traced beside this backend's
    # (`jax.lax.platform_dependent` needs one output structure), which this program runs.
    auto_chunked = run("auto", 8)
    auto_whole = run("auto", kernels_tpu.ROW_CHUNK)
    jax.tree.map(np.testing.assert_array_equal, auto_whole, auto_chunked)


@pytest.mark.parametrize("sharded", [False, True], ids=["jit", "shard_map-d_out"])
@pytest.mark.parametrize(
    "policy",
    # Independent: quantized twice, a threshold per element, per chunk of rows.
    [Policy(Phi2D(), c) for c in ALL_CORRECTIONS] + [Policy(Independent(), TwoWayEC())],
    ids=policy_id,
)
def test_expert_gemms_in_row_chunks_at_scale(monkeypatch, getkey, policy, sharded):
    """The chunked expert GEMMs at a realistic shape: 4 examples of 512 tokens routed top-2
    over 8 experts (4096 rows, `(4096, 256) @ (8, 256, 128)`), bfloat16 activations and
    gradient, in chunks of 1024 rows (groups straddle the chunks) against one chunk:
    `Y`, dX (divided by `s_x` and cast to bfloat16 chunk by chunk) and dW as
    `_assert_same_rows`, with every correction and with Independent two-way (the codes
    quantized twice, a threshold per element, chunk by chunk); sharded: inside `shard_map`
    with the features split over 2 shards of `d_out` (the dX sum over them taken per chunk,
    before the division and the cast)."""
    examples, seq, top_k, experts, h, d = 4, 512, 2, 8, 256, 128
    rng = np.random.default_rng(7)
    flat = np.stack([rng.permutation(experts)[:top_k] for _ in range(examples * seq)]).ravel()
    order = np.argsort(flat, kind="stable").astype(np.int32)
    gs = jnp.asarray(np.bincount(flat, minlength=experts).astype(np.int32))
    n = flat.shape[0]
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, h, d)), jnp.float32)
    g = jnp.asarray(
        rng.standard_normal((n, d)) * np.exp(rng.standard_normal((n, d))), jnp.bfloat16
    )
    row_id, example_id = jnp.asarray(order), jnp.asarray((order // top_k) // seq)
    key = getkey()
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    axes = ShardAxes(d_out="tp") if sharded else None
    w_spec, g_spec, r = P(None, None, "tp"), P(None, "tp"), P()

    def run(chunk):
        monkeypatch.setattr(kernels_tpu, "ROW_CHUNK", chunk)
        vjp = functools.partial(ragged_vjp, num_examples=examples)
        fn = lambda x, w, g: with_kernels("tpu", vjp)(
            policy, x, w, gs, g, key, row_id, example_id, axes
        )
        if not sharded:
            return jax.jit(fn)(x, w, g)
        specs = (r, w_spec, g_spec)
        fn = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(g_spec, r, w_spec))
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w, g), specs)]
        return jax.jit(fn)(*args)

    whole, chunked = run(2 * n), run(1024)
    assert kernels_tpu.row_chunk(n) == 1024 and np.any(np.cumsum(np.asarray(gs)) % 1024)
    for which, u, v in zip(("y", "dX", "dW"), whole, chunked):
        assert u.dtype == v.dtype and u.dtype == (jnp.float32 if which == "dW" else jnp.bfloat16)
        _assert_same_rows(u, v, which, which, policy)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float32])
def test_segment_sums_in_row_chunks(monkeypatch, dtype):
    """`segment_sums` with the rows cut into chunks of 7 (groups straddle the chunks, one
    expert has no rows) against `jax.ops.segment_sum`: int8 codes exactly, float32 within
    the float32 bound of two summation orders of `k` terms, `2 (k - 1) 2**-24 sum |v|`."""
    x, _, gs, _, _, example_id = _problem(3)
    n = x.shape[0]
    rng = np.random.default_rng(3)
    if dtype == jnp.int8:
        v = jnp.asarray(rng.integers(-127, 128, (n, H)), jnp.int8)
    else:
        v = jnp.asarray(rng.standard_normal((n, H)) * np.exp(rng.standard_normal((n, H))), dtype)
    monkeypatch.setattr(kernels_tpu, "SEGMENT_CHUNK", 7)
    assert n > 7 and n % 7
    got = jax.jit(lambda v: kernels_tpu.segment_sums(v, example_id, B, gs))(v)
    expert = np.repeat(np.arange(E), np.asarray(gs))
    segment = np.asarray(example_id) * E + expert
    want = jax.ops.segment_sum(v.astype(jnp.float32), jnp.asarray(segment), B * E)
    assert got.shape == (B * E, H) and got.dtype == jnp.float32
    if dtype == jnp.int8:
        np.testing.assert_array_equal(got, want)
    else:
        k = np.bincount(segment, minlength=B * E).max()
        mag = jax.ops.segment_sum(jnp.abs(v), jnp.asarray(segment), B * E)
        assert np.all(np.abs(got - want) <= 2 * (k - 1) * 2.0**-24 * np.asarray(mag))


@pytest.mark.parametrize("factors", ["both", "token", "segments"])
def test_xq_sums_in_row_chunks(monkeypatch, factors):
    """`xq_sums` with the rows cut into chunks of 500 (groups straddle the chunks, one
    expert has no rows) at Qwen3-30B-A3B's routing on 4 x 64 tokens, `eps` spanning `2**-30` to
    `2**30`. The segment sums of the codes equal `jax.ops.segment_sum`'s exactly; `Xq_e^T
    eps_e` is within `sum |Xq| (2**-24 |eps| + 2**-28 max|eps|)` (the digits,
    `int8_digits`) plus `11 2**-24` of `scale sum_j |S_j| 128**-j <= 64 (128 / 127) scale
    sum |Xq| = 1.008 max|eps| sum |Xq|` (each digit sum `S_j` is exact in int32 and rounded
    once to float32, weighted with one rounding, the four added with three) of the float64
    sums of every expert."""
    gs, example_id = _routed(6, 4, 64, 8, 128, EMPTY)
    n, h, experts = example_id.shape[0], 24, 128
    rng = np.random.default_rng(6)
    xq = jnp.asarray(rng.integers(-127, 128, (n, h)), jnp.int8)
    eps = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-30, 30, n)
    eps = jnp.asarray(eps, jnp.float32)
    monkeypatch.setattr(kernels_tpu, "SEGMENT_CHUNK", 500)
    assert n > 500 and n % 500
    with_eps = factors in ("both", "token")
    with_segments = factors in ("both", "segments")
    fn = lambda xq, eps: kernels_tpu.xq_sums(
        xq, eps if with_eps else None, example_id if with_segments else None, 4, gs
    )
    token, segments = jax.jit(fn)(xq, eps)
    expert = np.repeat(np.arange(experts), np.asarray(gs))
    if with_segments:
        segment = jnp.asarray(np.asarray(example_id) * experts + expert)
        want = jax.ops.segment_sum(xq.astype(jnp.int32), segment, 4 * experts)
        assert segments is not None and segments.dtype == jnp.float32
        np.testing.assert_array_equal(segments, want.astype(jnp.float32))
    else:
        assert segments is None
    if not with_eps:
        assert token is None
        return
    assert token is not None and token.shape == (experts, h, 1)
    x64, e64 = np.asarray(xq, np.float64), np.asarray(eps, np.float64)
    want, mag, xabs = (np.zeros((experts, h)) for _ in range(3))
    np.add.at(want, expert, x64 * e64[:, None])
    np.add.at(mag, expert, np.abs(x64) * np.abs(e64)[:, None])
    np.add.at(xabs, expert, np.abs(x64))
    top = np.abs(e64).max()
    bound = 2.0**-24 * mag + (2.0**-28 + 11 * 1.008 * 2.0**-24) * top * xabs
    assert np.all(np.abs(np.asarray(token[..., 0], np.float64) - want) <= bound)
    assert not np.any(np.asarray(token)[EMPTY])  # the expert with no rows


def test_xq_sums_at_the_int32_bound():
    """`xq_sums` on `SEGMENT_CHUNK + 2**16` rows of one expert (a full chunk, then a half
    one), every code 127 and every `eps` 1 (its first digit 64, the largest): a chunk's int32
    sums reach `64 * 127 * 2**17` (below `2**31`), and both factors come out exact: the token
    term `127 n` (below `2**24`), the segment sums `127` times the rows of each example."""
    n, h, examples = kernels_tpu.SEGMENT_CHUNK + 2**16, 8, 3
    xq = jnp.full((n, h), 127, jnp.int8)
    eps = jnp.ones((n,), jnp.float32)
    example_id = jnp.asarray(np.arange(n) * examples // n, jnp.int32)
    gs = jnp.asarray([n], jnp.int32)
    fn = lambda xq, eps: kernels_tpu.xq_sums(xq, eps, example_id, examples, gs)
    token, segments = jax.jit(fn)(xq, eps)
    assert token is not None and segments is not None
    np.testing.assert_array_equal(token, np.full((1, h, 1), 127.0 * n, np.float32))
    rows = np.bincount(np.asarray(example_id), minlength=examples)
    np.testing.assert_array_equal(segments, np.repeat(127.0 * rows, h).reshape(examples, h))


def _routed(seed: int, examples: int, seq: int, top_k: int, experts: int, empty: int):
    """`(group_sizes, example_id)` of expert-sorted rows: every token of `examples x seq`
    routed to `top_k` distinct random experts, never `empty`."""
    rng = np.random.default_rng(seed)
    used = np.array([e for e in range(experts) if e != empty])
    flat = np.stack([rng.choice(used, top_k, replace=False) for _ in range(examples * seq)])
    flat = flat.reshape(-1)
    order = np.argsort(flat, kind="stable")
    gs = np.bincount(flat, minlength=experts).astype(np.int32)
    return jnp.asarray(gs), jnp.asarray((order // top_k) // seq, jnp.int32)


# (examples, tokens per example, top-k, experts, d, rows per chunk): this file's toy problem,
# and Qwen3-30B-A3B's routing (top-8 of 128 experts) on 4 x 512 tokens, chunks of 5000 rows.
FOLD_SHAPES = {"toy": (B, SEQ, TOP_K, E, D, 7), "qwen3-30b-a3b": (4, 512, 8, 128, 512, 5000)}


@pytest.mark.parametrize("shape", FOLD_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_folded_segment_sums_error_bound(monkeypatch, dtype, shape):
    """`folded_segment_sums` with the rows cut into chunks (groups straddle the chunks, one
    expert has no rows) against the segment sums of `G' = s_x (g 2**c) s_w` in float64,
    for gradients spread over `2**-60` to `2**60` with a tiny shift `2**c` (`c = -60`), at
    this file's toy shape and at Qwen3-30B-A3B's routing (16384 rows, 128 experts).

    The bound, with `u = 2**-24`: the scaled one-hot is cut into three bfloat16 pieces
    (their sum within `u |s_x|`); every product of bfloat16 pieces and bfloat16 `g` is exact
    in float32 (a float32 product of float32 operands rounds once); the float32 sums of a
    chunk's at most `3k` terms of a segment (`k` rows) round within `(3k - 1) u`, adding the
    chunks' sums and the three pieces' sums within `(chunks + 2) u`, the product with
    `s_w` within `u`, each of the sum of the terms' magnitudes (`sum |G'|`, to first order
    in `u`): at most `(3k + chunks + 3) u sum |G'|`; the test allows `(3k + chunks + 4) u`
    for the second-order terms. The bound grows with `k`: at the toy shape (`k <= 8`) it
    fails with two pieces of the one-hot in place of three, at Qwen3-30B-A3B's (`k` near 60)
    two pieces stay within it, and it checks the routing, the chunks and the scales."""
    examples, seq, top_k, experts, d, chunk = FOLD_SHAPES[shape]
    gs, example_id = _routed(4, examples, seq, top_k, experts, EMPTY)
    n = example_id.shape[0]
    rng = np.random.default_rng(4)
    g = (rng.standard_normal((n, d)) * 2.0 ** rng.uniform(-60, 60, (n, d))).astype(np.float32)
    g = jnp.asarray(g, dtype)
    sx = jnp.asarray(2.0 ** rng.uniform(-20, 20, (n, 1)), jnp.float32)
    sw = jnp.asarray(2.0 ** rng.uniform(-20, 20, (experts, 1, d)), jnp.float32)
    shift = jnp.float32(2.0**-60)
    monkeypatch.setattr(kernels_tpu, "FOLD_CHUNK", chunk)
    chunks = -(-n // chunk)
    assert n > chunk and n % chunk
    fn = lambda g: kernels_tpu.folded_segment_sums(g, shift, sx, sw, example_id, examples, gs)
    got = np.asarray(jax.jit(fn)(g), np.float64)
    expert = np.repeat(np.arange(experts), np.asarray(gs))
    segment = np.asarray(example_id) * experts + expert
    gp = (
        np.asarray(sx, np.float64)
        * (np.asarray(g, np.float64) * 2.0**-60)
        * np.asarray(sw, np.float64)[expert, 0, :]
    )
    segments = examples * experts
    want, mag = np.zeros((segments, d)), np.zeros((segments, d))
    np.add.at(want, segment, gp)
    np.add.at(mag, segment, np.abs(gp))
    k = np.bincount(segment, minlength=segments).max()
    assert got.shape == (segments, d)
    assert np.all(np.abs(got - want) <= (3 * k + chunks + 4) * 2.0**-24 * mag)
    assert not np.any(got[EMPTY::experts])  # the segments of the expert with no rows


def test_token_dx_bitwise_at_qwen3_routing():
    """`token_dx` (a ragged product) equals the reference's `eps * rw[expert]` bit for bit at
    Qwen3-30B-A3B's routing (16384 rows, top-8 of 128 experts, one with no rows, h = 2048):
    one product of one row and one expert per element."""
    gs, _ = _routed(5, 4, 512, 8, 128, EMPTY)
    n = int(gs.sum())
    rng = np.random.default_rng(5)
    eps = jnp.asarray(rng.standard_normal(n) * 2.0 ** rng.uniform(-30, 30, n), jnp.float32)
    rw = jnp.asarray(rng.integers(-127 * 768, 127 * 768, (128, 2048)), jnp.float32)
    got = jax.jit(kernels_tpu.token_dx)(eps, rw, gs)
    expert = np.repeat(np.arange(128), np.asarray(gs))
    np.testing.assert_array_equal(got, np.asarray(eps)[:, None] * np.asarray(rw)[expert])


@pytest.mark.parametrize("case", ["magnitudes", "zeros"])
def test_int8_digits_error_bound(case):
    """`int8_digits` of the token means as `xq_sums` takes them, one row of `n = 131072`
    (the rows per chip of the TPU benchmark) in `EPS_DIGITS` digits: digits in [-64, 64],
    and `scale * digits . digit_weights` (exact in float64) within `2**-24 |v| + 2**-28
    max|v|` of `v`, for values spanning 2**-120 to 2**40 with zeros among them, and for a
    vector of zeros (all digits 0)."""
    n = 131072
    rng = np.random.default_rng(0)
    if case == "zeros":
        v = np.zeros(n, np.float32)
    else:
        v = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(-120, 40, n)
        v[rng.random(n) < 0.05] = 0.0
        v[rng.integers(n)] = 2.0**40  # the largest value exactly
        v = v.astype(np.float32)
    digits, scale = jax.jit(int8_digits, static_argnums=1)(v[None], EPS_DIGITS)
    digits, scale = np.asarray(digits), np.asarray(scale, np.float64)
    assert digits.shape == (EPS_DIGITS, 1, n) and digits.dtype == np.int8
    assert np.abs(digits).max() <= 64
    weights = np.asarray(digit_weights(EPS_DIGITS), np.float64)
    back = scale[0] * (weights @ digits[:, 0].astype(np.float64))
    v64 = v.astype(np.float64)
    bound = 2.0**-24 * np.abs(v64) + 2.0**-28 * np.abs(v64).max()
    assert np.all(np.abs(back - v64) <= bound)
    if case == "zeros":
        assert not digits.any()
    else:
        assert np.all(back[v == 0] == 0)


def _dense_vjp(policy, x, w, g, key):
    y, pull = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
    return (y, *pull(g))


DENSE_POLICIES = ALL_POLICIES + [Policy(Phi2D(), DwOnlyEC())]


@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "batch-sharded"])
@pytest.mark.parametrize("shape", [(4, 16, 48, 64), (4, 512, 1024, 512)], ids=str)
def test_dense_tpu_kernel_agrees_with_reference(getkey, shape, sharded):
    """Every policy, the dense layer's TPU forms against the reference, bit for bit, at a
    toy shape and at W1's widths (the batch over 4 devices under `jax.jit`: the factors of
    the dW terms are then summed over the devices by the partitioner)."""
    B, S, H, D = shape
    x = jr.normal(getkey(), (B, S, H), jnp.bfloat16)
    w = jr.normal(getkey(), (H, D))
    g = jr.normal(getkey(), (B, S, D)) * jnp.exp(jr.normal(getkey(), (B, S, D)))
    g = g.astype(jnp.bfloat16)
    key = getkey()
    if sharded:
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=auto)
        x, g = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, g))

    def both(x, w, g, key):
        return [
            (
                with_kernels("reference", _dense_vjp)(p, x, w, g, key),
                with_kernels("tpu", _dense_vjp)(p, x, w, g, key),
            )
            for p in DENSE_POLICIES
        ]

    for policy, (ref, tpu) in zip(DENSE_POLICIES, jax.jit(both)(x, w, g, key)):
        name = policy_id(policy)
        for which, a, b in zip(("y", "dX", "dW"), ref, tpu):
            if sharded and which == "dW" and isinstance(policy.correction, (TwoWayEC, DwOnlyEC)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                bound = 2.0**-16 * np.abs(a).max()
                assert np.all(np.abs(a - b) <= bound), (name, np.abs(a - b).max() / bound)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{name} {which}")


@pytest.mark.parametrize(
    "correction", ALL_CORRECTIONS + [DwOnlyEC()], ids=lambda c: type(c).__name__
)
def test_asked_terms(correction):
    """The terms a correction asks for, read from abstract traces of `correct_dx` and
    `correct_dw`: the dW terms (whose factors are summed first on TPU) exactly where the
    correction subtracts them from dW."""
    dx = jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)
    dw = jax.ShapeDtypeStruct((16, 12), jnp.float32)
    expected = {
        NoEC: set(),
        DxOnlyEC: {"dx_token"},
        TwoWayEC: {"dx_structured", "dw_token", "dw_channel"},
        DwOnlyEC: {"dw_token", "dw_channel"},
    }[type(correction)]
    assert asked_terms(correction, dx, dw) == expected
