"""LatentMoE (docs/math.md §4): shared experts at full width, routed experts in a latent of width ℓ.

    y = Σ_j E_shared_j(x) + W_↑ RMSNorm(Σ_k p_k · E_routed_{id_k}(W_↓ x))

Routing: sigmoid scores on x in fp32; top-k on scores + a load-balancing bias (a buffer, no
gradient); weights p = the UNbiased scores of the chosen k, normalised by their sum (K3 /
DeepSeek-V3). Balancing is auxiliary-loss-free: `update_bias()` after each optimiser step.

Options (each off by default, docs/math.md §4): the weights scaled by `routed_scaling_factor` and left
unnormalised (`renormalize=False`); grouped routing (`num_expert_groups` G, `topk_groups`: top-k only
within the best groups, DeepSeek-V3); the experts' gated activation (`expert_act`: situ | silu); routed
experts at full width on x (`latent=False`: no W_↓, RMSNorm, W_↑). Kimi Linear's MoE is G groups, silu,
latent off.

Shape-suffix legend (torchtitan style): T tokens (B·T flattened), D hidden, L latent ℓ,
F expert hidden d_ff, E routed experts, K top-k, S = T·K token-slots, C per-expert capacity.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3cli.layers.ffn import EXPERT_ACTS, SiTUExpert
from k3cli.layers.linear import fused_linear, summed_linear
from k3cli.layers.norm import RMSNorm
from k3cli.ops.precision import work_dtype

DISPATCH_MODES = ("grouped", "tiled", "loop", "dense")


def _recomputing() -> bool:
    """Inside a backward pass, i.e. activation checkpointing re-running this forward in eager mode
    (whose tokens were counted the first time). Compiled graphs recompute inside the graph, once."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def tile_rows(slots: int, experts: int) -> int:
    """Rows per tile R of the tiled dispatch: the power of two (16 to 1024) nearest S / 8E, so an
    average group spans ~8 tiles: padding costs at most E·R rows (~1/8 of S), and the per-tile
    weight copies (P·ℓ·d_ff per weight) stay a few times the experts' own size."""
    r = 16
    while r < 1024 and r * 8 * experts < slots:
        r *= 2
    return r


def gather_experts(w_E: torch.Tensor, expert_P: torch.Tensor) -> torch.Tensor:
    """w[expert_P] ([E, ...] -> [P, ...]) as a one-hot product: the same values, but its backward is one
    matmul instead of an accumulating index-put, which sorts (6 ms of a 358 ms k3-0.5b step on an H200)."""
    # a comparison, not F.one_hot, which reads the indices' range back to the host
    onehot_PE = (expert_P[:, None] == torch.arange(w_E.shape[0], device=w_E.device)).to(w_E.dtype)
    return (onehot_PE @ w_E.reshape(w_E.shape[0], -1)).view(expert_P.shape[0], *w_E.shape[1:])


class _GatherRows(torch.autograd.Function):
    """y = [x; 0][fwd_N] with the gradient gathered too: dx = Σ_k [dy; 0][bwd_XK[:, k]]. Autograd's own
    backward of an index is an accumulating index-put that sorts its indices: 100 of 358 ms of a k3-0.5b
    step on an H200. A gather both ways needs no sort and no atomics, so it stays deterministic."""

    @staticmethod
    def forward(ctx, x_XL, fwd_N, bwd_XK):
        ctx.save_for_backward(bwd_XK)
        return torch.cat([x_XL, x_XL.new_zeros(1, x_XL.shape[1])])[fwd_N]

    @staticmethod
    def backward(ctx, dy_NL):
        (bwd_XK,) = ctx.saved_tensors
        dy = torch.cat([dy_NL, dy_NL.new_zeros(1, dy_NL.shape[1])])
        return dy[bwd_XK].sum(1), None, None


def gather_rows(x_XL: torch.Tensor, fwd_N: torch.Tensor, bwd_XK: torch.Tensor) -> torch.Tensor:
    """Rows of x [X, L] at fwd_N [N] (index X: a zero row) -> [N, L]. bwd_XK [X, k] must list, for every
    row of x, the k positions of y that read it (index N: none), so that the gradient is a gather too."""
    return _GatherRows.apply(x_XL, fwd_N, bwd_XK)


@torch.compiler.assume_constant_result
def grouped_mm_kernel_on(device: torch.device) -> bool:
    """Whether torch's grouped matmul has its kernel on this CUDA device (NVIDIA compute capability 9.x or
    10.x); on other GPUs it loops over the groups and reads their sizes back to the host at every call.
    ROCm reports its own chips' versions here, and its path was not checked: tiled there."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_mm_runs(x: torch.Tensor, *widths: int) -> bool:
    """Whether torch's grouped matmul takes rows of x [.., widths] here without a host sync: bf16 on a CUDA
    device with its kernel (other CUDA dtypes and devices fall back to a loop that reads the group sizes
    back to the host), bf16 or fp32 on the CPU (fp32 outside torch.compile, whose shape function accepts
    bf16 only), nothing elsewhere; rows of a multiple of 16 bytes."""
    if not all(w * x.element_size() % 16 == 0 for w in widths):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and grouped_mm_kernel_on(x.device)
    if x.device.type == "cpu":
        return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not torch.compiler.is_compiling())
    return False


def max_over_mean(counts: torch.Tensor) -> torch.Tensor:
    """Expert-load imbalance over the last dim, max load / mean load (0 where no tokens were routed);
    batched, so several layers' counts [L, E] cost one read-back."""
    load = counts.double()
    return torch.where(load.sum(-1) > 0, load.amax(-1) / load.mean(-1), 0.0)


class LatentMoE(nn.Module):
    """Parameters: n_s shared SiTUExpert(D, d_ff); router D→n_r; down_proj D→ℓ; stacked routed
    w_gate [n_r, ℓ, d_ff], w_up [n_r, ℓ, d_ff], w_down [n_r, d_ff, ℓ]; u_norm [ℓ]; up_proj ℓ→D.
    With latent=False: no down_proj, u_norm, up_proj, and the routed weights have D in place of ℓ.
    Buffers: router_bias [n_r] (persistent), load_counts [n_r] (token-slots since the last update).
    """

    def __init__(self, hidden_size: int, num_routed_experts: int, top_k: int, num_shared_experts: int,
                 d_ff: int, latent_dim: int, dispatch: str = "grouped", bias_update_rate: float = 1e-3,
                 norm_eps: float = 1e-6, init_std: float = 0.02, routed_scaling_factor: float = 1.0,
                 renormalize: bool = True, num_expert_groups: int = 1, topk_groups: int = 1,
                 expert_act: str = "situ", latent: bool = True):
        super().__init__()
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown MoE dispatch '{dispatch}'; valid: {', '.join(DISPATCH_MODES)}")
        if expert_act not in EXPERT_ACTS:
            raise ValueError(f"unknown MoE expert_act '{expert_act}'; valid: {', '.join(EXPERT_ACTS)}")
        G = num_expert_groups
        if G < 1 or num_routed_experts % G or (G > 1 and num_routed_experts // G < 2):
            raise ValueError(f"num_expert_groups={G} must divide num_routed_experts={num_routed_experts} "
                             "into groups of at least 2 experts")
        if not 1 <= topk_groups <= G or top_k > num_routed_experts // G * topk_groups:
            raise ValueError(f"topk_groups={topk_groups} must lie in [1, num_expert_groups={G}] and keep at "
                             f"least top_k={top_k} experts")
        D, E, L = hidden_size, num_routed_experts, latent_dim if latent else hidden_size
        self.num_experts, self.top_k, self.dispatch = E, top_k, dispatch
        self.bias_update_rate = bias_update_rate
        self.routed_scaling_factor, self.renormalize = routed_scaling_factor, renormalize
        self.num_expert_groups, self.topk_groups = G, topk_groups
        self.expert_act, self.latent = expert_act, latent
        self.act = EXPERT_ACTS[expert_act]
        self.shared = nn.ModuleList(SiTUExpert(D, d_ff, expert_act) for _ in range(num_shared_experts))
        self.router = nn.Linear(D, E, bias=False)
        self.register_buffer("router_bias", torch.zeros(E))
        # integer counts: exact, and untouched by model.to(dtype)
        self.register_buffer("load_counts", torch.zeros(E, dtype=torch.long), persistent=False)
        self.down_proj = nn.Linear(D, L, bias=False) if latent else None
        self.w_gate = nn.Parameter(torch.randn(E, L, d_ff) * init_std)
        self.w_up = nn.Parameter(torch.randn(E, L, d_ff) * init_std)
        self.w_down = nn.Parameter(torch.randn(E, d_ff, L) * init_std)
        self.u_norm = RMSNorm(L, norm_eps) if latent else None
        self.up_proj = nn.Linear(L, D, bias=False) if latent else None

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (ids [T, K] long, weights [T, K] fp32, or fp64 for fp64 x)."""
        wd = work_dtype(x_TD)
        # fp32 router even under autocast: near-tied scores would flip expert choices in bf16
        with torch.autocast(x_TD.device.type, enabled=False):
            scores_TE = torch.sigmoid(F.linear(x_TD.to(wd), self.router.weight.to(wd)))
        # the bias only picks experts; it never enters the weights and gets no gradient
        choice_TE = scores_TE.detach() + self.router_bias.to(wd)
        if self.num_expert_groups > 1:
            # a group's score: the sum of its 2 best biased scores; experts outside the best topk_groups
            # groups cannot be chosen
            G, E = self.num_expert_groups, self.num_experts
            group_TG = choice_TE.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            best_TG = group_TG.topk(self.topk_groups, dim=-1).indices
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, True)
            choice_TE = choice_TE.masked_fill(~keep_TG.repeat_interleave(E // G, dim=1), float("-inf"))
        ids_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
        top_TK = scores_TE.gather(1, ids_TK)
        if self.renormalize:
            top_TK = top_TK / top_TK.sum(-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            top_TK = top_TK * self.routed_scaling_factor
        return ids_TK, top_TK

    def forward(self, x: torch.Tensor, dispatch: str | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. `dispatch` overrides the configured mode.

        With the configured grouped or tiled form and at most num_experts tokens (decode steps), the dense
        form runs instead: same values up to summation order, and fewer ops for a handful of tokens. The
        grouped form runs the tiled one where torch's grouped matmul does not run (`grouped_mm_runs`:
        fp64, fp32 on CUDA or under torch.compile, GPUs without its kernel, unaligned widths).
        """
        shape = x.shape
        x_TD = x.reshape(-1, shape[-1])
        ids_TK, w_TK = self.route(x_TD)
        if self.training and not _recomputing():
            with torch.no_grad():   # scatter_add, not bincount: its output size would depend on the data
                self.load_counts.scatter_add_(0, ids_TK.flatten(), torch.ones_like(ids_TK.flatten()))
        # x's projections (the latent, each shared expert's gate and up) as one matmul (layers/linear.py);
        # without the latent the routed experts read x itself
        projs = [*([self.down_proj] if self.latent else []), *(p for e in self.shared for p in (e.gate_proj, e.up_proj))]
        outs = fused_linear(x_TD, *projs) if projs else ()
        z_TL, gate_up = (outs[0], outs[1:]) if self.latent else (x_TD, outs)
        mode = dispatch or self.dispatch
        if dispatch is None and mode in ("grouped", "tiled") and x_TD.shape[0] <= self.num_experts:
            mode = "dense"
        if mode == "grouped" and not grouped_mm_runs(z_TL, z_TL.shape[1], self.w_gate.shape[2]):
            mode = "tiled"
        if mode == "grouped":
            u_TL = self._grouped(z_TL, ids_TK, w_TK)
        elif mode == "tiled":
            u_TL = self._tiled(z_TL, ids_TK, w_TK)
        elif mode == "loop":
            u_TL = self._loop(z_TL, ids_TK, w_TK)
        elif mode == "dense":
            u_TL = self._dense(z_TL, ids_TK, w_TK)
        else:
            raise ValueError(f"unknown MoE dispatch '{mode}'; valid: {', '.join(DISPATCH_MODES)}")
        # W_↑ on the routed sum and each shared expert's down-projection, summed inside one matmul
        h_shared = [self.act(g, u) for g, u in zip(gate_up[0::2], gate_up[1::2])]
        if self.latent:
            y_TD = summed_linear([self.u_norm(u_TL), *h_shared], [self.up_proj, *(e.down_proj for e in self.shared)])
        elif self.shared:
            y_TD = u_TL + summed_linear(h_shared, [e.down_proj for e in self.shared])
        else:
            y_TD = u_TL
        return y_TD.view(shape)

    def _experts(self, z_ECL: torch.Tensor) -> torch.Tensor:
        """All routed experts at once, each on its own rows: [E, N, L] -> [E, N, L]."""
        h_ECF = self.act(torch.bmm(z_ECL, self.w_gate), torch.bmm(z_ECL, self.w_up))
        return torch.bmm(h_ECF, self.w_down)

    def _grouped(self, z_TL, ids_TK, w_TK):
        """Sort token-slots by expert and run each expert on its own rows, one grouped matmul per weight
        (torch._grouped_mm, group ends from the counts): no padding rows and no per-tile weight copies,
        and every shape depends only on T and K, so nothing is read back to the host. Deterministic: both
        row gathers are permutations whose gradients are gathers too (`gather_rows`)."""
        T, L = z_TL.shape
        S, dev, dt = T * self.top_k, z_TL.device, z_TL.dtype
        ids_S = ids_TK.flatten()
        order_S = torch.argsort(ids_S, stable=True)                                  # sorted row -> slot
        row_S = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(S, device=dev))  # slot -> sorted row
        counts_E = torch.zeros(self.num_experts, dtype=torch.long, device=dev).scatter_add_(
            0, ids_S, torch.ones_like(ids_S))
        ends_E = torch.cumsum(counts_E, 0).to(torch.int32)                           # expert e's rows end here
        # slot s = t·K + k belongs to token t
        z_SL = gather_rows(z_TL, order_S // self.top_k, row_S.view(T, self.top_k))  # (S, L), expert order
        h_SF = self.act(torch._grouped_mm(z_SL, self.w_gate.to(dt), offs=ends_E),
                        torch._grouped_mm(z_SL, self.w_up.to(dt), offs=ends_E))
        out_SL = torch._grouped_mm(h_SF, self.w_down.to(dt), offs=ends_E)
        out_SL = gather_rows(out_SL, row_S, order_S[:, None])                       # (S, L), slot order
        return (out_SL.view(T, self.top_k, L) * w_TK.to(dt)[..., None]).sum(1)     # (T, L)

    def _tiled(self, z_TL, ids_TK, w_TK):
        """Sort token-slots by expert, pad each group to whole tiles of R rows, run every tile with its
        expert's weights in one bmm per weight, gather back. Every shape depends only on T, K, E and R
        (docs/math.md §4): nothing is read back to the host, so the step stays asynchronous and
        compiles to one static graph.

        The groups fill at most P = ceil(S / R) + E tiles (each group wastes under one tile); empty
        trailing tiles run on zero rows. Deterministic: each row gather's gradient is a gather too
        (`gather_rows`), the weight gradient a one-hot product, the top-k combine a sum over K.
        """
        T, L = z_TL.shape
        E, K = self.num_experts, self.top_k
        S = T * K
        R = tile_rows(S, E)
        P = -(-S // R) + E
        ids_S = ids_TK.flatten()                                                     # (S,)
        order_S = torch.argsort(ids_S, stable=True)                                  # slots sorted by expert
        counts_E = torch.zeros(E, dtype=torch.long, device=z_TL.device).scatter_add_(
            0, ids_S, torch.ones_like(ids_S))
        starts_E = torch.cumsum(counts_E, 0) - counts_E                              # first sorted slot
        tiles_E = (counts_E + R - 1) // R
        tile_end_E = torch.cumsum(tiles_E, 0)                                        # tiles through expert e
        row0_E = (tile_end_E - tiles_E) * R                                          # first padded row
        # sorted slot i of expert e sits at padded row row0[e] + (i − starts[e])
        sorted_ids_S = ids_S[order_S]
        row_S = row0_E[sorted_ids_S] + torch.arange(S, device=z_TL.device) - starts_E[sorted_ids_S]
        row_tok_S = torch.empty_like(row_S).scatter_(0, order_S, row_S)              # each slot's row, token order
        slot_PR = torch.full((P * R,), S, dtype=torch.long, device=z_TL.device).scatter_(
            0, row_tok_S, torch.arange(S, device=z_TL.device))                       # padded row -> slot (S: none)
        # slot s = t·K + k belongs to token t, so padding rows read the zero row T = S // K
        z_pad = gather_rows(z_TL, slot_PR // K, row_tok_S.view(T, K)).view(P, R, L)   # (P, R, L)
        # tile p belongs to the first expert whose tiles end after p (trailing empty tiles: the last)
        expert_P = torch.searchsorted(tile_end_E, torch.arange(P, device=z_TL.device), right=True).clamp_max(E - 1)
        h_PRF = self.act(torch.bmm(z_pad, gather_experts(self.w_gate, expert_P)),
                         torch.bmm(z_pad, gather_experts(self.w_up, expert_P)))
        out_PRL = torch.bmm(h_PRF, gather_experts(self.w_down, expert_P))
        out_SL = gather_rows(out_PRL.reshape(P * R, L), row_tok_S, slot_PR[:, None])  # (S, L)
        return (out_SL.view(T, K, L) * w_TK.to(out_SL.dtype)[..., None]).sum(1)    # (T, L)

    def _loop(self, z_TL, ids_TK, w_TK):
        """Reference: one expert at a time on the tokens that chose it."""
        u_TL = torch.zeros_like(z_TL)
        for e in range(self.num_experts):
            tok, slot = (ids_TK == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = self.act(z_TL[tok] @ self.w_gate[e], z_TL[tok] @ self.w_up[e]) @ self.w_down[e]
            u_TL = u_TL.index_add(0, tok, h * w_TK[tok, slot, None].to(h.dtype))
        return u_TL

    def _dense(self, z_TL, ids_TK, w_TK):
        """Reference: every expert on every token, combined with a one-hot (scattered) weight matrix."""
        T = z_TL.shape[0]
        out_ETL = self._experts(z_TL.unsqueeze(0).expand(self.num_experts, T, -1))
        w_TE = torch.zeros(T, self.num_experts, dtype=w_TK.dtype, device=w_TK.device)
        w_TE = w_TE.scatter(1, ids_TK, w_TK)
        return torch.einsum("te,etl->tl", w_TE.to(out_ETL.dtype), out_ETL)

    @torch.no_grad()
    def update_bias(self) -> None:
        """bias_e += γ · sign(mean_load − load_e) from the counts since the last call; resets them."""
        load = self.load_counts.to(self.router_bias.dtype)
        self.router_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load_counts.zero_()

    @torch.no_grad()
    def load_stats(self) -> dict:
        """Per-expert load fractions [E] and max/mean imbalance of the counts since the last update."""
        load = self.load_counts.double()
        return {"load": (load / load.sum().clamp_min(1)).cpu(), "max_over_mean": max_over_mean(load).item()}
