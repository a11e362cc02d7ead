"""Triton kernels of the tile-signaled GEMM2 + GatherRS operation (DESIGN.md §1, §3), v4.

The main kernels, launched by `megatron_overlap.ops.triton_gemm2_gatherrs` (the preparation
kernels further down, and the pre-reduced mode's `_reduce_send_kernel`, described at the
end):

* `_gemm_scatter_kernel` (persistent): GEMM2 tiles y[r0:r1, n0:n0+BN] =
  h[r0:r1] @ w2[l, n0:n0+BN]^T of every local expert l (bf16/fp16 in, fp32 accumulation,
  TMA tensor-descriptor loads when rows are 16-byte aligned). The epilogue stores the tile
  straight to where the rank its rows belong to sums them: into the call's local buffer for
  this rank's own tokens, over NVLink into another rank's receive buffer (peer stores
  through symmetric memory) for its tokens. A tile's rows are one (local expert, source
  chunk) run, and the destination keeps each sender's rows in the same order, so a tile
  lands as one contiguous block of rows.
  The SM partition: CTAs 0..k-1 (k = the plan's communication CTAs) take the remote-bound
  tiles first, the others the local tiles first, so NVLink traffic is spread over the GEMM
  instead of bunched at its start; either side takes the other's tiles when its own run out.
  Two ways to hand out tiles (`STATIC`): a host-built list in which every wave of G tiles
  holds k remote and G - k local ones, CTA p taking tiles p, p + G, ... (no atomics; the
  default); or two atomic claim counters (dynamic: a slow CTA cannot delay others; each CTA
  claims its next tile before computing the current one, hiding the atomic's latency).
  Variants (v5.2, `TileConfig` fields): TMA_STORE (the default tile's at world 1 since v5.9;
  opt-in at world > 1, where it has run only emulated on one GPU), the epilogue
  stores through a TMA descriptor of the tile's rows (asynchronous: Triton's pipeliner
  waits for it only before the next tile's epilogue; a full wait and a proxy fence precede
  each signal), and ROTATE, the static list's waves rotated over the CTAs.
  Signals: a CTA counts the remote tiles it stored per destination and, when it moves on to
  another destination or runs out of work, adds that count to its arrival counter at the
  destination (release, system scope), after a CTA barrier (every thread's peer stores are
  issued before the count). One system-scope atomic per CTA and destination per call.
  Before its first tile for a remote destination a CTA waits (acquire, system scope) until
  that destination's finalize count (on this rank) shows the previous call's rows read: one
  receive buffer serves every call (`megatron_overlap.symm`).
* `_finalize_kernel`: waits until every other rank's arrival counter reaches this call's
  target (acquire, system scope; targets are cumulative over calls, counters are never
  reset), then sums each token's rows (its top-k experts' outputs, times TP partials) in a
  fixed order (expert ascending, then TP rank) into the output: deterministic. Rows below
  `split` (the rows other ranks sent) are read from the receive buffer, the others from the
  call's local buffer. The rows of each token come from the finalize index (`_index_block`:
  row = base[tp, e] + rank of the token among expert e's tokens, from the routing map's
  per-block token counts, counted by `_block_count_block` when the call is prepared, and an
  in-block prefix sum), which the GEMM2 kernel's CTAs build after their tiles. The
  finalize's last CTA adds 1 to this rank's finalize count on every other rank (release,
  system scope): the buffer is free for the next call.

In the default (direct) layout no pre-reduction happens before the rows travel: every
(token, expert) row is stored once,
where it is summed (the design brief's gather-then-send needs y written, re-read and
written again; measured in docs/perf_notes.md, v3). This trades NVLink bytes (up to
min(top-k, L) times more) for HBM bytes and a whole pass.

Every spin-wait is bounded by `timeout_ns` (GPU global timer; a poll count in the
interpreter). On expiry the kernel writes a record into the error buffer (the first one of
a call wins) and stops waiting: the finalize skips its sum, the producer stores and signals
nothing more for that destination (its rows may still be read there); the launcher raises.
Error record (int64[4]): code, the rank waited for, value seen, value expected. Codes:
1 the destination's buffer never became free (`ERR_PRODUCER_WAIT`), 2 arrivals missing
(`ERR_FINALIZE_WAIT`), 3 the destination's buffer never became free for a pre-reduced send
(`ERR_SEND_WAIT`).

Pre-reduced mode (`_reduce_send_kernel`; `megatron_overlap.ops.triton_prereduce`): the
producer stores every tile into a local buffer y (h's row order, no signals); then, per
destination, each token's rows here (its experts on this rank's EP group) are summed and
travel as one row; the destination's finalize sums one row per source rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

ERR_PRODUCER_WAIT = 1
ERR_FINALIZE_WAIT = 2
ERR_SEND_WAIT = 3

_ERR_PRODUCER_WAIT = tl.constexpr(ERR_PRODUCER_WAIT)
_ERR_FINALIZE_WAIT = tl.constexpr(ERR_FINALIZE_WAIT)
_ERR_SEND_WAIT = tl.constexpr(ERR_SEND_WAIT)

TILE_FIELDS = 6
"""int32 fields of one tile entry: local expert, first row, end row (in h), first column,
destination group rank, first row in the destination's receive buffer."""

SEGMENT_FIELDS = 6
"""int32 fields of one segment (the rows of one local expert for one destination): local
expert, first row in h, rows, destination group rank, first row in the destination's
receive buffer, first tile (exclusive prefix of the segments' tiles in list order)."""


@triton.jit
def _now_ns(USE_TIMER: tl.constexpr):
    """Nanoseconds of the GPU global timer (0 in the interpreter)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        t = tl.full((), 0, tl.int64)
    return t


@triton.jit
def _wait_at_least(ptr, target, timeout_ns, SCOPE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Spin until *ptr >= target (acquire) or the timeout; returns the last value seen."""
    start = _now_ns(USE_TIMER)
    value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    spins = 0
    while (value < target) & (spins >= 0):
        value = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
        if USE_TIMER:
            if _now_ns(USE_TIMER) - start > timeout_ns:
                spins = -1
        else:
            if spins > timeout_ns:  # interpreter: timeout_ns counts polls
                spins = -1
    return value


@triton.jit
def _record_error(err_ptr, code, rank, seen, expected):
    """Write the error record (code, the rank waited for, value seen, value expected) unless
    an earlier error holds it: the first error of a call is the one reported."""
    zero = tl.zeros((), tl.int64)
    if tl.atomic_cas(err_ptr, zero, zero + code) == 0:
        tl.store(err_ptr + 1, zero + rank)
        tl.store(err_ptr + 2, zero + seen)
        tl.store(err_ptr + 3, zero + expected)


@triton.jit
def _signal(peer_sig_ptrs, dest, my_rank, count):
    """Add `count` arrivals from this rank to `dest`'s counter (after every thread's stores)."""
    tl.debug_barrier()
    sig = tl.load(peer_sig_ptrs + dest).to(tl.pointer_type(tl.int64))
    tl.atomic_add(sig + my_rank, count.to(tl.int64), sem="release", scope="sys")


@triton.jit
def _bulk_store_wait(READ_ONLY: tl.constexpr):
    """Wait until this thread's TMA (bulk tensor) stores are done: READ_ONLY, until they
    have read their shared-memory source and descriptor (`cp.async.bulk.wait_group.read`);
    otherwise until their writes are performed, then a proxy fence, so that a release by
    this CTA after a barrier orders them (the arrival signals). Every thread runs it; only
    the one that issued the stores has any to wait for. GPU only (inline PTX)."""
    if READ_ONLY:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group.read 0;\n\tmov.u32 $0, 0;", "=r",
                                  [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
            "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _proxy_fence():
    """`fence.proxy.async.global` in every thread: this thread's generic-proxy accesses
    before it (the acquire of a destination's free count) are ordered before its TMA
    (async-proxy) stores after it. GPU only (inline PTX)."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile(h_ptr, w2_ptr, a_desc, b_desc, tile_ptr, dest, store_ok, peer_recv_ptrs, local_ptr,
          my_rank, F, H, stride_h, stride_wl, stride_wn,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
          TMA_STORE: tl.constexpr, USE_TIMER: tl.constexpr):
    """One GEMM2 tile, stored at its destination `dest` (unless `store_ok` is 0): another
    rank's receive buffer (`peer_recv_ptrs[dest]`), or for this rank's own rows the call's
    local buffer `local_ptr`.

    With TMA the A block may run past r1 into the next expert's rows and the B block past H
    into the next expert's weight: those rows / columns of the result are never stored.

    TMA_STORE: the epilogue stores through a TMA descriptor made for this tile (its rows'
    block at the destination, [r1 - r0, H]: the copy engine clips the rows and columns past
    it), so the store runs on while the CTA computes its next tile (Triton's pipeliner waits
    for it before the next tile's epilogue reuses its shared memory). Needs H x element size
    a multiple of 16 bytes (the launcher checks) and 16-byte-aligned destination buffers
    (every buffer the launcher passes starts an allocation).
    Otherwise stores from registers, masked. USE_TIMER: on the GPU (where the waits' inline
    PTX runs; the interpreter has no asynchronous stores to wait for).
    """
    expert = tl.load(tile_ptr + 0)
    r0 = tl.load(tile_ptr + 1)
    r1 = tl.load(tile_ptr + 2)
    # n0 is a multiple of BN, and every receive buffer is 16-byte aligned (H is specialised
    # on its divisibility by 16): telling the compiler so lets the epilogue store 16 bytes
    # per instruction instead of one element.
    n0 = tl.multiple_of(tl.load(tile_ptr + 3), BN)
    dest_row = tl.load(tile_ptr + 5)
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, F, BK):
            a = a_desc.load([r0, k0])
            b = b_desc.load([expert * H + n0, k0])
            acc = tl.dot(a, b.T, acc)
    else:
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + (r0 + rows)[:, None].to(tl.int64) * stride_h + ks[None, :]
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_wl
                  + cols[None, :].to(tl.int64) * stride_wn + ks[:, None])
        for k0 in range(0, F, BK):
            a = tl.load(a_ptrs, mask=(r0 + rows[:, None] < r1) & (ks[None, :] + k0 < F),
                        other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] + k0 < F) & (cols[None, :] < H), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
    # (The hint goes on each branch's pointer: on the if's result, an scf.if value, Triton
    # 3.6's axis analysis drops it and the register epilogue stores one element per
    # instruction: 128 st.global.b16 per thread and 256 x 128 tile instead of 16
    # st.global.v4.b32, from v5.0 to v6.3; `launch/compile_sm90.py` counts them.)
    if dest == my_rank:
        dst = tl.multiple_of(local_ptr, 16)
    else:
        dst = tl.multiple_of(
            tl.load(peer_recv_ptrs + dest).to(tl.pointer_type(h_ptr.dtype.element_ty)), 16)
    r_end = tl.where(store_ok != 0, r1, r0)  # no row stored unless store_ok
    if TMA_STORE:
        if USE_TIMER:
            # Before the descriptor is rewritten, the stores that read an earlier one have
            # read it. (Triton 3.6 already alternates two descriptor slots and waits for
            # their reads itself; this keeps the guarantee where a version does not.)
            _bulk_store_wait(True)
            tl.debug_barrier()
        out_desc = tl.make_tensor_descriptor(dst + dest_row.to(tl.int64) * H,
                                             shape=[tl.maximum(r_end - r0, 1), H],
                                             strides=[H, 1], block_shape=[BM, BN])
        if r_end > r0:
            out_desc.store([0, n0], acc.to(h_ptr.dtype.element_ty))
    else:
        out_rows = (dest_row + rows).to(tl.int64)
        tl.store(dst + out_rows[:, None] * H + cols[None, :], acc.to(h_ptr.dtype.element_ty),
                 mask=(r0 + rows[:, None] < r_end) & (cols[None, :] < H))


@triton.jit
def _run_tile(h_ptr, w2_ptr, a_desc, b_desc, tile_ptr, peer_recv_ptrs, local_ptr, peer_sig_ptrs,
              sig_ptr, my_rank, num_ranks, freed_target, timeout_ns, err_ptr, pend_dest, pend,
              free_dest, free_ok, F, H, stride_h, stride_wl, stride_wn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
              TMA_STORE: tl.constexpr, USE_TIMER: tl.constexpr):
    """One tile of a CTA's loop, with the CTA's signal state; returns the new state.

    State: `pend` remote tiles stored for `pend_dest` and not yet signalled (signalled when
    the CTA moves on to another destination, or at its end); `free_dest`, the last remote
    destination whose receive buffer this CTA found free (its finalize count, at
    sig[num_ranks + dest], reached `freed_target`), and `free_ok` (0: the wait timed out;
    that destination's tiles are neither stored nor signalled, and the error is recorded).
    """
    dest = tl.load(tile_ptr + 4)
    remote = dest != my_rank
    if remote:
        if dest != free_dest:
            seen = _wait_at_least(sig_ptr + num_ranks + dest, freed_target, timeout_ns, "sys",
                                  USE_TIMER)
            free_ok = (seen >= freed_target).to(tl.int32)
            if free_ok == 0:
                _record_error(err_ptr, _ERR_PRODUCER_WAIT, dest, seen, freed_target)
            free_dest = dest
            if TMA_STORE and USE_TIMER:
                _proxy_fence()  # the buffer's old rows were read before the TMA stores
    store_ok = tl.where(remote, free_ok, 1)
    if TMA_STORE and USE_TIMER:
        # Moving on to another destination: signal the previous one's tiles before this
        # tile's store is issued, so the wait for their writes does not wait for it too.
        if remote & (store_ok != 0) & (dest != pend_dest) & (pend > 0):
            _bulk_store_wait(False)  # the counted tiles' rows are written
            _signal(peer_sig_ptrs, pend_dest, my_rank, pend)
            pend = 0
    _tile(h_ptr, w2_ptr, a_desc, b_desc, tile_ptr, dest, store_ok, peer_recv_ptrs, local_ptr,
          my_rank, F, H, stride_h, stride_wl, stride_wn, BM, BN, BK, USE_TMA, TMA_STORE,
          USE_TIMER)
    if remote & (store_ok != 0):
        if dest != pend_dest:
            if not (TMA_STORE and USE_TIMER):  # (else signalled above)
                if pend > 0:
                    _signal(peer_sig_ptrs, pend_dest, my_rank, pend)
            pend_dest = dest
            pend = 0
        pend += 1
    return pend_dest, pend, free_dest, free_ok


# Sizes that change every call are not specialised on (one compiled variant per model
# shape); the strides, F and H are (16-divisibility makes the loads vectorise and the K loop
# software-pipeline).
@triton.jit(do_not_specialize=["num_remote", "num_local", "my_rank", "num_ranks", "num_comm",
                               "N", "freed_target", "timeout_ns", "index_blocks", "num_tokens",
                               "num_experts"])
def _gemm_scatter_kernel(
    h_ptr, w2_ptr, tiles_ptr, num_remote, num_local, counters_ptr, peer_recv_ptrs, local_ptr,
    peer_sig_ptrs, sig_ptr, my_rank, num_ranks, num_comm, freed_target, timeout_ns, err_ptr,
    N, F, H, L, stride_h, stride_wl, stride_wn,
    rmap_ptr, counts_ptr, base_ptr, index_ptr, index_blocks, num_tokens, num_experts,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr,
    STATIC: tl.constexpr, USE_TIMER: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
    EP2: tl.constexpr, IBT: tl.constexpr, CB: tl.constexpr, TMA_STORE: tl.constexpr,
    ROTATE: tl.constexpr,
):
    """Run this CTA's share of the GEMM2 tiles, then its share of the finalize index; see
    the module docstring.

    tiles: int32 [num_remote + num_local, TILE_FIELDS]. STATIC: one list in wave order
    (CTA p takes p, p + G, ...; with ROTATE, in wave w the position w * G + (p + w *
    num_comm) mod G, so the wave's remote-bound positions, its first ones, fall to other
    CTAs each wave instead of always to CTAs 0..k-1: every CTA computes local tiles while
    its remote stores drain, which an asynchronous epilogue (TMA_STORE) can use; each wave
    is still taken whole, by its G CTAs). Dynamic: the remote-bound tiles, then the local
    ones, each claimed through its counter (counters int32 [2], zero before the launch).
    sig: this rank's int64 [2 * num_ranks] counters (arrivals, then every rank's finalize
    count); a remote destination's tiles are stored once its finalize count reached
    freed_target.

    After its tiles and its last signal, CTA p builds the finalize index's token blocks p,
    p + G, ... < index_blocks (`_index_block` with rmap, counts, base, index, num_tokens,
    num_experts, TP, K, EP2, IBT, CB; 0 blocks: none): one launch less on the host's
    critical path than a kernel of its own, and the work fills the CTAs that finish their
    tiles early. The finalize (the next launch on the stream) reads the index.
    """
    a_desc = None
    b_desc = None
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(h_ptr, shape=[N, F], strides=[stride_h, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(w2_ptr, shape=[L * H, F], strides=[stride_wn, 1],
                                           block_shape=[BN, BK])
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    pend_dest = my_rank  # remote tiles stored but not yet signalled: destination, count
    pend = 0
    free_dest = my_rank  # the last remote destination found free, and whether it was
    free_ok = 1
    if STATIC and ROTATE:
        num_tiles = num_remote + num_local
        for w in range(0, tl.cdiv(num_tiles, grid)):
            t = w * grid + (pid + w * num_comm) % grid
            if t < num_tiles:
                pend_dest, pend, free_dest, free_ok = _run_tile(
                    h_ptr, w2_ptr, a_desc, b_desc, tiles_ptr + t * 6, peer_recv_ptrs,
                    local_ptr, peer_sig_ptrs, sig_ptr, my_rank, num_ranks, freed_target,
                    timeout_ns, err_ptr, pend_dest, pend, free_dest, free_ok, F, H, stride_h,
                    stride_wl, stride_wn, BM, BN, BK, USE_TMA, TMA_STORE, USE_TIMER)
    elif STATIC:
        for t in range(pid, num_remote + num_local, grid):
            pend_dest, pend, free_dest, free_ok = _run_tile(
                h_ptr, w2_ptr, a_desc, b_desc, tiles_ptr + t * 6, peer_recv_ptrs, local_ptr,
                peer_sig_ptrs, sig_ptr, my_rank, num_ranks, freed_target, timeout_ns, err_ptr,
                pend_dest, pend, free_dest, free_ok, F, H, stride_h, stride_wl, stride_wn,
                BM, BN, BK, USE_TMA, TMA_STORE, USE_TIMER)
    else:
        for phase in range(2):
            take_remote = (pid < num_comm) == (phase == 0)
            first = tl.where(take_remote, 0, num_remote)
            count = tl.where(take_remote, num_remote, num_local)
            claim = counters_ptr + tl.where(take_remote, 0, 1)
            t = tl.atomic_add(claim, 1, sem="relaxed", scope="gpu")
            while t < count:
                # Claim the next tile now: the atomic's latency hides behind this tile.
                t_next = tl.atomic_add(claim, 1, sem="relaxed", scope="gpu")
                pend_dest, pend, free_dest, free_ok = _run_tile(
                    h_ptr, w2_ptr, a_desc, b_desc, tiles_ptr + (first + t) * 6,
                    peer_recv_ptrs, local_ptr, peer_sig_ptrs, sig_ptr, my_rank, num_ranks,
                    freed_target, timeout_ns, err_ptr, pend_dest, pend, free_dest, free_ok, F,
                    H, stride_h, stride_wl, stride_wn, BM, BN, BK, USE_TMA, TMA_STORE,
                    USE_TIMER)
                t = t_next
    if pend > 0:
        if TMA_STORE and USE_TIMER:
            _bulk_store_wait(False)  # the counted tiles' rows are written
        _signal(peer_sig_ptrs, pend_dest, my_rank, pend)
    for b in range(pid, index_blocks, grid):
        _index_block(b, rmap_ptr, counts_ptr, base_ptr, index_ptr, num_tokens, num_experts,
                     TP, K, EP2, IBT, CB)


@triton.jit
def _tile_list_block(b, seg_ptr, tiles_ptr, num_segments, num_remote, num_local, grid,
                     num_comm, col_blocks, search_steps, BM: tl.constexpr, BN: tl.constexpr,
                     WAVES: tl.constexpr, BLOCK: tl.constexpr):
    """Expand segments into the tile list `_gemm_scatter_kernel` reads: entries
    [b * BLOCK, (b + 1) * BLOCK).

    seg: int32 [S, SEGMENT_FIELDS], remote segments first (their tiles are the first
    num_remote); tiles: int32 [num_remote + num_local, TILE_FIELDS]. Tile i belongs to the
    last segment whose first tile is <= i (binary search, `search_steps` >= ceil(log2(S))
    steps); within it, row block q // col_blocks and column block q % col_blocks. With WAVES
    the entries are stored in the wave order of `wave_order` (each wave of `grid` entries
    holds num_comm remote and grid - num_comm local tiles while both last; closed form of
    the merged positions, 0 < num_comm < grid; int32, so the launcher keeps
    (num_remote + num_local) * grid < 2^31), else in list order.
    """
    i = b * BLOCK + tl.arange(0, BLOCK)
    ok = i < num_remote + num_local
    lo = tl.zeros((BLOCK,), tl.int32)
    hi = tl.zeros((BLOCK,), tl.int32) + num_segments
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        live = (hi - lo) > 1
        first = tl.load(seg_ptr + mid * 6 + 5, mask=ok & live, other=0)
        lo = tl.where(live & (first <= i), mid, lo)
        hi = tl.where(live & (first > i), mid, hi)
    seg = seg_ptr + lo * 6
    expert = tl.load(seg + 0, mask=ok, other=0)
    row0 = tl.load(seg + 1, mask=ok, other=0)
    rows = tl.load(seg + 2, mask=ok, other=0)
    dest = tl.load(seg + 3, mask=ok, other=0)
    dest_row0 = tl.load(seg + 4, mask=ok, other=0)
    q = i - tl.load(seg + 5, mask=ok, other=0)
    blk = q // col_blocks
    r0 = row0 + blk * BM
    if WAVES:
        j = i - num_remote
        local = i >= num_remote
        pos_remote = i + tl.minimum(num_local, (i // num_comm) * (grid - num_comm))
        pos_local = j + tl.minimum(num_remote, (j // (grid - num_comm) + 1) * num_comm)
        pos = tl.where(local, pos_local, pos_remote)
    else:
        pos = i
    out = tiles_ptr + pos.to(tl.int64) * 6
    tl.store(out + 0, expert, mask=ok)
    tl.store(out + 1, r0, mask=ok)
    tl.store(out + 2, tl.minimum(r0 + BM, row0 + rows), mask=ok)
    tl.store(out + 3, (q - blk * col_blocks) * BN, mask=ok)
    tl.store(out + 4, dest, mask=ok)
    tl.store(out + 5, dest_row0 + blk * BM, mask=ok)


@triton.jit
def _block_count_block(b, rmap_ptr, counts_ptr, num_tokens, num_experts, EP2: tl.constexpr,
                       BT: tl.constexpr):
    """counts[b, e] = tokens t in [b * BT, (b + 1) * BT) routed to expert e.

    rmap: uint8 [T, E] routing map; counts: int32 [ceil(T / BT), E]. The first half of the
    routing map's prefix sum over tokens (`_index_block` adds the rest): a column scan as
    one torch.cumsum over [T, E] runs one thread per expert down all T tokens (0.72 ms at
    T = 4096, E = 128 on H200; docs/perf_notes.md).
    """
    tokens = b * BT + tl.arange(0, BT)
    experts = tl.arange(0, EP2)
    e_ok = experts < num_experts
    m = (tokens < num_tokens)[:, None] & e_ok[None, :]
    sel = tl.load(rmap_ptr + tokens.to(tl.int64)[:, None] * num_experts + experts[None, :],
                  mask=m, other=0) != 0
    tl.store(counts_ptr + b * num_experts + experts, tl.sum(sel.to(tl.int32), axis=0),
             mask=e_ok)


@triton.jit(do_not_specialize=["num_segments", "num_remote", "num_local", "grid",
                               "num_comm", "col_blocks", "search_steps", "tile_blocks",
                               "num_tokens", "num_experts"])
def _prepare_kernel(seg_ptr, tiles_ptr, num_segments, num_remote, num_local, grid, num_comm,
                    col_blocks, search_steps, tile_blocks, rmap_ptr, counts_ptr, num_tokens,
                    num_experts, BM: tl.constexpr, BN: tl.constexpr, WAVES: tl.constexpr,
                    BLOCK: tl.constexpr, EP2: tl.constexpr, BT: tl.constexpr):
    """The call's two independent preparation steps in one launch (one launch less on the
    host's critical path): CTAs [0, tile_blocks) expand the tile list
    (`_tile_list_block`), the others count the routing map's tokens per block
    (`_block_count_block`, block pid - tile_blocks)."""
    pid = tl.program_id(0)
    if pid < tile_blocks:
        _tile_list_block(pid, seg_ptr, tiles_ptr, num_segments, num_remote, num_local, grid,
                         num_comm, col_blocks, search_steps, BM, BN, WAVES, BLOCK)
    else:
        _block_count_block(pid - tile_blocks, rmap_ptr, counts_ptr, num_tokens, num_experts,
                           EP2, BT)


@triton.jit
def _index_block(b, rmap_ptr, counts_ptr, base_ptr, index_ptr, num_tokens, num_experts,
                 TP: tl.constexpr, K: tl.constexpr, EP2: tl.constexpr, BT: tl.constexpr,
                 CB: tl.constexpr):
    """Token block b of the finalize index: index[t, j * TP + tp] = base[tp, e_j] +
    cum[t, e_j] for token t's j-th expert e_j (ascending), -1 past its last one; cum[t, e] =
    tokens <= t routed to e (cum - 1 is t's rank among expert e's tokens).

    rmap: uint8 [T, E] routing map; counts: int32 [ceil(T / BT), E] per token block
    (`_block_count_block`, same BT); base: int32 [TP, E]; index: int32 [T, K * TP]. Block b
    gets cum as the sum of the counts of blocks < b (CB blocks per load) plus an in-block
    scan. Needs only the routing map and the counts (`_gemm_scatter_kernel` runs it after
    its tiles, `_index_kernel` alone).
    """
    tokens = b * BT + tl.arange(0, BT)
    experts = tl.arange(0, EP2)
    t_ok = tokens < num_tokens
    e_ok = experts < num_experts
    at = tokens.to(tl.int64)[:, None] * num_experts + experts[None, :]
    sel = tl.load(rmap_ptr + at, mask=t_ok[:, None] & e_ok[None, :], other=0) != 0
    prefix = tl.zeros((EP2,), tl.int32)
    blocks = tl.arange(0, CB)
    for c0 in range(0, b, CB):
        rows = c0 + blocks
        prefix += tl.sum(tl.load(counts_ptr + rows[:, None] * num_experts + experts[None, :],
                                 mask=(rows < b)[:, None] & e_ok[None, :], other=0), axis=0)
    cum = tl.cumsum(sel.to(tl.int32), axis=0) + prefix[None, :]
    prev = tl.full((BT,), -1, tl.int32)
    for j in tl.static_range(K):
        cand = sel & (experts[None, :] > prev[:, None])
        e_j = tl.min(tl.where(cand, experts[None, :], EP2), axis=1)  # EP2: none left
        found = e_j < EP2
        rank = tl.sum(tl.where(experts[None, :] == e_j[:, None], cum, 0), axis=1)
        for tp in tl.static_range(TP):
            base = tl.load(base_ptr + tp * num_experts + e_j, mask=found, other=0)
            tl.store(index_ptr + tokens.to(tl.int64) * (K * TP) + j * TP + tp,
                     tl.where(found, base + rank, -1), mask=t_ok)
        prev = tl.where(found, e_j, EP2)


@triton.jit(do_not_specialize=["num_tokens", "num_experts"])
def _index_kernel(rmap_ptr, counts_ptr, base_ptr, index_ptr, num_tokens, num_experts,
                  TP: tl.constexpr, K: tl.constexpr, EP2: tl.constexpr, BT: tl.constexpr,
                  CB: tl.constexpr):
    """The finalize index alone, one token block per CTA (`_index_block`): the pre-reduced
    mode's per-destination indices, and a direct call's index before its GEMM2 ran."""
    _index_block(tl.program_id(0), rmap_ptr, counts_ptr, base_ptr, index_ptr, num_tokens,
                 num_experts, TP, K, EP2, BT, CB)


@triton.jit(do_not_specialize=["num_tokens", "num_ranks", "my_rank", "timeout_ns",
                               "last_done", "split"])
def _finalize_kernel(
    recv_ptr, local_ptr, split, index_ptr, out_ptr, sig_ptr, peer_sig_ptrs, targets_ptr,
    done_ptr, last_done, num_tokens, H, num_ranks, my_rank, timeout_ns, err_ptr,
    C: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, USE_TIMER: tl.constexpr,
    SIGNAL_FREE: tl.constexpr,
):
    """out[t] = sum over c < C of row index[t, c] (fp32 sum, fixed order), then "receive
    buffer free" to every other rank. Row i is recv[i] below `split`, else local[i - split]
    (the call's local buffer: this rank's rows for its own tokens).

    index: int32 [T, C] (`_index_block`; -1: none); targets: int64 [R], the arrival count
    each other rank must have reached first (sig[s], s < num_ranks). done: this rank's int64
    counter of finished finalize CTAs, over all calls; the CTA that brings it to
    last_done + 1 is the call's last: it adds 1 to this rank's finalize count on every
    other rank (sig[num_ranks + my_rank] there; release, system scope), after which the
    senders may store the next call's rows. Without SIGNAL_FREE (a repeated finalize of a
    call) neither happens: the count must rise exactly once per call.
    """
    num_bad = 0
    for s in range(num_ranks):
        if s != my_rank:
            target = tl.load(targets_ptr + s)
            seen = _wait_at_least(sig_ptr + s, target, timeout_ns, "sys", USE_TIMER)
            if seen < target:
                if num_bad == 0:  # the first missing sender is the one reported
                    _record_error(err_ptr, _ERR_FINALIZE_WAIT, s, seen, target)
                num_bad += 1
    if num_bad == 0:
        tokens = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        t_ok = tokens < num_tokens
        c_ok = cols < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for c in tl.static_range(C):
            rows = tl.load(index_ptr + tokens.to(tl.int64) * C + c, mask=t_ok, other=-1)
            # Each row's first element from a per-row select of the two buffers, then one
            # load: as fast as one buffer (launch/bench_finalize.py; two masked loads, one
            # per buffer, took 1.7x as long at 16 rows per token: 202 registers against 142).
            local = rows >= split
            base = tl.where(local, local_ptr + (rows - split).to(tl.int64) * H,
                            recv_ptr + rows.to(tl.int64) * H)
            v = tl.load(base[:, None] + cols[None, :],
                        mask=(rows[:, None] >= 0) & c_ok[None, :], other=0.0)
            acc += v.to(tl.float32)
        tl.store(out_ptr + tokens[:, None].to(tl.int64) * H + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
    if SIGNAL_FREE:
        # Every thread's loads of the receive buffer have returned before the count (the
        # loaded values were stored above); acq_rel orders them before the last CTA's signal.
        tl.debug_barrier()
        if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == last_done:
            for g in range(num_ranks):
                if g != my_rank:
                    peer = tl.load(peer_sig_ptrs + g).to(tl.pointer_type(tl.int64))
                    tl.atomic_add(peer + num_ranks + my_rank, 1, sem="release", scope="sys")


@triton.jit(do_not_specialize=["my_rank", "num_ranks", "num_rows", "freed_target",
                               "timeout_ns"])
def _reduce_send_kernel(y_ptr, rowy_ptr, table_ptr, peer_recv_ptrs, peer_sig_ptrs, sig_ptr,
                        my_rank, num_ranks, num_rows, H, freed_target, timeout_ns, err_ptr,
                        K: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                        USE_TIMER: tl.constexpr):
    """Pre-reduced send of one call to every destination, one launch: for destination d,
    recv_d[my_rank * T_d + t] = sum over j < K of y[rowy_d[t, j]] (fp32 sum in j order,
    stored in y's dtype) for each of d's T_d tokens t with rowy_d[t, 0] >= 0 (a token with
    no expert here is not stored; d's finalize skips that slot).

    y: [num_rows, H] this rank's GEMM2 rows (h order); rowy: int32 [sum_d T_d, K], every
    destination's rows of its tokens here (experts ascending, -1 past the last; rows outside
    y are not read), destinations in group-rank order. table: int32 [4R + 1]: the send
    order of the destinations (remote ones first, this rank last), the first CTA of each
    (R + 1 prefix entries, in send order), then by group rank T_d and d's first row in rowy.
    Grid: every destination's token blocks of BT, in send order (so the NVLink-bound
    remote blocks start first and the local ones fill the SMs behind them); each CTA walks
    the hidden columns BH at a time. For a remote d every CTA first waits (acquire, system
    scope, bounded) until d's finalize count sig[num_ranks + d] reaches freed_target (its
    buffer is free), then stores over NVLink and adds 1 to its arrival counter at d (release,
    system scope): d expects one arrival per CTA. On a timeout the CTA records
    `ERR_SEND_WAIT` and neither stores nor signals (d's finalize then times out too); once
    any error is recorded the CTAs still to come skip their wait, so a dead destination
    costs one timeout, not one per wave.
    """
    pid = tl.program_id(0)
    sel = 0
    for i in range(1, num_ranks):
        if pid >= tl.load(table_ptr + num_ranks + i):
            sel = i
    dest = tl.load(table_ptr + sel)
    block = pid - tl.load(table_ptr + num_ranks + sel)
    num_tokens = tl.load(table_ptr + 2 * num_ranks + 1 + dest)
    row0 = tl.load(table_ptr + 3 * num_ranks + 1 + dest).to(tl.int64)
    ok = tl.full((), 1, tl.int32)
    remote = dest != my_rank
    if remote & (tl.load(err_ptr, volatile=True) != 0):
        ok = tl.full((), 0, tl.int32)
    elif remote:
        seen = _wait_at_least(sig_ptr + num_ranks + dest, freed_target, timeout_ns, "sys",
                              USE_TIMER)
        if seen < freed_target:
            _record_error(err_ptr, _ERR_SEND_WAIT, dest, seen, freed_target)
            ok = tl.full((), 0, tl.int32)
    tokens = block * BT + tl.arange(0, BT)
    t_ok = tokens < num_tokens
    at = (row0 + tokens.to(tl.int64)) * K
    first = tl.load(rowy_ptr + at, mask=t_ok, other=-1)
    keep = (tl.where(ok != 0, first, -1) >= 0) & t_ok
    # 16-byte-aligned receive buffers (symmetric allocations): the hint makes the peer
    # stores 16 bytes wide instead of one element each
    dst = tl.multiple_of(
        tl.load(peer_recv_ptrs + dest).to(tl.pointer_type(y_ptr.dtype.element_ty)), 16)
    out_rows = (my_rank * num_tokens + tokens).to(tl.int64)
    for c0 in range(0, H, BH):
        cols = c0 + tl.arange(0, BH)
        c_ok = cols < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for j in tl.static_range(K):
            rows = tl.load(rowy_ptr + at + j, mask=t_ok, other=-1)
            v = tl.load(y_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                        mask=((rows >= 0) & (rows < num_rows))[:, None] & c_ok[None, :],
                        other=0.0)
            acc += v.to(tl.float32)
        tl.store(dst + out_rows[:, None] * H + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=keep[:, None] & c_ok[None, :])
    if remote & (ok != 0):
        _signal(peer_sig_ptrs, dest, my_rank, ok)  # ok == 1: one arrival
