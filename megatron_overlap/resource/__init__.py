"""Resource manager: picks the communication CTAs and the grid before every launch.

`plan_gemm2_gatherrs` reads the call's routing metadata, the kernel's resources and a
hardware profile (`configs/hardware/*.yaml`), and solves the wave-quantized model of
DESIGN.md §4 as written down in `resource.model` (docs/resource_model.md): nothing is
measured, compiled or tried at run time. The solver is C++ (`csrc/solver.cpp`, built with
the package); the Python twin in `resource.model` stands in, with a one-time warning, where
the extension is not built.

Shape symbols: H hidden size, F expert FFN width per TP rank, L local experts, R = TP * EP
ranks; G grid CTAs = S SMs x o_p CTAs per SM; k communication CTAs (CTAs with pid < k claim
remote-bound tiles first).
"""

from __future__ import annotations

import functools
import numbers

import warnings
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from megatron_overlap._host import getenv
from megatron_overlap.config import SOLVER_ENV, GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.resource import model as _model
from megatron_overlap.resource.mode import ModeChoice, mode_choice
from megatron_overlap.resource.profile import PROFILE_ENV, HardwareProfile, load_profile

__all__ = [
    "DEFAULT_KERNEL_RESOURCES",
    "DEFAULT_NUM_COMM_CTAS",
    "DEFAULT_TILE",
    "HardwareProfile",
    "KernelResources",
    "ModeChoice",
    "Plan",
    "PlanBreakdown",
    "kernel_resources_from_compiled",
    "group_time_us",
    "load_profile",
    "plan_gemm2_gatherrs",
]

DEFAULT_NUM_COMM_CTAS = 16
"""Communication CTAs when the model cannot run: no SM count (CPU / reference backend) or
no hidden/ffn sizes from the caller. On 2x H200 (NV18) Triton peer stores moved ~238 GB/s
with 16 CTAs against ~257 GB/s with 32 (DESIGN.md §4), so 16 is near the link's knee."""

DEFAULT_TILE = (128, 256, 64)
"""(BM, BN, BK) of the fused kernel's GEMM2 tiles (`ops.triton_gemm2_gatherrs.BLOCK_*`)."""


@dataclass(frozen=True)
class KernelResources:
    """What one CTA of the compiled fused kernel takes on an SM.

    From a compiled Triton kernel: `kernel_resources_from_compiled(compiled)`
    (`compiled.n_regs`, `compiled.metadata.shared`, `num_warps * 32`).

    Raises:
        TypeError: a field is not an int.
        ValueError: a field is out of range (registers < 1, shared memory < 0, threads < 1).
    """

    registers_per_thread: int
    shared_bytes: int
    """Shared memory per CTA in bytes (static + dynamic)."""
    threads_per_cta: int

    def __post_init__(self) -> None:
        for key, minimum in (("registers_per_thread", 1), ("shared_bytes", 0),
                             ("threads_per_cta", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"KernelResources.{key}={value!r}: expected an int")
            if value < minimum:
                raise ValueError(f"KernelResources.{key}={value}: expected >= {minimum}")


DEFAULT_KERNEL_RESOURCES = KernelResources(registers_per_thread=255, shared_bytes=98304,
                                           threads_per_cta=256)
"""Used until the caller passes the compiled kernel's values: 8 warps, 3 pipeline stages of
a 128x64 A and a 128x64 B bf16 tile (3 * 32 KiB of shared memory) and the most registers a
thread can have, so one CTA per SM: the grid the fused kernel has launched so far."""


def kernel_resources_from_compiled(compiled) -> KernelResources:
    """`KernelResources` of a compiled Triton kernel (`kernel.warmup(...)` or the handle a
    launch returns): registers `compiled.n_regs`, shared memory `compiled.metadata.shared`,
    threads `compiled.metadata.num_warps * 32`.

    Raises:
        ValueError: the object lacks these attributes (the kernel is not compiled yet).
    """
    try:
        return KernelResources(registers_per_thread=int(compiled.n_regs),
                               shared_bytes=int(compiled.metadata.shared),
                               threads_per_cta=int(compiled.metadata.num_warps) * 32)
    except AttributeError as err:
        raise ValueError(f"{type(compiled).__name__} is not a compiled Triton kernel "
                         f"(n_regs / metadata.shared / metadata.num_warps): {err}") from err


@dataclass(frozen=True)
class PlanBreakdown:
    """The model's terms for the chosen k (times in microseconds; docs/resource_model.md)."""

    remote_tiles: int
    """T_r: tiles whose rows go to other ranks."""
    local_tiles: int
    """T_l: tiles whose rows stay on this rank."""
    ctas_per_sm: int
    """o_p: resident CTAs per SM of the kernel."""
    tile_us: float
    """tau: the mean time of the call's tiles with all G CTAs busy (the profile's
    alpha + beta x ceil(F / BK), scaled by o_p / o_ref; where the entry has a `fill_cost`
    or a `stream_gbps`, the mean over the call's tiles of the larger of that time (scaled
    by the tile's fill cost) and its HBM bytes at the streaming bandwidth:
    `resource.model.stream_tau_ps`)."""
    remote_tile_us: float
    """tau_r(k) = max(tau, k * b / B_link, b / B_cta)."""
    remote_bound_us: float
    """R(k): the k communication CTAs working off the remote queue alone."""
    wave_bound_us: float
    """W(k): all G CTAs sharing every tile, in waves (a part-filled last one at its busy
    fraction + the tile's `idle_wave_cost` x its idle fraction)."""
    gemm_us: float
    """E(k) = max(R(k), W(k)): end of the tiles and their peer stores."""
    store_latency_us: float
    finalize_us: float
    launch_us: float


@dataclass(frozen=True)
class Plan:
    """One launch's resource split.

    Attributes:
        num_comm_ctas: k, the communication CTAs: CTAs with pid < k claim remote-bound tiles
            first (the SM partition that produces and ships them). 0 only with source
            "no-remote" (no tile leaves this rank); otherwise 1..num_ctas.
        num_ctas: G, grid of the fused persistent kernel (SMs x resident CTAs per SM), or
            None when the SM count is unknown (CPU / reference backend).
        source: "model" (the solver's choice), "no-remote" (nothing to ship), "override"
            (options.num_comm_ctas), "cpu" (no SM count) or "fixed" (no hidden/ffn sizes
            given: DEFAULT_NUM_COMM_CTAS).
        predicted_us: the model's predicted time of the op (GEMM end + last store latency +
            finalize + launch), or None when the model did not run.
        breakdown: the model's terms, or None when it did not run.
        mode: the combine mode, "direct" or "prereduce" (`GatherRSOptions.prereduce`: True
            or False as given; "auto": the mode model of `resource.mode` where it can run, else
            "direct"). The pre-reduced mode uses num_ctas, not num_comm_ctas.
        mode_choice: the two modes' predictions behind an "auto" choice, else None. They
            come from `resource.mode`'s simpler model (whole GEMM2 waves at the profile's
            calibrated occupancy, no launches), so its direct_us is not predicted_us.
    """

    num_comm_ctas: int
    num_ctas: Optional[int]
    source: str
    predicted_us: Optional[float] = None
    breakdown: Optional[PlanBreakdown] = None
    mode: str = "direct"
    mode_choice: Optional[ModeChoice] = None


_warned_fixed = False


MAX_WIDTH = 1 << 30
"""Largest H and F `plan_gemm2_gatherrs` accepts (the solvers' range for both)."""

MAX_RECV_ROWS = 1 << 40
"""Largest `recv_rows` `plan_gemm2_gatherrs` accepts (rows a finalize reads)."""


def _positive_int(name: str, value) -> int:
    if type(value) is int and value >= 1:  # the common case, first (runs per launch)
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r}: expected an int")
    if value < 1:
        raise ValueError(f"{name}={value}: expected >= 1")
    return int(value)


def _static_inputs(solver: Optional[str], profile, res: KernelResources):
    """(solver module, HardwareProfile, resident CTAs per SM of `res`): the inputs of a plan
    that depend neither on the call nor on its sizes."""
    # imported here, not at the top: `python -m megatron_overlap.resource.solver` must find
    # the module not yet imported by its package (runpy warns otherwise)
    from megatron_overlap.resource.solver import implementation

    impl = implementation(solver)
    prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    gpu = prof.gpu
    o_p = impl.ctas_per_sm(
        res.registers_per_thread, res.shared_bytes, res.threads_per_cta,
        registers_per_sm=gpu.registers_per_sm,
        max_registers_per_thread=gpu.max_registers_per_thread,
        register_alloc_unit=gpu.register_alloc_unit, shared_bytes_per_sm=gpu.shared_bytes_per_sm,
        max_shared_bytes_per_cta=gpu.max_shared_bytes_per_cta,
        shared_reserved_bytes_per_cta=gpu.shared_reserved_bytes_per_cta,
        max_threads_per_sm=gpu.max_threads_per_sm, max_threads_per_cta=gpu.max_threads_per_cta,
        max_ctas_per_sm=gpu.max_ctas_per_sm)
    return impl, prof, o_p


@functools.lru_cache(maxsize=64)
def _cached_static_inputs(solver: Optional[str], solver_env: Optional[str], profile,
                          profile_env: Optional[str], res: KernelResources):
    """`_static_inputs(solver, profile, res)` cached per its arguments and the values of the
    two variables it reads when they are None (errors are not cached)."""
    return _static_inputs(solver, profile, res)


def _tau_ref_ps(tile_time, ffn: int, bk: int) -> int:
    """The mode model's tile time tau(F) = alpha + beta x ceil(F / BK) in picoseconds (>= 1),
    from the profile's tile time alone (the same on every rank of a group)."""
    return max(1, _model._ps((tile_time.alpha_us + tile_time.beta_us * float(-(-ffn // bk)))
                             * 1e6))


def plan_gemm2_gatherrs(
    meta: GatherRSMetadata,
    options: GatherRSOptions,
    *,
    num_sms: Optional[int] = None,
    hidden: Optional[int] = None,
    ffn: Optional[int] = None,
    elem_bytes: int = 2,
    recv_rows: Optional[int] = None,
    kernel: Optional[KernelResources] = None,
    profile: Union[None, str, HardwareProfile] = None,
    tile: Tuple[int, int, int] = DEFAULT_TILE,
    solver: Optional[str] = None,
    tma_store: bool = False,
) -> Plan:
    """Choose the SM partition of one fused GEMM2 + GatherRS launch; measures nothing.

    Args:
        meta: routing metadata of the call: `rows_per_expert_per_chunk` [L, R] int64 (chunk
            order), TP/EP sizes and ranks, `num_tokens`.
        options: `GatherRSOptions`; `num_comm_ctas` overrides the choice of k; `prereduce`
            True / False fixes the mode, "auto" lets `resource.mode`'s model pick it
            from `meta.routed_counts` (the group-wide counts, so every rank picks alike;
            "direct" where the model cannot run: one rank, no SM count, no H / F).
        num_sms: S, streaming multiprocessors of the GPU; None: no model (source "cpu").
        hidden: H, columns of the output rows; ffn: F, the GEMM depth (expert FFN width per
            TP rank). Either None: no model (source "fixed", warned once).
        elem_bytes: bytes per element of the rows that travel (2 for bf16/fp16).
        recv_rows: rows this rank's finalize reads (every (token, expert, TP peer) row of its
            tokens); None: estimated as the rows this rank computes (equal on average over
            the group). Changes the predicted time, not the choice.
        kernel: the compiled fused kernel's resources; None: DEFAULT_KERNEL_RESOURCES.
        profile: a `HardwareProfile`, a profile name / YAML path, or None (the
            MEGATRON_OVERLAP_HW_PROFILE variable, else "h200").
        tile: (BM, BN, BK) of the kernel; the profile must have a tile time for it.
        solver: "cpp", "python" or None (C++ when built; see `resource.solver`).
        tma_store: the kernel's epilogue stores through TMA (`TileConfig.tma_store`): the
            profile's TMA-store tile time is used (`HardwareProfile.tile_time`; its
            register-store one, warned once, where it has none).

    Returns:
        A `Plan`.

    Raises:
        ValueError: the override exceeds the SM count; a size out of range (num_sms
            above MAX_CTAS, hidden or ffn above MAX_WIDTH, recv_rows above MAX_RECV_ROWS
            included); the kernel
            cannot be resident; remote tiles with a grid of one CTA; the profile has no
            tile time for `tile` (each message names the value and what was expected).
        TypeError: a size is not an int; tma_store is not a bool.
    """
    if not isinstance(meta, GatherRSMetadata):
        raise TypeError(f"meta must be a GatherRSMetadata, got {type(meta).__name__}")
    if not isinstance(options, GatherRSOptions):
        raise TypeError(f"options must be a GatherRSOptions, got {type(options).__name__}")
    if tma_store is not True and tma_store is not False:
        raise TypeError(f"tma_store={tma_store!r}: expected a bool")
    override = options.num_comm_ctas
    if num_sms is not None:
        _positive_int("num_sms", num_sms)
        if num_sms > _model.MAX_CTAS:
            raise ValueError(f"num_sms={num_sms}: expected an integer in [1, "
                             f"{_model.MAX_CTAS}]")
        if override is not None and override > num_sms:
            raise ValueError(
                f"moe_gatherrs_num_comm_ctas={override} exceeds the GPU's {num_sms} SMs; "
                f"expected 1..{num_sms}")
    fixed_mode = "prereduce" if options.prereduce is True else "direct"
    if num_sms is None:
        if override is not None:
            return Plan(num_comm_ctas=override, num_ctas=None, source="override",
                        mode=fixed_mode)
        return Plan(num_comm_ctas=DEFAULT_NUM_COMM_CTAS, num_ctas=None, source="cpu",
                    mode=fixed_mode)

    res = DEFAULT_KERNEL_RESOURCES if kernel is None else kernel
    if not isinstance(res, KernelResources):
        raise TypeError(f"kernel={kernel!r}: expected a KernelResources")
    if isinstance(profile, HardwareProfile):
        impl, prof, o_p = _static_inputs(solver, profile, res)
    else:
        # cached: everything here depends only on these (and the two variables) per process
        impl, prof, o_p = _cached_static_inputs(
            solver, getenv(SOLVER_ENV), profile, getenv(PROFILE_ENV), res)
    grid = num_sms * o_p

    for name, value in (("hidden", hidden), ("ffn", ffn)):  # checked even where unused
        if value is not None:
            _positive_int(name, value)
    if hidden is None or ffn is None:
        global _warned_fixed
        if not _warned_fixed:
            _warned_fixed = True
            warnings.warn("plan_gemm2_gatherrs without hidden= and ffn=: the resource model "
                          f"cannot count tiles; using {DEFAULT_NUM_COMM_CTAS} communication "
                          "CTAs", stacklevel=2)
        k = override if override is not None else min(DEFAULT_NUM_COMM_CTAS, max(1, grid - 1))
        return Plan(num_comm_ctas=k, num_ctas=grid,
                    source="override" if override is not None else "fixed", mode=fixed_mode)

    hidden, ffn = _positive_int("hidden", hidden), _positive_int("ffn", ffn)
    for name, value in (("hidden", hidden), ("ffn", ffn)):  # the solvers' range, named here
        if value > MAX_WIDTH:                              # (a C++ int64 would overflow)
            raise ValueError(f"{name}={value}: expected an integer in [1, {MAX_WIDTH}]")
    elem_bytes = _positive_int("elem_bytes", elem_bytes)
    if elem_bytes not in (1, 2, 4, 8):
        raise ValueError(f"elem_bytes={elem_bytes}: expected the byte size of a dtype "
                         "(1, 2, 4 or 8)")
    if tile is not DEFAULT_TILE and (
            not isinstance(tile, tuple) or len(tile) != 3
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile)):
        raise ValueError(f"tile={tile!r}: expected (BM, BN, BK), three ints >= 1")
    bm, bn, bk = tile
    tile_time = prof.tile_time(bm, bn, bk, tma_store, hidden=hidden)
    local_chunk = meta.tp_rank * meta.ep_size + meta.ep_rank  # chunk order c = tp * EP + ep
    # The mode model's inputs, only those every rank has alike: the group-wide counts, the
    # shapes, the profile and the SM count (the group's GPUs are alike), and the profile's
    # calibrated CTAs per SM and tile time, not this process's compiled-kernel occupancy
    # (o_p, known only after its first launch, which a rank without tiles may not have had).
    auto = (options.prereduce == "auto" and meta.group_size > 1
            and meta.routed_counts is not None and meta.topk)
    ref_ctas = tile_time.ctas_per_sm
    tau_ref_ps = _tau_ref_ps(tile_time, ffn, bk) if auto else 1
    # One crossing of the solver's binding: tiles, problem, k, the breakdown's terms, and
    # the two modes' times where the mode is chosen.
    (k, gemm_ps, remote_tiles, local_tiles, tau_ps, remote_tile_ps, remote_bound_ps,
     wave_bound_ps, times) = impl.plan_call(
        meta.rows_per_expert_per_chunk, local_chunk, bm, bn, bk, hidden, elem_bytes, ffn, grid,
        tile_time.alpha_us, tile_time.beta_us, o_p, tile_time.ctas_per_sm,
        prof.link_bandwidth_gbps, prof.cta_bandwidth_gbps, 0 if override is None else override,
        meta.routed_counts if auto else None, meta.tp_size, meta.ep_size, meta.topk or 1,
        num_sms * ref_ctas, tau_ref_ps, prof.hbm_bandwidth_gbps, tile_time.idle_ppm,
        tile_time.fill_ppm_table, tile_time.stream_mbps, tile_time.reread_ppm)
    source = "override" if override is not None else "model" if remote_tiles else "no-remote"
    if recv_rows is None:
        recv_rows = int(meta.rows_per_expert_per_chunk.sum())
    elif type(recv_rows) is int and recv_rows >= 0:
        pass
    elif isinstance(recv_rows, bool) or not isinstance(recv_rows, numbers.Integral):
        raise TypeError(f"recv_rows={recv_rows!r}: expected an int")
    elif recv_rows < 0:
        raise ValueError(f"recv_rows={recv_rows}: expected >= 0")
    if recv_rows > MAX_RECV_ROWS:
        raise ValueError(f"recv_rows={recv_rows}: expected at most {MAX_RECV_ROWS}")
    us = 1.0 / _model.PS_PER_US
    finalize_us = ((recv_rows + meta.num_tokens) * hidden * elem_bytes
                   / (prof.hbm_bandwidth_gbps * 1e3))
    latency_us = prof.store_latency_us if remote_tiles else 0.0
    gemm_us = gemm_ps * us
    breakdown = PlanBreakdown(
        remote_tiles=remote_tiles, local_tiles=local_tiles, ctas_per_sm=o_p,
        tile_us=tau_ps * us, remote_tile_us=remote_tile_ps * us,
        remote_bound_us=remote_bound_ps * us, wave_bound_us=wave_bound_ps * us,
        gemm_us=gemm_us, store_latency_us=latency_us, finalize_us=finalize_us,
        launch_us=prof.launch_overhead_us)
    predicted = gemm_us + latency_us + finalize_us + prof.launch_overhead_us
    mode, choice = fixed_mode, None
    if times is not None:
        choice = mode_choice(times, meta.group_size, prof.prereduce_host_us)
        mode = choice.mode
    return Plan(num_comm_ctas=k, num_ctas=grid, source=source, predicted_us=predicted,
                breakdown=breakdown, mode=mode, mode_choice=choice)


def group_time_us(meta: GatherRSMetadata, plan: Plan, *, num_sms: int, hidden: int, ffn: int,
                  elem_bytes: int, profile=None, tile: Tuple[int, int, int] = DEFAULT_TILE,
                  tma_store: bool = False, solver: Optional[str] = None) -> Optional[float]:
    """The predicted time of the slowest rank of the call's TP x EP group in the mode `plan`
    runs (microseconds, launches not included): the mode model's direct or pre-reduced time
    (`resource.mode`, docs/resource_model.md "The mode choice"), the pre-reduced one with the
    profile's `prereduce_host_us`. Every input is one that every rank of the group holds
    alike (the exchanged routed counts, the shapes, the profile and the SM count), so every
    rank computes the same number; `ops.triton_gemm2_gatherrs.plan_call` compares tiles by it
    at world > 1. Where the plan chose its mode (`Plan.mode_choice`) its times are reused
    as they are: they were computed for the plan's own tile, shapes and profile, so then
    `num_sms`, `hidden`, `ffn`, `elem_bytes`, `profile`, `tile`, `tma_store` and `solver`
    are checked but not used (pass the plan made for `tile`). Otherwise (a fixed mode) the
    mode model runs once here (C++ `mode_times`, a few us).

    Args:
        meta: the call's metadata (its `routed_counts` and `topk` are what this reads).
        plan: `plan_gemm2_gatherrs`'s plan of the call for `tile` (its `mode`).
        num_sms: S of the GPU; hidden, ffn: H, F (positive ints); elem_bytes: bytes per
            element of h (1, 2, 4 or 8).
        profile, tile, tma_store, solver: as `plan_gemm2_gatherrs` (the tile time used is
            the profile's for `tile` and `tma_store`, at its calibrated CTAs per SM).

    Returns:
        The time, or None where the metadata has no routed counts or top-k (no group-wide
        inputs: e.g. metadata built without the dispatcher's counts).

    Raises:
        TypeError: `meta` is not a GatherRSMetadata, `plan` not a Plan, a size not an int
            (bools refused), `tma_store` not a bool, `tile` not three ints.
        ValueError: a size < 1, `elem_bytes` not a dtype's size; the profile has no tile
            time for `tile`; as `resource.mode.choose_mode`.
    """
    from megatron_overlap.resource.mode import choose_mode

    if not isinstance(meta, GatherRSMetadata):
        raise TypeError(f"meta must be a GatherRSMetadata, got {type(meta).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a Plan, got {type(plan).__name__}")
    for name, value in (("num_sms", num_sms), ("hidden", hidden), ("ffn", ffn)):
        _positive_int(name, value)
    elem_bytes = _positive_int("elem_bytes", elem_bytes)
    if elem_bytes not in (1, 2, 4, 8):
        raise ValueError(f"elem_bytes={elem_bytes}: expected the byte size of a dtype "
                         "(1, 2, 4 or 8)")
    if tma_store is not True and tma_store is not False:
        raise TypeError(f"tma_store={tma_store!r}: expected a bool")
    if (not isinstance(tile, (tuple, list)) or len(tile) != 3
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in tile)):
        raise TypeError(f"tile={tile!r}: expected (BM, BN, BK), three ints")
    for name, value in zip(("BM", "BN", "BK"), tile):
        _positive_int(f"tile {name}", value)
    mc = plan.mode_choice
    if mc is None:
        if meta.routed_counts is None or not meta.topk:
            return None
        prof = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
        tile_time = prof.tile_time(tile[0], tile[1], tile[2], tma_store, hidden=hidden)
        mc = choose_mode(meta.routed_counts, tp_size=meta.tp_size, ep_size=meta.ep_size,
                         topk=meta.topk, hidden=hidden, elem_bytes=elem_bytes,
                         grid=num_sms * tile_time.ctas_per_sm,
                         tile_ps=_tau_ref_ps(tile_time, ffn, tile[2]), tile=tuple(tile),
                         link_gbps=prof.link_bandwidth_gbps, hbm_gbps=prof.hbm_bandwidth_gbps,
                         solver=solver, prereduce_host_us=prof.prereduce_host_us,
                         idle_ppm=tile_time.idle_ppm, ffn=ffn,
                         fill_ppm=tile_time.fill_ppm_table, stream_mbps=tile_time.stream_mbps,
                         reread_ppm=tile_time.reread_ppm)
    if plan.mode == "prereduce":
        return mc.prereduce_us + mc.prereduce_host_us
    return mc.direct_us
