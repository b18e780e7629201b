"""The whole model with every Kimi Linear option on (softplus KDA gate, direct query and shared key part in MLA,
no MLA output gate, full-width SwiGLU experts with grouped routing and scaling, a dense first block, the MLA
blocks by index): one full graph under torch.compile (forward and backward equal eager, with and without
packed documents), and prefill + decode equal to the full forward."""
import pytest
import torch

from k3cli.config import load_config
from k3cli.layers.segments import Segments
from k3cli.models.causal_lm import CausalLM
from k3cli.testing import KIMI_TINY as KIMI


def build():
    torch.manual_seed(0)
    return CausalLM(load_config("k3-toy", overrides=KIMI).model).train()


def loss_and_grads(model, forward, ids, segments=None):
    model.zero_grad()
    loss = forward(ids, labels=ids, segments=segments).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow   # about 30 s per case on 2 cores: the compile
@pytest.mark.parametrize("packed", [False, True])
def test_fullgraph_forward_backward_equals_eager(packed):
    model = build()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    segments = None
    if packed:
        starts = torch.zeros(2, 24, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, 9] = starts[1, 17] = True
        segments = Segments.from_starts(starts)
    ref_loss, ref = loss_and_grads(model, model, ids, segments)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss, grads = loss_and_grads(model, compiled, ids, segments)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.slow   # the compile, and on a CPU the kernels in the interpreter
@pytest.mark.triton
def test_fullgraph_with_the_triton_kernels_equals_eager():
    """The Triton path of the softplus gate (chunk_kda without a decay bound and the gate in the kernel, over
    packed documents; the interpreter on a CPU) as opaque ops in one compiled graph: loss and every gradient
    equal eager."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = load_config("k3-toy", overrides=KIMI + ["model.kda.chunk_size=16", "model.kda.backend=triton"])
    model = CausalLM(cfg.model).to(dev).train()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0)).to(dev)
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, 9] = starts[1, 27] = True
    segments = Segments.from_starts(starts, dev)
    ref_loss, ref = loss_and_grads(model, model, ids, segments)
    compiled = torch.compile(model, fullgraph=True, backend="inductor" if dev == "cuda" else "aot_eager")
    loss, grads = loss_and_grads(model, compiled, ids, segments)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


def test_prefill_then_decode_equals_the_full_forward():
    model = build().eval()
    ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        logits, cache = model.prefill(ids[:, :11])
        steps = [logits] + [model.decode_step(ids[:, t:t + 1], cache) for t in range(11, 19)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
