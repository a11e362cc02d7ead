"""Triton kernels of the tile-signaled GEMM2 + GatherRS operation (DESIGN.md §1, §3).

Three kernels, launched by `megatron_overlap.ops.triton_gemm2_gatherrs`:

* `_producer_kernel` (persistent, main stream): grouped GEMM2 over all local experts. CTAs
  claim tiles from an atomic counter in the schedule's order (remote segments first), store
  each tile of y = h @ w2[l]^T, then count it in its segment's counter (release, gpu scope).
* `_consumer_kernel` (persistent, k CTAs, side stream): for each segment (destination rank,
  column split) it owns, waits (acquire) until the segment's tiles are all counted, sums the
  rows of every slot in fixed local-expert order (the "Gather"), stores the pre-reduced rows
  straight into the destination's receive buffer (peer stores through symmetric memory), and
  adds 1 to the destination's arrival counter for this sender (release, system scope).
* `_finalize_kernel` (main stream, after the producer): waits until every sender's arrival
  counter reaches this call's target (acquire, system scope), then sums each token's partial
  rows in sender (group-rank) order into the output. Deterministic.

Every spin-wait is bounded by `timeout_ns` (GPU global timer; an iteration bound in the
interpreter). On expiry a kernel writes a record into its error buffer and stops waiting;
the launcher raises. A consumer that failed marks its arrival signal with `ERROR_BIT`, so
the receiving rank fails too instead of summing garbage.

Error record (int64[4]): code, segment or sender, observed value, expected value.
Codes: 1 producer tiles of a segment not done (consumer), 2 arrivals missing (finalize),
3 a sender reported an error (finalize).
"""

from __future__ import annotations

import triton
import triton.language as tl

ERROR_BIT = 1 << 30
"""Added to an arrival counter by a sender whose consumer failed."""

ERR_CONSUMER_WAIT = 1
ERR_FINALIZE_WAIT = 2
ERR_SENDER_FAILED = 3

# The same values as kernel constants (jit'ed code only reads constexpr globals).
_ERROR_BIT = tl.constexpr(ERROR_BIT)
_ERR_CONSUMER_WAIT = tl.constexpr(ERR_CONSUMER_WAIT)
_ERR_FINALIZE_WAIT = tl.constexpr(ERR_FINALIZE_WAIT)
_ERR_SENDER_FAILED = tl.constexpr(ERR_SENDER_FAILED)


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


# Sizes that change every call are not specialised on (one compiled variant per model
# shape); the strides, F and H are (16-divisibility makes the loads vectorise and the K loop
# software-pipeline: 96 KB of shared memory at 3 stages instead of 32 KB without).
@triton.jit(do_not_specialize=["num_tiles"])
def _producer_kernel(
    h_ptr, w2_ptr, y_ptr, tiles_ptr, num_tiles, tile_counter_ptr, seg_done_ptr,
    F, H, stride_h, stride_wl, stride_wn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """y[r0:r1, n0:n0+BN] = h[r0:r1] @ w2[l, n0:n0+BN]^T for each claimed tile.

    tiles: int32 [num_tiles, 5] = (local expert l, row start r0, row end r1, col start n0,
    segment); row ranges never cross a (local expert, source chunk) boundary.
    """
    t = tl.atomic_add(tile_counter_ptr, 1)
    while t < num_tiles:
        entry = tiles_ptr + t * 5
        expert = tl.load(entry + 0)
        r0 = tl.load(entry + 1)
        r1 = tl.load(entry + 2)
        n0 = tl.load(entry + 3)
        seg = tl.load(entry + 4)
        rows = r0 + tl.arange(0, BM)
        cols = n0 + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_wl + cols[None, :].to(tl.int64) * stride_wn
                  + ks[:, None])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, F, BK):
            a = tl.load(a_ptrs, mask=(rows[:, None] < r1) & (ks[None, :] + k0 < F), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] + k0 < F) & (cols[None, :] < H), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < r1) & (cols[None, :] < H))
        tl.debug_barrier()  # every thread's stores before the count
        tl.atomic_add(seg_done_ptr + seg, 1, sem="release", scope="gpu")
        t = tl.atomic_add(tile_counter_ptr, 1)


@triton.jit(do_not_specialize=["num_items", "my_rank", "recv_row_base", "timeout_ns"])
def _consumer_kernel(
    y_ptr, gather_ptr, segs_ptr, items_ptr, num_items, seg_done_ptr, seg_sent_ptr,
    peer_recv_ptrs, peer_sig_ptrs, my_rank, recv_row_base, H, stride_y, timeout_ns, err_ptr,
    K: tl.constexpr, KP: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    """Gather + send the work items this CTA owns (items pid, pid + k, ...).

    items: int32 [num_items, 4] = (segment, first slot, end slot, items of the segment).
    segs: int32 [num_segs, 7] = (destination rank g, column start c0, expected tiles,
    first slot s0, slot count, row offset of this sender in g's receive buffer, columns).
    gather: int64 [S, K] local rows per slot, -1 padded. The K rows of BS slots are loaded
    at once ([BS, KP, BN], all in flight) and summed in fp32. The last item of a segment to
    finish (an acq_rel counter) signals the destination (release, system scope): the chain
    of acq_rel increments carries every item's peer stores to that signal.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ks = tl.arange(0, KP)
    cols_in = tl.arange(0, BN)
    for it in range(pid, num_items, nprog):
        item = items_ptr + it * 4
        seg = tl.load(item + 0)
        lo = tl.load(item + 1)
        hi = tl.load(item + 2)
        seg_items = tl.load(item + 3)
        entry = segs_ptr + seg * 7
        dest = tl.load(entry + 0)
        c0 = tl.load(entry + 1)
        expected = tl.load(entry + 2)
        s0 = tl.load(entry + 3)
        dest_row = tl.load(entry + 5)
        width = tl.load(entry + 6)
        seen = _wait_at_least(seg_done_ptr + seg, expected, timeout_ns, "gpu", USE_TIMER)
        failed = seen < expected
        if failed:
            tl.store(err_ptr + 0, _ERR_CONSUMER_WAIT)
            tl.store(err_ptr + 1, seg)
            tl.store(err_ptr + 2, seen.to(tl.int64))
            tl.store(err_ptr + 3, expected.to(tl.int64))
        else:
            dst = tl.load(peer_recv_ptrs + dest).to(tl.pointer_type(y_ptr.dtype.element_ty))
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
        tl.debug_barrier()  # every thread's peer stores before the count
        # Low 16 bits count finished items; a failed item also adds 1 << 16, so the last
        # item knows whether any item of the segment failed.
        inc = tl.where(failed, 1 + 65536, 1)
        before = tl.atomic_add(seg_sent_ptr + seg, inc, sem="acq_rel", scope="sys")
        if (before & 65535) == seg_items - 1:
            sig = tl.load(peer_sig_ptrs + dest).to(tl.pointer_type(tl.int32))
            bump = tl.where(before + inc >= 65536, 1 + _ERROR_BIT, 1)
            tl.atomic_add(sig + my_rank, bump, sem="release", scope="sys")


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
