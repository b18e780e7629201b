"""Rich rendering of command results (tables only; the numbers come from plain functions)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from k3cli.models.layout import human


def print_layout(console: Console, data: dict, title: str) -> None:
    ar = data["attnres"]
    mode = ar["mode"] + (f", S={ar['block_size']}" if ar["mode"] == "block" else "")
    table = Table(title=f"{title}: {data['arch']} model, {data['num_hidden_layers']} blocks, AttnRes {mode}")
    for col, just in (("block", "right"), ("attention", "left"), ("FFN", "left"),
                      ("sublayers", "left"), ("AttnRes group", "left"), ("params", "right")):
        table.add_column(col, justify=just)
    for r in data["blocks"]:
        kind = r["attn"].upper()
        style = "bold yellow" if kind == "MLA" else "cyan"
        table.add_row(str(r["index"]), f"[{style}]{kind}[/]", "MoE" if r["ffn"] == "moe" else "SwiGLU",
                      f"{r['attn_sublayer']}, {r['ffn_sublayer']}",
                      f"{r['attn_group']}, {r['ffn_group']}", human(r["params"]))
    console.print(table)
    console.print(f"pattern: {data['pattern']}")
    for kind, line in data.get("components", {}).items():
        console.print(f"  {dict(kda='KDA', mla='MLA', moe='MoE', swiglu='dense FFN')[kind]}: {line}", highlight=False)
    p = data["params"]
    console.print(f"parameters: total {human(p['total'])} ({p['total']:,}), "
                  f"active per token {human(p['active'])} ({p['active']:,})")
    console.print(f"  embedding {human(p['embedding'])}, lm_head {human(p['lm_head'])}, "
                  f"blocks {human(p['blocks'])}, attnres {human(p['attnres'])}")


def print_eval(console: Console, res: dict) -> None:
    table = Table(title=f"eval: {res['checkpoint']} (step {res['step']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("validation loss (nats/token)", f"{res['val_loss']:.4f}")
    table.add_row("unigram entropy of the val set (baseline)", f"{res['unigram_entropy']:.4f}")
    table.add_row("perplexity", f"{res['perplexity']:.2f}")
    table.add_row("bits per byte", f"{res['bits_per_byte']:.4f}")
    table.add_row("bytes per token", f"{res['bytes_per_token']:.3f}")
    table.add_row("tokens", f"{res['tokens']:,}")
    table.add_row(f"tokens/s ({res['device']})", f"{res['tokens_per_s']:,.0f}")
    console.print(table)


def print_verify(console: Console, rows: list[tuple], title: str) -> None:
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=title)
    # the tolerance bounds the relative RMS error, so it stands beside it; max abs err is for information
    for col, just in (("kernel", "left"), ("output / gradient", "left"), ("rel RMS err", "right"),
                      ("rel RMS tol", "right"), ("", "left"), ("max abs err (info)", "right")):
        table.add_column(col, justify=just)
    for kernel, name, rel, mx, tol, ok in rows:
        table.add_row(kernel, name, f"{rel:.2e}", f"{tol:.1e}", "[green]pass[/]" if ok else "[red]FAIL[/]", f"{mx:.2e}")
    console.print(table)
    n_ok = sum(1 for r in rows if r[5])
    console.print(f"{n_ok} passed, {len(rows) - n_ok} failed (pass: rel RMS err ≤ rel RMS tol; max abs err is "
                  "not bounded)")


def _fmt(v, spec: str) -> str:
    if v is None:
        return "-"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


BENCH_WIDTH = 100


def print_bench(console: Console, results: dict[str, list[dict]], wide: bool = False) -> None:
    """One table per kernel: the main columns in BENCH_WIDTH characters (those empty in every row left out, and
    fla's published figures where fla was timed), or with `wide` every column at whatever width that takes."""
    from k3cli.bench.kernels import BENCH_COLUMNS, BENCH_COLUMNS_NARROW, BENCH_INSTEAD

    for kernel, rows in results.items():
        if not rows:
            continue
        cols = (BENCH_COLUMNS if wide else BENCH_COLUMNS_NARROW).get(kernel) or [
            (k, k, "" if not isinstance(v, float) else ".4g") for k, v in rows[0].items()
            if not isinstance(v, (dict, list))]
        if not wide:
            filled = {k for r in rows for k, v in r.items() if v is not None}
            cols = [c for c in cols if c[0] in filled and BENCH_INSTEAD.get(c[0]) not in filled]
        table = Table(title=kernel)
        for _, header, _ in cols:
            table.add_column(header, justify="right")
        for r in rows:
            table.add_row(*[_fmt(r.get(key), spec) for key, _, spec in cols])
        # wide: as wide as the table (nothing cut); else BENCH_WIDTH, or a narrower terminal's width
        width = Measurement.get(console, console.options.update_width(10**4), table).maximum if wide else BENCH_WIDTH
        out = console if console.is_terminal and not wide and console.width < width else Console(width=width)
        out.print(table)
    if set(results) & {"chunk_kda", "decode", "attnres"}:   # the kernels with fla columns
        console.print("fla† = flash-linear-attention's published H200 figures, not measured in this run; "
                      "fla without † was timed in this run.")


def print_compare(console: Console, data: dict) -> None:
    if not console.is_terminal:
        console = Console(width=160)
    def f(v, spec=".4f"):
        return "-" if v is None else format(v, spec)

    table = Table(title="runs")
    for col in ("run", "steps", "train loss", "val loss", "best val (step)", "tokens/s (median)"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in data["runs"]:
        best = "-" if r["best_val_loss"] is None else f"{r['best_val_loss']:.4f} ({r['best_val_step']})"
        table.add_row(r["run"], str(r["steps"]), f(r["train_loss"]), f(r["val_loss"]), best,
                      f(r["tokens_per_s"], ",.0f"))
    console.print(table)
    if data["config_diff"]:
        diff = Table(title="config differences")
        diff.add_column("key")
        for i in range(len(data["runs"])):
            diff.add_column(f"run {i + 1}")
        for key, values in data["config_diff"].items():
            diff.add_row(key, *[str(v) for v in values])
        console.print(diff)
    else:
        console.print("configs are identical")
    console.print("tokens/s: the median of each run's logged windows after its first (which holds the start-up); "
                  "- where a run logged only one", highlight=False)


def print_bench_train(console: Console, res: dict) -> None:
    if not console.is_terminal:
        console = Console(width=160)
    title = (f"bench-train on {res['device']}: batch {res['batch']} × {res['seq_len']} tokens, "
             f"{res['steps']} timed steps after {res['warmup']} warm-up")
    table = Table(title=title)
    for col in ("variant", "step ms (median)", "min–max ms", "host ms", "tokens/s", "TFLOP/s", "MFU",
                "peak mem GB", "× eager"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in res["rows"]:
        table.add_row(f"{r['variant']} ({r['backend']})", f"{r['step_ms']:.2f}",
                      f"{r['min_ms']:.2f}–{r['max_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tflops']:.4g}",
                      "-" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%", f"{r['peak_mem_gb']:.2f}",
                      f"{r['speedup_vs_eager']:.3f}")
    console.print(table)
    console.print(f"{res['flops_per_token'] / 1e6:.2f} MFLOP per token (forward+backward, analytic); "
                  + (f"MFU against {res['peak_tflops']:g} TFLOP/s ({res['peak_source']})" if res["peak_tflops"]
                     else "no MFU: no peak known for this device (give --peak-tflops)"))
    for k, v in res["ratios"].items():
        if k == "document_mask_cost":
            console.print(f"document mask ({res['documents_per_row']:.1f} documents per row): step time "
                          f"{v:.3f}× eager's")
            continue
        console.print(f"{k.replace('_vs_', ' / ')}: {v:.3f}× faster" if v >= 1 else
                      f"{k.replace('_vs_', ' / ')}: {v:.3f}× ({1 / v:.2f}× slower)")
    if res["device_type"] != "cpu":
        console.print("host ms: the median time until the step call returned, from an idle GPU (the host's "
                      "time to enqueue the step); near the step time, the step is host-bound", highlight=False)
    if res["device_type"] == "cpu":
        console.print(f"[yellow]CPU figures ({res['threads']} threads; peak memory is the process's peak RSS), "
                      "not GPU figures.[/]")


def make_logger(progress):
    """Log lines go through the progress bar's console when there is one (so the bar stays put)."""
    def log(msg: str) -> None:
        if progress is not None:
            progress.console.print(msg, highlight=False)
        else:
            print(msg, flush=True)
    return log


class TrainProgress:
    """A Rich progress bar with loss and tokens/s, used when stdout is a terminal."""

    def __init__(self, console: Console):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.console = console
        self._p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                           TimeRemainingColumn(), console=console)
        self._task = None

    def start(self, total: int, completed: int = 0) -> None:
        self._p.start()
        self._task = self._p.add_task("train", total=total, completed=completed, loss="-", tps="-")

    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        fields = {} if loss is None else {"loss": f"{loss:.4f}"}
        if tokens_per_s is not None:
            fields["tps"] = f"{tokens_per_s:.0f}"
        self._p.update(self._task, completed=step, **fields)

    def stop(self) -> None:
        self._p.stop()


class PrepareProgress:
    """`k3 data prepare`'s bar: documents, tokens, MB/s of source text and the time left."""

    def __init__(self, console: Console):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(TextColumn("[bold]prepare"), BarColumn(), TextColumn("{task.fields[docs]} documents"),
                           TextColumn("{task.fields[tokens]} tokens"), TextColumn("{task.fields[rate]} MB/s"),
                           TimeRemainingColumn(), console=console, transient=False)
        self._task, self._t0 = None, 0.0

    def start(self, documents: int, nbytes: int) -> None:
        self._p.start()
        self._t0 = time.perf_counter()
        self._task = self._p.add_task("prepare", total=nbytes, docs=f"0/{documents:,}", tokens="0", rate="-")
        self._docs = documents

    def update(self, documents: int, tokens: int, nbytes: int) -> None:
        rate = nbytes / 1e6 / max(time.perf_counter() - self._t0, 1e-9)
        self._p.update(self._task, completed=nbytes, docs=f"{documents:,}/{self._docs:,}", tokens=f"{tokens:,}",
                       rate=f"{rate:.1f}")

    def stop(self) -> None:
        self._p.stop()


PREPARE_LOG_EVERY_S = 10.0


class PrepareLog:
    """`k3 data prepare`'s progress off a terminal (logs, Slurm): a line every PREPARE_LOG_EVERY_S seconds
    of encoding, in place of the bar."""

    def __init__(self, log):
        self._log, self._every = log, PREPARE_LOG_EVERY_S
        self._t0 = self._last = 0.0
        self._docs = self._bytes = 0

    def start(self, documents: int, nbytes: int) -> None:
        self._t0 = self._last = time.perf_counter()
        self._docs, self._bytes = documents, nbytes

    def update(self, documents: int, tokens: int, nbytes: int) -> None:
        now = time.perf_counter()
        if now - self._last < self._every:
            return
        self._last = now
        rate = nbytes / max(now - self._t0, 1e-9)
        left = f", about {(self._bytes - nbytes) / rate:.0f} s left" if rate > 0 else ""
        self._log(f"prepare: {documents:,}/{self._docs:,} documents, {tokens:,} tokens, "
                  f"{nbytes / 2**20:,.1f}/{self._bytes / 2**20:,.1f} MiB ({nbytes / max(1, self._bytes):.0%}), "
                  f"{rate / 1e6:.1f} MB/s{left}")


def print_data_info(console: Console, path, m: dict, disk: int) -> None:
    src, tok = m["source"], m["tokenizer"]
    table = Table(title=f"prepared data: {path}")
    for col, just in (("split", "left"), ("documents", "right"), ("tokens", "right"), ("shards", "right"),
                      ("text MB", "right"), ("disk MB", "right"), ("bytes/token", "right")):
        table.add_column(col, justify=just)
    for split in ("train", "val"):
        s = m["splits"][split]
        size = sum(x["bytes"] for x in s["shards"])
        table.add_row(split, f"{s['documents']:,}", f"{s['tokens']:,}", str(len(s["shards"])),
                      f"{s['text_bytes'] / 1e6:,.1f}", f"{size / 1e6:,.1f}",
                      f"{s['text_bytes'] / max(1, s['tokens']):.2f}")
    console.print(table)
    console.print(f"source: {src['spec']} ({src['documents']:,} documents, {src['bytes'] / 1e6:,.1f} MB, "
                  f"val fraction {src['val_fraction']}), fingerprint {src['fingerprint']}", highlight=False)
    console.print(f"tokenizer: vocab {tok['vocab_size']:,}, sha256 {tok['sha256'][:16]}…, "
                  f"{'trained on the source' if tok.get('trained_key') else 'given'}; ids {m['dtype']}, "
                  + (f"documents end with id {m['eot_id']}" if m.get("start_id") is None else
                     f"documents framed by ids {m['start_id']} … {m['eot_id']}"), highlight=False)
    prep = m.get("prepared", {})
    console.print(f"disk: {disk / 1e6:,.1f} MB in {sum(len(m['splits'][s]['shards']) for s in ('train', 'val'))} "
                  f"shards; prepared {prep.get('at', '?')} with {prep.get('workers', '?')} worker(s) in "
                  f"{prep.get('seconds', 0):.1f} s", highlight=False)


def print_tasks(console: Console, rows: list[tuple], path) -> None:
    """`k3 eval --tasks`: one row per task and metric, as lm-evaluation-harness reports them."""
    table = Table(title="lm-evaluation-harness")
    for name in ("task", "metric", "value", "± stderr"):
        table.add_column(name, justify="left" if name in ("task", "metric") else "right")
    for task, metric, value, stderr in rows:
        table.add_row(task, metric, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}")
    console.print(table)
    console.print(f"results: {path}", highlight=False, soft_wrap=True)
