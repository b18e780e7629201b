"""The errors a user can cause, in one place. Each is a ValueError whose message is one line; the CLI
prints it as `error: ...` and exits 2. `on_every_rank`: every rank raises it alike, so under torchrun
rank 0 alone prints it."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input or a folder that cannot be used; the message is one line."""

    on_every_rank = False


class ConfigError(UserError):
    """A configuration error; the message names the key or file."""


class DataError(UserError):
    """A data problem (bad path, empty corpus, damaged shards, another tokenizer)."""


class CheckpointError(UserError):
    """A checkpoint cannot be written or read; the message names the folder."""


class SharedCheckpointError(CheckpointError):
    """A CheckpointError every rank raises with the same message."""

    on_every_rank = True


class RunDirError(UserError):
    """--out cannot be trained into; every rank finds the same (it checks before any rank writes)."""

    on_every_rank = True


def first_line(e: BaseException, limit: int | None = None) -> str:
    """The first non-blank line of an exception's message (its type name when there is none)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]


def last_line(e: BaseException, limit: int | None = None) -> str:
    """The last non-blank line: where torch.distributed.checkpoint puts the cause of its errors."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:limit]
