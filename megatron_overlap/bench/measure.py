"""Timing, memory and environment helpers shared by the layer and model benchmarks.

How we measure (DESIGN.md section 5): in one process run, on the same inputs, every variant
timed alternately; on CUDA with CUDA events around one forward, all ranks lined up before it
(`sync`); a forward takes as long as its slowest rank (`reduce_max`, element-wise over the
timed runs, then percentiles of that list).

Memory of a variant, in bytes, per rank (the maximum over ranks goes into the rows):
* `param_bytes`: its parameters and buffers;
* `symm_workspace_bytes`: the fused op's symmetric-memory workspace (`megatron_overlap.
  symm`; flag on only), allocated by PyTorch's symmetric-memory allocator outside the caching
  allocator and so not in `torch.cuda.max_memory_allocated`; added from the workspace's own
  size (if some torch version did count it, it would be counted twice: an overstatement
  against the flag);
* `fwd_extra_bytes`: the largest `max_memory_allocated` during one of its timed forwards
  minus what was allocated just before that forward (activations, outputs, temporaries);
* `own_peak_bytes` = `own_peak(param, symm, fwd_extra)`, their sum: the peak the variant
  needs on its own, input aside, whatever else the benchmark keeps resident (the other
  variants' weights). The flag's extra memory is own_peak(on) / own_peak(baseline) - 1;
* `peak_abs_bytes`: plain `max_memory_allocated` during its forwards (everything resident);
* `persistent_bytes` (information only, not in own_peak): what the variant's first forward
  left allocated. Buffers shared by all variants (Megatron's global memory buffer for
  sequence-parallel all-gathers) land on whichever variant runs first.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]

L2_FLUSH_BYTES = 256 * 2**20
"""Bytes zeroed before every timed layer forward on CUDA: > 4x the H200's 50 MB L2, so no
variant starts with the previous one's data cached."""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]) of a non-empty sequence.

    Raises:
        ValueError: empty `values`, or q outside [0, 100].
    """
    if len(values) == 0:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q}: expected 0 <= q <= 100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def sync(device: torch.device) -> None:
    """All ranks line up, and on CUDA the queued work is finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


TIMING_ORDER = "williams"
"""The rows' `timing_order`: the variants' order in the timed rounds (`round_order`)."""


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The order of the variants in timed round r: row r of a Williams design (a Latin
    square balanced for first-order carry-over; E. J. Williams, Aust. J. Sci. Res. A 2,
    149-168, 1949): every round times every variant once, and over each cycle of n rounds
    (2n for an odd number n of variants) every variant comes right after every other one
    equally often within the rounds (the rounds' boundaries add one succession each).

    A forward's host time depends on what ran just before it: a variant whose predecessor
    ran much of the same Python (Megatron's dispatcher, the same layer) finds it warm in the
    CPU's caches. With a rotation alone (bench_layer before v5.4; prefill kept one fixed
    order) every variant keeps one predecessor, so that effect has the same sign in every
    round: measured (docs/perf_notes.md v5.4, 1x H200, EP1 4096) the flag-on layer ran
    0.16-0.52 ms faster after `off-grouped` than after `off`."""
    names = list(names)
    n = len(names)
    if n < 2:
        return names
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    i = r % (n if n % 2 == 0 else 2 * n)
    row = [names[(x + i) % n] for x in first]
    return row if i < n else row[::-1]


def reduce_max(values: Sequence[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks (a forward takes as long as its slowest rank)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


_L2_BUFFERS: dict = {}


def flush_l2(device: torch.device) -> None:
    """Zero `L2_FLUSH_BYTES` on the device (queued; no-op on CPU). The buffer is allocated
    once per device and stays resident (the same for every variant)."""
    if device.type != "cuda":
        return
    buf = _L2_BUFFERS.get(str(device))
    if buf is None:
        buf = _L2_BUFFERS[str(device)] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8,
                                                     device=device)
    buf.zero_()


class Timer:
    """Times one forward per `measure` call: CUDA events on GPU, perf_counter on CPU.

    Every measured forward starts after all ranks line up (`sync`). `host_ms` holds each
    forward's host time (perf_counter around the call, no device sync added: on CUDA the
    time to enqueue it plus any wait in a host sync the forward makes itself, e.g.
    Megatron's split sizes; close to the event time means the host paces the forward, by
    its work or by its syncs). On CUDA it also
    records, in bytes, `peak_bytes` (largest `max_memory_allocated` during a forward, reset
    before each) and `fwd_extra_bytes` (largest peak minus what was allocated just before).

    Args:
        device: where the forwards run.
        flush_l2: zero `L2_FLUSH_BYTES` before every forward (CUDA; untimed).
    """

    def __init__(self, device: torch.device, *, flush_l2: bool = False) -> None:
        self.device = device
        self.flush_l2 = flush_l2
        self._pending: list[tuple[Any, Any]] = []
        self.cpu_ms: list[float] = []
        self.host_ms: list[float] = []
        self.peak_bytes = 0
        self.fwd_extra_bytes = 0

    def measure(self, fn: Callable[[], Any]) -> None:
        """Run `fn()` once, timed; its output is dropped."""
        sync(self.device)
        if self.device.type == "cuda":
            if self.flush_l2:
                flush_l2(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            self.host_ms.append((time.perf_counter() - t0) * 1e3)
            end.record()
            self._pending.append((start, end))
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_bytes = max(self.peak_bytes, peak)
            self.fwd_extra_bytes = max(self.fwd_extra_bytes, peak - before)
        else:
            t0 = time.perf_counter()
            fn()
            self.cpu_ms.append((time.perf_counter() - t0) * 1e3)
            self.host_ms.append(self.cpu_ms[-1])

    def times_ms(self) -> list[float]:
        """This rank's per-forward times in ms (waits for the GPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in self._pending]
        return list(self.cpu_ms)


STACK_DUMP_ENV = "MO_STACK_DUMP_S"


def arm_stack_dumps() -> float | None:
    """If `$MO_STACK_DUMP_S` is set (seconds > 0), every this many seconds each process
    writes all its threads' Python stacks to stderr (`faulthandler.dump_traceback_later`),
    so a run that stops making progress says where each rank waits. Returns the period.

    Raises:
        ValueError: the variable is set but not a number > 0.
    """
    import faulthandler

    text = os.environ.get(STACK_DUMP_ENV)
    if not text:
        return None
    try:
        period = float(text)
    except ValueError:
        period = -1.0
    if not period > 0:
        raise ValueError(f"{STACK_DUMP_ENV}={text!r}: expected seconds > 0")
    faulthandler.dump_traceback_later(period, repeat=True)
    return period


def allocated_bytes(device: torch.device) -> int:
    """`torch.cuda.memory_allocated` after the queued work finished (0 on CPU)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (each storage view counted by its size)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def own_peak(param: int, symm: int, fwd_extra: int) -> int:
    """A variant's own peak memory in bytes (see the module docstring)."""
    return int(param) + int(symm) + int(fwd_extra)


def symm_workspace_bytes() -> int:
    """Bytes of every live fused-op workspace of this process (receive buffers, arrival
    counters): allocated outside PyTorch's caching allocator (see the module docstring)."""
    from megatron_overlap import symm

    total = 0
    for ws in symm._WORKSPACES.values():
        if ws._destroyed:
            continue
        for t in (ws._recv, ws.signals, ws.error):
            if t is not None and t.is_cuda:
                total += t.numel() * t.element_size()
    return total


def max_error(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max|out - ref|, max|ref| and their ratio over all ranks, and NaN/Inf count in either.

    Args:
        out, ref: this rank's part of two results of the same computation, any equal shape.

    Raises:
        ValueError: the shapes differ.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs().nan_to_num(nan=float("inf"))
    zero = torch.zeros((), device=out.device)
    maxima = torch.stack([diff.max() if diff.numel() else zero,
                          ref.abs().max() if ref.numel() else zero]).double()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    nonfinite = (~torch.isfinite(out)).sum().double() + (~torch.isfinite(ref)).sum().double()
    dist.all_reduce(nonfinite)
    max_abs_diff, max_abs_ref = maxima.tolist()
    return {
        "max_abs_diff": max_abs_diff,
        "max_abs_ref": max_abs_ref,
        "max_rel_diff": max_abs_diff / max_abs_ref if max_abs_ref > 0 else float("inf"),
        "nonfinite": int(nonfinite.item()),
    }


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def git_sha() -> str:
    """The commit the rows come from: $MO_GIT_SHA when set (the GPU machine's copy of the
    working tree carries stale git metadata; `scripts/device_setup.sh` callers pass the dev
    checkout's HEAD), else `git rev-parse HEAD` of the checkout, "unknown" without git."""
    env = os.environ.get("MO_GIT_SHA", "").strip()
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line(world_size: int) -> str:
    """The command that started this process, as a user would type it: `torchrun --standalone
    --nproc_per_node <world> <script> <args>` for world > 1 (reconstructed: torchrun's own
    options other than the process count are not visible to its workers), else `python3
    <script> <args>`; the script path relative to the repository when inside it."""
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "?"
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(script, REPO_ROOT)
        if not rel.startswith(".."):
            script = rel
    args = shlex.join(sys.argv[1:])
    if world_size > 1:
        return f"torchrun --standalone --nproc_per_node {world_size} {script} {args}".strip()
    return f"python3 {script} {args}".strip()


def environment(device: torch.device) -> dict:
    """Fields common to every row: the command, hardware, versions, git sha, timestamp (UTC)."""
    import megatron.core

    from megatron_overlap.megatron.grouped_experts import grouped_mm_name

    return {
        "command": command_line(dist.get_world_size() if dist.is_initialized() else 1),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "megatron_overlap": _version("megatron_overlap"),
        "transformer_engine": _version("transformer_engine"),
        "grouped_mm": grouped_mm_name(),
        "git_sha": git_sha(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def append_rows(path: str, rows: list[dict]) -> None:
    """Append JSON lines to `path` (parent folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
