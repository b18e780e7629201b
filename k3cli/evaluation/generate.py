"""`k3 generate`: sample text from a trained model with the decode cache (prefill once, then one
recurrent step per new token; docs/math.md §2.5).

Sampling: greedy at temperature 0; otherwise softmax(logits / temperature) restricted to the top-k
tokens and then to the smallest set whose probability reaches top-p (nucleus), drawn from a seeded
generator. Generation stops at the tokenizer's end token (`<|endoftext|>`, EOT_ID, for k3's own
tokenizers), which is not part of the output. The prompt is preceded by its start token (EOT again for
k3's own, as every document is in the packed training stream).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3cli.data import EOT_ID
from k3cli.models.causal_lm import CausalLM


@dataclass
class Generation:
    text: str
    token_ids: list[int]            # the new tokens (without the prompt and the final EOT)
    prompt_tokens: int              # including the leading EOT
    stopped_at_eot: bool
    prefill_s: float
    decode_s: float

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        # the first new token comes from the prefill logits; each later one costs one decode step
        steps = max(len(self.token_ids) - 1 + self.stopped_at_eot, 0)
        return steps / self.decode_s if self.decode_s > 0 else float("nan")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):   # nan passed `< 0`; inf sampled uniformly
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, vocab] -> next token ids [B] (greedy at temperature 0; top_k 0 and top_p 1 = off)."""
    if temperature == 0 or top_k == 1:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()   # no autograd bookkeeping at all: ~10 % off a CPU decode step vs no_grad
def generate_ids(model: CausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 on_token: Callable[[int], None] | None = None,
                 stop_when: Callable[[list[int]], bool] | None = None,
                 eos_id: int = EOT_ID) -> tuple[list[int], bool, float, float]:
    """Sample up to max_new_tokens after prompt_ids (one sequence), until `eos_id` or `stop_when(new ids)`.
    Returns (new ids without the end token, stopped at it, prefill seconds, decode seconds)."""
    check_sampling(temperature, top_k, top_p)
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed if seed is not None else torch.seed())
    x = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new, stopped = [], False
    _sync(device)
    t0 = time.perf_counter()
    logits, cache = model.prefill(x)
    _sync(device)
    t1 = time.perf_counter()
    next_id = sample_next(logits[:, -1], temperature, top_k, top_p, gen) if max_new_tokens > 0 else None
    while next_id is not None:
        tok = int(next_id)
        if tok == eos_id:
            stopped = True
            break
        new.append(tok)
        if on_token is not None:
            on_token(tok)
        if len(new) == max_new_tokens or (stop_when is not None and stop_when(new)):
            break
        logits = model.decode_step(next_id.view(1, 1), cache)
        next_id = sample_next(logits[:, -1], temperature, top_k, top_p, gen)
    _sync(device)
    return new, stopped, t1 - t0, time.perf_counter() - t1


def generate(model: CausalLM, tokenizer, prompt: str, max_new_tokens: int = 128, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
             stream_callback: Callable[[str], None] | None = None) -> Generation:
    """Continue `prompt`; stream_callback(text_piece) receives the decoded text as it grows.

    Pieces are emitted only once they decode to whole characters (byte-level BPE can split one).
    """
    model.eval()
    prompt_ids = [tokenizer.bos_id] + tokenizer.encode(prompt).ids
    state = {"ids": [], "sent": 0}

    def on_token(tok: int) -> None:
        state["ids"].append(tok)
        text = tokenizer.decode(state["ids"])
        if stream_callback is not None and not text.endswith("\ufffd") and len(text) > state["sent"]:
            stream_callback(text[state["sent"]:])
            state["sent"] = len(text)

    # streaming re-decodes the growing text per token; without a callback there is nothing to stream
    ids, stopped, prefill_s, decode_s = generate_ids(model, prompt_ids, max_new_tokens, temperature, top_k,
                                                     top_p, seed, on_token if stream_callback is not None else None,
                                                     eos_id=tokenizer.eos_id)
    text = tokenizer.decode(ids)
    if stream_callback is not None and len(text) > state["sent"]:
        stream_callback(text[state["sent"]:])
    return Generation(text, ids, len(prompt_ids), stopped, prefill_s, decode_s)
