"""The `k3` command line: parse options, resolve the config, dispatch to plain functions.

Exit codes: 0 ok, 2 bad input (config, data, arguments), 3 training stopped on a non-finite loss,
4 an equivalence check failed.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Annotated, Optional

import typer
from rich.console import Console

from k3cli.config import ConfigError, dump_config, load_config

app = typer.Typer(
    name="k3",
    help="Train, check and measure K3 hybrid models (KDA / Gated MLA / LatentMoE / AttnRes).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
config_app = typer.Typer(help="Inspect resolved configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")

console = Console()
err_console = Console(stderr=True)


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
    err_console.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def resolve(preset: str, config: Optional[str], sets: Optional[list[str]], attnres: Optional[AttnResMode]):
    try:
        return load_config(preset, config, sets or [], attnres.value if attnres else None)
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
    from k3cli.layout import layout_dict
    from k3cli.report import print_layout

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


@app.command()
def train(
    preset: PresetOpt = "k3-toy",
    config: ConfigOpt = None,
    sets: SetOpt = None,
    attnres: AttnResOpt = None,
):
    """Train a model on real text (default: the Python standard library's source)."""
    resolve(preset, config, sets, attnres)
    fail("`k3 train` is not implemented yet (issue 4)", code=1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
