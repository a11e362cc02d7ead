"""launch/bench_layer.py end to end on the CPU (tiny model, gloo), as a user runs it.

* world 1 (`python3 launch/bench_layer.py`) and world 2 (`torchrun`, layouts ep2 and tp2 with
  SP): exit status 0, one summary line per workload, well-formed rows for "off", "on" and
  "off-grouped" that agree, "off-te" skipped with its reason where Transformer Engine is
  missing;
* a broken flag-on path (routed output halved) exits with status 1 and says which variant;
* a bad layout exits with status 2; layout parsing.

Quick by design (one short sequence, 1 warm-up + 2 timed forwards): correctness and row
writing, not speed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import (
    BROKEN_FLAG_ON,
    REPO,
    explain,
    run_launcher,
)

LAUNCHER = REPO / "launch" / "bench_layer.py"
SEQ = 32
COMMON = ["--device", "cpu", "--model", "tiny", "--seq-lengths", str(SEQ), "--warmup", "1",
          "--iters", "2"]
TIMEOUT_S = 240
FP32_TOLERANCE = 1e-5  # bench_layer.TOLERANCE["fp32"]

def _launch(tmp_path: Path, nproc: int, *args: str, script: Path = LAUNCHER):
    return run_launcher(LAUNCHER, tmp_path, nproc, [*COMMON, *args], out_name="layer.jsonl",
                        timeout_s=TIMEOUT_S, wrapper=None if script == LAUNCHER else script)


_explain = explain


@functools.cache
def _module():
    spec = importlib.util.spec_from_file_location("bench_layer_launcher", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _te_imports() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def _check_rows(rows: list, layouts: dict, world: int) -> None:
    """layouts: {layout name: (tp, dp)}."""
    expected = ["off", "on", "off-grouped"] + (["off-te"] if _te_imports() else [])
    by_layout = {}
    for row in rows:
        by_layout.setdefault(row["layout"], []).append(row)
    assert sorted(by_layout) == sorted(layouts), sorted(by_layout)
    for layout, (tp, dp) in layouts.items():
        group = by_layout[layout]
        assert [r["variant"] for r in group] == expected, layout
        on = next(r for r in group if r["variant"] == "on")
        for r in group:
            assert r["schema"] == "megatron_overlap.layer/1" and r["benchmark"] == "layer"
            assert (r["model"], r["seq_length"], r["world_size"]) == ("tiny", SEQ, world)
            assert (r["tp"], r["dp"], r["sequence_parallel"]) == (tp, dp, tp > 1)
            assert r["tokens_per_rank"] == SEQ // tp and r["global_tokens"] == SEQ * dp
            assert r["agree"] is True, r
            assert len(r["ms_all"]) == 2 and 0 < r["ms_p20"] <= r["ms_p50"] <= r["ms_p80"]
            assert r["speedup_over_on"] == pytest.approx(r["ms_p50"] / on["ms_p50"])
            # On the CPU the host time is the forward's time
            assert r["host_ms_p50"] == pytest.approx(r["ms_p50"])
            assert r["label"] and r["experts_impl"]
            assert r["dtype"] == "fp32" and r["gpu"] == "cpu" and r["own_peak_bytes"] is None
            assert r["param_bytes"] > 0
            assert r["torch"] == torch.__version__ and r["megatron_core"].startswith("0.19")
            if not _te_imports():
                assert "Transformer Engine" in r["skipped_baselines"]["off-te"]
            if r["variant"] != "off":
                assert r["errors"]["max_rel_diff"] <= FP32_TOLERANCE, r["errors"]
                assert r["errors"]["nonfinite"] == 0
        assert on["backend"] == "reference" and on["fused_calls"] == 2
        assert on["moe_gatherrs_overlap"] is True
        assert "GatherRSSequentialMLP" in on["label"] and "plan" in on["label"]
        grouped = next(r for r in group if r["variant"] == "off-grouped")
        assert "GroupedGEMMSequentialMLP" in grouped["label"]
        assert grouped["experts_impl"].startswith("grouped FC1:"), grouped["experts_impl"]


@pytest.mark.slow
def test_bench_layer_world1(tmp_path):
    proc, rows = _launch(tmp_path, 1, "--host-breakdown")
    assert proc.returncode == 0, _explain(proc)
    assert f"layer tiny tp1/ep1/dp1/sp0 seq {SEQ}: off " in proc.stdout, _explain(proc)
    assert f"== host us per forward tiny tp1/ep1/dp1/sp0 seq {SEQ}" in proc.stdout
    stages = {r["variant"]: r["host_breakdown_us"] for r in rows}
    for variant, stage in stages.items():  # the layer's own stages in every variant
        assert stage["forward"] >= stage["layer.routed_experts_compute"] > 0, (variant, stage)
        assert stage["layer.route"] > 0 and stage["token_dispatcher.dispatch_preprocess"] > 0
        assert 0 <= stage["python.gc"] < stage["forward"] * 10, (variant, stage)
    assert {"mo.plan", "mo.gemm2_gatherrs", "experts.forward_fc1",
            "token_dispatcher.prepare_combine"} <= set(stages["on"])
    assert not any(k.startswith("mo.") for k in stages["off"])
    assert "experts.forward" in stages["off"]
    if not _te_imports():
        assert "skipping off-te: Transformer Engine" in proc.stdout, _explain(proc)
    _check_rows(rows, {"tp1/ep1/dp1/sp0": (1, 1)}, 1)
    # The report reads these rows (CPU rows only with --include-cpu).
    from megatron_overlap.bench import make_report

    report = tmp_path / "report.md"
    assert make_report.main([str(tmp_path / "layer.jsonl"), "--out", str(report),
                             "--include-cpu", "--no-plots"]) == 0
    text = report.read_text()
    assert f"| tiny | tp1/ep1/dp1/sp0 | {SEQ} |" in text and "python3 launch/bench_layer.py" in text


@pytest.mark.slow
def test_bench_layer_world2_ep_and_tp(tmp_path):
    proc, rows = _launch(tmp_path, 2, "--layouts", "ep2", "tp2", "--profile")
    assert proc.returncode == 0, _explain(proc)
    _check_rows(rows, {"tp1/ep2/dp2/sp0": (1, 2), "tp2/ep1/dp1/sp1": (2, 1)}, 2)
    # the reference backend on the CPU runs no GEMM2 epilogue
    assert all(row["tma_store"] is False for row in rows), rows
    for variant in ("on", "off-grouped"):  # --profile: one table per variant and workload
        assert f"== profile tiny tp1/ep2/dp2/sp0 seq {SEQ} {variant}" in proc.stdout
    assert "cpu_time_total" not in proc.stdout and "Self CPU" in proc.stdout


@pytest.mark.slow
def test_broken_flag_on_exits_1(tmp_path):
    wrapper = tmp_path / "broken.py"
    wrapper.write_text(BROKEN_FLAG_ON)
    proc, rows = _launch(tmp_path, 1, "--baselines", "off", script=wrapper)
    assert proc.returncode == 1, _explain(proc)
    assert "ERROR: on disagrees with off" in proc.stderr, _explain(proc)
    assert "DISAGREE: ['on']" in proc.stdout, _explain(proc)
    on = next(r for r in rows if r["variant"] == "on")
    assert on["agree"] is False and on["errors"]["max_rel_diff"] > 0.1


def test_bad_layout_exits_2(tmp_path):
    proc, rows = _launch(tmp_path, 1, "--layouts", "ep3")
    assert proc.returncode == 2, _explain(proc)
    assert "tp1ep3" in proc.stderr and "world size 1" in proc.stderr, _explain(proc)
    assert rows == []


def test_fc1_impl_reaches_the_flag_on_experts(tmp_path):
    """--fc1-impl sets the flag-on experts' FC1 (CPU's "auto" is the loop: grouped asked
    for explicitly here), recorded in the rows; the variants still agree with off."""
    proc, rows = _launch(tmp_path, 1, "--baselines", "off", "--fc1-impl", "grouped")
    assert proc.returncode == 0, _explain(proc)
    on = next(r for r in rows if r["variant"] == "on")
    assert on["fc1_impl"] == "grouped" and on["agree"], on
    assert on["bias_activation_fusion"] is False and on["fc1_chunk_bytes"] == 128 * 2**20, on
    # no GPU kernel on the CPU: no TMA epilogue ran (unset variable: recorded as "")
    assert on["tma_store"] is False and on["tma_store_env"] == "", on
    # no Triton combine ran on the CPU: no GEMM2 tile, no tile choice
    assert on["gemm2_tile"] is None and on["tile_choice"] is False, on
    from megatron_overlap.resource.solver import implementation_name

    assert on["resource_solver"] == implementation_name(), on  # the launcher's, this one's
    assert on["experts_impl"].startswith("grouped FC1: "), on["experts_impl"]
    proc, rows = _launch(tmp_path, 1, "--baselines", "off", "--fc1-impl", "loop")
    assert proc.returncode == 0, _explain(proc)
    on = [r for r in rows if r["variant"] == "on"][-1]
    assert on["experts_impl"].startswith("loop: fc1_impl='loop'"), on["experts_impl"]


#: Wrapper that records the rows of every call of Megatron's fused weighted SwiGLU (the
#: MLP's `bias_activation_fusion` path) and prints them at exit.
FUSED_SWIGLU_SPY = """
import atexit, runpy, sys
import megatron.core.transformer.mlp as mlp

seen = []
original = mlp.weighted_bias_swiglu_impl

def spy(x, *args, **kwargs):
    seen.append(x.shape[0])
    return original(x, *args, **kwargs)

mlp.weighted_bias_swiglu_impl = spy
atexit.register(lambda: print("FUSED_SWIGLU_ROWS=" + ",".join(map(str, seen)), flush=True))
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on the CPU (Megatron's fused SwiGLU) needs a C++ "
                           "compiler")
def test_bias_activation_fusion_runs_megatrons_fused_swiglu(tmp_path):
    """--bias-activation-fusion sets the config of every variant: Megatron's fused SwiGLU
    with the probabilities (torch.compile'd, compiled on the first forwards), in the flag-off
    experts' loop and the flag-on grouped FC1 alike; the variants agree and the rows say so."""
    spy = tmp_path / "spy_fused_swiglu.py"
    spy.write_text(FUSED_SWIGLU_SPY)
    proc, rows = _launch(tmp_path, 1, "--baselines", "off", "--fc1-impl", "grouped",
                         "--bias-activation-fusion", script=spy)
    assert proc.returncode == 0, _explain(proc)
    assert {r["variant"] for r in rows} == {"off", "on"}, rows
    for r in rows:
        assert r["bias_activation_fusion"] is True and r["agree"], r
    # Megatron's fused SwiGLU ran: per expert for "off" (the tiny model's 8 experts, top-2),
    # and once over all SEQ * 2 rows for the flag-on grouped FC1
    assert "FUSED_SWIGLU_ROWS=" in proc.stdout, _explain(proc)
    rows_seen = [int(n) for n in proc.stdout.split("FUSED_SWIGLU_ROWS=")[-1].split()[0]
                 .split(",") if n]
    assert len(rows_seen) > 8 and SEQ * 2 in rows_seen, rows_seen


def test_bias_activation_fusion_reaches_every_variants_config():
    from megatron_overlap.models import load_model_shape

    mod = _module()
    shape = load_model_shape("tiny")
    for argv, fused in (([], False), (["--bias-activation-fusion"], True)):
        run = mod.resolve_args(mod.build_parser().parse_args([*argv, "--device", "cpu"]), 1)
        for flag in (False, True):
            config = mod.build_config(shape, run, 1, 1, flag=flag, initialize=False)
            assert config.bias_activation_fusion is fused, (argv, flag)


def test_sequence_longer_than_the_model_takes_exits_2(tmp_path):
    """A sequence length past the model's max_position_embeddings (tiny: 512), even one
    that does not fit in an int64, is refused by name before anything runs."""
    for seq in ("1024", "99999999999999999999"):
        proc, rows = _launch(tmp_path, 1, "--seq-lengths", seq)
        assert proc.returncode == 2 and rows == [], _explain(proc)
        assert f"--seq-lengths {seq}: longer than tiny.max_position_embeddings=512" in \
            proc.stderr, _explain(proc)


def test_prereduce_needs_the_triton_backend():
    mod = _module()
    parser = mod.build_parser()
    with pytest.raises(ValueError, match="--prereduce on needs the Triton backend"):
        mod.resolve_args(parser.parse_args(["--prereduce", "on", "--backend", "reference"]), 1)
    run = mod.resolve_args(parser.parse_args(["--prereduce", "on", "--device", "cpu"]), 1)
    assert run.prereduce is True and run.backend == "auto"
    run = mod.resolve_args(parser.parse_args(["--backend", "reference", "--device", "cpu"]), 1)
    assert run.prereduce == "auto"  # the default: allowed with any backend
    assert mod.resolve_args(parser.parse_args(["--prereduce", "off", "--device", "cpu"]),
                            1).prereduce is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--prereduce", "yes"])
    assert parser.parse_args(["--prereduce"]).prereduce is True  # the bare flag: on


def test_trace_dir_needs_profile_and_a_writable_place(tmp_path):
    mod = _module()
    parser = mod.build_parser()
    with pytest.raises(ValueError, match="add --profile"):
        mod.resolve_args(parser.parse_args(["--trace-dir", str(tmp_path / "t")]), 1)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot create it"):
        mod.resolve_args(parser.parse_args(["--profile", "--trace-dir",
                                            str(blocker / "sub")]), 1)


@pytest.mark.parametrize("text, layout", [("ep2", (1, 2)), ("tp2", (2, 1)),
                                          ("tp2ep4", (2, 4)), ("tp1ep1", (1, 1))])
def test_parse_layout(text, layout):
    assert _module().parse_layout(text) == layout


@pytest.mark.parametrize("text", ["", "pp2", "ep", "tp0", "ep2tp2", "tp-1", "ep01",
                                  "tp02ep1", "ep0", "ep1\u0660", "ep\u0662"])
def test_parse_layout_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _module().parse_layout(text)


def test_alt_env_interleaves_a_second_flag_on_variant(tmp_path):
    """--alt-env: 'on-alt' is the flag-on layer run with the variable set (here a tiny FC1
    chunk, so its FC1 runs in more row chunks than 'on''s), timed in the same rounds, agreeing
    with off like 'on'; the variable is unset again for every other forward."""
    proc, rows = _launch(tmp_path, 1, "--baselines", "off", "--fc1-impl", "grouped",
                         "--alt-env", "MEGATRON_OVERLAP_FC1_CHUNK_MB=0.001")
    assert proc.returncode == 0, _explain(proc)
    by = {r["variant"]: r for r in rows}
    assert list(by) == ["off", "on", "on-alt"], list(by)
    on, alt = by["on"], by["on-alt"]
    assert alt["alt_env"] == "MEGATRON_OVERLAP_FC1_CHUNK_MB=0.001" and on["alt_env"] is None
    assert alt["agree"] and alt["moe_gatherrs_overlap"] and alt["fused_calls"] == 2
    assert on["fused_calls"] == 2 and len(alt["ms_all"]) == 2
    assert "row chunks" in alt["experts_impl"], alt["experts_impl"]
    assert "row chunks" not in on["experts_impl"], on["experts_impl"]  # unset again for 'on'
    # each row records the settings its forwards ran with
    assert on["fc1_chunk_bytes"] == 128 * 2**20 and alt["fc1_chunk_bytes"] < 2**11, alt
    assert alt["speedup_over_on"] == pytest.approx(alt["ms_p50"] / on["ms_p50"])
    assert " on-alt " in proc.stdout, _explain(proc)


@pytest.mark.parametrize("value, message", [
    ("FC1_CHUNK_MB=1", "expected MEGATRON_OVERLAP_<NAME>=<value>"),
    ("MEGATRON_OVERLAP_TMA_STORE", "expected MEGATRON_OVERLAP_<NAME>=<value>"),
    ("MEGATRON_OVERLAP_TMA_STORE=2", "MEGATRON_OVERLAP_TMA_STORE"),
    ("MEGATRON_OVERLAP_TMA_STOR=1", "not a variable of the fused path; expected one of "
                                    "MEGATRON_OVERLAP_TMA_STORE"),
    ("MEGATRON_OVERLAP_FAST_LAUNCH=0", "is '0' already"),
])
def test_alt_env_refuses_bad_values(value, message, monkeypatch):
    module = _module()
    monkeypatch.delenv("MEGATRON_OVERLAP_TMA_STORE", raising=False)
    monkeypatch.setenv("MEGATRON_OVERLAP_FAST_LAUNCH", "0")
    with pytest.raises(ValueError, match=message):
        module.parse_alt_env(value)
    import os

    assert "MEGATRON_OVERLAP_TMA_STORE" not in os.environ  # restored after the check
    assert module.parse_alt_env("MEGATRON_OVERLAP_FAST_LAUNCH=1") == (
        "MEGATRON_OVERLAP_FAST_LAUNCH", "1")
    assert os.environ["MEGATRON_OVERLAP_FAST_LAUNCH"] == "0"


@pytest.mark.parametrize("value, group_sizes", [
    ("MEGATRON_OVERLAP_HOST_TABLES=fused", (1,)),
    ("MEGATRON_OVERLAP_HOST_TABLES=", (1,)),
    ("MEGATRON_OVERLAP_FAST_LAUNCH=1", (1,)),
    ("MEGATRON_OVERLAP_TILE_LIST=device", (1,)),
    ("MEGATRON_OVERLAP_TMA_STORE=1", (1,)),  # unset: TMA at a group of 1 rank
    ("MEGATRON_OVERLAP_TMA_STORE=0", (2,)),  # unset: registers at 2 ranks
    ("MEGATRON_OVERLAP_TMA_STORE=0", (2, 4)),
])
def test_alt_env_refuses_a_value_of_the_same_effect(value, group_sizes, monkeypatch):
    """A value that means what the current setting means in every layout of the run (here:
    the default spelled out, or empty for unset) would make 'on-alt' run what 'on' runs:
    refused."""
    module = _module()
    for name in ("HOST_TABLES", "FAST_LAUNCH", "TILE_LIST", "TMA_STORE"):
        monkeypatch.delenv(f"MEGATRON_OVERLAP_{name}", raising=False)
    with pytest.raises(ValueError, match="means what the current setting means"):
        module.parse_alt_env(value, group_sizes)
    assert module.parse_alt_env("MEGATRON_OVERLAP_HOST_TABLES=steps", group_sizes) == (
        "MEGATRON_OVERLAP_HOST_TABLES", "steps")


@pytest.mark.parametrize("value, group_sizes", [
    ("MEGATRON_OVERLAP_TMA_STORE=0", (1,)), ("MEGATRON_OVERLAP_TMA_STORE=1", (2,)),
    ("MEGATRON_OVERLAP_TMA_STORE=0", (1, 2)), ("MEGATRON_OVERLAP_TMA_STORE=1", (1, 2)),
])
def test_alt_env_tma_store_compared_in_every_layout(value, group_sizes, monkeypatch):
    """$MEGATRON_OVERLAP_TMA_STORE's default depends on the TP x EP group: a value is taken
    where it changes the epilogue in at least one of the run's layouts."""
    module = _module()
    monkeypatch.delenv("MEGATRON_OVERLAP_TMA_STORE", raising=False)
    var, _, want = value.partition("=")
    assert module.parse_alt_env(value, group_sizes) == (var, want)


def test_alt_env_notes_the_layouts_where_it_changes_nothing(monkeypatch, capsys):
    """Over layouts of group size 1 and 2, MEGATRON_OVERLAP_TMA_STORE=0 changes the epilogue
    at group size 1 only: taken, with a note naming group size 2; a refusal names the
    group size and the GPU's current epilogue there."""
    module = _module()
    monkeypatch.delenv("MEGATRON_OVERLAP_TMA_STORE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    module.parse_alt_env("MEGATRON_OVERLAP_TMA_STORE=0", (1, 2))
    assert "at TP x EP group size 2 it means what the current setting means" in (
        capsys.readouterr().err)
    module.parse_alt_env("MEGATRON_OVERLAP_TMA_STORE=0", (1,))
    assert "note" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="tma_store on the GPU at TP x EP group size 1: True"):
        module.parse_alt_env("MEGATRON_OVERLAP_TMA_STORE=1", (1,))


def test_alt_env_once(capsys):
    module = _module()
    with pytest.raises(SystemExit):
        module.build_parser().parse_args(["--alt-env", "MEGATRON_OVERLAP_TMA_STORE=1",
                                          "--alt-env", "MEGATRON_OVERLAP_FAST_LAUNCH=0"])
    assert "--alt-env given twice" in capsys.readouterr().err


def test_alt_env_refuses_the_breakdowns():
    module = _module()
    args = module.build_parser().parse_args(
        ["--device", "cpu", "--alt-env", "MEGATRON_OVERLAP_TMA_STORE=0", "--host-breakdown"])
    with pytest.raises(ValueError, match="--alt-env times 'on-alt' only"):
        module.resolve_args(args, 1)


def test_round_order_is_balanced_for_the_predecessor():
    """`round_order` (a Williams design): every round times every variant once; within the
    rounds of one cycle (n rounds, 2n for odd n) every variant follows every other one
    equally often, so no variant keeps one predecessor (as with the rotation alone before
    v5.4: 'on' always after 'off', 'off-grouped' always after 'on')."""
    from collections import Counter
    from itertools import permutations

    from megatron_overlap.bench.measure import round_order

    for n in range(2, 8):
        names = [f"v{i}" for i in range(n)]
        cycle = n if n % 2 == 0 else 2 * n
        rounds = [round_order(names, r) for r in range(cycle)]
        assert all(sorted(o) == names for o in rounds)
        pred = Counter((o[i - 1], o[i]) for o in rounds for i in range(1, n))
        want = (n - 1) * cycle // (n * (n - 1))  # within-round successions per ordered pair
        assert set(pred) == set(permutations(names, 2)), n
        assert set(pred.values()) == {want}, (n, pred)
        assert round_order(names, cycle + 1) == rounds[1]  # periodic
    assert round_order([], 3) == [] and round_order(["a"], 5) == ["a"]


def test_alt_env_of_a_triton_only_variable_on_the_cpu_says_it_compares_the_same_code(
        monkeypatch, capsys):
    mod = _module()
    monkeypatch.delenv("MEGATRON_OVERLAP_HOST_CACHE", raising=False)
    monkeypatch.delenv("MEGATRON_OVERLAP_FC1_CHUNK_MB", raising=False)
    parser = mod.build_parser()
    run = mod.resolve_args(parser.parse_args(["--device", "cpu", "--alt-env",
                                              "MEGATRON_OVERLAP_HOST_CACHE=0"]), 1)
    assert run.alt_env == ("MEGATRON_OVERLAP_HOST_CACHE", "0")
    assert "does not read it" in capsys.readouterr().err
    mod.resolve_args(parser.parse_args(["--device", "cpu", "--alt-env",
                                        "MEGATRON_OVERLAP_FC1_CHUNK_MB=64"]), 1)
    assert "does not read it" not in capsys.readouterr().err  # the CPU layer reads that one


def test_repeated_models_and_sequence_lengths_run_once_each():
    """Each model and sequence length is timed once, in the order first given."""
    mod = _module()
    args = mod.build_parser().parse_args(
        ["--model", "tiny", "tiny", "--seq-lengths", "64", "32", "64", "--device", "cpu"])
    run = mod.resolve_args(args, 1)
    assert run.models == ("tiny",) and run.seq_lengths == (64, 32)
