"""Host-side profile of one fused GEMM2 + GatherRS call (where the enqueue time goes).

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \
        launch/profile_call.py --model qwen3-30b-a3b --tokens 4096

Per stage of `_Call` (preparation: tables, upload, tile list; kernel launch; finalize
launch, with the finalize index's prefix sum; error-record copy), the host time to enqueue
it, median of --iters calls with the GPU idle at the start of each; the same calls' host us
per 'mo.*' span; the host us of the plan and of primitives the launch path uses (stream
queries, events, small allocations, a 24-argument launch through Triton's JIT, FastLauncher
and the compiled kernel; median of 200 back-to-back, i.e. warm); then the torch.profiler
table of the top CPU ops of one call. Rank 0 prints. A development tool; the numbers go
into docs/perf_notes.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_overlap.bench.cli import init_cuda_group, positive_int


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help="model shape (configs/models/*.yaml)")
    parser.add_argument("--tokens", type=positive_int, default=4096,
                        help="tokens per rank")
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="profiled calls (median per stage)")
    args = parser.parse_args()

    from megatron_overlap.bench.workloads import rank_rows, routing_maps
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.models import load_model_shape
    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        _Call,
        call_resources,
        epilogue_stores_tma,
        plan_call,
    )
    from megatron_overlap.resource import plan_gemm2_gatherrs
    from megatron_overlap.symm import destroy_workspaces, get_workspace

    device = init_cuda_group(__file__)
    if device is None:
        return 2
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = load_model_shape(args.model)
    maps = routing_maps([args.tokens] * world, shape.num_moe_experts, shape.moe_router_topk,
                        "uniform", seed=0)
    meta = rank_rows(maps, tp=1, ep=world, rank=rank, topk=shape.moe_router_topk).meta
    meta = meta.to(device)
    n = int(meta.tokens_per_local_expert.sum())
    h = torch.randn(n, shape.moe_ffn_hidden_size, device=device).to(torch.bfloat16)
    w2 = torch.randn(meta.num_local_experts, shape.hidden_size, shape.moe_ffn_hidden_size,
                     device=device).to(torch.bfloat16)
    group = dist.group.WORLD if world > 1 else None
    opts = GatherRSOptions(backend="triton", prereduce=False)  # _Call below: direct mode
    # the op's tile and plan for this group (the resource manager's choice, `plan_call`)
    choice = plan_call(meta, opts, device=device,
                       num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
                       hidden=shape.hidden_size, ffn=shape.moe_ffn_hidden_size, elem_bytes=2,
                       recv_rows=int(maps[rank].sum()),
                       resources=lambda t: call_resources(
                           h.dtype, shape.moe_ffn_hidden_size, shape.hidden_size, 1,
                           shape.moe_router_topk, shape.num_moe_experts, t))
    call_tile, plan = choice.tile, choice.plan
    ws = get_workspace(group, hidden=shape.hidden_size, dtype=h.dtype, device=device)

    stages = {"prepare": [], "(unused)": [], "gemm launch": [], "finalize launch": [],
              "error copy": []}

    def one(record: bool):
        t0 = time.perf_counter()
        call = _Call(meta, ws, plan, hidden=shape.hidden_size, dtype=h.dtype, device=device,
                     timeout_s=30.0, tile=call_tile)
        t1 = t2 = time.perf_counter()
        call.send(h, w2)
        t3 = time.perf_counter()
        call.finalize()
        t4 = time.perf_counter()
        ws.record_error_check()
        t5 = time.perf_counter()
        if record:
            for key, a, b in zip(stages, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                stages[key].append((b - a) * 1e3)

    with torch.no_grad():
        for i in range(args.iters + 3):
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier()
            one(record=i >= 3)
        torch.cuda.synchronize()
        ws.check_errors(block=True)
        if group is not None:
            dist.barrier()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one(record=False)
        torch.cuda.synchronize()
        ws.check_errors(block=True)
    # The same calls with the 'mo.*' spans on (host us per span, median), the plan, and
    # host primitives the launch path uses (us per call, median of 200).
    from megatron_overlap.profiling import host_times

    spans = {}
    with torch.no_grad():
        for _ in range(args.iters):
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier()
            with host_times() as times:
                one(record=False)
            for key, vals in times.items():
                spans.setdefault(key, []).append(sum(vals) * 1e6)
        torch.cuda.synchronize()
        ws.check_errors(block=True)
    opts_plan = dict(num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
                     tma_store=epilogue_stores_tma(call_tile, shape.hidden_size, 2),
                     tile=(call_tile.bm, call_tile.bn, call_tile.bk),
                     hidden=shape.hidden_size, ffn=shape.moe_ffn_hidden_size,
                     recv_rows=int(maps[rank].sum()))
    prims = {
        "plan_gemm2_gatherrs": lambda: plan_gemm2_gatherrs(meta, opts, **opts_plan),
        "plan_call (every candidate tile)": lambda: plan_call(
            meta, opts, device=device, num_sms=opts_plan["num_sms"], hidden=shape.hidden_size,
            ffn=shape.moe_ffn_hidden_size, elem_bytes=2, recv_rows=opts_plan["recv_rows"],
            resources=lambda t: None),
        "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(device),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.cuda.current_device()": lambda: torch.cuda.current_device(),
        "Event().record()": lambda: torch.cuda.Event().record(),
        "torch.empty(64, device)": lambda: torch.empty(64, device=device),
        "tensor.zero_() (64 int32)": lambda: small.zero_(),
        "h.contiguous()": lambda: h.contiguous(),
    }
    small = torch.empty(64, dtype=torch.int32, device=device)
    # Launch paths of a do-nothing kernel with our launches' argument mix (8 tensors, 16
    # ints, 2 constexprs): Triton's JIT, FastLauncher, the compiled kernel called directly.
    import triton
    import triton.language as tl

    from megatron_overlap.kernels.launch import FastLauncher

    @triton.jit
    def _noop(p0, p1, p2, p3, p4, p5, p6, p7, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10,
              i11, i12, i13, i14, i15, A: tl.constexpr, B: tl.constexpr):
        if i0 < 0:
            tl.store(p0, i1 + A + B)

    noop_args = [small] * 8 + [7, 100, 3000, 5, 1 << 20, 9, 11, 12, 13, 14, 15, 16, 17, 18,
                               19, 20]
    fast_noop = FastLauncher(_noop)
    compiled_noop = _noop[(1,)](*noop_args, A=1, B=2)
    prims.update({
        "noop 24 args: kernel[grid](...) (JIT)": lambda: _noop[(1,)](*noop_args, A=1, B=2),
        "noop 24 args: FastLauncher": lambda: fast_noop((1,), *noop_args, A=1, B=2),
        "noop 24 args: compiled[grid](...)": lambda: compiled_noop[(1, 1, 1)](*noop_args, 1, 2),
    })
    prim_us = {}
    for name, fn in prims.items():
        vals = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            vals.append((time.perf_counter() - t0) * 1e6)
        prim_us[name] = statistics.median(vals)
    torch.cuda.synchronize()
    if rank == 0:
        print(f"{args.model} {args.tokens} tokens/rank, world {world}: host ms per stage "
              "(median)")
        for key, vals in stages.items():
            print(f"  {key:16s} {statistics.median(vals):.3f}")
        print("host us per span (median):")
        for key, vals in sorted(spans.items()):
            print(f"  {key:24s} {statistics.median(vals):8.1f}")
        print("host us per primitive (median of 200):")
        for key, val in prim_us.items():
            print(f"  {key:36s} {val:8.1f}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if group is not None:
        dist.barrier()
    destroy_workspaces()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
