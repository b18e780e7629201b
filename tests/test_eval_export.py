"""`k3 export` and `k3 eval` check what they read: export refuses weights that do not fit the run's config
(nothing written), `eval --run` names a checkpoint that fails verification, `eval --data` evaluates any
source `train` takes with the run's tokenizer (a moved data folder, a prepared folder, other text), and
eval warns when the validation split holds fewer batches than asked."""
import json
import math
import os
import shutil

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from k3cli.checkpoint import MARKER, MODEL_FILE
from k3cli.cli import app
from k3cli.config import dump_config, load_config
from k3cli.files import sha256_file as _sha256
from k3cli.testing import TINY_MODEL, TINY_TRAIN, WORDS, one_error_line, write_corpus

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A kda-toy run of 6 steps with checkpoints at steps 4 and 6, and the corpus it trained on."""
    root = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(root, n_docs=30)
    sets = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(root / "cache"))
        r = runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out", str(root / "run"), *sets])
    assert r.exit_code == 0, r.output
    assert [p.name for p in sorted((root / "run" / "checkpoints").iterdir())] == ["step_00000004", "step_00000006"]
    return root / "run", corpus


@pytest.fixture
def run(trained, tmp_path, monkeypatch):
    """A copy of the trained run (each test may damage its own), with its own data cache."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return shutil.copytree(trained[0], tmp_path / "run")


def snapshot(folder):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def reseal(ckpt):
    """Rewrite COMPLETE to match the files, so only the tensors themselves are wrong."""
    marker = json.loads((ckpt / MARKER).read_text())
    for name in marker["files"]:
        marker["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": _sha256(ckpt / name)}
    (ckpt / MARKER).write_text(json.dumps(marker))


def eval_json(*args):
    r = runner.invoke(app, ["eval", *args, "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r.stderr


# ---- export checks the weights against the config ----------------------------------------------------

def set_config(run, *overrides):
    cfg = load_config(str(run / "config.yaml"), overrides=list(overrides))
    (run / "config.yaml").write_text(dump_config(cfg))


def to_fp16(run):
    ckpt = run / "checkpoints" / "step_00000006"
    sd = safetensors.torch.load_file(str(ckpt / MODEL_FILE))
    safetensors.torch.save_file({k: v.half() for k, v in sd.items()}, str(ckpt / MODEL_FILE))
    reseal(ckpt)


@pytest.mark.parametrize("damage,needle", [
    (lambda run: set_config(run, "model.num_hidden_layers=3"), "20 tensor(s) of the config's model are not in the checkpoint (blocks.2."),
    (lambda run: set_config(run, "model.vocab_size=320"), "embed_tokens.weight is (300, 32) torch.float32 in the "
                                                          "checkpoint, (320, 32) torch.float32 in the config's model"),
    (to_fp16, "torch.float16 in the checkpoint"),
], ids=["names", "shape", "dtype"])
@pytest.mark.parametrize("out_exists", [False, True], ids=["new-out", "empty-out"])
def test_export_refuses_weights_that_do_not_fit_the_config(run, tmp_path, damage, needle, out_exists):
    damage(run)
    out = tmp_path / "exports" / "model"
    out.mkdir(parents=True) if out_exists else out.parent.mkdir()
    before = snapshot(run)
    err = one_error_line(runner.invoke(app, ["export", "--run", str(run), "--out", str(out)]))
    assert "step_00000006 does not fit" in err and "config.yaml" in err and needle in err, err
    assert "nothing was written" in err
    assert os.listdir(out.parent) == (["model"] if out_exists else [])   # no temp folder left beside it
    assert not out.exists() or not any(out.iterdir())
    assert snapshot(run) == before


# ---- eval --run names a checkpoint that fails verification ---------------------------------------------

def flip(ckpt):
    f = ckpt / MODEL_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data))


def truncate(ckpt):
    f = ckpt / MODEL_FILE
    f.write_bytes(f.read_bytes()[:100])


@pytest.mark.parametrize("damage,why", [
    (flip, "model.safetensors does not match the SHA-256 COMPLETE records"),
    (truncate, "model.safetensors has 100 bytes, COMPLETE records"),
    (lambda ckpt: (ckpt / MARKER).unlink(), "no readable COMPLETE marker"),
], ids=["flipped", "truncated", "no-marker"])
def test_eval_run_names_the_checkpoint_that_fails_verification(run, damage, why):
    for ckpt in (run / "checkpoints").iterdir():
        damage(ckpt)
    err = one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--device", "cpu"]))
    newest = run / "checkpoints" / "step_00000006"
    assert f"no checkpoint of run {run} verifies: the newest, {newest}, fails ({why}" in err, err
    assert "no complete checkpoint yet" not in err


def test_eval_and_export_say_when_they_skip_a_newest_checkpoint_that_fails(run, tmp_path):
    flip(run / "checkpoints" / "step_00000006")
    res, stderr = eval_json("--run", str(run))
    assert res["step"] == 4 and res["checkpoint"].endswith("step_00000004")
    assert "warning: " in stderr and "step_00000006 fails verification (model.safetensors does not match" in stderr
    assert "using step_00000004" in stderr
    r = runner.invoke(app, ["export", "--run", str(run), "--out", str(tmp_path / "export")])
    assert r.exit_code == 0, r.output
    assert "step_00000006 fails verification" in r.stderr and "(step 4)" in r.stdout
    assert eval_json("--run", str(tmp_path / "export"))[0]["val_loss"] == pytest.approx(res["val_loss"], abs=1e-6)


# ---- eval --data ---------------------------------------------------------------------------------------

def test_eval_data_reads_a_moved_data_folder(run, trained, tmp_path):
    corpus = shutil.copytree(trained[1], tmp_path / "corpus")
    set_config(run, f"data.source={corpus}")
    before, _ = eval_json("--run", str(run))
    assert before["data"] == str(corpus)
    moved = corpus.rename(tmp_path / "moved")
    err = one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--device", "cpu"]))
    assert f"the run's data {corpus} does not exist" in err and "--data SRC" in err
    after, _ = eval_json("--run", str(run), "--data", str(moved))
    assert after["data"] == str(moved) and after["tokens"] == before["tokens"]
    assert after["val_loss"] == pytest.approx(before["val_loss"], abs=1e-6)


def test_eval_data_reads_a_folder_prepared_with_the_runs_tokenizer(run, trained, tmp_path):
    corpus = trained[1]
    own = tmp_path / "prepared"
    r = runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(own),
                            "--tokenizer", str(run / "tokenizer.json")])
    assert r.exit_code == 0, r.output
    res, _ = eval_json("--run", str(run), "--data", str(own))
    raw, _ = eval_json("--run", str(run), "--data", str(corpus))
    assert res["data"] == str(own) and res["tokens"] == raw["tokens"]   # the same validation documents
    assert res["val_loss"] == pytest.approx(raw["val_loss"], abs=1e-6)

    other = tmp_path / "other-tokenizer"
    r = runner.invoke(app, ["data", "prepare", "--data", str(corpus), "--out", str(other), "--vocab-size", "280"])
    assert r.exit_code == 0, r.output
    before = snapshot(other)
    err = one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--data", str(other), "--device", "cpu"]))
    assert f"{other} was tokenized by another tokenizer" in err
    assert snapshot(other) == before


def test_eval_data_reads_other_text(run, tmp_path):
    text = tmp_path / "other.txt"
    paras = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(60)) for i in range(200)]
    text.write_text("\n\n".join(paras) + "\n")
    res, stderr = eval_json("--run", str(run), "--data", str(text))
    assert res["data"] == str(text) and math.isfinite(res["val_loss"]) and res["tokens"] > 0
    assert f"reading {text}" in stderr
    err = one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--data", str(tmp_path / "nope.txt")]))
    assert "does not exist" in err


# ---- eval says when the data holds fewer batches than asked ----------------------------------------------

def test_eval_warns_when_the_split_holds_fewer_batches_than_asked(run):
    res, stderr = eval_json("--run", str(run), "--batches", "1000", "--batch-size", "2")
    assert res["batches_asked"] == 1000 and 0 < res["batches"] < 1000 and res["batch_size"] == 2
    assert res["tokens"] <= res["batches"] * 2 * 32
    warning = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"{res['batches']} batch(es) of 2, fewer than the 1000 asked" in warning[0]
    one, stderr = eval_json("--run", str(run), "--batches", "1", "--batch-size", "2")
    assert one["batches"] == one["batches_asked"] == 1 and one["tokens"] == 2 * 32
    assert "warning:" not in stderr


def test_public_load_reads_a_run_a_checkpoint_and_an_export_alike(run, tmp_path):
    import k3cli
    from k3cli.evaluation.generate import generate

    r = runner.invoke(app, ["export", "--run", str(run), "--out", str(tmp_path / "export")])
    assert r.exit_code == 0, r.output
    loaded = [k3cli.load(p, device="cpu") for p in (run, run / "checkpoints" / "step_00000006", tmp_path / "export")]
    ids = loaded[0].encode("the state decays")
    assert ids[0, 0].item() == 0 and ids.shape[1] > 2   # <|endoftext|> first
    logits = [m.model(ids).logits for m in loaded]
    assert all(torch.equal(x, logits[0]) for x in logits)
    assert [m.step for m in loaded] == [6, 6, 6] and not loaded[0].model.training
    assert loaded[0].config.model.hidden_size == 32
    text = loaded[0].generate("the state decays", max_new_tokens=5)
    assert text == generate(loaded[0].model, loaded[0].tokenizer, "the state decays", 5, temperature=0.0).text
    for bad, says in ((tmp_path / "missing", "no such folder"), (tmp_path, "is not a k3 run directory")):
        with pytest.raises(ValueError, match=says):
            k3cli.load(bad)


def test_init_from_starts_a_new_run_from_another_runs_weights_and_tokenizer(run, trained, tmp_path):
    _, corpus = trained
    sets = [a for s in TINY_MODEL + TINY_TRAIN + ["train.steps=1", "train.lr=1e-12", "train.warmup_steps=0"]
            for a in ("--set", s)]
    new = tmp_path / "tuned"
    r = runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out", str(new),
                            "--init-from", str(run), *sets])
    assert r.exit_code == 0, r.output
    assert "weights: from" in r.output and "step_00000006" in r.output
    assert (new / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    source = safetensors.torch.load_file(run / "checkpoints" / "step_00000006" / "model.safetensors")
    tuned = safetensors.torch.load_file(new / "checkpoints" / "step_00000001" / "model.safetensors")
    assert all(torch.allclose(tuned[k], source[k], atol=1e-8) for k in source)   # one step at lr 1e-12 from them
    fresh = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    first = [json.loads(line)["loss"] for line in (new / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)][0]
    assert first < fresh[0] - 0.1   # it starts where the source ended, not from random weights


def test_init_from_refuses_another_architecture_and_a_non_run(run, trained, tmp_path):
    _, corpus = trained
    sets = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]
    err = one_error_line(runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out",
                                             str(tmp_path / "a"), "--init-from", str(run), *sets,
                                             "--set", "model.num_hidden_layers=3"]))
    assert "do not fit this model" in err or "does not fit" in err or "missing" in err
    err = one_error_line(runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out",
                                             str(tmp_path / "b"), "--init-from", str(tmp_path), *sets]))
    assert "not a run directory, checkpoint folder or export" in err
