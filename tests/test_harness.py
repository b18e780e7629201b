"""`k3 eval --tasks`: k3's adapter of lm-evaluation-harness's `LM`, run through the harness's own
`simple_evaluate` on local tasks (jsonl + YAML), against arithmetic done here with the model directly."""
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

pytest.importorskip("lm_eval")

from k3cli.cli import app  # noqa: E402
from k3cli.config import load_config  # noqa: E402
from k3cli.data import EOT_ID, load_documents, train_tokenizer  # noqa: E402
from k3cli.evaluation.generate import generate  # noqa: E402
from k3cli.evaluation.harness import K3LM  # noqa: E402
from k3cli.models.causal_lm import CausalLM  # noqa: E402
from k3cli.testing import TINY_MODEL, TINY_TRAIN, WORDS, one_error_line, write_corpus  # noqa: E402
from k3cli.train.validation import evaluate_loss  # noqa: E402

MC = [{"question": "the state decays per", "choices": ["key", "value", "query"], "answer": 0},
      {"question": "the delta rule writes the", "choices": ["residual", "prediction of the chunk"], "answer": 1},
      {"question": "a", "choices": ["b", "c", "d", "e"], "answer": 2}]
ROLL = [{"text": "the state decays per key dimension"}, {"text": "and the delta rule writes the residual"}]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), n_docs=20)
    tok = train_tokenizer(load_documents(str(corpus)), 300)
    cfg = load_config("k3-toy", overrides=TINY_MODEL)
    torch.manual_seed(0)
    model = CausalLM(cfg.model).eval()
    return K3LM(model, tok, max_length=64, batch_size=2)


def write_tasks(folder):
    """Three local tasks: multiple choice, rolling log-likelihood and generation, each a jsonl and a YAML."""
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
    (folder / "roll.jsonl").write_text("".join(json.dumps(d) + "\n" for d in ROLL))
    (folder / "gen.jsonl").write_text(json.dumps({"prompt": "the state decays", "target": "x"}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "k3_mc.yaml").write_text(
        f"task: k3_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "k3_roll.yaml").write_text(
        f"task: k3_roll\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'roll.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "k3_gen.yaml").write_text(
        f"task: k3_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['<never>']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return folder


@pytest.fixture(scope="module")
def res(lm, tmp_path_factory):
    """The three tasks in one run of the harness (loading a task's data is most of a test's time)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    folder = write_tasks(tmp_path_factory.mktemp("tasks"))
    return lm_eval.simple_evaluate(model=lm, tasks=["k3_mc", "k3_roll", "k3_gen"],
                                   task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   log_samples=True)


def direct_loglikelihood(lm, context: str, continuation: str) -> float:
    """log p(continuation | <eot> context): one unbatched forward over the whole sequence, fp32."""
    head = lm.tokenizer.encode(context).ids
    whole = lm.tokenizer.encode(context + continuation).ids
    ids = torch.tensor([[EOT_ID] + whole])
    logp = F.log_softmax(lm.model(ids).logits.float(), -1)[0]
    return sum(float(logp[p, ids[0, p + 1]]) for p in range(len(head), len(whole)))


def test_multiple_choice_log_likelihoods_and_accuracy_are_the_models_own(lm, res):
    samples = res["samples"]["k3_mc"]
    correct = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        doc = MC[s["doc_id"]]
        got = [float(r[0][0]) for r in s["resps"]]
        want = [direct_loglikelihood(lm, doc["question"], " " + c) for c in doc["choices"]]
        assert got == pytest.approx(want, abs=1e-5, rel=0)
        correct.append(max(range(len(want)), key=want.__getitem__) == doc["answer"])
    assert res["results"]["k3_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_rolling_log_likelihood_matches_k3_evals_loss_on_the_same_text(lm, res):
    lls = {s["doc_id"]: float(s["resps"][0][0]) for s in res["samples"]["k3_roll"]}
    words = 0
    for i, doc in enumerate(ROLL):
        ids = lm.tokenizer.encode(doc["text"]).ids
        # k3 eval's validation loss of the document as one sequence: mean over its tokens, <eot> first
        loss = evaluate_loss(lm.model, [torch.tensor([[EOT_ID] + ids])], torch.device("cpu"), None)
        assert lls[i] == pytest.approx(-loss * len(ids), abs=1e-4, rel=1e-6)
        words += len(doc["text"].split())
    want = math.exp(-sum(lls.values()) / words)
    assert res["results"]["k3_roll"]["word_perplexity,none"] == pytest.approx(want, rel=1e-9)


def test_rolling_windows_predict_every_token_once_within_the_window(lm):
    text = " ".join(list(WORDS) * 3)
    ids = lm.tokenizer.encode(text).ids
    short = K3LM(lm.model, lm.tokenizer, max_length=16, batch_size=3)
    windows = short.rolling_windows(text)
    assert [t for _, t in windows] == [ids[i:i + 16] for i in range(0, len(ids), 16)]
    # by hand: each window is one forward over the 16 tokens before its last target
    stream, total = [EOT_ID] + ids, 0.0
    for start in range(0, len(ids), 16):
        end = min(start + 16, len(ids))
        x = torch.tensor([stream[max(0, end - 16):end]])
        logp = F.log_softmax(lm.model(x).logits.float(), -1)[0]
        total += sum(float(logp[p - max(0, end - 16), stream[p + 1]]) for p in range(start, end))
    assert sum(ll for ll, _ in short._score(windows)) == pytest.approx(total, abs=1e-4)
    assert len(ids) > 32   # more than two windows: the cut context is exercised


def test_generation_task_equals_k3_generate_and_stops_at_a_stop_string(lm, res):
    got = res["samples"]["k3_gen"][0]["resps"][0][0]
    want = generate(lm.model, lm.tokenizer, "the state decays", max_new_tokens=6, temperature=0.0).text
    assert got == want and want
    stop = want[len(want) // 2:][:2]
    assert lm.generate("the state decays", {"until": [stop], "max_gen_toks": 6}) == want.split(stop, 1)[0]


def test_batched_scores_do_not_depend_on_the_batch(lm):
    rows = [lm._split("the state decays per", " key"), lm._split("a", " b c d"), lm._split("", "the delta rule")]
    alone = [K3LM(lm.model, lm.tokenizer, 64, batch_size=1)._score([r])[0] for r in rows]
    together = lm._score(rows)
    for (a, ga), (b, gb) in zip(alone, together):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb


# ---- the command ---------------------------------------------------------------------------------------------

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A kda-toy run of 6 steps, and a folder of the three local tasks."""
    root = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(root, n_docs=30)
    sets = [a for s in TINY_MODEL + TINY_TRAIN for a in ("--set", s)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("K3_CACHE_DIR", str(root / "cache"))
        r = runner.invoke(app, ["train", "--preset", "kda-toy", "--data", str(corpus), "--out", str(root / "run"), *sets])
    assert r.exit_code == 0, r.output
    tasks = root / "tasks"
    tasks.mkdir()
    return root / "run", write_tasks(tasks)


def test_eval_tasks_prints_a_table_and_saves_json_beside_the_run(trained):
    run, tasks = trained
    r = runner.invoke(app, ["eval", "--run", str(run), "--tasks", "k3_mc,k3_roll", "--include-path", str(tasks),
                            "--device", "cpu", "--batch-size", "3"])
    assert r.exit_code == 0, r.output
    assert "k3_mc" in r.stdout and "acc" in r.stdout and "word_perplexity" in r.stdout
    saved = sorted((run / "eval").glob("k3_mc+k3_roll-*.json"))
    assert len(saved) == 1 and f"results: {saved[0]}" in r.stdout.replace("\n", "")
    doc = json.loads(saved[0].read_text())
    assert doc["harness_version"] and doc["step"] == 6 and doc["tasks"] == ["k3_mc", "k3_roll"]
    assert set(doc["configs"]) == {"k3_mc", "k3_roll"} and doc["configs"]["k3_mc"]["output_type"] == "multiple_choice"
    assert 0 <= doc["results"]["k3_mc"]["acc,none"] <= 1


def test_eval_tasks_limit_and_output(trained, tmp_path):
    run, tasks = trained
    out = tmp_path / "res.json"
    r = runner.invoke(app, ["eval", "--run", str(run), "--tasks", "k3_mc", "--include-path", str(tasks),
                            "--limit", "2", "--output", str(out), "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["file"] == str(out)
    assert json.loads(out.read_text())["n-samples"]["k3_mc"]["effective"] == 2


@pytest.mark.parametrize("args, says", [
    (["--tasks", "k3_mc", "--data", "stdlib"], "leave them out with --tasks"),
    (["--num-fewshot", "1"], "--num-fewshot go with --tasks"),
    (["--tasks", " , "], "at least one task name"),
    (["--tasks", "k3_mc", "--include-path", "/no/such/folder"], "is not a folder of task YAMLs"),
    (["--tasks", "no_such_task_k3"], "lm-evaluation-harness"),
])
def test_eval_tasks_bad_input_is_one_error_line(trained, args, says):
    run, _ = trained
    assert says in one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--device", "cpu", *args]))


def test_without_the_harness_one_line_says_how_to_install_it(trained, monkeypatch):
    run, tasks = trained
    monkeypatch.setitem(sys.modules, "lm_eval", None)   # `import lm_eval` raises ImportError
    monkeypatch.delitem(sys.modules, "k3cli.evaluation.harness", raising=False)
    line = one_error_line(runner.invoke(app, ["eval", "--run", str(run), "--tasks", "k3_mc", "--device", "cpu"]))
    assert "needs lm-evaluation-harness: pip install -e '.[eval]'" in line
