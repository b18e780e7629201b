"""Checkpoints: exact round trip (weights, tied weights, AdamW, LambdaLR, loader, RNG), atomicity
under interrupted saves, corruption detection, no overwrite, pruning, tidying what killed saves and
prunes leave behind."""
import json
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.torch
import torch
from torch import nn

from k3cli.checkpoint import (
    MARKER,
    MODEL_FILE,
    CheckpointError,
    is_complete,
    list_checkpoints,
    remove_leftovers,
)
from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.checkpoint import load as load_checkpoint
from k3cli.checkpoint import prune as prune_checkpoints
from k3cli.checkpoint.single import save as save_checkpoint
from k3cli.data import PackedLoader


class Tiny(nn.Module):
    """Embedding tied to the output head, so the state dict holds one tensor under two names."""

    def __init__(self, vocab: int = 32, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, ids):  # ids [B, T] -> loss
        logits = self.head(self.mlp(self.emb(ids))) * self.scale  # [B, T, vocab]
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    loader = PackedLoader(np.arange(2000, dtype=np.uint16) % 32, seq_len=9, batch_size=4, seed=1)
    return model, opt, sched, loader


def train(model, opt, sched, loader, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        ids = next(loader)
        # dropout-like randomness drawn from every RNG the checkpoint must restore
        noise = torch.rand(()) * 1e-3 + random.random() * 1e-3 + np.random.rand() * 1e-3
        loss = model(ids) + noise
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_round_trip_continues_identically(tmp_path):
    model, opt, sched, loader = setup()
    train(model, opt, sched, loader, 3)
    path = save_checkpoint(tmp_path, 3, model, opt, sched, loader.state_dict(), {"tokens_seen": 108})
    assert path == tmp_path / "checkpoints" / "step_00000003" and is_complete(path)
    expected = train(model, opt, sched, loader, 4)

    model2, opt2, sched2, loader2 = setup(seed=123)  # different init, fresh optimizer state
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    info = load_checkpoint(find_latest_checkpoint(tmp_path), model2, opt2, sched2)
    loader2.load_state_dict(info["loader"])
    assert info["step"] == 3 and info["extra"] == {"tokens_seen": 108}
    assert sched2.last_epoch == 3 and model2.head.weight is model2.emb.weight
    assert train(model2, opt2, sched2, loader2, 4) == expected


def test_tied_weights_stored_once(tmp_path):
    model = setup()[0]
    path = save_checkpoint(tmp_path, 1, model)
    keys = set(safetensors.torch.load_file(path / MODEL_FILE))
    assert len(keys & {"emb.weight", "head.weight"}) == 1 and "scale" in "".join(keys)
    info = load_checkpoint(path, Tiny())
    assert info["loader"] is None and info["step"] == 1


def test_wrong_model_is_one_clear_line(tmp_path):
    path = save_checkpoint(tmp_path, 1, setup()[0])
    with pytest.raises(CheckpointError, match="do not fit this model") as e:
        load_checkpoint(path, Tiny(vocab=40))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("failure", ["raise-after-model", "tmp-dir-left", "no-marker", "truncated",
                                     "bit-flip", "bad-marker-json"])
def test_interrupted_or_corrupt_save_is_ignored(tmp_path, monkeypatch, failure):
    model, opt, sched, loader = setup()
    good = save_checkpoint(tmp_path, 10, model, opt, sched, loader.state_dict())
    if failure == "raise-after-model":
        def boom(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr("k3cli.checkpoint.single.torch.save", boom)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path, 20, model, opt, sched, loader.state_dict())
        assert not (tmp_path / "checkpoints" / "step_00000020").exists()
        assert list((tmp_path / "checkpoints").glob("step_00000020.tmp-*"))
    else:
        bad = save_checkpoint(tmp_path, 20, model, opt, sched, loader.state_dict())
        if failure == "tmp-dir-left":
            bad.rename(bad.with_name("step_00000030.tmp-999"))
        elif failure == "no-marker":
            (bad / MARKER).unlink()
        elif failure == "truncated":
            data = (bad / MODEL_FILE).read_bytes()
            (bad / MODEL_FILE).write_bytes(data[:len(data) // 2])
        elif failure == "bit-flip":
            data = bytearray((bad / MODEL_FILE).read_bytes())
            data[-1] ^= 0xFF
            (bad / MODEL_FILE).write_bytes(bytes(data))
        else:
            (bad / MARKER).write_text("{not json")
    assert find_latest_checkpoint(tmp_path) == good
    if failure not in ("raise-after-model", "tmp-dir-left"):
        with pytest.raises(CheckpointError, match="not a complete checkpoint"):
            load_checkpoint(tmp_path / "checkpoints" / "step_00000020", Tiny())


class _InterruptedFile:
    """A file whose third write stores part of its bytes and then gets a Ctrl-C, as a SIGINT that lands
    inside torch.save's write of a file object does."""

    def __init__(self, f):
        self._f, self._writes = f, 0

    def write(self, data):
        self._writes += 1
        if self._writes == 3:
            self._f.write(bytes(data)[:10])
            raise KeyboardInterrupt
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_ctrl_c_inside_torch_save_is_an_interrupt(tmp_path, monkeypatch):
    """torch.save's zip writer raises a RuntimeError over the interrupt when it closes: the save re-raises
    the interrupt (the CLI's exit 130), not the writer's error, and leaves no checkpoint of that step."""
    model, opt, sched, loader = setup()
    good = save_checkpoint(tmp_path, 10, model, opt, sched, loader.state_dict())
    real_save = torch.save
    monkeypatch.setattr("k3cli.checkpoint.single.torch.save", lambda obj, f: real_save(obj, _InterruptedFile(f)))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 20, model, opt, sched, loader.state_dict())
    assert not (tmp_path / "checkpoints" / "step_00000020").exists()
    assert find_latest_checkpoint(tmp_path) == good


def test_no_checkpoint_and_no_overwrite(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None and list_checkpoints(tmp_path) == []
    model = setup()[0]
    path = save_checkpoint(tmp_path, 5, model)
    before = json.loads((path / MARKER).read_text())
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        save_checkpoint(tmp_path, 5, model)
    assert json.loads((path / MARKER).read_text()) == before


@pytest.mark.parametrize("keep_last", [1, 2, 3, 10])
def test_prune_keeps_last_k(tmp_path, keep_last):
    model = setup()[0]
    paths = [save_checkpoint(tmp_path, s, model) for s in (100, 200, 300, 400, 500)]
    shutil.copytree(paths[0], tmp_path / "checkpoints" / "step_00000050.tmp-1")  # not ours to judge
    removed = prune_checkpoints(tmp_path, keep_last)
    kept = [p for _, p in list_checkpoints(tmp_path)]
    assert kept == paths[-min(keep_last, 5):] and removed == paths[:-min(keep_last, 5)]
    assert (tmp_path / "checkpoints" / "step_00000050.tmp-1").is_dir()


def test_prune_never_deletes_newest_verified(tmp_path):
    model = setup()[0]
    paths = [save_checkpoint(tmp_path, s, model) for s in (1, 2)]
    data = bytearray((paths[1] / MODEL_FILE).read_bytes())
    data[-1] ^= 0xFF  # same size: only the checksum notices
    (paths[1] / MODEL_FILE).write_bytes(bytes(data))
    prune_checkpoints(tmp_path, keep_last=1)
    assert paths[0].is_dir() and find_latest_checkpoint(tmp_path) == paths[0]


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_saves_and_prunes_are_tidied(tmp_path):
    model = setup()[0]
    ckpts = tmp_path / "checkpoints"
    good = save_checkpoint(tmp_path, 1, model)
    dead, live = dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cut = shutil.copytree(good, ckpts / f"step_00000002.tmp-{dead}")   # killed while writing
        (cut / MODEL_FILE).write_bytes(b"half")
        unpublished = shutil.copytree(good, ckpts / f"step_00000003.tmp-{dead}-1234")   # killed before the rename
        marker = json.loads((good / MARKER).read_text())
        (unpublished / MARKER).write_text(json.dumps({**marker, "step": 3}))
        taken = shutil.copytree(good, ckpts / f"step_00000001.tmp-{dead}")   # complete, but its step exists
        shutil.copytree(good, ckpts / f"step_00000000.deleting-{dead}")   # a prune killed mid-delete
        in_flight = shutil.copytree(cut, ckpts / f"step_00000004.tmp-{live.pid}")   # another process is saving
        foreign = [shutil.copytree(cut, ckpts / name) for name in ("step_00000005.tmp-x", "step_00000006.unverified-1",
                                                                   "backup.tmp-1", "step_00000007")]
        done = remove_leftovers(tmp_path)
    finally:
        live.kill()
        live.wait()
    assert done == {ckpts / f"step_00000000.deleting-{dead}": "deleted", cut: "deleted", unpublished: "published"}
    assert is_complete(ckpts / "step_00000003") and find_latest_checkpoint(tmp_path) == ckpts / "step_00000003"
    assert all(p.is_dir() for p in [good, taken, in_flight, *foreign])
    assert remove_leftovers(tmp_path) == {in_flight: "deleted"}   # its process has gone since


def test_a_prune_killed_mid_delete_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    model = setup()[0]
    paths = [save_checkpoint(tmp_path, s, model) for s in (1, 2, 3)]
    real_rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        (path / MODEL_FILE).unlink()   # part of the folder is gone when the kill lands
        raise KeyboardInterrupt

    monkeypatch.setattr("k3cli.checkpoint.folder.shutil.rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, keep_last=1)
    monkeypatch.setattr("k3cli.checkpoint.folder.shutil.rmtree", real_rmtree)
    assert [p for _, p in list_checkpoints(tmp_path)] == paths[1:]   # no half folder under a step name
    assert all(is_complete(p) for p in paths[1:])
    save_checkpoint(tmp_path, 4, model)   # this process's own leftover: deleted by its next save
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000002", "step_00000003", "step_00000004"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_round_trip_restores_device_state_and_rng(tmp_path):
    model, opt, sched, loader = setup()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(next(loader).cuda())
    loss.backward()
    opt.step()
    path = save_checkpoint(tmp_path, 1, model, opt, None, loader.state_dict())
    expected = torch.rand(4, device="cuda")
    model2 = Tiny().cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    load_checkpoint(path, model2, opt2)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    assert all(s["exp_avg"].is_cuda for s in opt2.state.values())
    assert torch.equal(model2.emb.weight, model.emb.weight)


def test_checkpoint_with_numpy_rng_array_from_older_versions_still_loads(tmp_path, monkeypatch):
    import k3cli.checkpoint.single as ck

    def old_rng_state():  # the format written before the RNG key became a tensor
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    monkeypatch.setattr(ck, "_rng_state", old_rng_state)
    model = setup()[0]
    np.random.seed(5)
    path = save_checkpoint(tmp_path, 1, model)
    expected = np.random.rand()
    np.random.seed(0)
    load_checkpoint(path, setup()[0])
    assert np.random.rand() == expected
