"""Training: `train` runs a run directory's loop (`loop`), built from `build`; one optimiser step is
`step.TrainStep` (also what `k3 bench-train` times), fed by `batches.Prefetcher`; `metrics` records and
`stops` ends it; `rundir` writes, checks and restores the run directory; `validation` is its
validation loss. Other packages import these public names only."""
from k3cli.train.batches import Batch, Prefetcher, document_segments
from k3cli.train.build import (
    build_model,
    build_optimizer,
    check_parallel,
    flush_denormals,
    lr_lambda,
    param_groups,
    resolve_device,
)
from k3cli.train.loop import TrainResult, require_wandb, train
from k3cli.train.metrics import Throughput, peak_memory_bytes
from k3cli.train.rundir import (
    RESUMABLE_KEYS,
    RUN_MARKER,
    check_out,
    check_resume,
    check_resume_config,
    mark_run,
    new_run_dir,
    newest_run,
)
from k3cli.train.step import TrainStep, moe_imbalance
from k3cli.train.stops import StopSignals, TrainingInterrupted, TrainingStopped
from k3cli.train.validation import evaluate_loss

__all__ = [
    "Batch", "Prefetcher", "document_segments", "build_model", "build_optimizer", "check_parallel",
    "flush_denormals", "lr_lambda", "param_groups", "resolve_device", "TrainResult", "require_wandb", "train",
    "Throughput", "peak_memory_bytes", "RESUMABLE_KEYS", "RUN_MARKER",
    "check_out", "check_resume", "check_resume_config", "mark_run", "new_run_dir", "newest_run", "TrainStep", "moe_imbalance",
    "StopSignals", "TrainingInterrupted", "TrainingStopped", "evaluate_loss",
]
