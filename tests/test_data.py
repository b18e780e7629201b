"""Data pipeline: sources and their errors, hash split, BPE round trip and cache, packing, the
checkpointable loader and fixed validation batches. Small corpora written to tmp_path, except one
test on the real standard-library source (capped)."""
import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch

from k3cli.config import DataConfig
from k3cli.data import (
    EOT,
    EOT_ID,
    DataError,
    Document,
    PackedLoader,
    load_documents,
    load_tokenizer,
    pack_documents,
    prepare_data,
    save_tokenizer,
    split_documents,
    train_tokenizer,
    val_batches,
)
from k3cli.data.tokenizer import corpus_fingerprint

needs_datasets = pytest.mark.skipif(importlib.util.find_spec("datasets") is None,
                                    reason="`datasets` is not installed")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def doc(name: str, text: str) -> Document:
    return Document(name, text, len(text.encode()))


def corpus(n: int = 40, seed: int = 0) -> list[Document]:
    rng = np.random.default_rng(seed)
    return [doc(f"d{i:03d}.txt", " ".join(rng.choice(WORDS, 30 + i)) + f"\n# {i} ü → 日本\n")
            for i in range(n)]


def write_txt(folder, n: int = 12) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for d in corpus(n):
        (folder / d.name).write_text(d.text, encoding="utf-8")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus(60), vocab_size=320, min_frequency=2)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))


# ---- split ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,frac", [(2, 0.02), (3, 0.99), (40, 0.1), (500, 0.02)],
                         ids=["two-docs", "frac-0.99", "40-docs", "500-docs"])
def test_split_deterministic_disjoint_nonempty(n, frac):
    docs = corpus(n)
    train, val = split_documents(docs, frac)
    again = split_documents(list(reversed(docs)), frac)  # membership depends on names, not order
    assert {d.name for d in train} == {d.name for d in again[0]}
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert len(train) + len(val) == n and train and val


def test_split_is_stable_when_documents_are_added():
    _, val = split_documents(corpus(100), 0.2)
    _, val_more = split_documents(corpus(200), 0.2)
    assert {d.name for d in val} <= {d.name for d in val_more}


def test_split_needs_two_documents():
    with pytest.raises(DataError, match="at least 2"):
        split_documents(corpus(1), 0.1)


def test_fingerprint_tracks_content_and_settings():
    train, val = split_documents(corpus(10), 0.2)
    fp = corpus_fingerprint(train, val, 320, 2)
    assert fp == corpus_fingerprint(train, val, 320, 2)
    assert fp != corpus_fingerprint(train, val, 384, 2)
    assert fp != corpus_fingerprint(train, val, 320, 3)
    edited = [doc(train[0].name, train[0].text + "x")] + train[1:]
    assert fp != corpus_fingerprint(edited, val, 320, 2)


# ---- tokenizer ------------------------------------------------------------------------------------

ROUND_TRIP = ["hello world", " leading space", "trailing  \n\n", "\t\ttabs\r\nCRLF", "", " ", "\n",
              "ünïcödé → 日本語 🎉 \u200b zero-width", "def f(x):\n    return x  # comment\n",
              f"literal {EOT} stays text", "\x00\x01 control"]


@pytest.mark.parametrize("text", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text).ids
    assert EOT_ID not in ids
    assert tok.decode(ids) == text


def test_tokenizer_vocab_and_eot(tok):
    assert tok.token_to_id(EOT) == EOT_ID and tok.get_vocab_size() <= 320


def test_tokenizer_training_is_deterministic(tok):
    assert train_tokenizer(corpus(60), vocab_size=320, min_frequency=2).to_str() == tok.to_str()


def test_tokenizer_vocab_too_small():
    with pytest.raises(DataError, match="needs >= 257"):
        train_tokenizer(corpus(4), vocab_size=100)


def test_tokenizer_save_load(tok, tmp_path):
    path = save_tokenizer(tok, tmp_path / "run")
    assert path.name == "tokenizer.json"
    back = load_tokenizer(tmp_path / "run")
    text = ROUND_TRIP[7] + ROUND_TRIP[9]
    assert back.encode(text).ids == tok.encode(text).ids and back.decode(back.encode(text).ids) == text


# ---- packing and loaders --------------------------------------------------------------------------

def test_pack_puts_eot_after_every_document(tok):
    docs = corpus(5)
    stream = pack_documents(tok, docs)
    assert stream.dtype == np.uint16 and stream.ndim == 1
    ends = np.flatnonzero(stream == EOT_ID)
    assert len(ends) == len(docs) and ends[-1] == len(stream) - 1
    pieces = np.split(stream, ends + 1)[:-1]
    assert [tok.decode(p[:-1].tolist()) for p in pieces] == [d.text for d in docs]


def test_loader_shapes_and_epoch_coverage():
    tokens = np.arange(100, dtype=np.uint16)  # 12 windows of 8 (4 tokens dropped)
    loader = PackedLoader(tokens, seq_len=8, batch_size=4, seed=3)
    batches = [next(loader) for _ in range(3)]
    assert all(b.shape == (4, 8) and b.dtype == torch.int64 for b in batches)
    starts = sorted(torch.cat(batches)[:, 0].tolist())
    assert starts == list(range(0, 96, 8))  # one epoch = every window once
    assert torch.equal(batches[0][:, 1:] - batches[0][:, :-1], torch.ones(4, 7, dtype=torch.int64))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0


@pytest.mark.parametrize("n_tokens,batch_size,skip", [(1000, 4, 0), (1000, 5, 3), (1000, 7, 5), (125, 16, 2)],
                         ids=["B4-start", "B5-mid", "B7-epoch-straddle", "B16-more-than-12-windows"])
def test_loader_resume_gives_identical_batches(n_tokens, batch_size, skip):
    tokens = np.arange(n_tokens, dtype=np.uint16)
    ref = PackedLoader(tokens, 10, batch_size, seed=7)
    for _ in range(skip):
        next(ref)
    state = ref.state_dict()
    expected = [next(ref) for _ in range(25)]
    resumed = PackedLoader(tokens, 10, batch_size, seed=7)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a plain-JSON round trip
    assert all(torch.equal(a, next(resumed)) for a in expected)


def test_loader_seed_changes_order_and_mismatch_is_refused():
    tokens = np.arange(1000, dtype=np.uint16)
    assert not torch.equal(next(PackedLoader(tokens, 10, 4, 0)), next(PackedLoader(tokens, 10, 4, 1)))
    with pytest.raises(DataError, match="seq_len=10"):
        PackedLoader(tokens, 20, 4, 0).load_state_dict(PackedLoader(tokens, 10, 4, 0).state_dict())
    with pytest.raises(DataError, match="fewer than train.seq_len"):
        PackedLoader(tokens[:5], 10, 4, 0)


def test_val_batches_fixed_and_in_order():
    tokens = np.arange(100, dtype=np.uint16)
    batches = val_batches(tokens, seq_len=8, n=2, batch_size=4)
    assert [b.shape for b in batches] == [(4, 8), (4, 8)]
    assert torch.equal(torch.cat(batches).flatten(), torch.arange(64))
    assert [b.shape for b in val_batches(tokens, 8, n=10, batch_size=5)] == [(5, 8), (5, 8), (2, 8)]
    assert [b.shape for b in val_batches(tokens[:6], 8, n=3, batch_size=4)] == [(1, 6)]


# ---- sources and their errors ---------------------------------------------------------------------

@needs_datasets
def test_folder_of_txt_jsonl_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    root = tmp_path / "data"
    write_txt(root / "txt", 3)
    (root / "b.jsonl").write_text(
        "\n".join(json.dumps(r) for r in [{"text": "json one"}, {"text": ""}, {"text": "json ü"}]))
    pq.write_table(pa.table({"text": ["pq one", "pq two"], "body": ["b1", "b2"]}), root / "c.parquet")
    (root / "notes.md").write_text("ignored: not a corpus file type")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("ignored: hidden")
    docs = load_documents(str(root))
    assert [d.name for d in docs] == ["b.jsonl#0", "b.jsonl#2", "c.parquet#0", "c.parquet#1",
                                      "txt/d000.txt", "txt/d001.txt", "txt/d002.txt"]
    assert docs[1].text == "json ü" and docs[1].nbytes == len("json ü".encode())
    assert [d.text for d in load_documents(str(root / "c.parquet"), text_field="body")] == ["b1", "b2"]


def test_max_bytes_caps_the_corpus(tmp_path):
    write_txt(tmp_path / "c", 12)
    docs = load_documents(str(tmp_path / "c"), max_bytes=500)
    assert 500 - 4 < sum(d.nbytes for d in docs) <= 500 and len(docs) < 12
    assert docs == load_documents(str(tmp_path / "c"))[:len(docs) - 1] + docs[-1:]


@pytest.mark.parametrize("kind", ["missing", "suffix", "empty-folder", "empty-docs",
                                  pytest.param("no-field", marks=needs_datasets),
                                  pytest.param("bad-json", marks=needs_datasets),
                                  pytest.param("non-text", marks=needs_datasets)])
def test_source_errors_are_one_clear_line(tmp_path, kind):
    target, match = tmp_path / "nope", "does not exist"
    if kind == "suffix":
        target, match = tmp_path / "data.csv", "unsupported file type '.csv'"
        target.write_text("a,b")
    elif kind == "empty-folder":
        target, match = tmp_path / "empty", "no .txt/.jsonl/.parquet files"
        target.mkdir()
    elif kind == "empty-docs":
        target, match = tmp_path / "blank", "no non-empty documents"
        target.mkdir()
        (target / "a.txt").write_text("")
        (target / "b.txt").write_text("  \n\n")
    elif kind == "no-field":
        target, match = tmp_path / "x.jsonl", "has no column 'text'.*data.text_field"
        target.write_text('{"body": "hi"}\n')
    elif kind == "bad-json":
        target, match = tmp_path / "y.jsonl", "cannot read"
        target.write_text('{"text": "hi"\nnot json at all\n')
    elif kind == "non-text":
        target, match = tmp_path / "z.jsonl", "line 2: 'text' is int"
        target.write_text('{"text": "hi"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=match) as e:
        load_documents(str(target))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", [pytest.param("offline-env", marks=needs_datasets), "unreachable"])
def test_hub_fails_fast(monkeypatch, mode):
    if mode == "unreachable":
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("HF_DATASETS_OFFLINE")
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="hf:no-such/dataset-k3") as e:
        load_documents("hf:no-such/dataset-k3")
    assert time.perf_counter() - t0 < 10 and "\n" not in str(e.value)
    assert mode == "offline-env" or "cannot reach" in str(e.value)


# ---- prepare_data ---------------------------------------------------------------------------------

def test_prepare_data_and_cache_hit(tmp_path):
    write_txt(tmp_path / "c", 30)
    cfg = DataConfig(source=str(tmp_path / "c"), val_fraction=0.2, min_frequency=1)
    messages = []
    first = prepare_data(cfg, vocab_size=300, seq_len=16, progress=messages.append)
    assert not first.tokenizer_cached and messages
    assert first.n_train_docs + first.n_val_docs == 30 and first.n_val_docs >= 1
    assert first.bytes_per_token_val == pytest.approx(first.val_bytes / len(first.val_tokens))
    assert (tmp_path / "cache" / "tokenizers" / f"{first.fingerprint}.json").is_file()
    again = prepare_data(cfg, vocab_size=300, seq_len=16)
    assert again.tokenizer_cached and again.tokens_cached and again.fingerprint == first.fingerprint
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    assert np.array_equal(again.train_tokens, first.train_tokens)
    assert next(again.train_loader(4, seed=0)).shape == (4, 16)
    assert again.val_batches(2, 2)[0].shape[1] <= 16
    other = prepare_data(cfg, vocab_size=320, seq_len=16)
    assert other.fingerprint != first.fingerprint and not other.tokenizer_cached


def test_prepare_data_seq_len_too_long(tmp_path):
    write_txt(tmp_path / "c", 4)
    with pytest.raises(DataError, match="fewer than train.seq_len"):
        prepare_data(DataConfig(source=str(tmp_path / "c"), val_fraction=0.5), 300, seq_len=10**6)


def test_stdlib_source_capped(tmp_path):
    cfg = DataConfig(source="stdlib", max_bytes=1_500_000, val_fraction=0.05)
    data = prepare_data(cfg, vocab_size=512, seq_len=64, cache_dir=tmp_path / "c2")
    assert 1_500_000 - 4 < data.train_bytes + data.val_bytes <= 1_500_000 and data.n_val_docs >= 1
    assert 1.5 < data.bytes_per_token_val < 8  # Python source under a 512-token BPE
    text = "import os\n\nclass Foo:\n    def bar(self):\n        return os.sep  # ü\n"
    assert data.tokenizer.decode(data.tokenizer.encode(text).ids) == text
    assert os.environ["K3_CACHE_DIR"] != str(tmp_path / "c2")  # cache_dir argument beats the env
    assert (tmp_path / "c2" / "tokenizers" / f"{data.fingerprint}.json").is_file()


def test_single_txt_file_is_cut_into_documents_at_blank_lines(tmp_path):
    from k3cli.data.sources import TXT_PIECE_BYTES
    paras = [f"paragraph {i} " + "word " * 300 for i in range(40)]
    f = tmp_path / "book.txt"
    f.write_text("\n\n".join(paras))
    docs = load_documents(str(f))
    assert len(docs) > 2 and all(d.name.startswith("book.txt#") for d in docs)
    assert "\n\n".join(d.text for d in docs) == f.read_text()  # nothing lost or reordered
    assert all(d.nbytes >= TXT_PIECE_BYTES for d in docs[:-1])
    train, val = split_documents(docs, 0.1)
    assert train and val


def test_document_starts_open_a_document_at_each_separator():
    from k3cli.data import EOT_ID, document_starts
    ids = torch.tensor([[5, 6, EOT_ID, 7, 8, EOT_ID], [EOT_ID, 9, 9, 9, 9, 9]])
    assert document_starts(ids).tolist() == [[True, False, True, False, False, True],
                                             [True, False, False, False, False, False]]
