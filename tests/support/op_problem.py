"""A global GEMM2 + GatherRS problem, laid out per rank exactly as Megatron's dispatch does.

Every rank builds the same global problem from one seed (all ranks' routing maps, FC1
outputs and FC2 weights) and takes its own operands from it without communication, so the
op can be checked against a dense formula on the full data. The layout follows
`MoEAlltoAllTokenDispatcher.dispatch_postprocess`: rows grouped by local expert, then by
source chunk (c = tp * EP + ep), then in source-token order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from megatron_overlap.metadata import build_metadata, chunk_to_group_rank, source_slots


@dataclass(frozen=True)
class OpCase:
    """One problem: layout, sizes and routing kind."""

    tp: int
    ep: int
    num_experts: int
    topk: int
    tokens_per_rank: Sequence[int]  # group order, len = tp * ep
    hidden: int = 16
    ffn: int = 8  # per TP rank
    routing: str = "uniform"  # "uniform" | "skewed" (expert 0 takes >= half) | "sparse"
    dtype: torch.dtype = torch.float32
    seed: int = 0


def routing_maps(case: OpCase) -> List[torch.Tensor]:
    """[T_g, E] bool routing map of every rank g (group order)."""
    gen = torch.Generator().manual_seed(case.seed)
    maps = []
    for num_tokens in case.tokens_per_rank:
        scores = torch.rand(num_tokens, case.num_experts, generator=gen)
        if case.routing == "skewed":
            scores[: (num_tokens + 1) // 2 + num_tokens // 4, 0] += 2.0  # expert 0: most tokens
        elif case.routing == "sparse":
            scores[:, 1::2] -= 2.0  # odd experts receive no token (if topk <= E/2)
        top = scores.topk(case.topk, dim=1).indices
        maps.append(torch.zeros(num_tokens, case.num_experts, dtype=torch.bool).scatter_(
            1, top, True))
    return maps


def global_tensors(case: OpCase):
    """FC1 outputs h_full[g] ([E, T_g, F * TP], zero where not routed) and w2 ([E, H, F*TP])."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    full_ffn = case.ffn * case.tp
    maps = routing_maps(case)
    h_full = [
        torch.randn(case.num_experts, m.shape[0], full_ffn, generator=gen) * m.T.unsqueeze(-1)
        for m in maps
    ]
    w2 = torch.randn(case.num_experts, case.hidden, full_ffn, generator=gen) / full_ffn**0.5
    return maps, h_full, w2


def dense_output(case: OpCase, rank: int) -> torch.Tensor:
    """[T_rank, H] fp32: sum over routed experts of h @ w2[e]^T, on the full data."""
    maps, h_full, w2 = global_tensors(case)
    return torch.einsum("etf,ehf->th", h_full[rank], w2)


def rank_operands(case: OpCase, rank: int, tensors=None):
    """This rank's (h [N, F], w2 [L, H, F], metadata), as the dispatcher would produce them.

    `tensors` replaces `global_tensors(case)` (same structure), e.g. to lay out gradients.
    """
    tp_rank, ep_rank = rank % case.tp, rank // case.tp
    group_size = case.tp * case.ep
    num_local = case.num_experts // case.ep
    maps, h_full, w2 = global_tensors(case) if tensors is None else tensors
    shard = slice(tp_rank * case.ffn, (tp_rank + 1) * case.ffn)
    slots = [source_slots(m, case.ep) for m in maps]
    counts = torch.stack(
        [torch.cat([m.sum(0), s[2]]) for m, s in zip(maps, slots)]
    ).numpy()

    rows, row_slot = [], []
    for local in range(num_local):
        e = ep_rank * num_local + local
        for chunk in range(group_size):
            g = chunk_to_group_rank(chunk, case.tp, case.ep)
            m, slot_all = maps[g], slots[g][0]
            start = int(m.sum(0)[:e].sum())
            tokens = m[:, e].nonzero().view(-1)
            rows.append(h_full[g][e, tokens][:, shard])
            row_slot.append(slot_all[start : start + tokens.numel()])
    h = torch.cat(rows).to(case.dtype)
    meta = build_metadata(
        counts=counts,
        row_slot=torch.cat(row_slot),
        dest_token_mask=slots[rank][1],
        tp_size=case.tp,
        tp_rank=tp_rank,
        ep_size=case.ep,
        ep_rank=ep_rank,
        topk=case.topk,
    )
    w2_local = w2[ep_rank * num_local : (ep_rank + 1) * num_local, :, shard].to(case.dtype)
    return h, w2_local.contiguous(), meta
