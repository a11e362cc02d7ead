"""Launcher of the tile-signaled Triton GEMM2 + GatherRS kernels.

Shape symbols as in `megatron_overlap.metadata`; BM x BN is the producer's output tile, and
one *segment* is (destination rank, BN-wide column split).

Per call, on this rank (DESIGN.md §3):
  1. host: the schedule: producer tiles in priority order (segment by segment, the remote
     destinations round-robin split by split, this rank's own segments last) and the segment
     table the consumer walks in the same order;
  2. main stream: zero the per-segment tile counters, record an event;
     side stream: wait for it, launch the consumer (k CTAs);
     main stream: launch the producer (the plan's CTAs), then finalize;
     main stream waits for the side stream's end, so later work (and the caching allocator)
     sees every buffer of this call released;
  3. read the error record; a non-zero code raises RuntimeError naming rank, segment/sender,
     the value seen and the value waited for.

Without CUDA (the Triton interpreter) the three kernels run one after another on one rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import triton
import torch.distributed as dist

from megatron_overlap.kernels import gemm2_gatherrs as k
from megatron_overlap.metadata import GatherRSMetadata, chunk_to_group_rank
from megatron_overlap.resource import Plan
from megatron_overlap.symm import GatherRSWorkspace

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
"""Producer tile (rows x hidden columns x ffn depth) on the GPU."""
GATHER_ROWS = 128
"""Rows of y one consumer step loads at once (slots x padded contributions), all in flight
together: the gather is latency-bound, so its memory-level parallelism sets its speed."""
FINALIZE_BLOCK = (32, 128)
"""Tokens x columns per finalize CTA."""


def interpreting() -> bool:
    """Whether Triton runs in interpreter mode (TRITON_INTERPRET=1, CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_shape(device: torch.device):
    """(BM, BN, BK) for `device`: 16 x 16 x 16 in the interpreter (speed), else the GPU's."""
    return (16, 16, 16) if device.type != "cuda" else (BLOCK_M, BLOCK_N, BLOCK_K)


@dataclass(frozen=True)
class Schedule:
    """Host-built work lists of one call.

    tiles: int32 [num_tiles, 5] (local expert, row start, row end, column start, segment).
    segments: int32 [num_segments, 7] (destination rank, column start, expected tiles,
        first slot, slot count, row offset of this sender in the destination's buffer,
        column width).
    items: int32 [num_items, 4] consumer work items (segment, first slot, end slot (both
        relative to the segment), items of that segment); every segment has >= 1 item.
    splits: column splits per destination (segments per sender per destination).
    """

    tiles: np.ndarray
    segments: np.ndarray
    items: np.ndarray
    splits: int


SEGMENT_COLUMNS = 1024
"""Target width of a segment's column split. Within a segment the producer walks row block by
row block across the split's column blocks, so each A row block is read once per split (not
once per BN-wide block): 4 reads of h at H = 4096 instead of 32 (measured on 2x H200, Mixtral
EP=2, 4096 tokens/rank: producer 2.61 ms at 128-wide segments vs 1.37 ms for torch's grouped
GEMM)."""
SLOTS_PER_ITEM = 256
"""Slots of one consumer work item (it sweeps the segment's columns BN at a time)."""


def destination_order(rank: int, num_ranks: int):
    """Remote destinations round-robin starting after `rank`, then `rank` itself."""
    return [(rank + d) % num_ranks for d in range(1, num_ranks)] + [rank]


def split_columns(hidden: int, bn: int, target: int = SEGMENT_COLUMNS):
    """(splits, width): `hidden` cut into `splits` column splits of `width` (a multiple of bn;
    the last one is masked at `hidden`)."""
    splits = max(1, -(-hidden // max(target, bn)))
    width = -(-(-(-hidden // splits)) // bn) * bn
    return -(-hidden // width), width


def build_schedule(meta: GatherRSMetadata, hidden: int, bm: int, bn: int,
                   slots_per_item: int = SLOTS_PER_ITEM) -> Schedule:
    """The producer tiles, segments and consumer items of one call, in priority order."""
    group_size = meta.group_size
    rank = meta.ep_rank * meta.tp_size + meta.tp_rank
    counts = meta.rows_per_expert_per_chunk  # [L, R] chunk order
    row_start = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    splits, width = split_columns(hidden, bn)
    blocks_per_split = width // bn

    # Row blocks of each destination, (expert, r0, r1), never crossing an (expert, chunk).
    blocks = {}
    for chunk in range(group_size):
        dest = chunk_to_group_rank(chunk, meta.tp_size, meta.ep_size)
        n = counts[:, chunk]
        per_expert = -(-n // bm)
        expert = np.repeat(np.arange(len(n)), per_expert)
        first = np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
        r0 = row_start[expert, chunk] + (np.arange(len(expert)) - first) * bm
        r1 = np.minimum(r0 + bm, row_start[expert, chunk] + n[expert])
        blocks[dest] = np.stack([expert, r0, r1], axis=1)

    slot_start = np.concatenate([[0], np.cumsum(meta.send_slots)[:-1]])
    order = destination_order(rank, group_size)
    remote, local = order[:-1], order[-1:]
    seg_keys = [(d, j) for j in range(splits) for d in remote] + [(d, j) for d in local
                                                                   for j in range(splits)]
    tiles, segments, items = [], [], []
    for seg, (dest, j) in enumerate(seg_keys):
        b = blocks[dest]
        c0 = j * width
        n_blocks = min(blocks_per_split, -(-(hidden - c0) // bn))
        t = np.empty((len(b) * n_blocks, 5), dtype=np.int64)
        t[:, :3] = np.repeat(b, n_blocks, axis=0)  # row block by row block across the split
        t[:, 3] = c0 + np.tile(np.arange(n_blocks) * bn, len(b))
        t[:, 4] = seg
        tiles.append(t)
        num_slots = int(meta.send_slots[dest])
        segments.append((dest, c0, len(t), slot_start[dest], num_slots,
                         meta.dest_row_offsets[dest], min(width, hidden - c0)))
        lo = np.arange(0, max(num_slots, 1), slots_per_item)
        items.append(np.stack([np.full_like(lo, seg), lo,
                               np.minimum(lo + slots_per_item, num_slots),
                               np.full_like(lo, len(lo))], axis=1))
    tiles = np.concatenate(tiles) if tiles else np.zeros((0, 5), dtype=np.int64)
    return Schedule(tiles.astype(np.int32),
                    np.array(segments, dtype=np.int64).reshape(-1, 7).astype(np.int32),
                    np.concatenate(items).astype(np.int32), splits)


def finalize_index(meta: GatherRSMetadata, row_base: int, device) -> torch.Tensor:
    """int32 [T, R]: receive-buffer row of sender s's partial row of token t, or -1."""
    index = torch.full((meta.num_tokens, meta.group_size), -1, dtype=torch.int32, device=device)
    offset = 0
    for sender, n in enumerate(meta.recv_slots):
        n = int(n)
        tokens = meta.recv_token_index[offset : offset + n]
        index[tokens, sender] = torch.arange(row_base + offset, row_base + offset + n,
                                             dtype=torch.int32, device=device)
        offset += n
    return index


def _raise_on_error(ws: GatherRSWorkspace, schedule: Schedule, epoch: int) -> None:
    code, where, seen, expected = (int(x) for x in ws.error.tolist())
    if code == 0:
        return
    rank = ws.rank
    if code == k.ERR_CONSUMER_WAIT:
        dest, col = int(schedule.segments[where, 0]), int(schedule.segments[where, 1])
        what = (f"the consumer timed out on segment {where} (destination rank {dest}, columns "
                f"{col}..): {seen} of {expected} producer tiles done")
    elif code == k.ERR_FINALIZE_WAIT:
        what = (f"finalize timed out waiting for sender rank {where}: arrival counter {seen}, "
                f"expected >= {expected} (call {epoch})")
    else:
        what = (f"sender rank {where} reported a failed consumer (arrival counter {seen}, "
                f"call {epoch})")
    ws.error.zero_()
    raise RuntimeError(f"gemm2_gatherrs (Triton) on tp_ep rank {rank}: {what}. The workspace "
                       "is unusable now; counters are out of step across ranks.")


class _Call:
    """One call's buffers and launches: `send` (producer + consumer), then `finalize`."""

    def __init__(self, h, w2, meta: GatherRSMetadata, ws: GatherRSWorkspace, plan: Plan,
                 timeout_s: float) -> None:
        self.ws, self.meta, self.plan = ws, meta, plan
        device = self.device = h.device
        self.hidden = hidden = w2.shape[1]
        self.bm, self.bn, self.bk = tile_shape(device)
        self.schedule = build_schedule(meta, hidden, self.bm, self.bn)
        self.gpu = device.type == "cuda"
        # GPU: nanoseconds of the global timer; interpreter: polls (1000 per second asked).
        self.timeout = int(timeout_s * 1e9) if self.gpu else max(10, int(timeout_s * 1000))
        ws.ensure_capacity(int(meta.recv_rows_per_rank.max(initial=0)))
        self.epoch = ws.next_epoch()
        row_base = (self.epoch % 2) * ws.capacity_rows
        self.row_base, self.target = row_base, self.epoch * self.schedule.splits
        self.tiles = torch.from_numpy(self.schedule.tiles).to(device)
        self.segs = torch.from_numpy(self.schedule.segments).to(device)
        self.items = torch.from_numpy(self.schedule.items).to(device)
        self.index = finalize_index(meta, row_base, device)
        self.h, self.w2 = h.contiguous(), w2.contiguous()
        self.y = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=device)
        num_segs = len(self.schedule.segments)
        counters = torch.zeros(2 * num_segs + 1, dtype=torch.int32, device=device)
        self.counters = counters  # zeroed per call: tile claim, tiles done, items sent
        self.tile_counter = counters[:1]
        self.seg_done, self.seg_sent = counters[1 : 1 + num_segs], counters[1 + num_segs :]
        self.out = torch.empty(meta.num_tokens, hidden, dtype=h.dtype, device=device)
        self.rank = meta.ep_rank * meta.tp_size + meta.tp_rank

    def producer(self, grid: int) -> None:
        h, w2, y = self.h, self.w2, self.y
        k._producer_kernel[(grid,)](
            h, w2, y, self.tiles, len(self.schedule.tiles), self.tile_counter, self.seg_done,
            h.shape[1], self.hidden, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
            BM=self.bm, BN=self.bn, BK=self.bk, num_warps=8 if self.gpu else 4,
            num_stages=3 if self.gpu else 1,
        )

    def consumer(self, grid: int) -> None:
        ws = self.ws
        num_contrib = self.meta.gather_index.shape[1]
        kp = triton.next_power_of_2(num_contrib)
        k._consumer_kernel[(grid,)](
            self.y, self.meta.gather_index, self.segs, self.items, len(self.schedule.items),
            self.seg_done, self.seg_sent, ws.peer_recv_ptrs, ws.peer_signal_ptrs, self.rank,
            self.row_base, self.hidden, self.y.stride(0), self.timeout, ws.error,
            K=num_contrib, KP=kp, BS=max(8, GATHER_ROWS // kp) if self.gpu else 8,
            BN=self.bn, USE_TIMER=self.gpu, num_warps=8 if self.gpu else 4,
        )

    def finalize(self) -> None:
        ws, meta = self.ws, self.meta
        bt, bh = FINALIZE_BLOCK if self.gpu else (8, 16)
        grid = (max(1, -(-meta.num_tokens // bt)), -(-self.hidden // bh))
        k._finalize_kernel[grid](
            ws.recv, self.index, self.out, ws.signals, meta.num_tokens, self.hidden,
            meta.group_size, self.target, self.timeout, ws.error, BT=bt, BH=bh,
            USE_TIMER=self.gpu, num_warps=4,
        )

    def send(self) -> None:
        """Producer + consumer; concurrent on two streams on the GPU."""
        plan, ws = self.plan, self.ws
        num_producer = plan.num_producer_ctas or 1
        if not self.gpu:
            self.producer(1)
            self.consumer(1)
            return
        main = torch.cuda.current_stream(self.device)
        key = (self.h.dtype, self.meta.gather_index.shape[1], self.hidden, self.h.shape[1])
        if key not in ws.compiled:
            # First call of this specialisation: the kernels run one after another so that
            # their JIT compilation never races a spinning kernel; then the ranks line up.
            self.producer(num_producer)
            self.consumer(plan.num_comm_ctas)
            main.synchronize()
            if ws.group is not None:
                dist.barrier(group=ws.group)
            ws.compiled.add(key)
            return
        ready = torch.cuda.Event()
        ready.record(main)
        ws.side_stream.wait_event(ready)
        with torch.cuda.stream(ws.side_stream):
            self.consumer(plan.num_comm_ctas)
        self.producer(num_producer)

    def finish(self) -> torch.Tensor:
        """Finalize, join the side stream, raise on a recorded timeout; returns [T, H]."""
        self.finalize()
        if self.gpu:
            done = torch.cuda.Event()
            done.record(self.ws.side_stream)
            torch.cuda.current_stream(self.device).wait_event(done)
        _raise_on_error(self.ws, self.schedule, self.epoch)
        return self.out


def gemm2_gatherrs_triton(
    h: torch.Tensor,
    w2: torch.Tensor,
    meta: GatherRSMetadata,
    *,
    workspace: GatherRSWorkspace,
    plan: Plan,
    timeout_s: float,
) -> torch.Tensor:
    """The fused op on the Triton kernels; same contract as `gemm2_gatherrs_reference`.

    Args:
        h, w2, meta: as `gemm2_gatherrs_reference`.
        workspace: this group's `GatherRSWorkspace` (`symm.get_workspace`).
        plan: the resource manager's plan (communication CTAs, producer CTAs).
        timeout_s: bound on every spin-wait.

    Raises:
        RuntimeError: a bounded wait expired (names the rank, the segment or sender, what it
            saw and what it waited for).
    """
    call = _Call(h, w2, meta, workspace, plan, timeout_s)
    call.send()
    return call.finish()
