"""`compare`: the same run under several rounding policies, a table and a plot."""

import dataclasses
import json
import pathlib
import sys
import typing
from collections.abc import Sequence

from ._config import data_for, TrainConfig
from ._data import TokenData
from ._loop import train


def _val_curve(metrics: list[dict[str, typing.Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in metrics if r.get("val_loss") is not None]


def compare(
    config: TrainConfig,
    policies: Sequence[str],
    *,
    data: TokenData | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, typing.Any]:
    """Train the same model on the same data and seed under several rounding policies.

    Each policy trains into `config.out/<policy>/`; then `config.out` receives
    `compare.md` (a table), `compare.json` (the table, the config and every run's metrics) and
    `loss_curves.png` (training and validation loss against step).

    **Arguments:**

    - `config`: the shared [`s3req.train.TrainConfig`][]; its `policy` is ignored and its
      `out` (required) is the comparison folder.
    - `policies`: preset names, e.g. `["bf16", "rtne", "sr", "s3r", "s3r-ec-2way"]`.
    - `data`: pre-loaded [`s3req.train.TokenData`][]; default: load `config.data` once.
    - `overwrite`: replace earlier runs in the policy folders (else they raise
      `FileExistsError`).
    - `progress`: show progress bars.

    **Returns:**

    The content of `compare.json`.
    """
    from policies import PRESETS

    from ._plot import plot_curves

    if config.out is None:
        raise ValueError("compare: set config.out (--out DIR) for the table and the plot.")
    policies = list(policies)
    if not policies:
        raise ValueError("compare: name at least one policy, e.g. --policies bf16,s3r-ec-2way.")
    unknown = [p for p in policies if p not in PRESETS]
    if unknown:
        raise ValueError(
            f"compare: unknown policy {unknown[0]!r}; choose from: {', '.join(PRESETS)}."
        )
    if len(set(policies)) != len(policies):
        raise ValueError(f"compare: policies are repeated in {policies}.")
    out = pathlib.Path(config.out)
    if data is None:
        data = data_for(config)
    rows, curves = [], {}
    for name in policies:
        run = dataclasses.replace(config, policy=name, out=str(out / name))
        if progress:
            print(f"== {name}", file=sys.stderr)
        result = train(run, data=data, overwrite=overwrite, progress=progress)
        vals = _val_curve(result.metrics)
        rows.append(
            {
                "policy": name,
                "val_loss_start": vals[0][1],
                "val_loss_final": vals[-1][1],
                "val_loss_best": min(v for _, v in vals),
                "train_loss_final": result.metrics[-1]["train_loss"],
                "tokens_per_s": result.tokens_per_s,
                "wall_s": result.wall_s,
            }
        )
        curves[name] = result.metrics
    summary = {
        "config": config.to_dict(),
        "data": data.name,
        "results": rows,
        "curves": curves,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(summary, indent=1))
    (out / "compare.md").write_text(_compare_table(config, data, rows))
    plot_curves(
        curves,
        out / "loss_curves.png",
        title=f"{config.preset} on {pathlib.Path(data.name).name}, {config.steps} steps, "
        f"seed {config.seed}",
    )
    return summary


def _compare_table(config: TrainConfig, data: TokenData, rows: list[dict[str, typing.Any]]) -> str:
    base = rows[0]
    lines = [
        f"# Policy comparison: {config.preset} on {pathlib.Path(data.name).name}",
        "",
        f"{config.steps} steps, batch {config.batch} x {config.seq_len} tokens, lr {config.lr}, "
        f"seed {config.seed}, tokenizer {config.tokenizer}, compute {config.compute_dtype}. "
        "Losses in nats/token; the same data windows and initialisation for every policy.",
        "",
        f"| policy | val loss start | val loss final | best | vs {base['policy']} "
        "| train loss final | tokens/s | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        delta = r["val_loss_final"] - base["val_loss_final"]
        lines.append(
            f"| {r['policy']} | {r['val_loss_start']:.4f} | {r['val_loss_final']:.4f} "
            f"| {r['val_loss_best']:.4f} | {delta:+.4f} | {r['train_loss_final']:.4f} "
            f"| {r['tokens_per_s']:,.0f} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"
