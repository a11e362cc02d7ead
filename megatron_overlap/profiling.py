"""Named ranges for torch.profiler traces, free when no profiler runs.

`span("mo.prepare")` is `torch.profiler.record_function` while a torch profiler is active
and a no-op context otherwise (record_function costs a few microseconds a call even with no
profiler; a layer forward opens about ten of them). The names show up in chrome traces
(`launch/bench_layer.py --profile --trace-dir DIR`) as host ranges around the stages of the
flag-on forward.
"""

from __future__ import annotations

import contextlib

import torch


def _profiler_on() -> bool:
    # torch.autograd.profiler keeps this module-level flag for its record_function fast path.
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def span(name: str):
    """A context manager: `record_function(name)` under an active profiler, else nothing."""
    if _profiler_on():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
