"""The input pipeline: micro-batches made on the host ahead of the loop, copied without a host sync.

A background thread draws each micro-batch from the loader, checks its token ids, cuts it into
documents (docs/math.md §10), makes what the model computes on the host from those (the KDA layers'
chunk-aligned layout) and pins it, into a bounded queue; the loop takes one, copies it with
`non_blocking=True` and runs the step while the thread makes the next ones. The batches are exactly
the loader's, in its order. Every batch carries the loader's state after it was drawn, so a
checkpoint records the position of the last batch the loop *consumed*, not of those queued ahead.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3cli.data import EOT_ID, check_token_ids, document_starts
from k3cli.layers.segments import Segments
from k3cli.ops.transfer import to_device


def document_segments(ids: torch.Tensor, device: torch.device | None, document_mask: bool,
                      start_id: int = EOT_ID) -> Segments | None:
    """The packed documents of a CPU batch ids [B, T] for the model (data.document_mask), else None; each
    starts at a `start_id` (the data's, `PreparedData.start_id`)."""
    return Segments.from_starts(document_starts(ids, start_id), device) if document_mask else None


@dataclass
class Batch:
    ids: torch.Tensor                 # [B, T] int64 token ids (labels are the same ids)
    segments: Segments | None         # the packed documents, with the document mask
    loader_state: dict | None = None  # the loader's state right after this batch was drawn

    def to(self, device: torch.device) -> Batch:
        segments = None if self.segments is None else self.segments.to(device)
        return Batch(to_device(self.ids, device), segments, self.loader_state)


def host_batch(ids: torch.Tensor, vocab_size: int, document_mask: bool, pin: bool,
               prepare: Callable[[Segments], None] | None = None, start_id: int = EOT_ID) -> Batch:
    """A loader batch made ready for the device: token ids checked, documents cut (and `prepare(segments)`,
    what the model computes on the host from them, made), pinned for a GPU."""
    check_token_ids(ids, vocab_size)
    segments = document_segments(ids, None, document_mask, start_id)
    if segments is not None and prepare is not None:
        prepare(segments)
    if pin:
        ids = ids.pin_memory()
        segments = None if segments is None else segments.pin_memory()
    return Batch(ids, segments)


_DONE = object()


class Prefetcher:
    """`next_batch()` gives the loader's micro-batches on `device`, made `depth` ahead by a daemon
    thread. An error the thread meets (damaged data) is raised by the `next_batch()` that would
    have returned that batch; `close()` stops the thread. `wait_s` sums the seconds the loop waited."""

    def __init__(self, loader, vocab_size: int, document_mask: bool, device: torch.device, depth: int = 4,
                 prepare: Callable[[Segments], None] | None = None, start_id: int = EOT_ID):
        self.loader, self.device = loader, device
        self._make: Callable[[torch.Tensor], Batch] = lambda ids: host_batch(
            ids, vocab_size, document_mask, pin=device.type == "cuda", prepare=prepare, start_id=start_id)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self.wait_s = 0.0
        self.loader_state = loader.state_dict()   # of the last batch consumed
        # pinned memory belongs to a device's context: the thread uses this (the caller's) one
        self._cuda = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="k3-batches", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # one intra-op thread here (the setting is per thread): a second OpenMP team spinning beside the
            # step's made k3 train's CPU steps 1.75x slower
            torch.set_num_threads(1)
            if self._cuda is not None:
                torch.cuda.set_device(self._cuda)
            while not self._stop.is_set():
                ids = next(self.loader)
                batch = self._make(ids)
                batch.loader_state = self.loader.state_dict()
                self._put(batch)
        except BaseException as e:   # handed to the loop, which raises it where the batch was due
            self._put(e)
        self._put(_DONE)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_batch(self) -> Batch:
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch thread has stopped") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item is _DONE:
            raise RuntimeError("the batch thread has stopped")
        batch = item.to(self.device)
        self.loader_state = batch.loader_state
        self.wait_s += time.perf_counter() - t0
        return batch

    def close(self) -> None:
        self._stop.set()
        while True:   # unblock a put in flight
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
