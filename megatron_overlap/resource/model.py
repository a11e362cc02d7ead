"""The wave-quantized resource model, in plain Python: the readable twin of `csrc/solver.cpp`.

Both implement the same functions with the same arguments and the same integer arithmetic,
so they return the same plan (tests/cpu/test_resource_solver.py checks it on random inputs);
`megatron_overlap.resource.solver` picks the C++ one when it is built. docs/resource_model.md
derives the model; in short:

Shape symbols: G CTAs in the grid (S SMs x o_p CTAs per SM), T_r remote-bound and T_l local
GEMM2 tiles (BM x BN outputs of depth F), k communication CTAs (the CTAs with pid < k claim
remote tiles first, the others local tiles first; both steal from the other queue once
theirs is empty).

Times are integer picoseconds (`_ps`), so that Python and C++ compute bit-identical values:
    tau       one tile's time while all G CTAs are busy: tau(F) = alpha + beta * ceil(F / BK)
              from the hardware profile (scaled by o_p / o_ref when the kernel's occupancy
              differs from the calibrated one: an SM's tile throughput is fixed)
    c_link    one remote tile's bytes b at the link bandwidth: b / B_link
    c_cta     the same at one CTA's store bandwidth: b / B_cta
    tau_r(k)  = max(tau, k * c_link, c_cta): a remote tile's time with k CTAs storing to
              peers at once (the link back-pressures them)
    R(k)      = max(ceil(T_r / k) * max(tau, c_cta), T_r * c_link): the communication CTAs
              alone work off the remote queue, in waves of k, no faster than the link
              (non-increasing in k)
    W(k)      = waves(T_l * tau + T_r * tau_r(k)): all G CTAs share the tiles (whichever
              queue empties first, its CTAs steal from the other), in waves of tau; remote
              tiles count tau_r(k) each (non-decreasing in k)
    waves(w)  = floor(w / (G tau)) * tau + [rem > 0] * ceil((rem * (1 - eta) + eta * G tau)
              / G) for rem = w mod (G tau): whole waves, and a part-filled last wave (busy
              fraction phi) at tau * (phi + eta * (1 - phi)); eta (`idle` in millionths,
              IDLE_WHOLE = 1) is the tile's calibrated cost of a last wave's idle part
              (`TileTime.idle_wave_cost`): 1 gives ceil(w / (G tau)) * tau, the whole-wave
              model, 0 a fluid one (docs/perf_notes.md v6.2 / v6.3)
    E(k)      = max(R(k), W(k)): predicted end of the GEMM2 tiles (and their peer stores)
The plan's k is the smallest k in 1..G-1 with the least E(k); with no remote tile k = 0 and
E = waves(T_l * tau) (= ceil(T_l / G) * tau at eta = 1). Add the last store's latency, the
finalize (HBM bytes / B_hbm) and the launch overhead for the predicted time of the op.

Errors: bad input raises `ValueError` (a value out of range, infeasible resources) or
`TypeError` (not an integer), naming the value and what was expected.
"""

from __future__ import annotations

import math
from typing import Tuple

import numpy as np

PS_PER_US = 1_000_000
"""Picoseconds per microsecond: the model's integer time unit is the picosecond."""

MAX_TILES = 1 << 30
"""Largest tile count accepted (with MAX_TIME_PS and MAX_CTAS every product the model
forms fits in int64, except T_r * tau_r(k), which the C++ solver widens to 128 bits)."""
MAX_TIME_PS = 1 << 32
"""Largest per-tile time accepted for tau, c_link and c_cta: 2^32 ps, about 4.3 ms."""
MAX_CTAS = 1 << 16
"""Largest grid accepted."""
IDLE_WHOLE = 1_000_000
"""`idle_ppm` of the whole-wave model: a part-filled last wave costs a whole tau (the unit
of `idle_ppm` is a millionth of a wave's time)."""


def _int(name: str, value, minimum: int, maximum: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r}: expected an integer")
    value = int(value)
    if not minimum <= value <= maximum:
        raise ValueError(f"{name}={value}: expected an integer in [{minimum}, {maximum}]")
    return value


def _float(name: str, value, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}={value!r}: expected a number")
    value = float(value)
    if not (math.isfinite(value) and value >= minimum):
        raise ValueError(f"{name}={value}: expected a finite number >= {minimum}")
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _ps(x: float) -> int:
    """Round a non-negative time in picoseconds to the nearest integer (halves up)."""
    return math.floor(x + 0.5)


# ---- occupancy -----------------------------------------------------------------------------

def ctas_per_sm(registers_per_thread: int, shared_bytes: int, threads_per_cta: int, *,
                registers_per_sm: int, max_registers_per_thread: int, register_alloc_unit: int,
                shared_bytes_per_sm: int, max_shared_bytes_per_cta: int,
                shared_reserved_bytes_per_cta: int, max_threads_per_sm: int,
                max_threads_per_cta: int, max_ctas_per_sm: int) -> int:
    """Resident CTAs per SM of a kernel (o_p), by CUDA's occupancy rules.

    Registers are allocated per warp, rounded up to `register_alloc_unit`; each resident CTA
    also takes `shared_reserved_bytes_per_cta` of shared memory. The result is the least of
    the register, shared-memory, thread and CTA limits.

    Args:
        registers_per_thread: the compiled kernel's registers per thread (Triton: n_regs).
        shared_bytes: its dynamic + static shared memory per CTA in bytes (Triton:
            metadata.shared).
        threads_per_cta: threads per CTA (Triton: num_warps * 32).
        the rest: the GPU's limits (`GpuLimits` fields).

    Returns:
        int >= 1.

    Raises:
        ValueError: a value out of range, or a CTA of this kernel cannot be resident at all
            (too many registers, shared memory or threads; the message says which).
    """
    lim = dict(registers_per_sm=registers_per_sm, max_registers_per_thread=max_registers_per_thread,
               register_alloc_unit=register_alloc_unit, shared_bytes_per_sm=shared_bytes_per_sm,
               max_shared_bytes_per_cta=max_shared_bytes_per_cta,
               max_threads_per_sm=max_threads_per_sm, max_threads_per_cta=max_threads_per_cta,
               max_ctas_per_sm=max_ctas_per_sm)
    for key, value in lim.items():
        _int(key, value, 1, 1 << 40)
    reserved = _int("shared_reserved_bytes_per_cta", shared_reserved_bytes_per_cta, 0, 1 << 40)
    regs = _int("registers_per_thread", registers_per_thread, 1, max_registers_per_thread)
    shared = _int("shared_bytes", shared_bytes, 0, max_shared_bytes_per_cta)
    threads = _int("threads_per_cta", threads_per_cta, 1, max_threads_per_cta)
    warps = _cdiv(threads, 32)
    regs_per_warp = _cdiv(regs * 32, register_alloc_unit) * register_alloc_unit
    by_regs = (registers_per_sm // regs_per_warp) // warps
    by_shared = shared_bytes_per_sm // (shared + reserved) if shared + reserved > 0 else (
        max_ctas_per_sm)
    by_threads = max_threads_per_sm // (warps * 32)
    ctas = min(by_regs, by_shared, by_threads, max_ctas_per_sm)
    if ctas < 1:
        raise ValueError(
            f"a CTA of {threads} threads x {regs} registers with {shared} bytes of shared "
            f"memory cannot be resident on one SM ({registers_per_sm} registers, "
            f"{shared_bytes_per_sm} bytes of shared memory incl. {reserved} reserved per CTA, "
            f"{max_threads_per_sm} threads): registers allow {by_regs}, shared memory "
            f"{by_shared}, threads {by_threads}")
    return ctas


# ---- tiles ---------------------------------------------------------------------------------

def count_tiles(rows_per_expert_per_chunk, local_chunk: int, bm: int, bn: int,
                hidden: int) -> Tuple[int, int, int]:
    """GEMM2 tiles of one call, split by destination.

    Args:
        rows_per_expert_per_chunk: int64 [L, R]: rows of local expert l from source chunk c
            (`GatherRSMetadata.rows_per_expert_per_chunk`).
        local_chunk: the chunk whose rows stay on this rank (c with
            chunk_to_group_rank(c) == this rank's group rank), in [0, R).
        bm, bn: tile rows and hidden columns; hidden: H.

    Returns:
        (T_r, T_l, remote_rows): tiles of remote-bound rows, tiles of local rows (each
        (expert, chunk) block is ceil(rows / bm) * ceil(H / bn) tiles), rows bound remote.

    Raises:
        ValueError: not a 2-D array, a negative count, local_chunk out of range, bm/bn/hidden
            < 1.
    """
    counts = np.asarray(rows_per_expert_per_chunk)
    if counts.ndim != 2 or counts.shape[1] < 1 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"rows_per_expert_per_chunk must be an integer [L, R] array with R >= 1, "
                         f"got shape {counts.shape} dtype {counts.dtype}")
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"rows_per_expert_per_chunk has a negative count {int(counts.min())}")
    _int("local_chunk", local_chunk, 0, counts.shape[1] - 1)
    bm, bn = _int("bm", bm, 1, 1 << 20), _int("bn", bn, 1, 1 << 20)
    hidden = _int("hidden", hidden, 1, 1 << 30)
    row_blocks = -(-counts.astype(np.int64) // bm)
    col_blocks = _cdiv(hidden, bn)
    per_chunk = row_blocks.sum(axis=0) * col_blocks
    local = int(per_chunk[local_chunk])
    remote = int(per_chunk.sum()) - local
    remote_rows = int(counts.sum()) - int(counts[:, local_chunk].sum())
    if remote + local > MAX_TILES:
        raise ValueError(f"{remote + local} tiles: expected at most {MAX_TILES}")
    return remote, local, remote_rows


def fill_ppm_of_call(rows_per_expert_per_chunk, bm: int, fill_ppm) -> int:
    """The mean cost of the call's GEMM2 tiles relative to a full one, in millionths
    (IDLE_WHOLE = every tile costs a full tile's tau): each (expert, chunk) block of n rows
    is floor(n / BM) full tiles (IDLE_WHOLE each) and, where n mod BM > 0, one tile at
    `fill_ppm[n mod BM]`; the mean over the blocks, rounded to the nearest millionth (every
    block has the same ceil(H / BN) column tiles, so they do not weigh). `fill_ppm`: int64
    [BM + 1], a tile's cost at r valid rows in millionths of a full one
    (`TileTime.fill_ppm_table`); None: IDLE_WHOLE. No tile at all: IDLE_WHOLE.

    Raises:
        ValueError: a table not of BM + 1 integers with entries 1..BM in [1, IDLE_WHOLE]
            (the first bad entry named); counts not an integer [L, R] array, negative, or
            more than MAX_TILES row blocks (as `count_tiles`).
    """
    if fill_ppm is None:
        return IDLE_WHOLE
    bm = _int("bm", bm, 1, 1 << 20)
    table = np.asarray(fill_ppm)
    if (table.ndim != 1 or table.shape[0] != bm + 1
            or not np.issubdtype(table.dtype, np.integer)):
        raise ValueError(f"fill_ppm must be an integer [BM + 1] = [{bm + 1}] array of "
                         f"millionths in [1, {IDLE_WHOLE}], got shape {table.shape} dtype "
                         f"{table.dtype}")
    bad = np.flatnonzero((table[1:] < 1) | (table[1:] > IDLE_WHOLE))
    if bad.size:
        r = int(bad[0]) + 1
        raise ValueError(f"fill_ppm[{r}]={int(table[r])}: expected millionths in "
                         f"[1, {IDLE_WHOLE}]")
    counts = np.asarray(rows_per_expert_per_chunk)
    if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"rows_per_expert_per_chunk must be an integer [L, R] array, got "
                         f"shape {counts.shape} dtype {counts.dtype}")
    counts = counts.astype(np.int64).ravel()
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"rows_per_expert_per_chunk has a negative count {int(counts.min())}")
    if counts.size and int(counts.max()) // bm > MAX_TILES:
        raise ValueError(f"more than {MAX_TILES} row blocks")
    full, rem = counts // bm, counts % bm
    blocks = int(full.sum()) + int((rem > 0).sum())
    if blocks > MAX_TILES:
        raise ValueError(f"more than {MAX_TILES} row blocks")
    if blocks == 0:
        return IDLE_WHOLE
    weighted = int(full.sum()) * IDLE_WHOLE + int(table.astype(np.int64)[rem[rem > 0]].sum())
    return (2 * weighted + blocks) // (2 * blocks)


def scale_tau_ps(tau: int, fill_ppm: int) -> int:
    """tau x fill_ppm / IDLE_WHOLE, rounded to the nearest ps (ties up), at least 1.

    Raises:
        ValueError / TypeError: tau not an int in [1, MAX_TIME_PS], fill_ppm not in
            [1, IDLE_WHOLE].
    """
    tau = _int("tau_ps", tau, 1, MAX_TIME_PS)
    fill_ppm = _int("fill_ppm", fill_ppm, 1, IDLE_WHOLE)
    return max(1, (2 * tau * fill_ppm + IDLE_WHOLE) // (2 * IDLE_WHOLE))


MAX_STREAM_BYTES = 1 << 40
"""Largest BN x F, BM x F and BM x BN operand block (bytes) `stream_tau_ps` accepts (so that
every product it forms fits in 128 bits in the C++ solver)."""


def stream_tau_ps(rows_per_expert_per_chunk, bm: int, bn: int, hidden: int, ffn: int,
                  elem_bytes: int, num_ctas: int, tau: int, fill_ppm, stream_mbps: int,
                  reread_ppm: int) -> int:
    """The mean time of the call's GEMM2 tiles with all G CTAs busy, in ps: each tile at
    the larger of its compute time and its share of the HBM stream (docs/resource_model.md,
    "weight streaming"; docs/perf_notes.md v6.7).

    Per (expert, chunk) block of n rows: floor(n / BM) full tiles and, where r = n mod BM
    > 0, one of r valid rows, each at max(tau x fill, G x u / B_s) (fill: `fill_ppm[r]` /
    IDLE_WHOLE, 1 for a full tile; `scale_tau_ps`' rounding), with u the tile's HBM bytes
    (x 10^6, integer division in this order):
        u = BN F e (10^6 + (N - 1) q) // N + r F e 10^6 // ceil(H / BN) + r BN e 10^6
    the expert's weight slice read once for its first row block and q / 10^6 of it again
    for each of its other N - 1 row blocks (N: the expert's row blocks over all chunks;
    `reread_ppm` q), the tile's activation rows read once for all its column tiles, its
    outputs written once; B_s = `stream_mbps` (MB/s, so bytes x 10^6 / B_s is ps). The
    mean over the blocks, rounded to nearest (ties up): every block has the same ceil(H / BN)
    column tiles. `stream_mbps` 0: no streaming term, `scale_tau_ps(tau,
    fill_ppm_of_call(...))` exactly (the model before v6.7). No tile at all: tau.

    Raises:
        ValueError / TypeError: a size or count out of range, a BN x F, BM x F or BM x BN
            block above MAX_STREAM_BYTES, a bad fill table (as `fill_ppm_of_call`), a mean
            above MAX_TIME_PS (each names the value).
    """
    tau = _int("tau_ps", tau, 1, MAX_TIME_PS)
    stream_mbps = _int("stream_mbps", stream_mbps, 0, 1 << 40)
    reread = _int("reread_ppm", reread_ppm, 0, IDLE_WHOLE)
    bm, bn = _int("bm", bm, 1, 1 << 20), _int("bn", bn, 1, 1 << 20)
    hidden, ffn = _int("hidden", hidden, 1, 1 << 30), _int("ffn", ffn, 1, 1 << 30)
    elem = _int("elem_bytes", elem_bytes, 1, 16)
    g = _int("num_ctas", num_ctas, 1, MAX_CTAS)
    mean_fill = fill_ppm_of_call(rows_per_expert_per_chunk, bm, fill_ppm)  # checks both
    if stream_mbps == 0:
        return scale_tau_ps(tau, mean_fill)
    for name, value in (("BN x F x elem_bytes", bn * ffn * elem),
                        ("BM x F x elem_bytes", bm * ffn * elem),
                        ("BM x BN x elem_bytes", bm * bn * elem)):
        if value > MAX_STREAM_BYTES:
            raise ValueError(f"{name}={value}: expected at most {MAX_STREAM_BYTES} bytes")
    table = None if fill_ppm is None else [int(x) for x in np.asarray(fill_ppm)]
    counts = np.asarray(rows_per_expert_per_chunk)
    if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError(f"rows_per_expert_per_chunk must be an integer [L, R] array, got "
                         f"shape {counts.shape} dtype {counts.dtype}")
    counts = counts.astype(np.int64)
    if counts.size and int(counts.min()) < 0:
        raise ValueError(f"rows_per_expert_per_chunk has a negative count {int(counts.min())}")
    if int((-(-counts // bm)).sum()) > MAX_TILES:
        raise ValueError(f"more than {MAX_TILES} row blocks")
    cols = _cdiv(hidden, bn)
    weights = bn * ffn * elem

    def tile_ps(r: int, u_b: int) -> int:
        t = tau if table is None or r == bm else max(
            1, (2 * tau * table[r] + IDLE_WHOLE) // (2 * IDLE_WHOLE))
        u = u_b + r * ffn * elem * IDLE_WHOLE // cols + r * bn * elem * IDLE_WHOLE
        return max(t, g * u // stream_mbps)

    total = blocks = 0
    for row in counts.tolist():
        n_blocks = sum(_cdiv(n, bm) for n in row)
        if n_blocks == 0:
            continue
        u_b = weights * (IDLE_WHOLE + (n_blocks - 1) * reread) // n_blocks
        full_ps = tile_ps(bm, u_b)
        for n in row:
            full, rem = divmod(n, bm)
            total += full * full_ps
            blocks += full
            if rem:
                total += tile_ps(rem, u_b)
                blocks += 1
    if blocks == 0:
        return tau
    mean = (2 * total + blocks) // (2 * blocks)
    if mean > MAX_TIME_PS:
        raise ValueError(f"the call's mean tile time {mean} ps: expected at most "
                         f"{MAX_TIME_PS} ps")
    return mean


# ---- the problem and its solution ----------------------------------------------------------

def make_problem(num_ctas: int, remote_tiles: int, local_tiles: int, remote_rows: int,
                 hidden: int, elem_bytes: int, ffn: int, bk: int, alpha_us: float,
                 beta_us: float, ctas_per_sm: int, calibrated_ctas_per_sm: int,
                 link_bandwidth_gbps: float, cta_bandwidth_gbps: float) -> Tuple[int, ...]:
    """The solver's integer problem (G, T_r, T_l, tau_ps, c_link_ps, c_cta_ps).

    tau = (alpha_us + beta_us * ceil(ffn / bk)) * o_p / o_ref; b = remote_rows * hidden *
    elem_bytes / T_r bytes (the average remote tile); c_link = b / B_link, c_cta = b / B_cta
    (GB/s = 1e3 bytes per microsecond). Every time is rounded once to whole picoseconds.

    Raises:
        ValueError / TypeError: a value out of range (names it).
    """
    g = _int("num_ctas", num_ctas, 1, MAX_CTAS)
    tr = _int("remote_tiles", remote_tiles, 0, MAX_TILES)
    tl = _int("local_tiles", local_tiles, 0, MAX_TILES)
    rows = _int("remote_rows", remote_rows, 0, MAX_TILES)
    hidden = _int("hidden", hidden, 1, 1 << 30)
    elem = _int("elem_bytes", elem_bytes, 1, 16)
    ffn = _int("ffn", ffn, 1, 1 << 30)
    bk = _int("bk", bk, 1, 1 << 20)
    o_p = _int("ctas_per_sm", ctas_per_sm, 1, 1 << 10)
    o_ref = _int("calibrated_ctas_per_sm", calibrated_ctas_per_sm, 1, 1 << 10)
    alpha, beta = _float("alpha_us", alpha_us), _float("beta_us", beta_us)
    b_link = _float("link_bandwidth_gbps", link_bandwidth_gbps, 1e-9)
    b_cta = _float("cta_bandwidth_gbps", cta_bandwidth_gbps, 1e-9)
    if (tr == 0) != (rows == 0):
        raise ValueError(f"remote_tiles={tr} and remote_rows={rows}: both must be 0 or both > 0")
    ksteps = _cdiv(ffn, bk)
    tau = max(1, _ps((alpha + beta * float(ksteps)) * 1e6 * float(o_p) / float(o_ref)))
    c_link = c_cta = 0
    if tr:
        # float arithmetic in this exact order in both implementations (bit-identical)
        remote_bytes = float(rows) * float(hidden) * float(elem)
        c_link = _ps(remote_bytes * 1000.0 / (float(tr) * b_link))
        c_cta = _ps(remote_bytes * 1000.0 / (float(tr) * b_cta))
    for name, value in (("tau_ps", tau), ("c_link_ps", c_link), ("c_cta_ps", c_cta)):
        if value > MAX_TIME_PS:
            raise ValueError(f"{name}={value}: expected at most {MAX_TIME_PS} ps")
    return g, tr, tl, tau, c_link, c_cta


def _check_problem(g, tr, tl, tau, c_link, c_cta, idle=IDLE_WHOLE) -> Tuple[int, ...]:
    return (_int("num_ctas", g, 1, MAX_CTAS), _int("remote_tiles", tr, 0, MAX_TILES),
            _int("local_tiles", tl, 0, MAX_TILES), _int("tau_ps", tau, 1, MAX_TIME_PS),
            _int("c_link_ps", c_link, 0, MAX_TIME_PS), _int("c_cta_ps", c_cta, 0, MAX_TIME_PS),
            _int("idle_ppm", idle, 0, IDLE_WHOLE))


def remote_tile_ps(k: int, g, tr, tl, tau, c_link, c_cta, idle=IDLE_WHOLE) -> int:
    """tau_r(k) = max(tau, k * c_link, c_cta)."""
    return max(tau, k * c_link, c_cta)


def remote_bound_ps(k: int, g, tr, tl, tau, c_link, c_cta, idle=IDLE_WHOLE) -> int:
    """R(k) = max(ceil(T_r / k) * max(tau, c_cta), T_r * c_link) (k >= 1). The
    communication CTAs' own rounds are not given the last-wave discount (`idle`: unused)."""
    return max(_cdiv(tr, k) * max(tau, c_cta), tr * c_link)


def waves_ps(work: int, g: int, tau: int, idle: int = IDLE_WHOLE) -> int:
    """waves(work): `work` ps x CTAs on G CTAs in waves of tau, a part-filled last wave at
    tau x (busy fraction + idle / IDLE_WHOLE x idle fraction), rounded up to a ps."""
    full, rem = divmod(work, g * tau)
    if rem == 0:
        return full * tau
    return full * tau + _cdiv(rem * (IDLE_WHOLE - idle) + idle * g * tau, g * IDLE_WHOLE)


def wave_bound_ps(k: int, g, tr, tl, tau, c_link, c_cta, idle=IDLE_WHOLE) -> int:
    """W(k) = waves(T_l * tau + T_r * tau_r(k))."""
    work = tl * tau + tr * remote_tile_ps(k, g, tr, tl, tau, c_link, c_cta)
    return waves_ps(work, g, tau, idle)


def gemm_end_ps(k: int, g: int, tr: int, tl: int, tau: int, c_link: int, c_cta: int,
                idle_ppm: int = IDLE_WHOLE) -> int:
    """E(k): predicted end of the GEMM2 tiles with k communication CTAs, in ps.

    k may be 0 only without remote tiles (then E = waves(T_l * tau)); otherwise 1..G.
    idle_ppm: the tile's last-wave idle cost in millionths of a wave (IDLE_WHOLE: whole
    waves).

    Raises:
        ValueError: k out of range, or a bad problem.
    """
    p = _check_problem(g, tr, tl, tau, c_link, c_cta, idle_ppm)
    g, tr, tl, tau, _, _, idle = p
    if tr == 0:
        _int("k", k, 0, g)
        return waves_ps(tl * tau, g, tau, idle)
    _int("k", k, 1, g)
    return _end(k, p)


def _end(k: int, p: Tuple[int, ...]) -> int:
    return max(remote_bound_ps(k, *p), wave_bound_ps(k, *p))


def solve(g: int, tr: int, tl: int, tau: int, c_link: int, c_cta: int,
          idle_ppm: int = IDLE_WHOLE) -> Tuple[int, int]:
    """The plan's k and its E(k) in ps: every k in 1..G-1 tried, least E, ties to the
    smallest k; k = 0 without remote tiles. idle_ppm: as `gemm_end_ps`.

    Raises:
        ValueError: remote tiles with fewer than 2 CTAs in the grid (no k leaves a CTA for
            the local queue), or a bad problem.
    """
    p = _check_problem(g, tr, tl, tau, c_link, c_cta, idle_ppm)
    g, tr, tl, tau, _, _, idle = p
    if tr == 0:
        return 0, waves_ps(tl * tau, g, tau, idle)
    if g < 2:
        raise ValueError(f"num_ctas={g}: {tr} remote tiles need a grid of at least 2 CTAs "
                         "(k communication CTAs, 1 <= k <= G - 1)")
    best_k, best = 1, None
    for k in range(1, g):
        e = _end(k, p)
        if best is None or e < best:
            best_k, best = k, e
    return best_k, best


def solve_batch(problems) -> np.ndarray:
    """`solve` on every row of an int64 [n, 6] array of problems (or [n, 7]: with
    idle_ppm); returns int64 [n, 2]."""
    arr = np.asarray(problems)
    if arr.ndim != 2 or arr.shape[1] not in (6, 7):
        raise ValueError(f"problems must be [n, 6] (G, T_r, T_l, tau, c_link, c_cta) or [n, 7] "
                         f"(and idle_ppm), got shape {arr.shape}")
    out = np.empty((arr.shape[0], 2), dtype=np.int64)
    for i, row in enumerate(arr.tolist()):
        out[i] = solve(*row)
    return out


def plan_call(rows_per_expert_per_chunk, local_chunk: int, bm: int, bn: int, bk: int,
              hidden: int, elem_bytes: int, ffn: int, num_ctas: int, alpha_us: float,
              beta_us: float, ctas_per_sm: int, calibrated_ctas_per_sm: int,
              link_bandwidth_gbps: float, cta_bandwidth_gbps: float, override_k: int,
              routed_counts, tp_size: int, ep_size: int, topk: int, mode_num_ctas: int,
              mode_tile_ps: int, hbm_bandwidth_gbps: float,
              idle_ppm: int = IDLE_WHOLE, fill_ppm=None, stream_mbps: int = 0,
              reread_ppm: int = 0) -> tuple:
    """One plan's model in one call (what `plan_gemm2_gatherrs` asks; the C++ solver has
    the same function, one crossing of the binding instead of four): `count_tiles`,
    `make_problem`, `solve` (or `gemm_end_ps` at `override_k` when it is not 0), the
    breakdown's terms at the chosen k and, where `routed_counts` is not None, `mode_times`
    with (`mode_num_ctas`, `mode_tile_ps`); `idle_ppm` (the tile's last-wave idle cost) in
    both; `fill_ppm` (None, or the tile's cost at r valid rows, `fill_ppm_of_call`) and
    `stream_mbps` / `reread_ppm` (the tile's streaming bandwidth and weight re-read; 0 / 0:
    no streaming term) replace the problem's tau by the call's mean tile time
    (`stream_tau_ps`; with `stream_mbps` 0 the tau scaled by the mean fill cost) before it
    is solved; the mode model prices each rank's tiles alike from `mode_tile_ps`
    (`mode_times`' per-rank tile time, since v6.8).

    Returns:
        (k, E(k) ps, T_r, T_l, tau ps, tau_r(k) ps, R(k) ps, W(k) ps, mode_times' tuple or
        None); without remote tiles the three terms are (0, 0, E).

    Raises:
        ValueError / TypeError: as the functions it calls.
    """
    tr, tl, rows = count_tiles(rows_per_expert_per_chunk, local_chunk, bm, bn, hidden)
    p = make_problem(num_ctas, tr, tl, rows, hidden, elem_bytes, ffn, bk, alpha_us, beta_us,
                     ctas_per_sm, calibrated_ctas_per_sm, link_bandwidth_gbps,
                     cta_bandwidth_gbps)
    if fill_ppm is not None or stream_mbps != 0:
        p = p[:3] + (stream_tau_ps(rows_per_expert_per_chunk, bm, bn, hidden, ffn, elem_bytes,
                                   num_ctas, p[3], fill_ppm, stream_mbps, reread_ppm),) + p[4:]
    p = p + (_int("idle_ppm", idle_ppm, 0, IDLE_WHOLE),)
    if override_k != 0:
        k, end = override_k, gemm_end_ps(override_k, *p)
    else:
        k, end = solve(*p)
    terms = ((remote_tile_ps(k, *p), remote_bound_ps(k, *p), wave_bound_ps(k, *p))
             if p[1] and k >= 1 else (0, 0, end))
    mode = None
    if routed_counts is not None:
        mode = mode_times(routed_counts, tp_size, ep_size, topk, hidden, elem_bytes,
                          mode_num_ctas, mode_tile_ps, bm, bn, link_bandwidth_gbps,
                          hbm_bandwidth_gbps, idle_ppm, ffn, fill_ppm, stream_mbps,
                          reread_ppm)
    return (k, end, tr, tl, p[3]) + terms + (mode,)


# ---- the combine mode (resource.mode) -------------------------------------------------------

def mode_times(routed_counts, tp_size: int, ep_size: int, topk: int, hidden: int,
               elem_bytes: int, num_ctas: int, tile_ps: int, bm: int, bn: int,
               link_bandwidth_gbps: float, hbm_bandwidth_gbps: float,
               idle_ppm: int = IDLE_WHOLE, ffn: int = 0, fill_ppm=None,
               stream_mbps: int = 0, reread_ppm: int = 0) -> Tuple[float, ...]:
    """Predicted time of the slowest rank in the direct and the pre-reduced mode
    (microseconds), and which group rank that is in each: (direct_us, prereduce_us,
    slowest_direct, slowest_prereduce). The formulas: `resource.mode`. Plain loops in one
    fixed order of double operations, which `csrc/solver.cpp` repeats (bit-identical).

    Args:
        routed_counts: int [R, E] (R = TP * EP; row g = ep * TP + tp): tokens of rank g
            routed to expert e.
        tile_ps: tau, one tile's time at the profile's calibrated occupancy; num_ctas: G.
        idle_ppm: the tile's last-wave idle cost (as `gemm_end_ps`): a rank's GEMM2 time
            is its whole waves plus the last one's busy fraction + idle x its idle fraction.
        ffn, fill_ppm, stream_mbps, reread_ppm: F and the tile's fill table, streaming
            bandwidth and weight re-read (`stream_tau_ps`). Where `fill_ppm` is not None or
            `stream_mbps` is not 0, each rank's waves are priced at its own mean tile time,
            `stream_tau_ps` of its EP slice's counts (every source's rows of its L experts,
            [L, R]) from tau; the TP ranks of one EP slice share it. Otherwise (the
            defaults, the model before v6.8) every rank's tiles cost tau and `ffn` is
            not read.

    Raises:
        ValueError: not an integer [TP * EP, E] array with E divisible by EP, a negative
            count, or a size out of range (names it).
    """
    counts = np.asarray(routed_counts)
    tp = _int("tp_size", tp_size, 1, 1 << 16)
    ep = _int("ep_size", ep_size, 1, 1 << 16)
    r = tp * ep
    if (counts.ndim != 2 or counts.shape[0] != r or not np.issubdtype(counts.dtype, np.integer)
            or counts.shape[1] < ep or counts.shape[1] % ep):
        raise ValueError(f"routed_counts must be an integer [TP * EP = {r}, E] array with E "
                         f"divisible by EP = {ep}, got shape {counts.shape} dtype {counts.dtype}")
    topk = _int("topk", topk, 1, 1 << 20)
    hidden = _int("hidden", hidden, 1, 1 << 30)
    elem = _int("elem_bytes", elem_bytes, 1, 16)
    g = _int("num_ctas", num_ctas, 1, MAX_CTAS)
    tau = _int("tile_ps", tile_ps, 1, MAX_TIME_PS)
    bm, bn = _int("bm", bm, 1, 1 << 20), _int("bn", bn, 1, 1 << 20)
    b_link = _float("link_bandwidth_gbps", link_bandwidth_gbps, 1e-9)
    b_hbm = _float("hbm_bandwidth_gbps", hbm_bandwidth_gbps, 1e-9)
    idle_frac = float(_int("idle_ppm", idle_ppm, 0, IDLE_WHOLE)) / float(IDLE_WHOLE)
    rows = [[int(x) for x in row] for row in counts.tolist()]
    if any(x < 0 for row in rows for x in row):
        raise ValueError(f"routed_counts has a negative count {int(counts.min())}")
    if any(x > MAX_TILES * bm for row in rows for x in row):
        raise ValueError("routed_counts: count too large")
    num_experts = counts.shape[1]
    num_local = num_experts // ep
    col_blocks = _cdiv(hidden, bn)
    k = min(topk, num_experts)
    p_none = 0.0
    if ep > 1 and num_experts - num_local >= k:
        p_none = 1.0
        for i in range(k):  # C(E - L, k) / C(E, k) as a product, in this order
            p_none *= float(num_experts - num_local - i) / float(num_experts - i)
    p_any = 1.0 - p_none
    row_link = float(hidden) * float(elem) / (b_link * 1e3)  # one row over the link, us
    row_hbm = float(hidden) * float(elem) / (b_hbm * 1e3)
    tokens = [_cdiv(sum(row), topk) for row in rows]
    # rows and tiles of source d for EP slice j
    rows_to = [[sum(row[j * num_local:(j + 1) * num_local]) for j in range(ep)] for row in rows]
    tiles_to = [[sum(_cdiv(x, bm) for x in row[j * num_local:(j + 1) * num_local]) * col_blocks
                 for j in range(ep)] for row in rows]
    # each EP slice's mean tile time (v6.8): the rows of its experts from every source
    tau_of = [tau] * ep
    if fill_ppm is not None or stream_mbps != 0:
        for j in range(ep):
            slice_j = counts[:, j * num_local:(j + 1) * num_local].astype(np.int64).T
            tau_of[j] = stream_tau_ps(slice_j, bm, bn, hidden, ffn, elem, g, tau, fill_ppm,
                                      stream_mbps, reread_ppm)
    best = [-1.0, -1.0]
    slowest = [0, 0]
    for q in range(r):
        j = q // tp
        rows_q = sum(rows_to[d][j] for d in range(r))
        tiles_q = sum(tiles_to[d][j] for d in range(r))
        full, rem = divmod(tiles_q, g)
        waves = float(full)
        if rem:
            waves += (float(rem) + idle_frac * float(g - rem)) / float(g)
        waves_us = waves * (float(tau_of[j]) / float(PS_PER_US))
        direct = (max(waves_us, float(rows_q - rows_to[q][j]) * row_link)
                  + float(sum(rows[q]) * tp + tokens[q]) * row_hbm)
        pre_rows = 0.0
        for d in range(r):
            if d != q:
                pre_rows += min(float(rows_to[d][j]), float(tokens[d]) * p_any)
        pre = (waves_us + float(rows_q) * row_hbm + pre_rows * row_link
               + float((r + 1) * tokens[q]) * row_hbm)
        for m, t in ((0, direct), (1, pre)):
            if t > best[m]:
                best[m], slowest[m] = t, q
    return best[0], best[1], slowest[0], slowest[1]
