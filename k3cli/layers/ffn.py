"""Feed-forward blocks (docs/math.md §4): SwiGLU for the pure-KDA model, SiTU-GLU (or SiLU-GLU) experts for LatentMoE."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3cli.ops.precision import work_dtype


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): identity near 0, bounded by ±cap."""
    return cap * torch.tanh(x / cap)


def situ_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU: softcap(g, 4) · sigmoid(g) ⊙ softcap(u, 25), |out| ≤ 100 (K3's overflow guard).

    gate, up: [..., F]. Computed in fp32 (fp64 stays fp64) and cast back to gate.dtype.
    """
    wd = work_dtype(gate)
    g, u = gate.to(wd), up.to(wd)
    return (softcap(g, 4.0) * torch.sigmoid(g) * softcap(u, 25.0)).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU-GLU (SwiGLU's product): silu(g) ⊙ u, unbounded. Like `situ_glu`, computed in fp32 (fp64 stays
    fp64) and cast back to gate.dtype."""
    wd = work_dtype(gate)
    return (F.silu(gate.to(wd)) * up.to(wd)).to(gate.dtype)


# an expert's gated activation by name (`model.moe.expert_act`)
EXPERT_ACTS = {"situ": situ_glu, "silu": silu_glu}


class SwiGLUMLP(nn.Module):
    """y = W_d(SiLU(W_g x) ⊙ W_u x); D → F → D, no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SiTUExpert(nn.Module):
    """One SiTU-GLU expert: y = W_d situ(W_g x, W_u x); width in → d_ff → in, no biases.
    `act` picks the gated activation from EXPERT_ACTS ("silu": W_d(silu(W_g x) ⊙ W_u x))."""

    def __init__(self, dim: int, d_ff: int, act: str = "situ"):
        super().__init__()
        if act not in EXPERT_ACTS:
            raise ValueError(f"unknown expert activation '{act}'; valid: {', '.join(EXPERT_ACTS)}")
        self.act = act
        self.gate_proj = nn.Linear(dim, d_ff, bias=False)
        self.up_proj = nn.Linear(dim, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]."""
        return self.down_proj(EXPERT_ACTS[self.act](self.gate_proj(x), self.up_proj(x)))
