"""The C++ resource solver against its Python twin: same results, same errors.

The twin (`resource.model`) tries every k; the C++ solver searches (O(1) / O(log G)) and must
return exactly the twin's choice. In CI (CI=true) the extension must be built: a missing
build fails here instead of silently running the twin.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.resource import KernelResources, plan_gemm2_gatherrs, solver
from megatron_overlap.resource import model as twin
from megatron_overlap.resource.profile import load_profile

cpp = solver.cpp_module()


def test_extension_is_built_in_ci():
    if cpp is None:
        assert not os.environ.get("CI"), (
            "CI must build megatron_overlap.resource._solver (pip install -e .); import error: "
            f"{solver._CPP_ERROR}")
        pytest.skip("C++ solver not built here")
    assert solver.implementation() is cpp


needs_cpp = pytest.mark.skipif(cpp is None, reason="C++ solver not built")


def test_implementation_name_says_which_module_runs(monkeypatch):
    monkeypatch.setenv(solver.SOLVER_ENV, "python")
    assert solver.implementation_name() == "python"
    assert solver.implementation_name("python") == "python"
    monkeypatch.delenv(solver.SOLVER_ENV)
    assert solver.implementation_name() == ("cpp" if cpp is not None else "python")
    with pytest.raises(ValueError, match="expected 'cpp' or 'python'"):
        solver.implementation_name("fortran")


def random_problems(rng, n):
    """[n, 6] problems over every regime: compute-bound, link-bound (k * c_link > tau),
    store-bound (c_cta > tau), no remote / no local tiles, tiny grids and times."""
    g = rng.choice([2, 3, 4, 7, 16, 33, 66, 132, 264], n)
    tr = rng.integers(0, 6000, n)
    tl = rng.integers(0, 6000, n)
    tr[rng.random(n) < 0.08] = 0
    tl[rng.random(n) < 0.08] = 0
    tau = rng.integers(1, 130_000_000, n)
    c_link = (rng.random(n) ** 3 * tau * rng.choice([0.001, 0.01, 0.1, 1.0, 3.0], n))
    c_cta = (rng.random(n) ** 2 * tau * rng.choice([0.1, 1.0, 3.0], n))
    c_link[rng.random(n) < 0.1] = 0
    small = rng.random(n) < 0.25  # tiny integers: every rounding and tie shows
    tau[small] = rng.integers(1, 12, small.sum())
    c_link[small] = rng.integers(0, 15, small.sum())
    c_cta[small] = rng.integers(0, 30, small.sum())
    tr[small] = rng.integers(0, 80, small.sum())
    tl[small] = rng.integers(0, 80, small.sum())
    return np.stack([g, tr, tl, tau, c_link.astype(np.int64), c_cta.astype(np.int64)], 1)


@needs_cpp
def test_solver_matches_exhaustive_twin_on_12000_problems():
    problems = random_problems(np.random.default_rng(0), 12_000)
    fast = cpp.solve_batch(problems)
    slow = twin.solve_batch(problems)
    bad = np.nonzero((fast != slow).any(axis=1))[0]
    assert bad.size == 0, (f"{bad.size} of {len(problems)} differ; first: problem "
                           f"{problems[bad[0]].tolist()} C++ {fast[bad[0]]} twin {slow[bad[0]]}")
    # and the per-k predictions agree (the override path uses them)
    for p in problems[:300].tolist():
        ks = [0] if p[1] == 0 else [1, p[0] // 2 or 1, p[0] - 1 or 1, p[0]]
        for k in ks:
            assert cpp.gemm_end_ps(k, *p) == twin.gemm_end_ps(k, *p), (k, p)


@needs_cpp
def test_problem_building_matches():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        tr = int(rng.integers(0, 5000))
        args = dict(
            num_ctas=int(rng.integers(1, 600)), remote_tiles=tr,
            local_tiles=int(rng.integers(0, 5000)),
            remote_rows=int(rng.integers(1, 128 * tr + 1)) if tr else 0,
            hidden=int(rng.choice([576, 2048, 4096, 5120, 7168])), elem_bytes=int(rng.choice([2, 4])),
            ffn=int(rng.integers(1, 20000)), bk=int(rng.choice([32, 64, 128])),
            alpha_us=float(rng.uniform(0, 30)), beta_us=float(rng.uniform(0, 2)),
            ctas_per_sm=int(rng.integers(1, 4)), calibrated_ctas_per_sm=int(rng.integers(1, 3)),
            link_bandwidth_gbps=float(rng.uniform(20, 900)),
            cta_bandwidth_gbps=float(rng.uniform(1, 60)))
        if args["alpha_us"] + args["beta_us"] == 0:
            continue
        try:
            want = twin.make_problem(**args)
        except ValueError:  # e.g. a tile time above MAX_TIME_PS: both refuse
            with pytest.raises(ValueError):
                cpp.make_problem(**args)
            continue
        assert tuple(cpp.make_problem(**args)) == want, args


@needs_cpp
def test_tile_counting_and_occupancy_match():
    rng = np.random.default_rng(2)
    for _ in range(500):
        counts = rng.integers(0, 700, size=(int(rng.integers(1, 70)), int(rng.choice([1, 2, 4, 8]))))
        counts[rng.random(counts.shape) < 0.2] = 0
        args = (counts.astype(np.int64), int(rng.integers(0, counts.shape[1])),
                int(rng.choice([64, 128])), int(rng.choice([64, 128, 256])),
                int(rng.integers(1, 8000)))
        assert tuple(cpp.count_tiles(*args)) == twin.count_tiles(*args)
    gpu = load_profile("h200").gpu
    limits = {k: getattr(gpu, k) for k in gpu.__dataclass_fields__ if k != "num_sms"}
    for _ in range(2000):
        regs, shared = int(rng.integers(1, 256)), int(rng.integers(0, 232449))
        threads = int(rng.choice([32, 64, 128, 256, 384, 512, 1024]))
        try:
            want = twin.ctas_per_sm(regs, shared, threads, **limits)
        except ValueError:
            with pytest.raises(ValueError):
                cpp.ctas_per_sm(regs, shared, threads, **limits)
            continue
        assert cpp.ctas_per_sm(regs, shared, threads, **limits) == want


def _meta(counts, tp, ep, rank, num_tokens):
    counts = np.asarray(counts, dtype=np.int64)
    r = tp * ep
    z = np.zeros(r, dtype=np.int64)
    return GatherRSMetadata(tp_size=tp, tp_rank=rank % tp, ep_size=ep, ep_rank=rank // tp,
                            num_local_experts=counts.shape[0], num_tokens=num_tokens,
                            rows_per_expert_per_chunk=counts, send_slots=z, recv_slots=z,
                            dest_row_offsets=z, recv_rows_per_rank=z, gather_index=None,
                            recv_token_index=None)


@needs_cpp
def test_whole_plans_match():
    rng = np.random.default_rng(3)
    kernels = [None, KernelResources(128, 65536, 256), KernelResources(96, 40000, 128)]
    for i in range(300):
        tp, ep = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)][i % 6]
        counts = rng.integers(0, 900, size=(int(rng.integers(1, 40)), tp * ep))
        meta = _meta(counts, tp, ep, int(rng.integers(0, tp * ep)), int(rng.integers(1, 9000)))
        kw = dict(num_sms=int(rng.choice([8, 78, 132])), hidden=int(rng.choice([2048, 4096])),
                  ffn=int(rng.choice([384, 768, 1408, 7168, 14336])),
                  kernel=kernels[i % len(kernels)])
        options = GatherRSOptions(num_comm_ctas=None if i % 5 else int(rng.integers(1, 9)))
        a = plan_gemm2_gatherrs(meta, options, solver="cpp", **kw)
        b = plan_gemm2_gatherrs(meta, options, solver="python", **kw)
        assert a == b, (a, b)


@needs_cpp
@pytest.mark.parametrize("impl", ["cpp", "python"])
def test_infeasible_inputs_raise_value_error(impl):
    m = solver.implementation(impl)
    with pytest.raises(ValueError, match="at least 2 CTAs"):
        m.solve(1, 5, 5, 100, 1, 1)  # remote tiles, no room for a local CTA
    for bad in [(0, 0, 0, 1, 0, 0), (4, -1, 0, 1, 0, 0), (4, 1, 1, 0, 0, 0),
                (4, 1, 1, 1, -1, 0), (4, 1 << 31, 0, 1, 0, 0)]:
        with pytest.raises(ValueError):
            m.solve(*bad)
    with pytest.raises(ValueError):
        m.gemm_end_ps(0, 4, 3, 3, 10, 1, 1)  # k = 0 with remote tiles
    with pytest.raises(ValueError):
        m.gemm_end_ps(5, 4, 3, 3, 10, 1, 1)  # k > G
    gpu = load_profile("h200").gpu
    limits = {k: getattr(gpu, k) for k in gpu.__dataclass_fields__ if k != "num_sms"}
    with pytest.raises(ValueError, match="registers"):
        m.ctas_per_sm(255, 0, 1024, **limits)  # 255 x 1024 registers > 65536
    with pytest.raises(ValueError):
        m.ctas_per_sm(64, gpu.max_shared_bytes_per_cta + 1, 128, **limits)
    with pytest.raises(ValueError):
        m.ctas_per_sm(64, 0, 2048, **limits)  # more threads than a CTA may have
    with pytest.raises(ValueError, match="negative"):
        m.count_tiles(np.array([[1, -2]]), 0, 128, 128, 4096)
    with pytest.raises(ValueError):
        m.count_tiles(np.array([[1, 2]]), 2, 128, 128, 4096)  # no such chunk
    with pytest.raises(ValueError):
        m.count_tiles(np.array([1, 2]), 0, 128, 128, 4096)  # not [L, R]
    with pytest.raises(ValueError):
        m.make_problem(132, 3, 3, 0, 4096, 2, 1024, 64, 1.0, 0.1, 1, 1, 300.0, 15.0)
    with pytest.raises(ValueError):
        m.make_problem(132, 3, 3, 10, 4096, 2, 1024, 64, 1.0, 0.1, 1, 1, 0.0, 15.0)


def test_command_line_reports_the_chosen_implementation(monkeypatch, capsys):
    """`python -m megatron_overlap.resource.solver` says which solver the resource manager
    will use ($MEGATRON_OVERLAP_SOLVER included) and rejects a bad value."""
    monkeypatch.setenv(solver.SOLVER_ENV, "python")
    assert solver.main([]) == 0
    assert capsys.readouterr().out.startswith("implementation: python")
    monkeypatch.setenv(solver.SOLVER_ENV, "fortran")
    assert solver.main([]) == 2
    assert "MEGATRON_OVERLAP_SOLVER='fortran'" in capsys.readouterr().out
    monkeypatch.delenv(solver.SOLVER_ENV)
    assert solver.main([]) == 0
    want = "cpp" if cpp is not None else "python"
    assert capsys.readouterr().out.startswith(f"implementation: {want}")


@needs_cpp
def test_plan_call_matches_the_twin():
    """`plan_call` (one crossing of the binding per plan) gives the twin's tuple exactly:
    tiles, problem, k (chosen or overridden), the breakdown's terms, the two modes'
    times."""
    rng = np.random.default_rng(4)
    for i in range(400):
        tp, ep = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)][i % 6]
        r, num_local = tp * ep, int(rng.integers(1, 20))
        routed = rng.integers(0, 900, size=(r, num_local * ep))
        routed[rng.random(routed.shape) < 0.2] = 0
        rank = int(rng.integers(r))
        counts = routed[:, (rank // tp) * num_local:(rank // tp + 1) * num_local].T.copy()
        g = int(rng.choice([2, 78, 132, 264]))
        args = (counts, int(rng.integers(r)), 128, int(rng.choice([128, 256])), 64,
                int(rng.choice([2048, 4096])), 2, int(rng.choice([768, 1408, 14336])), g,
                float(rng.uniform(1, 10)), float(rng.uniform(0.1, 1)),
                int(rng.integers(1, 3)), 1, float(rng.uniform(100, 500)),
                float(rng.uniform(5, 30)), 0 if i % 3 else int(rng.integers(1, g)),
                routed if i % 2 else None, tp, ep, int(rng.integers(1, 9)), g,
                int(rng.integers(1, 10**7)), float(rng.uniform(1000, 4800)))
        want = twin.plan_call(*args)
        got = cpp.plan_call(*args)
        assert tuple(got[:8]) == want[:8], (i, got, want)
        assert (got[8] is None) == (want[8] is None)
        if want[8] is not None:
            assert tuple(got[8]) == tuple(want[8]), i


@needs_cpp
def test_whole_plans_with_the_mode_choice_match():
    """An "auto" plan (routed counts and top-k in the metadata) is the same from the C++
    solver and the twin, mode choice included."""
    import dataclasses

    rng = np.random.default_rng(5)
    profile = dataclasses.replace(load_profile("h200"), prereduce_host_us=0.0)
    seen = set()
    for i in range(120):
        tp, ep = [(1, 2), (2, 1), (2, 2), (1, 4)][i % 4]
        r, num_local = tp * ep, int(rng.integers(1, 16))
        routed = rng.integers(0, rng.choice([30, 900, 9000]), size=(r, num_local * ep))
        rank = int(rng.integers(r))
        counts = routed[:, (rank // tp) * num_local:(rank // tp + 1) * num_local]
        meta = _meta(counts[[(c % ep) * tp + c // ep for c in range(r)]].T, tp, ep, rank,
                     int(routed[rank].sum() // 2 + 1))
        meta.routed_counts, meta.topk = routed.astype(np.int64), int(rng.choice([2, 8]))
        # no host time charged to the pre-reduced mode, so that it wins somewhere
        kw = dict(num_sms=132, hidden=int(rng.choice([2048, 4096])),
                  ffn=int(rng.choice([768, 1408, 14336])), profile=profile)
        options = GatherRSOptions(prereduce="auto")
        a = plan_gemm2_gatherrs(meta, options, solver="cpp", **kw)
        b = plan_gemm2_gatherrs(meta, options, solver="python", **kw)
        assert a == b and a.mode_choice is not None, (a, b)
        seen.add(a.mode)
    assert seen == {"direct", "prereduce"}  # both outcomes exercised
