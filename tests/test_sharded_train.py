"""Sharded training: a few steps on a fsdp x tp mesh give the unsharded loss curve."""

import jax
import numpy as np
import pytest

from policies import PRESETS
from s3req.train import TokenData, train, TrainConfig
from s3req.train._sharding import make_mesh, param_shardings, parse_mesh

from .helpers import release_executables


pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


@pytest.fixture(autouse=True)
def _release_executables():
    """Free every compiled program after each test: each training run compiles a few
    hundred XLA CPU kernels (see `helpers.release_executables`)."""
    yield
    release_executables()


_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64}


def _data():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 64, 4000).astype(np.uint16)
    return TokenData(train=text[:3000], val=text[3000:], vocab_size=64)


def _losses(preset, policy, mesh, data):
    model = dict(_MODEL)
    if preset == "tiny-moe":
        model.pop("d_ff")
    config = TrainConfig(
        preset=preset,
        policy=policy,
        steps=3,
        batch=8,
        seq_len=16,
        warmup=1,
        eval_every=0,
        eval_batches=1,
        log_every=1,
        model=model,
    )
    result = train(config, data=data, mesh=mesh, progress=False)
    return np.array([r["train_loss"] for r in result.metrics])


# Every case runs with -m slow (35 s to about 1 min each here); the default suite checks a
# sharded training step (tests/test_mesh_policies.py) and the sharded GEMMs (test_sharding.py).
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("policy", list(PRESETS))
def test_sharded_loss_curve_matches(preset, policy):
    data = _data()
    ref = _losses(preset, policy, None, data)
    got = _losses(preset, policy, "fsdp=4,tp=2", data)
    assert ref.shape == got.shape == (4,)
    # The first loss is the forward pass of identical parameters: equal to float precision.
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    # Thresholds are bitwise the same on every mesh, but the sharded GEMMs sum in another
    # order, so a gradient element that lands on a rounding boundary (or a router logit on a
    # top-k tie) can flip; Adam then moves that parameter by up to one learning rate. The
    # curves must agree far below the scale of training progress: within a tenth of the mean
    # loss change per step.
    tol = 0.1 * np.mean(np.abs(np.diff(ref)))
    assert np.max(np.abs(got - ref)) <= tol, (got, ref, tol)


def test_mesh_parsing_and_errors():
    assert parse_mesh("fsdp=4,tp=2") == {"fsdp": 4, "tp": 2}
    assert parse_mesh("tp=8") == {"fsdp": 1, "tp": 8}
    for bad in ("dp=2", "fsdp=x", "fsdp=4;tp=2", "fsdp=0"):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh("fsdp=16,tp=2")
    with pytest.raises(ValueError, match="divisible"):
        train(TrainConfig(batch=6, steps=1, model=_MODEL), data=_data(), mesh="fsdp=4,tp=2")


def test_parameter_specs():
    import jax.random as jr

    from models import get_config, Llama

    mesh = make_mesh("fsdp=4,tp=2")
    m = Llama(get_config("tiny"), PRESETS["s3r"], key=jr.key(0))
    sh = param_shardings(m, mesh)
    layer = sh.layers[0]
    assert tuple(layer.attn.q_proj.weight.spec) == (None, "tp", "fsdp")  # column-parallel
    assert tuple(layer.attn.o_proj.weight.spec) == (None, "fsdp", "tp")  # row-parallel
    assert tuple(layer.mlp.down.weight.spec) == (None, "fsdp", "tp")
    assert tuple(sh.norm.weight.spec) == (None,)


def test_parameter_specs_of_abstract_trees():
    """`param_shardings` on `ShapeDtypeStruct` trees (a model from `eqx.filter_eval_shape`,
    its AdamW state from `jax.eval_shape`) gives the concrete parameters' specs."""
    import collections

    import equinox as eqx
    import jax.random as jr

    from models import get_config, Llama
    from s3req.train import make_optimizer

    mesh = make_mesh("fsdp=4,tp=2")
    m = Llama(get_config("tiny"), PRESETS["s3r"], key=jr.key(0))
    abstract = eqx.filter_eval_shape(Llama, get_config("tiny"), PRESETS["s3r"], key=jr.key(0))
    specs = lambda tree: [
        None if s is None else tuple(s.spec)
        for s in jax.tree.leaves(param_shardings(tree, mesh), is_leaf=lambda x: x is None)
    ]
    concrete = specs(m)
    assert specs(abstract) == concrete
    assert (None, "tp", "fsdp") in concrete and (None, "fsdp", "tp") in concrete
    optimizer, _ = make_optimizer(TrainConfig())
    opt = jax.eval_shape(optimizer.init, eqx.filter(m, eqx.is_inexact_array))
    sh = param_shardings(opt, mesh)
    moments = [s for s in jax.tree.leaves(sh) if s is not None and tuple(s.spec) != ()]
    # AdamW's two moments mirror the parameters' paths, so they get the parameters' specs.
    params = [s for s in concrete if s is not None and s != ()]
    count = lambda specs: collections.Counter(map(repr, specs))
    assert count(tuple(s.spec) for s in moments) == count(params * 2)
