"""`k3 export --format hf`: a folder transformers' Auto classes load (trust_remote_code), giving k3's own
logits and, through `model.generate()`, k3 generate's greedy tokens."""
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

transformers = pytest.importorskip("transformers")

from k3cli.cli import app  # noqa: E402
from k3cli.data import EOT_ID  # noqa: E402
from k3cli.evaluation.generate import generate  # noqa: E402
from k3cli.evaluation.runs import load  # noqa: E402
from k3cli.testing import TINY_MODEL, TINY_TRAIN, one_error_line, write_corpus  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 6-step k3-toy run (MoE, MLA and KDA layers) and its export in the Hugging Face format."""
    root = tmp_path_factory.mktemp("hf")
    corpus = write_corpus(root, n_docs=30)
    sets = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(root / "cache"))
        r = runner.invoke(app, ["train", "--preset", "k3-toy", "--data", str(corpus), "--out", str(root / "run"), *sets])
        assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["export", "--run", str(root / "run"), "--out", str(root / "hf"), "--format", "hf"])
    assert r.exit_code == 0, r.output
    return root / "run", root / "hf"


def test_transformers_loads_it_and_gives_k3s_logits(exported):
    run, hf = exported
    assert json.loads((hf / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == "modeling_k3.K3ForCausalLM"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tok("the state decays per key", return_tensors="pt").input_ids
    ours = load(run, device="cpu")
    assert ids[0].tolist() == ours.encode("the state decays per key")[0].tolist()   # <|endoftext|> first
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours.model(ids).logits)


def test_generate_gives_k3_generates_greedy_tokens(exported):
    run, hf = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    ids = tok("the delta rule", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=EOT_ID, pad_token_id=EOT_ID)
    new = out[0, ids.shape[1]:].tolist()
    ours = load(run, device="cpu")
    want = generate(ours.model, ours.tokenizer, "the delta rule", max_new_tokens=6, temperature=0.0)
    assert new[:len(want.token_ids)] == want.token_ids and want.token_ids
    assert tok.decode(new, skip_special_tokens=True) == want.text


def test_export_hf_refuses_a_folder_in_use_and_keeps_it(exported, tmp_path):
    run, _ = exported
    (tmp_path / "notes.txt").write_text("mine")
    err = one_error_line(runner.invoke(app, ["export", "--run", str(run), "--out", str(tmp_path), "--format", "hf"]))
    assert "already exists; refusing to overwrite it" in err and (tmp_path / "notes.txt").read_text() == "mine"
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    cfg = (damaged / "config.yaml").read_text().replace("num_hidden_layers: 2", "num_hidden_layers: 3")
    (damaged / "config.yaml").write_text(cfg)
    err = one_error_line(runner.invoke(app, ["export", "--run", str(damaged), "--out", str(tmp_path / "o"),
                                             "--format", "hf"]))
    assert "does not fit" in err and not (tmp_path / "o").exists()


def test_a_transformers_pipeline_reads_it(exported):
    run, hf = exported
    pipe = transformers.pipeline("text-generation", model=str(hf), trust_remote_code=True, device="cpu")
    out = pipe("the delta rule", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    ours = load(run, device="cpu")
    want = generate(ours.model, ours.tokenizer, "the delta rule", max_new_tokens=6, temperature=0.0).text
    assert out.startswith("the delta rule") and out[len("the delta rule"):] == want
