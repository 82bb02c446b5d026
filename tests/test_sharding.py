"""Sharding: thresholds and int8 gradient codes are bitwise identical on every mesh.

Runs on 8 host CPU devices (tests/conftest.py sets `--xla_force_host_platform_device_count=8`).
"""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from policies import DxOnlyEC, Independent, Nearest, Phi2D, PhiBcast, Policy, TwoWayEC
from s3req import Block, dot_general, gradient_codes, qdot, qragged_dot, QuantLinear, ShardAxes

from .helpers import (
    ALL_POLICIES,
    iter_eqns,
    policy_id,
    ragged_vjp,
    STOCHASTIC_TOPOLOGIES,
    with_kernels,
)


MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
B, S, H, D = 8, 8, 16, 32

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


def _mesh(shape):
    # Auto axes: XLA's SPMD partitioner chooses the collectives under jit (GSPMD).
    return jax.make_mesh(shape, ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))


def _put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _full_thresholds(topology, key, block, shape):
    th = topology.thresholds(key, block, "dx")
    return jnp.broadcast_to(th[0], shape)


@pytest.mark.parametrize("topology", STOCHASTIC_TOPOLOGIES, ids=lambda t: type(t).__name__)
@pytest.mark.parametrize("mesh_shape", MESHES, ids=str)
def test_thresholds_bitwise(topology, mesh_shape, getkey):
    key = getkey()
    ref = _full_thresholds(topology, key, Block.whole((B, S, D)), (B, S, D))
    mesh = _mesh(mesh_shape)
    spec = P("fsdp", None, "tp")
    # under jit with a NamedSharding: XLA partitions the counter arithmetic
    jitted = jax.jit(
        lambda k: _full_thresholds(topology, k, Block.whole((B, S, D)), (B, S, D)),
        out_shardings=NamedSharding(mesh, spec),
    )(key)
    np.testing.assert_array_equal(jitted, ref)
    # inside shard_map: every shard computes its own block from global indices
    axes = ShardAxes(batch="fsdp", d_out="tp")
    local = (B // mesh_shape[0], S, D // mesh_shape[1])

    def shard(k):
        return _full_thresholds(topology, k, axes.block(local), local)

    mapped = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=spec))(key)
    np.testing.assert_array_equal(mapped, ref)


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=policy_id)
def test_gradient_codes_bitwise(policy, getkey):
    gp = jr.normal(getkey(), (B, S, D)) * jnp.exp(jr.normal(getkey(), (B, S, D)))
    key = getkey()
    ref = gradient_codes(policy, gp, key)
    for mesh_shape in MESHES:
        mesh = _mesh(mesh_shape)
        spec = P("fsdp", None, "tp")
        sh = NamedSharding(mesh, spec)
        got = jax.jit(lambda g, k: gradient_codes(policy, g, k), in_shardings=(sh, None))(
            jax.device_put(gp, sh), key
        )
        axes = ShardAxes(batch="fsdp", d_out="tp")
        mapped = jax.jit(
            jax.shard_map(
                lambda g, k: gradient_codes(policy, g, k, axes),
                mesh=mesh,
                in_specs=(spec, P()),
                out_specs=(P(), P(), spec, spec),
            )
        )(_put(gp, mesh, spec), key)
        for out in (got, mapped):
            assert float(out[0]) == float(ref[0])  # the global step, bitwise
            np.testing.assert_array_equal(out[2], ref[2])
            np.testing.assert_array_equal(out[3], ref[3])


def _vjp(policy, x, w, g, key, axes=None):
    _, f = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key, axes=axes), x, w)
    return f(g)


LAYOUTS = {
    # column-parallel: w split on d_out
    "column": (
        ShardAxes(batch="fsdp", d_out="tp"),
        P("fsdp"),
        P(None, "tp"),
        P("fsdp", None, "tp"),
    ),
    # row-parallel: x and w split on d_in, output summed
    "row": (ShardAxes(batch="fsdp", d_in="tp"), P("fsdp", None, "tp"), P("tp", None), P("fsdp")),
    # sequence-parallel tokens
    "seq": (ShardAxes(batch="fsdp", seq="tp"), P("fsdp", "tp"), P(), P("fsdp", "tp")),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "policy",
    [Policy(Phi2D(), TwoWayEC()), Policy(PhiBcast(), TwoWayEC()), Policy(Independent())],
    ids=policy_id,
)
def test_qdot_inside_shard_map(layout, policy, getkey):
    """Forward, dX and dW inside shard_map agree with the unsharded qdot (float tolerance)."""
    x = jr.normal(getkey(), (B, S, H))
    w = jr.normal(getkey(), (H, D))
    g = jr.normal(getkey(), (B, S, D))
    key = getkey()
    y_ref = qdot(x, w, policy=policy, key=key)
    dx_ref, dw_ref = _vjp(policy, x, w, g, key)
    axes, xs, ws, ys = LAYOUTS[layout]
    for mesh_shape in MESHES:
        mesh = _mesh(mesh_shape)
        f = jax.jit(
            jax.shard_map(
                lambda x, w, g, k: (
                    (qdot(x, w, policy=policy, key=k, axes=axes),)
                    + tuple(_vjp(policy, x, w, g, k, axes))
                ),
                mesh=mesh,
                in_specs=(xs, ws, ys, P()),
                out_specs=(ys, xs, ws),
            )
        )
        y, dx, dw = f(_put(x, mesh, xs), _put(w, mesh, ws), _put(g, mesh, ys), key)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            dx, dx_ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(dx_ref)))
        )
        np.testing.assert_allclose(
            dw, dw_ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(dw_ref)))
        )


@pytest.mark.parametrize(
    "policy", [Policy(Phi2D(), TwoWayEC()), Policy(Independent())], ids=policy_id
)
def test_cuda_kernel_in_sharded_programs(policy, getkey):
    """The CUDA form traces in a program sharded by `jax.jit` (with its barrier) and inside
    `shard_map` (the reference form there): the gradients are the reference's bit for bit."""
    x = jr.normal(getkey(), (B, S, H))
    w = jr.normal(getkey(), (H, D))
    g = jr.normal(getkey(), (B, S, D))
    key = getkey()
    mesh = _mesh((2, 4))
    args = (_put(x, mesh, P("fsdp")), _put(w, mesh, P(None, "tp")), _put(g, mesh, P("fsdp")))
    axes, xs, ws, ys = LAYOUTS["row"]
    inside = jax.shard_map(
        lambda x, w, g, k: _vjp(policy, x, w, g, k, axes),
        mesh=mesh,
        in_specs=(xs, ws, ys, P()),
        out_specs=(xs, ws),
    )
    outside = lambda x, w, g, k: _vjp(policy, x, w, g, k)
    for f, a in (
        (outside, args),
        (inside, (_put(x, mesh, xs), _put(w, mesh, ws), _put(g, mesh, ys))),
    ):
        ref = jax.jit(with_kernels("reference", f))(*a, key)
        cuda = jax.jit(with_kernels("cuda", f))(*a, key)
        for u, v in zip(ref, cuda):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _u32_sizes(hlo: str) -> list[int]:
    sizes = []
    for dims in re.findall(r"u32\[([\d,]+)\]", hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split(",")])))
    return sizes


@pytest.mark.parametrize("mesh_shape", [(8, 1), (2, 4)], ids=str)
def test_no_full_size_random_tensor(mesh_shape, getkey):
    """Phi2D/PhiBcast hash B*S/4 (B/4) words: no uint32 tensor of a shard's gradient size
    appears in the compiled backward; Independent SR does have one (so the check can fail)."""
    mesh = _mesh(mesh_shape)
    spec = P("fsdp", None, "tp")
    sh = NamedSharding(mesh, spec)
    x = jax.device_put(jr.normal(getkey(), (B, S, H)), NamedSharding(mesh, P("fsdp")))
    w = jax.device_put(jr.normal(getkey(), (H, D)), NamedSharding(mesh, P(None, "tp")))
    g = jax.device_put(jr.normal(getkey(), (B, S, D)), sh)
    shard_elems = B * S * D // 8
    for policy, expect_full in [
        (Policy(Phi2D()), False),
        (Policy(PhiBcast()), False),
        (Policy(Independent()), True),
    ]:
        hlo = (
            jax.jit(lambda x, w, g, k, p=policy: _vjp(p, x, w, g, k))
            .lower(x, w, g, getkey())
            .compile()
            .as_text()
        )
        assert hlo is not None
        biggest = max(_u32_sizes(hlo), default=0)
        assert (biggest >= shard_elems) == expect_full, (policy, biggest, shard_elems)


def test_quant_linear_inside_shard_map(getkey):
    """QuantLinear takes the same `axes`: a column-parallel layer with bias on a (4, 2) mesh."""
    from s3req import QuantLinear

    layer = QuantLinear(H, D, policy=Policy(Phi2D(), TwoWayEC()), key=getkey())
    x = jr.normal(getkey(), (B, S, H))
    key = getkey()
    mesh = _mesh((4, 2))
    axes = ShardAxes(batch="fsdp", d_out="tp")
    specs = eqx.tree_at(lambda l: (l.weight, l.bias), layer, (P("tp"), P("tp")))
    sharded = eqx.tree_at(
        lambda l: (l.weight, l.bias),
        layer,
        (_put(layer.weight, mesh, P("tp")), _put(layer.bias, mesh, P("tp"))),
    )
    y = jax.jit(
        jax.shard_map(
            lambda l, x, k: l(x, key=k, axes=axes),
            mesh=mesh,
            in_specs=(specs, P("fsdp"), P()),
            out_specs=P("fsdp", None, "tp"),
        )
    )(sharded, _put(x, mesh, P("fsdp")), key)
    np.testing.assert_allclose(y, layer(x, key=key), rtol=1e-5, atol=1e-5)


def _ragged_problem(key, nb, B=8, S=4, k=2, E=3, H=16, D=64):
    """Expert rows of a random routing of B examples, once sorted globally by expert and
    once per batch shard (`nb` shards of B/nb examples each, sorted by expert locally), with
    global (token, slot) ids. Activations and gradients belong to the (token, slot) pair."""
    kr, kx, kw, kg = jr.split(key, 4)
    T = B * S
    experts = jnp.stack([jr.permutation(kk, E)[:k] for kk in jr.split(kr, T)]).reshape(-1)
    xp, gp = jr.normal(kx, (T * k, H)), jr.normal(kg, (T * k, D))
    w = jr.normal(kw, (E, H, D))

    def rows(pairs):
        order = pairs[jnp.argsort(experts[pairs], stable=True)].astype(jnp.int32)
        gs = jnp.bincount(experts[pairs], length=E).astype(jnp.int32)
        return order, gs

    whole = rows(jnp.arange(T * k))
    per = T * k // nb
    shards = [rows(jnp.arange(i * per, (i + 1) * per)) for i in range(nb)]
    order = jnp.concatenate([o for o, _ in shards])
    gs = jnp.concatenate([g for _, g in shards])
    return xp, gp, w, whole, (order, gs), S * k


RAGGED_LAYOUTS = {
    # rows over fsdp, expert weights column-parallel
    "column": (
        ShardAxes(batch="fsdp", d_out="tp"),
        P("fsdp"),
        P(None, None, "tp"),
        P("fsdp", "tp"),
    ),
    # rows over fsdp, row-parallel experts (x and w split on d_in, the output summed)
    "row": (ShardAxes(batch="fsdp", d_in="tp"), P("fsdp", "tp"), P(None, "tp"), P("fsdp")),
}


@pytest.mark.parametrize(
    "layout,policy",
    [
        ("column", Policy(Phi2D(), TwoWayEC())),
        ("column", Policy(Independent())),
        ("row", Policy(Independent())),
        # -m slow: the column case covers the sharded EC sums, Independent the row layout
        pytest.param("row", Policy(Phi2D(), TwoWayEC()), marks=pytest.mark.slow),
        pytest.param("column", Policy(PhiBcast(), TwoWayEC()), marks=pytest.mark.slow),
        pytest.param("row", Policy(PhiBcast(), TwoWayEC()), marks=pytest.mark.slow),
    ],
    ids=lambda v: v if isinstance(v, str) else policy_id(v),
)
def test_qragged_dot_inside_shard_map(layout, policy, getkey):
    """The expert GEMM inside shard_map, rows split over the batch axis and features over the
    other, agrees with the unsharded expert GEMM (float tolerance): forward, dX row by row
    (matched by global id) and dW."""

    B = 8
    key = getkey()
    axes, xs, ws, ys = RAGGED_LAYOUTS[layout]
    for mesh_shape in MESHES:
        nb = mesh_shape[0]
        xp, gp, w, (order, gs), (sorder, sgs), rows_per_example = _ragged_problem(key, nb)

        def run(x, w, g, gs, order, k_, axes=None):
            example_id = order // rows_per_example
            return ragged_vjp(policy, x, w, gs, g, k_, order, example_id, axes, num_examples=B)

        y_ref, dx_ref, dw_ref = jax.jit(run)(xp[order], w, gp[order], gs, order, key)
        mesh = _mesh(mesh_shape)
        ids = P("fsdp")
        f = jax.jit(
            jax.shard_map(
                lambda x, w, g, gs, o, k_: run(x, w, g, gs, o, k_, axes),
                mesh=mesh,
                in_specs=(xs, ws, ys, ids, ids, P()),
                out_specs=(ys, xs, ws),
            )
        )
        y, dx, dw = f(
            _put(xp[sorder], mesh, xs),
            _put(w, mesh, ws),
            _put(gp[sorder], mesh, ys),
            _put(sgs, mesh, ids),
            _put(sorder, mesh, ids),
            key,
        )
        back = np.argsort(np.asarray(order))[np.asarray(sorder)]  # global row of each row
        np.testing.assert_allclose(y, np.asarray(y_ref)[back], rtol=1e-5, atol=1e-5)
        scale = float(jnp.max(jnp.abs(dx_ref)))
        np.testing.assert_allclose(dx, np.asarray(dx_ref)[back], rtol=1e-4, atol=1e-4 * scale)
        scale = float(jnp.max(jnp.abs(dw_ref)))
        np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4 * scale)


def test_qragged_dot_bad_example_id_on_one_shard_raises(getkey):
    """Inside `shard_map` the routing check of `qragged_dot` sees every shard: example ids
    out of range on the last `fsdp` shard alone raise on all of them."""
    B = 8
    axes, xs, ws, ys = RAGGED_LAYOUTS["column"]
    policy = Policy(Phi2D(), TwoWayEC())
    xp, gp, w, _, (sorder, sgs), rows_per_example = _ragged_problem(getkey(), 4)
    mesh = _mesh((4, 2))
    ids = P("fsdp")

    def run(x, w, g, gs, order, k_):
        # num_examples one short: the rows of the last example are out of range
        example_id = order // rows_per_example
        return ragged_vjp(policy, x, w, gs, g, k_, order, example_id, axes, num_examples=B - 1)

    f = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=(xs, ws, ys, ids, ids, P()), out_specs=(ys, xs, ws))
    )
    args = [_put(v, mesh, s) for v, s in ((xp[sorder], xs), (w, ws), (gp[sorder], ys))]
    with pytest.raises(RuntimeError, match=r"example_id must lie in \[0, num_examples=7\)"):
        jax.block_until_ready(f(*args, _put(sgs, mesh, ids), _put(sorder, mesh, ids), getkey()))


def _shard_sums(fn, in_specs, out_specs, *args):
    """`(axes, operand shape)` of every `psum` in the program of `fn` inside `shard_map` on a
    (4, 2) mesh."""
    mapped = jax.shard_map(fn, mesh=_mesh((4, 2)), in_specs=in_specs, out_specs=out_specs)
    jaxpr = jax.make_jaxpr(mapped)(*args)
    return [
        (tuple(e.params["axes"]), e.invars[0].aval.shape)  # pyright: ignore
        for e in iter_eqns(jaxpr.jaxpr)
        if e.primitive.name.startswith("psum")
    ]


@pytest.mark.parametrize("correction", [DxOnlyEC(), TwoWayEC()], ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("kind", ["qdot", "qragged_dot"])
def test_one_shard_sum_per_gradient(kind, correction):
    """A column-parallel layer adds dX over `tp` and dW over `fsdp` once each, after the
    error correction: each shard subtracts its own part of the (linear) correction terms, so
    no term of the input width (the weight's row sums, the channel terms through `Wq^T`,
    `Xq^T eps`, the rank-B dW term) has a shard sum of its own. Only per-row statistics are
    added besides."""
    policy = Policy(Phi2D(), correction)
    h, d, E, n = 40, 32, 3, 80  # h differs from every other local extent
    S_ = jax.ShapeDtypeStruct
    axes = ShardAxes(batch="fsdp", d_out="tp")
    key = jr.key(0)
    if kind == "qdot":

        def fn(x, w, g, k):  # pyright: ignore[reportRedeclaration]
            return _vjp(policy, x, w, g, k, axes)

        args = (S_((8, 8, h), jnp.float32), S_((h, d), jnp.float32), S_((8, 8, d), jnp.float32))
        specs = (P("fsdp"), P(None, "tp"), P("fsdp", None, "tp"))
        dx_shape, dw_shape = (2, 8, h), (h, d // 2)
    else:

        def fn(x, w, g, gs, ids, k):
            return ragged_vjp(policy, x, w, gs, g, k, ids, ids // 10, axes, num_examples=8)[1:]

        args = (
            S_((n, h), jnp.float32),
            S_((E, h, d), jnp.float32),
            S_((n, d), jnp.float32),
            S_((4 * E,), jnp.int32),
            S_((n,), jnp.int32),
        )
        specs = (P("fsdp"), P(None, None, "tp"), P("fsdp", "tp"), P("fsdp"), P("fsdp"))
        dx_shape, dw_shape = (n // 4, h), (E, h, d // 2)
    sums = _shard_sums(fn, (*specs, P()), specs[:2], *args, key)
    wide = [s for s in sums if h in s[1]]
    assert sorted(wide) == sorted([(("tp",), dx_shape), (("fsdp",), dw_shape)]), sums


def _on_mesh(kind, fn, specs, *args):
    """`fn(*args)` jitted on a (4, 2) mesh of `kind` axes, the arrays placed with `specs`
    (`None`: not an array)."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(kind, kind))
    placed = [a if s is None else _put(a, mesh, s) for a, s in zip(args, specs)]
    with jax.set_mesh(mesh):
        return jax.jit(fn)(*placed)


def _explicit_and_auto(fn, specs, *args):
    return [_on_mesh(kind, fn, specs, *args) for kind in (AxisType.Explicit, AxisType.Auto)]


def _spec(a) -> P:
    """`a`'s partition spec without its trailing unsharded dimensions."""
    spec = list(a.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _same(explicit, auto):
    for e, a in zip(jax.tree.leaves(explicit), jax.tree.leaves(auto)):
        np.testing.assert_array_equal(np.asarray(e), np.asarray(a))


SHARD_SUMS = 2.0**-20
"""Expert GEMMs on Explicit axes with their rows split run per shard (`shard_map`); the Auto
program under GSPMD, or the unsharded one, does not: `(y, dX, dW)` agree but for the order in
which the shards' float32 partial sums are added (dW over the row shards, dX over the `d_out`
shards), within this fraction of the largest value (measured about `2**-23`: a few float32
roundings); `y` bitwise."""


def _per_shard_agrees(explicit, auto):
    y, *grads = explicit
    np.testing.assert_array_equal(np.asarray(y), np.asarray(auto[0]))  # one GEMM per row
    for e, a in zip(grads, auto[1:]):
        a = np.asarray(a)
        np.testing.assert_allclose(np.asarray(e), a, rtol=0, atol=SHARD_SUMS * np.abs(a).max())


@pytest.mark.parametrize(
    "policy", [Policy(Phi2D(), TwoWayEC()), Policy(Independent())], ids=policy_id
)
def test_explicit_axes(policy, getkey):
    """On a mesh of `AxisType.Explicit` axes (`jax.make_mesh`'s default) `qdot`, `QuantLinear`,
    `dot_general` run under `jax.jit` with the products and gradients sharded as the float
    ones, bitwise equal to the same program on Auto axes; `qragged_dot` with its rows split
    runs per shard, equal to it but for the order of the shard sums."""
    x, w, key = jr.normal(getkey(), (B, S, H)), jr.normal(getkey(), (H, D)), getkey()
    xs, ws = P("fsdp"), P(None, "tp")

    def grads(f):
        def run(x, w, key):
            y, pull = jax.vjp(lambda x, w: f(x, w, key), x, w)
            return (y, *pull(jnp.cos(y)))

        return run

    products = {
        "qdot": lambda x, w, k: qdot(x, w, policy=policy, key=k),
        "QuantLinear": lambda x, w, k: eqx.tree_at(
            lambda m: m.weight, QuantLinear(H, D, policy=policy, use_bias=False, key=jr.key(0)), w
        )(x, key=k),
        "dot_general": lambda x, w, k: dot_general(
            x, w, (((2,), (0,)), ((), ())), policy=policy, key=k
        ),
    }
    for name, f in products.items():
        wspec = P("tp") if name == "QuantLinear" else ws
        warg = w.T if name == "QuantLinear" else w
        explicit, auto = _explicit_and_auto(grads(f), (xs, wspec, None), x, warg, key)
        _same(explicit, auto)
        y, dx, dw = explicit
        assert _spec(y) == P("fsdp", None, "tp"), name
        assert _spec(dx) == xs and _spec(dw) == wspec, name

    B_ = 8
    xp, gp, we, (order, gs), _, rows_per_example = _ragged_problem(getkey(), 1, B=B_)

    def ragged(x, w, gs, order, key):
        example_id = order // rows_per_example
        return ragged_vjp(
            policy, x, w, gs, jnp.cos(x @ w[0]), key, order, example_id, num_examples=B_
        )

    specs = (P("fsdp"), P(None, None, "tp"), None, None, None)
    explicit, auto = _explicit_and_auto(ragged, specs, xp[order], we, gs, order, key)
    _per_shard_agrees(explicit, auto)
    y, dx, dw = explicit
    assert _spec(y) == P("fsdp", "tp")
    assert _spec(dx) == P("fsdp") and _spec(dw) == P(None, None, "tp")


SHARDED = r".*contracted dimension is sharded.*Reshard an operand"


def test_explicit_axes_sharded_contraction(getkey):
    """A contraction over a sharded dimension on Explicit axes: `qdot` and `qragged_dot`
    raise a `ValueError` that says what to do; `dot_general` takes the `out_sharding` that
    `jax.lax.dot_general` needs there (and refuses it on Auto axes)."""
    policy = Policy(Phi2D(), TwoWayEC())
    x, w, key = jr.normal(getkey(), (B, S, H)), jr.normal(getkey(), (H, D)), getkey()
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    xr, wr = _put(x, mesh, P("fsdp", None, "tp")), _put(w, mesh, P("tp"))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="s3req.qdot: " + SHARDED):
            jax.jit(lambda x, w: qdot(x, w, policy=policy, key=key))(xr, wr)
        with pytest.raises(ValueError, match="s3req.qragged_dot: " + SHARDED):
            jax.jit(
                lambda x, w: qragged_dot(
                    x,
                    w,
                    jnp.array([B * S], jnp.int32),
                    policy=policy,
                    key=key,
                    row_id=jnp.arange(B * S),
                    example_id=jnp.arange(B * S) // S,
                    num_examples=B,
                )
            )(xr.reshape(B * S, H), _put(w[None], mesh, P(None, "tp")))

    dims = (((2,), (0,)), ((), ()))

    def row_parallel(x, w, key, *, out=None):
        y, pull = jax.vjp(
            lambda x, w: dot_general(x, w, dims, policy=policy, key=key, out_sharding=out), x, w
        )
        return (y, *pull(jnp.cos(y)))

    specs = (P("fsdp", None, "tp"), P("tp"), None)
    to_batch = functools.partial(row_parallel, out=P("fsdp"))
    explicit = _on_mesh(AxisType.Explicit, to_batch, specs, x, w, key)
    _same(explicit, _on_mesh(AxisType.Auto, row_parallel, specs, x, w, key))
    assert _spec(explicit[0]) == P("fsdp")
    with pytest.raises(ValueError, match="applies on a mesh with Explicit axes only"):
        _on_mesh(AxisType.Auto, to_batch, specs, x, w, key)


def test_explicit_axes_at_a_realistic_shape(getkey):
    """The qdot page's layer `(4, 256, 1024) @ (1024, 4096)` and an expert GEMM of 1024 routed
    rows over 8 experts `(1024, 1024) x (8, 1024, 512)`, two-way EC, on Explicit axes:
    the Auto-axes program (bitwise; the expert GEMM, run per shard, but for the order of the
    shard sums), sharded as the float products."""
    policy = Policy(Phi2D(), TwoWayEC())
    x, w, key = jr.normal(getkey(), (4, 256, 1024)), jr.normal(getkey(), (1024, 4096)), getkey()

    def dense(x, w, key):
        y, pull = jax.vjp(lambda x, w: qdot(x, w, policy=policy, key=key), x, w)
        return (y, *pull(jnp.cos(y)))

    explicit, auto = _explicit_and_auto(dense, (P("fsdp"), P(None, "tp"), None), x, w, key)
    _same(explicit, auto)
    assert [_spec(a) for a in explicit] == [P("fsdp", None, "tp"), P("fsdp"), P(None, "tp")]

    n, E, per_example = 1024, 8, 128
    xe, we = jr.normal(getkey(), (n, 1024)), jr.normal(getkey(), (E, 1024, 512))
    gs = jnp.full((E,), n // E, jnp.int32)
    rows = jr.permutation(getkey(), n).astype(jnp.int32)  # global (token, slot) ids

    def ragged(x, w, gs, rows, key):
        g = jnp.cos(x @ w[0])  # sharded as the product, on either kind of axes
        return ragged_vjp(
            policy, x, w, gs, g, key, rows, rows // per_example, num_examples=n // per_example
        )

    specs = (P("fsdp"), P(None, None, "tp"), None, None, None)
    explicit, auto = _explicit_and_auto(ragged, specs, xe, we, gs, rows, key)
    _per_shard_agrees(explicit, auto)
    assert [_spec(a) for a in explicit] == [P("fsdp", "tp"), P("fsdp"), P(None, None, "tp")]


def test_explicit_axes_expert_rows_per_shard(getkey):
    """On Explicit axes `qragged_dot` runs the expert GEMM per shard (`shard_map`) where `x`'s
    rows are split (over one axis or two) and neither the contraction nor the experts are;
    elsewhere under `auto_axes`. Per shard it agrees with the unsharded product for every
    kind of policy. Each shard takes its block of the global `group_sizes`, which are checked
    whole: a count that does not sum to all the rows raises, though every shard's block of
    rows is whole."""
    policy = Policy(Phi2D(), TwoWayEC())
    n, E = 64, 4
    x, w = jr.normal(getkey(), (n, H)), jr.normal(getkey(), (E, H, D))
    rows = jnp.arange(n, dtype=jnp.int32)
    key = getkey()

    def f(x, w, gs, p=policy):
        return qragged_dot(
            x, w, gs, policy=p, key=key, row_id=rows, example_id=rows // 8, num_examples=8
        )

    gs = jnp.array([10, 30, 0, 24], jnp.int32)

    def grads(p, x, w):
        y, pull = jax.vjp(lambda x, w: f(x, w, gs, p), x, w)
        return (y, *pull(jnp.cos(y)))

    whole = {
        policy_id(p): jax.jit(functools.partial(grads, p))(x, w)
        for p in (None, Policy(Nearest()), policy)
    }
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        for xs, ws, per_shard in (
            (P("fsdp"), P(None, None, "tp"), True),
            (P(("fsdp", "tp")), P(), True),
            (P(), P(None, None, "tp"), False),  # no rows split
            (P("fsdp"), P("tp"), False),  # the experts split
        ):
            args = (_put(x, mesh, xs), _put(w, mesh, ws), gs)
            jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w, gs: jnp.sum(f(x, w, gs))))(*args))
            assert ("shard_map" in jaxpr) == per_shard, (xs, ws)
        # per shard, every kind of policy (float, round-to-nearest without row ids, EC) and
        # rows over one axis or two agree with the unsharded product but for the shard sums
        for p in (None, Policy(Nearest()), policy):
            for xs, ws in ((P("fsdp"), P(None, None, "tp")), (P(("fsdp", "tp")), P())):
                sharded = jax.jit(functools.partial(grads, p))(
                    _put(x, mesh, xs), _put(w, mesh, ws)
                )
                _per_shard_agrees(sharded, whole[policy_id(p)])
        xr, wr = _put(x, mesh, P("fsdp")), _put(w, mesh, P(None, None, "tp"))
        # more rows than x's (each shard's block alone still sums to its 16), fewer, negative
        for bad in ([10, 30, 0, 30], [10, 30, 0, 20], [10, 30, -2, 26]):
            with pytest.raises(RuntimeError, match="sum to the 64 rows of x"):
                jax.block_until_ready(jax.jit(f)(xr, wr, jnp.array(bad, jnp.int32)))
