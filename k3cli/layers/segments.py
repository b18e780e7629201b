"""Documents packed into a batch: which tokens may see which (docs/math.md §10).

A packed row holds the end of one document, whole documents and the start of another, separated by
`<|endoftext|>`. With a document mask every layer keeps to the token's own document: KDA restarts its
state (chunk_kda with cu_seqlens), the short convolutions read no tap before the document's start, and
MLA attends within the document (block-diagonal causal). FFNs and the AttnRes mix are per token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from k3cli.ops.transfer import to_device


class Segments(NamedTuple):
    """The documents of a batch [B, T]. The row-major flattened batch is one sequence of B·T tokens cut into
    documents: cu_seqlens has a fixed capacity of B·T + 1 entries (repeats of B·T after the last document:
    empty sequences), so its shape, and a compiled graph, does not depend on the batch's contents."""
    cu_seqlens: torch.Tensor   # int32 [B·T + 1], on the CPU (read on the host by the KDA op)
    doc: torch.Tensor          # [B, T] long, the document index of each token within its row
    pos: torch.Tensor          # [B, T] long, each token's position within its document

    @classmethod
    def from_starts(cls, starts: torch.Tensor, device=None) -> Segments:
        """starts [B, T] bool (True where a document begins; every row begins one) -> Segments, with doc
        and pos on `device`."""
        starts = starts.to("cpu", torch.bool).clone()
        starts[:, 0] = True
        B, T = starts.shape
        doc = starts.long().cumsum(1) - 1
        t = torch.arange(T).expand(B, T)
        pos = t - torch.cummax(torch.where(starts, t, 0), dim=1).values
        first = torch.nonzero(starts.flatten()).flatten()
        cu = torch.full((B * T + 1,), B * T, dtype=torch.int32)
        cu[:len(first)] = first.to(torch.int32)
        return cls(cu, to_device(doc, device), to_device(pos, device))
