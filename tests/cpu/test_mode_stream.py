"""The mode model's per-rank tile time (v6.8): with a fill table or a weight-streaming
bandwidth in the profile, each rank of the group prices its GEMM2 waves at the mean tile
time of its own tiles (`resource.model.stream_tau_ps` of its EP slice's rows), as its plan
does; without them every rank's tiles cost the profile's tau, as before.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_overlap.bench.workloads import rank_rows, routing_maps
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.resource import group_time_us, load_profile, plan_gemm2_gatherrs
from megatron_overlap.resource import model as twin
from megatron_overlap.resource import solver
from megatron_overlap.resource.model import IDLE_WHOLE, MAX_TIME_PS
from tests.cpu.test_resource_mode import _loop_reference  # the per-rank formulas

cpp = solver.cpp_module()
IMPLS = [twin] + ([cpp] if cpp is not None else [])


def _profile(fill=((32, 0.8),), gbps=2000.0, reread=0.3):
    """The shipped H200 profile with every tile's fill cost and streaming term replaced
    (whole-wave pricing, so that the reference below can count waves with ceil)."""
    base = load_profile("h200")
    return dataclasses.replace(base, prereduce_host_us=0.0, tile_times=tuple(
        dataclasses.replace(t, fill_cost=fill, stream_gbps=gbps, reread=reread,
                            idle_wave_cost=1.0) for t in base.tile_times))


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if cpp is not None else []))
@pytest.mark.parametrize("tp,ep,tokens", [
    (1, 2, [300, 2000]), (2, 1, [1500, 40]), (2, 2, [64, 900, 3000, 0]), (1, 4, [8] * 4)])
def test_each_rank_is_priced_at_its_own_plans_tile_time(impl, tp, ep, tokens):
    """The mode model's times are those of a per-rank loop in which rank q's waves cost the
    tile time of q's own plan (its own rows per expert per chunk, not the exchanged counts):
    what the plan prices on that rank is what the group's model prices for it."""
    prof = _profile()
    hidden, ffn, topk, experts = 2048, 768, 4, 16
    maps = routing_maps(tokens, experts, topk, "skewed", seed=5)
    rows = [rank_rows(maps, tp=tp, ep=ep, rank=q, topk=topk) for q in range(tp * ep)]
    metas = [rr.meta for rr in rows]
    plans = [plan_gemm2_gatherrs(m, GatherRSOptions(backend="triton"), num_sms=132,
                                 hidden=hidden, ffn=ffn, profile=prof, solver=impl)
             for m in metas]
    # the planner's default kernel resources run at the profile's calibrated occupancy, so
    # each plan's tile time is the mode model's tau scaled for that rank's tiles
    assert {p.breakdown.ctas_per_sm for p in plans} == {prof.tile_time(128, 256, 64).ctas_per_sm}
    taus = [p.breakdown.tile_us for p in plans]
    assert len(set(taus[q] for q in range(0, tp * ep, tp))) > 1 or ep == 1  # slices differ
    counts = np.asarray(metas[0].routed_counts)
    d, p = _loop_reference(counts, tp, ep, topk, hidden, plans[0].num_ctas, taus,
                           prof.link_bandwidth_gbps, prof.hbm_bandwidth_gbps, metas=metas)
    for plan in plans:  # every rank made the same choice from the same numbers
        assert plan.mode_choice == plans[0].mode_choice
    assert plans[0].mode_choice.direct_us == pytest.approx(d, rel=1e-9)
    assert plans[0].mode_choice.prereduce_us == pytest.approx(p, rel=1e-9)


def test_without_fill_or_streaming_every_rank_costs_tau_as_before():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 400, size=(4, 8))
    args = (counts, 2, 2, 2, 2048, 2, 132, 30_000_000, 128, 256, 350.0, 4000.0)
    for impl in IMPLS:
        base = impl.mode_times(*args)
        assert impl.mode_times(*args, IDLE_WHOLE, 0, None, 0, 0) == base  # ffn not read
        assert impl.mode_times(*args, IDLE_WHOLE, 768, None, 0, 300_000) == base


def test_streaming_slows_only_the_slice_whose_weights_dominate():
    """EP = 2, one wave per slice: slice 0's experts have one full row block each (the
    weight slice is read for 128 rows), slice 1's two (read once for 256 rows). At 3000 GB/s
    slice 0's tiles stream slower than a 25 us tau and slice 1's do not: the direct time of
    rank 0 (the slowest) rises by exactly the difference; at a 50 us tau nothing changes."""
    counts = np.zeros((2, 16), dtype=np.int64)
    counts[0, :8] = 128   # slice 0: 8 experts x 1 row block x 8 column tiles
    counts[:, 8:] = 64    # slice 1: 8 experts x 2 row blocks (one per source) x 8
    shape = (128, 256, 2048, 1408, 2, 132)
    for tau in (25_000_000, 50_000_000):
        t0 = twin.stream_tau_ps(counts[:, :8].T, *shape, tau, None, 3_000_000, 0)
        t1 = twin.stream_tau_ps(counts[:, 8:].T, *shape, tau, None, 3_000_000, 0)
        assert t1 == tau and (t0 > tau) == (tau == 25_000_000)
        args = (counts, 1, 2, 2, 2048, 2, 132, tau, 128, 256, 350.0, 4000.0, IDLE_WHOLE, 1408)
        for impl in IMPLS:
            plain = impl.mode_times(*args[:13])
            term = impl.mode_times(*args, None, 3_000_000, 0)
            if t0 == tau:
                assert term == plain
            else:
                assert term[2] == plain[2] == 0  # rank 0 is the slowest direct rank
                assert term[0] - plain[0] == pytest.approx((t0 - tau) / 1e6, rel=1e-9)
                assert term[1] >= plain[1]


def _outcome(impl, args):
    try:
        return impl.mode_times(*args)
    except ValueError as err:
        return ("ValueError", str(err))


@pytest.mark.skipif(cpp is None, reason="C++ solver not built")
def test_the_cpp_mode_times_gives_the_twins_times_and_errors_with_the_term():
    rng = np.random.default_rng(11)
    errors = 0
    for i in range(400):
        tp, ep = [(1, 2), (2, 1), (2, 2), (1, 8), (4, 2), (1, 1)][int(rng.integers(0, 6))]
        num_experts = ep * int(rng.integers(1, 9))
        bm = int(rng.choice([64, 128, 256]))
        counts = rng.integers(0, int(rng.choice([3, 300, 30000])), size=(tp * ep, num_experts))
        table = None
        if rng.random() < 0.5:
            table = np.concatenate([[0], np.sort(rng.integers(1, IDLE_WHOLE + 1, size=bm))])
            table[bm] = IDLE_WHOLE
        args = (counts, tp, ep, int(rng.integers(1, num_experts + 1)),
                int(rng.choice([32, 2048, 7168])), 2, int(rng.integers(1, 400)),
                int(rng.integers(1, MAX_TIME_PS)), bm, int(rng.choice([64, 256])),
                float(rng.uniform(1, 900)), float(rng.uniform(500, 5000)),
                int(rng.integers(0, IDLE_WHOLE + 1)), int(rng.choice([0, 768, 20000])), table,
                int(rng.choice([0, 2_700_000, int(rng.integers(1, 1 << 40))])),
                int(rng.integers(0, IDLE_WHOLE + 1)))
        a, b = _outcome(twin, args), _outcome(cpp, args)
        assert a == b, (i, args)
        errors += a[0] == "ValueError"
    assert 0 < errors < 400  # both outcomes were exercised


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if cpp is not None else []))
def test_group_time_of_a_fixed_mode_plan_uses_the_profiles_term(impl):
    """`group_time_us` of a plan whose mode was fixed (the mode model runs there, outside
    the plan) prices the tiles as the plan's own mode choice does."""
    prof = _profile(fill=(), gbps=1500.0, reread=0.2)
    maps = routing_maps([512, 512], 64, 6, "uniform", seed=1)
    meta = rank_rows(maps, tp=1, ep=2, rank=0, topk=6).meta
    kw = dict(num_sms=132, hidden=2048, ffn=1408, profile=prof, solver=impl)
    auto = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"), **kw)
    fixed = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton", prereduce=False), **kw)
    assert fixed.mode_choice is None
    got = group_time_us(meta, fixed, elem_bytes=2, **kw)
    assert got == auto.mode_choice.direct_us
    plain = dataclasses.replace(prof, tile_times=tuple(
        dataclasses.replace(t, stream_gbps=0.0, reread=0.0) for t in prof.tile_times))
    assert got > group_time_us(meta, fixed, elem_bytes=2, **dict(kw, profile=plain))


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if cpp is not None else []))
@pytest.mark.parametrize("kw, match", [
    (dict(ffn=2 ** 52), r"ffn=4503599627370496: expected an integer in \[1, 1073741824\]"),
    (dict(ffn=2 ** 63), "ffn=9223372036854775808"),
    (dict(hidden=2 ** 31), "hidden=2147483648"),
    (dict(num_sms=2 ** 40), "num_sms=1099511627776"),
    (dict(recv_rows=2 ** 70), "recv_rows=1180591620717411303424"),
])
def test_out_of_range_sizes_are_refused_by_their_own_name(impl, kw, match):
    """Sizes beyond the solvers' range get the planner's ValueError naming the argument
    the caller passed (not a binding's signature dump or another argument's name)."""
    maps = routing_maps([64, 64], 16, 2, "uniform", seed=0)
    meta = rank_rows(maps, tp=1, ep=2, rank=0, topk=2).meta
    args = dict(num_sms=132, hidden=2048, ffn=768, profile=_profile(), solver=impl)
    for prereduce in ("auto", False):
        with pytest.raises(ValueError, match=match):
            plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton", prereduce=prereduce),
                                **dict(args, **kw))


def test_build_metadata_refuses_a_topk_above_the_experts_even_without_tokens():
    import torch

    from megatron_overlap.metadata import build_metadata

    counts = np.zeros((1, 9), dtype=np.int64)  # E = 8, EP = 1, no tokens
    kw = dict(counts=counts, row_slot=torch.zeros(0, dtype=torch.int64),
              dest_token_mask=torch.zeros(0, 1, dtype=torch.bool), tp_size=1, tp_rank=0,
              ep_size=1, ep_rank=0, routing_map=torch.zeros(0, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="topk=9: expected at most the number of experts 8"):
        build_metadata(topk=9, **kw)
    assert build_metadata(topk=8, **kw).topk == 8
