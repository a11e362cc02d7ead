"""The Triton GEMM2 + GatherRS kernels on GPUs: against the reference, across calls, CTA
counts, tile configurations, layouts and the pre-reduced mode, back-to-back calls with a
late finalize (the one-buffer protocol), plus the timeout diagnosis. Skipped without CUDA;
world 2 needs 2 GPUs, world 4 (TP2 x EP2, EP4, TP4) needs 4 (not run yet: no 4-GPU machine
has been lent).

bf16 tolerance 2 ** -6 relative to the case's largest |output| (as the CPU suites): the
kernels round each GEMM2 row to bf16 and sum a token's rows in fp32 once; the reference
rounds the GEMM2 rows, then the pre-reduced rows, to bf16; and the kernels' tensor-core dot
accumulates in another order than cuBLAS.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist

from tests.cpu import test_megatron_flag as flag_suite
from tests.support.asserts import describe_mismatch
from tests.support.dist import run_distributed
from tests.support.op_problem import OpCase, dense_output, rank_operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BF16_TOL = 2.0**-6
COMM_CTAS = (1, 2, 4, 8, 16, 32, 64, 100)


def _needs_gpus(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")


def _run(case: OpCase, rank: int, *, num_comm_ctas=None, timeout_s=20.0, prereduce=False):
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs

    h, w2, meta = rank_operands(case, rank)
    h, w2, meta = h.cuda(), w2.cuda(), meta.to("cuda")
    group = dist.group.WORLD if case.tp * case.ep > 1 else None
    with torch.no_grad():
        out = gemm2_gatherrs(h, w2, meta, group=group, options=GatherRSOptions(
            backend="triton", num_comm_ctas=num_comm_ctas, timeout_s=timeout_s,
            prereduce=prereduce))
        ref = gemm2_gatherrs(h, w2, meta, group=group,
                             options=GatherRSOptions(backend="reference"))
    return out, ref


def _run_tile(case: OpCase, rank: int, tile, poison: bool = False) -> torch.Tensor:
    """The Triton op with an explicit GEMM2 tile configuration (the op's plan).

    poison: every buffer the finalize reads starts as NaN (this rank's receive buffer,
    refilled once every rank's previous call is done, and the call's local buffer), so a
    row that was not stored, or read before its store landed, shows in the output instead
    of an earlier call's identical row."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_gemm2_gatherrs import _Call
    from megatron_overlap.resource import plan_gemm2_gatherrs
    from megatron_overlap.symm import get_workspace

    h, w2, meta = rank_operands(case, rank)
    h, w2, meta = h.cuda(), w2.cuda(), meta.to("cuda")
    group = dist.group.WORLD if case.tp * case.ep > 1 else None
    opts = GatherRSOptions(backend="triton", timeout_s=20.0, prereduce=False)  # _Call: direct
    num_sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    plan = plan_gemm2_gatherrs(meta, opts, num_sms=num_sms)
    ws = get_workspace(group, hidden=w2.shape[1], dtype=h.dtype, device=h.device)
    with torch.no_grad():
        call = _Call(meta, ws, plan, hidden=w2.shape[1], dtype=h.dtype, device=h.device,
                     timeout_s=20.0, tile=tile)
        if poison:
            # (after _Call: it may have grown the receive buffer)
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier(group=group)  # no peer is still storing the previous call's rows
            ws.recv.fill_(float("nan"))
            torch.cuda.synchronize()
            if group is not None:
                dist.barrier(group=group)  # every buffer is poisoned before any store
            alloc = call._alloc_local

            def poisoned_local():
                alloc()
                call.local.fill_(float("nan"))

            call._alloc_local = poisoned_local
        return call.run(h, w2)


def _tile_variants() -> dict:
    """GEMM2 tile configurations besides the default, checked against the dense formula."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import WIDE_TILE, TileConfig

    return {"256x128 s4 (WIDE_TILE)": WIDE_TILE,
            "128x256 s4": TileConfig(num_stages=4),
            "128x128 w4 s3": TileConfig(bn=128, num_warps=4),
            "128x128 s3 dynamic": TileConfig(bn=128, static=False)}


def _assert_clean(results: list) -> None:
    """Every rank's {check: mismatch or None} report holds no mismatch."""
    for rank, report in enumerate(results):
        bad = {k: v for k, v in report.items() if v is not None}
        assert not bad, (rank, bad)


def _layouts(world: int):
    return {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(2, 2), (1, 4), (4, 1)]}[world]


def _op_cases(world: int) -> list:
    cases = []
    for tp, ep in _layouts(world):
        r = tp * ep
        uneven = [700 + 333 * g for g in range(r)]
        common = dict(hidden=512, ffn=256, dtype=torch.bfloat16)
        cases += [
            OpCase(tp, ep, num_experts=ep, topk=1, tokens_per_rank=uneven, **common),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven, **common),
            OpCase(tp, ep, num_experts=64 * ep, topk=8, tokens_per_rank=uneven,
                   routing="skewed", **common),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven,
                   routing="sparse", **common),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=[1] * r, **common),
            OpCase(tp, ep, num_experts=8 * ep, topk=2, tokens_per_rank=[0] + [64] * (r - 1),
                   **common),
            OpCase(tp, ep, num_experts=8 * ep, topk=2, tokens_per_rank=uneven, hidden=4096,
                   ffn=1024, dtype=torch.bfloat16),
        ]
    return cases


class _OneRank:
    """The ranks `_op_checks` runs, as one process of a distributed run (one GPU per rank):
    this process's rank alone, through `gemm2_gatherrs` (planned for the whole GPU) and
    against the reference backend. `tests/gpu/test_emulated_ranks_gpu.py` has the other
    kind: every rank in one process on one GPU."""

    max_comm_ctas = max(COMM_CTAS)

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def run(self, case: OpCase, **kwargs) -> dict:
        """{rank: (output, reference output)} of the op on `case` (`_run`'s keywords)."""
        return {self.rank: _run(case, self.rank, **kwargs)}

    def run_tile(self, case: OpCase, tile, poison: bool = False) -> dict:
        """{rank: output} of the direct mode with `tile` (`_run_tile`)."""
        return {self.rank: _run_tile(case, self.rank, tile, poison)}

    @staticmethod
    def dense(case: OpCase, rank: int) -> torch.Tensor:
        """The dense formula's output of `rank` (`op_problem.dense_output`)."""
        return dense_output(case, rank)


def _op_checks(world: int, ranks) -> dict:
    """{check: mismatch or None} of `test_triton_matches_reference` for the ranks that
    `ranks` runs (`_OneRank`, or the emulated ranks of test_emulated_ranks_gpu.py): its
    `run(case, num_comm_ctas=None, prereduce=False)` gives {rank: (out, ref)} (ref None where
    no reference backend can run: the dense formula is then the only reference), its
    `run_tile(case, tile, poison)` {rank: out}, its `dense(case, rank)` the dense formula's
    output; communication-CTA counts above its `max_comm_ctas` are left out."""
    report = {}
    # Every case, every layout: against the reference and the dense formula.
    for case in _op_cases(world):
        for rank, (out, ref) in ranks.run(case).items():
            if ref is not None:
                report[f"{case} rank {rank} vs reference"] = describe_mismatch(
                    out.cpu(), ref.cpu(), rel_tol=BF16_TOL)
            report[f"{case} rank {rank} vs dense"] = describe_mismatch(
                out.cpu(), ranks.dense(case, rank), rel_tol=BF16_TOL)
    # The pre-reduced mode (its routing maps all-gathered by the op) on every case.
    for case in _op_cases(world):
        for rank, (out, ref) in ranks.run(case, prereduce=True).items():
            report[f"{case} rank {rank} pre-reduced"] = describe_mismatch(
                out.cpu(), ranks.dense(case, rank) if ref is None else ref.cpu(),
                rel_tol=BF16_TOL)
    # Other tile configurations (stages, shapes, the dynamic schedule) agree too.
    for case in (_op_cases(world)[2], _op_cases(world)[6]):
        for name, tile in _tile_variants().items():
            for rank, out in ranks.run_tile(case, tile).items():
                report[f"{case} rank {rank} tile {name} vs dense"] = describe_mismatch(
                    out.cpu(), ranks.dense(case, rank), rel_tol=BF16_TOL)
    # The epilogue's two ways of storing a tile (from registers; through a TMA descriptor of
    # the tile's rows, clipped at a short tile's end), with and without the rotated static
    # schedule, store the same values: bit for bit. (Two variants, not three: each compiles
    # once per shape, and the JIT time is most of this test's.)
    from megatron_overlap.ops.triton_gemm2_gatherrs import DEFAULT_TILE, DEFAULT_TMA_TILE

    variants = {"TMA-store epilogue": DEFAULT_TMA_TILE,
                "TMA-store epilogue, rotated waves": dataclasses.replace(DEFAULT_TMA_TILE,
                                                                         rotate=True)}
    # (and two hidden sizes more: 640 is not a multiple of the 256-column tile, so the copy
    # engine clips the last column block; 1004 x 2 bytes is not a multiple of 16, so the
    # TMA-store tile falls back to the register stores)
    uneven = [700 + 333 * g for g in range(world)]
    extra = [OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven, hidden=hidden,
                    ffn=256, dtype=torch.bfloat16)
             for tp, ep in _layouts(world) for hidden in (640, 1004)]
    for case in _op_cases(world) + extra:
        plain = ranks.run_tile(case, DEFAULT_TILE, poison=True)
        for name, tile in variants.items():
            for rank, out in ranks.run_tile(case, tile, poison=True).items():
                report[f"{case} rank {rank} {name} bitwise equal"] = (
                    None if torch.equal(plain[rank], out) else
                    "differs: " + str(describe_mismatch(out.cpu(), plain[rank].cpu(),
                                                        rel_tol=0.0)))
    # Same result, bit for bit, for every communication-CTA count.
    comm_ctas = [k for k in COMM_CTAS if k <= ranks.max_comm_ctas]
    case = _op_cases(world)[2]
    first = ranks.run(case, num_comm_ctas=comm_ctas[0])
    for k in comm_ctas[1:]:
        for rank, (out, _) in ranks.run(case, num_comm_ctas=k).items():
            report[f"rank {rank} k={k} bitwise equal to k={comm_ctas[0]}"] = (
                None if torch.equal(out, first[rank][0]) else "differs")
    # 200 consecutive calls, new routing, sizes and data each call, on the same workspace.
    rng = random.Random(1234)  # same sequence on every rank: the layout must agree
    for call in range(200):
        tp, ep = _layouts(world)[call % len(_layouts(world))]
        r = tp * ep
        case = OpCase(tp, ep, num_experts=rng.choice([1, 2, 4, 8]) * ep,
                      topk=1, tokens_per_rank=[rng.randint(0, 300) for _ in range(r)],
                      routing=rng.choice(["uniform", "skewed", "sparse"]), hidden=256,
                      ffn=128, dtype=torch.bfloat16, seed=call)
        case = dataclasses.replace(case, topk=min(rng.randint(1, 4), case.num_experts))
        for rank, (out, ref) in ranks.run(case, num_comm_ctas=rng.choice(comm_ctas)).items():
            report[f"call {call} rank {rank}: {case}"] = describe_mismatch(
                out.cpu(), ranks.dense(case, rank) if ref is None else ref.cpu(),
                rel_tol=BF16_TOL)
    return report


def _op_worker(rank: int, world: int) -> dict:
    return _op_checks(world, _OneRank(rank))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_triton_matches_reference(world):
    _needs_gpus(world)
    _assert_clean(run_distributed(_op_worker, world, timeout_s=580, backend="nccl"))


def _back_to_back_worker(rank: int, world: int, prereduce: bool = False) -> dict:
    """Triton calls back to back with no host sync between them, one rank's finalize made
    late each call (a GPU sleep before it): the other rank's next producer (or pre-reduced
    send) must wait until that finalize has read its buffer (one receive buffer serves every
    call), else the late finalize sums the next call's rows. Checked against the reference,
    computed first. With `prereduce` the routing maps are gathered up front and passed in,
    so no call syncs the host."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs
    from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps

    group = dist.group.WORLD
    routings = ("uniform", "skewed", "sparse")
    cases = [OpCase(1, world, num_experts=8 * world, topk=2, hidden=512, ffn=256,
                    tokens_per_rank=[300 + 37 * ((i + g) % 5) for g in range(world)],
                    routing=routings[i % 3], dtype=torch.bfloat16, seed=100 + i)
             for i in range(24)]
    operands = []
    for case in cases:
        h, w2, meta = rank_operands(case, rank)
        operands.append((h.cuda(), w2.cuda(), meta.to("cuda")))
    triton_opts = GatherRSOptions(backend="triton", timeout_s=20.0, prereduce=prereduce)
    with torch.no_grad():
        refs = [gemm2_gatherrs(h, w2, meta, group=group,
                               options=GatherRSOptions(backend="reference"))
                for h, w2, meta in operands]
        maps = [gather_routing_maps(meta.routing_map, group) if prereduce else None
                for _, _, meta in operands]
        gemm2_gatherrs(*operands[-1], group=group, options=triton_opts)  # compile, grow
        torch.cuda.synchronize()
        dist.barrier()
        outs = []
        for i, (h, w2, meta) in enumerate(operands):
            call = prepare_gemm2_gatherrs(h, w2, meta, group=group, options=triton_opts,
                                          routing_maps=maps[i])
            call.send(h, w2)
            if rank == i % world:
                torch.cuda._sleep(3_000_000)  # ~1.5 ms: this rank's finalize runs late
            outs.append(call.finish())
        torch.cuda.synchronize()
    return {f"call {i}": describe_mismatch(out.cpu(), ref.cpu(), rel_tol=BF16_TOL)
            for i, (out, ref) in enumerate(zip(outs, refs))}


@pytest.mark.parametrize("prereduce", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_back_to_back_calls_with_a_late_finalize(world, prereduce):
    _needs_gpus(world)
    _assert_clean(run_distributed(_back_to_back_worker, world, prereduce, timeout_s=300,
                                  backend="nccl"))


def _timeout_worker(rank: int, world: int) -> list:
    """Rank 1 skips the calls: rank 0's first finalize must time out waiting for rank 1's
    arrivals (checked at once); its next producer must time out waiting for rank 1 to free
    its receive buffer (found by the call after); then a pre-reduced call's send must time
    out the same way. Each record names both ranks."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs
    from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps
    from megatron_overlap.symm import destroy_workspaces, get_workspace

    case = OpCase(1, 2, num_experts=4, topk=2, tokens_per_rank=[64, 64], hidden=256, ffn=128,
                  dtype=torch.bfloat16)
    _run(case, rank)  # compile + warm-up on both ranks, both modes (no compile barrier later)
    _run(case, rank, prereduce=True)
    maps = gather_routing_maps(rank_operands(case, rank)[2].routing_map.cuda(),
                               dist.group.WORLD)
    messages = ["rank 1 skipped the calls"]
    if rank == 0:
        h, w2, meta = rank_operands(case, rank)
        h, w2, meta = h.cuda(), w2.cuda(), meta.to("cuda")
        # the direct mode, explicitly: the test is about its waits (the pre-reduced mode's
        # routing-map gather, a collective, would wait for the absent rank 1 instead)
        opts = GatherRSOptions(backend="triton", timeout_s=2.0, prereduce=False)
        ws = get_workspace(dist.group.WORLD, hidden=case.hidden, dtype=h.dtype,
                           device=h.device)
        messages = []
        with torch.no_grad():
            gemm2_gatherrs(h, w2, meta, group=dist.group.WORLD, options=opts)
            try:
                ws.check_errors(block=True)
                messages.append("no error (checked at once)")
            except RuntimeError as err:
                messages.append(str(err))
            gemm2_gatherrs(h, w2, meta, group=dist.group.WORLD, options=opts)
            torch.cuda.synchronize()
            try:
                gemm2_gatherrs(h, w2, meta, group=dist.group.WORLD, options=opts)
                messages.append("no error (at the next call)")
            except RuntimeError as err:
                messages.append(str(err))
            pre = prepare_gemm2_gatherrs(h, w2, meta, group=dist.group.WORLD,
                                         options=dataclasses.replace(opts, prereduce=True),
                                         routing_maps=maps)
            try:
                pre.send(h, w2)
                pre.finish(sync_errors=True)
                messages.append("no error (pre-reduced)")
            except RuntimeError as err:
                messages.append(str(err))
    dist.barrier()
    destroy_workspaces()
    return messages


def check_timeout_messages(messages: list) -> None:
    """The three diagnoses `_timeout_worker` collects on rank 0, in order: its finalize
    waiting for rank 1's arrivals, its producer and then its pre-reduced send waiting for
    rank 1 to free its receive buffer; each names rank 0 and the rank waited for."""
    assert len(messages) == 3, messages
    for message in messages:
        assert "tp_ep rank 0" in message, message
    assert "finalize timed out waiting for sender rank 1" in messages[0], messages[0]
    assert "producer timed out waiting for rank 1 to free its receive buffer" in messages[1], \
        messages[1]
    assert "pre-reduced send timed out waiting for rank 1 to free its receive buffer" in \
        messages[2], messages[2]


def test_timeout_names_rank_and_sender():
    _needs_gpus(2)
    # ~20 s when it passes; a hang shows every rank's stack at the limit (seen once, v4.3).
    check_timeout_messages(run_distributed(_timeout_worker, 2, timeout_s=120,
                                           backend="nccl")[0])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flag_on_triton_matches_flag_off(world):
    _needs_gpus(world)
    cases = [dataclasses.replace(c, dtype=torch.bfloat16, check_grads=False, backend="triton")
             for c in flag_suite._cases(world) if not c.model]
    # The cases run the default mode, "auto" (every rank must choose alike; check_results
    # asserts it); then each layout forced pre-reduced (routing maps gathered by the
    # dispatcher with the token counts it already has) and forced direct.
    cases += ([dataclasses.replace(c, prereduce=True) for c in cases]
              + [dataclasses.replace(c, prereduce=False) for c in cases])
    results = run_distributed(flag_suite._worker, world, cases, timeout_s=400,
                              backend="nccl", device="cuda")
    flag_suite.check_results(world, cases, results)


@pytest.mark.parametrize("world", [2, 4])
def test_flag_on_auto_takes_the_prereduced_mode_where_the_link_is_slow(world, tmp_path,
                                                                      monkeypatch):
    """The default "auto" through the Megatron layer where the resource manager picks the
    pre-reduced mode (a profile whose link is 50 MB/s makes the direct mode's stores the
    bottleneck; with EP = 1 the pre-reduced mode moves 1 / top-k of the rows, so it must win
    there): the dispatcher gathers the maps, every rank chooses alike, and flag on still
    matches flag off. (Written in v4.4 after the device time was spent: not run yet.)"""
    _needs_gpus(world)
    import yaml

    from megatron_overlap.resource.profile import load_profile, save_profile

    # No host term (prereduce_host_us): this tiny case's GPU saving is far below the
    # shipped 605.6 us, and the test is about the link-bound choice through the layer.
    slow = dataclasses.replace(load_profile("h200"), name="slow-link", link_bandwidth_gbps=0.05,
                               prereduce_host_us=0.0)
    path = tmp_path / "slow-link.yaml"
    save_profile(slow, path)
    assert yaml.safe_load(path.read_text())["link_bandwidth_gbps"] == 0.05
    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", str(path))  # the spawned ranks inherit it
    cases = [dataclasses.replace(c, dtype=torch.bfloat16, check_grads=False, backend="triton",
                                 prereduce="auto")
             for c in flag_suite._cases(world) if not c.model]
    results = run_distributed(flag_suite._worker, world, cases, timeout_s=200,
                              backend="nccl", device="cuda")
    flag_suite.check_results(world, cases, results)
    for per_rank in results:
        for case, res in zip(cases, per_rank):
            if case.ep == 1 and case.topk >= 2:
                assert res["plan_mode"] == "prereduce", (case, res["plan_mode"])
                assert res["last_combine"] == "prereduced", (case, res["last_combine"])


def test_staging_slots_are_reused_only_when_the_call_is_gone():
    """`_StagingSlot`: a call object still alive keeps its slot, so its tile list and
    finalize index stay intact while later calls run (bench_op times `gemm_only` of an old
    call that way); dropped calls free theirs for reuse, and the ring stays bounded. World
    1, in this process."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs
    from megatron_overlap.ops.triton_gemm2_gatherrs import _StagingSlot
    from megatron_overlap.symm import destroy_workspaces

    opts = GatherRSOptions(backend="triton", timeout_s=20.0, prereduce=False)
    cases = [OpCase(1, 1, num_experts=8, topk=2, hidden=512, ffn=256,
                    tokens_per_rank=[200 + 29 * i], routing=("uniform", "skewed")[i % 2],
                    dtype=torch.bfloat16, seed=40 + i) for i in range(8)]
    operands = []
    for case in cases:
        h, w2, meta = rank_operands(case, 0)
        operands.append((h.cuda(), w2.cuda(), meta.to("cuda")))
    try:
        with torch.no_grad():
            gemm2_gatherrs(*operands[0], group=None, options=opts)  # compiles; sets the stream
            kept = prepare_gemm2_gatherrs(*operands[0], group=None, options=opts)
            kept.run(*operands[0][:2])
            assert kept._slot is not None, "the second call found no free staging slot"
            tiles, index = kept.tiles.clone(), kept.index.clone()
            seen = []
            for h, w2, meta in operands[1:]:
                ref = gemm2_gatherrs(h, w2, meta, group=None,
                                     options=GatherRSOptions(backend="reference"))
                call = prepare_gemm2_gatherrs(h, w2, meta, group=None, options=opts)
                assert call._slot is not kept._slot
                seen.append(call._slot)
                out = call.run(h, w2)
                torch.cuda.synchronize()
                problem = describe_mismatch(out.cpu(), ref.cpu(), rel_tol=BF16_TOL)
                assert problem is None, problem
                del call
            torch.cuda.synchronize()
            assert torch.equal(kept.tiles, tiles) and torch.equal(kept.index, index)
            ws = kept.ws
            assert len(ws.staging_slots) <= _StagingSlot.RING
            assert len({id(s) for s in seen if s is not None}) < len(seen), "no slot reused"
    finally:
        destroy_workspaces()


def test_gemm_only_stores_the_calls_rows_and_leaves_its_tables():
    """`_Call.gemm_only` (bench_op's and calibrate.py's producer timing) stores exactly the
    GEMM2 rows the call stored into its local buffer, bit for bit, on every repeat, with the
    call's own tile list untouched (from v6.0 the list with every destination set to this
    rank is built once, not in every timed launch). World 1, in this process."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import prepare_gemm2_gatherrs
    from megatron_overlap.symm import destroy_workspaces

    opts = GatherRSOptions(backend="triton", timeout_s=20.0, prereduce=False)
    case = OpCase(1, 1, num_experts=8, topk=2, hidden=512, ffn=256, tokens_per_rank=[333],
                  routing="skewed", dtype=torch.bfloat16, seed=71)
    h, w2, meta = rank_operands(case, 0)
    h, w2, meta = h.cuda(), w2.cuda(), meta.to("cuda")
    try:
        with torch.no_grad():
            call = prepare_gemm2_gatherrs(h, w2, meta, group=None, options=opts)
            call.run(h, w2)
            torch.cuda.synchronize()
            rows = call._local_rows
            assert rows > 0
            local, tiles = call.local[:rows].clone(), call.tiles.clone()
            for i in range(3):
                if i:  # the repeats must store every row again
                    call._scratch.fill_(float("nan"))
                call.gemm_only()
                torch.cuda.synchronize()
                assert torch.equal(call._scratch[:rows], local)
            assert torch.equal(call.tiles, tiles)
            assert int(call._gemm_only_tiles[:, 4].ne(call.rank).sum()) == 0
    finally:
        destroy_workspaces()


def _fast_wide_tile_profile(tmp_path):
    """A profile YAML in which `WIDE_TILE` is 100x faster than the default tile, so that the
    resource manager's tile choice (`plan_call`) picks it for every call."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import WIDE_TILE
    from megatron_overlap.resource.profile import TileTime, load_profile, save_profile

    base = load_profile()
    fast = TileTime(WIDE_TILE.bm, WIDE_TILE.bn, WIDE_TILE.bk, ctas_per_sm=1,
                    alpha_us=0.01, beta_us=0.001)
    prof = dataclasses.replace(base, name="fast-wide-tile", tile_times=tuple(
        t for t in base.tile_times if not t.key == fast.key) + (fast,))
    path = tmp_path / "fast-wide-tile.yaml"
    save_profile(prof, path)
    return path


def test_tile_choice_runs_the_chosen_tile_through_the_op_and_the_layer(tmp_path,
                                                                       monkeypatch):
    """Where the resource manager picks `WIDE_TILE` (a profile that makes it the fastest),
    the op runs it (`prepare_gemm2_gatherrs` without a tile) and matches the reference on
    the world-1 cases (uniform, 64 experts skewed, experts without tokens, one token, H 4096);
    `MEGATRON_OVERLAP_TILE_CHOICE=0` keeps the default tile; the Megatron layer's flag-on
    combine runs the chosen tile too and matches flag off. World 1 (the choice's default
    scope; the layer's ranks spawned)."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs
    from megatron_overlap.ops.triton_gemm2_gatherrs import WIDE_TILE, default_tile
    from megatron_overlap.symm import destroy_workspaces

    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", str(_fast_wide_tile_profile(tmp_path)))
    opts = GatherRSOptions(backend="triton", timeout_s=20.0, prereduce=False)
    try:
        with torch.no_grad():
            for case in [c for i, c in enumerate(_op_cases(1)) if i in (1, 2, 3, 4, 6)]:
                h, w2, meta = rank_operands(case, 0)
                h, w2, meta = h.cuda(), w2.cuda(), meta.to("cuda")
                call = prepare_gemm2_gatherrs(h, w2, meta, group=None, options=opts)
                assert call.tile == WIDE_TILE, (case, call.tile)
                out = call.run(h, w2)
                ref = gemm2_gatherrs(h, w2, meta, group=None,
                                     options=GatherRSOptions(backend="reference"))
                torch.cuda.synchronize()
                problem = describe_mismatch(out.cpu(), ref.cpu(), rel_tol=BF16_TOL)
                assert problem is None, (case, problem)
                del call
            monkeypatch.setenv("MEGATRON_OVERLAP_TILE_CHOICE", "0")
            call = prepare_gemm2_gatherrs(h, w2, meta, group=None, options=opts)
            assert call.tile == default_tile(h.device, 1)
            del call
            monkeypatch.delenv("MEGATRON_OVERLAP_TILE_CHOICE")
    finally:
        destroy_workspaces()
    cases = [dataclasses.replace(c, dtype=torch.bfloat16, check_grads=False, backend="triton",
                                 prereduce=False)
             for c in flag_suite._cases(1) if not c.model]
    results = run_distributed(flag_suite._worker, 1, cases, timeout_s=300,
                              backend="nccl", device="cuda")
    flag_suite.check_results(1, cases, results)
    assert {res["last_tile"] for res in results[0]} == {WIDE_TILE.name}, results[0]


@pytest.mark.parametrize("world", [2, 4])
def test_group_tile_choice_runs_one_tile_on_every_rank(world, tmp_path, monkeypatch):
    """`MEGATRON_OVERLAP_TILE_CHOICE=all` at world > 1, with a profile that makes
    `WIDE_TILE` the fastest: every rank of every layout's group picks it from the exchanged
    counts (`resource.group_time_us`), the senders' tiles and the receivers' expected
    arrivals agree (no hang), and the Megatron layer's flag-on output matches flag off, in
    the default "auto" mode and forced direct."""
    from megatron_overlap.ops.triton_gemm2_gatherrs import WIDE_TILE

    _needs_gpus(world)
    monkeypatch.setenv("MEGATRON_OVERLAP_HW_PROFILE", str(_fast_wide_tile_profile(tmp_path)))
    monkeypatch.setenv("MEGATRON_OVERLAP_TILE_CHOICE", "all")
    cases = [dataclasses.replace(c, dtype=torch.bfloat16, check_grads=False, backend="triton")
             for c in flag_suite._cases(world) if not c.model]
    cases += [dataclasses.replace(c, prereduce=False) for c in cases]
    results = run_distributed(flag_suite._worker, world, cases, timeout_s=400,
                              backend="nccl", device="cuda")
    flag_suite.check_results(world, cases, results)
    for rank, rows in enumerate(results):
        assert {res["last_tile"] for res in rows} == {WIDE_TILE.name}, (rank, rows)
