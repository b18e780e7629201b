"""The training loop's input pipeline and host-sync-free steps: the same batches, losses and weights as a
synchronous loop, exact resume with rare reads, a diverging run stopped with finite checkpoints only, and
(GPU) steady-state steps without a single device-to-host synchronisation."""
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import k3cli.train.loop as loop_mod
from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.checkpoint import list_checkpoints
from k3cli.cli import app
from k3cli.config import load_config
from k3cli.data import DataError, PackedLoader, prepare_data
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import (
    Prefetcher,
    build_model,
    build_optimizer,
    document_segments,
    evaluate_loss,
    train,
)
from k3cli.train.batches import make_parts, pack

runner = CliRunner()
# reads (log, eval, checkpoint) at steps 5, 7, 10, 14, 15, 20: most steps are not read when they end
RARE_READS = ["train.steps=20", "train.log_every=7", "train.eval_every=10", "train.ckpt_every=5", "train.keep_last=5"]


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path)


def cfg_of(corpus, preset, *extra):
    return load_config(preset, overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}", *RARE_READS, *extra])


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_prefetcher_gives_the_loader_batches_and_the_consumed_position():
    tokens = (np.arange(4000) * 7) % 50
    feed, ref = Prefetcher(PackedLoader(tokens, 10, 4, seed=3), 50, True, torch.device("cpu"), depth=3), \
        PackedLoader(tokens, 10, 4, seed=3)
    try:
        for _ in range(40):   # past an epoch (100 windows)
            batch, ids = feed.next_batch(), next(ref)
            assert torch.equal(batch.ids, ids)
            assert torch.equal(batch.segments.cu_seqlens, document_segments(ids, None, True).cu_seqlens)
            assert feed.loader_state == ref.state_dict()   # the batch consumed, not those queued ahead
    finally:
        feed.close()


class _WhereLoader(PackedLoader):
    """A loader whose state also says which process drew the batch and with how many torch threads."""

    def state_dict(self):
        return {**super().state_dict(), "pid": os.getpid(), "threads": torch.get_num_threads()}


def test_batches_are_made_in_a_worker_process_on_one_torch_thread():
    """The batches are made in another process (no interpreter lock shared with the launching thread), whose
    torch ops use one intra-op thread (no second OpenMP team spinning beside the step's)."""
    before = torch.get_num_threads()
    feed = Prefetcher(_WhereLoader((np.arange(4000) * 7) % 50, 10, 4, seed=3), 50, True, torch.device("cpu"))
    try:
        states = [(feed.next_batch(), feed.loader_state)[1] for _ in range(3)]
    finally:
        feed.close()
    assert {s["pid"] for s in states} != {os.getpid()} and len({s["pid"] for s in states}) == 1
    assert {s["threads"] for s in states} == {1}
    assert torch.get_num_threads() == before


def test_the_worker_outlives_a_signal_to_the_process_group():
    """Ctrl-C or a scheduler's SIGTERM reaches the worker too; the loop decides how the run stops (after the
    step's checkpoint), so the worker ignores both and keeps making batches."""
    import signal
    import time

    feed, ref = Prefetcher(PackedLoader((np.arange(4000) * 7) % 50, 10, 4, seed=3), 50, True, torch.device("cpu")), \
        PackedLoader((np.arange(4000) * 7) % 50, 10, 4, seed=3)
    try:
        assert torch.equal(feed.next_batch().ids, next(ref))
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(feed._proc.pid, sig)
        time.sleep(0.5)
        assert feed._proc.is_alive()
        for _ in range(10):   # past the slots filled before the signals
            assert torch.equal(feed.next_batch().ids, next(ref))
    finally:
        feed.close()
    assert not feed._proc.is_alive()


def test_a_batch_too_large_for_its_slot_arrives_whole():
    """Every token a document of its own: the layouts outgrow the slot, and the batch comes through the queue."""
    tokens = np.zeros(4000, dtype=np.int64)   # all EOT: every position starts a document
    feed, ref = Prefetcher(PackedLoader(tokens, 10, 4, seed=3), 50, True, torch.device("cpu"),
                           chunk_sizes=[16]), PackedLoader(tokens, 10, 4, seed=3)
    try:
        for _ in range(3):
            batch, ids = feed.next_batch(), next(ref)
            assert pack(make_parts(ids, 50, True, [16])[0], feed._slots[0]) is None   # it does not fit a slot
            assert torch.equal(batch.ids, ids)
            assert torch.equal(batch.segments.cu_seqlens, document_segments(ids, None, True).cu_seqlens)
    finally:
        feed.close()


def test_prefetcher_raises_a_bad_batch_where_it_is_due():
    tokens = np.full(400, 7)
    tokens[250:260] = 99   # window 25 of 40, in the second batch of the first epoch's order or later
    loader = PackedLoader(tokens, 10, 4, seed=0)
    order = loader._order().tolist()
    bad_batch = next(i for i in range(10) if 25 in order[4 * i:4 * i + 4])
    feed = Prefetcher(loader, 50, False, torch.device("cpu"))
    for _ in range(bad_batch):
        feed.next_batch()
    with pytest.raises(DataError, match="token id 99"):
        feed.next_batch()


class _FailingLoader(PackedLoader):
    def __next__(self):
        if self.position >= 2 * self.batch_size:   # the third batch
            raise RuntimeError("injected failure (test)")
        return super().__next__()


def test_the_worker_error_comes_after_the_batches_made_before_it_even_once_the_worker_is_gone():
    """The worker fails at its third batch and exits; the loop, still holding the first, gets the second and
    then that error (not a broken pipe from handing a slot back to a worker that is gone)."""
    import time

    feed = Prefetcher(_FailingLoader((np.arange(4000) * 7) % 50, 10, 4, seed=3), 50, True, torch.device("cpu"))
    try:
        feed.next_batch()
        deadline = time.time() + 10
        while feed._proc.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        assert not feed._proc.is_alive()
        feed.next_batch()
        with pytest.raises(RuntimeError, match="injected failure"):
            feed.next_batch()
    finally:
        feed.close()


def reference_run(cfg):
    """The loop as a plain synchronous one (each micro-batch read, cut and moved in place, the step's
    scalars read at once): its per-step losses, validation losses and final weights."""
    tc = cfg.train
    torch.manual_seed(tc.seed)
    data = prepare_data(cfg.data, cfg.model.vocab_size, tc.seq_len)
    model = build_model(cfg).train()
    opt, sched = build_optimizer(model, cfg)
    loader = data.train_loader(tc.micro_batch_size, seed=tc.seed, rows_per_step=tc.global_batch_size)
    val = data.val_batches(cfg.eval.batches, cfg.eval.batch_size)
    accum, moe = tc.global_batch_size // tc.micro_batch_size, model.moe_layers()
    losses, val_losses = [], {}
    for step in range(1, tc.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64)
        for _ in range(accum):
            ids = next(loader)
            out = model(ids, labels=ids, segments=document_segments(ids, None, cfg.data.document_mask))
            (out.loss / accum).backward()
            loss += out.loss.detach().float().double() / accum
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        losses.append(round(loss.item(), 6))
        assert torch.isfinite(norm)
        opt.step()
        sched.step()
        for m in moe:
            m.update_bias()
        if step % tc.eval_every == 0:
            val_losses[step] = round(evaluate_loss(model, val, torch.device("cpu"), None,
                                                   document_mask=cfg.data.document_mask), 6)
    return losses, val_losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["k3-toy", pytest.param("kda-toy", marks=pytest.mark.slow)])
def test_loop_is_bitwise_the_synchronous_loop_and_resumes_exactly(corpus, tmp_path, preset):
    cfg = cfg_of(corpus, preset)
    losses, val_losses, weights = reference_run(cfg)
    train(cfg_of(corpus, preset), tmp_path / "a", log=lambda m: None)
    train(cfg_of(corpus, preset), tmp_path / "b", log=lambda m: None, stop_at=10)
    train(cfg_of(corpus, preset), tmp_path / "b", resume=True, log=lambda m: None)
    for run in ("a", "b"):
        rows = metrics(tmp_path / run)
        assert [r["step"] for r in rows] == list(range(1, 21))
        assert [r["loss"] for r in rows] == losses, run
        assert {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} == val_losses, run
        saved = load_file(find_latest_checkpoint(tmp_path / run) / "model.safetensors")
        for k, w in saved.items():
            assert torch.equal(w, weights[k]), (run, k)


def test_a_diverging_run_exits_3_and_leaves_only_finite_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--preset", "kda-toy", "--out", str(out), "--data", str(corpus)]
    # lr 30 diverges at step 6 here (reads at 4 and 8): the update of step 6 and later is skipped on the device
    for s in TINY_MODEL + TINY_TRAIN + ["train.steps=40", "train.log_every=9", "train.ckpt_every=4",
                                        "train.eval_every=0", "train.keep_last=20", "train.lr=30",
                                        "train.warmup_steps=0", "train.grad_clip=0"]:
        args += ["--set", s]
    r = runner.invoke(app, args)
    assert r.exit_code == 3, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "non-finite" in lines[0], r.stderr
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    ckpts = list_checkpoints(out)
    assert ckpts and all(s < step for s, _ in ckpts) and f"step_{ckpts[-1][0]:08d}" in lines[0]
    for _, path in ckpts:
        assert all(torch.isfinite(t).all() for t in load_file(path / "model.safetensors").values()), path
    assert [r["step"] for r in metrics(out)] == list(range(1, step))   # every step before the bad one


@pytest.mark.gpu
def test_prefetcher_on_a_gpu_gives_the_loader_batches_and_their_layouts():
    """On a GPU the loop copies each batch straight from its page-locked slot and hands the slot back once
    the copy has run: 60 batches through 7 slots, each equal to the loader's, with the layout the op would make."""
    from k3cli.ops.kda import varlen

    tokens = torch.randint(0, 50, (40_000,)).numpy()
    tokens[::37] = 0
    dev = torch.device("cuda")
    feed, ref = Prefetcher(PackedLoader(tokens, 64, 8, seed=3), 50, True, dev, depth=4, chunk_sizes=[64]), \
        PackedLoader(tokens, 64, 8, seed=3)
    try:
        for _ in range(60):
            batch, ids = feed.next_batch(), next(ref)
            seg = document_segments(ids, dev, True)
            assert batch.ids.is_cuda and torch.equal(batch.ids.cpu(), ids)
            assert torch.equal(batch.segments.cu_seqlens, seg.cu_seqlens)
            assert torch.equal(batch.segments.doc, seg.doc) and torch.equal(batch.segments.pos, seg.pos)
            made, fresh = varlen.varlen_layout(seg.cu_seqlens, 64, dev), varlen._make_layout(seg.cu_seqlens.long(), 64, dev)
            assert all(torch.equal(a, b) for a, b in zip(made[:5], fresh[:5])) and made[5:] == fresh[5:]
    finally:
        feed.close()


@pytest.mark.gpu
def test_steady_state_steps_never_synchronise_the_host(tmp_path, monkeypatch):
    """22 steps of the real loop (k3-toy, document mask, the Triton ops, eager) with every device-to-host
    synchronisation an error after the first two steps (kernel autotuning); the one read, at the end,
    is allowed."""
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path)
    cfg = load_config("k3-toy", overrides=[f"data.source={corpus}", "train.steps=22", "train.log_every=22",
                                           "train.eval_every=0", "train.ckpt_every=0", "train.device=cuda"])
    calls, step_call, read = [0], loop_mod.TrainStep.__call__, loop_mod.StepRecords.read

    def step(self, next_batch):
        calls[0] += 1
        torch.cuda.set_sync_debug_mode("error" if calls[0] > 2 else 0)
        return step_call(self, next_batch)

    def reading(self):
        torch.cuda.set_sync_debug_mode(0)
        return read(self)

    monkeypatch.setattr(loop_mod.TrainStep, "__call__", step)
    monkeypatch.setattr(loop_mod.StepRecords, "read", reading)
    try:
        res = train(cfg, tmp_path / "run", log=lambda m: None)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert res.step == 22 and calls[0] == 22
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, 23))


def test_the_worker_makes_each_batch_document_layout_before_its_step(corpus, tmp_path, monkeypatch):
    """The KDA layers' chunk-aligned layout of a batch's documents is made by the batch worker, ahead: the
    training steps ask for one in every KDA layer and find every one made."""
    from k3cli.ops.kda import torch_chunk, varlen

    asked, made_here, kept = [0], [], []
    lookup, make, keep = torch_chunk.varlen_layout, varlen._make_layout, varlen.keep_layout

    def counting(*a):
        asked[0] += 1
        return lookup(*a)

    monkeypatch.setattr(torch_chunk, "varlen_layout", counting)
    monkeypatch.setattr(varlen, "_make_layout", lambda *a: made_here.append(a) or make(*a))
    monkeypatch.setattr(varlen, "keep_layout", lambda *a: kept.append(a) or keep(*a))
    varlen._MADE.clear()
    train(cfg_of(corpus, "k3-toy", "train.steps=6", "train.eval_every=0"), tmp_path / "run", log=lambda m: None)
    assert asked[0] > 0 and len(kept) >= 12   # 6 steps of 2 micro-batches, and those made ahead
    assert not made_here                       # none made by the training process
