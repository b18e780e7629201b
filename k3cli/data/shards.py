"""The prepared-data folder: the format `k3 data prepare` writes, and its reader (memory-mapped).

A prepared folder holds

    tokenizer.json
    train-00000.npy, train-00001.npy, ...   packed token ids (uint16 while the vocabulary fits, else uint32)
    val-00000.npy, ...
    manifest.json                          written last: without it nothing in the folder is read

Each split's stream is what `loader.pack_documents` gives for that split's documents (every document's
ids followed by `<|endoftext|>`), cut into shards at document ends. `prepare.py` writes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from k3cli.data.tokenizer import load_tokenizer, tokenizer_sha256
from k3cli.errors import DataError
from k3cli.files import sha256_file

MANIFEST = "manifest.json"


FORMAT = "k3-token-shards"


VERSION = 1


SPLITS = ("train", "val")



def is_prepared(path: str | os.PathLike) -> bool:
    return (Path(path).expanduser() / MANIFEST).is_file()


def looks_like_partial(path: Path) -> bool:
    """A folder a prepare started in but did not finish: its files, no manifest."""
    if not path.is_dir() or (path / MANIFEST).exists():
        return False
    return any(_ours(p.name) for p in path.iterdir())


def _ours(name: str) -> bool:
    return (name in ("tokenizer.json", "tokenizer_config.json") or name == ".lock" or ".tmp-" in name
            or (name.endswith(".npy") and name.split("-")[0] in SPLITS))


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

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows [s, s + length) for each s in `starts` -> [n, length]: one gather per shard (a memory map reads
        only those pages); the few rows that cross a shard's end are sliced."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), self.dtype)
        first = np.searchsorted(self.offsets, starts, side="right") - 1
        last = np.searchsorted(self.offsets, starts + max(length - 1, 0), side="right") - 1
        inside, cols = first == last, np.arange(length)
        for s in np.unique(first[inside]):
            rows = np.flatnonzero(inside & (first == s))
            out[rows] = self.arrays[s][(starts[rows] - self.offsets[s])[:, None] + cols]
        for r in np.flatnonzero(~inside):
            out[r] = self[int(starts[r]):int(starts[r]) + length]
        return out

    def __array__(self, dtype=None, copy=None):
        out = self[0:len(self)]
        return out if dtype is None else out.astype(dtype)


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
            if verify and sha256_file(f) != s["sha256"]:
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

