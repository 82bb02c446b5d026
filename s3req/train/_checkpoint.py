"""Checkpoints: orbax-checkpoint for the arrays, a checksummed JSON manifest, one atomic rename.

A checkpoint of run folder `out` is the folder `out/checkpoint/step_<N>/` holding

- `model/` and `opt_state/`: the array leaves of the model and of the optimizer state, written
  by orbax-checkpoint (tensorstore OCDBT). Every process writes its own shards, so sharded and
  multi-process arrays are saved without gathering them, and a restore puts every array
  straight onto the sharding the caller asks for;
- `meta.json`: the step, the data-generator state, the config, the names of the saved leaves,
  the size and SHA-256 of every file of the checkpoint, and the SHA-256 of `meta.json`'s own
  content.

A save writes everything into `out/checkpoint/.tmp-step_<N>/` and then renames that folder to
`step_<N>` (one atomic `rename` on a POSIX file system) before it deletes the older
checkpoint. A crash or kill at any moment therefore leaves the previous checkpoint complete and
loadable; the leftover `.tmp-*` folder is removed by the next save or the next `train` start
in that run folder ([`s3req.train.clean_checkpoint_temps`][]). A load checks every file against
the manifest before it reads any array, and raises [`s3req.train.CheckpointError`][] naming
the file and what to do when one is missing, truncated or altered.
"""

import hashlib
import json
import os
import pathlib
import shutil
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import SingleDeviceSharding
from jaxtyping import PyTree


CHECKPOINT_DIR = "checkpoint"
META_FILE = "meta.json"
MODEL_DIR = "model"
OPT_DIR = "opt_state"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
FORMAT = 2


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or damaged; the message names the file and the fix."""


def _is_key(x: typing.Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _is_leaf_array(x: typing.Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _arrays(tree: PyTree) -> tuple[list[str], list[typing.Any]]:
    """The array leaves of `tree` (typed keys as their key data) and their tree paths."""
    names, leaves = [], []
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        if _is_leaf_array(leaf):
            names.append(jtu.keystr(path))
            is_key_array = _is_key(leaf) and eqx.is_array(leaf)
            leaves.append(jax.random.key_data(leaf) if is_key_array else leaf)
    return names, leaves


def _target(like: typing.Any) -> jax.ShapeDtypeStruct:
    """What orbax restores a leaf into: the shape, dtype and sharding of `like`."""
    if _is_key(like):
        like = jax.eval_shape(jax.random.key_data, like)
        sharding = None  # key data has one more axis than the key: placed after the restore
    else:
        sharding = getattr(like, "sharding", None)
    if sharding is None:
        sharding = SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)


def _rebuild(like: PyTree, restored: list[typing.Any]) -> PyTree:
    """`like` with its array leaves replaced, in order, by `restored`."""
    leaves, treedef = jtu.tree_flatten(like)
    it = iter(restored)
    out = []
    for leaf in leaves:
        if not _is_leaf_array(leaf):
            out.append(leaf)
            continue
        value = next(it)
        if _is_key(leaf):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
            sharding = getattr(leaf, "sharding", None)
            if sharding is not None:
                value = jax.device_put(value, sharding)
        out.append(value)
    return jtu.tree_unflatten(treedef, out)


def _checkpointer() -> typing.Any:
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _sync(name: str) -> None:
    """A barrier across processes (nothing to wait for in a single process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: pathlib.Path) -> dict[str, dict[str, typing.Any]]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != META_FILE)
    return {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in files
    }


def _meta_digest(meta: dict[str, typing.Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _write_synced(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_path(out: str | pathlib.Path) -> pathlib.Path:
    """The folder that holds the checkpoints of run folder `out` (`out/checkpoint`)."""
    return pathlib.Path(out) / CHECKPOINT_DIR


def _step_dirs(out: str | pathlib.Path) -> list[tuple[int, pathlib.Path]]:
    root = checkpoint_path(out)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        suffix = p.name[len(STEP_PREFIX) :]
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and suffix.isdigit():
            found.append((int(suffix), p))
    return sorted(found)


def latest_checkpoint(out: str | pathlib.Path) -> pathlib.Path | None:
    """The newest committed checkpoint folder of run folder `out`, or `None`."""
    dirs = _step_dirs(out)
    return dirs[-1][1] if dirs else None


def has_checkpoint(out: str | pathlib.Path) -> bool:
    """Whether run folder `out` holds a committed checkpoint."""
    return latest_checkpoint(out) is not None


def clean_checkpoint_temps(out: str | pathlib.Path) -> list[pathlib.Path]:
    """Delete the unfinished saves (`out/checkpoint/.tmp-*`) a killed process left behind.

    `train` calls it when it starts in a run folder and before every save; only the first
    process deletes (the folder is shared between processes).

    **Arguments:**

    - `out`: the run folder.

    **Returns:**

    The folders deleted.
    """
    root = checkpoint_path(out)
    if jax.process_index() != 0 or not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def save_checkpoint(
    out: str | pathlib.Path,
    model: PyTree,
    opt_state: PyTree,
    meta: dict[str, typing.Any],
) -> pathlib.Path:
    """Save `out/checkpoint/step_<N>/` atomically and delete the older checkpoint.

    Every process of a multi-process run must call it (each writes its own shards); the first
    process writes `meta.json` and renames the folder into place.

    **Arguments:**

    - `out`: the run folder.
    - `model`: the model (any pytree; its array leaves are saved, sharded or not).
    - `opt_state`: the optimizer state (saved the same way).
    - `meta`: JSON-serialisable metadata; `meta["step"]` (an `int`) names the checkpoint.

    **Returns:**

    The checkpoint folder.
    """
    import orbax.checkpoint as ocp

    step = int(meta["step"])
    root = checkpoint_path(out)
    name = f"{STEP_PREFIX}{step:08d}"
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
    primary = jax.process_index() == 0
    if primary:
        root.mkdir(parents=True, exist_ok=True)
        clean_checkpoint_temps(out)
        tmp.mkdir()
    _sync(f"s3req-ckpt-start-{step}")
    model_names, model_leaves = _arrays(model)
    opt_names, opt_leaves = _arrays(opt_state)
    ckptr = _checkpointer()
    ckptr.save(tmp / MODEL_DIR, args=ocp.args.StandardSave(model_leaves))
    ckptr.save(tmp / OPT_DIR, args=ocp.args.StandardSave(opt_leaves))
    _sync(f"s3req-ckpt-written-{step}")
    if primary:
        record = {
            "format": FORMAT,
            **meta,
            "leaves": {MODEL_DIR: model_names, OPT_DIR: opt_names},
            "files": _manifest(tmp),
        }
        record["sha256"] = _meta_digest(record)
        _write_synced(tmp / META_FILE, json.dumps(record, indent=1))
        if final.exists():  # the same step saved again (e.g. a run restarted with --overwrite)
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit
        for _, older in _step_dirs(out):
            if older != final:
                shutil.rmtree(older, ignore_errors=True)
    _sync(f"s3req-ckpt-done-{step}")
    return final


def _fix() -> str:
    return (
        "Restore the file from a backup, or start the run again without --resume "
        "(add --overwrite to replace this run folder)."
    )


def _read_meta(folder: pathlib.Path) -> dict[str, typing.Any]:
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete. {_fix()}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged (not valid JSON: {e}). {_fix()}") from None
    if not isinstance(meta, dict) or meta.get("sha256") != _meta_digest(meta):
        raise CheckpointError(f"{path} is damaged (its checksum does not match). {_fix()}")
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format')!r}, this version of s3req reads "
            f"format {FORMAT}. Start the run again (add --overwrite)."
        )
    return meta


def _verify(folder: pathlib.Path, meta: dict[str, typing.Any], items: tuple[str, ...]) -> None:
    for rel, want in meta["files"].items():
        if rel.split("/")[0] not in items:
            continue
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint. {_fix()}")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"{path} is truncated or altered: {size} bytes, the checkpoint wrote "
                f"{want['size']}. {_fix()}"
            )
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(
                f"{path} is damaged: its SHA-256 does not match the one saved in "
                f"{folder / META_FILE}. {_fix()}"
            )


def load_meta(out: str | pathlib.Path) -> dict[str, typing.Any]:
    """The verified metadata of the newest checkpoint of run folder `out`.

    Raises `FileNotFoundError` when there is none and [`s3req.train.CheckpointError`][] when
    `meta.json` is damaged.
    """
    folder = latest_checkpoint(out)
    if folder is None:
        raise FileNotFoundError(
            f"No checkpoint in {out} (expected {checkpoint_path(out)}/{STEP_PREFIX}N). "
            f"Train first: s3req train --out {out}"
        )
    return _read_meta(folder)


def load_checkpoint(
    out: str | pathlib.Path, model_like: PyTree, opt_like: PyTree | None = None
) -> tuple[PyTree, PyTree | None, dict[str, typing.Any]]:
    """Verify and read the newest checkpoint of run folder `out`.

    Every file is checked against the sizes and SHA-256 sums of `meta.json` first. Each array
    is restored onto the sharding of the matching leaf of `model_like` / `opt_like` (a leaf
    without one, e.g. a `jax.ShapeDtypeStruct` from `eqx.filter_eval_shape`, goes to the first
    local device), so a sharded run gets its parameters and optimizer state back sharded.

    **Arguments:**

    - `out`: the run folder.
    - `model_like`: a model of the same structure (arrays or `jax.ShapeDtypeStruct`s).
    - `opt_like`: an optimizer state of the same structure, or `None` to skip it.

    **Returns:**

    `(model, opt_state or None, meta)`.
    """
    import orbax.checkpoint as ocp

    meta = load_meta(out)
    folder = latest_checkpoint(out)
    assert folder is not None
    wanted = [(MODEL_DIR, model_like)] + ([] if opt_like is None else [(OPT_DIR, opt_like)])
    _verify(folder, meta, tuple(item for item, _ in wanted))
    ckptr = _checkpointer()
    restored = []
    for item, like in wanted:
        names, leaves = _arrays(like)
        saved = meta["leaves"][item]
        if names != saved:
            extra = sorted(set(saved) ^ set(names))[:3]
            raise CheckpointError(
                f"{folder / item}: the checkpoint holds {len(saved)} arrays and the run "
                f"expects {len(names)} (differing: {extra}); it was written for another model "
                "or optimizer. Use the config of the run that wrote it, or a new --out."
            )
        targets = [_target(leaf) for leaf in jtu.tree_leaves(like) if _is_leaf_array(leaf)]
        try:
            values = ckptr.restore(folder / item, args=ocp.args.StandardRestore(targets))
        except Exception as e:  # tensorstore/orbax errors: name the folder and the fix
            raise CheckpointError(f"{folder / item} could not be read ({e}). {_fix()}") from e
        restored.append(_rebuild(like, list(values)))
    model = restored[0]
    opt_state = restored[1] if opt_like is not None else None
    return model, opt_state, meta
