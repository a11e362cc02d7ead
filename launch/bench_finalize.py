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
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    # (name, tokens, slots per token C = top-k x TP, hidden)
    shapes = [("qwen3 tp2 32768", 16384, 16, 2048), ("qwen3 ep2 32768", 32768, 8, 2048),
              ("qwen1.5 ep2 32768", 32768, 4, 2048), ("phi ep2 8192", 8192, 2, 4096)]
    print("| shape | one-buffer ms | two-loads | row-select | delta | GB/s one-buffer | "
          "registers/spills per mode |")
    print("|---|---|---|---|---|---|---|")
    for name, T, C, H in shapes:
        rows = T * C
        split = rows // 2  # half the rows remote, half local
        all_rows = torch.randn(rows, H, device=dev, dtype=torch.bfloat16)
        recv = all_rows[:split].clone()
        local = all_rows[split:].clone()
        index = torch.randperm(rows, device=dev, dtype=torch.int64).to(torch.int32).view(T, C)
        delta = (local.data_ptr() - recv.data_ptr()) // 2 - split * H
        outs = [torch.empty(T, H, device=dev, dtype=torch.bfloat16) for _ in range(4)]
        grid = (triton.cdiv(T, 32), triton.cdiv(H, 128))

        def launch(mode, out):
            src = all_rows if mode == 0 else recv
            return _sum_rows[grid](src, local, split if mode else rows, delta, index, out, T, H,
                            C=C, BT=32, BH=128, MODE=mode, num_warps=4)

        handles = [launch(mode, outs[mode]) for mode in range(4)]
        regs = " ".join(f"{h.n_regs}/{h.n_spills}" for h in handles)
        torch.cuda.synchronize()
        for mode in range(1, 4):
            assert torch.equal(outs[mode], outs[0]), (name, mode)
        flush = torch.empty(512 * 2**20, dtype=torch.int8, device=dev)
        times = [[] for _ in range(4)]
        for _ in range(args.iters):
            for mode in range(4):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                launch(mode, outs[mode])
                end.record()
                end.synchronize()
                times[mode].append(start.elapsed_time(end))
        med = [statistics.median(t) for t in times]
        gbs = (rows * H * 2 + T * H * 2) / med[0] / 1e6
        print(f"| {name} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | {med[3]:.3f} | "
              f"{gbs:.0f} | {regs} |")


if __name__ == "__main__":
    main()
