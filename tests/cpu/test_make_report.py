"""megatron_overlap.bench.make_report on SYNTHETIC rows (made up here, never benchmark data).

Every number below is invented to exercise the report: geometric means, the target verdicts
(met / missed), memory percentages, skipping of foreign / CPU / superseded rows, the
sections, the PNGs, bad input. The GPU name "SYNTHETIC-TEST-GPU" marks them.
"""

from __future__ import annotations

import json
import math

import pytest

from megatron_overlap.bench import make_report as mr

SYNTHETIC_GPU = "SYNTHETIC-TEST-GPU"


def _row(benchmark, model, layout, seq, variant, ms, *, own=None, agree=True, stamp="T1",
         gpu=SYNTHETIC_GPU, **extra):
    schema = {"layer": "megatron_overlap.layer/1", "prefill": "megatron_overlap.prefill/1"}
    row = {
        "schema": schema[benchmark], "benchmark": benchmark, "model": model, "layout": layout,
        "seq_length": seq, "variant": variant, "ms_p50": ms, "own_peak_bytes": own,
        "agree": agree, "timestamp": stamp, "gpu": gpu, "dtype": "bf16",
        "backend_requested": "auto", "backend": "triton" if variant == "on" else
        "megatron-alltoall", "label": f"synthetic {variant}", "experts_impl": "synthetic",
        "world_size": 2, "torch": "synthetic", "git_sha": "abc", "command": f"cmd-{benchmark}",
        "criterion": "synthetic", "errors": {"max_rel_diff": 0.0},
    }
    if benchmark == "prefill":
        row.update(num_layers=2, attention="sdpa")
    row.update(extra)
    return row


def _layer_rows():
    rows = []
    # fine-grained: on 10 ms; off-grouped 15 and 12 ms -> 1.5x, 1.2x (geomean sqrt(1.8))
    for model, grouped in (("qwen3-30b-a3b", 15.0), ("deepseek-v2-lite", 12.0)):
        rows += [
            _row("layer", model, "tp1/ep2/dp2/sp0", 4096, "on", 10.0, own=105,
                 combine_mode="prereduced" if model == "qwen3-30b-a3b" else "direct"),
            _row("layer", model, "tp1/ep2/dp2/sp0", 4096, "off", 20.0, own=100),
            _row("layer", model, "tp1/ep2/dp2/sp0", 4096, "off-grouped", grouped, own=100,
                 skipped_baselines={"off-te": "synthetic: no TE"}),
        ]
    # coarse: slower than off-grouped (0.8x), more memory (+20 %)
    rows += [
        _row("layer", "mixtral-8x7b", "tp2/ep1/dp1/sp1", 8192, "on", 10.0, own=120,
             symm_workspace_bytes=15),
        _row("layer", "mixtral-8x7b", "tp2/ep1/dp1/sp1", 8192, "off", 11.0, own=100),
        _row("layer", "mixtral-8x7b", "tp2/ep1/dp1/sp1", 8192, "off-grouped", 8.0, own=100),
    ]
    return rows


def _prefill_rows():
    rows = []
    for seq, off in ((2048, 5.0), (4096, 12.0), (8192, 13.0)):  # 2048 is below the target
        rows += [_row("prefill", "qwen1.5-moe-a2.7b", "tp1/ep2/dp2/sp0", seq, "on", 10.0,
                      own=100),
                 _row("prefill", "qwen1.5-moe-a2.7b", "tp1/ep2/dp2/sp0", seq, "off", off,
                      own=100)]
    return rows


def test_geomean_and_speedup():
    assert mr.geomean([1.5, 1.2]) == pytest.approx(math.sqrt(1.8))
    assert mr.geomean([]) is None
    with pytest.raises(ValueError, match="non-positive"):
        mr.geomean([1.0, 0.0])
    groups = mr.workloads(_layer_rows(), "layer")
    key = ("qwen3-30b-a3b", "tp1/ep2/dp2/sp0", None, 4096, "auto")
    assert mr.speedup(groups[key], "off-grouped") == pytest.approx(1.5)
    assert mr.speedup(groups[key], "off-te") is None
    assert mr.memory_extra(groups[key]) == pytest.approx(0.05)
    assert next(iter(groups))[0] == "qwen3-30b-a3b"  # fine-grained first, coarse last
    assert list(groups)[-1][0] == "mixtral-8x7b"


def test_targets_verdicts():
    layer = "\n".join(mr.target_lines(mr.workloads(_layer_rows(), "layer"), "layer"))
    assert f"**{math.sqrt(1.8):.3f}x** (target >= 1.3x): **met**" in layer
    # mixtral vs off-grouped is 0.8x: "never slower" missed, worst named
    assert "1 of 6 (workload, baseline) pairs slower; worst 0.800x (mixtral-8x7b" in layer
    assert "**+20.0%** (mixtral-8x7b" in layer and "**MISSED**" in layer
    # the same vs off-grouped, with the workspace's share where the rows have it
    assert ("vs `off-grouped` (the same grouped FC1 as flag on, so the difference is the "
            "fused return path's) at most **+20.0%** (mixtral-8x7b, tp2/ep1/dp1/sp1, seq "
            "8192; the flag-on symmetric receive workspace alone is 15.0% of") in layer
    prefill = "\n".join(mr.target_lines(mr.workloads(_prefill_rows(), "prefill"), "prefill"))
    # seq 2048 (0.5x) is below the target's 4096 and ignored: geomean sqrt(1.2 * 1.3)
    assert f"**{math.sqrt(1.2 * 1.3):.3f}x** (target >= 1.15x): **met**" in prefill
    assert "0 of 2 (workload, baseline) pairs slower" in prefill


def test_selection_skips_cpu_and_older_duplicates():
    rows = _layer_rows() + [
        _row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, "on", 5.0, stamp="T2"),
        _row("layer", "tiny", "tp1/ep1/dp1/sp0", 32, "on", 1.0, gpu="cpu"),
    ]
    kept, notes = mr.select_rows(rows)
    assert notes == {"cpu": 1, "superseded": 1}
    on = [r for r in kept if r["model"] == "qwen3-30b-a3b" and r["variant"] == "on"]
    assert [r["ms_p50"] for r in on] == [5.0]  # the newer row won
    kept, notes = mr.select_rows(rows, include_cpu=True)
    assert notes["cpu"] == 0 and any(r["model"] == "tiny" for r in kept)


def test_cpu_rows_and_several_commits_are_flagged():
    rows = _layer_rows()
    notes = {"files": 1, "foreign": 0, "cpu": 0, "superseded": 0}
    text = mr.render(rows, notes, ["r.jsonl"], "report.md", {})
    assert "**CPU times:**" not in text and "commits (" not in text
    # A CPU row (kept by --include-cpu) and rows of two commits in one benchmark.
    rows[0] = dict(rows[0], gpu="cpu")
    rows[1] = dict(rows[1], git_sha="def")
    text = mr.render(rows, notes, ["r.jsonl"], "report.md", {})
    assert "**CPU times:** 1 of these rows were measured on a CPU" in text
    assert ("**Note:** the layer rows come from 2 commits (abc, def): its tables compare "
            "code versions as well as workloads.") in text
    # the CPU row is one of two kinds of device in the layer rows
    assert ("**Warning:** the layer rows come from several GPUs (or the CPU) (SYNTHETIC-TEST-"
            "GPU, cpu): a speedup may divide one's time by another's.") in text
    # One commit per benchmark, different between benchmarks: no note; nor for an unknown
    # commit; rows of two dtypes: a warning.
    rows = _layer_rows() + [dict(r, git_sha="def") for r in _prefill_rows()]
    rows[0] = dict(rows[0], git_sha="unknown")
    text = mr.render(rows, notes, ["r.jsonl"], "report.md", {})
    assert "commits (" not in text and "several" not in text
    rows[1] = dict(rows[1], dtype="fp32")
    assert "the layer rows come from several dtypes (bf16, fp32)" in mr.render(
        rows, notes, ["r.jsonl"], "report.md", {})


def test_rows_of_another_gpu_replace_older_ones_of_the_same_cell():
    rows = _layer_rows()
    newer = dict(rows[0], gpu="cpu", ms_p50=99.0, timestamp="T9")
    kept, notes = mr.select_rows(rows + [newer], include_cpu=True)
    assert notes["superseded"] == 1 and newer in kept and rows[0] not in kept


def test_report_file_sections_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    data = tmp_path / "synthetic.jsonl"
    foreign = {"provider": "ours", "p50_ms": 1.0}  # an operator-benchmark row
    with data.open("w") as f:
        for row in _layer_rows() + _prefill_rows() + [foreign]:
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "report.md"
    assert mr.main([str(data), "--out", str(out)]) == 0
    text = out.read_text()
    assert "skipped 1 rows of other benchmarks, 0 CPU rows, 0 older duplicates" in text
    for heading in ("## MoE layer", "## Full-model prefill", "## Variants, exactly",
                    "## Agreement with flag off", "## Run settings", "## Hardware and software",
                    "## Commands"):
        assert heading in text, heading
    assert "| fine-grained | all | off-grouped | 2 | 1.342 | 1.200 | 0 |" in text
    assert "Where flag on is slower than a baseline (host ms:" in text  # mixtral 0.8x
    assert "`off-te` was not run: synthetic: no TE." in text
    # what the flag-on variant ran, per workload (rows from before v4.4 have no mode)
    assert "| yes | triton, prereduced (auto) |" in text
    assert "| yes | triton, direct (auto) |" in text
    assert "| yes | triton (auto) |" in text
    assert "cmd-layer" in text and "cmd-prefill" in text
    assert f"make_report {data} --out {out}" in text
    assert SYNTHETIC_GPU in text
    assert "![layer speedup vs sequence length](report_layer.png)" in text
    for png in ("report_layer.png", "report_prefill.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_slower_pairs_are_listed_with_host_times():
    rows = _layer_rows()
    for row in rows:  # host times on the coarse workload only (as rows from before v4.5)
        if row["model"] == "mixtral-8x7b":
            row["host_ms_p50"] = {"on": 9.5, "off": 10.5, "off-grouped": 7.0}[row["variant"]]
    text = mr.slower_table(mr.workloads(rows, "layer"), "layer")
    # mixtral vs off-grouped: 8 / 10 = 0.8x; 2 ms slower, 2.5 ms more host time
    assert ("| mixtral-8x7b | tp2/ep1/dp1/sp1 | 8192 | `off-grouped` | 0.800 | 10.000 | "
            "8.000 | 9.500 | 7.000 | +2.000 | +2.500 |") in text
    assert text.count("\n") == 2  # header, rule, one pair: the faster pairs are not listed
    for row in rows:
        row.pop("host_ms_p50", None)
    assert "| +2.000 | - |" in mr.slower_table(mr.workloads(rows, "layer"), "layer")
    # prefill: the 2048 pair (0.5x) is below the target's 4096 and not listed
    assert mr.slower_table(mr.workloads(_prefill_rows(), "prefill"), "prefill") is None


def test_disagreement_is_listed(tmp_path):
    rows = _layer_rows()
    rows[0]["agree"] = False
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "r.md"
    assert mr.main([str(data), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert f"make_report {data} --out {out} --no-plots\n" in text  # the switch kept
    assert "* layer qwen3-30b-a3b tp1/ep2/dp2/sp0 seq 4096 on:" in text
    assert "| NO |" in text and not (tmp_path / "r_layer.png").exists()


def test_bad_input_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        mr.main([str(tmp_path / "missing.jsonl")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(SystemExit) as exc:
        mr.main([str(bad)])
    assert exc.value.code == 2 and "bad.jsonl:1: not JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "report.md"
    assert mr.main([str(empty), "--out", str(out)]) == 2  # nothing to report: no file
    assert not out.exists() and "no layer or prefill rows" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"model": None}, "model=None, expected a non-empty string"),
    ({"ms_p50": "fast"}, "ms_p50='fast', expected a finite number of milliseconds > 0"),
    ({"ms_p50": 0}, "ms_p50=0, expected a finite"),
    ({"ms_p50": float("nan")}, "ms_p50=nan, expected a finite"),
    ({"ms_p50": -1.0}, "ms_p50=-1.0, expected a finite"),
    ({"seq_length": "4096"}, "seq_length='4096', expected an int >= 1"),
    ({"own_peak_bytes": "x"}, "own_peak_bytes='x', expected null or an int >= 0"),
    ({"agree": "yes"}, "agree='yes', expected true or false"),
])
def test_malformed_rows_are_named(tmp_path, capsys, change, message):
    rows = _layer_rows()
    rows[1].update(change)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(SystemExit) as exc:
        mr.main([str(data), "--out", str(tmp_path / "r.md"), "--no-plots"])
    assert exc.value.code == 2
    assert f"rows.jsonl:2: {message}" in capsys.readouterr().err


def test_bad_paths_exit_2(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _layer_rows()) + "\n")
    with pytest.raises(SystemExit) as exc:
        mr.main([str(tmp_path)])  # a directory as input
    assert exc.value.code == 2 and "not a regular file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        mr.main([str(data), "--out", ""])
    assert exc.value.code == 2 and "expected the report's file path" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker / "r.md", blocker / "x" / "r.md"):  # the file in the way is named
        assert mr.main([str(data), "--out", str(out), "--no-plots"]) == 2
        assert f"'{blocker}' is not a directory" in capsys.readouterr().err


def test_operator_table_refuses_layer_rows(tmp_path):
    from megatron_overlap.bench import report

    rows = tmp_path / "layer.jsonl"
    rows.write_text(json.dumps({"model": "m", "variant": "on", "seq_length": 64}) + "\n")
    with pytest.raises(ValueError, match="not an operator row"):
        report.load_rows(str(rows))


def test_missing_grid_points_are_listed(tmp_path):
    """A cut run (a model or a sequence length without rows) is named in the report."""
    groups = mr.workloads(_layer_rows(), "layer")
    assert mr.missing_workloads(groups) == [
        "* qwen3-30b-a3b, tp1/ep2/dp2/sp0: seq 8192",
        "* qwen3-30b-a3b, tp2/ep1/dp1/sp1: every sequence length",
        "* deepseek-v2-lite, tp1/ep2/dp2/sp0: seq 8192",
        "* deepseek-v2-lite, tp2/ep1/dp1/sp1: every sequence length",
        "* mixtral-8x7b, tp1/ep2/dp2/sp0: every sequence length",
        "* mixtral-8x7b, tp2/ep1/dp1/sp1: seq 4096",
    ]
    assert mr.missing_workloads(mr.workloads(_prefill_rows(), "prefill")) == []
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _layer_rows() + _prefill_rows()) + "\n")
    out = tmp_path / "r.md"
    assert mr.main([str(data), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert text.count("Not measured in these rows") == 1  # the prefill grid is complete
    assert "* mixtral-8x7b, tp1/ep2/dp2/sp0: every sequence length" in text


def test_output_paths_are_checked(tmp_path):
    from megatron_overlap.bench import report

    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _layer_rows()) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        mr.main([str(data), "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(data), "--plot", str(tmp_path)])
    assert exit_info.value.code == 2


def test_settings_section_shows_each_run_setting_and_warns_on_a_mix():
    rows = [_row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, v, 1.0, prereduce="auto",
                 fc1_impl="auto", bias_activation_fusion=False) for v in ("on", "off")]
    rows.append(_row("prefill", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, "on", 1.0))
    text = mr.settings_section(rows)
    assert "| layer | auto | auto | false | - | - | - | - | - | - | - | - | - | - | 2 |" in text, text
    assert "| prefill | - | - | - | - | - | - | - | - | - | - | - | - | - | 1 |" in text, text  # rows from before the fields
    assert "Warning" not in text, text
    rows.append(_row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 8192, "on", 1.0,
                     prereduce="auto", fc1_impl="auto", bias_activation_fusion=True))
    text = mr.settings_section(rows)
    assert "| layer | auto | auto | true | - | - | - | - | - | - | - | - | - | - | 1 |" in text, text
    assert "**Warning:** the layer rows mix settings" in text, text
    assert "prefill rows mix" not in text, text
    # v5.4 rows say in which order the variants were timed; older ones do not
    rows.append(_row("prefill", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 8192, "on", 1.0,
                     timing_order="williams"))
    text = mr.settings_section(rows)
    assert "| prefill | - | - | - | - | - | - | - | - | - | - | - | - | williams | 1 |" in text, text
    assert "**Warning:** the prefill rows mix settings" in text, text
    # an --alt-env A/B's 'on-alt' rows have their own settings by design: no mix warning
    ab = [_row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, v, 1.0, tma_store=v == "on-alt")
          for v in ("on", "off", "on-alt")]
    text = mr.settings_section(ab)
    assert "Warning" not in text and "(1 'on-alt' rows" in text, text
    assert "**Note:** the layer rows predate v5.4's balanced timing order" in text, text
    balanced = [dict(r, timing_order="williams") for r in ab]
    assert "predate" not in mr.settings_section(balanced)
    assert "| layer | - | - | - | - | false | - | - | - | - | - | - | - | - | 2 |" in text, text
    # v5.9 rows: the variable as set, not the epilogue (which depends on the layout's group
    # size): one run over EP1 and EP2 is one setting
    mixed = [_row("layer", "qwen3-30b-a3b", layout, 4096, v, 1.0, tma_store=layout.startswith(
        "tp1/ep1"), tma_store_env="") for layout in ("tp1/ep1/dp2/sp0", "tp1/ep2/dp2/sp0")
        for v in ("on", "off")]
    text = mr.settings_section(mixed)
    assert "Warning" not in text, text
    assert "| layer | - | - | - | - | unset | - | - | - | - | - | - | - | - | 4 |" in text, text
    mixed[0]["tma_store_env"] = "1"
    assert "**Warning:** the layer rows mix settings" in mr.settings_section(mixed)
    # v6.0 rows name the hardware profile the plans used: two GPUs' profiles are a mix
    profiles = [dict(r, hw_profile=name) for r, name in zip(ab[:2], ("h100", "h200"))]
    text = mr.settings_section(profiles)
    assert "| layer | - | - | - | - | false | - | - | - | - | - | - | h100 | - | 1 |" in text, text
    assert "**Warning:** the layer rows mix settings" in text, text
    # v6.1 rows: MEGATRON_OVERLAP_TILE_CHOICE as set ("unset" where not); another value
    # is another setting
    choice = [dict(r, tile_choice_env=value) for r, value in zip(ab[:2], ("", "0"))]
    text = mr.settings_section(choice)
    assert "| layer | - | - | - | - | false | unset | - | - | - | - | - | - | - | 1 |" in text, text
    assert "| layer | - | - | - | - | false | 0 | - | - | - | - | - | - | - | 1 |" in text, text
    assert "**Warning:** the layer rows mix settings" in text, text


def _breakdown_rows():
    """Synthetic rows of a --host-breakdown run: flag on and off-grouped, one workload."""
    on = {"forward": 3000.0, "layer.route": 300.0, "layer.preprocess": 900.0,
          "layer.dispatch": 250.0, "layer.routed_experts_compute": 1400.0,
          "layer.combine": 1.0, "layer.postprocess": 30.0, "mo.plan": 100.0,
          "token_dispatcher.prepare_combine": 400.0, "mo.zz_new_stage": 7.0}
    grouped = {"forward": 2500.0, "layer.route": 290.0, "layer.preprocess": 700.0,
               "layer.dispatch": 240.0, "layer.routed_experts_compute": 700.0,
               "layer.combine": 130.0, "layer.postprocess": 80.0, "experts.forward": 430.0}
    return [_row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, "on", 3.1,
                 host_ms_p50=3.05, host_breakdown_us=on, command="cmd-breakdown"),
            _row("layer", "qwen3-30b-a3b", "tp1/ep2/dp2/sp0", 4096, "off-grouped", 2.6,
                 host_ms_p50=2.55, host_breakdown_us=grouped)]


def test_breakdown_section(tmp_path):
    text = mr.breakdown_section(_breakdown_rows())
    assert ("**qwen3-30b-a3b tp1/ep2/dp2/sp0 seq 4096** (dtype bf16, gpu SYNTHETIC-TEST-GPU, "
            "backend_requested auto): p50 `on` 3.100 ms (host 3.050), `off-grouped` 2.600 ms "
            "(host 2.550).") in text
    assert "| host us per forward | `on` | `off-grouped` | on - `off-grouped` |" in text
    assert "| `forward` | 3000 | 2500 | +500 |" in text
    assert "| `layer.routed_experts_compute` | 1400 | 700 | +700 |" in text
    # the rest of the forward: 3000 - 2881 = 119 and 2500 - 2140 = 360
    assert "which do not add) | 119 | 360 | -241 |" in text
    # inner stages: known ones in forward order; where one side lacks a stage, no difference
    assert text.index("`token_dispatcher.prepare_combine`") < text.index("`mo.plan`")
    assert "`experts.forward` | - | 430 | - |" in text
    assert "`mo.plan` | 100 | - | - |" in text
    assert text.index("`mo.plan`") < text.index("`mo.zz_new_stage`")  # unknown names last
    # rows without a breakdown, or without a baseline's, give no section
    assert mr.breakdown_section(_layer_rows()) is None
    assert mr.breakdown_section(_breakdown_rows()[:1]) is None
    # the newest row of a variant wins; another GPU is another workload (left out here:
    # it has no baseline), named under "Left out"
    rows = _breakdown_rows()
    newer = dict(rows[0], timestamp="T9", ms_p50=9.0)
    other_gpu = dict(rows[0], gpu="OTHER-GPU")
    text = mr.breakdown_section([newer] + rows + [other_gpu])
    assert "p50 `on` 9.000 ms" in text and "3.100" not in text
    assert "Left out:" in text and "breakdowns of ['on'] only" in text
    # through the command line: its own section, its rows only there, the command recorded
    grid, extra = tmp_path / "grid.jsonl", tmp_path / "host.jsonl"
    grid.write_text("\n".join(json.dumps(r) for r in _layer_rows()) + "\n")
    extra.write_text("\n".join(json.dumps(r) for r in _breakdown_rows() + _layer_rows())
                     + "\n")  # (rows without a breakdown in the file are skipped)
    out = tmp_path / "r.md"
    assert mr.main([str(grid), "--breakdown", str(extra), "--out", str(out),
                    "--no-plots"]) == 0
    report = out.read_text()
    assert "## Where the host time goes (MoE layer)" in report and "cmd-breakdown" in report
    assert report.index("## Where the host time goes") < report.index("## Variants, exactly")
    assert f"make_report {grid} --breakdown {extra} --out {out} --no-plots\n" in report
    # the grid's qwen3 workload keeps the grid's times (10 ms), not the breakdown run's
    assert "| qwen3-30b-a3b | tp1/ep2/dp2/sp0 | 4096 | 10.000 |" in report


@pytest.mark.parametrize("change, message", [
    ({"host_breakdown_us": {}}, "host_breakdown_us={}, expected a non-empty"),
    ({"host_breakdown_us": {"forward": None}}, "host_breakdown_us['forward']=None, expected"),
    ({"host_breakdown_us": {"forward": "12"}}, "host_breakdown_us['forward']='12', expected"),
    ({"host_ms_p50": "4.1"}, "host_ms_p50='4.1', expected null or a finite number"),
])
def test_breakdown_bad_rows_exit_2(tmp_path, capsys, change, message):
    grid, extra = tmp_path / "grid.jsonl", tmp_path / "host.jsonl"
    grid.write_text("\n".join(json.dumps(r) for r in _layer_rows()) + "\n")
    rows = _breakdown_rows()
    rows[0].update(change)
    extra.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        mr.main([str(grid), "--breakdown", str(extra), "--out", str(tmp_path / "r.md")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert f"{extra}: the on row of qwen3-30b-a3b tp1/ep2/dp2/sp0 seq 4096" in err


def test_breakdown_needs_usable_rows(tmp_path, capsys):
    grid = tmp_path / "grid.jsonl"
    grid.write_text("\n".join(json.dumps(r) for r in _layer_rows()) + "\n")
    out = str(tmp_path / "r.md")
    with pytest.raises(SystemExit) as exit_info:  # a file without breakdowns
        mr.main([str(grid), "--breakdown", str(grid), "--out", out, "--no-plots"])
    assert exit_info.value.code == 2
    assert "give it before --breakdown" in capsys.readouterr().err
    extra = tmp_path / "host.jsonl"
    extra.write_text("\n".join(json.dumps(r) for r in _breakdown_rows()) + "\n")
    with pytest.raises(SystemExit):  # every file after --breakdown is a breakdown file
        mr.main(["--breakdown", str(extra), str(grid), "--out", out, "--no-plots"])
    assert "give them before --breakdown" in capsys.readouterr().err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"a": "\xd0\xff"}\n')
    with pytest.raises(SystemExit):
        mr.main([str(binary), "--out", out, "--no-plots"])
    assert f"{binary}: not UTF-8 text" in capsys.readouterr().err
    cpu = tmp_path / "cpu.jsonl"
    cpu.write_text("\n".join(json.dumps(dict(r, gpu="cpu")) for r in _breakdown_rows()))
    with pytest.raises(SystemExit):
        mr.main([str(grid), "--breakdown", str(cpu), "--out", out, "--no-plots"])
    assert "2 CPU rows were dropped (--include-cpu keeps them)" in capsys.readouterr().err
    assert mr.main([str(grid), "--breakdown", str(cpu), "--out", out, "--include-cpu",
                    "--no-plots"]) == 0  # kept, and the regeneration command says so
    assert (f"make_report {grid} --breakdown {cpu} --out {out} --include-cpu --no-plots\n"
            in (tmp_path / "r.md").read_text())
    # the section also comes with grid rows of the prefill only
    prefill = tmp_path / "prefill.jsonl"
    prefill.write_text("\n".join(json.dumps(r) for r in _prefill_rows()) + "\n")
    assert mr.main([str(prefill), "--breakdown", str(extra), "--out", out, "--no-plots"]) == 0
    assert "## Where the host time goes (MoE layer)" in (tmp_path / "r.md").read_text()


def test_the_committed_report_is_what_its_command_writes(tmp_path):
    """docs/report.md regenerated from its committed rows by the command README.md gives
    is the committed file (up to the --out path the report quotes): a change of
    make_report's output that was not followed by a regeneration fails here."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    command = re.search(r"python -m megatron_overlap\.bench\.make_report (.*?)--out docs/report\.md",
                        readme, re.S)
    assert command, "README.md has no make_report command writing docs/report.md"
    args = command.group(1).replace("\\\n", " ").split()
    out = tmp_path / "report.md"
    assert mr.main([str(root / a) if a.startswith("docs/") else a for a in args]
                   + ["--out", str(out)]) == 0
    ours = out.read_text().replace(str(tmp_path / "report.md"), "docs/report.md")
    ours = ours.replace(str(root) + "/", "")
    assert ours == (root / "docs/report.md").read_text()
