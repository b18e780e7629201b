"""Token shards on disk: tokenize a corpus once (`k3 data prepare`), then memory-map it to train.

A prepared directory holds

    tokenizer.json
    train-00000.npy, train-00001.npy, ...   packed token ids (uint16 while the vocabulary fits, else uint32)
    val-00000.npy, ...
    manifest.json                          written last: without it nothing in the folder is read

Each split's stream is what `data.pack_documents` gives for that split's documents (every document's
ids followed by `<|endoftext|>`), cut into shards at document ends once a shard holds `shard_tokens`
tokens. Documents go to train / val by the same stable name hash as `data.split_documents`.

Preparing reads the source twice, streaming both times: a scan (fingerprint, split, tokenizer
sample) and the encoding pass, in worker processes, whose fingerprint must match the scan's. Shards
are written as temporary files and renamed; the manifest replaces an old one only after every shard
is in place, and an old manifest is deleted before the first shard is touched, so a killed prepare
leaves a folder that `train` refuses and that the next prepare clears and writes again.
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
from tokenizers import Tokenizer

from k3cli.checkpoint import _sha256
from k3cli.data import (
    EOT_ID,
    TOKENIZER_FULL_MAX_BYTES,
    TOKENIZER_SAMPLE_BYTES,
    DataError,
    Document,
    _unit_hash,
    iter_documents,
    load_tokenizer,
    train_tokenizer,
    write_text_atomic,
)

MANIFEST = "manifest.json"
FORMAT = "k3-token-shards"
VERSION = 1
SPLITS = ("train", "val")
# 32 Mi tokens (64 MiB as uint16): what prepare holds in memory per split before writing a shard
SHARD_TOKENS = 2**25
# text handed to one encode call / worker task: large enough to amortise pickling, small for memory
CHUNK_BYTES = 2**20
SLOW_ENV = "K3_PREPARE_SLOW_S"  # tests: seconds to wait between writing a shard's temp file and renaming it


def tokenizer_sha256(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def looks_like_partial(path: Path) -> bool:
    """A folder a prepare started in but did not finish: its files, no manifest."""
    if not path.is_dir() or (path / MANIFEST).exists():
        return False
    return any(_ours(p.name) for p in path.iterdir())


def _ours(name: str) -> bool:
    return (name == "tokenizer.json" or name == ".lock" or ".tmp-" in name
            or (name.endswith(".npy") and name.split("-")[0] in SPLITS))


# ---- the token stream of a split -----------------------------------------------------------------

class TokenStream:
    """The concatenation of a split's shards, memory-mapped: `len`, slices `[a:b]` (a copy, possibly
    across shards) and `np.asarray` (the whole stream; for the small val split)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays])  # [S + 1]
        self.dtype = arrays[0].dtype if arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, key):
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream supports contiguous slices only")
        start, stop, _ = key.indices(len(self))
        if stop <= start:
            return np.empty(0, self.dtype)
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        for s in range(first, len(self.arrays)):
            lo = int(self.offsets[s])
            if lo >= stop:
                break
            parts.append(self.arrays[s][max(start - lo, 0):stop - lo])
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def __array__(self, dtype=None, copy=None):
        out = self[0:len(self)]
        return out if dtype is None else out.astype(dtype)


# ---- the manifest ---------------------------------------------------------------------------------

@dataclass
class Prepared:
    """An opened prepared directory."""
    path: Path
    manifest: dict
    tokenizer: Tokenizer
    streams: dict  # split -> TokenStream

    def split(self, name: str) -> dict:
        return self.manifest["splits"][name]


def _bad(path: Path, why: str) -> DataError:
    return DataError(f"{path}: {why}; prepare it again with `k3 data prepare`")


def read_manifest(path: str | os.PathLike) -> dict:
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"{root} does not exist")
    if not root.is_dir():
        raise DataError(f"{root} is not a prepared data directory (not a folder)")
    if looks_like_partial(root):
        raise DataError(f"{root} has no {MANIFEST}: a prepare there did not finish; "
                        "run `k3 data prepare` again (it starts clean)")
    try:
        m = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{root} is not a prepared data directory (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(root / MANIFEST, f"unreadable ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise _bad(root / MANIFEST, f"not a {FORMAT} manifest")
    if m.get("version") != VERSION:
        raise _bad(root / MANIFEST, f"format version {m.get('version')}, this k3 reads {VERSION}")
    if (problem := _manifest_problem(m)) is not None:
        raise _bad(root / MANIFEST, f"malformed ({problem})")
    return m


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# every manifest field a reader uses, with its kind (a type, or a check: counts are non-negative ints)
_FIELDS = {"": {"dtype": str, "eot_id": _count},
           "source.": {"spec": str, "fingerprint": str, "documents": _count, "bytes": _count, "val_fraction": _number},
           "tokenizer.": {"sha256": str, "vocab_size": _count}}
_SPLIT_FIELDS = {"documents": _count, "tokens": _count, "text_bytes": _count, "shards": list}
_SHARD_FIELDS = {"file": str, "documents": _count, "tokens": _count, "text_bytes": _count, "bytes": _count,
                 "sha256": str}


def _fields_problem(node, fields: dict, where: str) -> str | None:
    for name, kind in fields.items():
        ok = isinstance(node, dict) and name in node and (
            isinstance(node[name], kind) if isinstance(kind, type) else kind(node[name]))
        if not ok:
            return f"{where}{name} is missing or not a {kind.__name__.lstrip('_')}"
    return None


def _manifest_problem(m: dict) -> str | None:
    """What in a manifest is missing or of the wrong kind, or None."""
    sections = [(m if not where else m.get(where[:-1]), fields, where) for where, fields in _FIELDS.items()]
    splits = m.get("splits") if isinstance(m.get("splits"), dict) else {}
    sections += [(splits.get(split), _SPLIT_FIELDS, f"splits.{split}.") for split in SPLITS]
    for node, fields, where in sections:
        if problem := _fields_problem(node, fields, where):
            return problem
    for split in SPLITS:
        for i, shard in enumerate(splits[split]["shards"]):
            if problem := _fields_problem(shard, _SHARD_FIELDS, f"splits.{split}.shards[{i}]."):
                return problem
    try:
        np.dtype(m["dtype"])
    except TypeError:
        return f"dtype {m['dtype']!r} is not a numpy dtype"
    prepared = m.get("prepared", {})
    if not isinstance(prepared, dict) or not _number(prepared.get("seconds", 0)):
        return "prepared.seconds is not a number"
    return None


def open_prepared(path: str | os.PathLike, verify: bool = False) -> Prepared:
    """Memory-map the shards of a prepared directory after checking them against the manifest:
    each file's size (a truncated or replaced shard is refused), dtype and length, and with
    `verify` its SHA-256; the tokenizer must be the one the manifest names."""
    root = Path(path).expanduser()
    m = read_manifest(root)
    tok = load_tokenizer(root / "tokenizer.json")
    if tokenizer_sha256(tok) != m["tokenizer"]["sha256"]:
        raise _bad(root, "tokenizer.json is not the tokenizer its manifest names (SHA-256 differs)")
    dtype = np.dtype(m["dtype"])
    streams = {}
    for split in SPLITS:
        arrays = []
        for s in m["splits"][split]["shards"]:
            f = root / s["file"]
            if Path(s["file"]).name != s["file"]:
                raise _bad(root / MANIFEST, f"shard name {s['file']!r} is not a plain file name")
            try:
                size = f.stat().st_size
            except OSError:
                raise _bad(root, f"shard {s['file']} is missing") from None
            if size != s["bytes"]:
                raise _bad(root, f"shard {s['file']} has {size:,} bytes, the manifest says {s['bytes']:,} "
                                 "(truncated or replaced)")
            if verify and _sha256(f) != s["sha256"]:
                raise _bad(root, f"shard {s['file']} does not match its SHA-256 in the manifest")
            try:
                # allow_pickle=False: a planted object array is refused (unpickling could run code)
                arr = np.load(f, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:
                raise _bad(root, f"shard {s['file']} is unreadable ({str(e).strip()[:100]})") from None
            if arr.dtype != dtype or arr.shape != (s["tokens"],):
                raise _bad(root, f"shard {s['file']} holds {arr.dtype} {arr.shape}, the manifest says "
                                 f"{dtype} ({s['tokens']},)")
            arrays.append(arr)
        streams[split] = TokenStream(arrays)
    for split in SPLITS:
        if len(streams[split]) == 0:
            raise _bad(root, f"the {split} split is empty")
    return Prepared(root, m, tok, streams)


def disk_bytes(m: dict) -> int:
    return sum(s["bytes"] for split in SPLITS for s in m["splits"][split]["shards"])


# ---- scanning the source --------------------------------------------------------------------------

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


def _init_worker(tok_json: str, dtype: str) -> None:
    global _worker_tok, _worker_dtype
    # one process per worker already: the tokenizer's own thread pool would only oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from k3cli.data import _ready

    _worker_tok, _worker_dtype = _ready(Tokenizer.from_str(tok_json)), np.dtype(dtype)


def _encode(tok: Tokenizer, dtype, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids of all texts, each followed by EOT_ID [N]; tokens per text, EOT included [len(texts)])."""
    if not texts:
        return np.empty(0, dtype), np.empty(0, np.int64)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets (tokenizers>=0.20)
    encs = encode(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e.ids) + 1 for e in encs), np.int64, len(encs))
    out = np.empty(int(lengths.sum()), dtype)
    ends = np.cumsum(lengths)
    for e, end, n in zip(encs, ends, lengths):
        out[end - n:end - 1] = e.ids
    out[ends - 1] = EOT_ID
    return out, lengths


def _encode_task(task: tuple[list[str], list[str]]):
    return tuple(_encode(_worker_tok, _worker_dtype, texts) for texts in task)


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
                            "sha256": _sha256(self.root / name)})
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
    if workers <= 1:
        for texts, sizes in chunks:
            yield sizes, {s: _encode(tok, dtype, texts[s]) for s in SPLITS}
        return
    import multiprocessing as mp
    from collections import deque

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok.to_str(), np.dtype(dtype).str)) as pool:
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
    tok_str = tokenizer.to_str()
    write_text_atomic(root / "tokenizer.json", tok_str)
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
        "format": FORMAT, "version": VERSION, "dtype": dtype.name, "eot_id": EOT_ID,
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
