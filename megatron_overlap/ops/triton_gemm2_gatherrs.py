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
import torch.distributed as dist

from megatron_overlap.kernels import gemm2_gatherrs as k
from megatron_overlap.metadata import GatherRSMetadata, chunk_to_group_rank
from megatron_overlap.resource import Plan
from megatron_overlap.symm import GatherRSWorkspace

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
"""Producer tile (rows x hidden columns x ffn depth) on the GPU."""
SLOT_BLOCK = 32
"""Slots the consumer sums per step (x BLOCK_N columns)."""
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
    segments: int32 [num_segments, 6] (destination rank, column start, expected tiles,
        first slot, slot count, row offset of this sender in the destination's buffer).
    splits: column splits per destination (segments per sender per destination).
    """

    tiles: np.ndarray
    segments: np.ndarray
    splits: int


def destination_order(rank: int, num_ranks: int):
    """Remote destinations round-robin starting after `rank`, then `rank` itself."""
    return [(rank + d) % num_ranks for d in range(1, num_ranks)] + [rank]


def build_schedule(meta: GatherRSMetadata, hidden: int, bm: int, bn: int) -> Schedule:
    """The producer tiles and consumer segments of one call, in priority order."""
    group_size = meta.group_size
    rank = meta.ep_rank * meta.tp_size + meta.tp_rank
    counts = meta.rows_per_expert_per_chunk  # [L, R] chunk order
    row_start = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
    splits = -(-hidden // bn)

    # Row blocks of each destination: (expert, r0, r1), never crossing an (expert, chunk).
    blocks = {}
    for chunk in range(group_size):
        dest = chunk_to_group_rank(chunk, meta.tp_size, meta.ep_size)
        rows = []
        for expert in range(meta.num_local_experts):
            n, r0 = int(counts[expert, chunk]), int(row_start[expert, chunk])
            for b in range(0, n, bm):
                rows.append((expert, r0 + b, r0 + min(b + bm, n)))
        blocks[dest] = np.array(rows, dtype=np.int64).reshape(-1, 3)

    slot_start = np.concatenate([[0], np.cumsum(meta.send_slots)[:-1]])
    order = destination_order(rank, group_size)
    remote, local = order[:-1], order[-1:]
    seg_keys = [(d, j) for j in range(splits) for d in remote] + [(d, j) for d in local
                                                                   for j in range(splits)]
    tiles, segments = [], []
    for seg, (dest, j) in enumerate(seg_keys):
        b = blocks[dest]
        t = np.empty((len(b), 5), dtype=np.int64)
        t[:, :3] = b
        t[:, 3] = j * bn
        t[:, 4] = seg
        tiles.append(t)
        segments.append((dest, j * bn, len(b), slot_start[dest], meta.send_slots[dest],
                         meta.dest_row_offsets[dest]))
    tiles = np.concatenate(tiles) if tiles else np.zeros((0, 5), dtype=np.int64)
    return Schedule(tiles.astype(np.int32), np.array(segments, dtype=np.int32).reshape(-1, 6),
                    splits)


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
        self.index = finalize_index(meta, row_base, device)
        self.h, self.w2 = h.contiguous(), w2.contiguous()
        self.y = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=device)
        counters = torch.zeros(len(self.schedule.segments) + 1, dtype=torch.int32,
                               device=device)
        self.seg_done, self.tile_counter = counters[1:], counters[:1]
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
        k._consumer_kernel[(grid,)](
            self.y, self.meta.gather_index, self.segs, len(self.schedule.segments),
            self.seg_done, ws.peer_recv_ptrs, ws.peer_signal_ptrs, self.rank, self.row_base,
            self.hidden, self.y.stride(0), self.timeout, ws.error,
            K=self.meta.gather_index.shape[1], BS=SLOT_BLOCK if self.gpu else 8, SW=self.bn,
            USE_TIMER=self.gpu, num_warps=4,
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
