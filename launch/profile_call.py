"""Host-side profile of one fused GEMM2 + GatherRS call (where the enqueue time goes).

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \
        launch/profile_call.py --model qwen3-30b-a3b --tokens 4096

Per stage of `_Call` (preparation: tables, upload, tile list; kernel launch; finalize
launch, with the finalize index's prefix sum; error-record copy), the host time to enqueue
it, median of --iters calls with the GPU idle at the start of each; then the torch.profiler
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
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call
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
    plan = plan_gemm2_gatherrs(meta, opts,
                               num_sms=torch.cuda.get_device_properties(device)
                               .multi_processor_count,
                               hidden=shape.hidden_size, ffn=shape.moe_ffn_hidden_size,
                               recv_rows=int(maps[rank].sum()))
    ws = get_workspace(group, hidden=shape.hidden_size, dtype=h.dtype, device=device)

    stages = {"prepare": [], "(unused)": [], "gemm launch": [], "finalize launch": [],
              "error copy": []}

    def one(record: bool):
        t0 = time.perf_counter()
        call = _Call(meta, ws, plan, hidden=shape.hidden_size, dtype=h.dtype, device=device,
                     timeout_s=30.0)
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
    if rank == 0:
        print(f"{args.model} {args.tokens} tokens/rank, world {world}: host ms per stage "
              "(median)")
        for key, vals in stages.items():
            print(f"  {key:16s} {statistics.median(vals):.3f}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if group is not None:
        dist.barrier()
    destroy_workspaces()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
