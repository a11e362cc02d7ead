"""Named ranges of the flag-on forward: profiler ranges, or host-time accumulators.

`span("mo.prepare")` is `torch.profiler.record_function` while a torch profiler is active,
a host-time accumulator inside `host_times()`, and a no-op context otherwise
(record_function costs a few microseconds a call even with no profiler; a layer forward
opens about ten of them). The names show up in chrome traces (`launch/bench_layer.py
--profile --trace-dir DIR`) as host ranges around the stages of the flag-on forward, and in
`launch/bench_layer.py --host-breakdown` as host microseconds per stage.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Dict, Iterator, List, Optional

import torch

_HOST_TIMES: Optional[Dict[str, List[float]]] = None


def _profiler_on() -> bool:
    # torch.autograd.profiler keeps this module-level flag for its record_function fast path.
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


class _HostSpan:
    """Adds the host seconds between enter and exit to `_HOST_TIMES[name]`."""

    __slots__ = ("name", "t0")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if _HOST_TIMES is not None:
            _HOST_TIMES[self.name].append(time.perf_counter() - self.t0)


_NOTHING = contextlib.nullcontext()  # reusable and reentrant: one for every no-op span


def span(name: str):
    """A context manager: `record_function(name)` under an active profiler, a host timer
    inside `host_times()`, else nothing."""
    if _HOST_TIMES is not None:
        return _HostSpan(name)
    if _profiler_on():
        return torch.profiler.record_function(name)
    return _NOTHING


@contextlib.contextmanager
def host_times() -> Iterator[Dict[str, List[float]]]:
    """Inside: every `span` adds its host seconds (time.perf_counter, no device sync) to the
    yielded {name: [seconds, ...]}, one entry per span entered. Not reentrant.

    Raises:
        RuntimeError: entered while another `host_times()` is active.
    """
    global _HOST_TIMES
    if _HOST_TIMES is not None:
        raise RuntimeError("host_times() is already active")
    _HOST_TIMES = defaultdict(list)
    try:
        yield _HOST_TIMES
    finally:
        _HOST_TIMES = None
