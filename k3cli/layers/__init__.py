"""Layers of k3: KDA and Gated MLA attention, SwiGLU / LatentMoE FFNs, AttnRes, the decoder block."""
from k3cli.layers.attnres import AttnResMixer
from k3cli.layers.block import DecoderBlock, build_attn, build_ffn
from k3cli.layers.ffn import SiTUExpert, SwiGLUMLP, situ_glu
from k3cli.layers.kda import KDAAttention
from k3cli.layers.mla import GatedMLA
from k3cli.layers.moe import LatentMoE
from k3cli.layers.norm import RMSNorm, l2norm, rms_norm

__all__ = [
    "AttnResMixer", "DecoderBlock", "GatedMLA", "KDAAttention", "LatentMoE", "RMSNorm", "SiTUExpert",
    "SwiGLUMLP", "build_attn", "build_ffn", "l2norm", "rms_norm", "situ_glu",
]
