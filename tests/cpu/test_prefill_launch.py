"""launch/prefill.py end to end on the CPU, as a user runs it.

* plain `python3 launch/prefill.py` (world 1) and `torchrun --standalone --nproc_per_node 2`
  with (TP 1, EP 2) and (TP 2, EP 1, sequence parallel): tiny model, 2 layers, one short
  sequence, 1 warm-up + 1 timed forward; exit status 0, the table on stdout, two well-formed
  JSON rows (off, on) that agree;
* a bad layout exits with status 2 and names the option;
* a broken flag-on path (routed-expert output halved) exits with status 1;
* `judge`, the agreement rule, on hand-made error reports.

Each launch starts fresh processes (torch + Megatron imports, ~6 s of CPU each), so the
launches are few and short; OMP_NUM_THREADS=1 keeps two ranks from fighting over 2 cores.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.launch import (
    BROKEN_FLAG_ON,
    REPO,
    explain,
    launcher_env,
    run_launcher,
)

LAUNCHER = REPO / "launch" / "prefill.py"
SEQ = 32
COMMON = [
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--num-layers",
    "2",
    "--seq-lengths",
    str(SEQ),
    "--warmup",
    "1",
    "--iters",
    "1",
]
TIMEOUT_S = 180
FP32_TOLERANCE = 1e-5  # launch/prefill.py TOLERANCE["fp32"]

def _launch(tmp_path: Path, nproc: int, *args: str, script: Path = LAUNCHER):
    """Run the launcher (world `nproc`); return (completed process, JSON rows written)."""
    return run_launcher(LAUNCHER, tmp_path, nproc, [*COMMON, *args], out_name="prefill.jsonl",
                        timeout_s=TIMEOUT_S, wrapper=None if script == LAUNCHER else script)


_explain = explain


def _check_row(row: dict, *, layout: str, dp: int, world_size: int) -> None:
    on = row["variant"] == "on"
    assert row["schema"] == "megatron_overlap.prefill/1"
    assert (row["model"], row["num_layers"], row["layout"]) == ("tiny", 2, layout)
    assert (row["world_size"], row["dp"], row["seq_length"]) == (world_size, dp, SEQ)
    assert row["global_tokens"] == SEQ * dp
    assert row["moe_gatherrs_overlap"] is on
    assert row["backend"] == ("reference" if on else "megatron-alltoall")
    assert row["fused_calls"] == (2 if on else 0)  # 1 timed forward x 2 fused MoE layers
    assert row["fused_moe_layers"] == 2
    assert len(row["ms_all"]) == 1
    assert 0 < row["ms_p20"] <= row["ms_p50"] <= row["ms_p80"]
    # on the CPU the host time is the forward's time (perf_counter around the same call)
    assert 0 < row["host_ms_p50"] and row["host_ms_p50"] == pytest.approx(row["ms_p50"],
                                                                         rel=0.05)
    assert row["tokens_per_s"] == pytest.approx(SEQ * dp / (row["ms_p50"] / 1e3))
    assert row["speedup_off_over_on"] > 0
    assert row["dtype"] == "fp32" and row["reference"] == "none"
    assert row["agree"] is True
    assert row["errors"]["on_vs_off"]["max_rel_diff"] <= FP32_TOLERANCE
    assert row["errors"]["moe1_on_vs_off"]["max_rel_diff"] <= FP32_TOLERANCE
    assert row["errors"]["on_vs_off"]["tokens"] == SEQ * dp
    assert row["errors"]["on_vs_off"]["nonfinite"] == 0
    assert row["gpu"] == "cpu" and row["peak_mem_gib"] is None
    assert row["torch"] == torch.__version__
    assert row["megatron_core"].startswith("0.19")
    assert isinstance(row["git_sha"], str) and row["git_sha"]
    assert datetime.datetime.fromisoformat(row["timestamp"]).tzinfo is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout_args, layout, dp",
    [
        (1, [], "tp1/ep1/dp1/sp0", 1),
        (2, ["--tp", "1", "--ep", "2", "--host-breakdown"], "tp1/ep2/dp2/sp0", 2),
        (2, ["--tp", "2", "--ep", "1", "--profile", "--trace-dir", "traces"],
         "tp2/ep1/dp1/sp1", 1),
    ],
    ids=["world1-python", "world2-tp1-ep2", "world2-tp2-ep1-sp"],
)
def test_prefill_launch(tmp_path, nproc, layout_args, layout, dp):
    proc, rows = _launch(tmp_path, nproc, *layout_args)
    assert proc.returncode == 0, _explain(proc)
    assert "| model | layers | layout | seq | ms off | ms on |" in proc.stdout, _explain(proc)
    assert f"| tiny | 2 | {layout} | {SEQ} |" in proc.stdout, _explain(proc)
    assert "| yes |" in proc.stdout, _explain(proc)
    assert sorted(row["variant"] for row in rows) == ["off", "on"], _explain(proc)
    for row in rows:
        _check_row(row, layout=layout, dp=dp, world_size=nproc)
        # the reference backend on the CPU runs no GEMM2 epilogue, at any group size
        assert row["tma_store"] is False and row["tma_store_env"] == "", row
        if "--host-breakdown" in layout_args:
            _check_breakdown(row, moe_layers=2, world_size=nproc)
        else:
            assert row["host_breakdown_us"] is None, row
    title = f"tiny {layout} seq {SEQ}"
    if "--profile" in layout_args:  # rank 0's tables and traces of "on" and "off"
        for variant in ("on", "off"):
            assert f"== profile {title} {variant}\n" in proc.stdout, _explain(proc)
            trace = tmp_path / "traces" / f"tiny_{layout.replace('/', '-')}_{SEQ}_{variant}.json"
            events = json.loads(trace.read_text())["traceEvents"]
            names = {e.get("name") for e in events}
            assert ("mo.fc1" in names) is (variant == "on"), sorted(names)[:50]
    else:
        assert "== profile" not in proc.stdout, _explain(proc)


def _check_breakdown(row: dict, moe_layers: int, world_size: int) -> None:
    """A row of `--host-breakdown`: the model's stages, each within the forward.

    Each stage is its max over ranks, taken stage by stage, so a stage is at most the
    forward (a rank's stage lies inside that rank's forward), but a sum of stages can pass
    the forward when the maxima come from different ranks: the sums are checked at world 1.
    """
    stages = row["host_breakdown_us"]
    assert isinstance(stages, dict), row
    forward = stages["forward"]
    for name in ("model.embedding", "model.output_layer", "decoder.self_attention",
                 "decoder.moe_layer", "layer.route", "layer.routed_experts_compute",
                 "token_dispatcher.dispatch_preprocess"):
        assert 0 < stages[name] < forward, (name, stages)
    # the MoE layers' stages inside their layers' forward, the layers inside the model's
    assert stages["layer.routed_experts_compute"] < stages["decoder.moe_layer"], stages
    if world_size == 1:
        assert (stages["decoder.moe_layer"] + stages["decoder.self_attention"]
                + stages["model.embedding"] < forward), stages
    assert "decoder.dense_mlp" not in stages, stages  # tiny: MoE layers only
    flag_on = {"mo.plan", "token_dispatcher.prepare_combine", "experts.forward_fc1"}
    if row["variant"] == "on":
        assert flag_on <= set(stages), stages
    else:
        assert not any(k.startswith("mo.") or k in flag_on for k in stages), stages
    assert row["num_layers"] - row["num_dense_layers"] == moe_layers, row


def test_fc1_impl_reaches_every_fused_layer(tmp_path):
    """--fc1-impl sets every flag-on MoE layer's experts' FC1 (the CPU's "auto" is the loop:
    grouped asked for explicitly), recorded in the rows; flag on still agrees with off."""
    proc, rows = _launch(tmp_path, 1, "--fc1-impl", "grouped")
    assert proc.returncode == 0, _explain(proc)
    on = next(r for r in rows if r["variant"] == "on")
    assert on["fc1_impl"] == "grouped" and on["agree"] is True, on
    assert on["bias_activation_fusion"] is False and on["fc1_chunk_bytes"] == 128 * 2**20, on
    # no GPU kernel on the CPU: no TMA epilogue ran (unset variable: recorded as "")
    assert on["tma_store"] is False and on["tma_store_env"] == "", on
    assert on["gemm2_tiles"] == [] and on["tile_choice"] is False, on  # no Triton combine
    from megatron_overlap.resource.solver import implementation_name

    assert on["resource_solver"] == implementation_name(), on  # the launcher's, this one's
    assert on["experts_impl"].startswith("grouped FC1: "), on["experts_impl"]


def test_bad_layout_exits_2(tmp_path):
    proc, rows = _launch(tmp_path, 1, "--tp", "1", "--ep", "3")
    assert proc.returncode == 2, _explain(proc)
    assert "--ep 3" in proc.stderr and "world size 1" in proc.stderr, _explain(proc)
    assert rows == []
    # a refused run leaves no --out or --trace-dir folder behind
    cmd = [sys.executable, str(LAUNCHER), *COMMON, "--tp", "1", "--ep", "3", "--profile",
           "--trace-dir", "new_traces", "--out", "new/rows.jsonl"]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=launcher_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and "--ep 3" in proc.stderr, _explain(proc)
    assert not (tmp_path / "new").exists() and not (tmp_path / "new_traces").exists()
    # a --trace-dir that cannot be made is refused before --out's folder is made
    (tmp_path / "afile").write_text("")
    for trace_dir, message in (("afile/sub", "'afile' is not a directory"),
                               ("new/rows.jsonl", "is also --out")):
        cmd = [sys.executable, str(LAUNCHER), *COMMON, "--profile", "--trace-dir", trace_dir,
               "--out", "new/rows.jsonl"]
        proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=launcher_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 2 and message in proc.stderr, _explain(proc)
        assert not (tmp_path / "new").exists()


def test_bad_environment_and_out_exit_2(tmp_path, monkeypatch):
    """A bad MEGATRON_OVERLAP_* value, or --out naming a directory, is a one-line usage
    error (exit 2) before any work, not a traceback after it."""
    monkeypatch.setenv("MEGATRON_OVERLAP_TILE_LIST", "gpu")
    proc, rows = _launch(tmp_path, 1)
    assert proc.returncode == 2, _explain(proc)
    assert "MEGATRON_OVERLAP_TILE_LIST='gpu': expected 'device' or 'host'" in proc.stderr
    assert "Traceback" not in proc.stderr and rows == [], _explain(proc)
    monkeypatch.delenv("MEGATRON_OVERLAP_TILE_LIST")
    (tmp_path / "prefill.jsonl").mkdir()  # where _launch points --out
    proc = _launch(tmp_path, 1)[0]
    assert proc.returncode == 2, _explain(proc)
    assert "is a directory: give a file path" in proc.stderr, _explain(proc)
    (tmp_path / "prefill.jsonl").rmdir()
    proc = _launch(tmp_path, 1, "--trace-dir", "t")[0]  # traces need --profile
    assert proc.returncode == 2 and "add --profile" in proc.stderr, _explain(proc)


@pytest.mark.slow
def test_broken_flag_on_path_exits_1(tmp_path):
    wrapper = tmp_path / "broken_flag_on.py"
    wrapper.write_text(BROKEN_FLAG_ON)
    proc, rows = _launch(tmp_path, 1, script=wrapper)
    assert proc.returncode == 1, _explain(proc)
    assert "ERROR: flag on and off disagree" in proc.stderr, _explain(proc)
    assert "| NO |" in proc.stdout, _explain(proc)
    assert rows and not any(row["agree"] for row in rows)
    on = next(row for row in rows if row["variant"] == "on")
    assert on["errors"]["moe1_on_vs_off"]["max_rel_diff"] > 0.1


# --------------------------------------------------------------------------------------
# The agreement rule, without processes
# --------------------------------------------------------------------------------------


@functools.cache
def _prefill_module():
    """launch/prefill.py imported as a module (no side effects beyond sys.path)."""
    spec = importlib.util.spec_from_file_location("prefill_launcher", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _err(max_rel=0.0, fro=0.0, nonfinite=0):
    return {"max_rel_diff": max_rel, "rel_fro_diff": fro, "nonfinite": nonfinite}


def _errors(moe1=0.0, logits=0.0, logits_fro=0.0, off_ref=None, on_ref=None, nonfinite=0):
    return {
        "moe1_on_vs_off": _err(moe1),
        "on_vs_off": _err(logits, logits_fro, nonfinite),
        "off_vs_ref": None if off_ref is None else _err(fro=off_ref),
        "on_vs_ref": None if on_ref is None else _err(fro=on_ref),
    }


@pytest.mark.parametrize(
    "errors, dtype, agree",
    [
        (_errors(moe1=1e-7, logits=5e-7), "fp32", True),
        (_errors(moe1=1e-7, logits=2e-5), "fp32", False),  # logits off by more than 1e-5
        (_errors(moe1=2e-5, logits=5e-7), "fp32", False),  # first MoE layer off
        (_errors(moe1=1e-7, logits=5e-7, nonfinite=1), "fp32", False),
        # bf16 with the fp32 reference: routing flips make max rel diff large; the
        # Frobenius error against fp32 decides, within 2x of flag off's.
        (_errors(moe1=7e-3, logits=0.4, off_ref=4e-2, on_ref=5e-2), "bf16", True),
        (_errors(moe1=7e-3, logits=0.4, off_ref=4e-2, on_ref=9e-2), "bf16", False),
        (_errors(moe1=0.1, logits=0.4, off_ref=4e-2, on_ref=4e-2), "bf16", False),
        (_errors(moe1=0.0, logits=0.0, off_ref=0.0, on_ref=1e-4), "bf16", True),  # floor
        # bf16 without a reference: coarse Frobenius bound on on vs off.
        (_errors(moe1=7e-3, logits=0.4, logits_fro=3e-2), "bf16", True),
        (_errors(moe1=7e-3, logits=0.4, logits_fro=0.5), "bf16", False),
    ],
)
def test_judge(errors, dtype, agree):
    verdict, criterion = _prefill_module().judge(errors, dtype)
    assert verdict is agree, criterion
    assert "first MoE layer" in criterion


def test_percentile():
    percentile = _prefill_module().percentile
    assert percentile([3.0], 20) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0, 5.0], 50) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 20) == pytest.approx(1.8)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 80) == pytest.approx(4.2)


# --------------------------------------------------------------------------------------
# Several models, --num-moe-layers, the off-grouped baseline
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_several_models_and_grouped_baseline(tmp_path):
    proc, rows = _launch(
        tmp_path, 1, "--model", "tiny", "tiny", "--num-moe-layers", "1",
        "--baselines", "off", "off-grouped",
    )
    # COMMON's --num-layers 2 and --num-moe-layers are exclusive: argparse says so (status 2)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr, _explain(proc)
    args = [a for a in COMMON if a not in ("--num-layers", "2")]
    out = tmp_path / "several.jsonl"
    cmd = [sys.executable, str(LAUNCHER), *args, "--model", "tiny", "tiny", "--num-moe-layers",
           "1", "--baselines", "off", "off-grouped", "--host-breakdown", "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=launcher_env(),
                          capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, _explain(proc)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["off", "on", "off-grouped"] * 2, _explain(proc)
    assert proc.stdout.count("| tiny | 1 | tp1/ep1/dp1/sp0 | 32 |") == 2, _explain(proc)
    assert proc.stdout.count("== host us per forward tiny tp1/ep1/dp1/sp0 seq 32") == 2
    for row in rows:
        assert row["num_layers"] == 1 and row["fused_moe_layers"] == 1
        assert row["agree"] is True, row["errors"]
        _check_breakdown(row, moe_layers=1, world_size=1)
        assert row["label"] and row["experts_impl"]
        assert row["param_bytes"] > 0 and row["own_peak_bytes"] is None  # CPU: no memory
    grouped = [r for r in rows if r["variant"] == "off-grouped"]
    assert all("GroupedGEMMSequentialMLP" in r["label"] for r in grouped)
    assert all(r["errors"]["moe1_on_vs_off"]["max_rel_diff"] <= FP32_TOLERANCE for r in grouped)
    for first, second in ((rows[1], grouped[0]), (rows[4], grouped[1])):
        assert second["speedup_over_on"] == pytest.approx(second["ms_p50"] / first["ms_p50"])
    # Same seed, same model: the second model's weights equal the first's (`reseed`), so its
    # reports (max |output| included, which depends on the weights) are the same.
    assert rows[0]["errors"] == rows[3]["errors"]
    # The report reads these rows (CPU rows only with --include-cpu).
    from megatron_overlap.bench import make_report

    report = tmp_path / "report.md"
    assert make_report.main([str(out), "--out", str(report), "--include-cpu", "--no-plots"]) == 0
    text = report.read_text()
    assert "| tiny | tp1/ep1/dp1/sp0 | 1 (1 MoE) | 32 |" in text and "off-grouped / on" in text


def test_prereduce_needs_the_triton_backend():
    module = _prefill_module()
    parser = module.build_parser()
    with pytest.raises(ValueError, match="--prereduce on needs the Triton backend"):
        module.resolve_args(parser.parse_args(["--prereduce", "on", "--backend", "reference",
                                               "--device", "cpu"]), world_size=1)
    run = module.resolve_args(parser.parse_args(["--prereduce", "on", "--device", "cpu"]),
                              world_size=1)
    assert run.prereduce is True and run.backend == "auto"
    run = module.resolve_args(parser.parse_args(["--device", "cpu"]), world_size=1)
    assert run.prereduce == "auto"


def test_num_moe_layers_keeps_leading_dense_layers():
    module = _prefill_module()
    from megatron_overlap.models import load_model_shape

    args = module.build_parser().parse_args(["--num-moe-layers", "2", "--device", "cpu"])
    run = module.resolve_args(args, world_size=1)
    assert module.num_layers_for(load_model_shape("deepseek-v2-lite"), run) == 3  # 1 dense
    assert module.num_layers_for(load_model_shape("qwen3-30b-a3b"), run) == 2
    args = module.build_parser().parse_args(["--device", "cpu", "--baselines", "off-grouped"])
    run = module.resolve_args(args, world_size=1)
    assert run.baselines == ("off", "off-grouped") and run.num_layers is None
    assert module.num_layers_for(load_model_shape("qwen3-30b-a3b"), run) == 48  # the model's


def test_bias_activation_fusion_reaches_every_variants_config():
    module = _prefill_module()
    from megatron_overlap.models import load_model_shape

    shape = load_model_shape("tiny")
    for argv, fused in (([], False), (["--bias-activation-fusion"], True)):
        run = module.resolve_args(module.build_parser().parse_args([*argv, "--device", "cpu"]),
                                  world_size=1)
        assert run.bias_activation_fusion is fused
        for flag in (False, True):
            config = module.build_config(shape, run, flag=flag, dtype="fp32", initialize=False)
            assert config.bias_activation_fusion is fused, (argv, flag)


def test_repeated_sequence_lengths_run_once_and_repeated_models_twice():
    """`--model tiny tiny --seq-lengths 64 32 64` times each length once, in the order first
    given (as the layouts are); a repeated model runs again (same seed: the repeatability
    check of `test_prefill_several_models_and_grouped_baseline`)."""
    module = _prefill_module()
    args = module.build_parser().parse_args(
        ["--model", "tiny", "tiny", "--seq-lengths", "64", "32", "64", "--device", "cpu"])
    run = module.resolve_args(args, world_size=1)
    assert run.models == ("tiny", "tiny") and run.seq_lengths == (64, 32)
