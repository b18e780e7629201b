"""Prepared token shards (`k3 data prepare`, k3cli/data/): the manifest round trip, the streams
against one-process tokenization, reuse, a SIGKILLed prepare, the loader over shard boundaries and
the refusals of `k3 train --data DIR` / `k3 data info`. Tiny corpora written to tmp_path."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import DataConfig
from k3cli.data import EOT_ID, PackedLoader, load_documents, pack_documents, prepare_data, split_documents
from k3cli.data.prepare import SLOW_ENV, prepare_shards
from k3cli.data.shards import MANIFEST, TokenStream, open_prepared
from k3cli.distributed import shard_batch
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus

runner = CliRunner()


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path, n_docs=30)



@pytest.mark.parametrize("workers", [1, 2])
def test_shards_round_trip_and_equal_one_process_packing(corpus, tmp_path, workers):
    out = tmp_path / "prep"
    res = prepare_shards(str(corpus), out, vocab_size=300, workers=workers, val_fraction=0.2, shard_tokens=500)
    assert not res.reused
    p = open_prepared(out, verify=True)
    m = json.loads((out / MANIFEST).read_text())
    assert p.manifest == m and m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 300

    docs = load_documents(str(corpus))
    train, val = split_documents(docs, 0.2)
    for split, split_docs in (("train", train), ("val", val)):
        expected = pack_documents(p.tokenizer, split_docs, np.uint16)
        assert np.array_equal(np.asarray(p.streams[split]), expected)
        s = m["splits"][split]
        assert s["documents"] == len(split_docs) and s["tokens"] == len(expected)
        assert s["text_bytes"] == sum(d.nbytes for d in split_docs)
        assert sum(x["tokens"] for x in s["shards"]) == s["tokens"]
        assert sum(x["documents"] for x in s["shards"]) == s["documents"]
        for x in s["shards"]:  # shards end at a document's end, and all but the last hold >= shard_tokens
            arr = np.load(out / x["file"])
            assert arr[-1] == EOT_ID and (arr == EOT_ID).sum() == x["documents"]
            assert x["bytes"] == (out / x["file"]).stat().st_size
        assert all(x["tokens"] >= 500 for x in s["shards"][:-1])
    assert len(m["splits"]["train"]["shards"]) > 3
    assert m["source"]["documents"] == len(docs)

    again = prepare_shards(str(corpus), out, vocab_size=300, workers=workers, val_fraction=0.2, shard_tokens=500)
    assert again.reused and again.manifest == m
    # another tokenizer for the same folder: everything is rewritten, nothing of the old one stays
    other = prepare_shards(str(corpus), out, vocab_size=320, val_fraction=0.2, shard_tokens=10**6)
    assert not other.reused and other.manifest["tokenizer"]["sha256"] != m["tokenizer"]["sha256"]
    assert sorted(f.name for f in out.glob("*.npy")) == ["train-00000.npy", "val-00000.npy"]


def test_raw_source_goes_through_the_cache_with_the_same_streams(corpus, tmp_path):
    cfg = DataConfig(source=str(corpus), val_fraction=0.2)
    data = prepare_data(cfg, vocab_size=300, seq_len=16)
    assert data.path is not None and data.path.is_relative_to(tmp_path / "cache" / "shards")
    prepared = tmp_path / "prep"
    prepare_shards(str(corpus), prepared, vocab_size=300, val_fraction=0.2)
    direct = prepare_data(DataConfig(source=str(prepared)), vocab_size=300, seq_len=16)
    assert direct.tokenizer.to_str() == data.tokenizer.to_str()
    for a, b in ((data.train_tokens, direct.train_tokens), (data.val_tokens, direct.val_tokens)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert direct.n_train_docs == data.n_train_docs and direct.bytes_per_token_val == data.bytes_per_token_val


def test_token_stream_slices_across_shards():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 300, n).astype(np.uint16) for n in (7, 1, 30, 12)]
    whole, stream = np.concatenate(parts), TokenStream(parts)
    assert len(stream) == len(whole)
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 2, 3):
            assert np.array_equal(stream[a:b], whole[a:b]), (a, b)


def test_token_stream_windows_gather_what_slices_give():
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 300, n).astype(np.uint16) for n in (7, 0, 1, 30, 12)]
    whole, stream = np.concatenate(parts), TokenStream(parts)
    for length in (1, 5, 13):
        starts = np.arange(len(whole) - length + 1)
        rng.shuffle(starts)   # any order, shards interleaved, windows inside one shard and across several
        got = stream.windows(starts, length)
        assert got.dtype == whole.dtype and got.shape == (len(starts), length)
        assert np.array_equal(got, np.stack([whole[s:s + length] for s in starts])), length


def test_loader_resume_exact_over_shard_boundaries(corpus, tmp_path):
    out = tmp_path / "prep"
    prepare_shards(str(corpus), out, vocab_size=300, val_fraction=0.2, shard_tokens=100)
    stream = open_prepared(out).streams["train"]
    assert len(stream.arrays) > 10
    T, B = 24, 4  # windows straddle many of the ~100-token shards
    ref = PackedLoader(np.asarray(stream), T, B, seed=3)
    loader = PackedLoader(stream, T, B, seed=3)
    n = 2 * ref.num_windows // B + 3  # into the third epoch
    expected = [next(ref) for _ in range(n)]
    got = []
    for i in range(n):
        if i in (5, ref.num_windows // B + 1):  # resume from a saved state, mid-epoch and past a wrap
            state = loader.state_dict()
            loader = PackedLoader(stream, T, B, seed=3)
            loader.load_state_dict(state)
        got.append(next(loader))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # a rank's loader reads exactly its slice of the global batch
    ranks = [PackedLoader(stream, T, B, seed=3, rank=r, world_size=2) for r in range(2)]
    for g in expected[:6]:
        for r, ld in enumerate(ranks):
            assert torch.equal(next(ld), shard_batch(g, r, 2))


def test_sigkilled_prepare_leaves_nothing_train_loads_and_a_rerun_completes(corpus, tmp_path):
    out = tmp_path / "prep"
    cmd = [sys.executable, "-m", "k3cli", "data", "prepare", "--data", str(corpus), "--out", str(out),
           "--vocab-size", "300", "--val-fraction", "0.2", "--shard-tokens", "100"]
    proc = subprocess.Popen(cmd, env={**os.environ, SLOW_ENV: "30"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (out.is_dir() and any(".tmp-" in f.name for f in out.iterdir())):
            time.sleep(0.05)
        assert out.is_dir() and any(".tmp-" in f.name for f in out.iterdir()), "no shard was being written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / MANIFEST).exists()
    err = one_error_line(runner.invoke(app, ["train", "--preset", "k3-toy", "--data", str(out), "--out",
                                             str(tmp_path / "run"), *sum((["--set", s] for s in TINY_MODEL + TINY_TRAIN), [])]))
    assert "did not finish" in err
    one_error_line(runner.invoke(app, ["data", "info", str(out)]))

    r = runner.invoke(app, cmd[3:])
    assert r.exit_code == 0, r.output
    assert not any(".tmp-" in f.name for f in out.iterdir())
    fresh = tmp_path / "fresh"
    prepare_shards(str(corpus), fresh, vocab_size=300, val_fraction=0.2, shard_tokens=100)
    a, b = open_prepared(out, verify=True), open_prepared(fresh)
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(a.streams[split]), np.asarray(b.streams[split]))


def tiny_train(data, out, *extra):
    sets = sum((["--set", s] for s in TINY_MODEL + TINY_TRAIN + ["train.steps=2", "train.ckpt_every=2"]), [])
    return runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(data), "--out", str(out), *sets, *extra])


def test_prepare_with_a_given_tokenizer_and_a_byte_cap(corpus, tmp_path):
    prep, again = tmp_path / "prep", tmp_path / "again"
    prepare = ["data", "prepare", "--data", str(corpus)]
    assert runner.invoke(app, [*prepare, "--out", str(prep), "--vocab-size", "300"]).exit_code == 0
    given = prep / "tokenizer.json"
    err = one_error_line(runner.invoke(app, [*prepare, "--out", str(again), "--tokenizer", str(given),
                                             "--vocab-size", "300"]))
    assert "--tokenizer and --vocab-size exclude each other" in err and not again.exists()
    r = runner.invoke(app, [*prepare, "--out", str(again), "--tokenizer", str(given), "--max-bytes", "3000"])
    assert r.exit_code == 0, r.output
    assert (again / "tokenizer.json").read_text() == given.read_text()   # used as given, not trained
    full, capped = (json.loads((d / MANIFEST).read_text())["source"] for d in (prep, again))
    assert capped["bytes"] <= 3000 < full["bytes"] and capped["documents"] < full["documents"]


def test_train_on_prepared_dir_and_its_refusals(corpus, tmp_path):
    prep = tmp_path / "prep"
    assert runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(prep), "--vocab-size", "300",
                               "--val-fraction", "0.2", "--shard-tokens", "400"]).exit_code == 0
    info = runner.invoke(app, ["data", "info", str(prep), "--verify"])
    assert info.exit_code == 0 and "train" in info.stdout and "val" in info.stdout, info.output
    run = tmp_path / "run"
    r = tiny_train(prep, run)
    assert r.exit_code == 0, r.output
    assert (run / "tokenizer.json").read_text() == (prep / "tokenizer.json").read_text()
    assert not (tmp_path / "cache" / "shards").exists()  # nothing was tokenized at start-up

    # missing folder
    assert "does not exist" in one_error_line(runner.invoke(app, ["data", "info", str(tmp_path / "nope")]))
    one_error_line(tiny_train(tmp_path / "nope", tmp_path / "run2"))
    # the folder prepared again with another tokenizer (deleted first: prepare does not replace a finished
    # folder): the run's own tokenizer no longer matches
    shutil.rmtree(prep)
    assert runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(prep), "--vocab-size", "320",
                               "--val-fraction", "0.2", "--shard-tokens", "400"]).exit_code == 0
    err = one_error_line(tiny_train(prep, run, "--resume", "auto", "--steps", "4"))
    assert "another tokenizer" in err
    # a truncated shard
    shard = prep / "train-00001.npy"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in one_error_line(tiny_train(prep, tmp_path / "run3"))
    assert "truncated" in one_error_line(runner.invoke(app, ["data", "info", str(prep)]))
    # a shard of the same size but other bytes: only the checksum finds it
    shard.write_bytes(b"\0" * (json.loads((prep / MANIFEST).read_text())["splits"]["train"]["shards"][1]["bytes"]))
    assert "SHA-256" in one_error_line(runner.invoke(app, ["data", "info", str(prep), "--verify"]))


def test_prepare_logs_progress_off_a_terminal(corpus, tmp_path, monkeypatch):
    """Off a terminal (logs, Slurm: CliRunner is none) a progress line every PREPARE_LOG_EVERY_S seconds."""
    import k3cli.console

    args = ["data", "prepare", "--data", str(corpus), "--vocab-size", "300", "--val-fraction", "0.2"]
    monkeypatch.setattr(k3cli.console, "PREPARE_LOG_EVERY_S", 0.0)
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("prepare: ")]
    assert lines and re.fullmatch(r"prepare: 30/30 documents, [\d,]+ tokens, [\d.]+/[\d.]+ MiB \(100%\), "
                                  r"[\d.]+ MB/s, about 0 s left", lines[-1]), r.stderr
    monkeypatch.setattr(k3cli.console, "PREPARE_LOG_EVERY_S", 3600.0)   # a prepare shorter than the interval
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert r.exit_code == 0 and "prepare: " not in r.stderr, r.output


def test_info_verify_reports_its_result(corpus, tmp_path):
    prep = tmp_path / "prep"
    assert runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(prep), "--vocab-size", "300",
                               "--val-fraction", "0.2", "--shard-tokens", "400"]).exit_code == 0
    m = json.loads((prep / MANIFEST).read_text())
    shards = len(m["splits"]["train"]["shards"]) + len(m["splits"]["val"]["shards"])
    r = runner.invoke(app, ["data", "info", str(prep), "--verify"])
    assert r.exit_code == 0 and f"verified: {shards} shards, SHA-256 match" in r.stdout, r.output
    r = runner.invoke(app, ["data", "info", str(prep), "--verify", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["verified"] == {"shards": shards, "sha256_match": True}
    r = runner.invoke(app, ["data", "info", str(prep), "--json"])
    assert json.loads(r.stdout)["verified"] is None
    assert "verified" not in runner.invoke(app, ["data", "info", str(prep)]).stdout


def test_cache_prepare_waits_for_another_writer(corpus, tmp_path):
    """`k3 data prepare` refuses a folder another process holds; the training cache (wait=True, as runs started
    together by `k3 study --parallel` reach the same entry) waits for it, then reuses what it wrote."""
    import fcntl
    import threading

    from k3cli.data import DataError
    out = tmp_path / "prep"
    prepare_shards(str(corpus), out, vocab_size=300, val_fraction=0.2)
    holder = open(out / ".lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    with pytest.raises(DataError, match="another `k3 data prepare` is writing"):
        prepare_shards(str(corpus), out, vocab_size=300, val_fraction=0.2)
    said, result = [], {}
    waiter = threading.Thread(target=lambda: result.setdefault(
        "res", prepare_shards(str(corpus), out, vocab_size=300, val_fraction=0.2, say=said.append, wait=True)))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and any("waiting for it" in m for m in said)
    holder.close()
    waiter.join(60)
    assert not waiter.is_alive() and result["res"].reused
