"""SIGKILL `k3 train` at random moments, resume it with `--resume auto` each time, and check that
nothing a kill leaves behind is ever loaded: every resume names a complete checkpoint, no kill loses
more than the checkpoint interval, metrics.jsonl holds each step once, the final weights are
bitwise those of an uninterrupted run of the same config, and no folder a killed save or prune left
in checkpoints/ survives the final resume.

    python scripts/kill_test.py [--kills 20] [--seed 0] [--steps 40] [--ckpt-every 2] [--work DIR]
                                [--nproc 2 [--parallel ddp|fsdp]]

With --nproc N every run is `k3 train --nproc N` (gloo ranks under torchrun, sharded checkpoints),
the reference too, and a kill is a SIGKILL to the launcher's process group; no rank may outlive it.
Prints one row per kill (where it landed: during a step, a checkpoint save or a prune; steps lost)
and exits 1 on any violation. Runs on the CPU with one thread per process (bitwise comparisons need
the same kernels in every process)."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3cli.checkpoint import is_complete, list_checkpoints, load_full_model_state
from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus

RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_LINE = re.compile(r"^step \d+ \|", re.M)


def train_cmd(corpus: Path, out: Path, steps: int, ckpt_every: int, nproc: int = 1, parallel: str = "ddp") -> list[str]:
    cmd = [sys.executable, "-m", "k3cli", "train", "--preset", "k3-toy", "--data", str(corpus), "--out", str(out),
           "--resume", "auto"]
    sets = [*TINY_MODEL, *TINY_TRAIN, f"train.steps={steps}", f"train.ckpt_every={ckpt_every}", "train.eval_every=1000"]
    if nproc > 1:   # `k3 train --nproc N` runs torchrun in this process; the ranks are its children
        cmd += ["--nproc", str(nproc)]
        sets += [f"train.parallel={parallel}", "model.kda.backend=torch"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def survivors(run_dir: Path) -> list[int]:
    """Processes still running a training of `run_dir` (zombies aside)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir).encode() in (proc / "cmdline").read_bytes() \
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except (OSError, IndexError):   # gone meanwhile
            pass
    return found


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line)["step"])
            except (ValueError, KeyError):   # a line cut by the kill
                pass
    return out


def incomplete(run_dir: Path) -> set[Path]:
    return {p for _, p in list_checkpoints(run_dir) if not is_complete(p, verify=False)}


def landed(run_dir: Path, before: set[str]) -> str:
    """Where a kill landed, read from what it left in checkpoints/ (`before`: leftovers at the start)."""
    new = set(leftovers(run_dir)) - before
    if any(".tmp-" in n for n in new):
        return "checkpoint save"
    if new:
        return "prune"   # an old checkpoint half deleted
    return "step"


def leftovers(run_dir: Path) -> list[str]:
    """What killed saves and prunes left in checkpoints/: temp folders, folders being deleted,
    step folders that do not verify."""
    parent = run_dir / "checkpoints"
    temps = [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".deleting-" in p.name] if parent.is_dir() else []
    return temps + [p.name for p in incomplete(run_dir)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ckpt-every", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (k3 train --nproc N); a kill is a SIGKILL to the launcher's process group")
    ap.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp"], help="train.parallel with --nproc > 1")
    ap.add_argument("--work", type=Path, default=None, help="working folder (default: a new temporary one)")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="k3-kill-test-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K3_CACHE_DIR": os.environ.get("K3_CACHE_DIR", str(work / "cache"))}
    corpus = work / "corpus"
    if not corpus.is_dir():
        write_corpus(work)
    rng = random.Random(a.seed)
    errors: list[str] = []

    ref_dir, run_dir = work / "reference", work / "killed"
    t0 = time.time()
    cmd = {d: train_cmd(corpus, d, a.steps, a.ckpt_every, a.nproc, a.parallel) for d in (ref_dir, run_dir)}
    r = subprocess.run(cmd[ref_dir], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr)
        print("the uninterrupted reference run failed")
        return 1
    times = [json.loads(line)["time_s"] for line in (ref_dir / "metrics.jsonl").read_text().splitlines()]
    # the median step (checkpoints included): the first steps are slow warm-up, later ones set the pace
    step_s = statistics.median(b - a for a, b in zip([0.0, *times], times))
    # kill delays after a segment's first step line: about a step of progress each, so all kills land
    window = step_s * max(a.ckpt_every, a.steps / (a.kills + 1))
    print(f"reference: {a.steps} steps in {time.time() - t0:.1f} s ({1e3 * step_s:.0f} ms per step); "
          f"kills at 0-{1e3 * window:.0f} ms after each segment's first step")

    rows, kills, segment = [], 0, 0
    while True:
        segment += 1
        log = work / f"segment{segment:02d}.log"
        before = set(leftovers(run_dir))
        with log.open("w") as f:
            # a process group of its own: the kill takes the launcher and all it started in that group
            proc = subprocess.Popen(cmd[run_dir], env=env, stdout=f, stderr=subprocess.STDOUT, process_group=0)
        killing = kills < a.kills
        # the resume happens before the first step: wait for one past the resume point, then check
        # the checkpoint it names while it is still there (later saves prune it)
        while proc.poll() is None and not STEP_LINE.search(log.read_text()):
            time.sleep(0.005)
        text = log.read_text()
        m = RESUMED.search(text)
        resumed = int(m.group(2)) if m else 0
        if m and not is_complete(m.group(1)):
            errors.append(f"segment {segment}: resumed from {m.group(1)}, which is not a complete checkpoint")
        if not m and segment > 1 and list_checkpoints(run_dir) and "no checkpoint" not in text:
            errors.append(f"segment {segment}: no resume line")
        if rows:
            rows[-1]["resumed"] = resumed
            lost = rows[-1]["reached"] - resumed
            rows[-1]["lost"] = lost
            if lost > a.ckpt_every or lost < 0:
                errors.append(f"kill {len(rows)}: {lost} steps lost (reached {rows[-1]['reached']}, "
                              f"resumed at {resumed}); the interval is {a.ckpt_every}")
        if killing and proc.poll() is None:
            time.sleep(rng.uniform(0, window))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if proc.returncode == -signal.SIGKILL:
                kills += 1
                # torchrun starts each rank with setsid: they must die with the launcher, at once
                done, t_kill = steps_logged(run_dir), time.time()
                while survivors(run_dir) and time.time() - t_kill < 2:
                    time.sleep(0.05)
                if (left := survivors(run_dir)) or steps_logged(run_dir) != done:
                    errors.append(f"kill {kills}: training went on after the launcher was killed (processes {left}, "
                                  f"steps {done[-1] if done else 0} -> {steps_logged(run_dir)[-1]})")
                    for pid in left:
                        os.kill(pid, signal.SIGKILL)
                rows.append({"kill": kills, "reached": done[-1] if done else 0, "where": landed(run_dir, before)})
                continue
        proc.wait()
        if proc.returncode != 0:
            errors.append(f"segment {segment} exited with {proc.returncode}; see {log}")
        break

    print(f"\n{'kill':>4}  {'landed during':<16}{'step reached':>13}{'resumed at':>11}{'steps lost':>11}")
    for row in rows:
        print(f"{row['kill']:>4}  {row['where']:<16}{row['reached']:>13}{row.get('resumed', '-'):>11}"
              f"{row.get('lost', '-'):>11}")
    where = {w: sum(r["where"] == w for r in rows) for w in ("step", "checkpoint save", "prune")}
    print(f"\n{kills} kills: " + ", ".join(f"{n} during a {w}" for w, n in where.items() if n)
          + f"; {segment} segments")

    logged = steps_logged(run_dir)
    if logged != list(range(1, a.steps + 1)):
        errors.append(f"metrics.jsonl steps are not 1..{a.steps} once each: {logged}")
    final = find_latest_checkpoint(run_dir)
    if final is None or final.name != f"step_{a.steps:08d}":
        errors.append(f"the run did not end with a checkpoint of step {a.steps} (newest: {final})")
    else:
        wa = load_full_model_state(find_latest_checkpoint(ref_dir))
        wb = load_full_model_state(final)
        diff = [k for k in wa if k not in wb or not torch.equal(wa[k], wb[k])]
        if diff or wa.keys() != wb.keys():
            errors.append(f"final weights differ from the uninterrupted run: {diff[:5] or 'keys'}")
    # resume skips them, but they are disk the run would never get back: the next save or resume tidies them
    left = leftovers(run_dir)
    print(f"left behind after the final resume: {len(left)} folder(s) of killed saves or prunes")
    if left:
        errors.append(f"folders of killed saves or prunes were not tidied: {left}")
    for e in errors:
        print(f"VIOLATION: {e}")
    if kills < a.kills:
        print(f"note: the run finished after {kills} of {a.kills} kills")
    print("all checks passed" if not errors else f"{len(errors)} violation(s); work folder {work}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
