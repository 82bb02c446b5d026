"""The Flax adapters (`s3req.flax`) with real Flax linen and NNX layers."""

import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest


flax = pytest.importorskip("flax")
import flax.linen as nn
from flax import nnx

import s3req
import s3req.flax as sflax
from policies import Nearest, Phi2D, Policy, TwoWayEC


POLICY = Policy(Phi2D(), TwoWayEC())


def _exact(key, shape, axis):
    """Integers in [-126, 126] with max |.| = 127 along `axis` for every other index."""
    a = jr.randint(key, shape, -126, 127).astype(jnp.float32)
    idx = tuple(0 if i == axis else slice(None) for i in range(len(shape)))
    return a.at[idx].set(127.0)


def test_nearest_dense_is_dot_general(getkey):
    x = jr.normal(getkey(), (2, 6, 8))
    layer = nn.Dense(5, use_bias=False, dot_general_cls=sflax.dot_general_cls(Policy(Nearest())))
    params = layer.init(getkey(), x)
    kernel: jax.Array = params["params"]["kernel"]  # pyright: ignore
    ref = s3req.dot_general(x, kernel, (((2,), (0,)), ((), ())), policy=Policy(Nearest()))
    np.testing.assert_array_equal(layer.apply(params, x), ref)


def test_missing_stream_is_a_clear_error(getkey):
    x = jr.normal(getkey(), (2, 6, 8))
    layer = nn.Dense(5, dot_general_cls=sflax.dot_general_cls(POLICY))
    params = layer.init(getkey(), x)  # init falls back to the params stream
    with pytest.raises(ValueError, match=r"rngs=\{'s3req': step_key\}"):
        layer.apply(params, x)
    with pytest.raises(ValueError, match="nnx.Rngs"):
        sflax.NnxDotGeneral(POLICY, nnx.Rngs(params=0))


@pytest.mark.parametrize("kind", ["dense", "dense_general", "einsum"])
def test_linen_gradients_are_unbiased(kind, getkey):
    """Exact inputs and kernel, a random cotangent: over step keys, the mean gradient is the
    float gradient (5 sigma per element, from the sample variance)."""
    B, S, D, N, H = 2, 6, 8, 2, 3
    if kind == "dense":
        layer = nn.Dense(N * H, use_bias=False, dot_general_cls=sflax.dot_general_cls(POLICY))
        kshape, contract, out = (D, N * H), 0, (B, S, N * H)
        float_fn = lambda x, k: jnp.einsum("btd,de->bte", x, k)
    elif kind == "dense_general":
        layer = nn.DenseGeneral(
            (N, H), use_bias=False, dot_general_cls=sflax.dot_general_cls(POLICY)
        )
        kshape, contract, out = (D, N, H), 0, (B, S, N, H)
        float_fn = lambda x, k: jnp.einsum("btd,dnh->btnh", x, k)
    else:
        layer = sflax.Einsum((N, H, D), "btd,nhd->btnh", POLICY, use_bias=False)
        kshape, contract, out = (N, H, D), 2, (B, S, N, H)
        float_fn = lambda x, k: jnp.einsum("btd,nhd->btnh", x, k)
    x = _exact(getkey(), (B, S, D), 2)
    kernel = _exact(getkey(), kshape, contract)
    g = jr.normal(getkey(), out)
    params = {"params": {"kernel": kernel}}
    assert jax.tree.map(jnp.shape, layer.init(getkey(), x)) == jax.tree.map(jnp.shape, params)

    @jax.jit
    @jax.vmap
    def grads(key):
        f = lambda p, x: jnp.sum(layer.apply(p, x, rngs={"s3req": key}) * g)  # pyright: ignore
        return jax.grad(f, argnums=(0, 1))(params, x)

    n = 512
    dp, dx = grads(jr.split(getkey(), n))
    ref_dk, ref_dx = jax.grad(lambda k, x: jnp.sum(float_fn(x, k) * g), argnums=(0, 1))(kernel, x)
    for sample, ref in ((dp["params"]["kernel"], ref_dk), (dx, ref_dx)):
        mean, std = jnp.mean(sample, 0), jnp.std(sample, 0, ddof=1)
        assert float(jnp.max(std)) > 0
        tol = 5 * std / math.sqrt(n) + 1e-5 * jnp.max(jnp.abs(ref))
        assert bool(jnp.all(jnp.abs(mean - ref) <= tol)), float(jnp.max(jnp.abs(mean - ref) / tol))


class _LinenTwin(nn.Module):
    @nn.compact
    def __call__(self, x):
        dg = sflax.dot_general_cls(POLICY)
        return nn.Dense(12, dot_general_cls=dg)(x), nn.Dense(12, dot_general_cls=dg)(x)


def test_linen_thresholds_differ_across_layers_and_steps(getkey):
    model = _LinenTwin()
    x = jr.normal(getkey(), (2, 8, 16))
    g = jr.normal(getkey(), (2, 8, 12))
    params = model.init(getkey(), x)
    p = params["params"]
    params = {"params": {"Dense_0": p["Dense_0"], "Dense_1": p["Dense_0"]}}  # same weights

    @jax.jit
    def grads(params, key):
        def f(params):
            a, b = model.apply(params, x, rngs={"s3req": key})  # pyright: ignore
            return jnp.sum(a * g) + jnp.sum(b * g)  # pyright: ignore

        return jax.grad(f)(params)["params"]

    k1, k2 = getkey(), getkey()
    g1, g1b, g2 = grads(params, k1), grads(params, k1), grads(params, k2)
    assert not np.array_equal(g1["Dense_0"]["kernel"], g1["Dense_1"]["kernel"])
    np.testing.assert_array_equal(g1["Dense_0"]["kernel"], g1b["Dense_0"]["kernel"])
    assert not np.array_equal(g1["Dense_0"]["kernel"], g2["Dense_0"]["kernel"])


class _NnxTwin(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(16, 12, dot_general=sflax.NnxDotGeneral(POLICY, rngs), rngs=rngs)
        self.b = nnx.Linear(16, 12, dot_general=sflax.NnxDotGeneral(POLICY, rngs), rngs=rngs)
        self.b.kernel[...] = self.a.kernel[...]
        self.c = nnx.Einsum(
            "btd,dnh->btnh", (16, 2, 6), (2, 6), einsum_op=sflax.NnxEinsum(POLICY, rngs), rngs=rngs
        )

    def __call__(self, x):
        return self.a(x), self.b(x), self.c(x)


def test_nnx_thresholds_differ_across_layers_and_steps(getkey):
    model = _NnxTwin(nnx.Rngs(params=0, s3req=1))
    x = jr.normal(getkey(), (2, 8, 16))
    g = jr.normal(getkey(), (2, 8, 12))

    @nnx.jit
    def grads(model):
        def f(model):
            a, b, c = model(x)
            return jnp.sum(a * g) + jnp.sum(b * g) + jnp.sum(c * g.reshape(c.shape))

        return nnx.grad(f)(model)

    step1, step2 = grads(model), grads(model)  # the stream's counter advances
    k1a, k1b = step1["a"]["kernel"][...], step1["b"]["kernel"][...]
    assert not np.array_equal(k1a, k1b)
    assert not np.array_equal(k1a, step2["a"]["kernel"][...])
    assert not np.array_equal(step1["c"]["kernel"][...], step2["c"]["kernel"][...])


class _Block(nn.Module):
    """A pre-norm transformer block whose projections all run through s3req."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        dg = sflax.dot_general_cls(POLICY)
        hd = self.d // self.heads
        h = nn.LayerNorm()(x)
        q, k, v = (nn.DenseGeneral((self.heads, hd), dot_general_cls=dg)(h) for _ in range(3))
        s = jnp.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(hd)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        s = jnp.where(mask, s, -1e9)
        a = jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v)
        x = x + nn.DenseGeneral(self.d, axis=(-2, -1), dot_general_cls=dg)(a)
        h = nn.LayerNorm()(x)
        h = sflax.Einsum((self.d, 4 * self.d), "btd,df->btf", POLICY)(h)
        return x + nn.Dense(self.d, dot_general_cls=dg)(jax.nn.gelu(h))


class _Transformer(nn.Module):
    vocab: int = 16
    d: int = 32

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (tokens.shape[1], self.d))[None]
        for _ in range(2):
            x = _Block(self.d, 2)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))  # logits stay in float


def test_linen_transformer_trains(getkey):
    model = _Transformer()
    base = jr.randint(getkey(), (8, 1), 0, 16)
    tokens = (base + jnp.arange(17)[None]) % 16  # next token = current + 1
    params = model.init(getkey(), tokens[:, :-1])
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, key):
        def loss(params):
            logits: jax.Array = model.apply(params, tokens[:, :-1], rngs={"s3req": key})  # pyright: ignore
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
            updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for i in range(40):
        params, state, value = step(params, state, jr.fold_in(jr.key(7), i))
        losses.append(float(value))
    assert all(math.isfinite(l) for l in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_nnx_mlp_trains(getkey):
    rngs = nnx.Rngs(params=0, s3req=1)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            dg = lambda: sflax.NnxDotGeneral(POLICY, rngs)
            self.l1 = nnx.Linear(16, 64, dot_general=dg(), rngs=rngs)
            self.l2 = nnx.Linear(64, 4, dot_general=dg(), rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    model = MLP(rngs)
    x = jr.normal(getkey(), (8, 16, 16))
    y = jnp.tanh(2 * x[..., :4])
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss = lambda m: jnp.mean((m(x) - y) ** 2)
        value, grads = nnx.value_and_grad(loss)(model)
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_nnx_linear_on_a_mesh_of_explicit_axes(getkey):
    """`nnx.Linear` with `NnxDotGeneral` on `jax.make_mesh`'s default (Explicit) axes: the
    kernel's gradient keeps its sharding and equals, bitwise, the one on Auto axes."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    x = jr.normal(getkey(), (8, 4, 16))
    grads = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
        with jax.set_mesh(mesh):
            rngs = nnx.Rngs(params=0, s3req=1)
            layer = nnx.Linear(16, 32, dot_general=sflax.NnxDotGeneral(POLICY, rngs), rngs=rngs)
            kernel = jax.device_put(layer.kernel[...], NamedSharding(mesh, P(None, "model")))
            layer.kernel = nnx.Param(kernel)
            xs = jax.device_put(x, NamedSharding(mesh, P("data")))
            grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(jnp.sin(m(x)))))(layer, xs)
            grads.append(grad["kernel"][...])
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(grads[1]))
    assert jax.typeof(grads[0]).sharding.spec == P(None, "model")
