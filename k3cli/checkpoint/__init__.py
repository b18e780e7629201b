"""Checkpoints: the step-folder protocol (`folder`), the single-process (`single`) and sharded (`sharded`)
formats, the calls that pick between them (`api`), and `k3 export`'s consolidated folder (`export`)."""

from k3cli.checkpoint.api import (
    export_consolidated,
    latest,
    load,
    load_full_model_state,
    load_weights,
    prune,
    save,
)
from k3cli.checkpoint.folder import (
    EXPORT_MARKER,
    MARKER,
    MODEL_FILE,
    STATE_FILE,
    is_complete,
    list_checkpoints,
    remove_leftovers,
    tensor_bytes,
    why_incomplete,
)
from k3cli.checkpoint.sharded import is_sharded
from k3cli.errors import CheckpointError, SharedCheckpointError

__all__ = [
    "CheckpointError", "EXPORT_MARKER", "MARKER", "MODEL_FILE", "STATE_FILE", "SharedCheckpointError",
    "export_consolidated", "is_complete", "is_sharded", "latest", "list_checkpoints", "load",
    "load_full_model_state", "load_weights", "prune", "remove_leftovers", "save", "tensor_bytes",
    "why_incomplete",
]
