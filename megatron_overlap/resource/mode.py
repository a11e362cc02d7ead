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

    W      = ceil(tiles_q / G) x tau_q                (GEMM2 waves, as `resource.model`)
    D_q    = max(W, remote_rows_q x H x e / B_link)   (peer stores hidden under the GEMM2)
             + (recv_rows_q + T_q) x H x e / B_hbm    (finalize reads all routed rows)
    P_q    = W + rows_q x H x e / B_hbm               (the pass re-reads y)
             + pre_rows_q x H x e / B_link            (one row per token and destination)
             + (R + 1) x T_q x H x e / B_hbm          (finalize reads R slots per token)

tau_q is the profile's tau(F) = alpha + beta x ceil(F / BK) at its calibrated occupancy,
scaled, where the tile's profile has a fill table or a streaming bandwidth, to the mean
tile time of q's own tiles (`resource.model.stream_tau_ps` of the rows of q's EP slice's
experts from every source; since v6.8, as the plan prices this rank's tiles).
pre_rows_q to destination d is min(rows q computes for d, T_d x p) with
p = 1 - C(E - L, k) / C(E, k): the expected number of d's tokens with at least one of their
k experts among q's L (uniform routing; all of them with EP = 1). The op ends with its
slowest rank: the mode with the smaller max over q is chosen, the pre-reduced one charged
the profile's `prereduce_host_us` on top (its extra host work: at prefill sizes where the
host paces the layer, that is what the layer waits for; measured in docs/perf_notes.md
v4.6).

Every input comes from the group-wide routed counts that every rank holds alike (the
dispatcher all-gathers them; `GatherRSMetadata.routed_counts`), the shapes and the profile,
so every rank of the group makes the same choice: the two modes issue different collectives
and must not be mixed. The arithmetic is `mode_times`, in C++ (`csrc/solver.cpp`) with a
bit-identical Python twin (`resource.model.mode_times`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from megatron_overlap.resource.model import IDLE_WHOLE


@dataclass(frozen=True)
class ModeChoice:
    """The combine mode of one call and the two predictions behind it.

    Attributes:
        mode: "direct" or "prereduce".
        direct_us / prereduce_us: the predicted time of the slowest rank in each mode
            (GEMM2 + communication + finalize, microseconds; launches not included).
        slowest_rank: group rank of the slowest rank in the chosen mode.
        prereduce_host_us: the host time charged to the pre-reduced mode on top of
            prereduce_us (the profile's `prereduce_host_us`): "prereduce" was chosen only if
            prereduce_us + prereduce_host_us < direct_us.
    """

    mode: str
    direct_us: float
    prereduce_us: float
    slowest_rank: int
    prereduce_host_us: float = 0.0


def choose_mode(routed_counts, *, tp_size: int, ep_size: int, topk: int, hidden: int,
                elem_bytes: int, grid: int, tile_ps: int, tile: Tuple[int, int, int],
                link_gbps: float, hbm_gbps: float, solver: Optional[str] = None,
                prereduce_host_us: float = 0.0, idle_ppm: int = IDLE_WHOLE, ffn: int = 0,
                fill_ppm=None, stream_mbps: int = 0, reread_ppm: int = 0) -> ModeChoice:
    """Predict both modes from the group's routed counts; choose the faster.

    Args:
        routed_counts: int [R, E]: tokens of group rank g (g = ep * TP + tp) routed to expert
            e (`GatherRSMetadata.routed_counts`): a NumPy array, or a list / CPU tensor
            (converted to int64).
        tp_size, ep_size: TP and EP (R = TP * EP rows of routed_counts).
        topk: the router's top-k.
        hidden: H; elem_bytes: bytes per element of the rows that travel.
        grid: G, CTAs of the fused GEMM2 kernel; tile_ps: tau, one tile's time with all G
            CTAs busy, in picoseconds; tile: (BM, BN, BK).
        link_gbps, hbm_gbps: B_link and B_hbm of the profile (GB/s).
        solver: "cpp", "python" or None (`resource.solver.implementation`): the C++
            `mode_times` (a few us) or its Python twin (`resource.model.mode_times`), which give
            bit-identical times.
        prereduce_host_us: extra host time of a pre-reduced call (microseconds, >= 0),
            added to its prediction: where the host paces the layer (prefill at a few
            thousand tokens per rank) that time is on the critical path, and the GPU time the
            mode saves is not.
        idle_ppm: the tile's last-wave idle cost in millionths of a wave
            (`TileTime.idle_ppm`; `IDLE_WHOLE`, the default, prices whole waves).
        ffn, fill_ppm, stream_mbps, reread_ppm: F and the tile's fill table, streaming
            bandwidth (MB/s) and weight re-read (millionths): `TileTime.fill_ppm_table`,
            `.stream_mbps`, `.reread_ppm`. With a table or a bandwidth each rank's tiles
            cost its EP slice's mean tile time from `tile_ps` (`resource.model.mode_times`,
            `stream_tau_ps`); the defaults: every tile costs `tile_ps`.

    Returns:
        A `ModeChoice`; "direct" on ties and with one rank.

    Raises:
        ValueError: routed_counts not an integer [TP * EP, E] array with E divisible by EP,
            a negative count, or a size out of range; prereduce_host_us negative or not
            finite.
    """
    from megatron_overlap.resource.profile import _check_float
    from megatron_overlap.resource.solver import implementation

    _check_float("prereduce_host_us", prereduce_host_us, positive=False)  # the profile's rule
    if not isinstance(routed_counts, np.ndarray):  # a list or a CPU tensor: both solvers alike
        routed_counts = np.asarray(routed_counts, dtype=np.int64)

    times = implementation(solver).mode_times(
        routed_counts, tp_size, ep_size, topk, hidden, elem_bytes, grid, tile_ps, tile[0],
        tile[1], link_gbps, hbm_gbps, idle_ppm, ffn, fill_ppm, stream_mbps, reread_ppm)
    return mode_choice(times, tp_size * ep_size, prereduce_host_us)


def mode_choice(times: Tuple[float, float, int, int], group_size: int,
                prereduce_host_us: float) -> ModeChoice:
    """The `ModeChoice` of `mode_times`' result (direct_us, prereduce_us, slowest direct
    rank, slowest pre-reduced rank) for a group of `group_size` ranks: "prereduce" only
    where prereduce_us + prereduce_host_us < direct_us (the host time checked by the caller:
    `choose_mode`, or the profile's loader); "direct" on ties and with one rank."""
    direct, pre, slow_d, slow_p = times
    host = float(prereduce_host_us)
    if group_size == 1:
        return ModeChoice("direct", direct, pre, 0, host)
    if pre + host < direct:
        return ModeChoice("prereduce", direct, pre, int(slow_p), host)
    return ModeChoice("direct", direct, pre, int(slow_d), host)
