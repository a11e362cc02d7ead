"""Pre-reduced variant of the Triton GEMM2 + GatherRS call (`GatherRSOptions.prereduce`: True,
or "auto" where the resource manager picks it, `resource.mode`).

Why: the direct layout (`triton_gemm2_gatherrs`, v4) sends every (token, expert) row to the
token's rank, so NVLink carries top-k x TP rows per token (less the token's experts on its
own rank). Where the link is the limit (TP=2 with SP at top-k 8: 537 MB per rank at 16384
tokens, measured ~270 GB/s with the GEMM's peer stores; docs/perf_notes.md v4.3) summing a
token's rows on the rank that computed them first cuts the bytes to one row per (token,
source rank): the pre-reduced GatherRS of DESIGN.md §1, here with the reduction as its own
pass instead of v3's gather items.

Per call, on rank `me` of the tp_ep group (R ranks, T_d tokens on rank d):
  1. host (prepare): `direct_layout` gives, per (local expert l, destination d), the first
     row of d's chunk of expert l in h; its segments, re-pointed at a local buffer y in h's
     row order, give the tile list (expanded on the device, no signals); one pinned H2D
     copy.
  2. device (prepare): for every destination d, rowy_d [T_d, K] (K = min(top-k, L)): the rows
     in y of d's token t, its local experts ascending (`_prepare_kernel` block counts +
     `_index_kernel` on d's routing map restricted to this EP rank's experts); the finalize
     index [T_me, R]: slot s * T_me + t when token t has an expert on source s's EP rank,
     else -1.
  3. send: `_gemm_scatter_kernel` into y, then one `_reduce_send_kernel` launch for every
     destination (its CTAs in send order: remote destinations first, round-robin after
     `me`, so the local sums fill the SMs behind the NVLink-bound ones), each CTA storing
     one row per token of its block into d's receive buffer at slot me * T_d + t and
     signalling one arrival.
  4. finish: `_finalize_kernel` sums the R slots of each token in group-rank order
     (deterministic), then signals "buffer free" as in the direct layout.

The receive buffer holds R x max_d T_d rows, this rank's own slot included (the direct
layout: the top-k x TP x T rows less the rank's own block, which a local buffer holds), y is
a transient [N, H] like Megatron's FC2 output. The communication no longer overlaps the
GEMM (the reduction needs a token's rows from every local expert); the plan's SM partition
is not used. Needs every rank's routing map (`gemm2_gatherrs.gather_routing_maps`).

Measured (2x H200, docs/perf_notes.md v4.4): faster than the direct layout for
Qwen3-30B-A3B at TP2 (1.890 -> 1.487 ms at 16384 tokens/rank), 1.04-1.25x slower on the
other operator workloads; bit-identical to the reference path. Its host work costs ~0.6 ms
more per call than the direct layout's (v4.6, with the routing-map gather), which the mode
choice counts (`HardwareProfile.prereduce_host_us`).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_overlap._host import current_stream
from megatron_overlap.config import tile_list_source
from megatron_overlap.kernels import gemm2_gatherrs as k
from megatron_overlap.kernels.launch import FastLauncher
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.ops.triton_gemm2_gatherrs import (
    INDEX_BLOCK_TOKENS,
    TILE_LIST_BLOCK,
    DirectLayout,
    TileConfig,
    _Call,
    _StagingSlot,
    _align4,
    _cdiv,
    _index,
    _pow2,
    _prepare,
    destination_order,
    direct_layout,
    expand_tiles,
)
from megatron_overlap.profiling import span
from megatron_overlap.resource import Plan
from megatron_overlap.symm import GatherRSWorkspace

REDUCE_SEND_BLOCK = (32, 256)
"""Tokens per `_reduce_send_kernel` CTA x columns per step of its loop over the hidden size,
on the GPU (the interpreter: (8, 16)). One CTA per token block keeps the system-scope
arrival atomics at T / 32 per destination."""

_reduce_send = FastLauncher(k._reduce_send_kernel)


def _send_block(gpu: bool) -> tuple:
    """(tokens, columns) per `_reduce_send_kernel` CTA: `REDUCE_SEND_BLOCK`, or the
    interpreter's (8, 16). The launch and the arrival counts (`send_blocks`) must agree."""
    return REDUCE_SEND_BLOCK if gpu else (8, 16)


def send_blocks(num_tokens: int, gpu: bool) -> int:
    """`_reduce_send_kernel` CTAs for a destination with `num_tokens` tokens: the arrivals
    that destination expects from each source (0 without tokens)."""
    bt = _send_block(gpu)[0]
    if num_tokens <= 0:
        return 0
    return -(-num_tokens // bt)


@functools.lru_cache(maxsize=8)
def _all_slots(num_tokens: int, num_ranks: int, device: torch.device,
               stream=None) -> torch.Tensor:
    """int32 [T, R] on `device`: slot s * T + t in column s of row t, the pre-reduced
    finalize index when every token has an expert on every source's EP rank (EP = 1 and no
    token dropped). Cached (read only): it depends on the shapes alone, and on `stream`,
    the current stream of `device` (CUDA), where it is made: each stream gets its own, so
    that every use of a cached table is ordered after its making and before its memory is
    reused (tensors made on one stream and read on another need that ordering)."""
    with torch.inference_mode(False):  # a normal tensor: usable in training forwards too
        return (torch.arange(num_ranks, dtype=torch.int32, device=device)[None, :] * num_tokens
                + torch.arange(num_tokens, dtype=torch.int32, device=device)[:, None])


class PreReducedCall(_Call):
    """One pre-reduced call, prepared then run (same interface as `_Call`: `send`,
    `finish`, `run`, `finalize`; see the module docstring).

    Args:
        meta, ws, plan, hidden, dtype, device, timeout_s, tile: as `_Call` (the plan's grid
            sizes the GEMM; its communication CTAs are not used).
        routing_maps: every rank's routing map in group-rank order, bool/uint8 [T_d, E] on
            the call's device (`gemm2_gatherrs.gather_routing_maps`); routing_maps[me] has
            meta.routing_map's shape.

    Raises:
        ValueError: routing_maps of the wrong length, dtype, shape or device, or this rank's
            map not of meta's shape; meta without routed_counts or routing_map. The maps'
            content is not checked against meta's counts (that needs a device sync): a map
            that disagrees gives wrong sums, but no read outside y.
    """

    MODE = "prereduce"

    def __init__(self, meta: GatherRSMetadata, ws: GatherRSWorkspace, plan: Plan, *,
                 hidden: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
                 routing_maps: Sequence[torch.Tensor],
                 tile: Optional[TileConfig] = None) -> None:
        self._init_common(meta, ws, plan, hidden, dtype, device, timeout_s, tile)
        device, me = self.device, self.rank
        self.num_comm = 0  # the SM partition is not used: the GEMM stores locally
        tp, ep, num_local = meta.tp_size, meta.ep_size, meta.num_local_experts
        num_ranks = tp * ep
        maps = list(routing_maps)
        num_experts = meta.routing_map.shape[1]
        if len(maps) != num_ranks:
            raise ValueError(f"routing_maps: {len(maps)} maps for a group of {num_ranks}")
        for d, m in enumerate(maps):
            same_device = isinstance(m, torch.Tensor) and (
                m.device == device or (device.index is None and m.device.type == device.type))
            if (not same_device or m.dim() != 2 or m.shape[1] != num_experts
                    or m.dtype not in (torch.bool, torch.uint8)):
                raise ValueError(f"routing_maps[{d}] must be a bool/uint8 [T, {num_experts}] "
                                 f"tensor on {device}, got {getattr(m, 'dtype', type(m))} "
                                 f"{tuple(getattr(m, 'shape', ()))} on "
                                 f"{getattr(m, 'device', '-')}")
        if maps[me].shape != meta.routing_map.shape:
            raise ValueError(f"routing_maps[{me}] (this rank) has shape {tuple(maps[me].shape)}"
                             f", meta.routing_map {tuple(meta.routing_map.shape)}")
        self.tokens = [int(m.shape[0]) for m in maps]
        with span("mo.direct_layout"):
            lay = self.layout = direct_layout(meta, hidden, self.tile.bm, self.tile.bn)
            seg = lay.segments.copy()
            # base[d, l]: first row in h of (local expert l, destination d), minus 1 (the
            # index kernel adds the inclusive prefix count).
            base = np.zeros((num_ranks, num_local), dtype=np.int32)
            base[seg[:, 3], seg[:, 0]] = seg[:, 1] - 1
            seg[:, 3] = me  # every tile into the local y, in h's row order
            seg[:, 4] = seg[:, 1]
            num_tiles = lay.num_remote + lay.num_local
            # The tile list is expanded on the device from the segments (`_tile_list_block`,
            # list order), or on the host with MEGATRON_OVERLAP_TILE_LIST=host.
            on_host = tile_list_source() == "host"
            if on_host:
                table = expand_tiles(DirectLayout(
                    segments=seg, num_remote=0, num_local=num_tiles,
                    col_blocks=lay.col_blocks, bm=lay.bm, bn=lay.bn, arrivals=lay.arrivals,
                    recv_rows=lay.recv_rows, local_rows=lay.local_rows,
                    finalize_base=lay.finalize_base,
                    num_pairs=lay.num_pairs))
            else:
                table = seg
        self.num_remote, self.num_local = 0, num_tiles
        self.num_rows = int(lay.segments[:, 2].sum()) if len(lay.segments) else 0
        self._take_epoch(ws, num_ranks * max(self.tokens))
        arrivals = np.full(num_ranks, send_blocks(self.tokens[me], self.gpu),
                           dtype=np.int64)
        arrivals[me] = 0
        targets = ws.add_expected_arrivals(arrivals)
        # The send's table (`_reduce_send_kernel`): send order, first CTA per destination
        # in that order, then by group rank the token counts and first rows in rowy.
        order = destination_order(me, num_ranks)
        blocks = [send_blocks(self.tokens[d], self.gpu) for d in order]
        row_start = np.cumsum([0] + self.tokens[:-1])
        send = np.concatenate([order, np.cumsum([0] + blocks), self.tokens,
                               row_start]).astype(np.int32)
        self.send_ctas = int(sum(blocks))
        self.k = max(1, min(int(meta.topk or num_local), num_local))
        bt = INDEX_BLOCK_TOKENS if self.gpu else 16
        nbs = [-(-t // bt) for t in self.tokens]  # token blocks of each destination's index
        # Device scratch: the tile list, every destination's block counts, rowy.
        # (each part, and each destination's counts, 16-byte aligned: `_align4`)
        n_tiles = 0 if on_host else max(1, num_tiles) * k.TILE_FIELDS
        c0 = np.cumsum([0] + [_align4(n * num_local) for n in nbs])
        sizes = (_align4(n_tiles), int(c0[-1]), max(1, sum(self.tokens)) * self.k)
        r2 = 2 * num_ranks
        with span("mo.h2d"):
            # One pinned buffer, one copy (a staging slot of the workspace, as `_Call`):
            # targets (int64 as int32 pairs), the send table and the index bases, the
            # segments (or the tiles).
            tables = (r2, send.size + base.size, table.size)
            stream = current_stream(device) if self.gpu else None
            slot, kept = _StagingSlot.take(ws, device, tables, sum(sizes), stream)
            self._slot = slot if kept else None
            buf = slot.host_np
            buf[:r2] = targets.astype(np.int64).view(np.int32)
            buf[r2: r2 + send.size] = send
            buf[r2 + send.size: r2 + tables[1]] = base.reshape(-1)
            buf[r2 + tables[1]:] = table.reshape(-1)
            slot.copy_in(device, stream)
            self.targets, mid, table = slot.views
            self.send_table = mid[: send.size]
            bases = mid[send.size:].view(num_ranks, 1, num_local)
        with span("mo.prepare_kernels"):
            ep2 = max(16, _pow2(num_local))
            warps = 8 if ep2 >= 256 else 4
            scratch = slot.scratch[: sum(sizes)]
            self.tiles = (table if on_host
                          else scratch[:n_tiles].view(max(1, num_tiles), k.TILE_FIELDS))
            counts_all = scratch[sizes[0]: sizes[0] + sizes[1]]
            # Every destination's rows here, one tensor (destinations in group-rank order).
            self.rowy = scratch[sizes[0] + sizes[1]:].view(-1, self.k)
            # Each destination's map restricted to this EP rank's experts (EP = 1: the map).
            cols = slice(meta.ep_rank * num_local, (meta.ep_rank + 1) * num_local)
            rmaps = [m.view(torch.uint8) if ep == 1 else m[:, cols].contiguous().view(torch.uint8)
                     for m in maps]
            dests = [d for d in range(num_ranks) if self.tokens[d]]
            counts = [counts_all[int(c0[d]): int(c0[d]) + nbs[d] * num_local]
                      .view(-1, num_local) for d in range(num_ranks)]
            # The tile list and the first destination's block counts in one launch, then
            # the other destinations' counts; the index of each follows its counts.
            tile_blocks = 0 if on_host or not num_tiles else _cdiv(num_tiles,
                                                                         TILE_LIST_BLOCK)
            segs = len(seg)
            for i, (d, nb) in enumerate([(d, nbs[d]) for d in dests] or [(me, 0)]):
                tb = tile_blocks if i == 0 else 0
                if tb + nb:
                    _prepare((tb + nb,), table, self.tiles, segs, 0, num_tiles, 1, 1,
                             lay.col_blocks, max(1, segs.bit_length()), tb, rmaps[d], counts[d],
                             self.tokens[d] if nb else 0, num_local, BM=self.tile.bm,
                             BN=self.tile.bn, WAVES=False, BLOCK=TILE_LIST_BLOCK, EP2=ep2,
                             BT=bt, num_warps=warps)
            for d in dests:
                rowy = self.rowy[int(row_start[d]): int(row_start[d]) + self.tokens[d]]
                _index((nbs[d],), rmaps[d], counts[d], bases[d], rowy, self.tokens[d],
                       num_local, TP=1, K=self.k, EP2=ep2, BT=bt, CB=32, num_warps=warps)
            # Finalize index: slot s * T + t where token t has an expert on s's EP rank.
            # EP = 1 with every token routed (top-k experts each: no token dropped, which the
            # shared counts tell without a device sync): every slot, a cached table.
            t_me = self.tokens[me]
            slots = _all_slots(t_me, num_ranks, device, stream)
            full = (ep == 1 and bool(meta.topk)
                    and int(meta.routed_counts[me].sum()) == meta.topk * t_me)
            if full:
                self.index = slots
            else:  # a token without an expert on s's EP rank gets nothing from s: -1
                mine = maps[me] if maps[me].dtype == torch.bool else maps[me] != 0
                has = mine.view(t_me, ep, num_local).any(dim=2)  # [T, EP]
                if tp > 1:
                    has = has.repeat_interleave(tp, dim=1)  # [T, R]: s = ep * TP + tp
                self.index = torch.where(has, slots, -1)
        # Claim counters of the dynamic schedule (as `_Call`); the static one reads none.
        self.counters = (None if self.tile.static
                         else torch.empty(2, dtype=torch.int32, device=device))
        self.out = None  # allocated by the first finalize, as `_Call`'s
        self.h = self.w2 = self.y = None
        # Every slot the finalize reads, this rank's own included, is in the receive buffer
        # (`_reduce_send_kernel` stores into it): no row is read from a local buffer.
        self.split = ws.capacity_rows
        self.local = None
        self.sent = False
        self._finalized = False

    def _alloc_local(self) -> None:
        """No local buffer: the GEMM2 stores into y (`_launch`), the sums into the receive
        buffer."""

    def _launch(self, tiles, grid: int, num_remote: int, num_local: int,
                local: Optional[torch.Tensor] = None, index: bool = False) -> None:
        """The GEMM into y (`_Call._launch` with every tile local and y as the only
        destination; no finalize index in it: `index` must be False, this mode's index is
        built when the call is prepared), then the pre-reduced send to every destination
        (one launch)."""
        if index:
            raise ValueError("a pre-reduced call's GEMM2 builds no finalize index")
        ws = self.ws
        num_ranks = ws.num_ranks
        self.y = torch.empty(max(1, self.num_rows), self.hidden, dtype=self.dtype,
                             device=self.device)
        if num_local:  # (every tile is this rank's own: into y)
            super()._launch(tiles, grid, 0, num_local, local=self.y)
        bt, bh = _send_block(self.gpu)
        if self.send_ctas:  # every destination in one launch (send order: remote first)
            _reduce_send(
                (self.send_ctas,), self.y, self.rowy, self.send_table, ws.peer_recv_ptrs,
                ws.peer_signal_ptrs, ws.signals, self.rank, num_ranks, self.num_rows,
                self.hidden, self.freed_target, self.timeout, ws.error, K=self.k, BT=bt,
                BH=bh, USE_TIMER=self.gpu, num_warps=8 if self.gpu else 4)

    def gemm_only(self, grid: Optional[int] = None) -> None:
        """Not available for pre-reduced calls (the GEMM stores locally anyway: time
        `_Call.gemm_only` of a direct call instead)."""
        raise NotImplementedError("gemm_only: time a direct-layout call's gemm_only")
