"""Peak host memory of `models.load_hf`: one copy of the parameters plus a bounded transient.

    python experiments/hf_load_memory.py                      # docs/results/hf_load_memory.*
    python experiments/hf_load_memory.py --layers 1 --vocab 1024 --out /tmp/r   # smoke

Method. A "layer cut" of the `llama3.1-8b` preset (its exact widths: d_model 4096, d_ff 14336,
32 heads, 8 kv heads; `--layers` decoder layers and a `--vocab`-token vocabulary instead of
32 and 128256) is written as a sharded bfloat16 Hugging Face checkpoint by one process, and
loaded by a fresh one (`load_hf(..., dtype=float32)`, then `bfloat16`). That process resets
its peak resident set size (`/proc/self/clear_refs`), loads, and reads the peak (`VmHWM`):
the transient is the peak minus the resident size before loading minus the bytes of the
loaded parameters. The reader does not memory-map the files, so no page cache is counted.
The transient does not grow with the model (the cuts with different layer counts show it);
the peak for the full 8B checkpoint is its parameter bytes (`jax.eval_shape` on the preset)
plus the largest transient measured. Linux only.
"""

import argparse
import dataclasses
import json
import pathlib
import subprocess
import sys
import tempfile
import time


ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESET = "llama3.1-8b"


def _status(field: str) -> int:
    """A `/proc/self/status` field (`VmRSS`, `VmHWM`) in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _child(argv: list[str]) -> None:
    """`write CONFIG_JSON FOLDER SHARDS` or `load FOLDER DTYPE [CHUNK INPLACE]`, in a fresh
    process; `load` prints its measurement as JSON."""
    import gc

    import jax
    import jax.numpy as jnp
    import jax.random as jr

    from models import _hf, Llama, LlamaConfig, load_hf, MoEConfig, RopeScaling, save_hf

    if argv[0] == "write":
        fields = json.loads(argv[1])
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if fields["moe"] is not None:
            fields["moe"] = MoEConfig(**fields["moe"])
        config = LlamaConfig(**fields)
        model = Llama(config, None, key=jr.key(0))
        model = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model)
        save_hf(model, argv[2], shards=int(argv[3]))
        return
    folder, dtype = argv[1], getattr(jnp, argv[2])
    if len(argv) > 3:
        _hf._CHUNK_BYTES, _hf._INPLACE_BYTES = int(argv[3]), int(argv[4])
    jnp.zeros(8).block_until_ready()  # start the backend before measuring
    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to VmRSS
    before = _status("VmRSS")
    t0 = time.perf_counter()
    model = jax.block_until_ready(load_hf(folder, dtype=dtype))
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    params = sum(x.nbytes for x in jax.tree.leaves(model))
    largest = max(x.nbytes for x in jax.tree.leaves(model))
    out = dict(before=before, peak=peak, after=_status("VmRSS"), params=params, seconds=seconds)
    out["largest"] = largest
    print(json.dumps(out))


def _run(*args: str) -> str:
    cmd = [sys.executable, __file__, "--child", *args]
    env = {"PYTHONPATH": str(ROOT), **__import__("os").environ}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def write_checkpoint(config, folder: pathlib.Path, shards: int = 2) -> None:
    """Write a random bfloat16 checkpoint of `config` (a `LlamaConfig`) in a fresh process."""
    _run("write", json.dumps(dataclasses.asdict(config)), str(folder), str(shards))


def measure_load(
    folder: pathlib.Path, dtype: str, chunk: int | None = None, inplace: int | None = None
) -> dict:
    """Load `folder` with `dtype` in a fresh process: resident bytes `before`, `peak`,
    `after`, parameter bytes `params`, `seconds`, and `transient` = peak - before - params.
    `chunk` and `inplace` set `_CHUNK_BYTES` and `_INPLACE_BYTES` of `models._hf`."""
    extra = [] if chunk is None else [str(chunk), str(inplace)]
    r = json.loads(_run("load", str(folder), dtype, *extra).strip().splitlines()[-1])
    r["transient"] = r["peak"] - r["before"] - r["params"]
    return r


def cut(layers: int, vocab: int):
    from models import get_config

    return dataclasses.replace(get_config(PRESET), n_layers=layers, vocab_size=vocab)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "results")
    ap.add_argument("--child", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return {}
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from models import count_params, get_config, Llama

    rows = []
    for layers in args.layers:
        config = cut(layers, args.vocab)
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(config, pathlib.Path(tmp), shards=2)
            disk = sum(p.stat().st_size for p in pathlib.Path(tmp).glob("*.safetensors"))
            for dtype in ("float32", "bfloat16"):
                r = measure_load(pathlib.Path(tmp), dtype)
                rows.append(dict(layers=layers, vocab=args.vocab, dtype=dtype, disk=disk, **r))
                print(json.dumps(rows[-1]), flush=True)
    full = eqx.filter_eval_shape(
        Llama, get_config(PRESET), None, key=jax.ShapeDtypeStruct((2,), jnp.uint32)
    )
    n = sum(x.size for x in jax.tree.leaves(full))
    assert n == count_params(get_config(PRESET))
    largest = max(x.size for x in jax.tree.leaves(full)) * 2  # bytes, as bfloat16
    # float32: a constant transient. bfloat16: the same plus one copy of the largest
    # parameter (XLA's CPU backend copies a buffer when it reinterprets the uint16 bits).
    for r in rows:
        r["fixed"] = r["transient"] - (r["largest"] if r["dtype"] == "bfloat16" else 0)
    estimate = {}
    for d, size in (("float32", 4), ("bfloat16", 2)):
        fixed = max(r["fixed"] for r in rows if r["dtype"] == d)
        transient = fixed + (largest if d == "bfloat16" else 0)
        estimate[d] = dict(params=n * size, transient=transient, peak=n * size + transient)
    result = dict(
        preset=PRESET,
        n_params=n,
        checkpoint_bytes=2 * n,
        largest_param_bytes=largest,
        estimate_8b=estimate,
        cuts=rows,
        host=dict(python=sys.version.split()[0], jax=jax.__version__),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hf_load_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "hf_load_memory.md").write_text(markdown(result))
    return result


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _mb(b: float) -> str:
    return f"{b / 1e6:.0f} MB"


def markdown(r: dict) -> str:
    e = r["estimate_8b"]
    lines = [
        "# Peak memory of `load_hf`",
        "",
        "`python experiments/hf_load_memory.py` (CPU; resident set size of a fresh process). "
        f"`{r['preset']}` has {r['n_params']:,} parameters: a {_gb(r['checkpoint_bytes'])} "
        "bfloat16 checkpoint.",
        "",
        "| loading the 8B bf16 checkpoint as | parameters | + transient | peak |",
        "| --- | ---: | ---: | ---: |",
    ]
    for d in ("float32", "bfloat16"):
        lines.append(
            f"| {d} | {_gb(e[d]['params'])} | {_mb(e[d]['transient'])} | {_gb(e[d]['peak'])} |"
        )
    lines += [
        "",
        "Two full float32 copies would need "
        f"{_gb(2 * e['float32']['params'])}. The transient is measured on layer cuts of the "
        "preset (its widths, fewer layers, a smaller vocabulary). Loading float32 parameters "
        "it is a constant (`fixed`); bfloat16 parameters are filled as their uint16 bits "
        "(XLA's CPU backend computes a bfloat16 `dynamic_update_slice` in float32 over the "
        "whole buffer), and reinterpreting them copies each parameter once, so their "
        "transient is that constant plus the largest parameter (for the 8B model a stacked "
        f"FFN weight, {_gb(r['largest_param_bytes'])}):",
        "",
        "| layers | vocab | dtype | checkpoint | parameters | peak - before | transient "
        "| largest parameter | fixed | load time |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in r["cuts"]:
        lines.append(
            f"| {c['layers']} | {c['vocab']} | {c['dtype']} | {_mb(c['disk'])} "
            f"| {_mb(c['params'])} | {_mb(c['peak'] - c['before'])} | {_mb(c['transient'])} "
            f"| {_mb(c['largest'])} | {_mb(c['fixed'])} | {c['seconds']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
