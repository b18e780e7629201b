"""Models of k3: configs (`k3_config`) and the CausalLM (`causal_lm`).

CausalLM is exported lazily so that importing the configs (the CLI, `k3 layout`) does not pull in torch.
"""
from k3cli.models.k3_config import K3Config, KDAConfig, ModelConfig

__all__ = ["CausalLM", "K3Config", "KDAConfig", "ModelConfig", "ModelOutput"]


def __getattr__(name: str):
    if name in ("CausalLM", "ModelOutput"):
        from k3cli.models import causal_lm
        return getattr(causal_lm, name)
    raise AttributeError(f"module 'k3cli.models' has no attribute {name!r}")
