"""Synthetic routed workloads for the operator benchmark and the tests.

Every rank draws the same global routing (all ranks' routing maps, from one seed) and lays out
its own expert rows as Megatron's alltoall dispatch would (local expert, source chunk, token),
without communication. Routing kinds:
  * "uniform": each token's top-k of i.i.d. uniform scores (every expert equally likely);
  * "skewed": as uniform, but expert 0 gets +2 on the first ~3/4 of each rank's tokens, so it
    takes at least half of them (one hot expert: the p90-style imbalance of real routers);
  * "sparse": odd experts get -2, so with top-k <= E/2 they receive no token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from megatron_overlap.metadata import (
    GatherRSMetadata,
    build_metadata,
    chunk_to_group_rank,
    source_slots,
)

ROUTINGS = ("uniform", "skewed", "sparse")


def routing_maps(tokens_per_rank: Sequence[int], num_experts: int, topk: int, routing: str,
                 seed: int) -> List[torch.Tensor]:
    """[T_g, E] bool routing map of every rank g of the tp_ep group (group order).

    Raises:
        ValueError: unknown routing kind, or topk not in [1, num_experts].
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}; expected one of {ROUTINGS}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
    gen = torch.Generator().manual_seed(seed)
    maps = []
    for num_tokens in tokens_per_rank:
        scores = torch.rand(num_tokens, num_experts, generator=gen)
        if routing == "skewed":
            scores[: (num_tokens + 1) // 2 + num_tokens // 4, 0] += 2.0
        elif routing == "sparse":
            scores[:, 1::2] -= 2.0
        top = scores.topk(topk, dim=1).indices
        maps.append(torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True))
    return maps


def balanced_routing_map(num_tokens: int, num_experts: int, topk: int) -> torch.Tensor:
    """[T, E] bool routing map with no draw: token t goes to experts (t + j) mod E, j < topk,
    so every expert gets T x topk / E rows when E divides T.

    Raises:
        ValueError: topk not in [1, E], or T not a positive multiple of E.
    """
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk}: expected 1..{num_experts} (the experts)")
    if num_tokens < 1 or num_tokens % num_experts:
        raise ValueError(f"num_tokens={num_tokens}: expected a positive multiple of "
                         f"num_experts={num_experts}")
    t = torch.arange(num_tokens).unsqueeze(1)
    cols = (t + torch.arange(topk).unsqueeze(0)) % num_experts
    return torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, cols, True)


def whole_wave_rows(tiles: Sequence[Tuple[int, int, int]], *, num_experts: int, topk: int,
                    hidden: int, min_waves: int = 16, max_rows: int = 1 << 16) -> int:
    """Rows per expert r for a balanced routing map (`balanced_routing_map`) on which every
    tile in `tiles` fills whole waves: for each (BM, BN, G) (G: the tile's grid, SMs x
    resident CTAs per SM) E x ceil(r / BM) x ceil(H / BN) is a multiple of G, with at least
    `min_waves` waves. r is a multiple of every BM and of top-k, so tiles grow linearly in r
    and T = r x E / top-k tokens route evenly. The smallest such r.

    The resource manager prices the GEMM2 in whole waves, ceil(tiles / G) x tau (docs/
    resource_model.md), and calibrate.py fits tau from time / waves; on a workload whose last
    wave is part-filled a tile whose idle tail costs little (the default TMA-store tile,
    docs/perf_notes.md v6.2) gets a tau below its per-wave cost, one that is whole-wave
    quantized (`WIDE_TILE`) not, so the tiles' taus would not compare.

    Raises:
        ValueError: a size < 1, or no r <= max_rows.
    """
    r = _whole_wave_rows(tiles, num_experts, topk, hidden, min_waves, max_rows)
    if r is None:
        raise ValueError(f"no rows per expert <= {max_rows} fill whole waves of every tile "
                         f"{list(tiles)} at E={num_experts}, H={hidden}, top-k={topk} with "
                         f">= {min_waves} waves; use --sweep uniform")
    return r


def _whole_wave_rows(tiles, num_experts, topk, hidden, min_waves, max_rows):
    """`whole_wave_rows`, None where no r <= max_rows works (inputs checked here)."""
    for name, value in (("num_experts", num_experts), ("topk", topk), ("hidden", hidden),
                        ("min_waves", min_waves), ("max_rows", max_rows)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if not tiles:
        raise ValueError("tiles: expected at least one (BM, BN, G)")
    for tile in tiles:
        if len(tile) != 3 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in tile):
            raise ValueError(f"tile {tile!r}: expected (BM, BN, G), three ints >= 1")
    unit = math.lcm(topk, *(bm for bm, _, _ in tiles))
    for r in range(unit, max_rows + 1, unit):
        counts = [(num_experts * (r // bm) * -(-hidden // bn), g) for bm, bn, g in tiles]
        if all(n % g == 0 for n, g in counts):
            # multiples of r keep every count a multiple of its G
            r *= -(-min_waves // min(n // g for n, g in counts))
            return r if r <= max_rows else None
    return None


def whole_wave_sweep(tiles: Sequence[Tuple[int, int, int]], *, topk: int, hidden: int,
                     target_waves: int = 16, max_experts: int = 64,
                     max_rows: int = 1 << 16) -> Tuple[int, int]:
    """(experts E, rows per expert r) of a balanced sweep on which every tile in `tiles`
    fills whole waves (`whole_wave_rows`) with the fewest waves >= `target_waves` (ties: E
    nearest 8). With E fixed at 8 on 132 SMs the smallest such r is 8448 (64 waves of the
    default tile at H = 4096): a GEMM of ~13 ms at F = 14336, long enough that the GPU's
    clocks drop under it (v6.2 run e: tau 10-17 % above a 17-wave sweep's); choosing E as
    well gets 16 waves (E = 6, r = 2816 there) like a mid-size call.

    Raises:
        ValueError: as `whole_wave_rows`, or no E <= max_experts works.
    """
    best = None
    for experts in range(1, max_experts + 1):
        r = _whole_wave_rows(tiles, experts, topk, hidden, target_waves, max_rows)
        if r is None:
            continue
        waves = min(experts * (r // bm) * -(-hidden // bn) // g for bm, bn, g in tiles)
        key = (waves, abs(experts - 8))
        if best is None or key < best[0]:
            best = (key, experts, r)
    if best is None:
        raise ValueError(f"no experts <= {max_experts} give whole waves of every tile "
                         f"{list(tiles)} at H={hidden}, top-k={topk}; use --sweep uniform")
    return best[1], best[2]


@dataclass(frozen=True)
class TailPoint:
    """One workload of the last-wave sweep (`tail_sweep`): `rows` per expert (multiples of
    BM), giving `tiles` tiles = `waves` x G (a float: whole waves and a last one `fill`
    full; fill 1.0 for whole-wave points)."""

    rows: Tuple[int, ...]
    tiles: int
    waves: float
    fill: float


def tail_sweep(bm: int, bn: int, grid: int, *, hidden: int, num_experts: int = 8,
               min_waves: int = 8, fills: Sequence[float] = (0.25, 0.5, 0.75)
               ) -> List[TailPoint]:
    """The workloads that measure what a part-filled last wave costs one tile shape on a
    grid of G = `grid` CTAs (`launch/calibrate.py`, `TileTime.idle_wave_cost`): two whole-wave
    points, N0 and N1 waves (N0 the smallest >= `min_waves`, N1 the next, with N x G a
    multiple of the ceil(H / BN) column blocks so that whole row blocks give exactly that
    many tiles), then N0 waves plus a last wave filled to the nearest reachable fraction of
    each of `fills` (tiles step by the column-block count). Rows are whole BM blocks,
    spread over `num_experts` experts as evenly as they go. The whole points give the
    per-wave time (t(N1) - t(N0)) / (N1 - N0) without the launch's fixed cost; each partial
    point's excess over t(N0) is fill + eta x (1 - fill) of it.

    Returns:
        The points in order: N0, N1, then the partial ones (none where a wave is not
        larger than one row block's tiles, G <= ceil(H / BN)).

    Raises:
        ValueError: a size < 1, a fill outside (0, 1).
    """
    for name, value in (("bm", bm), ("bn", bn), ("grid", grid), ("hidden", hidden),
                        ("num_experts", num_experts), ("min_waves", min_waves)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if any(not 0.0 < f < 1.0 for f in fills):
        raise ValueError(f"fills={list(fills)}: expected fractions in (0, 1)")
    cols = -(-hidden // bn)
    step = cols // math.gcd(grid, cols)  # waves between whole-wave points
    n0 = -(-min_waves // step) * step
    n1 = n0 + step

    def point(tiles: int) -> TailPoint:
        blocks = tiles // cols
        rows = tuple((blocks // num_experts + (e < blocks % num_experts)) * bm
                     for e in range(num_experts))
        full, rem = divmod(tiles, grid)
        return TailPoint(rows=rows, tiles=tiles, waves=tiles / grid,
                         fill=round(rem / grid, 6) if rem else 1.0)

    points = [point(n0 * grid), point(n1 * grid)]
    seen = set()
    for f in fills:
        m = min(max(cols * round(f * grid / cols), cols), (grid - 1) // cols * cols)
        if 0 < m < grid and m not in seen:
            seen.add(m)
            points.append(point(n0 * grid + m))
    return points


@dataclass(frozen=True)
class FillPoint:
    """One workload of the part-filled tile sweep (`fill_sweep`): `experts` experts of
    `valid_rows` rows each, one row block per expert, so every one of the `tiles` tiles
    (whole waves of the grid) has `valid_rows` of its BM rows valid."""

    valid_rows: int
    experts: int
    tiles: int
    waves: int

    @property
    def rows(self) -> Tuple[int, ...]:
        """Rows per expert (`top1_routing_map`'s input)."""
        return (self.valid_rows,) * self.experts


FILL_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)
"""The fractions of BM `fill_sweep` times a tile at by default (1.0: the full tile, the
reference every other point is divided by)."""


def fill_sweep(bm: int, bn: int, grid: int, *, hidden: int, min_waves: int = 8,
               fractions: Sequence[float] = FILL_FRACTIONS) -> List[FillPoint]:
    """The workloads that measure what a tile with fewer than BM valid rows costs
    (`launch/calibrate.py --fill-ffn`, `TileTime.fill_cost`): for each fraction f, experts
    of r = max(1, floor(f x BM + 1/2)) rows each, one row block (ceil(H / BN) tiles) per expert,
    and as many experts as make N whole waves of G = `grid` CTAs (N the smallest multiple
    of ceil(H / BN) / gcd(G, ceil(H / BN)) >= `min_waves`). Every point has the same tiles
    and waves, so time(r) / time(BM) is the cost of an r-row tile relative to a full one
    (the kernel multiplies masked rows like valid ones; what a masked row saves is its
    loads and stores).

    Returns:
        One point per distinct r, in the order of `fractions`.

    Raises:
        ValueError: a size < 1, a fraction outside (0, 1], no fraction 1.0.
    """
    for name, value in (("bm", bm), ("bn", bn), ("grid", grid), ("hidden", hidden),
                        ("min_waves", min_waves)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if not fractions or any(not 0.0 < f <= 1.0 for f in fractions) or 1.0 not in fractions:
        raise ValueError(f"fractions={list(fractions)}: expected fractions in (0, 1], 1.0 "
                         "among them (the full tile every point is divided by)")
    cols = -(-hidden // bn)
    step = cols // math.gcd(grid, cols)
    waves = -(-min_waves // step) * step
    experts = waves * grid // cols
    points, seen = [], set()
    for f in fractions:
        r = max(1, math.floor(f * bm + 0.5))
        if r not in seen:
            seen.add(r)
            points.append(FillPoint(valid_rows=r, experts=experts, tiles=experts * cols,
                                    waves=waves))
    return points


@dataclass(frozen=True)
class StreamPoint:
    """One workload of the weight-streaming sweep (`stream_sweep`): `experts` experts of
    `row_blocks` x BM rows each (every tile full), `tiles` tiles in `waves` whole waves."""

    row_blocks: int
    bm: int
    experts: int
    tiles: int
    waves: int

    @property
    def rows(self) -> Tuple[int, ...]:
        """Rows per expert (`top1_routing_map`'s input)."""
        return (self.row_blocks * self.bm,) * self.experts


STREAM_ROW_BLOCKS = (1, 2, 3)
"""Row blocks per expert of the streaming sweep: 1 measures the streaming bandwidth (each
weight slice read by one tile), 2 and 3 what the L2 keeps of it for the next row block."""


def stream_sweep(bm: int, bn: int, grid: int, *, hidden: int, min_waves: int = 8,
                 row_blocks: Sequence[int] = STREAM_ROW_BLOCKS) -> List[StreamPoint]:
    """The workloads that measure a tile's weight-streaming cost (`launch/calibrate.py
    --stream-ffn`, `TileTime.stream_gbps` and `reread`): for each m in `row_blocks`,
    experts of m x BM rows each (full tiles only), m x ceil(H / BN) tiles per expert, and
    as many experts as make N whole waves of G = `grid` CTAs (N the smallest multiple of
    m ceil(H / BN) / gcd(G, m ceil(H / BN)) >= `min_waves`). Few rows per expert, as in a
    fine-grained MoE at a few thousand tokens (docs/perf_notes.md v6.6): every expert's
    weights are read for only m row blocks.

    Returns:
        One point per m, in the order of `row_blocks`.

    Raises:
        ValueError: a size < 1, no row-block count, or one that is not an int >= 1.
    """
    for name, value in (("bm", bm), ("bn", bn), ("grid", grid), ("hidden", hidden),
                        ("min_waves", min_waves)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if not row_blocks or any(isinstance(m, bool) or not isinstance(m, int) or m < 1
                             for m in row_blocks):
        raise ValueError(f"row_blocks={list(row_blocks)}: expected ints >= 1")
    cols = -(-hidden // bn)
    points = []
    for m in dict.fromkeys(row_blocks):
        per_expert = m * cols
        step = per_expert // math.gcd(grid, per_expert)
        waves = -(-min_waves // step) * step
        experts = waves * grid // per_expert
        points.append(StreamPoint(row_blocks=m, bm=bm, experts=experts,
                                  tiles=experts * per_expert, waves=waves))
    return points


def top1_routing_map(rows_per_expert: Sequence[int]) -> torch.Tensor:
    """[T, E] bool top-1 routing map with `rows_per_expert[e]` tokens on expert e
    (contiguous token ranges), T = their sum.

    Raises:
        ValueError: a negative count, or no token at all.
    """
    rows = [int(r) for r in rows_per_expert]
    if not rows or min(rows) < 0 or sum(rows) < 1:
        raise ValueError(f"rows_per_expert={rows}: expected counts >= 0, at least one token")
    expert = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
    return torch.zeros(sum(rows), len(rows), dtype=torch.bool).scatter_(
        1, expert.unsqueeze(1), True)


@dataclass(frozen=True)
class RankRows:
    """This rank's received rows, in the op's `h` order.

    meta: the op's metadata; row_source: [N] group rank each row came from; row_token: [N]
    that source's token index; row_expert: [N] local expert of the row.
    """

    meta: GatherRSMetadata
    row_source: torch.Tensor
    row_token: torch.Tensor
    row_expert: torch.Tensor


def rank_rows(maps: Sequence[torch.Tensor], *, tp: int, ep: int, rank: int,
              topk: int) -> RankRows:
    """Lay out rank `rank`'s rows and metadata from the global routing maps (CPU tensors)."""
    tp_rank, ep_rank = rank % tp, rank // tp
    num_experts = maps[0].shape[1]
    num_local = num_experts // ep
    slots = [source_slots(m, ep) for m in maps]
    counts = torch.stack([torch.cat([m.sum(0), s[2]]) for m, s in zip(maps, slots)]).numpy()
    row_slot, row_source, row_token, row_expert = [], [], [], []
    for local in range(num_local):
        e = ep_rank * num_local + local
        for chunk in range(tp * ep):
            g = chunk_to_group_rank(chunk, tp, ep)
            m = maps[g]
            start = int(m.sum(0)[:e].sum())
            tokens = m[:, e].nonzero().view(-1)
            row_slot.append(slots[g][0][start : start + tokens.numel()])
            row_source.append(torch.full_like(tokens, g))
            row_token.append(tokens)
            row_expert.append(torch.full_like(tokens, local))
    meta = build_metadata(counts=counts, row_slot=torch.cat(row_slot),
                          dest_token_mask=slots[rank][1], tp_size=tp, tp_rank=tp_rank,
                          ep_size=ep, ep_rank=ep_rank, topk=topk, routing_map=maps[rank])
    return RankRows(meta, torch.cat(row_source), torch.cat(row_token), torch.cat(row_expert))
