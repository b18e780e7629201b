"""Loss plots for `k3 study` and `k3 compare --plot` (matplotlib, the optional `plot` extra).

`plot_loss(groups, baseline, path)` draws, per group of runs, validation loss against tokens (mean
line, min–max band over the group's runs), the difference to the baseline group against tokens
(paired run by run when the groups have as many runs, else against the baseline's mean), and, when
every run recorded its training time, validation loss against wall-clock seconds. A curve of one
point (a run evaluated once) is drawn as a marker.
"""

from __future__ import annotations

from pathlib import Path

from k3cli.study.stats import interp


def _pyplot():
    import matplotlib  # ImportError goes to the caller, which says how to install the extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_target(path: Path) -> None:
    """A plot replaces an earlier plot (a PNG file) and nothing else: not a folder, not a checkpoint."""
    if path.is_dir():
        raise ValueError(f"plot target {path} is a folder; give a .png file path")
    if path.exists():
        with open(path, "rb") as f:
            if f.read(len(PNG_MAGIC)) != PNG_MAGIC:
                raise ValueError(f"plot target {path} exists and is not a PNG; choose another path (nothing was changed)")


def _on_grid(curve: list[dict], grid: list[float], key: str = "tokens") -> list[float]:
    xs, ys = [p[key] for p in curve], [p["val_loss"] for p in curve]
    return [interp(x, xs, ys) for x in grid]


def _band(rows: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    cols = list(zip(*rows))
    return [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def _line(ax, x: list[float], y: list[float], **kw) -> None:
    """A curve; one point has no line to draw, so it is a marker."""
    ax.plot(x, y, marker="o" if len(x) == 1 else None, **kw)


def _token_unit(groups: dict) -> tuple[float, str]:
    top = max(p["tokens"] for runs in groups.values() for c in runs for p in c)
    return (1e6, "tokens (M)") if top >= 1e6 else (1e3, "tokens (k)") if top >= 1e3 else (1.0, "tokens")


def plot_loss(groups: dict[str, list[list[dict]]], baseline: str | None, path: Path, title: str = "") -> Path:
    """`groups`: label -> runs, each run a list of {"tokens", "time_s", "val_loss"} points."""
    plt = _pyplot()
    groups = {k: [c for c in runs if c] for k, runs in groups.items()}
    groups = {k: runs for k, runs in groups.items() if runs}
    if not groups:
        raise ValueError("no validation points to plot (have the runs reached their first eval?)")
    timed = all(p.get("time_s") is not None for runs in groups.values() for c in runs for p in c)
    panels = 2 + timed if baseline in groups and len(groups) > 1 else 1 + timed
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    axes = axes[0]
    colors = {k: f"C{i}" for i, k in enumerate(groups)}
    unit, unit_label = _token_unit(groups)

    ax = axes[0]
    for k, runs in groups.items():
        grid = [p["tokens"] for p in runs[0]]
        mean, lo, hi = _band([_on_grid(c, grid) for c in runs])
        x = [t / unit for t in grid]
        _line(ax, x, mean, color=colors[k], label=f"{k} (n = {len(runs)})")
        if len(runs) > 1:
            ax.fill_between(x, lo, hi, color=colors[k], alpha=0.2, linewidth=0)
    ax.set_xlabel(unit_label)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("validation loss")
    ax.legend()
    ax.grid(alpha=0.3)

    i = 1
    if baseline in groups and len(groups) > 1:
        ax = axes[i]
        i += 1
        base_runs = groups[baseline]
        grid = [p["tokens"] for p in base_runs[0]]
        base_rows = [_on_grid(c, grid) for c in base_runs]
        base_mean = _band(base_rows)[0]
        for k, runs in groups.items():
            if k == baseline:
                continue
            rows = [_on_grid(c, grid) for c in runs]
            if len(rows) == len(base_rows):
                diffs = [[a - b for a, b in zip(r, br)] for r, br in zip(rows, base_rows)]
            else:
                diffs = [[a - b for a, b in zip(r, base_mean)] for r in rows]
            mean, lo, hi = _band(diffs)
            x = [t / unit for t in grid]
            _line(ax, x, mean, color=colors[k], label=f"{k} − {baseline}")
            if len(diffs) > 1:
                ax.fill_between(x, lo, hi, color=colors[k], alpha=0.2, linewidth=0)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xlabel(unit_label)
        ax.set_ylabel(f"validation loss − {baseline}")
        ax.set_title(f"difference to {baseline} (below 0 = better)")
        ax.legend()
        ax.grid(alpha=0.3)

    if timed:
        ax = axes[i]
        for k, runs in groups.items():
            start, end = max(c[0]["time_s"] for c in runs), min(c[-1]["time_s"] for c in runs)
            # where every run has points (one time: a run with one validation point)
            grid = [start + (end - start) * j / 50 for j in range(51)] if end > start else [start]
            mean = _band([_on_grid(c, grid, key="time_s") for c in runs])[0]
            _line(ax, grid, mean, color=colors[k], label=k)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("validation loss at equal wall-clock")
        ax.legend()
        ax.grid(alpha=0.3)

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    _check_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)
    return path
