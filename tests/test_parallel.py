"""Multi-process training pieces (k3cli.distributed, k3cli.checkpoint) on CPU with gloo.

Quick cases run in this process. The `slow` ones start 2 ranks with torchrun (this file is the
worker script: `python -m torch.distributed.run ... tests/test_parallel.py SCENARIO OUT`) and compare
what the ranks dump against a 1-process run done here.

Tolerances, fp32, 3 AdamW steps at lr 1e-2 (scaled max error of the parameters):
- TOL_SAME_GROUPS = 5e-6 (seen: 5e-7) against 1 process that accumulates the same 2-row groups the
  ranks compute: only the summation order of the gradient reduction differs (rank partial sums
  averaged by gloo instead of added one after the other in one process);
- TOL_FULL_BATCH = 1e-4 (seen: 2e-5) against 1 process on the full 4-row micro-batches, which is
  also what 1 process gets when it splits the same rows into 2-row micro-batches: the mean over 4
  rows and the matmuls of another shape round differently (~1e-10 absolute in the gradients), and
  Adam's first updates lr·g/(|g|+eps) amplify that for elements with |g| near eps = 1e-8 (slope
  lr/(4·eps) = 2.5e5 there).
Routing (top-k) and the MoE loads are integers, so the router biases are compared exactly.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3cli import checkpoint
from k3cli.checkpoint import CheckpointError
from k3cli.checkpoint import sharded as dc
from k3cli.checkpoint.single import save as save_checkpoint
from k3cli.distributed import (
    DistInfo,
    all_reduce_mean,
    all_reduce_moe_loads,
    all_reduce_sum_,
    barrier,
    broadcast_object,
    clip_grad_norm_,
    grad_sync,
    init_distributed,
    is_distributed,
    parallelize,
    resolve_parallel,
    shard_batch,
)

STEPS, ACCUM, ROWS, SEQ = 3, 2, 4, 32   # per step: ACCUM global micro-batches of ROWS rows
TOL_SAME_GROUPS, TOL_FULL_BATCH = 5e-6, 1e-4
WORLD = 2


# ---- a tiny model, its optimizer, its batches, and the training step every run shares ------------

def tiny_model(seed: int = 0, attnres: str = "off"):
    from k3cli.config import load_config
    from k3cli.models.causal_lm import CausalLM
    from k3cli.testing import TINY_MODEL

    # the torch KDA path whatever TRITON_INTERPRET says: both runs compute the same way, fast
    cfg = load_config("k3-toy", overrides=TINY_MODEL + ["model.kda.backend=torch", f"model.attnres.mode={attnres}"])
    torch.manual_seed(seed)
    return CausalLM(cfg.model)


def optimizer_for(model):
    from k3cli.train import lr_lambda, param_groups

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 1, 10, 0.1))
    return opt, sched


def batches(steps: int = STEPS, seed: int = 123) -> torch.Tensor:
    """[steps, ACCUM, ROWS, SEQ] token ids: the global micro-batches of every step."""
    return torch.randint(300, (steps, ACCUM, ROWS, SEQ), generator=torch.Generator().manual_seed(seed))


def same_groups(data: torch.Tensor, world: int = WORLD) -> torch.Tensor:
    """The batches as 1 process accumulating the ranks' row groups: micro-batch i's rows of rank r
    become micro-batch (i, r), [steps, ACCUM·world, ROWS/world, SEQ]."""
    s, a, r, t = data.shape
    return data.reshape(s, a * world, r // world, t)


def train_steps(module, model, opt, sched, data, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """The training loop's step on this rank's rows; returns each step's local MoE loads [layers, E]
    (before they are summed over ranks)."""
    loads = []
    for step in data:
        opt.zero_grad(set_to_none=True)
        for i, ids in enumerate(step):
            ids = shard_batch(ids, rank, world)
            with grad_sync(module, enabled=i == len(step) - 1):
                (module(ids, labels=ids).loss / len(step)).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        loads.append(torch.stack([m.load_counts.clone() for m in model.moe_layers()]))
        all_reduce_moe_loads(model)
        opt.step()
        sched.step()
        for m in model.moe_layers():
            m.update_bias()
    return loads


def biases(model) -> torch.Tensor:
    return torch.stack([m.router_bias.detach().cpu().clone() for m in model.moe_layers()])


def assert_state_close(actual: dict, expected: dict, tol: float, what: str) -> None:
    from k3cli.testing import assert_close

    assert set(actual) == set(expected), f"{what}: names differ: {set(actual) ^ set(expected)}"
    for name, t in expected.items():
        assert_close(f"{what} {name}", actual[name].float(), t.float(), tol)


def full_optim_state(model, opt) -> dict:
    """{fqn.key: full tensor} of an optimizer (plain or FSDP2): one flat dict to compare."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {f"{fqn}.{k}": v.detach().cpu().clone() for fqn, st in osd.get("state", {}).items()
            for k, v in st.items() if isinstance(v, torch.Tensor)}


def full_params(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


# ---- quick: one process ----------------------------------------------------------------------------

def test_shard_batch_gives_every_row_to_exactly_one_rank():
    batch = torch.arange(12 * 3).view(12, 3)
    for world in (1, 2, 3, 4, 6, 12):
        parts = [shard_batch(batch, r, world) for r in range(world)]
        assert all(p.shape == (12 // world, 3) for p in parts)
        assert torch.equal(torch.cat(parts), batch)        # contiguous, in order, nothing dropped or repeated
    with pytest.raises(ValueError, match="do not split evenly"):
        shard_batch(batch, 0, 5)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="not in"):
            shard_batch(batch, bad, 2)


def test_resolve_parallel():
    assert resolve_parallel("auto", 1) == "none"
    assert resolve_parallel("auto", 8) == "fsdp"
    for mode in ("ddp", "fsdp"):
        assert resolve_parallel(mode, 1) == mode and resolve_parallel(mode, 4) == mode
    assert resolve_parallel("none", 1) == "none"
    with pytest.raises(ValueError, match="independent copies"):
        resolve_parallel("none", 2)
    with pytest.raises(ValueError, match="unknown train.parallel"):
        resolve_parallel("tp", 2)


def test_one_process_without_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed("cpu")
    assert info == DistInfo(0, 1, 0, torch.device("cpu")) and info.is_main and not is_distributed()
    t = torch.tensor([1.0, 2.0])
    assert all_reduce_sum_(t) is t and t.tolist() == [1.0, 2.0]
    assert all_reduce_mean(torch.tensor([3, 4])).tolist() == [3.0, 4.0]
    assert broadcast_object({"a": 1}) == {"a": 1}
    barrier()
    model = tiny_model()
    all_reduce_moe_loads(model)
    assert parallelize(model, "none", torch.device("cpu")) is model
    with pytest.raises(RuntimeError, match="needs a process group"):
        parallelize(model, "fsdp", torch.device("cpu"))
    with grad_sync(model, enabled=False):   # a plain module: nothing to switch off
        pass


def test_one_process_fsdp_and_ddp_write_the_sharded_format(tmp_path, monkeypatch):
    """A 1-process ddp / fsdp run (a group of one, no torchrun) trains like the plain model and its
    checkpoint is the DCP format, readable after the group is gone."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plain = tiny_model()
    opt, sched = optimizer_for(plain)
    train_steps(plain, plain, opt, sched, batches(2))
    info = init_distributed("cpu", single_process_group=True)
    try:
        assert is_distributed() and info.world_size == 1 and info.is_main
        for mode in ("ddp", "fsdp"):
            model = tiny_model()
            module = parallelize(model, mode, info.device)
            opt, sched = optimizer_for(model)
            train_steps(module, model, opt, sched, batches(2))
            assert_state_close(full_params(model), plain.state_dict(), TOL_SAME_GROUPS, f"1-process {mode}:")
            path = dc.save(tmp_path / mode, 2, module, opt, sched, {"epoch": 0, "position": 2})
            assert checkpoint.is_sharded(path) and checkpoint.is_complete(path) and checkpoint.latest(tmp_path / mode) == path
        saved = full_params(model)
    finally:
        from k3cli.distributed import destroy

        destroy()
    assert not is_distributed()
    for mode in ("ddp", "fsdp"):
        fresh = tiny_model(seed=4)
        dc.load_weights(tmp_path / mode / "checkpoints" / "step_00000002", fresh)
        assert_state_close(fresh.state_dict(), plain.state_dict(), TOL_SAME_GROUPS, f"{mode} checkpoint:")
    assert_state_close(fresh.state_dict(), saved, 0.0, "fsdp checkpoint = its weights")


def trained(steps: int = 2, seed: int = 0):
    model = tiny_model(seed)
    opt, sched = optimizer_for(model)
    train_steps(model, model, opt, sched, batches(steps))
    return model, opt, sched


def test_dcp_one_process_round_trip_and_exact_resume(tmp_path):
    """save_dcp / load_dcp without a process group; continuing from it matches continuing in memory."""
    model, opt, sched = trained()
    loader = {"epoch": 0, "position": 5}
    torch.manual_seed(7)
    path = dc.save(tmp_path, 2, model, opt, sched, loader, extra={"val_loss": 1.5})
    assert path.name == "step_00000002" and checkpoint.is_sharded(path) and checkpoint.is_complete(path)
    marker = __import__("json").loads((path / "COMPLETE").read_text())
    assert marker["format"] == "dcp" and marker["world_size"] == 1 and marker["step"] == 2
    assert {".metadata", "state.pt", "__0_0.distcp"} <= set(marker["files"])
    rng_after_save = torch.rand(3)

    model2 = tiny_model(seed=1)
    opt2, sched2 = optimizer_for(model2)
    state = dc.load(path, model2, opt2, sched2)
    assert state["step"] == 2 and state["loader"] == loader and state["extra"] == {"val_loss": 1.5}
    assert torch.equal(torch.rand(3), rng_after_save)                  # RNG restored to the save's
    assert_state_close(model2.state_dict(), model.state_dict(), 0.0, "weights")
    assert_state_close(full_optim_state(model2, opt2), full_optim_state(model, opt), 0.0, "optimizer")
    assert sched2.last_epoch == sched.last_epoch
    more = batches(4)[2:]
    train_steps(model, model, opt, sched, more)
    train_steps(model2, model2, opt2, sched2, more)
    assert_state_close(model2.state_dict(), model.state_dict(), 0.0, "after resume")

    with pytest.raises(CheckpointError, match="already exists"):
        dc.save(tmp_path, 2, model, opt, sched, loader)


def test_temp_and_damaged_folders_are_never_picked(tmp_path):
    model, opt, sched = trained(steps=1)
    good = dc.save(tmp_path, 1, model, opt, sched, {})
    later = dc.save(tmp_path, 2, model, opt, sched, {})
    # an interrupted save of step 3: complete-looking files, but under its temp name
    shutil.copytree(later, tmp_path / "checkpoints" / "step_00000003.tmp-99-1")
    assert checkpoint.latest(tmp_path) == later
    # a shard of step 2 changed after its marker was written: not complete any more
    shard = later / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not checkpoint.is_complete(later) and checkpoint.is_sharded(later) and checkpoint.is_complete(later, verify=False)
    assert checkpoint.latest(tmp_path) == good
    with pytest.raises(CheckpointError, match="not a complete"):
        dc.load(later, tiny_model())
    with pytest.raises(CheckpointError, match="not a complete"):
        dc.load_weights(tmp_path / "checkpoints" / "step_00000003.tmp-99-1", tiny_model())


def test_both_formats_list_find_and_prune_together(tmp_path):
    model, opt, sched = trained(steps=1)
    single = [save_checkpoint(tmp_path, s, model, opt, sched, {}) for s in (1, 2)]
    sharded = [dc.save(tmp_path, s, model, opt, sched, {}) for s in (3, 4)]
    assert checkpoint.latest(tmp_path) == sharded[-1]
    assert all(checkpoint.is_complete(p) for p in single + sharded)
    assert not checkpoint.is_sharded(single[0]) and checkpoint.is_sharded(sharded[0])
    assert checkpoint.prune(tmp_path, keep_last=2, newest=sharded[-1]) == single
    assert checkpoint.prune(tmp_path, keep_last=1) == sharded[:1]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000004"]


def test_export_and_model_only_loads_without_a_process_group(tmp_path):
    model, opt, sched = trained(steps=1)
    sharded = dc.save(tmp_path, 1, model, opt, sched, {})
    single = save_checkpoint(tmp_path / "single", 1, model, opt, sched, {})
    want = model.state_dict()
    for path in (sharded, single):
        assert_state_close(checkpoint.load_full_model_state(path), want, 0.0, f"full state of {path.name}")
    fresh = tiny_model(seed=5)
    assert dc.load_weights(sharded, fresh) == {"step": 1, "loader": {}, "extra": {}, "path": sharded}
    assert_state_close(fresh.state_dict(), want, 0.0, "model only")
    out = checkpoint.export_consolidated(sharded, tmp_path / "export")
    import safetensors.torch

    assert_state_close(safetensors.torch.load_file(str(out)), want, 0.0, "export")
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.export_consolidated(sharded, tmp_path / "export")
    from k3cli.config import load_config
    from k3cli.models.causal_lm import CausalLM
    from k3cli.testing import TINY_MODEL

    other = CausalLM(load_config("k3-toy", overrides=TINY_MODEL + ["model.hidden_size=48"]).model)
    with pytest.raises(CheckpointError, match="shape"):
        dc.load_weights(sharded, other)


# ---- slow: 2 ranks under torchrun ----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, out: Path, world: int = WORLD, timeout: int = 240) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", __file__, scenario, str(out)]
    t = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun {scenario} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    print(f"{scenario}: {world} ranks in {time.time() - t:.1f} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.slow
def test_two_ranks_fsdp_ddp_checkpoints(tmp_path):
    data = batches(STEPS + 1)
    # the 1-process reference on the full batches
    ref = tiny_model()
    opt, sched = optimizer_for(ref)
    ref_loads = train_steps(ref, ref, opt, sched, data[:STEPS])
    single = save_checkpoint(tmp_path / "single", STEPS, ref, opt, sched, {"epoch": 0, "position": 3})
    single_dcp = dc.save(tmp_path / "single_dcp", STEPS, ref, opt, sched, {"epoch": 0, "position": 3})
    ref_params, ref_biases, ref_optim = ref.state_dict(), biases(ref), full_optim_state(ref, opt)

    grouped = tiny_model()
    opt_g, sched_g = optimizer_for(grouped)
    train_steps(grouped, grouped, opt_g, sched_g, same_groups(data[:STEPS]))

    res = run_ranks("main", tmp_path)

    for mode in ("fsdp", "ddp"):
        # same parameters as the 1-process runs, and router biases equal on both ranks and to them
        assert_state_close(res[0][mode]["params"], grouped.state_dict(), TOL_SAME_GROUPS, f"{mode} vs same groups:")
        assert_state_close(res[0][mode]["params"], ref_params, TOL_FULL_BATCH, f"{mode} vs full batch:")
        for r in range(WORLD):
            assert torch.equal(res[r][mode]["biases"], ref_biases), f"{mode} rank {r} router biases"
        local = [torch.stack(res[r][mode]["loads"]) for r in range(WORLD)]
        assert torch.equal(local[0] + local[1], torch.stack(ref_loads))     # all_reduce = the global loads
        assert not torch.equal(local[0], local[1])                          # which no rank has alone

    # 2-rank FSDP DCP checkpoint, read in this process without a process group
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{STEPS:08d}"
    marker = __import__("json").loads((ckpt / "COMPLETE").read_text())
    assert marker["world_size"] == WORLD and {"__0_0.distcp", "__1_0.distcp"} <= set(marker["files"])
    assert not is_distributed()
    saved = res[0]["fsdp"]["params"]
    plain = tiny_model(seed=9)
    dc.load_weights(ckpt, plain)
    assert_state_close(plain.state_dict(), saved, 0.0, "2-rank DCP -> 1 process (model only)")
    resumed = tiny_model(seed=9)
    opt1, sched1 = optimizer_for(resumed)
    state = checkpoint.load(ckpt, resumed, opt1, sched1)
    assert state["step"] == STEPS and state["loader"] == {"epoch": 0, "position": 3}
    assert_state_close(resumed.state_dict(), saved, 0.0, "2-rank DCP -> 1 process")
    assert_state_close(full_optim_state(resumed, opt1), res[0]["fsdp"]["optim"], 0.0, "optimizer 2 -> 1")
    # one more step here = the ranks' step 4 on their halves
    train_steps(resumed, resumed, opt1, sched1, same_groups(data[STEPS:]))
    assert_state_close(res[0]["fsdp"]["params_after"], resumed.state_dict(), TOL_SAME_GROUPS, "step after resume")

    # the marker appeared only after the slow rank had written its shard
    assert res[1]["marker_while_writing"] is False
    assert res[1]["marker_mtime"] >= res[1]["shard_mtime"]
    # a save whose rank 1 fails: both ranks raise, nothing under the final name, the temp folder is removed
    assert all(r["failed_save_raised"] for r in res)
    assert not (tmp_path / "run" / "checkpoints" / "step_00000099").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("step_00000099.tmp-*"))
    assert checkpoint.latest(tmp_path / "run") == ckpt

    # 1-process checkpoints of both formats into 2-rank FSDP and DDP: weights, optimizer, schedule equal
    for name in ("single_fsdp", "single_ddp", "single_dcp_fsdp", "single_dcp_ddp"):
        assert_state_close(res[0][name]["params"], ref_params, 0.0, f"{name} -> 2 ranks")
        assert_state_close(res[0][name]["optim"], ref_optim, 0.0, f"{name} optimizer -> 2 ranks")
        assert all(r[name]["step"] == STEPS and r[name]["lr"] == sched.get_last_lr() for r in res)
    assert single.is_dir() and single_dcp.is_dir()

    # AttnRes on (and recomputed in backward): attn and ffn sharded one by one, the pre-norms with the root
    attnres = tiny_model(attnres="block")
    opt_a, sched_a = optimizer_for(attnres)
    train_steps(attnres, attnres, opt_a, sched_a, same_groups(data[:STEPS]))
    assert_state_close(res[0]["fsdp_attnres"]["params"], attnres.state_dict(), TOL_SAME_GROUPS, "fsdp attnres:")
    assert all(torch.equal(r["fsdp_attnres"]["biases"], biases(attnres)) for r in res)


@pytest.mark.slow
def test_two_ranks_fsdp_with_compiled_blocks(tmp_path):
    """Compiled blocks under FSDP2: the same parameters as eager in 1 process up to Inductor's fused
    reductions (another summation order, amplified by Adam as described above: TOL_FULL_BATCH), no
    `_orig_mod` in the names, and one graph per block on each rank (no fallback to eager)."""
    data = batches(2)
    ref = tiny_model()
    opt, sched = optimizer_for(ref)
    train_steps(ref, ref, opt, sched, same_groups(data))
    res = run_ranks("compile", tmp_path)
    assert all(r["names_ok"] and r["graphs"] == 2 for r in res), [(r["names_ok"], r["graphs"]) for r in res]
    assert_state_close(res[0]["params"], ref.state_dict(), TOL_FULL_BATCH, "compiled fsdp vs eager 1 process:")


# ---- the ranks' side -----------------------------------------------------------------------------

@contextlib.contextmanager
def _write_hooked(hook):
    """Inside, DCP's FileSystemWriter.write_data runs `hook()` before writing."""
    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        hook()
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data
    try:
        yield
    finally:
        dcp.FileSystemWriter.write_data = original


def _scenario_main(info: DistInfo, out: Path) -> dict:
    rank, world = info.rank, info.world_size
    data = batches(STEPS + 1)
    res = {}
    for mode in ("fsdp_attnres", "ddp", "fsdp"):
        model = tiny_model(attnres="block" if mode == "fsdp_attnres" else "off")
        # AttnRes run also recomputes its sublayers in backward (activation checkpointing)
        model.activation_checkpointing = "block" if mode == "fsdp_attnres" else "none"
        module = parallelize(model, mode.split("_")[0], info.device)
        opt, sched = optimizer_for(model)
        loads = train_steps(module, model, opt, sched, data[:STEPS], rank, world)
        res[mode] = {"loads": loads, "biases": biases(model), "params": full_params(model)}
    res["fsdp"]["optim"] = full_optim_state(model, opt)

    def slow_rank1():   # rank 1 writes late and looks for a marker before writing
        if rank == 1:
            time.sleep(1.0)
            res["marker_while_writing"] = any((out / "run" / "checkpoints").rglob("COMPLETE"))

    with _write_hooked(slow_rank1):
        path = dc.save(out / "run", STEPS, module, opt, sched, {"epoch": 0, "position": 3},
                           extra={"train_loss": 1.0})
    res["shard_mtime"] = (path / f"__{rank}_0.distcp").stat().st_mtime_ns
    res["marker_mtime"] = (path / "COMPLETE").stat().st_mtime_ns

    def failing_rank1():
        if rank == 1:
            raise OSError("disk full (test)")

    with _write_hooked(failing_rank1):
        try:
            dc.save(out / "run", 99, module, opt, sched, {})
            res["failed_save_raised"] = False
        except CheckpointError:
            res["failed_save_raised"] = True
    barrier()
    train_steps(module, model, opt, sched, data[STEPS:], rank, world)
    res["fsdp"]["params_after"] = full_params(model)

    for name in ("single", "single_dcp"):
        for mode in ("fsdp", "ddp"):
            model = tiny_model(seed=3)
            module = parallelize(model, mode, info.device)
            opt, sched = optimizer_for(model)
            state = checkpoint.load(checkpoint.latest(out / name), module, opt, sched)
            res[f"{name}_{mode}"] = {"step": state["step"], "params": full_params(model),
                                     "optim": full_optim_state(model, opt), "lr": sched.get_last_lr()}
    return res


def _scenario_compile(info: DistInfo, out: Path) -> dict:
    model = tiny_model()
    module = parallelize(model, "fsdp", info.device, compile_mode="default")
    names_ok = not any("_orig_mod" in n for n, _ in model.named_parameters())
    opt, sched = optimizer_for(model)
    train_steps(module, model, opt, sched, batches(2), info.rank, info.world_size)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"names_ok": names_ok, "graphs": graphs, "params": full_params(model)}


def _worker(scenario: str, out: Path) -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu", timeout_s=120)
    assert info.world_size == int(os.environ["WORLD_SIZE"]) and is_distributed()
    try:
        res = {"main": _scenario_main, "compile": _scenario_compile}[scenario](info, out)
        torch.save(res, out / f"rank{info.rank}.pt")
        barrier()
    finally:
        from k3cli.distributed import destroy

        destroy()


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))


def test_one_process_fsdp_trains_the_kimi_linear_options_like_the_plain_model(monkeypatch):
    """FSDP2 units with every Kimi Linear option on (softplus gate, direct query and shared key, full-width
    grouped experts, a dense first block) step like the plain model."""
    from k3cli.config import load_config
    from k3cli.models.causal_lm import CausalLM
    from k3cli.testing import KIMI_TINY as KIMI

    def kimi_model():
        torch.manual_seed(0)
        return CausalLM(load_config("k3-toy", overrides=KIMI + ["model.kda.backend=torch"]).model)

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    plain = kimi_model()
    opt, sched = optimizer_for(plain)
    train_steps(plain, plain, opt, sched, batches(2))
    info = init_distributed("cpu", single_process_group=True)
    try:
        model = kimi_model()
        module = parallelize(model, "fsdp", info.device)
        opt, sched = optimizer_for(model)
        train_steps(module, model, opt, sched, batches(2))
        assert_state_close(full_params(model), plain.state_dict(), TOL_SAME_GROUPS, "1-process fsdp, Kimi options:")
    finally:
        from k3cli.distributed import destroy

        destroy()
