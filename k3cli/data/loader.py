"""Token streams → batches: documents packed into one stream (each followed by `<|endoftext|>`), an infinite
sequence of `input_ids [B, T]` training batches whose position `state_dict()` captures exactly, and fixed,
unshuffled validation batches. Labels are the inputs: the model shifts internally."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tokenizers import Tokenizer

from k3cli.data.sources import Document
from k3cli.data.tokenizer import EOT_ID
from k3cli.errors import DataError


def pack_documents(tok: Tokenizer, docs: list[Document], dtype=np.uint16,
                   progress: Callable[[str], None] | None = None, label: str = "") -> np.ndarray:
    """One stream [N] of token ids: each document's ids followed by EOT_ID."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers>=0.20)
    parts, batch, size, done = [], [], 0, 0
    total = sum(d.nbytes for d in docs)
    eot = np.array([EOT_ID], dtype=dtype)
    for i, d in enumerate(docs):
        batch.append(d.text)
        size += d.nbytes
        # ~4 MiB per call: parallel inside encode_batch, bounded memory, and a progress tick
        if size >= 4 * 2**20 or i == len(docs) - 1:
            for enc in encode(batch, add_special_tokens=False):
                parts += [np.asarray(enc.ids, dtype=dtype), eot]
            done += size
            batch, size = [], 0
            if progress:
                progress(f"encoded {label} {done / 2**20:.1f}/{total / 2**20:.1f} MiB")
    return np.concatenate(parts)


class PackedLoader:
    """Infinite, checkpointable batches `input_ids [B, T]` (int64) from a packed stream `tokens [N]`.

    The stream is cut into W = N // T non-overlapping windows. Epoch e visits all W windows in a
    permutation drawn from (seed, e); a batch that runs past the end of an epoch continues into the
    next, so every batch is full. `state_dict()` = (epoch, position) reproduces the batch sequence.

    The position counts windows of the one order, whatever the batch size: a multi-process run
    draws global micro-batches (micro_batch_size × processes rows, each rank keeps its slice), and
    `rows_per_step` (the global batch) is what a resumed loader must share, so a state saved at a
    step boundary continues under any number of processes with every window seen once. With
    `world_size` > 1 a batch is rank `rank`'s contiguous rows of the global one and only those are read.
    `tokens` may be a memory-mapped `shards.TokenStream`: a window is read when its batch is made.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 rows_per_step: int | None = None, rank: int = 0, world_size: int = 1):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.rows_per_step = rows_per_step
        if batch_size % world_size or not 0 <= rank < world_size:
            raise ValueError(f"PackedLoader: {batch_size} rows do not split over {world_size} ranks (rank {rank})")
        self.rank, self.world_size = rank, world_size
        self.num_windows = len(tokens) // seq_len
        if self.num_windows < 1:
            raise DataError(f"the train split has {len(tokens)} tokens, fewer than train.seq_len "
                            f"({seq_len}); use more data or a shorter seq_len")
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, None

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> torch.Tensor:
        parts, got = [], 0
        while got < self.batch_size:
            take = self._order()[self.position:self.position + self.batch_size - got]
            parts.append(take)
            got += len(take)
            self.position += len(take)
            if self.position == self.num_windows:
                self.epoch, self.position = self.epoch + 1, 0
        n = self.batch_size // self.world_size
        idx = np.concatenate(parts)[self.rank * n:(self.rank + 1) * n]  # this rank's rows only (par.shard_batch's)
        rows = windows(self.tokens, idx.astype(np.int64) * self.seq_len, self.seq_len)
        return torch.from_numpy(rows.astype(np.int64))  # [B / world_size, T]

    def state_dict(self) -> dict:
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                 "batch_size": self.batch_size, "num_windows": self.num_windows}
        if self.rows_per_step is not None:
            state["rows_per_step"] = self.rows_per_step
        return state

    def load_state_dict(self, state: dict) -> None:
        # with a global batch on both sides only it must match: the batch size follows the number of processes
        shared = ("rows_per_step",) if self.rows_per_step is not None and "rows_per_step" in state else ("batch_size",)
        for key in ("seed", "seq_len", "num_windows") + shared:
            if state[key] != getattr(self, key):
                raise DataError(f"cannot resume the data loader: checkpoint has {key}={state[key]}, "
                                f"this run has {getattr(self, key)} (different data or config?)")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def windows(tokens, starts: np.ndarray, length: int) -> np.ndarray:
    """Rows tokens[s:s + length] for each s in `starts` -> [n, length], gathered in one indexing op (a
    `shards.TokenStream` by one per shard): slicing row by row held the interpreter about 12 µs a row, which
    the training step's launching thread waited out."""
    if hasattr(tokens, "windows"):
        return tokens.windows(starts, length)
    return np.asarray(tokens)[starts[:, None] + np.arange(length)]


def document_starts(ids: torch.Tensor, start_id: int = EOT_ID) -> torch.Tensor:
    """ids [B, T] -> bool [B, T], True where a document starts: the first position of every row and every
    `start_id`: `<|endoftext|>` for k3's own tokenizers, the separator `pack_documents` puts before each next
    document (EOT_ID never occurs inside a document: a literal '<|endoftext|>' there is text), or the start
    token an imported tokenizer frames each document with (`prepare.frame_ids`). The start token opens its
    document, so the loss at its position predicts that document's first token from it alone, as a prompt
    that starts with it would; the token before it predicts the end of the previous document."""
    starts = ids == start_id
    starts[:, 0] = True
    return starts


def check_token_ids(ids: torch.Tensor, vocab_size: int, every_rank: bool = False) -> None:
    """DataError when a batch holds a token id past the model's vocabulary: shards damaged in place (their
    sizes still right) or written by another tokenizer; the embedding would fail with an index error,
    on CUDA as a device-side assert. `every_rank`: all ranks check the same batch (one of them reports)."""
    top = int(ids.max()) if ids.numel() else 0
    if top >= vocab_size:
        e = DataError(f"token id {top} in the data is outside the model's vocabulary ({vocab_size}): the "
                      "prepared shards are damaged or from another tokenizer (check them with "
                      "`k3 data info DIR --verify`)")
        e.on_every_rank = every_rank
        raise e


def val_batches(tokens: np.ndarray, seq_len: int, n: int, batch_size: int) -> list[torch.Tensor]:
    """Up to n batches `[B, T]` of consecutive windows from the start of `tokens [N]`, no shuffle
    (the last may hold fewer rows). A stream shorter than T gives one batch [1, N]."""
    T = min(seq_len, len(tokens))
    if T < 2:
        raise DataError(f"the validation split has {len(tokens)} tokens; need at least 2")
    W = min(len(tokens) // T, n * batch_size)
    windows = np.asarray(tokens[:W * T]).astype(np.int64).reshape(W, T)  # [W, T]
    return [torch.from_numpy(windows[i:i + batch_size]) for i in range(0, W, batch_size)]

