"""Options of the fused GEMM2 + GatherRS combine path.

`GatherRSOptions` is the one place the fused path's knobs live. The Megatron integration
(`megatron_overlap.megatron.config`) builds it from the `moe_gatherrs_*` fields of a
`TransformerConfig`; the operator (`megatron_overlap.ops.gemm2_gatherrs`) takes it directly.
"""

from __future__ import annotations

import argparse
import math
import numbers
import re
from dataclasses import dataclass
from typing import Optional, Union

from megatron_overlap._host import HOST_CACHE_ENV, getenv  # noqa: F401 (re-export)

BACKENDS = ("auto", "triton", "reference")
"""Values accepted for `GatherRSOptions.backend`."""

DEFAULT_TIMEOUT_S = 30.0
"""Default bound on every GPU spin-wait of the fused kernels, in seconds."""
TIMEOUT_RANGE_S = (1e-6, 1e6)
"""Accepted `timeout_s` (the kernels count it in int64 nanoseconds of the GPU timer)."""

TILE_LIST_ENV = "MEGATRON_OVERLAP_TILE_LIST"
"""Where the Triton path builds the GEMM2 kernel's tile list: "device" (default: the host
sends one entry per destination and local expert, `_tile_list_block` expands them) or
"host" (numpy `expand_tiles` + `wave_order`, the whole list copied; the twin, for
comparison and debugging)."""

TMA_STORE_ENV = "MEGATRON_OVERLAP_TMA_STORE"
"""How the GEMM2 kernel's epilogue stores its tiles on the GPU (`tma_store_enabled`): "1"
through a TMA descriptor per tile, asynchronous (`TileConfig.tma_store`), "0" from
registers; unset: TMA at world 1, registers at world > 1 (`TMA_STORE_DEFAULT_MAX_WORLD`)."""

TILE_CHOICE_ENV = "MEGATRON_OVERLAP_TILE_CHOICE"
"""Whether the resource manager picks the GEMM2 tile of each call (`tile_choice_enabled`):
"1" or unset: among the default tile and `ops.triton_gemm2_gatherrs.TILE_CANDIDATES` by the
wave model (`ops.triton_gemm2_gatherrs.plan_call`) for calls whose TP x EP group has at most
`TILE_CHOICE_MAX_WORLD` (1) rank; "all": for every call, at world > 1 from the group-wide
routed counts, so every rank of the group picks the same tile (v6.2; not yet run on two
GPUs); "0": always the default tile (`default_tile`)."""

TILE_CHOICE_VALUES = ("0", "1", "all")
"""The values $MEGATRON_OVERLAP_TILE_CHOICE takes (unset or empty: as "1")."""

HOST_TABLES_ENV = "MEGATRON_OVERLAP_HOST_TABLES"
"""How a direct call's host tables (segments, finalize bases, arrival targets) reach its
staging buffer (`host_tables_mode`): "fused" (default: one call of
`ops._layout.direct_tables` writes them straight into the pinned buffer; where the C++
layout extension is built, the tile list is built on the device, the default
`MEGATRON_OVERLAP_TILE_LIST`, and the metadata has the routed counts, as the dispatcher's
always has; otherwise "steps" runs) or "steps" (`direct_layout`'s arrays, then numpy copies
into the buffer: the path before v5.4, kept for comparison)."""

HOST_SPLITS_ENV = "MEGATRON_OVERLAP_HOST_SPLITS"
"""How the flag-on dispatcher gets the dispatch's counts to the host (`host_splits_enabled`):
"1" (default) one gather and one device-to-host copy of every rank's tokens per expert,
from which the host derives Megatron's splits; "0" Megatron's own `preprocess` and its
device-to-host copies, plus the counts' copy of ours (the path before v5.7, kept for
comparison)."""

FC1_CHUNK_ENV = "MEGATRON_OVERLAP_FC1_CHUNK_MB"
"""The grouped FC1's chunk of rows, in MiB of [rows, F] (`fc1_chunk_bytes`)."""

SOLVER_ENV = "MEGATRON_OVERLAP_SOLVER"
"""Environment variable of the resource solver: "cpp", "python" or unset (C++ when built;
`megatron_overlap.resource.solver.implementation`)."""


ENV_PREFIX = "MEGATRON_OVERLAP_"
"""Prefix of the fused path's environment variables (`environment_variables`)."""

_warned_unknown: set = set()


def environment_variables() -> tuple:
    """Every variable the package reads, as their modules name them (README, "Turning the
    flag on"); `check_environment` warns about any other `MEGATRON_OVERLAP_*` name it finds
    set. (A function: `kernels.launch` and `resource.profile` own two of the names and
    cannot be imported when this module loads.)"""
    from megatron_overlap.kernels.launch import FAST_LAUNCH_ENV
    from megatron_overlap.resource.profile import PROFILE_ENV

    return (TILE_LIST_ENV, TMA_STORE_ENV, TILE_CHOICE_ENV, FAST_LAUNCH_ENV, PROFILE_ENV,
            SOLVER_ENV, FC1_CHUNK_ENV, HOST_TABLES_ENV, HOST_CACHE_ENV, HOST_SPLITS_ENV)


def unknown_variables(environ=None) -> list:
    """The set `MEGATRON_OVERLAP_*` names that are not `environment_variables()`, sorted, each
    as (name, closest known name or None) (`difflib.get_close_matches` on the names without
    the prefix, cutoff 0.6).
    `environ`: a mapping (default `os.environ`)."""
    import difflib
    import os

    env = os.environ if environ is None else environ
    known = environment_variables()
    n = len(ENV_PREFIX)  # compared without the shared prefix
    out = []
    for name in sorted(k for k in env if k.startswith(ENV_PREFIX)):
        if name not in known:
            close = difflib.get_close_matches(name[n:], [v[n:] for v in known], n=1,
                                              cutoff=0.6)
            out.append((name, ENV_PREFIX + close[0] if close else None))
    return out


def check_environment() -> None:
    """Check every `MEGATRON_OVERLAP_*` variable of the fused path now, so that a typo fails
    where the user can act on it (the dispatcher's construction, a launcher's argument
    check) instead of at the first GPU launch: `MEGATRON_OVERLAP_TILE_LIST`,
    `MEGATRON_OVERLAP_TMA_STORE`, `MEGATRON_OVERLAP_TILE_CHOICE`,
    `MEGATRON_OVERLAP_FAST_LAUNCH`,
    `MEGATRON_OVERLAP_HW_PROFILE`, `MEGATRON_OVERLAP_SOLVER`, `MEGATRON_OVERLAP_FC1_CHUNK_MB`,
    `MEGATRON_OVERLAP_HOST_TABLES`, `MEGATRON_OVERLAP_HOST_CACHE`,
    `MEGATRON_OVERLAP_HOST_SPLITS`. A set `MEGATRON_OVERLAP_*` name that is none of these
    (a misspelling, e.g. `TMASTORE` for `TMA_STORE`) gets one `UserWarning` per process that
    names it and the closest known variable (`unknown_variables`); the package never reads
    it.

    Raises:
        ValueError: a bad value (the message names the variable and what it accepts).
        ImportError: `MEGATRON_OVERLAP_SOLVER=cpp` without the built C++ solver.
    """
    import warnings

    from megatron_overlap.kernels.launch import fast_launch_enabled
    from megatron_overlap.resource.profile import load_profile
    from megatron_overlap.resource.solver import implementation

    for name, close in unknown_variables():
        if name not in _warned_unknown:
            _warned_unknown.add(name)
            hint = f"did you mean {close}? " if close else ""
            warnings.warn(f"${name} is set but is not a variable of megatron_overlap (ignored); "
                          f"{hint}the package reads {', '.join(environment_variables())}",
                          UserWarning, stacklevel=2)
    tile_list_source()
    host_tables_mode()
    host_cache_enabled()
    host_splits_enabled()
    tma_store_enabled(1)
    tile_choice_enabled(1)
    fast_launch_enabled()
    load_profile()
    implementation()
    fc1_chunk_bytes()


def fused_path_settings(world_size: int, triton_gpu: bool = True,
                        row_bytes: int | None = None) -> dict:
    """The effective values of the fused path's per-call variables for calls over
    `world_size` ranks (the TP x EP group), as the benchmarks' rows record them:
    {"tma_store": bool, "tma_store_env": "" | "0" | "1", "tile_choice": bool,
    "tile_choice_env": "" | "0" | "1" | "all", "tile_list": "device" | "host",
    "host_tables": "fused" | "steps", "fast_launch": "0" | "1" | "direct", "host_cache":
    bool, "host_splits": bool, "hw_profile": str} (unset and empty read as the defaults).
    `hw_profile` is the `name` of the hardware profile the resource manager plans with
    (`resource.profile.load_profile()`: the variable, else the current GPU's shipped
    profile), "" where `triton_gpu` is false (no plan is made from it there).

    `tma_store` is the epilogue the GEMM2 kernel's default tile runs for this group size
    (`tma_store_enabled(world_size)`), and false where `triton_gpu` is false (the caller's
    flag-on path runs no GPU kernel: the CPU, the reference backend) or where `row_bytes`
    (the output rows' bytes, H x element size, if given) fails `tma_rows_aligned` (the
    register fallback of `ops.triton_gemm2_gatherrs.epilogue_stores_tma`); `tma_store_env`
    is the variable as set ("" unset), the same in every layout of a run. `tma_store`
    describes the default tile (`ops.triton_gemm2_gatherrs.default_tile`); where
    `tile_choice` is true (`tile_choice_enabled(world_size)` on the GPU path) a call may run
    another of `TILE_CANDIDATES` (the launchers' rows record the tile each flag-on call
    ran: `gemm2_tile`, `gemm2_tiles`); `tile_choice_env` is that variable as set.

    Raises:
        ValueError: a bad value (as `check_environment`); TypeError / ValueError: a bad
            world_size (as `tma_store_enabled`).
    """
    from megatron_overlap.kernels.launch import fast_launch_mode
    from megatron_overlap.resource.profile import load_profile

    tma = tma_store_enabled(world_size)  # (checks the variable and world_size everywhere)
    choice = tile_choice_enabled(world_size)
    aligned = row_bytes is None or tma_rows_aligned(row_bytes)
    return {"tma_store": bool(triton_gpu) and aligned and tma,
            "tma_store_env": getenv(TMA_STORE_ENV, ""),
            "tile_choice": bool(triton_gpu) and choice,
            "tile_choice_env": getenv(TILE_CHOICE_ENV, ""),
            "tile_list": tile_list_source(),
            "host_tables": host_tables_mode(), "fast_launch": fast_launch_mode(),
            "host_cache": host_cache_enabled(), "host_splits": host_splits_enabled(),
            "hw_profile": load_profile().name if triton_gpu else ""}


FC1_CHUNK_MAX_MB = 2**30
"""Largest accepted `MEGATRON_OVERLAP_FC1_CHUNK_MB` (1 PiB: no limit in practice)."""

_DECIMAL = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
"""An unsigned ASCII decimal number, as `fc1_chunk_bytes` accepts it."""


def fc1_chunk_bytes() -> int:
    """The grouped FC1's chunk of rows, in bytes of [rows, F] (F the activation's width:
    half of FC1's output with a GLU): at most this many bytes of FC1's linear half run in
    one grouped GEMM for Megatron's unfused SwiGLU (`swiglu_fc1_split`; its gate half runs
    for all rows at once), and of as many rows FC1's whole output otherwise (peak memory,
    see `grouped_fc1_activation`). 128 MiB, or $MEGATRON_OVERLAP_FC1_CHUNK_MB mebibytes (a
    number > 0; smaller chunks lower the FC1's transient peak at the cost of more, smaller
    GEMMs: measured with launch/bench_fc1.py, docs/perf_notes.md v4.9).

    Raises:
        ValueError: the variable is set to something other than a number in
            (0, FC1_CHUNK_MAX_MB] written as a plain unsigned ASCII decimal (no spaces, sign,
            "_" or non-ASCII digits).
    """
    raw = getenv(FC1_CHUNK_ENV, "")
    if not raw:
        return 128 * 2**20
    # A plain ASCII decimal ("128", "0.5", "1e-3"): float() alone would also take spaces
    # around it, "1_0", a sign and non-ASCII digits ("６４"); the 0/1 variables refuse such
    # values, and so does this one.
    mib = float(raw) if _DECIMAL.fullmatch(raw) else float("nan")
    if not (0 < mib <= FC1_CHUNK_MAX_MB):
        raise ValueError(f"{FC1_CHUNK_ENV}={raw!r}: expected a number of MiB > 0 and <= "
                         f"{FC1_CHUNK_MAX_MB} (e.g. 128)")
    return max(1, int(mib * 2**20))


def tile_list_source() -> str:
    """$MEGATRON_OVERLAP_TILE_LIST, "device" when unset or empty.

    Raises:
        ValueError: any other value than "device" or "host".
    """
    value = getenv(TILE_LIST_ENV, "device") or "device"
    if value not in ("device", "host"):
        raise ValueError(f"{TILE_LIST_ENV}={value!r}: expected 'device' or 'host'")
    return value


def host_tables_mode() -> str:
    """$MEGATRON_OVERLAP_HOST_TABLES, "fused" when unset or empty (where the C++ layout
    extension is not built, the Triton call takes "steps" whatever this says).

    Raises:
        ValueError: any other value than "fused" or "steps".
    """
    value = getenv(HOST_TABLES_ENV, "")
    if value in ("", "fused"):
        return "fused"
    if value != "steps":
        raise ValueError(f"{HOST_TABLES_ENV}={value!r}: expected 'fused' or 'steps'")
    return value


def host_cache_enabled() -> bool:
    """$MEGATRON_OVERLAP_HOST_CACHE: whether the host shortcuts of `megatron_overlap._host`
    (the environment read from `os.environ`'s own mapping, the current CUDA stream object
    cached while the current stream is the same, Triton's launch scratch of the GEMM2 kept
    per device and stream) run; True when unset or empty, False for "0".

    Raises:
        ValueError: any other value than "0" or "1".
    """
    return _zero_or_one(HOST_CACHE_ENV, True)


def host_splits_enabled() -> bool:
    """$MEGATRON_OVERLAP_HOST_SPLITS: whether the flag-on dispatcher derives Megatron's
    dispatch splits on the host from one copy of the gathered counts
    (`GatherRSAlltoAllTokenDispatcher.preprocess`); True when unset or empty, False for "0".

    Raises:
        ValueError: any other value than "0" or "1".
    """
    return _zero_or_one(HOST_SPLITS_ENV, True)


def _zero_or_one(name: str, default: bool) -> bool:
    """A "0" / "1" variable: `default` when unset or empty; ValueError naming it otherwise."""
    value = getenv(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected '0' or '1'")
    return default if value == "" else value == "1"


TMA_STORE_DEFAULT_MAX_WORLD = 1
"""Where $MEGATRON_OVERLAP_TMA_STORE is unset, the GEMM2 epilogue stores through TMA
descriptors for process groups of at most this many ranks, from registers for larger ones.
World 1 (every tile local): run on an H200 bit for bit equal to the register epilogue, the
producer 8-22 % less time on the fine-grained shapes, 2-5 % on Mixtral and Phi
(docs/perf_notes.md v5.3; v5.9's draw: Mixtral 4096 2 % more), the fine-grained models'
layer 1-5 % less at 16384 tokens (v5.9). World > 1: its stores
into a peer GPU's buffer over NVLink have run only emulated on one GPU (v5.6), not yet on
two."""


def tile_choice_enabled(world_size: int) -> bool:
    """$MEGATRON_OVERLAP_TILE_CHOICE: whether a call over `world_size` ranks (its TP x EP
    group) on the GPU lets the resource manager pick its GEMM2 tile among the default tile
    and `ops.triton_gemm2_gatherrs.TILE_CANDIDATES` (`ops.triton_gemm2_gatherrs.plan_call`):
    "1", unset or empty: where `world_size <= TILE_CHOICE_MAX_WORLD`; "all": at every world
    size (at world > 1 from group-wide inputs only, see `plan_call`); "0": never (the default
    tile, `default_tile`).

    Raises:
        TypeError: world_size is not an int.
        ValueError: world_size < 1; the variable is not one of `TILE_CHOICE_VALUES`.
    """
    _check_world_size(world_size)
    value = getenv(TILE_CHOICE_ENV, "")
    if value not in ("",) + TILE_CHOICE_VALUES:
        raise ValueError(f"{TILE_CHOICE_ENV}={value!r}: expected one of "
                         f"{', '.join(repr(v) for v in TILE_CHOICE_VALUES)} (or unset)")
    if value == "all":
        return True
    return value != "0" and world_size <= TILE_CHOICE_MAX_WORLD


TILE_CHOICE_MAX_WORLD = 1
"""Where $MEGATRON_OVERLAP_TILE_CHOICE is unset or "1", the GEMM2 tile is chosen per call
only for process groups of at most this many ranks. At world 1 every tile is local, so the
choice changes the GEMM2's waves and tile rate only (docs/perf_notes.md v6.1). At world > 1
every rank of the group must run the same tile shape (a receiver's expected arrivals count
the senders' tiles with its own BM x BN), so "all" decides there from what every rank holds
alike (the exchanged routed counts, the shapes, the profile: the slowest rank's predicted
time, as the mode choice). The choice is CPU-tested and `WIDE_TILE`'s kernels at world 2
have run emulated on one GPU (docs/perf_notes.md v6.2); neither has run on two GPUs, hence
not the default there."""


def _check_world_size(world_size) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size={world_size!r}: expected an int (ranks of the call's "
                        "TP x EP group)")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1")


def tma_rows_aligned(row_bytes: int) -> bool:
    """Whether output rows of `row_bytes` bytes (H x element size) can be stored through a
    TMA descriptor, whose row stride must be a multiple of 16 bytes; elsewhere the
    TMA-store tile stores from registers."""
    return row_bytes % 16 == 0


def tma_store_enabled(world_size: int) -> bool:
    """$MEGATRON_OVERLAP_TMA_STORE: whether the GPU's default tile configuration for a call
    over `world_size` ranks (its TP x EP group) stores the GEMM2 tiles through TMA
    descriptors: "1" always, "0" never; unset or empty: where `world_size <=
    TMA_STORE_DEFAULT_MAX_WORLD`.

    Raises:
        TypeError: world_size is not an int.
        ValueError: world_size < 1; the variable is anything other than "0" or "1".
    """
    _check_world_size(world_size)
    return _zero_or_one(TMA_STORE_ENV, world_size <= TMA_STORE_DEFAULT_MAX_WORLD)


@dataclass(frozen=True)
class GatherRSOptions:
    """How the fused GEMM2 + GatherRS operation runs.

    Raises:
        ValueError: a field is out of range (the message names the field and the value).
        TypeError: a field has the wrong type.
    """

    backend: str = "auto"
    """`"reference"`: plain PyTorch + torch.distributed collectives (any device, any
    process-group backend, autograd-capable). `"triton"`: the tile-signaled fused kernel
    (CUDA, bf16/fp16, forward only, the tp_ep group on one node with peer access). `"auto"`:
    the Triton path where it can run, else the reference path with a one-time warning
    saying why."""

    num_comm_ctas: Optional[int] = None
    """Override of the communication CTAs k: the CTAs of the fused kernel that take the
    remote-bound GEMM2 tiles (whose epilogues store over NVLink) before the local ones; the
    others take local tiles first (the SM partition). `None` lets the resource manager
    choose before every launch."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on every GPU spin-wait, in seconds (`TIMEOUT_RANGE_S`: 1e-6 to 1e6); on expiry
    the op raises `RuntimeError` naming this rank, the rank it waited for, the counter value
    seen and the value expected (a finalize waiting for a sender's arrivals, or a producer
    waiting for a destination to free its receive buffer)."""

    prereduce: Union[bool, str] = "auto"
    """The combine mode. False: direct (each GEMM2 tile's rows travel as they are computed,
    overlapped with the GEMM2). True: pre-reduced (Triton backend only: an error with
    backend "reference"; with "auto" where the Triton path cannot run the fallback warning
    says it is dropped): each token's rows are summed on the rank that computed them
    before they travel, one row per token and source rank over NVLink instead of one per
    (token, expert); the GEMM2 then stores locally and the send is a pass of its own
    (`megatron_overlap.ops.triton_prereduce`). "auto" (default): the resource manager picks
    one per call from the group's routing counts (the mode model of `resource.mode`; every rank
    picks alike). The pre-reduced mode needs every rank's routing map: one all-gather per
    call, which the Megatron dispatcher does without a host sync
    (`ops.gemm2_gatherrs.gather_routing_maps` with the token counts it has). At the op level
    (`gemm2_gatherrs` / `prepare_gemm2_gatherrs`) True gathers them inside (a collective
    plus a host sync for the token counts), while "auto" takes the pre-reduced mode only
    where the caller passes `routing_maps` to `prepare_gemm2_gatherrs`, else runs direct."""

    def __post_init__(self) -> None:
        if isinstance(self.prereduce, str):
            if self.prereduce != "auto":
                hint = (f" (the command line's {self.prereduce!r} is "
                        f"{PREREDUCE_CHOICES[self.prereduce]!r} here)"
                        if self.prereduce in PREREDUCE_CHOICES else "")
                raise ValueError(f"moe_gatherrs_prereduce={self.prereduce!r} must be True, "
                                 f"False or 'auto'{hint}")
        elif not isinstance(self.prereduce, bool):
            raise TypeError(f"moe_gatherrs_prereduce={self.prereduce!r} must be True, False "
                            "or 'auto'")
        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(
                f"moe_gatherrs_backend={self.backend!r} is not supported; expected one of "
                f"{BACKENDS}"
            )
        if self.prereduce is True and self.backend == "reference":
            raise ValueError("moe_gatherrs_prereduce=True needs the Triton backend "
                             "(moe_gatherrs_backend 'triton' or 'auto'), got 'reference'")
        if self.num_comm_ctas is not None:
            if isinstance(self.num_comm_ctas, bool) or not isinstance(self.num_comm_ctas,
                                                                      numbers.Integral):
                raise TypeError(
                    f"moe_gatherrs_num_comm_ctas={self.num_comm_ctas!r} must be an int or None"
                )
            object.__setattr__(self, "num_comm_ctas", int(self.num_comm_ctas))
            if self.num_comm_ctas < 1:
                raise ValueError(
                    f"moe_gatherrs_num_comm_ctas={self.num_comm_ctas} must be >= 1 (or None for "
                    "the resource manager's choice)"
                )
            from megatron_overlap.resource.model import MAX_CTAS

            if self.num_comm_ctas > MAX_CTAS:
                raise ValueError(
                    f"moe_gatherrs_num_comm_ctas={self.num_comm_ctas} must be <= {MAX_CTAS} "
                    "(the resource model's CTA bound; each launch also checks it against the "
                    "GPU's SM count)")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real):
            raise TypeError(f"moe_gatherrs_timeout_s={self.timeout_s!r} must be a number")
        low, high = TIMEOUT_RANGE_S
        if not (math.isfinite(self.timeout_s) and low <= self.timeout_s <= high):
            raise ValueError(
                f"moe_gatherrs_timeout_s={self.timeout_s} must be a number of seconds in "
                f"[{low:g}, {high:g}]"
            )
        object.__setattr__(self, "timeout_s", float(self.timeout_s))


PREREDUCE_CHOICES = {"auto": "auto", "on": True, "off": False}
"""Command-line spellings of `moe_gatherrs_prereduce` and their config values."""


def prereduce_arg(text: str) -> Union[bool, str]:
    """argparse type of `--moe-gatherrs-prereduce` / `--prereduce`: auto, on or off."""
    if text not in PREREDUCE_CHOICES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one of "
                                         f"{', '.join(PREREDUCE_CHOICES)}")
    return PREREDUCE_CHOICES[text]


PREREDUCE_ARGUMENT = dict(type=prereduce_arg, default="auto", nargs="?", const=True,
                          metavar="{auto,on,off}")
"""argparse keywords of the combine-mode option (`--moe-gatherrs-prereduce` / the launch
scripts' `--prereduce`): auto (default), on (also the bare flag) or off."""

FC1_IMPLS = ("auto", "grouped", "loop")
"""`GatherRSSequentialMLP.fc1_impl` values: "auto" = grouped on CUDA where supported, else
Megatron's per-expert loop; "grouped" = grouped wherever supported (any device; for tests
on CPU); "loop" = always Megatron's loop."""

FC1_IMPL_ARGUMENT = dict(
    choices=FC1_IMPLS, default="auto",
    help="the flag-on experts' FC1 (GatherRSSequentialMLP.fc1_impl): auto (default: one "
         "grouped GEMM on CUDA where supported), grouped, or loop (Megatron's per-expert MLP "
         "loop, as 'off' runs it)")
"""argparse keywords of the launch scripts' `--fc1-impl`."""

BIAS_ACTIVATION_FUSION_ARGUMENT = dict(
    action="store_true",
    help="set TransformerConfig.bias_activation_fusion in every variant (what Megatron-LM's "
         "training arguments default to for SwiGLU, --bias-swiglu-fusion): the GLU "
         "activation and the router-probability scale run as Megatron's one "
         "torch.compile'd function (weighted_bias_swiglu_impl) instead of its unfused torch "
         "ops; the first forwards compile it")
"""argparse keywords of the launch scripts' `--bias-activation-fusion`."""
