"""The reference GEMM2 + GatherRS op against a dense single-process formula, under gloo.

World 1, 2 and 4; EP, TP (SP), TP x EP; 1, several and 64 local experts; uniform, skewed and
sparse (zero-token experts) routing; uneven tokens per rank, ranks with one or zero tokens;
fp32 and bf16; run twice for determinism; gradients through the collectives.

Tolerances (relative to the largest |expected| of the case, since the output is a sum):
  * fp32: 1e-5, a few ulps of fp32 over sums of <= top-k dot products of length <= 16;
  * bf16: 2 ** -6 = four bf16 half-ulps, for three bf16 roundings (GEMM2 output rows, the
    pre-reduced slot row that travels, the final cast) against an fp32 formula.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_overlap import gemm2_gatherrs_reference
from megatron_overlap.metadata import build_metadata, source_slots
from tests.support.asserts import describe_mismatch
from tests.support.dist import for_each_case, run_distributed
from tests.support.op_problem import (
    OpCase,
    dense_output,
    global_tensors,
    rank_operands,
    routing_maps,
)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}


def _run_case(rank: int, case: OpCase, device: str = "cpu") -> dict:
    h, w2, meta = rank_operands(case, rank)
    h, w2, meta = h.to(device), w2.to(device), meta.to(device)
    group = dist.group.WORLD if case.tp * case.ep > 1 else None
    out = gemm2_gatherrs_reference(h, w2, meta, group)
    again = gemm2_gatherrs_reference(h, w2, meta, group)
    out, again = out.cpu(), again.cpu()
    expected = dense_output(case, rank)
    result = {
        "shape_ok": tuple(out.shape) == tuple(expected.shape),
        "dtype_ok": out.dtype == case.dtype,
        "mismatch": describe_mismatch(out, expected, rel_tol=TOLERANCE[case.dtype]),
        "deterministic": torch.equal(out, again),
    }
    if case.dtype == torch.float32:
        # d(sum(out * g))/dh for row (token t, expert e) is g[t] @ w2[e] (this rank's shard).
        h = h.clone().requires_grad_(True)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        (gemm2_gatherrs_reference(h, w2, meta, group) * grad_out.to(device)).sum().backward()
        result["grad_mismatch"] = describe_mismatch(
            h.grad.cpu(), _expected_h_grad(case, rank), rel_tol=TOLERANCE[torch.float32]
        )
    return result


def _expected_h_grad(case: OpCase, rank: int) -> torch.Tensor:
    """dL/dh in this rank's row layout: row (g, t, e) gets grad_g[t] @ w2[e] (this TP shard)."""
    grads = [
        torch.randn(n, case.hidden, generator=torch.Generator().manual_seed(g))
        for g, n in enumerate(case.tokens_per_rank)
    ]
    maps, _, w2 = global_tensors(case)
    grad_rows = [torch.einsum("th,ehf->etf", grads[g], w2) * m.T.unsqueeze(-1)
                 for g, m in enumerate(maps)]
    return rank_operands(case, rank, tensors=(maps, grad_rows, w2))[0]


def _worker(rank: int, world_size: int, cases: list, device: str = "cpu") -> list:
    return for_each_case(cases, lambda case: _run_case(rank, case, device))


def _cases(world: int) -> list:
    layouts = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (4, 1), (2, 2)]}[world]
    cases = []
    for tp, ep in layouts:
        r = tp * ep
        uneven = [7 + 5 * g for g in range(r)]
        cases += [
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven),
            OpCase(tp, ep, num_experts=ep, topk=1, tokens_per_rank=uneven),  # 1 local expert
            OpCase(tp, ep, num_experts=8 * ep, topk=3, tokens_per_rank=uneven, routing="skewed"),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven, routing="sparse"),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=[1] * r),  # single token
            OpCase(tp, ep, num_experts=2 * ep, topk=2, tokens_per_rank=[0] + [3] * (r - 1)),
            OpCase(tp, ep, num_experts=4 * ep, topk=2, tokens_per_rank=uneven,
                   dtype=torch.bfloat16, hidden=64, ffn=32),
        ]
    cases.append(OpCase(1, world, num_experts=64 * world, topk=8, tokens_per_rank=[40] * world,
                        routing="skewed"))  # 64 local experts
    return cases


def check_results(cases: list, results: list) -> None:
    """Assert every rank's result of every case (shared with the GPU tests)."""
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            where = f"rank {rank} {case}"
            assert res["shape_ok"] and res["dtype_ok"], where
            assert res["mismatch"] is None, (where, res["mismatch"])
            assert res["deterministic"], where
            assert res.get("grad_mismatch") is None, (where, "dL/dh", res["grad_mismatch"])


def test_source_slots_order_and_counts():
    routing_map = torch.tensor(
        [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 0, 1], [0, 0, 0, 1]], dtype=torch.bool
    )
    row_slot, mask, per_ep = source_slots(routing_map, ep_size=2)
    # Rows expert-major: e0: t0,t2  e1: t1,t2  e2: t0  e3: t2,t3.
    # EP rank 0 (experts 0,1) sees tokens 0,1,2 -> slots 0,1,2; EP rank 1 sees 0,2,3.
    assert row_slot.tolist() == [0, 2, 1, 2, 0, 1, 2]
    assert per_ep.tolist() == [3, 3]
    assert mask.tolist() == [[True, True], [True, False], [True, True], [False, True]]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="routing_map"):
        source_slots(torch.ones(3, 4), ep_size=2)
    with pytest.raises(ValueError, match="ep_size=3"):
        source_slots(torch.ones(3, 4, dtype=torch.bool), ep_size=3)
    case = OpCase(1, 1, num_experts=4, topk=2, tokens_per_rank=[5])
    h, w2, meta = rank_operands(case, 0)
    with pytest.raises(ValueError, match="rows"):
        gemm2_gatherrs_reference(h[1:], w2, meta)
    with pytest.raises(ValueError, match="w2 must be"):
        gemm2_gatherrs_reference(h, w2[:, :, :-1], meta)
    with pytest.raises(TypeError, match="must match"):
        gemm2_gatherrs_reference(h, w2.double(), meta)
    with pytest.raises(ValueError, match="counts must be"):
        build_metadata(counts=meta.rows_per_expert_per_chunk,
                       row_slot=torch.zeros(0, dtype=torch.int32),
                       dest_token_mask=torch.zeros(5, 1, dtype=torch.bool), tp_size=1,
                       tp_rank=0, ep_size=1, ep_rank=0, topk=2)
    # Each bad argument is named (what a new user tried: ranks, top-k, types, counts).
    maps = routing_maps(case)
    row_slot, mask, per_ep = source_slots(maps[0], ep_size=1)
    good = dict(counts=torch.cat([maps[0].sum(0), per_ep]).numpy()[None], row_slot=row_slot,
                dest_token_mask=mask, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=2,
                routing_map=maps[0])
    build_metadata(**good)
    for change, error, match in [
        (dict(tp_rank=1), ValueError, "tp_rank=1 of tp_size=1"),
        (dict(ep_rank=-1), ValueError, "ep_rank=-1"),
        (dict(topk=0), ValueError, "topk=0"),
        (dict(topk=1), ValueError, "topk=1 is smaller"),
        (dict(topk=2.5), TypeError, "topk=2.5"),
        (dict(row_slot=row_slot.float()), TypeError, "row_slot must be a integer"),
        (dict(row_slot=row_slot.numpy()), TypeError, "row_slot must be a torch.Tensor"),
        (dict(row_slot=row_slot[:, None]), ValueError, "1-D"),
        (dict(row_slot=row_slot + 5), ValueError, "row_slot values out of range"),
        (dict(dest_token_mask=None), ValueError, "dest_token_mask is required"),
        (dict(dest_token_mask=torch.ones(5, 2, dtype=torch.bool)), ValueError, "EP=1"),
        (dict(counts=good["counts"][:, [1, 0, 2, 3, 4]]), ValueError, "disagrees"),
        (dict(row_slot=torch.flip(row_slot, [0])), ValueError, "not in the order"),
        (dict(counts=good["counts"] + 0.5), TypeError, "counts must be an integer array"),
        (dict(counts=None), TypeError, "counts must be an integer array"),
        (dict(counts="abc"), TypeError, "counts must be an integer array"),
        (dict(dest_token_mask=mask[:-1]), ValueError, "dest_token_mask has 4 tokens"),
    ]:
        if "counts" in change and np.array_equal(change["counts"], good["counts"]):
            continue  # the permuted counts happen to be equal
        with pytest.raises(error, match=match):
            build_metadata(**dict(good, **change))
    two_rank = dataclasses.replace(meta, tp_size=2)
    with pytest.raises(ValueError, match="tp_ep process group"):
        gemm2_gatherrs_reference(h, w2, two_rank, None)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_op_matches_dense_formula(world):
    cases = _cases(world)
    check_results(cases, run_distributed(_worker, world, cases, timeout_s=240))


def test_prepare_and_type_errors_of_the_op():
    """On the CPU nothing is prepared (the reference path runs); bad argument types are
    named instead of failing deep inside."""
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs

    case = OpCase(1, 1, num_experts=4, topk=2, tokens_per_rank=[5])
    h, w2, meta = rank_operands(case, 0)
    opts = GatherRSOptions(backend="reference")
    assert prepare_gemm2_gatherrs(h, w2, meta, group=None, options=opts) is None
    out = gemm2_gatherrs(h, w2, meta, group=None, options=opts, prepared=None)
    assert torch.equal(out, gemm2_gatherrs_reference(h, w2, meta, None))
    with pytest.raises(TypeError, match="meta must be a GatherRSMetadata"):
        gemm2_gatherrs(h, w2, None, group=None, options=opts)
    with pytest.raises(TypeError, match="options must be a GatherRSOptions"):
        prepare_gemm2_gatherrs(h, w2, meta, group=None, options={"backend": "reference"})
    with pytest.raises(TypeError, match="prepared must come from prepare_gemm2_gatherrs"):
        gemm2_gatherrs(h, w2, meta, group=None, options=opts, prepared="x")
    with pytest.raises(TypeError, match="plan must be a resource.Plan"):
        gemm2_gatherrs(h, w2, meta, group=None, options=opts, plan="x")
    with pytest.raises(TypeError, match="h must be a floating-point tensor, got a torch.int64"):
        gemm2_gatherrs(h.long(), w2, meta, group=None, options=opts)

    from megatron_overlap.symm import GatherRSWorkspace

    class _Prepared:  # a prepared call keeps the metadata (and epoch) it was made with
        def __init__(self, meta):
            self.meta, self.epoch = meta, 1
            self.ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")

        def run(self, h, w2):
            raise AssertionError("must not run")

    other = rank_operands(case, 0)[2]
    stale = _Prepared(other)
    with pytest.raises(ValueError, match="prepared was made for other metadata"):
        gemm2_gatherrs(h, w2, meta, group=None, options=opts, prepared=stale)
    with pytest.raises(RuntimeError, match="unusable: call 1 was prepared but not run"):
        stale.ws.next_epoch()  # its epoch was taken on every rank: fail fast from now on
    with pytest.raises(ValueError, match=r"w2 must be a \[L, H, F\] tensor"):
        prepare_gemm2_gatherrs(h, w2[0], meta, group=None, options=opts)
    with pytest.raises(RuntimeError, match="need CUDA"):
        prepare_gemm2_gatherrs(h, w2, meta, group=None,
                               options=GatherRSOptions(backend="triton"))


def test_workspace_argument_errors():
    """The symmetric-memory workspace names a bad argument (CPU stand-in, no group)."""
    from megatron_overlap.symm import GatherRSWorkspace, local_workspaces

    with pytest.raises(TypeError, match="hidden='64' must be an int"):
        GatherRSWorkspace(None, hidden="64", dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        GatherRSWorkspace(None, hidden=64, dtype="bf16", device="cpu")
    with pytest.raises(ValueError, match="hidden=0 must be >= 1"):
        GatherRSWorkspace(None, hidden=0, dtype=torch.float32, device="cpu")
    ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="rows=-5 must be >= 0"):
        ws.ensure_capacity(-5)
    ws.ensure_capacity(100)  # the first allocation is exact ...
    assert ws.capacity_rows == 100 and tuple(ws.recv.shape) == (100, 8)
    ws.ensure_capacity(90)  # ... smaller calls reuse it ...
    assert ws.capacity_rows == 100
    ws.ensure_capacity(101)  # ... and a growth leaves 1/8 headroom
    assert ws.capacity_rows == 101 + 101 // 8 and tuple(ws.recv.shape) == (113, 8)
    empty_first = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    empty_first.ensure_capacity(0)  # a first call with no rows: one row ...
    empty_first.ensure_capacity(50)  # ... and the first real size is still exact
    assert empty_first.capacity_rows == 50
    with pytest.raises(ValueError, match="one per rank of the group"):
        ws.add_expected_arrivals([1, 2, 3])
    fixed = local_workspaces(2, hidden=8, dtype=torch.float32, device="cpu", capacity_rows=4)
    with pytest.raises(ValueError, match="holds 4 rows, the call needs 5"):
        fixed[0].ensure_capacity(5)


def test_workspace_call_order_stream_and_counter_reset():
    """One receive buffer serves every call: calls must be sent in prepare order on one
    stream; a skipped call makes the workspace fail fast; the finalize-CTA total restarts
    before it would leave int32."""
    from megatron_overlap.symm import GatherRSWorkspace

    ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    ws.start_send(ws.next_epoch(), "s0")
    ws.start_send(ws.next_epoch(), "s0")
    with pytest.raises(RuntimeError, match="sent on s1, the workspace's calls run on s0"):
        ws.start_send(ws.next_epoch(), "s1")
    ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    ws.next_epoch()
    second = ws.next_epoch()
    with pytest.raises(RuntimeError, match="call 2 was sent after call 0"):
        ws.start_send(second, None)
    with pytest.raises(RuntimeError, match="unusable"):
        ws.next_epoch()
    ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    ws.finalize_done.fill_(2**31 - 10)
    ws.finalize_ctas = 2**31 - 10
    assert ws.add_finalize_ctas(20) == 20 and int(ws.finalize_done) == 0
    assert ws.add_finalize_ctas(5) == 25


def test_error_record_messages():
    """Each kernel error code reads as what waited for what (codes of
    `kernels.gemm2_gatherrs`; the record is (code, rank waited for, seen, expected)), and the
    record is cleared once reported."""
    from megatron_overlap.kernels import gemm2_gatherrs as k
    from megatron_overlap.symm import GatherRSWorkspace

    for code, text in ((k.ERR_PRODUCER_WAIT, "the GEMM2 producer timed out waiting for rank 1"),
                       (k.ERR_FINALIZE_WAIT, "finalize timed out waiting for sender rank 1"),
                       (k.ERR_SEND_WAIT, "the pre-reduced send timed out waiting for rank 1")):
        ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
        ws.error.copy_(torch.tensor([code, 1, 2, 3]))
        with pytest.raises(RuntimeError, match=f"error code {code}") as err:
            ws.check_errors()
        assert text in str(err.value) and "expected >= 3" in str(err.value)
        ws.check_errors()


def test_triton_metadata_tables_and_copy():
    """`triton_metadata`'s cheap form gives the defining tables: rows_per_expert_per_chunk
    [L, R] is counts of group rank chunk_to_group_rank(c) for local expert l; the slot
    fields are read-only zeros; `routed_counts` is a copy unless copy=False hands over a
    C-contiguous int64 [R, E] array (wider or other arrays are copied anyway)."""
    import numpy as np

    from megatron_overlap.metadata import chunk_to_group_rank, triton_metadata

    rng = np.random.default_rng(9)
    for tp, ep in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2)):
        r, num_local = tp * ep, int(rng.integers(1, 6))
        e = num_local * ep
        counts = rng.integers(0, 50, size=(r, e + 3)).astype(np.int64)  # 3 extra columns
        rmap = torch.zeros(7, e, dtype=torch.bool)
        for rank in range(r):
            meta = triton_metadata(counts, tp_size=tp, tp_rank=rank % tp, ep_size=ep,
                                   ep_rank=rank // tp, topk=2, routing_map=rmap, copy=False)
            want = np.array([[counts[chunk_to_group_rank(c, tp, ep), (rank // tp) * num_local + l]
                              for c in range(r)] for l in range(num_local)])
            assert np.array_equal(meta.rows_per_expert_per_chunk, want)
            assert np.array_equal(meta.routed_counts, counts[:, :e])
            assert not np.shares_memory(meta.routed_counts, counts)  # wider: copied
            for name in ("send_slots", "recv_slots", "dest_row_offsets", "recv_rows_per_rank"):
                field = getattr(meta, name)
                assert field.shape == (r,) and not field.any() and not field.flags.writeable
        exact = np.ascontiguousarray(counts[:, :e])
        kept = triton_metadata(exact, tp_size=tp, tp_rank=0, ep_size=ep, ep_rank=0, topk=2,
                               routing_map=rmap, copy=False)
        assert kept.routed_counts is exact
        copied = triton_metadata(exact, tp_size=tp, tp_rank=0, ep_size=ep, ep_rank=0, topk=2,
                                 routing_map=rmap)
        assert not np.shares_memory(copied.routed_counts, exact)
