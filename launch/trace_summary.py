"""Where a profiled forward's time goes, from its chrome trace (torch.profiler).

    python launch/trace_summary.py results/traces/qwen3-30b-a3b_tp1-ep2-dp2-sp0_4096_on.json

Traces come from `launch/bench_layer.py --profile --trace-dir DIR`. For each trace it prints
  * the span from the first to the last event (host and device), the device's busy time
    (union of kernels and copies) and its idle time inside the span;
  * the host ranges (`user_annotation`: the 'mo.*' stages of the flag-on layer and
    Megatron's own ranges) with start offset and duration;
  * the device's idle gaps longer than --gap-us, each with the host operations that were
    running when it began (what the device waited for: a host sync, a slow enqueue);
  * the CUDA API calls (runtime and driver: Triton launches through the driver's
    cuLaunchKernel) by total host time (a host that waits for the device shows here:
    cudaStreamSynchronize, cudaEventSynchronize, or a cudaMemcpyAsync from pageable memory
    that the driver ran synchronously), with each one's longest call;
  * the kernels by total time.
All times in microseconds; offsets from the trace's first event.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from collections import defaultdict

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    # run from a checkout without `pip install`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_overlap.bench.cli import non_negative_float, positive_int  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")
"""torch.profiler's categories of CUDA API calls (Triton kernels launch through the driver)."""


def load(path: str) -> list[dict]:
    """The complete ("X") events of a chrome trace.

    Raises:
        ValueError: the file cannot be read or is not a chrome trace, or a complete event's
            ts / dur is not a number (names the file and the event).
    """
    try:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON chrome trace (a .json file, or .json.gz; "
                         f"{err})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list (not a torch.profiler chrome trace)")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e or "dur" not in e:
            continue  # other phases, metadata, anything that is not an event object
        try:
            ts, dur = float(e["ts"]), float(e["dur"])
        except (TypeError, ValueError):
            ts = dur = float("nan")
        if not (math.isfinite(ts) and math.isfinite(dur) and dur >= 0):
            raise ValueError(f"{path}: traceEvents[{i}] has ts={e['ts']!r}, dur={e['dur']!r}; "
                             "expected finite numbers of microseconds, dur >= 0") from None
        if not isinstance(e.get("name"), str):
            raise ValueError(f"{path}: traceEvents[{i}] has name={e.get('name')!r}; expected "
                             "a string")
        out.append(e)
    return out


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """Union of the device events' [start, end) intervals, sorted."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def totals_by_name(events: list[dict], cats) -> list[tuple[str, float, int, float]]:
    """The events of categories `cats` per name: (name, total us, count, longest us), by
    total time, largest first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for e in events:
        if e.get("cat") in cats:
            t = totals[e["name"]]
            dur = float(e["dur"])
            t[0] += dur
            t[1] += 1
            t[2] = max(t[2], dur)
    return sorted(((name, tot, int(n), longest) for name, (tot, n, longest) in totals.items()),
                  key=lambda r: -r[1])


def api_totals(events: list[dict]) -> list[tuple[str, float, int, float]]:
    """`totals_by_name` of the CUDA API calls (`API_CATS`)."""
    return totals_by_name(events, API_CATS)


def summarize(path: str, gap_us: float = 30.0, top: int = 12) -> str:
    events = load(path)
    if not events:
        return f"{path}: no complete events"
    t0 = min(float(e["ts"]) for e in events)
    t1 = max(float(e["ts"]) + float(e["dur"]) for e in events)
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    host_ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation",
                                                       "python_function", *API_CATS)]
    busy = busy_intervals(device)
    busy_us = sum(b - a for a, b in busy)
    lines = [f"== {path}"]
    if busy:
        lines.append(f"span {t1 - t0:.0f} us; device busy {busy_us:.0f} us, idle "
                     f"{(t1 - t0) - busy_us:.0f} us inside the span")
    else:
        lines.append(f"span {t1 - t0:.0f} us; no device events (a CPU run, or the profiler "
                     "recorded no CUDA activity)")
    if busy:
        lines.append(f"device first start +{busy[0][0] - t0:.0f}, last end +{busy[-1][1] - t0:.0f}")

    lines.append("-- host ranges (user_annotation): +start dur name")
    for e in sorted((e for e in events if e.get("cat") == "user_annotation"),
                    key=lambda e: float(e["ts"])):
        lines.append(f"  +{float(e['ts']) - t0:8.0f} {float(e['dur']):8.0f}  {e['name']}")

    lines.append(f"-- device idle gaps > {gap_us:.0f} us: +start dur | host ops running then")
    prev_end = busy[0][1] if busy else t0
    for a, b in busy[1:]:
        if a - prev_end > gap_us:
            running = [e for e in host_ops if float(e["ts"]) <= prev_end
                       < float(e["ts"]) + float(e["dur"]) and e.get("cat") != "user_annotation"]
            running.sort(key=lambda e: float(e["dur"]))
            names = ", ".join(f"{e['name'][:40]} ({float(e['dur']):.0f})" for e in running[:4])
            lines.append(f"  +{prev_end - t0:8.0f} {a - prev_end:8.0f} | {names}")
        prev_end = max(prev_end, b)

    lines.append("-- CUDA API calls (runtime and driver) by host time: total count max name")
    lines.extend(f"  {tot:8.0f} {n:4d} {longest:8.0f}  {name[:60]}" for name, tot, n, longest
                 in api_totals(events)[:top])

    lines.append("-- kernels by total time: total count name")
    lines.extend(f"  {tot:8.0f} {n:4d}  {name[:90]}" for name, tot, n, _
                 in totals_by_name(device, DEVICE_CATS)[:top])
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="chrome trace JSON files")
    parser.add_argument("--gap-us", type=non_negative_float, default=30.0,
                        help="report device idle gaps longer than this (default 30 us)")
    parser.add_argument("--top", type=positive_int, default=12,
                        help="kernels listed (default 12)")
    args = parser.parse_args(argv)
    for path in args.traces:
        try:
            print(summarize(path, args.gap_us, args.top))
        except ValueError as err:
            parser.error(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
