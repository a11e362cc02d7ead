"""Oracle regret of the resource manager: the fused op at every k vs the plan (issue 4).

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \
        launch/oracle.py --out $OUT/oracle.jsonl
    python3 launch/oracle.py --dry-run --out /tmp/oracle.jsonl    # CPU: the solver only

For each workload of `megatron_overlap.bench.oracle.SUITE` (16: five model shapes x EP=2 /
TP=2 x uniform / skewed routing x tokens per rank, seed --seed; the module documents the
distributions), on the same inputs:
  grid  the fused Triton op forced to k communication CTAs on every rank
        (`GatherRSOptions(backend="triton", num_comm_ctas=k)`) for every feasible k
        (1..G-1) every --k-step (always k = 16, the old fixed choice, and G - 1);
        --k-step 0 (default) takes the smallest step whose runs fit --budget-s seconds
        over the suite, from the wall time of a few calls of each workload;
  plan  the op with the plan each rank's resource manager chose (`plan=`).
Times: CUDA events around one call (host work included), ranks lined up before every run
(`bench_op.timed`), median of --iters runs after --warmup, the slowest rank's median. Each
row also has the model's predicted time for that k (the slowest rank's). Prints a table
(plan vs oracle, regret, k = 16), mean / max regret; writes the JSON rows (--out), the
per-workload summary (<out>.summary.jsonl) and a plot (<out>.png): predicted vs measured
time of every run, and the regret per workload.

--dry-run (no GPU, one process): every rank's plan and the predicted time over the k grid
for each workload, from the same metadata; nothing is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_op (timing helpers)
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))  # run from a checkout without `pip install`

from megatron_overlap.bench import oracle  # noqa: E402
from megatron_overlap.bench.cli import (  # noqa: E402
    add_timing_args,
    check_launch_inputs,
    init_cuda_group,
    layout_label,
    layout_sizes,
    parse_layout,
    non_negative_int,
    positive_float,
    positive_int,
)
from megatron_overlap.bench.workloads import rank_rows, routing_maps  # noqa: E402
from megatron_overlap.config import GatherRSOptions  # noqa: E402

DIRECT = GatherRSOptions(backend="triton", prereduce=False)
"""The oracle studies the direct mode's communication CTAs, so the mode is fixed."""
from megatron_overlap.models import load_model_shape  # noqa: E402
from megatron_overlap.resource import plan_gemm2_gatherrs  # noqa: E402


def workload_metas(workload, world: int, seed: int, ranks=None):
    """(shape, tp, ep, {rank: metadata} for `ranks` (default all), [routing maps])."""
    model, layout, routing, tokens = workload
    shape = load_model_shape(model)
    tp, ep = layout_sizes(layout, world)
    maps = routing_maps([tokens] * world, shape.num_moe_experts, shape.moe_router_topk,
                        routing, seed=seed)
    metas = {g: rank_rows(maps, tp=tp, ep=ep, rank=g, topk=shape.moe_router_topk).meta
             for g in (range(world) if ranks is None else ranks)}
    return shape, tp, ep, metas, maps


def plan_for(meta, shape, tp, maps, rank, num_sms, options=None, profile=None):
    """The resource manager's plan of one rank (what the dispatcher would pass: the tile
    time of the epilogue the GPU's calls run, `MEGATRON_OVERLAP_TMA_STORE`'s)."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import _gpu_tile, epilogue_stores_tma

    return plan_gemm2_gatherrs(
        meta, options or DIRECT, num_sms=num_sms,
        hidden=shape.hidden_size, ffn=shape.moe_ffn_hidden_size // tp, elem_bytes=2,
        recv_rows=int(maps[rank].sum()) * tp, profile=profile,
        tma_store=epilogue_stores_tma(_gpu_tile(meta.group_size), shape.hidden_size, 2))


def dry_run(args) -> int:
    from megatron_overlap.resource.profile import load_profile

    profile = load_profile(args.profile)
    num_sms = args.num_sms or profile.gpu.num_sms
    rows = []
    _check_layouts(args, args.world)
    for w in _workloads(args):
        shape, tp, ep, metas, maps = workload_metas(w, args.world, args.seed)
        plans = [plan_for(m, shape, tp, maps, g, num_sms, profile=profile)
                 for g, m in metas.items()]
        grid = oracle.k_grid(plans[0].num_ctas, max(1, args.k_step))
        for k in grid:
            opts = GatherRSOptions(backend="triton", num_comm_ctas=min(k, num_sms),
                                   prereduce=False)
            pred = max(plan_for(m, shape, tp, maps, g, num_sms, opts, profile).predicted_us
                       for g, m in metas.items())
            rows.append(_row(w, "grid", k, None, pred / 1e3))
        rows.append(_row(w, "plan", plans[0].num_comm_ctas, None,
                         max(p.predicted_us for p in plans) / 1e3,
                         k_ranks=[p.num_comm_ctas for p in plans], num_ctas=plans[0].num_ctas,
                         k_step=max(1, args.k_step), source=plans[0].source,
                         layout_name=layout_label(tp, ep)))
        b = plans[0].breakdown
        ks = [p.num_comm_ctas for p in plans]
        print(f"{w[0]} {layout_label(tp, ep)} {w[2]} {w[3]}: plan k={ks} "
              f"of G={plans[0].num_ctas}, predicted {max(p.predicted_us for p in plans):.0f} us "
              f"(rank 0: T_r {b.remote_tiles}, T_l {b.local_tiles}, tau {b.tile_us:.1f} us, "
              f"R {b.remote_bound_us:.0f}, W {b.wave_bound_us:.0f})", flush=True)
    _write(args.out, rows)
    print(f"dry run: {len(rows)} rows (predicted only) -> {args.out}")
    return 0


def _row(w, kind, k, t, predicted_ms, **extra):
    model, layout, routing, tokens = w
    d = dict(model=model, layout=layout, routing=routing, tokens_per_rank=tokens, kind=kind,
             k=k, predicted_ms=predicted_ms)
    if t is not None:
        d.update(p20_ms=t[0], p50_ms=t[1], p80_ms=t[2])
    d.update(extra)
    return d


def _workloads(args):
    ws = oracle.suite(args.models)
    if args.tokens:
        ws = [(m, lay, r, t) for m, lay, r, _ in ws for t in args.tokens]
    if args.layouts:
        ws = [(m, lay, r, t) for m, _, r, t in ws for lay in args.layouts]
    return list(dict.fromkeys(ws))


def _check_layouts(args, world: int) -> None:
    """Every --layouts entry must split `world` ranks (ValueError naming it)."""
    for layout in args.layouts or ():
        layout_sizes(layout, world)


def _write(path, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def gpu_run(args) -> int:
    import bench_op  # launch/bench_op.py: timed(), git_sha()
    import torch
    import torch.distributed as dist

    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs

    device = init_cuda_group(__file__, "; --dry-run runs on a CPU")
    if device is None:
        return 2
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        _check_layouts(args, world)
    except ValueError as err:
        if rank == 0:
            print(f"oracle.py: error: --layouts: {err}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    group = dist.group.WORLD if world > 1 else None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    info = dict(gpu=torch.cuda.get_device_name(device), world=world, git_sha=bench_op.git_sha(),
                timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                torch=torch.__version__)
    workloads = _workloads(args)
    budget_each = args.budget_s / max(1, len(workloads))
    rows = []
    start_all = time.perf_counter()
    for w in workloads:
        shape, tp, ep, metas, maps = workload_metas(w, world, args.seed, ranks=[rank])
        meta = metas[rank].to(device)
        ffn, hidden = shape.moe_ffn_hidden_size // tp, shape.hidden_size
        n = int(meta.tokens_per_local_expert.sum())
        gen = torch.Generator(device=device).manual_seed(args.seed + rank)
        h = (torch.randn(n, ffn, generator=gen, device=device) * 0.1).to(torch.bfloat16)
        w2 = (torch.randn(meta.num_local_experts, hidden, ffn, generator=gen, device=device)
              / ffn**0.5).to(torch.bfloat16)
        plan = plan_for(meta, shape, tp, maps, rank, num_sms)

        def prep(options=None, plan_=None, h=h, w2=w2, meta=meta):
            return prepare_gemm2_gatherrs(
                h, w2, meta, group=group,
                options=options or DIRECT, plan=plan_)

        def run(options=None, plan_=None, h=h, w2=w2, meta=meta):
            return gemm2_gatherrs(h, w2, meta, group=group,
                                  options=options or DIRECT, plan=plan_)

        with torch.no_grad():
            run(plan_=plan)  # compile + warm up
            t0 = time.perf_counter()
            bench_op.timed(lambda: run(plan_=plan), 0, 3)
            per_run = torch.tensor([(time.perf_counter() - t0) / 3], device=device)
            if group is not None:
                dist.all_reduce(per_run, op=dist.ReduceOp.MAX)
            step = args.k_step or oracle.auto_step(plan.num_ctas, float(per_run),
                                                   args.warmup + args.iters, budget_each)
            grid = oracle.k_grid(plan.num_ctas, step)
            # Prepared calls, as the layer runs them (host work overlaps FC1 there); every k
            # and the plan measured interleaved, round by round (noise hits all alike).
            options = [GatherRSOptions(backend="triton", num_comm_ctas=min(k, num_sms),
                                   prereduce=False)
                       for k in grid]
            prepares = [lambda o=o: prep(options=o) for o in options]
            times = bench_op.timed_prepared_interleaved(
                prepares + [lambda: prep(plan_=plan)], h, w2, args)
            new = []
            for k, o, t in zip(grid, options, times):
                pred = plan_for(meta, shape, tp, maps, rank, num_sms, o).predicted_us / 1e3
                new.append((k, _slowest(t, pred, device, group)))
            plan_vals = _slowest(times[-1], plan.predicted_us / 1e3, device, group)
        ks = [plan.num_comm_ctas] * world
        if group is not None:
            gathered = [None] * world
            dist.all_gather_object(gathered, plan.num_comm_ctas)
            ks = gathered
        for k, vals in new:
            rows.append(_row(w, "grid", k, vals[:3], vals[3], **info))
        rows.append(_row(w, "plan", plan.num_comm_ctas, plan_vals[:3], plan_vals[3],
                         k_ranks=ks, num_ctas=plan.num_ctas, k_step=step, source=plan.source,
                         layout_name=layout_label(tp, ep), **info))
        if rank == 0:
            s = oracle.summarize(rows[-len(new) - 1:])[0]
            print(f"{w[0]} {layout_label(tp, ep)} {w[2]} {w[3]}: plan k={ks} "
                  f"{s['t_plan_ms']:.3f} ms, "
                  f"oracle k={s['k_oracle']} {s['t_oracle_ms']:.3f} ms, regret "
                  f"{100 * s['regret']:.2f} % ({len(grid)} k, step {step}; "
                  f"{time.perf_counter() - start_all:.0f} s so far)", flush=True)
        del h, w2
        torch.cuda.empty_cache()
    if rank == 0:
        summary = oracle.summarize(rows)
        print(oracle.table(summary))
        _write(args.out, rows)
        _write(os.path.splitext(args.out)[0] + ".summary.jsonl",
               [dict(s, **info) for s in summary])
        try:
            oracle.plot(rows, summary, os.path.splitext(args.out)[0] + ".png")
        except ImportError:
            print("matplotlib missing: no plot")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _slowest(t, predicted_ms, device, group):
    """(p20, p50, p80, predicted) maxima over the ranks."""
    import torch
    import torch.distributed as dist

    vals = torch.tensor([t["p20"], t["p50"], t["p80"], predicted_ms], device=device)
    if group is not None:
        dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    return [float(v) for v in vals]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(oracle.MODELS),
                        help="model shapes (configs/models/*.yaml) of the suite")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=None,
                        help="replace the suite's tokens per rank with these")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help="replace the suite's layouts ('ep': EP = world, 'tp': TP = "
                             "world) with these: 'ep', 'tp' or tpXepY names with TP x EP = "
                             "world, e.g. tp2ep2 on 4 GPUs")
    parser.add_argument("--k-step", type=non_negative_int, default=0,
                        help="measure every k-th feasible k (0: fit --budget-s)")
    parser.add_argument("--budget-s", type=positive_float, default=200.0,
                        help="seconds of timed runs over the whole suite for --k-step 0")
    add_timing_args(parser, warmup=3, iters=20, per="per k",
                    iters_help="; >= 20 for the issue's oracle")
    parser.add_argument("--out", default=None,
                        help="JSON rows (appended); summary, table and plot next to it "
                             "(default results/oracle.jsonl; with --dry-run "
                             "results/oracle_dry_run.jsonl, so predicted-only rows never mix "
                             "with measured ones)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: plans and predicted times only (one process)")
    parser.add_argument("--world", type=positive_int, default=2, help="ranks of the --dry-run")
    parser.add_argument("--num-sms", type=positive_int, default=None,
                        help="SMs for --dry-run (default: the profile's)")
    parser.add_argument("--profile", default=None, help="hardware profile for --dry-run")
    args = parser.parse_args(argv)
    args.models = list(dict.fromkeys(args.models))  # each once, in order
    args.tokens = list(dict.fromkeys(args.tokens)) if args.tokens else args.tokens
    if args.k_step < 0 or args.iters < 1 or args.warmup < 0 or args.world < 1:
        parser.error("--k-step >= 0, --iters >= 1, --warmup >= 0, --world >= 1 expected")
    if not args.dry_run:
        given = [f"--{n.replace('_', '-')}" for n in ("num_sms", "profile")
                 if getattr(args, n) is not None]
        given += ["--world"] if args.world != parser.get_default("world") else []
        if given:
            parser.error(f"{', '.join(given)}: only with --dry-run (a GPU run uses its world "
                         "size, SM count and the calibrated profile)")
    from megatron_overlap.resource.model import MAX_CTAS

    if args.num_sms is not None and args.num_sms > MAX_CTAS:
        parser.error(f"--num-sms {args.num_sms}: expected at most {MAX_CTAS} (the resource "
                     "model's CTA bound, resource.model.MAX_CTAS)")
    if args.out is None:
        args.out = "results/oracle_dry_run.jsonl" if args.dry_run else "results/oracle.jsonl"
    try:  # names that need no GPU are checked before any work
        for model in args.models:
            load_model_shape(model)
        if args.dry_run:
            from megatron_overlap.resource.profile import load_profile

            load_profile(args.profile)
        check_launch_inputs(args.out, create=False)  # its folder: made by `_write`
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    for layout in args.layouts or ():
        try:  # the name now; against the world size where it is known (dry run: --world)
            if args.dry_run:
                layout_sizes(layout, args.world)
            elif layout not in ("ep", "tp"):
                parse_layout(layout)
        except (ValueError, argparse.ArgumentTypeError) as err:
            parser.error(f"--layouts: {err}")
    if args.dry_run:
        try:
            return dry_run(args)
        except ValueError as err:  # a workload that does not fit the layout or the SMs
            parser.error(str(err))
    return gpu_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
