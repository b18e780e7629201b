"""Sampling and `k3 generate` (decode cache end to end): reproducible seeded sampling, greedy ==
argmax of the full forward, top-k = 1 == greedy, top-p keeps the nucleus, CLI on a tiny trained run."""
import pytest
import torch
from typer.testing import CliRunner

from k3cli.cli import app
from k3cli.config import load_config
from k3cli.data import EOT_ID
from k3cli.evaluation.generate import generate, generate_ids, sample_next
from k3cli.models import CausalLM
from k3cli.testing import TINY_MODEL, TINY_TRAIN, write_corpus
from k3cli.train import train

runner = CliRunner()

SMALL = [
    "model.vocab_size=300", "model.hidden_size=32", "model.num_hidden_layers=4",
    "model.kda={num_heads: 2, num_v_heads: 4, head_k_dim: 8, head_v_dim: 8, chunk_size: 8}",
    "model.mla={num_heads: 2, q_lora_rank: 16, kv_lora_rank: 8, qk_head_dim: 8, v_head_dim: 8}",
    "model.moe={num_routed_experts: 4, top_k: 2, num_shared_experts: 1, d_ff: 16, latent_dim: 16}",
    "model.initializer_range=0.2",
]
PROMPT = [EOT_ID, 17, 101, 5, 250, 33]


@pytest.fixture(autouse=True)
def one_thread():
    # decode is many tiny ops; see tests/models/test_decode.py
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = CausalLM(load_config("k3-toy", overrides=SMALL, attnres="block").model).eval()
    # EOT's logit is exactly 0 while the largest of the 299 others is ~3 (std ~1.1): greedy and top-k 50
    # never pick it, so these tests compare sequences of a fixed length
    with torch.no_grad():
        m.lm_head.weight[EOT_ID] = 0.0
    return m


def test_greedy_equals_argmax_of_the_full_forward(model):
    new, stopped, _, _ = generate_ids(model, PROMPT, 12, temperature=0)
    assert len(new) == 12 and not stopped
    seq = PROMPT + new
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0]
    assert new == logits[len(PROMPT) - 1:-1].argmax(-1).tolist()


def test_top_k_1_equals_greedy(model):
    greedy = generate_ids(model, PROMPT, 10, temperature=0)[0]
    assert generate_ids(model, PROMPT, 10, temperature=1.5, top_k=1, seed=3)[0] == greedy


def test_seeded_sampling_is_reproducible(model):
    a = generate_ids(model, PROMPT, 16, temperature=1.0, top_k=50, top_p=0.9, seed=7)[0]
    b = generate_ids(model, PROMPT, 16, temperature=1.0, top_k=50, top_p=0.9, seed=7)[0]
    c = generate_ids(model, PROMPT, 16, temperature=1.0, top_k=50, top_p=0.9, seed=8)[0]
    assert a == b and a != c


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).log_softmax(-1)
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {1, 2}
    # probabilities ≈ [.03, .64, .24, .09, .01]: top_p 0.7 keeps tokens 1 and 2 (0.64 < 0.7)
    draws = {int(sample_next(logits, 1.0, top_p=0.7, generator=gen)) for _ in range(200)}
    assert draws == {1, 2}
    draws = {int(sample_next(logits, 1.0, top_p=0.5, generator=gen)) for _ in range(50)}
    assert draws == {1}
    assert int(sample_next(logits, 0.0)) == 1


def test_stops_at_eot(model, monkeypatch):
    """The third decode step makes EOT the argmax: 3 tokens come out (EOT is not one of them)."""
    real = model.decode_step
    calls = []

    def eot_on_third(token_ids, cache):
        logits = real(token_ids, cache)
        calls.append(1)
        if len(calls) == 3:
            logits[..., EOT_ID] = 1e4
        return logits

    monkeypatch.setattr(model, "decode_step", eot_on_third)
    greedy = generate_ids(model, PROMPT, 3, temperature=0)[0]
    calls.clear()
    new, stopped, _, _ = generate_ids(model, PROMPT, 10, temperature=0)
    assert stopped and new == greedy and len(calls) == 3


class ByteTok:
    """A stand-in tokenizer: ids 1..256 are bytes, id 0 starts and ends a text (as in k3's own)."""

    bos_id = eos_id = 0

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text):
        return self.Enc([b + 1 for b in text.encode()])

    def decode(self, ids):
        return bytes(i - 1 for i in ids if 0 < i <= 256).decode("utf-8", errors="replace")


def test_generate_streams_the_text_and_reports_speed(model):
    pieces = []
    res = generate(model, ByteTok(), "ab", max_new_tokens=6, temperature=0, stream_callback=pieces.append)
    assert res.prompt_tokens == 3 and len(res.token_ids) == 6
    assert "".join(pieces) == res.text
    assert res.prefill_tokens_per_s > 0 and res.decode_tokens_per_s > 0


TINY = TINY_MODEL + TINY_TRAIN + ["train.steps=4", "train.ckpt_every=4", "train.eval_every=4",
                                  "eval.batches=1", "train.warmup_steps=1"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    mp = pytest.MonkeyPatch()
    mp.setenv("K3_CACHE_DIR", str(root / "cache"))
    corpus = write_corpus(root, n_docs=20)
    run = root / "run"
    cfg = load_config("k3-toy", overrides=TINY + [f"data.source={corpus}"], attnres="block")
    train(cfg, run, log=lambda m: None)
    yield run
    mp.undo()


def test_cli_generate_on_a_trained_run(trained_run):
    args = ["generate", "--run", str(trained_run), "--prompt", "the state", "--max-new-tokens", "8",
            "--device", "cpu"]
    a = runner.invoke(app, args + ["--temperature", "0.9", "--top-k", "20", "--seed", "1", "--no-stream"])
    assert a.exit_code == 0, a.output
    assert "decode" in a.stderr and "tok/s" in a.stderr
    b = runner.invoke(app, args + ["--temperature", "0.9", "--top-k", "20", "--seed", "1", "--stream"])
    assert b.exit_code == 0 and b.stdout == a.stdout
    ckpt = next((trained_run / "checkpoints").iterdir())
    g = runner.invoke(app, ["generate", "--ckpt", str(ckpt), "--prompt", "the", "--temperature", "0",
                            "--max-new-tokens", "4", "--device", "cpu"])
    assert g.exit_code == 0, g.output


@pytest.mark.parametrize("extra,message", [
    ([], "exactly one of --run"),
    (["--run", "/nonexistent"], "not a k3 run directory"),
    (["--run", "RUN", "--top-p", "0"], "top_p"),
    (["--run", "RUN", "--temperature", "-1"], "temperature"),
])
def test_cli_generate_errors_are_one_line(trained_run, extra, message):
    extra = [str(trained_run) if e == "RUN" else e for e in extra]
    r = runner.invoke(app, ["generate", "--prompt", "x", *extra])
    assert r.exit_code == 2
    assert message in r.stderr and "Traceback" not in r.output
