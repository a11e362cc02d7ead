"""Cheaper forms of three host operations that the flag-on forward runs several times each.

A flag-on MoE layer forward runs its host code once, with the CPU caches cold from the rest
of the model's forward, so every distinct operation costs several times its warm time
(docs/perf_notes.md v5.3, v5.4). Three of them recur:

* `getenv(name)`: `os.environ.get(name)` without `os._Environ`'s per-call key check and
  encoding (one dict lookup of the encoded name in `os.environ`'s own mapping; the value
  is decoded as `os.environ` decodes it). The fused path reads about ten
  `MEGATRON_OVERLAP_*` variables per forward, each at its use, so that a benchmark can
  switch one between forwards (`launch/bench_layer.py --alt-env`).
* `current_stream(device)`: `torch.cuda.current_stream(device)`, which builds a new
  `torch.cuda.Stream` object per call, returned from a per-device cache while the current
  stream's raw handle (`torch._C._cuda_getCurrentRawStream`, the one Triton launches on) is
  the one it was cached for. Two torch streams of one device never share a raw handle at
  the same time, so the cached object names the same stream.
* `triton_scratch(size, alignment, stream)`: the global scratch that Triton asks its
  allocator for at every launch of a kernel with device-side TMA descriptors (the GEMM2),
  from one int8 buffer kept per device and raw stream (grown when a launch asks for more)
  instead of a `torch.empty` per launch. Sound because kernels on one stream run one after
  another (Triton's programmatic dependent launch is off), so a launch's scratch is free
  once the next launch on that stream starts; a launch on another stream gets a buffer of
  its own. Each buffer stays allocated for the process's life (a few tens of KB).
* `span`'s no-op context (`megatron_overlap.profiling`): one shared `nullcontext`.

`MEGATRON_OVERLAP_HOST_CACHE=0` makes the first three take the plain calls again (for an
A/B of this module in one process, `bench_layer.py --alt-env MEGATRON_OVERLAP_HOST_CACHE=0`).
"""

from __future__ import annotations

import os
import sys
from typing import Dict, Optional, Tuple

import torch

HOST_CACHE_ENV = "MEGATRON_OVERLAP_HOST_CACHE"
"""Environment variable: "0" turns this module's shortcuts off (the plain calls run); "1",
unset or empty: on. Read at every call."""

_ENCODING = sys.getfilesystemencoding()
# POSIX: os.environ keeps the environment as {bytes: bytes} in `_data` (CPython's
# os._Environ since 3.2); elsewhere its keys are transformed (upper-cased on Windows), so the
# plain call runs.
_RAW_ENV = os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict)
_KEYS: Dict[str, bytes] = {}
_HOST_CACHE_KEY = HOST_CACHE_ENV.encode(_ENCODING, "surrogateescape")


def _enabled() -> bool:
    if _RAW_ENV:
        return os.environ._data.get(_HOST_CACHE_KEY) != b"0"
    return os.environ.get(HOST_CACHE_ENV) != "0"


def getenv(name: str, default: Optional[str] = None) -> Optional[str]:
    """`os.environ.get(name, default)` (the same value; see the module docstring).

    Raises:
        TypeError: `name` is not a str (as `os.environ.get`).
    """
    if not _RAW_ENV or not _enabled():
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        if not isinstance(name, str):
            raise TypeError(f"str expected, not {type(name).__name__}")
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = os.environ._data.get(key)
    return default if value is None else value.decode(_ENCODING, "surrogateescape")


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_STREAMS: Dict[int, Tuple[int, torch.cuda.Stream]] = {}


def current_stream(device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)` (a `torch.device`, or a device index; None: the
    current device), cached per device while its raw handle is unchanged (see the module
    docstring)."""
    index = device.index if isinstance(device, torch.device) else device
    if _RAW_STREAM is None or not _enabled():
        return torch.cuda.current_stream(index)
    if index is None:
        index = torch.cuda.current_device()
    raw = _RAW_STREAM(index)
    hit = _STREAMS.get(index)
    if hit is not None and hit[0] == raw:
        return hit[1]
    stream = torch.cuda.current_stream(index)
    _STREAMS[index] = (raw, stream)
    return stream


_SCRATCH: Dict[Tuple[int, int], torch.Tensor] = {}


def triton_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator interface (`triton.set_allocator`): `size` bytes of device
    memory aligned to `alignment` for a launch on the current device's raw stream
    `stream`; from a buffer kept per (device, stream) (see the module docstring)."""
    if not _enabled() or alignment > 512:  # (the caching allocator aligns to 512 bytes)
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf
