"""Hardware profiles of the resource manager: `configs/hardware/<name>.yaml`.

A profile holds what the wave-quantized model (`megatron_overlap.resource.model`) needs and
nothing measured per workload: the GPU's residency limits (for the occupancy of the compiled
kernel), the tile time model tau(F) per tile shape, the peer-store bandwidths, the HBM
bandwidth of the finalize, two latency constants and, optionally, the pre-reduced mode's
extra host time (`prereduce_host_us`, for the mode choice). `launch/calibrate.py` measures
all but the last on a GPU machine and writes the profile with `save_profile`.

Units live in the key names: `_us` microseconds, `_gbps` GB/s (1e9 bytes per second),
`_bytes` bytes.

Errors: every bad file or value raises `ValueError` naming the key, the value and what was
expected.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
import warnings
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Optional, Tuple, Union

import numpy as np
import yaml

from megatron_overlap.resource.model import IDLE_WHOLE

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
"""Directory of the shipped hardware profiles (``<repo>/configs/hardware``)."""

DEFAULT_PROFILE = "h200"
"""Profile used when the caller names none, ``MEGATRON_OVERLAP_HW_PROFILE`` is unset and the
current CUDA device matches no entry of `DEVICE_PROFILES` (or there is no CUDA device)."""

DEVICE_PROFILES = (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"))
"""(`torch.cuda.get_device_name()`, profile name) pairs: the GPUs a shipped profile was
calibrated on, matched by the whole name (spaces around it ignored). "NVIDIA H100 80GB
HBM3" is the SXM H100 (132 SMs, NVLink 4), "NVIDIA H200" the SXM H200. Every other name
gets `DEFAULT_PROFILE` with a warning: the PCIe H100 (fewer SMs), the NVL parts and the
GH200 (other power limits, clocks or links), and MIG instances ("... MIG 1g.10gb": a
fraction of the SMs), whose tile times and bandwidths these profiles do not describe."""

PROFILE_ENV = "MEGATRON_OVERLAP_HW_PROFILE"
"""Environment variable naming the default profile (a name in HARDWARE_DIR or a YAML path)."""

_GPU_KEYS = ("num_sms", "registers_per_sm", "max_registers_per_thread", "register_alloc_unit",
             "shared_bytes_per_sm", "max_shared_bytes_per_cta", "shared_reserved_bytes_per_cta",
             "max_threads_per_sm", "max_threads_per_cta", "max_ctas_per_sm")
_POSITIVE_FLOATS = ("link_bandwidth_gbps", "cta_bandwidth_gbps", "hbm_bandwidth_gbps")
_NONNEGATIVE_FLOATS = ("store_latency_us", "launch_overhead_us", "prereduce_host_us")


def _check_int(key: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}={value!r}: expected an integer >= {minimum}")


def _check_float(key: str, value, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = (" (YAML reads a number like 6e2 as text: write it with a point and a "
                        "signed exponent, 6.0e+2, or as 600.0)")
            except ValueError:
                pass
        raise ValueError(f"{key}={value!r}: expected a finite number{hint}")
    if (value <= 0) if positive else (value < 0):
        raise ValueError(f"{key}={value!r}: expected a number {'>' if positive else '>='} 0")


@dataclass(frozen=True)
class GpuLimits:
    """Residency limits of one GPU (CUDA occupancy rules; sm_90 values in h200.yaml)."""

    num_sms: int
    registers_per_sm: int
    max_registers_per_thread: int
    register_alloc_unit: int
    """Registers are allocated per warp in multiples of this (256 on sm_70..sm_90)."""
    shared_bytes_per_sm: int
    max_shared_bytes_per_cta: int
    shared_reserved_bytes_per_cta: int
    """Shared memory the driver reserves per resident CTA (1 KiB since sm_80)."""
    max_threads_per_sm: int
    max_threads_per_cta: int
    max_ctas_per_sm: int

    def __post_init__(self) -> None:
        for key in _GPU_KEYS:
            _check_int(f"gpu.{key}", getattr(self, key),
                       0 if key == "shared_reserved_bytes_per_cta" else 1)


def _fill_cost(points, bm: int) -> Tuple[Tuple[int, float], ...]:
    """`TileTime.fill_cost` checked and as a tuple of (int, float) pairs."""
    if isinstance(points, (str, bytes, dict)) or not isinstance(points, (list, tuple)):
        raise ValueError(f"tile_times.fill_cost={points!r}: expected a list of [rows, cost] "
                         "pairs")
    out = []
    for p in points:
        if (not isinstance(p, (list, tuple)) or len(p) != 2 or isinstance(p[0], bool)
                or not isinstance(p[0], numbers.Integral) or isinstance(p[1], bool)
                or not isinstance(p[1], numbers.Real)):
            raise ValueError(f"tile_times.fill_cost entry {p!r}: expected [rows, cost], an int "
                             "and a number")
        r, c = int(p[0]), float(p[1])
        if not 1 <= r < bm or not 0.0 < c <= 1.0 or (out and r <= out[-1][0]):
            raise ValueError(f"tile_times.fill_cost entry {list(p)!r} of a {bm}-row tile: "
                             f"expected rows strictly increasing in [1, {bm}) and a cost in "
                             "(0, 1] (a fraction of a full tile's time)")
        out.append((r, c))
    return tuple(out)


@dataclass(frozen=True)
class TileTime:
    """tau(F) = alpha_us + beta_us * ceil(F / bk): time of one BM x BN output tile of depth F
    while every CTA of the grid is busy, measured with `ctas_per_sm` CTAs resident per SM.

    `tma_store`: measured with the GEMM2 kernel's TMA-store epilogue
    (`ops.triton_gemm2_gatherrs.TileConfig.tma_store`; `launch/calibrate.py --tma-store`)
    instead of the register-store one; a YAML entry without the key is a register-store
    time. One profile may hold both for a shape (`HardwareProfile.tile_time`).

    `idle_wave_cost` (eta, in [0, 1]; YAML key optional, default 1): what a part-filled last
    wave of the grid costs for its idle part, as a fraction of a wave's time. The resource
    model prices a GEMM2 of n = tiles / G waves at tau x (floor(n) + phi + eta x (1 - phi)),
    phi = the last wave's busy fraction (`resource.model.waves_ps`): 1 is the whole-wave
    model (ceil(n) x tau, every profile before v6.3), 0 a fluid one. `launch/calibrate.py`
    measures it (`--tail-ffn`, at ~8 waves); on one H100 docs/perf_notes.md v6.3 found
    0.89-1.00 for every tile there (v6.2: ~0.1 for the default TMA-store tile after 31
    waves, where the CTAs have drifted apart).

    `hidden` (H, elements; YAML key optional, default None): the output width H the entry
    was measured at (`launch/calibrate.py --hidden`: since v6.5 on every entry it fits;
    an entry it copies from the base keeps the base's). A profile may hold one entry per H
    for a shape and epilogue; `HardwareProfile.tile_time` gives a call the entry whose H is
    nearest its own (on one H100 the wide tile was 4 % faster per wave than the default
    tile at F = 1408 and H = 4096, 1 % slower at H = 2048, docs/perf_notes.md v6.5). None:
    H not recorded, the entry serves every H.

    `fill_cost` (YAML key optional, default empty): what a tile with r < BM valid rows (the
    last row block of an (expert, source chunk) block of rows) costs, as a fraction of a full tile's tau: pairs
    (r, cost), r strictly increasing in [1, BM), cost in (0, 1]; between two points (and
    up to (BM, 1.0)) linear in r, below the first point the first point's cost. Empty: every
    tile costs a full one (every profile before v6.6). `launch/calibrate.py --fill-ffn`
    measures it (`bench.workloads.fill_sweep`); the resource model scales a call's tau by
    its tiles' mean cost (`fill_ppm_table`, `resource.model.fill_ppm_of_call`).

    `stream_gbps` (GB/s, YAML key optional, default 0) and `reread` (in [0, 1], optional,
    default 0): the weight-streaming term (v6.7). A tile costs at least its HBM bytes at
    `stream_gbps` / G while all G CTAs stream: the expert's BN-column weight slice once
    for the expert's first row block and `reread` of it again for each of the others
    (what the L2 does not keep between the row blocks), plus its activation rows' share
    and its outputs (`resource.model.stream_tau_ps`). `launch/calibrate.py --stream-ffn`
    measures both (`bench.workloads.stream_sweep`: experts of 1, 2 and 3 full row blocks);
    on one H100 a call of few rows per expert runs at up to 1.3-1.4x the compute time
    (docs/perf_notes.md v6.6). 0: no streaming term (every profile before v6.7)."""

    bm: int
    bn: int
    bk: int
    ctas_per_sm: int
    alpha_us: float
    beta_us: float
    tma_store: bool = False
    idle_wave_cost: float = 1.0
    hidden: Optional[int] = None
    fill_cost: Tuple[Tuple[int, float], ...] = ()
    stream_gbps: float = 0.0
    reread: float = 0.0

    def __post_init__(self) -> None:
        for key in ("bm", "bn", "bk", "ctas_per_sm"):
            _check_int(f"tile_times.{key}", getattr(self, key), 1)
        if not isinstance(self.tma_store, bool):
            raise ValueError(f"tile_times.tma_store={self.tma_store!r}: expected true or false")
        if self.hidden is not None:
            _check_int("tile_times.hidden", self.hidden, 1)
        _check_float("tile_times.alpha_us", self.alpha_us, positive=False)
        _check_float("tile_times.beta_us", self.beta_us, positive=False)
        _check_float("tile_times.idle_wave_cost", self.idle_wave_cost, positive=False)
        if self.idle_wave_cost > 1.0:
            raise ValueError(f"tile_times.idle_wave_cost={self.idle_wave_cost!r}: expected a "
                             "number in [0, 1] (a fraction of a wave's time)")
        object.__setattr__(self, "fill_cost", _fill_cost(self.fill_cost, self.bm))
        _check_float("tile_times.stream_gbps", self.stream_gbps, positive=False)
        _check_float("tile_times.reread", self.reread, positive=False)
        if self.reread > 1.0:
            raise ValueError(f"tile_times.reread={self.reread!r}: expected a number in [0, 1] "
                             "(a fraction of a weight slice)")
        if self.stream_gbps == 0 and self.reread != 0:
            raise ValueError(f"tile_times.reread={self.reread!r} without stream_gbps: the "
                             "re-read prices bytes at the streaming bandwidth (give both)")
        if self.alpha_us + self.beta_us <= 0:
            raise ValueError(f"tile_times {self.bm}x{self.bn}x{self.bk}: alpha_us + beta_us "
                             "must be > 0 (a tile takes time)")

    @functools.cached_property
    def fill_ppm_table(self) -> Optional[np.ndarray]:
        """int64 [BM + 1]: the cost of a tile with r valid rows (index r; 0 unused) in
        millionths of a full tile's (`fill_cost` interpolated, IDLE_WHOLE at BM), what the
        solver's `plan_call` takes as `fill_ppm`; None where `fill_cost` is empty."""
        if not self.fill_cost:
            return None
        xs = [r for r, _ in self.fill_cost] + [self.bm]
        ys = [c for _, c in self.fill_cost] + [1.0]
        cost = np.interp(np.arange(self.bm + 1, dtype=float), xs, ys)
        table = np.clip(np.rint(cost * IDLE_WHOLE), 1, IDLE_WHOLE).astype(np.int64)
        table.setflags(write=False)
        return table

    @property
    def stream_mbps(self) -> int:
        """`stream_gbps` in the solver's unit, MB/s (int, 0: no streaming term)."""
        return math.floor(self.stream_gbps * 1000.0 + 0.5)

    @property
    def reread_ppm(self) -> int:
        """`reread` in millionths (int, 0..IDLE_WHOLE)."""
        return math.floor(self.reread * IDLE_WHOLE + 0.5)

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.bm, self.bn, self.bk)

    @property
    def idle_ppm(self) -> int:
        """`idle_wave_cost` in the solver's unit: millionths of a wave (int, 0..IDLE_WHOLE)."""
        return int(round(self.idle_wave_cost * IDLE_WHOLE))

    @property
    def key(self) -> Tuple[int, int, int, bool]:
        """(bm, bn, bk, tma_store): what `HardwareProfile.tile_time` looks an entry up by
        (then by the nearest `hidden`)."""
        return (self.bm, self.bn, self.bk, self.tma_store)

    def hidden_distance(self, hidden: Optional[int]):
        """How far this entry's H is from a call's, as the exact ratio max / min of the two
        (a `fractions.Fraction` >= 1: 1 at the same H, so ties compare exactly); 1 where the
        call gives no H (a lookup without H takes the first entry); infinity where the
        entry has no H and the call has one (such an entry serves every H, after the
        measured ones). `HardwareProfile.tile_time` takes the smallest."""
        if hidden is None:
            return Fraction(1)
        if self.hidden is None:
            return math.inf
        return Fraction(max(self.hidden, hidden), min(self.hidden, hidden))


@dataclass(frozen=True)
class HardwareProfile:
    """One GPU kind's profile (see the module docstring and configs/hardware/h200.yaml).

    Raises:
        ValueError: a field is missing, has the wrong type or is out of range.
    """

    name: str
    gpu: GpuLimits
    tile_times: Tuple[TileTime, ...]
    link_bandwidth_gbps: float
    """B_link: aggregate peer-store bandwidth of one GPU (all its CTAs storing at once)."""
    cta_bandwidth_gbps: float
    """B_cta: peer-store bandwidth of one CTA."""
    store_latency_us: float
    """From the last peer store issued to it being visible at the destination."""
    hbm_bandwidth_gbps: float
    """B_hbm: the finalize kernel's read + write bandwidth."""
    launch_overhead_us: float
    """Launch cost of the fused kernel and the finalize kernel together."""
    prereduce_host_us: float = 0.0
    """Host time a pre-reduced call costs more than a direct one (its routing-map all-gather
    and per-destination launches; `launch/bench_op.py` rows ours_prereduced_host - ours_host).
    The mode choice charges it to the pre-reduced mode (`resource.mode`); 0 (the default
    where the YAML has no such key) compares GPU times alone."""
    provisional: bool = False
    """True while the values are not from `launch/calibrate.py` on this GPU kind."""
    source: str = ""
    """Where the numbers come from (calibration command and date, or the provisional notes)."""
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    """Calibration details kept for people (raw sweeps); the model reads none of it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r}: expected a non-empty string")
        if not isinstance(self.provisional, bool):
            raise ValueError(f"provisional={self.provisional!r}: expected true or false")
        if not self.tile_times:
            raise ValueError("tile_times: expected at least one tile shape")
        keys = [t.key + (t.hidden,) for t in self.tile_times]
        if len(set(keys)) != len(keys):
            raise ValueError("tile_times: a tile shape appears twice with the same tma_store "
                             "and hidden in "
                             f"{[(t.shape, t.tma_store, t.hidden) for t in self.tile_times]}")
        register_shapes = {t.shape for t in self.tile_times if not t.tma_store}
        for t in self.tile_times:
            if t.shape not in register_shapes:
                raise ValueError(f"tile_times: {t.bm}x{t.bn}x{t.bk} has a tma_store entry but "
                                 "no register-store one (an entry without tma_store); every "
                                 "shape needs one")
        for key in _POSITIVE_FLOATS:
            _check_float(key, getattr(self, key), positive=True)
        for key in _NONNEGATIVE_FLOATS:
            _check_float(key, getattr(self, key), positive=False)

    def has_tile_time(self, bm: int, bn: int, bk: int, tma_store: bool = False) -> bool:
        """Whether the profile has an entry of exactly this shape and epilogue, at any H (no
        fallback, no warning: `ops.triton_gemm2_gatherrs.plan_call` offers the resource
        manager only the candidate tiles a profile has measured)."""
        return any(t.key == (bm, bn, bk, tma_store) for t in self.tile_times)

    def tile_time(self, bm: int, bn: int, bk: int, tma_store: bool = False,
                  hidden: Optional[int] = None) -> TileTime:
        """The tile time model of shape (bm, bn, bk) with the register-store epilogue, or
        with the TMA-store one (`tma_store`), for a call of output width `hidden` (H,
        elements): of the entries for that shape and epilogue, the one measured at H, else
        the one nearest by ratio (`TileTime.hidden_distance`, exact; a tie: the smaller H), else
        one without H; `hidden` None: the first entry. A profile without a TMA-store entry
        for the shape gives its register-store entry for it, warned once per profile and
        shape (in one calibration run on one H200 the TMA-store tile was never the slower
        of the two, docs/perf_notes.md v5.3).

        Raises:
            TypeError: tma_store is not a bool.
            ValueError: hidden is not None or an int >= 1; the profile has no entry for
                that shape (the message lists them).
        """
        if tma_store is not True and tma_store is not False:
            raise TypeError(f"tma_store={tma_store!r}: expected a bool")
        if hidden is not None:
            if isinstance(hidden, bool) or not isinstance(hidden, numbers.Integral) or hidden < 1:
                raise ValueError(f"hidden={hidden!r}: expected None or an int >= 1 (H, "
                                 "elements)")
            hidden = int(hidden)
        best, best_d = None, math.inf
        for t in self.tile_times:  # (a short tuple; the same H returns at once)
            if t.bm == bm and t.bn == bn and t.bk == bk and t.tma_store == tma_store:
                d = t.hidden_distance(hidden)
                if d == 1:
                    return t
                if best is None or d < best_d or (d == best_d and t.hidden < best.hidden):
                    best, best_d = t, d
        if best is not None:
            return best
        if tma_store:
            fallback = self.tile_time(bm, bn, bk, hidden=hidden)
            key = (self.name, self.source, (bm, bn, bk))
            if key not in _WARNED_TMA_FALLBACK:
                _WARNED_TMA_FALLBACK.add(key)
                warnings.warn(f"hardware profile {self.name!r} has no TMA-store tile time for "
                              f"{bm}x{bn}x{bk}; the plan uses the register-store one "
                              "instead. `launch/calibrate.py --tma-store` measures it.",
                              stacklevel=2)
            return fallback
        raise ValueError(f"hardware profile {self.name!r} has no tile time for tile "
                         f"{bm}x{bn}x{bk}; it has {sorted({t.shape for t in self.tile_times})} "
                         "(launch/calibrate.py measures the default tile "
                         "megatron_overlap.resource.DEFAULT_TILE and, with --tiles, others: "
                         "plan for a tile the profile has, or calibrate this one)")

    def to_dict(self) -> dict:
        """Plain dict in the YAML layout (`save_profile`)."""
        d = asdict(self)
        # (tma_store only where true, idle_wave_cost only where not 1, hidden only where set:
        # an entry without them reads as before)
        d["tile_times"] = [{k: v for k, v in asdict(t).items()
                            if not (k == "tma_store" and not v)
                            and not (k == "idle_wave_cost" and v == 1.0)
                            and not (k == "hidden" and v is None)
                            and not (k == "fill_cost" and not v)
                            and not (k in ("stream_gbps", "reread") and v == 0)}
                           for t in self.tile_times]
        for t in d["tile_times"]:  # (YAML lists, not tuples)
            if "fill_cost" in t:
                t["fill_cost"] = [[int(r), float(c)] for r, c in t["fill_cost"]]
        if not d["extra"]:
            del d["extra"]
        return d


_WARNED_TMA_FALLBACK: set = set()
"""(profile name, source, shape) already warned about by `HardwareProfile.tile_time`."""

_KEYS = ("name", "gpu", "tile_times", "link_bandwidth_gbps", "cta_bandwidth_gbps",
         "store_latency_us", "hbm_bandwidth_gbps", "launch_overhead_us")
_OPTIONAL = ("provisional", "source", "extra", "prereduce_host_us")


def profile_from_dict(data: dict, where: str = "profile") -> HardwareProfile:
    """Build and validate a profile from its YAML mapping.

    Raises:
        ValueError: missing or unknown keys (named with `where`), or a bad value.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    missing = sorted(set(_KEYS) - set(data))
    unknown = sorted(set(data) - set(_KEYS) - set(_OPTIONAL))
    if missing or unknown:
        raise ValueError(f"{where}: missing keys {missing}, unknown keys {unknown}")
    gpu = data["gpu"]
    if not isinstance(gpu, dict) or set(gpu) != set(_GPU_KEYS):
        if not isinstance(gpu, dict):
            raise ValueError(f"{where}: gpu must be a mapping with the keys "
                             f"{list(_GPU_KEYS)}, got {gpu!r}")
        raise ValueError(f"{where}: gpu: missing keys {sorted(set(_GPU_KEYS) - set(gpu))}, "
                         f"unknown keys {sorted(set(gpu) - set(_GPU_KEYS))} (expected exactly "
                         f"{list(_GPU_KEYS)})")
    tiles = data["tile_times"]
    if not isinstance(tiles, list) or not all(isinstance(t, dict) for t in tiles):
        raise ValueError(f"{where}: tile_times must be a list of mappings, got {tiles!r}")
    try:
        tile_objs = []
        for t in tiles:
            want = {"bm", "bn", "bk", "ctas_per_sm", "alpha_us", "beta_us"}
            optional = {"tma_store", "idle_wave_cost", "hidden", "fill_cost", "stream_gbps",
                        "reread"}
            if not want <= set(t) <= want | optional:
                raise ValueError(f"tile_times entry {t}: missing keys {sorted(want - set(t))}, "
                                 f"unknown keys {sorted(set(t) - want - optional)} "
                                 f"(expected exactly the keys {sorted(want)}, and optionally "
                                 "tma_store, idle_wave_cost, hidden, fill_cost, "
                                 "stream_gbps and reread)")
            tile_objs.append(TileTime(**t))
        rest = {k: data[k] for k in _KEYS[3:]}
        return HardwareProfile(name=data["name"], gpu=GpuLimits(**gpu),
                               tile_times=tuple(tile_objs), provisional=data.get("provisional",
                                                                                 False),
                               source=data.get("source", ""), extra=data.get("extra") or {},
                               prereduce_host_us=data.get("prereduce_host_us", 0.0), **rest)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def _resolve(name_or_path: Union[str, Path]) -> Path:
    text = str(name_or_path)
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"hardware profile {text!r} is a directory; expected a profile name "
                         "or a YAML file")
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ValueError(f"hardware profile file {text!r} does not exist")
        return path
    path = HARDWARE_DIR / f"{text}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise ValueError(f"hardware profile {text!r}: unknown; expected one of {names} or a "
                         "YAML path")
    return path


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int) -> HardwareProfile:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a valid YAML text file ({err})") from err
    profile = profile_from_dict(data, where=path)
    if isinstance(data, dict) and "prereduce_host_us" not in data:
        warnings.warn(f"hardware profile {path} has no prereduce_host_us (written before "
                      "v4.6): the combine-mode choice compares GPU times alone there; add the "
                      "key (configs/hardware/h200.yaml says how it was measured)", stacklevel=3)
    return profile


_BY_NAME: dict = {}


def device_profile_name(device_name: str) -> Optional[str]:
    """The shipped profile calibrated on the GPU named `device_name` (as
    `torch.cuda.get_device_name` spells it), or None where `DEVICE_PROFILES` has none.

    Raises:
        TypeError: `device_name` is not a str.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name={device_name!r}: expected a str (a CUDA device's name)")
    for gpu, name in DEVICE_PROFILES:
        if device_name.strip() == gpu:
            return name
    return None


_warned_unknown_gpu: set = set()


@functools.lru_cache(maxsize=None)
def _current_device_profile(index: int) -> str:
    """`DEVICE_PROFILES`' profile for CUDA device `index`, else `DEFAULT_PROFILE` with a
    one-time warning per GPU name (the planner would otherwise use another GPU's tile times
    and bandwidths without saying so)."""
    import torch

    gpu = torch.cuda.get_device_name(index)
    name = device_profile_name(gpu)
    if name is None:
        name = DEFAULT_PROFILE
        if gpu not in _warned_unknown_gpu:
            _warned_unknown_gpu.add(gpu)
            warnings.warn(
                f"no hardware profile for GPU {gpu!r} (shipped: "
                f"{', '.join(n for _, n in DEVICE_PROFILES)}): the resource manager uses "
                f"{DEFAULT_PROFILE!r}, whose tile times and bandwidths were measured on "
                "another GPU; calibrate this one with launch/calibrate.py and set "
                f"{PROFILE_ENV}=<the YAML it writes>", stacklevel=4)
    return name


def default_profile_name() -> str:
    """The profile `load_profile()` loads without an argument: `MEGATRON_OVERLAP_HW_PROFILE`
    if set, else the current CUDA device's entry in `DEVICE_PROFILES` (torch imported and a
    CUDA device present; a GPU with no entry gets `DEFAULT_PROFILE` and a one-time
    warning), else `DEFAULT_PROFILE` (no CUDA: the CPU paths plan nothing from it but its
    limits)."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return env
    torch = sys.modules.get("torch")  # never imports torch (the C++ solver's tests do not)
    if torch is not None and torch.cuda.is_available():
        return _current_device_profile(torch.cuda.current_device())
    return DEFAULT_PROFILE


def load_profile(name_or_path: Optional[Union[str, Path]] = None) -> HardwareProfile:
    """Load a hardware profile; cached per process by name or path (the resource manager
    calls this before every launch: no file system access after the first call).

    Args:
        name_or_path: a name in `HARDWARE_DIR` ("h200", "h100") or a YAML path; None:
            `default_profile_name()` (the variable `MEGATRON_OVERLAP_HW_PROFILE`, else the
            current CUDA device's shipped profile, else `DEFAULT_PROFILE`).

    Raises:
        TypeError: `name_or_path` neither None, a str nor a Path.
        ValueError: an empty name, unknown name, unreadable YAML, or a bad profile.
    """
    if name_or_path is not None and not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"hardware profile {name_or_path!r}: expected a profile name or a "
                        f"YAML path (str or Path), got {type(name_or_path).__name__}")
    from_env = name_or_path is None and bool(os.environ.get(PROFILE_ENV))
    if name_or_path is None:
        name_or_path = default_profile_name()
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise ValueError("hardware profile '': expected a profile name (e.g. 'h200', "
                         "'h100') or a YAML path")
    key = str(name_or_path)
    profile = _BY_NAME.get(key)
    if profile is None:
        try:
            path = _resolve(name_or_path)
            profile = _BY_NAME[key] = _load_cached(str(path), path.stat().st_mtime_ns)
        except ValueError as err:
            if from_env:
                raise ValueError(f"{PROFILE_ENV}={key!r}: {err}") from err
            raise
    return profile


def save_profile(profile: HardwareProfile, path: Union[str, Path], header: str = "") -> None:
    """Write `profile` as YAML (with `header` lines as comments on top)."""
    text = yaml.safe_dump(profile.to_dict(), sort_keys=False, width=100)
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(comment + text)
