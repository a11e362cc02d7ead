"""Tile times per output width H (`TileTime.hidden`, v6.5): the profile's lookup of the
entry nearest a call's H, its validation and YAML round trip, the resource manager's tile
choice priced with the entry of the call's H, and `launch/calibrate.py --hidden` writing
one set of entries per H. CPU only: `plan_call` plans for a CUDA device without touching
one."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_overlap import config
from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import triton_metadata
from megatron_overlap.ops import triton_gemm2_gatherrs as op
from megatron_overlap.resource.profile import (
    TileTime,
    load_profile,
    profile_from_dict,
    save_profile,
)

REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")  # a device name only: nothing is allocated on it
NUM_SMS = 132


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(alpha, hidden, bm=128, bn=256, tma=False):
    return TileTime(bm, bn, 64, ctas_per_sm=1, alpha_us=alpha, beta_us=1.0, tma_store=tma,
                    hidden=hidden)


def _with(entries, base="h100"):
    return dataclasses.replace(load_profile(base), name="per-h", tile_times=tuple(entries))


@pytest.fixture(autouse=True)
def _no_variables(monkeypatch):
    for name in (config.TILE_CHOICE_ENV, config.TMA_STORE_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("hidden, want", [
    (2048, 2048), (4096, 4096), (1024, 2048), (16384, 4096), (2896, 2048), (2897, 4096),
    (np.int64(3000), 4096), (None, 4096)])
def test_the_entry_nearest_the_calls_hidden_is_taken(hidden, want):
    """Same H first, else the nearest by ratio (the geometric mean of 2048 and 4096 is
    2896.3), a numpy int as an int; no H: the first entry in the file."""
    prof = _with([_entry(2.0, 4096), _entry(1.0, 2048)])
    assert prof.tile_time(128, 256, 64, hidden=hidden).hidden == want


def test_an_entry_without_hidden_serves_every_h_after_the_measured_ones():
    prof = _with([_entry(1.0, None), _entry(2.0, 8192)])
    assert prof.tile_time(128, 256, 64, hidden=8192).alpha_us == 2.0
    assert prof.tile_time(128, 256, 64, hidden=1024).alpha_us == 2.0  # nearest measured
    only_old = _with([_entry(1.0, None)])
    assert only_old.tile_time(128, 256, 64, hidden=1024).alpha_us == 1.0


@pytest.mark.parametrize("entries, hidden, want", [
    ((4096, 1024), 2048, 1024),  # one octave from each
    ((4608, 2048), 3072, 2048),  # 1.5 x from each: exact, not float log2
    ((4500, 2000), 3000, 2000)])
def test_a_tie_between_two_hs_takes_the_smaller(entries, hidden, want):
    prof = _with([_entry(2.0, entries[0]), _entry(1.0, entries[1])])
    assert prof.tile_time(128, 256, 64, hidden=hidden).hidden == want


def test_the_tma_fallback_takes_the_register_entry_of_the_calls_h():
    prof = _with([_entry(1.0, 2048), _entry(2.0, 4096)])
    with pytest.warns(UserWarning, match="no TMA-store tile time"):
        assert prof.tile_time(128, 256, 64, tma_store=True, hidden=4096).hidden == 4096


@pytest.mark.parametrize("hidden", [0, -1, 2.0, "4096", True])
def test_a_bad_hidden_is_refused(hidden):
    prof = _with([_entry(1.0, 4096)])
    with pytest.raises(ValueError, match="hidden"):
        prof.tile_time(128, 256, 64, hidden=hidden)
    with pytest.raises(ValueError, match="tile_times.hidden"):
        _entry(1.0, hidden)


def test_two_entries_at_one_h_are_refused_and_at_two_hs_allowed():
    with pytest.raises(ValueError, match="appears twice"):
        _with([_entry(1.0, 4096), _entry(2.0, 4096)])
    with pytest.raises(ValueError, match="appears twice"):
        _with([_entry(1.0, None), _entry(2.0, None)])
    assert len(_with([_entry(1.0, 4096), _entry(2.0, 2048), _entry(3.0, None)]).tile_times) == 3


def test_hidden_round_trips_through_yaml_and_is_left_out_where_unset(tmp_path):
    prof = _with([_entry(1.0, 2048), _entry(2.0, 4096), _entry(3.0, None, tma=True)])
    path = tmp_path / "p.yaml"
    save_profile(prof, path)
    assert load_profile(path).tile_times == prof.tile_times
    entries = prof.to_dict()["tile_times"]
    assert [e.get("hidden") for e in entries] == [2048, 4096, None]
    assert "hidden" not in entries[2]


def test_the_yaml_loader_names_hidden_among_the_optional_keys():
    d = _with([_entry(1.0, 2048)]).to_dict()
    d["tile_times"][0]["width"] = 2048
    with pytest.raises(ValueError, match=r"unknown keys \['width'\].*hidden"):
        profile_from_dict(d)
    d["tile_times"][0].pop("width")
    d["tile_times"][0]["hidden"] = "wide"
    with pytest.raises(ValueError, match="tile_times.hidden='wide'"):
        profile_from_dict(d)


def _meta(rows_per_expert):
    experts = len(rows_per_expert)
    counts = np.array([list(rows_per_expert)], dtype=np.int64)
    return triton_metadata(counts, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, topk=1,
                           routing_map=torch.zeros(int(counts.sum()), experts, dtype=torch.bool))


def test_the_tile_choice_prices_each_h_with_its_own_entries():
    """The wide tile 10 % faster per wave at H = 4096, 10 % slower at H = 2048 (the other
    entries alike at both): the choice follows the call's H, and a profile with the
    H = 4096 entries alone picks wide at both (the v6.5 DeepSeek-V2-Lite case)."""
    w = op.WIDE_TILE
    both = []
    for hidden, ratio in ((2048, 1.1), (4096, 0.9)):
        both += [_entry(2.0, hidden), _entry(2.0, hidden, tma=True),
                 TileTime(w.bm, w.bn, w.bk, ctas_per_sm=1, alpha_us=2.0 * ratio,
                          beta_us=ratio, hidden=hidden)]
    both = [dataclasses.replace(t, beta_us=1.0) if t.bm == 128 else t for t in both]
    only_4096 = [t for t in both if t.hidden == 4096]
    meta = _meta([1024] * 8)  # 1024 / 128 and / 256: whole tiles of both shapes

    def choose(prof, hidden):
        return op.plan_call(meta, GatherRSOptions(backend="triton"), device=CUDA, hidden=hidden,
                            ffn=1408, elem_bytes=2, num_sms=NUM_SMS, resources=lambda t: None,
                            profile=_with(prof)).tile

    assert choose(both, 4096) == w
    assert choose(both, 2048) == op.DEFAULT_TMA_TILE
    assert choose(only_4096, 2048) == w


def test_calibrate_dry_run_writes_one_set_of_entries_per_hidden(tmp_path, capsys):
    calibrate = _load("calibrate")
    base = _with([_entry(1.0, 2048), _entry(5.0, 4096), _entry(1.5, 2048, tma=True),
                  _entry(5.5, 4096, tma=True)])
    base_path, out = tmp_path / "base.yaml", tmp_path / "out.yaml"
    save_profile(base, base_path)
    assert calibrate.main(["--dry-run", "--base", str(base_path), "--tma-store", "--tiles",
                           "--hidden", "4096", "2048", "4096", "--out", str(out)]) == 0
    assert "H 2048" in capsys.readouterr().out
    prof = load_profile(out)
    assert [(t.tma_store, t.hidden) for t in prof.tile_times] == [
        (False, 2048), (False, 4096), (True, 2048), (True, 4096)]
    for t in prof.tile_times:  # each fitted from the base's entry at its own H
        want = base.tile_time(128, 256, 64, t.tma_store, hidden=t.hidden)
        assert (t.alpha_us, t.beta_us) == pytest.approx((want.alpha_us, want.beta_us), abs=1e-3)
    assert {r["hidden"] for r in prof.extra["tile_sweep"]} == {2048, 4096}


def test_calibrate_refuses_a_tma_hidden_the_tma_epilogue_cannot_store(tmp_path, capsys):
    calibrate = _load("calibrate")
    with pytest.raises(SystemExit) as err:
        calibrate.main(["--dry-run", "--tma-store", "--hidden", "4096", "2052", "--out",
                        str(tmp_path / "x.yaml")])
    assert err.value.code == 2
    assert "--hidden 2052" in capsys.readouterr().err


def test_calibrate_dry_run_tails_come_from_the_first_hiddens_entries(tmp_path, capsys):
    """The dry run's last-wave rows are generated from the base's entry at --hidden[0], so
    the fitted idle_wave_cost is that entry's (not the first entry's in the file)."""
    calibrate = _load("calibrate")
    base = _with([dataclasses.replace(_entry(1.0, 2048), idle_wave_cost=0.5),
                  dataclasses.replace(_entry(5.0, 4096), idle_wave_cost=0.9)])
    base_path, out = tmp_path / "base.yaml", tmp_path / "out.yaml"
    save_profile(base, base_path)
    assert calibrate.main(["--dry-run", "--base", str(base_path), "--tiles", "--hidden",
                           "4096", "--out", str(out)]) == 0
    (entry,) = load_profile(out).tile_times
    assert entry.hidden == 4096 and entry.idle_wave_cost == pytest.approx(0.9, abs=0.01)


def test_load_profile_refuses_an_empty_name_and_non_path_types_by_name():
    from megatron_overlap.resource import load_profile

    with pytest.raises(ValueError, match="hardware profile '': expected a profile name"):
        load_profile("")
    for bad in (5, b"h200", ["h200"]):
        with pytest.raises(TypeError, match="expected a profile name or a YAML path"):
            load_profile(bad)
