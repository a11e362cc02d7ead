"""Measure the resource manager's hardware profile once on a GPU machine; write its YAML.

    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \
        launch/calibrate.py --name h200 --out $OUT/h200.yaml
    python3 launch/calibrate.py --dry-run --out /tmp/h200.yaml     # CPU: no measurement

What it measures (CUDA events, median of --iters runs after --warmup; rank 0's values are
written, every rank measures alike at the same time, as in the fused op):
  tile time  the fused kernel's GEMM2 tiles alone (`_Call.gemm_only` on the plan's grid G,
             world-1 metadata, H = each --hidden, top-2; --sweep whole-waves, the default
             since v6.2: a balanced routing map whose experts and rows fill 16 whole
             waves of every tile below, so time / waves is each tile's per-wave time;
             --sweep uniform: 8 experts, --tokens tokens of uniform routing) for every
             F in --ffn, every tile below on the same operands and timed interleaved
             (since v6.2): tau(F) = time / ceil(tiles / G); then a least-squares fit
             tau = alpha + beta * ceil(F / BK) (alpha, beta >= 0); the register-store
             epilogue (`DEFAULT_TILE`, whatever $MEGATRON_OVERLAP_TMA_STORE says),
             and with --tma-store also the TMA-store one (`DEFAULT_TMA_TILE`): a second
             tile_times entry with `tma_store: true` (without the flag, the base
             profile's TMA-store entry is copied, and the header says so); then each
             of --tiles (default: all of `ops.triton_gemm2_gatherrs.TILE_CANDIDATES`,
             the tiles the resource manager may choose per call), one entry each (the
             base's entries of other shapes are not copied: a candidate the run did
             not measure is not offered); one set of entries per --hidden, each with
             its `hidden` (since v6.5; the resource manager takes the entry nearest a
             call's H: on one H100 the tiles' ratio moved 4 % between H = 2048 and
             4096, docs/perf_notes.md v6.5);
  last wave  for each swept tile and each F in --tail-ffn (since v6.3), the GEMM2 at two
             whole wave counts N0, N1 and at N0 waves plus a last wave ~1/4, 1/2, 3/4 full
             (`bench.workloads.tail_sweep`: top-1 routing on 8 experts), timed
             interleaved: the per-wave time is (t(N1) - t(N0)) / (N1 - N0), and each
             part-filled point's time over t(N0) is fill + eta x (1 - fill) waves; the
             least-squares eta over every F, clipped to [0, 1], is the tile's
             `idle_wave_cost` (1: whole waves; the resource model prices a part-filled
             last wave with it), at the first --hidden only, given to the tile's
             entries at every --hidden;
  tile fill  for each swept tile, each --hidden and each F in --fill-ffn (since v6.6), the
             GEMM2 on `bench.workloads.fill_sweep`'s points: the same whole waves of
             tiles, one row block per expert, r = BM/8, BM/4, BM/2, 3BM/4, BM rows valid,
             timed interleaved: each point's time over the full one's, the mean over the
             F's, is the entry's `fill_cost` (what a tile with r valid rows costs; the
             resource model scales a call's tile time by its tiles' mean cost; on one H100
             0.87-0.93 at r <= BM/4 and F <= 1408, 0.93-1.0 at F = 6400,
             docs/perf_notes.md v6.6);
  streaming  for each swept tile, each --hidden and each F in --stream-ffn (since v6.7), the
             GEMM2 on `bench.workloads.stream_sweep`'s points: whole waves of full tiles,
             experts of 1, 2 and 3 row blocks, timed interleaved: the one-block points'
             bytes per wave over their time is the entry's `stream_gbps` (each weight
             slice read once), and the re-read fraction that fits the 2- and 3-block
             points its `reread` (`fit_stream`; the resource model prices each tile at
             the larger of its compute time and its HBM bytes at that bandwidth);
  peer stores  `kernels.peer_store` with k CTAs for k in --ctas, every rank storing
             --store-mib MiB into its neighbour's symmetric buffer at once: B_link = the
             largest bandwidth seen, B_cta = the largest bandwidth per CTA at k <= 4;
  HBM        a --copy-mib MiB device copy: (read + written bytes) / time;
  launches   two launches of an empty kernel (launch_overhead_us); one CTA storing one
             32 KiB tile to the peer, less one empty launch (store_latency_us).
The GPU limits (SMs, registers, shared memory, threads) come from the device properties
where torch reports them, else from the --base profile. With one rank the link values are
copied from --base (said in the output), and so is prereduce_host_us always (a host cost:
launch/bench_op.py's ours_prereduced_host - ours_host). --dry-run measures nothing: it
feeds the fits with values generated from --base's own model, so that the fitting and
writing path runs on CPU. --name and --base default to the GPU's shipped profile
(`resource.profile.DEVICE_PROFILES`: h100 on an SXM H100, h200 on an H200); on any other GPU
both must be given (exit 2 otherwise); with --dry-run --base defaults to h200 and --name to
the base's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import warnings
from typing import Dict, List, Sequence, Tuple

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_op (timing helpers)
if os.path.dirname(_HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(_HERE))  # run from a checkout without `pip install`

from megatron_overlap.bench.cli import (  # noqa: E402
    add_timing_args,
    check_launch_inputs,
    init_cuda_group,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from megatron_overlap.bench.workloads import STREAM_ROW_BLOCKS  # noqa: E402
from megatron_overlap.resource import DEFAULT_TILE  # noqa: E402
from megatron_overlap.resource.profile import (  # noqa: E402
    DEFAULT_PROFILE,
    DEVICE_PROFILES,
    GpuLimits,
    HardwareProfile,
    TileTime,
    device_profile_name,
    load_profile,
    save_profile,
)

DEFAULT_FFN = (384, 704, 768, 1408, 3200, 6400, 7168, 14336)
"""The F (per TP rank) of the oracle suite's shapes (EP=2 and TP=2): each is one kernel
compilation, so --ffn with fewer values shortens a run."""
DEFAULT_TAIL_FFN = (1408, 6400, 14336)
"""The F of the last-wave sweep: a fine-grained (Qwen1.5-MoE / DeepSeek-V2-Lite) and the
two coarse models' depths."""
DEFAULT_FILL_FFN = (768, 1408, 6400)
"""The F of the part-filled tile sweep: the fine-grained models' depths, where experts get
few rows and many tiles are part-filled, and one coarse one."""
DEFAULT_STREAM_FFN = (768, 1408, 6400)
"""The F of the weight-streaming sweep: as the part-filled one's."""
DEFAULT_CTAS = (1, 2, 4, 8, 16, 32, 64, 0)  # 0: the whole grid (one CTA per SM)
STREAM_ELEM_BYTES = 2
"""Element size of the sweeps' operands (bf16)."""


def fit_tile_time(ksteps: Sequence[int], tau_us: Sequence[float]) -> Tuple[float, float]:
    """Least-squares (alpha_us, beta_us) of tau = alpha + beta * ksteps, both >= 0.

    Raises:
        ValueError: fewer than two distinct K-step counts, or a non-positive time.
    """
    x, y = np.asarray(ksteps, dtype=float), np.asarray(tau_us, dtype=float)
    if len(set(x.tolist())) < 2 or len(x) != len(y):
        raise ValueError(f"need >= 2 distinct K-step counts with one time each, got {ksteps}")
    if (y <= 0).any():
        raise ValueError(f"tile times must be > 0 us, got {tau_us}")
    beta, alpha = np.polyfit(x, y, 1)
    if beta < 0:  # flat: a constant tile time
        return float(y.mean()), 0.0
    if alpha < 0:  # through the origin
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(alpha), float(beta)


def fit_idle_wave_cost(rows: Sequence[dict]) -> float:
    """eta of one tile from its last-wave sweep rows (`measure_tails`; each: ffn, waves,
    fill, point "whole" / "partial", ms): per F, the per-wave time u = (t(N1) - t(N0)) /
    (N1 - N0) of its two whole points, then for each partial point y = (t - t(N0)) / u -
    fill = eta x (1 - fill); the least-squares eta over every F's partial points
    (sum (1 - fill) y / sum (1 - fill)^2), clipped to [0, 1], rounded to 3 decimals.

    Raises:
        ValueError: an F without exactly two whole points, a per-wave time <= 0, or no
            partial point.
    """
    by_f: Dict[int, List[dict]] = {}
    for r in rows:
        by_f.setdefault(r["ffn"], []).append(r)
    num = den = 0.0
    for f, group in sorted(by_f.items()):
        whole = sorted((r for r in group if r["point"] == "whole"), key=lambda r: r["waves"])
        if len(whole) != 2:
            raise ValueError(f"F={f}: expected two whole-wave points, got {len(whole)}")
        per_wave = (whole[1]["ms"] - whole[0]["ms"]) / (whole[1]["waves"] - whole[0]["waves"])
        if not per_wave > 0:
            raise ValueError(f"F={f}: per-wave time {per_wave} ms from the whole points "
                             f"{[(r['waves'], r['ms']) for r in whole]}: expected > 0")
        for r in group:
            if r["point"] == "partial":
                x = 1.0 - r["fill"]
                num += x * ((r["ms"] - whole[0]["ms"]) / per_wave - r["fill"])
                den += x * x
    if den == 0:
        raise ValueError("no part-filled last-wave point to fit idle_wave_cost from")
    return round(min(1.0, max(0.0, num / den)), 3)


def fit_fill_cost(rows: Sequence[dict]) -> Tuple[Tuple[int, float], ...]:
    """`TileTime.fill_cost` of one tile entry from its part-filled sweep rows
    (`measure_fills`; each: bm, ffn, valid_rows, ms): per F, each point's time over the
    full point's (valid_rows = bm), then per valid_rows < bm the mean over the F's, clipped
    to (0, 1], made non-decreasing in valid_rows (`monotone_fit`) and rounded to 4
    decimals.

    Raises:
        ValueError: an F without exactly one full point, a time <= 0.
    """
    by_f: Dict[int, List[dict]] = {}
    for r in rows:
        by_f.setdefault(r["ffn"], []).append(r)
    ratios: Dict[int, List[float]] = {}
    for f, group in sorted(by_f.items()):
        full = [r for r in group if r["valid_rows"] == r["bm"]]
        if len(full) != 1 or not full[0]["ms"] > 0 or any(not r["ms"] > 0 for r in group):
            raise ValueError(f"F={f}: expected one full-tile point and times > 0, got "
                             f"{[(r['valid_rows'], r['ms']) for r in group]}")
        for r in group:
            if r["valid_rows"] < r["bm"]:
                ratios.setdefault(r["valid_rows"], []).append(r["ms"] / full[0]["ms"])
    points = sorted((r, min(1.0, max(1e-4, float(np.mean(v))))) for r, v in ratios.items())
    costs = monotone_fit([c for _, c in points])
    return tuple((r, round(c, 4)) for (r, _), c in zip(points, costs))


def stream_tile_bytes(bm: int, bn: int, hidden: int, ffn: int, row_blocks: int,
                      reread: float, elem_bytes: int = STREAM_ELEM_BYTES) -> float:
    """HBM bytes of one full tile of an expert with `row_blocks` row blocks, as the
    resource model counts them (`resource.model.stream_tau_ps`, there in integers): the
    BN-column weight slice once plus `reread` of it for each other row block, shared by
    the row blocks; the BM rows' activations, shared by the ceil(H / BN) column tiles; the
    BM x BN outputs."""
    cols = -(-hidden // bn)
    return (bn * ffn * elem_bytes * (1.0 + (row_blocks - 1) * reread) / row_blocks
            + bm * ffn * elem_bytes / cols + bm * bn * elem_bytes)


def fit_stream(rows: Sequence[dict], alpha_us: float, beta_us: float) -> Tuple[float, float]:
    """(`TileTime.stream_gbps`, `reread`) of one tile entry from its streaming sweep rows
    (`measure_streams`; each: bm, bn, bk, hidden, ffn, grid, row_blocks, waves, ms) and
    the entry's fitted tile time alpha + beta x ceil(F / BK) (us). stream_gbps: the mean
    over F of the one-row-block points' G x bytes per tile / time per wave (each weight
    slice read once, by one tile), rounded to 0.1 GB/s. reread: the q in 0, 0.01, .., 1
    whose model time per wave, max(tau(F), G x bytes(q) / stream_gbps), is nearest (least
    squares of the relative error) the points of 2 and more row blocks; the smallest q
    of the least error, so 0 where every such point is compute-bound (the term then
    cannot tell). No multi-block point: 0.

    Raises:
        ValueError: no one-row-block point, a time <= 0.
    """
    if any(not r["ms"] > 0 for r in rows):
        raise ValueError(f"streaming sweep: expected times > 0, got "
                         f"{[(r['row_blocks'], r['ffn'], r['ms']) for r in rows]}")
    ones = [r for r in rows if r["row_blocks"] == 1]
    if not ones:
        raise ValueError(f"streaming sweep: no one-row-block point among "
                         f"{sorted({r['row_blocks'] for r in rows})}")

    def per_wave_us(r):
        return r["ms"] * 1e3 / r["waves"]

    gbps = float(np.mean([
        r["grid"] * stream_tile_bytes(r["bm"], r["bn"], r["hidden"], r["ffn"], 1, 0.0)
        / (per_wave_us(r) * 1e3) for r in ones]))
    gbps = round(gbps, 1)
    multi = [r for r in rows if r["row_blocks"] > 1]
    if not multi:
        return gbps, 0.0
    best = None
    for i in range(101):
        q = i / 100
        err = 0.0
        for r in multi:
            tau = alpha_us + beta_us * -(-r["ffn"] // r["bk"])
            mem = (r["grid"] * stream_tile_bytes(r["bm"], r["bn"], r["hidden"], r["ffn"],
                                                 r["row_blocks"], q) / (gbps * 1e3))
            err += (max(tau, mem) / per_wave_us(r) - 1.0) ** 2
        if best is None or err < best[0] - 1e-12:
            best = (err, q)
    return gbps, best[1]


def monotone_fit(values: Sequence[float]) -> List[float]:
    """The least-squares non-decreasing sequence nearest `values` (pool adjacent violators,
    equal weights): a tile with fewer valid rows never costs more than one with more, so a
    measured dip (noise: `WIDE_TILE`'s 64-row point below its 32-row one on one H100,
    docs/perf_notes.md v6.6) is averaged with its neighbours instead of entering the
    model."""
    blocks: List[List[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


def fit_link(ctas: Sequence[int], gbps: Sequence[float]) -> Tuple[float, float]:
    """(B_link, B_cta) from a peer-store sweep: the best bandwidth, and the best bandwidth per
    CTA among k <= 4 (the smallest k when none is).

    Raises:
        ValueError: empty sweep or a non-positive bandwidth.
    """
    if not ctas or len(ctas) != len(gbps) or min(gbps) <= 0 or min(ctas) < 1:
        raise ValueError(f"bad peer-store sweep: ctas {ctas}, GB/s {gbps}")
    small = [(k, b) for k, b in zip(ctas, gbps) if k <= 4] or [min(zip(ctas, gbps))]
    return float(max(gbps)), float(max(b / k for k, b in small))


def candidate_tiles(names=None) -> list:
    """The TileConfigs of --tiles: `names` as launch/bench_op.py's --variants spells them
    (`TileConfig.name`), each one of `ops.triton_gemm2_gatherrs.TILE_CANDIDATES` (None: all
    of them). A profile entry is keyed by shape and epilogue, and the planner reads it as the
    time of the candidate of that shape, so only the candidates' own configurations may be
    measured into one.

    Raises:
        ValueError: a name that is not a candidate's, or a repeat (the message lists them).
    """
    from megatron_overlap.ops.triton_gemm2_gatherrs import TILE_CANDIDATES

    if names is None:
        return list(TILE_CANDIDATES)
    by_name = {t.name: t for t in TILE_CANDIDATES}
    tiles = []
    for name in names:
        if name not in by_name:
            raise ValueError(f"{name!r}: expected one of the resource manager's candidate "
                             f"tiles {sorted(by_name)} (ops.triton_gemm2_gatherrs."
                             "TILE_CANDIDATES; the default tile is measured anyway)")
        if by_name[name] in tiles:
            raise ValueError(f"{name!r} listed twice")
        tiles.append(by_name[name])
    return tiles


def gpu_limits(base: GpuLimits, props=None) -> GpuLimits:
    """`base` with the values the device properties report (torch names vary by version)."""
    if props is None:
        return base
    names = {
        "num_sms": "multi_processor_count",
        "registers_per_sm": "regs_per_multiprocessor",
        "shared_bytes_per_sm": "shared_memory_per_multiprocessor",
        "max_shared_bytes_per_cta": "shared_memory_per_block_optin",
        "max_threads_per_sm": "max_threads_per_multi_processor",
    }
    found = {ours: int(getattr(props, theirs)) for ours, theirs in names.items()
             if isinstance(getattr(props, theirs, None), int) and getattr(props, theirs) > 0}
    return dataclasses.replace(base, **found)


def _row_key(row: dict) -> Tuple[int, int, int, bool]:
    """(bm, bn, bk, tma_store) of a tile-sweep row (rows without a shape: `DEFAULT_TILE`'s,
    as calibrate.py wrote them before v6.1; without tma_store: False)."""
    bm, bn, bk = (row.get(k, d) for k, d in zip(("bm", "bn", "bk"), DEFAULT_TILE))
    return (bm, bn, bk, bool(row.get("tma_store", False)))


def _entry_key(row: dict):
    """(bm, bn, bk, tma_store, hidden) of a tile-sweep row: one tile_times entry each
    (hidden None: a row written before v6.5, whose H was not recorded)."""
    return _row_key(row) + (row.get("hidden"),)


def build_profile(name: str, base: HardwareProfile, gpu: GpuLimits, tile_rows: List[dict],
                  store_rows: List[dict], hbm_gbps: float, launch_us: float,
                  latency_us: float, source: str, link_from_base: bool,
                  tail_rows: Sequence[dict] = (),
                  fill_rows: Sequence[dict] = (),
                  stream_rows: Sequence[dict] = ()) -> HardwareProfile:
    """The profile from the measured rows (`tile_rows`: bm, bn, bk (absent: `DEFAULT_TILE`),
    ksteps, tau_us, ctas_per_sm, tma_store (absent: False) and hidden (absent: None), one
    tile_times entry fitted per tile shape, epilogue and H, the default tile's first, each
    shape's entries by H; `store_rows`: ctas, gbps; `tail_rows`: the last-wave sweep
    (`measure_tails`), each shape and epilogue's `idle_wave_cost` fitted from its own rows
    (`fit_idle_wave_cost`, whatever their H) and given to its entries at every H, 1.0
    (whole waves) for one without any, which `extra.idle_wave_cost_measured` lists as
    false; `fill_rows`: the part-filled tile sweep (`measure_fills`), each entry's
    `fill_cost` fitted from the rows of its own shape, epilogue and H (`fit_fill_cost`),
    empty (every tile priced as a full one) for an entry without any; `stream_rows`: the
    weight-streaming sweep (`measure_streams`), each entry's `stream_gbps` and `reread`
    fitted from the rows of its own shape, epilogue and H (`fit_stream`, with the entry's
    fitted tile time), 0 and 0 (no streaming term) for an entry without any)."""
    bm, bn, bk = DEFAULT_TILE
    entries = []
    measured_idle: Dict[str, bool] = {}
    keys = sorted({_entry_key(r) for r in tile_rows},  # the default tile first, then by H
                  key=lambda k: (k[:3] != DEFAULT_TILE, k[:3], k[3], k[4] or 0))
    for key in keys:
        rows = [r for r in tile_rows if _entry_key(r) == key]
        alpha, beta = fit_tile_time([r["ksteps"] for r in rows], [r["tau_us"] for r in rows])
        tails = [r for r in tail_rows if _row_key(r) == key[:4]]
        idle = fit_idle_wave_cost(tails) if tails else 1.0
        fills = [r for r in fill_rows if _entry_key(r) == key]
        measured_idle[f"{key[0]}x{key[1]}x{key[2]}{'tma' if key[3] else ''}"] = bool(tails)
        alpha, beta = round(alpha, 4), round(beta, 5)
        streams = [r for r in stream_rows if _entry_key(r) == key]
        stream_gbps, reread = fit_stream(streams, alpha, beta) if streams else (0.0, 0.0)
        entries.append(TileTime(bm=key[0], bn=key[1], bk=key[2],
                                ctas_per_sm=rows[0]["ctas_per_sm"],
                                alpha_us=alpha, beta_us=beta,
                                tma_store=key[3], idle_wave_cost=idle, hidden=key[4],
                                fill_cost=fit_fill_cost(fills) if fills else (),
                                stream_gbps=stream_gbps, reread=reread))
    # A TMA-store time not measured here (no --tma-store): the base's, where it has one (at
    # every H it has one for), so that a re-calibration without the flag does not drop it
    # (`tma_store_copied_from_base`).
    copied_tma = not any(t.tma_store and t.shape == (bm, bn, bk) for t in entries) and any(
        t.tma_store and t.shape == (bm, bn, bk) for t in base.tile_times)
    if copied_tma:
        last_default = max(i for i, t in enumerate(entries) if t.shape == (bm, bn, bk))
        entries[last_default + 1:last_default + 1] = [
            t for t in base.tile_times if t.tma_store and t.shape == (bm, bn, bk)]
    # (The base's entries of other shapes are never copied: the tile choice compares them
    # with this run's default-tile time, so one from another run or GPU would decide it.)
    if link_from_base:
        b_link, b_cta = base.link_bandwidth_gbps, base.cta_bandwidth_gbps
    else:
        b_link, b_cta = fit_link([r["ctas"] for r in store_rows], [r["gbps"] for r in store_rows])
    return HardwareProfile(
        name=name, gpu=gpu,
        tile_times=tuple(entries),
        link_bandwidth_gbps=round(b_link, 2), cta_bandwidth_gbps=round(b_cta, 3),
        store_latency_us=round(max(0.0, latency_us), 3), hbm_bandwidth_gbps=round(hbm_gbps, 1),
        launch_overhead_us=round(max(0.0, launch_us), 3),
        # not measured here (a host cost, from bench_op's ours_prereduced_host - ours_host)
        prereduce_host_us=base.prereduce_host_us, provisional=False, source=source,
        extra={"tile_sweep": tile_rows, "tail_sweep": list(tail_rows),
               **({"fill_sweep": list(fill_rows)} if fill_rows else {}),
               **({"stream_sweep": list(stream_rows)} if stream_rows else {}),
               "idle_wave_cost_measured": measured_idle, "peer_store_sweep": store_rows,
               "link_values_copied_from_base": link_from_base,
               "tma_store_copied_from_base": copied_tma,

               "prereduce_host_us_copied_from_base": base.name})


def _synthetic_tile_time(base: HardwareProfile, shape, tma: bool, hidden=None) -> TileTime:
    """--dry-run's tile time of `shape` at H = `hidden` (None: the first entry): the base's
    entry for it (its register-store one where it has no TMA-store entry, without the
    warning: the caller says so), else the default tile's register-store entry."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (base.tile_time(*shape, tma_store=tma, hidden=hidden)
                if base.has_tile_time(*shape)
                else base.tile_time(*DEFAULT_TILE, hidden=hidden))


def _with_placeholder_times(base: HardwareProfile, shape, tma_store: bool) -> HardwareProfile:
    """`base` with a placeholder tile time (1 + 1 x K steps us) for `shape` where it has
    none, register and (with `tma_store`) TMA-store entries, so that a plan counts this
    tile's tiles and grid for a tile new to the profile (the time only sets k, and at world 1
    no tile is remote)."""
    return dataclasses.replace(base, tile_times=base.tile_times + tuple(
        TileTime(*shape, ctas_per_sm=1, alpha_us=1.0, beta_us=1.0, tma_store=tma)
        for tma in {False, tma_store} if not base.has_tile_time(*shape, tma)))


def synthetic_tails(base: HardwareProfile, tail_ffns, num_sms: int, hidden: int,
                    tma_store: bool = False, tiles=()) -> List[dict]:
    """--dry-run: the last-wave sweep's rows if the base profile were exact: each point's time
    from the base's tile time and `idle_wave_cost` (so the fit gives the base's value back),
    for the tiles `synthetic_measurements` sweeps, one CTA per SM."""
    from megatron_overlap.bench.workloads import tail_sweep
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TMA_TILE

    rows = []
    sweeps = [(REGISTER_TILE, False)] + ([(DEFAULT_TMA_TILE, True)] if tma_store else [])
    for config, tma in sweeps + [(t, t.tma_store) for t in tiles]:
        shape = (config.bm, config.bn, config.bk)
        t = _synthetic_tile_time(base, shape, tma, hidden)
        for f in tail_ffns:
            tau_ms = (t.alpha_us + t.beta_us * -(-f // shape[2])) * 1e-3
            for p in tail_sweep(config.bm, config.bn, num_sms, hidden=hidden):
                full = math.floor(p.waves + 1e-9)
                waves = (p.waves if p.fill == 1.0
                         else full + p.fill + t.idle_wave_cost * (1.0 - p.fill))
                rows.append(dict(tile=config.name, bm=shape[0], bn=shape[1], bk=shape[2],
                                 tma_store=tma, ffn=f, tiles=p.tiles, grid=num_sms,
                                 waves=round(p.waves, 6), fill=p.fill,
                                 point="whole" if p.fill == 1.0 else "partial",
                                 ms=0.005 + waves * tau_ms))
    return rows


def synthetic_fills(base: HardwareProfile, fill_ffns, num_sms: int, hidden: int,
                    tma_store: bool = False, tiles=()) -> List[dict]:
    """--dry-run: the part-filled tile sweep's rows at H = `hidden` if the base profile were
    exact: each point's time from the base's entry (its tau and `fill_ppm_table`; a full
    tile's cost where it has none), so the fit gives the base's costs back at the sweep's
    points, for the tiles `synthetic_measurements` sweeps, one CTA per SM."""
    from megatron_overlap.bench.workloads import fill_sweep
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TMA_TILE

    rows = []
    sweeps = [(REGISTER_TILE, False)] + ([(DEFAULT_TMA_TILE, True)] if tma_store else [])
    for config, tma in sweeps + [(t, t.tma_store) for t in tiles]:
        shape = (config.bm, config.bn, config.bk)
        t = _synthetic_tile_time(base, shape, tma, hidden)
        table = t.fill_ppm_table if t.bm == config.bm else None
        for f in fill_ffns:
            tau_ms = (t.alpha_us + t.beta_us * -(-f // shape[2])) * 1e-3
            for p in fill_sweep(config.bm, config.bn, num_sms, hidden=hidden):
                cost = 1.0 if table is None else int(table[p.valid_rows]) / 1e6
                rows.append(dict(tile=config.name, bm=shape[0], bn=shape[1], bk=shape[2],
                                 tma_store=tma, ffn=f, valid_rows=p.valid_rows,
                                 experts=p.experts, tiles=p.tiles, grid=num_sms,
                                 waves=p.waves, ms=p.waves * tau_ms * cost, hidden=hidden))
    return rows


def synthetic_streams(base: HardwareProfile, stream_ffns, num_sms: int, hidden: int,
                      tma_store: bool = False, tiles=(), row_blocks=None) -> List[dict]:
    """--dry-run: the streaming sweep's rows (`measure_streams`) a GPU run would produce if
    the base profile were exact: each point's time per wave max(tau(F), G x bytes /
    stream_gbps) from the base's entry nearest `hidden` (its tau alone where the entry has
    no streaming term), G = `num_sms` (one CTA per SM); `row_blocks`: the points' row
    blocks per expert (None: `STREAM_ROW_BLOCKS`)."""
    from megatron_overlap.bench.workloads import stream_sweep
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TMA_TILE

    rows = []
    sweeps = [(REGISTER_TILE, False)] + ([(DEFAULT_TMA_TILE, True)] if tma_store else [])
    for config, tma in sweeps + [(t, t.tma_store) for t in tiles]:
        shape = (config.bm, config.bn, config.bk)
        t = _synthetic_tile_time(base, shape, tma, hidden)
        for f in stream_ffns:
            tau_us = t.alpha_us + t.beta_us * -(-f // shape[2])
            for p in stream_sweep(config.bm, config.bn, num_sms, hidden=hidden,
                                  row_blocks=row_blocks or STREAM_ROW_BLOCKS):
                wave_us = tau_us
                if t.stream_gbps > 0 and t.bm == config.bm and t.bn == config.bn:
                    wave_us = max(tau_us, num_sms * stream_tile_bytes(
                        config.bm, config.bn, hidden, f, p.row_blocks, t.reread)
                        / (t.stream_gbps * 1e3))
                rows.append(dict(tile=config.name, bm=shape[0], bn=shape[1], bk=shape[2],
                                 tma_store=tma, ffn=f, grid=num_sms, row_blocks=p.row_blocks,
                                 experts=p.experts, tiles=p.tiles, waves=p.waves,
                                 ms=p.waves * wave_us * 1e-3, hidden=hidden))
    return rows


def synthetic_measurements(base: HardwareProfile, ffns, ctas, num_sms: int,
                           tma_store: bool = False, tiles=(), hidden=None):
    """--dry-run: the rows a GPU run would produce if the base profile were exact (with
    `tma_store`, also the TMA-store sweep, from the base's TMA-store entry, else from its
    register-store one; each of `tiles` (TileConfigs) from the base's entry for it, else
    from the default tile's register-store entry; `hidden`: the rows' H, the base's entry
    nearest it; None: rows without H, as before v6.5)."""
    tile_rows = []
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TMA_TILE

    sweeps = [(REGISTER_TILE, False)] + ([(DEFAULT_TMA_TILE, True)] if tma_store else [])
    sweeps += [(t, t.tma_store) for t in tiles]
    for config, tma in sweeps:
        shape = (config.bm, config.bn, config.bk)
        t = _synthetic_tile_time(base, shape, tma, hidden)
        for f in ffns:
            ksteps = -(-f // shape[2])
            tile_rows.append(dict(tile=config.name, bm=shape[0], bn=shape[1], bk=shape[2],
                                  ffn=f, ksteps=ksteps,
                                  ctas_per_sm=t.ctas_per_sm,
                                  tau_us=t.alpha_us + t.beta_us * ksteps, tma_store=tma,
                                  **({} if hidden is None else {"hidden": hidden})))
    store_rows = [dict(ctas=k or num_sms, gbps=min((k or num_sms) * base.cta_bandwidth_gbps,
                                                   base.link_bandwidth_gbps)) for k in ctas]
    return tile_rows, store_rows


# ---- GPU measurements ------------------------------------------------------------------

SWEEP_EXPERTS, SWEEP_TOPK = 8, 2
"""Experts of the uniform sweep; top-k of both sweeps (the whole-wave sweep picks its
experts: `bench.workloads.whole_wave_sweep`)."""


def sweep_meta(args, tiles, base: HardwareProfile, num_sms: int):
    """The tile-time sweep's world-1 metadata (CPU). `--sweep whole-waves` (the default
    since v6.2): a balanced routing map whose experts and rows per expert
    (`bench.workloads.whole_wave_sweep`: 16 waves, as a mid-size call; 6 experts x 2816
    rows at H = 4096 on 132 SMs) fill whole waves of every tile in `tiles` at its grid (its
    resident CTAs per SM from `base`, with the GPU's `num_sms`), so time / waves is each
    tile's per-wave time and the tiles' taus compare (docs/perf_notes.md v6.2);
    `--tokens` is not used. `--sweep uniform` (before v6.2): `--tokens` tokens of uniform
    routing, whose last waves are part-filled by different amounts per tile."""
    from megatron_overlap.bench.workloads import (
        balanced_routing_map,
        rank_rows,
        routing_maps,
        whole_wave_sweep,
    )
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_gemm2_gatherrs import epilogue_stores_tma
    from megatron_overlap.resource import plan_gemm2_gatherrs

    if args.sweep == "uniform":
        maps = routing_maps([args.tokens], SWEEP_EXPERTS, SWEEP_TOPK, "uniform",
                            seed=args.seed)
        return rank_rows(maps, tp=1, ep=1, rank=0, topk=SWEEP_TOPK).meta
    probe = rank_rows([balanced_routing_map(SWEEP_EXPERTS, SWEEP_EXPERTS, SWEEP_TOPK)],
                      tp=1, ep=1, rank=0, topk=SWEEP_TOPK).meta
    shapes = []
    for tile in tiles:
        plan = plan_gemm2_gatherrs(probe, GatherRSOptions(backend="triton"), num_sms=num_sms,
                                   hidden=args.hidden, ffn=args.ffn[0],
                                   tma_store=epilogue_stores_tma(tile, args.hidden, 2),
                                   profile=base, tile=(tile.bm, tile.bn, tile.bk))
        shapes.append((tile.bm, tile.bn, plan.num_ctas))
    experts, rows = whole_wave_sweep(shapes, topk=SWEEP_TOPK, hidden=args.hidden)
    tokens = rows * experts // SWEEP_TOPK
    return rank_rows([balanced_routing_map(tokens, experts, SWEEP_TOPK)], tp=1, ep=1,
                     rank=0, topk=SWEEP_TOPK).meta


def measure_tiles(args, device, timed_interleaved, base: HardwareProfile,
                  tiles=None) -> List[dict]:
    """The tile-time sweep of tile configurations (`ops.triton_gemm2_gatherrs.TileConfig`s;
    None or an empty list: `DEFAULT_TILE`'s register stores alone; each epilogue set
    explicitly, not by the environment). For each F every tile's GEMM2 runs on the same
    operands, the tiles timed interleaved round by round (`bench_op.timed_interleaved`, a
    Williams order) since v6.2: the resource manager's tile choice compares these times with
    each other, and tiles timed one sweep after another had the machine's drift between them
    (docs/perf_notes.md v6.2)."""
    import torch

    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call, epilogue_stores_tma
    from megatron_overlap.resource import plan_gemm2_gatherrs
    from megatron_overlap.symm import get_workspace

    tiles = list(tiles or [REGISTER_TILE])
    for tile in tiles:
        shape = (tile.bm, tile.bn, tile.bk)
        tma_store = epilogue_stores_tma(tile, args.hidden, 2)
        if not base.has_tile_time(*shape, tma_store):
            base = _with_placeholder_times(base, shape, tma_store)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    meta = sweep_meta(args, tiles, base, num_sms).to(device)
    n = int(meta.tokens_per_local_expert.sum())
    ws = get_workspace(None, hidden=args.hidden, dtype=torch.bfloat16, device=device)
    rows = []
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for f in args.ffn:
        h = (torch.randn(n, f, generator=gen, device=device) * 0.1).to(torch.bfloat16)
        w2 = (torch.randn(meta.num_local_experts, args.hidden, f, generator=gen,
                          device=device) / f**0.5).to(
            torch.bfloat16)
        calls = []
        for tile in tiles:
            tma_store = epilogue_stores_tma(tile, args.hidden, 2)
            plan = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"),
                                       num_sms=num_sms, hidden=args.hidden, ffn=f,
                                       tma_store=tma_store, profile=base,
                                       tile=(tile.bm, tile.bn, tile.bk))
            call = _Call(meta, ws, plan, hidden=args.hidden, dtype=h.dtype, device=device,
                         timeout_s=30.0, tile=tile)
            call.run(h, w2)  # world 1: every tile local; gemm_only needs a call that was run
            calls.append((tile, tma_store, plan, call))
        times = timed_interleaved([lambda c=c, g=p.num_ctas: c.gemm_only(g)
                                   for _, _, p, c in calls], args.warmup, args.iters,
                                  args.queue_ms)
        for (tile, tma_store, plan, _), t in zip(calls, times):
            tiles_n = plan.breakdown.local_tiles
            waves = -(-tiles_n // plan.num_ctas)
            rows.append(dict(tile=tile.name, bm=tile.bm, bn=tile.bn, bk=tile.bk, ffn=f,
                             ksteps=-(-f // tile.bk), tiles=tiles_n, grid=plan.num_ctas,
                             waves=waves, fill=round(tiles_n / plan.num_ctas - waves + 1, 4),
                             sweep=args.sweep, ctas_per_sm=plan.breakdown.ctas_per_sm,
                             ms=t["p50"], tau_us=t["p50"] * 1e3 / waves, tma_store=tma_store,
                             interleaved=len(calls)))
        del h, w2, calls, times
        torch.cuda.empty_cache()
    return rows


def _time_sweep(args, device, timed_interleaved, base: HardwareProfile, tiles, *, what: str,
                ffns, seed_offset: int, points_of, row_of) -> List[dict]:
    """The GEMM2 tiles alone (`_Call.gemm_only` on the plan's grid) of each tile (a
    `ops.triton_gemm2_gatherrs.TileConfig`) on each workload point `points_of(tile, grid)`
    gives (top-1 routing of `point.rows` rows per expert, `point.tiles` tiles), for each F
    in `ffns`, the points of one (tile, F) timed interleaved on shared operands; one row per
    point: tile, bm, bn, bk, tma_store, ffn, grid, ms (p50) and `row_of(point)`'s fields.
    Plans with the tile times of `base` (for the grid alone); `what` names the sweep in
    the error raised where a plan's tiles or grid are not the point's."""
    import torch

    from megatron_overlap.bench.workloads import rank_rows, top1_routing_map
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call, epilogue_stores_tma
    from megatron_overlap.resource import plan_gemm2_gatherrs
    from megatron_overlap.symm import get_workspace

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    ws = get_workspace(None, hidden=args.hidden, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed + seed_offset)
    rows = []
    for tile in tiles:
        shape = (tile.bm, tile.bn, tile.bk)
        tma_store = epilogue_stores_tma(tile, args.hidden, 2)
        if not base.has_tile_time(*shape, tma_store):
            base = _with_placeholder_times(base, shape, tma_store)
        probe = rank_rows([top1_routing_map([tile.bm])], tp=1, ep=1, rank=0, topk=1).meta
        grid = plan_gemm2_gatherrs(probe, GatherRSOptions(backend="triton"), num_sms=num_sms,
                                   hidden=args.hidden, ffn=ffns[0],
                                   tma_store=tma_store, profile=base, tile=shape).num_ctas
        points = points_of(tile, grid)
        metas = [rank_rows([top1_routing_map(p.rows)], tp=1, ep=1, rank=0, topk=1).meta.to(
            device) for p in points]
        n = max(int(m.tokens_per_local_expert.sum()) for m in metas)
        experts = max(len(p.rows) for p in points)  # a point of fewer takes the first ones
        for f in ffns:
            h = (torch.randn(n, f, generator=gen, device=device) * 0.1).to(torch.bfloat16)
            w2 = (torch.randn(experts, args.hidden, f, generator=gen, device=device)
                  / f**0.5).to(torch.bfloat16)
            calls = []
            for p, meta in zip(points, metas):
                plan = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"),
                                           num_sms=num_sms, hidden=args.hidden, ffn=f,
                                           tma_store=tma_store, profile=base, tile=shape)
                call = _Call(meta, ws, plan, hidden=args.hidden, dtype=h.dtype,
                             device=device, timeout_s=30.0, tile=tile)
                call.run(h[:int(meta.tokens_per_local_expert.sum())], w2[:len(p.rows)])
                if plan.breakdown.local_tiles != p.tiles or plan.num_ctas != grid:
                    raise RuntimeError(
                        f"{what} {tile.name}: the plan has {plan.breakdown.local_tiles} "
                        f"tiles on a grid of {plan.num_ctas}, the point expected {p.tiles} on "
                        f"{grid}")
                calls.append((p, plan, call))
            times = timed_interleaved([lambda c=c, g=pl.num_ctas: c.gemm_only(g)
                                       for _, pl, c in calls], args.warmup, args.iters,
                                      args.queue_ms)
            for (p, _, _), t in zip(calls, times):
                rows.append(dict(tile=tile.name, bm=tile.bm, bn=tile.bn, bk=tile.bk,
                                 tma_store=tma_store, ffn=f, grid=grid, **row_of(p),
                                 ms=t["p50"]))
            del h, w2, calls, times
            torch.cuda.empty_cache()
    return rows


def measure_tails(args, device, timed_interleaved, base: HardwareProfile,
                  tiles) -> List[dict]:
    """The last-wave sweep (module docstring "last wave"): for each tile (a
    `ops.triton_gemm2_gatherrs.TileConfig`) and each F in --tail-ffn, the GEMM2 tiles alone
    on every `bench.workloads.tail_sweep` point, timed interleaved (`_time_sweep`). Rows:
    tile, bm, bn, bk, tma_store, ffn, grid, tiles, waves (tiles / grid), fill, point
    ("whole" / "partial"), ms (p50)."""
    from megatron_overlap.bench.workloads import tail_sweep

    return _time_sweep(
        args, device, timed_interleaved, base, tiles, what="tail sweep", ffns=args.tail_ffn,
        seed_offset=1, points_of=lambda t, grid: tail_sweep(t.bm, t.bn, grid,
                                                            hidden=args.hidden),
        row_of=lambda p: dict(tiles=p.tiles, waves=round(p.waves, 6), fill=p.fill,
                              point="whole" if p.fill == 1.0 else "partial"))


def measure_fills(args, device, timed_interleaved, base: HardwareProfile,
                  tiles) -> List[dict]:
    """The part-filled tile sweep (module docstring "tile fill"): for each tile and each F in
    --fill-ffn, the GEMM2 tiles alone on every `bench.workloads.fill_sweep` point (the same
    tiles and whole waves, r of BM rows valid in each), timed interleaved (`_time_sweep`).
    Rows: tile, bm, bn, bk, tma_store, ffn, grid, valid_rows, experts, tiles, waves, ms
    (p50)."""
    from megatron_overlap.bench.workloads import fill_sweep

    return _time_sweep(
        args, device, timed_interleaved, base, tiles, what="fill sweep", ffns=args.fill_ffn,
        seed_offset=2, points_of=lambda t, grid: fill_sweep(t.bm, t.bn, grid,
                                                            hidden=args.hidden),
        row_of=lambda p: dict(valid_rows=p.valid_rows, experts=p.experts, tiles=p.tiles,
                              waves=p.waves))


def measure_streams(args, device, timed_interleaved, base: HardwareProfile,
                    tiles) -> List[dict]:
    """The weight-streaming sweep (module docstring "streaming"): for each tile and each F
    in --stream-ffn, the GEMM2 tiles alone on every `bench.workloads.stream_sweep` point
    (experts of 1, 2, 3 full row blocks, whole waves), timed interleaved (`_time_sweep`).
    Rows: tile, bm, bn, bk, tma_store, ffn, grid, row_blocks, experts, tiles, waves, ms
    (p50)."""
    from megatron_overlap.bench.workloads import stream_sweep

    return _time_sweep(
        args, device, timed_interleaved, base, tiles, what="streaming sweep",
        ffns=args.stream_ffn, seed_offset=3,
        points_of=lambda t, grid: stream_sweep(t.bm, t.bn, grid, hidden=args.hidden,
                                               row_blocks=args.stream_row_blocks),
        row_of=lambda p: dict(row_blocks=p.row_blocks, experts=p.experts, tiles=p.tiles,
                              waves=p.waves))


def measure_link(args, device, timed, num_sms: int):
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from megatron_overlap.kernels.peer_store import peer_store

    world, rank = dist.get_world_size(), dist.get_rank()
    numel = args.store_mib * (1 << 20) // 2
    buf = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # as megatron_overlap.symm does
        symm_mem.enable_symm_mem_for_group(name)
    handle = symm_mem.rendezvous(buf, name)
    peer = handle.get_buffer((rank + 1) % world, (numel,), torch.bfloat16)
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    rows = []
    for k in args.ctas:
        k = k or num_sms
        t = timed(lambda k=k: peer_store(src, peer, num_ctas=k), args.warmup, args.iters,
                  args.queue_ms)
        rows.append(dict(ctas=k, ms=t["p50"], gbps=numel * 2 / (t["p50"] * 1e-3) / 1e9))
    tile = 128 * 128  # one bf16 128 x 128 tile
    empty = src[:0]
    one_launch = timed(lambda: peer_store(empty, peer[:0], num_ctas=1), args.warmup,
                       args.iters)["p50"]
    one_tile = timed(lambda: peer_store(src[:tile], peer[:tile], num_ctas=1), args.warmup,
                     args.iters)["p50"]
    dist.barrier()
    return rows, (one_tile - one_launch) * 1e3


def measure_local(args, device, timed) -> Tuple[float, float]:
    """(HBM copy GB/s, two empty launches in us)."""
    import torch

    from megatron_overlap.kernels.peer_store import peer_store

    numel = args.copy_mib * (1 << 20) // 2
    a = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), args.warmup, args.iters, args.queue_ms)["p50"]
    empty = a[:0]
    launch = timed(lambda: (peer_store(empty, b[:0], num_ctas=1),
                            peer_store(empty, b[:0], num_ctas=1)), args.warmup,
                   args.iters)["p50"]
    return 2 * numel * 2 / (t * 1e-3) / 1e9, launch * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--name", default=None,
                        help="profile name written into the YAML (default: the GPU's shipped "
                             "profile's, h100 / h200 (resource.profile.DEVICE_PROFILES); "
                             "--dry-run: the base's)")
    parser.add_argument("--out", required=True, help="YAML file to write")
    parser.add_argument("--base", default=None,
                        help="profile (name or YAML) for limits torch does not report, and the "
                             "link values with one rank / in --dry-run (default: the GPU's "
                             f"shipped profile; --dry-run: {DEFAULT_PROFILE})")
    parser.add_argument("--ffn", nargs="+", type=positive_int, default=list(DEFAULT_FFN),
                        help="GEMM depths F of the tile-time sweep (>= 2 distinct K-step counts)")
    parser.add_argument("--hidden", nargs="+", type=positive_int, default=[4096],
                        help="H of the tile-time sweep: one tile_times entry per tile and H "
                             "(the resource manager takes the one nearest a call's H; the "
                             "last-wave sweep runs at the first)")
    parser.add_argument("--sweep", choices=("whole-waves", "uniform"), default="whole-waves",
                        help="routing of the tile-time sweep: whole-waves (a balanced map "
                             "whose rows fill whole waves of every swept tile) or uniform "
                             "(--tokens tokens, uniform routing: before v6.2)")
    parser.add_argument("--tokens", type=positive_int, default=8192,
                        help="tokens of the tile-time sweep with --sweep uniform")
    parser.add_argument("--ctas", nargs="+", type=non_negative_int, default=list(DEFAULT_CTAS),
                        help="peer-store CTA counts (0 = one per SM)")
    parser.add_argument("--store-mib", type=positive_int, default=256,
                        help="MiB each peer-store measurement moves")
    parser.add_argument("--copy-mib", type=positive_int, default=1024,
                        help="MiB of the HBM copy measurement")
    add_timing_args(parser, warmup=3, iters=10, per="per measurement")
    parser.add_argument("--queue-ms", type=non_negative_float, default=1.0,
                        help="GPU sleep before each timed tile / store / copy run, so the "
                             "host's enqueue is not timed (the launch measurements never "
                             "sleep: they time the enqueue on purpose)")
    parser.add_argument("--tma-store", action="store_true",
                        help="also sweep the TMA-store epilogue's tile time (a second "
                             "tile_times entry, tma_store: true)")
    parser.add_argument("--tiles", nargs="*", default=None, metavar="TILE",
                        help="the resource manager's candidate tiles to sweep, one tile_times "
                             "entry each (names as launch/bench_op.py --variants spells "
                             "them, from ops.triton_gemm2_gatherrs.TILE_CANDIDATES, e.g. "
                             "256x128x64w8s4); default: all candidates; none: --tiles with "
                             "no value")
    parser.add_argument("--tail-ffn", nargs="*", type=positive_int,
                        default=list(DEFAULT_TAIL_FFN),
                        help="GEMM depths F of the last-wave sweep that measures each tile's "
                             "idle_wave_cost (none: --tail-ffn with no value; the entries "
                             "then keep 1.0, whole waves)")
    parser.add_argument("--fill-ffn", nargs="*", type=positive_int,
                        default=list(DEFAULT_FILL_FFN),
                        help="GEMM depths F of the part-filled tile sweep that measures each "
                             "tile's fill_cost, at every --hidden (none: --fill-ffn with no "
                             "value; the entries then price every tile as a full one)")
    parser.add_argument("--stream-ffn", nargs="*", type=positive_int,
                        default=list(DEFAULT_STREAM_FFN),
                        help="GEMM depths F of the weight-streaming sweep that measures each "
                             "tile's stream_gbps and reread, at every --hidden (none: "
                             "--stream-ffn with no value; the entries then have no "
                             "streaming term)")
    parser.add_argument("--stream-row-blocks", nargs="+", type=positive_int,
                        default=list(STREAM_ROW_BLOCKS),
                        help="row blocks per expert of the weight-streaming sweep's points "
                             f"(default {' '.join(map(str, STREAM_ROW_BLOCKS))}; more, e.g. "
                             "1 2 3 4 6 8 12 16, measure how the re-read grows with them: "
                             "all points >= 2 enter the reread fit)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: fit and write from values generated by --base's model")
    args = parser.parse_args(argv)
    args.hidden = list(dict.fromkeys(args.hidden))  # each once, in order
    for hidden in args.hidden:
        if args.tma_store and hidden * 2 % 16:
            parser.error(f"--tma-store --hidden {hidden}: the TMA-store epilogue needs rows "
                         "of a multiple of 16 bytes (H a multiple of 8 in bf16); at this H "
                         "the kernel stores from registers")
    ksteps = {-(-f // DEFAULT_TILE[2]) for f in args.ffn}
    if len(ksteps) < 2:
        parser.error(f"--ffn {' '.join(map(str, args.ffn))}: the fit needs >= 2 distinct "
                     f"K-step counts (ceil(F / {DEFAULT_TILE[2]})), got {sorted(ksteps)}")
    try:
        extra_tiles = candidate_tiles(args.tiles)
    except ValueError as err:
        parser.error(f"--tiles: {err}")
    if args.name is not None and not args.name.strip():
        parser.error(f"--name {args.name!r}: expected a non-empty profile name")
    try:
        base = load_profile(args.base or DEFAULT_PROFILE)  # checked now; on a GPU see below
        check_launch_inputs(args.out)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    if args.dry_run:
        num_sms = base.gpu.num_sms
        tile_rows = []
        for hidden in args.hidden:
            rows, store_rows = synthetic_measurements(base, args.ffn, args.ctas, num_sms,
                                                      args.tma_store, extra_tiles,
                                                      hidden=hidden)
            tile_rows += rows
        tail_rows = synthetic_tails(base, args.tail_ffn, num_sms, args.hidden[0],
                                    args.tma_store, extra_tiles)
        fill_rows = [r for hidden in args.hidden for r in synthetic_fills(
            base, args.fill_ffn, num_sms, hidden, args.tma_store, extra_tiles)]
        stream_rows = [r for hidden in args.hidden for r in synthetic_streams(
            base, args.stream_ffn, num_sms, hidden, args.tma_store, extra_tiles,
            args.stream_row_blocks)]
        profile = build_profile(
            args.name or base.name, base, base.gpu, tile_rows, store_rows, base.hbm_bandwidth_gbps,
            base.launch_overhead_us, base.store_latency_us,
            source=f"launch/calibrate.py --dry-run {stamp}: generated from {base.name}, "
                   "nothing measured", link_from_base=False, tail_rows=tail_rows,
            fill_rows=fill_rows, stream_rows=stream_rows)
        profile = dataclasses.replace(profile, provisional=True)
        save_profile(profile, args.out, header="DRY RUN: values generated from the base "
                                               "profile's model, not measured")
        print(f"dry run: wrote {args.out}")
        _print(profile)
        return 0

    import torch
    import torch.distributed as dist

    import bench_op  # launch/bench_op.py: timed(), git_sha()

    device = init_cuda_group(__file__, "; --dry-run runs on a CPU")
    if device is None:
        return 2
    gpu_name = torch.cuda.get_device_name(device)
    shipped = device_profile_name(gpu_name)
    if shipped is None and (args.name is None or args.base is None):
        print(f"calibrate.py: GPU {gpu_name!r} has no shipped profile (resource.profile."
              f"DEVICE_PROFILES: {', '.join(n for _, n in DEVICE_PROFILES)}): give --name "
              "(what to call this GPU's profile) and --base (a profile for the limits torch "
              "does not report, e.g. h100)", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    name = args.name or shipped
    if args.base is None:
        base = load_profile(shipped)
    props = torch.cuda.get_device_properties(device)
    gpu = gpu_limits(base.gpu, props)
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TMA_TILE

    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE as REGISTER_TILE

    swept = ([REGISTER_TILE] + ([DEFAULT_TMA_TILE] if args.tma_store else [])
             + list(extra_tiles))
    at = [argparse.Namespace(**dict(vars(args), hidden=h)) for h in args.hidden]  # one H each
    tile_rows = [dict(r, hidden=a.hidden) for a in at
                 for r in measure_tiles(a, device, bench_op.timed_interleaved, base, swept)]
    tail_rows = ([dict(r, hidden=at[0].hidden) for r in measure_tails(
        at[0], device, bench_op.timed_interleaved, base, swept)] if args.tail_ffn else [])
    fill_rows = ([dict(r, hidden=a.hidden) for a in at for r in measure_fills(
        a, device, bench_op.timed_interleaved, base, swept)] if args.fill_ffn else [])
    stream_rows = ([dict(r, hidden=a.hidden) for a in at for r in measure_streams(
        a, device, bench_op.timed_interleaved, base, swept)] if args.stream_ffn else [])
    hbm_gbps, launch_us = measure_local(at[0], device, bench_op.timed)
    world = dist.get_world_size()
    if world > 1:
        store_rows, latency_us = measure_link(args, device, bench_op.timed, gpu.num_sms)
    else:
        store_rows, latency_us = [], base.store_latency_us
    if dist.get_rank() == 0:
        source = (f"launch/calibrate.py on {world}x {torch.cuda.get_device_name(device)}, "
                  f"{stamp}, git {bench_op.git_sha()[:12]}, torch {torch.__version__}")
        profile = build_profile(name, base, gpu, tile_rows, store_rows, hbm_gbps,
                                launch_us, latency_us, source, link_from_base=world == 1,
                                tail_rows=tail_rows, fill_rows=fill_rows,
                                stream_rows=stream_rows)
        header = (f"Calibrated: {source}.\n"
                  + ("Link values copied from the base profile (one rank).\n" if world == 1
                     else "")
                  + ("idle_wave_cost not measured (--tail-ffn with no value): 1.0, whole "
                     "waves.\n" if not tail_rows else "")
                  + ("TMA-store tile time copied from the base profile (not measured: "
                     "no --tma-store).\n" if profile.extra["tma_store_copied_from_base"]
                     else "")

                  + f"prereduce_host_us copied from the base profile ({base.name}; a host "
                    "cost, not measured here: bench_op's ours_prereduced_host - ours_host).\n"
                  + "Re-run launch/calibrate.py after kernel changes (the tile time is the "
                    "fused kernel's).")
        save_profile(profile, args.out, header=header)
        print(f"wrote {args.out}")
        _print(profile)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _print(p: HardwareProfile) -> None:
    fits = {t.key + (t.hidden,): t for t in p.tile_times}
    for t in p.tile_times:
        print(f"tile {t.bm}x{t.bn}x{t.bk}, {'TMA' if t.tma_store else 'register'} stores"
              f"{'' if t.hidden is None else f', H {t.hidden}'}: "
              f"tau = {t.alpha_us:.3f} + {t.beta_us:.4f} * ceil(F/{t.bk}) us at "
              f"{t.ctas_per_sm} CTA/SM, idle_wave_cost {t.idle_wave_cost:.3f}"
              + (", fill_cost " + " ".join(f"{r}:{c:.3f}" for r, c in t.fill_cost)
                 if t.fill_cost else "")
              + (f", stream {t.stream_gbps:.0f} GB/s, reread {t.reread:.2f}"
                 if t.stream_gbps else ""))
    print(f"B_link {p.link_bandwidth_gbps:.0f} GB/s | B_cta "
          f"{p.cta_bandwidth_gbps:.2f} GB/s | HBM {p.hbm_bandwidth_gbps:.0f} GB/s | launch "
          f"{p.launch_overhead_us:.1f} us | store latency {p.store_latency_us:.2f} us | "
          f"pre-reduced host term {p.prereduce_host_us:.1f} us (from the base profile)")
    extra: Dict = p.extra
    for r in extra.get("tile_sweep", []):
        t = fits.get(_entry_key(r), p.tile_times[0])
        at_h = "" if r.get("hidden") is None else f" H={r['hidden']}"
        print(f"  {t.bm}x{t.bn}x{t.bk}{at_h} F={r['ffn']:>6} ksteps={r['ksteps']:>4}"
              f"{' TMA' if r.get('tma_store') else ''} tau={r['tau_us']:.2f} us"
              + (f" (fit {t.alpha_us + t.beta_us * r['ksteps']:.2f})" if not math.isnan(
                  r["tau_us"]) else ""))
    for r in extra.get("tail_sweep", []):
        print(f"  last wave {r['tile']} F={r['ffn']:>6} tiles={r['tiles']:>5} "
              f"waves={r['waves']:.3f} ({r['point']}) {r['ms']:.4f} ms")
    full = {(r["tile"], r.get("hidden"), r["ffn"]): r["ms"] for r in extra.get("fill_sweep", [])
            if r["valid_rows"] == r["bm"]}
    for r in extra.get("fill_sweep", []):
        ref = full.get((r["tile"], r.get("hidden"), r["ffn"]))
        print(f"  fill {r['tile']} H={r.get('hidden')} F={r['ffn']:>6} rows={r['valid_rows']:>4}"
              f"/{r['bm']} {r['ms']:.4f} ms" + (f" ({r['ms'] / ref:.3f} of a full tile)"
                                                  if ref else ""))
    for r in extra.get("stream_sweep", []):
        print(f"  stream {r['tile']} H={r.get('hidden')} F={r['ffn']:>6} row blocks="
              f"{r['row_blocks']} experts={r['experts']:>4} {r['ms'] * 1e3 / r['waves']:.2f} "
              "us per wave")
    for r in extra.get("peer_store_sweep", []):
        print(f"  peer stores, {r['ctas']:>4} CTAs: {r['gbps']:.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
