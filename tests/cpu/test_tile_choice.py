"""The resource manager's per-call GEMM2 tile choice (`ops.triton_gemm2_gatherrs.plan_call`)
on the CPU: the wave model behind it (whole waves of the grid x the profile's tile time),
the margin, the candidates a profile offers, the variable that turns it off, the tile names
the rows record, and calibrate.py's --tiles. Nothing here launches a kernel: `plan_call`
plans for a CUDA device without touching one."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_overlap import config
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import triton_metadata
from megatron_overlap.ops import triton_gemm2_gatherrs as op
from megatron_overlap.resource.profile import TileTime, load_profile, save_profile

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # a device name only: nothing is allocated on it
NUM_SMS = 132
H, F = 4096, 14336  # Mixtral's expert: 224 K steps of 64


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _meta(rows_per_expert, group=(1, 1)):
    """World-1 metadata (or this rank of a TP x EP group, every rank alike) whose local
    experts get `rows_per_expert` rows each."""
    tp, ep = group
    experts = len(rows_per_expert) * ep
    counts = np.tile(np.array(list(rows_per_expert) * ep, dtype=np.int64), (tp * ep, 1))
    tokens = max(1, int(counts[0].sum()))
    return triton_metadata(counts, tp_size=tp, tp_rank=0, ep_size=ep, ep_rank=0, topk=1,
                           routing_map=torch.zeros(tokens, experts, dtype=torch.bool))


def _profile(wide_ratio: float, base: str = "h100"):
    """`base` with a `WIDE_TILE` tile time of `wide_ratio` x its default TMA-store tile's,
    every entry priced in whole waves and every tile as a full one (idle_wave_cost 1,
    fill_cost empty: the counts below are ceil(tiles / G); tests/cpu/test_last_wave.py
    covers the part-filled last wave, tests/cpu/test_fill_cost.py part-filled tiles)."""
    prof = load_profile(base)
    prof = dataclasses.replace(prof, tile_times=tuple(
        dataclasses.replace(t, idle_wave_cost=1.0, fill_cost=()) for t in prof.tile_times))
    d = prof.tile_time(128, 256, 64, tma_store=True)
    w = op.WIDE_TILE
    wide = TileTime(w.bm, w.bn, w.bk, ctas_per_sm=1, alpha_us=d.alpha_us * wide_ratio,
                    beta_us=d.beta_us * wide_ratio)
    return dataclasses.replace(prof, name=f"wide-{wide_ratio}", tile_times=tuple(
        t for t in prof.tile_times if t.key != wide.key) + (wide,))


def _choose(meta, profile, device=CUDA, num_sms=NUM_SMS, hidden=H, ffn=F):
    return op.plan_call(meta, GatherRSOptions(backend="triton"), device=device, hidden=hidden,
                        ffn=ffn, elem_bytes=2, num_sms=num_sms, resources=lambda t: None,
                        profile=profile)


def _waves(rows_per_expert, bm, bn, hidden=H):
    tiles = sum(math.ceil(r / bm) for r in rows_per_expert) * math.ceil(hidden / bn)
    return math.ceil(tiles / NUM_SMS)


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch):
    for name in (config.TILE_CHOICE_ENV, config.TMA_STORE_ENV):
        monkeypatch.delenv(name, raising=False)


def test_the_faster_tile_in_whole_waves_wins():
    """Equal waves (1024 rows per expert: 8 x 16 tiles of 128 x 256 per expert = 8 x 32 of
    256 x 128): the tile 10 % faster per tile wins, and the two predictions differ by exactly
    the GEMM2 term, waves x tau(F) (the launch, finalize and latency terms are the same)."""
    rows = [1024] * 8
    prof = _profile(0.9)
    choice = _choose(_meta(rows), prof)
    assert choice.tile == op.WIDE_TILE
    default, wide = op.DEFAULT_TMA_TILE.name, op.WIDE_TILE.name
    assert list(choice.predicted_us) == [default, wide]  # the default tile first
    assert choice.plan.predicted_us == choice.predicted_us[wide]
    ks = F // 64
    tau_d = prof.tile_time(128, 256, 64, tma_store=True)
    tau_w = prof.tile_time(256, 128, 64)
    gemm_d = _waves(rows, 128, 256) * (tau_d.alpha_us + tau_d.beta_us * ks)
    gemm_w = _waves(rows, 256, 128) * (tau_w.alpha_us + tau_w.beta_us * ks)
    assert _waves(rows, 128, 256) == _waves(rows, 256, 128) == 8
    assert (choice.predicted_us[default] - choice.predicted_us[wide]
            == pytest.approx(gemm_d - gemm_w, abs=1e-3))
    assert choice.plan.breakdown.local_tiles == 8 * 4 * 32  # counted with BM 256, BN 128


def test_a_wave_more_cancels_a_faster_tile():
    """1100 rows per expert: 9 x 16 x 8 = 1152 tiles of 128 x 256 (9 waves on 132 SMs)
    against 5 x 32 x 8 = 1280 of 256 x 128 (10 waves): 10 % per tile buys nothing, so the
    default tile stays; with 20 % it wins again."""
    rows = [1100] * 8
    assert (_waves(rows, 128, 256), _waves(rows, 256, 128)) == (9, 10)
    assert _choose(_meta(rows), _profile(0.9)).tile == op.DEFAULT_TMA_TILE
    assert _choose(_meta(rows), _profile(0.8)).tile == op.WIDE_TILE


def test_a_gain_within_the_margin_keeps_the_default_tile():
    rows = [1024] * 8
    just_below = 1.0 - op.TILE_CHOICE_MARGIN * 1.6  # the GEMM2 term is most of the call
    assert _choose(_meta(rows), _profile(0.995)).tile == op.DEFAULT_TMA_TILE
    assert _choose(_meta(rows), _profile(1.0)).tile == op.DEFAULT_TMA_TILE
    assert _choose(_meta(rows), _profile(just_below)).tile == op.WIDE_TILE
    assert _choose(_meta(rows), _profile(1.2)).tile == op.DEFAULT_TMA_TILE


def test_only_tiles_the_profile_has_are_offered():
    """The shipped H200 profile has no `WIDE_TILE` time: only the default tile is planned
    (no warning, no error); neither on the CPU (the interpreter's tile) nor without an SM
    count is there a choice."""
    import warnings

    assert not load_profile("h200").has_tile_time(256, 128, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = _choose(_meta([1024] * 8), "h200")
    assert choice.tile == op.DEFAULT_TMA_TILE and list(choice.predicted_us) == [
        op.DEFAULT_TMA_TILE.name]
    cpu = _choose(_meta([1024] * 8), _profile(0.5), device=torch.device("cpu"), num_sms=None)
    assert cpu.tile == op.INTERPRETER_TILE and cpu.plan.source == "cpu"
    none = _choose(_meta([1024] * 8), _profile(0.5), num_sms=None)
    assert none.tile == op.DEFAULT_TMA_TILE and none.plan.num_ctas is None
    # a CPU device with an SM count (a caller that plans for a GPU from the CPU): the
    # interpreter's tile, planned with the default tile's shape as before v6.1, no choice
    cpu = _choose(_meta([1024] * 8), _profile(0.5), device="cpu")
    default = _choose(_meta([1024] * 8), _profile(0.5), device="cuda")
    assert cpu.tile == op.INTERPRETER_TILE and list(cpu.predicted_us) == [
        op.INTERPRETER_TILE.name]
    assert cpu.plan.breakdown.local_tiles == default.plan.breakdown.local_tiles == 8 * 8 * 16
    assert default.tile == op.WIDE_TILE


def test_choose_false_plans_the_default_tile_alone():
    """The dispatcher's reference path on CUDA (`choose=False`): one plan, the default
    tile, whatever the profile offers."""
    choice = op.plan_call(_meta([1024] * 8), GatherRSOptions(backend="triton"), device=CUDA,
                          hidden=H, ffn=F, elem_bytes=2, num_sms=NUM_SMS,
                          resources=lambda t: None, profile=_profile(0.5), choose=False)
    assert choice.tile == op.DEFAULT_TMA_TILE
    assert list(choice.predicted_us) == [op.DEFAULT_TMA_TILE.name]


def test_the_shipped_h100_profile_offers_the_wide_tile():
    prof = load_profile("h100")
    w = op.WIDE_TILE
    assert prof.has_tile_time(w.bm, w.bn, w.bk, False)
    assert not prof.has_tile_time(w.bm, w.bn, w.bk, True)
    choice = _choose(_meta([1024] * 8), "h100")
    assert set(choice.predicted_us) == {op.DEFAULT_TMA_TILE.name, w.name}


@pytest.mark.parametrize("value, world, considered", [
    ("", 1, True), ("", 2, False), ("0", 1, False), ("1", 1, True), ("1", 2, False),
    ("1", 4, False), ("0", 4, False), ("all", 1, True), ("all", 2, True), ("all", 4, True)])
def test_the_variable_turns_the_choice_on_and_off(monkeypatch, value, world, considered):
    """Unset or "1": world 1 only; "all": every world (at world > 1 from the group-wide
    counts, below); "0": never."""
    monkeypatch.setenv(config.TILE_CHOICE_ENV, value)
    assert config.TILE_CHOICE_MAX_WORLD == 1
    assert config.tile_choice_enabled(world) is considered
    group = {1: (1, 1), 2: (1, 2), 4: (2, 2)}[world]
    choice = _choose(_meta([1024] * 8, group), _profile(0.5))
    default = op.default_tile(CUDA, world)
    assert choice.tile == (op.WIDE_TILE if considered else default)
    assert len(choice.predicted_us) == (2 if considered else 1)
    settings = config.fused_path_settings(world)
    assert settings["tile_choice"] is considered and settings["tile_choice_env"] == value
    assert config.fused_path_settings(world, triton_gpu=False)["tile_choice"] is False


@pytest.mark.parametrize("value", ["yes", "true", " 1", "2", "ALL", "group"])
def test_a_bad_variable_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(config.TILE_CHOICE_ENV, value)
    for call in (lambda: config.tile_choice_enabled(1), config.check_environment,
                 lambda: _choose(_meta([64] * 4), _profile(0.5))):
        with pytest.raises(ValueError, match=f"MEGATRON_OVERLAP_TILE_CHOICE={value!r}"):
            call()


@pytest.mark.parametrize("world, error", [(0, ValueError), (1.0, TypeError), (True, TypeError)])
def test_tile_choice_enabled_refuses_a_bad_world_size(world, error):
    with pytest.raises(error, match=f"world_size={world!r}"):
        config.tile_choice_enabled(world)


def test_tile_names_round_trip_through_bench_op():
    bench_op = _load("bench_op")
    for tile in (op.DEFAULT_TILE, op.DEFAULT_TMA_TILE, op.WIDE_TILE, op.INTERPRETER_TILE,
                 op.TileConfig(bn=128, static=False), op.TileConfig(tma_store=True, rotate=True),
                 op.TileConfig(rotate=True)):
        assert bench_op.parse_tile(tile.name) == (tile, 1), tile.name
    assert op.DEFAULT_TMA_TILE.name == "128x256x64w8s3tma"
    assert op.WIDE_TILE.name == "256x128x64w8s4"
    assert op.WIDE_TILE in op.TILE_CANDIDATES


def test_empty_experts_and_no_rows_plan_without_error():
    for rows in ([0] * 8, [0, 0, 5, 0], [1]):
        choice = _choose(_meta(rows), _profile(0.5))
        assert choice.plan.predicted_us is not None
    assert _choose(_meta([0] * 8), _profile(0.5)).plan.breakdown.local_tiles == 0


# ---- world > 1: one tile for the whole group, from what every rank holds alike --------------

def _group_metas(counts, tp, ep, topk=2):
    """The metadata of every rank g (= ep * TP + tp) of a TP x EP group from one routed
    counts array [R, E] (as the dispatcher all-gathers it)."""
    counts = np.asarray(counts, dtype=np.int64)
    metas = []
    for g in range(tp * ep):
        tokens = max(1, int(counts[g].sum()))
        metas.append(triton_metadata(
            counts, tp_size=tp, tp_rank=g % tp, ep_size=ep, ep_rank=g // tp, topk=topk,
            routing_map=torch.zeros(tokens, counts.shape[1], dtype=torch.bool)))
    return metas


def _uneven_ep2_counts():
    """EP2, 16 experts (8 per rank), 2 source ranks: rank 0's experts get 2 x 512 = 1024
    rows each (8 waves of either tile on 132 SMs), rank 1's 2 x 550 = 1100 (1152 tiles of
    128 x 256 in 9 waves against 1280 of 256 x 128 in 10)."""
    return [[512] * 8 + [550] * 8, [512] * 8 + [550] * 8]


def _alone(meta, prof, tile):
    """This rank's own prediction for `tile` (the world-1 comparison)."""
    from megatron_overlap.resource import plan_gemm2_gatherrs

    return plan_gemm2_gatherrs(meta, GatherRSOptions(backend="triton"), num_sms=NUM_SMS,
                               hidden=H, ffn=F, elem_bytes=2, profile=prof,
                               tile=(tile.bm, tile.bn, tile.bk)).predicted_us


def test_the_group_picks_one_tile_where_each_rank_alone_would_differ(monkeypatch):
    """With a wide tile 10 % faster per tile, rank 0's rows alone favour it (8 waves
    either way), rank 1's the default tile (9 waves against 10): with "all" both ranks
    compare the group's slowest rank (rank 1) and pick the same tile, the default, with the
    same numbers."""
    monkeypatch.setenv(config.TILE_CHOICE_ENV, "all")
    metas = _group_metas(_uneven_ep2_counts(), tp=1, ep=2)
    prof = _profile(0.9)
    assert [int(m.tokens_per_local_expert.sum()) for m in metas] == [8 * 1024, 8 * 1100]
    margin = 1.0 - op.TILE_CHOICE_MARGIN
    assert _alone(metas[0], prof, op.WIDE_TILE) < margin * _alone(metas[0], prof,
                                                                   op.DEFAULT_TILE)
    assert _alone(metas[1], prof, op.WIDE_TILE) >= margin * _alone(metas[1], prof,
                                                                    op.DEFAULT_TILE)
    choices = [_choose(m, prof) for m in metas]
    assert [c.tile for c in choices] == [op.DEFAULT_TILE] * 2
    assert choices[0].predicted_us == choices[1].predicted_us  # bit for bit: same inputs
    assert set(choices[0].predicted_us) == {op.DEFAULT_TILE.name, op.WIDE_TILE.name}
    for c in choices:  # the numbers are the slowest rank's: rank 1, the more rows
        assert c.plan.mode_choice is not None and c.plan.mode_choice.slowest_rank == 1


def test_the_group_choice_follows_the_slowest_ranks_prediction(monkeypatch):
    """The tile whose slowest rank is predicted faster wins, by the margin; the compared
    numbers are the mode model's (`resource.mode.choose_mode`) for each tile."""
    from megatron_overlap.resource.mode import choose_mode

    monkeypatch.setenv(config.TILE_CHOICE_ENV, "all")
    counts = _uneven_ep2_counts()
    chosen = set()
    for ratio, pinned in ((0.9, op.DEFAULT_TILE), (0.7, op.WIDE_TILE), (0.5, op.WIDE_TILE),
                          (1.0, op.DEFAULT_TILE)):
        prof = _profile(ratio)
        choice = _choose(_group_metas(counts, tp=1, ep=2)[0], prof)
        expected = {}
        for t in (op.DEFAULT_TILE, op.WIDE_TILE):
            tt = prof.tile_time(t.bm, t.bn, t.bk)
            tau_ps = round((tt.alpha_us + tt.beta_us * (F // t.bk)) * 1e6)
            mc = choose_mode(np.asarray(counts), tp_size=1, ep_size=2, topk=2, hidden=H,
                             elem_bytes=2, grid=NUM_SMS, tile_ps=tau_ps,
                             tile=(t.bm, t.bn, t.bk), link_gbps=prof.link_bandwidth_gbps,
                             hbm_gbps=prof.hbm_bandwidth_gbps,
                             prereduce_host_us=prof.prereduce_host_us, idle_ppm=tt.idle_ppm)
            expected[t.name] = (mc.prereduce_us + mc.prereduce_host_us
                                if mc.mode == "prereduce" else mc.direct_us)
        assert choice.predicted_us == pytest.approx(expected, rel=1e-9), ratio
        wide_wins = (expected[op.WIDE_TILE.name]
                     < (1.0 - op.TILE_CHOICE_MARGIN) * expected[op.DEFAULT_TILE.name])
        want = op.WIDE_TILE if wide_wins else op.DEFAULT_TILE
        assert choice.tile == want == pinned, (ratio, expected)
        chosen.add(want)
    assert chosen == {op.DEFAULT_TILE, op.WIDE_TILE}  # (both outcomes are exercised)


def test_a_fixed_mode_is_priced_in_that_mode(monkeypatch):
    """moe_gatherrs_prereduce=False (direct) or True: no mode choice in the plan, so the
    group time is the mode model's for that mode (computed once more, alike on every rank);
    "auto" reuses the plan's own mode times (the same numbers)."""
    from megatron_overlap.resource import group_time_us

    monkeypatch.setenv(config.TILE_CHOICE_ENV, "all")
    prof = _profile(0.8)
    metas = _group_metas(_uneven_ep2_counts(), tp=1, ep=2)
    auto = [op.plan_call(m, GatherRSOptions(backend="triton"), device=CUDA, hidden=H, ffn=F,
                         elem_bytes=2, num_sms=NUM_SMS, resources=lambda t: None,
                         profile=prof) for m in metas]
    for prereduce in (False, True):
        opts = GatherRSOptions(backend="triton", prereduce=prereduce)
        fixed = [op.plan_call(m, opts, device=CUDA, hidden=H, ffn=F, elem_bytes=2,
                              num_sms=NUM_SMS, resources=lambda t: None, profile=prof)
                 for m in metas]
        assert fixed[0].predicted_us == fixed[1].predicted_us
        assert fixed[0].tile == fixed[1].tile
        assert fixed[0].plan.mode == ("prereduce" if prereduce else "direct")
        assert fixed[0].plan.mode_choice is None
        mc = auto[0].plan.mode_choice
        got = fixed[0].predicted_us[fixed[0].tile.name]
        if fixed[0].tile == auto[0].tile:
            assert got == pytest.approx(mc.prereduce_us + mc.prereduce_host_us if prereduce
                                        else mc.direct_us, rel=1e-12)
    plan = auto[0].plan
    again = group_time_us(metas[0], dataclasses.replace(plan, mode_choice=None), num_sms=NUM_SMS,
                          hidden=H, ffn=F, elem_bytes=2, profile=prof,
                          tile=(auto[0].tile.bm, auto[0].tile.bn, auto[0].tile.bk))
    assert again == group_time_us(metas[0], plan, num_sms=NUM_SMS, hidden=H, ffn=F,
                                  elem_bytes=2, profile=prof)


def test_no_group_counts_no_choice_at_world_2(monkeypatch):
    """Metadata without the routed counts (or top-k) at world > 1: nothing every rank
    holds alike to compare, so the default tile, planned alone."""
    monkeypatch.setenv(config.TILE_CHOICE_ENV, "all")
    meta = _group_metas(_uneven_ep2_counts(), tp=1, ep=2)[0]
    for change in (dict(routed_counts=None), dict(topk=None)):
        choice = _choose(dataclasses.replace(meta, **change), _profile(0.5))
        assert choice.tile == op.DEFAULT_TILE and len(choice.predicted_us) == 1


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (1, 4)])
def test_every_rank_of_tp_and_ep_groups_agrees(monkeypatch, tp, ep):
    """Random uneven counts over TP2 (SP), TP2 x EP2 and EP4: every rank picks the same tile
    and compares the same numbers."""
    monkeypatch.setenv(config.TILE_CHOICE_ENV, "all")
    rng = np.random.default_rng(tp * 10 + ep)
    for ratio in (0.5, 0.85, 0.95, 1.1):
        counts = rng.integers(0, 1500, size=(tp * ep, 8 * ep))
        choices = [_choose(m, _profile(ratio)) for m in _group_metas(counts, tp, ep)]
        assert len({c.tile for c in choices}) == 1, ratio
        assert all(c.predicted_us == choices[0].predicted_us for c in choices), ratio
        assert len(choices[0].predicted_us) == 2


# ---- calibrate.py --tiles -----------------------------------------------------------------

calibrate = _load("calibrate")


def test_calibrate_tiles_default_to_the_candidates():
    assert calibrate.candidate_tiles() == list(op.TILE_CANDIDATES)
    assert calibrate.candidate_tiles([]) == []
    assert calibrate.candidate_tiles(["256x128x64w8s4"]) == [op.WIDE_TILE]


@pytest.mark.parametrize("names, message", [
    # another configuration of a candidate's shape: its time would be read as the
    # candidate's (a profile entry is keyed by shape and epilogue)
    (["256x128x64w4s2"], "expected one of the resource manager's candidate tiles"),
    (["128x256x64w8s3"], "expected one of the resource manager's candidate tiles"),
    (["128x128x64w8s3tma"], "expected one of the resource manager's candidate tiles"),
    (["256x128x64w8s4", "256x128x64w8s4"], "listed twice"),
    (["bogus"], "'bogus': expected one of"),
])
def test_calibrate_refuses_bad_tiles_before_measuring(names, message, tmp_path, capsys):
    out = tmp_path / "p.yaml"
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--dry-run", "--out", str(out), "--tiles", *names])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def _base_with_wide_tile(tmp_path):
    """A base profile YAML with a `WIDE_TILE` entry (0.9 x the H100's default tile)."""
    path = tmp_path / "base-with-wide.yaml"
    save_profile(_profile(0.9), path)
    return path


def test_calibrate_dry_run_writes_the_candidate_entries(tmp_path):
    out = tmp_path / "h100.yaml"
    base_path = _base_with_wide_tile(tmp_path)
    assert calibrate.main(["--dry-run", "--base", str(base_path), "--tma-store", "--out",
                           str(out)]) == 0
    prof, base = load_profile(out), load_profile(base_path)
    w = op.WIDE_TILE
    assert [t.key for t in prof.tile_times] == [
        (128, 256, 64, False), (128, 256, 64, True), (w.bm, w.bn, w.bk, False)]
    # (generated from the base's entry for it)
    got, want = prof.tile_time(w.bm, w.bn, w.bk), base.tile_time(w.bm, w.bn, w.bk)
    assert (got.alpha_us, got.beta_us) == pytest.approx((want.alpha_us, want.beta_us), abs=1e-3)
    shapes = {(r["bm"], r["bn"], r["bk"], r["tma_store"]) for r in prof.extra["tile_sweep"]}
    assert shapes == {t.key for t in prof.tile_times}
    assert {r["tile"] for r in prof.extra["tile_sweep"]} == {
        op.DEFAULT_TILE.name, op.DEFAULT_TMA_TILE.name, w.name}


def test_calibrate_without_a_candidate_writes_no_candidate_entry(tmp_path):
    """A candidate not measured in the run is not copied from the base (the choice would
    compare another run's or GPU's time with this run's default tile): not offered."""
    out = tmp_path / "h100.yaml"
    base_path = _base_with_wide_tile(tmp_path)
    assert calibrate.main(["--dry-run", "--base", str(base_path), "--tiles", "--out",
                           str(out)]) == 0
    prof, w = load_profile(out), op.WIDE_TILE
    assert load_profile(base_path).has_tile_time(w.bm, w.bn, w.bk)
    assert not prof.has_tile_time(w.bm, w.bn, w.bk)
    assert not any(r.get("bm") == 256 for r in prof.extra["tile_sweep"])
    choice = _choose(_meta([1024] * 8), prof)
    assert list(choice.predicted_us) == [op.DEFAULT_TMA_TILE.name]


def test_old_sweep_rows_without_a_shape_fit_the_default_tile():
    rows = [dict(ffn=f, ksteps=f // 64, ctas_per_sm=1, tau_us=2.0 + 0.5 * (f // 64))
            for f in (384, 1408, 14336)]
    base = load_profile("h200")
    prof = calibrate.build_profile("x", base, base.gpu, rows, [], 1.0, 1.0, 1.0, "test",
                                   link_from_base=True)
    t = prof.tile_time(128, 256, 64)
    assert (t.alpha_us, t.beta_us) == pytest.approx((2.0, 0.5))


def test_profile_with_a_new_tile_round_trips(tmp_path):
    prof = _profile(0.9)
    path = tmp_path / "p.yaml"
    save_profile(prof, path)
    again = load_profile(path)
    assert again.has_tile_time(256, 128, 64) and again.tile_time(256, 128, 64) == \
        prof.tile_time(256, 128, 64)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_sms=0), ValueError, "num_sms=0"),
    (dict(num_sms=True), TypeError, "num_sms=True"),
    (dict(hidden=-1), ValueError, "hidden=-1"),
    (dict(ffn=2.5), TypeError, "ffn=2.5"),
    (dict(elem_bytes=3), ValueError, "elem_bytes=3"),
    (dict(elem_bytes=False), TypeError, "elem_bytes=False"),
    (dict(tma_store=1), TypeError, "tma_store=1"),
    (dict(tile=(128, 256)), TypeError, "tile="),
    (dict(tile=(128, 0, 64)), ValueError, "tile BN=0"),
    (dict(meta="meta"), TypeError, "GatherRSMetadata"),
    (dict(plan=None), TypeError, "Plan"),
])
@pytest.mark.parametrize("fixed_mode", [False, True])
def test_group_time_refuses_bad_inputs(kwargs, error, match, fixed_mode):
    """`resource.group_time_us` checks its inputs as `plan_gemm2_gatherrs` does, also where
    it reuses the plan's own mode times (they are then not recomputed from the inputs)."""
    from megatron_overlap.resource import group_time_us

    metas = _group_metas(_uneven_ep2_counts(), tp=1, ep=2)
    opts = GatherRSOptions(backend="triton", prereduce=False if fixed_mode else "auto")
    call = op.plan_call(metas[0], opts, device=CUDA, hidden=H, ffn=F, elem_bytes=2,
                        num_sms=NUM_SMS, resources=lambda t: None, profile="h100")
    assert (call.plan.mode_choice is None) == fixed_mode
    args = dict(meta=metas[0], plan=call.plan, num_sms=NUM_SMS, hidden=H, ffn=F,
                elem_bytes=2, profile="h100", tile=(call.tile.bm, call.tile.bn, call.tile.bk),
                tma_store=call.tile.tma_store)
    assert group_time_us(**args) > 0
    args.update(kwargs)
    with pytest.raises(error, match=match):
        group_time_us(**args)


def test_whole_wave_rows_fill_every_tiles_waves():
    """The calibration's default sweep (v6.2): rows per expert on which each tile's count
    is a multiple of its grid, the smallest such, with >= min_waves waves."""
    from megatron_overlap.bench.workloads import whole_wave_rows

    shapes = [(128, 256, NUM_SMS), (256, 128, NUM_SMS)]
    r = whole_wave_rows(shapes, num_experts=8, topk=2, hidden=H)
    assert r == 8448  # lcm(256, 132) x 8 experts / 8 = 64 waves of either tile
    r = whole_wave_rows(shapes + [(128, 128, 2 * NUM_SMS)], num_experts=8, topk=2, hidden=H)
    for bm, bn, g in shapes + [(128, 128, 2 * NUM_SMS)]:
        assert 8 * (r // bm) * -(-H // bn) % g == 0
    smaller = [r for r in range(256, 8448, 256)
               if all(8 * (r // bm) * (H // bn) % g == 0 for bm, bn, g in shapes)]
    assert smaller == []
    assert whole_wave_rows([(128, 256, 8)], num_experts=8, topk=2, hidden=H,
                           min_waves=40) // 128 * 8 * 16 // 8 >= 40
    with pytest.raises(ValueError, match="no rows per expert"):
        whole_wave_rows(shapes, num_experts=8, topk=2, hidden=H, max_rows=4096)
    with pytest.raises(ValueError, match="topk=0"):
        whole_wave_rows(shapes, num_experts=8, topk=0, hidden=H)


@pytest.mark.parametrize("sweep", ["whole-waves", "uniform"])
def test_calibration_sweep_rows(sweep):
    """calibrate.py's tile-time sweep metadata: whole-waves gives every swept tile a
    whole-wave tile count at its planned grid; uniform is the --tokens draw (before v6.2)."""
    from megatron_overlap.config import GatherRSOptions as Opts
    from megatron_overlap.resource import plan_gemm2_gatherrs

    args = calibrate.argparse.Namespace(sweep=sweep, tokens=8192, seed=0, hidden=H,
                                        ffn=[6400, 14336])
    tiles = [op.DEFAULT_TILE, op.DEFAULT_TMA_TILE, op.WIDE_TILE]
    prof = load_profile("h100")
    meta = calibrate.sweep_meta(args, tiles, prof, NUM_SMS)
    counts = meta.tokens_per_local_expert.tolist()
    if sweep == "uniform":
        assert sum(counts) == 8192 * 2 and len(set(counts)) > 1
        return
    assert counts == [2816] * 6  # 16 waves of either tile on 132 SMs
    for tile in tiles:
        plan = plan_gemm2_gatherrs(meta, Opts(backend="triton"), num_sms=NUM_SMS, hidden=H,
                                   ffn=6400, tma_store=tile.tma_store, profile=prof,
                                   tile=(tile.bm, tile.bn, tile.bk))
        assert plan.breakdown.local_tiles == 16 * plan.num_ctas


def test_whole_wave_sweep_picks_the_fewest_waves_at_the_target():
    """The sweep's experts and rows: whole waves of every tile, the fewest >= the target
    (a long sweep runs at lower clocks: run e), ties to 8 experts."""
    from megatron_overlap.bench.workloads import whole_wave_sweep

    for shapes, hidden in (([(128, 256, NUM_SMS), (256, 128, NUM_SMS)], H),
                           ([(128, 256, 114), (256, 128, 114)], H),
                           ([(128, 256, NUM_SMS), (256, 128, NUM_SMS)], 2048)):
        experts, r = whole_wave_sweep(shapes, topk=2, hidden=hidden)
        waves = [experts * (r // bm) * -(-hidden // bn) / g for bm, bn, g in shapes]
        assert all(w == int(w) and w >= 16 for w in waves), (experts, r, waves)
        assert min(waves) <= 16 or experts == 1
    assert whole_wave_sweep([(128, 256, NUM_SMS), (256, 128, NUM_SMS)], topk=2,
                            hidden=H) == (6, 2816)
    with pytest.raises(ValueError, match="no experts"):
        whole_wave_sweep([(128, 256, 7919)], topk=2, hidden=H, max_experts=2, max_rows=1024)
