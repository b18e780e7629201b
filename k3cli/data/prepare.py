"""Preparing data: a corpus tokenized once into a prepared folder (`k3 data prepare`, `shards.py`'s format),
and `prepare_data`, the one entry point training and evaluation call.

Preparing reads the source twice, streaming both times: a scan (fingerprint, split, tokenizer
sample) and the encoding pass, in worker processes, whose fingerprint must match the scan's. Shards
are written as temporary files and renamed; the manifest replaces an old one only after every shard
is in place, and an old manifest is deleted before the first shard is touched, so a killed prepare
leaves a folder that `train` refuses and that the next prepare clears and writes again.

`prepare_data` opens a prepared folder as it is; any other source is prepared into the cache first
(`$K3_CACHE_DIR`, default `~/.cache/k3`: `tokenizers/<key>.json`, `shards/<key>/`), its tokenizer
trained on a bounded sample of the train split. Nothing here prints; progress goes to a callback.
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from k3cli.data.loader import PackedLoader, val_batches
from k3cli.data.shards import (
    FORMAT,
    MANIFEST,
    SPLITS,
    VERSION,
    _ours,
    is_prepared,
    looks_like_partial,
    open_prepared,
)
from k3cli.data.sources import Document, _unit_hash, iter_documents
from k3cli.data.tokenizer import (
    EOT_ID,
    TOKENIZER_FULL_MAX_BYTES,
    TOKENIZER_SAMPLE_BYTES,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from k3cli.errors import DataError
from k3cli.files import sha256_file, write_text_atomic

# 32 Mi tokens (64 MiB as uint16): what prepare holds in memory per split before writing a shard
SHARD_TOKENS = 2**25


# text handed to one encode call / worker task: large enough to amortise pickling, small for memory
CHUNK_BYTES = 2**20


SLOW_ENV = "K3_PREPARE_SLOW_S"  # tests: seconds to wait between writing a shard's temp file and renaming it



def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: `cache_dir`, else $K3_CACHE_DIR, else ~/.cache/k3."""
    return Path(cache_dir or os.environ.get("K3_CACHE_DIR") or Path.home() / ".cache" / "k3")



@dataclass
class Scan:
    fingerprint: str  # source: names, sizes and content hashes in order, with the split settings
    documents: int
    nbytes: int
    forced: dict  # name -> True (val) / False (train): the split's at-least-one-each fix-ups
    sample: list[Document] = field(default_factory=list)  # what train_tokenizer would train on


def _is_val(name: str, val_fraction: float, forced: dict) -> bool:
    v = forced.get(name)
    return v if v is not None else _unit_hash(name) < val_fraction


def _source_hasher(source: str, text_field: str, max_bytes: int, val_fraction: float):
    return hashlib.sha256(json.dumps({"format": VERSION, "text_field": text_field, "max_bytes": max_bytes,
                                      "val_fraction": val_fraction}, sort_keys=True).encode())


def _doc_line(d: Document) -> bytes:
    return f"{d.name}\0{d.nbytes}\0{hashlib.sha1(d.text.encode('utf-8')).hexdigest()}\n".encode()


def scan_source(source: str, text_field: str, max_bytes: int, val_fraction: float,
                want_sample: bool, forced: dict | None = None) -> Scan:
    """One streaming pass: the fingerprint, the split's fix-ups (as `split_documents`: at least one
    document each), and, with `want_sample`, the tokenizer's training sample: every train document
    while they total <= TOKENIZER_FULL_MAX_BYTES, else the first TOKENIZER_SAMPLE_BYTES in hash order
    (the same documents `data.train_tokenizer` picks from the whole list; at most ~20 MiB held)."""
    forced = dict(forced or {})
    h = _source_hasher(source, text_field, max_bytes, val_fraction)
    n = total = train_bytes = 0
    lo = hi = None  # (hash, name) of the lowest / highest document
    any_val = any_train = False
    full: list[Document] = []  # train documents in corpus order, while they fit under the full-size cap
    heap: list = []  # max-heap (-hash, i, doc) of the train documents first in hash order
    heap_bytes = 0
    for d in iter_documents(source, text_field, max_bytes):
        h.update(_doc_line(d))
        u = _unit_hash(d.name)
        lo = min(lo, (u, d.name)) if lo else (u, d.name)
        hi = max(hi, (u, d.name)) if hi else (u, d.name)
        n, total = n + 1, total + d.nbytes
        if _is_val(d.name, val_fraction, forced):
            any_val = True
            continue
        any_train = True
        train_bytes += d.nbytes
        if not want_sample:
            continue
        if train_bytes <= TOKENIZER_FULL_MAX_BYTES:
            full.append(d)
        else:
            full = []
        heapq.heappush(heap, (-u, n, d))
        heap_bytes += d.nbytes
        while heap and heap_bytes - heap[0][2].nbytes >= TOKENIZER_SAMPLE_BYTES:
            heap_bytes -= heapq.heappop(heap)[2].nbytes
    if n == 0:
        raise DataError(f"data.source: {source} holds no non-empty documents (empty corpus)")
    if n < 2:
        raise DataError(f"the corpus has {n} document; a train/validation split needs at least 2 "
                        f"(split the text into several files)")
    fix = dict(forced)
    if not any_val:
        fix[lo[1]] = True
    if not any_train:
        fix[hi[1]] = False
    if fix != forced:  # a fix-up moves a document across the split: scan again with it in place
        return scan_source(source, text_field, max_bytes, val_fraction, want_sample, fix)
    h.update(json.dumps(sorted(forced.items())).encode())
    sample = full if train_bytes <= TOKENIZER_FULL_MAX_BYTES else \
        [d for _, _, d in sorted(heap, key=lambda x: -x[0])]
    return Scan(h.hexdigest()[:24], n, total, forced, sample)


def tokenizer_key(scan: Scan, vocab_size: int, min_frequency: int) -> str:
    """The trained tokenizer's identity: the source and the BPE settings."""
    return hashlib.sha256(json.dumps({
        "source": scan.fingerprint, "vocab_size": vocab_size, "min_frequency": min_frequency,
        "sample": [TOKENIZER_FULL_MAX_BYTES, TOKENIZER_SAMPLE_BYTES]}, sort_keys=True).encode()).hexdigest()[:24]


# ---- encoding -------------------------------------------------------------------------------------

_worker_tok: Tokenizer | None = None
_worker_dtype = None
_worker_frame: tuple[int | None, int] = (None, EOT_ID)


def _init_worker(tok_json: str, dtype: str, frame: tuple[int | None, int]) -> None:
    global _worker_tok, _worker_dtype, _worker_frame
    # one process per worker already: the tokenizer's own thread pool would only oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tok, _worker_dtype, _worker_frame = Tokenizer.from_str(tok_json), np.dtype(dtype), frame
    _worker_tok.encode_special_tokens = True   # as `_ready` sets it: a special token inside a text is text


def frame_ids(tok: Tokenizer) -> tuple[int | None, int]:
    """(start, end) ids each document is framed with in the token streams: k3's own tokenizers only end it
    with <|endoftext|> (None, EOT_ID), which then also opens the next one; a tokenizer whose start and end
    tokens differ (an imported model's) gets both, [start] ids [end], so that a document reads as that
    model's prompts do."""
    bos, eos = getattr(tok, "bos_id", EOT_ID), getattr(tok, "eos_id", EOT_ID)
    return (None if bos == eos else bos), eos


def _encode(tok: Tokenizer, dtype, texts: list[str], frame: tuple[int | None, int] = (None, EOT_ID)
            ) -> tuple[np.ndarray, np.ndarray]:
    """(ids of all texts, each framed by `frame` [N]; tokens per text, its frame included [len(texts)])."""
    if not texts:
        return np.empty(0, dtype), np.empty(0, np.int64)
    start, end = frame
    lead = 0 if start is None else 1
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers>=0.20)
    encs = encode(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 + lead for e in encs), np.int64, len(encs))
    out = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    for e, stop, n in zip(encs, ends, lengths):
        out[stop - n + lead:stop - 1] = e.ids
    if lead:
        out[ends - lengths] = start
    out[ends - 1] = end
    return out, lengths


def _encode_task(task: tuple[list[str], list[str]]):
    return tuple(_encode(_worker_tok, _worker_dtype, texts, _worker_frame) for texts in task)


# ---- writing --------------------------------------------------------------------------------------

def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class _ShardWriter:
    """Collects one split's stream and writes a shard once it holds `shard_tokens` tokens (cut at a
    document's end): temp file, fsync, rename."""

    def __init__(self, root: Path, split: str, dtype, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.parts: list[np.ndarray] = []
        self.tokens = self.docs = self.text_bytes = 0
        self.shards: list[dict] = []
        self.total_docs = self.total_tokens = self.total_text_bytes = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray, nbytes: np.ndarray) -> None:
        while len(lengths):
            need = self.shard_tokens - self.tokens
            ends = np.cumsum(lengths)
            k = int(np.searchsorted(ends, need))  # the document that fills the shard (or len: none does)
            take = min(k + 1, len(lengths))
            n_tok = int(ends[take - 1])
            self.parts.append(ids[:n_tok])
            self.tokens += n_tok
            self.docs += take
            self.text_bytes += int(nbytes[:take].sum())
            ids, lengths, nbytes = ids[n_tok:], lengths[take:], nbytes[take:]
            if self.tokens >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.tokens:
            return
        arr = np.concatenate(self.parts) if len(self.parts) > 1 else self.parts[0]
        name = f"{self.split}-{len(self.shards):05d}.npy"
        tmp = self.root / f"{name}.tmp-{os.getpid()}"
        _fsync_write(tmp, lambda f: np.save(f, arr, allow_pickle=False))
        if os.environ.get(SLOW_ENV):
            time.sleep(float(os.environ[SLOW_ENV]))
        os.replace(tmp, self.root / name)
        self.shards.append({"file": name, "documents": self.docs, "tokens": self.tokens,
                            "text_bytes": self.text_bytes, "bytes": (self.root / name).stat().st_size,
                            "sha256": sha256_file(self.root / name)})
        self.total_docs += self.docs
        self.total_tokens += self.tokens
        self.total_text_bytes += self.text_bytes
        self.parts, self.tokens, self.docs, self.text_bytes = [], 0, 0, 0

    def summary(self) -> dict:
        return {"documents": self.total_docs, "tokens": self.total_tokens, "text_bytes": self.total_text_bytes,
                "shards": self.shards}


def _chunks(source: str, text_field: str, max_bytes: int, val_fraction: float, forced: dict, h) -> Iterator:
    """(train texts, val texts, their byte sizes) of about CHUNK_BYTES each, in corpus order; feeds
    the fingerprint hasher `h` on the way."""
    texts: dict = {s: [] for s in SPLITS}
    sizes: dict = {s: [] for s in SPLITS}
    size = 0
    for d in iter_documents(source, text_field, max_bytes):
        h.update(_doc_line(d))
        split = "val" if _is_val(d.name, val_fraction, forced) else "train"
        texts[split].append(d.text)
        sizes[split].append(d.nbytes)
        size += d.nbytes
        if size >= CHUNK_BYTES:
            yield texts, sizes
            texts, sizes, size = {s: [] for s in SPLITS}, {s: [] for s in SPLITS}, 0
    if size:
        yield texts, sizes


def _encoded(chunks: Iterator, tok: Tokenizer, dtype, workers: int) -> Iterator:
    """(sizes, {split: (ids, lengths)}) per chunk, in order; with workers > 1 in a process pool with
    at most 2 tasks per worker in flight (the source is read only as fast as it is encoded)."""
    frame = frame_ids(tok)
    if workers <= 1:
        for texts, sizes in chunks:
            yield sizes, {s: _encode(tok, dtype, texts[s], frame) for s in SPLITS}
        return
    import multiprocessing as mp
    from collections import deque

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker,
                  initargs=(tok.to_str(), np.dtype(dtype).str, frame)) as pool:
        pending: deque = deque()
        for texts, sizes in chunks:
            pending.append((sizes, pool.apply_async(_encode_task, ((texts["train"], texts["val"]),))))
            if len(pending) >= 2 * workers:
                sizes0, res = pending.popleft()
                yield sizes0, dict(zip(SPLITS, res.get()))
        while pending:
            sizes0, res = pending.popleft()
            yield sizes0, dict(zip(SPLITS, res.get()))


def _clear(root: Path) -> None:
    """Remove what an earlier prepare left here (the manifest first, so no reader trusts the rest)."""
    (root / MANIFEST).unlink(missing_ok=True)
    for p in root.iterdir():
        if p.is_file() and _ours(p.name) and p.name != ".lock":
            p.unlink()


def _other(m: dict, scan: Scan, tok_sha: str | None, tok_key: str | None) -> str | None:
    """What manifest `m` holds when it is not this source with this tokenizer (a given one's SHA-256, or a
    trained one's settings), or None."""
    if m["source"]["fingerprint"] != scan.fingerprint:
        return f"a prepare of another source ({m['source'].get('spec', '?')}), or of this one before it changed"
    tok = m["tokenizer"]
    if (tok.get("sha256") != tok_sha) if tok_sha is not None else (tok.get("trained_key") != tok_key):
        return "a prepare of this source with another tokenizer"
    return None


def _other_prepare(root: Path, scan: Scan, tok_sha: str | None, tok_key: str | None) -> str | None:
    """`_other` of the finished prepare in `root`; None without a manifest or with one too damaged to say."""
    try:
        return _other(json.loads((root / MANIFEST).read_text(encoding="utf-8")), scan, tok_sha, tok_key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _reusable(root: Path, scan: Scan, tok_sha: str | None, tok_key: str | None) -> dict | None:
    try:
        m = open_prepared(root).manifest
    except DataError:
        return None
    return m if _other(m, scan, tok_sha, tok_key) is None else None


@dataclass
class PrepareResult:
    path: Path
    manifest: dict
    reused: bool
    seconds: float
    scan_seconds: float


def prepare_shards(source: str, out: str | os.PathLike, tokenizer: Tokenizer | None = None,
                   vocab_size: int = 8192, workers: int = 1, val_fraction: float = 0.02,
                   text_field: str = "text", max_bytes: int = 0, min_frequency: int = 2,
                   shard_tokens: int = SHARD_TOKENS, say: Callable[[str], None] | None = None,
                   on_start: Callable[[int, int], None] | None = None,
                   on_progress: Callable[[int, int, int], None] | None = None,
                   scan: Scan | None = None, wait: bool = False, replace: bool = True) -> PrepareResult:
    """Tokenize `source` into `out` (see the module docstring). With `tokenizer` it is used as is,
    else a byte-level BPE of `vocab_size` is trained on the scan's sample. An `out` that already
    holds this source prepared with this tokenizer (or tokenizer settings) is reused as it is.
    `on_start(documents, bytes)` once the scan is done; `on_progress(documents, tokens, bytes)` as
    chunks are written (cumulative). `scan`: the source's `scan_source` when the caller has it. `wait`: if
    another process holds `out`, wait for it (then reuse its result) instead of refusing. `replace=False`:
    refuse an `out` that holds a finished prepare of another source or tokenizer instead of replacing it."""
    say = say or (lambda msg: None)
    root = Path(out).expanduser()
    if root.exists() and not root.is_dir():
        raise DataError(f"--out {root} is a file, not a folder")
    root.mkdir(parents=True, exist_ok=True)
    foreign = [p.name for p in root.iterdir() if not (_ours(p.name) or p.name == MANIFEST)]
    if foreign:
        raise DataError(f"--out {root} holds files that are not prepared data ({', '.join(sorted(foreign)[:3])}); "
                        "choose an empty or new folder")
    lock = open(root / ".lock", "w")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if not wait:
                raise DataError(f"another `k3 data prepare` is writing {root}; wait for it or choose another "
                                "--out") from None
            say(f"another process is preparing {root}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_locked(source, root, tokenizer, vocab_size, workers, val_fraction, text_field, max_bytes,
                               min_frequency, shard_tokens, say, on_start, on_progress, scan, replace)
    finally:
        lock.close()


def _prepare_locked(source, root, tokenizer, vocab_size, workers, val_fraction, text_field, max_bytes,
                    min_frequency, shard_tokens, say, on_start, on_progress, scan, replace=True) -> PrepareResult:
    t0 = time.perf_counter()
    if shard_tokens < 1:
        raise DataError(f"shard size must be >= 1 token, got {shard_tokens}")
    if scan is None:
        say(f"scanning {source}")
        scan = scan_source(source, text_field, max_bytes, val_fraction, want_sample=tokenizer is None)
        say(f"{scan.documents:,} documents ({scan.nbytes / 2**20:.1f} MiB), fingerprint {scan.fingerprint}")
    scan_s = time.perf_counter() - t0
    tok_key = None if tokenizer is not None else tokenizer_key(scan, vocab_size, min_frequency)
    tok_sha = tokenizer_sha256(tokenizer) if tokenizer is not None else None
    old = _reusable(root, scan, tok_sha, tok_key)
    if old is not None:
        say(f"{root} already holds this source with this tokenizer; reusing it")
        return PrepareResult(root, old, True, time.perf_counter() - t0, scan_s)
    if not replace and (other := _other_prepare(root, scan, tok_sha, tok_key)):
        raise DataError(f"{root} holds {other}; choose another --out, or delete the folder to prepare it again "
                        "(nothing was changed)")
    _clear(root)   # nothing, an interrupted prepare, or this source's prepare damaged since
    if tokenizer is None:
        sample_bytes = sum(d.nbytes for d in scan.sample)
        say(f"training byte-level BPE (vocab {vocab_size}) on {len(scan.sample):,} train documents "
            f"({sample_bytes / 2**20:.1f} MiB)")
        tokenizer = train_tokenizer(scan.sample, vocab_size, min_frequency)
    save_tokenizer(tokenizer, root)   # with its start and end tokens where they are not <|endoftext|>
    frame = frame_ids(tokenizer)
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    writers = {s: _ShardWriter(root, s, dtype, shard_tokens) for s in SPLITS}
    if on_start:
        on_start(scan.documents, scan.nbytes)
    h = _source_hasher(source, text_field, max_bytes, val_fraction)
    docs = tokens = nbytes = 0
    chunks = _chunks(source, text_field, max_bytes, val_fraction, scan.forced, h)
    for sizes, enc in _encoded(chunks, tokenizer, dtype, workers):
        for s in SPLITS:
            ids, lengths = enc[s]
            writers[s].add(ids, lengths, np.asarray(sizes[s], np.int64))
            docs, tokens, nbytes = docs + len(lengths), tokens + len(ids), nbytes + sum(sizes[s])
        if on_progress:
            on_progress(docs, tokens, nbytes)
    for w in writers.values():
        w.flush()
    h.update(json.dumps(sorted(scan.forced.items())).encode())
    if h.hexdigest()[:24] != scan.fingerprint:
        raise DataError(f"data.source {source} changed while it was being prepared; run the prepare again")
    seconds = time.perf_counter() - t0
    manifest = {
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "eot_id": frame[1], "start_id": frame[0],
        "source": {"spec": source, "fingerprint": scan.fingerprint, "documents": scan.documents,
                   "bytes": scan.nbytes, "text_field": text_field, "max_bytes": max_bytes,
                   "val_fraction": val_fraction},
        "tokenizer": {"file": "tokenizer.json", "sha256": tokenizer_sha256(tokenizer), "vocab_size": vocab,
                      "trained_key": tok_key, "min_frequency": min_frequency if tok_key else None},
        "shard_tokens": shard_tokens,
        "splits": {s: writers[s].summary() for s in SPLITS},
        "prepared": {"workers": workers, "seconds": round(seconds, 3),
                     "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }
    for s in SPLITS:
        if not manifest["splits"][s]["tokens"]:
            raise DataError(f"the {s} split of {source} is empty")
    tmp = root / f"{MANIFEST}.tmp-{os.getpid()}"
    _fsync_write(tmp, lambda f: f.write((json.dumps(manifest, indent=1) + "\n").encode()))
    os.replace(tmp, root / MANIFEST)  # last: from here on the folder is complete
    return PrepareResult(root, manifest, False, seconds, scan_s)


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
    start_id: int = EOT_ID    # the token each document starts at (`document_starts`)

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
    say = progress or (lambda msg: None)
    source = data_cfg.source
    if is_prepared(source) or looks_like_partial(Path(source).expanduser()):
        prepared = open_prepared(source)
        say(f"prepared data {prepared.path} (tokenizer {prepared.manifest['tokenizer']['sha256'][:12]})")
        if tokenizer is not None and tokenizer_sha256(tokenizer) != prepared.manifest["tokenizer"]["sha256"]:
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
    scan = scan_source(source, data_cfg.text_field, data_cfg.max_bytes, data_cfg.val_fraction,
                              want_sample=tokenizer is None)
    key = tokenizer_key(scan, vocab_size, data_cfg.min_frequency)
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
            key = f"{key}-{tokenizer_sha256(tok)[:12]}"
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
    res = prepare_shards(source, root / "shards" / key, tok, val_fraction=data_cfg.val_fraction,
                                text_field=data_cfg.text_field, max_bytes=data_cfg.max_bytes,
                                min_frequency=data_cfg.min_frequency, say=say, scan=scan,
                                wait=True)   # runs started together (`k3 study --parallel`) share the entry
    if not res.reused:
        say(f"tokenized into {res.path} in {res.seconds:.1f} s")
    return _prepared(open_prepared(res.path), seq_len, key, tokenizer_cached, res.reused, tok)


def _prepared(p, seq_len: int, fingerprint: str, tokenizer_cached: bool, tokens_cached: bool,
              tok: Tokenizer) -> PreparedData:
    train, val = p.split("train"), p.split("val")
    if len(p.streams["train"]) < seq_len:
        raise DataError(f"the train split has {len(p.streams['train'])} tokens, fewer than train.seq_len "
                        f"({seq_len}); use more data or a shorter seq_len")
    start = p.manifest.get("start_id")
    return PreparedData(tok, p.streams["train"], p.streams["val"], fingerprint, seq_len, train["documents"],
                        val["documents"], train["text_bytes"], val["text_bytes"],
                        val["text_bytes"] / val["tokens"], tokenizer_cached, tokens_cached, p.path,
                        p.manifest["eot_id"] if start is None else start)

