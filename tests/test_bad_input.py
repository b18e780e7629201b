"""Bad input that used to end in a traceback (or in silence) ends in one `error:` line and exit 2: unknown
devices, seeds past 64 bits, duplicate YAML keys, sizes past any real model, a manifest with fields of the
wrong kind, shard bytes damaged in place, an export that mixes two runs, wandb that cannot start, and
running out of memory."""
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import ConfigError, load_config, read_yaml
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus
from k3cli.train import resolve_device

runner = CliRunner()
TINY = [a for s in TINY_MODEL + TINY_TRAIN + ["train.steps=2", "train.ckpt_every=2"] for a in ("--set", s)]



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    corpus = write_corpus(root, n_docs=30)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(root / "cache"))
        for preset in ("kda-toy", "k3-toy"):
            r = runner.invoke(app, ["train", "--preset", preset, "--data", str(corpus), "--out", str(root / preset), *TINY])
            assert r.exit_code == 0, r.output
    return root


@pytest.mark.parametrize("name", ["tpu", "meta", "cpu:1", "cuda:x", "mps"])
def test_unknown_devices_are_one_line(runs, name):
    err = one_error_line(runner.invoke(app, ["generate", "--run", str(runs / "kda-toy"), "--prompt", "x", "--device", name]))
    assert f"unknown device '{name}'; use auto, cpu, cuda or cuda:N" in err
    assert "unknown device" in one_error_line(runner.invoke(app, ["eval", "--run", str(runs / "kda-toy"), "--device", name]))


def test_device_names_that_resolve():
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("cpu:0") == torch.device("cpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")


def test_seeds_past_64_bits_are_one_line(runs):
    err = one_error_line(runner.invoke(app, ["generate", "--run", str(runs / "kda-toy"), "--prompt", "x",
                                             "--seed", str(2**63)]))
    assert "Invalid value for '--seed'" in err and "(see k3 generate --help)" in err
    with pytest.raises(ConfigError, match=r"train\.seed"):
        load_config("kda-toy", overrides=[f"train.seed={2**70}"])
    with pytest.raises(ConfigError, match=r"train\.seed"):
        load_config("kda-toy", overrides=["train.seed=-5"])


def test_duplicate_yaml_keys_are_refused(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("train:\n  steps: 5\ntrain:\n  lr: 0.1\n")
    err = one_error_line(runner.invoke(app, ["config", "show", "-c", str(f)]))
    assert "duplicate key 'train'" in err and "line 3" in err
    f.write_text("base: &b {steps: 1, lr: 0.5}\ntrain:\n  <<: *b\n  steps: 2\n")   # a merge key may be overridden
    assert read_yaml(f)["train"] == {"steps": 2, "lr": 0.5}


@pytest.mark.parametrize("key,value", [("model.vocab_size", 10**11), ("model.num_hidden_layers", 10**9),
                                       ("model.hidden_size", 2**20)])
def test_sizes_past_any_real_model_name_their_key(key, value):
    err = one_error_line(runner.invoke(app, ["layout", "--preset", "kda-toy", "--set", f"{key}={value}"]))
    assert key in err


def test_manifest_fields_of_the_wrong_kind_are_one_line(runs, tmp_path):
    prep = tmp_path / "prep"
    assert runner.invoke(app, ["data", "prepare", "--data", str(runs / "corpus"), "--out", str(prep),
                               "--vocab-size", "300"]).exit_code == 0
    m = json.loads((prep / "manifest.json").read_text())
    m["splits"]["train"]["tokens"] = "lots"
    (prep / "manifest.json").write_text(json.dumps(m))
    assert "splits.train.tokens is missing or not a count" in one_error_line(runner.invoke(app, ["data", "info", str(prep)]))


def test_shard_bytes_damaged_in_place_stop_training_with_one_line(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    prep = tmp_path / "prep"
    assert runner.invoke(app, ["data", "prepare", "--data", str(runs / "corpus"), "--out", str(prep),
                               "--vocab-size", "300"]).exit_code == 0
    shard = prep / "train-00000.npy"
    header = len(shard.read_bytes()) - np.load(shard).nbytes
    data = bytearray(shard.read_bytes())
    data[header:] = b"\xff" * (len(data) - header)   # the same size: only a checksum or the ids tell
    shard.write_bytes(bytes(data))
    err = one_error_line(runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(prep),
                                             "--out", str(tmp_path / "run"), *TINY]), alone=True)
    assert "token id 65535" in err and "outside the model's vocabulary (300)" in err


def test_export_refuses_a_checkpoint_of_another_run(runs, tmp_path):
    ckpt = runs / "k3-toy" / "checkpoints" / "step_00000002"
    err = one_error_line(runner.invoke(app, ["export", "--run", str(runs / "kda-toy"), "--ckpt", str(ckpt),
                                             "--out", str(tmp_path / "mixed")]))
    assert "is not a checkpoint of --run" in err and not (tmp_path / "mixed").exists()
    own = runs / "kda-toy" / "checkpoints" / "step_00000002"
    r = runner.invoke(app, ["export", "--run", str(runs / "kda-toy"), "--ckpt", str(own), "--out", str(tmp_path / "ok")])
    assert r.exit_code == 0, r.output
    err = one_error_line(runner.invoke(app, ["export", "--run", str(tmp_path / "ok"), "--out", str(tmp_path / "again")]))
    assert "is an export already" in err and not (tmp_path / "again").exists()


def test_wandb_that_cannot_start_is_one_line(runs, tmp_path, monkeypatch):
    import types

    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setitem(__import__("sys").modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("K3_CACHE_DIR", str(runs / "cache"))
    err = one_error_line(runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(runs / "corpus"),
                                             "--out", str(tmp_path / "run"), "--wandb", "online", *TINY]), alone=True)
    assert "--wandb online: wandb could not start the run (api_key not configured" in err


def test_running_out_of_memory_is_one_line_with_advice(monkeypatch):
    import k3cli.bench.train as bt

    def bench_train(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1600000000000 bytes.")

    monkeypatch.setattr(bt, "bench_train", bench_train)
    err = one_error_line(runner.invoke(app, ["bench-train", "--preset", "kda-toy", "--device", "cpu"]))
    assert err.startswith("error: out of memory") and "--batch" in err and "--seq-len" in err


@pytest.mark.parametrize("args,needle", [(["nosuchcommand"], "No such command"), (["train", "--bogus"], "--bogus"),
                                         (["compare"], "Missing argument"), (["train", "--nproc", "0"], "--nproc")])
def test_usage_errors_are_one_line_naming_the_help(args, needle):
    err = one_error_line(runner.invoke(app, args))
    assert needle in err and "--help)" in err


@pytest.mark.parametrize("name,text", [("bad.jsonl", '{"text": "hello"}\n{bad json\n'), ("fake.parquet", "not parquet")])
def test_unreadable_table_is_one_line_with_no_library_log(tmp_path, monkeypatch, name, text):
    pytest.importorskip("datasets")
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / name).write_text(text)
    r = runner.invoke(app, ["data", "prepare", "--data", str(tmp_path / name), "--out", str(tmp_path / "out")])
    err = one_error_line(r)
    assert "cannot read " in err and f"{name}: " in err
    assert [line for line in r.stderr.splitlines() if line.strip()][-2:-1] == [f"scanning {tmp_path / name}"]


def test_a_tokenizer_file_of_any_name_is_read_as_that_file(runs, tmp_path):
    given = tmp_path / "tok.bin"
    given.write_bytes((runs / "kda-toy" / "tokenizer.json").read_bytes())
    r = runner.invoke(app, ["data", "prepare", "--data", str(runs / "corpus"), "--out", str(tmp_path / "p"),
                            "--tokenizer", str(given)])
    assert r.exit_code == 0, r.output
    (tmp_path / "junk.jsonl").write_text('{"a": 1}\n')
    err = one_error_line(runner.invoke(app, ["data", "prepare", "--data", str(runs / "corpus"), "--out",
                                             str(tmp_path / "q"), "--tokenizer", str(tmp_path / "junk.jsonl")]))
    assert f"cannot read tokenizer {tmp_path / 'junk.jsonl'}" in err
