"""The chunk-aligned layout of variable-length sequences (README.md §9), shared by the Triton path (chunk.py)
and the torch path (torch_chunk.py)."""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

from k3cli.ops.rows import gather_rows_reference
from k3cli.ops.transfer import to_device


class VarlenLayout(NamedTuple):
    """Sequences of one flattened row moved so that each starts on a chunk: a chunk never spans two, the
    intra-chunk kernels need no change, and only the state scans restart per sequence."""
    src: Tensor    # [T'] original token of each laid-out position; total_T (a zero row) in the gaps
    tok: Tensor    # int32 [T'] the same with -1 in the gaps: the forward kernels read their inputs through it
    dst: Tensor    # [total_T] laid-out position of each original token
    ctab: Tensor   # int32 [T' / C] on the CPU: sequence << 2 | (last chunk of it) << 1 | (first chunk of it)
    seqs: Tensor   # int32 [N, 3] on the device: (sequence, first chunk, end chunk), longest first
    n_seq: int
    n_run: int     # sequences with at least one chunk: the first n_run rows of seqs


def cu_seqlens_of(lengths) -> Tensor:
    """Sequence lengths -> cu_seqlens [N + 1] int32 on the CPU (0, then the running sums)."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


# the layouts made lately, by value: every KDA layer of a step, forward and backward, asks for the same one,
# and the training loop's input pipeline makes each batch's ahead of its step (`keep_layout`)
_MADE: OrderedDict[tuple, VarlenLayout] = OrderedDict()
_MADE_LOCK = threading.Lock()
KEEP_LAYOUTS = 8


def _filled(cu: Tensor) -> int:
    """The sequences before a fixed-capacity cu_seqlens' trailing repeats of its total (empty sequences):
    they hold every token, and with the entry count they fix all of it."""
    return int(torch.searchsorted(cu, cu[-1:]))   # cu is non-decreasing: a binary search, not a pass over it


def _indexed(device) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def _key(cu: Tensor, C: int, device: torch.device) -> tuple:
    """The layout's key from cu (any integer dtype, on the CPU): only the filled entries are read (converting all
    B·T + 1 entries of a training batch's cu_seqlens took 0.6 ms, at every KDA op's lookup)."""
    return C, device, cu.numel(), cu[:_filled(cu) + 1].to(torch.int64).numpy().tobytes()


def varlen_layout(cu_seqlens: Tensor, C: int, device) -> VarlenLayout:
    """The chunk-aligned layout of the sequences [cu[i], cu[i+1]) for chunk size C, computed on the CPU with
    vectorised ops, or one made lately for the same cu_seqlens values, C and device (1.7 ms to make at
    B·T = 16,384). Empty sequences take no chunk."""
    cu = cu_seqlens.cpu()
    device = _indexed(device)
    key = _key(cu, C, device)
    with _MADE_LOCK:
        if (lay := _MADE.get(key)) is not None:
            _MADE.move_to_end(key)
            return lay
    lay = _make_layout(cu.long(), C, device)
    _keep(key, lay)
    return lay


def keep_layout(cu_seqlens: Tensor, C: int, device, lay: VarlenLayout) -> None:
    """Remember `lay` (`host_layout(cu_seqlens, C)` with its device tensors on `device`) as the layout of those
    sequences: the training loop's input pipeline makes each batch's in a worker process, ahead of its step."""
    _keep(_key(cu_seqlens.cpu(), C, _indexed(device)), lay)


def _keep(key: tuple, lay: VarlenLayout) -> None:
    with _MADE_LOCK:
        _MADE[key] = lay
        _MADE.move_to_end(key)
        while len(_MADE) > KEEP_LAYOUTS:
            _MADE.popitem(last=False)


def _make_layout(cu: Tensor, C: int, device: torch.device) -> VarlenLayout:
    lay = host_layout(cu, C)
    return lay._replace(src=to_device(lay.src, device), tok=to_device(lay.tok, device), dst=to_device(lay.dst, device),
                        seqs=to_device(lay.seqs, device))


def host_layout(cu: Tensor, C: int) -> VarlenLayout:
    """The layout of the sequences cu (long, on the CPU), every tensor on the CPU."""
    # the work runs on the filled sequences (B512 T256, one CPU thread: 8.8 -> 3.1 ms); the trailing empty
    # ones get their rows directly
    N, n = cu.numel() - 1, _filled(cu)
    lens = cu[1:n + 1] - cu[:n]
    chunks = (lens + C - 1) // C                                          # per sequence
    first_chunk = torch.cumsum(chunks, 0) - chunks
    total, NT = int(cu[-1]), int(chunks.sum())
    seq_of_tok = torch.repeat_interleave(torch.arange(n), lens)
    dst = torch.arange(total) + (first_chunk * C - cu[:n])[seq_of_tok]    # laid-out position of each token
    src = torch.full((NT * C,), total, dtype=torch.long).scatter_(0, dst, torch.arange(total))
    seq_of_chunk = torch.repeat_interleave(torch.arange(n), chunks)
    j = torch.arange(NT) - first_chunk[seq_of_chunk]
    ctab = (seq_of_chunk << 2) | ((j == chunks[seq_of_chunk] - 1).long() << 1) | (j == 0).long()
    # the Triton scans run one program per (value block, head, sequence): the longest start first, so that
    # the last programs the GPU schedules are the short ones; the trailing empty sequences (no chunk, at NT)
    # come last in their own order, as a stable sort of all N would put them
    order = torch.sort(chunks, descending=True, stable=True).indices
    seqs = torch.full((N, 3), NT, dtype=torch.int32)
    seqs[:, 0] = torch.arange(N, dtype=torch.int32)
    seqs[:n, 0], seqs[:n, 1], seqs[:n, 2] = order, first_chunk[order], (first_chunk + chunks)[order]
    tok = torch.where(src < total, src, -1).to(torch.int32)
    return VarlenLayout(src, tok, dst, ctab.to(torch.int32), seqs, N, int((chunks > 0).sum()))


def lay_out(x: Tensor, lay: VarlenLayout) -> Tensor:
    """[1, total_T, ...] -> [1, T', ...] in `lay`'s order, zeros in the gaps (q = k = v = 0, g = 0, β = 0: a gap
    changes no state and its outputs are dropped)."""
    return gather_rows_reference(x[0], lay.src)[None]
