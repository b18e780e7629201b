"""Data edge cases through `k3 train`: empty files, bytes that are not UTF-8, one enormous line, a
corpus smaller than one batch, a folder with no readable file. Each is a correct run or one
`error:` line with exit 2, never a traceback or a hang."""

import json
import math
import os
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.data import Document, train_tokenizer
from k3cli.data.tokenizer import TOKENIZER_MAX_RUN, _bounded_runs
from k3cli.testing import TINY_MODEL, TINY_TRAIN, WORDS, write_corpus

runner = CliRunner()
RANDOM_BYTES = bytes(random.Random(0).randrange(256) for _ in range(4000))   # NULs, lone continuation bytes, ...


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def folder(tmp: Path, files: dict[str, bytes | str], with_corpus: bool = False) -> Path:
    d = write_corpus(tmp) if with_corpus else tmp / "corpus"
    d.mkdir(exist_ok=True)
    for name, content in files.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return d


def train(tmp: Path, source: Path):
    args = ["train", "--preset", "k3-toy", "--data", str(source), "--out", str(tmp / "run")]
    for s in [*TINY_MODEL, *TINY_TRAIN]:
        args += ["--set", s]
    return runner.invoke(app, args)


def assert_one_error(r, *needles: str) -> None:
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def assert_trained(r, tmp: Path, docs: int) -> None:
    assert r.exit_code == 0, (r.output, r.exception)
    assert "done: step 6" in r.output
    assert f"{docs} documents" in r.output, r.output
    steps = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert all(math.isfinite(s["loss"]) for s in steps)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))


# ---- empty files --------------------------------------------------------------------------------

def test_a_folder_of_empty_files_is_an_empty_corpus(tmp_path):
    src = folder(tmp_path, {"a.txt": "", "b.txt": " \n\n\t", "c.jsonl": "", "d.jsonl": "\n\n", "e.parquet": ""})
    assert_one_error(train(tmp_path, src), "holds no non-empty documents")


def test_empty_files_among_documents_are_skipped(tmp_path):
    """Before: an empty .jsonl stopped the run with "cannot read e.jsonl: StopIteration"."""
    src = folder(tmp_path, {"a.txt": "", "b.txt": "\n \n", "e.jsonl": "", "f.jsonl": "\n\n", "g.parquet": ""},
                 with_corpus=True)
    assert_trained(train(tmp_path, src), tmp_path, docs=40)


# ---- bytes that are not UTF-8 -------------------------------------------------------------------

def test_invalid_utf8_in_txt_is_replaced(tmp_path):
    src = folder(tmp_path, {"bytes.txt": RANDOM_BYTES, "latin1.txt": "caf\u00e9 na\u00efve ".encode("latin-1") * 50},
                 with_corpus=True)
    assert_trained(train(tmp_path, src), tmp_path, docs=42)


def test_invalid_utf8_in_a_single_txt_file_is_replaced(tmp_path):
    src = tmp_path / "book.txt"
    src.write_bytes(b"\n\n".join(words(300, i).encode() + RANDOM_BYTES[:200] for i in range(40)))
    r = train(tmp_path, src)
    assert r.exit_code == 0, (r.output, r.exception)
    assert "done: step 6" in r.output


def test_invalid_utf8_in_jsonl_is_one_error_naming_the_file(tmp_path):
    src = folder(tmp_path, {"rows.jsonl": b'{"text": "caf\xe9"}\n'}, with_corpus=True)
    assert_one_error(train(tmp_path, src), "cannot read rows.jsonl", "line 1: not UTF-8")


@pytest.mark.parametrize("content,where", [
    (b'{"text": "a b"}\n{"text": "c"}\n{"text": 3}\n', "line 3: 'text' is int"),
    (b'{"text": "a"}\n{"text": "b", "x": 1}\n{"text": "c", "x": 2}\n{"text": "d"\n', "line 4: not valid JSON"),
    (b'{"text": "a"}\n[1, 2]\n', "line 2: a JSON list"),
    (b'{"text": "a"}\n\n{"text": 3}\n', "line 3: 'text' is int"),   # blank lines count as lines
    (b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n', "line 3: not UTF-8"),
])
def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path, content, where):
    """Lines counted from 1, as an editor shows them (the reader's own messages count rows from 0)."""
    pytest.importorskip("datasets")
    (tmp_path / "rows.jsonl").write_bytes(content)
    r = runner.invoke(app, ["data", "prepare", "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out")])
    assert_one_error(r, "rows.jsonl", where)


# ---- one enormous line --------------------------------------------------------------------------

def test_one_enormous_line_as_the_whole_corpus_is_one_document(tmp_path):
    src = tmp_path / "line.txt"
    src.write_text(words(400_000))   # 2.7 MB, no newline: nothing to cut at
    assert_one_error(train(tmp_path, src), "the corpus has 1 document")


def test_one_enormous_word_among_documents_trains(tmp_path):
    """A 1 MB run of one letter: BPE training merges within a word in quadratic time (200 KB took
    14 s, 20 MB never finished) until long runs reached the trainer in pieces."""
    src = folder(tmp_path, {"blob.txt": "a" * 2**20}, with_corpus=True)
    assert_trained(train(tmp_path, src), tmp_path, docs=41)


def test_long_runs_reach_the_tokenizer_trainer_in_pieces():
    text = "ab " + "x" * (2 * TOKENIZER_MAX_RUN + 5) + " cd " + "y" * TOKENIZER_MAX_RUN
    pieces = list(_bounded_runs([text, "plain text"]))
    assert "".join(pieces) == text + "plain text"
    assert max(map(len, pieces)) == TOKENIZER_MAX_RUN + 4 and pieces[-1] == "plain text"
    assert list(_bounded_runs(["no long run here " * 500])) == ["no long run here " * 500]
    tok = train_tokenizer([Document("a", "z" * 50_000, 50_000), Document("b", words(200), 0)], 300)
    assert tok.decode(tok.encode("z" * 50_000 + " the").ids) == "z" * 50_000 + " the"


@pytest.mark.slow
def test_a_20_mb_line_without_spaces_among_documents_trains(tmp_path):
    src = folder(tmp_path, {"blob.txt": "a" * 20_000_000}, with_corpus=True)
    assert_trained(train(tmp_path, src), tmp_path, docs=41)


# ---- a corpus smaller than one batch ------------------------------------------------------------

def test_a_corpus_smaller_than_one_batch_trains(tmp_path):
    """4 rows of 32 tokens per step; the train split has fewer, so every batch wraps into the next epoch."""
    src = folder(tmp_path, {f"d{i}.txt": words(12, i) for i in range(4)})
    r = train(tmp_path, src)
    assert_trained(r, tmp_path, docs=4)
    train_tokens = int(re.search(r"data: \d+ train / \d+ val documents, ([\d,]+) / ", r.output)[1].replace(",", ""))
    assert 32 <= train_tokens < 4 * 32, r.output


def test_a_train_split_shorter_than_one_sequence_is_one_error(tmp_path):
    src = folder(tmp_path, {"a.txt": "hello world", "b.txt": "hi there"})
    assert_one_error(train(tmp_path, src), "fewer than train.seq_len")


# ---- a folder with no readable file -------------------------------------------------------------

def test_a_folder_without_data_files_is_one_error(tmp_path):
    src = folder(tmp_path, {"data.bin": b"\x00\x01", "notes.csv": "a,b"})
    (src / "sub.txt").mkdir()   # a folder named like a document
    assert_one_error(train(tmp_path, src), "no .txt/.jsonl/.parquet files")


@pytest.mark.parametrize("kind", ["broken-link", "pipe"])
def test_a_data_file_that_is_no_regular_file_is_one_error(tmp_path, kind):
    """Before: a broken link was a bare FileNotFoundError, and a pipe named *.txt blocked forever."""
    src = folder(tmp_path, {}, with_corpus=True)
    bad = src / ("zz.txt" if kind == "pipe" else "zz.jsonl")
    os.mkfifo(bad) if kind == "pipe" else bad.symlink_to(tmp_path / "gone.jsonl")
    assert_one_error(train(tmp_path, src), str(bad), "not a regular file")


def test_an_unreadable_file_is_one_error_naming_it(tmp_path, monkeypatch):
    src = folder(tmp_path, {"locked.txt": "secret"}, with_corpus=True)
    if os.geteuid() != 0:
        (src / "locked.txt").chmod(0)
    else:   # root reads any file whatever its mode
        read_bytes = Path.read_bytes

        def refuse(self):
            if self.name == "locked.txt":
                raise PermissionError(13, "Permission denied", str(self))
            return read_bytes(self)
        monkeypatch.setattr(Path, "read_bytes", refuse)
    assert_one_error(train(tmp_path, src), "cannot read", "locked.txt: Permission denied")
