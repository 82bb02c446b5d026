"""The flags of `s3req train | compare | sample`, as dataclasses that tyro turns into parsers.

The training options are not declared here: each command nests a `TrainConfig` whose fields
become top-level flags (`--seq-len` for `seq_len`, `--model.d-model` for `model.d_model`).
Only the flags that are not part of a run's config (resume, mesh, processes, ...) live here.
"""

import dataclasses
import typing

import tyro

from ._config import TrainConfig


# The nested config's fields are flags of the command itself: no `--run.` prefix and no group
# heading of its own (`model` keeps its prefix: `--model.d-model`).
_Flattened = typing.Annotated[TrainConfig, tyro.conf.arg(name="", help="", prefix_name=False)]


@dataclasses.dataclass(frozen=True)
class TrainCommand:
    """Train a model. Writes DIR/config.json, DIR/metrics.jsonl, DIR/loss_curve.png and
    DIR/checkpoint/ (DIR: --out, default runs/PRESET-POLICY)."""

    run: _Flattened
    config: str | None = None
    """JSON file of options, keys as the flags (e.g. {"steps": 500}); flags override it."""
    resume: bool = False
    """Continue from DIR/checkpoint (bit-exact)."""
    overwrite: bool = False
    """Replace an earlier run in DIR (without it, s3req refuses to start over one)."""
    allow_changes: bool = False
    """With --resume: accept changed settings such as lr (the run is then no longer exact)."""
    mesh: str | None = None
    """Train sharded on a device mesh, e.g. fsdp=4,tp=2 (see the scaling guide)."""
    coordinator: str | None = None
    """HOST:PORT of process 0 of a multi-process run (None: $JAX_COORDINATOR_ADDRESS)."""
    num_processes: int | None = None
    """Processes taking part (None: $JAX_NUM_PROCESSES)."""
    process_id: int | None = None
    """Index of this process (None: $JAX_PROCESS_ID)."""
    distributed: bool = False
    """Detect the cluster (SLURM, Open MPI, Cloud TPU) when no address is given."""
    quiet: bool = False
    """No header and no progress bar."""


@dataclasses.dataclass(frozen=True)
class CompareCommand:
    """Train under several rounding policies and compare them. The same model, data and seed
    for each policy in --policies (--policy is not used); writes DIR/compare.md,
    DIR/compare.json and DIR/loss_curves.png (DIR: --out, default runs/compare)."""

    run: _Flattened
    config: str | None = None
    """JSON file of options, keys as the flags (e.g. {"steps": 500}); flags override it."""
    policies: str = "bf16,rtne,sr,s3r,s3r-ec-2way"
    """Comma-separated rounding presets, one run each into DIR/<policy>/."""
    overwrite: bool = False
    """Replace earlier runs in DIR/<policy>/."""
    quiet: bool = False
    """No progress bars."""


@dataclasses.dataclass(frozen=True)
class SampleCommand:
    """Generate text from the checkpoint of a run folder."""

    ckpt: str
    """Run folder written by s3req train (its --out DIR)."""
    prompt: str = ""
    """Text to continue (token ids separated by spaces for pre-tokenized runs)."""
    tokens: int = 200
    """Tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0 is greedy."""
    seed: int = 0
    """Sampling seed."""


COMMANDS: dict[str, type] = {
    "train": TrainCommand,
    "compare": CompareCommand,
    "sample": SampleCommand,
}
