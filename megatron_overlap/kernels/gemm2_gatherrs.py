"""Triton kernels of the tile-signaled GEMM2 + GatherRS operation (DESIGN.md §1, §3).

Two kernels, launched by `megatron_overlap.ops.triton_gemm2_gatherrs`:

* `_fused_kernel` (persistent, one CTA per SM): every CTA claims work entries in the
  schedule's order from one atomic counter (dynamic scheduling: a CTA that is not resident is
  never needed for progress). Two kinds of entries:
  - GEMM2 tiles: y[r0:r1, n0:n0+BN] = h[r0:r1] @ w2[l, n0:n0+BN]^T for one local expert
    (TMA tensor-descriptor loads on the GPU), stored, then counted in their segment's
    counter (release, gpu scope). A *segment* is (destination rank, column split).
  - gather items (the communication role): wait (acquire) until the segment's tiles are all
    counted, sum the rows of each slot (the token's local top-k contributions, loaded all at
    once) in fp32, store the pre-reduced rows straight into the destination's receive buffer
    (peer stores through symmetric memory); the segment's last finished item adds 1 to the
    destination's arrival counter for this sender (release, system scope).
  The schedule puts remote segments first and each segment's gather items a few segments
  after its tiles, so sending overlaps the GEMM of later segments, and the local segment's
  gather at the end runs on every CTA. At most `max_comm` CTAs hold gather items at a time
  (a counting semaphore): the SM partition between computation and communication, chosen
  per launch by the resource manager.
* `_finalize_kernel` (after it): waits until every sender's arrival counter reaches this
  call's target (acquire, system scope), then sums each token's partial rows in sender
  (group-rank) order into the output. Deterministic.

This replaces the design brief's separate consumer kernel on a fixed SM partition: measured
on 2x H200 (Mixtral / Qwen3 shapes), 16 consumer CTAs gathering with dependent loads left a
1-13 ms tail after the GEMM; here the tail's gather runs on all CTAs.

Every spin-wait is bounded by `timeout_ns` (GPU global timer; an iteration bound in the
interpreter). On expiry a kernel writes a record into its error buffer and stops waiting;
the launcher raises. A segment with a failed item is signalled with `ERROR_BIT`, so the
receiving rank fails too instead of summing garbage.

Error record (int64[4]): code, segment or sender, observed value, expected value.
Codes: 1 GEMM tiles of a segment not done (gather item), 2 arrivals missing (finalize),
3 a sender reported an error (finalize), 4 no communication slot freed up (gather item).
"""

from __future__ import annotations

import triton
import triton.language as tl

ERROR_BIT = 1 << 30
"""Added to an arrival counter by a sender whose consumer failed."""

ERR_TILES_WAIT = 1
ERR_FINALIZE_WAIT = 2
ERR_SENDER_FAILED = 3
ERR_COMM_SLOT = 4

# The same values as kernel constants (jit'ed code only reads constexpr globals).
_ERROR_BIT = tl.constexpr(ERROR_BIT)
_ERR_TILES_WAIT = tl.constexpr(ERR_TILES_WAIT)
_ERR_FINALIZE_WAIT = tl.constexpr(ERR_FINALIZE_WAIT)
_ERR_SENDER_FAILED = tl.constexpr(ERR_SENDER_FAILED)
_ERR_COMM_SLOT = tl.constexpr(ERR_COMM_SLOT)


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
def _record_error(err_ptr, code, where, seen, expected):
    tl.store(err_ptr + 0, code)
    tl.store(err_ptr + 1, where)
    tl.store(err_ptr + 2, seen.to(tl.int64))
    tl.store(err_ptr + 3, expected.to(tl.int64))


@triton.jit
def _gemm_tile(h_ptr, w2_ptr, y_ptr, a_desc, b_desc, expert, r0, r1, n0, F, H, stride_h,
               stride_wl, stride_wn, stride_y,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_TMA: tl.constexpr):
    """y[r0:r1, n0:n0+BN] = h[r0:r1] @ w2[expert, n0:n0+BN]^T (fp32 accumulation).

    With TMA the A block may run past r1 into the next expert's rows and the B block past H
    into the next expert's weight: those rows/columns of the result are never stored.
    """
    rows = r0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, F, BK):
            a = a_desc.load([r0, k0])
            b = b_desc.load([expert * H + n0, k0])
            acc = tl.dot(a, b.T, acc)
    else:
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_wl
                  + cols[None, :].to(tl.int64) * stride_wn + ks[:, None])
        for k0 in range(0, F, BK):
            a = tl.load(a_ptrs, mask=(rows[:, None] < r1) & (ks[None, :] + k0 < F), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] + k0 < F) & (cols[None, :] < H), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < r1) & (cols[None, :] < H))


@triton.jit
def _gather_item(y_ptr, gather_ptr, dst, seg_done_ptr, err_ptr, seg, lo, hi, expected, s0,
                 dest_row, c0, width, recv_row_base, H, stride_y, timeout_ns,
                 K: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                 USE_TIMER: tl.constexpr):
    """Wait for the segment's tiles, then pre-reduce slots [lo, hi) and store them at the
    destination. Returns 1 if the wait timed out (nothing stored), else 0."""
    seen = _wait_at_least(seg_done_ptr + seg, expected, timeout_ns, "gpu", USE_TIMER)
    failed = (seen < expected).to(tl.int32)
    if failed != 0:
        _record_error(err_ptr, _ERR_TILES_WAIT, seg, seen, expected)
    else:
        ks = tl.arange(0, KP)
        cols_in = tl.arange(0, BN)
        for sb in range(lo, hi, BS):
            local = sb + tl.arange(0, BS)
            valid = local < hi
            slots = (s0 + local).to(tl.int64)
            idx = tl.load(gather_ptr + slots[:, None] * K + ks[None, :],
                          mask=valid[:, None] & (ks[None, :] < K), other=-1)
            out_rows = (recv_row_base + dest_row + local).to(tl.int64)
            for cb in range(0, width, BN):
                cols = c0 + cb + cols_in
                col_ok = (cols < c0 + width) & (cols < H)
                v = tl.load(y_ptr + idx[:, :, None] * stride_y + cols[None, None, :],
                            mask=(idx[:, :, None] >= 0) & col_ok[None, None, :], other=0.0)
                acc = tl.sum(v.to(tl.float32), axis=1)
                tl.store(dst + out_rows[:, None] * H + cols[None, :],
                         acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
    return failed


# Sizes that change every call are not specialised on (one compiled variant per model
# shape); the strides, F and H are (16-divisibility makes the loads vectorise and the K loop
# software-pipeline: 96 KB of shared memory at 3 stages instead of 32 KB without).
@triton.jit(do_not_specialize=["num_entries", "my_rank", "recv_row_base", "max_comm",
                               "timeout_ns"])
def _fused_kernel(
    h_ptr, w2_ptr, y_ptr, entries_ptr, num_entries, counters_ptr, num_segs,
    gather_ptr, segs_ptr, items_ptr, peer_recv_ptrs, peer_sig_ptrs, my_rank, recv_row_base,
    max_comm, N, F, H, L, stride_h, stride_wl, stride_wn, stride_y, timeout_ns, err_ptr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K: tl.constexpr,
    KP: tl.constexpr, BS: tl.constexpr, USE_TMA: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """Claim and run work entries until the queue is empty.

    entries: int32 [num_entries, 5]: a GEMM2 tile (local expert, row start, row end, column
    start, segment), or a gather item (-1, item index, 0, 0, 0).
    items: int32 [num_items, 4] (segment, first slot, end slot, items of the segment).
    segs: int32 [num_segs, 7] (destination rank, column start, expected tiles, first slot,
    slot count, row offset of this sender in the destination's buffer, columns).
    counters: int32 [3 + 2 * num_segs]: entry claim, CTAs in the communication role, unused,
    tiles done per segment, items finished per segment (zeroed before the launch).
    """
    a_desc = None
    b_desc = None
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(h_ptr, shape=[N, F], strides=[stride_h, 1],
                                           block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(w2_ptr, shape=[L * H, F], strides=[stride_wn, 1],
                                           block_shape=[BN, BK])
    seg_done_ptr = counters_ptr + 3
    seg_sent_ptr = counters_ptr + 3 + num_segs
    t = tl.atomic_add(counters_ptr, 1)
    while t < num_entries:
        entry = entries_ptr + t * 5
        expert = tl.load(entry + 0)
        if expert >= 0:
            _gemm_tile(h_ptr, w2_ptr, y_ptr, a_desc, b_desc, expert, tl.load(entry + 1),
                       tl.load(entry + 2), tl.load(entry + 3), F, H, stride_h, stride_wl,
                       stride_wn, stride_y, BM, BN, BK, USE_TMA)
            tl.debug_barrier()  # every thread's stores before the count
            tl.atomic_add(seg_done_ptr + tl.load(entry + 4), 1, sem="release", scope="gpu")
        else:
            item = items_ptr + tl.load(entry + 1) * 4
            seg = tl.load(item + 0)
            seg_items = tl.load(item + 3)
            info = segs_ptr + seg * 7
            dest = tl.load(info + 0)
            # Items for another rank take one of max_comm communication slots (bounded
            # wait); this rank's own items (no NVLink traffic) run on any CTA.
            remote = dest != my_rank
            held = 1
            if remote:
                held = _wait_for_slot(counters_ptr + 1, max_comm, timeout_ns, USE_TIMER)
            failed = 1 - held
            if held == 0:
                _record_error(err_ptr, _ERR_COMM_SLOT, seg, max_comm, max_comm)
            else:
                dst = tl.load(peer_recv_ptrs + dest).to(tl.pointer_type(y_ptr.dtype.element_ty))
                failed = _gather_item(
                    y_ptr, gather_ptr, dst, seg_done_ptr, err_ptr, seg, tl.load(item + 1),
                    tl.load(item + 2), tl.load(info + 2), tl.load(info + 3),
                    tl.load(info + 5), tl.load(info + 1), tl.load(info + 6), recv_row_base, H,
                    stride_y, timeout_ns, K, KP, BS, BN, USE_TIMER)
            tl.debug_barrier()  # every thread's peer stores before the count
            if remote & (held != 0):
                tl.atomic_add(counters_ptr + 1, -1, sem="relaxed", scope="gpu")
            # Low 16 bits count finished items; a failed item also adds 1 << 16, so the
            # segment's last item knows whether any of its items failed. The acq_rel chain
            # carries every item's peer stores to the last one's release.
            inc = 1 + failed * 65536
            before = tl.atomic_add(seg_sent_ptr + seg, inc, sem="acq_rel", scope="sys")
            if (before & 65535) == seg_items - 1:
                sig = tl.load(peer_sig_ptrs + dest).to(tl.pointer_type(tl.int32))
                bump = tl.where(before + inc >= 65536, 1 + _ERROR_BIT, 1)
                tl.atomic_add(sig + my_rank, bump, sem="release", scope="sys")
        t = tl.atomic_add(counters_ptr, 1)


@triton.jit
def _wait_for_slot(active_ptr, max_comm, timeout_ns, USE_TIMER: tl.constexpr):
    """Counting semaphore: 1 once this CTA holds one of `max_comm` slots, 0 on timeout."""
    start = _now_ns(USE_TIMER)
    held = 0
    spins = 0
    while (held == 0) & (spins >= 0):
        before = tl.atomic_add(active_ptr, 1, sem="acquire", scope="gpu")
        if before < max_comm:
            held = 1
        else:
            tl.atomic_add(active_ptr, -1, sem="relaxed", scope="gpu")
            spins += 1
            if USE_TIMER:
                if _now_ns(USE_TIMER) - start > timeout_ns:
                    spins = -1
            else:
                if spins > timeout_ns:
                    spins = -1
    return held


@triton.jit(do_not_specialize=["num_tokens", "num_senders", "target", "timeout_ns"])
def _finalize_kernel(
    recv_ptr, index_ptr, out_ptr, sig_ptr, num_tokens, H, num_senders, target, timeout_ns,
    err_ptr, BT: tl.constexpr, BH: tl.constexpr, USE_TIMER: tl.constexpr,
):
    """out[t] = sum over senders s (group-rank order) of recv[index[t, s]] (fp32 sum).

    index: int32 [T, R], the receive-buffer row holding sender s's partial row of token t
    (parity base included), or -1. Waits first for every sender's arrival counter >= target.
    """
    num_bad = 0
    for s in range(num_senders):
        seen = _wait_at_least(sig_ptr + s, target, timeout_ns, "sys", USE_TIMER)
        code = tl.where(seen >= _ERROR_BIT, _ERR_SENDER_FAILED,
                        tl.where(seen < target, _ERR_FINALIZE_WAIT, 0))
        if code != 0:
            if num_bad == 0:  # the first failing sender is the one reported
                tl.store(err_ptr + 0, code.to(tl.int64))
                tl.store(err_ptr + 1, s)
                tl.store(err_ptr + 2, seen.to(tl.int64))
                tl.store(err_ptr + 3, target)
            num_bad += 1
    if num_bad == 0:
        tokens = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        t_ok = tokens < num_tokens
        c_ok = cols < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for s in range(num_senders):
            rows = tl.load(index_ptr + tokens.to(tl.int64) * num_senders + s, mask=t_ok, other=-1)
            v = tl.load(recv_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                        mask=(rows[:, None] >= 0) & c_ok[None, :], other=0.0)
            acc += v.to(tl.float32)
        tl.store(out_ptr + tokens[:, None].to(tl.int64) * H + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
