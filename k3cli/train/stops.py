"""How a run ends early: a non-finite loss (exit 3), a signal (128 + its number), `--until`, the
time limit. Without a per-step host sync: one process decides from host state at every step,
several processes agree at the loop's read steps only."""
from __future__ import annotations

import signal
import threading
import time

import torch

from k3cli import distributed as par


class TrainingStopped(RuntimeError):
    """Raised on a non-finite loss; `code` is the CLI exit code. Every rank raises it together."""

    code = 3
    on_every_rank = True


class TrainingInterrupted(RuntimeError):
    """Raised after SIGINT / SIGTERM once the step's checkpoint is written; `code` is 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class StopSignals:
    """Once armed, SIGINT and SIGTERM only set a flag that the loop reads at each step's end, so
    training stops after a checkpoint of that step; a second SIGINT raises KeyboardInterrupt at once.
    Handlers are installed from the main thread only; `restore` puts the previous ones back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def arm(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt   # the user insists; a checkpoint save in flight is atomic anyway
        if self.signum is None:   # a repeated SIGTERM is ignored: scancel and torchrun may each send one
            self.signum = signum

    def poll(self, device: torch.device) -> int | None:
        """The signal that stops training now, the same on every rank (any rank's signal stops all)."""
        if not (par.is_distributed() and par.env_world_size() > 1):
            return self.signum
        seen = torch.tensor([self.signum == s for s in self.SIGNALS], dtype=torch.float32, device=device)
        hit = [s for s, n in zip(self.SIGNALS, par.all_reduce_sum_(seen).tolist()) if n > 0]
        if hit and self.signum is None:
            self.signum = hit[0]
        return hit[0] if hit else None


class Stops:
    """The time limit and signals. `early()`: with one process, whether either asks to stop now (host
    state only, every step); with several, nothing (they cannot agree without a collective).
    `agreed()`: at a read step, (signal, out of time) as every rank sees them."""

    def __init__(self, time_limit_s: float, signals: StopSignals, device: torch.device):
        self.time_limit_s, self.signals, self.device = time_limit_s, signals, device
        self.single = not (par.is_distributed() and par.env_world_size() > 1)
        self.t_start = time.time()

    def _out_of_time(self) -> bool:
        return self.time_limit_s > 0 and time.time() - self.t_start >= self.time_limit_s

    def early(self) -> bool:
        return self.single and (self.signals.signum is not None or self._out_of_time())

    def agreed(self) -> tuple[int | None, bool]:
        out_of_time = self._out_of_time()
        if self.time_limit_s > 0 and not self.single:
            out_of_time = par.broadcast_object(out_of_time)   # rank 0's clock stops every rank
        return self.signals.poll(self.device), out_of_time
