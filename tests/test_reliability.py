"""Stopping and crashing: SIGINT / SIGTERM stop after a checkpoint of the step reached, SIGKILL at
random moments never leaves a checkpoint that resume would load half-written, a diverging run
stops with exit 3 and good weights on disk, a full disk or a read-only run directory is one error
line with the earlier checkpoints intact. Runs `python -m k3cli train` as subprocesses."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from k3cli.checkpoint import CheckpointError, is_complete, list_checkpoints, tensor_bytes
from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.checkpoint import load as load_checkpoint
from k3cli.checkpoint.sharded import save as save_dcp
from k3cli.checkpoint.single import save as save_checkpoint
from k3cli.config import load_config
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import StopSignals, build_model

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
    assert len(err.strip().splitlines()) == 1, err   # the CLI prints the stop once; the loop does not log it too
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
def test_kill_test_script_with_two_ranks(root):
    """SIGKILL to the process group of `k3 train --nproc 2` (ddp, gloo): no rank outlives the launcher,
    every resume names a complete sharded checkpoint, and the final weights equal those of an
    uninterrupted 2-rank run bitwise."""
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kill_test.py"), "--nproc", "2", "--kills", "3",
                        "--seed", "1", "--work", str(root / "kill-2")], env=env(root / "cache"), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert int(re.search(r"(\d+) kills:", r.stdout)[1]) >= 2, r.stdout


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


# ---- a full disk or a read-only run directory during a checkpoint ----------------------------------

def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    """Both formats: need = model + optimizer tensor bytes; nothing is written, earlier checkpoints stay."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    need = tensor_bytes(model.state_dict(), opt.state_dict())
    assert need == 3 * 4 * (64 * 64 + 64) + 2 * 4   # weights, exp_avg, exp_avg_sq, two step counters
    for save, name in ((save_checkpoint, "one"), (save_dcp, "dcp")):
        run = tmp_path / name
        first = save(run, 1, model, opt)
        monkeypatch.setattr("k3cli.checkpoint.folder.shutil.disk_usage", lambda p: SimpleNamespace(free=need // 2))
        with pytest.raises(CheckpointError) as e:
            save(run, 2, model, opt)
        monkeypatch.undo()
        assert f"need {need / 1e6:.1f} MB, {need // 2 / 1e6:.1f} MB free" in str(e.value), e.value
        assert "\n" not in str(e.value)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001"] and is_complete(first)
    assert tensor_bytes({"a": model.weight, "b": model.weight, "c": [model.bias]}) == 4 * (64 * 64 + 64)


def limit_file_size(limit: int):
    """preexec_fn: files past `limit` bytes fail with EFBIG (SIGXFSZ ignored, so write raises instead of killing)."""
    import resource

    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` read-only: chmod 0555, or as root (whom modes do not stop) a read-only bind mount."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield "chmod 0555"
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True).returncode:
        pytest.skip("running as root, and mount --bind is not allowed here")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True, capture_output=True)
        yield "read-only bind mount"
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: int):
    """A tmpfs of `size` bytes mounted on `folder` (root only; skips elsewhere); unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


def assert_intact_and_resumable(root: Path, run: Path, good: int) -> None:
    """Checkpoint `good` is the newest complete one, no temp folder is left, and the run resumes to the end."""
    last = find_latest_checkpoint(run)
    assert last is not None and last.name == f"step_{good:08d}" and is_complete(last)
    assert not [p for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]
    load_checkpoint(last, build_model(load_config(str(run / "config.yaml"))), restore_rng=False)
    r = run_train(root, run, resume=True)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {last} at step {good}" in r.stdout + r.stderr
    assert steps_logged(run) == list(range(1, 7))


@pytest.fixture(scope="module")
def paused(root):
    """A run stopped at step 2 with its checkpoint, copied by each test."""
    run = root / "paused"
    r = subprocess.run(train_cmd(root / "corpus", run) + ["--until", "2"], env=env(root / "cache"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return run


def test_file_size_limit_during_a_checkpoint_is_one_error_line(root, paused, tmp_path):
    """The state file passes the limit after the weights are written: EFBIG inside torch.save."""
    run = tmp_path / "run"
    shutil.copytree(paused, run)
    limit = (paused / "checkpoints" / "step_00000002" / "model.safetensors").stat().st_size + 4096
    r = subprocess.run(train_cmd(root / "corpus", run, resume=True), env=env(root / "cache"), capture_output=True,
                       text=True, timeout=600, preexec_fn=limit_file_size(limit))
    line = one_error_line(r)
    assert "cannot write checkpoint" in line and "step_00000004: File too large" in line, line
    assert "Last complete checkpoint: " + str(run / "checkpoints" / "step_00000002") in line, line
    assert_intact_and_resumable(root, run, 2)


def test_full_disk_is_refused_before_the_save_with_the_space_it_needs(root, paused, tmp_path):
    """checkpoints/ on a tmpfs with room for a quarter of a checkpoint more."""
    run = tmp_path / "run"
    shutil.copytree(paused, run, ignore=shutil.ignore_patterns("checkpoints"))
    ckpt = paused / "checkpoints" / "step_00000002"
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    with small_tmpfs(run / "checkpoints", size + size // 4 + 3 * 4096):
        shutil.copytree(ckpt, run / "checkpoints" / ckpt.name)
        r = run_train(root, run, resume=True)
        line = one_error_line(r)
        assert re.search(r"step_00000004: not enough disk space \(need \d+\.\d MB, 0\.\d MB free in ", line), line
        assert (run / "checkpoints" / ckpt.name).is_dir()
        subprocess.run(["mount", "-o", f"remount,size={4 * size}", str(run / "checkpoints")], check=True)
        assert_intact_and_resumable(root, run, 2)


def test_read_only_run_directory_is_one_error_line(root, paused, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(paused, run)
    with read_only(run / "checkpoints") as how:
        line = one_error_line(run_train(root, run, resume=True))
    assert "cannot write checkpoint" in line and "step_00000004" in line, (how, line)
    with read_only(run) as how:   # nothing can be written: refused before training
        line = one_error_line(run_train(root, run, resume=True))
    assert str(run) in line, (how, line)
    assert_intact_and_resumable(root, run, 2)
