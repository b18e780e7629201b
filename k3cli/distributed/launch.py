"""`k3 train --nproc N`: torchrun started in this process, and what each rank it starts does first (die
with the launcher, join the process group, share rank 0's run directory)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

LAUNCHER_PID = "K3_LAUNCHER_PID"


class LaunchError(RuntimeError):
    """The launcher or a rank stopped; `code` is the exit code to leave with."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class RankFailed(LaunchError):
    """A rank under `launch` failed; the message says which and how."""


class LaunchStopped(LaunchError):
    """SIGINT / SIGTERM reached the launcher; the ranks have stopped after a checkpoint (128 + signal)."""


def torchrun_world() -> tuple[int, int]:
    """(WORLD_SIZE, RANK) as torchrun sets them; (1, 0) otherwise. Read without importing torch."""
    return int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))


def die_with_launcher() -> None:
    """Make this rank die (SIGKILL) when the process that started it does. torchrun starts every rank
    with setsid, outside its process group, so a SIGKILL to the launcher's process group left the ranks
    training on, orphaned, into the run directory a resumed run then wrote too. Linux only."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    # `k3 train --nproc` names itself: if it died before the call, this rank has another parent by now
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is not None and os.getppid() != int(launcher):
        raise LaunchError("the process that started this rank has exited; stopping", 1)


def join_ranks(device_type: str, run_dir: Path | None, new_run_dir: Callable[[], Path]) -> Path:
    """Under torchrun: join the process group (training reuses it) and take rank 0's run directory,
    made by rank 0 with `new_run_dir()` when none was given."""
    from k3cli.distributed.env import broadcast_object, init_distributed

    info = init_distributed(device_type)
    if run_dir is None and info.is_main:
        run_dir = new_run_dir()
    return Path(broadcast_object(str(run_dir) if run_dir is not None else None))


def launch(nproc: int, args: list[str]) -> None:
    """`torchrun --standalone --nproc-per-node N -m k3cli train ARGS` in this process. RankFailed names
    the rank that caused a failure and its exit code; LaunchStopped a signal that stopped every rank."""
    import logging
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the launcher's own log lines (closing signals, the failure table) would repeat the one error line
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    argv = ["--standalone", f"--nproc-per-node={nproc}", "-m", "k3cli", "train", *args]
    previous = os.environ.get(LAUNCHER_PID)
    os.environ[LAUNCHER_PID] = str(os.getpid())   # the ranks inherit it (die_with_launcher)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        # the cause first: a rank killed from outside, else the lowest rank that exited with an error
        # (ranks that were only told to stop, or followed rank 0's reported error, come after it)
        def blame(item):
            rank, f = item
            killed = f.exitcode < 0 and f.exitcode != -signal.SIGTERM
            return (not killed, f.exitcode <= 0, rank)

        rank, failure = min(e.failures.items(), key=blame)
        code = failure.exitcode
        how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with code {code}"
        raise RankFailed(f"rank {rank} {how}; every rank has stopped", code if 0 < code < 128 else 1) from None
    except (KeyboardInterrupt, SignalException) as e:
        # the ranks got the signal too and have stopped after a checkpoint; exit as they did (130 / 143)
        sig = e.sigval if isinstance(e, SignalException) else signal.SIGINT
        raise LaunchStopped(f"stopped by {signal.Signals(sig).name}", 128 + sig) from None
    finally:   # an in-process caller (tests) may later start ranks under another torchrun
        if previous is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = previous
