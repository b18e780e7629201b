"""The language-model loss without the [N, V] fp32 logits: cross-entropy of `h @ wᵀ`, made chunk by chunk of
tokens, each chunk's logits reduced and dropped.

    loss = (1/n) Σ_t [labels[t] != ignore_index] (logsumexp(z_t) − z_t[labels[t]]),   z_t = w h_t

with n the counted tokens. d loss / d z_t = (softmax(z_t) − onehot(labels[t])) / n, so dh_t = dz_t w and
dw = Σ_t dz_tᵀ h_t. The loss is a scalar, so its gradients are known up to the incoming factor once the
forward has the logits: per chunk the forward makes z (in the inputs' dtype, as `F.linear` does), one kernel
(`ce_rows`) reads each row twice — its log-sum-exp, then dz written over z — and two products give the chunk's
dh and its share of dw (fp32 sums). The backward only scales them: the logits are made once, not twice, and
peak memory holds one chunk's logits instead of all N (`linear_cross_entropy_reference` is the full-logits
form: `F.cross_entropy(F.linear(h, w).float(), labels)`, the oracle of the tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from k3cli.ops.custom import absent
from k3cli.ops.launch import fast_launch, next_pow2
from k3cli.ops.precision import widen, work_dtype

# one chunk's logits stay below this many bytes counted at 4 per logit (2,048 tokens at a 32,768 vocabulary)
CHUNK_BYTES = 2**28


def linear_cross_entropy_reference(h: Tensor, w: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """h [N, D], w [V, D], labels [N] -> mean cross-entropy over the counted tokens (full logits)."""
    z = F.linear(h, w)
    return F.cross_entropy(widen(z), labels, ignore_index=ignore_index)


def ce_rows_reference(z: Tensor, labels: Tensor, scale: Tensor, ignore_index: int,
                      grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """Per row of logits z [R, V]: (logsumexp(z) − z[label], 0 where ignored) in fp32 (fp64 for fp64 z), and with
    `grad` dz = (softmax(z) − onehot(label))·scale (0 where ignored) in z's dtype. scale: a 0-dim tensor."""
    zf = widen(z)
    counted = labels != ignore_index
    y = torch.where(counted, labels, 0)[:, None]
    lse = torch.logsumexp(zf, 1)
    loss = torch.where(counted, lse - zf.gather(1, y).squeeze(1), 0)
    if not grad:
        return loss, None
    dz = torch.exp(zf - lse[:, None]).scatter_add_(1, y, -torch.ones_like(zf[:, :1]))
    return loss, (dz * torch.where(counted, scale.to(zf.dtype), 0)[:, None]).to(z.dtype)


@fast_launch
@triton.jit
def _ce_rows_kernel(z, labels, loss, scale, stride, ignore_index, V: tl.constexpr, BLOCK: tl.constexpr,
                    GRAD: tl.constexpr):
    """One program per row: log-sum-exp by an online max over BLOCK-column pieces, the row's loss, and with GRAD
    dz over the row in place (z's dtype). Sums in loss's dtype (fp32, fp64 for fp64 logits)."""
    ACC = loss.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    p = z + row * stride
    cols = tl.arange(0, BLOCK)
    x = tl.load(p + cols, mask=cols < V, other=float("-inf")).to(ACC)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    for start in range(BLOCK, V, BLOCK):
        x = tl.load(p + start + cols, mask=start + cols < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(labels + row).to(tl.int64)
    counted = y != ignore_index
    z_y = tl.load(p + y, mask=counted, other=0.).to(ACC)
    tl.store(loss + row, tl.where(counted, lse - z_y, 0.))
    if GRAD:
        sc = tl.where(counted, tl.load(scale).to(ACC), 0.)
        for start in range(0, V, BLOCK):
            o = start + cols
            x = tl.load(p + o, mask=o < V, other=0.).to(ACC)
            d = tl.exp(x - lse)
            d = tl.where(o == y, d - 1., d) * sc
            tl.store(p + o, d.to(z.dtype.element_ty), mask=o < V)


def ce_rows(z: Tensor, labels: Tensor, scale: Tensor, ignore_index: int, grad: bool = True) -> Tensor:
    """As `ce_rows_reference` by one Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1): returns the row losses;
    with `grad` z [R, V] (contiguous rows) is overwritten by dz."""
    R, V = z.shape
    loss = torch.empty(R, dtype=work_dtype(z), device=z.device)
    if R:
        BLOCK = min(next_pow2(V), 4096)
        _ce_rows_kernel[(R,)](z, labels, loss, scale, z.stride(0), ignore_index, V=V, BLOCK=BLOCK, GRAD=grad,
                              num_warps=8 if BLOCK >= 2048 else 4)
    return loss


def _kernel_runs(device: torch.device) -> bool:
    # CUDA only: under Triton's interpreter every model test on the CPU would run the row kernel row by row in
    # Python; the kernel's own tests run it there
    return device.type == "cuda"


def _mm_acc(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """a @ b with the product in `acc`: on CUDA 16-bit operands accumulate into fp32 directly."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=acc)
    return (a @ b).to(acc)


def _linear_ce(h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, rows: int, grad: bool):
    acc = work_dtype(h)
    kernel = _kernel_runs(h.device)
    counted = labels != ignore_index
    scale = 1 / counted.sum().to(acc)              # a device tensor: nothing is read back to the host
    total = torch.zeros((), dtype=acc, device=h.device)
    dh = torch.empty(h.shape, dtype=acc, device=h.device) if grad else absent(h)
    dw = torch.zeros(w.shape, dtype=acc, device=h.device) if grad else absent(h)
    for s in range(0, h.shape[0], rows):
        hs, y = h[s:s + rows], labels[s:s + rows]
        z = hs @ w.T                                                               # (rows, V), h's dtype
        if kernel:
            loss = ce_rows(z, y, scale, ignore_index, grad)
        else:
            loss, z = ce_rows_reference(z, y, scale, ignore_index, grad)
        total = total + loss.sum()
        if grad:
            dh[s:s + rows] = _mm_acc(z, w, acc)
            dw += _mm_acc(z.T, hs, acc)
    return total * scale, dh, dw


@torch.library.custom_op("k3::linear_ce", mutates_args=(), device_types=("cuda", "cpu"))
def linear_ce_op(h: Tensor, w: Tensor, labels: Tensor, ignore_index: int, rows: int,
                 grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(mean loss, dh, dw) of the loss itself (fp32; fp64 for fp64 inputs); dh and dw empty unless `grad`."""
    return _linear_ce(h, w, labels, ignore_index, rows, grad)


@linear_ce_op.register_fake
def _(h, w, labels, ignore_index, rows, grad):
    acc = work_dtype(h)
    return (h.new_empty((), dtype=acc), h.new_empty(h.shape, dtype=acc) if grad else absent(h),
            h.new_empty(w.shape, dtype=acc) if grad else absent(h))


def _setup(ctx, inputs, output):
    h, w = inputs[:2]
    ctx.save_for_backward(output[1], output[2])
    ctx.dtypes = h.dtype, w.dtype


def _backward(ctx, grad, _dh, _dw):
    dh, dw = ctx.saved_tensors
    if dh.numel() == 0:
        raise RuntimeError("linear_cross_entropy: called without gradients, then differentiated")
    g = grad.to(dh.dtype)
    return (dh * g).to(ctx.dtypes[0]), (dw * g).to(ctx.dtypes[1]), None, None, None, None


linear_ce_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(h: Tensor, w: Tensor, labels: Tensor, ignore_index: int = -100,
                         rows: int | None = None) -> Tensor:
    """h [N, D], w [V, D], labels [N] (long) -> the mean cross-entropy of `h @ wᵀ` over tokens whose label is
    not `ignore_index`, in chunks of `rows` tokens (default: as many as CHUNK_BYTES hold at 4 bytes per logit).
    Under autocast h and w are cast as `F.linear` would cast them; the gradients are made only when autograd
    will ask for them."""
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1] or labels.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy: h [N, D], w [V, D], labels [N]; got {tuple(h.shape)}, "
                         f"{tuple(w.shape)}, {tuple(labels.shape)}")
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        dt = torch.get_autocast_dtype(kind)
        h, w = h.to(dt), w.to(dt)
    elif h.dtype != w.dtype:
        raise ValueError(f"linear_cross_entropy: h is {h.dtype} and w {w.dtype}; they must match")
    grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    rows = rows or max(1, min(h.shape[0], CHUNK_BYTES // (4 * w.shape[0])))
    return linear_ce_op(h.contiguous(), w.contiguous(), labels, ignore_index, rows, grad)[0]
