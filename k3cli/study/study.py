"""`k3 study`: train AttnRes variants of one preset side by side and say whether they differ.

A study directory holds

  study.json          the design: preset, variants, seeds, steps, and every run's resolved config
  configs/NAME.yaml   that config, which `k3 train --preset` reads
  runs/NAME/          an ordinary k3 run directory per variant × seed (NAME = MODE-sSEED)
  logs/NAME.log       that run's `k3 train` output
  summary.json, report.md, loss.png   the results (`k3 study --report DIR` rebuilds them)

The design is controlled: for one seed every variant gets the same data order (the loader is seeded
with train.seed), the same base weights (checked here: AttnRes parameters are built after the base
model and draw from their own stream), the same token budget and the same validation batches.
Runs are `k3 train --resume auto` subprocesses, so a stopped study continues where it stopped.
The statistics are paired over seeds: d_s = L(variant, s) − L(baseline, s), reported as the mean
with a 95 % t interval (docs/math.md §8).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from k3cli.checkpoint import latest
from k3cli.config import ConfigError, dump_config, load_config
from k3cli.study.compare import run_summary
from k3cli.study.stats import interp, mean_std, paired_interval

STUDY_FILE = "study.json"
WEIGHTS_FILE = "base_weights.json"
PROGRESS_EVERY_S = 60.0
# below this many validation points a run's curve says too little for a verdict
MIN_VAL_POINTS = 3


# ---- verdicts -----------------------------------------------------------------------------------

def too_short(steps: int, val_points: int, warmup_steps: int) -> str | None:
    """Why a run is too short for a verdict (it ends inside its warm-up, or has fewer than MIN_VAL_POINTS
    validation points), or None."""
    why = []
    if steps <= warmup_steps:
        why.append(f"ends at step {steps}, inside its {warmup_steps} warm-up steps")
    if val_points < MIN_VAL_POINTS:
        why.append(f"{val_points} validation point{'s' if val_points != 1 else ''}, fewer than {MIN_VAL_POINTS}")
    return "; ".join(why) or None


def verdict(variant: str, baseline: str, iv: dict, short: str | None = None) -> str:
    """One sentence on a paired interval of (variant − baseline) validation loss; `short` (why the runs are
    too short) replaces the verdict with that caveat."""
    m, n = iv["mean"], iv["n"]
    if short:
        return (f"{variant} against {baseline}: no verdict, the runs are too short ({short}); "
                f"the difference was {m:+.4f} over n = {n} seed{'s' if n != 1 else ''}")
    if iv["excludes_zero"] is None:
        return f"{variant}: {m:+.3f} against {baseline} from n = {n} seed; one seed gives no confidence interval"
    if iv["excludes_zero"]:
        side = "lower" if m < 0 else "higher"
        return (f"{variant} is {abs(m):.3f} ± {iv['half_width']:.3f} {side} than {baseline} "
                f"(95 % CI [{iv['low']:+.3f}, {iv['high']:+.3f}], n = {n})")
    return (f"{variant}: no detectable difference from {baseline} ({m:+.3f} ± {iv['half_width']:.3f}, "
            f"95 % CI [{iv['low']:+.3f}, {iv['high']:+.3f}] includes 0, n = {n})")


# ---- the design ----------------------------------------------------------------------------------

def run_name(mode: str, seed: int) -> str:
    return f"{mode}-s{seed}"


def design_study(preset: str, config: str | None, sets: list[str], modes: list[str], n_seeds: int,
                 steps: int | None = None, tokens: int | None = None, device: str | None = None) -> dict:
    """Resolve every variant × seed config. Seeds are train.seed, +1, …; `tokens` becomes the step
    count that reaches it at the preset's batch (rounded up)."""
    if not modes or len(set(modes)) != len(modes):
        raise ConfigError(f"--attnres needs distinct variants, got {','.join(modes) or 'none'}")
    if n_seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {n_seeds}")
    if steps is not None and tokens is not None:
        raise ConfigError("give --steps or --tokens, not both")
    flags = {} if device is None else {"train.device": device}
    base = load_config(preset, config, sets, modes[0], flags)
    per_step = base.train.global_batch_size * base.train.seq_len
    if tokens is not None:
        if tokens < 1:
            raise ConfigError(f"--tokens must be >= 1, got {tokens}")
        steps = math.ceil(tokens / per_step)
    steps = steps or base.train.steps
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    seeds = [base.train.seed + i for i in range(n_seeds)]
    runs = []
    for seed in seeds:   # seed-major: with --parallel J a seed's variants share the machine at once
        for mode in modes:
            cfg = load_config(preset, config, sets, mode, {**flags, "train.seed": seed, "train.steps": steps})
            runs.append({"name": run_name(mode, seed), "mode": mode, "seed": seed, "config": dump_config(cfg)})
    return {"preset": preset, "config": config, "sets": list(sets), "modes": modes, "seeds": seeds,
            "steps": steps, "tokens_per_step": per_step, "tokens_per_run": steps * per_step,
            "machine": _machine(base.train.device), "runs": runs}


def read_design(out: Path) -> dict:
    path = out / STUDY_FILE
    if not path.is_file():
        raise ConfigError(f"not a k3 study directory (no {STUDY_FILE}): {out}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None


def prepare_study(out: Path, design: dict) -> None:
    """Write the design into `out`, or check that the study already there has the same one."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; choose a folder")
    # configs/ alone: a start of this command stopped before its study.json
    if out.is_dir() and not (out / STUDY_FILE).is_file() and any(p.name != "configs" for p in out.iterdir()):
        raise ConfigError(f"{out} is not empty and holds no k3 study; choose a new or empty folder for --out "
                          "(nothing was changed)")
    if (out / STUDY_FILE).is_file():
        old = read_design(out)
        changed = [k for k in ("preset", "config", "sets", "modes", "seeds", "steps") if old.get(k) != design[k]]
        changed += [f"{r['name']} config" for r, o in zip(design["runs"], old.get("runs", []))
                    if r["name"] == o.get("name") and r["config"] != o.get("config")]
        if changed or len(old.get("runs", [])) != len(design["runs"]):
            shown = ", ".join(changed[:3]) or "its runs"
            raise ConfigError(f"{out} holds a study with a different {shown}; continue it with the same "
                              "options, or choose another --out (nothing was changed)")
        return
    from k3cli.files import write_text_atomic

    (out / "configs").mkdir(parents=True, exist_ok=True)
    for r in design["runs"]:
        write_text_atomic(out / "configs" / f"{r['name']}.yaml", r["config"])
    write_text_atomic(out / STUDY_FILE, json.dumps(design, indent=1) + "\n")


def base_weight_digests(out: Path, design: dict) -> dict:
    """Per run: a SHA-256 over the step-0 base-model parameters (everything but the AttnRes mixer),
    built from the run's config file exactly as `k3 train` builds it, and the parameter counts."""
    import torch

    from k3cli.train import build_model

    digests = {}
    for r in design["runs"]:
        model = build_model(load_config(str(out / "configs" / f"{r['name']}.yaml")))
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            if not name.startswith("attnres."):
                h.update(name.encode())
                h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
        digests[r["name"]] = {"base_digest": h.hexdigest(), "parameters": model.num_parameters(),
                              "active_parameters": model.num_active_parameters()}
    return digests


# ---- running -------------------------------------------------------------------------------------

def check_base_weights(out: Path, design: dict, log: Callable[[str], None] = print) -> dict:
    """The digests of `out/base_weights.json`, computed (and written) the first time."""
    from k3cli.files import write_text_atomic

    path = out / WEIGHTS_FILE
    if path.is_file():
        return json.loads(path.read_text())
    log(f"checking step-0 base weights of {len(design['runs'])} runs")
    digests = base_weight_digests(out, design)
    write_text_atomic(path, json.dumps(digests, indent=1) + "\n")
    for seed in design["seeds"]:
        if len({digests[run_name(m, seed)]["base_digest"] for m in design["modes"]}) != 1:
            log(f"warning: seed {seed}: the variants' base weights differ at step 0; the study is not paired")
    return digests


def prepare_shared_data(out: Path, design: dict, log: Callable[[str], None] = print) -> None:
    """Tokenise the corpus once (into the data cache) before the runs start, instead of once per run
    and all at the same time; every run of a study has the same data config."""
    from k3cli.data import prepare_data

    cfg = load_config(str(out / "configs" / f"{design['runs'][0]['name']}.yaml"))
    data = prepare_data(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, progress=log)
    log(f"data: {len(data.train_tokens):,} train / {len(data.val_tokens):,} val tokens "
        f"({design['tokens_per_run'] / max(1, len(data.train_tokens)):.2f} epochs per run)")


def run_state(run_dir: Path, steps: int) -> int:
    """The step of the run's newest complete checkpoint (0 if none); `steps` means finished."""
    ckpt = latest(run_dir, verify=False) if run_dir.is_dir() else None
    return min(steps, int(ckpt.name.split("_")[-1])) if ckpt is not None else 0


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError):
            continue
    return 0


def train_command(out: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "k3cli.cli", "train", "--preset", str(out / "configs" / f"{name}.yaml"),
            "--out", str(out / "runs" / name), "--resume", "auto"]


def run_study(out: Path, design: dict, parallel: int = 1, log: Callable[[str], None] = print,
              threads: int | None = None) -> list[str]:
    """Train every unfinished run, `parallel` at a time; returns the names of runs that failed.

    Each run gets `threads` torch threads (default: the CPU count shared among the parallel runs),
    unless OMP_NUM_THREADS is already set."""
    steps = design["steps"]
    todo, start_step = [], {}
    for r in design["runs"]:
        at = run_state(out / "runs" / r["name"], steps)
        if at >= steps:
            log(f"{r['name']}: finished, skipped")
        else:
            todo.append(r["name"])
            start_step[r["name"]] = at
            if at:
                log(f"{r['name']}: will resume from step {at}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // max(1, parallel))))
    running: dict[str, tuple[subprocess.Popen, object]] = {}
    started: dict[str, float] = {}
    rates: list[float] = []   # steps per second of the runs finished so far, each while sharing the machine
    failed: list[str] = []
    t0 = last_report = time.time()
    try:
        while todo or running:
            while todo and len(running) < parallel:
                name = todo.pop(0)
                f = (out / "logs" / f"{name}.log").open("a")
                running[name] = (subprocess.Popen(train_command(out, name), stdout=f, stderr=subprocess.STDOUT,
                                                  env=env), f)
                started[name] = time.time()
                log(f"{name}: started (log {out / 'logs' / (name + '.log')})")
            time.sleep(0.5)
            for name, (p, f) in list(running.items()):
                if p.poll() is None:
                    continue
                f.close()
                del running[name]
                if p.returncode == 0:
                    rates.append((steps - start_step[name]) / max(time.time() - started[name], 1e-9))
                    log(f"{name}: finished in {time.time() - t0:.0f} s since the study started")
                else:
                    failed.append(name)
                    log(f"{name}: k3 train exited with code {p.returncode}; see {out / 'logs' / (name + '.log')}")
            if running and time.time() - last_report >= PROGRESS_EVERY_S:
                last_report = time.time()
                log(_progress(out, steps, running, started, start_step, todo, rates, parallel,
                              len(design["runs"]) - len(todo) - len(running) - len(failed), len(design["runs"])))
    except KeyboardInterrupt:
        for p, _ in running.values():   # each run stops at its last checkpoint; resume continues it
            p.send_signal(signal.SIGINT)
        for p, f in running.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
            f.close()
        raise
    return failed


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _progress(out: Path, steps: int, running: dict, started: dict, start_step: dict, todo: list, rates: list,
              parallel: int, done: int, total: int) -> str:
    """One progress line: each running run's step and time left at its rate so far, then the study's time
    left at the mean rate of the runs (running with steps done, or finished) times the runs at once."""
    now, parts, known = time.time(), [], list(rates)
    left = sum(steps - start_step[n] for n in todo)
    for n in running:
        at = max(_last_step(out / "runs" / n), start_step[n])
        rate = (at - start_step[n]) / max(now - started[n], 1e-9)
        left += steps - at
        if rate > 0:
            known.append(rate)
        eta = f"about {_duration((steps - at) / rate)} left" if rate > 0 else "time left not known yet"
        parts.append(f"{n} {at}/{steps} ({eta})")
    overall = (f"about {_duration(left / (sum(known) / len(known) * min(parallel, len(running) + len(todo))))} left"
               if known else "time left not known yet")
    return f"progress: {', '.join(parts)}; study: {done}/{total} runs done, {overall}"


# ---- the summary and the report ------------------------------------------------------------------

def summarize(out: Path, design: dict, weights: dict | None = None) -> dict:
    """Every number of the report, from the runs' metrics (finished or not)."""
    modes, steps = design["modes"], design["steps"]
    baseline = "off" if "off" in modes else modes[0]
    runs = {}
    for r in design["runs"]:
        d = out / "runs" / r["name"]
        s = run_summary(d) if (d / "config.yaml").is_file() else None
        warmup = s["config"].get("train.warmup_steps", 0) if s else 0
        runs[r["name"]] = {"mode": r["mode"], "seed": r["seed"], "steps": s["steps"] if s else 0,
                           "finished": bool(s) and s["steps"] >= steps,
                           "too_short": too_short(s["steps"], len(s["val_curve"]), warmup) if s else None,
                           "timed_windows": s["timed_windows"] if s else 0,
                           "val_loss": s["val_loss"] if s else None,
                           "best_val_loss": s["best_val_loss"] if s else None,
                           "tokens_per_s": s["tokens_per_s"] if s else None,
                           "time_s": (s["val_curve"][-1]["time_s"] if s and s["val_curve"] else None),
                           "val_curve": s["val_curve"] if s else [],
                           **((weights or {}).get(r["name"], {}))}
    done = {m: [runs[run_name(m, s)] for s in design["seeds"] if runs[run_name(m, s)]["finished"]]
            for m in modes}
    # seeds where every variant finished: the paired comparisons use these alone
    paired_seeds = [s for s in design["seeds"] if all(runs[run_name(m, s)]["finished"] for m in modes)]

    variants = {}
    for m in modes:
        rs = done[m]
        row = {"finished": len(rs), "parameters": rs[0].get("parameters") if rs else None}
        for key in ("val_loss", "best_val_loss", "tokens_per_s", "time_s"):
            vals = [x[key] for x in rs if x[key] is not None]
            row[key], row[key + "_std"] = mean_std(vals) if vals else (None, None)
        row["flattening"] = _flattening(rs)
        variants[m] = row
    base_tps = variants[baseline]["tokens_per_s"]
    for m in modes:
        tps = variants[m]["tokens_per_s"]
        variants[m]["tokens_per_s_ratio"] = tps / base_tps if tps and base_tps else None

    diffs, at_time = {}, None
    times_known = paired_seeds and all(runs[run_name(m, s)]["time_s"] is not None
                                       for m in modes for s in paired_seeds)
    if times_known:   # the budget of the variant that needs the least time for the full token budget
        t_eq = min(mean_std([runs[run_name(m, s)]["time_s"] for s in paired_seeds])[0] for m in modes)
        at_time = {"time_s": t_eq, "val_loss": {}}
        for m in modes:
            vals = []
            for s in paired_seeds:
                c = runs[run_name(m, s)]["val_curve"]
                vals.append(interp(t_eq, [p["time_s"] for p in c], [p["val_loss"] for p in c]))
            at_time["val_loss"][m] = vals
    for m in modes:
        if m == baseline or len(paired_seeds) < 1:
            continue
        short = next((f"{n}: {runs[n]['too_short']}" for s in paired_seeds for n in (run_name(baseline, s), run_name(m, s))
                      if runs[n]["too_short"]), None)
        d_tok = [runs[run_name(m, s)]["val_loss"] - runs[run_name(baseline, s)]["val_loss"] for s in paired_seeds]
        entry = {"seeds": paired_seeds, "too_short": short,
                 "equal_tokens": {"per_seed": d_tok, **paired_interval(d_tok)}}
        entry["equal_tokens"]["verdict"] = verdict(m, baseline, entry["equal_tokens"], short)
        if at_time is not None:
            d_t = [a - b for a, b in zip(at_time["val_loss"][m], at_time["val_loss"][baseline])]
            entry["equal_time"] = {"per_seed": d_t, **paired_interval(d_t)}
            entry["equal_time"]["verdict"] = verdict(m, baseline, entry["equal_time"], short)
        diffs[m] = entry
    digests = {n: r.get("base_digest") for n, r in runs.items()}
    identical = None
    if weights:
        identical = all(len({digests[run_name(m, s)] for m in modes}) == 1 for s in design["seeds"])
    return {"preset": design["preset"], "modes": modes, "baseline": baseline, "seeds": design["seeds"],
            "steps": steps, "tokens_per_run": design["tokens_per_run"], "sets": design["sets"],
            "base_weights_identical": identical, "machine": design.get("machine", "not recorded"),
            "variants": variants, "differences": diffs, "equal_time": at_time, "runs": runs}


def _flattening(rs: list[dict]) -> dict | None:
    """Mean validation loss at 80 % and at 100 % of the token budget: how much the last fifth still gave."""
    if not rs or len(rs[0]["val_curve"]) < 2:
        return None
    at80, at100 = [], []
    for r in rs:
        c = r["val_curve"]
        toks, vals = [p["tokens"] for p in c], [p["val_loss"] for p in c]
        at80.append(interp(0.8 * toks[-1], toks, vals))
        at100.append(vals[-1])
    a, b = mean_std(at80)[0], mean_std(at100)[0]
    return {"at_80pct": a, "at_100pct": b, "drop": a - b}


def _machine(device: str) -> str:
    """Where the study runs, in words (recorded with the design: reports may be rebuilt elsewhere)."""
    text = f"{platform.machine()}, {os.cpu_count()} CPU cores"
    try:
        import torch

        if device != "cpu" and torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name(0)}"
    except Exception:  # the device name is decoration; the numbers stand without it
        pass
    return text


def _pm(m, s, spec=".4f") -> str:
    if m is None:
        return "-"
    return format(m, spec) + ("" if s is None else f" ± {format(s, spec)}")


def render_report(summary: dict, plot_error: str | None) -> str:
    modes, base = summary["modes"], summary["baseline"]
    n_seeds = len(summary["seeds"])
    lines = [f"# AttnRes study: {summary['preset']}, {' / '.join(modes)}", ""]
    lines += [f"- Design: {n_seeds} seed{'s' if n_seeds > 1 else ''} ({', '.join(map(str, summary['seeds']))}) × "
              f"{len(modes)} variants, {summary['steps']:,} steps = {summary['tokens_per_run']:,} tokens per run"
              + (f"; overrides `{' '.join(summary['sets'])}`" if summary["sets"] else "") + ".",
              "- For one seed every variant sees the same data order, the same validation batches and the "
              "same token budget; base weights at step 0: "
              + {True: "identical across variants (SHA-256 of the shared parameters).",
                 False: "**NOT identical** across variants: the comparison is not paired.",
                 None: "not checked."}[summary["base_weights_identical"]],
              f"- Machine: {summary['machine']}. Runs that share the machine at once also share its speed.", ""]
    unfinished = [n for n, r in summary["runs"].items() if not r["finished"]]
    if unfinished:
        lines += [f"**Unfinished runs** (left out below): {', '.join(unfinished)}. Run the same `k3 study` "
                  "command again to continue them.", ""]
    short: dict[str, list[str]] = {}   # why -> the finished runs too short for that reason
    for n, r in summary["runs"].items():
        if r["finished"] and r.get("too_short"):
            short.setdefault(r["too_short"], []).append(n)
    if short:
        lines += [f"**Too short for a verdict**: a run needs at least {MIN_VAL_POINTS} validation points and to "
                  "end after its learning-rate warm-up. " + " ".join(f"{', '.join(ns)}: {why}." for why, ns in short.items())
                  + " The numbers below describe these runs; they say nothing about the variants. "
                  "Train longer (--steps, --tokens) or evaluate more often (--set train.eval_every=N).", ""]
    lines += ["## Validation loss at equal tokens", "",
              "| variant | runs | parameters | final val loss | best val loss | tokens/s | × " + base
              + " | val loss drop over the last 20 % |", "|---|---|---|---|---|---|---|---|"]
    for m in modes:
        v = summary["variants"][m]
        fl = v["flattening"]
        lines.append(f"| {m} | {v['finished']} | {v['parameters']:,} | {_pm(v['val_loss'], v['val_loss_std'])} | "
                     f"{_pm(v['best_val_loss'], v['best_val_loss_std'])} | {_pm(v['tokens_per_s'], None, ',.0f')} | "
                     f"{_pm(v['tokens_per_s_ratio'], None, '.3f')} | {_pm(fl and fl['drop'], None)} |"
                     if v["parameters"] is not None else f"| {m} | 0 | - | - | - | - | - | - |")
    lines += ["", "Mean ± standard deviation over seeds. tokens/s: the median of each run's logged windows after "
              "its first (which holds the start-up); - where a run logged no window after its first.", ""]
    diffs = summary["differences"]
    if diffs:
        seeds = next(iter(diffs.values()))["seeds"]
        lines += [f"## Paired difference to {base} (final validation loss; negative = lower than {base})", "",
                  "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | 95 % CI |",
                  "|---|" + "---|" * len(seeds) + "---|---|"]
        for m, e in diffs.items():
            t = e["equal_tokens"]
            ci = "-" if t["low"] is None else f"[{t['low']:+.4f}, {t['high']:+.4f}]"
            lines.append(f"| {m} | " + " | ".join(f"{d:+.4f}" for d in t["per_seed"]) + f" | {t['mean']:+.4f} | {ci} |")
        lines += [""]
        if summary["equal_time"] is not None:
            t_eq = summary["equal_time"]["time_s"]
            lines += [f"## At equal wall-clock ({t_eq:,.1f} s of training, the fastest variant's mean time)", "",
                      "| variant | val loss at that time | difference to " + base + " | 95 % CI |", "|---|---|---|---|"]
            for m in modes:
                vals = summary["equal_time"]["val_loss"][m]
                e = diffs.get(m, {}).get("equal_time")
                ci = "-" if not e or e["low"] is None else f"[{e['low']:+.4f}, {e['high']:+.4f}]"
                lines.append(f"| {m} | {_pm(*mean_std(vals))} | {'-' if not e else format(e['mean'], '+.4f')} | {ci} |")
            lines += [""]
        lines += ["## Verdict", ""]
        for e in diffs.values():
            lines.append(f"- At equal tokens: {e['equal_tokens']['verdict']}.")
            if "equal_time" in e:
                lines.append(f"- At equal wall-clock: {e['equal_time']['verdict']}.")
        lines += [""]
    lines += ["## Plot", ""]
    lines += ["![validation loss](loss.png)"] if plot_error is None else [plot_error]
    return "\n".join(lines) + "\n"


def write_report(out: Path, summary: dict) -> Path:
    """summary.json, loss.png (when matplotlib is there) and report.md in `out`."""
    from k3cli.files import write_text_atomic

    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    plot_error = None
    try:
        from k3cli.study.plot import plot_loss

        groups = {m: [summary["runs"][run_name(m, s)]["val_curve"] for s in summary["seeds"]
                      if summary["runs"][run_name(m, s)]["finished"]] for m in summary["modes"]}
        plot_loss({m: g for m, g in groups.items() if g}, summary["baseline"], out / "loss.png",
                  title=f"{summary['preset']}: validation loss over finished seeds (min–max band)")
    except ImportError:
        plot_error = ("No plot: matplotlib is not installed. `pip install 'k3cli[plot]'`, then "
                      f"`k3 study --report {out}` draws loss.png.")
    write_text_atomic(out / "report.md", render_report(summary, plot_error))
    return out / "report.md"
