"""Training loop: exact resume, metrics, determinism, checkpoints, sampling, bad configs."""

import dataclasses
import json
import math
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from s3req.train import (
    ByteTokenizer,
    load_checkpoint,
    load_run,
    sample,
    save_checkpoint,
    TokenData,
    train,
    TrainConfig,
)
from s3req.train._checkpoint import load_meta


# A very small Llama: compile time and steps stay well under a second each.
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64}


@pytest.fixture(scope="module")
def data():
    text = "".join(
        f"To be, or not to be, that is the question {i % 7}: whether 'tis nobler {i % 5}.\n"
        for i in range(300)
    )
    tok = ByteTokenizer()
    cut = int(len(text) * 0.9)
    return TokenData(tok.encode(text[:cut]), tok.encode(text[cut:]), 256, tok, name="toy")


def _config(tmp_path, name, **kw):
    base: dict[str, typing.Any] = dict(
        steps=6,
        batch=2,
        seq_len=16,
        warmup=2,
        eval_every=2,
        eval_batches=2,
        log_every=1,
        model=SMALL,
        out=None if tmp_path is None else str(tmp_path / name),
    )
    return TrainConfig(**{**base, **kw})


def _mem(**kw):
    """An in-memory config sharing the optimizer (hence the compiled step) of `_config`."""
    base: dict[str, typing.Any] = dict(
        steps=6, batch=2, seq_len=16, warmup=2, eval_every=0, eval_batches=1, model=SMALL
    )
    return TrainConfig(**{**base, **kw})


def _leaves(tree):
    return [np.asarray(x) for x in jtu.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _strip_time(metrics):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in metrics]


def _opt_like(model):
    from s3req.train import init_state, make_optimizer

    return init_state(model, make_optimizer(_config(None, "x"))[0]).opt_state


def _same_trees(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, data):
    """The uninterrupted reference run of `test_exact_resume`."""
    tmp = tmp_path_factory.mktemp("full")
    return tmp, train(_config(tmp, "full"), data=data, progress=False)


@pytest.mark.parametrize("interrupt", [False, True], ids=["stop_at", "ctrl_c"])
def test_exact_resume(tmp_path, data, full_run, interrupt, monkeypatch):
    """Stopped at step 3 and resumed == uninterrupted, bit for bit (stochastic policy)."""
    full_dir, full = full_run
    cfg = _config(tmp_path, "split")
    if interrupt:
        draw = TokenData.sample_batch
        calls = []

        def flaky(self, rng, batch, seq_len):
            calls.append(None)
            if len(calls) == 4:  # Ctrl-C while drawing the batch of step 3
                raise KeyboardInterrupt
            return draw(self, rng, batch, seq_len)

        monkeypatch.setattr(TokenData, "sample_batch", flaky)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, data=data, progress=False)
        monkeypatch.undo()
    else:
        part = train(cfg, data=data, stop_at=3, progress=False)
        assert part.step == 3
        assert not _same_trees(part.model, full.model)
    assert load_meta(tmp_path / "split")["step"] == 3
    resumed = train(cfg, data=data, resume=True, progress=False)
    assert resumed.step == 6
    assert _same_trees(resumed.model, full.model)
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert _strip_time(map(json.loads, lines)) == _strip_time(full.metrics)
    assert _strip_time(resumed.metrics) == _strip_time(full.metrics)
    # The optimizer state and the data generator agree too.
    m_full, m_split = load_meta(full_dir / "full"), load_meta(tmp_path / "split")
    assert m_full["data_rng"] == m_split["data_rng"] and m_full["step"] == m_split["step"] == 6
    like = (full.model, resumed.model)
    _, opt_full, _ = load_checkpoint(full_dir / "full", full.model, _opt_like(full.model))
    _, opt_split, _ = load_checkpoint(tmp_path / "split", like[1], _opt_like(like[1]))
    assert _same_trees(opt_full, opt_split)


def test_metrics_well_formed(tmp_path, data):
    cfg = _config(tmp_path, "run", eval_every=3, log_every=2, ckpt_every=4)
    result = train(cfg, data=data, progress=False)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records == result.metrics
    steps = [r["step"] for r in records]
    assert steps == [0, 2, 3, 4, 6]  # log_every, eval_every and the final step
    for r in records:
        assert isinstance(r["step"], int)
        assert isinstance(r["train_loss"], float) and math.isfinite(r["train_loss"])
        assert r.keys() >= {"step", "train_loss", "lr", "tokens", "time_s"}
        assert ("val_loss" in r) == (r["step"] in (0, 3, 6))
        if "val_loss" in r:
            assert math.isfinite(r["val_loss"])
    assert records[0]["val_loss"] == pytest.approx(math.log(256), abs=0.3)
    assert records[0]["lr"] == 0.0 and records[2]["lr"] == pytest.approx(cfg.lr, rel=0.2)
    assert load_meta(tmp_path / "run")["step"] == 6
    assert (tmp_path / "run" / "loss_curve.png").read_bytes().startswith(b"\x89PNG")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert TrainConfig.from_dict(saved) == cfg


def test_run_is_a_function_of_the_seed(data):
    a = train(_mem(), data=data, stop_at=2, progress=False)
    b = train(_mem(), data=data, stop_at=2, progress=False)
    c = train(_mem(seed=1), data=data, stop_at=2, progress=False)
    assert a.out is None
    assert _same_trees(a.model, b.model)
    assert not _same_trees(a.model, c.model)


def test_step_keys_are_fresh(data, monkeypatch):
    """The step key is fold_in(train_key, step): a different key every step."""
    seen = []
    fold_in = jr.fold_in

    def spy(key, data):
        seen.append(data)
        return fold_in(key, data)

    import s3req.train._loop as loop

    monkeypatch.setattr(loop.jr, "fold_in", spy)
    train(_mem(), data=data, stop_at=3, progress=False)
    # the last fold_ins are the three steps' (model initialisation may fold in too)
    assert seen[-3:] == [0, 1, 2]


def test_bf16_compute(data):
    cfg = _mem(compute_dtype="bfloat16", policy="s3r")
    r = train(cfg, data=data, stop_at=2, progress=False)
    assert all(math.isfinite(m["train_loss"]) for m in r.metrics)
    assert r.model.config.compute_dtype == "bfloat16"


def test_sample(tmp_path, data):
    cfg = _config(tmp_path, "run", eval_every=0)
    result = train(cfg, data=data, stop_at=3, progress=False)
    model, tok, loaded_cfg = load_run(tmp_path / "run")
    assert loaded_cfg == cfg and tok == ByteTokenizer()
    assert _same_trees(model, result.model)
    g1 = sample(model, tok, "To be", tokens=20, temperature=0.0, context=16, key=jr.key(0))
    g2 = sample(model, tok, "To be", tokens=20, temperature=0.0, context=16, key=jr.key(1))
    assert g1 == g2  # greedy ignores the key
    s1 = sample(model, tok, "To be", tokens=20, temperature=1.0, context=16, key=jr.key(0))
    s2 = sample(model, tok, "To be", tokens=20, temperature=1.0, context=16, key=jr.key(0))
    assert s1 == s2 and isinstance(s1, str)
    ids = sample(model, None, "84 111", tokens=5, temperature=0.0, context=16, key=jr.key(0))
    assert len(ids.split()) == 5
    with pytest.raises(ValueError, match="temperature"):
        sample(model, tok, "x", temperature=-1.0, key=jr.key(0))


def test_checkpoint_typed_keys(tmp_path):
    tree = {"w": jnp.arange(3.0), "k": jr.key(7), "ks": jr.split(jr.key(1), 2), "n": 3}
    save_checkpoint(tmp_path, tree, {"count": jnp.int32(4)}, {"step": 1})
    like = dict(tree, w=jnp.zeros(3), k=jr.key(0), ks=jr.split(jr.key(0), 2))
    back, opt, meta = load_checkpoint(tmp_path, like, {"count": jnp.int32(0)})
    assert opt is not None
    assert meta["step"] == 1 and int(opt["count"]) == 4 and back["n"] == 3
    assert np.array_equal(back["w"], tree["w"])
    assert np.array_equal(jr.key_data(back["k"]), jr.key_data(tree["k"]))
    assert np.array_equal(jr.key_data(back["ks"]), jr.key_data(tree["ks"]))
    assert jax.dtypes.issubdtype(back["k"].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(steps=-1), "steps must be >= 0"),
        (dict(policy="s4r"), "Unknown policy 's4r'; choose one of: bf16"),
        (dict(tokenizer="wordpiece"), "Unknown tokenizer"),
        (dict(eval_batches=-1), "eval_batches"),
        (dict(model={"width": 3}), "Unknown model option 'width'"),
        (dict(seq_len=512), "max_seq_len 256"),
        (dict(compute_dtype="float16"), "compute_dtype"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)
    assert TrainConfig(eval_batches=0).eval_batches is None  # 0: the whole stream


def test_bad_run_arguments(tmp_path, data):
    with pytest.raises(ValueError, match="max_seq_len 256.*--seq-len 256"):
        train(TrainConfig(seq_len=512), data=data, progress=False)
    with pytest.raises(ValueError, match="Unknown model preset 'huge'"):
        train(TrainConfig(preset="huge"), data=data, progress=False)
    with pytest.raises(ValueError, match="Unknown model option"):
        train(TrainConfig(model={"width": 3}), data=data, progress=False)
    with pytest.raises(ValueError, match="--mesh"):
        train(TrainConfig(), data=data, mesh="dp=2", progress=False)
    with pytest.raises(FileNotFoundError, match="Drop --resume"):
        train(_config(tmp_path, "none"), data=data, resume=True, progress=False)
    with pytest.raises(ValueError, match="Unknown training option 'stepz'"):
        TrainConfig.from_dict({"stepz": 3})
    assert TrainConfig.from_dict({"seq-len": 32, "lr": 1}).lr == 1.0
    cfg = _config(tmp_path, "r", eval_every=0)
    train(cfg, data=data, stop_at=1, progress=False)
    with pytest.raises(ValueError, match="different policy"):
        train(
            dataclasses.replace(cfg, policy="s3r"),
            data=data,
            resume=True,
            progress=False,
        )
