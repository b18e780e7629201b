"""`k3 train` on several processes (torchrun, gloo on CPU): 2 processes against 1, resume across
world sizes, a killed rank, and eval / export / generate of the sharded checkpoints.

Quick cases run in this process (1-process ddp / fsdp runs use a process group of one). The `slow`
ones start 2 ranks with torchrun; this file is then also the ranks' script (`python -m
torch.distributed.run ... tests/test_distributed_train.py OUT`): each rank trains the runs listed in
OUT/spec.json with the recorder below and dumps what it saw.

What is compared, per step, to one process with the same global batch (tiny configs, fp32, 6 steps):
- the global loss before read-back (`all_reduce_mean`'s result, unrounded) and metrics.jsonl;
- every rank's router biases after every update: exactly equal to each other and to 1 process
  (the update reads integer load counts, summed over the ranks, of the same routing decisions);
- the rows every rank trained on (read from the loader, each rank its slice): together, each row of the
  global order exactly once.
Tolerance on the loss: TOL_LOSS = 1e-5 absolute (losses ~5.7); on the logged gradient norm 1e-4.
With the same 2-row micro-batches on both sides (each rank's slice of a global micro-batch is one
micro-batch of the 1-process run) only the summation order differs: the ranks' partial gradients
averaged by gloo / FSDP's reduce-scatter instead of added in turn, and the loss mean over ranks.
Seen (`-s` prints them): ddp 0 (equal), fsdp 4.8e-7 on kda-toy and 0 on k3-toy, both resumes 0.
A real fault is far outside this: another batch moves the loss by ~1e-2 (as much as consecutive
steps differ here), and a gradient off by a factor (sum instead of mean), which AdamW with clipping
nearly hides in the loss, moves the logged gradient norm by that factor.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import load_config
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus

TOL_LOSS = 1e-5
STEPS = 6
runner = CliRunner()


def tiny_cfg(corpus, preset="k3-toy", *extra):
    # the torch KDA path whatever TRITON_INTERPRET says: every process computes the same way, fast
    return load_config(preset, overrides=TINY_MODEL + TINY_TRAIN + [
        f"data.source={corpus}", "model.kda.backend=torch", *extra])


def tiny_sets(corpus, *extra) -> list[str]:
    args = []
    for s in TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}", "model.kda.backend=torch", *extra]:
        args += ["--set", s]
    return args


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the recorder: what one process trained on, its global losses and router biases ---------------

@contextlib.contextmanager
def recording():
    """Inside, every training micro-batch this process trains on (its rank's rows of the loader's global
    batch, as the loop takes them from its input pipeline: not those made ahead and never used), every
    global loss (`all_reduce_mean` in the loop) and every router-bias update is recorded."""
    import k3cli.distributed as par
    from k3cli.layers.moe import LatentMoE
    from k3cli.train import Prefetcher

    rec = {"rows": [], "losses": [], "biases": []}
    take, mean, update = Prefetcher.next_batch, par.all_reduce_mean, LatentMoE.update_bias

    def next_rows(self):
        batch = take(self)
        rec["rows"] += [tuple(r) for r in batch.ids.tolist()]
        return batch

    def all_reduce_mean(t):
        out = mean(t)
        rec["losses"].append(out.item())
        return out

    def update_bias(self):
        update(self)
        rec["biases"].append(self.router_bias.detach().clone())

    Prefetcher.next_batch, par.all_reduce_mean, LatentMoE.update_bias = next_rows, all_reduce_mean, update_bias
    try:
        yield rec
    finally:
        Prefetcher.next_batch, par.all_reduce_mean, LatentMoE.update_bias = take, mean, update


def train_here(cfg, run_dir: Path, **kw) -> dict:
    from k3cli.train import train

    with recording() as rec:
        train(cfg, run_dir, log=lambda m: None, **kw)
    return rec


def global_rows(cfg, steps: int) -> list[tuple]:
    """The rows of the first `steps` global batches of the run's one data order."""
    from k3cli.data import PackedLoader, prepare_data

    data = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len)
    loader = PackedLoader(data.train_tokens, cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.seed)
    return [tuple(r) for _ in range(steps) for r in next(loader).tolist()]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


# ---- quick: one process ----------------------------------------------------------------------------

def test_loader_state_resumes_at_another_batch_size():
    """The position counts windows of the one order: 3 steps of 4 rows read as 2 × 2-row micro-
    batches, then continued as 1 × 4-row batches, give the same rows as 6 × 2-row batches."""
    import numpy as np

    from k3cli.data import DataError, PackedLoader

    tokens = np.arange(40 * 8) % 97
    one = PackedLoader(tokens, 8, 2, seed=1, rows_per_step=4)
    ref = torch.cat([next(one) for _ in range(12)])
    a = PackedLoader(tokens, 8, 2, seed=1, rows_per_step=4)
    first = torch.cat([next(a) for _ in range(6)])
    b = PackedLoader(tokens, 8, 4, seed=1, rows_per_step=4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(torch.cat([first] + [next(b) for _ in range(3)]), ref)
    with pytest.raises(DataError, match="rows_per_step"):
        PackedLoader(tokens, 8, 4, seed=1, rows_per_step=8).load_state_dict(a.state_dict())
    old = {k: v for k, v in a.state_dict().items() if k != "rows_per_step"}   # written before rows_per_step
    PackedLoader(tokens, 8, 2, seed=1, rows_per_step=4).load_state_dict(old)
    with pytest.raises(DataError, match="batch_size"):
        PackedLoader(tokens, 8, 4, seed=1, rows_per_step=4).load_state_dict(old)


def test_check_parallel():
    from k3cli.train import check_parallel

    cfg = load_config("k3-toy", overrides=TINY_TRAIN)             # micro 2, global 4
    assert check_parallel(cfg, 1) == ("none", 2)
    assert check_parallel(cfg, 2) == ("fsdp", 1)
    with pytest.raises(ValueError, match=r"multiple of micro_batch_size x processes \(2 x 4 = 8\)"):
        check_parallel(cfg, 4)
    with pytest.raises(ValueError, match="independent copies"):
        check_parallel(load_config("k3-toy", overrides=TINY_TRAIN + ["train.parallel=none"]), 2)
    graphs = ["train.compile=true", "train.compile_mode=reduce-overhead", "data.document_mask=false"]
    with pytest.raises(ValueError, match="reduce-overhead.*fsdp"):
        check_parallel(load_config("k3-toy", overrides=TINY_TRAIN + graphs), 2)
    assert check_parallel(load_config("k3-toy", overrides=TINY_TRAIN + graphs + ["train.parallel=ddp"]), 2)[0] == "ddp"
    # CUDA graphs replay recorded launches; the masked KDA's follow each batch's documents
    with pytest.raises(ValueError, match="reduce-overhead.*document_mask"):
        check_parallel(load_config("k3-toy", overrides=TINY_TRAIN + graphs[:2]), 1)


def test_one_process_fsdp_run_resumes_without_parallel(corpus, tmp_path):
    """A 1-process fsdp run (group of one) writes sharded checkpoints; it resumes as a plain run
    (train.parallel may change) and the loss curve is the plain run's; eval, export and generate
    read the sharded checkpoint on one device."""
    from k3cli.checkpoint import is_sharded as is_dcp

    ref = train_here(tiny_cfg(corpus), tmp_path / "ref")
    run = tmp_path / "run"
    first = train_here(tiny_cfg(corpus, "k3-toy", "train.parallel=fsdp", "train.keep_last=5"), run, stop_at=3)
    ckpt = run / "checkpoints" / "step_00000003"
    assert is_dcp(ckpt) and not (ckpt / "model.safetensors").exists()
    second = train_here(tiny_cfg(corpus, "k3-toy", "train.parallel=none", "train.keep_last=5"), run, resume=True)
    assert max_diff(first["losses"] + second["losses"], ref["losses"]) <= TOL_LOSS
    assert sorted(first["rows"] + second["rows"]) == sorted(ref["rows"])
    assert [m["step"] for m in metrics(run)] == list(range(1, STEPS + 1))

    r = runner.invoke(app, ["eval", "--ckpt", str(ckpt), "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["step"] == 3
    out = tmp_path / "export"
    r = runner.invoke(app, ["export", "--run", str(run), "--ckpt", str(ckpt), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["EXPORT", "config.yaml", "model.safetensors", "tokenizer.json"]
    a = runner.invoke(app, ["eval", "--run", str(out), "--json", "--device", "cpu"])
    b = runner.invoke(app, ["eval", "--ckpt", str(ckpt), "--json", "--device", "cpu"])
    assert json.loads(a.stdout)["val_loss"] == json.loads(b.stdout)["val_loss"]
    r = runner.invoke(app, ["generate", "--ckpt", str(out), "--prompt", "the state", "--max-new-tokens", "4",
                            "--temperature", "0", "--device", "cpu", "--no-stream"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["export", "--run", str(run), "--out", str(out)])
    assert r.exit_code == 2 and "already exists" in r.stderr                    # nothing replaced


def test_export_refuses_damaged_input(corpus, tmp_path):
    run = tmp_path / "run"
    train_here(tiny_cfg(corpus, "k3-toy", "train.parallel=ddp", "train.steps=2"), run)
    ckpt = run / "checkpoints" / "step_00000002"
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    r = runner.invoke(app, ["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "ex")])
    assert r.exit_code == 2 and "not a complete checkpoint" in r.stderr
    assert not (tmp_path / "ex").exists() and not list(tmp_path.glob("ex.tmp-*"))


def test_nproc_errors_are_one_line_before_any_process_starts(corpus, tmp_path, monkeypatch):
    base = ["train", "--preset", "k3-toy", "--out", str(tmp_path / "r")] + tiny_sets(corpus)
    r = runner.invoke(app, base + ["--nproc", "3"])
    assert r.exit_code == 2 and "micro_batch_size x processes (2 x 3 = 6)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
    r = runner.invoke(app, base + ["--nproc", "2", "--set", "train.parallel=none"])
    assert r.exit_code == 2 and "independent copies" in r.stderr
    r = runner.invoke(app, base + ["--set", "train.parallel=tp"])
    assert r.exit_code == 2 and "train.parallel: 'tp' is not one of auto, none, ddp, fsdp" in r.stderr
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = runner.invoke(app, base + ["--nproc", "2"])
    assert r.exit_code == 2 and "under torchrun leave it out" in r.stderr


def test_nproc_hands_every_option_to_the_ranks(corpus, tmp_path, monkeypatch):
    import torch.distributed.run as torchrun

    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda args: seen.update(vars(args)))
    out = tmp_path / "r"
    r = runner.invoke(app, ["train", "--preset", "kda-toy", "--attnres", "block", "--out", str(out), "--nproc", "2",
                            "--steps", "4", "--seed", "3", "--until", "2", "--device", "cpu"] + tiny_sets(corpus))
    assert r.exit_code == 0, r.output
    assert seen["standalone"] and seen["nproc_per_node"] == "2" and seen["module"]
    args = [seen["training_script"]] + seen["training_script_args"]
    assert args[:2] == ["k3cli", "train"]
    for pair in (["--preset", "kda-toy"], ["--out", str(out)], ["--attnres", "block"], ["--steps", "4"],
                 ["--seed", "3"], ["--until", "2"], ["--device", "cpu"], ["--set", f"data.source={corpus}"]):
        assert any(args[i:i + 2] == pair for i in range(len(args))), pair
    assert "--nproc" not in args


# ---- slow: 2 ranks under torchrun ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun(out: Path, runs: list[dict], world: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    """Start `world` ranks of this file's worker on `runs` (see `_worker`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(runs))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, str(out)]
    t = time.time()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    print(f"{world} ranks, {len(runs)} runs: {time.time() - t:.1f} s")
    return proc


def run_ranks(out: Path, runs: list[dict], world: int = 2) -> list[dict]:
    """Each rank trains `runs` ({name, preset, sets, stop_at, resume}) in order; their records."""
    proc = torchrun(out, runs, world)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["kda-toy", "k3-toy"])
def test_two_processes_match_one(corpus, tmp_path, preset):
    """ddp and fsdp on 2 ranks against 1 process, the same global batch (2 micro-batches of 2 in
    1 process, 1 micro-batch of 2 on each rank): loss curve, rows, router biases."""
    ref = train_here(tiny_cfg(corpus, preset), tmp_path / "ref")
    expected = global_rows(tiny_cfg(corpus, preset), STEPS)
    assert sorted(ref["rows"]) == sorted(expected)
    runs = [{"name": mode, "preset": preset, "sets": [f"train.parallel={mode}"]} for mode in ("ddp", "fsdp")]
    res = run_ranks(tmp_path / "ranks", runs)
    for mode in ("ddp", "fsdp"):
        ranks = [r[mode] for r in res]
        diff = max_diff(ranks[0]["losses"], ref["losses"])
        print(f"{preset} {mode}: max |loss 2 proc - loss 1 proc| = {diff:.2e} over {STEPS} steps")
        assert diff <= TOL_LOSS
        assert ranks[0]["losses"] == ranks[1]["losses"]                       # the logged loss is global
        m2, m1 = metrics(tmp_path / "ranks" / mode), metrics(tmp_path / "ref")
        assert [m["step"] for m in m2] == list(range(1, STEPS + 1))
        assert max_diff([m["loss"] for m in m2], [m["loss"] for m in m1]) <= TOL_LOSS + 1e-6
        assert max_diff([m["grad_norm"] for m in m2], [m["grad_norm"] for m in m1]) <= 1e-4
        assert max_diff([m["val_loss"] for m in m2 if "val_loss" in m],
                        [m["val_loss"] for m in m1 if "val_loss" in m]) <= TOL_LOSS
        # each rank its own rows; together every row of the global order once
        assert not set(ranks[0]["rows"]) & set(ranks[1]["rows"])
        assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == sorted(expected)
        if preset == "k3-toy":
            assert [m["moe_imbalance"] for m in m2] == [m["moe_imbalance"] for m in m1]
            assert len(ref["biases"]) == STEPS * 2                             # 2 MoE layers
            for r in ranks:
                assert all(torch.equal(a, b) for a, b in zip(r["biases"], ref["biases"], strict=True))
        else:
            assert not ref["biases"] and not ranks[0]["biases"]


@pytest.mark.slow
def test_resume_across_world_sizes_sees_each_sequence_once(corpus, tmp_path):
    """2 ranks (fsdp) to step 3, then 1 process to 6; and 1 process to 3 (its own format), then 2
    ranks to 6: both loss curves are the uninterrupted run's, and every row is trained on once."""
    ref = train_here(tiny_cfg(corpus), tmp_path / "ref")
    expected = global_rows(tiny_cfg(corpus), STEPS)
    # each segment: the records of its processes
    first = [r["2to1"] for r in run_ranks(tmp_path / "a", [{"name": "2to1", "preset": "k3-toy", "sets": [],
                                                             "stop_at": 3}])]
    second = [train_here(tiny_cfg(corpus), tmp_path / "a" / "2to1", resume=True)]
    one = [train_here(tiny_cfg(corpus), tmp_path / "b" / "1to2", stop_at=3)]
    two = [r["1to2"] for r in run_ranks(tmp_path / "b", [{"name": "1to2", "preset": "k3-toy", "sets": [],
                                                           "resume": True}])]
    for name, before, after in (("2to1", first, second), ("1to2", one, two)):
        diff = max_diff(before[0]["losses"] + after[0]["losses"], ref["losses"])
        print(f"resume {name}: max |loss - uninterrupted| = {diff:.2e}")
        assert diff <= TOL_LOSS
        rows = [row for r in before + after for row in r["rows"]]
        assert len(rows) == len(expected) and sorted(rows) == sorted(expected)   # none twice, none dropped
        run = tmp_path / ("a" if name == "2to1" else "b") / name
        assert [m["step"] for m in metrics(run)] == list(range(1, STEPS + 1))
        # every process's router biases after every update are the uninterrupted run's
        done = len(before[0]["biases"])
        for r, offset in [(r, 0) for r in before] + [(r, done) for r in after]:
            assert r["biases"] and all(torch.equal(a, b) for a, b in zip(r["biases"], ref["biases"][offset:]))


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The process torchrun (under `launcher`) started for `rank`, found by its RANK variable."""
    todo = _children(launcher)
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
        todo += _children(pid)
    return None


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_and_resume_auto_continues(corpus, tmp_path):
    """`k3 train --nproc 2`; SIGKILL of rank 1 after the step-4 checkpoint: the launcher exits
    non-zero within a bounded time, naming rank 1. An incomplete newer checkpoint (shards without
    marker) and a temp folder that looks complete are planted: `--resume auto` in 1 process skips
    both, continues from the last complete checkpoint and the run has each step once."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3cli", "train", "--preset", "k3-toy", "--out", str(run), "--nproc", "2"] \
        + tiny_sets(corpus, "train.steps=200", "train.ckpt_every=4", "train.keep_last=5", "train.eval_every=0",
                    "train.log_every=50")
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (run / "checkpoints" / "step_00000004" / "COMPLETE").is_file():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.05)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.time() - killed
    print(f"launcher exited {took:.1f} s after the kill, code {proc.returncode}")
    assert proc.returncode != 0 and took < 60
    assert "error: rank 1 was killed by SIGKILL" in err, err
    assert "--resume auto" in err

    from k3cli.checkpoint import latest as find_latest
    from k3cli.checkpoint import list_checkpoints

    last = find_latest(run)
    done = int(last.name.split("_")[1])
    assert done >= 4 and done % 4 == 0
    # a save cut off before its marker, and one cut off before its rename
    fake = run / "checkpoints" / f"step_{done + 4:08d}"
    import shutil

    shutil.copytree(last, fake)
    (fake / "COMPLETE").unlink()
    shutil.copytree(last, run / "checkpoints" / f"step_{done + 8:08d}.tmp-1-2")
    assert find_latest(run) == last
    steps = done + 3
    r = runner.invoke(app, ["train", "--out", str(run), "--resume", "auto", "--steps", str(steps)])
    assert r.exit_code == 0, r.output
    assert f"resumed from {last} at step {done}" in r.output
    assert [m["step"] for m in metrics(run)] == list(range(1, steps + 1))
    # the incomplete folder was set aside, never loaded or deleted; the temp folder is untouched
    assert any(".unverified-" in p.name for p in (run / "checkpoints").iterdir())
    assert (run / "checkpoints" / f"step_{done + 8:08d}.tmp-1-2").is_dir()
    assert list_checkpoints(run)[-1][0] == steps


@pytest.mark.slow
def test_an_exception_on_one_rank_is_one_line_naming_it(corpus, tmp_path):
    """Rank 1 raises in its third micro-batch of `k3 train` under torchrun: it prints one error line
    naming itself, every rank exits (rank 0's next collective fails at once; torchrun stops the
    rest) and the run keeps its last complete checkpoint."""
    args = ["train", "--preset", "k3-toy", "--out", str(tmp_path / "ranks" / "run")] + tiny_sets(corpus)
    t = time.time()
    proc = torchrun(tmp_path / "ranks", [{"cli": args, "fail_rank": 1, "fail_at": 3}])
    assert proc.returncode != 0 and time.time() - t < 120
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: rank 1:")]
    assert lines == ["error: rank 1: RuntimeError: injected failure (test)"], proc.stderr[-3000:]
    from k3cli.checkpoint import latest as find_latest

    assert find_latest(tmp_path / "ranks" / "run").name == "step_00000002"


@pytest.mark.slow
def test_eval_export_generate_of_a_two_rank_fsdp_checkpoint(corpus, tmp_path):
    """`k3 train --nproc 2` (fsdp) writes sharded checkpoints; `k3 eval` reads them in one process
    (the same val loss as the run logged), `k3 export` consolidates one, `k3 generate` reads the
    export, `k3 compare` reads the run."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "k3cli", "train", "--preset", "k3-toy", "--out", str(run), "--nproc", "2"] \
        + tiny_sets(corpus)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("done: step 6") == 1                             # rank 0 alone reports
    assert proc.stdout.count("step 1 | loss") == 1 and proc.stdout.count("run directory:") == 1
    ckpt = run / "checkpoints" / "step_00000006"
    marker = json.loads((ckpt / "COMPLETE").read_text())
    assert marker["format"] == "dcp" and marker["world_size"] == 2
    r = runner.invoke(app, ["eval", "--run", str(run), "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["step"] == 6 and abs(res["val_loss"] - metrics(run)[-1]["val_loss"]) <= TOL_LOSS
    out = tmp_path / "export"
    r = runner.invoke(app, ["export", "--run", str(run), "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["eval", "--ckpt", str(out), "--json", "--device", "cpu"])
    assert r.exit_code == 0 and json.loads(r.stdout)["val_loss"] == res["val_loss"]
    r = runner.invoke(app, ["generate", "--run", str(out), "--prompt", "the state", "--max-new-tokens", "8",
                            "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "(step 6)" in r.stderr
    r = runner.invoke(app, ["compare", str(run), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["runs"][0]["steps"] == 6


# ---- the ranks' side -----------------------------------------------------------------------------

def _worker(out: Path) -> None:
    from k3cli.distributed import destroy, init_distributed

    torch.set_num_threads(1)
    info = init_distributed("cpu", timeout_s=120)
    corpus = Path(os.environ["K3_CACHE_DIR"]).parent / "corpus"
    res = {}
    try:
        for spec in json.loads((out / "spec.json").read_text()):
            if "cli" in spec:   # the command line itself, rank `fail_rank` raising in micro-batch `fail_at`
                _fail_on(info.rank == spec["fail_rank"], spec["fail_at"])
                app(spec["cli"])
            cfg = tiny_cfg(corpus, spec["preset"], *spec["sets"])
            res[spec["name"]] = train_here(cfg, out / spec["name"], resume=spec.get("resume", False),
                                           stop_at=spec.get("stop_at"))
        torch.save(res, out / f"rank{info.rank}.pt")
    finally:
        destroy()


def _fail_on(this_rank: bool, at: int) -> None:
    from k3cli.data import PackedLoader

    take, calls = PackedLoader.__next__, []

    def next_rows(self):
        calls.append(1)
        if this_rank and len(calls) == at:
            raise RuntimeError("injected failure (test)")
        return take(self)

    PackedLoader.__next__ = next_rows


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))


@pytest.mark.slow
def test_ranks_started_by_torchrun_refuse_an_out_that_holds_a_run(corpus, tmp_path):
    """Each rank checks --out before it joins the process group: none starts over a run without --resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"k3": "run", "format": 1}\n')
    (run / "config.yaml").write_text("a run of someone's\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "k3cli", "train", "--preset", "k3-toy", "--out", str(run)] \
        + tiny_sets(corpus)
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "error: rank 0: " in proc.stderr and "holds a run with no checkpoint yet; pass --resume auto" in proc.stderr, \
        proc.stderr[-3000:]
    assert "k3cli/" not in proc.stderr   # torchrun's own failure table follows, but no traceback of ours
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
