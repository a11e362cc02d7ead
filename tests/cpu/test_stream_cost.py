"""The weight-streaming term (`TileTime.stream_gbps` / `reread`, v6.7): the profile fields'
validation and YAML round trip; `resource.model.stream_tau_ps` and its C++ twin (bytes
counted by hand, the limits, bit-identical results and errors); the plan's tile time;
`bench.workloads.stream_sweep`; `launch/calibrate.py`'s fit and dry run; the replay's
GEMM2 accuracy. CPU only."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from megatron_overlap.bench.workloads import STREAM_ROW_BLOCKS, stream_sweep
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.resource import plan_gemm2_gatherrs, solver
from megatron_overlap.resource import model as twin
from megatron_overlap.resource.model import IDLE_WHOLE, MAX_TIME_PS
from megatron_overlap.resource.profile import TileTime, load_profile, save_profile
from tests.cpu.test_fill_cost import _meta  # one rank's metadata from rows per expert

REPO = Path(__file__).resolve().parents[2]
cpp = solver.cpp_module()
IMPLS = [twin] + ([cpp] if cpp is not None else [])


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(**kw):
    return TileTime(128, 256, 64, ctas_per_sm=1, alpha_us=2.0, beta_us=1.0, **kw)


def test_the_fields_convert_to_the_solvers_units_and_bad_values_are_refused_by_name():
    t = _entry(stream_gbps=2737.95, reread=0.3)
    assert (t.stream_mbps, t.reread_ppm) == (2737950, 300000)
    assert (_entry().stream_mbps, _entry().reread_ppm) == (0, 0)
    for kw, match in ((dict(stream_gbps=-1.0), "stream_gbps"), (dict(stream_gbps="2e3"),
                                                                  "stream_gbps"),
                      (dict(stream_gbps=2000.0, reread=1.5), "reread"),
                      (dict(stream_gbps=2000.0, reread=-0.1), "reread"),
                      (dict(reread=0.3), "without stream_gbps")):
        with pytest.raises(ValueError, match=match):
            _entry(**kw)


def test_the_profile_round_trips_through_yaml_and_entries_without_the_term_omit_it(tmp_path):
    prof = load_profile("h200")
    assert all(t.stream_gbps == 0 and t.reread == 0 for t in prof.tile_times)
    t = dataclasses.replace(prof.tile_times[0], stream_gbps=2400.5, reread=0.25)
    new = dataclasses.replace(prof, tile_times=(t,) + prof.tile_times[1:])
    save_profile(new, tmp_path / "p.yaml")
    text = (tmp_path / "p.yaml").read_text()
    assert text.count("stream_gbps") == 1 and text.count("reread") == 1
    assert load_profile(tmp_path / "p.yaml") == new


def test_the_shipped_h100_profile_has_a_measured_streaming_term_on_every_entry():
    prof = load_profile("h100")
    for t in prof.tile_times:
        assert 1000.0 < t.stream_gbps < 3350.0 and 0.0 <= t.reread <= 1.0, t  # < HBM3 peak
    assert prof.extra["stream_sweep"]


def test_bytes_counted_by_hand():
    """One expert of 256 rows = 2 row blocks of 128, H = 512 (2 column tiles of 256), F =
    1024, bf16, G = 4 CTAs, 1 GB/s, re-read 0.5: a tile's HBM bytes are the weight slice
    256 x 1024 x 2 = 524288 x (1 + 0.5) / 2, its rows' activations 128 x 1024 x 2 / 2, its
    outputs 128 x 256 x 2: 589824 bytes, at 1 GB/s over 4 CTAs 2.359296 ms each."""
    counts = np.array([[256]])
    for impl in IMPLS:
        assert impl.stream_tau_ps(counts, 128, 256, 512, 1024, 2, 4, 1000, None, 1000,
                                  500_000) == 4 * 589824 * 1000
        # a slow compute time wins the max
        assert impl.stream_tau_ps(counts, 128, 256, 512, 1024, 2, 4, 3_000_000_000, None,
                                  1000, 500_000) == 3_000_000_000


def test_streaming_matters_at_few_rows_per_expert_and_not_at_many():
    """The 1x H100 numbers of docs/perf_notes.md v6.6 / v6.7 (default tile, H = 4096, F =
    1408, tau 19.6 us, 2.74 TB/s): one full row block per expert streams its weights at
    ~2x the compute time; 22 row blocks per expert (the tile-time sweep's 2816 rows) are
    compute-bound, tau exactly."""
    tau = 19_600_000
    for impl in IMPLS:
        one = impl.stream_tau_ps(np.array([[128]] * 66), 128, 256, 4096, 1408, 2, 132, tau,
                                 None, 2_737_900, 300_000)
        assert 1.9 < one / tau < 2.1
        many = impl.stream_tau_ps(np.array([[2816]] * 6), 128, 256, 4096, 1408, 2, 132, tau,
                                  None, 2_737_900, 300_000)
        assert many == tau


def test_more_reread_or_less_bandwidth_never_lowers_the_tile_time():
    rng = np.random.default_rng(3)
    for _ in range(50):
        counts = rng.integers(0, 600, size=(int(rng.integers(1, 10)), int(rng.integers(1, 3))))
        args = (counts, 128, 256, 2048, 1408, 2, 132, 15_000_000, None)
        times = [twin.stream_tau_ps(*args, 2_700_000, q) for q in (0, 200_000, 1_000_000)]
        assert times == sorted(times)
        times = [twin.stream_tau_ps(*args, mbps, 300_000) for mbps in (4_000_000, 2_000_000)]
        assert times == sorted(times)


def test_without_bandwidth_it_is_the_fill_scaled_tau_exactly():
    rng = np.random.default_rng(5)
    for i in range(200):
        bm = int(rng.choice([64, 128, 256]))
        counts = rng.integers(0, 700, size=(int(rng.integers(1, 8)), int(rng.integers(1, 4))))
        table = None
        if i % 2:
            table = np.asarray(rng.integers(1, IDLE_WHOLE + 1, size=bm + 1), dtype=np.int64)
        tau = int(rng.integers(1, MAX_TIME_PS))
        want = twin.scale_tau_ps(tau, twin.fill_ppm_of_call(counts, bm, table))
        for impl in IMPLS:
            assert impl.stream_tau_ps(counts, bm, 128, 4096, 768, 2, 132, tau, table, 0,
                                      0) == want


def _outcome(impl, args):
    try:
        return impl.stream_tau_ps(*args)
    except ValueError as err:
        return ("ValueError", str(err))


@pytest.mark.skipif(cpp is None, reason="C++ solver not built")
def test_the_cpp_solver_gives_the_twins_times_and_errors():
    rng = np.random.default_rng(7)
    errors = 0
    for i in range(1500):
        bm, bn = int(rng.choice([16, 64, 128, 256])), int(rng.choice([64, 128, 256]))
        counts = rng.integers(0, int(rng.choice([5, 200, 3000])),
                              size=(int(rng.integers(1, 9)), int(rng.integers(1, 5))))
        table = None
        if rng.random() < 0.5:
            table = np.concatenate([[0], np.sort(rng.integers(1, IDLE_WHOLE + 1, size=bm))])
            table[bm] = IDLE_WHOLE
        args = (counts, bm, bn, int(rng.choice([512, 2048, 7168])), int(rng.integers(1, 20000)),
                2, int(rng.integers(1, 300)), int(rng.integers(1, MAX_TIME_PS)), table,
                int(rng.choice([0, 1, 2_700_000, int(rng.integers(1, 1 << 40))])),
                int(rng.integers(0, IDLE_WHOLE + 1)))
        a, b = _outcome(twin, args), _outcome(cpp, args)
        assert a == b, i
        errors += isinstance(a, tuple)
    assert 0 < errors < 1500  # both outcomes were exercised
    # and through plan_call, with the other terms
    for i in range(100):
        counts = rng.integers(0, 500, size=(int(rng.integers(1, 9)), 2))
        args = (counts, 0, 128, 256, 64, 2048, 2, 1408, 132, 3.0, 0.8, 1, 1, 300.0, 20.0, 0,
                None, 1, 2, 2, 132, 1, 3000.0, 900_000, None, 2_700_000, 300_000)
        assert tuple(cpp.plan_call(*args)[:8]) == twin.plan_call(*args)[:8], i


@pytest.mark.parametrize("impl", IMPLS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("args, match", [
    ((np.array([[1]]), 128, 4096, 4096, 1 << 30, 2, 132, 1000, None, 1, 0), "BN x F"),
    ((np.array([[-1]]), 128, 256, 4096, 1408, 2, 132, 1000, None, 1, 0), "negative"),
    ((np.array([1, 2]), 128, 256, 4096, 1408, 2, 132, 1000, None, 1, 0), r"\[L, R\]"),
    ((np.array([[128]]), 128, 256, 4096, 14336, 2, 132, 1000, None, 1, 0), "mean tile time"),
    ((np.array([[128]]), 128, 256, 4096, 1408, 2, 132, 1000, None, -1, 0), "stream_mbps"),
    ((np.array([[128]]), 128, 256, 4096, 1408, 2, 132, 1000, None, 1, IDLE_WHOLE + 1),
     "reread_ppm"),
    ((np.array([[128]]), 128, 256, 4096, 1408, 2, 0, 1000, None, 1, 0), "num_ctas"),
])
def test_bad_values_are_refused_by_name(impl, args, match):
    with pytest.raises(ValueError, match=match):
        impl.stream_tau_ps(*args)


@pytest.mark.parametrize("impl", ["python"] + (["cpp"] if cpp is not None else []))
def test_the_plans_tile_time_is_the_streaming_time_where_weights_dominate(impl):
    base = load_profile("h200")
    streamed = dataclasses.replace(base, tile_times=tuple(
        dataclasses.replace(t, fill_cost=(), stream_gbps=2000.0, reread=0.2)
        for t in base.tile_times))
    plain = dataclasses.replace(base, tile_times=tuple(
        dataclasses.replace(t, fill_cost=()) for t in base.tile_times))

    def plan(rows, prof):
        return plan_gemm2_gatherrs(_meta(rows), GatherRSOptions(backend="triton"), num_sms=132,
                                   hidden=4096, ffn=1408, profile=prof, solver=impl)

    few, few_plain = plan([128] * 66, streamed), plan([128] * 66, plain)
    grid = few.num_ctas
    tile_bytes = 256 * 1408 * 2 + 128 * 1408 * 2 / 16 + 128 * 256 * 2
    assert few.breakdown.tile_us == pytest.approx(grid * tile_bytes / 2000e3, rel=1e-6)
    assert few.breakdown.tile_us > few_plain.breakdown.tile_us
    assert few.predicted_us > few_plain.predicted_us
    many, many_plain = plan([4096] * 4, streamed), plan([4096] * 4, plain)
    assert many.breakdown.tile_us == many_plain.breakdown.tile_us


def test_stream_sweep_points_fill_whole_waves_with_full_tiles():
    for bm, bn, grid, hidden in ((128, 256, 132, 2048), (256, 128, 132, 4096),
                                 (128, 256, 78, 7168), (64, 64, 1, 100)):
        points = stream_sweep(bm, bn, grid, hidden=hidden)
        cols = -(-hidden // bn)
        assert [p.row_blocks for p in points] == list(STREAM_ROW_BLOCKS)
        for p in points:
            assert p.tiles == p.experts * p.row_blocks * cols == p.waves * grid
            assert p.waves >= 8 and p.rows == (p.row_blocks * bm,) * p.experts
    for bad in (dict(row_blocks=()), dict(row_blocks=(0,)), dict(row_blocks=(1.5,)),
                dict(min_waves=0)):
        with pytest.raises(ValueError):
            stream_sweep(128, 256, 132, hidden=4096, **bad)


def _sweep_rows(cal, gbps, reread, alpha, beta, bm=128, bn=256, hidden=4096, grid=132,
                ffns=(768, 1408, 6400)):
    rows = []
    for f in ffns:
        tau = alpha + beta * -(-f // 64)
        for p in stream_sweep(bm, bn, grid, hidden=hidden):
            mem = grid * cal.stream_tile_bytes(bm, bn, hidden, f, p.row_blocks, reread) / (
                gbps * 1e3)
            rows.append(dict(tile="t", bm=bm, bn=bn, bk=64, hidden=hidden, ffn=f, grid=grid,
                             row_blocks=p.row_blocks, waves=p.waves,
                             ms=p.waves * max(tau, mem) * 1e-3))
    return rows


def test_calibrate_fits_the_bandwidth_and_the_reread_it_was_given():
    cal = _load("calibrate")
    for gbps, reread in ((2737.9, 0.3), (2400.0, 0.0), (2600.0, 0.75)):
        got = cal.fit_stream(_sweep_rows(cal, gbps, reread, 3.0, 0.75), 3.0, 0.75)
        assert got == (pytest.approx(gbps, abs=0.1), pytest.approx(reread, abs=1e-9))
    # compute-bound multi-block points cannot tell the re-read: the smallest, 0
    slow = _sweep_rows(cal, 2700.0, 0.6, 3.0, 0.75)
    rows = [dict(r, ms=r["ms"] * (1 if r["row_blocks"] == 1 else 3)) for r in slow]
    assert cal.fit_stream(rows, 3.0 * 10, 0.75 * 10)[1] == 0.0
    ones = [r for r in slow if r["row_blocks"] == 1]
    assert cal.fit_stream(ones, 3.0, 0.75) == (pytest.approx(2700.0, abs=0.1), 0.0)
    with pytest.raises(ValueError, match="no one-row-block point"):
        cal.fit_stream([r for r in slow if r["row_blocks"] > 1], 3.0, 0.75)
    with pytest.raises(ValueError, match="times > 0"):
        cal.fit_stream([dict(slow[0], ms=0.0)], 3.0, 0.75)


def test_calibrate_dry_run_gives_the_base_profiles_streaming_term_back(tmp_path):
    cal = _load("calibrate")
    base = load_profile("h100")
    with_term = dataclasses.replace(base, tile_times=tuple(
        dataclasses.replace(t, stream_gbps=2500.0 + 100 * i, reread=0.2 + 0.1 * i)
        for i, t in enumerate(base.tile_times)))
    save_profile(with_term, tmp_path / "base.yaml")
    out = tmp_path / "p.yaml"
    assert cal.main(["--dry-run", "--base", str(tmp_path / "base.yaml"), "--tma-store",
                     "--out", str(out)]) == 0
    prof = load_profile(out)
    for t in prof.tile_times:  # the same bandwidth, and the same time on every sweep point
        b = with_term.tile_time(t.bm, t.bn, t.bk, t.tma_store, hidden=t.hidden)
        assert t.stream_gbps == pytest.approx(b.stream_gbps, abs=0.1), t
        for f in cal.DEFAULT_STREAM_FFN:
            tau = t.alpha_us + t.beta_us * -(-f // t.bk)
            for p in stream_sweep(t.bm, t.bn, base.gpu.num_sms, hidden=4096):
                def wave(e):
                    return max(tau, base.gpu.num_sms * cal.stream_tile_bytes(
                        t.bm, t.bn, 4096, f, p.row_blocks, e.reread) / (e.stream_gbps * 1e3))
                assert wave(t) == pytest.approx(wave(b), rel=0.01), (t, f, p)
    assert any(t.reread > 0 for t in prof.tile_times)  # where memory-bound, it is measured
    assert prof.extra["stream_sweep"]
    out = tmp_path / "none.yaml"
    assert cal.main(["--dry-run", "--base", str(tmp_path / "base.yaml"), "--tma-store",
                     "--stream-ffn", "--out", str(out)]) == 0
    assert all(t.stream_gbps == 0 for t in load_profile(out).tile_times)
    # --stream-row-blocks: the sweep's points, and the same fit from more of them
    out = tmp_path / "more.yaml"
    assert cal.main(["--dry-run", "--base", str(tmp_path / "base.yaml"), "--tma-store",
                     "--stream-row-blocks", "1", "4", "16", "--out", str(out)]) == 0
    more = load_profile(out)
    assert sorted({r["row_blocks"] for r in more.extra["stream_sweep"]}) == [1, 4, 16]
    for t, u in zip(prof.tile_times, more.tile_times):
        assert u.stream_gbps == t.stream_gbps
    with pytest.raises(SystemExit):  # argparse: row blocks are ints >= 1
        cal.main(["--dry-run", "--stream-row-blocks", "0", "--out", str(tmp_path / "x")])


def test_the_replays_gemm_accuracy_is_the_plans_gemm_term_over_the_measured_time():
    rep = _load("replay_tile_choice")
    path = REPO / "docs" / "results" / "bench_op_v66a_ep1_1xh100.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    workloads = rep.measured_workloads(rows)
    acc = rep.gemm_accuracy(workloads, "h100", num_sms=132, seed=0)
    assert set(acc) == {"128x256x64w8s3tma", "256x128x64w8s4"}
    key, ratio = acc["256x128x64w8s4"][0]
    from megatron_overlap.bench.workloads import rank_rows, routing_maps

    _, tokens, hidden, ffn, experts, topk, routing = key
    meta = rank_rows(routing_maps([tokens], experts, topk, routing, seed=0), tp=1, ep=1,
                     rank=0, topk=topk).meta
    plan = plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"), num_sms=132,
                               hidden=hidden, ffn=ffn, profile="h100", tile=(256, 128, 64))
    assert ratio == pytest.approx(plan.breakdown.gemm_us
                                  / (workloads[key]["256x128x64w8s4"] * 1e3))
