"""Config: layer pattern (docs/math.md §1), presets load/validate/round-trip, precedence, bad input."""

import dataclasses

import pytest
import yaml

from k3cli.config import ConfigError, dump_config, list_presets, load_config
from k3cli.models.k3_config import K3Config, KDAConfig


def expected_k3_types(L):
    types = ["mla" if i % 4 == 3 else "kda" for i in range(L)]
    types[-1] = "mla"
    return types


@pytest.mark.parametrize("L", range(1, 17))
def test_k3_layer_types_follow_spec(L):
    types = K3Config(num_hidden_layers=L).layer_types()
    assert types == expected_k3_types(L)
    assert K3Config(num_hidden_layers=L).layer_specs() == [(t, "moe") for t in types]


@pytest.mark.parametrize("L,pattern", [
    (1, "MLA"), (4, "KDA KDA KDA MLA"), (5, "KDA KDA KDA MLA MLA"),
    (6, "KDA KDA KDA MLA KDA MLA"), (8, "KDA KDA KDA MLA KDA KDA KDA MLA"),
])
def test_k3_layer_types_examples(L, pattern):
    assert " ".join(K3Config(num_hidden_layers=L).layer_types()).upper() == pattern


def test_kda_config_layer_specs():
    assert KDAConfig(num_hidden_layers=3).layer_specs() == [("kda", "swiglu")] * 3


PRESETS = ["kda-toy", "k3-toy", "k3-0.5b"]
OVERLAYS = [None, "off", "full", "block"]


def test_all_presets_listed():
    assert set(PRESETS) <= set(list_presets("model"))
    assert {"off", "full", "block"} <= set(list_presets("attnres"))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("attnres", OVERLAYS, ids=lambda a: f"attnres-{a}")
def test_preset_loads_validates_and_round_trips(preset, attnres, tmp_path):
    cfg = load_config(preset, attnres=attnres)
    if attnres:
        assert cfg.model.attnres.mode == attnres
    # dump -> load as a preset path gives the same config
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    again = load_config(str(path))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert type(again.model) is type(cfg.model)


def test_preset_arch_classes():
    assert isinstance(load_config("kda-toy").model, KDAConfig)
    assert isinstance(load_config("k3-toy").model, K3Config)


def test_precedence_preset_config_set_flag(tmp_path):
    f = tmp_path / "over.yaml"
    f.write_text("train: {lr: 0.5, steps: 7}\nmodel: {attnres: {mode: full}}\n")
    cfg = load_config("k3-toy", str(f), ["train.lr=0.25"], None)
    assert cfg.train.lr == 0.25  # --set beats --config
    assert cfg.train.steps == 7  # --config beats preset
    assert cfg.model.hidden_size == 256  # preset beats default
    assert cfg.model.attnres.mode == "full"
    cfg = load_config("k3-toy", str(f), ["model.attnres.mode=full"], "block")
    assert cfg.model.attnres.mode == "block"  # dedicated flag beats everything
    assert cfg.model.attnres.block_size == 2


def test_set_values_parse_as_yaml():
    cfg = load_config("k3-toy", overrides=["train.lr=1e-3", "model.tie_word_embeddings=true",
                                            "model.attnres.mode=off", "data.source=/tmp/x"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.model.tie_word_embeddings is True
    assert cfg.model.attnres.mode == "off"
    assert cfg.data.source == "/tmp/x"


def test_preset_by_path(tmp_path):
    from k3cli.config import preset_dir
    src = preset_dir() / "kda-toy.yaml"
    dst = tmp_path / "mine.yaml"
    dst.write_text(src.read_text())
    assert load_config(str(dst)).model.arch == "kda"


BAD = [
    ("unknown-key", dict(overrides=["model.hiden_size=3"]), "unknown config key 'model.hiden_size'",
     "did you mean 'model.hidden_size'"),
    ("unknown-section", dict(overrides=["trian.lr=1"]), "unknown config section 'trian'", "did you mean 'train'"),
    ("wrong-type", dict(overrides=["model.hidden_size=abc"]), "model.hidden_size: expected int", "'abc'"),
    ("wrong-type-float", dict(overrides=["train.lr=fast"]), "train.lr: expected float", "'fast'"),
    ("bad-choice", dict(overrides=["model.kda.backend=trition"]), "model.kda.backend", "did you mean 'triton'"),
    ("out-of-range", dict(overrides=["model.kda.lower_bound=-7"]), "model.kda.lower_bound", "[-5, 0)"),
    ("out-of-range-gva", dict(overrides=["model.kda.num_v_heads=12"]), "model.kda.num_v_heads", "multiple"),
    ("out-of-range-topk", dict(overrides=["model.moe.top_k=17"]), "model.moe.top_k", "num_routed_experts=16"),
    ("bad-set-syntax", dict(overrides=["train.lr"]), "--set expects KEY=VALUE", "train.lr"),
    ("missing-preset", dict(preset="k3-tyo"), "unknown preset 'k3-tyo'", "did you mean 'k3-toy'"),
    ("missing-preset-file", dict(preset="/nonexistent/x.yaml"), "preset file not found", "/nonexistent/x.yaml"),
    ("bad-arch", dict(overrides=["model.arch=k4"]), "model.arch", "'k4'"),
]


@pytest.mark.parametrize("case,kwargs,msg1,msg2", BAD, ids=[b[0] for b in BAD])
def test_bad_config_errors(case, kwargs, msg1, msg2):
    kwargs = {"preset": "k3-toy", **kwargs}
    with pytest.raises(ConfigError) as e:
        load_config(**kwargs)
    text = str(e.value)
    assert msg1 in text and msg2 in text
    assert "\n" not in text


def test_malformed_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("model:\n  hidden_size: [1, 2\n")
    with pytest.raises(ConfigError) as e:
        load_config("k3-toy", str(f))
    assert "malformed YAML" in str(e.value) and str(f) in str(e.value) and "line" in str(e.value)


def test_non_mapping_yaml(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config("k3-toy", str(f))


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = tmp_path / "typo.yaml"
    f.write_text("train: {stpes: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config("k3-toy", str(f))
    assert "train.stpes" in str(e.value) and str(f) in str(e.value) and "train.steps" in str(e.value)


def test_non_utf8_config_is_one_line(tmp_path):
    f = tmp_path / "bin.yaml"
    f.write_bytes(b"\xff\xfe\x00train: 1")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config("k3-toy", str(f))


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_header_parameter_counts_are_true(preset):
    """The counts quoted in each preset's comment header match `k3 layout` (AttnRes off)."""
    import re

    from k3cli.config import preset_dir
    from k3cli.models.layout import param_counts

    header = "".join(line for line in (preset_dir() / f"{preset}.yaml").read_text().splitlines(True)
                     if line.startswith("#"))
    quoted = {int(n.replace(",", "")) for n in re.findall(r"\d{1,3}(?:,\d{3})+", header)}
    counts = param_counts(load_config(preset, attnres="off").model)
    assert quoted and quoted <= {counts["total"], counts["active"]}
    assert counts["total"] in quoted


def test_dedicated_flags_beat_set_and_are_taken_literally():
    cfg = load_config("k3-toy", overrides=["train.steps=5", "data.source=stdlib"],
                      flags={"train.steps": 9, "data.source": "hf:org/name:config"})
    assert cfg.train.steps == 9
    assert cfg.data.source == "hf:org/name:config"  # not parsed as YAML (it would be a mapping)
    with pytest.raises(ConfigError, match="train.steps: expected int"):
        load_config("k3-toy", flags={"train.steps": "many"})


def test_document_mask_on_for_new_runs_and_off_for_runs_written_before_it(tmp_path):
    """data.document_mask defaults to true; a run directory's config.yaml without the key (written before it
    existed) resumes as that run trained: without the mask. The same file elsewhere is an ordinary config."""
    from k3cli.config import dump_config
    assert load_config("k3-toy").data.document_mask is True
    run = tmp_path / "run"
    run.mkdir()
    old = dump_config(load_config("k3-toy")).replace("  document_mask: true\n", "")
    assert "document_mask" not in old
    (run / "config.yaml").write_text(old)
    (run / "tokenizer.json").write_text("{}")
    assert load_config(str(run / "config.yaml")).data.document_mask is False
    (tmp_path / "config.yaml").write_text(old)
    assert load_config(str(tmp_path / "config.yaml")).data.document_mask is True
    (run / "config.yaml").write_text(dump_config(load_config("k3-toy", overrides=["data.document_mask=true"])))
    assert load_config(str(run / "config.yaml")).data.document_mask is True


def test_mla_layers_and_first_dense_layers_set_the_pattern():
    cfg = load_config("k3-toy", overrides=['model.mla_layers="1, 3"', "model.first_dense_layers=1"])
    assert cfg.model.layer_specs() == [("kda", "swiglu"), ("mla", "moe"), ("kda", "moe"), ("mla", "moe")]
    assert load_config("k3-toy").model.layer_specs() == [("kda", "moe")] * 3 + [("mla", "moe")]
    for bad, says in (('model.mla_layers="1,x"', "comma-separated block indices"),
                      ('model.mla_layers="4"', "distinct blocks below num_hidden_layers=4"),
                      ('model.mla_layers="1,1"', "distinct blocks"), ("model.first_dense_layers=5", "must lie in")):
        with pytest.raises(ConfigError, match=says):
            load_config("k3-toy", overrides=[bad])


def test_layout_names_the_layer_options():
    from k3cli.models.layout import components

    assert components(load_config("k3-toy").model) == {
        "kda": "H 8, HV 8, K 16, V 16, short conv 4, gate lower_bound (L -5)",
        "mla": "H 8, query low-rank 64, latent r 32, d_q 16, d_v 16, output gate on",
        "moe": "16 experts top-2, 2 shared, d_ff 96, latent 128, situ"}
    kimi = load_config("k3-toy", overrides=[
        "model.first_dense_layers=1", "model.kda.gate=softplus", "model.mla.q_lora_rank=0",
        "model.mla.qk_rope_head_dim=4", "model.mla.output_gate=false", "model.moe.latent=false",
        "model.moe.expert_act=silu", "model.moe.num_expert_groups=4", "model.moe.topk_groups=2",
        "model.moe.routed_scaling_factor=2.5"]).model
    c = components(kimi)
    assert c["kda"].endswith("gate softplus") and "query direct" in c["mla"] and "shared key 4" in c["mla"]
    assert "in 4 groups (best 2)" in c["moe"] and "full width, silu, weights ×2.5" in c["moe"]
    assert c["swiglu"] == "SwiGLU d_ff 512"
