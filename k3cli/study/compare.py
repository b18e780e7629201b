"""`k3 compare`: runs side by side — their metrics and how their configs differ."""

from __future__ import annotations

import json
from pathlib import Path

from k3cli.config import ConfigError, flatten, read_yaml


def _is_record(row) -> bool:
    number = (int, float)
    return (isinstance(row, dict) and isinstance(row.get("step"), int) and isinstance(row.get("loss"), number)
            and all(isinstance(row[k], number) for k in ("val_loss", "tokens_per_s", "time_s") if k in row))


def run_summary(run_dir: Path) -> dict:
    """Final/best metrics of one run directory, read from its metrics.jsonl and config.yaml."""
    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not cfg_path.is_file():
        raise ConfigError(f"not a k3 run directory (no config.yaml): {run_dir}")
    rows = []
    if metrics_path.is_file():
        try:
            lines = metrics_path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {metrics_path}: {e}") from None
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
            if not _is_record(row):
                raise ConfigError(f"{metrics_path}, line {i}: not a k3 metrics record (a step and a loss, numbers)")
            rows.append(row)
    vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    # the first logged window holds the start-up (first-step overhead, compilation): speed is read after it
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    config = flatten(read_yaml(cfg_path))
    tokens_per_step = config.get("train.global_batch_size", 0) * config.get("train.seq_len", 0)
    return {
        "run": str(run_dir),
        "steps": rows[-1]["step"] if rows else 0,
        "train_loss": rows[-1]["loss"] if rows else None,
        "val_loss": vals[-1][1] if vals else None,
        "best_val_loss": min(v for _, v in vals) if vals else None,
        "best_val_step": min(vals, key=lambda sv: sv[1])[0] if vals else None,
        "tokens_per_s": sorted(tps)[len(tps) // 2] if tps else None,  # median of the windows after the first
        "timed_windows": len(tps),
        "tokens": rows[-1]["step"] * tokens_per_step if rows else 0,
        # time_s: training seconds since step 0 (None in runs written before it was recorded)
        "val_curve": [{"step": r["step"], "tokens": r["step"] * tokens_per_step, "time_s": r.get("time_s"),
                       "val_loss": r["val_loss"]} for r in rows if "val_loss" in r],
        "config": config,
    }


def compare_runs(run_dirs: list[Path]) -> dict:
    """Summaries of each run and the config keys whose values differ between them."""
    summaries = [run_summary(Path(r)) for r in run_dirs]
    keys = sorted(set().union(*(s["config"] for s in summaries)))
    differing = {k: [s["config"].get(k) for s in summaries] for k in keys
                 if len({json.dumps(s["config"].get(k)) for s in summaries}) > 1}
    for s in summaries:
        del s["config"]
    return {"runs": summaries, "config_diff": differing}


def plot_runs(data: dict, path: Path) -> Path:
    """The study's loss plot for any runs (`compare_runs` output): each run its own line, the first
    run the baseline of the difference panel. ImportError without matplotlib."""
    from k3cli.study.plot import plot_loss

    labels = [Path(r["run"]).name or r["run"] for r in data["runs"]]
    labels = [f"{i + 1}: {name}" if labels.count(name) > 1 else name for i, name in enumerate(labels)]
    groups = {label: [r["val_curve"]] for label, r in zip(labels, data["runs"])}
    return plot_loss(groups, labels[0], Path(path), title="validation loss")
