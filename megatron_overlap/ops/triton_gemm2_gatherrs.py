"""Launcher of the tile-signaled Triton GEMM2 + GatherRS kernels (v4).

Shape symbols as in `megatron_overlap.metadata`; BM x BN is the GEMM2 output tile.

Row layout ("direct"): every (token, expert) row is summed where its token lives. The
symmetric receive buffer of rank g holds, for every other sender s of the tp_ep group in
group order, a block of `pairs(g, ep(s))` rows: g's routed (token, expert) pairs with an
expert on s's EP rank, in g's permute order (expert-major, token ascending) -- the order in
which s's rows of source chunk g already are. So sender s stores rows [r0, r1) of (expert
l, chunk of g) at `offset(g, s) + (rows of experts < l in that chunk) + (r0 - chunk
start)`. g's own block (s = g) is not in the receive buffer: g's GEMM2 stores it into the
call's local buffer (a transient [local_rows, H], from row 0), and g's finalize reads row
i >= recv_rows[g] there as row i - recv_rows[g]. The symmetric buffer, held for the whole
run, so carries only rows that travel (at EP = 2 with uniform routing, half the rows).
Everything is known on every rank from the exchanged tokens-per-expert counts
(`meta.routed_counts`).

Per call, on this rank (DESIGN.md §3):
  1. host: the segments (`direct_layout`: one per destination and local expert, remote
     destinations round-robin after this rank, this rank last), the arrival targets and the
     finalize index bases, in one pinned int32 buffer, one asynchronous H2D copy; O(L x R +
     E) host work, whatever the token count;
  2. device, current stream: the tile list (`_tile_list_block`: the segments' tiles,
     wave-ordered for the plan's k communication CTAs) and the routing map's token counts
     per block (`_block_count_block`), both in one launch (`_prepare_kernel`); once h
     exists, `_gemm_scatter_kernel` (persistent, `plan.num_ctas` CTAs), whose CTAs build
     the finalize index (`_index_block`: the routing map's prefix sum over tokens,
     compacted per token) after their tiles, then `_finalize_kernel`: three launches a
     call. The tile list needs only the metadata: `_Call` launches it at construction
     ("prepare"), which the Megatron layer does while FC1 runs;
  3. the error record is copied to pinned memory asynchronously and checked at the start of
     the next call on the workspace (or now with `finish(sync_errors=True)`, or by
     `GatherRSWorkspace.check_errors()`): a finalize that timed out raises RuntimeError
     naming the rank, the sender, the value seen and the value waited for.

The first call of each kernel specialisation synchronises and lines the ranks up after
compiling, so no rank's finalize waits out a peer's JIT compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import triton

from megatron_overlap._host import current_stream, own_launch, triton_scratch
from megatron_overlap.config import TILE_LIST_ENV, tile_list_source  # noqa: F401 (re-export)
from megatron_overlap.config import host_tables_mode, tma_rows_aligned, tma_store_enabled
from megatron_overlap.kernels import gemm2_gatherrs as k
from megatron_overlap.kernels.launch import FastLauncher
from megatron_overlap.metadata import GatherRSMetadata, chunk_to_group_rank
from megatron_overlap.profiling import span
from megatron_overlap.resource import (
    HardwareProfile,
    KernelResources,
    Plan,
    kernel_resources_from_compiled,
)
from megatron_overlap.symm import GatherRSWorkspace

try:  # the C++ `direct_layout` (csrc/layout.cpp), built by setup.py; else the numpy twin
    from megatron_overlap.ops import _layout as _layout_cpp
except ImportError:
    _layout_cpp = None


@dataclass(frozen=True)
class TileConfig:
    """GEMM2 tile and launch configuration of `_gemm_scatter_kernel`.

    bm x bn output tile (rows x hidden columns), bk the FFN depth per K step, Triton
    num_warps / num_stages; static: wave-ordered tile list (True) or atomic claims (False);
    tma_store: the epilogue stores each tile through a TMA descriptor (asynchronous: the
    store overlaps the CTA's next tile) where H x element size is a multiple of 16 bytes,
    else from registers (`_tile`); rotate: each wave's remote-bound positions go to other
    CTAs every wave instead of always to CTAs 0..k-1 (`_gemm_scatter_kernel`'s ROTATE).
    Both need the static schedule; neither changes the result (bit for bit). The TMA-store
    epilogue adds a bm x bn tile of shared memory (64 KiB at 128 x 256 in bf16): with 4
    stages at 128 x 256 x 64 it exceeds an H200's 227 KiB (Triton then refuses to launch).

    Raises:
        ValueError: a tile size that is not a power of two in [16, 256], num_warps not a
            power of two in [1, 32], num_stages < 1; tma_store or rotate with static=False.
    """

    bm: int = 128
    bn: int = 256
    bk: int = 64
    num_warps: int = 8
    num_stages: int = 3
    static: bool = True
    tma_store: bool = False
    rotate: bool = False

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v > 256 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}={v} must be a power of two in [16, 256] "
                                 "(256: a TMA box's largest dimension)")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"TileConfig.num_warps={self.num_warps} must be a power of two "
                             "in [1, 32]")
        if self.num_stages < 1:
            raise ValueError(f"TileConfig.num_stages={self.num_stages} must be >= 1")
        if not self.static and (self.tma_store or self.rotate):
            # (Triton 3.6 does not compile the TMA-store epilogue in the dynamic schedule's
            # while loop: "sinking into unhandled control flow op: scf.while".)
            raise ValueError(f"TileConfig(static=False, tma_store={self.tma_store}, "
                             f"rotate={self.rotate}): tma_store and rotate need the static "
                             "schedule (static=True)")

    @property
    def name(self) -> str:
        """The configuration as `launch/bench_op.py --variants` spells it, e.g.
        "128x256x64w8s3tma" (BMxBNxBK, wWARPS, sSTAGES, then "dyn" for atomic claims, "tma"
        for the TMA-store epilogue, "rot" for rotated waves); the rows' `gemm2_tile`."""
        return (f"{self.bm}x{self.bn}x{self.bk}w{self.num_warps}s{self.num_stages}"
                f"{'' if self.static else 'dyn'}{'tma' if self.tma_store else ''}"
                f"{'rot' if self.rotate else ''}")


DEFAULT_TILE = TileConfig()
"""The GPU's tile with the epilogue's stores from registers (measured choice:
docs/perf_notes.md): `default_tile`'s at world > 1 unless $MEGATRON_OVERLAP_TMA_STORE=1."""
DEFAULT_TMA_TILE = dataclasses.replace(DEFAULT_TILE, tma_store=True)
"""`DEFAULT_TILE` with the epilogue's stores through TMA descriptors: `default_tile`'s at
world 1 unless $MEGATRON_OVERLAP_TMA_STORE=0 (`megatron_overlap.config.tma_store_enabled`)."""
WIDE_TILE = TileConfig(bm=256, bn=128, bk=64, num_warps=8, num_stages=4)
"""256 x 128 x 64, 8 warps, 4 pipeline stages, stores from registers (4 x 48 KiB of stages
leave no room for the TMA store's 64 KiB staging tile): on one H100 7-11 % less time per
tile than `DEFAULT_TMA_TILE` at Mixtral's and Phi-3.5's long K (F 14336 / 6400), 12-27 %
more producer time on the fine-grained shapes (F <= 1408; docs/perf_notes.md v6.0, v6.1);
3-4 % more there since v6.4 (its epilogue's stores 16 bytes wide, v6.4 run a).
Offered to the resource manager by `plan_call` (`TILE_CANDIDATES`) where the hardware
profile has its tile time (`launch/calibrate.py --tiles`)."""
TILE_CANDIDATES = (WIDE_TILE,)
"""The tiles `plan_call` may choose besides the call's default tile (`default_tile`), each
only where the hardware profile has a tile time of its shape and epilogue
(`HardwareProfile.has_tile_time`). A profile's entry for a shape is the time of the
configuration listed here (or of `DEFAULT_TILE` / `DEFAULT_TMA_TILE`) for that shape."""
INTERPRETER_TILE = TileConfig(16, 16, 16, num_warps=4, num_stages=1)
"""Small tiles for the Triton interpreter (speed)."""
FINALIZE_BLOCK = (32, 128)
"""Tokens x columns per finalize CTA."""
INDEX_BLOCK_TOKENS = 64
"""Tokens per CTA of `_block_count_block` and per block of the finalize index
(`_index_block`) on the GPU."""
TILE_LIST_BLOCK = 256
"""Tile entries per CTA of `_tile_list_block`."""
FOLD_MAX_EP2 = 128
"""Up to this many experts (rounded up to a power of two), the GEMM2 kernel's CTAs build the
finalize index after their tiles; above, `_index_kernel` runs alone after the GEMM2 (the
index's [64, EP2] int32 tiles would crowd the GEMM2 kernel's registers)."""


def default_tile(device: torch.device, world_size: int) -> TileConfig:
    """The tile configuration of a call over `world_size` ranks (its TP x EP group) on
    `device`: on CUDA `DEFAULT_TMA_TILE` where `tma_store_enabled(world_size)` (unset:
    world 1), else `DEFAULT_TILE`; `INTERPRETER_TILE` elsewhere.

    Raises:
        TypeError, ValueError: a bad world_size or $MEGATRON_OVERLAP_TMA_STORE
            (`tma_store_enabled`).
    """
    gpu_tile = _gpu_tile(world_size)  # checks world_size and the variable on every device
    return gpu_tile if torch.device(device).type == "cuda" else INTERPRETER_TILE


def _gpu_tile(world_size: int) -> TileConfig:
    return DEFAULT_TMA_TILE if tma_store_enabled(world_size) else DEFAULT_TILE


def epilogue_stores_tma(tile: TileConfig, hidden: int, elem_bytes: int) -> bool:
    """Whether the GEMM2 kernel's epilogue stores through TMA for a call with this tile:
    `tile.tma_store`, and rows of `hidden` elements of `elem_bytes` bytes a multiple of 16
    bytes (a TMA descriptor's row stride); else it stores from registers. The planner
    takes the matching tile time (`plan_gemm2_gatherrs(..., tma_store=...)`)."""
    return tile.tma_store and tma_rows_aligned(hidden * elem_bytes)


TILE_CHOICE_MARGIN = 0.02
"""`plan_call` takes a candidate over the default tile only where the model predicts the
whole call (`Plan.predicted_us`: GEMM2 waves, finalize, launches) at least this fraction
faster (2 %): a smaller predicted gain is within the tile-time fits' own error at long K
(docs/perf_notes.md v6.1), and the default tile is the one measured on every shape."""


@dataclass(frozen=True)
class TileChoice:
    """`plan_call`'s result: the tile the call runs, its plan, and the model's predicted
    time of every tile it compared (microseconds, the default tile first, by
    `TileConfig.name`): `Plan.predicted_us` at world 1, the group's slowest rank
    (`resource.group_time_us`) where it compared tiles at world > 1."""

    tile: TileConfig
    plan: Plan
    predicted_us: dict


def plan_call(meta: GatherRSMetadata, options, *, device: torch.device, hidden: int,
              ffn: int, elem_bytes: int, num_sms: Optional[int], resources, recv_rows=None,
              profile=None, choose: bool = True) -> TileChoice:
    """The GEMM2 tile and the plan of one call: the resource manager's wave model
    (`resource.plan_gemm2_gatherrs`, C++ solver) run for the call's default tile
    (`default_tile(device, meta.group_size)`) and, where `choose`, the call runs on CUDA
    with an SM count and `tile_choice_enabled(group size)` (unset: world 1 only; "all":
    every world), for each of `TILE_CANDIDATES` the hardware profile has a tile time for;
    the fastest candidate predicted at least `TILE_CHOICE_MARGIN` faster than the default
    tile wins, else the default tile. Nothing is measured, compiled or launched: the tile
    counts come from the routing metadata (ceil(rows / BM) x ceil(H / BN) per expert), the
    tile times from the profile (tau(F) = alpha + beta x ceil(F / BK)), the time from the
    grid's waves (DESIGN.md §4; a part-filled last wave at its busy fraction + the tile's
    calibrated `idle_wave_cost` x its idle fraction).

    What is compared: at world 1 each tile's `Plan.predicted_us` (this rank's GEMM2 waves,
    finalize and launches); at world > 1 the group's slowest rank in the mode the plan runs
    (`resource.group_time_us`), whose inputs every rank of the group holds alike (the
    exchanged routed counts, shapes, profile), so every rank picks the same tile, as the
    senders and receivers of one call must (a receiver counts its expected arrivals with its
    own BM x BN). Metadata without routed counts or top-k at world > 1: the default tile.

    Args:
        meta, options: as `plan_gemm2_gatherrs`.
        device: the call's device (not CUDA: the interpreter's tile, no choice, planned
            with `resource.DEFAULT_TILE`'s shape as before v6.1).
        hidden, ffn: H, F of the call; elem_bytes: bytes per element of h.
        num_sms: the GPU's SMs (None: no model, as `plan_gemm2_gatherrs`; the default
            tile).
        resources: callable TileConfig -> `KernelResources` or None (the compiled GEMM2
            kernel's for that tile, e.g. `call_resources(..., tile)`; None before its
            first launch: the planner's default, one CTA per SM).
        recv_rows, profile: as `plan_gemm2_gatherrs`.
        choose: False plans the default tile alone (the caller runs no Triton kernel, e.g.
            the reference backend).

    Returns:
        A `TileChoice` (its `predicted_us`: the compared time of each tile planned; the
        default tile's `Plan.predicted_us` where it is planned alone).

    Raises:
        as `plan_gemm2_gatherrs` and `default_tile`; ValueError: a bad
        $MEGATRON_OVERLAP_TILE_CHOICE.
    """
    from megatron_overlap.config import tile_choice_enabled
    from megatron_overlap.resource import DEFAULT_TILE as DEFAULT_SHAPE
    from megatron_overlap.resource import group_time_us, load_profile, plan_gemm2_gatherrs

    default = default_tile(device, meta.group_size)
    cuda = (device.type if isinstance(device, torch.device) else torch.device(device).type
            ) == "cuda"
    tiles = [default]
    group = meta.group_size > 1
    if tile_choice_enabled(meta.group_size) and choose and cuda and num_sms is not None and (
            not group or (meta.routed_counts is not None and meta.topk)):
        prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        tiles += [t for t in TILE_CANDIDATES if t != default and prof.has_tile_time(
            t.bm, t.bn, t.bk, epilogue_stores_tma(t, hidden, elem_bytes))]
    plans, scores = [], []
    for tile in tiles:
        shape = (tile.bm, tile.bn, tile.bk) if cuda else DEFAULT_SHAPE
        tma = epilogue_stores_tma(tile, hidden, elem_bytes)
        plan = plan_gemm2_gatherrs(
            meta, options, num_sms=num_sms, hidden=hidden, ffn=ffn, elem_bytes=elem_bytes,
            recv_rows=recv_rows, kernel=resources(tile), profile=profile, tile=shape,
            tma_store=tma)
        plans.append(plan)
        scores.append(group_time_us(meta, plan, num_sms=num_sms, hidden=hidden, ffn=ffn,
                                    elem_bytes=elem_bytes, profile=profile, tile=shape,
                                    tma_store=tma)
                      if group and len(tiles) > 1 else plan.predicted_us)
    best = 0
    base_us = scores[0]
    for i in range(1, len(plans)):
        us = scores[i]
        if (base_us is not None and us is not None
                and us < (1.0 - TILE_CHOICE_MARGIN) * base_us
                and (best == 0 or us < scores[best])):
            best = i
    return TileChoice(tile=tiles[best], plan=plans[best],
                      predicted_us={t.name: us for t, us in zip(tiles, scores)})


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (`triton.cdiv` is a `ConstexprFunction`: ~6 us per host call)."""
    return -(-a // b)


def _align4(n: int) -> int:
    """n rounded up to a multiple of 4: int32 counts whose scratch parts start 16-byte
    aligned. Triton (and `FastLauncher`'s key) specialise a kernel on each pointer's 16-byte
    alignment, so a part whose alignment followed the call's tile count would compile a
    second variant mid-run, on one rank."""
    return (n + 3) & ~3


def _pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`, in plain
    Python."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def destination_order(rank: int, num_ranks: int):
    """Remote destinations round-robin starting after `rank`, then `rank` itself."""
    return [(rank + d) % num_ranks for d in range(1, num_ranks)] + [rank]


@dataclass(frozen=True)
class DirectLayout:
    """Host-side tables of one call (see the module docstring).

    segments: int32 [S, k.SEGMENT_FIELDS]: one per (destination, local expert) in list
        order: destinations in `destination_order` (remote ones first, this rank last),
        local experts ascending; fields: local expert, first row in h, rows, destination
        group rank, first row in the destination's buffer, first tile (exclusive prefix of
        ceil(rows / bm) * col_blocks over the list).
    num_remote, num_local: tiles bound for other ranks / for this rank.
    col_blocks: ceil(hidden / bn); bm, bn: the tile shape.
    arrivals: int64 [R]: tiles each rank stores into this rank's buffer this call (0 for
        this rank itself: its own tiles go to the call's local buffer, ordered by the
        stream).
    recv_rows: int64 [R]: rows each rank receives from the other ranks this call (the rows
        of its symmetric receive buffer: TP x its routed pairs, less those it computes
        itself).
    local_rows: rows this rank computes for its own tokens (its block of its own buffer,
        kept in the call's local buffer instead of the symmetric one).
    finalize_base: int32 [TP, E]: the row of token t's expert-e output from TP rank tp of
        EP rank e // L is finalize_base[tp, e] + cum[t, e], cum the inclusive prefix sum of
        the routing map over tokens (`contribution_rows`); rows from recv_rows[rank] on
        are rows of the local buffer (row - recv_rows[rank] there).
    num_pairs: this rank's routed (token, expert) pairs.

    `tiles_remote` / `tiles_local` expand the segments on the host (`expand_tiles`; the
    GPU path expands them on the device with `_tile_list_block`).
    """

    segments: np.ndarray
    num_remote: int
    num_local: int
    col_blocks: int
    bm: int
    bn: int
    arrivals: np.ndarray
    recv_rows: np.ndarray
    local_rows: int
    finalize_base: np.ndarray
    num_pairs: int

    @property
    def tiles_remote(self) -> np.ndarray:
        """int32 [num_remote, 6] tile entries (`k.TILE_FIELDS`), grouped by destination in
        `destination_order`, each destination's row blocks in h order, column blocks
        innermost."""
        return expand_tiles(self)[: self.num_remote]

    @property
    def tiles_local(self) -> np.ndarray:
        """int32 [num_local, 6] tile entries of this rank's own rows."""
        return expand_tiles(self)[self.num_remote:]


def _ceil_div(a, b):
    return -(-a // b)


def expand_tiles(layout: DirectLayout) -> np.ndarray:
    """int32 [num_remote + num_local, 6]: every segment's tiles in list order (the host
    twin of `_tile_list_block` without the wave order)."""
    seg = layout.segments.astype(np.int64)
    nb = _ceil_div(seg[:, 2], layout.bm)
    run = np.repeat(np.arange(len(seg)), nb)
    blk = np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)
    r0 = seg[run, 1] + blk * layout.bm
    ncb = layout.col_blocks
    tiles = np.empty((len(run) * ncb, k.TILE_FIELDS), dtype=np.int32)
    tiles[:, 0] = np.repeat(seg[run, 0], ncb)
    tiles[:, 1] = np.repeat(r0, ncb)
    tiles[:, 2] = np.repeat(np.minimum(r0 + layout.bm, seg[run, 1] + seg[run, 2]), ncb)
    tiles[:, 3] = np.tile(np.arange(ncb) * layout.bn, len(run))
    tiles[:, 4] = np.repeat(seg[run, 3], ncb)
    tiles[:, 5] = np.repeat(seg[run, 4] + blk * layout.bm, ncb)
    return tiles


def direct_layout(meta: GatherRSMetadata, hidden: int, bm: int, bn: int) -> DirectLayout:
    """Segments, arrival counts and index bases of one call (host only, no device work;
    O(L x R + R x E), independent of the token count).

    Runs the C++ extension `megatron_overlap.ops._layout` when it is built, else
    `direct_layout_numpy`; both return the same `DirectLayout` (tests/cpu/test_layout_cpp.py).

    Raises:
        ValueError: `meta` lacks `routed_counts` (built without the exchanged counts), or a
            row or tile coordinate does not fit in int32; with the C++ extension also counts
            of the wrong shape, not integers or outside [0, 2^31), hidden < 0, bm < 1 or
            bn < 1 (unchecked by the twin).
    """
    if meta.routed_counts is None:
        raise ValueError("metadata without routed_counts: build it with build_metadata(...)")
    if _layout_cpp is None:
        return direct_layout_numpy(meta, hidden, bm, bn)
    (segments, num_remote, num_local, col_blocks, arrivals, recv_rows, local_rows,
     finalize_base, num_pairs) = _layout_cpp.direct_layout(
        meta.routed_counts, meta.rows_per_expert_per_chunk, meta.tp_size, meta.ep_size,
        meta.tp_rank, meta.ep_rank, hidden, bm, bn)
    return DirectLayout(segments=segments, num_remote=num_remote, num_local=num_local,
                        col_blocks=col_blocks, bm=bm, bn=bn, arrivals=arrivals,
                        recv_rows=recv_rows, local_rows=local_rows,
                        finalize_base=finalize_base, num_pairs=num_pairs)


def direct_layout_numpy(meta: GatherRSMetadata, hidden: int, bm: int, bn: int) -> DirectLayout:
    """The numpy twin of `direct_layout` (same values; used where the C++ extension is not
    built, and by the tests that compare the two).

    Raises:
        ValueError: `meta` lacks `routed_counts`, or a row or tile coordinate does not fit in
            int32.
    """
    if meta.routed_counts is None:
        raise ValueError("metadata without routed_counts: build it with build_metadata(...)")
    tp, ep = meta.tp_size, meta.ep_size
    group_size, num_local = tp * ep, meta.num_local_experts
    me = meta.ep_rank * tp + meta.tp_rank
    routed = meta.routed_counts  # [R, E] group order
    num_experts = routed.shape[1]
    pairs_to_ep = routed.reshape(group_size, ep, num_local).sum(axis=2)  # [R(g), EP(j)]
    ep_of_sender = np.arange(group_size) // tp
    block = pairs_to_ep[:, ep_of_sender]  # [R(g), R(s)]: rows s sends to g
    own = np.eye(group_size, dtype=bool)
    remote_block = np.where(own, 0, block)  # g's own rows stay out of its receive buffer
    # [R(g), R(s)]: s's block in g's receive buffer (the remote senders' blocks in group
    # order); g's own block is the local buffer, from row 0.
    offsets = np.where(own, 0, np.cumsum(remote_block, axis=1) - remote_block)
    recv_rows = remote_block.sum(axis=1)
    local_rows = int(block[me, me])

    # This rank's segments: for chunk c (destination d) and local expert l, rows[l, c].
    counts = meta.rows_per_expert_per_chunk  # [L, R] chunk order
    row_start = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    dests = np.array([chunk_to_group_rank(c, tp, ep) for c in range(group_size)])
    within = np.cumsum(counts, axis=0) - counts  # rows of experts < l in chunk c
    dest_row = offsets[dests, me][None, :] + within  # [L, R]
    # Destination order (remote round-robin, this rank's own last), then expert order.
    position = {d: i for i, d in enumerate(destination_order(me, group_size))}
    c_order = np.argsort(np.array([position[d] for d in dests]), kind="stable")
    l_idx = np.tile(np.arange(num_local), group_size)
    c_idx = np.repeat(c_order, num_local)
    rows = counts[l_idx, c_idx]
    col_blocks = _ceil_div(hidden, bn)
    tiles = _ceil_div(rows, bm) * col_blocks
    segments = np.stack([l_idx, row_start[l_idx, c_idx], rows, dests[c_idx],
                         dest_row[l_idx, c_idx], np.cumsum(tiles) - tiles], axis=1)
    if segments.size and max(int((segments[:, 1] + segments[:, 2]).max()),
                              int((segments[:, 4] + segments[:, 2]).max()),
                              int(tiles.sum())) >= 2**31:
        raise ValueError("a row or tile coordinate does not fit in int32")
    remote = dests[c_idx] != me

    # Tiles every sender s stores into this rank: ceil(rows/bm) * column blocks per expert.
    mine = routed[me].reshape(ep, num_local)  # my tokens per expert, by EP rank
    tiles_from_ep = (_ceil_div(mine, bm) * col_blocks).sum(axis=1)
    arrivals = tiles_from_ep[ep_of_sender].astype(np.int64)
    arrivals[me] = 0

    first_pair = np.cumsum(routed[me]) - routed[me]  # first pair index of expert e
    first_pair_of_ep = first_pair.reshape(ep, num_local)[:, 0]
    expert_ep = np.arange(num_experts) // num_local
    senders = expert_ep[None, :] * tp + np.arange(tp)[:, None]  # [TP, E]
    # pair p of expert e sits at offsets + (p - first pair of e's EP rank); p = first_pair[e]
    # + cum[t, e] - 1. The finalize reads rows >= recv_rows[me] from the local buffer: this
    # rank's own block is addressed after the receive buffer's rows.
    virtual = np.where(own[me], recv_rows[me], offsets[me])  # [R(s)]
    finalize_base = (virtual[senders] - first_pair_of_ep[expert_ep][None, :]
                     + first_pair[None, :] - 1)
    return DirectLayout(
        segments=segments.astype(np.int32),
        num_remote=int(tiles[remote].sum()),
        num_local=int(tiles[~remote].sum()),
        col_blocks=int(col_blocks), bm=bm, bn=bn,
        arrivals=arrivals,
        recv_rows=recv_rows.astype(np.int64),
        local_rows=local_rows,
        finalize_base=finalize_base.astype(np.int32),
        num_pairs=int(routed[me].sum()),
    )


def wave_order(num_remote: int, num_local: int, grid: int, num_comm: int) -> np.ndarray:
    """Static schedule: positions of the remote tiles (first num_remote) and local tiles
    (after them) in the wave-ordered list in which every wave of `grid` tiles holds
    `num_comm` remote and `grid - num_comm` local tiles while both last, then whatever is
    left. Returns the permutation (indices into remote ++ local)."""
    if num_remote == 0 or num_local == 0 or grid < 2:
        return np.arange(num_remote + num_local)
    kc = min(max(num_comm, 1), grid - 1)
    i = np.arange(num_remote)
    j = np.arange(num_local)
    pos = np.concatenate([(i // kc) * grid + i % kc,
                          (j // (grid - kc)) * grid + kc + j % (grid - kc)])
    return np.argsort(pos, kind="stable")


def contribution_rows(meta: GatherRSMetadata, layout: DirectLayout) -> torch.Tensor:
    """int64 [T, E, TP]: the receive-buffer row holding token t's expert-e output from TP rank
    tp, -1 where t is not routed to e; `_index_kernel` compacts it to [T, top-k * TP] (a
    torch twin for tests and debugging).

    Raises:
        ValueError: `meta` has no routing map.
    """
    if meta.routing_map is None:
        raise ValueError("meta.routing_map is missing (build_metadata(..., routing_map=...))")
    rmap = meta.routing_map.cpu()
    cum = torch.cumsum(rmap, dim=0)
    base = torch.from_numpy(layout.finalize_base.astype(np.int64))  # [TP, E]
    rows = base.t()[None, :, :] + cum[:, :, None]
    return torch.where(rmap[:, :, None], rows, torch.full_like(rows, -1))


# Every per-call launch goes through a FastLauncher (compiled kernels reused without the
# JIT's per-call argument binding; megatron_overlap.kernels.launch).
_prepare = FastLauncher(k._prepare_kernel)
_index = FastLauncher(k._index_kernel)
_gemm_scatter = FastLauncher(k._gemm_scatter_kernel)
_finalize = FastLauncher(k._finalize_kernel)

_RESOURCES: dict = {}
"""(dtype, F, H, TileConfig, `gemm_index_key`) -> KernelResources of the compiled
`_gemm_scatter_kernel`."""

_PLACEHOLDER_INDEX = (1, 1, 16)
"""(TP, K, EP2) of a GEMM2 kernel that builds no finalize index (`gemm_index_key`)."""


def gemm_index_key(tp_size: int, topk: Optional[int], num_experts: int) -> tuple:
    """(TP, K, EP2): the finalize index's constexprs in the GEMM2 kernel, part of its
    specialisation: TP partials, top-k slots (K = top-k, or E when unknown, at most E),
    experts rounded up to a power of two (>= 16); `_PLACEHOLDER_INDEX` where EP2 exceeds
    `FOLD_MAX_EP2` (the index runs alone there)."""
    key = _index_constants(tp_size, topk, num_experts)
    return key if key[2] <= FOLD_MAX_EP2 else _PLACEHOLDER_INDEX


@functools.lru_cache(maxsize=256)
def _index_constants(tp_size: int, topk: Optional[int], num_experts: int) -> tuple:
    """(TP, K, EP2) of the finalize index (`gemm_index_key` without the placeholder)."""
    return (tp_size, max(1, min(int(topk or num_experts), num_experts)),
            max(16, _pow2(num_experts)))


def compiled_resources(dtype: torch.dtype, ffn: int, hidden: int,
                       tile: Optional[TileConfig] = None,
                       index: Optional[tuple] = None) -> Optional[KernelResources]:
    """Registers, shared memory and threads of the GEMM2 + scatter kernel compiled for this
    shape (the resource manager's occupancy input), or None before its first GPU launch in
    this process. `tile`: None for `DEFAULT_TILE` (the register epilogue's); `index`:
    `gemm_index_key` of the call (None: any; the first recorded for this shape)."""
    if index is not None:
        return _RESOURCES.get((dtype, ffn, hidden, tile or DEFAULT_TILE, index))
    want = (dtype, ffn, hidden, tile or DEFAULT_TILE)
    for key, res in _RESOURCES.items():
        if key[:4] == want:
            return res
    return None


def call_resources(dtype: torch.dtype, ffn: int, hidden: int, tp_size: int,
                   topk: Optional[int], num_experts: int,
                   tile: Optional[TileConfig] = None) -> Optional[KernelResources]:
    """`compiled_resources` of the GEMM2 kernel as a call of this TP size, top-k and expert
    count launches it (`gemm_index_key`): the plan's occupancy input. `tile`: as
    `compiled_resources`."""
    return compiled_resources(dtype, ffn, hidden, tile,
                              index=gemm_index_key(tp_size, topk, num_experts))


def _record_resources(key, handle) -> None:
    if key not in _RESOURCES:
        try:
            _RESOURCES[key] = kernel_resources_from_compiled(handle)
        except ValueError:  # the interpreter returns no compiled kernel
            pass


def _ensure_allocator() -> None:
    """Device-side TMA descriptors (`tl.make_tensor_descriptor`) need Triton's scratch
    allocator; it takes memory from PyTorch's caching allocator (`_host.triton_scratch`:
    one buffer per device and stream). Set at every launch: Triton keeps it per thread (a
    context variable), and a launch from another thread would find none."""
    triton.set_allocator(triton_scratch)


class _StagingSlot:
    """Per-call buffers that a workspace keeps for reuse (CUDA; both modes): a pinned host
    buffer of the call's tables in three parts (targets; the direct call's finalize bases
    or the pre-reduced call's send table and index bases; segments or tiles) with the event
    of its last upload, their device copy with its views, and the device scratch (a direct
    call's finalize index, block counts and tile list, `scratch_parts`; a pre-reduced call's
    tile list, block counts and rowy).
    Saves a pinned and two device allocations, and the views, per call on the host's
    critical path.

    A slot serves one `_Call` at a time, from its construction until it is garbage
    collected (a caller may finalize again, or time `gemm_only`, long after the run). It is
    reused only when that call is gone, the upload from its host buffer is done, every
    launch that read its buffers on another stream than the workspace's is done (`fence`;
    no host wait: a slot still in use is skipped), and the current stream is the
    workspace's stream (every other device use of the old call's buffers is then ordered
    before the new call's); otherwise `acquire` returns None and the call fills a slot of its
    own (`fit`, as off CUDA), which the workspace does not keep. The buffers are allocated
    outside inference mode, so that a slot filled under `torch.inference_mode()` can be
    refilled outside it.
    """

    __slots__ = ("busy", "event", "fences", "host", "dev", "host_np", "host_view", "dev_view",
                 "views", "tables", "scratch", "_parts")
    RING = 4
    """Slots per workspace."""

    def __init__(self) -> None:
        self.busy = False
        self.event = None
        self.fences: list = []
        self.host = self.dev = self.host_np = self.host_view = self.dev_view = None
        self.views = self.tables = self.scratch = self._parts = None

    def _free(self) -> bool:
        if self.busy or (self.event is not None and not self.event.query()):
            return False
        if any(not e.query() for e in self.fences):
            return False
        self.fences.clear()
        return True

    @classmethod
    def acquire(cls, ws: GatherRSWorkspace, tables: tuple, scratch_size: int, stream=None):
        """A free slot of `ws` with room for `tables` (int32 sizes of its three parts, see
        the class docstring) and `scratch_size` int32 of scratch, marked busy; or None.
        `stream`: the current stream of ws.device, if the caller has it."""
        ring = ws.staging_slots
        if ws.stream is None:
            return None  # the first call
        if stream is None:
            stream = current_stream(ws.device)
        if stream != ws.stream:
            return None  # another stream than the workspace's
        for slot in ring:
            if slot._free():
                break
        else:
            if len(ring) >= cls.RING:
                return None
            slot = cls()
            ring.append(slot)
        slot.fit(ws.device, tables, scratch_size)  # may raise (allocation): not busy then
        slot.busy = True
        return slot

    @classmethod
    def take(cls, ws: GatherRSWorkspace, device, tables: tuple, scratch_size: int,
             stream=None):
        """(slot, kept): a free slot of the workspace (`acquire`, CUDA only; kept=True: the
        call must release it, `_Call.__del__`), else a slot of the call's own, fitted
        (kept=False). `stream`: device's current stream, if the caller has it."""
        slot = (cls.acquire(ws, tables, scratch_size, stream)
                if torch.device(device).type == "cuda" else None)
        if slot is not None:
            return slot, True
        slot = cls()
        slot.fit(device, tables, scratch_size)
        return slot, False

    def fit(self, device, tables: tuple, scratch_size: int) -> None:
        """Room for `tables` and `scratch_size` int32 of scratch (reallocated only when too
        small; the host buffer pinned on a CUDA device), with views for these tables."""
        need = sum(tables)
        if self.host is None or self.host.numel() < need:
            size = need + need // 8  # headroom: the host tile list's length varies
            with torch.inference_mode(False):  # (views of these are normal tensors too)
                self.host = torch.empty(size, dtype=torch.int32,
                                        pin_memory=torch.device(device).type == "cuda")
                self.dev = torch.empty(size, dtype=torch.int32, device=device)
            self.tables = None
        if self.tables != tables:
            r2, n_base, _ = tables
            self.host_view, self.dev_view = self.host[:need], self.dev[:need]
            self.host_np = self.host_view.numpy()
            self.views = (self.dev[:r2].view(torch.int64), self.dev[r2: r2 + n_base],
                          self.dev[r2 + n_base: need].view(-1, k.TILE_FIELDS))
            self.tables = tables
        self.fit_scratch(device, scratch_size)

    def fit_scratch(self, device, scratch_size: int) -> None:
        """Room for `scratch_size` int32 of device scratch (reallocated only when too
        small, with 1/8 headroom)."""
        if self.scratch is None or self.scratch.numel() < scratch_size:
            with torch.inference_mode(False):
                self.scratch = torch.empty(max(scratch_size, 1) * 9 // 8 + 1024,
                                           dtype=torch.int32, device=device)
            self._parts = None

    def scratch_parts(self, n_index: int, n_counts: int, index_shape: tuple):
        """(index [index_shape], block counts [n_counts], the rest): views of the scratch in
        that order, the block counts at n_index (index_shape's size rounded up to a multiple
        of 4) and the rest at n_index + `_align4(n_counts)`, so every part starts 16-byte
        aligned. Remembered while the scratch and these sizes stay (a prefill's calls share
        them; the part whose size follows the routing, the tile list, comes last and
        open-ended)."""
        key = (n_index, n_counts, index_shape)
        if self._parts is None or self._parts[0] != key:
            rest = n_index + _align4(n_counts)
            scratch = self.scratch
            self._parts = (key, scratch[: index_shape[0] * index_shape[1]].view(index_shape),
                           scratch[n_index: n_index + n_counts], scratch[rest:])
        return self._parts[1:]

    def copy_in(self, device, stream=None) -> None:
        """Upload the tables (asynchronous, on `device`'s current stream, which the caller
        may pass as `stream`) and record the event there; off CUDA, a plain copy."""
        if torch.device(device).type != "cuda":
            self.dev_view.copy_(self.host_view)
            return
        if stream is None:
            stream = current_stream(device)
        # normal tensors (made outside inference mode): in place in either mode
        self.dev_view.copy_(self.host_view, non_blocking=True)
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(stream)

    def fence(self, stream) -> None:
        """A launch just read this slot's buffers on `stream`, which is not the workspace's:
        the slot is reused only after that stream gets past this point."""
        event = torch.cuda.Event()
        event.record(stream)
        self.fences.append(event)


class _Call:
    """One call, prepared then run.

    Construction does the host work and needs only the metadata: the tables, the arrival
    targets, one asynchronous H2D copy (into a reused `_StagingSlot` where one is free) and
    the tile list, on the current stream; the GEMM2 kernel builds the finalize index after
    its tiles (up to `FOLD_MAX_EP2` experts, else `_index_kernel` runs before the finalize).
    The Megatron layer prepares the call right after it enqueues FC1, so this host
    work overlaps FC1 on the GPU. `send` launches the GEMM2 + scatter kernel and
    `finish` the finalize; `run` does both. A prepared call must be run: its arrival
    targets are already counted.

    Args:
        meta: routing metadata with the routing map (`build_metadata(..., routing_map=...)`).
        ws: this group's `GatherRSWorkspace` (`symm.get_workspace`).
        plan: the resource manager's plan (grid, CTAs taking remote-bound tiles first).
        hidden: H; dtype, device: of the operands.
        timeout_s: bound of every spin-wait.
        tile: tile configuration (default: `default_tile(device, meta.group_size)`).
    """

    MODE = "direct"
    """The combine mode, in `Plan.mode`'s names ("direct" here, "prereduce" for
    `PreReducedCall`); also names the kernels a call launches (the first call of each mode
    and specialisation lines the ranks up after compiling)."""

    _index_parts = None
    """The finalize index's operands (routing map, block counts, bases, index, token blocks,
    tokens, experts), for the GEMM2 kernel or `_index_kernel` alone; None: no index."""
    _fold = False
    """Whether the GEMM2 kernel builds the finalize index (`FOLD_MAX_EP2`)."""
    _indexed = False

    def _init_common(self, meta, ws, plan, hidden, dtype, device, timeout_s, tile) -> None:
        """The fields every mode sets first (see the class docstring for the arguments)."""
        ws.check_errors(block=False)  # a previous call's timeout surfaces here
        self.ws, self.meta, self.plan = ws, meta, plan
        self.device = torch.device(device)
        self.gpu = self.device.type == "cuda"
        self.dtype, self.hidden = dtype, hidden
        self.tile = tile or default_tile(self.device, meta.group_size)
        self.rank = meta.ep_rank * meta.tp_size + meta.tp_rank
        self.grid = max(1, plan.num_ctas or 1)
        self.num_comm = int(plan.num_comm_ctas)
        # GPU: nanoseconds of the global timer; interpreter: polls (1000 per second asked).
        self.timeout = int(timeout_s * 1e9) if self.gpu else max(10, int(timeout_s * 1000))
        if meta.routing_map is None:
            raise ValueError("the Triton backend needs meta.routing_map "
                             "(build_metadata(..., routing_map=...))")
        # The finalize index's constexprs (`_index_block`): TP partials, top-k slots,
        # experts rounded up to a power of two, tokens per block, counts per load; and
        # those every GEMM2 launch of the call passes (`gemm_index_key`: the same where the
        # GEMM2 builds the index, placeholders where it cannot).
        num_experts = meta.routing_map.shape[1]
        tp, kk, ep2 = _index_constants(meta.tp_size, meta.topk, num_experts)
        self._index_meta = dict(TP=tp, K=kk, EP2=ep2, BT=INDEX_BLOCK_TOKENS if self.gpu else 16,
                                CB=32, num_warps=8 if ep2 >= 256 else 4)
        self._gemm_index = gemm_index_key(meta.tp_size, meta.topk, num_experts)

    def __init__(self, meta: GatherRSMetadata, ws: GatherRSWorkspace, plan: Plan, *,
                 hidden: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
                 tile: Optional[TileConfig] = None) -> None:
        self._init_common(meta, ws, plan, hidden, dtype, device, timeout_s, tile)
        device = self.device
        tile_list = tile_list_source()
        num_experts = meta.routing_map.shape[1]
        im = self._index_meta
        kmax, bt, ep2, warps = im["K"], im["BT"], im["EP2"], im["num_warps"]
        nb = -(-meta.num_tokens // bt)  # token blocks of the finalize index
        # Device scratch: the index, the per-block token counts, the tile list, each part
        # starting 16-byte aligned (`_align4`, `_StagingSlot.scratch_parts`).
        n_counts = nb * num_experts
        index_shape = (meta.num_tokens, kmax * meta.tp_size)
        n_index = _align4(index_shape[0] * index_shape[1])
        stream = current_stream(device) if self.gpu else None
        head = n_index + _align4(n_counts)  # the scratch before the device tile list
        if (tile_list == "device" and _layout_cpp is not None
                and meta.routed_counts is not None and host_tables_mode() == "fused"):
            slot = self._fused_tables(meta, ws, stream, head)
        else:
            slot = self._step_tables(meta, ws, stream, tile_list, head)
        num_tiles = self.num_remote + self.num_local
        tile_list, waves, kc = self._tile_list, self._waves, self._kc
        # (every path: the index and block counts; the device tile list after them)
        slot.fit_scratch(device, head + (0 if tile_list == "host" else
                                         num_tiles * k.TILE_FIELDS))
        rmap = meta.routing_map.view(torch.uint8)
        with span("mo.h2d"):
            slot.copy_in(device, stream)
            self.targets, self.finalize_base, table = slot.views
            self._table = table  # the segments (or the host tile list) as uploaded
        with span("mo.prepare_kernels"):
            self.index, block_counts, tiles = slot.scratch_parts(n_index, n_counts, index_shape)
            # the tile list the kernels read (device: the open-ended rest of the scratch)
            self._tiles_arg = table if tile_list == "host" else tiles
            tile_blocks = 0 if tile_list == "host" else _cdiv(num_tiles, TILE_LIST_BLOCK)
            if tile_blocks + nb:
                # Tile list and block counts (independent) in one launch; the GEMM2 builds
                # the index from the counts.
                segs = self._num_segments
                _prepare(
                    (tile_blocks + nb,), table, self._tiles_arg, segs, self.num_remote,
                    self.num_local, self.grid, kc, self._col_blocks, max(1, segs.bit_length()),
                    tile_blocks, rmap, block_counts, meta.num_tokens, num_experts,
                    BM=self.tile.bm, BN=self.tile.bn, WAVES=waves, BLOCK=TILE_LIST_BLOCK,
                    EP2=ep2, BT=bt, num_warps=warps)
            # The finalize index: built by the GEMM2 kernel's CTAs after their tiles (no
            # launch of its own) up to FOLD_MAX_EP2 experts; `launch_index` launches
            # `_index_kernel` alone above that, and where the GEMM2 has not run.
            self._index_parts = (rmap, block_counts, self.finalize_base, self.index, nb,
                                 meta.num_tokens, num_experts)
            self._fold = ep2 <= FOLD_MAX_EP2  # else `launch_index` runs `_index_kernel` alone
        # Claim counters of the dynamic schedule (zeroed at each launch); the static one
        # reads none.
        self.counters = (None if self.tile.static
                         else torch.empty(2, dtype=torch.int32, device=device))
        # [T, H], allocated by the first finalize: by then a caller that let go of h (`send`'s
        # keep_operands) has freed h, whose memory the output can take.
        self.out = None
        self.local = None
        self.h = self.w2 = None
        self.sent = False
        self._finalized = False

    def _take_epoch(self, ws: GatherRSWorkspace, recv_rows: int) -> None:
        """Room for `recv_rows` rows in the receive buffer, then this call's epoch (every
        mode, once per call, before its arrival targets are taken)."""
        ws.ensure_capacity(recv_rows)
        self.epoch = ws.next_epoch()
        # A remote destination's buffer is free for this call once its finalize of every
        # earlier call on the workspace has run.
        self.freed_target = self.epoch - 1

    def _wave_plan(self, tile_list: str) -> str:
        """Sets `_waves` and `_kc` (the static schedule's wave order: each wave of `grid`
        entries holds kc remote-bound tiles, `wave_order`) from the tile counts; returns the
        tile list's source, "host" where the kernel's int32 wave positions would overflow."""
        self._waves = waves = (self.tile.static and self.num_remote > 0 and self.num_local > 0
                               and self.grid >= 2)
        self._kc = min(max(self.num_comm, 1), self.grid - 1) if waves else 1
        if waves and (self.num_remote + self.num_local) * self.grid >= 2**31:
            return "host"  # the kernel's wave positions are int32 products
        return tile_list

    def _fused_tables(self, meta: GatherRSMetadata, ws: GatherRSWorkspace, stream,
                      scratch_head: int):
        """The host tables of the device tile list, written by one C++ call
        (`_layout.direct_tables`) into a staging slot's pinned buffer (taken with room for
        `scratch_head` int32 of scratch: the index and block counts; the caller fits the
        tile list after them); takes the call's epoch and arrival targets. Returns the slot.
        Falls back to `_step_tables` where the wave positions overflow int32 (the host tile
        list then), before anything of the workspace is taken."""
        group, num_experts = meta.group_size, meta.routed_counts.shape[1]
        n_seg = group * meta.num_local_experts
        tables = (2 * group, meta.tp_size * num_experts, n_seg * k.SEGMENT_FIELDS)
        with span("mo.direct_layout"):
            slot, kept = _StagingSlot.take(ws, self.device, tables, scratch_head, stream)
            self._slot = slot if kept else None
            nxt = ws.spare_arrivals()
            (self.num_remote, self.num_local, self._col_blocks, self._local_rows, self.split,
             recv_max, self.num_rows, _) = _layout_cpp.direct_tables(
                meta.routed_counts, meta.tp_size, meta.ep_size, meta.tp_rank, meta.ep_rank,
                self.hidden, self.tile.bm, self.tile.bn, ws.expected_arrivals, nxt,
                slot.host_np)
            self._num_segments = n_seg
            self._layout = None  # `layout` computes it where asked
            self._tile_list = self._wave_plan("device")
        if self._tile_list == "host":
            # Nothing of the workspace taken yet: this slot goes back (unused), the tables
            # are built for the host tile list.
            slot.busy, self._slot = False, None
            return self._step_tables(meta, ws, stream, "host", scratch_head)
        self._take_epoch(ws, recv_max)
        ws.take_arrivals(nxt)  # the totals written as this call's targets
        return slot

    def _step_tables(self, meta: GatherRSMetadata, ws: GatherRSWorkspace, stream,
                     tile_list: str, scratch_head: int):
        """The host tables step by step (`direct_layout`'s arrays, then numpy copies into a
        staging slot's pinned buffer; every tile on the host with the host tile list); takes
        the call's epoch and arrival targets. Returns the slot."""
        with span("mo.direct_layout"):
            lay = self._layout = direct_layout(meta, self.hidden, self.tile.bm, self.tile.bn)
            self.num_remote, self.num_local = lay.num_remote, lay.num_local
            self.num_rows = int(lay.segments[:, 2].sum()) if len(lay.segments) else 0
            self._col_blocks, self._local_rows = lay.col_blocks, lay.local_rows
            self._num_segments = len(lay.segments)
            # The finalize reads rows from `split` on from the local buffer (`send`
            # allocates it: this rank's own rows, which stay out of the symmetric receive
            # buffer).
            self.split = int(lay.recv_rows[self.rank])
            tile_list = self._tile_list = self._wave_plan(tile_list)
            if tile_list == "host":
                table = expand_tiles(lay)
                if self._waves:
                    table = table[wave_order(self.num_remote, self.num_local, self.grid,
                                             self._kc)]
            else:
                table = lay.segments
        self._take_epoch(ws, int(lay.recv_rows.max(initial=0)))
        targets = ws.add_expected_arrivals(lay.arrivals)
        r2, n_base = 2 * meta.group_size, lay.finalize_base.size
        tables = (r2, n_base, table.size)
        with span("mo.h2d"):
            # One pinned buffer: targets (int64 as int32 pairs), finalize bases, and the
            # segments (or, with the host tile list, the tiles); the buffers of a free
            # staging slot of the workspace when there is one (`_StagingSlot`), else a slot
            # of this call's own, not kept by the workspace.
            slot, kept = _StagingSlot.take(ws, self.device, tables, scratch_head, stream)
            self._slot = slot if kept else None
            buf = slot.host_np
            buf[:r2] = targets.astype(np.int64).view(np.int32)
            buf[r2: r2 + n_base] = lay.finalize_base.reshape(-1)
            buf[r2 + n_base:] = table.reshape(-1)
        return slot

    @property
    def layout(self) -> DirectLayout:
        """The call's `DirectLayout` (computed here where the fused C++ path filled the
        tables without one)."""
        if self._layout is None:
            self._layout = direct_layout(self.meta, self.hidden, self.tile.bm, self.tile.bn)
        return self._layout

    @layout.setter
    def layout(self, value: DirectLayout) -> None:
        self._layout, self._local_rows = value, value.local_rows

    @property
    def tiles(self) -> torch.Tensor:
        """int32 [num_remote + num_local, TILE_FIELDS]: the call's tile list in the order the
        GEMM2 kernel takes it (a view of what the kernels read)."""
        t = self._tiles_arg
        if t.dim() == 2:
            return t
        return t[: (self.num_remote + self.num_local) * k.TILE_FIELDS].view(-1, k.TILE_FIELDS)

    @tiles.setter
    def tiles(self, value: torch.Tensor) -> None:
        self._tiles_arg = value

    def __del__(self) -> None:
        slot = self.__dict__.get("_slot")
        if slot is not None:
            slot.busy = False

    def _fence_slot(self, stream=None) -> None:
        """After a launch that reads this call's buffers: where it ran on another stream than
        the workspace's, the staging slot is not reused before that stream gets there.
        `stream`: the current stream, if the caller has it."""
        slot = self.__dict__.get("_slot")
        if slot is not None:
            if stream is None:
                stream = current_stream(self.device)
            if stream != self.ws.stream:
                slot.fence(stream)

    def run(self, h: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """`send` then `finish`; returns [T, H]."""
        self.send(h, w2)
        return self.finish()

    def send(self, h: torch.Tensor, w2: torch.Tensor, keep_operands: bool = True) -> None:
        """Launch the GEMM2 + scatter kernel on h [N, F] and w2 [L, H, F].

        keep_operands: False drops the call's references to h and w2 once the GEMM2 is
            queued, so that h's memory is free for the finalize's output as soon as the
            caller lets go of it too (the Megatron layer does: it needs h no more). h must
            then have been allocated on the current stream (the caching allocator reuses
            its memory only for work queued after the GEMM2 there); `gemm_only` is then not
            available.

        Raises:
            RuntimeError: called twice; sent out of prepare order or on another stream than
                the workspace's earlier calls (`GatherRSWorkspace.start_send`).
            ValueError: h / w2 are not [N, F] / [L, H, F] tensors with the prepared rows N,
                local experts L, hidden size H, dtype and device (the workspace is unusable
                afterwards: this call's epoch is taken on every rank).
        """
        if self.sent:
            raise RuntimeError("this prepared gemm2_gatherrs call was already run")
        if (not isinstance(h, torch.Tensor) or not isinstance(w2, torch.Tensor)
                or h.dim() != 2 or w2.dim() != 3 or h.shape[0] != self.num_rows
                or w2.shape[0] != self.meta.num_local_experts or w2.shape[1] != self.hidden
                or w2.shape[2] != h.shape[1] or h.dtype != self.dtype or w2.dtype != h.dtype
                or h.device != self.device):
            self.ws.poison(f"call {self.epoch} was prepared but not run (bad operands)")
            shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                      for t in (h, w2)]
            raise ValueError(
                f"call prepared for h [{self.num_rows}, F] and w2 "
                f"[{self.meta.num_local_experts}, {self.hidden}, F], {self.dtype} on "
                f"{self.device}; got h {shapes[0]} {getattr(h, 'dtype', '')} on "
                f"{getattr(h, 'device', '')}, w2 {shapes[1]} {getattr(w2, 'dtype', '')}")
        self.ws.start_send(self.epoch,
                           current_stream(self.device) if self.gpu else None)
        self.h, self.w2 = h.contiguous(), w2.contiguous()
        self._alloc_local()
        row_bytes = self.h.shape[1] * self.h.element_size()
        self.use_tma = self.gpu and row_bytes % 16 == 0 and all(
            t.data_ptr() % 16 == 0 for t in (self.h, self.w2))
        with span("mo.send"):
            self._launch(self._tiles_arg, self.grid, self.num_remote, self.num_local,
                         index=self._fold)
        self.sent = True
        if self._fold:
            self._indexed = True  # built by the GEMM2's CTAs
        ws = self.ws
        key = (self.MODE, self.dtype, self.hidden, self.h.shape[1], self.use_tma, self.tile,
               self._gemm_index)
        if self.gpu and key not in ws.compiled:
            # First call of this specialisation: line the ranks up after their JIT
            # compilation, so that no rank's finalize waits out another's compile (a
            # finalize index launched alone, if any, is compiled here too).
            self.launch_index()
            torch.cuda.current_stream(self.device).synchronize()
            if ws.group is not None:
                dist.barrier(group=ws.group)
            ws.compiled.add(key)
        if not keep_operands:
            self.h = self.w2 = None

    def _alloc_local(self) -> None:
        """The call's local buffer: [local_rows, H] (at least one row), this rank's GEMM2
        rows for its own tokens, which the finalize reads (rows >= `split`). Allocated when
        the call is sent, on the current stream, and freed with the call: it is transient
        memory like Megatron's FC2 output, where the symmetric receive buffer is held for
        the whole run."""
        self.local = torch.empty(max(1, self._local_rows), self.hidden, dtype=self.dtype,
                                 device=self.device)

    def gemm_only(self, grid: Optional[int] = None) -> None:
        """The GEMM2 tiles alone, every tile stored into a scratch buffer of this rank and no
        signal sent (communication off): the benchmark's producer timing. Only after
        `finish` (uses this call's tables and operands); does not touch the epochs. The
        tile list with every destination set to this rank is copied once, at the first
        call (before v6.0 every call copied it: two small kernels inside the timing)."""
        if not self.sent:
            raise RuntimeError("gemm_only needs a call that was run")
        if self.h is None:
            raise RuntimeError("gemm_only needs the operands: send(..., keep_operands=True)")
        tiles = self.__dict__.get("_gemm_only_tiles")
        if tiles is None:  # built once, so that a timed gemm_only launches the GEMM2 alone
            tiles = self.tiles.clone()
            self._fence_slot()
            tiles[:, 4] = self.rank
            self._gemm_only_tiles = tiles
        # Into a scratch buffer, not the receive buffer (peers may already store the next
        # call's rows there: they wait only for this rank's finalize) nor the local one (the
        # call's output reads it): every tile is this rank's now, stored at its row in its
        # destination's buffer, so the scratch has the rows of the larger of the two.
        if getattr(self, "_scratch", None) is None:
            rows = max(self.ws.capacity_rows, self._local_rows, 1)
            self._scratch = torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device)
        self._launch(tiles, grid or self.grid, num_remote=0,
                     num_local=self.num_remote + self.num_local, local=self._scratch,
                     index=False)

    def _launch(self, tiles, grid: int, num_remote: int, num_local: int,
                local: Optional[torch.Tensor] = None, index: bool = False) -> None:
        """`_gemm_scatter_kernel` over `tiles`, this rank's own rows into `local` (default:
        the call's local buffer); with `index`, its CTAs also build the
        finalize index (`_index_parts`); without, the index arguments are placeholders of the
        same dtypes (0 token blocks), so both take one compiled kernel wherever the pointers'
        16-byte alignment agrees (the bases' alignment follows the group size: with one
        rank, `gemm_only` compiles a variant of its own)."""
        ws, h, w2, t = self.ws, self.h, self.w2, self.tile
        if self.gpu:
            _ensure_allocator()
        if not t.static:
            self.counters.zero_()
        if index:
            rmap, counts, base, out, blocks, tokens, experts = self._index_parts
        else:
            rmap, counts, base, out = self.meta.routing_map.view(torch.uint8), tiles, tiles, tiles
            blocks = tokens = experts = 0
        tp, kk, ep2 = self._gemm_index
        im = self._index_meta
        with own_launch():  # its global scratch may come from the kept buffer (`_host`)
            handle = _gemm_scatter(
                (grid,), h, w2, tiles, num_remote, num_local,
                tiles if t.static else self.counters, ws.peer_recv_ptrs,
                self.local if local is None else local, ws.peer_signal_ptrs, ws.signals,
                self.rank, ws.num_ranks, self.num_comm, self.freed_target, self.timeout,
                ws.error, max(1, h.shape[0]), h.shape[1], self.hidden, w2.shape[0],
                h.stride(0), w2.stride(0), w2.stride(1), rmap, counts, base, out, blocks,
                tokens, experts,
                BM=t.bm, BN=t.bn, BK=t.bk, USE_TMA=self.use_tma, STATIC=t.static,
                USE_TIMER=self.gpu, TP=tp, K=kk, EP2=ep2, IBT=im["BT"], CB=im["CB"],
                TMA_STORE=epilogue_stores_tma(t, self.hidden, h.element_size()),
                ROTATE=t.rotate,
                num_warps=t.num_warps, num_stages=t.num_stages,
            )
        if self.gpu:
            _record_resources((self.dtype, h.shape[1], self.hidden, t, self._gemm_index),
                              handle)

    def launch_index(self) -> None:
        """Launch the finalize index alone (`_index_kernel`, into `index`) on the current
        stream, once per call, unless the GEMM2 kernel built it already (`send`);
        `finalize` calls it first."""
        if self._indexed:
            return
        if self._index_parts is not None and self._index_parts[4]:
            rmap, counts, base, out, blocks, tokens, experts = self._index_parts
            _index((blocks,), rmap, counts, base, out, tokens, experts, **self._index_meta)
        self._indexed = True  # after: a launch that raised is tried again

    def finalize(self) -> None:
        """`_finalize_kernel` on the current stream (waits for the arrivals), after the
        finalize index (built by the GEMM2, else `launch_index`).

        The first finalize of the call also tells every other rank that this rank's buffer
        is free (its finalize count goes up by one per call, which the producers' waits
        count on); running it again (the benchmark times the summing alone that way) only
        sums again."""
        ws, meta = self.ws, self.meta
        self.launch_index()
        bt, bh = FINALIZE_BLOCK if self.gpu else (8, 16)
        grid = (max(1, -(-meta.num_tokens // bt)), -(-self.hidden // bh))
        if self.out is None:
            self.out = torch.empty(meta.num_tokens, self.hidden, dtype=self.dtype,
                                   device=self.device)
        signal_free = not self._finalized
        last_done = ws.add_finalize_ctas(grid[0] * grid[1]) - 1 if signal_free else 0
        _finalize(
            grid, ws.recv, ws.recv if self.local is None else self.local, self.split,
            self.index, self.out, ws.signals, ws.peer_signal_ptrs, self.targets,
            ws.finalize_done, last_done, meta.num_tokens, self.hidden, ws.num_ranks, self.rank,
            self.timeout, ws.error, C=self.index.shape[1], BT=bt, BH=bh, USE_TIMER=self.gpu,
            SIGNAL_FREE=signal_free, num_warps=4,
        )
        self._stream = current_stream(self.device) if self.gpu else None
        self._fence_slot(self._stream)
        if self.gpu and self.local is not None and self._stream != ws.stream:
            # Read here on another stream than the one it was allocated on: the caching
            # allocator must not hand it out again before this finalize is done.
            self.local.record_stream(self._stream)
        self._finalized = True

    def finish(self, sync_errors: bool = False) -> torch.Tensor:
        """Finalize; returns [T, H]. The error record is checked now (`sync_errors`, and
        always off the GPU) or at the next call on the workspace."""
        if not self.sent:
            raise RuntimeError("_Call.finish before send")
        with span("mo.finalize"):
            self.finalize()
            self.ws.record_error_check(self._stream)
        if sync_errors or not self.gpu:
            self.ws.check_errors(block=True)
        return self.out

