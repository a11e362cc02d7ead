"""The resource model's price of a part-filled last wave (`TileTime.idle_wave_cost`, eta):
the arithmetic of `resource.model.waves_ps` and its C++ twin, that eta = 1 is the whole-wave
model bit for bit, the profile key, the tile choice it changes, the last-wave sweep's
workloads (`bench.workloads.tail_sweep`) and calibrate.py's fit of eta."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megatron_overlap import config
from megatron_overlap.bench.workloads import tail_sweep, top1_routing_map
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import triton_metadata
from megatron_overlap.ops import triton_gemm2_gatherrs as op
from megatron_overlap.resource import model as twin
from megatron_overlap.resource import plan_gemm2_gatherrs
from megatron_overlap.resource.profile import TileTime, load_profile, profile_from_dict
from megatron_overlap.resource.solver import cpp_module

REPO = Path(__file__).resolve().parents[2]
cpp = cpp_module()
needs_cpp = pytest.mark.skipif(cpp is None, reason="C++ solver not built")
WHOLE = twin.IDLE_WHOLE


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _impls():
    return [twin] + ([cpp] if cpp is not None else [])


# ---- the arithmetic ------------------------------------------------------------------------

@pytest.mark.parametrize("impl", _impls(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_part_filled_last_wave_costs_its_fill_plus_eta_of_its_idle_part(impl):
    """1000 tiles of 10 ps on 132 CTAs: 7 whole waves (70 ps) and a last one 760 / 1320
    full. Whole waves: 80; fluid (eta 0): 70 + ceil(5.76) = 76; eta 0.1: 70 +
    ceil(5.76 + 0.1 x 4.24 = 6.18) = 77; eta 0.5: 70 + ceil(7.88) = 78."""
    for idle, want in ((WHOLE, 80), (0, 76), (100_000, 77), (500_000, 78)):
        assert impl.solve(132, 0, 1000, 10, 0, 0, idle_ppm=idle) == (0, want), idle
        assert impl.gemm_end_ps(0, 132, 0, 1000, 10, 0, 0, idle_ppm=idle) == want
    # whole waves cost the same whatever eta is
    for idle in (0, 300_000, WHOLE):
        assert impl.solve(132, 0, 1320, 10, 0, 0, idle_ppm=idle) == (0, 100)
    assert impl.solve(132, 0, 1000, 10, 0, 0) == (0, 80)  # the default is whole waves


@pytest.mark.parametrize("impl", _impls(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("idle", [-1, WHOLE + 1, 1.5])
def test_idle_ppm_out_of_range_is_refused_by_name(impl, idle):
    with pytest.raises((ValueError, TypeError), match="idle_ppm"):
        impl.solve(132, 0, 1000, 10, 0, 0, idle_ppm=idle)


def _random_problems(rng, n):
    g = rng.choice([2, 3, 7, 16, 66, 132, 264], n)
    tr, tl = rng.integers(0, 5000, n), rng.integers(0, 5000, n)
    tr[rng.random(n) < 0.15] = 0
    tau = rng.integers(1, 130_000_000, n)
    small = rng.random(n) < 0.3
    tau[small] = rng.integers(1, 12, small.sum())
    c_link = (rng.random(n) ** 3 * tau * rng.choice([0.001, 0.1, 1.0, 3.0], n)).astype(np.int64)
    c_cta = (rng.random(n) ** 2 * tau * rng.choice([0.1, 1.0, 3.0], n)).astype(np.int64)
    idle = rng.choice([0, 1, 99_999, 100_000, 500_000, 750_000, 999_999, WHOLE], n)
    return np.stack([g, tr, tl, tau, c_link, c_cta, idle], 1)


def test_twin_eta_never_raises_the_time_and_one_is_the_whole_wave_model():
    """The twin (every k tried) on random problems: eta = 1 gives the six-column problem's
    plan exactly; a smaller eta never predicts a later end, and the end never falls as eta
    grows (each W(k) is non-decreasing in eta)."""
    probs = _random_problems(np.random.default_rng(11), 400)
    whole = twin.solve_batch(probs[:, :6])
    assert (twin.solve_batch(np.concatenate([probs[:, :6], np.full((400, 1), WHOLE)], 1))
            == whole).all()
    prev = None
    for idle in (0, 250_000, 750_000, WHOLE):
        p = probs.copy()
        p[:, 6] = idle
        end = twin.solve_batch(p)[:, 1]
        assert (end <= whole[:, 1]).all()
        if prev is not None:
            assert (end >= prev).all()
        prev = end


@needs_cpp
def test_cpp_solver_matches_the_exhaustive_twin_with_eta():
    """The C++ solver's shortcuts (W constant while k c_link <= tau, a guessed crossing, a
    binary search) assume W(k) non-decreasing in k: the last-wave price keeps it so. Its
    plans and per-k ends equal the twin's on 4000 problems with every kind of eta."""
    probs = _random_problems(np.random.default_rng(12), 4000)
    fast, slow = cpp.solve_batch(probs), twin.solve_batch(probs)
    bad = np.nonzero((fast != slow).any(axis=1))[0]
    assert bad.size == 0, (probs[bad[0]].tolist(), fast[bad[0]], slow[bad[0]])
    for p in probs[:300].tolist():
        for k in ([0] if p[1] == 0 else [1, p[0] // 2 or 1, p[0] - 1 or 1, p[0]]):
            assert (cpp.gemm_end_ps(k, *p[:6], idle_ppm=p[6])
                    == twin.gemm_end_ps(k, *p[:6], idle_ppm=p[6])), (k, p)
    with pytest.raises(ValueError, match=r"\[n, 7\]"):
        cpp.solve_batch(probs[:, :5])


@needs_cpp
def test_mode_times_with_eta_match_and_one_is_bit_identical_to_before():
    rng = np.random.default_rng(13)
    for i in range(200):
        tp, ep = [(1, 2), (2, 1), (2, 2), (1, 4)][i % 4]
        routed = rng.integers(0, 3000, size=(tp * ep, int(rng.integers(1, 9)) * ep))
        args = (routed, tp, ep, int(rng.integers(1, 9)), 4096, 2, int(rng.choice([2, 132])),
                int(rng.integers(1, 10**8)), 128, int(rng.choice([128, 256])), 300.0, 3000.0)
        idle = int(rng.choice([0, 100_000, 750_000, WHOLE]))
        assert tuple(cpp.mode_times(*args, idle)) == tuple(twin.mode_times(*args, idle))
        assert tuple(cpp.mode_times(*args, WHOLE)) == tuple(cpp.mode_times(*args))
        lo, hi = twin.mode_times(*args, 0), twin.mode_times(*args)
        assert lo[0] <= hi[0] and lo[1] <= hi[1]


# ---- the profile -------------------------------------------------------------------------

def test_idle_wave_cost_is_optional_checked_and_round_trips(tmp_path):
    prof = load_profile("h200")
    assert all(t.idle_wave_cost == 1.0 for t in prof.tile_times)  # no key in the file
    assert any(t.idle_wave_cost < 1.0 for t in load_profile("h100").tile_times)  # measured
    data = prof.to_dict()
    assert all("idle_wave_cost" not in t for t in data["tile_times"])  # 1.0 everywhere
    data["tile_times"][1]["idle_wave_cost"] = 0.125
    again = profile_from_dict(yaml.safe_load(yaml.safe_dump(data)))
    assert again.tile_times[1].idle_wave_cost == 0.125 and again.tile_times[1].idle_ppm == 125_000
    assert again.to_dict()["tile_times"][1]["idle_wave_cost"] == 0.125
    assert "idle_wave_cost" not in again.to_dict()["tile_times"][0]  # 1.0: not written
    for bad in (1.5, -0.1, "0.5", True, float("nan")):
        data["tile_times"][1]["idle_wave_cost"] = bad
        with pytest.raises(ValueError, match="idle_wave_cost"):
            profile_from_dict(data)
    data["tile_times"][1]["idle_wave_costs"] = 0.1
    del data["tile_times"][1]["idle_wave_cost"]
    with pytest.raises(ValueError, match="idle_wave_cost"):
        profile_from_dict(data)


def _meta(rows_per_expert):
    counts = np.array([list(rows_per_expert)], dtype=np.int64)
    return triton_metadata(counts, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=1,
                           routing_map=torch.zeros(max(1, int(counts.sum())),
                                                   len(rows_per_expert), dtype=torch.bool))


def _with_idle(prof, **idle_by_key):
    tiles = []
    for t in prof.tile_times:
        name = f"{t.bm}x{t.bn}{'tma' if t.tma_store else ''}"
        # (every tile priced as a full one: tests/cpu/test_fill_cost.py covers fill_cost)
        tiles.append(dataclasses.replace(t, idle_wave_cost=idle_by_key.get(name, 1.0),
                                         fill_cost=()))
    return dataclasses.replace(prof, name="idle", tile_times=tuple(tiles))


def test_the_plan_prices_the_last_wave_with_the_tiles_eta():
    """world 1, 8 experts: 1088 rows each (9 row blocks of 128 x 16 column blocks x 8 =
    1152 tiles = 8.73 waves) against 1024 (1024 tiles, 7.76 waves): the GEMM2 term drops by
    (1 - eta) x the idle part of the last wave, and not at all on whole waves (1056 tiles)."""
    prof = _with_idle(load_profile("h100"))  # every entry at 1.0: whole waves
    tt = prof.tile_time(128, 256, 64, tma_store=True)
    tau = tt.alpha_us + tt.beta_us * (14336 // 64)
    kw = dict(num_sms=132, hidden=4096, ffn=14336, tile=(128, 256, 64), tma_store=True)
    for rows, waves in (([1024] * 8, 1024 / 132), ([1088] * 8, 1152 / 132)):
        whole = plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(), profile=prof, **kw)
        tail = plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(), profile=_with_idle(
            prof, **{"128x256tma": 0.25}), **kw)
        fill = waves - math.floor(waves)
        assert whole.breakdown.gemm_us == pytest.approx(math.ceil(waves) * tau, abs=1e-5)
        assert tail.breakdown.gemm_us == pytest.approx(
            (math.floor(waves) + fill + 0.25 * (1 - fill)) * tau, abs=1e-5)
    rows = [1152, 1152, 1024, 1024, 1024, 1024, 1024, 1024]  # 1056 tiles: 8 whole waves
    a = plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(), profile=prof, **kw)
    b = plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(), profile=_with_idle(
        prof, **{"128x256tma": 0.0}), **kw)
    assert a.breakdown.gemm_us == b.breakdown.gemm_us == pytest.approx(8 * tau, abs=1e-5)


def test_a_fluid_default_tile_keeps_a_call_the_whole_wave_model_gave_to_the_wide_tile(
        monkeypatch):
    """Mixtral at 2048 tokens (bench_op's seed-0 routing: 576 default tiles = 4.36 waves,
    640 wide tiles = 4.85 waves, docs/perf_notes.md v6.3): with whole waves for both the
    wide tile (0.906 x per wave) wins by ~10 %; with the default tile's tail nearly free
    (eta 0.1) and the wide one's at 0.75 the default tile stays."""
    from megatron_overlap.bench.workloads import routing_maps

    monkeypatch.delenv(config.TILE_CHOICE_ENV, raising=False)
    monkeypatch.delenv(config.TMA_STORE_ENV, raising=False)
    rows = routing_maps([2048], 8, 2, "uniform", seed=0)[0].sum(0).tolist()
    assert sum(math.ceil(r / 128) for r in rows) * 16 == 576
    prof = _with_idle(load_profile("h100"))  # whole waves

    def choose(p):
        return op.plan_call(_meta(rows), GatherRSOptions(backend="triton"),
                            device=torch.device("cuda"), hidden=4096, ffn=14336, elem_bytes=2,
                            num_sms=132, resources=lambda t: None, profile=p).tile

    assert choose(prof) == op.WIDE_TILE
    assert choose(_with_idle(prof, **{"128x256tma": 0.1, "256x128": 0.75})) == op.DEFAULT_TMA_TILE
    # the shipped profile's measured values (~0.9 / 1.0 at 8 waves, v6.3 run a) keep the
    # wide tile, which measured 8 % faster there
    assert choose(load_profile("h100")) == op.WIDE_TILE


# ---- the sweep's workloads -----------------------------------------------------------------

@pytest.mark.parametrize("bm,bn,grid,hidden", [(128, 256, 132, 4096), (256, 128, 132, 4096),
                                               (128, 256, 78, 2048), (128, 128, 264, 7168)])
def test_tail_sweep_points_have_the_tiles_they_claim(bm, bn, grid, hidden):
    points = tail_sweep(bm, bn, grid, hidden=hidden)
    cols = math.ceil(hidden / bn)
    assert [p.fill for p in points[:2]] == [1.0, 1.0]
    assert points[0].waves >= 8 and points[1].waves > points[0].waves
    assert len(points) >= 3
    for p in points:
        assert all(r % bm == 0 for r in p.rows) and len(p.rows) == 8
        assert sum(r // bm for r in p.rows) * cols == p.tiles
        assert p.waves == p.tiles / grid
        if p.fill != 1.0:
            assert math.floor(p.waves) == points[0].waves
            assert p.fill == pytest.approx(p.tiles / grid - points[0].waves, abs=1e-6)
    assert len({p.tiles for p in points}) == len(points)


def test_tail_sweep_refuses_bad_input_and_skips_unreachable_fills():
    with pytest.raises(ValueError, match="bm"):
        tail_sweep(0, 128, 132, hidden=4096)
    with pytest.raises(ValueError, match="fills"):
        tail_sweep(128, 128, 132, hidden=4096, fills=(1.0,))
    # a wave of 16 CTAs is one row block's 16 tiles: no part-filled point
    assert len(tail_sweep(128, 256, 16, hidden=4096)) == 2
    assert [p.fill for p in tail_sweep(128, 256, 20, hidden=4096)] == [1.0, 1.0, 0.8]


def test_top1_routing_map_gives_each_expert_its_rows():
    m = top1_routing_map([3, 0, 2])
    assert m.shape == (5, 3) and m.sum(1).eq(1).all()
    assert m.sum(0).tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="rows_per_expert"):
        top1_routing_map([0, 0])


# ---- calibrate.py's fit ---------------------------------------------------------------------

def _rows(eta, per_wave=0.2, start=0.05, ffns=(1408, 14336)):
    rows = []
    for f in ffns:
        for waves, fill, point in ((8.0, 1.0, "whole"), (12.0, 1.0, "whole"),
                                   (8.25, 0.25, "partial"), (8.5, 0.5, "partial")):
            cost = waves if point == "whole" else 8 + fill + eta * (1 - fill)
            rows.append(dict(ffn=f, waves=waves, fill=fill, point=point,
                             ms=start + cost * per_wave * f / 1408))
    return rows


def test_fit_idle_wave_cost_recovers_eta_and_clips():
    cal = _load("calibrate")
    for eta in (0.0, 0.1, 0.75, 1.0):
        assert cal.fit_idle_wave_cost(_rows(eta)) == pytest.approx(eta, abs=1e-3)
    assert cal.fit_idle_wave_cost(_rows(1.4)) == 1.0
    assert cal.fit_idle_wave_cost(_rows(-0.3)) == 0.0
    with pytest.raises(ValueError, match="two whole-wave points"):
        cal.fit_idle_wave_cost([r for r in _rows(0.1) if r["waves"] != 12.0])
    with pytest.raises(ValueError, match="part-filled"):
        cal.fit_idle_wave_cost([r for r in _rows(0.1) if r["point"] == "whole"])
    flat = _rows(0.1)
    for r in flat:
        r["ms"] = 1.0
    with pytest.raises(ValueError, match="per-wave time"):
        cal.fit_idle_wave_cost(flat)


def test_calibrate_dry_run_gives_the_base_eta_back(tmp_path):
    """--dry-run generates the last-wave sweep from the base's own model: each entry's fit
    returns the base's idle_wave_cost (to 3 decimals); --tail-ffn with no value keeps 1.0
    and says so."""
    cal = _load("calibrate")
    base = load_profile("h100")
    tiles = tuple(dataclasses.replace(t, idle_wave_cost=v) for t, v in
                  zip(base.tile_times, (0.5, 0.125, 0.75)))
    path = tmp_path / "base.yaml"
    from megatron_overlap.resource.profile import save_profile
    save_profile(dataclasses.replace(base, tile_times=tiles), path)
    out = tmp_path / "out.yaml"
    assert cal.main(["--dry-run", "--base", str(path), "--tma-store", "--out", str(out)]) == 0
    got = {t.key: t.idle_wave_cost for t in load_profile(str(out)).tile_times}
    assert got == {t.key: t.idle_wave_cost for t in tiles}
    extra = yaml.safe_load(out.read_text())["extra"]
    assert all(extra["idle_wave_cost_measured"].values()) and extra["tail_sweep"]
    out2 = tmp_path / "none.yaml"
    assert cal.main(["--dry-run", "--base", str(path), "--tma-store", "--tail-ffn",
                     "--out", str(out2)]) == 0
    assert all(t.idle_wave_cost == 1.0 for t in load_profile(str(out2)).tile_times)
    assert not any(yaml.safe_load(out2.read_text())["extra"]["idle_wave_cost_measured"].values())


def test_tile_time_default_is_whole_waves():
    t = TileTime(128, 256, 64, ctas_per_sm=1, alpha_us=1.0, beta_us=1.0)
    assert t.idle_wave_cost == 1.0 and t.idle_ppm == WHOLE
