"""Routing metadata of one fused GEMM2 + GatherRS call.

Shape symbols used in this module:
    T   tokens held by this rank (the MoE layer's local tokens)
    E   routed experts in the model;  L = E / EP local experts on this rank
    EP  expert-parallel size;  TP  expert tensor-parallel size;  R = TP * EP ranks of the
        tp_ep group, the group every partial row travels in
    N   rows this rank's experts received (routed (token, expert) pairs), grouped by local
        expert, then by source chunk, then in source token order: exactly the order Megatron's
        `MoEAlltoAllTokenDispatcher.dispatch_postprocess` produces
    S   "slots": the distinct (source rank, token) pairs that this rank's experts saw; each
        slot becomes one pre-reduced row sent back to its source (DESIGN.md §3, "Gather")

Two orders of ranks appear and are never mixed up:
  * group order: rank g of the tp_ep group, g = ep_rank * TP + tp_rank (the layout Megatron's
    `MoEAlltoAllTokenDispatcher.preprocess` assumes when it reshapes the gathered counts to
    [EP, TP, E]);
  * chunk order: c = tp_rank * EP + ep_rank, the order of the source chunks inside each local
    expert's rows after Megatron's TP all-gather + `sort_chunks_by_idxs`.

The source side computes, for every routed row it sends, the row's *slot*: the position of its
token among this rank's tokens routed to the destination EP rank (`source_slots`). The slots
travel with the dispatch (4 bytes a row); the expert side then knows, without token indices,
which of its rows belong to one token and where that token's pre-reduced row goes. That is
what the reference path does; the Triton backend sums every row where its token lives and
needs only the exchanged counts and the routing map (`build_metadata(row_slot=None, ...)`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import numpy as np
import torch


def chunk_to_group_rank(chunk: int, tp_size: int, ep_size: int) -> int:
    """Group rank of source chunk `chunk` (chunk order c = tp * EP + ep -> g = ep * TP + tp)."""
    tp_rank, ep_rank = divmod(chunk, ep_size)
    return ep_rank * tp_size + tp_rank


@functools.lru_cache(maxsize=None)
def _chunk_groups(tp_size: int, ep_size: int) -> np.ndarray:
    """int64 [R]: `chunk_to_group_rank` of every chunk (read-only)."""
    out = np.array([chunk_to_group_rank(c, tp_size, ep_size)
                    for c in range(tp_size * ep_size)], dtype=np.int64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=256)
def _chunk_take_index(tp_size: int, ep_size: int, ep_rank: int, num_local: int,
                      columns: int) -> np.ndarray:
    """int64 [L * R] (read-only): the flat positions in a C-contiguous [R, columns] counts
    array of `rows_per_expert_per_chunk` [L, R] (chunk c's rows of local expert l are
    group rank chunk_to_group_rank(c)'s tokens of expert ep_rank * L + l)."""
    groups = _chunk_groups(tp_size, ep_size)
    experts = ep_rank * num_local + np.arange(num_local, dtype=np.int64)
    out = (groups[None, :] * columns + experts[:, None]).reshape(-1)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> np.ndarray:
    """A read-only int64 [n] array of zeros (the Triton-only metadata's slot fields)."""
    out = np.zeros(n, dtype=np.int64)
    out.flags.writeable = False
    return out


def triton_metadata(counts: np.ndarray, *, tp_size: int, tp_rank: int, ep_size: int,
                    ep_rank: int, topk: int, routing_map: torch.Tensor,
                    copy: bool = True) -> GatherRSMetadata:
    """Triton-only metadata (no slots): what `build_metadata(row_slot=None,
    validate=False)` returns, without its argument checks.

    For callers that made `counts` themselves from this very `routing_map` (the Megatron
    dispatcher, once per forward on the host's critical path); everyone else calls
    `build_metadata`, which checks the arguments and then calls this. Each numpy operation
    here costs tens of microseconds on a forward's cold host (docs/perf_notes.md v5.4), so
    there are few: the four slot fields share one read-only zeros array, and
    `rows_per_expert_per_chunk` is one `take` of cached positions.

    Args:
        counts: [R, >= E] int64 host array, group order: every rank's tokens per expert
            (columns past E, e.g. `build_metadata`'s slot columns, are ignored).
        tp_size, tp_rank, ep_size, ep_rank, topk: as `build_metadata`.
        routing_map: [T, E] bool device tensor, this rank's.
        copy: False hands `counts` over when it is a C-contiguous int64 [R, E] array (the
            metadata's `routed_counts` is then that array: the caller must not change it
            afterwards); True (default) copies it.
    """
    group_size = tp_size * ep_size
    num_experts = routing_map.shape[1]
    num_local = num_experts // ep_size
    zeros = _zeros(group_size)
    if (copy or counts.shape[1] != num_experts or counts.dtype != np.int64
            or not counts.flags.c_contiguous):
        counts = np.array(counts[:, :num_experts], dtype=np.int64, order="C")  # a copy
    rows = counts.take(_chunk_take_index(tp_size, ep_size, ep_rank, num_local, num_experts))
    return GatherRSMetadata(
        tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank,
        num_local_experts=num_local, num_tokens=int(routing_map.shape[0]),
        rows_per_expert_per_chunk=rows.reshape(num_local, group_size),
        send_slots=zeros, recv_slots=zeros, dest_row_offsets=zeros,
        recv_rows_per_rank=zeros, gather_index=None, recv_token_index=None,
        topk=int(topk), routed_counts=counts, routing_map=routing_map,
    )


class MegatronSplits(NamedTuple):
    """The dispatch's split sizes as Megatron's `MoEAlltoAllTokenDispatcher.preprocess`
    computes them on the device and then copies to the host (`megatron_splits`); int64
    numpy arrays, some of them views of one another: copy before changing one.

    Fields (group sizes R = TP * EP, L local experts):
        input_splits: [EP] rows this rank sends to each EP rank (Megatron's `input_splits`).
        output_splits: [EP] rows this rank receives from each EP rank of its TP rank's slice
            (`output_splits`).
        output_splits_tp: [TP] rows each TP rank of this rank's TP group received
            (`output_splits_tp`, the TP all-gather's split sizes).
        tokens_per_local_expert: [L] rows of each local expert after the TP all-gather
            (what `preprocess` returns).
        per_local_expert: [R, L] rows of each source chunk (chunk order) per local expert
            (`num_global_tokens_per_local_expert`, `sort_chunks_by_idxs`'s split sizes).
    """

    input_splits: np.ndarray
    output_splits: np.ndarray
    output_splits_tp: np.ndarray
    tokens_per_local_expert: np.ndarray
    per_local_expert: np.ndarray


def megatron_splits(counts: np.ndarray, *, tp_size: int, tp_rank: int, ep_size: int,
                    ep_rank: int, num_experts: int) -> MegatronSplits:
    """Megatron's dispatch splits from every rank's tokens per expert, on the host.

    Megatron's `MoEAlltoAllTokenDispatcher.preprocess` (megatron-core 0.19) gathers the
    [E] counts over the tp_ep group, derives the splits with a handful of device operations
    and copies each to the host (`_maybe_dtoh_and_synchronize`); the flag-on dispatcher
    copies the gathered counts once (it needs all of them for the fused op) and derives
    the same numbers here, with few numpy operations (each costs tens of microseconds on
    a forward's cold host, docs/perf_notes.md v5.4).

    Args:
        counts: [R, >= E] int64 host array, group order (columns past E are ignored).
        tp_size, tp_rank, ep_size, ep_rank: this rank's place in the tp_ep group.
        num_experts: E (a multiple of ep_size).

    Returns:
        `MegatronSplits` (`per_local_expert` transposed is `triton_metadata`'s
        `rows_per_expert_per_chunk`: the same `take`).

    Raises:
        ValueError: `counts` is not [R, >= E], or ep_size does not divide E.
    """
    num_local = num_experts // ep_size
    group_size = tp_size * ep_size
    if (counts.ndim != 2 or counts.shape[0] != group_size or counts.shape[1] < num_experts
            or num_experts < 1 or num_experts % ep_size):
        raise ValueError(f"counts of shape {counts.shape} with tp_size={tp_size}, "
                         f"ep_size={ep_size}, num_experts={num_experts}: expected [R = "
                         f"{group_size}, >= E] and E a positive multiple of ep_size")
    rows_per_expert_per_chunk = counts.take(_chunk_take_index(
        tp_size, ep_size, ep_rank, num_local, counts.shape[1])).reshape(num_local, group_size)
    per_chunk = rows_per_expert_per_chunk.sum(axis=0).reshape(tp_size, ep_size)
    me = ep_rank * tp_size + tp_rank
    return MegatronSplits(
        input_splits=counts[me, :num_experts].reshape(ep_size, num_local).sum(axis=1),
        output_splits=per_chunk[tp_rank],
        output_splits_tp=per_chunk.sum(axis=1),
        tokens_per_local_expert=rows_per_expert_per_chunk.sum(axis=1),
        per_local_expert=rows_per_expert_per_chunk.T,
    )


def source_slots(routing_map: torch.Tensor, ep_size: int):
    """Slots of this rank's routed rows, in Megatron's permute order.

    Megatron's `permute` (moe_utils.py, unfused path) orders routed rows expert-major, token
    ascending within an expert. For a row (token t, expert e) going to EP rank j = e // L, its
    slot is the rank of t among this rank's tokens routed to any expert of j.

    Args:
        routing_map: [T, E] bool.
        ep_size: EP; must divide E.

    Returns:
        row_slot: [num routed rows] int32, in permute order.
        dest_token_mask: [T, EP] bool, token t has at least one expert on EP rank j.
        num_slots_per_ep: [EP] int64, tokens going to each EP rank.

    Raises:
        ValueError: routing_map is not a 2-D bool tensor or E % ep_size != 0.
    """
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(
            f"routing_map must be a [tokens, experts] bool tensor, got shape "
            f"{tuple(routing_map.shape)} dtype {routing_map.dtype}"
        )
    num_tokens, num_experts = routing_map.shape
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(f"ep_size={ep_size} must divide the number of experts {num_experts}")
    num_local = num_experts // ep_size
    dest_token_mask = routing_map.view(num_tokens, ep_size, num_local).any(dim=-1)
    slot_of_token = torch.cumsum(dest_token_mask.to(torch.int32), dim=0) - 1  # [T, EP]
    expert_of_row, token_of_row = routing_map.T.nonzero(as_tuple=True)
    row_slot = slot_of_token[token_of_row, expert_of_row // num_local].to(torch.int32)
    return row_slot, dest_token_mask, dest_token_mask.sum(dim=0)


@dataclass
class GatherRSMetadata:
    """Everything one rank needs for one fused GEMM2 + GatherRS call.

    Host-side counts are numpy int64 arrays (they size launches and collectives); per-row data
    are device tensors. Built by `build_metadata`; read by the reference op, the Triton kernels
    and the resource manager.
    """

    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    num_local_experts: int
    num_tokens: int
    """T: tokens of this rank (rows of the op's output)."""

    rows_per_expert_per_chunk: np.ndarray
    """[L, R] int64: rows of local expert l from source chunk c (chunk order); their sum over
    chunks is Megatron's tokens-per-local-expert, also when L == 1."""

    send_slots: np.ndarray
    """[R] int64, group order: pre-reduced rows this rank sends to each rank."""

    recv_slots: np.ndarray
    """[R] int64, group order: pre-reduced (partial) rows each rank sends to this rank."""

    dest_row_offsets: np.ndarray
    """[R] int64, group order: the first row of this rank's block in each destination's
    receive buffer (receive buffers hold senders' blocks in group-rank order)."""

    recv_rows_per_rank: np.ndarray
    """[R] int64, group order: rows every rank receives in one call (the receive-buffer
    capacity all ranks agree on, computed alike everywhere from the exchanged counts)."""

    gather_index: Optional[torch.Tensor]
    """[S, K] int64, S = send_slots.sum(), slots grouped by destination in group order: the
    local rows (indices into the op's `h` rows) whose FC2 outputs sum into each slot, in
    ascending local-expert order, padded with -1; K = min(L, top-k)."""

    recv_token_index: Optional[torch.Tensor]
    """[recv_slots.sum()] int64: for the rows received from each sender (group order,
    concatenated), the local token each row belongs to. This and `gather_index` are None in
    Triton-only metadata (`build_metadata(row_slot=None)`)."""

    topk: Optional[int] = None
    """The router's top-k: at most this many experts per token."""

    routed_counts: Optional[np.ndarray] = None
    """[R, E] int64, group order: every rank's tokens per expert (`routing_map.sum(0)`), as
    exchanged. Sizes the Triton backend's un-reduced row layout (see `direct_layout`)."""

    routing_map: Optional[torch.Tensor] = None
    """[T, E] bool device tensor: this rank's routing map (the Triton backend's finalize
    index is built from it on the device)."""

    @property
    def group_size(self) -> int:
        """R = TP * EP."""
        return self.tp_size * self.ep_size

    @property
    def tokens_per_local_expert(self) -> np.ndarray:
        """[L] int64: rows per local expert (Megatron's `tokens_per_expert`)."""
        return self.rows_per_expert_per_chunk.sum(axis=1)

    def to(self, device) -> "GatherRSMetadata":
        """A copy whose device tensors live on `device` (host counts are shared)."""
        return dataclasses.replace(
            self,
            gather_index=None if self.gather_index is None else self.gather_index.to(device),
            recv_token_index=(None if self.recv_token_index is None
                              else self.recv_token_index.to(device)),
            routing_map=None if self.routing_map is None else self.routing_map.to(device),
        )

    def split_sizes(self, counts: np.ndarray) -> List[int]:
        """A [R] count array as a list of Python ints (collective split sizes)."""
        return [int(x) for x in counts]


def build_metadata(
    *,
    counts: np.ndarray,
    row_slot: torch.Tensor,
    dest_token_mask: torch.Tensor,
    tp_size: int,
    tp_rank: int,
    ep_size: int,
    ep_rank: int,
    topk: int,
    routing_map: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> GatherRSMetadata:
    """Build the metadata of one call from the exchanged routing counts.

    Args:
        counts: [R, E + EP] int host array, group order: row g is rank g's tokens per expert
            (`routing_map.sum(0)`) followed by its `num_slots_per_ep` (see `source_slots`).
        row_slot: [N] int32 device tensor: the slots of this rank's received rows, in the
            order of the op's `h` rows (local expert, source chunk, token); or None for
            metadata the Triton backend alone can use (no slots: `gather_index` and
            `recv_token_index` are None, the slot counts zero; needs `routing_map`).
        dest_token_mask: [T, EP] bool, this rank's own `source_slots` mask (None with
            row_slot None).
        tp_size, tp_rank, ep_size, ep_rank: this rank's place in the tp_ep group.
        topk: the router's top-k (bounds the contributions per slot).
        routing_map: [T, E] bool, this rank's routing map; needed by the Triton backend
            (kept in the metadata), optional for the reference path.
        validate: check this rank's row of `counts` against `routing_map.sum(0)` (a device
            to host copy; the dispatcher, which computed both from the same map, skips it).

    Returns:
        `GatherRSMetadata` (host counts; `gather_index`, `recv_token_index` on row_slot's
        device).

    Raises:
        ValueError: inconsistent sizes, ranks out of range, top-k < 1, above the number
            of experts or smaller than a token's routed experts, counts that disagree with the routing map (the message
            names them).
        TypeError: a rank, size or top-k that is not an int; row_slot / dest_token_mask /
            routing_map that are not tensors of the documented dtypes.
    """
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank), ("ep_size", ep_size),
                        ("ep_rank", ep_rank), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}={value!r} must be an int")
    if tp_size < 1 or ep_size < 1 or not 0 <= tp_rank < tp_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"tp_rank={tp_rank} of tp_size={tp_size}, ep_rank={ep_rank} of "
                         f"ep_size={ep_size}: expected sizes >= 1 and 0 <= rank < size")
    if topk < 1:
        raise ValueError(f"topk={topk} must be >= 1")
    for name, t, kinds in (("row_slot", row_slot, "integer"),
                           ("dest_token_mask", dest_token_mask, "bool"),
                           ("routing_map", routing_map, "bool")):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        ok = (t.dtype == torch.bool) if kinds == "bool" else (
            not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool)
        if not ok:
            raise TypeError(f"{name} must be a {kinds} tensor, got {t.dtype}")
    if row_slot is not None and row_slot.dim() != 1:
        raise ValueError(f"row_slot must be 1-D [N], got shape {tuple(row_slot.shape)}")
    group_size = tp_size * ep_size
    if row_slot is None:
        if routing_map is None:
            raise ValueError("build_metadata without row_slot needs the routing_map")
        dest_token_mask = torch.zeros(routing_map.shape[0], ep_size, dtype=torch.bool)
    elif dest_token_mask is None:
        raise ValueError("dest_token_mask is required with row_slot (see source_slots)")
    elif dest_token_mask.dim() != 2 or dest_token_mask.shape[1] != ep_size:
        raise ValueError(f"dest_token_mask must be [T, EP={ep_size}] bool, got shape "
                         f"{tuple(dest_token_mask.shape)}")
    if isinstance(counts, torch.Tensor):
        counts = counts.detach().cpu().numpy()
    try:
        raw = np.asarray(counts)
    except (TypeError, ValueError) as err:
        raise TypeError(f"counts must be an integer array [R, E + EP], got "
                        f"{type(counts).__name__} ({err})") from None
    if raw.dtype.kind not in "iu":
        raise TypeError(f"counts must be an integer array [R, E + EP], got "
                        f"{type(counts).__name__} of dtype {raw.dtype}")
    counts = raw.astype(np.int64, copy=False)
    if counts.ndim != 2 or counts.shape[0] != group_size or counts.shape[1] <= ep_size:
        raise ValueError(
            f"counts must be [R={group_size}, E + EP] with EP={ep_size}, got {counts.shape}"
        )
    if (routing_map is not None and row_slot is not None and routing_map.dim() == 2
            and routing_map.shape[0] != dest_token_mask.shape[0]):
        raise ValueError(f"dest_token_mask has {dest_token_mask.shape[0]} tokens, routing_map "
                         f"{routing_map.shape[0]}: both are this rank's [T, ...] tables")
    if routing_map is not None and (
        routing_map.dtype != torch.bool or routing_map.dim() != 2
        or routing_map.shape[0] != dest_token_mask.shape[0]
        or routing_map.shape[1] != counts.shape[1] - ep_size
    ):
        raise ValueError(
            f"routing_map must be [T={dest_token_mask.shape[0]}, E={counts.shape[1] - ep_size}] "
            f"bool, got {tuple(routing_map.shape)} {routing_map.dtype}"
        )
    num_experts = counts.shape[1] - ep_size
    if num_experts % ep_size != 0:
        raise ValueError(f"ep_size={ep_size} must divide the number of experts {num_experts}")
    if topk > num_experts:  # checked whatever the tokens (with none, no map would tell)
        raise ValueError(f"topk={topk}: expected at most the number of experts {num_experts}")
    if (counts < 0).any():
        raise ValueError("counts must be >= 0")
    if validate and routing_map is not None:
        mine = counts[ep_rank * tp_size + tp_rank, :num_experts]
        real = routing_map.sum(dim=0).cpu().numpy()
        if not np.array_equal(mine, real):
            raise ValueError(f"counts row {ep_rank * tp_size + tp_rank} (this rank) "
                             f"{mine.tolist()} disagrees with routing_map.sum(0) "
                             f"{real.tolist()}")
        if routing_map.shape[0] and int(routing_map.sum(dim=1).max()) > topk:
            raise ValueError(f"topk={topk} is smaller than a token's routed experts "
                             f"({int(routing_map.sum(dim=1).max())})")
    num_local = num_experts // ep_size
    chunk_groups = _chunk_groups(tp_size, ep_size)
    local = slice(ep_rank * num_local, (ep_rank + 1) * num_local)
    if row_slot is None:  # Triton-only metadata: no slots
        return triton_metadata(counts, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
                               ep_rank=ep_rank, topk=topk, routing_map=routing_map)
    device = row_slot.device

    rows_per_expert_per_chunk = counts[chunk_groups, local].T.copy()  # [L, R] chunk order
    num_rows = int(rows_per_expert_per_chunk.sum())
    if row_slot.numel() != num_rows:
        raise ValueError(f"row_slot has {row_slot.numel()} rows, the counts say {num_rows}")
    if validate and num_rows > 1:
        # Within one (local expert, source chunk) run the rows are the source's tokens in
        # ascending order, so their slots (ranks among that source's tokens for this EP
        # rank) strictly increase; anything else is a mis-ordered row_slot.
        runs = rows_per_expert_per_chunk.reshape(-1)
        starts = np.zeros(num_rows, dtype=bool)
        starts[(np.cumsum(runs) - runs)[runs > 0]] = True
        rising = (row_slot[1:] > row_slot[:-1]).cpu().numpy()
        bad = np.nonzero(~rising & ~starts[1:])[0]
        if bad.size:
            raise ValueError(
                f"row_slot is not in the order of the received rows: row {int(bad[0]) + 1} "
                f"has slot {int(row_slot[bad[0] + 1])} after {int(row_slot[bad[0]])} within "
                "one (local expert, source chunk) run, where slots strictly increase (rows "
                "in Megatron's dispatch_postprocess order; see source_slots)")

    send_slots = counts[:, num_experts + ep_rank].copy()  # [R] group order
    # rows_from[g, s]: pre-reduced rows sender s sends to rank g (s's EP rank's slots of g).
    rows_from = counts[:, num_experts + np.arange(group_size) // tp_size]
    my_rank = ep_rank * tp_size + tp_rank
    dest_row_offsets = rows_from[:, :my_rank].sum(axis=1)
    num_slots_per_ep = dest_token_mask.sum(dim=0).cpu().numpy().astype(np.int64)
    recv_slots = np.array([num_slots_per_ep[g // tp_size] for g in range(group_size)])
    if not np.array_equal(rows_from[my_rank], recv_slots):
        raise ValueError(
            f"exchanged slot counts {rows_from[my_rank].tolist()} disagree with this rank's "
            f"routing map {recv_slots.tolist()}"
        )

    # Destination (group rank) of every received row, then its global slot index.
    chunk_of_row = np.tile(np.arange(group_size), num_local)
    dest_of_row_chunks = np.array(chunk_groups)[chunk_of_row]
    send_offsets = np.concatenate([[0], np.cumsum(send_slots)[:-1]])
    row_base = torch.from_numpy(
        np.repeat(send_offsets[dest_of_row_chunks], rows_per_expert_per_chunk.reshape(-1))
    ).to(device)
    global_slot = row_base + row_slot.to(torch.int64)

    num_contrib = max(1, min(num_local, topk))
    num_slots = int(send_slots.sum())
    gather_index = torch.full((num_slots, num_contrib), -1, dtype=torch.int64, device=device)
    if num_rows:
        order = torch.sort(global_slot, stable=True).indices  # keeps ascending expert order
        sorted_slot = global_slot[order]
        first = torch.searchsorted(sorted_slot, sorted_slot, right=False)
        position = torch.arange(num_rows, device=device) - first
        if validate and (int(row_slot.min()) < 0 or int(sorted_slot[-1]) >= num_slots
                         or int(position.max()) >= num_contrib):
            raise ValueError(
                "row_slot values out of range: slots must lie in [0, slots of the "
                f"destination) with at most {num_contrib} rows each (see source_slots)")
        gather_index[sorted_slot, position] = order

    recv_token_index = torch.cat(
        [dest_token_mask[:, g // tp_size].nonzero().view(-1) for g in range(group_size)]
    )
    return GatherRSMetadata(
        tp_size=tp_size,
        tp_rank=tp_rank,
        ep_size=ep_size,
        ep_rank=ep_rank,
        num_local_experts=num_local,
        num_tokens=int(dest_token_mask.shape[0]),
        rows_per_expert_per_chunk=rows_per_expert_per_chunk,
        send_slots=send_slots,
        recv_slots=recv_slots,
        dest_row_offsets=dest_row_offsets,
        recv_rows_per_rank=rows_from.sum(axis=1),
        gather_index=gather_index,
        recv_token_index=recv_token_index,
        topk=int(topk),
        routed_counts=counts[:, :num_experts].copy(),
        routing_map=routing_map,
    )
