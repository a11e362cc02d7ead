"""Synthetic routed workloads for the operator benchmark and the tests.

Every rank draws the same global routing (all ranks' routing maps, from one seed) and lays out
its own expert rows as Megatron's alltoall dispatch would (local expert, source chunk, token),
without communication. Routing kinds:
  * "uniform": each token's top-k of i.i.d. uniform scores (every expert equally likely);
  * "skewed": as uniform, but expert 0 gets +2 on the first ~3/4 of each rank's tokens, so it
    takes at least half of them (one hot expert: the p90-style imbalance of real routers);
  * "sparse": odd experts get -2, so with top-k <= E/2 they receive no token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from megatron_overlap.metadata import (
    GatherRSMetadata,
    build_metadata,
    chunk_to_group_rank,
    source_slots,
)

ROUTINGS = ("uniform", "skewed", "sparse")


def routing_maps(tokens_per_rank: Sequence[int], num_experts: int, topk: int, routing: str,
                 seed: int) -> List[torch.Tensor]:
    """[T_g, E] bool routing map of every rank g of the tp_ep group (group order).

    Raises:
        ValueError: unknown routing kind, or topk not in [1, num_experts].
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}; expected one of {ROUTINGS}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
    gen = torch.Generator().manual_seed(seed)
    maps = []
    for num_tokens in tokens_per_rank:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if routing == "skewed":
            scores[: (num_tokens + 1) // 2 + num_tokens // 4, 0] += 2.0
        elif routing == "sparse":
            scores[:, 1::2] -= 2.0
        top = scores.topk(topk, dim=1).indices
        maps.append(torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True))
    return maps


@dataclass(frozen=True)
class RankRows:
    """This rank's received rows, in the op's `h` order.

    meta: the op's metadata; row_source: [N] group rank each row came from; row_token: [N]
    that source's token index; row_expert: [N] local expert of the row.
    """

    meta: GatherRSMetadata
    row_source: torch.Tensor
    row_token: torch.Tensor
    row_expert: torch.Tensor


def rank_rows(maps: Sequence[torch.Tensor], *, tp: int, ep: int, rank: int,
              topk: int) -> RankRows:
    """Lay out rank `rank`'s rows and metadata from the global routing maps (CPU tensors)."""
    tp_rank, ep_rank = rank % tp, rank // tp
    num_experts = maps[0].shape[1]
    num_local = num_experts // ep
    slots = [source_slots(m, ep) for m in maps]
    counts = torch.stack([torch.cat([m.sum(0), s[2]]) for m, s in zip(maps, slots)]).numpy()
    row_slot, row_source, row_token, row_expert = [], [], [], []
    for local in range(num_local):
        e = ep_rank * num_local + local
        for chunk in range(tp * ep):
            g = chunk_to_group_rank(chunk, tp, ep)
            m = maps[g]
            start = int(m.sum(0)[:e].sum())
            tokens = m[:, e].nonzero().view(-1)
            row_slot.append(slots[g][0][start : start + tokens.numel()])
            row_source.append(torch.full_like(tokens, g))
            row_token.append(tokens)
            row_expert.append(torch.full_like(tokens, local))
    meta = build_metadata(counts=counts, row_slot=torch.cat(row_slot),
                          dest_token_mask=slots[rank][1], tp_size=tp, tp_rank=tp_rank,
                          ep_size=ep, ep_rank=ep_rank, topk=topk, routing_map=maps[rank])
    return RankRows(meta, torch.cat(row_source), torch.cat(row_token), torch.cat(row_expert))
