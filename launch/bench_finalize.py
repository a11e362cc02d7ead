"""The finalize's row loads alone, on one GPU: where a token's rows come from two buffers
(the receive buffer and the call's local buffer, `_finalize_kernel`), four ways to load
them, interleaved in one run (CUDA events, median), outputs checked against each other.

  one-buffer    every row in one buffer (the layout before local rows left the receive
                buffer): the reference speed
  two-loads     two masked loads per slot, one per buffer, and a select
  row-select    a per-row select of the row's base pointer, one load
  delta         one load from the receive buffer's base with a per-row int64 offset that
                points into the local buffer for local rows

Usage: python launch/bench_finalize.py [--iters 20]   (CUDA; no process group)
       TRITON_INTERPRET=1 python launch/bench_finalize.py --tiny   (the check alone, CPU)

Measured (1x H200, docs/perf_notes.md v5.0): two-loads up to 1.7x one-buffer (16 rows per
token), row-select and delta within 1-2 % of it.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _sum_rows(recv_ptr, local_ptr, split, delta, index_ptr, out_ptr, num_tokens, H,
              C: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, MODE: tl.constexpr):
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    t_ok = tokens < num_tokens
    c_ok = cols < H
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for c in tl.static_range(C):
        rows = tl.load(index_ptr + tokens.to(tl.int64) * C + c, mask=t_ok, other=-1)
        if MODE == 0:
            v = tl.load(recv_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                        mask=(rows[:, None] >= 0) & c_ok[None, :], other=0.0)
        elif MODE == 1:
            local = rows >= split
            a = tl.load(recv_ptr + rows[:, None].to(tl.int64) * H + cols[None, :],
                        mask=((rows >= 0) & ~local)[:, None] & c_ok[None, :], other=0.0)
            b = tl.load(local_ptr + (rows - split)[:, None].to(tl.int64) * H + cols[None, :],
                        mask=local[:, None] & c_ok[None, :], other=0.0)
            v = tl.where(local[:, None], b, a)
        elif MODE == 2:
            local = rows >= split
            base = tl.where(local, local_ptr + (rows - split).to(tl.int64) * H,
                            recv_ptr + rows.to(tl.int64) * H)
            v = tl.load(base[:, None] + cols[None, :],
                        mask=(rows[:, None] >= 0) & c_ok[None, :], other=0.0)
        else:
            off = rows.to(tl.int64) * H + tl.where(rows >= split, delta, 0)
            v = tl.load(recv_ptr + off[:, None] + cols[None, :],
                        mask=(rows[:, None] >= 0) & c_ok[None, :], other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * H + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


SHAPES = [("qwen3 tp2 32768", 16384, 16, 2048), ("qwen3 ep2 32768", 32768, 8, 2048),
          ("qwen1.5 ep2 32768", 32768, 4, 2048), ("phi ep2 8192", 8192, 2, 4096)]
"""(name, tokens, rows per token C = top-k x TP, hidden H): the finalize's shapes per rank
of the GPU grid's largest fine-grained cells."""

MODES = ("one-buffer", "two-loads", "row-select", "delta")


def run_modes(tokens: int, slots: int, hidden: int, device: torch.device, iters: int = 0,
              seed: int = 0):
    """The four ways (`MODES`) on random rows, half in each buffer, a random index without
    empty slots: (whether every way's output equals one-buffer's bit for bit, median ms per
    way (empty list for iters=0), (registers, spills) per way on CUDA, else None).

    Raises:
        ValueError: a size < 1 or iters < 0.
    """
    if min(tokens, slots, hidden) < 1 or iters < 0:
        raise ValueError(f"tokens={tokens}, slots={slots}, hidden={hidden}, iters={iters}: "
                         "expected sizes >= 1 and iters >= 0")
    gen = torch.Generator().manual_seed(seed)
    rows = tokens * slots
    split = rows // 2  # the first half of the rows in the receive buffer, the rest local
    all_rows = torch.randn(rows, hidden, generator=gen).to(device, torch.bfloat16)
    recv = all_rows[:split].clone()
    local = all_rows[split:].clone()
    index = torch.randperm(rows, generator=gen).to(device, torch.int32).view(tokens, slots)
    # local row i - split, counted from the receive buffer's base (elements)
    delta = (local.data_ptr() - recv.data_ptr()) // all_rows.element_size() - split * hidden
    outs = [torch.empty(tokens, hidden, device=device, dtype=torch.bfloat16) for _ in MODES]
    gpu = device.type == "cuda"
    bt, bh = (32, 128) if gpu else (8, 16)
    grid = (triton.cdiv(tokens, bt), triton.cdiv(hidden, bh))

    def launch(mode):
        src = all_rows if mode == 0 else recv
        return _sum_rows[grid](src, local, split if mode else rows, delta, index, outs[mode],
                               tokens, hidden, C=slots, BT=bt, BH=bh, MODE=mode, num_warps=4)

    handles = [launch(mode) for mode in range(len(MODES))]
    regs = [(h.n_regs, h.n_spills) for h in handles] if gpu else None
    agree = all(torch.equal(out, outs[0]) for out in outs[1:])
    times = [[] for _ in MODES]
    flush = torch.empty(512 * 2**20 if gpu else 1, dtype=torch.int8, device=device)
    for _ in range(iters if gpu else 0):
        for mode in range(len(MODES)):
            flush.zero_()  # the rows come from HBM, not from L2
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            launch(mode)
            end.record()
            end.synchronize()
            times[mode].append(start.elapsed_time(end))
    return agree, [statistics.median(t) for t in times if t], regs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20,
                        help="timed rounds (every way once a round; default 20)")
    parser.add_argument("--tiny", action="store_true",
                        help="one small shape, no timing: the agreement check alone (CPU: "
                             "run under TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: expected an integer >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("no CUDA device: on the CPU run the check under Triton's interpreter, "
                     "TRITON_INTERPRET=1 python launch/bench_finalize.py --tiny")
    if args.tiny:
        agree, _, _ = run_modes(6, 3, 48, device)
        print(f"tiny: {'agree' if agree else 'DIFFER'}")
        return 0 if agree else 1
    if device.type != "cuda":
        parser.error("timing needs CUDA (--tiny checks the agreement on the CPU)")
    print("| shape | " + " | ".join(f"{m} ms" for m in MODES)
          + " | GB/s one-buffer | registers/spills per way |")
    print("|---" * (len(MODES) + 3) + "|")
    ok = True
    for name, tokens, slots, hidden in SHAPES:
        agree, med, regs = run_modes(tokens, slots, hidden, device, args.iters)
        ok &= agree
        gbs = (tokens * slots + tokens) * hidden * 2 / med[0] / 1e6
        print(f"| {name} | " + " | ".join(f"{t:.3f}" for t in med) + f" | {gbs:.0f} | "
              + " ".join(f"{r}/{sp}" for r, sp in regs) + (" |" if agree else " | DIFFER |"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
