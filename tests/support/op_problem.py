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

from megatron_overlap.bench import workloads


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
    return workloads.routing_maps(case.tokens_per_rank, case.num_experts, case.topk,
                                  case.routing, case.seed)


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


def dense_output(case: OpCase, rank: int, tensors=None) -> torch.Tensor:
    """[T_rank, H] fp32: sum over routed experts of h @ w2[e]^T, on the full data
    (`tensors`: `global_tensors(case)` if already made)."""
    maps, h_full, w2 = global_tensors(case) if tensors is None else tensors
    return torch.einsum("etf,ehf->th", h_full[rank], w2)


def rank_operands(case: OpCase, rank: int, tensors=None):
    """This rank's (h [N, F], w2 [L, H, F], metadata), as the dispatcher would produce them.

    `tensors` replaces `global_tensors(case)` (same structure), e.g. to lay out gradients.
    """
    tp_rank, ep_rank = rank % case.tp, rank // case.tp
    num_local = case.num_experts // case.ep
    maps, h_full, w2 = global_tensors(case) if tensors is None else tensors
    shard = slice(tp_rank * case.ffn, (tp_rank + 1) * case.ffn)
    rows = workloads.rank_rows(maps, tp=case.tp, ep=case.ep, rank=rank, topk=case.topk)
    expert = ep_rank * num_local + rows.row_expert
    h = torch.stack([h_full[g][e, t] for g, e, t in
                     zip(rows.row_source.tolist(), expert.tolist(), rows.row_token.tolist())]
                    + [torch.zeros(case.ffn * case.tp)])[:-1]  # (the zero row: N may be 0)
    h = h[:, shard].to(case.dtype)
    w2_local = w2[ep_rank * num_local : (ep_rank + 1) * num_local, :, shard].to(case.dtype)
    return h, w2_local.contiguous(), rows.meta
