"""Host and GPU cost of the dispatch's sort by local expert: Megatron's unfused
`sort_chunks_by_idxs` against the flag-on dispatcher's `sort_by_local_expert` (CUDA only).

    python3 launch/bench_sort.py --out sort.jsonl

After the EP all-to-all (and the TP all-gather) a rank's received rows are chunk-major
(source chunk, then local expert); `MoEAlltoAllTokenDispatcher.dispatch_postprocess`
reorders them expert-major with `sort_chunks_by_idxs` (megatron-core 0.19, without Transformer
Engine's fused kernel: a split into R * L chunks and a cat, for the rows and for the
probabilities). The flag-on dispatcher (v5.7) does it as one `index_select` per tensor with
a gather index built on the host (C++ `local_expert_sort_index` where built) in pinned
memory. Workloads (`CASES`): bf16 rows of H = 2048 and fp32 probabilities, N = 4096 tokens
per rank x top-k rows, counts per (chunk, expert) drawn from a Dirichlet-multinomial with
--seed:

  qwen3 ep2      R = 2, L = 64  (128 experts, top-8, EP2)
  qwen3 tp2      R = 2, L = 128 (TP2 with SP: every expert local)
  qwen1.5 ep2    R = 2, L = 30  (60 experts, top-4, EP2)
  qwen3 ep1      R = 1, L = 128 (world 1: the sort is the identity, which the flag-on
                 dispatcher skips; timed here for its cost alone)

Variants: `megatron` (`sort_chunks_by_idxs` as the dispatcher calls it), `index (numpy)`
(the same gather with the numpy twin's index), `ours` (`sort_by_local_expert`). Per round
each variant once cold (after a cache thrash, `bench_host._Thrash`) and once warm, in a
Williams order (`bench_host.time_steps`), host microseconds from the call to its return
(GPU work queued, not waited for; `torch.cuda.synchronize` before each thrash); then GPU
microseconds per call, median of 20 CUDA-event timings. Every variant's output is checked
bit for bit against `megatron`'s first (a row says `same`). `--out` appends one JSON row per
workload.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_overlap.bench.cli import (  # noqa: E402
    THRASH_MIB_HELP,
    THRASH_MIB_MAX,
    check_launch_inputs,
    check_thrash_memory,
    int_in,
    make_folder,
    non_negative_int,
    positive_int,
)

CASES = (("qwen3 ep2", 2, 64, 32768), ("qwen3 tp2", 2, 128, 32768),
         ("qwen1.5 ep2", 2, 30, 16384), ("qwen3 ep1", 1, 128, 32768))
"""(name, source chunks R, local experts L, rows N); rows of H = HIDDEN bf16."""

HIDDEN = 2048


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=40,
                        help="cold + warm host measurements per variant (medians)")
    parser.add_argument("--thrash-mib", type=int_in(1, THRASH_MIB_MAX), default=64,
                        help="MiB written before each cold measurement " + THRASH_MIB_HELP)
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the counts")
    parser.add_argument("--out", default="", help="JSONL file to append one row per workload to")
    args = parser.parse_args(argv)
    try:
        # --out's folder is made only once the run proceeds: a refused run leaves none
        check_launch_inputs(args.out, create=False)
        check_thrash_memory(args.thrash_mib)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    import torch

    if not torch.cuda.is_available():
        print("bench_sort: needs a CUDA device (it times GPU launches and kernels)",
              file=sys.stderr)
        return 2
    try:
        make_folder(args.out)
    except ValueError as err:
        parser.error(str(err))
    return _measure(args)


def _measure(args) -> int:
    import numpy as np
    import torch
    from bench_host import _Thrash, time_steps
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from megatron_overlap.bench.measure import git_sha
    from megatron_overlap.megatron import dispatcher

    device = torch.device("cuda")
    thrash = _Thrash(args.thrash_mib, args.seed)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    rows = []
    for name, num_chunks, num_local, num_rows in CASES:
        rng = np.random.default_rng(args.seed)
        share = rng.dirichlet(np.ones(num_chunks * num_local))
        by_chunk = rng.multinomial(num_rows, share).astype(np.int64).reshape(num_chunks,
                                                                             num_local)
        rows_lr = np.ascontiguousarray(by_chunk.T)  # [L, R], the dispatcher's argument
        x = torch.randn(num_rows, HIDDEN, device=device, dtype=torch.bfloat16)
        probs = torch.rand(num_rows, device=device)
        # MoEAlltoAllTokenDispatcher.__init__'s sort_input_by_local_experts
        order = torch.arange(num_chunks * num_local).reshape(-1, num_local).T.ravel()
        split_sizes = torch.from_numpy(by_chunk.reshape(-1).copy())

        def numpy_index():
            index = torch.empty(num_rows, dtype=torch.int32, pin_memory=True)
            dispatcher.local_expert_sort_index_numpy(rows_lr, index.numpy())
            index = index.to(device, non_blocking=True)
            return x.index_select(0, index), probs.index_select(0, index)

        todo = {
            "megatron": lambda: sort_chunks_by_idxs(x, split_sizes, order, probs=probs),
            "index (numpy)": numpy_index,
            "ours": lambda: dispatcher.sort_by_local_expert(x, probs, rows_lr),
        }
        want = todo["megatron"]()
        same = all(torch.equal(a, b) for fn in todo.values() for a, b in zip(fn(), want))
        host = time_steps(todo, thrash, args.rounds, torch.cuda.synchronize)
        gpu = {}
        for variant, fn in todo.items():
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            gpu[variant] = statistics.median(times)
        print(f"{name}: R={num_chunks} L={num_local} N={num_rows} same={same}; host us "
              "cold / warm, GPU us: " + "; ".join(
                  f"{v} {host[v][0]:.0f} / {host[v][1]:.0f}, {gpu[v]:.0f}" for v in todo))
        rows.append(dict(benchmark="sort", case=name, chunks=num_chunks, local_experts=num_local,
                         rows=num_rows, hidden=HIDDEN, same=same,
                         host_cold_us={v: host[v][0] for v in todo},
                         host_warm_us={v: host[v][1] for v in todo}, gpu_us=gpu,
                         cpp_index=dispatcher._sort_index_cpp is not None,
                         rounds=args.rounds, thrash_mib=args.thrash_mib, seed=args.seed,
                         gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         git_sha=git_sha(), timestamp=stamp))
    if args.out:
        from megatron_overlap.bench.measure import append_rows

        try:
            append_rows(args.out, rows)
        except OSError as err:
            print(f"bench_sort: cannot write the rows to {args.out}: {err}", file=sys.stderr)
            return 2
    return 0 if all(row["same"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
