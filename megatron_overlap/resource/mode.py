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
    counts = counts.astype(np.int64)
    tokens = _tokens(counts, topk)  # [R]
    row_us_link = hidden * elem_bytes / (link_gbps * 1e3)  # one row over the link, in us
    row_us_hbm = hidden * elem_bytes / (hbm_gbps * 1e3)
    k = min(topk, num_experts)
    if ep_size > 1 and num_experts - num_local >= k:
        p_any = 1.0 - math.comb(num_experts - num_local, k) / math.comb(num_experts, k)
    else:
        p_any = 1.0
    # Group rank q = ep * TP + tp computes the rows of EP slice j = q // TP for every source
    # d (its F / TP share): per (d, j), rows and tiles (ceil(rows / BM) x ceil(H / BN) per
    # (expert, source) block, as `resource.model.count_tiles`).
    per_slice = counts.reshape(r, ep_size, num_local)
    rows_to = per_slice.sum(axis=2)  # [R sources, EP slices]
    tiles = (-(-per_slice // bm)).sum(axis=2) * -(-hidden // bn)
    q = np.arange(r)
    j = q // tp_size
    rows_q = rows_to[:, j].sum(axis=0)  # [R]: rows rank q computes
    remote_rows = rows_q - rows_to[q, j]
    waves_us = -(-tiles[:, j].sum(axis=0) // grid) * (tile_ps / _model.PS_PER_US)
    direct = (np.maximum(waves_us, remote_rows * row_us_link)
              + (counts.sum(axis=1) * tp_size + tokens) * row_us_hbm)
    pre_to = np.minimum(rows_to[:, j], tokens[:, None] * p_any)  # [d, q]
    pre_to[q, q] = 0.0  # a rank's own tokens do not travel
    pre = (waves_us + rows_q * row_us_hbm + pre_to.sum(axis=0) * row_us_link
           + (r + 1) * tokens * row_us_hbm)
    d_max, p_max = float(direct.max()), float(pre.max())
    mode = "prereduce" if p_max < d_max else "direct"
    times = pre if mode == "prereduce" else direct
    return ModeChoice(mode, d_max, p_max, int(np.argmax(times)))
