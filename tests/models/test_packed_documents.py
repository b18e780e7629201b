"""Packed documents with the document mask (docs/math.md §10): every position of every document has the logits,
and the parameters the gradients, of that document run alone; without the mask the documents leak into each
other. fp64 on CPU (the torch paths: torch_chunk_kda_varlen, the masked short convs, masked SDPA)."""
import pytest
import torch

from k3cli.config import load_config
from k3cli.layers.segments import Segments
from k3cli.models import CausalLM
from k3cli.testing import TINY_MODEL

# two rows of 32 tokens: documents of 5, 17, 1, 9 and of 20, 12 tokens (the 1-token one, short-conv taps
# that would reach back over 1-3 boundaries, and KDA chunks of 16 that straddle documents)
ROWS = [[5, 17, 1, 9], [20, 12]]
BUILDS = [("kda-toy", "off"), ("k3-toy", "off"), ("k3-toy", "full"), ("k3-toy", "block")]


def model_of(preset, attnres):
    torch.manual_seed(0)
    cfg = load_config(preset, attnres=attnres).model
    return CausalLM(cfg).double().eval()


def starts_of(rows):
    T = sum(rows[0])
    starts = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, lens in enumerate(rows):
        starts[b, torch.tensor([0, *lens]).cumsum(0)[:-1]] = True
    return starts


def grads(model, loss):
    return torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)


@pytest.mark.parametrize("preset,attnres", BUILDS, ids=[f"{p}-{a}" for p, a in BUILDS])
def test_packed_row_equals_each_document_alone(preset, attnres):
    model = model_of(preset, attnres)
    T = sum(ROWS[0])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (len(ROWS), T), generator=g)
    weight = torch.randn(len(ROWS), T, model.config.vocab_size, generator=g, dtype=torch.float64)
    segments = Segments.from_starts(starts_of(ROWS))
    packed = model(ids, segments=segments).logits
    packed_grads = grads(model, (packed * weight).sum())
    alone_loss, bounds = 0.0, []
    for b, lens in enumerate(ROWS):
        edges = torch.tensor([0, *lens]).cumsum(0).tolist()
        for a, e in zip(edges[:-1], edges[1:]):
            logits = model(ids[b:b + 1, a:e]).logits
            err = (logits[0] - packed[b, a:e]).abs().max().item()
            assert err <= 1e-10, f"row {b} tokens {a}:{e}: logits differ by {err:.3g}"
            alone_loss = alone_loss + (logits[0] * weight[b, a:e]).sum()
            bounds.append((b, a))
    alone_grads = grads(model, alone_loss)
    for (name, _), gp, ga in zip(model.named_parameters(), packed_grads, alone_grads):
        if gp is None and ga is None:
            continue
        err = (gp - ga).abs().max().item() / max(ga.abs().max().item(), 1e-30)
        assert err <= 1e-10, f"{name}: gradient differs by {err:.3g} (relative to its max)"
    # without the mask the second document onwards reads the first: the logits differ
    leaky = model(ids).logits.detach()
    b, a = bounds[1]
    assert (leaky[b, a:] - packed[b, a:].detach()).abs().max() > 1e-4, "no leakage without the mask?"


def test_segments_from_starts():
    s = Segments.from_starts(starts_of([[2, 3], [5]]))
    assert s.cu_seqlens.tolist() == [0, 2, 5, 10, 10, 10, 10, 10, 10, 10, 10]
    assert s.doc.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert s.pos.tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.mark.triton
def test_packed_row_on_the_triton_kernels():
    """The KDA layers' Triton path (chunk_kda with cu_seqlens and the in-kernel gate; the interpreter on CPU),
    fp32: a packed batch against each document alone, logits and gradients within chunk_kda's fp32 bound.
    One layer of the tiny model's KDA (grouped value heads, K = 8, chunk 16) keeps the interpreter's work
    small."""
    torch.manual_seed(0)
    cfg = load_config("kda-toy", overrides=[*TINY_MODEL, "model.num_hidden_layers=1", "model.kda.backend=triton",
                                            "model.kda.chunk_size=16", "model.vocab_size=256"]).model
    model = CausalLM(cfg).eval()
    rows = [[5, 17, 1, 9]]
    T = sum(rows[0])
    ids = torch.randint(1, 256, (1, T), generator=torch.Generator().manual_seed(1))
    packed = model(ids, segments=Segments.from_starts(starts_of(rows))).logits
    gp = grads(model, packed.square().sum())
    edges = torch.tensor([0, *rows[0]]).cumsum(0).tolist()
    alone = [model(ids[:, a:e]).logits for a, e in zip(edges[:-1], edges[1:])]
    ga = grads(model, sum(x.square().sum() for x in alone))
    ref = torch.cat(alone, 1)
    assert ((packed - ref).norm() / ref.norm()).item() < 2e-4
    for (name, _), x, y in zip(model.named_parameters(), gp, ga):
        assert ((x - y).norm() / y.norm().clamp_min(1e-12)).item() < 2e-4, name
