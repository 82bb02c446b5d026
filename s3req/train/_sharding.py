"""Sharded training on a 2-D `fsdp` x `tp` device mesh with `jax.jit` and `NamedSharding`.

Parameters are FSDP-sharded and tensor-parallel: column-parallel projections (q, k, v, gate,
up and the experts' gate/up) split their output features on `tp`, row-parallel ones (o, down
and the experts' down) their input features; the other feature axis of every weight is split
on `fsdp`. The batch is split on `fsdp`. XLA's SPMD partitioner (GSPMD, `AxisType.Auto`)
inserts the collectives; the optimizer state follows the parameters. Thresholds are computed
from global element indices, so they are bitwise the same on every mesh.
"""

import os
import typing

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P


AXES = ("fsdp", "tp")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate", "up"}
_ROW = {"o_proj", "down"}


def parse_mesh(spec: str) -> dict[str, int]:
    """Parse `"fsdp=4,tp=2"` into `{"fsdp": 4, "tp": 2}` (a missing axis has size 1).

    **Arguments:**

    - `spec`: comma-separated `axis=size` pairs over the axes `fsdp` and `tp`.

    **Returns:**

    The axis sizes.
    """
    sizes = {"fsdp": 1, "tp": 1}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in sizes or not value.strip().isdigit():
            raise ValueError(f"--mesh: expected 'fsdp=N,tp=M' (axes fsdp and tp), got {spec!r}.")
        sizes[name.strip()] = int(value)
        if sizes[name.strip()] < 1:
            raise ValueError(f"--mesh: axis sizes must be positive, got {spec!r}.")
    return sizes


def make_mesh(spec: "str | dict[str, int] | Mesh") -> Mesh:
    """A `fsdp` x `tp` mesh of `AxisType.Auto` axes over the first `fsdp * tp` devices.

    **Arguments:**

    - `spec`: `"fsdp=4,tp=2"`, a dict of axis sizes, or a ready `jax.sharding.Mesh` (returned
      as is; it must have axes named `fsdp` and `tp`).

    **Returns:**

    The mesh.
    """
    if isinstance(spec, Mesh):
        if set(spec.axis_names) != set(AXES):
            raise ValueError(f"mesh: expected axes {AXES}, got {spec.axis_names}.")
        return spec
    sizes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    n = sizes["fsdp"] * sizes["tp"]
    if n > len(jax.devices()):
        raise ValueError(
            f"mesh {sizes} needs {n} devices but JAX sees {len(jax.devices())}. On CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python."
        )
    return jax.make_mesh(
        (sizes["fsdp"], sizes["tp"]), AXES, axis_types=(AxisType.Auto, AxisType.Auto)
    )


def _names(path) -> list[str]:
    return [k.name for k in path if isinstance(k, jtu.GetAttrKey)]


def _spec_for(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The partition spec of one parameter, from its name and shape."""
    names = _names(path)
    field = names[-1] if names else ""
    owner = names[-2] if len(names) > 1 else ""
    axes: list[str | None] = [None] * len(shape)
    if field == "weight" and owner in _COLUMN | _ROW and len(shape) >= 2:
        out_ax, in_ax = len(shape) - 2, len(shape) - 1  # (..., out, in) as eqx.nn.Linear
        tp_ax, fsdp_ax = (out_ax, in_ax) if owner in _COLUMN else (in_ax, out_ax)
        axes[tp_ax], axes[fsdp_ax] = "tp", "fsdp"
    elif field in ("w_gate", "w_up") and len(shape) >= 3:  # (..., experts, d_model, d_expert)
        axes[-1], axes[-2] = "tp", "fsdp"
    elif field == "w_down" and len(shape) >= 3:  # (..., experts, d_expert, d_model)
        axes[-2], axes[-1] = "tp", "fsdp"
    elif field in ("embed", "head") and len(shape) == 2:  # (vocab, d_model)
        # Both mesh axes split the vocabulary: with `fsdp` on `d_model`, XLA's SPMD partitioner
        # mis-sliced the embedding gather (whose token batch is also split over `fsdp`) on
        # some meshes: "Slice dim size 32 greater than dynamic slice dimension: 16" (hlo
        # verifier) on fsdp=2,tp=4 with two-way EC.
        if shape[0] % (mesh.shape["tp"] * mesh.shape["fsdp"]) == 0:
            return P(("tp", "fsdp"), None)
        axes[0] = "tp"
    # An axis that does not divide its dimension is left unsplit.
    for i, a in enumerate(axes):
        if a is not None and shape[i] % mesh.shape[a]:
            axes[i] = None
    return P(*axes)


def param_shardings(model: typing.Any, mesh: Mesh) -> typing.Any:
    """A pytree like `model` with a `NamedSharding` for every array (`None` elsewhere).

    The leaves may also be `jax.ShapeDtypeStruct`s, as in a model built abstractly with
    `eqx.filter_eval_shape(models.Llama, config, policy, key=key)` or an optimizer state from
    `jax.eval_shape`: each gets the sharding its array would get, so a program can be
    lowered and compiled for `mesh` (e.g. with `s3req.tpu.compile_for_tpu`) without
    allocating the parameters. The rule depends only on a leaf's attribute path and shape,
    so an optimizer state whose leaves mirror the model's paths (AdamW's moments) is
    sharded like the parameters.

    **Arguments:**

    - `model`: a `models.Llama` (or any model built from `QuantLinear` layers), or a pytree
      holding one (an optimizer state); arrays or `jax.ShapeDtypeStruct` leaves.
    - `mesh`: a mesh with axes `fsdp` and `tp`, e.g. from [`s3req.train.make_mesh`][].

    **Returns:**

    The shardings.

    ```python
    import equinox as eqx
    import jax
    import jax.random as jr

    import models
    from s3req.train import make_mesh, param_shardings

    cfg = models.PRESETS["tiny"]
    abstract = eqx.filter_eval_shape(models.Llama, cfg, None, key=jr.key(0))
    shardings = param_shardings(abstract, make_mesh("fsdp=1,tp=1"))
    placed = jax.tree.map(
        lambda x, s: x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        shardings,
        is_leaf=lambda x: x is None,
    )
    ```
    """
    return jtu.tree_map_with_path(
        lambda path, x: (
            NamedSharding(mesh, _spec_for(path, x.shape, mesh))
            if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
            else None
        ),
        model,
    )


def place(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """Put `x`, the same on every process, onto `sharding`, which may span the devices of
    several processes (each process fills only its own devices)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(model: eqx.Module, mesh: Mesh) -> eqx.Module:
    """Place `model`'s arrays on `mesh` with [`s3req.train.param_shardings`][]."""
    shardings = param_shardings(model, mesh)
    return jtu.tree_map(
        lambda x, s: place(x, s) if eqx.is_array(x) else x,
        model,
        shardings,
        is_leaf=lambda x: x is None,
    )


def init_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
) -> bool:
    """Start `jax.distributed` for a run over several processes (hosts), before any other JAX
    call.

    Each value comes from its argument, else from the environment variables
    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`. With none of them set,
    `auto=True` lets `jax.distributed.initialize()` detect the cluster (SLURM, Open MPI,
    Cloud TPU pods, ...); otherwise nothing is started.

    **Arguments:**

    - `coordinator`: `host:port` of process 0, reachable from every process.
    - `num_processes`: how many processes take part.
    - `process_id`: this process's index, `0 .. num_processes - 1`.
    - `auto`: detect the cluster when nothing is given. (Keyword only argument.)

    **Returns:**

    Whether `jax.distributed` was started.
    """
    env = os.environ.get
    coordinator = coordinator or env("JAX_COORDINATOR_ADDRESS")
    n = num_processes if num_processes is not None else env("JAX_NUM_PROCESSES")
    i = process_id if process_id is not None else env("JAX_PROCESS_ID")
    if coordinator is None and n is None and i is None:
        if auto:
            jax.distributed.initialize()
            return True
        return False
    if coordinator is None or n is None or i is None:
        raise ValueError(
            "multi-process run: give all of --coordinator HOST:PORT, --num-processes N and "
            "--process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), "
            "or --distributed to detect the cluster."
        )
    n, i = int(n), int(i)
    if not 0 <= i < n:
        raise ValueError(f"--process-id must lie in [0, {n}), got {i}.")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=i)
    return True


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches `(batch, seq)` split over `fsdp`."""
    return NamedSharding(mesh, P("fsdp"))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, P())
