"""Checkpoints: Equinox serialisation of model + optimizer state, JSON metadata, atomic swap."""

import json
import os
import pathlib
import shutil
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree


CHECKPOINT_DIR = "checkpoint"
MODEL_FILE = "model.eqx"
OPT_FILE = "opt_state.eqx"
META_FILE = "meta.json"
FORMAT = 1


def _is_key(x: typing.Any) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _keys_to_data(tree: PyTree) -> PyTree:
    """Typed PRNG keys -> their raw `uint32` data (`tree_serialise_leaves` rejects keys)."""
    return jtu.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _like_without_keys(like: PyTree) -> PyTree:
    def convert(x):
        if not _is_key(x):
            return x
        return jax.eval_shape(jax.random.key_data, x)

    return jtu.tree_map(convert, like)


def _data_to_keys(tree: PyTree, like: PyTree) -> PyTree:
    def convert(x, ref):
        if _is_key(ref):
            return jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
        return x

    return jtu.tree_map(convert, tree, like)


def save_tree(path: str | pathlib.Path, tree: PyTree) -> None:
    """`eqx.tree_serialise_leaves` after turning typed keys into key data."""
    eqx.tree_serialise_leaves(path, _keys_to_data(tree))


def load_tree(path: str | pathlib.Path, like: PyTree) -> PyTree:
    """Inverse of `save_tree`: `like` may hold arrays or `jax.ShapeDtypeStruct`s."""
    loaded = eqx.tree_deserialise_leaves(path, _like_without_keys(like))
    return _data_to_keys(loaded, like)


def checkpoint_path(out: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint folder of a run folder."""
    return pathlib.Path(out) / CHECKPOINT_DIR


def has_checkpoint(out: str | pathlib.Path) -> bool:
    """Whether the run folder `out` holds a complete checkpoint."""
    return (checkpoint_path(out) / META_FILE).is_file()


def save_checkpoint(
    out: str | pathlib.Path,
    model: PyTree,
    opt_state: PyTree,
    meta: dict[str, typing.Any],
) -> pathlib.Path:
    """Write `out/checkpoint/{model.eqx, opt_state.eqx, meta.json}` and swap it in atomically.

    **Arguments:**

    - `out`: the run folder.
    - `model`: the model.
    - `opt_state`: the optimizer state.
    - `meta`: JSON-serialisable metadata (step, data-RNG state, config).

    **Returns:**

    The checkpoint folder.
    """
    final = checkpoint_path(out)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{CHECKPOINT_DIR}.{os.getpid()}.tmp")
    old = final.with_name(f".{CHECKPOINT_DIR}.{os.getpid()}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_tree(tmp / MODEL_FILE, model)
    save_tree(tmp / OPT_FILE, opt_state)
    (tmp / META_FILE).write_text(json.dumps({"format": FORMAT, **meta}, indent=1))
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_meta(out: str | pathlib.Path) -> dict[str, typing.Any]:
    """The metadata of the checkpoint in run folder `out`."""
    path = checkpoint_path(out) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"No checkpoint in {out} (expected {path}). Train first: s3req train --out {out}"
        )
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {meta.get('format')!r}.")
    return meta


def load_checkpoint(
    out: str | pathlib.Path, model_like: PyTree, opt_like: PyTree | None = None
) -> tuple[PyTree, PyTree | None, dict[str, typing.Any]]:
    """Read a checkpoint written by `save_checkpoint`.

    **Arguments:**

    - `out`: the run folder.
    - `model_like`: a model of the same structure (arrays or `jax.ShapeDtypeStruct`s).
    - `opt_like`: an optimizer state of the same structure, or `None` to skip it.

    **Returns:**

    `(model, opt_state or None, meta)`.
    """
    meta = load_meta(out)
    folder = checkpoint_path(out)
    model = load_tree(folder / MODEL_FILE, model_like)
    opt_state = None if opt_like is None else load_tree(folder / OPT_FILE, opt_like)
    return model, opt_state, meta
