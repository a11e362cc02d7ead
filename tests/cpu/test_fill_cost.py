"""Part-filled tiles (`TileTime.fill_cost`, v6.6): the profile field's validation, table and
YAML round trip; the call's mean tile cost in the C++ solver and its Python twin; the plan's
tile time scaled by it; `bench.workloads.fill_sweep`; `launch/calibrate.py`'s fit of the
sweep and its dry run. CPU only."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_overlap.bench.workloads import FILL_FRACTIONS, fill_sweep
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import triton_metadata
from megatron_overlap.resource import plan_gemm2_gatherrs, solver
from megatron_overlap.resource import model as twin
from megatron_overlap.resource.model import IDLE_WHOLE
from megatron_overlap.resource.profile import TileTime, load_profile, save_profile

REPO = Path(__file__).resolve().parents[2]
cpp = solver.cpp_module()
needs_cpp = pytest.mark.skipif(cpp is None, reason="C++ solver not built")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(fill=(), bm=128):
    return TileTime(bm, 256, 64, ctas_per_sm=1, alpha_us=2.0, beta_us=1.0, fill_cost=fill)


def test_the_table_interpolates_between_the_points_and_is_flat_below_the_first():
    t = _entry([[16, 0.5], [64, 0.7]])
    assert t.fill_cost == ((16, 0.5), (64, 0.7))
    table = t.fill_ppm_table
    assert table.shape == (129,) and table.dtype == np.int64
    assert [int(table[r]) for r in (1, 16, 40, 64, 96, 128)] == [
        500000, 500000, 600000, 700000, 850000, IDLE_WHOLE]
    assert not table.flags.writeable
    assert _entry().fill_ppm_table is None


@pytest.mark.parametrize("bad", [
    [[0, 0.5]], [[128, 0.5]], [[16, 0.0]], [[16, 1.2]], [[32, 0.5], [16, 0.6]],
    [[16, 0.5], [16, 0.6]], [[16.0, 0.5]], [[True, 0.5]], [[16]], "16:0.5", {16: 0.5},
    [[16, "0.5"]]])
def test_a_bad_fill_cost_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="fill_cost"):
        _entry(bad)


def test_the_profile_round_trips_through_yaml_and_old_files_read_as_before(tmp_path):
    prof = load_profile("h200")
    assert all(not t.fill_cost for t in prof.tile_times)  # not calibrated with the sweep
    t = dataclasses.replace(prof.tile_times[0], fill_cost=((16, 0.9), (64, 0.95)))
    new = dataclasses.replace(prof, tile_times=(t,) + prof.tile_times[1:])
    save_profile(new, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert text.count("fill_cost") == 1  # empty ones are left out
    assert load_profile(tmp_path / "p.yaml") == new


def test_the_shipped_h100_profile_has_a_measured_fill_cost_on_every_entry():
    prof = load_profile("h100")
    for t in prof.tile_times:
        assert t.fill_cost and all(0.5 < c <= 1.0 for _, c in t.fill_cost), t
        assert prof.extra["fill_sweep"]


def _fill_table(rng, bm):
    return np.asarray(rng.integers(1, IDLE_WHOLE + 1, size=bm + 1), dtype=np.int64)


def test_the_mean_cost_counts_full_blocks_whole_and_one_part_filled_tile_per_block():
    table = np.full(129, 500000, dtype=np.int64)
    table[128] = IDLE_WHOLE
    # 300 rows: 2 full blocks + one of 44 rows; 128: one full; 0: none; 5: one of 5 rows
    counts = np.array([[300, 128], [0, 5]], dtype=np.int64)
    # 5 blocks: 3 full (two of the 300 rows, the 128) and 2 at half: 0.8 of a full tile
    assert twin.fill_ppm_of_call(counts, 128, table) == 800000
    assert twin.fill_ppm_of_call(np.zeros((2, 2), dtype=np.int64), 128, table) == IDLE_WHOLE
    assert twin.fill_ppm_of_call(counts, 128, None) == IDLE_WHOLE
    assert twin.scale_tau_ps(1000, 500000) == 500
    assert twin.scale_tau_ps(3, 500000) == 2  # 1.5 rounds up
    assert twin.scale_tau_ps(1, 1) == 1  # never 0


_T = np.full(129, 500000, dtype=np.int64)


@pytest.mark.parametrize("counts, table, match", [
    (np.array([[3]]), np.ones(128, dtype=np.int64), r"fill_ppm must be .*\[129\]"),
    (np.array([[3]]), np.zeros(129, dtype=np.int64), r"fill_ppm\[1\]=0"),
    (np.array([[3]]), np.r_[_T[:7], IDLE_WHOLE + 1, _T[8:]], r"fill_ppm\[7\]=1000001"),
    (np.array([[3]]), np.ones(129, dtype=float), "fill_ppm must be"),
    (np.array([[3]]), np.full((1, 129), 5), "fill_ppm must be"),
    (np.array([[3]]), np.array(["a"] * 129, dtype=object), "fill_ppm must be"),
    (np.array([[-5, 200]]), _T, "negative count -5"),
    (np.array([[3.0]]), _T, "integer \\[L, R\\]"),
    (np.array([[True]]), _T, "integer \\[L, R\\]"),
    (np.array([3]), _T, "integer \\[L, R\\]"),
    (np.array([[2**50] * 4]), _T, "row blocks"),
])
def test_bad_counts_or_tables_are_refused_alike_by_both_implementations(counts, table, match):
    impls = [twin] + ([cpp] if cpp is not None else [])
    for impl in impls:
        with pytest.raises(ValueError, match=match):
            impl.fill_ppm_of_call(counts, 128, table)


@pytest.mark.parametrize("tau, ppm, error", [
    (0, 5, ValueError), (2**62, 5, ValueError), (1000, 0, ValueError),
    (1000, IDLE_WHOLE + 1, ValueError), (10.0, 5, TypeError)])
def test_scale_tau_refuses_values_out_of_range_in_both(tau, ppm, error):
    with pytest.raises(error):
        twin.scale_tau_ps(tau, ppm)
    if cpp is not None:
        with pytest.raises((error, TypeError)):
            cpp.scale_tau_ps(tau, ppm)


@needs_cpp
def test_the_cpp_solver_computes_the_twins_mean_cost_and_plan():
    rng = np.random.default_rng(11)
    for i in range(300):
        bm = int(rng.choice([64, 128, 256]))
        table = _fill_table(rng, bm)
        counts = rng.integers(0, 700, size=(int(rng.integers(1, 12)), int(rng.integers(1, 4))))
        counts[rng.random(counts.shape) < 0.2] = 0
        assert cpp.fill_ppm_of_call(counts, bm, table) == twin.fill_ppm_of_call(
            counts, bm, table), i
        g = int(rng.choice([2, 132, 264]))
        args = (counts, 0, bm, 128, 64, 4096, 2, int(rng.choice([768, 14336])), g,
                float(rng.uniform(1, 10)), float(rng.uniform(0.1, 1)), 1, 1, 300.0, 20.0,
                0, None, 1, counts.shape[1], 2, g, 1, 3000.0,
                int(rng.integers(0, IDLE_WHOLE + 1)), table if i % 4 else None)
        assert tuple(cpp.plan_call(*args)[:8]) == twin.plan_call(*args)[:8], i


def _meta(rows_per_expert):
    counts = np.array([rows_per_expert], dtype=np.int64)
    return triton_metadata(counts, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=1,
                           routing_map=torch.zeros(max(1, int(counts.sum())), counts.shape[1],
                                                   dtype=torch.bool))


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if cpp is not None else []))
def test_the_plans_tile_time_is_scaled_by_the_calls_mean_tile_cost(impl):
    """Experts of 32 rows: every 128-row tile has a quarter of its rows; with fill_cost
    (32 rows: 0.8) the plan's tile time is 0.8 x the full one's; full row blocks are not
    scaled."""
    base = load_profile("h200")
    plain = dataclasses.replace(base, tile_times=tuple(
        dataclasses.replace(t, fill_cost=()) for t in base.tile_times))
    filled = dataclasses.replace(base, tile_times=tuple(
        dataclasses.replace(t, fill_cost=((32, 0.8),)) for t in base.tile_times))

    def plan(rows, prof):
        return plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(backend="triton"), num_sms=132,
                                   hidden=4096, ffn=1408, profile=prof, solver=impl)

    for rows, ratio in (([32] * 40, 0.8), ([128] * 40, 1.0), ([160] * 40, 0.9)):
        full, part = plan(rows, plain), plan(rows, filled)
        assert part.breakdown.tile_us == pytest.approx(ratio * full.breakdown.tile_us, abs=2e-6)
        assert part.breakdown.local_tiles == full.breakdown.local_tiles
        assert (part.predicted_us < full.predicted_us) == (ratio < 1.0)


def test_fill_sweep_points_share_tiles_and_waves_and_fill_one_row_block_per_expert():
    for bm, bn, grid, hidden in ((128, 256, 132, 2048), (256, 128, 132, 4096),
                                 (128, 256, 78, 7168), (64, 64, 1, 100)):
        points = fill_sweep(bm, bn, grid, hidden=hidden)
        cols = -(-hidden // bn)
        assert [p.valid_rows for p in points] == sorted(
            {max(1, round(f * bm)) for f in FILL_FRACTIONS})
        assert points[-1].valid_rows == bm
        for p in points:
            assert p.tiles == p.experts * cols == p.waves * grid and p.waves >= 8
            assert p.rows == (p.valid_rows,) * p.experts
    with pytest.raises(ValueError, match="fractions"):
        fill_sweep(128, 256, 132, hidden=4096, fractions=(0.0,))
    with pytest.raises(ValueError, match="1.0 among them"):
        fill_sweep(128, 256, 132, hidden=4096, fractions=(0.25, 0.5))
    assert [p.valid_rows for p in fill_sweep(8, 64, 2, hidden=64, fractions=(
        0.0625, 0.1875, 1.0))] == [1, 2, 8]  # halves round up: 0.5 -> 1, 1.5 -> 2
    with pytest.raises(ValueError, match="bm"):
        fill_sweep(0, 256, 132, hidden=4096)


def test_calibrate_fits_the_fill_cost_from_the_sweep_and_refuses_a_sweep_without_a_full_point():
    cal = _load("calibrate")
    rows = [dict(bm=128, ffn=f, valid_rows=r, ms=ms) for f, pts in (
        (768, ((16, 0.8), (64, 0.9), (128, 1.0))), (1408, ((16, 0.9 * 2), (64, 1.0 * 2),
                                                            (128, 2.0))))
        for r, ms in pts]
    assert cal.fit_fill_cost(rows) == ((16, 0.85), (64, 0.95))
    # a noisy point above the full tile's time is clipped to 1
    assert cal.fit_fill_cost([dict(bm=128, ffn=768, valid_rows=16, ms=1.1),
                              dict(bm=128, ffn=768, valid_rows=128, ms=1.0)]) == ((16, 1.0),)
    with pytest.raises(ValueError, match="full-tile point"):
        cal.fit_fill_cost([dict(bm=128, ffn=768, valid_rows=16, ms=1.0)])
    # a dip (fewer rows costing more) is pooled with its neighbours: non-decreasing in r
    dip = [dict(bm=256, ffn=768, valid_rows=r, ms=ms) for r, ms in (
        (32, 0.96), (64, 0.94), (128, 0.95), (192, 0.97), (256, 1.0))]
    assert cal.fit_fill_cost(dip) == ((32, 0.95), (64, 0.95), (128, 0.95), (192, 0.97))
    assert cal.monotone_fit([1.0, 0.5, 0.6, 0.2]) == pytest.approx([0.575] * 4)


def test_calibrate_dry_run_gives_the_base_profiles_fill_cost_back(tmp_path):
    """The dry run generates the fill sweep from the base's own entries, so the fitted
    fill_cost is the base's at the sweep's points (rounding aside); --fill-ffn with no
    value leaves it out."""
    cal = _load("calibrate")
    out = tmp_path / "p.yaml"
    assert cal.main(["--dry-run", "--base", "h100", "--tma-store", "--out", str(out)]) == 0
    base, prof = load_profile("h100"), load_profile(out)
    for t in prof.tile_times:
        b = base.tile_time(t.bm, t.bn, t.bk, t.tma_store, hidden=t.hidden)
        want = {r: int(b.fill_ppm_table[r]) / 1e6 for r, _ in t.fill_cost}
        assert [r for r, _ in t.fill_cost] == [p.valid_rows for p in fill_sweep(
            t.bm, t.bn, base.gpu.num_sms, hidden=4096)][:-1]
        assert all(c == pytest.approx(want[r], abs=1e-4) for r, c in t.fill_cost), t
    assert prof.extra["fill_sweep"]
    out = tmp_path / "none.yaml"
    assert cal.main(["--dry-run", "--base", "h100", "--tma-store", "--fill-ffn", "--out",
                     str(out)]) == 0
    assert all(not t.fill_cost for t in load_profile(out).tile_times)


def test_the_replay_reproduces_the_gpu_runs_choices_and_counts_the_right_ones(tmp_path):
    """launch/replay_tile_choice.py on v6.6 run a's rows (1x H100): planned on the CPU with
    the profile that run used (calibrate_v65a, shipped then as h100.yaml), every workload's
    tile is the one the GPU run's op chose; the count of right choices is the measured
    one (22 of 25, docs/perf_notes.md v6.6)."""
    import json

    rep = _load("replay_tile_choice")
    path = REPO / "docs" / "results" / "bench_op_v66a_ep1_1xh100.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    workloads, on_gpu = rep.measured_workloads(rows), rep.gpu_choices(rows)
    assert len(workloads) == 25 and set(on_gpu) == set(workloads)
    res = rep.replay(workloads, REPO / "docs" / "results" / "calibrate_v65a_1xh100.yaml",
                     num_sms=132, seed=0, tie=0.0)
    assert [c for _, c, _, _ in res] == [on_gpu[k][0] for k, *_ in res]
    assert sum(ok for *_, ok in res) == 22
    assert rep.main([str(path), "--profile", "h100"]) == 0

    no_variants = tmp_path / "plain.jsonl"  # rows of a run without --variants
    no_variants.write_text("".join(json.dumps(r) + "\n" for r in rows
                                   if not r["provider"].startswith("nocomm[")))
    assert rep.main([str(no_variants)]) == 2
