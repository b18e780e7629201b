"""Hostile input and files from elsewhere: fuzzed config sources and CLI options end in a valid config
or one `error:` line with exit 2 (never a traceback); checkpoints, configs and caches someone else
made never run code when loaded, and tampered files are refused with a message naming them."""

import hashlib
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from k3cli.checkpoint import MARKER, MODEL_FILE, STATE_FILE, CheckpointError
from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.checkpoint import load as load_checkpoint
from k3cli.checkpoint.single import save as save_checkpoint
from k3cli.cli import app
from k3cli.config import ConfigError, RunConfig, config_to_dict, dump_config, flatten, load_config

runner = CliRunner()
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
KNOWN_KEYS = sorted(flatten(config_to_dict(load_config("k3-toy"))))

# ---- fuzzed config sources ---------------------------------------------------------------------

NASTY = ["nan", ".nan", "NaN", "-.inf", ".inf", "inf", "1e999", "-1e999", "9" * 5000, "-0", "~", "null",
         "[]", "{}", "[" * 60 + "]" * 60, "{a: " * 40 + "1" + "}" * 40, "on", "off", "yes", "0x1F",
         "1_000", "'", '"', ":", "- a", "&a [*a]", "*a", "!!python/object/apply:os.system ['true']",
         "!!binary AAAA", "2026-01-01", "ü\u202e\U0001f600", "a\nb", "\t", "\x00", "true", "0", "-1", "1e-3",
         "[1, [2, [3, {x: y}]]]", "{model: {arch: k3}}", "!!set {a, b}", "? [a, b]\n: 1"]
SCALARS = st.one_of(
    st.sampled_from(NASTY), st.text(max_size=20),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 30).map(str),
    # no subnormals: training in the same worker flushes them to zero (train.flush_denormals), which
    # hypothesis refuses to draw under
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False).map(repr),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
    st.dictionaries(st.text("abcxyz_", min_size=1, max_size=4), inner, max_size=3).map(
        lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}")), max_leaves=8)
KEYS = st.one_of(st.sampled_from(KNOWN_KEYS), st.sampled_from(["model", "train", "data", "eval", "model.moe"]),
                 st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=4).map(".".join),
                 st.sampled_from(KNOWN_KEYS).map(lambda k: k + ".deeper"))


def check_one_line(fn):
    """fn() returns a validated RunConfig or raises ConfigError with a one-line message."""
    try:
        cfg = fn()
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and "\r" not in msg, repr(msg)
        return None
    assert isinstance(cfg, RunConfig)
    cfg.validate()
    for v in flatten(config_to_dict(cfg)).values():
        assert not (isinstance(v, float) and not math.isfinite(v)), v
    return cfg


@FUZZ
@given(st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=3))
def test_fuzzed_set_overrides(pairs):
    check_one_line(lambda: load_config("k3-toy", overrides=[f"{k}={v}" for k, v in pairs]))


@FUZZ
@given(st.text(max_size=40))
def test_fuzzed_set_expression_text(expr):
    check_one_line(lambda: load_config("kda-toy", overrides=[expr]))


YAML_DOCS = st.one_of(
    VALUES,
    st.dictionaries(st.sampled_from(["model", "train", "data", "eval", "bogus", "1", "null"]),
                    st.one_of(VALUES, st.dictionaries(st.sampled_from([k.split(".")[-1] for k in KNOWN_KEYS]
                                                                      + ["zzz", "moe", "attnres"]),
                                                      VALUES, max_size=3)), max_size=3).map(
        lambda d: "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in d.items())),
    st.text(max_size=60),
)


@FUZZ
@given(YAML_DOCS, YAML_DOCS)
def test_fuzzed_yaml_config_files_and_overlays(tmp_path_factory, doc, overlay):
    d = tmp_path_factory.mktemp("yaml")
    base, over = d / "base.yaml", d / "over.yaml"
    base.write_text(doc, encoding="utf-8", errors="surrogatepass")
    over.write_text(overlay, encoding="utf-8", errors="surrogatepass")
    check_one_line(lambda: load_config("k3-toy", config_file=str(base)))
    # a YAML path as the preset, with another file merged over it
    check_one_line(lambda: load_config(str(base), config_file=str(over)))


def assert_cli_error(r, code=2):
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    # progress lines ("run directory: ...") may come first; the failure is one line, Typer's usage errors too
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(KEYS, VALUES), min_size=1, max_size=2), st.sampled_from([["config", "show"], ["layout"]]))
def test_fuzzed_cli_set(pairs, cmd):
    args = [*cmd]
    for k, v in pairs:
        args += ["--set", f"{k}={v}".replace("\x00", "")]
    r = runner.invoke(app, args)
    if r.exit_code == 0:
        assert r.exception is None
    else:
        assert_cli_error(r)


def test_deep_nesting_and_huge_numbers_are_config_errors(tmp_path):
    for value in ["[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000, "9" * 5000, "1e999", ".nan", "-.inf"]:
        with pytest.raises(ConfigError) as e:
            load_config("k3-toy", overrides=[f"train.lr={value}"])
        assert "\n" not in str(e.value)
        f = tmp_path / "deep.yaml"
        f.write_text(f"train:\n  lr: {value}\n")
        with pytest.raises(ConfigError) as e:
            load_config("k3-toy", config_file=str(f))
        assert "\n" not in str(e.value)


def test_newline_in_key_stays_one_line():
    with pytest.raises(ConfigError) as e:
        load_config("k3-toy", overrides=["train.l\nr=1"])
    assert "\n" not in str(e.value)
    r = runner.invoke(app, ["layout", "--preset", "k3\ntoy"])
    assert_cli_error(r)


# ---- table-driven bad options for every command ------------------------------------------------

def bad_option_table(tmp):
    missing = str(tmp / "missing")
    return [
        ["train", "--resume", "yes"],
        ["train", "--steps", "0", "--out", str(tmp / "r1")],
        ["train", "--steps", "-5", "--out", str(tmp / "r1")],
        ["train", "--steps", "abc", "--out", str(tmp / "r1")],
        ["train", "--device", "tpu", "--out", str(tmp / "r1")],
        ["train", "--seed", "-1"],
        ["train", "--until", "0"],
        ["train", "--nproc", "0"],
        ["train", "--wandb", "maybe"],
        ["train", "--time-limit", "-1", "--out", str(tmp / "r1")],
        ["train", "--time-limit", "nan", "--out", str(tmp / "r1")],
        ["train", "--time-limit", "inf", "--out", str(tmp / "r1")],
        ["train", "--peak-tflops", "-1"],
        ["train", "--peak-tflops", "nan", "--out", str(tmp / "r1")],
        ["train", "--preset", "nope"],
        ["train", "--set", "train.lr=-1", "--out", str(tmp / "r1")],
        ["train", "--config", missing],
        ["eval"],
        ["eval", "--run", missing],
        ["eval", "--ckpt", missing],
        ["eval", "--run", missing, "--ckpt", missing],
        ["eval", "--batches", "0", "--run", missing],
        ["eval", "--batch-size", "-1", "--run", missing],
        ["generate"],
        ["generate", "--prompt", "x"],
        ["generate", "--prompt", "x", "--run", missing],
        ["generate", "--prompt", "x", "--max-new-tokens", "-1", "--run", missing],
        ["generate", "--prompt", "x", "--temperature", "-1", "--run", missing],
        ["generate", "--prompt", "x", "--top-k", "-1", "--run", missing],
        ["generate", "--prompt", "x", "--top-p", "0", "--run", missing],
        ["generate", "--prompt", "x", "--top-p", "2", "--run", missing],
        ["generate", "--prompt", "x", "--top-p", "nan", "--run", missing],
        # (args, text the error must hold): rows that would also fail on the missing run alone
        (["generate", "--prompt", "x", "--temperature", "nan", "--run", missing], "temperature"),
        (["generate", "--prompt", "x", "--temperature", "inf", "--run", missing], "temperature"),
        (["generate", "--prompt", "x", "--temperature", "-inf", "--run", missing], "temperature"),
        (["generate", "--prompt", "x", "--temperature", "-0.5", "--run", missing], "temperature"),
        (["train", "--steps", str(10**12 + 1), "--out", str(tmp / "r1")], "train.steps"),
        (["train", "--steps", "9" * 400, "--out", str(tmp / "r1")], "train.steps"),
        (["train", "--set", "train.steps=10000000000000", "--out", str(tmp / "r1")], "train.steps"),
        (["study", "--steps", str(10**13), "--out", str(tmp / "s1")], "train.steps"),
        (["study", "--tokens", str(10**30), "--out", str(tmp / "s1")], "train.steps"),
        (["bench-train", "--steps", str(10**13)], "--steps"),
        (["bench-train", "--warmup", str(10**13)], "--warmup"),
        ["compare"],
        ["compare", missing],
        ["study", "--attnres", "bogus", "--out", str(tmp / "s1")],
        ["study", "--seeds", "0"],
        ["study", "--steps", "0"],
        ["study", "--tokens", "-1"],
        ["study", "--parallel", "0"],
        ["study", "--preset", "nope", "--out", str(tmp / "s1")],
        ["study", "--report", missing],
        ["bench-train", "--batch", "0"],
        ["bench-train", "--seq-len", "-1"],
        ["bench-train", "--steps", "0"],
        ["bench-train", "--warmup", "-1"],
        ["bench-train", "--backend", "cuda"],
        ["bench-train", "--device", "tpu"],
        ["bench-train", "--peak-tflops", "-3"],
        ["bench-train", "--set", "model.hidden_size=nan"],
        ["bench-kernel", "--shapes", "huge"],
        ["bench-kernel", "--kernel", "nope"],
        ["bench-kernel", "--against", "cuBLAS"],
        ["bench-kernel", "--shapes", "ci", "--kernel", "chunk_kda", "--shape", "1,2"],
        ["verify-equivalence", "--shapes", "huge"],
        ["verify-equivalence", "--kernel", "nope"],
        ["verify-equivalence", "--dtype", "fp8"],
        ["layout", "--preset", "nope"],
        ["layout", "--attnres", "half"],
        ["layout", "--set", "noequals"],
        ["layout", "--set", "=1"],
        ["layout", "--set", "a..b=1"],
        ["layout", "--config", missing],
        ["config", "show", "--preset", "nope"],
        ["config", "show", "--config", str(tmp)],
        ["config", "show", "--set", "model.num_hidden_layers=-1"],
        ["config", "show", "--set", "model.vocab_size=" + "9" * 5000],
        ["config", "nope"],
        ["export"],
        ["export", "--out", str(tmp / "e1")],
        ["export", "--out", str(tmp / "e1"), "--run", missing],
        ["export", "--out", str(tmp / "e1"), "--ckpt", missing],
        ["export", "--out", str(tmp / "e1"), "--run", missing, "--ckpt", missing],
        ["nosuchcommand"],
    ]


def test_every_command_rejects_bad_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default run directory would land here, not in the checkout
    failures = []
    for row in bad_option_table(tmp_path):
        args, needle = row if isinstance(row, tuple) else (row, "")
        r = runner.invoke(app, args)
        try:
            assert_cli_error(r)
            assert needle in r.stderr, r.stderr
        except AssertionError as e:
            failures.append(f"{args}: {e}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ---- files from elsewhere ----------------------------------------------------------------------

class Payload:
    """Unpickling this creates the marker file: the proof that a loader ran foreign code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tiny_run(tmp_path):
    """A run directory as `k3 train` leaves it (config, tokenizer, one checkpoint), built cheaply."""
    from k3cli.data import Document, save_tokenizer, train_tokenizer
    from k3cli.models.causal_lm import CausalLM

    run = tmp_path / "run"
    run.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i} says hello world number {i * 7}" for i in range(400)))
    cfg = load_config("kda-toy", overrides=[f"data.source={corpus}", "train.steps=2", "train.seq_len=16",
                                            "model.vocab_size=300", "train.micro_batch_size=2",
                                            "train.global_batch_size=2", "train.device=cpu"])
    (run / "config.yaml").write_text(dump_config(cfg))
    docs = [Document(f"d{i}", t, len(t)) for i in range(50) for t in [f"document {i} says hello world"]]
    save_tokenizer(train_tokenizer(docs, cfg.model.vocab_size, 1), run)
    torch.manual_seed(0)
    model = CausalLM(cfg.model)
    ckpt = save_checkpoint(run, 2, model, extra={})
    return run, ckpt, cfg, model


def reseal(ckpt):
    """Rewrite COMPLETE to match the files: what someone handing over a malicious checkpoint would do."""
    marker = json.loads((ckpt / MARKER).read_text())
    for name in marker["files"]:
        data = (ckpt / name).read_bytes()
        marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MARKER).write_text(json.dumps(marker))


def test_malicious_state_pt_never_runs(tmp_path, monkeypatch):
    run, ckpt, cfg, model = tiny_run(tmp_path)
    marker = tmp_path / "PWNED"
    with open(ckpt / STATE_FILE, "wb") as f:
        pickle.dump({"step": 2, "optimizer": None, "scheduler": None, "loader": Payload(marker),
                     "rng": {}, "extra": {}}, f)
    reseal(ckpt)
    assert find_latest_checkpoint(run) == ckpt  # checksums match: only the loader can refuse it
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, model)
    assert STATE_FILE in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()

    monkeypatch.chdir(tmp_path)
    for args in (["eval", "--run", str(run), "--device", "cpu"], ["eval", "--ckpt", str(ckpt), "--device", "cpu"],
                 ["train", "--out", str(run), "--resume", "auto"]):
        r = runner.invoke(app, args)
        assert_cli_error(r)
        assert STATE_FILE in r.stderr, (args, r.stderr)
        assert not marker.exists(), args


def test_state_pt_of_ours_loads_weights_only(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = save_checkpoint(tmp_path, 1, model, opt, sched, {"pos": 3, "seed": 1}, {"note": "x"})
    state = torch.load(ckpt / STATE_FILE, weights_only=True)  # no allow-list: plain containers and tensors
    assert state["step"] == 1 and state["loader"] == {"pos": 3, "seed": 1}
    assert load_checkpoint(ckpt, model, opt, sched)["step"] == 1


def test_yaml_python_tag_never_runs(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "config.yaml"
    for doc in (f"train: !!python/object/apply:os.system ['touch {marker}']\n",
                f"!!python/object/apply:os.system ['touch {marker}']\n",
                f"train:\n  lr: !!python/object/new:os.system ['touch {marker}']\n"):
        f.write_text(doc)
        with pytest.raises(ConfigError) as e:
            load_config(str(f))
        assert "\n" not in str(e.value) and "config.yaml" in str(e.value)
        with pytest.raises(ConfigError):
            load_config("k3-toy", config_file=str(f))
        with pytest.raises(ConfigError):
            load_config("k3-toy", overrides=[f"train.lr=!!python/object/apply:os.system ['touch {marker}']"])
        assert_cli_error(runner.invoke(app, ["config", "show", "--config", str(f)]))
        assert not marker.exists()


def test_yaml_python_tag_in_a_run_config_never_runs(tmp_path):
    run, ckpt, cfg, model = tiny_run(tmp_path)
    marker = tmp_path / "PWNED"
    (run / "config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    r = runner.invoke(app, ["eval", "--run", str(run), "--device", "cpu"])
    assert_cli_error(r)
    assert "config.yaml" in r.stderr
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_truncated_or_tampered_weights_refused(tmp_path, damage):
    run, ckpt, cfg, model = tiny_run(tmp_path)
    f = ckpt / MODEL_FILE
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert find_latest_checkpoint(run) is None
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, model, verify=True)
    assert str(ckpt) in str(e.value) and "\n" not in str(e.value)
    for args in (["eval", "--ckpt", str(ckpt), "--device", "cpu"], ["eval", "--run", str(run), "--device", "cpu"]):
        r = runner.invoke(app, args)
        assert_cli_error(r)
        assert str(run) in r.stderr, (args, r.stderr)


def test_truncated_state_pt_refused(tmp_path):
    run, ckpt, cfg, model = tiny_run(tmp_path)
    f = ckpt / STATE_FILE
    f.write_bytes(f.read_bytes()[:40])
    reseal(ckpt)  # even with a marker that matches, the file itself is refused
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, model)
    assert STATE_FILE in str(e.value) and "\n" not in str(e.value)


def test_pickled_npy_in_token_cache_never_runs(tmp_path):
    from k3cli.data import prepare_data

    run, ckpt, cfg, model = tiny_run(tmp_path)
    cache = tmp_path / "cache"
    first = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cache_dir=cache)
    expected = np.array(first.train_tokens)  # a copy: the memory map goes when the file is replaced
    del first
    marker = tmp_path / "PWNED"
    planted = sorted((cache / "shards").glob("*/train-*.npy"))
    assert planted
    for p in planted:
        np.save(p, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    again = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cache_dir=cache)
    assert not marker.exists()
    assert np.array_equal(np.asarray(again.train_tokens), expected)  # rebuilt


def test_garbage_tokenizer_files_refused_or_rebuilt(tmp_path):
    from k3cli.data import DataError, load_tokenizer, prepare_data

    run, ckpt, cfg, model = tiny_run(tmp_path)
    cache = tmp_path / "cache"
    first = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cache_dir=cache)
    for p in (cache / "tokenizers").glob("*.json"):
        p.write_text('{"model": ' + "[" * 100)
    again = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cache_dir=cache)
    assert again.tokenizer.to_str() == first.tokenizer.to_str()
    (run / "tokenizer.json").write_bytes(os.urandom(64))
    with pytest.raises(DataError) as e:
        load_tokenizer(run)
    assert "tokenizer.json" in str(e.value) and "\n" not in str(e.value)
    assert_cli_error(runner.invoke(app, ["eval", "--run", str(run), "--device", "cpu"]))
