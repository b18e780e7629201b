"""Stopping and crashing: SIGINT / SIGTERM stop after a checkpoint of the step reached, SIGKILL at
random moments never leaves a checkpoint that resume would load half-written, a diverging run
stops with exit 3 and good weights on disk. Runs `python -m k3cli train` as subprocesses."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3cli.checkpoint import find_latest_checkpoint, list_checkpoints
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import StopSignals

ROOT = Path(__file__).resolve().parents[1]
# long enough that a signal sent after step 3 lands well before the end; no periodic checkpoints
SIGNAL_RUN = ["train.steps=60", "train.ckpt_every=1000", "train.eval_every=1000"]


def env(cache: Path) -> dict:
    # one thread: the same kernels in every process, so resumed and reference weights compare bitwise
    return {**os.environ, "K3_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}


def train_cmd(corpus: Path, out: Path, *extra: str, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "k3cli", "train", "--preset", "k3-toy", "--data", str(corpus), "--out", str(out)]
    for s in [*TINY_MODEL, *TINY_TRAIN, *extra]:
        cmd += ["--set", s]
    return cmd + (["--resume", "auto"] if resume else [])


def run_train(root: Path, out: Path, *extra: str, resume: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(root / "corpus", out, *extra, resume=resume), env=env(root / "cache"),
                          capture_output=True, text=True, timeout=600)


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):   # the line being written right now
            pass
    return out


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    t0 = time.time()
    while not steps_logged(run_dir) or steps_logged(run_dir)[-1] < step:
        assert proc.poll() is None, f"training exited ({proc.returncode}) before step {step}"
        assert time.time() - t0 < timeout, f"no step {step} within {timeout} s"
        time.sleep(0.01)


def weights(run_dir: Path) -> dict:
    return load_file(find_latest_checkpoint(run_dir) / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    write_corpus(root)
    return root


@pytest.fixture(scope="module")
def reference(root):
    """The uninterrupted run's final weights."""
    r = run_train(root, root / "reference", *SIGNAL_RUN)
    assert r.returncode == 0, r.stderr
    return weights(root / "reference")


def test_handler_sets_a_flag_and_a_second_sigint_raises_at_once():
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    s = StopSignals()
    s.arm()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)   # repeated: ignored
        time.sleep(0.01)
        assert s.poll(torch.device("cpu")) == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    finally:
        s.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == old


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_writes_a_checkpoint_of_the_step_and_resumes_bitwise(root, reference, sig):
    run = root / f"run-{sig.name}"
    proc = subprocess.Popen(train_cmd(root / "corpus", run, *SIGNAL_RUN), env=env(root / "cache"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run, 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err
    stopped = steps_logged(run)[-1]
    assert 3 <= stopped < 60
    ckpts = list_checkpoints(run)
    assert [s for s, _ in ckpts] == [stopped], ckpts   # the stop wrote the step it reached, and only it
    assert f"{sig.name}: stopped at step {stopped}" in err and "--resume auto" in err, err
    r = run_train(root, run, *SIGNAL_RUN, resume=True)
    assert r.returncode == 0, r.stderr
    assert f"at step {stopped}" in r.stdout
    assert steps_logged(run) == list(range(1, 61))
    assert_same_weights(weights(run), reference)


@pytest.mark.slow
def test_second_sigint_stops_at_once_and_leaves_a_resumable_run(root, reference):
    run = root / "run-twice"
    proc = subprocess.Popen(train_cmd(root / "corpus", run, *SIGNAL_RUN, "train.ckpt_every=1"),
                            env=env(root / "cache"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.005)   # two signals at once would be delivered as one
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    r = run_train(root, run, *SIGNAL_RUN, resume=True)
    assert r.returncode == 0, r.stderr
    assert steps_logged(run) == list(range(1, 61))
    assert_same_weights(weights(run), reference)


@pytest.mark.slow
def test_loss_spike_stops_with_exit_3_and_finite_weights_on_disk(root):
    """train.lr=3.0, 1000x the preset's 3e-3 (at 100x, 0.3, the clipped AdamW run still trains to a
    finite loss in 200 steps): the loss turns non-finite within a few steps, training stops with exit 3
    before the update, and every checkpoint on disk (one per step) loads with finite weights."""
    run = root / "spike"
    r = run_train(root, run, "train.lr=3.0", "train.steps=40", "train.ckpt_every=1", "train.keep_last=1000",
                  "train.warmup_steps=0", "train.eval_every=1000")
    assert r.returncode == 3, (r.returncode, r.stdout[-2000:], r.stderr)
    assert "non-finite" in r.stderr
    last = find_latest_checkpoint(run)
    assert last is not None and str(last) in r.stderr
    for _, ckpt in list_checkpoints(run):
        for k, t in load_file(ckpt / "model.safetensors").items():
            assert torch.isfinite(t).all(), (ckpt.name, k)
    assert all(math.isfinite(json.loads(line)["loss"]) for line in (run / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
def test_kill_test_script_survives_random_sigkills(root):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kill_test.py"), "--kills", "4", "--seed", "1",
                        "--work", str(root / "kill")], env=env(root / "cache"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_at_one_step(root):
    """`k3 train --nproc 2`: torchrun passes the signal on, both ranks stop at the same step and write
    one sharded checkpoint of it, the launcher exits 143 and the run resumes to the end."""
    run, extra = root / "run-nproc", [*SIGNAL_RUN, "model.kda.backend=torch"]
    proc = subprocess.Popen(train_cmd(root / "corpus", run, *extra)[:4] + ["--nproc", "2"]
                            + train_cmd(root / "corpus", run, *extra)[4:], env=env(root / "cache"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    stopped = steps_logged(run)[-1]
    assert [s for s, _ in list_checkpoints(run)] == [stopped] and stopped < 60, err
    assert find_latest_checkpoint(run) is not None
    r = run_train(root, run, *extra, resume=True)
    assert r.returncode == 0, r.stderr
    assert steps_logged(run) == list(range(1, 61))
