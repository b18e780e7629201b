"""`model.fp32_residual`: under autocast the residual stream (with AttnRes: the depth mixes' sources) stays fp32
by default, or takes the autocast dtype when false; without autocast the setting changes nothing."""
import pytest
import torch

from k3cli.config import load_config
from k3cli.models.causal_lm import CausalLM
from k3cli.testing import TINY_MODEL, relative_rms_error


def build(attnres: str, fp32_residual: bool) -> CausalLM:
    torch.manual_seed(0)
    cfg = load_config("k3-toy", overrides=TINY_MODEL + [f"model.fp32_residual={str(fp32_residual).lower()}"],
                      attnres=attnres)
    return CausalLM(cfg.model).train()


def stream_dtypes(model: CausalLM, ids: torch.Tensor, autocast: bool):
    """The dtypes of what the blocks' pre-norms read (the residual stream, or the AttnRes mixes), the loss
    and every gradient."""
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
             for b in model.blocks for m in b.sublayer_norms()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(ids, labels=ids).loss
    loss.backward()
    for h in hooks:
        h.remove()
    return seen, loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attnres", ["off", "block", "full"])
def test_the_stream_takes_the_autocast_dtype_only_when_asked(attnres):
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    wide, narrow = build(attnres, True), build(attnres, False)
    seen_wide, loss_wide, grads_wide = stream_dtypes(wide, ids, autocast=True)
    seen_narrow, loss_narrow, grads_narrow = stream_dtypes(narrow, ids, autocast=True)
    assert seen_wide == {torch.float32} and seen_narrow == {torch.bfloat16}
    # the same model at bf16's rounding: parameters stay fp32, the gradients close to the fp32 stream's
    assert abs(loss_narrow.item() - loss_wide.item()) < 0.02 * loss_wide.item()
    num = sum(relative_rms_error(a, b) * b.norm() for a, b in zip(grads_narrow, grads_wide))
    assert num / sum(b.norm() for b in grads_wide) < 0.1
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads_narrow)
    # no autocast: nothing to narrow to, bitwise the default model
    _, loss_a, grads_a = stream_dtypes(wide, ids, autocast=False)
    seen_b, loss_b, grads_b = stream_dtypes(narrow, ids, autocast=False)
    assert seen_b == {torch.float32} and torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_one_graph_under_compile():
    """The autocast queries trace into one graph; values as eager's up to the order of bf16 casts (the
    default stream's compiled loss differs from eager by as much)."""
    model = build("block", False)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(ids, labels=ids).loss, compiled(ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)
