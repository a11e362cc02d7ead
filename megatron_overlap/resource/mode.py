"""Direct or pre-reduced: the resource manager's choice of the combine mode per call.

The fused op has two modes (docs/resource_model.md, "The mode choice"):

* **direct**: every GEMM2 tile's epilogue stores its rows into the destination's receive
  buffer (remote-bound tiles over NVLink, while the other tiles compute); the destination's
  finalize then sums top-k x TP rows per token;
* **pre-reduced** (`ops.triton_prereduce`): the GEMM2 stores every tile locally, then one
  pass sums each token's rows on the rank that computed them and sends one row per
  (token, source rank); the finalize sums R rows per token.

The direct mode moves top-k-times more bytes over the link (for TP, top-k x more; for EP
the rows of a token's experts on one rank) but hides them under the GEMM2; the pre-reduced
mode moves few bytes but re-reads y and does not overlap its pass with the GEMM. Per group
rank q (all times in microseconds):

    W      = ceil(tiles_q / G) x tau                  (GEMM2 waves, as `resource.model`)
    D_q    = max(W, remote_rows_q x H x e / B_link)   (peer stores hidden under the GEMM2)
             + (recv_rows_q + T_q) x H x e / B_hbm    (finalize reads all routed rows)
    P_q    = W + rows_q x H x e / B_hbm               (the pass re-reads y)
             + pre_rows_q x H x e / B_link            (one row per token and destination)
             + (R + 1) x T_q x H x e / B_hbm          (finalize reads R slots per token)

pre_rows_q to
destination d is min(rows q computes for d, T_d x (1 - C(E - L, k) / C(E, k))): the
expected number of d's tokens with at least one of their k experts among q's L (uniform
routing; all of them with EP = 1). The op ends with its slowest rank: the mode with the
smaller max over q is chosen.

Every input comes from the group-wide routed counts that every rank holds alike (the
dispatcher all-gathers them; `GatherRSMetadata.routed_counts`), so every rank of the group
makes the same choice: the two modes issue different collectives and must not be mixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np

from megatron_overlap.metadata import chunk_to_group_rank
from megatron_overlap.resource import model as _model

MODES = ("direct", "prereduce")


@dataclass(frozen=True)
class ModeChoice:
    """The combine mode of one call and the two predictions behind it.

    Attributes:
        mode: "direct" or "prereduce".
        direct_us / prereduce_us: the predicted time of the slowest rank in each mode
            (GEMM2 + communication + finalize, microseconds; launches not included).
        slowest_rank: group rank of the slowest rank in the chosen mode.
    """

    mode: str
    direct_us: float
    prereduce_us: float
    slowest_rank: int


def _tokens(routed: np.ndarray, topk: int) -> np.ndarray:
    """Every rank's token count from its routed (token, expert) pairs (exact when dropless;
    a lower bound otherwise, which only matters for the prediction)."""
    return -(-routed.sum(axis=1) // topk)


def choose_mode(routed_counts, *, tp_size: int, ep_size: int, topk: int, hidden: int,
                elem_bytes: int, grid: int, tile_ps: int, tile: Tuple[int, int, int],
                link_gbps: float, hbm_gbps: float) -> ModeChoice:
    """Predict both modes from the group's routed counts; choose the faster.

    Args:
        routed_counts: int [R, E]: tokens of group rank g (g = ep * TP + tp) routed to expert
            e (`GatherRSMetadata.routed_counts`).
        tp_size, ep_size: TP and EP (R = TP * EP rows of routed_counts).
        topk: the router's top-k.
        hidden: H; elem_bytes: bytes per element of the rows that travel.
        grid: G, CTAs of the fused GEMM2 kernel; tile_ps: tau, one tile's time with all G
            CTAs busy, in picoseconds (`resource.model.make_problem`); tile: (BM, BN, BK).
        link_gbps, hbm_gbps: B_link and B_hbm of the profile (GB/s).

    Returns:
        A `ModeChoice`; "direct" on ties and with one rank.

    Raises:
        ValueError: routed_counts not an integer [TP * EP, E] array with E divisible by EP,
            or a size out of range.
    """
    counts = np.asarray(routed_counts)
    r = tp_size * ep_size
    if (counts.ndim != 2 or counts.shape[0] != r or not np.issubdtype(counts.dtype, np.integer)
            or counts.shape[1] < ep_size or counts.shape[1] % ep_size):
        raise ValueError(f"routed_counts must be an integer [TP * EP = {r}, E] array with E "
                         f"divisible by EP = {ep_size}, got shape {counts.shape} "
                         f"dtype {counts.dtype}")
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"routed_counts has a negative count {int(counts.min())}")
    for name, value in (("topk", topk), ("hidden", hidden), ("elem_bytes", elem_bytes),
                        ("grid", grid), ("tile_ps", tile_ps)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
    if not (link_gbps > 0 and hbm_gbps > 0):
        raise ValueError(f"bandwidths must be > 0 GB/s, got link {link_gbps}, HBM {hbm_gbps}")
    if r == 1:
        return ModeChoice("direct", 0.0, 0.0, 0)
    num_experts = counts.shape[1]
    num_local = num_experts // ep_size
    bm, bn, _ = tile
    tokens = _tokens(counts, topk)
    row_us_link = hidden * elem_bytes / (link_gbps * 1e3)  # one row over the link, in us
    row_us_hbm = hidden * elem_bytes / (hbm_gbps * 1e3)
    k = min(topk, num_experts)
    if ep_size > 1 and num_experts - num_local >= k:
        p_any = 1.0 - math.comb(num_experts - num_local, k) / math.comb(num_experts, k)
    else:
        p_any = 1.0
    chunk_groups = [chunk_to_group_rank(c, tp_size, ep_size) for c in range(r)]
    tau_us = tile_ps / _model.PS_PER_US
    direct, pre = [], []
    for q in range(r):
        ep_q, tp_q = divmod(q, tp_size)
        experts = slice(ep_q * num_local, (ep_q + 1) * num_local)
        rows_to = counts[:, experts].sum(axis=1)  # rows q computes for each destination
        rpc = counts[chunk_groups, experts].T  # [L, R] chunk order, as the metadata has it
        remote_tiles, local_tiles, remote_rows = _model.count_tiles(
            rpc, tp_q * ep_size + ep_q, bm, bn, hidden)
        waves_us = -(-(remote_tiles + local_tiles) // grid) * tau_us
        link_d = remote_rows * row_us_link
        recv_rows = int(counts[q].sum()) * tp_size
        direct.append(max(waves_us, link_d) + (recv_rows + int(tokens[q])) * row_us_hbm)
        pre_rows = sum(min(float(rows_to[d]), float(tokens[d]) * p_any)
                       for d in range(r) if d != q)
        pre.append(waves_us + int(rows_to.sum()) * row_us_hbm + pre_rows * row_us_link
                   + (r + 1) * int(tokens[q]) * row_us_hbm)
    d_max, p_max = max(direct), max(pre)
    mode = "prereduce" if p_max < d_max else "direct"
    times = pre if mode == "prereduce" else direct
    return ModeChoice(mode, d_max, p_max, int(np.argmax(times)))
