"""AttnRes ops (docs/math.md §5): torch references and Triton kernels (full form, block form two-phase)."""
from k3cli.ops.attnres.block import attnres_merge, attnres_phase1
from k3cli.ops.attnres.fused import fused_attnres
from k3cli.ops.attnres.naive import (
                                     naive_attnres,
                                     naive_attnres_block,
                                     naive_attnres_merge,
                                     naive_attnres_phase1,
)

__all__ = ["attnres_merge", "attnres_phase1", "fused_attnres", "naive_attnres", "naive_attnres_block",
           "naive_attnres_merge", "naive_attnres_phase1"]
