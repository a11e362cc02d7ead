"""Operator benchmark of GEMM2 + GatherRS (DESIGN.md §5), side by side in one run.

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \
        launch/bench_op.py --out $OUT/bench_op.jsonl

For each workload (model expert shapes x tokens per rank x layout EP=R or TP=R), on the same
inputs, CUDA events, median (p20/p80) of --iters timed runs after --warmup:
  gemm          FC2 alone: torch grouped GEMM (F.grouped_mm; a per-expert loop if absent)
  megatron      (a) non-overlapped as Megatron: grouped GEMM, then the collective on routed
                rows (EP all-to-all / TP reduce-scatter), then the un-permute (index_add)
  prereduced    (b) non-overlapped, pre-reduced: grouped GEMM, local top-k gather, the
                collective on the reduced rows, finalize (`reference.gatherrs_reference`)
  ours_nocomm   (d) our fused kernel with its GEMM2 tiles only (communication off)
Every ours* provider runs the op's own GEMM2 tile: the one the resource manager picks for
the call (`ops.triton_gemm2_gatherrs.plan_call`; row fields gemm2_tile and
tile_predicted_us, the model's time of each tile it compared); --variants add others.
  gemm_paired   the grouped GEMM again, its runs interleaved with ours_nocomm's (and every
                --variants tile's nocomm[...]): the producer efficiency is
                gemm_paired / ours_nocomm (from v6.0; before, gemm / ours_nocomm, timed
                apart)
  ours_paired   with --variants: ours_prepared's call again, its runs interleaved with
                every variant's prepared call ours[...] (from v6.5; before, each variant
                was timed alone), so ours[<tile>] / ours_paired compares the tiles
  ours          the fused Triton op as `gemm2_gatherrs` runs it, host work included (tables,
                copies, launches); op-level "auto" without routing maps runs direct
  ours_prepared the op as the Megatron layer runs it: host work done beforehand (it
                overlaps FC1 there), launches + GPU work timed
                (direct mode, the plan's grid and communication CTAs)
  ours_prereduced  the same for the pre-reduced mode (`GatherRSOptions.prereduce`), its
                runs interleaved with ours_prepared's; row field max_rel_err_prereduced_mode
  ours_auto     whichever of the two the resource manager picks (GatherRSOptions' default
                prereduce="auto"; row field auto_mode): the same runs, not timed again
  ours_e2e, ours_prereduced_e2e  the two modes with their preparation inside the timed
                region (after the queue sleep): uploads, table kernels and, pre-reduced, the
                routing-map all-gather, which ours_prepared / ours_prereduced leave out
  ours_host     (breakdown) host time to enqueue one call (tables, copies, launches)
  ours_prereduced_host  the same for a pre-reduced call, its routing-map all-gather included
  ours_finalize (breakdown) the finalize kernel alone (arrivals already in)
  bound         (c) max(gemm, remote pre-reduced bytes / measured peer bandwidth)
Every provider but "ours" is timed with --queue-ms of GPU sleep before its start event, so
its time is GPU work (the host's enqueue hidden, as in a model whose host runs ahead).
Ratios printed: (a)/ours, (b)/ours, ours/bound, gemm_paired/ours_nocomm (producer efficiency),
and the same over ours_auto.
Every rank runs the same workload list; rank 0 prints and writes. Routing: "uniform" (default)
or "skewed" (see megatron_overlap.bench.workloads), fixed seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_overlap.bench.cli import (
    add_timing_args,
    check_launch_inputs,
    check_layout_name,
    init_cuda_group,
    layout_label,
    layout_sizes,
    non_negative_float,
    positive_float,
    positive_int,
)
from megatron_overlap.bench.measure import percentile, round_order
from megatron_overlap.bench.report import plot, table
from megatron_overlap.bench.workloads import rank_rows, routing_maps
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.models import load_model_shape
from megatron_overlap.ops import gemm2_gatherrs
from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps
from megatron_overlap.reference import gatherrs_reference
from megatron_overlap.resource.profile import load_profile

MODELS = ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "phi-3.5-moe", "qwen3-30b-a3b",
          "deepseek-v2-lite")


_GROUPED_MM = [hasattr(F, "grouped_mm")]


def grouped_gemm(h, w2, rows_per_expert, offs):
    """y [N, H] = h @ w2[l]^T per local expert: torch's grouped GEMM (F.grouped_mm), or a
    per-expert loop where it is missing or refuses the shapes (said once on stdout)."""
    if _GROUPED_MM[0]:
        try:
            return F.grouped_mm(h, w2.transpose(1, 2), offs=offs)
        except RuntimeError as err:
            _GROUPED_MM[0] = False
            print(f"F.grouped_mm refused ({err}); the gemm baseline is a per-expert loop")
    return torch.cat([h_l @ w2[l].t() for l, h_l in enumerate(torch.split(h, rows_per_expert))])


_SLEEP_CYCLES_PER_MS = {}


def _queue_gpu(queue_ms: float) -> None:
    """Keep the GPU busy for ~queue_ms (`torch.cuda._sleep`) so that the host's enqueue of
    the timed work hides behind it: the events then time GPU work only, as in a model whose
    host runs ahead of the GPU. Cycles per ms measured once per device."""
    if queue_ms <= 0:
        return
    dev = torch.cuda.current_device()
    if dev not in _SLEEP_CYCLES_PER_MS:
        cycles = 1_000_000
        torch.cuda._sleep(cycles)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[dev] = cycles / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(queue_ms * _SLEEP_CYCLES_PER_MS[dev]))


def timed(fn, warmup: int, iters: int, queue_ms: float = 0.0):
    """p20/p50/p80 milliseconds of fn() on the GPU, ranks lined up before every run.

    queue_ms > 0: the GPU sleeps that long before the start event (`_queue_gpu`), so the
    time is fn's GPU work without the host's enqueue (its launches); 0: the host's enqueue
    counts where the GPU waits for it (a short op timed alone)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        _queue_gpu(queue_ms)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return _quantiles(times)


def timed_interleaved(fns, warmup: int, iters: int, queue_ms: float = 0.0):
    """`timed` for several functions at once, their runs interleaved: round r runs every
    function once, in row r of a Williams design (`bench.measure.round_order`: every
    function comes right after every other one equally often, as the layer benchmark's
    variants do), so that a drift of the machine (clocks under power or heat, a
    neighbour's load) over the minute a workload takes hits all of them alike. Returns one
    p20/p50/p80 dict per entry of `fns`. The producer-efficiency pair (the grouped GEMM and
    our GEMM2 tiles) is timed this way from v6.0: timed apart, half a minute of other
    providers between them, Mixtral's producer came out slower than the whole call whose
    part it is (docs/perf_notes.md v5.9, v6.0)."""
    times = [[] for _ in fns]
    n = len(fns)
    for r in range(warmup + iters):
        for i in round_order(range(n), r):
            dist.barrier()
            torch.cuda.synchronize()
            _queue_gpu(queue_ms)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fns[i]()
            end.record()
            end.synchronize()
            if r >= warmup:
                times[i].append(start.elapsed_time(end))
    return [_quantiles(t) for t in times]


def timed_prepared(prepare, h, w2, args):
    """p20/p50/p80 ms of running calls that were prepared (host work) before the timing
    starts, as the Megatron layer runs them (there the preparation overlaps FC1)."""
    return timed_prepared_interleaved([prepare], h, w2, args)[0]


def timed_prepared_interleaved(prepares, h, w2, args, *, prepare_timed: bool = False):
    """`timed_prepared` for several configurations at once, their runs interleaved (round r
    runs every configuration once, starting at a different one each round), so that a slow
    phase of the machine hits all of them alike instead of one configuration's whole sample.
    With `prepare_timed` the preparation runs inside the timed region, after the queue sleep:
    its GPU work (uploads, table kernels, a routing-map gather) is timed and its host work
    hides behind the queue as far as --queue-ms reaches. Returns one p20/p50/p80 dict per
    entry of `prepares`."""
    times = [[] for _ in prepares]
    n = len(prepares)
    for r in range(args.warmup + args.iters):
        for j in range(n):
            i = (r + j) % n
            pending = None if prepare_timed else prepares[i]()
            torch.cuda.synchronize()
            dist.barrier()
            _queue_gpu(getattr(args, "queue_ms", 0.0))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            if prepare_timed:
                pending = prepares[i]()
            pending.run(h, w2)
            end.record()
            end.synchronize()
            if r >= args.warmup:
                times[i].append(start.elapsed_time(end))
    return [_quantiles(t) for t in times]


def _quantiles(t) -> dict:
    """p20 / p50 / p80 of a sample (ms): the rows' timing fields."""
    # linear interpolation inside the sample (statistics.quantiles' default "exclusive"
    # method, used until v4.9, extrapolates beyond it for small samples)
    return {"p20": percentile(t, 20), "p50": statistics.median(t), "p80": percentile(t, 80)}


def peer_bandwidth_gbps(device, num_bytes: int = 1 << 30) -> float:
    """Copy-engine bandwidth of one rank storing into its neighbour's symmetric buffer."""
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = dist.get_world_size(), dist.get_rank()
    buf = symm_mem.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
    peer = handle.get_buffer((rank + 1) % world, (num_bytes // 2,), torch.bfloat16)
    src = torch.randn(num_bytes // 2, device=device).to(torch.bfloat16)
    t = timed(lambda: peer.copy_(src), warmup=3, iters=10)
    dist.barrier()
    return num_bytes / (t["p50"] * 1e-3) / 1e9


def megatron_combine(y, rows, tp, ep, hidden, num_tokens, group):
    """(a): the routed rows go back un-reduced (EP all-to-all or TP reduce-scatter), then the
    source scatter-adds them into its tokens (Megatron's combine_preprocess, token_combine,
    combine_postprocess, without the unsort copy)."""
    if tp > 1:  # rows are the same on all TP ranks; reduce-scatter partials by source
        splits = [int((rows.row_source == g).sum()) for g in range(tp)]
        order = torch.argsort(rows.row_source_dev, stable=True)
        parts = list(y.index_select(0, order).split(splits))
        out_rows = y.new_empty(splits[dist.get_rank()], hidden)
        dist.reduce_scatter(out_rows, parts, group=group)
    else:
        splits_in = [int((rows.row_source == g).sum()) for g in range(ep)]
        order = torch.argsort(rows.row_source_dev, stable=True)
        out_rows = y.new_empty(rows.recv_rows, hidden)
        dist.all_to_all_single(out_rows, y.index_select(0, order), rows.recv_splits, splits_in,
                               group=group)
    out = torch.zeros(num_tokens, hidden, dtype=y.dtype, device=y.device)
    return out.index_add_(0, rows.recv_token, out_rows)


def run_workload(model: str, tokens: int, layout: str, args, device, bandwidth) -> list:
    shape = load_model_shape(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, ep = layout_sizes(layout, world)
    hidden, ffn = shape.hidden_size, shape.moe_ffn_hidden_size // tp
    experts, topk = shape.num_moe_experts, shape.moe_router_topk
    tokens_per_rank = [tokens] * world
    maps = routing_maps(tokens_per_rank, experts, topk, args.routing, seed=args.seed)
    rows = rank_rows(maps, tp=tp, ep=ep, rank=rank, topk=topk)
    meta = rows.meta.to(device)
    num_local = experts // ep
    gen = torch.Generator(device=device).manual_seed(rank)
    n = int(meta.tokens_per_local_expert.sum())
    h = (torch.randn(n, ffn, generator=gen, device=device) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(num_local, hidden, ffn, generator=gen, device=device)
          / ffn**0.5).to(torch.bfloat16)
    rows_per_expert = [int(x) for x in meta.tokens_per_local_expert]
    offs = torch.tensor(rows_per_expert, device=device).cumsum(0).to(torch.int32)

    # (a)'s index data: the source's rows in its permute order (expert-major, token asc).
    expert_of, token_of = maps[rank].T.nonzero(as_tuple=True)
    extra = argparse.Namespace(
        row_source=rows.row_source, row_source_dev=rows.row_source.to(device),
        recv_token=token_of.to(device), recv_rows=int(token_of.numel()),
        recv_splits=[int(((expert_of // num_local) == j).sum()) for j in range(ep)],
    )

    group = dist.group.WORLD
    opts = GatherRSOptions(backend="triton", timeout_s=30.0)
    results = {}
    with torch.no_grad():
        y = grouped_gemm(h, w2, rows_per_expert, offs)
        results["gemm"] = timed(lambda: grouped_gemm(h, w2, rows_per_expert, offs),
                                args.warmup, args.iters, args.queue_ms)
        results["megatron"] = timed(lambda: megatron_combine(
            grouped_gemm(h, w2, rows_per_expert, offs), extra, tp, ep, hidden,
            tokens, group), args.warmup, args.iters, args.queue_ms)
        results["prereduced"] = timed(lambda: gatherrs_reference(
            grouped_gemm(h, w2, rows_per_expert, offs), meta, group), args.warmup, args.iters,
            args.queue_ms)
        out = gemm2_gatherrs(h, w2, meta, group=group, options=opts)  # compiles, warms up
        ref = gatherrs_reference(y, meta, group)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        results["ours"] = timed(lambda: gemm2_gatherrs(h, w2, meta, group=group, options=opts),
                                args.warmup, args.iters)
        from megatron_overlap.ops.triton_gemm2_gatherrs import _Call, call_resources, plan_call
        from megatron_overlap.symm import get_workspace

        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # The tile and plan as the op makes them (the tile: the resource manager's choice for
        # this group, `plan_call`; k from the model; mode: GatherRSOptions' default "auto").
        # The timed direct / pre-reduced calls below use its grid and k; auto_mode records
        # which of the two the resource manager would run.
        choice = plan_call(meta, opts, device=device, num_sms=num_sms, hidden=hidden, ffn=ffn,
                           elem_bytes=h.element_size(), recv_rows=int(maps[rank].sum()) * tp,
                           resources=lambda t: call_resources(h.dtype, ffn, hidden, tp,
                                                              meta.topk,
                                                              meta.routing_map.shape[1], t))
        call_tile, plan = choice.tile, choice.plan
        ws = get_workspace(group, hidden=hidden, dtype=h.dtype, device=device)

        def prepare(tile=None, call_plan=plan):
            return _Call(meta, ws, call_plan, hidden=hidden, dtype=h.dtype, device=device,
                         timeout_s=30.0, tile=tile or call_tile)

        def one_call(tile=None, call_plan=plan):
            call = prepare(tile, call_plan)
            call.run(h, w2)
            return call

        host_ms = []
        for _ in range(args.iters):  # host time to enqueue one call (tables, copies, launches)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            call = one_call()
            host_ms.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        results["ours_host"] = _quantiles(host_ms)
        # The last call's arrivals are all in: finalize again = its summing alone.
        results["ours_finalize"] = timed(call.finalize, args.warmup, args.iters, args.queue_ms)
        # The call as the Megatron layer runs it: prepared (host work) while FC1 runs, so the
        # timed part is the launches and the GPU work.
        # The pre-reduced mode (GatherRSOptions.prereduce) side by side with the direct
        # layout, interleaved; its result is checked against the reference too.
        from megatron_overlap.ops.triton_prereduce import PreReducedCall

        dev_maps = [m.to(device) for m in maps]

        sizes = [int(m.shape[0]) for m in maps]

        def prepare_prereduced(gather: bool = False):
            # gather: the routing maps all-gathered here, as the Megatron dispatcher does
            return PreReducedCall(
                meta, ws, plan, hidden=hidden, dtype=h.dtype, device=device, timeout_s=30.0,
                tile=call_tile,
                routing_maps=(gather_routing_maps(dev_maps[rank], group, sizes) if gather
                              else dev_maps))

        pre_out = prepare_prereduced().run(h, w2)
        err_prereduced = float((pre_out.float() - ref.float()).abs().max()
                               / ref.float().abs().max())
        host_ms = []
        for _ in range(args.iters):  # the same host time for a pre-reduced call (map gather in)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            prepare_prereduced(gather=True).run(h, w2)
            host_ms.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        results["ours_prereduced_host"] = _quantiles(host_ms)
        results["ours_prepared"], results["ours_prereduced"] = timed_prepared_interleaved(
            [prepare, prepare_prereduced], h, w2, args)
        # The op as the Megatron layer runs it: the mode the resource manager picks.
        results["ours_auto"] = results["ours_prereduced" if plan.mode == "prereduce"
                                       else "ours_prepared"]
        # Both modes with their preparation timed too (the mode model leaves it out); the
        # pre-reduced one with the routing-map all-gather, as the Megatron dispatcher does.
        results["ours_e2e"], results["ours_prereduced_e2e"] = timed_prepared_interleaved(
            [prepare, lambda: prepare_prereduced(gather=True)], h, w2, args,
            prepare_timed=True)
        # the producer's efficiency: the grouped GEMM again ("gemm_paired") and our GEMM2
        # tiles alone, each variant's too, timed in the same interleaved rounds below
        producers = [("gemm_paired", lambda: grouped_gemm(h, w2, rows_per_expert, offs)),
                     ("ours_nocomm", call.gemm_only)]
        variant_errs = {}
        variant_prepares = []
        # other tile configurations / schedules, same inputs and the same plan (grid and k of
        # the op's tile, `call_tile`): an A/B of the tiles at equal k
        for name in args.variants:
            tile, per_sm = parse_tile(name)
            v_plan = dataclasses.replace(plan, num_ctas=per_sm * num_sms, source="forced")
            v_call = one_call(tile, v_plan)  # compiles; its result is checked
            variant_errs[name] = float((v_call.out.float() - ref.float()).abs().max()
                                       / ref.float().abs().max())
            variant_prepares.append((f"ours[{name}]",
                                     lambda tile=tile, v_plan=v_plan: prepare(tile, v_plan)))
            producers.append((f"nocomm[{name}]", v_call.gemm_only))
        if variant_prepares:
            # the variants' prepared calls interleaved with the op's own, so ours[...] /
            # ours_paired is an A/B in the same rounds (since v6.5; before, each variant was
            # timed alone, and under the H100's power cap Mixtral 16384's wide tile read
            # 5.60-6.17 ms there against 5.45 for the op running the same tile)
            paired = timed_prepared_interleaved([prepare] + [f for _, f in variant_prepares],
                                                h, w2, args)
            results["ours_paired"] = paired[0]
            for (key, _), t in zip(variant_prepares, paired[1:]):
                results[key] = t
        for (key, _), t in zip(producers, timed_interleaved(
                [fn for _, fn in producers], args.warmup, args.iters, args.queue_ms)):
            results[key] = t
        for kc in args.comm_ctas:  # the SM partition forced
            forced = dataclasses.replace(plan, num_comm_ctas=kc, source="forced")
            results[f"ours[k={kc}]"] = timed_prepared(lambda: prepare(call_plan=forced), h,
                                                      w2, args)
        ws.check_errors(block=True)

    remote = sum(int(meta.send_slots[g]) for g in range(world) if g != rank)
    remote_bytes = remote * hidden * 2
    comm_ms = remote_bytes / (bandwidth * 1e9) * 1e3
    results["bound"] = {k: max(results["gemm"][k], comm_ms) for k in ("p20", "p50", "p80")}
    flops = 2.0 * n * ffn * hidden
    common = dict(model=model, tokens_per_rank=tokens, layout=layout_label(tp, ep),
                  routing=args.routing, hidden=hidden, ffn_per_rank=ffn, local_experts=num_local,
                  topk=topk, rows=n, remote_bytes=remote_bytes, queue_ms=args.queue_ms,
                  max_rel_err_vs_prereduced=err,
                  max_rel_err_variants=variant_errs,
                  max_rel_err_prereduced_mode=err_prereduced, auto_mode=plan.mode,
                  num_comm_ctas=plan.num_comm_ctas,
                  # the op's GEMM2 tile (`TileConfig.name`) and the model's predicted time
                  # of each tile it compared (`plan_call`)
                  gemm2_tile=call_tile.name, tile_predicted_us=choice.predicted_us,
                  gemm_tflops=flops / (results["gemm"]["p50"] * 1e-3) / 1e12)
    # every rank's p50 -> the slowest rank is the op's time
    rows_out = []
    for provider, t in results.items():
        vals = torch.tensor([t["p20"], t["p50"], t["p80"]], device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
        rows_out.append(dict(common, provider=provider, p20_ms=float(vals[0]),
                             p50_ms=float(vals[1]), p80_ms=float(vals[2]),
                             tma_store=provider_tma_store(provider, call_tile, hidden)))
    return rows_out


def provider_tma_store(provider: str, call_tile, hidden: int):
    """Whether a provider's GEMM2 epilogue stored through TMA (bf16 rows of `hidden`):
    `ours*` (k forced included) the op's tile for the group (`call_tile`), `ours[<tile>]` /
    `nocomm[<tile>]` that tile's; None for the providers without our GEMM2 (gemm, megatron,
    prereduced, bound)."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import epilogue_stores_tma

    if not provider.startswith(("ours", "nocomm[")):
        return None
    if "[" in provider and not provider.startswith("ours[k="):
        call_tile = parse_tile(provider[provider.index("[") + 1:-1])[0]
    return epilogue_stores_tma(call_tile, hidden, 2)


def parse_tile(name: str):
    """'128x256x64w8s3' (+ 'dyn' for dynamic claims, + 'g2' for two CTAs per SM, + 'tma'
    for the epilogue's stores through TMA descriptors, + 'rot' for the static schedule's
    rotated waves) -> (TileConfig, CTAs per SM)."""
    import re

    from megatron_overlap.ops.triton_gemm2_gatherrs import TileConfig

    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(dyn)?(g2)?(tma)?(rot)?", name)
    if not m or (m.group(6) and (m.group(8) or m.group(9))):
        raise ValueError(f"tile variant {name!r}: expected e.g. 128x256x64w8s3, "
                         "128x128x64w8s3dyn, 128x256x64w8s3tma or 128x256x64w8s3tmarot "
                         "('tma' and 'rot' only with the static schedule)")
    bm, bn, bk, w, st = (int(x) for x in m.groups()[:5])
    try:
        tile = TileConfig(bm, bn, bk, num_warps=w, num_stages=st, static=m.group(6) is None,
                          tma_store=m.group(8) is not None, rotate=m.group(9) is not None)
    except ValueError as err:
        raise ValueError(f"tile variant {name!r}: {err}") from None
    return tile, 2 if m.group(7) else 1


def git_sha() -> str:
    """See megatron_overlap.bench.measure.git_sha ($MO_GIT_SHA first)."""
    if os.environ.get("MO_GIT_SHA", "").strip():
        return os.environ["MO_GIT_SHA"].strip()
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS),
                        help="model shapes (configs/models/*.yaml)")
    parser.add_argument("--tokens", nargs="+", type=positive_int,
                        default=[2048, 4096, 8192, 16384], help="tokens per rank")
    parser.add_argument("--layouts", nargs="+", default=["ep", "tp"],
                        help="ep: EP = world size; tp: TP = world size; or tpXepY with "
                             "TP x EP = world size (e.g. tp2ep2 on 4 GPUs)")
    parser.add_argument("--routing", choices=("uniform", "skewed"), default="uniform",
                        help="routing distribution (megatron_overlap.bench.workloads)")
    add_timing_args(parser, warmup=5, iters=20, per="per provider")
    parser.add_argument("--queue-ms", type=non_negative_float, default=1.0,
                        help="GPU sleep before each timed run (every provider but 'ours'), so "
                             "the events time GPU work without the host's enqueue; 0: the "
                             "host's launches count where the GPU waits for them")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="extra tile configurations to time (prepared), e.g. "
                             "128x256x64w8s3 128x128x64w8s3dyn 128x256x64w8s3tma "
                             "128x256x64w8s3tmarot (BMxBNxBK, wWARPS, sSTAGES; dyn: atomic "
                             "claims; g2: 2 CTAs per SM; tma: TMA-store epilogue; rot: "
                             "rotated waves) (rows ours[...] / nocomm[...])")
    parser.add_argument("--comm-ctas", nargs="*", type=positive_int, default=[],
                        help="also time the op (prepared) with these forced communication-CTA "
                             "counts (rows ours[k=...])")
    parser.add_argument("--out", default="results/bench_op.jsonl",
                        help="JSON rows (appended); a PNG plot next to it")
    parser.add_argument("--stack-dump-s", type=positive_float, default=300.0,
                        help="print every thread's stack each this many seconds (stuck runs)")
    args = parser.parse_args()
    for name in ("models", "tokens", "layouts", "variants"):  # each once, in order
        setattr(args, name, list(dict.fromkeys(getattr(args, name))))
    try:  # what needs no GPU is checked before the process group starts
        for model in args.models:
            load_model_shape(model)
        for name in args.variants:
            parse_tile(name)
        check_launch_inputs(args.out, create=False)  # its folder: made by rank 0 below
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    try:  # the names here; TP x EP = world once the group is up (below)
        for layout in args.layouts:
            check_layout_name(layout)
    except ValueError as err:
        parser.error(f"--layouts: {err}")

    faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)  # a stuck run says where
    device = init_cuda_group(__file__)
    if device is None:
        return 2
    for layout in args.layouts:
        try:
            layout_sizes(layout, dist.get_world_size())
        except ValueError as err:
            if dist.get_rank() == 0:
                print(f"bench_op.py: error: --layouts: {err}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
    bandwidth = peer_bandwidth_gbps(device)
    rows = []
    info = dict(gpu=torch.cuda.get_device_name(device), world=dist.get_world_size(),
                peer_bandwidth_gbps=bandwidth, git_sha=git_sha(),
                hw_profile=load_profile().name,
                timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                torch=torch.__version__)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for model in args.models:
        for layout in args.layouts:
            for tokens in args.tokens:
                new = [dict(r, **info)
                       for r in run_workload(model, tokens, layout, args, device, bandwidth)]
                rows += new
                if dist.get_rank() == 0:
                    with open(args.out, "a") as f:  # row by workload: a cut run keeps them
                        for r in new:
                            f.write(json.dumps(r) + "\n")
                    g = {r["provider"]: r["p50_ms"] for r in new}
                    print(f"{model} {layout} {tokens}: " + " ".join(
                        f"{k} {v:.3f}" for k, v in g.items()), flush=True)
    if dist.get_rank() == 0:
        print(f"peer bandwidth (copy engine, 1 GiB): {bandwidth:.0f} GB/s")
        print(table(rows))
        try:
            plot(rows, os.path.splitext(args.out)[0] + ".png")
        except ImportError:
            print("matplotlib missing: no plot")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
