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

    With two or more runs a third panel shows each run's validation loss minus the first
    run's (the baseline), where the curves themselves overlap.

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
    with_delta = len(runs) > 1
    fig = Figure(figsize=(16 if with_delta else 11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3 if with_delta else 2)
    ax_train, ax_val = axes[0], axes[1]
    base: dict[int, float] = {}
    for i, (label, records) in enumerate(runs.items()):
        train = [(r["step"], r["train_loss"]) for r in records if "train_loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if train:
            (line,) = ax_train.plot(*zip(*train), label=label, linewidth=1.2)
            color = line.get_color()
        else:
            color = None
        if val:
            ax_val.plot(*zip(*val), marker="o", markersize=3, label=label, color=color)
        if with_delta:
            if i == 0:
                base = dict(val)
            delta = [(s, v - base[s]) for s, v in val if s in base]
            if delta:
                axes[2].plot(*zip(*delta), marker="o", markersize=3, label=label, color=color)
    if with_delta:
        first = next(iter(runs))
        axes[2].set_xlabel("step")
        axes[2].set_ylabel(f"val loss - {first} (nats/token)")
        axes[2].set_title(f"validation loss vs {first}")
        axes[2].grid(alpha=0.3)
        axes[2].legend(fontsize="small")
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
