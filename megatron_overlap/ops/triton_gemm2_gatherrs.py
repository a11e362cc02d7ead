"""Launcher of the tile-signaled Triton GEMM2 + GatherRS kernels.

Shape symbols as in `megatron_overlap.metadata`; BM x BN is the GEMM2 output tile, and one
*segment* is (destination rank, column split).

Per call, on this rank (DESIGN.md §3):
  1. host: the schedule: one work queue of GEMM2 tiles, segment by segment (the remote
     destinations round-robin split by split, this rank's own segments last, each segment
     row block by row block across its split), with each segment's gather items placed
     `GATHER_LAG` segments after its tiles;
  2. current stream: zero the counters, launch `_fused_kernel` (one CTA per SM; at most the
     plan's communication CTAs in the peer-store role at once), then `_finalize_kernel`;
  3. read the error record; a non-zero code raises RuntimeError naming rank, segment/sender,
     the value seen and the value waited for.

Without CUDA (the Triton interpreter) the kernels run with one program each (a gather item
then never waits: the tiles before it in the queue are done).
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
"""Rows of y one gather step loads at once (slots x padded contributions), all in flight
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

    entries: int32 [num_entries, 5], the work queue: a GEMM2 tile (local expert, row start,
        row end, column start, segment) or a gather item (-1, item index, 0, 0, 0).
    segments: int32 [num_segments, 7] (destination rank, column start, expected tiles,
        first slot, slot count, row offset of this sender in the destination's buffer,
        column width).
    items: int32 [num_items, 4] gather items (segment, first slot, end slot (both relative
        to the segment), items of that segment); every segment has >= 1 item.
    splits: column splits per destination (segments per sender per destination).
    """

    entries: np.ndarray
    segments: np.ndarray
    items: np.ndarray
    splits: int

    @property
    def num_tiles(self) -> int:
        return int((self.entries[:, 0] >= 0).sum())


GATHER_LAG = 2
"""Segments between a segment's last GEMM2 tile and its first gather item in the queue, so
that a gather item rarely waits for tiles still in flight."""

SEGMENT_COLUMNS = 1024
"""Target width of a segment's column split. Within a segment the tiles go row block by row
block across the split's column blocks, so h is read once per split rather than once per
BN-wide block (4 times at H = 4096 instead of 32). Predicted to close the producer's gap to
torch's grouped GEMM (2.61 ms vs 1.37 ms, Mixtral shapes, 4096 tokens/rank, H200); measured:
2.57 ms, so h re-reads were not the cause (notes: docs/perf_notes.md)."""
SLOTS_PER_ITEM = 256
"""Slots of one gather item (it sweeps the segment's columns BN at a time)."""


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
    """The work queue, segments and gather items of one call, in priority order."""
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
    item_base = 0
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
    queue = []
    item_refs = []
    for seg_items in items:
        refs = np.zeros((len(seg_items), 5), dtype=np.int64)
        refs[:, 0] = -1
        refs[:, 1] = item_base + np.arange(len(seg_items))
        item_base += len(seg_items)
        item_refs.append(refs)
    for seg in range(len(seg_keys)):
        queue.append(tiles[seg])
        if seg >= GATHER_LAG:
            queue.append(item_refs[seg - GATHER_LAG])
    queue += item_refs[max(0, len(seg_keys) - GATHER_LAG):]
    return Schedule(np.concatenate(queue).astype(np.int32),
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


_allocator_set = False


def _ensure_allocator() -> None:
    """Device-side TMA descriptors (`tl.make_tensor_descriptor`) need Triton's scratch
    allocator; it takes memory from PyTorch's caching allocator."""
    global _allocator_set
    if not _allocator_set:
        triton.set_allocator(
            lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _allocator_set = True


def _raise_on_error(ws: GatherRSWorkspace, schedule: Schedule, epoch: int) -> None:
    code, where, seen, expected = (int(x) for x in ws.error.tolist())
    if code == 0:
        return
    rank = ws.rank
    if code == k.ERR_TILES_WAIT:
        dest, col = int(schedule.segments[where, 0]), int(schedule.segments[where, 1])
        what = (f"a gather item timed out on segment {where} (destination rank {dest}, columns "
                f"{col}..): {seen} of {expected} GEMM2 tiles done")
    elif code == k.ERR_COMM_SLOT:
        what = (f"a gather item of segment {where} waited too long for one of {seen} "
                "communication CTA slots")
    elif code == k.ERR_FINALIZE_WAIT:
        what = (f"finalize timed out waiting for sender rank {where}: arrival counter {seen}, "
                f"expected >= {expected} (call {epoch})")
    else:
        what = (f"sender rank {where} reported a failed gather (arrival counter {seen}, "
                f"call {epoch})")
    ws.error.zero_()
    raise RuntimeError(f"gemm2_gatherrs (Triton) on tp_ep rank {rank}: {what}. The workspace "
                       "is unusable now; counters are out of step across ranks.")


class _Call:
    """One call's buffers and launches: `send` (the fused kernel), then `finish` (finalize)."""

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
        self.entries = torch.from_numpy(self.schedule.entries).to(device)
        self.segs = torch.from_numpy(self.schedule.segments).to(device)
        self.items = torch.from_numpy(self.schedule.items).to(device)
        self.index = finalize_index(meta, row_base, device)
        self.h, self.w2 = h.contiguous(), w2.contiguous()
        self.y = torch.empty(h.shape[0], hidden, dtype=h.dtype, device=device)
        num_segs = len(self.schedule.segments)
        # Zeroed per call: entry claim, CTAs communicating, unused, tiles done per segment,
        # items finished per segment.
        self.counters = torch.zeros(3 + 2 * num_segs, dtype=torch.int32, device=device)
        self.out = torch.empty(meta.num_tokens, hidden, dtype=h.dtype, device=device)
        self.rank = meta.ep_rank * meta.tp_size + meta.tp_rank
        # TMA needs 16-byte aligned row strides and bases (e.g. not F = 12 in bf16).
        row_bytes = self.h.shape[1] * self.h.element_size()
        self.use_tma = self.gpu and row_bytes % 16 == 0 and all(
            t.data_ptr() % 16 == 0 for t in (self.h, self.w2))

    def gemm_only(self, grid: int) -> None:
        """The GEMM2 tiles alone (communication off), for the benchmark's producer timing;
        zeroes the counters first. The call must not be finished afterwards."""
        tiles = self.entries[self.entries[:, 0] >= 0].contiguous()
        saved = self.entries
        self.entries = tiles
        try:
            self.counters.zero_()
            self.fused(grid, max_comm=1, num_entries=len(tiles))
        finally:
            self.entries = saved

    def fused(self, grid: int, max_comm: int, num_entries: Optional[int] = None) -> None:
        """Launch `_fused_kernel` on `grid` CTAs (counters must be zero)."""
        ws, h, w2, y = self.ws, self.h, self.w2, self.y
        num_contrib = self.meta.gather_index.shape[1]
        kp = triton.next_power_of_2(num_contrib)
        k._fused_kernel[(grid,)](
            h, w2, y, self.entries,
            len(self.schedule.entries) if num_entries is None else num_entries, self.counters,
            len(self.schedule.segments), self.meta.gather_index, self.segs, self.items,
            ws.peer_recv_ptrs, ws.peer_signal_ptrs, self.rank, self.row_base, max_comm,
            max(1, h.shape[0]), h.shape[1], self.hidden, w2.shape[0], h.stride(0), w2.stride(0),
            w2.stride(1), y.stride(0), self.timeout, ws.error,
            BM=self.bm, BN=self.bn, BK=self.bk, K=num_contrib, KP=kp,
            BS=max(8, GATHER_ROWS // kp) if self.gpu else 8, USE_TMA=self.use_tma,
            USE_TIMER=self.gpu, num_warps=8 if self.gpu else 4,
            num_stages=3 if self.gpu else 1,
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
        """GEMM2 tiles and gather items, all in one persistent launch."""
        plan, ws = self.plan, self.ws
        if not self.gpu:
            self.fused(1, max_comm=1)
            return
        _ensure_allocator()
        grid = plan.num_ctas or 1
        key = (self.h.dtype, self.meta.gather_index.shape[1], self.hidden, self.h.shape[1])
        self.fused(grid, max(1, plan.num_comm_ctas))  # 0: "no-remote" plan
        key = key + (self.use_tma,)
        if key not in ws.compiled:
            # First call of this specialisation: line the ranks up after their JIT
            # compilation, so that no rank's finalize waits out another's compile.
            torch.cuda.current_stream(self.device).synchronize()
            if ws.group is not None:
                dist.barrier(group=ws.group)
            ws.compiled.add(key)

    def finish(self) -> torch.Tensor:
        """Finalize, then raise on a recorded timeout (reads the error record: a host sync);
        returns [T, H]."""
        self.finalize()
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
        plan: the resource manager's plan (grid, most CTAs storing to peers at once).
        timeout_s: bound on every spin-wait.

    Raises:
        RuntimeError: a bounded wait expired (names the rank, the segment or sender, what it
            saw and what it waited for).
    """
    call = _Call(h, w2, meta, workspace, plan, timeout_s)
    call.send()
    return call.finish()
