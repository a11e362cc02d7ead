"""World 2 and 4 of the Triton kernels on one GPU: one process plays every rank.

`test_triton_gpu.py` runs each rank in a process of its own on a GPU of its own, so its
world-2 and world-4 cases need 2 and 4 GPUs. Here `symm.local_workspaces` gives each
emulated rank a workspace whose peer tables point at the other ranks' receive buffers and
signal counters on the same GPU, and each rank's calls run on a CUDA stream of its own:
the ranks' kernels run at the same time, store tiles into each other's buffers, signal
arrivals and freed buffers, and wait for each other, with the kernels, tables, epochs and
protocol of a multi-GPU run. The checks of `test_triton_matches_reference`
(`test_triton_gpu._op_checks`: every case and layout, the pre-reduced mode, tile variants,
the TMA-store epilogue bit for bit, the communication-CTA counts bit for bit, 200 calls in
a row), against the dense formula only (no reference backend runs without a process
group), with the k values up to a rank's share of the SMs (on an H200: up to 32 at world 2,
16 at world 4), and another random 200-call sequence (it draws k from that shorter list);
back-to-back calls with a late finalize; finalizes waiting for a late sender; the timeouts'
diagnoses (at world 2, EP2).

What this cannot cover: NVLink (stores and TMA stores into another GPU's memory, the
system-scope ordering between two GPUs), symmetric-memory allocation and its rendezvous,
the process-group collectives around the op. Nor the op's entry points
(`gemm2_gatherrs`, `prepare_gemm2_gatherrs`): the calls are made with `_Call` and
`PreReducedCall` directly, so the plan with the compiled kernel's resources, the routing
maps' gather, the receive buffer's growth (the emulated capacity is fixed) and the compile
line-up across ranks are not exercised here. The 2-GPU tests cover them.

One GPU cannot hold every wait that two GPUs can (a rank's spinning CTAs may take the SMs
that the kernel it waits for needs), so the schedule keeps every wait satisfiable:

* each rank's GEMM2 is planned for S // (R + 1) of the S SMs (the resource manager's own
  plan for that many), so all R producers together leave SMs free;
* a rank's finalize (not persistent: its CTAs would fill the GPU) is queued after every
  rank's send of the same call (stream events), so it never spins on arrivals;
* a pre-reduced send (one CTA per token block, not persistent either) is queued after
  every rank's finalize of the previous call, unless every rank's send CTAs together fit
  in half the SMs.

The producers' (and small pre-reduced sends') wait for a destination's finalize of the
previous call is left to the kernels: the late-finalize test makes them wait for real. So is the finalize's wait for
its arrivals in the late-sender test, whose finalizes are small enough to run beside every
producer.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.test_triton_gpu import (BF16_TOL, _assert_clean, _op_checks,
                                       check_timeout_messages)
from tests.support.asserts import describe_mismatch
from tests.support.dist import run_distributed
from tests.support.op_problem import OpCase, dense_output, global_tensors, rank_operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

def _needs_hardware_queues(num_ranks: int) -> None:
    """Skip where `CUDA_DEVICE_MAX_CONNECTIONS` leaves fewer hardware queues than the rank
    streams plus the main one: the queued work of several streams then waits behind one
    stream's sleep or wait, and a late rank would hold the others back before their kernels
    start, so that no kernel waits and these tests would pass without checking the waits
    (Megatron setups often export 1)."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    if value.strip().isdigit() and int(value) < num_ranks + 1:
        pytest.skip(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: the late-rank tests need "
                    f">= {num_ranks + 1} hardware queues (one per rank stream and the main "
                    "stream's)")


TIMEOUT_S = 20.0
"""Every kernel wait's bound in these calls (`GatherRSOptions.timeout_s`)."""
LATE_CYCLES = 20_000_000
"""GPU clock cycles a late rank's finalize or send waits first (`torch.cuda._sleep`; ~10 ms
on an H200): longer than the host takes to queue the other ranks' next kernels, so that
they run while it waits (one host thread queues every rank's work here)."""


class _EmulatedRanks:
    """Every rank of a layout in this process, on one GPU, one CUDA stream per rank
    (`_op_checks`' `ranks`: see the module docstring for the schedule)."""

    def __init__(self, world: int) -> None:
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        # (tp, ep, hidden, dtype) -> [workspaces, streams, events of the last finalizes]
        self._groups: dict = {}
        self._latest = None  # (repr(case), global_tensors(case), {what: derived from them})
        # the largest k a rank's plan can take at this world size (`_op_checks`)
        self.max_comm_ctas = self.share(world)

    def share(self, num_ranks: int) -> int:
        """SMs each rank's GEMM2 is planned for."""
        return self.num_sms // (num_ranks + 1)

    def _group(self, case: OpCase) -> list:
        """The workspaces, streams and last finalize events of `case`'s layout and row
        shape, (re)built with room for its rows (all earlier calls are done then)."""
        from megatron_overlap.symm import local_workspaces

        r = case.tp * case.ep
        key = (case.tp, case.ep, case.hidden, case.dtype)
        # rows a destination can receive: direct, every (token, expert, TP rank) row of its
        # tokens; pre-reduced, one slot per source rank for each of its tokens
        need = max(1, max(case.tokens_per_rank) * max(case.topk * case.tp, r))
        group = self._groups.get(key)
        if group is None or group[0][0].capacity_rows < need:
            torch.cuda.synchronize()
            rows = need if group is None else max(need, 2 * group[0][0].capacity_rows)
            spaces = local_workspaces(r, hidden=case.hidden, dtype=case.dtype, device="cuda",
                                      capacity_rows=rows)
            torch.cuda.synchronize()  # (zeroed on this stream: before any rank stream runs)
            group = self._groups[key] = [spaces, [torch.cuda.Stream() for _ in range(r)], []]
        return group

    def _tensors(self, case: OpCase):
        """`op_problem.global_tensors(case)`, kept for the latest case (its checks run the
        same case several times in a row)."""
        if self._latest is None or self._latest[0] != repr(case):
            self._latest = (repr(case), global_tensors(case), {})
        return self._latest[1], self._latest[2]

    def _operands(self, case: OpCase) -> list:
        """Every rank's (h, w2, meta) on the GPU (read only by the calls)."""
        tensors, kept = self._tensors(case)
        if "operands" not in kept:
            kept["operands"] = [tuple(x.cuda() if isinstance(x, torch.Tensor) else x.to("cuda")
                                      for x in rank_operands(case, g, tensors))
                                for g in range(case.tp * case.ep)]
        return kept["operands"]

    def dense(self, case: OpCase, rank: int) -> torch.Tensor:
        """The dense formula's output of `rank` (`op_problem.dense_output`, from the
        operands' tensors)."""
        tensors, kept = self._tensors(case)
        if rank not in kept:
            kept[rank] = dense_output(case, rank, tensors)
        return kept[rank]

    def calls(self, case: OpCase, *, num_comm_ctas=None, prereduce=False, tile=None,
              poison=False, late_rank=None, late_sender=None, operands=None,
              join=True) -> list:
        """Run one call of every rank; returns every rank's output (on the GPU; ready on
        the current stream, or with join False after a device sync).

        join: the ranks' streams wait for the current stream first (the operands' upload)
            and it waits for them after (the outputs); without, each rank's stream goes on
            from its previous call alone, as a GPU of its own would (the operands must be
            ready on the device).
        late_rank: that rank's finalize waits `LATE_CYCLES` on its stream first.
        late_sender: that rank's send waits `LATE_CYCLES` on its stream first, and no finalize
            waits for the other ranks' sends on the host side: the finalizes spin on their
            arrivals in the kernel. Only for calls whose finalizes fit beside every
            producer (ValueError otherwise; see the module docstring).
        operands: every rank's (h, w2, meta) on the GPU (default: `case`'s)."""
        from megatron_overlap.config import GatherRSOptions
        from megatron_overlap.ops.triton_gemm2_gatherrs import _Call
        from megatron_overlap.ops.triton_prereduce import PreReducedCall, send_blocks
        from megatron_overlap.resource import plan_gemm2_gatherrs

        spaces, streams, finalized = self._group(case)
        ops = self._operands(case) if operands is None else operands
        r = case.tp * case.ep
        if poison:
            # Every buffer a finalize may read starts as NaN: the receive buffers (no call is
            # running now) and each call's local buffer, when it is allocated.
            torch.cuda.synchronize()
            for ws in spaces:
                ws.recv.fill_(float("nan"))
            torch.cuda.synchronize()
        if late_sender is not None:
            from megatron_overlap.ops.triton_gemm2_gatherrs import FINALIZE_BLOCK

            bt, bh = FINALIZE_BLOCK
            finalize_ctas = sum(-(-t // bt) * -(-case.hidden // bh) for t in case.tokens_per_rank)
            if prereduce or finalize_ctas > self.num_sms - r * self.share(r):
                raise ValueError(f"late_sender: {finalize_ctas} finalize CTAs (or the "
                                 "pre-reduced mode) could take the SMs of a producer they "
                                 "wait for")
        options = GatherRSOptions(backend="triton", num_comm_ctas=num_comm_ctas,
                                  timeout_s=TIMEOUT_S, prereduce=prereduce)
        maps = [meta.routing_map for _, _, meta in ops]
        # (a pre-reduced send's CTAs: one per token block of each destination)
        wait_finalized = prereduce and r * sum(
            send_blocks(t, True) for t in case.tokens_per_rank) > self.num_sms // 2
        main = torch.cuda.current_stream()
        calls, sent = [], []
        for g, (h, w2, meta) in enumerate(ops):
            stream = streams[g]
            if join:
                stream.wait_stream(main)  # the operands were uploaded there
            if wait_finalized:
                for event in finalized:
                    stream.wait_event(event)
            with torch.cuda.stream(stream), torch.no_grad():
                if g == late_sender:
                    torch.cuda._sleep(LATE_CYCLES)
                plan = plan_gemm2_gatherrs(meta, options, num_sms=self.share(r),
                                           hidden=w2.shape[1], ffn=w2.shape[2])
                kwargs = dict(hidden=w2.shape[1], dtype=h.dtype, device=h.device,
                              timeout_s=TIMEOUT_S, tile=tile)
                call = (PreReducedCall(meta, spaces[g], plan, routing_maps=maps, **kwargs)
                        if prereduce else _Call(meta, spaces[g], plan, **kwargs))
                if poison:
                    alloc = call._alloc_local

                    def poisoned_local(call=call, alloc=alloc):
                        alloc()
                        if call.local is not None:
                            call.local.fill_(float("nan"))

                    call._alloc_local = poisoned_local
                call.send(h, w2)
                sent.append(stream.record_event())
            calls.append(call)
        outs = []
        finalized.clear()
        for g, call in enumerate(calls):
            stream = streams[g]
            for event in (sent if late_sender is None else ()):
                stream.wait_event(event)
            with torch.cuda.stream(stream), torch.no_grad():
                if g == late_rank:
                    torch.cuda._sleep(LATE_CYCLES)
                outs.append(call.finish())
                finalized.append(stream.record_event())
        if join:
            for stream in streams:
                main.wait_stream(stream)
        return outs

    def run(self, case: OpCase, **kwargs) -> dict:
        """{rank: (output, None)}: no reference backend runs without a process group."""
        return {g: (out, None) for g, out in enumerate(self.calls(case, **kwargs))}

    def run_tile(self, case: OpCase, tile, poison: bool = False) -> dict:
        """{rank: output} of the direct mode with `tile`."""
        return dict(enumerate(self.calls(case, tile=tile, poison=poison)))


def _op_worker(rank: int, world: int, emulated_world: int) -> dict:
    # (the GPU's SMs bound the k values checked: up to 16 on an H200 at world 4)
    return _op_checks(emulated_world, _EmulatedRanks(emulated_world))


@pytest.mark.parametrize("emulated_world", [2, 4])
def test_emulated_ranks_match_dense(emulated_world):
    if torch.cuda.device_count() >= emulated_world:
        # (the same checks across GPUs, NVLink included; and the suite stays within one
        # device call: this one takes 2-4 minutes, most of it compiling)
        pytest.skip(f"test_triton_matches_reference[{emulated_world}] runs on this "
                    f"machine's {torch.cuda.device_count()} GPUs")
    _assert_clean(run_distributed(_op_worker, 1, emulated_world, timeout_s=580,
                                  backend="nccl"))


def _back_to_back_worker(rank: int, world: int, emulated_world: int,
                         prereduce: bool = False) -> dict:
    """Calls back to back with no host sync and no stream joined to another between them,
    one rank's finalize late each call: the other ranks' next producers (pre-reduced
    sends) must wait in the kernel until it has read its buffer (one receive buffer serves
    every call), else the late finalize sums the next call's rows. The pre-reduced calls
    are small, so that their sends' waits are left to the kernel (`_EmulatedRanks.calls`)."""
    ranks = _EmulatedRanks(emulated_world)
    routings = ("uniform", "skewed", "sparse")
    r = emulated_world
    size = (dict(hidden=256, ffn=128, tokens=lambda i, g: 40 + 23 * ((i + g) % 3))
            if prereduce else
            dict(hidden=512, ffn=256, tokens=lambda i, g: 300 + 37 * ((i + g) % 5)))
    cases = [OpCase(1, r, num_experts=8 * r, topk=2, hidden=size["hidden"], ffn=size["ffn"],
                    tokens_per_rank=[size["tokens"](i, g) for g in range(r)],
                    routing=routings[i % 3], dtype=torch.bfloat16, seed=100 + i)
             for i in range(24)]
    operands = [ranks._operands(case) for case in cases]
    # compile, and the workspaces' room (the last case has the most tokens on some rank)
    ranks.calls(cases[-1], operands=operands[-1], prereduce=prereduce)
    torch.cuda.synchronize()
    # (join=False: a join would order every call after the previous one's late finalize)
    outs = [ranks.calls(case, operands=ops, late_rank=i % r, join=False, prereduce=prereduce)
            for i, (case, ops) in enumerate(zip(cases, operands))]
    torch.cuda.synchronize()
    return {f"call {i} rank {g}": describe_mismatch(out.cpu(), ranks.dense(case, g),
                                                    rel_tol=BF16_TOL)
            for i, (case, per_rank) in enumerate(zip(cases, outs))
            for g, out in enumerate(per_rank)}


@pytest.mark.parametrize("prereduce", [False, True])
@pytest.mark.parametrize("emulated_world", [2, 4])
def test_emulated_back_to_back_calls_with_a_late_finalize(emulated_world, prereduce):
    _needs_hardware_queues(emulated_world)
    _assert_clean(run_distributed(_back_to_back_worker, 1, emulated_world, prereduce,
                                  timeout_s=300, backend="nccl"))


def _late_sender_worker(rank: int, world: int, emulated_world: int) -> dict:
    """Each call, one rank sends late (a GPU sleep before its GEMM2) while the others'
    finalizes are already running: they must wait in the kernel for its arrivals before
    they read its rows (every receive and local buffer NaN first), in both layouts' kinds
    (EP and TP) and with the TMA-store epilogue too."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE, DEFAULT_TMA_TILE

    ranks = _EmulatedRanks(emulated_world)
    r = emulated_world

    def case_tile(i, tokens=None):
        tp = 1 if i % 2 == 0 else r
        case = OpCase(tp, r // tp, num_experts=4 * (r // tp), topk=2, hidden=256, ffn=128,
                      tokens_per_rank=tokens or [40 + 23 * ((i + g) % 3) for g in range(r)],
                      routing=("uniform", "skewed", "sparse")[i % 3], dtype=torch.bfloat16,
                      seed=200 + i)
        return case, DEFAULT_TMA_TILE if i % 4 >= 2 else DEFAULT_TILE

    # First each layout and tile once, at the most tokens: compiled, and the workspaces'
    # room made (a call of a new specialisation, or one that rebuilds the workspaces,
    # syncs the host after each rank's send, so no finalize of it would wait).
    for i in range(4):
        case, tile = case_tile(i, [86] * r)
        ranks.calls(case, tile=tile)
    report = {}
    for i in range(12):
        case, tile = case_tile(i)
        outs = ranks.calls(case, tile=tile, poison=True, late_sender=i % r)
        for g, out in enumerate(outs):
            report[f"call {i} rank {g} (late sender {i % r}): {case}"] = describe_mismatch(
                out.cpu(), ranks.dense(case, g), rel_tol=BF16_TOL)
    return report


@pytest.mark.parametrize("emulated_world", [2, 4])
def test_emulated_finalize_waits_for_a_late_sender(emulated_world):
    _needs_hardware_queues(emulated_world)
    _assert_clean(run_distributed(_late_sender_worker, 1, emulated_world, timeout_s=300,
                                  backend="nccl"))


def _timeout_worker(rank: int, world: int) -> list:
    """Emulated rank 1 skips the calls after a first call of both: rank 0's finalize must
    time out waiting for rank 1's arrivals (checked at once); its next producer must time
    out waiting for rank 1 to free its receive buffer (found by the call after); then a
    pre-reduced call's send must time out the same way."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call
    from megatron_overlap.ops.triton_prereduce import PreReducedCall
    from megatron_overlap.resource import Plan

    ranks = _EmulatedRanks(2)
    case = OpCase(1, 2, num_experts=4, topk=2, tokens_per_rank=[64, 64], hidden=256, ffn=128,
                  dtype=torch.bfloat16)
    ops = ranks._operands(case)
    ranks.calls(case, operands=ops)  # compiled, both modes (no compile line-up later)
    ranks.calls(case, operands=ops, prereduce=True)
    torch.cuda.synchronize()
    spaces, streams, _ = ranks._group(case)
    h, w2, meta = ops[0]
    maps = [m.routing_map for _, _, m in ops]
    plan = Plan(num_comm_ctas=1, num_ctas=ranks.share(2), source="test")
    kwargs = dict(hidden=case.hidden, dtype=h.dtype, device=h.device, timeout_s=2.0)
    messages = []
    # (on rank 0's stream: every call on a workspace is sent on one stream)
    with torch.cuda.stream(streams[0]), torch.no_grad():
        _Call(meta, spaces[0], plan, **kwargs).run(h, w2)
        try:
            spaces[0].check_errors(block=True)
            messages.append("no error (checked at once)")
        except RuntimeError as err:
            messages.append(str(err))
        _Call(meta, spaces[0], plan, **kwargs).run(h, w2)
        torch.cuda.synchronize()
        try:
            _Call(meta, spaces[0], plan, **kwargs).run(h, w2)
            messages.append("no error (at the next call)")
        except RuntimeError as err:
            messages.append(str(err))
        try:
            call = PreReducedCall(meta, spaces[0], plan, routing_maps=maps, **kwargs)
            call.send(h, w2)
            call.finish(sync_errors=True)
            messages.append("no error (pre-reduced)")
        except RuntimeError as err:
            messages.append(str(err))
    torch.cuda.synchronize()
    return messages


def test_emulated_timeout_names_rank_and_sender():
    check_timeout_messages(run_distributed(_timeout_worker, 1, timeout_s=120,
                                           backend="nccl")[0])
