"""Kimi Delta Attention ops: torch references, Triton chunked kernel, fused gate, fused short conv (docs/math.md §2)."""
from k3cli.ops.kda.chunk import chunk_kda
from k3cli.ops.kda.conv import short_conv, short_conv_reference
from k3cli.ops.kda.fused_recurrent import fused_recurrent_kda
from k3cli.ops.kda.gate import kda_gate
from k3cli.ops.kda.naive import (
                                 chunk_local_cumsum,
                                 naive_chunk_kda,
                                 naive_chunk_kda_varlen,
                                 naive_kda_gate,
                                 naive_recurrent_kda,
)

__all__ = ["chunk_kda", "chunk_local_cumsum", "fused_recurrent_kda", "kda_gate", "naive_chunk_kda",
           "naive_chunk_kda_varlen", "naive_kda_gate", "naive_recurrent_kda", "short_conv",
           "short_conv_reference"]
