"""Corpora → documents: `stdlib`, a .txt/.jsonl/.parquet file or a folder of them, or `hf:NAME`, read in a
deterministic order up to a byte budget, and split into train / validation by a stable hash of each
document's name (not its position, so adding files does not reshuffle the split)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from k3cli.errors import DataError, first_line

SUFFIXES = (".txt", ".jsonl", ".parquet")


TXT_PIECE_BYTES = 8192  # a lone .txt corpus is cut at blank lines into pieces of about this size


HUB_PROBE_TIMEOUT_S = 5.0



@dataclass(frozen=True)
class Document:
    name: str  # stable identity, e.g. 'stdlib/json/decoder.py' or 'shard0.jsonl#17'
    text: str
    nbytes: int  # UTF-8 size of text


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

