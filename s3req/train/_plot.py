"""Loss-curve plots (matplotlib, no pyplot state: safe on headless machines)."""

import pathlib
import typing


def plot_curves(
    runs: dict[str, list[dict[str, typing.Any]]],
    path: str | pathlib.Path,
    *,
    title: str | None = None,
) -> pathlib.Path:
    """Plot training and validation loss against step for several runs into a PNG.

    **Arguments:**

    - `runs`: run label -> metrics records (the lines of each run's `metrics.jsonl`).
    - `path`: the output file (`.png`).
    - `title`: an optional figure title.

    **Returns:**

    The path written.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("Plots need matplotlib: pip install 's3req[train]'.") from None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_train, ax_val = fig.subplots(1, 2)
    for label, records in runs.items():
        train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if train:
            (line,) = ax_train.plot(*zip(*train), label=label, linewidth=1.2)
            color = line.get_color()
        else:
            color = None
        if val:
            ax_val.plot(*zip(*val), marker="o", markersize=3, label=label, color=color)
    for ax, name in ((ax_train, "train loss"), (ax_val, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel(f"{name} (nats/token)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
