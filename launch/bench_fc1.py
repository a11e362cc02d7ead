"""The grouped FC1 + SwiGLU of the flag-on experts, whole or in chunks of rows: time and peak
memory of each way, side by side in one run (one GPU; no process group).

    source scripts/device_setup.sh && python launch/bench_fc1.py --out $OUT/bench_fc1.jsonl

Two ways, both in `megatron_overlap.megatron.grouped_experts`, for Megatron's unfused
SwiGLU:
  split  `swiglu_fc1_split`, what the grouped FC1 runs (flag on and the `off-grouped`
         baseline alike): the gate half's GEMM for all rows straight into the [N, F]
         output, the linear half's GEMM in chunks of [rows, F], each chunk's SwiGLU x probs
         in place;
  rows   `swiglu_fc1_chunks` (for comparison; v4.9's first version): per chunk of rows
         (`row_chunks`) one torch grouped GEMM of FC1's whole [rows, 2F] output, then the
         in-place SwiGLU x probs into the chunk's rows of one [N, F] output.
The rows are those one EP rank's experts receive in a balanced layer: tokens per rank x
top-k (all EP ranks' tokens routed uniformly), split evenly over the num_moe_experts / EP
local experts.

Per (model, tokens) the settings run interleaved (one call of each per round, CUDA events
around each call, --iters rounds after --warmup), so a slow spell of the machine hits every
setting alike; printed and in the rows: median (p20 / p80) ms, its ratio to the first
setting's, and the peak memory the call allocates beyond its inputs (`torch.cuda` peak
statistics, one more call per setting); each setting's output is checked against the first
setting's (`agree`, bf16 tolerance; exit status 1 when one disagrees). On the CPU (a smoke
run) the times are wall-clock and the memory is not measured. A setting that would make
more than MAX_CHUNKS chunks exits with status 2.

Row schema (JSON lines, `benchmark: "fc1"`): model, tokens_per_rank, ep, rows,
local_experts, hidden_size, moe_ffn_hidden_size, dtype, mode ("rows" | "split"), chunk_mb
(null: one chunk), chunks, ms_p50, ms_p20, ms_p80, vs_first (ms_p50 / the first setting's),
agree, peak_extra_bytes (null on CPU), iters, warmup, device, gpu, torch, git_sha, command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_overlap.bench.cli import (
    add_timing_args,
    check_launch_inputs,
    make_folder,
    positive_int,
)
from megatron_overlap.bench.measure import percentile
from megatron_overlap.config import FC1_CHUNK_MAX_MB
from megatron_overlap.megatron.grouped_experts import (
    row_chunks,
    swiglu_fc1_chunks,
    swiglu_fc1_split,
)
from megatron_overlap.models import available_models, load_model_shape

MAX_CHUNKS = 4096
"""Most chunks one setting may make (a tiny size would launch one GEMM per row)."""

AGREE_REL_TOL = {torch.bfloat16: 2**-7, torch.float32: 1e-5}
"""max|h - h_first| / max|h_first| each setting must stay under (`agree`)."""


def chunk_setting(text: str) -> tuple[str, float | None]:
    """"[rows:|split:]SIZE" -> (mode, MiB or None for "all": one chunk)."""
    mode, colon, size = text.rpartition(":")
    mode = mode if colon else "rows"
    if mode not in ("rows", "split"):
        raise argparse.ArgumentTypeError(f"{text!r}: the mode before ':' must be 'rows' or "
                                         "'split'")
    if size == "all":
        return mode, None
    try:
        mib = float(size)
    except ValueError:
        mib = float("nan")
    if not 0 < mib <= FC1_CHUNK_MAX_MB:
        raise argparse.ArgumentTypeError(f"{text!r}: expected [rows:|split:] then 'all' or a "
                                         f"number of MiB > 0 and <= {FC1_CHUNK_MAX_MB}")
    return mode, mib


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+",
                   default=(["phi-3.5-moe", "mixtral-8x7b", "qwen3-30b-a3b",
                             "qwen1.5-moe-a2.7b", "deepseek-v2-lite"] if cuda else ["tiny"]),
                   help=f"names in configs/models ({', '.join(available_models())}) or "
                        "YAML paths (default: the five suite models on GPU, tiny on CPU)")
    p.add_argument("--tokens", nargs="+", type=positive_int,
                   default=[8192, 32768] if cuda else [64],
                   help="tokens per rank (default 8192 32768 on GPU, 64 on CPU)")
    p.add_argument("--ep", type=positive_int, default=2,
                   help="expert-parallel size: num_moe_experts / EP local experts (default 2)")
    p.add_argument("--chunk-mb", nargs="+", type=chunk_setting,
                   default=[chunk_setting(t) for t in (
                       ("all", "512", "128", "split:all", "split:256", "split:128",
                        "split:64") if cuda else ("all", "0.01", "split:0.005"))],
                   help="what runs, each [MODE:]SIZE: MODE rows (default; "
                        "swiglu_fc1_chunks: FC1's whole [rows, 2F] output in chunks of SIZE "
                        "MiB) or split (swiglu_fc1_split: the gate half for all rows, the "
                        "linear half in chunks of SIZE MiB of [rows, F]); SIZE a number of "
                        "MiB or 'all' (one chunk). Default: all 512 128 split:all split:256 "
                        "split:128 split:64 on GPU, all 0.01 split:0.005 on CPU; ratios "
                        "against the first")
    add_timing_args(p, warmup=3 if cuda else 1, iters=20 if cuda else 2, per="per setting")
    p.add_argument("--out", default="results/bench_fc1.jsonl",
                   help="JSONL file rows are appended to ('' = none)")
    args = p.parse_args(argv)
    args.model, args.tokens = list(dict.fromkeys(args.model)), list(dict.fromkeys(args.tokens))
    try:
        check_launch_inputs(args.out, create=False)  # its folder: made below
        shapes = [load_model_shape(m) for m in args.model]
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    for shape in shapes:
        if shape.num_moe_experts % args.ep:
            p.error(f"--ep {args.ep} does not divide {shape.name}'s "
                    f"{shape.num_moe_experts} experts")
        elsize = 2 if cuda else 4  # bf16 on GPU, fp32 on CPU
        for tokens in args.tokens:
            counts = _expert_rows(shape, tokens, args.ep)
            for mode, mib in args.chunk_mb:
                chunks = _chunk_count(mode, mib, counts, shape.moe_ffn_hidden_size * elsize)
                if chunks > MAX_CHUNKS:
                    p.error(f"--chunk-mb {mode}:{mib:g} makes {chunks} chunks of "
                            f"{shape.name}'s {sum(counts)} rows at {tokens} tokens (more "
                            f"than {MAX_CHUNKS}): give a larger size")
    make_folder(args.out)  # every check passed: the run proceeds
    args.shapes = shapes
    return args


def _expert_rows(shape, tokens: int, ep: int) -> list[int]:
    """Rows of each of the rank's num_moe_experts / EP local experts: tokens x top-k, even."""
    local, n = shape.num_moe_experts // ep, tokens * shape.moe_router_topk
    return [n // local + (e < n % local) for e in range(local)]


def _chunk_count(mode: str, mib: float | None, counts, half_bytes: int) -> int:
    return len(row_chunks(counts, half_bytes * (1 if mode == "split" else 2), _budget(mib)))


def _budget(mib: float | None) -> int:
    return 2**62 if mib is None else max(1, int(mib * 2**20))


def _runner(mode: str, mib: float | None, x, w1, counts, probs):
    """A call of the FC1 the way `mode` computes it, returning its [N, F] output."""
    if mode == "split":
        return lambda: swiglu_fc1_split(x, w1, counts, probs, _budget(mib))[0]
    chunks = row_chunks(counts, w1.shape[1] * x.element_size(), _budget(mib))
    return lambda: swiglu_fc1_chunks(x, w1, chunks, probs)[0]


def _git_sha() -> str | None:
    sha = os.environ.get("MO_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    command = " ".join(["bench_fc1.py"] + list(sys.argv[1:] if argv is None else argv))
    git_sha = _git_sha()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows_out = []
    for shape in args.shapes:
        local = shape.num_moe_experts // args.ep
        hidden, ffn = shape.hidden_size, shape.moe_ffn_hidden_size
        w1 = (torch.randn(local, 2 * ffn, hidden, generator=gen, device=device)
              * hidden**-0.5).to(dtype)
        for tokens in args.tokens:
            counts = _expert_rows(shape, tokens, args.ep)
            n = sum(counts)
            x = torch.randn(n, hidden, generator=gen, device=device).to(dtype)
            probs = torch.rand(n, generator=gen, device=device)
            half_bytes = ffn * x.element_size()

            plans = [(mode, mib, _runner(mode, mib, x, w1, counts, probs))
                     for mode, mib in args.chunk_mb]
            times = {i: [] for i in range(len(plans))}
            for it in range(args.warmup + args.iters):
                for i, (_, _, run) in enumerate(plans):
                    if cuda:
                        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        start.record()
                        run()
                        end.record()
                        end.synchronize()
                        ms = start.elapsed_time(end)
                    else:
                        t0 = time.perf_counter()
                        run()
                        ms = (time.perf_counter() - t0) * 1e3
                    if it >= args.warmup:
                        times[i].append(ms)
            base = statistics.median(times[0])  # ratios against the first setting
            reference = plans[0][2]()
            for i, (mode, mib, run) in enumerate(plans):
                chunks = _chunk_count(mode, mib, counts, half_bytes)
                peak = None
                if cuda:
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    h = run()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - before
                else:
                    h = run()
                # the same values as the first setting's (within the GEMM's rounding: other
                # shapes may take other kernels)
                scale = reference.abs().max().clamp_min(1e-30)
                agree = bool(((h - reference).abs().max() / scale) <= AGREE_REL_TOL[dtype])
                del h
                # (linear interpolation inside the sample, as the layer benchmark's)
                q = [percentile(times[i], 20), None, None, percentile(times[i], 80)]
                p50 = statistics.median(times[i])
                row = {
                    "benchmark": "fc1", "model": shape.name, "tokens_per_rank": tokens,
                    "ep": args.ep, "rows": n, "local_experts": local, "hidden_size": hidden,
                    "moe_ffn_hidden_size": ffn, "dtype": str(dtype).replace("torch.", ""),
                    "mode": mode, "chunk_mb": mib, "chunks": chunks, "ms_p50": p50, "ms_p20": q[0],
                    "ms_p80": q[3], "vs_first": p50 / base if base > 0 else None,
                    "peak_extra_bytes": peak, "agree": agree, "iters": args.iters, "warmup": args.warmup,
                    "device": device.type,
                    "gpu": torch.cuda.get_device_name() if cuda else None,
                    "torch": torch.__version__, "git_sha": git_sha, "command": command,
                }
                rows_out.append(row)
                peak_txt = f"{peak / 2**20:8.0f} MiB" if peak is not None else "       -"
                size = "all" if mib is None else f"{mib:g} MiB"
                print(f"fc1 {shape.name:18s} tokens {tokens:6d} rows {n:7d} {mode:5s} "
                      f"{size:>9s} x{chunks:3d}: "
                      f"{p50:8.3f} ms (p20 {q[0]:.3f} p80 {q[3]:.3f}) "
                      f"{p50 / base if base > 0 else float('nan'):.3f}x the first, "
                      f"peak extra {peak_txt}{'' if agree else ', DISAGREES'}",
                      flush=True)
            del x, probs, plans, reference
        del w1
    bad = [r for r in rows_out if not r["agree"]]
    for r in bad:
        print(f"fc1 {r['model']} tokens {r['tokens_per_rank']} {r['mode']} "
              f"{r['chunk_mb']}: disagrees with the first setting", file=sys.stderr)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows_out:
                f.write(json.dumps(row) + "\n")
        print(f"rows appended to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
