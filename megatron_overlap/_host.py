"""Cheaper forms of host operations that the flag-on forward runs several times each.

A flag-on MoE layer forward runs its host code once, with the CPU caches cold from the rest
of the model's forward, so every distinct operation costs several times its warm time
(docs/perf_notes.md v5.3, v5.4). These recur:

* `getenv(name)`: `os.environ.get(name)` without `os._Environ`'s per-call key check and
  encoding (one dict lookup of the encoded name in `os.environ`'s own mapping; the value
  is decoded as `os.environ` decodes it; where `os.environ` is not CPython's POSIX
  `os._Environ`, e.g. replaced by a test, the plain call). The fused path reads about ten
  `MEGATRON_OVERLAP_*` variables per forward, each at its use, so that a benchmark can
  switch one between forwards (`launch/bench_layer.py --alt-env`).
* `current_stream(device)`: `torch.cuda.current_stream(device)`, which builds a new
  `torch.cuda.Stream` object per call, returned from a per-device cache while the current
  stream's identity (`torch._C._cuda_getCurrentStream`: stream id, device index, device
  type, from which `torch.cuda.current_stream` builds its object) is the one it was cached
  for: the cached object compares equal to the one torch would build.
* `triton_scratch(size, alignment, stream)`: the global scratch that Triton asks its
  allocator for at a launch of a kernel with device-side TMA descriptors (the GEMM2), for
  this package's own launches (`own_launch()`) from one int8 buffer kept per device and
  raw stream (grown when a launch asks for more) instead of a `torch.empty` per launch.
  Sound because those launches do not use programmatic dependent launch, and a launch
  without it starts only once all earlier work on its stream is done, so the previous
  launch's scratch is free by then; a launch on another stream gets a buffer of its own.
  Outside `own_launch()` (another library's Triton kernels in this thread find this
  allocator set too) and while the current stream is being captured into a CUDA graph
  (whose replays must own their memory), a `torch.empty` per launch as before. Each kept
  buffer stays allocated for the process's life (a few tens of KB).
* `span`'s no-op context (`megatron_overlap.profiling`): one shared `nullcontext`.

`MEGATRON_OVERLAP_HOST_CACHE=0` makes the first three take the plain calls again (for an
A/B of this module in one process, `bench_layer.py --alt-env MEGATRON_OVERLAP_HOST_CACHE=0`).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Dict, Optional

import torch

HOST_CACHE_ENV = "MEGATRON_OVERLAP_HOST_CACHE"
"""Environment variable: "0" turns this module's shortcuts off (the plain calls run); "1",
unset or empty: on. Read at every call."""

_ENCODING = sys.getfilesystemencoding()
# POSIX: os.environ keeps the environment as {bytes: bytes} in `_data` (CPython's
# os._Environ since 3.2); elsewhere its keys are transformed (upper-cased on Windows), so the
# plain call runs there, and wherever os.environ is no longer that object.
_ENVIRON_TYPE = type(os.environ)
_POSIX = os.name == "posix"
_KEYS: Dict[str, bytes] = {}
_HOST_CACHE_KEY = HOST_CACHE_ENV.encode(_ENCODING, "surrogateescape")


def _raw_env() -> Optional[dict]:
    """os.environ's own {bytes: bytes} mapping, or None where it is not to be read."""
    environ = os.environ
    if not _POSIX or type(environ) is not _ENVIRON_TYPE:
        return None
    data = getattr(environ, "_data", None)
    return data if type(data) is dict else None


def _enabled() -> bool:
    data = _raw_env()
    if data is not None:
        return data.get(_HOST_CACHE_KEY) != b"0"
    return os.environ.get(HOST_CACHE_ENV) != "0"


def getenv(name: str, default: Optional[str] = None) -> Optional[str]:
    """`os.environ.get(name, default)` (the same value; see the module docstring).

    Raises:
        TypeError: `name` is not a str (as `os.environ.get`).
    """
    data = _raw_env()
    if data is None or data.get(_HOST_CACHE_KEY) == b"0":
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        if not isinstance(name, str):
            raise TypeError(f"str expected, not {type(name).__name__}")
        key = _KEYS[name] = name.encode(_ENCODING, "surrogateescape")
    value = data.get(key)
    return default if value is None else value.decode(_ENCODING, "surrogateescape")


_STREAM_ID = getattr(torch._C, "_cuda_getCurrentStream", None)
_STREAMS: Dict[int, tuple] = {}


def current_stream(device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)` (a `torch.device`, or a device index; None: the
    current device), cached per device while the current stream is the same (see the
    module docstring)."""
    index = device.index if isinstance(device, torch.device) else device
    if _STREAM_ID is None or not _enabled():
        return torch.cuda.current_stream(index)
    if index is None:
        index = torch.cuda.current_device()
    ident = _STREAM_ID(index)
    hit = _STREAMS.get(index)
    if hit is not None and hit[0] == ident:
        return hit[1]
    stream = torch.cuda.current_stream(index)
    _STREAMS[index] = (ident, stream)
    return stream


_SCRATCH: Dict[tuple, torch.Tensor] = {}
_OWN = threading.local()  # .depth: this thread's `own_launch()` nesting


class _OwnLaunch:
    __slots__ = ()

    def __enter__(self) -> None:
        _OWN.depth = getattr(_OWN, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _OWN.depth -= 1


_OWN_LAUNCH = _OwnLaunch()


def own_launch() -> _OwnLaunch:
    """A context manager: inside it (in this thread) Triton launches are this package's
    own, whose global scratch `triton_scratch` may keep (see the module docstring).
    Reentrant."""
    return _OWN_LAUNCH


def triton_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator interface (`triton.set_allocator`): `size` bytes of device
    memory aligned to `alignment` for a launch on the current device's raw stream
    `stream`; inside `own_launch()` from a buffer kept per (device, stream), elsewhere new
    (see the module docstring)."""
    if (not getattr(_OWN, "depth", 0) or alignment > 512  # (the caching allocator: 512)
            or not _enabled() or torch.cuda.is_current_stream_capturing()):
        return torch.empty(size, dtype=torch.int8, device="cuda")
    key = (torch.cuda.current_device(), stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < size:
        buf = _SCRATCH[key] = torch.empty(size, dtype=torch.int8, device="cuda")
    return buf
