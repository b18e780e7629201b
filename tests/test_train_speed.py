"""What makes the training step fast and measured: one traced graph per model, activation
checkpointing, the throughput fields of the log, a real offline wandb run, `k3 bench-train`."""

import json

import pytest
import torch
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import load_config
from k3cli.data import EOT_ID
from k3cli.models.causal_lm import CausalLM
from k3cli.ops.transfer import to_device
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import document_segments, train

runner = CliRunner()
BUILDS = [(p, m) for p in ("kda-toy", "k3-toy") for m in ("off", "full", "block")]


def tiny_model(preset, mode, dtype=torch.float32):
    cfg = load_config(preset, overrides=TINY_MODEL, attnres=mode)
    torch.manual_seed(0)
    return CausalLM(cfg.model).to(dtype).train()


@pytest.mark.parametrize("preset,mode", BUILDS)
def test_model_traces_into_one_graph(preset, mode):
    """Forward with the loss: no graph break anywhere (MoE, KDA torch path, MLA, AttnRes)."""
    m = tiny_model(preset, mode)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    explain = torch._dynamo.explain(lambda ids: m(ids, labels=ids).loss)(ids)
    assert explain.graph_break_count == 0, [str(b.reason)[:200] for b in explain.break_reasons]
    assert explain.graph_count == 1


@pytest.mark.parametrize("preset,mode", BUILDS)
def test_activation_checkpointing_keeps_gradients_and_load_counts(preset, mode):
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    out = {}
    for ac in ("none", "block"):
        m = tiny_model(preset, mode, torch.float64)
        m.activation_checkpointing = ac
        loss = m(ids, labels=ids).loss
        loss.backward()
        out[ac] = (loss.detach(), {n: p.grad for n, p in m.named_parameters()},
                   [x.load_counts.clone() for x in m.moe_layers()])
    (la, ga, ca), (lb, gb, cb) = out["none"], out["block"]
    assert torch.equal(la, lb)
    for n in ga:   # fp64: recomputation repeats the same operations, so equal within rounding
        assert torch.allclose(ga[n], gb[n], rtol=1e-12, atol=1e-14), n
    # the recomputed forward does not count the tokens a second time
    assert all(torch.equal(a, b) for a, b in zip(ca, cb))


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path)


def test_log_records_carry_throughput_fields(corpus, tmp_path):
    cfg = load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}",
                                                                    "train.peak_tflops=0.5"])
    train(cfg, tmp_path / "run", log=lambda m: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["data_ms"] >= 0 and r["peak_mem_gb"] > 0
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5, rel=1e-3, abs=1e-5)
        # TFLOP/s = tokens/s × analytic FLOPs per token
        from k3cli.models.flops import flops_per_token

        fpt = flops_per_token(cfg.model, cfg.train.seq_len)["total"]
        assert r["tflops"] == pytest.approx(r["tokens_per_s"] * fpt / 1e12, rel=1e-2, abs=1e-4)


def test_no_mfu_on_cpu_without_a_peak(corpus, tmp_path):
    cfg = load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}"])
    lines = []
    train(cfg, tmp_path / "run", log=lines.append)
    assert any("no MFU" in m and "--peak-tflops" in m for m in lines)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("mfu" not in r and r["tflops"] > 0 for r in rows)


def test_wandb_offline_run_writes_files_and_sends_nothing(corpus, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")   # installed by `make setup` (the wandb extra)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")   # were anything sent, it would fail here
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}"])
    train(cfg, tmp_path / "run", log=lambda m: None, wandb_mode="offline")
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "run").rglob("*"))
    files = {p.name for p in runs[0].rglob("*") if p.is_file()}
    assert any(name.endswith(".wandb") for name in files), files
    assert wandb.run is None   # finished


def test_bench_train_runs_on_cpu():
    r = runner.invoke(app, ["bench-train", "--preset", "kda-toy", "--steps", "2", "--warmup", "1", "--json",
                            *[a for s in TINY_MODEL + ["train.seq_len=32", "train.micro_batch_size=2",
                                                       "train.device=cpu"] for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    row, plain = res["rows"]   # as k3 train runs (the document mask on), then without it
    assert res["device_type"] == "cpu" and res["batch"] == 2 and res["seq_len"] == 32 and res["document_mask"]
    assert row["variant"] == "eager" and row["min_ms"] <= row["step_ms"] <= row["max_ms"]
    assert 0 < row["host_ms"] <= row["max_ms"]   # on a CPU the host runs the whole step
    assert row["tokens_per_s"] == pytest.approx(64 / (row["step_ms"] / 1e3))
    assert row["mfu"] is None and set(res["ratios"]) == {"document_mask_cost"}
    assert plain["variant"] == "no-document-mask" and res["documents_per_row"] > 1
    assert res["ratios"]["document_mask_cost"] == pytest.approx(row["step_ms"] / plain["step_ms"])
    # one variant alone, fed by the training loop's input pipeline
    r = runner.invoke(app, ["bench-train", "--preset", "kda-toy", "--steps", "2", "--warmup", "1", "--json",
                            "--loader", "--variants", "eager", "--set", "data.document_mask=false",
                            *[a for s in TINY_MODEL + ["train.seq_len=32", "train.micro_batch_size=2",
                                                       "train.device=cpu"] for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["loader"] and not res["document_mask"] and [x["variant"] for x in res["rows"]] == ["eager"]
    assert res["ratios"] == {}
    r = runner.invoke(app, ["bench-train", "--preset", "kda-toy", "--variants", "compiled", "--device", "cpu"])
    assert r.exit_code == 2 and "no variant 'compiled'" in r.output
    r = runner.invoke(app, ["bench-train", "--backend", "triton", "--device", "cpu"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.output


@pytest.mark.gpu
@pytest.mark.parametrize("mode,documents", [("off", False), ("block", False), ("block", True)],
                         ids=["off", "block", "block-documents"])
def test_training_step_has_no_host_sync_on_cuda(mode, documents):
    """Forward, backward, clipping and AdamW of k3-toy on the Triton ops, with every device->host
    synchronisation turned into an error; with `documents`, as training runs by default: the document mask
    built from the batch on the host (varlen KDA, FlexAttention, masked short convs). The batch moves as
    the training loop moves it. The first step is unchecked: it compiles and autotunes kernels (FlexAttention's
    Inductor build synchronises); the next two, each on a new batch (new documents), are checked."""
    cfg = load_config("k3-toy", attnres=mode)
    torch.manual_seed(0)
    model = CausalLM(cfg.model).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for step in range(3):
        ids = torch.randint(1, cfg.model.vocab_size, (8, 256))
        ids = torch.where(torch.rand(8, 256) < 4 / 256, EOT_ID, ids)
        torch.cuda.set_sync_debug_mode("error" if step else 0)
        try:
            segments = document_segments(ids, torch.device("cuda"), documents)
            batch = to_device(ids, torch.device("cuda"))   # as the training loop moves each micro-batch
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(batch, labels=batch, segments=segments).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()


def test_bench_train_variants():
    """Each mode timed gets its triton/torch counterpart in the same run (CUDA only: the torch ops are the
    CPU path anyway)."""
    from k3cli.bench.train import plan_variants

    def names(backend, compile, masked=False):
        return [(v.name, v.backend, v.compiled, v.masked) for v in plan_variants(backend, compile, masked)]
    assert names("torch", False) == [("eager", "torch", False, False), ("document-mask", "torch", False, True)]
    assert names("torch", True, True) == [("eager", "torch", False, True), ("compiled", "torch", True, True),
                                          ("no-document-mask", "torch", False, False)]
    assert names("triton", True) == [("eager", "triton", False, False), ("compiled", "triton", True, False),
                                     ("torch-backend", "torch", False, False), ("torch-compiled", "torch", True, False),
                                     ("document-mask", "triton", False, True)]


def test_bench_train_compares_attnres_overlays_in_one_run():
    r = runner.invoke(app, ["bench-train", "--preset", "k3-toy", "--steps", "2", "--warmup", "1", "--json",
                            "--compare-attnres",
                            *[a for s in TINY_MODEL + ["train.seq_len=32", "train.micro_batch_size=2",
                                                       "train.device=cpu"] for a in ("--set", s)]])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["attnres"] == ["off", "full", "block"]
    assert [(row["variant"], row["attnres"]) for row in res["rows"]] == [
        ("eager attnres=off", "off"), ("eager attnres=full", "full"), ("eager attnres=block", "block")]
    by = {row["attnres"]: row["step_ms"] for row in res["rows"]}
    assert set(res["ratios"]) == {"eager_full_vs_off", "eager_block_vs_off"}
    assert res["ratios"]["eager_block_vs_off"] == pytest.approx(by["off"] / by["block"])
    r = runner.invoke(app, ["bench-train", "--compare-attnres", "--attnres", "block", "--device", "cpu"])
    assert r.exit_code == 2 and "leave out --attnres" in r.output


def test_throughput_leaves_out_evaluation_and_checkpoints(corpus, tmp_path, monkeypatch):
    """A log window's step time counts training steps only: here every evaluation and every checkpoint moves
    the loop's clock on by 1,000 s, which must not reach step_ms or tokens/s. (A skewed clock, not a sleep:
    a real pause of a second was within reach of a step's own time on a loaded 2-core machine.)"""
    import time as time_mod
    from types import SimpleNamespace

    import k3cli.train.loop as train_mod
    skew = [0.0]
    monkeypatch.setattr(train_mod, "time", SimpleNamespace(
        time=lambda: time_mod.time() + skew[0], perf_counter=time_mod.perf_counter, strftime=time_mod.strftime))

    def slow(fn):
        def wrapped(*a, **k):
            skew[0] += 1000.0
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(train_mod, "evaluate_loss", slow(train_mod.evaluate_loss))
    monkeypatch.setattr(train_mod.checkpoint, "save", slow(train_mod.checkpoint.save))
    cfg = load_config("k3-toy", overrides=TINY_MODEL + TINY_TRAIN + [f"data.source={corpus}", "train.eval_every=2",
                                                                    "train.log_every=2", "train.ckpt_every=2"])
    train(cfg, tmp_path / "run", log=lambda m: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "step_ms" in r]
    assert len(logged) >= 2 and all("val_loss" in r for r in logged)
    assert skew[0] >= 2000.0 * (len(logged) - 1)   # an evaluation and a checkpoint before every later window
    # leaked, 2,000 s over a window of 2 steps would add 1,000,000 ms to each step
    assert all(r["step_ms"] < 60_000 for r in logged), [r["step_ms"] for r in logged]
    assert rows[-1]["time_s"] >= 2000.0   # the run's own clock did see the skew


def _profile_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_step_groups_kernels_by_component():
    """scripts/profile_step.py's grouping of CUDA kernel names, on names a compiled k3 step produces."""
    component = _profile_script().component
    assert component("_kda_bwd_kside_kernel") == "KDA kernels (ours)"
    assert component("merge_bwd_kernel") == component("phase1_bwd_kernel") == "AttnRes kernels (ours)"
    assert component("triton_poi_fused__to_copy_add_attnres_merge_bwd_view_21") == "Inductor fused kernels"
    assert component("triton_tem_fused_0_flex_attention") == "attention (SDPA / FlexAttention)"
    assert component("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention (SDPA / FlexAttention)"
    assert component("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNN") == "matrix products"
    assert component("void at::native::sbtopk::gatherTopK<float>") == "gathers, scatters, sorts"
    assert component("something_else") == "other"


def test_profile_step_leaves_out_annotations():
    """The optimizer's region is reported as a device event spanning kernels already counted: not a kernel."""
    from types import SimpleNamespace
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key="_kda_fwd_state_kernel", device_type=cuda, is_user_annotation=False),
              SimpleNamespace(key="Optimizer.step#AdamW.step", device_type=cuda, is_user_annotation=False),
              SimpleNamespace(key="my_region", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(key="aten::mm", device_type=cpu, is_user_annotation=False)]
    assert [e.key for e in _profile_script().kernel_events(events)] == ["_kda_fwd_state_kernel"]


def test_profile_step_runs_on_cpu():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_step.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--batch", "2", "--seq-len", "32", "--attnres",
                        "off", "block", "--steps", "1", "--warmup", "1", "--top", "3", "--matmuls", "4",
                        "--document-mask", "--host", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for mode in ("off", "block"):
        assert f"== k3-toy attnres={mode} B2 T32 eager, document mask" in r.stdout
    assert r.stdout.count("kernels/step") == 2 and r.stdout.count("run ahead, one batch kept on the device:") == 2
    assert r.stdout.count("run ahead, a fresh batch each step from the loop's input pipeline:") == 2
    assert "garbage collection" in r.stdout
    assert r.stdout.count("matrix-product ops:") == 2 and "aten::mm " in r.stdout


def test_time_attnres_forms_runs_on_cpu():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "time_attnres_forms.py"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "--batch", "2", "--seq-len", "32", "--steps",
                        "2", "--warmup", "1", "off", "block:two_phase+model.fp32_residual=false"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    table = r.stdout.split("tokens/s\n", 1)[1].splitlines()
    rows = {line.split()[0]: line.split() for line in table if line.strip()}
    assert set(rows) == {"off", "block:two_phase+model.fp32_residual=false"} and rows["off"][4] == "1.000"
    r = subprocess.run([sys.executable, str(script), "--device", "cpu", "off:fused"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "has no mixer" in r.stderr
