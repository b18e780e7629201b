"""`k3 study` end to end on a tiny preset (its runs are real `k3 train` subprocesses), and the
statistics it reports."""

import json
import math
import shutil

import pytest
import torch
from typer.testing import CliRunner

from k3cli.checkpoint import list_checkpoints
from k3cli.cli import app
from k3cli.config import load_config
from k3cli.stats import interp, paired_interval, t_critical, t_two_sided_mass
from k3cli.study import verdict
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
