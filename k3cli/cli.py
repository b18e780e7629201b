"""The `k3` command line: parse options, resolve the config, dispatch to plain functions.

Exit codes: 0 ok, 1 a run of `k3 study` failed (the others finished and were reported), 2 bad input
(config, data, arguments) or a run directory that cannot be written (full disk, read-only), 3 training
stopped on a non-finite loss, 4 an equivalence check failed, 130 / 143 training stopped by SIGINT /
SIGTERM (after a checkpoint of the step it reached).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.rich_utils
from rich.console import Console
from rich.markup import escape

from k3cli.config import MAX_STEPS, dump_config, load_config
from k3cli.errors import ConfigError, first_line

app = typer.Typer(
    name="k3",
    help="Train, check and measure K3 hybrid models (KDA / Gated MLA / LatentMoE / AttnRes).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect resolved configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")
data_app = typer.Typer(help="Tokenize a corpus once into memory-mapped shards, and inspect them.", no_args_is_help=True)
app.add_typer(data_app, name="data")
import_app = typer.Typer(help="Bring released models into k3 as run directories.", no_args_is_help=True)
app.add_typer(import_app, name="import")

console = Console()
err_console = Console(stderr=True, soft_wrap=True)   # log lines stay whole lines, whatever the width


class AttnResMode(str, Enum):
    off = "off"
    full = "full"
    block = "block"


PresetOpt = Annotated[str, typer.Option("--preset", "-p", help="Preset name (k3-toy, kda-toy, k3-0.5b) or a YAML path.")]
ConfigOpt = Annotated[Optional[str], typer.Option("--config", "-c", help="YAML file merged over the preset.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", "-s", help="Override KEY=VALUE (value parsed as YAML), e.g. train.lr=1e-3; repeatable.")]
AttnResOpt = Annotated[Optional[AttnResMode], typer.Option(
    "--attnres", help="AttnRes overlay (presets/attnres/*.yaml); overrides preset, --config and --set.")]


def fail(msg: str, code: int = 2) -> None:
    # the message is plain text: no Rich markup ("[B, T, HV]") or emoji codes ("hf:x:") in it
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def _usage_error(e) -> None:
    """Typer's usage errors (an unknown option, a value out of range) as the one `error:` line of every
    other k3 error, with the command's --help named, instead of a usage line and a framed panel."""
    if type(e).__name__ == "NoArgsIsHelpError":   # the help text is the answer; it is printed already
        return
    ctx = getattr(e, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    msg = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    err_console.print(f"[bold red]error:[/] {escape(msg + hint)}", highlight=False, soft_wrap=True, emoji=False)


typer.rich_utils.rich_format_error = _usage_error   # Typer calls it for every usage error it reports


def resolve(preset: str, config: Optional[str], sets: Optional[list[str]], attnres: Optional[AttnResMode],
            flags: Optional[dict] = None):
    try:
        return load_config(preset, config, sets or [], attnres.value if attnres else None, flags)
    except ConfigError as e:
        fail(str(e))


@app.command()
def layout(
    preset: PresetOpt = "k3-toy",
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: AttnResOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")] = False,
):
    """Print the KDA/MLA block pattern, AttnRes grouping and parameter counts of a config."""
    from k3cli.console import print_layout
    from k3cli.models.layout import layout_dict

    cfg = resolve(preset, config, sets, attnres)
    data = layout_dict(cfg.model)
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        print_layout(console, data, preset)


@config_app.command("show")
def config_show(
    preset: PresetOpt = "k3-toy",
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: AttnResOpt = None,
):
    """Print the fully resolved config as YAML."""
    cfg = resolve(preset, config, sets, attnres)
    sys.stdout.write(dump_config(cfg))


@config_app.command("presets")
def config_presets():
    """List the model presets and AttnRes overlays."""
    from k3cli.config import list_presets

    console.print("presets: " + ", ".join(list_presets("model")))
    console.print("attnres overlays: " + ", ".join(list_presets("attnres")))


@data_app.command("prepare")
def data_prepare(
    data: Annotated[str, typer.Option(
        help="Corpus: stdlib, a .txt file (cut into documents at blank lines), a .jsonl/.parquet file, a "
             "folder of them (each .txt one document), or hf:NAME.")],
    out: Annotated[Path, typer.Option(help="Folder for the shards and manifest (new, empty, or an earlier prepare's).")],
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="Use this tokenizer.json (e.g. a run's) instead of training one.")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(
        "--vocab-size", min=257, help="Train a byte-level BPE of this size (default 4096, the toy presets') on a "
                                      "sample of the train split: all of it up to 20 MiB, else the first 8 MiB "
                                      "of documents in name-hash order.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Tokenizer processes (1: in this process, the tokenizer's "
                                                     "own threads on every core).")] = 1,
    val_fraction: Annotated[float, typer.Option(
        "--val-fraction", help="Fraction of documents held out for validation (by a stable hash of their names).")] = 0.02,
    text_field: Annotated[str, typer.Option("--text-field", help="Column of .jsonl/.parquet/hub data holding the text.")] = "text",
    max_bytes: Annotated[int, typer.Option("--max-bytes", min=0, help="Read at most this many bytes of text (0 = all).")] = 0,
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", min=1, help="Tokens per shard (cut at a document's end).")] = 2**25,
):
    """Tokenize a corpus once into .npy token shards plus a manifest; `k3 train --data OUT` memory-maps them.

    Re-running with the same source and tokenizer reuses OUT as it is; an interrupted prepare leaves no
    manifest (train refuses the folder) and the next run starts it clean."""
    from k3cli.console import PrepareLog, PrepareProgress
    from k3cli.data import disk_bytes, load_tokenizer, prepare_shards
    from k3cli.errors import DataError

    if not 0 < val_fraction < 1:
        fail(f"--val-fraction must lie in (0, 1), got {val_fraction}")
    if tokenizer is not None and vocab_size is not None:
        fail("--tokenizer and --vocab-size exclude each other (a given tokenizer has its own vocabulary)")
    bar = PrepareProgress(console) if console.is_terminal else None
    progress = bar or PrepareLog(_log)   # off a terminal (logs, Slurm): a line now and then
    try:
        tok = load_tokenizer(tokenizer) if tokenizer is not None else None
        res = prepare_shards(data, out, tok, vocab_size=vocab_size or 4096, workers=workers, val_fraction=val_fraction,
                             text_field=text_field, max_bytes=max_bytes, shard_tokens=shard_tokens, say=_log, replace=False,
                             on_start=progress.start, on_progress=progress.update)
    except (DataError, OSError) as e:
        fail(str(e))
    finally:
        if bar is not None:
            bar.stop()
    m = res.manifest
    tokens = sum(m["splits"][s]["tokens"] for s in ("train", "val"))
    done = "reused" if res.reused else f"prepared in {res.seconds:.1f} s ({m['source']['bytes'] / 1e6 / res.seconds:.1f} MB/s)"
    console.print(f"{out}: {m['source']['documents']:,} documents, {tokens:,} tokens in "
                  f"{sum(len(m['splits'][s]['shards']) for s in ('train', 'val'))} shards "
                  f"({disk_bytes(m) / 1e6:,.1f} MB); {done}", highlight=False, soft_wrap=True)


@data_app.command("info")
def data_info(
    path: Annotated[Path, typer.Argument(help="A prepared data directory.")],
    verify: Annotated[bool, typer.Option("--verify", help="Also check every shard's SHA-256.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON to stdout, with 'verified': "
                                                         "{shards, sha256_match} under --verify (else null).")] = False,
):
    """The manifest of a prepared directory: tokens, documents, shards, tokenizer, disk size."""
    from k3cli.console import print_data_info
    from k3cli.data import disk_bytes, open_prepared
    from k3cli.errors import DataError

    try:
        p = open_prepared(path, verify=verify)
    except (DataError, OSError) as e:
        fail(str(e))
    shards = sum(len(p.manifest["splits"][s]["shards"]) for s in ("train", "val"))
    checked = {"shards": shards, "sha256_match": True} if verify else None
    if as_json:
        sys.stdout.write(json.dumps({**p.manifest, "verified": checked}, indent=2) + "\n")
    else:
        print_data_info(console, path, p.manifest, disk_bytes(p.manifest))
        if verify:
            console.print(f"verified: {shards} shards, SHA-256 match", highlight=False)


class Kernel(str, Enum):
    chunk_kda = "chunk_kda"
    kda_gate = "kda_gate"
    decode = "decode"
    attnres = "attnres"
    short_conv = "short_conv"
    linear_ce = "linear_ce"
    all = "all"


class DType(str, Enum):
    auto = "auto"
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


@app.command("verify-equivalence")
def verify_equivalence(
    kernel: Annotated[Kernel, typer.Option(help="Kernel to check against its fp32 torch reference.")] = Kernel.all,
    shapes: Annotated[str, typer.Option(help="ci (tiny; fine on CPU) | full (GPU sizes).")] = "ci",
    dtype: Annotated[DType, typer.Option(
        help="Input dtype; auto = bf16 on CUDA, fp32 on CPU (the Triton interpreter mis-handles bf16).")] = DType.auto,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON to stdout (tol bounds rel_rms).")] = False,
):
    """Run each Triton kernel and its torch reference on the same inputs; compare outputs and every gradient.

    Exit code 4 when any row's relative RMS error exceeds its tolerance (the max abs error is shown for
    information). Without a GPU the kernels run in the Triton
    interpreter (slow: keep --shapes ci)."""
    from k3cli.bench.kernels import VERIFY_KERNELS, prepare_device, run_verify
    from k3cli.console import print_verify

    if shapes not in ("ci", "full"):
        fail(f"--shapes must be ci or full, got '{shapes}'")
    try:
        device = prepare_device()
    except RuntimeError as e:
        fail(str(e))
    dt = dtype.value if dtype != DType.auto else ("bf16" if device == "cuda" else "fp32")
    if device == "cpu" and dt == "bf16":
        fail("bf16 needs a GPU: the Triton interpreter gives wrong results for bf16 tensors; use fp32 or fp16")
    import torch

    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    kernels = list(VERIFY_KERNELS) if kernel == Kernel.all else [kernel.value]
    rows = run_verify(kernels, shapes, tdt)
    failed = [r for r in rows if not r[5]]
    if as_json:
        keys = ("kernel", "name", "rel_rms", "max_abs", "tol", "passed")
        sys.stdout.write(json.dumps([dict(zip(keys, r)) for r in rows], indent=2) + "\n")
    else:
        print_verify(console, rows, f"verify-equivalence on {device} ({dt}, shapes {shapes})")
    if failed:
        fail(f"{len(failed)} of {len(rows)} checks exceed their tolerance", code=4)


def parse_shape(text: str) -> tuple[int, ...]:
    """'B,T,H,HV,K' -> ints (K = V), HV a multiple of H; one error line otherwise."""
    parts = text.replace(" ", "").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 5 or min(dims) < 1:
        fail(f"--shape '{text}': expected five positive integers B,T,H,HV,K (e.g. 8,2048,16,16,128)")
    if dims[3] % dims[2]:
        fail(f"--shape '{text}': HV={dims[3]} must be a multiple of H={dims[2]}")
    return dims


@app.command("bench-kernel")
def bench_kernel(
    kernel: Annotated[Kernel, typer.Option(help="Kernel to time.")] = Kernel.all,
    shapes: Annotated[str, typer.Option(help="ci (tiny, CPU interpreter) | toy | k3 (the shapes of the published fla H200 figures).")] = "k3",
    against_fla: Annotated[Optional[str], typer.Option(
        "--against", help="'fla': also time flash-linear-attention when it is importable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON to stdout.")] = False,
    shape: Annotated[Optional[list[str]], typer.Option(
        help="chunk_kda / kda_gate only: time this B,T,H,HV,K shape (K = V) instead of a shape set; "
             "repeatable, e.g. --shape 8,2048,16,16,128.")] = None,
    wide: Annotated[bool, typer.Option(
        "--wide", help="Every column (spreads, host times, first-call times, ...) instead of the main ones in "
                       "100 characters.")] = False,
):
    """Time kernels against the torch reference (and fla) measured in the same run.

    Forward and forward+backward medians with spread (warm-up excluded), Mtok/s, achieved GB/s
    against a device copy measured in the same run. fla† columns are fla's published H200 figures
    (kept in the bench modules), for orientation only; the fla columns without † are fla timed in
    this run (--against fla), the only ones to take ratios against. The table shows the main columns in 100
    characters; --wide or --json gives every one."""
    from k3cli.bench.kernels import BENCH_KERNELS, prepare_device, run_bench
    from k3cli.console import print_bench

    if shapes not in ("ci", "toy", "k3"):
        fail(f"--shapes must be ci, toy or k3, got '{shapes}'")
    if against_fla not in (None, "fla"):
        fail(f"--against takes 'fla', got '{against_fla}'")
    try:
        device = prepare_device()
    except RuntimeError as e:
        fail(str(e))
    if device == "cpu" and shapes != "ci":
        fail("without a GPU only --shapes ci runs (through the Triton interpreter)")
    kernels = list(BENCH_KERNELS) if kernel == Kernel.all else [kernel.value]
    custom = None
    if shape:
        if device == "cpu":
            fail("--shape needs a GPU (without one only --shapes ci runs, through the interpreter)")
        if not set(kernels) <= {"chunk_kda", "kda_gate"}:
            fail("--shape applies to --kernel chunk_kda or kda_gate")
        custom = [parse_shape(s) for s in shape]
    if shapes == "toy" and "attnres" in kernels:
        kernels.remove("attnres")
        if not kernels:
            fail("attnres has no toy shape set; use --shapes ci or k3")
    results = run_bench(kernels, shapes, against_fla == "fla", custom=custom)
    if as_json:
        sys.stdout.write(json.dumps({"device": device, "results": results}, indent=2, default=str) + "\n")
        return
    if device == "cpu":
        console.print("[yellow]CPU: the kernels ran in the Triton interpreter; these times are not GPU figures.[/]")
    print_bench(console, results, wide=wide)


class Backend(str, Enum):
    auto = "auto"
    triton = "triton"
    torch = "torch"


@app.command("bench-train")
def bench_train_cmd(
    preset: PresetOpt = "k3-toy",
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: AttnResOpt = None,
    batch: Annotated[Optional[int], typer.Option(min=1, help="Sequences per step (default: train.micro_batch_size).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=1, help="Tokens per sequence (default: train.seq_len).")] = None,
    steps: Annotated[int, typer.Option(min=1, max=MAX_STEPS, help="Timed steps per variant.")] = 10,
    warmup: Annotated[int, typer.Option(min=0, max=MAX_STEPS, help="Untimed steps first (compilation happens here).")] = 3,
    compile: Annotated[bool, typer.Option("--compile/--no-compile", help="Also time the torch.compile'd step.")] = False,
    backend: Annotated[Backend, typer.Option(
        help="KDA/AttnRes ops: triton (CUDA; the torch ops are then timed too) or torch; auto picks.")] = Backend.auto,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda (default: train.device).")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", min=0,
        help="Dense peak TFLOP/s for MFU (default: the device table; none on CPU).")] = None,
    compare_attnres: Annotated[bool, typer.Option("--compare-attnres", help=(
        "Time the step with each AttnRes overlay (off, full, block), eager and with --compile compiled, "
        "interleaved in this run, with each overlay's ratio to off (instead of the backend and mask variants)."))] = False,
    loader: Annotated[bool, typer.Option("--loader", help=(
        "Feed each step through the training loop's input pipeline (a worker process draws, checks and "
        "cuts batches of a synthetic token stream) instead of one batch kept on the device."))] = False,
    variants: Annotated[Optional[str], typer.Option(help=(
        "Comma-separated variants to time, of those the run plans (eager, compiled, torch-backend, "
        "torch-compiled, document-mask or no-document-mask); e.g. compiled for a model whose eager step "
        "does not fit in memory. Default: all."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")] = False,
):
    """Time the training loop's own step (forward, backward, clipping, AdamW, MoE balancing) on synthetic tokens.

    Eager is the reference; --compile adds the compiled step and, on CUDA with the Triton ops, the
    torch ops are timed too (eager, and compiled with --compile), all interleaved in this one run:
    median step time with its spread, the host's time to enqueue it (near the step time: host-bound),
    tokens/s, TFLOP/s (analytic FLOPs, docs/math.md §9), MFU and peak memory. The variants use the document mask as `k3 train` does (data.document_mask); one more
    eager variant has it the other way, for its cost."""
    from k3cli.bench.train import bench_train
    from k3cli.console import print_bench_train

    flags = {"train.micro_batch_size": batch, "train.seq_len": seq_len, "train.device": device,
             "train.peak_tflops": peak_tflops}
    flags = {k: v for k, v in flags.items() if v is not None}
    if batch is not None:
        flags["train.global_batch_size"] = batch
    if compare_attnres and attnres is not None:
        fail("--compare-attnres times every AttnRes overlay; leave out --attnres")
    cfg = resolve(preset, config, sets, attnres, flags)
    overlays = {m.value: resolve(preset, config, sets, m, flags) for m in AttnResMode} if compare_attnres else None
    try:
        res = bench_train(cfg, steps=steps, warmup=warmup, compile=compile, backend=backend.value, log=_log,
                          attnres_configs=overlays, loader=loader,
                          only=[n.strip() for n in variants.split(",")] if variants else None)
    except ValueError as e:
        fail(str(e))
    except Exception as e:
        if not _out_of_memory(e):
            raise
        fail(_memory_advice(e, "--batch or --seq-len"))
    if as_json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
    else:
        print_bench_train(console, res)


class WandbMode(str, Enum):
    off = "off"
    offline = "offline"
    online = "online"


@app.command()
def train(
    ctx: typer.Context,
    preset: Annotated[Optional[str], typer.Option("--preset", "-p", help=(
        "Preset name (k3-toy, kda-toy, k3-0.5b) or a YAML path; default k3-toy. On resume the run's "
        "config.yaml is the base; a --preset given there must resolve to the run's config."))] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: AttnResOpt = None,
    data: Annotated[Optional[str], typer.Option(
        help="Corpus: a folder written by `k3 data prepare` (memory-mapped), or a source it is prepared from "
             "into the cache first: stdlib (the Python standard library's source), a .txt file (cut into "
             "documents at blank lines), a .jsonl/.parquet file, a folder of them (each .txt one document), "
             "or hf:NAME. Default: data.source.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimiser steps (default: the preset's train.steps).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Run directory. Default: runs/PRESET-ATTNRES-TIMESTAMP.")] = None,
    resume: Annotated[Optional[str], typer.Option(
        help="'auto': continue the run in --out (or in the newest runs/PRESET-ATTNRES-* directory) from its "
             "newest complete checkpoint; a new or empty --out starts a run. Any other folder (an export, "
             "prepared data, other files) is refused and left as it is.")] = None,
    restart: Annotated[bool, typer.Option(
        "--restart", help="Start the run in --out over with this command's config: only while it has no "
                          "checkpoint (e.g. it failed at once on a bad learning rate); replaces its run.json, "
                          "config.yaml, tokenizer.json and metrics.jsonl, nothing else.")] = False,
    until: Annotated[Optional[int], typer.Option(min=1,
        help="Stop after this step (with a checkpoint) without changing the schedule; resume later.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda (default: train.device).")] = None,
    seed: Annotated[Optional[int], typer.Option(min=0, max=2**63 - 1, help="Random seed (default: train.seed).")] = None,
    time_limit: Annotated[Optional[float], typer.Option(
        "--time-limit", help="Stop with a checkpoint after this many seconds.")] = None,
    wandb: Annotated[WandbMode, typer.Option(help="Log to Weights & Biases (needs the wandb extra).")] = WandbMode.off,
    peak_tflops: Annotated[Optional[float], typer.Option(
        "--peak-tflops", min=0, help="Dense peak TFLOP/s for the MFU column (default: the device table; "
                                     "none on CPU).")] = None,
    init_from: Annotated[Optional[Path], typer.Option(
        "--init-from", help="Start from the weights of a run (its newest checkpoint), a checkpoint folder, an export "
                            "or an imported model, with their tokenizer; a fresh optimiser and schedule. The model "
                            "config must build the same architecture (e.g. --preset SRC/config.yaml).")] = None,
    nproc: Annotated[Optional[int], typer.Option(
        "--nproc", min=1, help="Train on N processes of this machine (one per GPU): starts `torchrun "
                               "--standalone --nproc-per-node N -m k3cli train` with the other options; "
                               "train.parallel (auto: fsdp) says how they share the model.")] = None,
):
    """Train a model on real text (default: the Python standard library's own source).

    Several processes: `--nproc N`, or `torchrun --nproc-per-node N -m k3cli train ...` yourself."""
    from k3cli.distributed.launch import torchrun_world

    world, rank = torchrun_world()
    _start_rank(world, rank)
    if resume not in (None, "auto"):
        fail(f"--resume takes 'auto', got '{resume}'")
    if nproc is not None and world > 1:
        fail("--nproc starts torchrun itself; under torchrun leave it out")
    if restart and (resume or out is None):
        fail("--restart starts over the run in --out: give --out, and leave --resume out")
    flags = {"data.source": data, "train.steps": steps, "train.device": device, "train.seed": seed,
             "train.time_limit_s": time_limit, "train.peak_tflops": peak_tflops}
    flags = {k: v for k, v in flags.items() if v is not None}
    cfg, run_dir = _plan_run(preset, config, sets, attnres, flags, out, resume, restart, wandb, nproc or world, world)
    if nproc is not None:
        return _launch(ctx, nproc, run_dir)
    if world > 1:
        from k3cli.distributed.launch import join_ranks
        from k3cli.train import resolve_device

        try:
            run_dir = join_ranks(resolve_device(cfg.train.device).type, run_dir,
                                 lambda: _fresh_run_dir(Path(preset or "k3-toy").stem, cfg.model.attnres.mode))
        except ValueError as e:
            fail(str(e))
    _run_training(cfg, run_dir, bool(resume), restart, until, wandb, world, rank, init_from)


def _start_rank(world: int, rank: int) -> None:
    """Under torchrun: die with the launcher; rank 0 reports, the other ranks speak only of a failure of their own."""
    from k3cli.distributed.launch import LaunchError, die_with_launcher

    if world == 1:
        return
    try:
        die_with_launcher()
    except LaunchError as e:
        fail(str(e), e.code)
    if rank != 0:
        console.quiet = err_console.quiet = True


def _plan_run(preset, config, sets, attnres, flags: dict, out: Optional[Path], resume: Optional[str], restart: bool,
              wandb: WandbMode, processes: int, world: int):
    """(config, run directory) of a `k3 train`: the run to continue or a new one, every check made before any
    file is written (a new run's directory under torchrun is None here: rank 0 makes it)."""
    from k3cli.train import check_out, check_parallel, check_resume, newest_run, require_wandb

    try:
        require_wandb(wandb.value)   # fail before any data or model work
    except ValueError as e:
        fail(str(e))
    name = preset or "k3-toy"   # --preset's default; None tells a resume that the user gave none
    run_dir = out
    if resume and run_dir is None:
        run_dir = newest_run(name, attnres.value if attnres else None)
    # under torchrun each rank checks before joining the process group, so before rank 0 writes anything
    try:
        resuming = run_dir is not None and check_out(run_dir, bool(resume), restart)
    except ValueError as e:
        _fail_rank(str(e), 2, every_rank=True)
    # a resumed run's own config is the base; an explicit --preset is resolved as for a new run and checked
    cfg = resolve(str(run_dir / "config.yaml") if resuming and not preset else name, config, sets, attnres, flags)
    try:
        if resuming:
            check_resume(run_dir, cfg)
        check_parallel(cfg, processes)
    except ValueError as e:
        fail(str(e) + (f" (--preset {preset} gives this command's config as for a new run; leave it out to continue "
                       "from the run's config.yaml)" if resuming and preset and "cannot resume" in str(e) else ""))
    if run_dir is None and world == 1:   # with --nproc too: the launcher makes it, the ranks share it
        run_dir = _fresh_run_dir(Path(name).stem, cfg.model.attnres.mode)
    return cfg, run_dir


def _run_training(cfg, run_dir: Path, resume: bool, restart: bool, until: Optional[int], wandb: WandbMode,
                  world: int, rank: int, init_from: Optional[Path] = None) -> None:
    """The training run, each way it can end as one line and an exit code."""
    from k3cli.console import TrainProgress, make_logger
    from k3cli.distributed import PeerFailed
    from k3cli.train import TrainingInterrupted, TrainingStopped
    from k3cli.train import train as run_training

    progress = TrainProgress(console) if console.is_terminal and rank == 0 else None  # plain lines in logs
    created = not run_dir.exists()
    try:
        result = run_training(cfg, run_dir, resume=resume, log=make_logger(progress), progress=progress,
                              wandb_mode=wandb.value, stop_at=until, restart=restart, init_from=init_from)
    except KeyboardInterrupt:
        last = _last_checkpoint(run_dir)
        fail(f"interrupted; last checkpoint: {last or 'none'}"
             + (f"; continue with --out {run_dir} --resume auto" if last else ""), code=130)
    except TrainingInterrupted as e:   # a clean stop, not an error: the step's checkpoint is written
        err_console.print(escape(f"{e}; continue with --out {run_dir} --resume auto"), highlight=False, emoji=False)
        raise typer.Exit(e.code) from None
    except PeerFailed as e:   # rank 0 has printed why
        raise typer.Exit(e.code) from None
    except TrainingStopped as e:
        _fail_rank(str(e), e.code, every_rank=True)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # DataError, CheckpointError are ValueErrors
        _fail_rank(str(e), 2, every_rank=getattr(e, "on_every_rank", False))
    except OSError as e:   # a file the run writes (metrics, config, caches) on a full or read-only disk
        _fail_rank(str(e), 2)
    except Exception as e:
        if _out_of_memory(e):
            _fail_rank(_memory_advice(e), 2)
        if world == 1:
            raise
        # a failed collective, a bug: one line naming this rank; torchrun stops the others
        _fail_rank(f"{type(e).__name__}: {first_line(e, 300)}", 1)
    finally:
        if progress is not None:
            progress.stop()
        if rank == 0 and created and run_dir.is_dir() and not any(run_dir.iterdir()):
            with contextlib.suppress(OSError):   # a read-only folder stays
                run_dir.rmdir()  # failed before writing anything: leave no empty run behind (an empty --out the user made stays)
    if world > 1:
        from k3cli.distributed import destroy

        destroy()
    console.print(f"done: step {result.step}, train loss {result.train_loss:.4f}"
                  + (f", val loss {result.val_loss:.4f}" if result.val_loss is not None else "")
                  + f"; run directory {result.run_dir}", highlight=False, soft_wrap=True)


def _out_of_memory(e: BaseException) -> bool:
    """torch's CUDA allocator (torch.OutOfMemoryError) or its CPU allocator running out."""
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))


def _memory_advice(e: BaseException, lower: str = "train.micro_batch_size (train.global_batch_size stays: more "
                   "micro-batches per step) or train.seq_len") -> str:
    return f"out of memory ({first_line(e, 160)}); lower {lower}, or set train.activation_checkpointing=block"


def _fail_rank(msg: str, code: int, every_rank: bool = False) -> None:
    # under torchrun each rank names itself; an error every rank raises alike is printed by rank 0 alone
    from k3cli.distributed.launch import torchrun_world

    world, rank = torchrun_world()
    if world > 1:
        err_console.quiet = rank != 0 and every_rank
        msg = f"rank {rank}: {msg}"
    fail(msg, code)


def _fresh_run_dir(preset: str, mode: str) -> Path:
    from k3cli.train import new_run_dir

    try:
        return new_run_dir(preset, mode)
    except ValueError as e:
        fail(str(e))


def _last_checkpoint(run_dir: Path):
    from k3cli.checkpoint import latest

    return latest(run_dir) if run_dir.is_dir() else None


def _rank_args(ctx: typer.Context, run_dir: Path) -> list[str]:
    """This `k3 train` command's options as given, for the ranks: --out fixed to the run directory they
    share, --nproc left out. Read from the parsed command, so a new option needs no code here."""
    args = ["--out", str(run_dir)]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        source = ctx.get_parameter_source(param.name)
        if param.name in ("out", "nproc") or source is None or source.name == "DEFAULT":
            continue
        flag = param.opts[0]
        if param.is_flag:
            args += [flag] if value else []
            continue
        for v in value if param.multiple else [value]:
            args += [flag, str(v.value if isinstance(v, Enum) else v)]
    return args


def _launch(ctx: typer.Context, nproc: int, run_dir: Path) -> None:
    from k3cli.distributed.launch import LaunchError, RankFailed, launch

    try:
        launch(nproc, _rank_args(ctx, run_dir))
    except LaunchError as e:
        last = _last_checkpoint(run_dir)
        if isinstance(e, RankFailed):
            fail(f"{e}" + (f". Last complete checkpoint: {last}; continue with --out {run_dir} --resume auto"
                           if last else ""), code=e.code)
        fail(f"{e}; last checkpoint: {last or 'none'}"
             + (f"; continue with --out {run_dir} --resume auto" if last else ""), code=e.code)


@app.command("eval")
def eval_cmd(
    run: Annotated[Optional[str], typer.Option(
        help="Run directory (uses its newest checkpoint that verifies), or a `k3 export` folder.")] = None,
    ckpt: Annotated[Optional[str], typer.Option(help="A checkpoint directory (runs/X/checkpoints/step_N).")] = None,
    data: Annotated[Optional[str], typer.Option(
        help="Evaluate on this source's validation split instead of the run's data: any source `k3 train` takes "
             "(stdlib, a .txt/.jsonl/.parquet file or folder, hf:NAME, a `k3 data prepare` folder made with the "
             "run's tokenizer), tokenized with the run's tokenizer.json.")] = None,
    batches: Annotated[Optional[int], typer.Option(
        min=1, help="Validation batches (default: eval.batches); fewer when the split holds fewer, with a warning.")] = None,
    batch_size: Annotated[Optional[int], typer.Option(min=1, help="Sequences per batch (default: eval.batch_size).")] = None,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")] = False,
    tasks: Annotated[Optional[str], typer.Option(
        help="Run lm-evaluation-harness tasks instead, comma-separated (e.g. hellaswag,arc_easy,lambada_openai); "
             "needs the eval extra. Results: a table, and JSON in RUN/eval/.")] = None,
    num_fewshot: Annotated[Optional[int], typer.Option(
        "--num-fewshot", min=0, help="Few-shot examples per prompt (default: each task's own).")] = None,
    limit: Annotated[Optional[float], typer.Option(
        min=0, help="Examples per task (below 1: a fraction of each task); for quick checks, not for figures.")] = None,
    include_path: Annotated[Optional[Path], typer.Option(
        "--include-path", help="A folder of task YAMLs of your own (their data may be local json/jsonl files).")] = None,
    output: Annotated[Optional[Path], typer.Option(
        help="Where the tasks' JSON goes (default: RUN/eval/TASKS-TIME.json).")] = None,
):
    """Validation loss, perplexity, bits per byte and tokens/s of a run, or benchmark tasks (--tasks).

    --tasks runs lm-evaluation-harness tasks through k3's adapter (the eval extra).

    --run uses the newest checkpoint that verifies and names a newer one that fails (an error when
    none verifies). The JSON records the data evaluated and the batches used."""
    from k3cli.console import print_eval
    from k3cli.evaluation.evaluate import evaluate_run

    if tasks is not None:
        return _eval_tasks(run, ckpt, tasks, num_fewshot, limit, batch_size, include_path, device, output, as_json,
                           data=data, batches=batches)
    harness_only = {"--num-fewshot": num_fewshot, "--limit": limit, "--include-path": include_path, "--output": output}
    given = [k for k, v in harness_only.items() if v is not None]
    if given:
        fail(f"{', '.join(given)} go with --tasks")
    try:
        res = evaluate_run(run, ckpt, batches, batch_size, device, data,
                           log=lambda m: err_console.print(m, highlight=False))
    except (ConfigError, ValueError, FileNotFoundError) as e:  # DataError, CheckpointError are ValueErrors
        fail(str(e))
    if as_json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
    else:
        print_eval(console, res)


def _eval_tasks(run, ckpt, tasks: str, num_fewshot, limit, batch_size, include_path, device, output, as_json,
                data, batches) -> None:
    from k3cli.console import print_tasks

    if data is not None or batches is not None:
        fail("--data and --batches measure the validation loss; leave them out with --tasks")
    names = [n.strip() for n in tasks.split(",") if n.strip()]
    if not names:
        fail("--tasks needs at least one task name")
    try:
        from k3cli.evaluation.harness import evaluate_tasks, result_rows

        results, path = evaluate_tasks(run, ckpt, names, num_fewshot, limit, batch_size,
                                       str(include_path) if include_path else None, device, output,
                                       log=lambda m: err_console.print(m, highlight=False))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    except Exception as e:   # the harness's own errors (a task that needs the Hub offline, a bad task YAML)
        fail(f"lm-evaluation-harness: {type(e).__name__}: {first_line(e, 300)}")
    if as_json:
        sys.stdout.write(json.dumps({"results": results.get("results", {}), "file": str(path)}, indent=2,
                                    default=str) + "\n")
    else:
        print_tasks(console, result_rows(results), path)


class ExportFormat(str, Enum):
    k3 = "k3"
    hf = "hf"
    kimi_linear = "kimi_linear"


@app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option(help="New folder for the model (must not exist, or be empty).")],
    run: Annotated[Optional[str], typer.Option(help="Run directory (its newest complete checkpoint, or --ckpt's).")] = None,
    ckpt: Annotated[Optional[str], typer.Option(help="A checkpoint directory (runs/X/checkpoints/step_N).")] = None,
    fmt: Annotated[ExportFormat, typer.Option(
        "--format", help="k3: the folder k3 reads; hf: a folder Hugging Face transformers loads "
                         "(trust_remote_code=True; its modeling file needs k3cli installed); kimi_linear: "
                         "transformers' own Kimi Linear format, for models built with its options "
                         "(k3 import hf).")] = ExportFormat.k3,
):
    """Write one checkpoint (sharded DCP at any world size, or single-process) as a consolidated folder.

    OUT gets model.safetensors (full tensors, plain names), the run's config.yaml and tokenizer.json
    and a checksummed EXPORT marker; `k3 eval` and `k3 generate` read it with --run OUT or --ckpt OUT
    on one device. Weights only: training does not resume from it. Every tensor's name, shape and
    dtype is checked against the model config.yaml builds first; a mismatch writes nothing.
    --format hf writes config.json (with an auto_map), modeling_k3.py, model.safetensors and the
    tokenizer files for AutoModelForCausalLM / AutoTokenizer instead."""
    from k3cli.checkpoint.export import export_checkpoint, is_export
    from k3cli.evaluation.runs import locate

    try:
        if run is not None and ckpt is not None:
            run_dir, ckpt_dir = Path(run), Path(ckpt)
            if ckpt_dir.resolve().parent != (run_dir / "checkpoints").resolve():
                raise ConfigError(f"--ckpt {ckpt} is not a checkpoint of --run {run} (one of {run}/checkpoints/)")
        else:
            run_dir, ckpt_dir = locate(run, ckpt, warn=_log)
        if is_export(ckpt_dir):
            raise ConfigError(f"{ckpt_dir} is an export already (weights, config and tokenizer); copy the folder instead")
        if fmt is ExportFormat.hf:
            from k3cli.evaluation.hf import export_hf

            marker = export_hf(run_dir, ckpt_dir, out)
        elif fmt is ExportFormat.kimi_linear:
            from k3cli.evaluation.kimi_linear import export_kimi_linear

            marker = export_kimi_linear(run_dir, ckpt_dir, out)
        else:
            marker = export_checkpoint(run_dir, ckpt_dir, out)
    except (ConfigError, ValueError, FileNotFoundError) as e:  # CheckpointError is a ValueError
        fail(str(e))
    console.print(f"exported {ckpt_dir} (step {marker['step']}) to {out}: "
                  + ", ".join(sorted(marker["files"])), highlight=False, soft_wrap=True)


@import_app.command("hf")
def import_hf(
    src: Annotated[Path, typer.Argument(help="A Hugging Face folder of a kimi_linear model (config.json, "
                                             "model.safetensors or a sharded index, and its tokenizer: "
                                             "tokenizer.json or tiktoken.model).")],
    out: Annotated[Path, typer.Option(help="New run directory (must not exist, or be empty).")],
    preset: Annotated[str, typer.Option(
        "--preset", "-p", help="Whose training settings (train.*, data.*, eval.*) the run's config.yaml takes.")] = "k3-toy",
):
    """Import Moonshot's Kimi Linear (model type kimi_linear) as a k3 run: config.yaml with k3's layers set to
    Kimi Linear's options, its tokenizer (a tiktoken one converted to tokenizer.json) with its start and end
    tokens, and checkpoint step 0, which k3 eval, k3 generate, k3 export and `k3cli.load` read. Weights are
    read shard by shard."""
    from k3cli.evaluation.kimi_linear import import_kimi_linear

    try:
        ckpt = import_kimi_linear(src, out, preset, log=_log)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    console.print(f"imported {src} into {out}: checkpoint {ckpt}", highlight=False, soft_wrap=True)


@app.command("generate")
def generate_cmd(
    prompt: Annotated[str, typer.Option(help="Text to continue.")],
    run: Annotated[Optional[str], typer.Option(help="Run directory (uses its newest complete checkpoint).")] = None,
    ckpt: Annotated[Optional[str], typer.Option(help="A checkpoint directory (runs/X/checkpoints/step_N).")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Stop after this many new tokens (or at the end token).")] = 128,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 = greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens; 0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: smallest set with this probability; 1 = off.")] = 1.0,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1, help="Sampling seed (same seed, same text).")] = 0,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="Print tokens as they come.")] = True,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
):
    """Continue a prompt with a trained model: prefill once, then one cached decode step per token.

    The text goes to stdout; prefill and decode tokens/s to stderr."""
    from k3cli.errors import CheckpointError, DataError
    from k3cli.evaluation.generate import check_sampling, generate
    from k3cli.evaluation.runs import open_run

    try:
        check_sampling(temperature, top_k, top_p)
        if max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        _, ckpt_dir, dev, _, model, step, tok = open_run(run, ckpt, device)
    except (ConfigError, DataError, CheckpointError, ValueError, FileNotFoundError) as e:
        fail(str(e))

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    res = generate(model, tok, prompt, max_new_tokens, temperature, top_k, top_p, seed,
                   stream_callback=emit if stream else None)
    sys.stdout.write(("" if stream else res.text) + "\n")
    sys.stdout.flush()
    err_console.print(f"{ckpt_dir} (step {step}) on {dev}: prefill {res.prompt_tokens} tokens "
                      f"{res.prefill_tokens_per_s:.1f} tok/s; {len(res.token_ids)} new tokens, decode "
                      f"{res.decode_tokens_per_s:.1f} tok/s" + ("; stopped at <|endoftext|>" if res.stopped_at_eot
                                                               else ""), highlight=False)


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(help="Run directories to put side by side.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")] = False,
    plot: Annotated[Optional[Path], typer.Option(
        help="Also draw the validation-loss plot (loss vs tokens, difference to the first run, loss vs "
             "training time) into this PNG; needs the plot extra.")] = None,
):
    """Compare runs: steps, final and best validation loss, tokens/s, and the config keys that differ."""
    from k3cli.console import print_compare
    from k3cli.study.compare import compare_runs, plot_runs

    try:
        data = compare_runs(runs)
        if plot is not None:
            plot_runs(data, plot)
            err_console.print(f"plot: {plot}", highlight=False)
    except ImportError:
        fail("--plot needs matplotlib: pip install 'k3cli[plot]'")
    except (ConfigError, ValueError) as e:
        fail(str(e))
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        print_compare(console, data)


@app.command()
def study(
    preset: PresetOpt = "k3-toy",
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: Annotated[str, typer.Option(
        help="Comma-separated AttnRes variants to train side by side; the first 'off' (else the first) "
             "is the baseline.")] = "off,full,block",
    seeds: Annotated[int, typer.Option(min=1, help="Seeds per variant: train.seed, +1, …")] = 3,
    steps: Annotated[Optional[int], typer.Option(min=1, help="Steps per run (default: the preset's).")] = None,
    tokens: Annotated[Optional[int], typer.Option(min=1,
        help="Tokens per run instead of --steps (rounded up to whole steps).")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda (default: train.device).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Study directory. Default: studies/PRESET-TIMESTAMP.")] = None,
    parallel: Annotated[int, typer.Option(min=1, help="Runs trained at once (each gets CPUs / J threads).")] = 1,
    report: Annotated[Optional[Path], typer.Option(
        help="Only rebuild report.md, summary.json and loss.png of this study directory.")] = None,
):
    """Train AttnRes variants × seeds under one controlled design and report whether they differ.

    Every run is an ordinary `k3 train` run directory under DIR/runs; running the same command again
    skips finished runs and resumes interrupted ones. The report (DIR/report.md) gives final and best
    validation loss per variant, tokens/s, the paired difference to the baseline with a 95 % interval,
    the loss at equal wall-clock, and DIR/loss.png (needs the plot extra)."""
    from k3cli.study import study as st

    try:
        if report is not None:
            design = st.read_design(report)
            weights = st.check_base_weights(report, design, log=_log)
            path = st.write_report(report, st.summarize(report, design, weights))
            console.print(f"report: {path}", highlight=False, soft_wrap=True)
            return
        modes = [m.strip() for m in attnres.split(",") if m.strip()]
        bad = [m for m in modes if m not in AttnResMode.__members__]
        if bad:
            fail(f"--attnres: unknown variant '{bad[0]}' (choose from off, full, block)")
        design = st.design_study(preset, config, sets or [], modes, seeds, steps, tokens, device)
        if out is None:
            out = Path("studies") / f"{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        st.prepare_study(out, design)
        _log(f"study directory: {out} ({len(design['runs'])} runs of {design['steps']:,} steps, "
             f"{design['tokens_per_run']:,} tokens each)")
        weights = st.check_base_weights(out, design, log=_log)
        st.prepare_shared_data(out, design, log=_log)
        failed = st.run_study(out, design, parallel, log=_log)
        path = st.write_report(out, st.summarize(out, design, weights))
    except KeyboardInterrupt:
        fail(f"interrupted; run the same command again to continue the study in {out}", code=130)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    console.print(f"report: {path}", highlight=False, soft_wrap=True)
    if failed:
        fail(f"{len(failed)} run(s) failed: {', '.join(failed)}; their logs are in {out / 'logs'}", code=1)


def _log(msg: str) -> None:
    err_console.print(msg, highlight=False)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
