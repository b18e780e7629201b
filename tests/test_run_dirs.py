"""Only a run directory is trained into: `k3 train --resume auto` (or a new run) aimed at prepared data, a
corpus, an export or any other folder is one `error:` line, exit 2, every file's bytes and mtime as they
were; a resume refuses what it cannot honour (another --preset) and takes what it can (another
micro-batch); a run stopped before its first checkpoint starts over with --restart."""
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import load_config
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus
from k3cli.train import RUN_MARKER

runner = CliRunner()
SETS = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]


def train(out, corpus, *extra, preset=("--preset", "kda-toy")):
    return runner.invoke(app, ["train", *preset, "--data", str(corpus), "--out", str(out), *SETS, *extra])


def state(folder):
    """Every path under `folder` (itself included) with its bytes (files) and mtime."""
    paths = [folder, *sorted(folder.rglob("*"))]
    return {p: (p.read_bytes() if p.is_file() else None, os.stat(p).st_mtime_ns) for p in paths}


def steps(run):
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A corpus, a run stopped at step 2, a prepared-data folder and an export of the run."""
    root = tmp_path_factory.mktemp("run-dirs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(root / "cache"))
        corpus = write_corpus(root, n_docs=30)
        assert train(root / "run", corpus, "--until", "2").exit_code == 0
        assert runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(root / "prepared"),
                                   "--vocab-size", "300"]).exit_code == 0
        assert runner.invoke(app, ["export", "--run", str(root / "run"), "--out", str(root / "export")]).exit_code == 0
    (root / "stray").mkdir()
    (root / "stray" / "notes.txt").write_text("mine\n")
    return root


@pytest.fixture
def root(made, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(made / "cache"))
    return made


def copy_run(root, tmp_path):
    return shutil.copytree(root / "run", tmp_path / "run")


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "new"])
@pytest.mark.parametrize("folder,msg", [
    ("prepared", "is a `k3 data prepare` folder: train on it with --data"),
    ("corpus", "is not empty and holds no k3 run"),
    ("export", "is a `k3 export` folder (weights only, no optimiser or data state); training never writes into one: "
               "continue the run it was exported from"),
    ("stray", "is not empty and holds no k3 run"),
])
def test_only_a_run_directory_is_trained_into(root, folder, msg, resume):
    before = state(root / folder)
    err = one_error_line(train(root / folder, root / "corpus", *(["--resume", "auto"] if resume else [])), alone=True)
    assert msg in err
    assert state(root / folder) == before


def test_a_run_written_before_the_marker_resumes_and_a_marker_alone_is_not_trusted(root, tmp_path):
    run = copy_run(root, tmp_path)
    (run / RUN_MARKER).unlink()   # config.yaml, tokenizer.json, metrics.jsonl, checkpoints/: a run all the same
    r = train(run, root / "corpus", "--resume", "auto", "--until", "3")
    assert r.exit_code == 0, r.output
    assert steps(run) == [1, 2, 3]
    other = tmp_path / "other"   # a user's own run.json is no marker; config.yaml alone is no run
    other.mkdir()
    (other / RUN_MARKER).write_text('{"name": "mine"}\n')
    shutil.copy(run / "config.yaml", other / "config.yaml")
    before = state(other)
    assert "holds no k3 run" in one_error_line(train(other, root / "corpus", "--resume", "auto"), alone=True)
    assert state(other) == before


def test_an_explicit_preset_must_resolve_to_the_runs_config(root, tmp_path):
    run = copy_run(root, tmp_path)
    before = state(run)
    err = one_error_line(train(run, root / "corpus", "--resume", "auto", preset=("--preset", "k3-toy")), alone=True)
    assert "cannot resume with a changed model.arch ('kda' -> 'k3')" in err and "leave it out" in err
    assert state(run) == before
    r = train(run, root / "corpus", "--resume", "auto", "--until", "3")   # the run's own preset: fine
    assert r.exit_code == 0, r.output
    assert "resumed from" in r.stdout and steps(run) == [1, 2, 3]


def test_the_micro_batch_may_change_on_resume(root, tmp_path):
    run = copy_run(root, tmp_path)
    r = train(run, root / "corpus", "--resume", "auto", "--set", "train.micro_batch_size=1")
    assert r.exit_code == 0, r.output
    assert "done: step 6" in r.stdout and steps(run) == [1, 2, 3, 4, 5, 6]
    assert load_config(str(run / "config.yaml")).train.micro_batch_size == 1
    err = one_error_line(train(run, root / "corpus", "--resume", "auto", "--set", "train.global_batch_size=8"),
                         alone=True)
    assert "changed train.global_batch_size (4 -> 8)" in err


def test_a_run_without_a_checkpoint_starts_over_with_restart(root, tmp_path):
    run = tmp_path / "run"
    r = train(run, root / "corpus", "--set", "train.lr=1e30")   # diverges before its first checkpoint
    assert r.exit_code == 3, r.output
    assert not (run / "checkpoints").exists() and steps(run)
    (run / "notes.txt").write_text("mine\n")
    before = state(run)
    err = one_error_line(train(run, root / "corpus", "--resume", "auto"), alone=True)
    assert "changed train.lr" in err and "or pass --restart: the run has no checkpoint yet" in err
    assert "--restart to start it over" in one_error_line(train(run, root / "corpus"), alone=True)
    assert "leave --resume out" in one_error_line(train(run, root / "corpus", "--restart", "--resume", "auto"),
                                                  alone=True)
    assert state(run) == before
    r = train(run, root / "corpus", "--restart", "--until", "2")
    assert r.exit_code == 0, r.output
    assert steps(run) == [1, 2] and load_config(str(run / "config.yaml")).train.lr == 0.003
    assert (run / "notes.txt").read_text() == "mine\n"   # only the run's own files were replaced
    before = state(run)
    assert "--restart starts over only a run with none" in one_error_line(
        train(run, root / "corpus", "--restart"), alone=True)
    assert state(run) == before
