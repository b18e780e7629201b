"""The input pipeline: micro-batches made ahead of the loop in a worker process, copied without a host sync.

A worker process (forked, so it starts at once and reads the same memory-mapped data) draws each micro-batch
from the loader, checks its token ids, cuts it into documents (docs/math.md §10), makes what the model computes
on the host from those (the KDA layers' chunk-aligned layouts, `layout_chunk_sizes`) and writes all of it into
one of a few shared-memory slots. The loop takes a finished slot, copies it to the device in one `non_blocking`
transfer (on a GPU straight from the slot, page-locked), hands the slot back once that copy has run, and
runs the step while the worker fills the next ones.

A process, not a thread: a thread making batches beside a host-bound step's launching thread contends with
it for the interpreter lock, which each of its torch and numpy calls gives up and takes again. k3-toy B512
T256 compiled on an H100, one machine: 54.5–63.2 ms per step with a thread, 37.1–37.5 ms with the worker
(docs/performance.md).

The batches are exactly the loader's, in its order. Every batch carries the loader's state after it was
drawn, so a checkpoint records the position of the last batch the loop *consumed*, not of those made ahead.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import pickle
import signal
import time
from collections import deque
from dataclasses import dataclass

import torch

from k3cli.data import EOT_ID, check_token_ids, document_starts
from k3cli.layers.segments import Segments
from k3cli.ops.kda import varlen


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


# a batch's tensors in a slot: (name, offset in int32 words, dtype, shape); int64 ones start on an even word
Part = tuple[str, int, torch.dtype, tuple[int, ...]]


def make_parts(ids: torch.Tensor, vocab_size: int, document_mask: bool, chunk_sizes: list[int],
               start_id: int = EOT_ID) -> tuple[dict[str, torch.Tensor], dict[int, tuple[int, int]]]:
    """A loader batch made ready for the model, on the CPU: its tensors by name (ids; with the document mask
    the documents and, per KDA chunk size C, the layout's tensors `src{C}` ...) and each layout's
    (n_seq, n_run). Raises DataError on a token id outside the vocabulary."""
    check_token_ids(ids, vocab_size)
    parts, counts = {"ids": ids}, {}
    if document_mask:
        seg = document_segments(ids, None, True, start_id)
        parts.update(doc=seg.doc, pos=seg.pos, cu=seg.cu_seqlens)
        cu = seg.cu_seqlens.long()
        for C in chunk_sizes:
            lay = varlen.host_layout(cu, C)
            parts.update({f"src{C}": lay.src, f"tok{C}": lay.tok, f"dst{C}": lay.dst, f"seqs{C}": lay.seqs,
                          f"ctab{C}": lay.ctab})
            counts[C] = (lay.n_seq, lay.n_run)
    return parts, counts


def places_of(parts: dict[str, torch.Tensor]) -> tuple[list[Part], int]:
    """Where `pack` writes each of `parts`, and the int64 words they take."""
    places, word = [], 0
    for name, x in parts.items():
        word += word % 2 if x.dtype == torch.int64 else 0
        places.append((name, word, x.dtype, tuple(x.shape)))
        word += x.numel() * x.element_size() // 4
    return places, (word + 1) // 2


def pack(parts: dict[str, torch.Tensor], slot: torch.Tensor) -> tuple[list[Part], int] | None:
    """Write `parts` into `slot` (int64 [n]): their places and the int64 words used, or None if they do not fit."""
    places, used = places_of(parts)
    if used > slot.numel():
        return None
    words = slot.view(torch.int32)
    for (_, at, dtype, _), x in zip(places, parts.values()):
        words[at:at + x.numel() * x.element_size() // 4].view(dtype).copy_(x.flatten())
    return places, used


def unpack(buf: torch.Tensor, places: list[Part], names=None) -> dict[str, torch.Tensor]:
    """The tensors `pack` wrote, as views of `buf` (int64), those in `names` only if given."""
    words = buf.view(torch.int32)
    out = {}
    for name, at, dtype, shape in places:
        if names is None or name in names:
            n = torch.Size(shape).numel() * dtype.itemsize // 4
            out[name] = words[at:at + n].view(dtype).view(shape)
    return out


@dataclass
class _Made:
    slot: int                       # the slot it holds (freed once the loop has copied the batch)
    places: list[Part]
    used: int                       # int64 words
    counts: dict[int, tuple[int, int]]
    loader_state: dict
    whole: object = None            # the batch itself (numpy int64) when it did not fit the slot


class _Failed:
    def __init__(self, error: BaseException):
        try:   # the loop raises the worker's own error if it survives the trip
            self.error = pickle.loads(pickle.dumps(error))
        except Exception:
            self.error = RuntimeError(f"{type(error).__name__}: {error}")


def _shared_slot(words: int) -> torch.Tensor:
    """int64 [words] in anonymous shared memory: a forked worker writes what the parent reads."""
    return torch.frombuffer(mmap.mmap(-1, max(8, words * 8)), dtype=torch.int64)


def _work(loader, vocab_size: int, document_mask: bool, chunk_sizes: list[int], start_id: int,
          slots: list[torch.Tensor], free, ready, stop, parent: int) -> None:
    """The worker process: fill free slots with the loader's batches until `stop` or the parent is gone."""
    # the loop decides how a run stops (a signal to the whole process group included), and stops this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)

    def alive() -> bool:
        return not stop.is_set() and os.getppid() == parent

    try:
        while alive():
            parts, counts = make_parts(next(loader), vocab_size, document_mask, chunk_sizes, start_id)
            while alive():
                if free.poll(0.1):
                    slot = free.recv()
                    break
            else:
                break
            if (placed := pack(parts, slots[slot])) is not None:
                ready.send(_Made(slot, *placed, counts, loader.state_dict()))
            else:   # unusually many documents: sent whole, through the pipe (slower), the slot kept meanwhile
                whole = torch.empty(places_of(parts)[1], dtype=torch.int64)
                ready.send(_Made(slot, *pack(parts, whole), counts, loader.state_dict(), whole.numpy()))
    except BaseException as e:   # handed to the loop, which raises it where the batch was due
        try:
            ready.send(_Failed(e))
        except OSError:   # the loop is gone
            pass


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A copy made on this thread: torch's clone of B·T + 1 entries hands it to the intra-op pool, whose threads
    then wait for the cores the worker holds (on 2 CPU cores 3 ms for cu_seqlens, against 0.1–0.3 ms here)."""
    return torch.from_numpy(x.numpy().copy())


def _check_cuda(err, what: str) -> None:
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"could not {what} the batch slots as page-locked memory (CUDA error {err})")


class Prefetcher:
    """`next_batch()` gives the loader's micro-batches on `device`, made `depth` ahead by a worker process
    (one intra-op thread). With the document mask it also makes, per size in `chunk_sizes` (the model's
    `layout_chunk_sizes()`), each batch's KDA layout, which the step then finds made. An error the worker
    meets (damaged data) is raised by the `next_batch()` that would have returned that batch; `close()`
    stops the worker. `wait_s` sums the seconds spent in `next_batch` (waiting, and taking and copying the
    batch)."""

    def __init__(self, loader, vocab_size: int, document_mask: bool, device: torch.device, depth: int = 4,
                 chunk_sizes: list[int] = (), start_id: int = EOT_ID):
        self.device, self.wait_s = device, 0.0
        self.loader_state = loader.state_dict()   # of the last batch consumed
        self._cuda = device.type == "cuda"
        rows, T = loader.batch_size // loader.world_size, loader.seq_len
        # ids, doc, pos, cu and per chunk size the layout (src and tok at most twice B·T here; larger goes whole)
        n = rows * T
        self._slots = [_shared_slot(4 * n + len(chunk_sizes) * (6 * n + n // 8 + 64) + 64) for _ in range(depth + 3)]
        ctx = mp.get_context("fork")
        # pipes, not queues: a queue's feeder thread in this process would contend for the interpreter lock too
        free, self._free = ctx.Pipe(duplex=False)
        self._ready, ready = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        for i in range(len(self._slots)):   # a few small messages: the pipe holds them
            self._free.send(i)
        self._proc = ctx.Process(target=_work, name="k3-batches", daemon=True,
                                 args=(loader, vocab_size, document_mask, list(chunk_sizes), start_id, self._slots,
                                       free, ready, self._stop, os.getpid()))
        self._proc.start()
        free.close()   # the worker's ends
        ready.close()
        # on a GPU the slots are page-locked (after the fork: the child keeps its mapping) and copied from
        # directly; a slot goes back to the worker once its copy has run (`_inflight`: event, slot)
        self._inflight: deque = deque()
        if self._cuda:
            for slot in self._slots:
                _check_cuda(torch.cuda.cudart().cudaHostRegister(slot.data_ptr(), slot.numel() * 8, 0), "register")

    def next_batch(self) -> Batch:
        t0 = time.perf_counter()
        while True:
            self._reclaim()
            try:
                if self._ready.poll(0.002 if self._inflight else 1.0):
                    item = self._ready.recv()
                    break
            except (EOFError, OSError):
                pass
            if not self._proc.is_alive():
                raise RuntimeError(f"the batch process has stopped (exit code {self._proc.exitcode})") from None
        if isinstance(item, _Failed):
            self.close()
            raise item.error
        host = (self._slots[item.slot] if item.whole is None else torch.from_numpy(item.whole))[:item.used]
        kept = {k: _copy(v) for k, v in unpack(host, item.places, self._host_names(item)).items()}
        if self._cuda and item.whole is None:   # one transfer, straight from the page-locked slot
            on_device = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._inflight.append((done, item.slot))
        else:
            on_device = host.pin_memory().to(self.device, non_blocking=True) if self._cuda else _copy(host)
            self._give_back(item.slot)
        parts = unpack(on_device, item.places)
        segments = None
        if "cu" in parts:
            segments = Segments(kept["cu"], parts["doc"], parts["pos"])
            for C, (n_seq, n_run) in item.counts.items():
                lay = varlen.VarlenLayout(parts[f"src{C}"], parts[f"tok{C}"], parts[f"dst{C}"], kept[f"ctab{C}"],
                                          parts[f"seqs{C}"], n_seq, n_run)
                varlen.keep_layout(kept["cu"], C, self.device, lay)
        self.loader_state = item.loader_state
        self.wait_s += time.perf_counter() - t0
        return Batch(parts["ids"], segments, item.loader_state)

    def _reclaim(self) -> None:
        while self._inflight and self._inflight[0][0].query():
            self._give_back(self._inflight.popleft()[1])

    def _give_back(self, slot: int) -> None:
        try:
            self._free.send(slot)
        except OSError:   # the worker has stopped: what it sent last (its error, if any) is still to be read
            pass

    @staticmethod
    def _host_names(item: _Made) -> set[str]:
        """The parts read on the host: cu_seqlens and the chunk tables stay on the CPU."""
        return {"cu"} | {f"ctab{C}" for C in item.counts}

    def close(self) -> None:
        self._stop.set()
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if self._cuda and self._slots:
            for done, _ in self._inflight:
                done.synchronize()
            for slot in self._slots:
                _check_cuda(torch.cuda.cudart().cudaHostUnregister(slot.data_ptr()), "unregister")
            self._slots, self._inflight = [], deque()
        self._free.close()
        self._ready.close()
