"""Nothing a user already has is written over: a new run, a prepare, a plot or a study aimed at a folder or
file that holds something else is refused with one `error:` line (exit 2) and leaves it as it was."""
import json

import pytest
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import dump_config, load_config
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus
from k3cli.train import RUN_MARKER

runner = CliRunner()



def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path, n_docs=30)


def train(out, corpus, *extra):
    sets = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]
    return runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out", str(out), *sets, *extra])


@pytest.mark.parametrize("holds,msg", [
    ("user files", "is not empty and holds no k3 run"),
    ("a run without checkpoints", "holds a run with no checkpoint yet; pass --resume auto"),
    ("a file", "is a file"),
])
def test_a_new_run_does_not_write_over_the_out_folder(corpus, tmp_path, holds, msg):
    out = tmp_path / "out"
    if holds == "a file":
        out.write_text("mine\n")
        before = out.read_bytes()
    else:
        out.mkdir()
        names = ("notes.txt", "metrics.jsonl") if holds == "user files" else ("tokenizer.json", RUN_MARKER)
        for name in names:
            (out / name).write_text('{"k3": "run", "format": 1}\n' if name == RUN_MARKER else "mine\n")
        if holds != "user files":
            (out / "config.yaml").write_text(dump_config(load_config("kda-toy")))
        before = snapshot(out)
    assert msg in one_error_line(train(out, corpus), alone=True)
    assert (out.read_bytes() if holds == "a file" else snapshot(out)) == before


def test_a_new_run_may_use_an_empty_existing_folder(corpus, tmp_path):
    (tmp_path / "empty").mkdir()
    r = train(tmp_path / "empty", corpus, "--set", "train.steps=2")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "empty" / "config.yaml").is_file()
    (tmp_path / "mine").mkdir()   # a run that fails before writing anything leaves the user's empty folder
    one_error_line(train(tmp_path / "mine", tmp_path / "no-such-corpus"), alone=True)
    assert (tmp_path / "mine").is_dir()
    one_error_line(train(tmp_path / "new", tmp_path / "no-such-corpus"), alone=True)
    assert not (tmp_path / "new").exists()   # and removes the one it made


def test_prepare_refuses_a_folder_that_holds_another_prepare(corpus, tmp_path):
    prep = tmp_path / "prep"
    prepare = ["data", "prepare", "--data", str(corpus), "--out", str(prep)]
    assert runner.invoke(app, [*prepare, "--vocab-size", "300"]).exit_code == 0
    before = snapshot(prep)
    assert "holds a prepare of this source with another tokenizer" in one_error_line(
        runner.invoke(app, [*prepare, "--vocab-size", "320"]))
    other = write_corpus(tmp_path / "other", n_docs=12, seed=1)
    assert "holds a prepare of another source" in one_error_line(
        runner.invoke(app, ["data", "prepare", "--data", str(other), "--out", str(prep), "--vocab-size", "300"]))
    assert snapshot(prep) == before
    r = runner.invoke(app, [*prepare, "--vocab-size", "300"])   # the same source and tokenizer: reused
    assert r.exit_code == 0 and "reused" in r.stdout and snapshot(prep) == before
    shard = prep / "train-00000.npy"
    shard.write_bytes(shard.read_bytes()[:-10])   # damaged since: this source's own prepare is rebuilt
    r = runner.invoke(app, [*prepare, "--vocab-size", "300"])
    assert r.exit_code == 0 and "reused" not in r.stdout
    shards = lambda files: {k: v for k, v in files.items() if k.name != "manifest.json"}   # noqa: E731
    assert shards(snapshot(prep)) == shards(before)   # the same tokens again (the manifest's timings differ)


def fake_run(folder, losses):
    folder.mkdir()
    (folder / "config.yaml").write_text(dump_config(load_config("kda-toy")))
    with (folder / "metrics.jsonl").open("w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "val_loss": loss + 0.1}) + "\n")
    return folder


def test_compare_plot_replaces_an_earlier_plot_only(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = fake_run(tmp_path / "a", [3.0, 2.5]), fake_run(tmp_path / "b", [3.1, 2.4])
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00weights")
    assert "exists and is not a PNG" in one_error_line(runner.invoke(app, ["compare", str(a), str(b), "--plot", str(weights)]))
    assert weights.read_bytes() == b"\x00weights"
    assert "is a folder" in one_error_line(runner.invoke(app, ["compare", str(a), str(b), "--plot", str(a)]))
    assert not list(tmp_path.glob("*.tmp"))
    png = tmp_path / "loss.png"
    for _ in range(2):   # the second run replaces its own earlier plot
        r = runner.invoke(app, ["compare", str(a), str(b), "--plot", str(png)])
        assert r.exit_code == 0, r.output
        assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("line", ['{"step": 1, "val_loss": 2.0}', '[1, 2]', '{"step": "one", "loss": 2.0}'],
                         ids=["no-loss", "not-a-record", "step-not-a-number"])
def test_compare_names_a_metrics_line_it_cannot_read(tmp_path, line):
    run = fake_run(tmp_path / "run", [3.0])
    with (run / "metrics.jsonl").open("a") as f:
        f.write(line + "\n")
    err = one_error_line(runner.invoke(app, ["compare", str(run)]))
    assert "metrics.jsonl, line 2: not a k3 metrics record" in err
    (run / "metrics.jsonl").write_bytes(b"\xc9\xff\n")
    assert "cannot read" in one_error_line(runner.invoke(app, ["compare", str(run)]))


def test_a_study_stopped_before_its_design_file_continues(corpus, tmp_path, monkeypatch):
    from k3cli.study import study

    out = tmp_path / "study"
    (out / "configs").mkdir(parents=True)
    (out / "configs" / "off-s0.yaml").write_text("half written")
    design = {"preset": "kda-toy", "config": None, "sets": [], "modes": ["off"], "seeds": 1, "steps": 2,
              "runs": [{"name": "off-s0", "config": "train: {steps: 2}\n"}]}
    study.prepare_study(out, design)   # configs/ alone is this command's own start: no refusal
    assert (out / "configs" / "off-s0.yaml").read_text() == "train: {steps: 2}\n" and (out / study.STUDY_FILE).is_file()


@pytest.mark.parametrize("holds", ["user files", "a file"])
def test_study_does_not_write_over_the_out_folder(corpus, tmp_path, holds):
    out = tmp_path / "study"
    if holds == "a file":
        out.write_text("mine\n")
    else:
        out.mkdir()
        (out / "report.md").write_text("mine\n")
    sets = [a for s in TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}"] for a in ("--set", s)]
    r = runner.invoke(app, ["study", "--preset", "kda-toy", *sets, "--attnres", "off,block", "--seeds", "1",
                            "--steps", "2", "--out", str(out)])
    err = one_error_line(r)
    assert ("is a file" if holds == "a file" else "is not empty and holds no k3 study") in err
    assert (out.read_text() if holds == "a file" else (out / "report.md").read_text()) == "mine\n"
    assert holds == "a file" or [p.name for p in out.iterdir()] == ["report.md"]
