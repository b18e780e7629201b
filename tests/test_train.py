"""Training and eval end to end on a tiny model and a tiny real-text corpus written to tmp_path."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from k3cli.checkpoint import latest as find_latest_checkpoint
from k3cli.checkpoint import list_checkpoints
from k3cli.cli import app
from k3cli.config import load_config
from k3cli.models.causal_lm import CausalLM
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus
from k3cli.train import TrainingStopped, lr_lambda, param_groups, train

runner = CliRunner()

TINY = TINY_MODEL + TINY_TRAIN


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "cache"))
    return write_corpus(tmp_path)


def tiny_cfg(corpus, *extra, preset="k3-toy"):
    return load_config(preset, overrides=TINY + [f"data.source={corpus}", *extra])


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lr_schedule_warmup_then_cosine():
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert 0.1 < lr_lambda(55, 10, 100, 0.1) < 1.0


def test_no_weight_decay_on_norms_biases_gates_and_attnres_queries():
    cfg = load_config("k3-toy", overrides=TINY, attnres="block")
    model = CausalLM(cfg.model)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert any("A_log" in n for n in nd) and any("dt_bias" in n for n in nd)
    assert any("norm" in n for n in nd)
    assert not any(k in n for n in d for k in ("A_log", "dt_bias", "norm"))
    assert all(model.get_parameter(n).ndim >= 2 for n in d)
    mixer = [n for n, _ in model.named_parameters() if n.startswith("attnres")]
    assert mixer and all(n in nd for n in mixer)


@pytest.mark.parametrize("preset", ["k3-toy", "kda-toy"])
def test_exact_resume_is_bitwise(corpus, tmp_path, preset):
    cfg = tiny_cfg(corpus, preset=preset)
    a = train(cfg, tmp_path / "a", log=lambda m: None)
    train(tiny_cfg(corpus, preset=preset), tmp_path / "b", log=lambda m: None, stop_at=3)
    assert find_latest_checkpoint(tmp_path / "b").name == "step_00000003"
    b = train(tiny_cfg(corpus, preset=preset), tmp_path / "b", resume=True, log=lambda m: None)
    assert a.step == b.step == 6
    ma, mb = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [m["loss"] for m in ma] == [m["loss"] for m in mb]
    assert [m["grad_norm"] for m in ma] == [m["grad_norm"] for m in mb]
    times = [m["time_s"] for m in mb]  # the resumed segment continues the clock of the first
    assert times[0] > 0 and times == sorted(times) and len(times) == 6
    wa = load_file(find_latest_checkpoint(tmp_path / "a") / "model.safetensors")
    wb = load_file(find_latest_checkpoint(tmp_path / "b") / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_resume_after_a_crash_keeps_each_metrics_step_once(corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=5)  # checkpoints at 2 and 4, then 5
    import shutil
    shutil.rmtree(run / "checkpoints" / "step_00000005")  # as if the run died after step 5's metrics
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "loss": 1.0')  # a line cut mid-write
    train(tiny_cfg(corpus), run, resume=True, log=lambda m: None)
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))


def test_run_dir_contents_and_pruning(corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None)
    assert {"config.yaml", "tokenizer.json", "metrics.jsonl", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert [p.name for _, p in list_checkpoints(run)] == ["step_00000004", "step_00000006"]  # keep_last=2
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"loss", "lr", "grad_norm", "moe_imbalance"} <= rows[0].keys()
    assert "val_loss" in rows[2] and "val_loss" in rows[5]
    assert load_config(str(run / "config.yaml")).model.hidden_size == 32


def test_nan_loss_stops_with_code_3_and_keeps_last_checkpoint(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=2)
    good = find_latest_checkpoint(run)
    before = (good / "model.safetensors").read_bytes()
    real_forward = CausalLM.forward

    def poisoned(self, input_ids, labels=None, segments=None):
        out = real_forward(self, input_ids, labels, segments)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(CausalLM, "forward", poisoned)
    with pytest.raises(TrainingStopped) as e:
        train(tiny_cfg(corpus), run, resume=True, log=lambda m: None)
    assert e.value.code == 3 and "non-finite loss" in str(e.value) and good.name in str(e.value)
    assert find_latest_checkpoint(run) == good
    assert (good / "model.safetensors").read_bytes() == before


def test_cli_train_then_eval_json(corpus, tmp_path):
    run = tmp_path / "cli-run"
    args = ["train", "--preset", "k3-toy", "--attnres", "block", "--out", str(run), "--data", str(corpus)]
    for s in TINY:
        args += ["--set", s]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "done: step 6" in r.output
    r = runner.invoke(app, ["eval", "--run", str(run), "--json", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["step"] == 6
    assert math.isfinite(res["val_loss"]) and res["val_loss"] < math.log(300)
    assert 0 < res["unigram_entropy"] < math.log(300)
    assert res["perplexity"] == pytest.approx(math.exp(res["val_loss"]))
    assert res["bits_per_byte"] == pytest.approx(res["val_loss"] / math.log(2) / res["bytes_per_token"])
    # the same run dir without --resume is refused, and nothing in it is touched
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "--resume auto" in one_error_line(runner.invoke(app, args), alone=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


@pytest.mark.parametrize("source,msg", [("/nonexistent/corpus", "does not exist"), ("EMPTY", "empty")],
                         ids=["missing-path", "empty-corpus"])
def test_bad_data_is_one_line_exit_2(tmp_path, source, msg):
    if source == "EMPTY":
        source = tmp_path / "empty"
        source.mkdir()
        (source / "a.txt").write_text("")
    r = runner.invoke(app, ["train", "--preset", "k3-toy", "--data", str(source), "--out", str(tmp_path / "r")]
                      + sum((["--set", s] for s in TINY), []))
    assert msg in one_error_line(r, alone=True).lower()


def test_eval_errors(tmp_path):
    r = runner.invoke(app, ["eval", "--run", str(tmp_path)])
    assert r.exit_code == 2 and "no config.yaml" in r.stderr
    r = runner.invoke(app, ["eval"])
    assert r.exit_code == 2 and "exactly one of --run" in r.stderr


def test_compare_runs_reports_metrics_and_config_diff(corpus, tmp_path):
    from k3cli.study.compare import compare_runs

    train(tiny_cfg(corpus), tmp_path / "a", log=lambda m: None)
    train(tiny_cfg(corpus, "train.lr=0.001"), tmp_path / "b", log=lambda m: None, stop_at=3)
    data = compare_runs([tmp_path / "a", tmp_path / "b"])
    a, b = data["runs"]
    assert (a["steps"], b["steps"]) == (6, 3)
    assert a["val_loss"] == metrics(tmp_path / "a")[-1]["val_loss"]
    assert a["best_val_loss"] == min(r["val_loss"] for r in metrics(tmp_path / "a") if "val_loss" in r)
    assert data["config_diff"] == {"train.lr": [0.003, 0.001]}


def test_cli_compare(corpus, tmp_path):
    train(tiny_cfg(corpus), tmp_path / "a", log=lambda m: None, stop_at=2)
    train(tiny_cfg(corpus, "train.seed=1"), tmp_path / "b", log=lambda m: None, stop_at=2)
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["config_diff"] == {"train.seed": [0, 1]}
    r = runner.invoke(app, ["compare", str(tmp_path / "a"), str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no config.yaml" in r.stderr


def test_resume_refuses_changed_config_and_touches_nothing(corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=2)
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "tokenizer.json")}
    for change in ("model.hidden_size=48", "train.lr=0.03", "train.seq_len=16"):
        with pytest.raises(ValueError, match="cannot resume with a changed") as e:
            train(tiny_cfg(corpus, change), run, resume=True, log=lambda m: None)
        assert change.split("=")[0] in str(e.value)
    assert {p: p.read_bytes() for p in before} == before
    # allowed: more steps; the config records them only after the checkpoint loaded
    res = train(tiny_cfg(corpus, "train.steps=7"), run, resume=True, log=lambda m: None)
    assert res.step == 7 and load_config(str(run / "config.yaml")).train.steps == 7


def test_unverified_newest_checkpoint_is_set_aside_not_deleted(corpus, tmp_path):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=4)
    bad = run / "checkpoints" / "step_00000004"
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (bad / "model.safetensors").write_bytes(bytes(data))
    res = train(tiny_cfg(corpus), run, resume=True, log=lambda m: None)
    assert res.step == 6
    aside = [p.name for p in (run / "checkpoints").iterdir() if ".unverified-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step_00000004")


def test_non_finite_gradient_stops_before_the_update(corpus, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=2)
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: real(params, max_norm) * float("inf"))
    with pytest.raises(TrainingStopped, match="non-finite gradient norm"):
        train(tiny_cfg(corpus), run, resume=True, log=lambda m: None)
    assert find_latest_checkpoint(run).name == "step_00000002"
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_default_run_dirs_never_collide(tmp_path, monkeypatch):
    from k3cli.train import new_run_dir as _new_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20260101-000000")
    a, b = _new_run_dir("k3-toy", "off"), _new_run_dir("k3-toy", "off")
    assert a != b and a.is_dir() and b.is_dir()


def test_ctrl_c_is_one_line_exit_130_and_names_the_checkpoint(corpus, tmp_path, monkeypatch):
    import k3cli.train as train_mod

    run = tmp_path / "run"
    train(tiny_cfg(corpus), run, log=lambda m: None, stop_at=2)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "train", interrupted)
    r = runner.invoke(app, ["train", "--out", str(run), "--resume", "auto"])
    assert r.exit_code == 130
    assert "interrupted" in r.stderr and "step_00000002" in r.stderr and "--resume auto" in r.stderr


def test_error_text_is_not_rich_markup_or_emoji(tmp_path):
    r = runner.invoke(app, ["train", "--data", "hf:x:", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2
    assert "hf:x:" in r.stderr
    assert not (tmp_path / "r").exists()  # nothing written, no empty run left behind
    r = runner.invoke(app, ["layout", "--set", "model.[bold]x=1"])
    assert r.exit_code == 2 and "model.[bold]x" in r.stderr


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, record, step):
        self.calls.append(("log", step, dict(record)))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_logging_records_every_logged_step(corpus, tmp_path, monkeypatch):
    """`--wandb offline`: one init with the resolved config, one log per logged step (the same
    records as metrics.jsonl), finish at the end. A stand-in module replaces the optional package
    (the real one, 0.31 offline, was run by hand: it wrote runs/*/wandb/offline-run-*)."""
    import sys
    import types
    calls = []
    fake = types.ModuleType("wandb")

    def init(project, dir, mode, config):
        calls.append(("init", project, dir, mode, config))
        return _FakeRun(calls)

    fake.init = init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "wb-run"
    args = ["train", "--preset", "k3-toy", "--out", str(run), "--data", str(corpus), "--wandb", "offline"]
    for s in TINY:
        args += ["--set", s]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert calls[0][:4] == ("init", "k3", str(run), "offline")
    assert calls[0][4]["train"]["steps"] == 6 and calls[0][4]["model"]["arch"] == "k3"
    assert calls[-1] == ("finish",)
    logged = [c for c in calls if c[0] == "log"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [c[1] for c in logged] == [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    for (_, _, rec), m in zip(logged, metrics):
        assert rec["loss"] == pytest.approx(m["loss"])
    assert any("val_loss" in rec for _, _, rec in logged)


def test_wandb_missing_is_one_line_exit_2(corpus, tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "wandb", None)   # makes `import wandb` raise ImportError
    run = tmp_path / "wb-missing"
    args = ["train", "--preset", "k3-toy", "--out", str(run), "--data", str(corpus), "--wandb", "offline"]
    for s in TINY:
        args += ["--set", s]
    r = runner.invoke(app, args)
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == ["error: --wandb needs the wandb package: pip install 'k3cli[wandb]'"]
    assert not run.exists()   # checked before any data, model or run-directory work


def test_evaluation_builds_no_autograd_graph():
    """evaluate_loss runs its forwards without autograd (a graph kept per batch grew a 20-batch k3-toy
    evaluation to 11 GB)."""
    from k3cli.models.causal_lm import ModelOutput
    from k3cli.train import evaluate_loss
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, ids, labels=None, segments=None):
            seen.append(torch.is_grad_enabled())
            return ModelOutput(logits=torch.zeros(0), loss=torch.ones((), requires_grad=True) * 2)
    assert evaluate_loss(Probe(), [torch.ones(2, 4, dtype=torch.long)] * 3, torch.device("cpu"), None) == 2.0
    assert seen == [False, False, False]


def test_uncompiled_runs_the_modules_own_forwards_and_restores_the_compiled_ones():
    """`uncompiled` (what a masked evaluation on CUDA runs through): the model in place of its
    compiled form, each unit's compiled forward (parallelize's ddp / fsdp units) set aside for
    the duration and put back afterwards, also when the evaluation raises. Nothing is compiled here:
    torch.compile wraps lazily."""
    from k3cli.distributed import fsdp_units
    from k3cli.distributed.compile import compile_forward as _compile_forward
    from k3cli.distributed.compile import uncompiled
    model = CausalLM(load_config("k3-toy", overrides=TINY_MODEL, attnres="block").model)
    units = fsdp_units(model)
    for u in units:
        _compile_forward(u, "default")
    compiled = {u: u.forward for u in units}
    whole = torch.compile(model)   # as compile_model wraps it, without its global recompile settings
    for forward in (whole, model):
        with uncompiled(forward, model) as f:
            assert f is model
            assert not any("forward" in m.__dict__ for m in model.modules())
            assert all(u.forward.__func__ is type(u).forward for u in units)
        assert all(u.forward is compiled[u] for u in units)
    with pytest.raises(RuntimeError, match="inside"):
        with uncompiled(whole, model):
            raise RuntimeError("inside")
    assert all(u.forward is compiled[u] for u in units)
    wrapper = object()   # a parallel wrapper (DDP) is returned as it is
    with uncompiled(wrapper, model) as f:
        assert f is wrapper


def test_time_limit_stops_with_a_checkpoint_and_the_resume_finishes(corpus, tmp_path):
    run = tmp_path / "run"
    r = train(tiny_cfg(corpus, "train.time_limit_s=1e-6"), run, log=lambda m: None)   # out of time after step 1
    assert r.step == 1 and find_latest_checkpoint(run).name == "step_00000001"
    assert "val_loss" in metrics(run)[0]   # the stop evaluates before its checkpoint
    r = train(tiny_cfg(corpus), run, resume=True, log=lambda m: None)   # time_limit_s may change on resume
    assert r.step == 6 and [m["step"] for m in metrics(run)] == list(range(1, 7))


def test_adamw_betas_and_the_lr_floor_come_from_the_config(corpus, tmp_path):
    cfg = tiny_cfg(corpus, "train.beta1=0.8", "train.beta2=0.9", "train.min_lr_ratio=0.5")
    train(cfg, tmp_path / "run", log=lambda m: None)
    tc = cfg.train
    state = torch.load(find_latest_checkpoint(tmp_path / "run") / "state.pt", weights_only=True)
    assert {tuple(g["betas"]) for g in state["optimizer"]["param_groups"]} == {(0.8, 0.9)}
    # each step logs the rate the scheduler sets for the next one
    lrs = [m["lr"] for m in metrics(tmp_path / "run")]
    assert lrs == pytest.approx([tc.lr * lr_lambda(s, tc.warmup_steps, tc.steps, 0.5) for s in range(1, tc.steps + 1)])
    assert lrs[-1] == pytest.approx(0.5 * tc.lr)


def test_grad_clip_zero_is_off(corpus, tmp_path):
    def weights(clip):
        run = tmp_path / f"clip-{clip}"
        train(tiny_cfg(corpus, f"train.grad_clip={clip}", "train.steps=2"), run, log=lambda m: None)
        return load_file(find_latest_checkpoint(run) / "model.safetensors")

    off, huge, tiny = weights(0), weights(1e9), weights(1e-6)
    assert all(torch.equal(off[k], huge[k]) for k in off)       # a clip that never binds is no clip
    assert any(not torch.equal(off[k], tiny[k]) for k in off)   # and one that binds changes the update
