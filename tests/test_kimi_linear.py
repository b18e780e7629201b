"""`k3 import hf`: tiny random Kimi Linear models built by transformers (CPU, fp32), saved with save_pretrained,
imported as k3 run directories; k3's own layers (with the Kimi Linear options) give transformers' logits and
loss gradients, and its greedy tokens."""
import json

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_linear")

from k3cli.checkpoint import load_weights  # noqa: E402
from k3cli.cli import app  # noqa: E402
from k3cli.config import load_config  # noqa: E402
from k3cli.evaluation.generate import generate_ids  # noqa: E402
from k3cli.evaluation.kimi_linear import _rename  # noqa: E402
from k3cli.models.causal_lm import CausalLM  # noqa: E402
from k3cli.testing import one_error_line  # noqa: E402

runner = CliRunner()

# (id, q_lora_rank, n_group, topk_group, first dense blocks, hidden, layers, full-attention blocks (1-based))
CONFIGS = [
    ("direct_q_one_group", None, 1, 1, 1, 32, 4, [2, 4]),
    ("q_lora_4_groups", 10, 4, 2, 1, 32, 4, [2, 4]),
    ("2_groups_no_dense_5_blocks", 6, 2, 1, 0, 36, 5, [3, 5]),   # transformers grouped_mm wants widths of 4k
    ("2_dense_blocks", None, 2, 2, 2, 24, 4, [1, 4]),
]


def kimi(q_lora, n_group, topk_group, dense, hidden, layers, full, seed=0, vocab=97, bos=1, eos=2):
    torch.manual_seed(seed)
    cfg = transformers.KimiLinearConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=2, kv_lora_rank=12, q_lora_rank=q_lora,
        qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=8, n_group=n_group, topk_group=topk_group,
        num_experts_per_tok=2, num_local_experts=8, routed_scaling_factor=2.5,
        linear_attn_config={"head_dim": 5, "num_heads": 3, "short_conv_kernel_size": 4, "full_attn_layers": full,
                            "kda_layers": [i for i in range(1, layers + 1) if i not in full]},
        first_k_dense_replace=dense, pad_token_id=0, bos_token_id=bos, eos_token_id=eos)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():   # random router biases and gate parameters: the paths that use them are exercised
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name or "dt_bias" in name or "A_log" in name:
                p.normal_(std=0.5)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(std=0.5)
    return model


@pytest.fixture(scope="module", params=CONFIGS, ids=[c[0] for c in CONFIGS])
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    hf = kimi(*request.param[1:])
    hf.save_pretrained(root / "hf")
    r = runner.invoke(app, ["import", "hf", str(root / "hf"), "--out", str(root / "run")])
    assert r.exit_code == 0, r.output
    cfg = load_config(str(root / "run" / "config.yaml"))
    ours = CausalLM(cfg.model)
    load_weights(root / "run" / "checkpoints" / "step_00000000", ours)
    return hf, ours.eval(), root


def test_export_back_is_bit_exact_and_transformers_reads_it(imported):
    from safetensors.torch import load_file

    hf, _, root = imported
    r = runner.invoke(app, ["export", "--run", str(root / "run"), "--out", str(root / "back"), "--format", "kimi_linear"])
    assert r.exit_code == 0, r.output
    original, back = load_file(root / "hf" / "model.safetensors"), load_file(root / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    again = transformers.AutoModelForCausalLM.from_pretrained(root / "back").eval()
    ids = torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


def test_logits_equal_transformers(imported):
    hf, ours, _ = imported
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_loss_gradients_equal_transformers(imported):
    hf, ours, _ = imported
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(4))
    hf.zero_grad()
    ours.zero_grad()
    hf(ids, labels=ids).loss.backward()
    ours(ids, labels=ids).loss.backward()
    theirs = {_rename(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}
    mine = dict(ours.named_parameters())
    checked = 0
    for name, g in theirs.items():
        if name in mine:   # the tensors kept whole (the rest are split or stacked: covered by the logits)
            ref, got = g.reshape(mine[name].grad.shape), mine[name].grad
            if name == "embed_tokens.weight":   # transformers' embedding keeps no gradient at padding_idx 0
                ref, got = ref[1:], got[1:]
            assert (got - ref).abs().max() <= 1e-3 * ref.abs().max() + 1e-7, name
            checked += 1
    assert checked >= 10


def test_greedy_tokens_equal_transformers_generate(imported):
    hf, ours, _ = imported
    prompt = [5, 17, 3, 44, 9]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                      pad_token_id=0, min_new_tokens=32)
    want = out[0, len(prompt):].tolist()
    got, _, _, _ = generate_ids(ours, prompt, 32, temperature=0.0)
    # k3 stops at <|endoftext|> (id 0); transformers was told not to: compare up to it
    n = got.index(0) if 0 in got else len(got)
    assert got[:n] == want[:len(got[:n])] and len(got) == n


def test_import_refuses_what_k3_cannot_express(tmp_path):
    hf = kimi(None, 1, 1, 1, 32, 4, [2, 4])
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key, value, says in (("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
                             ("model_type", "llama", "kimi_linear only"),
                             ("mlp_layer_types", ["sparse", "dense", "sparse", "sparse"], "dense blocks after MoE")):
        bad = dict(cfg, **{key: value})
        (tmp_path / "hf" / "config.json").write_text(json.dumps(bad))
        line = one_error_line(runner.invoke(app, ["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / key)]))
        assert says in line and not (tmp_path / key).exists()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    good = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (tmp_path / "hf" / "model.safetensors").write_bytes(good[:len(good) // 2])   # a truncated download
    line = one_error_line(runner.invoke(app, ["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "cut")]))
    assert "cannot read" in line and "model.safetensors" in line and not (tmp_path / "cut").exists()
    (tmp_path / "hf" / "model.safetensors").write_bytes(good)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    line = one_error_line(runner.invoke(app, ["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "used")]))
    assert "refusing to overwrite" in line and (tmp_path / "used" / "notes.txt").read_text() == "mine"


def test_export_refuses_a_model_the_format_cannot_hold():
    from k3cli.errors import UserError
    from k3cli.evaluation.kimi_linear import _fits

    with pytest.raises(UserError, match="cannot hold model.kda.gate=lower_bound"):
        _fits(load_config("k3-toy"))
    with pytest.raises(UserError, match="cannot hold model.attnres.mode=block"):
        _fits(load_config("k3-toy", attnres="block"))


def test_a_sharded_checkpoint_imports_shard_by_shard(tmp_path):
    hf = kimi(10, 4, 2, 1, 32, 4, [2, 4], seed=2)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")   # experts of one layer across shards
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 3 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    r = runner.invoke(app, ["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert f"read {shards[-1].name} ({len(shards)}/{len(shards)})" in r.output
    ours = CausalLM(load_config(str(tmp_path / "run" / "config.yaml")).model)
    load_weights(tmp_path / "run" / "checkpoints" / "step_00000000", ours)
    ids = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want, got = hf(ids).logits, ours.eval()(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_a_tiktoken_tokenizer_is_converted_with_its_start_and_end_tokens(tmp_path):
    """A folder with Kimi Linear's tokenizer files (tiktoken.model, tokenizer_config.json, the Python file with
    pat_str) and no tokenizer.json: the run gets a tokenizer.json that encodes as tiktoken does, and its
    [BOS] / [EOS]: `load` starts a text with [BOS], generation stops at [EOS], and fine-tuning frames each
    training document as [BOS] text [EOS], its documents starting at [BOS]."""
    tiktoken = pytest.importorskip("tiktoken")
    import numpy as np

    import k3cli
    from k3cli.data import load_tokenizer
    from k3cli.data.prepare import open_prepared, prepare_shards
    from k3cli.testing import TINY_TRAIN, write_corpus
    from k3cli.train.batches import document_segments
    from tests.test_tiktoken_bpe import PATTERN, trained_ranks, write_tiktoken_folder

    ranks = trained_ranks(300)
    specials = {300: "[BOS]", 301: "[EOS]", 302: "<|im_end|>"}
    hf = kimi(None, 1, 1, 1, 32, 4, [2, 4], vocab=303, bos=300, eos=301)
    hf.save_pretrained(tmp_path / "hf")
    write_tiktoken_folder(tmp_path / "hf", ranks, specials)
    r = runner.invoke(app, ["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    tok = load_tokenizer(tmp_path / "run")
    assert (tok.bos_id, tok.eos_id) == (300, 301)
    enc = tiktoken.Encoding("t", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={})
    text = "Hello world, 中文 text 123"
    assert tok.encode(text).ids == enc.encode(text)
    loaded = k3cli.load(tmp_path / "run", device="cpu")
    assert loaded.encode(text)[0].tolist() == [300, *enc.encode(text)]
    with torch.no_grad():   # the end token stops generation: make it the model's certain next token
        head = loaded.model.lm_head.weight
        head.zero_()
        head[301] = 1.0
    new, stopped, _, _ = generate_ids(loaded.model, loaded.encode(text)[0].tolist(), 5, temperature=0,
                                      eos_id=loaded.tokenizer.eos_id)
    assert (new, stopped) == ([], True)

    corpus = write_corpus(tmp_path / "docs", n_docs=12, words_per_doc=40)
    prepared = open_prepared(prepare_shards(str(corpus), tmp_path / "prepared", tokenizer=tok).path)
    assert (prepared.manifest["start_id"], prepared.manifest["eot_id"]) == (300, 301)
    stream = np.asarray(prepared.streams["train"])
    starts, ends = np.flatnonzero(stream == 300), np.flatnonzero(stream == 301)
    assert starts[0] == 0 and ends[-1] == len(stream) - 1 and len(starts) == len(ends)
    assert (ends + 1)[:-1].tolist() == starts[1:].tolist()   # [BOS] text [EOS] [BOS] text [EOS] ...
    ids = torch.from_numpy(stream[None, :64].astype(np.int64))
    cu = sorted(set(document_segments(ids, None, True, start_id=300).cu_seqlens.tolist()))   # a padded table
    assert cu[1:-1] == [int(i) for i in starts if 0 < i < 64]
    sets = [a for s in TINY_TRAIN + ["train.steps=1"] for a in ("--set", s)]
    r = runner.invoke(app, ["train", "--preset", str(tmp_path / "run" / "config.yaml"), "--data", str(corpus),
                            "--out", str(tmp_path / "tuned"), "--init-from", str(tmp_path / "run"), *sets])
    assert r.exit_code == 0, r.output
    assert load_tokenizer(tmp_path / "tuned").bos_id == 300   # the tuned run keeps the start and end tokens
