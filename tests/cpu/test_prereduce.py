"""Host side of the pre-reduced mode (`GatherRSOptions.prereduce`): the routing-map
all-gather under gloo (uneven tokens per rank, world 2 and 4, with and without the counts
known) and the input checks of `PreReducedCall`. The kernels themselves run in
tests/cpu/test_triton_interpreter.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed


def _map(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.rand(3 + 2 * rank, 6, generator=g) > 0.5


def _gather_worker(rank: int, world: int) -> dict:
    from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps

    want = [_map(r) for r in range(world)]
    report = {}
    for label, sizes in (("gathered counts", None),
                         ("known counts", [3 + 2 * r for r in range(world)])):
        got = gather_routing_maps(want[rank], dist.group.WORLD, num_tokens=sizes)
        report[label] = (len(got) == world and all(
            g.dtype == torch.bool and torch.equal(g, w) for g, w in zip(got, want)))
    try:
        gather_routing_maps(want[rank], dist.group.WORLD, num_tokens=[1] * world)
        report["bad counts"] = "no error"
    except ValueError as err:
        report["bad counts"] = str(err)
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_gather_routing_maps(world):
    for report in run_distributed(_gather_worker, world):
        assert report["gathered counts"] and report["known counts"], report
        assert "expected" in report["bad counts"] and "tokens at index" in report["bad counts"]


def test_gather_checks_its_inputs_before_any_collective():
    from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps

    m = _map(0)
    assert torch.equal(gather_routing_maps(m, None)[0], m)
    assert torch.equal(gather_routing_maps(m.to(torch.uint8), None, num_tokens=[3])[0], m)
    with pytest.raises(ValueError, match=r"bool/uint8 \[T, E\]"):
        gather_routing_maps(m[0], None)
    with pytest.raises(ValueError, match=r"got torch.float32"):
        gather_routing_maps(m.float(), None)
    with pytest.raises(ValueError, match=r"got list"):
        gather_routing_maps([[True]], None)
    for bad in ([99], [3, 3], ["3"], [3.0], [True]):
        with pytest.raises(ValueError, match="num_tokens="):
            gather_routing_maps(m, None, num_tokens=bad)


def _empty_worker(rank: int, world: int) -> list:
    from megatron_overlap.ops.gemm2_gatherrs import gather_routing_maps

    out = gather_routing_maps(torch.zeros(0, 4, dtype=torch.bool), dist.group.WORLD)
    return [tuple(o.shape) for o in out] + [str(o.dtype) for o in out]


def test_gather_with_no_tokens_anywhere():
    for shapes in run_distributed(_empty_worker, 2):
        assert shapes == [(0, 4), (0, 4), "torch.bool", "torch.bool"], shapes


def test_prereduced_call_checks_the_maps():
    from megatron_overlap.config import GatherRSOptions
    from megatron_overlap.ops.triton_prereduce import PreReducedCall
    from megatron_overlap.resource import Plan
    from megatron_overlap.symm import local_workspaces
    from tests.support.op_problem import OpCase, rank_operands

    case = OpCase(1, 2, num_experts=4, topk=2, tokens_per_rank=[5, 7], hidden=16, ffn=16,
                  dtype=torch.float32)
    ws = local_workspaces(2, hidden=16, dtype=case.dtype, device="cpu", capacity_rows=64)
    h, w2, meta = rank_operands(case, 0)
    maps = [rank_operands(case, g)[2].routing_map for g in range(2)]
    plan = Plan(num_comm_ctas=1, num_ctas=1, source="test")

    def make(routing_maps):
        return PreReducedCall(meta, ws[0], plan, hidden=16, dtype=h.dtype, device=h.device,
                              timeout_s=1.0, routing_maps=routing_maps)

    with pytest.raises(ValueError, match="1 maps for a group of 2"):
        make(maps[:1])
    with pytest.raises(ValueError, match=r"routing_maps\[1\] must be a bool/uint8 \[T, 4\]"):
        make([maps[0], maps[1][:, :3]])
    with pytest.raises(ValueError, match=r"got torch.int64"):
        make([maps[0], maps[1].long()])
    with pytest.raises(ValueError, match=r"routing_maps\[0\] \(this rank\)"):
        make([maps[1], maps[1]])
    with pytest.raises(TypeError, match="moe_gatherrs_prereduce=1 must be True, False or .auto."):
        GatherRSOptions(prereduce=1)
    with pytest.raises(ValueError, match="needs the Triton backend"):
        GatherRSOptions(prereduce=True, backend="reference")


def test_tokens_per_rank_from_the_exchanged_counts():
    import numpy as np

    from megatron_overlap.megatron.dispatcher import tokens_per_rank

    # [R, E + slot columns]: rank 0 has 5 tokens, rank 1 has 7, top-2, 4 experts.
    counts = np.array([[3, 2, 4, 1, 9], [4, 4, 3, 3, 9]])
    assert tokens_per_rank(counts, 4, 2, dropless=True) == [5, 7]
    assert tokens_per_rank(counts, 4, 2, dropless=False) is None  # a capacity may drop
    assert tokens_per_rank(counts, 4, 3, dropless=True) is None  # not a multiple
