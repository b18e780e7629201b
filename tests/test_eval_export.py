"""`k3 export` and `k3 eval` check what they read: export refuses weights that do not fit the run's config
(nothing written)."""
import json
import os
import shutil

import pytest
import safetensors.torch
from typer.testing import CliRunner

from k3cli.checkpoint import MARKER, MODEL_FILE, _sha256
from k3cli.cli import app
from k3cli.config import dump_config, load_config
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus

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
