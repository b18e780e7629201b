"""Corpus → byte-level BPE → packed token streams → checkpointable batches.

`prepare_data` is the one entry point the training command calls:

1. read documents from `data.source` (`stdlib`, a .txt/.jsonl/.parquet file or folder, `hf:NAME`),
   streamed in a deterministic order, up to `data.max_bytes` UTF-8 bytes (`iter_documents`);
2. split them into train / validation by a stable hash of each document's name (not its position,
   so adding files does not reshuffle the split);
3. train a byte-level BPE (`<|endoftext|>` = id 0) on a bounded sample of the train split, cached by
   corpus fingerprint;
4. encode both splits once into memory-mapped token shards (`k3cli.shards`: uint16 while the
   vocabulary fits, else uint32), each split one stream, every document followed by `<|endoftext|>`.
   A folder written by `k3 data prepare` is used as it is.

`PackedLoader` turns the train stream into an infinite sequence of `input_ids [B, T]` batches whose
position is captured exactly by `state_dict()`; `val_batches` gives fixed, unshuffled eval batches.
Labels are the inputs: the model shifts internally. Nothing here prints; progress goes to a callback.
Caches live under `$K3_CACHE_DIR` (default `~/.cache/k3`): `tokenizers/<fp>.json`, `shards/<fp>/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "DataError", "Document", "PreparedData", "PackedLoader", "EOT", "EOT_ID", "document_starts", "prepare_data",
    "load_documents", "iter_documents", "split_documents", "corpus_fingerprint", "train_tokenizer", "save_tokenizer",
    "load_tokenizer", "pack_documents", "val_batches", "cache_root",
]

EOT = "<|endoftext|>"
EOT_ID = 0
SUFFIXES = (".txt", ".jsonl", ".parquet")
TXT_PIECE_BYTES = 8192  # a lone .txt corpus is cut at blank lines into pieces of about this size
# Whole-stdlib BPE training takes ~6 s on a 2-core CPU, an 8 MiB sample 1.7 s (vocab 4096); above
# this size train on a sample (first 8 MiB of train documents in hash order) to keep startup short.
TOKENIZER_FULL_MAX_BYTES = 20 * 2**20
TOKENIZER_SAMPLE_BYTES = 8 * 2**20
# BPE training merges within a word in time quadratic in its length (a 200 KB run of one letter took
# 14 s, a 20 MB one never finished), so longer runs of non-space characters reach the trainer in
# pieces of this size; the longest run in the stdlib's source is 1,170, so its tokenizer is unchanged
TOKENIZER_MAX_RUN = 2048
HUB_PROBE_TIMEOUT_S = 5.0
_FORMAT = 1  # bump when the meaning of cached files changes


class DataError(ValueError):
    """A user-caused data problem (bad path, empty corpus, ...); its message is one line."""


@dataclass(frozen=True)
class Document:
    name: str  # stable identity, e.g. 'stdlib/json/decoder.py' or 'shard0.jsonl#17'
    text: str
    nbytes: int  # UTF-8 size of text


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else $K3_CACHE_DIR, else ~/.cache/k3."""
    return Path(cache_dir or os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3")


# ---- reading ------------------------------------------------------------------------------------

def _walk(root: Path, suffixes: tuple[str, ...], skip: frozenset = frozenset()) -> Iterator[Path]:
    """Files under root with one of the suffixes, in sorted order, skipping hidden and `skip` folders."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(suffixes) and not f.startswith("."):
                yield Path(dirpath) / f


def _stdlib_docs() -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # a handful of stdlib test files are deliberately mis-encoded; 'replace' keeps them deterministic
    for path in _walk(root, (".py",), frozenset({"site-packages", "dist-packages", "__pycache__"})):
        yield f"stdlib/{path.relative_to(root).as_posix()}", path.read_bytes().decode("utf-8", "replace")


def _import_datasets():
    try:
        import datasets  # lazy: not installed on every machine, and slow to import
    except ImportError:
        raise DataError("reading .jsonl/.parquet/hf: sources needs the `datasets` package "
                        "(pip install datasets)") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # it logs a parse failure before raising it: ours is the one line
    return datasets


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _jsonl_line(path: Path, row: int) -> int:
    """The line number (1-based, as editors count) of 0-based `row` of a .jsonl file: its row-th non-blank line."""
    n = 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                if row == 0:
                    return n
                row -= 1
    return n


def _bad_jsonl_line(path: Path, text_field: str) -> str | None:
    """"line N: why" for the first line of a .jsonl file that is no JSON object with text in `text_field`
    (the reader's own messages count rows from 0 within a block, or name no row), or None."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip(b"\r\n").decode("utf-8"))
            except UnicodeDecodeError as e:
                return f"line {n}: not UTF-8 (byte {e.start + 1}; JSON is UTF-8)"
            except json.JSONDecodeError as e:
                return f"line {n}: not valid JSON ({e.msg}, column {e.colno})"
            if not isinstance(obj, dict):
                return f"line {n}: a JSON {type(obj).__name__}, expected an object"
            text = obj.get(text_field)
            if text is not None and not isinstance(text, str):
                return f"line {n}: '{text_field}' is {type(text).__name__}, expected text"
    return None


def _rows(ds, where: str, text_field: str, jsonl: Path | None = None) -> Iterator[tuple[str, str]]:
    """(name, text) of each row of a `datasets` table; reading errors become one-line DataErrors. `jsonl`:
    the table's .jsonl file, whose errors are placed by line number."""
    columns = ds.column_names  # None when a streamed source has not declared its features
    if columns is not None and text_field not in columns:
        raise DataError(f"{where} has no column '{text_field}' (columns: {', '.join(columns)}); "
                        f"set data.text_field")
    try:
        for i, row in enumerate(ds):
            if i == 0 and text_field not in row:
                raise DataError(f"{where} has no column '{text_field}' (columns: {', '.join(row)}); "
                                f"set data.text_field")
            text = row[text_field]
            if text is not None and not isinstance(text, str):
                at = f"line {_jsonl_line(jsonl, i)}" if jsonl else f"row {i}"
                raise DataError(f"{where} {at}: '{text_field}' is {type(text).__name__}, expected text")
            yield f"{where}#{i}", text or ""
    except DataError:
        raise
    except Exception as e:  # malformed JSON / parquet, a dropped connection: many exception types
        bad = _bad_jsonl_line(jsonl, text_field) if jsonl else None
        raise DataError(f"cannot read {where}: {bad or first_line(e)}") from None


def _table_docs(path: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    datasets = _import_datasets()
    builder = "json" if path.suffix == ".jsonl" else "parquet"
    try:
        # streaming reads the local file directly: no network, no Arrow copy in the HF cache
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
    except Exception as e:
        bad = _bad_jsonl_line(path, text_field) if builder == "json" else None
        raise DataError(f"cannot read {path}: {bad or first_line(e)}") from None
    yield from _rows(ds, name, text_field, path if builder == "json" else None)


def _regular(path: Path) -> Path:
    if not path.is_file():  # os.walk lists broken links, pipes and sockets too; reading a pipe would block
        raise DataError(f"data.source: {path} is not a regular file (a broken link, a pipe or a device); "
                        "remove it or point data.source elsewhere")
    return path


def _read_text(path: Path) -> str:
    """A .txt file's text (invalid UTF-8 replaced), or a one-line DataError naming it."""
    try:
        return _regular(path).read_bytes().decode("utf-8", "replace")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _is_blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace; reads a real file only up to its first other byte."""
    try:
        with open(_regular(path), "rb") as f:
            return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _file_docs(path: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    if path.suffix == ".txt":
        yield name, _read_text(path)
    elif not _is_blank(path):  # an empty table holds no documents, as an empty .txt does (datasets fails on it)
        yield from _table_docs(path, name, text_field)


def _split_text(text: str, name: str, target_bytes: int = TXT_PIECE_BYTES) -> Iterator[tuple[str, str]]:
    """One .txt file given as the whole corpus: cut it at blank lines into pieces of about
    `target_bytes`, so that it can be split into train and validation documents."""
    piece, size, i = [], 0, 0
    for para in text.split("\n\n"):
        piece.append(para)
        size += len(para.encode("utf-8")) + 2
        if size >= target_bytes:
            yield f"{name}#{i}", "\n\n".join(piece)
            piece, size, i = [], 0, i + 1
    if piece:
        yield f"{name}#{i}", "\n\n".join(piece)


def _path_docs(source: str, text_field: str) -> Iterator[tuple[str, str]]:
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source: {source} does not exist (expected stdlib, hf:NAME, "
                        f"or a .txt/.jsonl/.parquet file or folder)")
    if not path.is_dir():
        if path.suffix not in SUFFIXES:
            raise DataError(f"data.source: unsupported file type '{path.suffix or path.name}' ({source}); "
                            f"use a .txt, .jsonl or .parquet file or a folder of them")
        if path.suffix == ".txt":
            yield from _split_text(_read_text(path), path.name)
        else:
            yield from _file_docs(path, path.name, text_field)
        return
    files = list(_walk(path, SUFFIXES))
    if not files:
        raise DataError(f"data.source: no .txt/.jsonl/.parquet files under {source}")
    for f in files:
        yield from _file_docs(f, f.relative_to(path).as_posix(), text_field)


def _hub_reachable() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _hub_docs(spec: str, text_field: str) -> Iterator[tuple[str, str]]:
    """`hf:NAME` or `hf:NAME:CONFIG`, split 'train', streamed; from the local HF cache when offline."""
    name, _, config = spec.partition(":")
    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
                  for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if not offline and not _hub_reachable():
        raise DataError(f"data.source hf:{spec}: cannot reach the Hugging Face hub; download the data "
                        f"elsewhere and point data.source at its .jsonl/.parquet files")
    datasets = _import_datasets()
    try:
        ds = datasets.load_dataset(name, config or None, split="train", streaming=not offline)
    except Exception as e:
        mode = " (offline mode: only data sets already in the local HF cache)" if offline else ""
        raise DataError(f"data.source hf:{spec}: cannot load{mode}: {first_line(e)}") from None
    yield from _rows(ds, f"hf:{spec}", text_field)


def iter_documents(source: str, text_field: str = "text", max_bytes: int = 0) -> Iterator[Document]:
    """The non-empty documents of `source` one at a time, in a deterministic order, at most
    `max_bytes` UTF-8 bytes in all (0 = no cap; the document that crosses the cap is cut at it).
    Streams: only the current document is held (a .txt file given alone is read whole)."""
    if source == "stdlib":
        rows = _stdlib_docs()
    elif source.startswith("hf:"):
        rows = _hub_docs(source[3:], text_field)
    else:
        rows = _path_docs(source, text_field)
    total = 0
    for name, text in rows:
        if not text.strip():
            continue
        raw = text.encode("utf-8")
        full = not max_bytes or total + len(raw) < max_bytes
        if not full:
            # a character split by the cap is dropped, so the total may fall up to 3 bytes short
            text = raw[:max_bytes - total].decode("utf-8", "ignore")
            raw = text.encode("utf-8")
        if raw:
            yield Document(name, text, len(raw))
            total += len(raw)
        if not full:
            break


def load_documents(source: str, text_field: str = "text", max_bytes: int = 0) -> list[Document]:
    """All of `iter_documents` as a list; a DataError when there are none."""
    docs = list(iter_documents(source, text_field, max_bytes))
    if not docs:
        raise DataError(f"data.source: {source} holds no non-empty documents (empty corpus)")
    return docs


# ---- split and fingerprint ------------------------------------------------------------------------

def _unit_hash(name: str) -> float:
    """A stable number in [0, 1) from a document name (sha1, independent of Python's hash seed)."""
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "big") / 2**64


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, val), disjoint, each in corpus order; a document goes to val when its name hashes below
    `val_fraction`. With >= 2 documents each split gets at least one."""
    if len(docs) < 2:
        raise DataError(f"the corpus has {len(docs)} document; a train/validation split needs at least 2 "
                        f"(split the text into several files)")
    h = [_unit_hash(d.name) for d in docs]
    is_val = [x < val_fraction for x in h]
    if not any(is_val):
        is_val[h.index(min(h))] = True
    if all(is_val):
        is_val[h.index(max(h))] = False
    return ([d for d, v in zip(docs, is_val) if not v], [d for d, v in zip(docs, is_val) if v])


def corpus_fingerprint(train: list[Document], val: list[Document], vocab_size: int,
                       min_frequency: int) -> str:
    """sha256 (24 hex) over document names, sizes, content hashes, split membership and BPE settings."""
    h = hashlib.sha256(json.dumps({
        "format": _FORMAT, "vocab_size": vocab_size, "min_frequency": min_frequency, "eot": EOT,
        "sample": [TOKENIZER_FULL_MAX_BYTES, TOKENIZER_SAMPLE_BYTES]}, sort_keys=True).encode())
    for split, docs in (("train", train), ("val", val)):
        for d in docs:
            digest = hashlib.sha1(d.text.encode("utf-8")).hexdigest()
            h.update(f"{split}\0{d.name}\0{d.nbytes}\0{digest}\n".encode())
    return h.hexdigest()[:24]


# ---- tokenizer ------------------------------------------------------------------------------------

def _ready(tok: Tokenizer) -> Tokenizer:
    # a literal '<|endoftext|>' inside a document is text, not the separator; this flag is not
    # stored in tokenizer.json, so set it on every load
    tok.encode_special_tokens = True
    return tok


def _tokenizer_sample(train: list[Document]) -> list[str]:
    if sum(d.nbytes for d in train) <= TOKENIZER_FULL_MAX_BYTES:
        return [d.text for d in train]
    out, total = [], 0
    for d in sorted(train, key=lambda d: _unit_hash(d.name)):
        if total >= TOKENIZER_SAMPLE_BYTES:
            break
        out.append(d.text)
        total += d.nbytes
    return out


def _bounded_runs(texts: list[str]) -> Iterator[str]:
    """The texts, with each run of more than TOKENIZER_MAX_RUN non-space characters cut out of its
    text and given as pieces of at most that length (a text without one is given whole)."""
    long_run = re.compile(rf"\S{{{TOKENIZER_MAX_RUN + 1},}}")
    for text in texts:
        pos = 0
        for m in long_run.finditer(text):
            yield text[pos:m.start()]
            yield from (m.group()[i:i + TOKENIZER_MAX_RUN] for i in range(0, len(m.group()), TOKENIZER_MAX_RUN))
            pos = m.end()
        yield text[pos:]


def train_tokenizer(train: list[Document], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Byte-level BPE with `<|endoftext|>` = id 0 and at most `vocab_size` tokens, trained on the train
    documents (all of them up to 20 MiB, else the first 8 MiB in hash order).
    decode(encode(s)) == s for any string: no normalizer, no prefix space, byte-level decoder."""
    if vocab_size < 257:
        raise DataError(f"model.vocab_size is {vocab_size}; a byte-level tokenizer needs >= 257 "
                        f"(256 bytes + {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = list(_bounded_runs(_tokenizer_sample(train)))
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert tok.token_to_id(EOT) == EOT_ID
    return _ready(tok)


def save_tokenizer(tok: Tokenizer, run_dir: str | os.PathLike) -> Path:
    """Write `run_dir/tokenizer.json` (atomically) and return its path."""
    path = Path(run_dir) / "tokenizer.json"
    write_text_atomic(path, tok.to_str())
    return path


def write_text_atomic(path: Path, text: str) -> None:
    # temp name + rename: a concurrent reader sees the old file or the whole new one, never half
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def load_tokenizer(run_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a run directory (or a tokenizer .json file)."""
    path = Path(run_dir)
    path = path if path.suffix == ".json" or path.is_file() else path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"no tokenizer at {path}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
        raise DataError(f"cannot read tokenizer {path}: {(str(e).strip().splitlines() or ['malformed'])[0][:160]}") from None
    return _ready(tok)


# ---- encoding and packing -------------------------------------------------------------------------

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
        idx = []
        while len(idx) < self.batch_size:
            take = self._order()[self.position:self.position + self.batch_size - len(idx)]
            idx.extend(take.tolist())
            self.position += len(take)
            if self.position == self.num_windows:
                self.epoch, self.position = self.epoch + 1, 0
        n = self.batch_size // self.world_size
        idx = idx[self.rank * n:(self.rank + 1) * n]  # this rank reads its rows only (par.shard_batch's slice)
        T = self.seq_len
        rows = np.stack([self.tokens[i * T:(i + 1) * T] for i in idx]).astype(np.int64)
        return torch.from_numpy(rows)  # [B / world_size, T]

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


def document_starts(ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> bool [B, T], True where a document starts: the first position of every row and every
    `<|endoftext|>`, the separator `pack_documents` puts before each next document (EOT_ID never occurs
    inside a document: a literal '<|endoftext|>' there is text). The separator opens the next document, so
    the loss at its position predicts that document's first token from the separator alone, as a prompt
    that starts with `<|endoftext|>` would; the token before it predicts the end of its own document."""
    starts = ids == EOT_ID
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


# ---- the entry point ------------------------------------------------------------------------------

@dataclass
class PreparedData:
    tokenizer: Tokenizer
    train_tokens: np.ndarray  # [N_train] packed stream: memory-mapped shards (`shards.TokenStream`)
    val_tokens: np.ndarray  # [N_val]
    fingerprint: str
    seq_len: int
    n_train_docs: int
    n_val_docs: int
    train_bytes: int
    val_bytes: int
    # UTF-8 bytes of val text per token of the val stream (EOT separators included, as eval's mean
    # loss includes them): bits/byte = loss_nats_per_token / ln 2 / bytes_per_token_val
    bytes_per_token_val: float
    tokenizer_cached: bool
    tokens_cached: bool
    path: Path | None = None  # the prepared directory the streams are mapped from

    def train_loader(self, batch_size: int, seed: int = 0, rows_per_step: int | None = None,
                     rank: int = 0, world_size: int = 1) -> PackedLoader:
        return PackedLoader(self.train_tokens, self.seq_len, batch_size, seed, rows_per_step, rank, world_size)

    def val_batches(self, n: int, batch_size: int) -> list[torch.Tensor]:
        return val_batches(self.val_tokens, self.seq_len, n, batch_size)


def prepare_data(data_cfg, vocab_size: int, seq_len: int, cache_dir: str | os.PathLike | None = None,
                 progress: Callable[[str], None] | None = None, tokenizer=None) -> PreparedData:
    """The token streams of `data_cfg.source` (a `DataConfig`) for training, memory-mapped.

    A prepared directory (`k3 data prepare`) is opened as it is. Any other source is prepared into
    the cache first (`shards/<key>/`, reused while the source and tokenizer settings are the same),
    its tokenizer trained on a bounded sample and cached as `tokenizers/<key>.json`. With
    `tokenizer` (e.g. a run's saved one, for resume and eval) no tokenizer is trained, and the
    streams must have been tokenized by that one."""
    from k3cli import shards  # shards builds on this module's readers and tokenizer

    say = progress or (lambda msg: None)
    source = data_cfg.source
    if shards.is_prepared(source) or shards.looks_like_partial(Path(source).expanduser()):
        prepared = shards.open_prepared(source)
        say(f"prepared data {prepared.path} (tokenizer {prepared.manifest['tokenizer']['sha256'][:12]})")
        if tokenizer is not None and shards.tokenizer_sha256(tokenizer) != prepared.manifest["tokenizer"]["sha256"]:
            raise DataError(f"{prepared.path} was tokenized by another tokenizer than this run's tokenizer.json "
                            "(SHA-256 differs); prepare the data again with --tokenizer RUN/tokenizer.json, "
                            "or train into a new --out")
        tok_vocab = prepared.manifest["tokenizer"]["vocab_size"]
        if tok_vocab > vocab_size:
            raise DataError(f"{prepared.path} has a tokenizer of {tok_vocab} tokens, more than model.vocab_size "
                            f"({vocab_size}); set model.vocab_size={tok_vocab} or prepare with --vocab-size {vocab_size}")
        return _prepared(prepared, seq_len, prepared.manifest["source"]["fingerprint"], True, True,
                         tokenizer or prepared.tokenizer)

    say(f"reading {source}")
    scan = shards.scan_source(source, data_cfg.text_field, data_cfg.max_bytes, data_cfg.val_fraction,
                              want_sample=tokenizer is None)
    key = shards.tokenizer_key(scan, vocab_size, data_cfg.min_frequency)
    say(f"{scan.documents} documents ({scan.nbytes / 2**20:.1f} MiB); fingerprint {key}")
    root = cache_root(cache_dir)
    tok_path = root / "tokenizers" / f"{key}.json"
    tokenizer_cached = tok_path.is_file()
    if tokenizer is not None:
        try:
            same = tokenizer_cached and load_tokenizer(tok_path).to_str() == tokenizer.to_str()
        except DataError:  # a damaged cache entry: key the streams by the given tokenizer instead
            same = False
        tok, tokenizer_cached = tokenizer, True
        if not same:  # token streams of another tokenizer must not share the cache entry
            key = f"{key}-{shards.tokenizer_sha256(tok)[:12]}"
    elif tokenizer_cached:
        try:
            tok = load_tokenizer(tok_path)
            say(f"tokenizer from cache {tok_path}")
        except DataError as e:  # a damaged cache entry is rebuilt, not trusted
            say(f"{e}; training it again")
            tokenizer_cached = False
    if not tokenizer_cached:
        sample_mib = sum(d.nbytes for d in scan.sample) / 2**20
        say(f"training byte-level BPE (vocab {vocab_size}) on {len(scan.sample)} train documents ({sample_mib:.1f} MiB)")
        tok = train_tokenizer(scan.sample, vocab_size, data_cfg.min_frequency)
        write_text_atomic(tok_path, tok.to_str())
    res = shards.prepare_shards(source, root / "shards" / key, tok, val_fraction=data_cfg.val_fraction,
                                text_field=data_cfg.text_field, max_bytes=data_cfg.max_bytes,
                                min_frequency=data_cfg.min_frequency, say=say, scan=scan,
                                wait=True)   # runs started together (`k3 study --parallel`) share the entry
    if not res.reused:
        say(f"tokenized into {res.path} in {res.seconds:.1f} s")
    return _prepared(shards.open_prepared(res.path), seq_len, key, tokenizer_cached, res.reused, tok)


def _prepared(p, seq_len: int, fingerprint: str, tokenizer_cached: bool, tokens_cached: bool,
              tok: Tokenizer) -> PreparedData:
    train, val = p.split("train"), p.split("val")
    if len(p.streams["train"]) < seq_len:
        raise DataError(f"the train split has {len(p.streams['train'])} tokens, fewer than train.seq_len "
                        f"({seq_len}); use more data or a shorter seq_len")
    return PreparedData(tok, p.streams["train"], p.streams["val"], fingerprint, seq_len, train["documents"],
                        val["documents"], train["text_bytes"], val["text_bytes"],
                        val["text_bytes"] / val["tokens"], tokenizer_cached, tokens_cached, p.path)
