"""Host cost of the flag-on path's CPU-side steps, warm and cold, on any machine (no GPU
needed; `--gpu`: a whole combine call's on a CUDA device).

    python3 launch/bench_host.py --model qwen3-30b-a3b --tokens 4096 --ep 2

A MoE layer forward runs each of these steps once, after the rest of the forward has
evicted their code and data from the CPU's caches. On the GPU machines a step's span in the
forward (`bench_layer.py --host-breakdown`) is 3-8x its warm time: `mo.plan` 83-116 us
against ~11 us back to back (docs/perf_notes.md v5.3). There, the host speed of a process
moves such spans by up to 1.7x. This script measures the same steps on the machine at
hand: per round, each step once right after a thrash of the caches ("cold": a pass over
--thrash-mib MiB of memory and a walk over 20000 of 200000 small Python objects), then once
more at once ("warm"); it prints the median of --rounds rounds, in microseconds. The steps
take turns within each round, in the order of a row of a Williams design
(`bench.measure.round_order`, as the layer benchmark's variants): run one after another,
the fourth `--gpu` step came out fastest in both Qwen3-30B-A3B runs, whichever it was (by
up to 170 us; docs/perf_notes.md v5.5). Steps, for rank 0 of an EP group with uniform
routing (`bench.workloads`):

  triton_metadata      the dispatcher's metadata from the exchanged counts
  plan (direct)        `plan_gemm2_gatherrs`, the C++ solver where it is built
  plan (auto)          the same, with the combine-mode choice (the dispatcher's default)
  direct_layout        the segments, arrivals and finalize bases (C++ where built)
  host tile list       `expand_tiles` + `wave_order` (MEGATRON_OVERLAP_TILE_LIST=host)
  tables (steps)       a direct call's host tables as `_Call` builds them with
                       MEGATRON_OVERLAP_HOST_TABLES=steps: `direct_layout`, the running
                       totals, the copies into the staging buffer, the call's sizes
  tables (fused)       the same with the default "fused": one `_layout.direct_tables`
                       call writes them into the staging buffer (C++ extension only)
  env (os.environ)     the ten reads of the fused path's variables that a flag-on forward
                       does (`FORWARD_ENV_READS`), with `os.environ.get`
  env (getenv)         the same with `megatron_overlap._host.getenv` (the path's reader)

With `--gpu` (CUDA only) it times instead the whole host side of one world-1 combine call
as the dispatcher runs it (plan, `prepare_gemm2_gatherrs`, `send`, `finish`: tables,
upload and the three kernel launches; the GPU work itself is queued, not waited for),
under several settings of the fused path's per-call variables, one after another in this
process (`GPU_VARIANTS`):

  combine (default)             as configured
  combine (HOST_CACHE=0)        MEGATRON_OVERLAP_HOST_CACHE=0: `os.environ` reads, a new
                                stream object per `torch.cuda.current_stream` and a new
                                Triton scratch per GEMM2 launch (`megatron_overlap._host`)
  combine (FAST_LAUNCH=0)       every launch through Triton's JIT entry point
  combine (FAST_LAUNCH=direct)  cached kernels through their C launchers
  finalize launch               `_Call.finalize` of one call again (it sums again)

Use it to compare a change of these steps before and after it on one machine (the numbers
are this CPU's, not the GPU host's). `--out` appends one JSON row per step. Without the C++
layout extension there is no "tables (fused)" step (the call would run "steps").
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

if os.path.dirname(os.path.dirname(os.path.abspath(__file__))) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_overlap.bench.cli import (  # noqa: E402
    THRASH_MIB_HELP,
    THRASH_MIB_MAX,
    int_in,
    positive_int,
)


class _Thrash:
    """Evicts the CPU's caches: a strided write over a buffer and a walk over many small
    objects (what the rest of a forward does to them)."""

    def __init__(self, mib: int, seed: int) -> None:
        import numpy as np

        self.buf = np.zeros(mib << 20, dtype=np.uint8)
        self.objs = [{"k": [i] * 8} for i in range(200_000)]
        self.rng = random.Random(seed)

    def __call__(self) -> int:
        self.buf[::64] += 1
        total = 0
        for d in self.rng.sample(self.objs, 20_000):
            total += d["k"][0]
        return total


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def time_steps(todo: dict, thrash, rounds: int, sync=None) -> dict:
    """{name: (cold, warm) median microseconds of todo[name]() over `rounds` rounds}: in
    each round every step once cold (right after `thrash()`) and once warm (at once after),
    the steps in the round's order of a Williams design (`measure.round_order`). `sync`
    (e.g. `torch.cuda.synchronize`) runs before each thrash, so that no queued GPU work
    makes a timed launch wait for room in the queue."""
    from megatron_overlap.bench.measure import round_order

    times = {name: ([], []) for name in todo}
    for fn in todo.values():
        fn()  # imports, caches and first-call costs out of the way
    for r in range(rounds):
        for name in round_order(list(todo), r):
            fn, (cold, warm) = todo[name], times[name]
            if sync is not None:
                sync()
            thrash()
            t0 = time.perf_counter()
            fn()
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t0)
    return {name: (statistics.median(c) * 1e6, statistics.median(w) * 1e6)
            for name, (c, w) in times.items()}


FORWARD_ENV_READS = ("MEGATRON_OVERLAP_TMA_STORE", "MEGATRON_OVERLAP_SOLVER",
                     "MEGATRON_OVERLAP_HW_PROFILE", "MEGATRON_OVERLAP_TMA_STORE",
                     "MEGATRON_OVERLAP_TILE_LIST", "MEGATRON_OVERLAP_HOST_TABLES",
                     "MEGATRON_OVERLAP_FAST_LAUNCH", "MEGATRON_OVERLAP_FAST_LAUNCH",
                     "MEGATRON_OVERLAP_FAST_LAUNCH", "MEGATRON_OVERLAP_FC1_CHUNK_MB")
"""The variables one flag-on direct-mode forward reads, in order (the default tile twice,
the plan's solver and profile, the call's tile list and tables, three launches, the FC1's
chunk)."""


def steps(model: str, tokens: int, ep: int, seed: int) -> dict:
    """{name: zero-argument callable} of the measured steps."""
    import numpy as np

    from megatron_overlap.bench.workloads import routing_maps
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.metadata import triton_metadata
    from megatron_overlap.models import load_model_shape
    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        DEFAULT_TILE,
        direct_layout,
        expand_tiles,
        wave_order,
    )
    from megatron_overlap.resource import KernelResources, plan_gemm2_gatherrs

    shape = load_model_shape(model)
    num_experts, topk = shape.num_moe_experts, shape.moe_router_topk
    if num_experts % ep:
        raise ValueError(f"--ep {ep}: {shape.name}'s {num_experts} experts do not split "
                         f"over {ep} ranks")
    maps = routing_maps([tokens] * ep, num_experts, topk, "uniform", seed=seed)
    counts = np.stack([m.sum(dim=0).numpy() for m in maps]).astype(np.int64)  # [R, E]
    routing_map = maps[0]

    def meta():
        return triton_metadata(counts, tp_size=1, tp_rank=0, ep_size=ep, ep_rank=0,
                               topk=topk, routing_map=routing_map)

    m = meta()
    # the compiled kernel's resources as the GPU reports them for the default tile (v5.2)
    kernel = KernelResources(registers_per_thread=255, shared_bytes=147480,
                             threads_per_cta=256)
    hidden, ffn = shape.hidden_size, shape.moe_ffn_hidden_size
    recv_rows = int(counts[0].sum())

    def plan(prereduce):
        options = GatherRSOptions(prereduce=prereduce)
        return lambda: plan_gemm2_gatherrs(m, options, num_sms=132, hidden=hidden, ffn=ffn,
                                           elem_bytes=2, recv_rows=recv_rows, kernel=kernel)

    bm, bn = DEFAULT_TILE.bm, DEFAULT_TILE.bn
    layout = direct_layout(m, hidden, bm, bn)
    grid = plan(False)().num_ctas

    def tile_list():
        table = expand_tiles(layout)
        if layout.num_remote and layout.num_local:
            table = table[wave_order(layout.num_remote, layout.num_local, grid, 16)]
        return table

    def tables(fused):
        """`_Call`'s table step on a bare call object (its `_init_common` fields) and a
        workspace with room, one staging slot reused (as on the GPU)."""
        import torch

        from megatron_overlap.ops import triton_gemm2_gatherrs as op
        from megatron_overlap.resource import Plan
        from megatron_overlap.symm import GatherRSWorkspace

        ws = GatherRSWorkspace(None, hidden=1, dtype=torch.bfloat16, device="cpu")
        ws.ensure_capacity(int(layout.recv_rows.max(initial=0)))  # no growth while timed
        ws.expected_arrivals = np.zeros(ep, dtype=np.int64)
        ws.num_ranks = ep
        call = object.__new__(op._Call)
        call._init_common(m, ws, Plan(num_comm_ctas=16, num_ctas=grid, source="model"),
                          hidden, torch.bfloat16, "cpu", 30.0, DEFAULT_TILE)
        slot = op._StagingSlot()

        def take(ws, device, tables, scratch, stream=None):
            slot.fit(device, tables, scratch)
            return slot, False

        def run():
            real, op._StagingSlot.take = op._StagingSlot.take, take
            try:
                if fused:
                    call._fused_tables(m, ws, None, 0)
                else:
                    call._step_tables(m, ws, None, "device", 0)
            finally:
                op._StagingSlot.take = real
        return run

    todo = {
        "triton_metadata": meta,
        "plan (direct)": plan(False),
        "plan (auto)": plan("auto"),
        "direct_layout": lambda: direct_layout(m, hidden, bm, bn),
        "host tile list": tile_list,
        "tables (steps)": tables(False),
    }
    from megatron_overlap.ops.triton_gemm2_gatherrs import _layout_cpp

    if _layout_cpp is not None:
        todo["tables (fused)"] = tables(True)
    from megatron_overlap._host import getenv

    def env(read):
        def run():
            for name in FORWARD_ENV_READS:
                read(name, "")
        return run

    todo["env (os.environ)"] = env(os.environ.get)
    todo["env (getenv)"] = env(getenv)
    return todo


GPU_VARIANTS = (("combine (default)", None),
                ("combine (HOST_CACHE=0)", ("MEGATRON_OVERLAP_HOST_CACHE", "0")),
                ("combine (FAST_LAUNCH=0)", ("MEGATRON_OVERLAP_FAST_LAUNCH", "0")),
                ("combine (FAST_LAUNCH=direct)", ("MEGATRON_OVERLAP_FAST_LAUNCH", "direct")))
"""`--gpu`'s combine steps: (name, the (variable, value) set while it runs, or None)."""


def gpu_steps(model: str, tokens: int, seed: int) -> dict:
    """{name: zero-argument callable}: a world-1 combine call's host side on the current
    CUDA device (`--gpu`, see the module docstring). Each callable runs one whole call."""
    import torch

    from megatron_overlap.bench.cli import alt_environment
    from megatron_overlap.bench.workloads import routing_maps
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.metadata import triton_metadata
    from megatron_overlap.models import load_model_shape
    from megatron_overlap.ops import prepare_gemm2_gatherrs
    from megatron_overlap.ops.triton_gemm2_gatherrs import call_resources, plan_call

    shape = load_model_shape(model)
    num_experts, topk = shape.num_moe_experts, shape.moe_router_topk
    hidden, ffn = shape.hidden_size, shape.moe_ffn_hidden_size
    device = torch.device("cuda", torch.cuda.current_device())
    rmap = routing_maps([tokens], num_experts, topk, "uniform", seed=seed)[0]
    counts = rmap.sum(dim=0).numpy()[None].astype("int64")
    meta = triton_metadata(counts, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=topk,
                           routing_map=rmap.to(device))
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = int(counts.sum())
    h = torch.randn(rows, ffn, device=device, dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(num_experts, hidden, ffn, device=device, dtype=torch.bfloat16,
                     generator=gen) * ffn ** -0.5
    options = GatherRSOptions(backend="triton", prereduce=False)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    calls = []

    def combine():
        # world 1; the tile and plan as the dispatcher makes them (`plan_call`)
        choice = plan_call(meta, options, device=device, num_sms=sms, hidden=hidden, ffn=ffn,
                           elem_bytes=2, recv_rows=rows,
                           resources=lambda t: call_resources(h.dtype, ffn, hidden, 1, topk,
                                                              num_experts, t))
        call = prepare_gemm2_gatherrs(h, w2, meta, group=None, options=options,
                                      plan=choice.plan, tile=choice.tile)
        call.send(h, w2, keep_operands=False)
        calls[:] = [call]  # the last call, for the finalize step; the one before is freed
        return call.finish()

    def under(setting):
        def run():
            with alt_environment(setting):
                return combine()
        return run

    todo = {name: under(setting) for name, setting in GPU_VARIANTS}
    with torch.no_grad():
        for run in todo.values():
            run()  # compiles every variant's kernels
        torch.cuda.synchronize()

    def finalize():
        calls[0].finalize()
    todo["finalize launch"] = finalize
    return todo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help="model shape (configs/models/*.yaml or a YAML path)")
    parser.add_argument("--tokens", type=positive_int, default=4096, help="tokens per rank")
    parser.add_argument("--ep", type=positive_int, default=None,
                        help="EP size (rank 0 timed; default 2; not with --gpu, which times a "
                             "world-1 call)")
    parser.add_argument("--rounds", type=positive_int, default=60,
                        help="cold + warm measurements per step (medians)")
    parser.add_argument("--thrash-mib", type=int_in(1, THRASH_MIB_MAX), default=64,
                        help="MiB written between rounds to evict the caches "
                             + THRASH_MIB_HELP)
    parser.add_argument("--seed", type=int, default=0, help="routing seed")
    parser.add_argument("--out", default="",
                        help="JSONL file to append one row per step to (a regular file, a FIFO "
                             "or a character device such as /dev/null; checked, and a "
                             "missing folder made, before any timing)")
    parser.add_argument("--profile-step", default="", metavar="STEP",
                        help="after the timing, run STEP (a step's name, as printed) 200 "
                             "times warm under cProfile and print its 30 costliest "
                             "functions by own time")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch's intra-op threads while timing (torch.set_num_threads, "
                             "1 to the machine's cores; default 1: on a shared 2-core "
                             "machine torch's default made these timings vary 40-70x between "
                             "runs; 0: leave the process's count as it is)")
    parser.add_argument("--gpu", action="store_true",
                        help="time a world-1 combine call's host side on the GPU instead, "
                             "under each launch setting (CUDA only; the module docstring "
                             "lists the steps)")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    if not 0 <= args.threads <= cores:
        parser.error(f"--threads: {args.threads}: expected 0 (the process's count as it is) "
                     f"to {cores} (this machine's cores)")
    from megatron_overlap.bench.cli import check_launch_inputs, check_thrash_memory, make_folder

    try:
        # an unwritable --out fails now, not after the timing; its folder is made only once
        # the run proceeds (below), so that a refused run leaves none behind
        check_launch_inputs(args.out, create=False)
        check_thrash_memory(args.thrash_mib)
        from megatron_overlap.config import check_environment

        check_environment()  # the fused path's variables, which the steps read
        if args.gpu:
            import torch

            if args.ep is not None:
                raise ValueError("--ep does not apply to --gpu (it times a world-1 call)")
            if not torch.cuda.is_available():
                raise ValueError("--gpu needs CUDA")
            todo = gpu_steps(args.model, args.tokens, args.seed)
        else:
            todo = steps(args.model, args.tokens, args.ep or 2, args.seed)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    if args.profile_step and args.profile_step not in todo:
        parser.error(f"--profile-step {args.profile_step!r}: expected one of "
                     f"{', '.join(repr(n) for n in todo)}")
    try:
        make_folder(args.out)  # the run proceeds
    except ValueError as err:
        parser.error(str(err))
    import datetime

    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    import torch

    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _measure(args, todo, torch.get_num_threads(), stamp)
    finally:
        torch.set_num_threads(before)  # (main may run inside another program: pytest)


def _measure(args, todo: dict, threads: int, stamp: str) -> int:
    """The timing, the rows and the profile of `main` (its arguments parsed and checked)."""
    from megatron_overlap.bench.measure import git_sha
    from megatron_overlap.config import fused_path_settings
    from megatron_overlap.resource.solver import implementation_name

    thrash = _Thrash(args.thrash_mib, args.seed)
    rows = []
    ep = 1 if args.gpu else (args.ep or 2)
    print(f"{args.model}, {args.tokens} tokens per rank, EP {ep}, rank 0: host us "
          f"(median of {args.rounds})")
    width = max(18, *(len(name) for name in todo))
    print(f"  {'step':{width}s} {'cold':>9s} {'warm':>9s} {'cold/warm':>9s}")
    sync = None
    if args.gpu:
        import torch

        sync = torch.cuda.synchronize
    for name, (cold, warm) in time_steps(todo, thrash, args.rounds, sync).items():
        print(f"  {name:{width}s} {cold:9.1f} {warm:9.1f} {cold / warm:9.1f}")
        rows.append(dict(benchmark="host", model=args.model, tokens_per_rank=args.tokens,
                         ep=ep, step=name, cold_us=cold, warm_us=warm,
                         rounds=args.rounds, thrash_mib=args.thrash_mib,
                         gpu=_gpu_name() if args.gpu else "cpu", timing_order="williams",
                         git_sha=git_sha(), resource_solver=implementation_name(),
                         seed=args.seed, intra_op_threads=threads, timestamp=stamp,
                         **fused_path_settings(ep, bool(args.gpu))))
    if args.out:
        from megatron_overlap.bench.measure import append_rows

        try:
            append_rows(args.out, rows)
        except OSError as err:
            print(f"bench_host: cannot write the rows to {args.out}: {err}", file=sys.stderr)
            return 2
    if args.profile_step:
        import cProfile
        import pstats

        fn, prof = todo[args.profile_step], cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        if sync is not None:
            sync()
        stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        print(f"cProfile of {args.profile_step!r}, 200 warm runs: us per run, own and "
              "cumulative, calls per run")
        top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:30]
        for (file, line, name), (_, calls, own, cum, _) in top:
            where = f"{'/'.join(file.split('/')[-2:])}:{line}({name})"
            print(f"  {own / 200 * 1e6:8.1f} {cum / 200 * 1e6:8.1f} {calls / 200:6.1f}  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
