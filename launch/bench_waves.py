"""The GEMM2 producer's time against its tile count around the grid's wave boundaries: does
a partial last wave cost a whole tile time, as the resource manager's wave model says?

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 1 \
        launch/bench_waves.py --out $OUT/waves.jsonl

The resource manager prices the GEMM2 as whole waves of the grid: ceil(tiles / G) x tau(F)
(`resource.model`, docs/resource_model.md), so a call whose last wave has a few tiles costs
as much as one whose last wave is full. This measures it: world 1, E experts (--experts,
top-k --topk), every expert the same rows (token t goes to experts t, t + 1, ..., t + k - 1
mod E: no routing draw), rows per expert = BM_unit x b for each b of --row-blocks (BM_unit
= 128, the default tile's BM), so the tile count moves by E x ceil(H / BN) per step (or per
two steps with BM = 256). For each tile of --tiles (names as `launch/bench_op.py
--variants` spells them) and F of --ffn, every b's GEMM2 alone (`_Call.gemm_only` on the
plan's grid, communication off, as `launch/calibrate.py`'s tile times) is timed with CUDA
events, the b's of one (tile, F) interleaved round by round (`bench_op.timed_interleaved`,
a Williams order) after --warmup rounds, median of --iters. One JSON row per (tile, F, b):
tiles, grid G, waves ceil(tiles / G), fill (tiles / G - waves + 1: the last wave's share of
the grid), the measured ms, the planner's predicted GEMM2 us (`Plan.breakdown.gemm_us`,
the profile's tile time) and ms per tile / per wave. Nothing here changes a profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_op (timing helpers)
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))  # run from a checkout without `pip install`

from megatron_overlap.bench.cli import (  # noqa: E402
    add_timing_args,
    check_launch_inputs,
    init_cuda_group,
    make_folder,
    positive_int,
)
from megatron_overlap.bench.workloads import balanced_routing_map as balanced_map  # noqa: E402

BM_UNIT = 128
"""Rows per row block of --row-blocks (the default tile's BM)."""

DEFAULT_TILES = ("128x256x64w8s3tma", "256x128x64w8s4")
"""The default tile at world 1 and `WIDE_TILE`: the two tiles `plan_call` chooses from."""


def tokens_for(row_blocks: int, num_experts: int, topk: int) -> int:
    """Tokens T whose balanced map gives every expert BM_UNIT x row_blocks rows.

    Raises:
        ValueError: no integer T does (BM_UNIT x row_blocks x E not divisible by topk, or
            T then not a multiple of E).
    """
    rows = BM_UNIT * row_blocks
    if rows * num_experts % topk or (rows * num_experts // topk) % num_experts:
        raise ValueError(f"row_blocks={row_blocks}: {rows} rows per expert need "
                         f"{rows * num_experts}/{topk} tokens, a multiple of "
                         f"{num_experts}; choose another --row-blocks or --topk")
    return rows * num_experts // topk


def wave_fields(tiles: int, grid: int) -> dict:
    """waves = ceil(tiles / grid); fill = the last wave's share of the grid (1: full)."""
    if tiles < 1 or grid < 1:
        raise ValueError(f"tiles={tiles}, grid={grid}: expected both >= 1")
    waves = -(-tiles // grid)
    return dict(waves=waves, fill=round(tiles / grid - waves + 1, 4))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--out", required=True, help="JSONL file to append rows to")
    parser.add_argument("--tiles", nargs="+", default=list(DEFAULT_TILES),
                        help="tile configurations (launch/bench_op.py --variants names)")
    parser.add_argument("--ffn", nargs="+", type=positive_int, default=[6400, 14336],
                        help="GEMM depths F (Phi-3.5-MoE's 6400, Mixtral's 14336)")
    parser.add_argument("--hidden", type=positive_int, default=4096, help="H")
    parser.add_argument("--experts", type=positive_int, default=8, help="E")
    parser.add_argument("--topk", type=positive_int, default=2, help="top-k")
    parser.add_argument("--row-blocks", nargs="+", type=positive_int,
                        default=list(range(26, 37)),
                        help=f"rows per expert in units of {BM_UNIT}")
    add_timing_args(parser, warmup=3, iters=20, per="per point")
    args = parser.parse_args(argv)
    import bench_op  # launch/bench_op.py: parse_tile, timed_interleaved, git_sha

    try:
        tiles = [bench_op.parse_tile(name)[0] for name in args.tiles]
        if not 1 <= args.topk <= args.experts:
            raise ValueError(f"--topk {args.topk}: expected 1..{args.experts} (--experts)")
        counts = [tokens_for(b, args.experts, args.topk) for b in args.row_blocks]
        check_launch_inputs(args.out, create=False)
    except ValueError as err:
        parser.error(str(err))

    import torch

    from megatron_overlap.bench.workloads import rank_rows
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call, epilogue_stores_tma
    from megatron_overlap.resource import load_profile, plan_gemm2_gatherrs
    from megatron_overlap.symm import get_workspace

    device = init_cuda_group(__file__)
    if device is None:
        return 2
    try:
        make_folder(args.out)
    except ValueError as err:
        parser.error(str(err))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    profile = load_profile()
    gen = torch.Generator(device=device).manual_seed(args.seed)
    ws = get_workspace(None, hidden=args.hidden, dtype=torch.bfloat16, device=device)
    common = dict(gpu=torch.cuda.get_device_name(device), hw_profile=profile.name,
                  git_sha=bench_op.git_sha(), hidden=args.hidden, experts=args.experts,
                  topk=args.topk, warmup=args.warmup, iters=args.iters)
    with open(args.out, "a") as out:
        for tile in tiles:
            tma = epilogue_stores_tma(tile, args.hidden, 2)
            shape = (tile.bm, tile.bn, tile.bk)
            priced = profile.has_tile_time(*shape, tma)
            if not priced:
                print(f"bench_waves: note: profile {profile.name!r} has no tile time for "
                      f"{tile.name}: its rows have predicted_gemm_us null (planned with the "
                      "default tile's time)", flush=True)
            for f in args.ffn:
                w2 = (torch.randn(args.experts, args.hidden, f, generator=gen, device=device)
                      / f**0.5).to(torch.bfloat16)
                points = []
                for b, n in zip(args.row_blocks, counts):
                    meta = rank_rows([balanced_map(n, args.experts, args.topk)], tp=1, ep=1,
                                     rank=0, topk=args.topk).meta.to(device)
                    rows = int(meta.tokens_per_local_expert.sum())
                    h = (torch.randn(rows, f, generator=gen, device=device) * 0.1).to(
                        torch.bfloat16)
                    plan = plan_gemm2_gatherrs(
                        meta, GatherRSOptions(backend="triton"), num_sms=num_sms,
                        hidden=args.hidden, ffn=f, tma_store=tma, profile=profile,
                        tile=shape if priced else (128, 256, 64))
                    call = _Call(meta, ws, plan, hidden=args.hidden, dtype=h.dtype,
                                 device=device, timeout_s=30.0, tile=tile)
                    call.run(h, w2)
                    tiles_n = -(-rows // args.experts // tile.bm) * args.experts * (
                        -(-args.hidden // tile.bn))
                    points.append((b, rows, tiles_n, plan, call))
                times = bench_op.timed_interleaved(
                    [lambda c=c, g=p.num_ctas: c.gemm_only(g) for _, _, _, p, c in points],
                    args.warmup, args.iters, 1.0)
                for (b, rows, tiles_n, plan, _), t in zip(points, times):
                    row = dict(common, bench="waves", tile=tile.name, ffn=f, row_blocks=b,
                               rows_per_expert=rows // args.experts, tiles=tiles_n,
                               grid=plan.num_ctas, **wave_fields(tiles_n, plan.num_ctas),
                               ms=t["p50"], p20_ms=t["p20"], p80_ms=t["p80"],
                               predicted_gemm_us=(plan.breakdown.gemm_us if priced else None),
                               us_per_wave=t["p50"] * 1e3 / -(-tiles_n // plan.num_ctas),
                               us_per_tile_x_grid=t["p50"] * 1e3 * plan.num_ctas / tiles_n)
                    out.write(json.dumps(row) + "\n")
                    print(f"{tile.name} F={f} b={b}: {tiles_n} tiles, "
                          f"{row['waves']} waves (fill {row['fill']:.2f}), "
                          f"{t['p50']:.3f} ms, {row['us_per_wave']:.1f} us/wave, "
                          f"predicted {row['predicted_gemm_us']}", flush=True)
                del points, times, w2, h
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
