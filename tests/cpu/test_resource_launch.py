"""launch/calibrate.py and launch/oracle.py on the CPU: --help, the --dry-run paths, the fits,
the regret summary, table and plot (the GPU measurements themselves run on the device)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_overlap.bench import oracle
from megatron_overlap.resource.profile import load_profile

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


calibrate = _load("calibrate")
oracle_launch = _load("oracle")


@pytest.mark.parametrize("script", ["calibrate.py", "oracle.py"])
def test_help_runs_without_a_gpu(script):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(REPO / "launch" / script), "--help"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout


def test_fits_recover_the_model():
    alpha, beta = calibrate.fit_tile_time([6, 12, 22, 224], [2.0 + 0.5 * k for k in
                                                             (6, 12, 22, 224)])
    assert alpha == pytest.approx(2.0) and beta == pytest.approx(0.5)
    assert calibrate.fit_tile_time([1, 2], [3.0, 3.0]) == pytest.approx((3.0, 0.0))
    with pytest.raises(ValueError):
        calibrate.fit_tile_time([4, 4], [1.0, 2.0])
    link, cta = calibrate.fit_link([1, 2, 4, 8, 132], [15.0, 31.0, 62.0, 120.0, 330.0])
    assert (link, cta) == (330.0, 15.5)
    with pytest.raises(ValueError):
        calibrate.fit_link([1], [0.0])


def test_calibrate_rejects_an_empty_name_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        calibrate.main(["--dry-run", "--out", str(tmp_path / "x.yaml"), "--name", " "])
    assert exit_info.value.code == 2
    assert "--name ' ': expected a non-empty profile name" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_calibrate_dry_run_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "h200.yaml"
    assert calibrate.main(["--dry-run", "--out", str(out)]) == 0
    prof, base = load_profile(out), load_profile("h200")
    assert prof.provisional and "DRY RUN" in out.read_text()
    from megatron_overlap.resource import DEFAULT_TILE

    t, b = prof.tile_time(*DEFAULT_TILE), base.tile_time(*DEFAULT_TILE)
    assert t.alpha_us == pytest.approx(b.alpha_us, abs=1e-3)
    assert t.beta_us == pytest.approx(b.beta_us, abs=1e-4)
    assert prof.link_bandwidth_gbps == base.link_bandwidth_gbps
    assert prof.cta_bandwidth_gbps == pytest.approx(base.cta_bandwidth_gbps)
    assert len(prof.extra["peer_store_sweep"]) == len(calibrate.DEFAULT_CTAS)


def test_calibrate_dry_run_names_the_profile_after_its_base(tmp_path):
    """Without --name the dry run's profile takes its base's name (h200 by default, h100
    with --base h100), never a name that is not the base's; --name wins."""
    for argv, name in (([], "h200"), (["--base", "h100"], "h100"),
                       (["--base", "h100", "--name", "mine"], "mine")):
        out = tmp_path / f"{name}.yaml"
        assert calibrate.main(["--dry-run", "--out", str(out), *argv]) == 0
        assert load_profile(out).name == name, argv


def test_calibrate_dry_run_tma_store_writes_both_epilogues(tmp_path):
    out = tmp_path / "h200.yaml"
    assert calibrate.main(["--dry-run", "--tma-store", "--out", str(out)]) == 0
    prof, base = load_profile(out), load_profile("h200")
    from megatron_overlap.resource import DEFAULT_TILE

    assert sorted(t.tma_store for t in prof.tile_times if t.shape == DEFAULT_TILE) == [
        False, True]
    for tma in (False, True):  # each fitted from its own sweep (here: the base's model)
        t, b = (p.tile_time(*DEFAULT_TILE, tma_store=tma) for p in (prof, base))
        assert (t.alpha_us, t.beta_us) == pytest.approx((b.alpha_us, b.beta_us), abs=1e-3)
    sweep = [r for r in prof.extra["tile_sweep"] if (r["bm"], r["bn"], r["bk"]) == DEFAULT_TILE]
    assert sum(r["tma_store"] for r in sweep) == len(sweep) // 2 == len(calibrate.DEFAULT_FFN)
    assert "tma_store" not in prof.to_dict()[
        "tile_times"][0]  # a register-store entry is written as before


def test_calibrate_without_tma_store_keeps_the_bases_tma_entry(tmp_path, capsys):
    out = tmp_path / "h200.yaml"
    assert calibrate.main(["--dry-run", "--out", str(out)]) == 0
    prof, base = load_profile(out), load_profile("h200")
    from megatron_overlap.resource import DEFAULT_TILE

    assert prof.extra["tma_store_copied_from_base"] is True
    assert prof.tile_time(*DEFAULT_TILE, tma_store=True) == base.tile_time(*DEFAULT_TILE,
                                                                            tma_store=True)
    assert not any(r["tma_store"] for r in prof.extra["tile_sweep"])  # not measured
    with pytest.raises(SystemExit) as exc:  # 2008-byte rows: registers, not TMA
        calibrate.main(["--dry-run", "--tma-store", "--hidden", "1004", "--out", str(out)])
    assert exc.value.code == 2
    assert "needs rows of a multiple of 16 bytes" in capsys.readouterr().err


def test_oracle_dry_run_rows(tmp_path):
    out = tmp_path / "oracle.jsonl"
    args = ["--dry-run", "--out", str(out), "--models", "mixtral-8x7b", "qwen3-30b-a3b",
            "--tokens", "256", "--k-step", "16"]
    assert oracle_launch.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    workloads = {oracle.workload_key(r) for r in rows}
    assert len(workloads) == 6  # 2 models x (ep uniform, ep skewed, tp uniform), 256 tokens
    for key in workloads:
        grid = [r for r in rows if oracle.workload_key(r) == key and r["kind"] == "grid"]
        plan = [r for r in rows if oracle.workload_key(r) == key and r["kind"] == "plan"]
        assert len(plan) == 1 and len(plan[0]["k_ranks"]) == 2
        assert [r["k"] for r in grid] == oracle.k_grid(plan[0]["num_ctas"], 16)
        # the plan's predicted time is the least over the grid (the model's own optimum)
        assert plan[0]["predicted_ms"] <= min(r["predicted_ms"] for r in grid) + 1e-9
        assert all("p50_ms" not in r for r in grid)  # nothing measured


def test_suite_grid_and_budget():
    assert len(oracle.SUITE) >= 15
    assert {m for m, *_ in oracle.SUITE} == set(oracle.MODELS)
    assert {(lay, r) for _, lay, r, _ in oracle.SUITE} >= {("ep", "uniform"), ("ep", "skewed"),
                                                           ("tp", "uniform")}
    assert oracle.k_grid(132, 1) == list(range(1, 132))
    assert oracle.k_grid(132, 50) == [1, 16, 51, 101, 131]
    with pytest.raises(ValueError):
        oracle.k_grid(1, 1)
    assert oracle.auto_step(132, 0.001, 23, 12.0) == 1  # 0.3 s for every k: fits
    step = oracle.auto_step(132, 0.01, 23, 12.0)  # 23 ms per k, 12 s: ~52 k
    assert 2 <= step <= 3 and len(oracle.k_grid(132, step)) * 0.23 <= 12.0 + 0.23 * 3


def _measured(model, k_times, plan_k, plan_t):
    w = dict(model=model, layout="ep", routing="uniform", tokens_per_rank=4096)
    rows = [dict(w, kind="grid", k=k, p20_ms=t, p50_ms=t, p80_ms=t, predicted_ms=t * 0.9)
            for k, t in k_times.items()]
    rows.append(dict(w, kind="plan", k=plan_k, p20_ms=plan_t, p50_ms=plan_t, p80_ms=plan_t,
                     predicted_ms=plan_t * 0.9, k_ranks=[plan_k, plan_k], num_ctas=132,
                     k_step=1))
    return rows


def test_oracle_dry_run_four_ranks_tp_x_ep(tmp_path):
    """Nothing assumes 2 GPUs: a TP2 x EP2 suite on 4 ranks, labelled so in the table."""
    out = tmp_path / "oracle.jsonl"
    assert oracle_launch.main(["--dry-run", "--world", "4", "--out", str(out), "--models",
                               "qwen3-30b-a3b", "--tokens", "256", "--k-step", "32",
                               "--layouts", "tp2ep2", "ep"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    plans = [r for r in rows if r["kind"] == "plan"]
    assert {r["layout_name"] for r in plans} == {"tp2ep2", "ep4"}
    assert all(len(r["k_ranks"]) == 4 for r in plans)


def test_layout_names():
    from megatron_overlap.bench.cli import layout_label, layout_sizes

    assert layout_sizes("ep", 4) == (1, 4) and layout_sizes("tp", 4) == (4, 1)
    assert layout_sizes("tp2ep2", 4) == (2, 2) and layout_sizes("ep2", 2) == (1, 2)
    assert [layout_label(*t) for t in ((1, 4), (4, 1), (2, 2), (1, 1))] == [
        "ep4", "tp4", "tp2ep2", "ep1"]
    with pytest.raises(ValueError, match="TP x EP = 2, but there are 4 ranks"):
        layout_sizes("tp2", 4)
    with pytest.raises(ValueError, match="'bogus'"):
        layout_sizes("bogus", 2)


def test_layout_name_check_before_the_world_is_known():
    from megatron_overlap.bench.cli import check_layout_name

    assert check_layout_name("ep") is None and check_layout_name("tp") is None
    assert check_layout_name("tp2ep4") == (2, 4) and check_layout_name("ep3") == (1, 3)
    for bad in ("ep01", "pp2", "", "ep0"):
        with pytest.raises(ValueError, match=f"layout {bad!r}: expected epN"):
            check_layout_name(bad)


def test_regret_summary_table_and_plot(tmp_path):
    rows = (_measured("a", {1: 2.0, 16: 1.2, 64: 1.0, 131: 1.5}, 60, 1.05)
            + _measured("b", {1: 3.0, 16: 2.0, 64: 2.2}, 16, 2.0)
            + _measured("c", {1: 1.0, 16: 1.1}, 5, 0.9))  # the plan beats every grid k
    s = {r["model"]: r for r in oracle.summarize(rows)}
    assert s["a"]["k_oracle"] == 64 and s["a"]["regret"] == pytest.approx(0.05)
    assert s["a"]["regret_fixed"] == pytest.approx(0.2)
    assert s["b"]["regret"] == 0 and s["b"]["k_oracle"] == 16
    assert s["c"]["regret"] == 0 and s["c"]["k_oracle"] == 5
    text = oracle.table(list(s.values()))
    assert "mean 1.67 %, max 5.00 % over 3 workloads" in text
    path = tmp_path / "oracle.png"
    oracle.plot(rows, list(s.values()), str(path))
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("script,args,message", [
    ("oracle.py", ["--dry-run", "--tokens", "-5"], "--tokens: '-5': expected an integer >= 1"),
    ("oracle.py", ["--dry-run", "--num-sms", "0"], "--num-sms: '0': expected an integer >= 1"),
    ("oracle.py", ["--dry-run", "--num-sms", "100000"], "--num-sms 100000: expected at most 65536"),
    ("oracle.py", ["--dry-run", "--world", "4", "--layouts", "tp2"],
     "--layouts: layout 'tp2': TP x EP = 2, but there are 4 ranks"),
    ("calibrate.py", ["--dry-run", "--ffn", "0", "--out", "x.yaml"], "--ffn: '0'"),
    ("calibrate.py", ["--dry-run", "--ctas", "-1", "--out", "x.yaml"], "--ctas: '-1'"),
    ("calibrate.py", ["--dry-run", "--ffn", "768", "--out", "x.yaml"],
     ">= 2 distinct K-step counts"),
    ("calibrate.py", ["--dry-run", "--base", "nope", "--out", "x.yaml"],
     "hardware profile 'nope'"),
    ("oracle.py", ["--dry-run", "--models", "nosuch"], "model 'nosuch': unknown"),
    ("oracle.py", ["--dry-run", "--world", "3"], "ep_size=3 must divide"),
    ("oracle.py", ["--num-sms", "10"], "--num-sms: only with --dry-run"),
    ("bench_op.py", ["--iters", "0"], "--iters: '0': expected an integer >= 1"),
    ("bench_op.py", ["--stack-dump-s", "0"], "--stack-dump-s: '0': expected a finite number"),
    ("bench_op.py", ["--models", "nosuch"], "model 'nosuch': unknown"),
    ("bench_op.py", ["--variants", "bogus"], "tile variant 'bogus'"),
    ("bench_op.py", ["--variants", "128x256x64w8s3dynrot"],
     "'tma' and 'rot' only with the static schedule"),
    ("bench_op.py", ["--out", "."], "--out '.' is a directory"),
    ("bench_op.py", ["--out", "/dev/null/x/rows.jsonl"], "cannot create its folder"),
    ("bench_layer.py", ["--out", "/dev/null/x/rows.jsonl"], "cannot create its folder"),
    ("prefill.py", ["--out", "/dev/null/x/rows.jsonl"], "cannot create its folder"),
    ("oracle.py", ["--dry-run", "--out", "/dev/null/x/rows.jsonl"], "cannot create its folder"),
    ("bench_layer.py", ["--out", "newdir/"], "--out 'newdir/' is a directory"),
    ("bench_fc1.py", ["--out", "new/.."], "is a directory: give a file path"),
    ("trace_summary.py", ["t.json", "--top", "0"], "--top: '0': expected an integer >= 1"),
    ("trace_summary.py", ["t.json", "--gap-us", "nan"], "--gap-us: 'nan': expected finite"),
    ("profile_call.py", ["--tokens", "x"], "--tokens: 'x'"),
    ("bench_host.py", ["--out", "/proc/rows.jsonl"], "cannot be written"),
    ("bench_layer.py", ["--out", "/proc/rows.jsonl"], "cannot be written"),
])
def test_launchers_reject_bad_values(script, args, message, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    launch = Path(__file__).resolve().parents[2] / "launch" / script
    proc = subprocess.run([sys.executable, str(launch), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_bench_op_tile_variant_names():
    import importlib.util

    from megatron_overlap.ops.triton_gemm2_gatherrs import TileConfig

    path = Path(__file__).resolve().parents[2] / "launch" / "bench_op.py"
    spec = importlib.util.spec_from_file_location("bench_op_launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_tile("128x256x64w8s3") == (TileConfig(), 1)
    assert module.parse_tile("128x128x64w4s3dyng2") == (
        TileConfig(bn=128, num_warps=4, static=False), 2)
    assert module.parse_tile("128x256x64w8s3tma") == (TileConfig(tma_store=True), 1)
    assert module.parse_tile("128x256x64w8s3rot") == (TileConfig(rotate=True), 1)
    assert module.parse_tile("128x256x64w8s3tmarot") == (
        TileConfig(tma_store=True, rotate=True), 1)
    for bad in ("128x256x64w8s3rottma", "128x256x64w8s3dynrot", "128x256x64w8s3dyntma",
                "128x256", "128x256x64w0s0", "128x256x64w3s3", "8192x8192x64w8s3"):
        with pytest.raises(ValueError, match=f"tile variant {bad!r}"):
            module.parse_tile(bad)
    # each row's tma_store: the epilogue its provider ran (None: no GEMM2 of ours)
    tma, regs = TileConfig(tma_store=True), TileConfig()
    tma_of = module.provider_tma_store
    for provider in ("ours", "ours_nocomm", "ours_prepared", "ours_paired", "ours[k=8]"):
        assert tma_of(provider, tma, 2048) is True and tma_of(provider, regs, 2048) is False
    assert tma_of("ours[128x256x64w8s3]", tma, 2048) is False  # the variant's own tile
    assert tma_of("nocomm[128x256x64w8s3tma]", regs, 2048) is True
    assert tma_of("ours", tma, 1004) is False  # 2008-byte rows: the register fallback
    for provider in ("gemm", "megatron", "prereduced", "bound"):
        assert tma_of(provider, tma, 2048) is None


def test_trace_summary_skips_non_events_and_names_bad_times(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "launch" / "trace_summary.py"
    spec = importlib.util.spec_from_file_location("trace_summary_launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    good = {"ph": "X", "ts": 1, "dur": 2, "name": "k", "cat": "kernel"}
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [1, "x", None, {"ph": "M"}, good]}))
    assert module.load(str(trace)) == [good]
    trace.write_text(json.dumps({"traceEvents": [good, {"ph": "X", "ts": "a", "dur": 1}]}))
    with pytest.raises(ValueError, match=r"t.json: traceEvents\[1\] has ts='a'"):
        module.load(str(trace))
    for bad, what in (({"ts": 1, "dur": float("nan")}, "dur=nan"), ({"ts": 1, "dur": -2},
                      "dur=-2"), ({"ts": 1, "dur": 2, "name": None}, "name=None")):
        trace.write_text(json.dumps({"traceEvents": [good, {"ph": "X", "name": "k", **bad}]}))
        with pytest.raises(ValueError, match=rf"traceEvents\[1\] has .*{what}"):
            module.load(str(trace))
    trace.write_bytes(b"\x8b\x1f not text")
    with pytest.raises(ValueError, match="t.json: not a JSON chrome trace"):
        module.load(str(trace))
    import gzip
    packed = tmp_path / "t.json.gz"
    packed.write_bytes(gzip.compress(json.dumps({"traceEvents": [good]}).encode()))
    assert module.load(str(packed)) == [good]
    sync = {"ph": "X", "ts": 0, "dur": 40, "name": "cudaStreamSynchronize", "cat": "cuda_runtime"}
    launch = {"ph": "X", "ts": 5, "dur": 3, "name": "cudaLaunchKernel", "cat": "cuda_runtime"}
    driver = {"ph": "X", "ts": 20, "dur": 4, "name": "cuLaunchKernel", "cat": "cuda_driver"}
    events = [sync, launch, dict(launch, ts=9, dur=7), dict(sync, dur=10), good, driver]
    assert module.api_totals(events) == [("cudaStreamSynchronize", 50.0, 2, 40.0),
                                         ("cudaLaunchKernel", 10.0, 2, 7.0),
                                         ("cuLaunchKernel", 4.0, 1, 4.0)]
    trace.write_text(json.dumps({"traceEvents": events}))
    text = module.summarize(str(trace))
    assert "-- CUDA API calls (runtime and driver) by host time" in text
    assert "cuLaunchKernel" in text
    assert "      50    2       40  cudaStreamSynchronize" in text


def test_check_host_memory_refuses_copies_that_do_not_fit():
    """The launchers' CPU guard: copies of a model's parameters (plus one for the build)
    that would not fit in the available host memory are refused with the numbers named,
    instead of the OS killing the run; `approx_param_count` sizes the shipped models as
    their model cards do."""
    from megatron_overlap.bench.cli import (
        HostMemoryError,
        available_host_bytes,
        check_host_memory,
    )
    from megatron_overlap.models import approx_param_count, load_model_shape

    check_host_memory(2**20, 2, "m", available=10 * 2**20)  # 3 MiB of 10: fine
    check_host_memory(2**40, 0, "m", available=1)  # nothing to build
    with pytest.raises(HostMemoryError, match=r"m: 3 copies of its ~1\.0 GiB of parameters "
                                              r"\(one per variant\) and their build need "
                                              r"~4\.0 GiB of host memory, 4\.2 GiB are"):
        check_host_memory(2**30, 3, "m", available=int(4.2 * 2**30))
    assert isinstance(HostMemoryError("x"), MemoryError)
    avail = available_host_bytes()
    assert avail is None or avail > 0
    # Total parameters, billions (model cards): 46.7, 30.5, 15.7, 14.3, 41.9.
    for name, billions in [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5),
                           ("deepseek-v2-lite", 15.7), ("qwen1.5-moe-a2.7b", 14.3),
                           ("phi-3.5-moe", 41.9)]:
        count = approx_param_count(load_model_shape(name))
        assert abs(count / 1e9 - billions) < 0.03 * billions, (name, count)
    with pytest.raises(ValueError, match="num_layers=0"):
        approx_param_count(load_model_shape("tiny"), 0)


@pytest.mark.parametrize("script", ["prefill.py", "bench_layer.py"])
def test_launchers_refuse_a_model_too_big_for_the_host(script, tmp_path):
    """A model whose experts alone are ~0.5 TiB per copy (tiny's shape, 1024 experts of
    F = 2^16 at H = 2048) is refused before anything is built, with exit status 2."""
    from megatron_overlap.bench.cli import available_host_bytes

    avail = available_host_bytes()
    if avail is None or avail > 2**40:
        pytest.skip("host memory unknown or over 1 TiB")
    text = (REPO / "configs" / "models" / "tiny.yaml").read_text()
    for key, value in [("hidden_size", 2048), ("moe_ffn_hidden_size", 65536),
                       ("num_moe_experts", 1024), ("kv_channels", 512)]:
        text = "\n".join(f"{key}: {value}" if line.startswith(f"{key}:") else line
                         for line in text.splitlines())
    huge = tmp_path / "huge.yaml"
    huge.write_text(text)
    proc = subprocess.run([sys.executable, str(REPO / "launch" / script), "--model", str(huge),
                           "--out", ""], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "GiB are available; on the CPU use a smaller model" in proc.stderr, proc.stderr


def test_bench_host_times_every_step(tmp_path, capsys):
    bench_host = _load("bench_host")
    out = tmp_path / "host.jsonl"
    assert bench_host.main(["--model", "qwen1.5-moe-a2.7b", "--tokens", "256", "--rounds", "2",
                            "--thrash-mib", "1", "--out", str(out)]) == 0
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == ["triton_metadata", "plan (direct)", "plan (auto)",
                                         "direct_layout", "host tile list", "tables (steps)",
                                         "tables (fused)", "env (os.environ)",
                                         "env (getenv)"]
    assert all(r["cold_us"] > 0 and r["warm_us"] > 0 and r["rounds"] == 2 for r in rows)
    # one intra-op thread while timing (--threads' default), torch's count restored after
    assert all(r["intra_op_threads"] == 1 for r in rows)
    import torch

    before = torch.get_num_threads()
    assert bench_host.main(["--model", "qwen1.5-moe-a2.7b", "--tokens", "256", "--rounds", "1",
                            "--thrash-mib", "1", "--threads", "0"]) == 0
    assert torch.get_num_threads() == before
    assert "cold/warm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        bench_host.main(["--threads", "-1", "--rounds", "1"])
    assert exc.value.code == 2 and "--threads: -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # more threads than cores
        bench_host.main(["--threads", "100000", "--rounds", "1"])
    assert exc.value.code == 2 and "this machine's cores" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # 60 experts do not split over 7 ranks
        bench_host.main(["--model", "qwen1.5-moe-a2.7b", "--ep", "7", "--rounds", "1"])
    assert exc.value.code == 2
    assert "do not split over 7 ranks" in capsys.readouterr().err
    (tmp_path / "adir").mkdir()
    with pytest.raises(SystemExit) as exc:  # before any timing
        bench_host.main(["--out", str(tmp_path / "adir"), "--rounds", "1"])
    assert exc.value.code == 2


def test_bench_host_gpu_needs_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: --gpu would run (tests/gpu runs it)")
    bench_host = _load("bench_host")
    with pytest.raises(SystemExit) as exc:
        bench_host.main(["--gpu", "--rounds", "1"])
    assert exc.value.code == 2 and "--gpu needs CUDA" in capsys.readouterr().err


def test_bench_host_gpu_refuses_ep(capsys):
    bench_host = _load("bench_host")
    with pytest.raises(SystemExit) as exc:
        bench_host.main(["--gpu", "--ep", "2", "--rounds", "1"])
    assert exc.value.code == 2 and "--ep does not apply to --gpu" in capsys.readouterr().err


def test_out_under_a_file_names_the_file(tmp_path):
    """`check_launch_inputs`: an --out whose folder path runs through a file names that
    file (the OS alone says "File exists" or "Not a directory")."""
    from megatron_overlap.bench.cli import check_launch_inputs

    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile" / "rows.jsonl", tmp_path / "afile" / "sub" / "rows.jsonl"):
        with pytest.raises(ValueError, match=f"'{tmp_path / 'afile'}' is not a directory"):
            check_launch_inputs(str(out))
    check_launch_inputs(str(tmp_path / "new" / "rows.jsonl"))  # a new folder is made
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "rows.jsonl").exists()
