"""CLI: layout / config show for every preset, --help texts, and one-line errors with exit code 2."""

import json

import pytest
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import load_config
from k3cli.models.layout import param_counts

runner = CliRunner()
PRESETS = ["kda-toy", "k3-toy", "k3-0.5b"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("attnres", ["off", "full", "block"])
def test_layout_runs_for_every_preset(preset, attnres):
    r = runner.invoke(app, ["layout", "--preset", preset, "--attnres", attnres])
    assert r.exit_code == 0, r.output
    assert "pattern:" in r.output and "active per token" in r.output


def test_layout_json_is_machine_readable():
    r = runner.invoke(app, ["layout", "--preset", "k3-toy", "--attnres", "block", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["pattern"] == "KDA KDA KDA MLA"
    assert [b["attn"] for b in data["blocks"]] == ["kda", "kda", "kda", "mla"]
    assert all(b["ffn"] == "moe" for b in data["blocks"])
    # S = 2 sublayers per AttnRes block: block i's two sublayers share group b{i+1}
    assert [(b["attn_group"], b["ffn_group"]) for b in data["blocks"]] == [
        ("b1", "b1"), ("b2", "b2"), ("b3", "b3"), ("b4", "b4")]
    assert data["params"] == param_counts(load_config("k3-toy", attnres="block").model)
    assert data["params"]["active"] < data["params"]["total"]


def test_layout_block_groups_with_odd_s():
    # S = 3 through --set (k3-toy's own S is 2): groups straddle blocks
    r = runner.invoke(app, ["layout", "--preset", "k3-toy", "--set", "model.attnres.mode=block",
                            "--set", "model.attnres.block_size=3", "--set", "model.num_hidden_layers=5", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["pattern"] == "KDA KDA KDA MLA MLA"
    assert [(b["attn_group"], b["ffn_group"]) for b in data["blocks"]] == [
        ("b1", "b1"), ("b1", "b2"), ("b2", "b2"), ("b3", "b3"), ("b3", "b4")]


def test_config_show_round_trips(tmp_path):
    r = runner.invoke(app, ["config", "show", "--preset", "kda-toy", "--set", "train.steps=11"])
    assert r.exit_code == 0, r.output
    f = tmp_path / "c.yaml"
    f.write_text(r.stdout)
    assert load_config(str(f)).train.steps == 11


@pytest.mark.parametrize("cmd", [[], ["layout"], ["config", "show"], ["train"], ["export"]])
def test_help(cmd):
    r = runner.invoke(app, cmd + ["--help"])
    assert r.exit_code == 0
    assert "Usage" in r.output


def test_help_lists_defaults_and_choices():
    r = runner.invoke(app, ["layout", "--help"])
    assert "k3-toy" in r.output and "off" in r.output and "block" in r.output


BAD = [
    (["layout", "--preset", "k3-tyo"], "unknown preset 'k3-tyo'"),
    (["layout", "--set", "model.hiden_size=3"], "did you mean 'model.hidden_size'"),
    (["layout", "--set", "model.hidden_size=abc"], "model.hidden_size: expected int"),
    (["layout", "--set", "model.moe.top_k=0"], "model.moe.top_k"),
    (["config", "show", "--config", "/nonexistent.yaml"], "cannot read config file /nonexistent.yaml"),
]


@pytest.mark.parametrize("args,msg", BAD, ids=lambda x: x if isinstance(x, str) else "-".join(x)[:40])
def test_bad_input_one_line_exit_2(args, msg):
    r = runner.invoke(app, args)
    assert r.exit_code == 2
    assert msg in r.stderr
    assert "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_malformed_yaml_exit_2(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: {lr: [\n")
    r = runner.invoke(app, ["layout", "--config", str(f)])
    assert r.exit_code == 2
    assert "malformed YAML" in r.stderr and "bad.yaml" in r.stderr


def test_bad_attnres_choice_exit_2():
    r = runner.invoke(app, ["layout", "--attnres", "blok"])
    assert r.exit_code == 2
