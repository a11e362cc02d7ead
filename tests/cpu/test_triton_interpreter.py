"""The Triton kernels' logic on the CPU, in Triton's interpreter (TRITON_INTERPRET=1).

One process plays every rank of a TP x EP layout: each rank's "peer" buffers are the other
ranks' workspaces (`symm.local_workspaces`). All ranks send (the GEMM2 + scatter kernel;
one program, or several with the static wave-ordered list or dynamic claims), then all
finalize; outputs are checked against the dense formula, over several calls on the same
workspaces with new routing, sizes and data each call (one receive buffer reused, growing
epochs, every rank's finalize count checked on every other rank, every arrival counter
checked exactly); then the same cases in the pre-reduced mode on the same workspaces, and
the timeouts of a finalize, a producer and a pre-reduced send. Concurrency and memory
ordering are not exercised here (the interpreter runs one program at a time): the GPU
tests cover them.

Runs in a subprocess because the interpreter must be chosen before the kernels are defined.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

SCRIPT_TIMEOUT_S = 600


def _cases():
    import torch

    from tests.support.op_problem import OpCase

    layouts = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)]
    cases = []
    for tp, ep in layouts:
        r = tp * ep
        for call, (routing, experts, topk) in enumerate(
            [("uniform", 4 * ep, 2), ("skewed", 2 * ep, 2), ("sparse", 4 * ep, 1)]
        ):
            tokens = [3 + 7 * ((g + call) % 3) for g in range(r)]
            if call == 2:
                tokens[0] = 0
            cases.append(OpCase(tp, ep, num_experts=experts, topk=topk, tokens_per_rank=tokens,
                                routing=routing, hidden=40, ffn=24, seed=call,
                                dtype=torch.float32))
    return cases


def _index_mismatch():
    """The finalize index of a prepared call (`_block_count_block` + `_index_block`, 16
    tokens a block: 75 blocks, so the cross-block prefix takes three CB = 32 loads) against
    its torch twin `contribution_rows`, compacted per token, built alone (`_index_kernel`)
    and by the GEMM2 kernel; None when they agree."""
    import torch

    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        INTERPRETER_TILE, _Call)
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.op_problem import OpCase, rank_operands

    case = OpCase(2, 1, num_experts=24, topk=3, tokens_per_rank=[1200, 1100],
                  routing="skewed", hidden=16, ffn=16, seed=5, dtype=torch.float32)
    ws = local_workspaces(2, hidden=16, dtype=case.dtype, device="cpu", capacity_rows=8192)
    h, w2, meta = rank_operands(case, 1)
    call = _Call(meta, ws[1], Plan(num_comm_ctas=1, num_ctas=1, source="test"), hidden=16,
                 dtype=h.dtype, device=h.device, timeout_s=1.0, tile=INTERPRETER_TILE)
    call.launch_index()  # alone (`_index_kernel`): this call's GEMM2 never runs
    problem = _compare_index(call, meta)
    if problem is not None:
        return f"_index_kernel: {problem}"
    # The same index built by the GEMM2 kernel's CTAs (`send`; one rank, so the call runs
    # alone; three programs, so each builds several token blocks).
    case = OpCase(1, 1, num_experts=24, topk=3, tokens_per_rank=[1200], routing="skewed",
                  hidden=16, ffn=16, seed=6, dtype=torch.float32)
    ws = local_workspaces(1, hidden=16, dtype=case.dtype, device="cpu", capacity_rows=8192)
    h, w2, meta = rank_operands(case, 0)
    call = _Call(meta, ws[0], Plan(num_comm_ctas=1, num_ctas=3, source="test"), hidden=16,
                 dtype=h.dtype, device=h.device, timeout_s=1.0, tile=INTERPRETER_TILE)
    call.index.fill_(-7)  # stale scratch: every entry must be written
    call.send(h, w2)
    problem = _compare_index(call, meta)
    call.finish()
    return None if problem is None else f"GEMM2's index: {problem}"


def _compare_index(call, meta):
    """None when call.index equals its torch twin (`contribution_rows`, compacted per
    token), else what differs."""
    import torch

    from megatron_overlap.ops.triton_gemm2_gatherrs import contribution_rows

    rows = contribution_rows(meta, call.layout)  # [T, E, TP], -1: not routed
    want = torch.full_like(call.index, -1)
    for t in range(rows.shape[0]):
        found = rows[t][(rows[t] >= 0).all(dim=1)].reshape(-1)
        want[t, : found.numel()] = found.to(want.dtype)
    if torch.equal(call.index, want):
        return None
    bad = (call.index != want).any(dim=1).nonzero().reshape(-1)
    return (f"{bad.numel()} tokens differ, first {int(bad[0])}: "
            f"{call.index[bad[0]].tolist()} vs {want[bad[0]].tolist()}")


def _tile_list_mismatch():
    """The device tile list (`_tile_list_block`) against the host twin (`expand_tiles` +
    `wave_order`) for several plans, layouts and routings (empty segments included); None
    when every one agrees."""
    import os

    import torch

    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        INTERPRETER_TILE, TILE_LIST_ENV, _Call)
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.op_problem import OpCase, rank_operands

    problems = []
    for tp, ep, routing in ((1, 2, "skewed"), (2, 2, "uniform"), (1, 4, "sparse")):
        case = OpCase(tp, ep, num_experts=4 * ep, topk=2,
                      tokens_per_rank=[40 + 17 * g for g in range(tp * ep)], routing=routing,
                      hidden=48, ffn=16, seed=3, dtype=torch.float32)
        for grid, comm, static in ((1, 1, True), (5, 2, True), (4, 3, True), (3, 9, True),
                                   (4, 2, False)):
            tile = dataclasses.replace(INTERPRETER_TILE, static=static)
            plan = Plan(num_comm_ctas=comm, num_ctas=grid, source="test")
            lists = {}
            for source in ("device", "host"):
                os.environ[TILE_LIST_ENV] = source
                ws = local_workspaces(tp * ep, hidden=48, dtype=case.dtype, device="cpu",
                                      capacity_rows=4096)
                h, w2, meta = rank_operands(case, tp * ep - 1)
                call = _Call(meta, ws[tp * ep - 1], plan, hidden=48, dtype=h.dtype,
                             device=h.device, timeout_s=1.0, tile=tile)
                lists[source] = call.tiles.clone()
            os.environ.pop(TILE_LIST_ENV)
            if not torch.equal(lists["device"], lists["host"]):
                problems.append(f"tp{tp} ep{ep} {routing} grid {grid} k {comm} static "
                                f"{static}: {lists['device'].shape} vs {lists['host'].shape}")
        # The pre-reduced call's list (every tile local, in h's row order) the same way.
        from megatron_overlap.ops.triton_prereduce import PreReducedCall

        maps = [rank_operands(case, g)[2].routing_map for g in range(tp * ep)]
        lists = {}
        for source in ("device", "host"):
            os.environ[TILE_LIST_ENV] = source
            ws = local_workspaces(tp * ep, hidden=48, dtype=case.dtype, device="cpu",
                                  capacity_rows=4096)
            h, w2, meta = rank_operands(case, 0)
            call = PreReducedCall(meta, ws[0], Plan(num_comm_ctas=1, num_ctas=3, source="t"),
                                  hidden=48, dtype=h.dtype, device=h.device, timeout_s=1.0,
                                  tile=INTERPRETER_TILE, routing_maps=maps)
            lists[source] = call.tiles[: call.num_local].clone()
        os.environ.pop(TILE_LIST_ENV)
        if not torch.equal(lists["device"], lists["host"]):
            problems.append(f"pre-reduced tp{tp} ep{ep} {routing}: tile lists differ")
    return "; ".join(problems) or None


def _host_tables_mismatch():
    """The fused host tables (`_layout.direct_tables` into the staging buffer) against the
    step-by-step ones (`direct_layout` + numpy copies), $MEGATRON_OVERLAP_HOST_TABLES:
    three calls in a row on a fresh workspace per mode, for several layouts and routings:
    the uploaded segments, targets and bases, the device tile list, the call's
    sizes and the workspace's running totals after each call. None when every one agrees
    (and the fused calls did take the fused path: no `DirectLayout` built)."""
    import os

    import torch

    from megatron_overlap.config import HOST_TABLES_ENV
    from megatron_overlap.ops.triton_gemm2_gatherrs import INTERPRETER_TILE, _Call
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.op_problem import OpCase, rank_operands

    problems = []
    for tp, ep, routing in ((1, 1, "uniform"), (1, 2, "skewed"), (2, 2, "uniform"),
                            (1, 4, "sparse"), (2, 1, "skewed")):
        r = tp * ep
        case = OpCase(tp, ep, num_experts=4 * ep, topk=2,
                      tokens_per_rank=[40 + 17 * g for g in range(r)], routing=routing,
                      hidden=48, ffn=16, seed=5, dtype=torch.float32)
        plan = Plan(num_comm_ctas=2, num_ctas=5, source="test")
        seen = {}
        for mode in ("fused", "steps"):
            os.environ[HOST_TABLES_ENV] = mode
            ws = local_workspaces(r, hidden=48, dtype=case.dtype, device="cpu",
                                  capacity_rows=4096)
            rows = []
            for n in range(3):
                g = (r - 1 + n) % r  # a different rank's tables each call
                h, w2, meta = rank_operands(case, g)
                call = _Call(meta, ws[0], plan, hidden=48, dtype=h.dtype, device=h.device,
                             timeout_s=1.0, tile=INTERPRETER_TILE)
                fused = call.__dict__["_layout"] is None
                if fused != (mode == "fused"):
                    problems.append(f"tp{tp} ep{ep}: {mode} call took the other path")
                rows.append((call._table.tolist(), call.targets.tolist(),
                             call.finalize_base.tolist(), call.tiles.tolist(),
                             (call.num_remote, call.num_local, call.num_rows, call.split,
                              call._local_rows, call._col_blocks, call._num_segments,
                              call.epoch, call.freed_target),
                             ws[0].expected_arrivals.tolist()))
                del call
            seen[mode] = rows
        os.environ.pop(HOST_TABLES_ENV)
        for n, (a, b) in enumerate(zip(seen["fused"], seen["steps"])):
            names = ("uploaded segments", "targets", "finalize bases", "tile list", "sizes",
                     "running totals")
            for name, x, y in zip(names, a, b):
                if x != y:
                    problems.append(f"tp{tp} ep{ep} {routing} call {n}: {name} differ")
    # A grid so large that the static schedule's int32 wave positions would overflow: the
    # fused path falls back to the host tile list before it takes anything of the
    # workspace, with the scratch of the index and block counts (here 1200 index entries,
    # more than a fresh slot's minimum scratch).
    case = OpCase(1, 2, num_experts=8, topk=2, tokens_per_rank=[600, 500], routing="uniform",
                  hidden=48, ffn=16, seed=6, dtype=torch.float32)
    plan = Plan(num_comm_ctas=2, num_ctas=2**27, source="test")
    got = {}
    for mode in ("fused", "steps"):
        os.environ[HOST_TABLES_ENV] = mode
        ws = local_workspaces(2, hidden=48, dtype=case.dtype, device="cpu", capacity_rows=4096)
        h, w2, meta = rank_operands(case, 0)
        call = _Call(meta, ws[0], plan, hidden=48, dtype=h.dtype, device=h.device,
                     timeout_s=1.0, tile=INTERPRETER_TILE)
        if call._tile_list != "host" or call.__dict__["_layout"] is None:
            problems.append(f"{mode}: no host tile list for a grid of 2**27 CTAs")
        got[mode] = (call.tiles.tolist(), call.targets.tolist(), call.finalize_base.tolist(),
                     call.epoch, ws[0].expected_arrivals.tolist())
    os.environ.pop(HOST_TABLES_ENV)
    if got["fused"] != got["steps"]:
        problems.append("the fused path's host-tile-list fallback differs from steps")
    return "; ".join(problems) or None


def _finish_error(call) -> str:
    """The RuntimeError message of `call.finish()`, or "no error raised"."""
    try:
        call.finish()
    except RuntimeError as err:
        return str(err)
    return "no error raised"


def _arrivals_mismatch(ws: list, r: int):
    """Every rank's arrival counters equal the running targets it expects (exact once all
    ranks finalized: the interpreter runs every send before any finalize, so a target that
    is too low, or a surplus signal, shows only here); None when they do."""
    for g in range(r):
        seen = [int(x) for x in ws[g].signals[:r]]
        want = [int(x) for x in ws[g].expected_arrivals]
        if seen != want:
            return f"rank {g} arrival counters {seen}, expected {want}"
    return None


def _dropped_tokens_mismatch():
    """Megatron with a capacity factor drops tokens: a routing-map row can be empty. Such a
    token's output row must be 0 in both modes, whatever the receive buffer held before
    (filled with 7.0 first), at TP = 2 and at EP = 2. None when it is."""
    import torch

    from megatron_overlap.ops.triton_gemm2_gatherrs import INTERPRETER_TILE, _Call
    from megatron_overlap.ops.triton_prereduce import PreReducedCall
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.asserts import describe_mismatch
    from tests.support.op_problem import OpCase, global_tensors, rank_operands

    plan = Plan(num_comm_ctas=1, num_ctas=2, source="test")
    problems = []
    for tp, ep in ((2, 1), (1, 2)):
        case = OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=[5, 6], hidden=40,
                      ffn=24, dtype=torch.float32, seed=11)
        maps, h_full, w2 = global_tensors(case)
        for g in range(2):  # token 1 of each rank, and rank 1's token 4, routed nowhere
            for t in ((1,) if g == 0 else (1, 4)):
                maps[g][t] = False
                h_full[g][:, t] = 0
        dense = [torch.einsum("etf,ehf->th", h_full[g], w2) for g in range(2)]
        operands = [rank_operands(case, g, (maps, h_full, w2)) for g in range(2)]
        for mode in ("direct", "prereduce"):
            ws = local_workspaces(2, hidden=40, dtype=torch.float32, device="cpu",
                                  capacity_rows=256)
            for w in ws:
                w.recv.fill_(7.0)
            calls = []
            for g, (h, w2_local, meta) in enumerate(operands):
                kwargs = dict(hidden=40, dtype=h.dtype, device=h.device, timeout_s=30.0,
                              tile=INTERPRETER_TILE)
                calls.append(_Call(meta, ws[g], plan, **kwargs) if mode == "direct" else
                             PreReducedCall(meta, ws[g], plan, routing_maps=maps, **kwargs))
            for call, (h, w2_local, _) in zip(calls, operands):
                call.send(h, w2_local)
            for g, call in enumerate(calls):
                bad = describe_mismatch(call.finish(), dense[g], rel_tol=1e-5)
                if bad:
                    problems.append(f"{mode} tp{tp} ep{ep} rank {g}: {bad}")
    return "; ".join(problems) or None


def _simulate() -> dict:
    """Run every layout's calls through the kernels; returns {case: mismatch or None}."""
    import torch

    from megatron_overlap.ops.triton_gemm2_gatherrs import INTERPRETER_TILE, _Call
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.asserts import describe_mismatch
    from tests.support.op_problem import dense_output, rank_operands

    plan = Plan(num_comm_ctas=1, num_ctas=1, source="test")
    # (plan, tile) variants, one per case in turn: one program; several programs with the
    # wave-ordered list (k remote-first CTAs); several programs claiming tiles dynamically;
    # several programs storing each tile through a TMA descriptor of its rows (`_tile`: the
    # rows past a short tile's end must be clipped, not stored into the next segment's);
    # the same with the static schedule's waves rotated over the programs (ROTATE: every
    # tile taken once, whichever program takes it).
    variants = [(plan, INTERPRETER_TILE),
                (Plan(num_comm_ctas=1, num_ctas=3, source="test"), INTERPRETER_TILE),
                (Plan(num_comm_ctas=2, num_ctas=3, source="test"),
                 dataclasses.replace(INTERPRETER_TILE, static=False)),
                (Plan(num_comm_ctas=1, num_ctas=2, source="test"),
                 dataclasses.replace(INTERPRETER_TILE, tma_store=True)),
                (Plan(num_comm_ctas=3, num_ctas=4, source="test"),
                 dataclasses.replace(INTERPRETER_TILE, tma_store=True, rotate=True))]
    # Every buffer a finalize may read starts as NaN (the receive buffers before each case,
    # each call's local buffer when it is allocated): a row read from the wrong buffer, or
    # never written, shows in the output.
    alloc_local = _Call._alloc_local

    def poisoned_local(call):
        alloc_local(call)
        call.local.fill_(float("nan"))

    _Call._alloc_local = poisoned_local
    report, spaces = {}, {}
    for n, case in enumerate(_cases()):
        call_plan, tile = variants[n % len(variants)]
        r = case.tp * case.ep
        if (case.tp, case.ep) not in spaces:
            spaces[(case.tp, case.ep)] = local_workspaces(
                r, hidden=case.hidden, dtype=case.dtype, device="cpu", capacity_rows=256)
        ws = spaces[(case.tp, case.ep)]
        for w in ws:
            w.recv.fill_(float("nan"))
        operands = [rank_operands(case, g) for g in range(r)]
        calls = [_Call(meta, ws[g], call_plan, hidden=w2.shape[1], dtype=h.dtype,
                       device=h.device, timeout_s=30.0, tile=tile)
                 for g, (h, w2, meta) in enumerate(operands)]
        keep = n % 2 == 0  # (the Megatron layer's calls let go of h and w2 once sent)
        for call, (h, w2, _) in zip(calls, operands):
            call.send(h, w2, keep_operands=keep)
        if any(call.out is not None for call in calls):
            report[f"{case} output"] = "output allocated before the finalize"
        outs = [call.finish() for call in calls]
        calls[0].finalize()  # a repeated finalize sums again but must not signal again
        if not keep:
            try:
                calls[0].gemm_only()
                report[f"{case} operands"] = "gemm_only ran without the operands"
            except RuntimeError:
                pass
        elif r == 1:  # the producer timing's launch: the call's rows again (NaN-poisoned
            # local buffer: every row compared was written), tables untouched
            call, tiles = calls[0], calls[0].tiles.clone()
            rows = call._local_rows
            for i in range(2):
                if i:
                    call._scratch.fill_(float("nan"))
                call.gemm_only()
                if rows and not torch.equal(call._scratch[:rows], call.local[:rows]):
                    report[f"{case} gemm_only {i}"] = "gemm_only's rows differ from the call's"
            if not torch.equal(call.tiles, tiles):
                report[f"{case} gemm_only tiles"] = "gemm_only changed the call's tile list"
        for g, out in enumerate(outs):
            key = f"{case} rank {g}"
            report[key] = describe_mismatch(out, dense_output(case, g), rel_tol=1e-5)
            # Rank g's finalize count on every other rank: one per call so far.
            counts = [int(ws[s].signals[r + g]) for s in range(r) if s != g]
            if report[key] is None and counts != [calls[g].epoch] * (r - 1):
                report[key] = f"finalize counts of rank {g}: {counts}, want {calls[g].epoch}"
            done = int(ws[g].finalize_done)
            if report[key] is None and done != ws[g].finalize_ctas:
                report[key] = f"finalize CTAs done {done}, launched {ws[g].finalize_ctas}"
            if report[key] is None:
                report[key] = _arrivals_mismatch(ws, r)
    # Pre-reduced calls (`triton_prereduce`) on the same workspaces: their counters
    # continue the direct calls' above, so mixing the two modes is checked too.
    from megatron_overlap.ops.triton_prereduce import PreReducedCall

    for n, case in enumerate(_cases()):
        r = case.tp * case.ep
        ws = spaces[(case.tp, case.ep)]
        operands = [rank_operands(case, g) for g in range(r)]
        maps = [meta.routing_map for _, _, meta in operands]
        # (every other case with the TMA-store epilogue: the GEMM2 into y)
        tile = dataclasses.replace(INTERPRETER_TILE, tma_store=n % 2 == 1)
        calls = [PreReducedCall(meta, ws[g], variants[n % 2][0], hidden=w2.shape[1],
                                dtype=h.dtype, device=h.device, timeout_s=30.0,
                                tile=tile, routing_maps=maps)
                 for g, (h, w2, meta) in enumerate(operands)]
        for call, (h, w2, _) in zip(calls, operands):
            call.send(h, w2)
        for g, call in enumerate(calls):
            key = f"prereduce {case} rank {g}"
            report[key] = describe_mismatch(call.finish(), dense_output(case, g), rel_tol=1e-5)
            counts = [int(ws[s].signals[r + g]) for s in range(r) if s != g]
            if report[key] is None and counts != [call.epoch] * (r - 1):
                report[key] = f"finalize counts of rank {g}: {counts}, want {call.epoch}"
        for g in range(r):
            key = f"prereduce {case} rank {g}"
            if report[key] is None:
                report[key] = _arrivals_mismatch(ws, r)
    report["dropped"] = _dropped_tokens_mismatch()
    report["index"] = _index_mismatch()
    report["tile_list"] = _tile_list_mismatch()
    report["host_tables"] = _host_tables_mismatch()
    # A missing sender: rank 1 never sends, so rank 0's finalize must time out and say so.
    case = _cases()[3]  # a 2-rank layout
    ws = local_workspaces(2, hidden=case.hidden, dtype=case.dtype, device="cpu",
                          capacity_rows=256)
    h, w2, meta = rank_operands(case, 0)
    call = _Call(meta, ws[0], plan, hidden=w2.shape[1], dtype=h.dtype, device=h.device,
                 timeout_s=0.02)
    call.send(h, w2)
    report["timeout"] = _finish_error(call)
    # Operands that do not match the prepared call (one row short; one local expert short):
    # `send` refuses them before any launch.
    messages = []
    for bad in ("rows", "experts"):
        ws = local_workspaces(2, hidden=case.hidden, dtype=case.dtype, device="cpu",
                              capacity_rows=256)
        call = _Call(meta, ws[0], plan, hidden=w2.shape[1], dtype=h.dtype, device=h.device,
                     timeout_s=0.02)
        try:
            call.send(h[:-1] if bad == "rows" else h, w2 if bad == "rows" else w2[:-1])
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    report["bad_operands"] = messages
    # A receive buffer still in use: rank 1 sends call 1 but never finalizes it, so rank 0's
    # producer must time out before storing call 2's rows into rank 1's buffer (with either
    # epilogue: stores from registers, or through a TMA descriptor).
    for name, tile in (("producer_timeout", INTERPRETER_TILE),
                       ("producer_timeout_tma",
                        dataclasses.replace(INTERPRETER_TILE, tma_store=True))):
        ws = local_workspaces(2, hidden=case.hidden, dtype=case.dtype, device="cpu",
                              capacity_rows=256)
        calls = [_Call(m, ws[g], plan, hidden=w.shape[1], dtype=x.dtype, device=x.device,
                       timeout_s=0.02, tile=tile)
                 for g, (x, w, m) in enumerate(rank_operands(case, g) for g in range(2))]
        for g, (x, w, _) in enumerate(rank_operands(case, g) for g in range(2)):
            calls[g].send(x, w)
        calls[0].finish()
        h, w2, meta = rank_operands(case, 0)
        call = _Call(meta, ws[0], plan, hidden=w2.shape[1], dtype=h.dtype, device=h.device,
                     timeout_s=0.02, tile=tile)
        ws[1].recv.fill_(-7.0)  # poison: a store into rank 1's buffer would show
        stored = ws[1].recv.clone()
        call.send(h, w2)
        report[name] = _finish_error(call)
        if not torch.equal(stored, ws[1].recv):
            report[name] += " (and rank 1's buffer was overwritten)"
    # The same for a pre-reduced send: rank 1 never finalizes call 1.
    ws = local_workspaces(2, hidden=case.hidden, dtype=case.dtype, device="cpu",
                          capacity_rows=256)
    operands = [rank_operands(case, g) for g in range(2)]
    maps = [m.routing_map for _, _, m in operands]
    for g, (x, w, m) in enumerate(operands):
        PreReducedCall(m, ws[g], plan, hidden=w.shape[1], dtype=x.dtype, device=x.device,
                       timeout_s=0.02, routing_maps=maps).send(x, w)
    h, w2, meta = operands[0]
    call = PreReducedCall(meta, ws[0], plan, hidden=w2.shape[1], dtype=h.dtype,
                          device=h.device, timeout_s=0.02, routing_maps=maps)
    ws[1].recv.fill_(-7.0)
    stored = ws[1].recv.clone()
    call.send(h, w2)
    report["send_timeout"] = _finish_error(call)
    if not torch.equal(stored, ws[1].recv):
        report["send_timeout"] += " (and rank 1's buffer was overwritten)"
    return report


def test_kernels_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.cpu.test_triton_interpreter"],
        env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    timeout_msg = report.pop("timeout")
    assert report.pop("dropped") is None
    assert report.pop("index") is None
    assert report.pop("tile_list") is None
    assert report.pop("host_tables") is None
    assert "finalize timed out waiting for sender rank 1" in timeout_msg, timeout_msg
    assert "tp_ep rank 0" in timeout_msg, timeout_msg
    for name in ("producer_timeout", "producer_timeout_tma"):
        producer_msg = report.pop(name)
        assert producer_msg.startswith(
            "gemm2_gatherrs (Triton) on tp_ep rank 0: the GEMM2 producer timed out waiting for "
            "rank 1 to free its receive buffer: its finalize count 0, expected >= 1"
        ), (name, producer_msg)
        assert "overwritten" not in producer_msg, (name, producer_msg)
    send_msg = report.pop("send_timeout")
    assert send_msg.startswith(
        "gemm2_gatherrs (Triton) on tp_ep rank 0: the pre-reduced send timed out waiting for "
        "rank 1 to free its receive buffer: its finalize count 0, expected >= 1"), send_msg
    assert "overwritten" not in send_msg, send_msg
    for message in report.pop("bad_operands"):
        assert message is not None and message.startswith("call prepared for h ["), message
    bad = {k: v for k, v in report.items() if v is not None}
    assert not bad, bad
    assert len(report) == 2 * sum(c.tp * c.ep for c in _cases())  # direct + pre-reduced


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.exit("run with TRITON_INTERPRET=1")
    print(json.dumps(_simulate()))


def test_staging_slot_reuse_rules(monkeypatch):
    """`_StagingSlot.acquire` (GPU-only in use; here with stand-in streams and events on
    CPU tensors): a slot is reused only when its call is gone, its upload is done, every
    fence on another stream is passed and the current stream is the workspace's; the ring
    stays bounded; an allocation failure leaves no slot busy; reused buffers are normal
    tensors even when first made under inference mode."""
    import types

    import torch

    from megatron_overlap.ops import triton_gemm2_gatherrs as tg

    class Event:
        def __init__(self):
            self.done = False

        def record(self, stream=None):
            self.done = False

        def query(self):
            return self.done

    streams = {"current": "main"}
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams["current"])
    ws = types.SimpleNamespace(staging_slots=[], stream=None, device=torch.device("cpu"))
    tables = (4, 6, 12)
    assert tg._StagingSlot.acquire(ws, tables, 100) is None  # first call: no stream yet
    ws.stream = "main"
    with torch.inference_mode():
        a = tg._StagingSlot.acquire(ws, tables, 100)
    assert a is not None and a.busy and not a.host.is_inference()
    a.host_np[:] = 7
    a.copy_in("cuda")  # the CUDA branch (stand-in stream and event; CPU tensors)
    assert torch.equal(a.dev_view, torch.full((22,), 7, dtype=torch.int32))
    assert [v.shape for v in a.views] == [(2,), (6,), (2, 6)]
    b = tg._StagingSlot.acquire(ws, tables, 100)
    assert b is not None and b is not a  # a is busy (its call is alive)
    a.busy = False  # a's call was collected ...
    c = tg._StagingSlot.acquire(ws, tables, 100)
    assert c not in (a, b)  # ... but its upload is not done
    a.event.done = True
    assert tg._StagingSlot.acquire(ws, tables, 100) is a  # now it is free
    a.busy = False
    a.fence("side")  # a finalize read a's buffers on another stream
    d = tg._StagingSlot.acquire(ws, tables, 100)
    assert d not in (a, b, c) and len(ws.staging_slots) == 4
    assert tg._StagingSlot.acquire(ws, tables, 100) is None  # ring full, none free
    a.fences[0].done = True
    assert tg._StagingSlot.acquire(ws, (4, 6, 42), 5000) is a  # bigger tables: refitted
    assert a.host.numel() >= 52 and a.scratch.numel() >= 5000 and not a.fences
    streams["current"] = "other"
    for slot in ws.staging_slots:
        slot.busy = False
    assert tg._StagingSlot.acquire(ws, tables, 100) is None  # not the workspace's stream
    streams["current"] = "main"
    ws.staging_slots[:] = []

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torch, "empty", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        tg._StagingSlot.acquire(ws, tables, 100)
    assert [s.busy for s in ws.staging_slots] == [False]


def test_staging_slot_scratch_parts():
    """`_StagingSlot.scratch_parts`: the index, block counts and tile list at 16-byte-aligned
    offsets of the scratch, remembered while the sizes stay, made anew for other sizes and
    after the scratch is reallocated (a view of the old scratch would be read by the
    kernels otherwise)."""

    from megatron_overlap.ops import triton_gemm2_gatherrs as tg

    slot = tg._StagingSlot()
    slot.fit("cpu", (2, 4, 6), 100)
    index, counts, tiles = slot.scratch_parts(8, 5, (2, 3))  # index 6 used, 8 reserved
    base, size = slot.scratch.data_ptr(), slot.scratch.element_size()
    assert index.shape == (2, 3) and index.data_ptr() == base
    assert counts.numel() == 5 and counts.data_ptr() == base + 8 * size
    assert tiles.data_ptr() == base + 16 * size  # 8 + _align4(5)
    again = slot.scratch_parts(8, 5, (2, 3))
    assert all(a is b for a, b in zip(again, (index, counts, tiles)))  # remembered
    other = slot.scratch_parts(8, 9, (2, 3))
    assert other[1].numel() == 9 and other[2].data_ptr() == base + 20 * size
    slot.fit("cpu", (2, 4, 6), 10_000)  # a bigger scratch: a new tensor
    assert slot.scratch.data_ptr() != base or slot.scratch.numel() >= 10_000
    fresh = slot.scratch_parts(8, 9, (2, 3))
    assert fresh[0].data_ptr() == slot.scratch.data_ptr()
    assert fresh[0].untyped_storage().data_ptr() == slot.scratch.untyped_storage().data_ptr()
    assert not any(a is b for a, b in zip(fresh, other))

