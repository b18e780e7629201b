"""Run configuration: per-component dataclasses, YAML presets, overlays and `--set` overrides.

Precedence (later wins): dataclass defaults < preset < `--config FILE` < `--set a.b=value`
< dedicated flags such as `--attnres`. Every user-caused problem raises `ConfigError` with one
line that names the key or file; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3cli.errors import ConfigError
from k3cli.models.k3_config import MODEL_CLASSES, ModelConfig, _check

__all__ = [
    "ConfigError", "TrainConfig", "DataConfig", "EvalConfig", "RunConfig", "load_config",
    "preset_dir", "list_presets", "resolve_preset", "config_to_dict", "flatten",
]


def _did_you_mean(value, options, prefix: str = "") -> str:
    """" (did you mean 'PREFIX<closest>'?)" for the option closest to `value`, or "" when none is."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


# a thousand years at 30 steps a second: a larger count is a typo, and the run would never end
MAX_STEPS = 10**12
PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")   # train.parallel
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")   # train.compile_mode


@dataclass
class TrainConfig:
    steps: int = 1000
    seq_len: int = 256  # T
    micro_batch_size: int = 8  # sequences per forward/backward
    global_batch_size: int = 8  # sequences per optimiser step (multiple of micro_batch_size)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 10
    eval_every: int = 100  # 0 = only at the end
    ckpt_every: int = 100  # 0 = only at the end
    keep_last: int = 3  # checkpoints kept
    time_limit_s: float = 0.0  # stop (with a checkpoint) after this much wall time; 0 = no limit
    compile: bool = False  # torch.compile the model (fullgraph) for training and eval (masked CUDA eval: uncompiled)
    compile_mode: str = "default"  # torch.compile mode
    activation_checkpointing: str = "none"  # none | block: recompute each block's activations in backward
    peak_tflops: float = 0.0  # dense peak for MFU; 0 = from the device table (none on CPU)
    # more than one process (torchrun / k3 train --nproc): auto = fsdp then, none alone; ddp | fsdp
    parallel: str = "auto"

    CHOICES: typing.ClassVar[dict] = {
        "device": ("auto", "cpu", "cuda"),
        "parallel": PARALLEL_MODES,
        "compile_mode": COMPILE_MODES,
        "activation_checkpointing": ("none", "block"),
    }

    def validate(self, p: str = "train") -> None:
        for name in ("steps", "seq_len", "micro_batch_size", "global_batch_size", "keep_last"):
            _check(getattr(self, name) >= 1, f"{p}.{name}", "must be >= 1")
        _check(self.steps <= MAX_STEPS, f"{p}.steps", "must be <= 10^12 (a run that long would never finish)")
        _check(self.global_batch_size % self.micro_batch_size == 0, f"{p}.global_batch_size",
               f"must be a multiple of micro_batch_size ({self.micro_batch_size})")
        _check(self.lr > 0, f"{p}.lr", "must be > 0")
        _check(0 <= self.min_lr_ratio <= 1, f"{p}.min_lr_ratio", "must lie in [0, 1]")
        for name in ("warmup_steps", "log_every", "eval_every", "ckpt_every"):
            _check(getattr(self, name) >= 0, f"{p}.{name}", "must be >= 0")
        _check(self.log_every >= 1, f"{p}.log_every", "must be >= 1")
        _check(self.weight_decay >= 0, f"{p}.weight_decay", "must be >= 0")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"{p}.beta1/beta2", "must lie in [0, 1)")
        _check(self.grad_clip >= 0, f"{p}.grad_clip", "must be >= 0 (0 = off)")
        _check(self.time_limit_s >= 0, f"{p}.time_limit_s", "must be >= 0")
        _check(self.peak_tflops >= 0, f"{p}.peak_tflops", "must be >= 0 (0 = from the device table)")
        _check(0 <= self.seed < 2**63, f"{p}.seed", "must lie in [0, 2^63)")


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | PATH (.txt/.jsonl/.parquet file or folder) | hf:NAME
    text_field: str = "text"  # column holding the text in .jsonl / .parquet / hub data
    val_fraction: float = 0.02  # fraction of documents held out for validation
    max_bytes: int = 0  # cap on corpus bytes read (0 = all)
    min_frequency: int = 2  # BPE merge threshold
    # each document of a packed row computed as if alone (docs/math.md §10); runs written before the key
    # existed resume without it (see `_as_written`)
    document_mask: bool = True

    def validate(self, p: str = "data") -> None:
        _check(bool(self.source), f"{p}.source", "must not be empty")
        _check(0 < self.val_fraction < 1, f"{p}.val_fraction", "must lie in (0, 1)")
        _check(self.max_bytes >= 0, f"{p}.max_bytes", "must be >= 0 (0 = all)")
        _check(self.min_frequency >= 1, f"{p}.min_frequency", "must be >= 1")


@dataclass
class EvalConfig:
    batches: int = 20  # validation batches per evaluation
    batch_size: int = 8

    def validate(self, p: str = "eval") -> None:
        _check(self.batches >= 1, f"{p}.batches", "must be >= 1")
        _check(self.batch_size >= 1, f"{p}.batch_size", "must be >= 1")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=lambda: MODEL_CLASSES["k3"]())
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> RunConfig:
        self.model.validate("model")
        self.train.validate("train")
        self.data.validate("data")
        self.eval.validate("eval")
        return self


# ---- presets -----------------------------------------------------------------------------------

def preset_dir() -> Path:
    """`presets/` beside the package (editable install / checkout), or $K3_PRESETS."""
    env = os.environ.get("K3_PRESETS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "presets"


def list_presets(kind: str = "model") -> list[str]:
    base = preset_dir() / ("attnres" if kind == "attnres" else "")
    return sorted(p.stem for p in base.glob("*.yaml"))


def resolve_preset(name: str, kind: str = "model") -> Path:
    """A preset name (`k3-toy`) or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or os.sep in name:
        if not p.is_file():
            raise ConfigError(f"preset file not found: {name}")
        return p
    cand = preset_dir() / ("attnres" if kind == "attnres" else "") / f"{name}.yaml"
    if not cand.is_file():
        known = list_presets(kind)
        hint = _did_you_mean(name, known)
        raise ConfigError(f"unknown {'AttnRes overlay' if kind == 'attnres' else 'preset'} '{name}'"
                          f"{hint}; available: {', '.join(known)}")
    return cand


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:   # the keys as written: merge keys (<<) may be overridden
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key}' (the first would be ignored)", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)   # safe_load's loader, duplicate keys refused
    except (RecursionError, ValueError) as e:  # nesting past the stack; an int past Python's digit limit
        raise ConfigError(f"malformed YAML in {path}: {_why(e)}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


# ---- merging and typed construction -----------------------------------------------------------

def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return cfg


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}: the dotted keys that --set uses."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(flatten(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _why(e: BaseException) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).strip().split("\n")[0][:160]


def _short(value: Any, limit: int = 80) -> str:
    # a hostile value (a 4000-digit int, a megabyte string) must not flood the one error line
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "…"


def _one_line(msg: str) -> str:
    # keys and names from files may hold control characters; the error stays one printable line
    # C0/C1 controls and the Unicode line/paragraph separators (str.splitlines breaks at \x85, \u2028 too)
    return re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]", lambda m: repr(m.group())[1:-1], msg)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, choices: tuple | None) -> Any:
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            value = float(value) if ok else value
        except OverflowError:
            ok = False
        if ok and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    elif tp is str:
        # YAML 1.1 reads a bare off/on as a bool; for choice fields that mean 'off'/'on', take it back
        if isinstance(value, bool) and choices and ("off" if not value else "on") in choices:
            value = "off" if not value else "on"
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {_short(value)}")
    if choices is not None and value not in choices:
        hint = _did_you_mean(value, choices)
        raise ConfigError(f"{key}: {_short(value)} is not one of {', '.join(map(str, choices))}{hint}")
    return value


def _build(cls: type, data: dict, prefix: str, source: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__} ({source})")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in data:
        if k not in fields:
            hint = _did_you_mean(k, fields, f"{prefix}.")
            raise ConfigError(f"unknown config key '{prefix}.{k}'{hint} ({source})")
    kwargs = {}
    choices = getattr(cls, "CHOICES", {})
    for name, value in data.items():
        tp = hints[name]
        key = f"{prefix}.{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key, source)
        else:
            kwargs[name] = _coerce(value, tp, key, choices.get(name))
    return cls(**kwargs)


def _parse_set(expr: str) -> tuple[list[str], Any]:
    if "=" not in expr:
        raise ConfigError(f"--set expects KEY=VALUE (e.g. train.lr=1e-3), got '{expr}'")
    key, raw = expr.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set: malformed key '{key}' in '{expr}'")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else ""
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        problem = getattr(e, "problem", None)
        raise ConfigError(f"--set {key}: cannot parse value {_short(raw)} as YAML"
                          + (f" ({problem})" if problem else "")) from None
    # YAML 1.1 reads 1e-3 as a string; accept numeric-looking strings as floats
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.split("."), value


def _nest(path: list[str], value: Any) -> dict:
    out: Any = value
    for part in reversed(path):
        out = {part: out}
    return out


def load_config(preset: str | None = "k3-toy", config_file: str | None = None,
                overrides: list[str] | None = None, attnres: str | None = None,
                flags: dict[str, Any] | None = None) -> RunConfig:
    """Resolve a RunConfig: defaults < preset < config file < --set overrides < dedicated flags
    (`flags`, {"data.source": "...", ...}: values taken as given, not parsed as YAML) < --attnres."""
    try:
        return _load_config(preset, config_file, overrides, attnres, flags)
    except ConfigError as e:
        raise ConfigError(_one_line(str(e))) from None


def _load_config(preset, config_file, overrides, attnres, flags) -> RunConfig:
    layers: list[tuple[dict, str]] = []
    if preset:
        path = resolve_preset(preset)
        layers.append((_as_written(read_yaml(path), path), str(path)))
    if config_file:
        layers.append((read_yaml(Path(config_file)), config_file))
    for expr in overrides or []:
        keys, value = _parse_set(expr)
        layers.append((_nest(keys, value), f"--set {expr}"))
    for key, value in (flags or {}).items():
        layers.append((_nest(key.split("."), value), f"--{key.split('.')[-1].replace('_', '-')}"))
    if attnres:
        path = resolve_preset(attnres, kind="attnres")
        layers.append((read_yaml(path), f"--attnres {attnres}"))

    merged: dict = {}
    for data, source in layers:
        # check each layer's keys against the schema so the error names the layer it came from
        _validate_keys(data, source)
        merged = _deep_merge(merged, data)

    return _from_merged(merged)


def config_from_dict(data: dict, source: str = "config") -> RunConfig:
    """A RunConfig from a resolved config's dict (a run's config.yaml, parsed), checked as a file is."""
    _validate_keys(data, source)
    return _from_merged(data)


def _from_merged(merged: dict) -> RunConfig:
    model_data = dict(merged.get("model") or {})
    arch = model_data.get("arch", "k3")
    if arch not in MODEL_CLASSES:
        hint = _did_you_mean(arch, MODEL_CLASSES)
        raise ConfigError(f"model.arch: {arch!r} is not one of {', '.join(MODEL_CLASSES)}{hint}")
    model = _build(MODEL_CLASSES[arch], model_data, "model", "resolved config")
    rest = {k: v for k, v in merged.items() if k != "model"}
    cfg = _build(RunConfig, rest, "config", "resolved config")
    cfg.model = model
    return cfg.validate()


def _as_written(data: Any, path: Path) -> Any:
    """A run directory's config.yaml (beside its tokenizer.json) holds every key of its time: a key added
    since takes the value that reproduces how that run trained, not today's default."""
    if path.name == "config.yaml" and (path.parent / "tokenizer.json").is_file() and isinstance(data, dict):
        section = data.get("data")
        if isinstance(section, dict) and "document_mask" not in section:
            data = {**data, "data": {**section, "document_mask": False}}   # packed rows were not masked before
    return data


def _validate_keys(data: dict, source: str) -> None:
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    for k, v in data.items():
        if k not in sections:
            hint = _did_you_mean(k, sorted(sections))
            raise ConfigError(f"unknown config section '{k}'{hint} ({source})")
        cls = ModelConfig if k == "model" else typing.get_type_hints(RunConfig)[k]
        _check_keys(cls, v, k, source)


def _check_keys(cls: type, data: Any, prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__} ({source})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k, v in data.items():
        if k not in names:
            hint = _did_you_mean(k, names, f"{prefix}.")
            raise ConfigError(f"unknown config key '{prefix}.{k}'{hint} ({source})")
        if dataclasses.is_dataclass(hints[k]):
            _check_keys(hints[k], v, f"{prefix}.{k}", source)
        else:
            _coerce(v, hints[k], f"{prefix}.{k}", getattr(cls, "CHOICES", {}).get(k))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
