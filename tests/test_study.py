"""`k3 study` end to end on a tiny preset (its runs are real `k3 train` subprocesses), and the
statistics it reports."""

import json
import math
import re
import shutil
import sys

import pytest
import torch
import yaml
from typer.testing import CliRunner

from k3cli.checkpoint import list_checkpoints
from k3cli.cli import app
from k3cli.config import load_config
from k3cli.study.stats import interp, paired_interval, t_critical, t_two_sided_mass
from k3cli.study.study import verdict
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import build_model

runner = CliRunner()


# ---- statistics ----------------------------------------------------------------------------------

@pytest.mark.parametrize("df, t", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622),
                                   (10, 2.2281), (30, 2.0423), (200, 1.9719)])
def test_t_critical_matches_the_tables(df, t):
    assert t_critical(df) == pytest.approx(t, abs=1e-4)


def test_t_mass_is_a_distribution():
    for df in (1, 2, 5, 8):
        masses = [t_two_sided_mass(x, df) for x in (0.0, 0.5, 1.0, 3.0, 50.0)]
        assert masses[0] == 0.0 and masses == sorted(masses) and 0.98 < masses[-1] < 1.0
    assert t_two_sided_mass(50.0, 1) == pytest.approx(2 / math.pi * math.atan(50.0))  # Cauchy, closed form
    assert t_two_sided_mass(1.959964, 10_000) == pytest.approx(0.95, abs=1e-4)   # the normal limit


def test_paired_interval_and_verdicts():
    iv = paired_interval([1.0, 2.0, 3.0])           # mean 2, sd 1: half width t(2) / sqrt(3)
    assert iv["mean"] == 2.0 and iv["std"] == pytest.approx(1.0)
    assert iv["half_width"] == pytest.approx(4.3027 / math.sqrt(3), abs=1e-4)
    assert iv["excludes_zero"] is False
    assert "no detectable difference" in verdict("full", "off", iv)
    lower = paired_interval([-0.030, -0.031, -0.029])
    assert lower["excludes_zero"] is True and lower["high"] < 0
    assert verdict("block", "off", lower).startswith("block is 0.030 ± 0.002 lower than off")
    assert "higher" in verdict("block", "off", paired_interval([0.5, 0.6, 0.55]))
    one = paired_interval([0.1])
    assert one["excludes_zero"] is None and "no confidence interval" in verdict("block", "off", one)


def test_interp_clamps_and_interpolates():
    xs, ys = [1.0, 2.0, 4.0], [10.0, 8.0, 4.0]
    assert [interp(x, xs, ys) for x in (0.0, 1.5, 3.0, 9.0)] == [10.0, 9.0, 6.0, 4.0]


# ---- the command ---------------------------------------------------------------------------------

def _sets(corpus):
    return [a for s in TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}"] for a in ("--set", s)]


def _val_losses(run):
    return [r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r]


@pytest.mark.slow   # four training runs in two worker processes: ~35 s
def test_study_trains_reports_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path)
    out = tmp_path / "study"
    args = ["study", "--preset", "k3-toy", "--attnres", "off,block", "--seeds", "2", "--out", str(out),
            "--parallel", "2", *_sets(corpus)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    runs = {p.name for p in (out / "runs").iterdir()}
    assert runs == {"off-s0", "off-s1", "block-s0", "block-s1"}

    # the design: per seed, the same base weights at step 0 (built from the runs' own configs)
    for seed in (0, 1):
        off = build_model(load_config(str(out / "configs" / f"off-s{seed}.yaml")))
        block = build_model(load_config(str(out / "configs" / f"block-s{seed}.yaml")))
        shared = dict(off.named_parameters())
        extra = [n for n, _ in block.named_parameters() if n not in shared]
        assert extra and all(n.startswith("attnres.") for n in extra)
        for n, p in block.named_parameters():
            if n in shared:
                assert torch.equal(p, shared[n]), n
    s0 = build_model(load_config(str(out / "configs" / "off-s0.yaml")))
    s1 = build_model(load_config(str(out / "configs" / "off-s1.yaml")))
    assert not torch.equal(s0.embed_tokens.weight, s1.embed_tokens.weight)   # seeds differ

    summary = json.loads((out / "summary.json").read_text())
    assert summary["base_weights_identical"] is True
    assert summary["baseline"] == "off" and summary["seeds"] == [0, 1] and summary["steps"] == 6
    finals = {n: _val_losses(out / "runs" / n)[-1] for n in runs}
    v = summary["variants"]
    assert v["off"]["val_loss"] == pytest.approx((finals["off-s0"] + finals["off-s1"]) / 2)
    assert v["block"]["parameters"] > v["off"]["parameters"]
    assert v["off"]["tokens_per_s_ratio"] == 1.0 and v["block"]["tokens_per_s_ratio"] > 0
    d = summary["differences"]["block"]["equal_tokens"]
    assert d["per_seed"] == pytest.approx([finals["block-s0"] - finals["off-s0"], finals["block-s1"] - finals["off-s1"]])
    assert d["n"] == 2 and d["low"] <= d["mean"] <= d["high"] and isinstance(d["excludes_zero"], bool)
    # 6 steps, evaluated at 3 and 6: two validation points, too few for a verdict
    assert "2 validation points" in summary["differences"]["block"]["too_short"] and "no verdict" in d["verdict"]
    assert "equal_time" in summary["differences"]["block"] and summary["equal_time"]["time_s"] > 0
    report = (out / "report.md").read_text()
    for part in ("## Validation loss at equal tokens", "## Paired difference to off", "## At equal wall-clock",
                 "## Verdict", "![validation loss](loss.png)", "identical across variants"):
        assert part in report, part
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # an interrupted run: block-s1 lost its last checkpoint; off-s0 is finished and must stay untouched
    before = finals["block-s1"]
    off_metrics = (out / "runs" / "off-s0" / "metrics.jsonl").read_bytes()
    step, last = list_checkpoints(out / "runs" / "block-s1")[-1]
    assert step == 6
    shutil.rmtree(last)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "off-s0: finished, skipped" in r.output and "block-s1: will resume from step 4" in r.output
    assert _val_losses(out / "runs" / "block-s1")[-1] == before            # exact resume
    assert (out / "runs" / "off-s0" / "metrics.jsonl").read_bytes() == off_metrics

    # another design into the same directory is refused and changes nothing
    r = runner.invoke(app, [*args[:6], "3", *args[7:]])
    assert r.exit_code == 2 and "different seeds" in r.output
    assert json.loads((out / "study.json").read_text())["seeds"] == [0, 1]

    # --report rebuilds the results alone; without matplotlib the report says how to get the plot
    (out / "report.md").unlink()
    (out / "loss.png").unlink()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    r = runner.invoke(app, ["study", "--report", str(out)])
    assert r.exit_code == 0, r.output
    assert "pip install 'k3cli[plot]'" in (out / "report.md").read_text() and not (out / "loss.png").exists()


def test_study_bad_input(tmp_path):
    r = runner.invoke(app, ["study", "--attnres", "off,blok"])
    assert r.exit_code == 2 and "unknown variant 'blok'" in r.output
    r = runner.invoke(app, ["study", "--attnres", "off,off"])
    assert r.exit_code == 2 and "distinct variants" in r.output
    r = runner.invoke(app, ["study", "--steps", "5", "--tokens", "100"])
    assert r.exit_code == 2 and "not both" in r.output
    r = runner.invoke(app, ["study", "--report", str(tmp_path)])
    assert r.exit_code == 2 and "not a k3 study directory" in r.output


def test_compare_plot(tmp_path, monkeypatch):
    from k3cli.train import train

    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path)
    for name, seed in (("a", 0), ("b", 1)):
        cfg = load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}", f"train.seed={seed}"])
        train(cfg, tmp_path / name, log=lambda m: None)
    png = tmp_path / "plots" / "cmp.png"
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and "pip install 'k3cli[plot]'" in r.output


# ---- reports of runs too short, speed after the first window, single-point plots, ETA --------------

def _fake_run(d, steps: int, warmup: int, log_at: dict, val_at: dict) -> None:
    """A run directory as `k3 train` leaves it: config.yaml and metrics.jsonl with tokens/s at the steps
    of `log_at` ({step: tokens/s}) and validation loss at those of `val_at` ({step: loss})."""
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(
        {"train": {"global_batch_size": 4, "seq_len": 32, "warmup_steps": warmup, "steps": steps}}))
    rows = [{"step": s, "loss": 5.0, "time_s": 0.1 * s, **({"tokens_per_s": log_at[s]} if s in log_at else {}),
             **({"val_loss": val_at[s]} if s in val_at else {})} for s in range(1, steps + 1)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _fake_study(out, steps: int, warmup: int, runs: dict) -> None:
    """A study directory of finished runs: runs = {name: (log_at, val_at)}, names MODE-sSEED."""
    design = {"preset": "k3-toy", "config": None, "sets": [], "modes": ["off", "block"], "seeds": [0, 1],
              "steps": steps, "tokens_per_step": 128, "tokens_per_run": 128 * steps, "machine": "test",
              "runs": [{"name": n, "mode": n.split("-")[0], "seed": int(n[-1]), "config": ""} for n in runs]}
    out.mkdir()
    (out / "study.json").write_text(json.dumps(design))
    (out / "base_weights.json").write_text(json.dumps(
        {n: {"base_digest": f"seed {n[-1]}", "parameters": 1000, "active_parameters": 1000} for n in runs}))
    for name, (log_at, val_at) in runs.items():
        _fake_run(out / "runs" / name, steps, warmup, log_at, val_at)


def test_report_of_runs_too_short_gives_no_verdict_and_no_speed_ratio(tmp_path):
    """The tiny study of the issue: 3 steps inside a 50-step warm-up, one evaluation and one logged window each
    (the window holds the first step's overhead: 4.1x apart). Before: "block is 0.000 ± 0.000 lower", 4.1x."""
    out = tmp_path / "s"
    _fake_study(out, 3, 50, {"off-s0": ({3: 1000.0}, {3: 5.0}), "block-s0": ({3: 4100.0}, {3: 4.9996}),
                             "off-s1": ({3: 1000.0}, {3: 5.0}), "block-s1": ({3: 4100.0}, {3: 4.9996})})
    r = runner.invoke(app, ["study", "--report", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    d = summary["differences"]["block"]
    assert d["too_short"] == "off-s0: ends at step 3, inside its 50 warm-up steps; 1 validation point, fewer than 3"
    assert d["equal_tokens"]["verdict"].startswith("block against off: no verdict, the runs are too short (off-s0")
    assert summary["variants"]["block"]["tokens_per_s"] is None and summary["variants"]["block"]["tokens_per_s_ratio"] is None
    report = (out / "report.md").read_text()
    verdicts = [line for line in report.splitlines() if line.startswith("- At equal")]
    assert len(verdicts) == 2 and all("no verdict, the runs are too short" in line for line in verdicts), verdicts
    assert "**Too short for a verdict**" in report and "windows after" in report


def test_report_of_runs_long_enough_gives_a_verdict_and_speed_after_the_first_window(tmp_path):
    out = tmp_path / "s"
    val = {25: 5.0, 50: 4.5, 75: 4.2, 100: 4.0}
    lower = lambda by: {s: v - by for s, v in val.items()}
    off_tps, block_tps = {25: 100.0, 50: 1000.0, 75: 1010.0, 100: 990.0}, {25: 4100.0, 50: 900.0, 75: 910.0, 100: 890.0}
    _fake_study(out, 100, 10, {"off-s0": (off_tps, val), "block-s0": (block_tps, lower(0.10)),
                               "off-s1": (off_tps, val), "block-s1": (block_tps, lower(0.11))})
    r = runner.invoke(app, ["study", "--report", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["differences"]["block"]["too_short"] is None
    assert summary["differences"]["block"]["equal_tokens"]["verdict"].startswith("block is 0.105 ± ")
    v = summary["variants"]
    assert (v["off"]["tokens_per_s"], v["block"]["tokens_per_s"]) == (1000.0, 900.0)   # the first window left out
    assert v["block"]["tokens_per_s_ratio"] == pytest.approx(0.9)
    assert "Too short" not in (out / "report.md").read_text()


def test_compare_speed_after_the_first_window_and_single_point_runs_drawn_as_markers(tmp_path, monkeypatch):
    import matplotlib.figure

    _fake_run(tmp_path / "a", 6, 2, {2: 50.0, 4: 1000.0, 6: 1100.0}, {2: 5.0, 4: 4.8, 6: 4.7})
    _fake_run(tmp_path / "b", 2, 2, {2: 70.0}, {2: 5.1})
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    a, b = json.loads(r.stdout)["runs"]
    assert (a["tokens_per_s"], a["timed_windows"]) == (1100.0, 2) and (b["tokens_per_s"], b["timed_windows"]) == (None, 0)

    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    lines = {(i, line.get_label()): line for i, ax in enumerate(figures[0].axes) for line in ax.get_lines()}
    for key in ((0, "b (n = 1)"), (2, "b")):   # loss against tokens and against time: one point, a marker
        assert len(lines[key].get_xdata()) == 1 and lines[key].get_marker() == "o", key
    assert lines[(0, "a (n = 1)")].get_marker() in ("None", None, "") and len(lines[(0, "a (n = 1)")].get_xdata()) == 3


FAKE_TRAIN = """
import json, shutil, sys, time
from pathlib import Path
config, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
shutil.copy(config, out / "config.yaml")
with open(out / "metrics.jsonl", "a") as f:
    for s in range(1, steps + 1):
        time.sleep(0.2)
        f.write(json.dumps({"step": s, "loss": 5.0, "time_s": 0.2 * s, "val_loss": 5.0 - s / 100}) + "\\n")
        f.flush()
"""


def test_study_progress_has_an_eta(tmp_path, monkeypatch):
    """Each running run's step and time left at its rate so far, and the study's (runs: a stand-in for
    `k3 train` that writes a metrics line every 0.2 s)."""
    import k3cli.study.study as st

    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path)
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(st, "train_command", lambda out, name: [
        sys.executable, str(script), str(out / "configs" / f"{name}.yaml"), str(out / "runs" / name), "6"])
    monkeypatch.setattr(st, "PROGRESS_EVERY_S", 0.4)
    r = runner.invoke(app, ["study", "--preset", "k3-toy", "--attnres", "off,block", "--seeds", "1", "--steps", "6",
                            "--out", str(tmp_path / "s"), "--parallel", "2", *_sets(corpus)])
    assert r.exit_code == 0, r.output
    eta = re.compile(r"progress: off-s0 [1-5]/6 \(about \d+ s left\), block-s0 [1-5]/6 \(about \d+ s left\); "
                     r"study: 0/2 runs done, about \d+ s left")
    assert any(eta.fullmatch(line) for line in r.stderr.splitlines()), r.stderr
