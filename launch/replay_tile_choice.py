"""Replay the resource manager's GEMM2 tile choice against a bench_op run, on a CPU.

    python3 launch/replay_tile_choice.py docs/results/bench_op_v66a_ep1_1xh100.jsonl \
        --profile h100 docs/results/calibrate_v66a_1xh100.yaml

For every world-1 workload of the JSONL rows (`launch/bench_op.py --variants ...`, which
times each variant tile's producer, `nocomm[<tile>]`, interleaved with the others), this
rebuilds the call's metadata as bench_op did (`bench.workloads.routing_maps` with the row's
routing and --seed, `rank_rows`) and runs `ops.triton_gemm2_gatherrs.plan_call` for a CUDA
device with --num-sms SMs under each --profile (no kernel, no GPU: `resources` gives the
planner's default occupancy, as before a call's first launch). A choice is right where the
chosen tile's measured producer time is within --tie of the fastest measured variant
among the tiles the planner compared. Prints one line per workload and, per profile, how
many choices were right, and the tile the GPU run itself chose (`gemm2_tile`, with the
profile it ran with: replayed with that profile, the two agree); then, per tile, how far
the model's GEMM2 term (the tiles' waves alone) is from that tile's measured producer time
(`gemm_accuracy`). Exits 2 where the rows have no variant timings.

Rows at world > 1 are skipped (the group's choice needs every rank's counts; bench_op's
JSONL has one rank's). Profile: a shipped name (configs/hardware) or a YAML path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))  # run from a checkout without `pip install`


def _key(r):
    return (r["model"], r["tokens_per_rank"], r["hidden"], r["ffn_per_rank"],
            r["local_experts"], r["topk"], r.get("routing", "uniform"))


def measured_workloads(rows):
    """{(model, tokens, hidden, ffn, experts, topk, routing): {tile name: producer p50 ms}}
    of the world-1 rows with `nocomm[<tile>]` variant timings (a workload in several files:
    the last file's times)."""
    out = defaultdict(dict)
    for r in rows:
        p = r.get("provider", "")
        if r.get("world") == 1 and p.startswith("nocomm[") and p.endswith("]"):
            out[_key(r)][p[len("nocomm["):-1]] = r["p50_ms"]
    return dict(out)


def gpu_choices(rows):
    """{workload key: (the tile the GPU run's op chose, its hw_profile)} of world-1 rows."""
    return {_key(r): (r["gemm2_tile"], r.get("hw_profile")) for r in rows
            if r.get("world") == 1 and r.get("gemm2_tile")}


def replay(workloads, profile, *, num_sms: int, seed: int, tie: float):
    """[(workload key, chosen tile name, {tile: predicted us}, right: bool)] for one profile
    (a `HardwareProfile`, a name or a YAML path)."""
    import torch

    from megatron_overlap.bench.workloads import rank_rows, routing_maps
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import triton_gemm2_gatherrs as op
    from megatron_overlap.resource.profile import HardwareProfile, load_profile

    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    results = []
    for key, times in sorted(workloads.items()):
        _, tokens, hidden, ffn, experts, topk, routing = key
        maps = routing_maps([tokens], experts, topk, routing, seed=seed)
        meta = rank_rows(maps, tp=1, ep=1, rank=0, topk=topk).meta
        choice = op.plan_call(meta, GatherRSOptions(backend="triton"),
                              device=torch.device("cuda"), hidden=hidden, ffn=ffn,
                              elem_bytes=2, num_sms=num_sms, resources=lambda t: None,
                              profile=prof)
        compared = [t for t in choice.predicted_us if t in times]
        best = min(times[t] for t in compared) if compared else None
        chosen = choice.tile.name
        right = (best is not None and chosen in times
                 and times[chosen] <= (1.0 + tie) * best)
        results.append((key, chosen, choice.predicted_us, right))
    return results


def gemm_accuracy(workloads, profile, *, num_sms: int, seed: int):
    """{tile name: [(workload key, the model's GEMM2 term / the measured producer time)]}
    for every measured tile the profile has a tile time for: `resource.plan_gemm2_gatherrs`
    for that tile at the planner's default occupancy (`PlanBreakdown.gemm_us`, the waves of
    tiles alone, which is what `nocomm[<tile>]` times)."""
    from megatron_overlap.bench.workloads import rank_rows, routing_maps
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import triton_gemm2_gatherrs as op
    from megatron_overlap.resource import plan_gemm2_gatherrs
    from megatron_overlap.resource.profile import HardwareProfile, load_profile

    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    configs = {t.name: t for t in (op.DEFAULT_TILE, op.DEFAULT_TMA_TILE, *op.TILE_CANDIDATES)}
    out = defaultdict(list)
    for key, times in sorted(workloads.items()):
        _, tokens, hidden, ffn, experts, topk, routing = key
        maps = routing_maps([tokens], experts, topk, routing, seed=seed)
        meta = rank_rows(maps, tp=1, ep=1, rank=0, topk=topk).meta
        for name, ms in sorted(times.items()):
            t = configs.get(name)
            if t is None or not prof.has_tile_time(t.bm, t.bn, t.bk, t.tma_store):
                continue
            plan = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"),
                                       num_sms=num_sms, hidden=hidden, ffn=ffn, elem_bytes=2,
                                       profile=prof, tile=(t.bm, t.bn, t.bk),
                                       tma_store=t.tma_store)
            out[name].append((key, plan.breakdown.gemm_us / (ms * 1e3)))
    return dict(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("jsonl", nargs="+", help="bench_op JSONL files (rows with --variants)")
    parser.add_argument("--profile", nargs="+", default=["h100"],
                        help="hardware profiles to plan with (names or YAML paths)")
    parser.add_argument("--num-sms", type=int, default=132, help="SMs of the GPU the rows ran on")
    parser.add_argument("--seed", type=int, default=0, help="bench_op's --seed")
    parser.add_argument("--tie", type=float, default=0.0,
                        help="a choice within this fraction of the fastest tile counts as right")
    args = parser.parse_args(argv)
    if args.num_sms < 1 or args.tie < 0:
        parser.error(f"--num-sms {args.num_sms} / --tie {args.tie}: expected >= 1 / >= 0")
    rows = []
    for path in args.jsonl:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    workloads = measured_workloads(rows)
    on_gpu = gpu_choices(rows)
    if not workloads:
        print("no world-1 rows with nocomm[<tile>] variant timings (bench_op --variants)",
              file=sys.stderr)
        return 2
    for profile in args.profile:
        results = replay(workloads, profile, num_sms=args.num_sms, seed=args.seed,
                         tie=args.tie)
        print(f"== profile {profile}")
        for key, chosen, predicted, right in results:
            times = workloads[key]
            measured = " ".join(f"{t}={ms:.3f}" for t, ms in sorted(times.items()))
            pred = " ".join(f"{t}={us:.0f}" for t, us in predicted.items())
            gpu = on_gpu.get(key, ("?", None))[0]
            print(f"  {key[0]:<20} {key[1]:>6}  chose {chosen:<20} {'right' if right else 'WRONG'}"
                  f"  (the GPU run chose {gpu})  measured ms: {measured}  predicted us: {pred}")
        print(f"  right on {sum(r for *_, r in results)} of {len(results)}")
        for name, ratios in gemm_accuracy(workloads, profile, num_sms=args.num_sms,
                                          seed=args.seed).items():
            err = [abs(r - 1.0) for _, r in ratios]
            worst = max(ratios, key=lambda kr: abs(kr[1] - 1.0))
            print(f"  GEMM2 term / measured {name}: mean |error| {sum(err) / len(err):.3f} "
                  f"over {len(err)}, worst {worst[1]:.2f} ({worst[0][0]} {worst[0][1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
