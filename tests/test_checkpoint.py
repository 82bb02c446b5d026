"""Checkpoints: sharded restore, atomic saves under SIGKILL, checksums, SIGTERM, exact resume."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest
from jax.sharding import NamedSharding

from s3req.train import (
    CheckpointError,
    clean_checkpoint_temps,
    init_state,
    latest_checkpoint,
    load_checkpoint,
    load_run,
    main,
    make_optimizer,
    save_checkpoint,
    shard_model,
    TrainConfig,
)
from s3req.train._checkpoint import load_meta
from s3req.train._loop import _on_mesh


ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64}


def _leaves(tree):
    return [np.asarray(x) for x in jtu.tree_leaves(eqx.filter(tree, eqx.is_array))]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb)
    )


def _tree(value: float):
    return {"w": jnp.full((64, 32), value), "b": jnp.arange(5, dtype=jnp.int32)}, {
        "mu": jnp.full((64, 32), -value),
        "count": jnp.int32(7),
    }


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_restore_on_the_run_shardings(tmp_path):
    """Parameters and the optimizer state come back on the shardings of the run."""
    import models
    from policies import PRESETS

    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = models.get_config("tiny")
    optimizer, _ = make_optimizer(TrainConfig())

    def state(seed):
        model = shard_model(models.Llama(cfg, PRESETS["s3r"], key=jr.key(seed)), mesh)
        return _on_mesh(init_state(model, optimizer), mesh)

    saved = state(0)
    save_checkpoint(tmp_path, saved.model, saved.opt_state, {"step": 3})
    like = state(1)
    model, opt_state, meta = load_checkpoint(tmp_path, like.model, like.opt_state)
    assert meta["step"] == 3
    assert _same(model, saved.model) and _same(opt_state, saved.opt_state)
    shardings = lambda t: [x.sharding for x in jtu.tree_leaves(eqx.filter(t, eqx.is_array))]
    got = shardings((model, opt_state))
    assert all(isinstance(s, NamedSharding) for s in got)
    assert got == shardings((like.model, like.opt_state))
    # The Adam moments are split like their parameters (not replicated).
    assert opt_state is not None
    mu = opt_state[1][0].mu
    q_spec = model.layers[0].attn.q_proj.weight.sharding.spec
    assert mu.layers[0].attn.q_proj.weight.sharding.spec == q_spec
    assert tuple(q_spec) == (None, "tp", "fsdp")


_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    import s3req.train._checkpoint as ck

    out, where = sys.argv[1], sys.argv[2]
    tree = lambda v: ({"w": jnp.full((64, 32), v), "b": jnp.arange(5, dtype=jnp.int32)},
                      {"mu": jnp.full((64, 32), -v), "count": jnp.int32(7)})
    ck.save_checkpoint(out, *tree(1.0), {"step": 1})
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if where == "arrays":  # after the model's arrays, during the optimizer state's
        save = ck._checkpointer
        class Dying:
            def __init__(self):
                self.inner, self.calls = save(), 0
            def save(self, *a, **k):
                self.calls += 1
                if self.calls == 2:
                    kill()
                return self.inner.save(*a, **k)
        ck._checkpointer = Dying
    elif where == "manifest":  # while hashing the files, before meta.json
        ck._manifest = kill
    elif where == "cleanup":  # after the commit, before the old checkpoint is deleted
        ck.shutil.rmtree = kill
    ck.save_checkpoint(out, *tree(2.0), {"step": 2})
    """
)


@pytest.mark.parametrize("where", ["arrays", "manifest", "cleanup"])
def test_killed_during_save(tmp_path, where):
    """SIGKILL anywhere in a save leaves a complete, loadable checkpoint."""
    run = subprocess.run(
        [sys.executable, "-c", _KILLER, str(tmp_path), where],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    step = 2 if where == "cleanup" else 1  # the commit is the rename
    model, opt, meta = load_checkpoint(tmp_path, *_tree(0.0))
    assert meta["step"] == step
    assert _same(model, _tree(float(step))[0]) and _same(opt, _tree(float(step))[1])
    temps = list((tmp_path / "checkpoint").glob(".tmp-*"))
    assert len(temps) == (0 if where == "cleanup" else 1)
    assert clean_checkpoint_temps(tmp_path) == temps
    assert not list((tmp_path / "checkpoint").glob(".tmp-*"))
    save_checkpoint(tmp_path, *_tree(3.0), {"step": 3})
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step_00000003"]
    assert load_meta(tmp_path)["step"] == 3


def _biggest(folder: pathlib.Path) -> pathlib.Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("item", ["model", "opt_state"])
def test_damaged_files_are_named(tmp_path, damage, item):
    save_checkpoint(tmp_path, *_tree(1.0), {"step": 1})
    folder = latest_checkpoint(tmp_path)
    assert folder is not None
    victim = _biggest(folder / item)
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    word = {"flip": "SHA-256 does not match", "truncate": "truncated", "delete": "missing"}
    with pytest.raises(CheckpointError, match=word[damage]) as info:
        load_checkpoint(tmp_path, *_tree(0.0))
    assert str(victim) in str(info.value) and "--overwrite" in str(info.value)
    if item == "opt_state":  # the model alone still loads (e.g. for sampling)
        model, _, _ = load_checkpoint(tmp_path, _tree(0.0)[0])
        assert _same(model, _tree(1.0)[0])


@pytest.mark.parametrize("damage", ["truncate", "edit"])
def test_damaged_meta(tmp_path, damage):
    save_checkpoint(tmp_path, *_tree(1.0), {"step": 1})
    meta = latest_checkpoint(tmp_path) / "meta.json"  # pyright: ignore[reportOptionalOperand]
    text = meta.read_text()
    if damage == "truncate":
        meta.write_text(text[: len(text) // 2])
    else:
        meta.write_text(text.replace('"step": 1', '"step": 2'))
    match = "not valid JSON" if damage == "truncate" else "checksum does not match"
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(tmp_path, *_tree(0.0))
    assert str(meta) in str(info.value)


def test_wrong_structure(tmp_path):
    save_checkpoint(tmp_path, *_tree(1.0), {"step": 1})
    other = {"w": jnp.zeros((64, 32))}
    with pytest.raises(CheckpointError, match="written for another model"):
        load_checkpoint(tmp_path, other)


def _text_file(folder: pathlib.Path) -> pathlib.Path:
    path = folder / "verse.txt"
    path.write_text(
        "".join(
            f"Shall I compare thee to a summer's day {i % 9}? Thou art lovely.\n"
            for i in range(300)
        )
    )
    return path


_SLOW_TRAIN = textwrap.dedent(
    """
    import sys, time
    from s3req.train import TokenData, main

    draw = TokenData.sample_batch
    def slow(self, *a):
        time.sleep(0.15)
        return draw(self, *a)
    TokenData.sample_batch = slow
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigterm_saves_and_resume_is_exact(tmp_path):
    """SIGTERM (preemption) saves a checkpoint and exits 143; the resumed run ends bit for bit
    where the uninterrupted run ends; a changed --lr on resume is refused."""
    cfg = tmp_path / "small.json"
    cfg.write_text(json.dumps({"model": SMALL, "batch": 2, "seq_len": 16, "warmup": 2}))
    common = [
        "--config", str(cfg), "--steps", "40", "--eval-every", "20", "--eval-batches", "1",
        "--log-every", "1", "--data", str(_text_file(tmp_path)), "--cache", str(tmp_path / "c"),
    ]  # fmt: skip
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_TRAIN, "train", *common, "--out", str(run_dir)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    meta = load_meta(run_dir)
    assert 3 <= meta["step"] < 40
    assert f"SIGTERM after step {meta['step']}: checkpoint saved" in err
    assert not list((run_dir / "checkpoint").glob(".tmp-*"))

    with pytest.raises(SystemExit):  # a changed learning rate would make the resume inexact
        main(["train", *common, "--out", str(run_dir), "--resume", "--lr", "0.001", "--quiet"])
    assert main(["train", *common, "--out", str(run_dir), "--resume", "--quiet"]) == 0
    assert main(["train", *common, "--out", str(tmp_path / "full"), "--quiet"]) == 0
    resumed, _, _ = load_run(run_dir)
    full, _, _ = load_run(tmp_path / "full")
    assert _same(resumed, full)
    strip = lambda p: [
        {k: v for k, v in json.loads(line).items() if k != "time_s"}
        for line in (p / "metrics.jsonl").read_text().splitlines()
    ]
    assert strip(run_dir) == strip(tmp_path / "full")
