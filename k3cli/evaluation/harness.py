"""Benchmark tasks through EleutherAI's lm-evaluation-harness (`k3 eval --tasks`): k3's adapter of the harness's
`LM` interface, and `run_tasks`, which runs tasks on a run, checkpoint or export and saves the results.

The harness is an optional extra (`pip install -e '.[eval]'`); importing this module without it raises one
UserError that says how to install it.

How the adapter scores text, in the model's own terms:
- every sequence starts with `<|endoftext|>`, as a document does in training and a prompt in `k3 generate`;
- `loglikelihood(context, continuation)`: the sum of log p(token) over the continuation's tokens, and whether
  each was the argmax. The continuation's tokens are the tokens of context + continuation after the context's
  own (whitespace at the end of the context moves to the continuation, so BPE sees " word" whole). Longer
  than the window (`train.seq_len`): the context is cut from the left. Requests run in batches, longest first;
- `loglikelihood_rolling(text)`: the whole text's log-likelihood, in windows of at most the window's length
  that each predict the next stretch of tokens (the first from `<|endoftext|>`);
- `generate_until(context, kwargs)`: prefill once, then the decode cache; stops at `<|endoftext|>`, at
  `max_gen_toks` or when the text holds one of `until`, and is cut before it. Greedy unless `do_sample`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from k3cli.errors import UserError
from k3cli.evaluation.generate import generate_ids
from k3cli.files import write_text_atomic

try:
    import lm_eval
    from lm_eval.api.model import LM
except ImportError:
    raise UserError("k3 eval --tasks needs lm-evaluation-harness: pip install -e '.[eval]' "
                    "(or pip install 'lm-eval>=0.4,<0.5')") from None


class K3LM(LM):
    """A k3 `CausalLM` and its tokenizer behind the harness's `LM` interface (one process, one device)."""

    def __init__(self, model, tokenizer, max_length: int, batch_size: int = 8, seed: int = 0):
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self._max_length, self.batch_size, self.seed = max_length, batch_size, seed
        self._device = model.embed_tokens.weight.device

    @property
    def max_length(self) -> int:
        return self._max_length

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        head, whole = self._encode(context), self._encode(context + continuation)
        if whole[:len(head)] == head:
            return [self.tokenizer.bos_id] + head, whole[len(head):]
        return [self.tokenizer.bos_id] + head, self._encode(continuation)

    @torch.no_grad()
    def _score(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each row's `targets` following its `tokens`: [context..., targets...]
        with the last `len(targets)` positions scored; the context is cut from the left to the window."""
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        inputs = []
        for i, (tokens, targets) in enumerate(rows):
            full = (tokens + targets)[-(self.max_length + 1):]
            inputs.append((i, full[:-1], targets[len(targets) - min(len(targets), len(full) - 1):]))
        inputs.sort(key=lambda r: -len(r[1]))   # longest first: the first batch shows an out-of-memory at once
        for start in range(0, len(inputs), self.batch_size):
            batch = inputs[start:start + self.batch_size]
            width = len(batch[0][1])
            # padding after a row's end: causal, so it never reaches the scored positions
            x = torch.full((len(batch), width), self.tokenizer.eos_id, dtype=torch.long)
            for j, (_, ids, _) in enumerate(batch):
                x[j, :len(ids)] = torch.tensor(ids)
            logp = F.log_softmax(self.model(x.to(self._device)).logits.float(), dim=-1)
            for j, (i, ids, targets) in enumerate(batch):
                n, k = len(ids), len(targets)
                rows_logp = logp[j, n - k:n]   # [k, V]: position t predicts token t + 1
                want = torch.tensor(targets, device=rows_logp.device)
                picked = rows_logp.gather(-1, want[:, None]).squeeze(-1)
                out[i] = (float(picked.double().sum()), bool((rows_logp.argmax(-1) == want).all()))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        results = self._score([self._split(*r.args) for r in requests])
        for r, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", r.args, res)
        return results

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """(context, targets) windows that together predict every token of `text` once: targets in stretches of
        the window's length, each after as much of the text before it as fits the window (`_score` cuts it)."""
        ids = self._encode(text)
        stream = [self.tokenizer.bos_id] + ids
        L = self.max_length
        return [(stream[max(0, start + 1 - L):start + 1], ids[start:start + L]) for start in range(0, len(ids), L)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for r in requests:
            windows = self.rolling_windows(r.args[0])
            total = sum(ll for ll, _ in self._score(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
            results.append(total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        for r in requests:
            text = self.generate(*r.args)
            self.cache_hook.add_partial("generate_until", r.args, text)
            results.append(text)
        return results

    def generate(self, context: str, kwargs: dict | None = None) -> str:
        """The continuation of `context` under the harness's generation arguments, cut before a stop string."""
        kwargs = dict(kwargs or {})
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        sample = bool(kwargs.get("do_sample", False))
        temperature = float(kwargs.get("temperature", 1.0)) if sample else 0.0
        prompt = ([self.tokenizer.bos_id] + self._encode(context))[-self.max_length:]

        def stop(new: list[int]) -> bool:
            return any(s in self.tokenizer.decode(new) for s in until)

        new, _, _, _ = generate_ids(self.model, prompt, int(kwargs.get("max_gen_toks", 256)), temperature,
                                    int(kwargs.get("top_k", 0)), float(kwargs.get("top_p", 1.0)), self.seed,
                                    stop_when=stop if until else None, eos_id=self.tokenizer.eos_id)
        text = self.tokenizer.decode(new)
        for s in until:
            text = text.split(s, 1)[0]
        return text


def harness_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def run_tasks(model, tokenizer, max_length: int, tasks: list[str], num_fewshot: int | None = None,
              limit: float | None = None, batch_size: int = 8, include_path: str | None = None,
              seed: int = 0) -> dict:
    """The harness's `simple_evaluate` over `tasks` with k3's adapter; its result dict (no per-sample logs)."""
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path:   # the harness's own task index takes seconds to build: skip it when the folder holds them all
        local = TaskManager(include_path=include_path, include_defaults=False)
        manager = local if set(tasks) <= set(local.all_tasks) else TaskManager(include_path=include_path)
    manager = manager or TaskManager()
    lm = K3LM(model, tokenizer, max_length, batch_size, seed)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=False, random_seed=seed,
                                   numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)


def result_rows(results: dict) -> list[tuple[str, str, float, float | None]]:
    """(task, metric, value, stderr) of every metric the harness reports, in its task order."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if name in ("alias", "samples", "sample_len") or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{name}_stderr,{filt}")
            rows.append((task, name if filt in ("", "none") else f"{name} ({filt})", float(value),
                         float(stderr) if isinstance(stderr, (int, float)) else None))
    return rows


def save_results(results: dict, out: Path, source: dict) -> Path:
    """The results as JSON at `out`: the harness's results, versions, n-shot and task configs, its version,
    and what was evaluated (`source`)."""
    keep = {k: results[k] for k in ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples",
                                    "configs") if k in results}
    doc = {"harness": "lm-evaluation-harness", "harness_version": harness_version(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **source, **keep}
    write_text_atomic(out, json.dumps(doc, indent=2, default=str) + "\n")
    return out


def default_output(run_dir: Path, tasks: list[str]) -> Path:
    """eval/<tasks>-<time>.json beside the run (inside an export folder for an export)."""
    name = "+".join(t.replace("/", "_") for t in tasks)[:80]
    return run_dir / "eval" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def evaluate_tasks(run: str | None, ckpt: str | None, tasks: list[str], num_fewshot: int | None = None,
                   limit: float | None = None, batch_size: int | None = None, include_path: str | None = None,
                   device: str = "auto", output: Path | None = None, log=print) -> tuple[dict, Path]:
    """`k3 eval --tasks`: the harness's tasks on a run's newest verified checkpoint, a checkpoint or an export;
    the harness's results and the JSON file they were saved to."""
    from k3cli.evaluation.runs import open_run

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path} is not a folder of task YAMLs")
    opened = open_run(run, ckpt, device, warn=log)
    bs = batch_size or opened.cfg.eval.batch_size
    log(f"tasks {', '.join(tasks)} on {opened.ckpt_dir} (step {opened.step}), window {opened.cfg.train.seq_len} "
        f"tokens, batch {bs}, lm-evaluation-harness {harness_version()}")
    cuda = opened.device.type == "cuda"
    with torch.autocast(opened.device.type, dtype=torch.bfloat16, enabled=cuda):
        results = run_tasks(opened.model, opened.tokenizer, opened.cfg.train.seq_len, tasks, num_fewshot, limit,
                            bs, include_path)
    source = {"run": str(opened.run_dir), "checkpoint": str(opened.ckpt_dir), "step": opened.step,
              "tasks": tasks, "num_fewshot": num_fewshot, "limit": limit, "batch_size": bs,
              "window": opened.cfg.train.seq_len, "device": str(opened.device)}
    return results, save_results(results, output or default_output(opened.run_dir, tasks), source)
