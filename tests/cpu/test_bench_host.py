"""`launch/bench_host.py`'s argument checks, before any timing: --thrash-mib's bound, an
--out that cannot take rows (a /proc file), and no --out folder left by a refused run."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from megatron_overlap.bench import cli

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--model", "qwen1.5-moe-a2.7b", "--tokens", "256", "--rounds", "1"]


@pytest.fixture
def bench_host(monkeypatch):
    """The launcher, its timing replaced by one that fails the test (these runs must be
    refused first) unless a test sets its own."""
    spec = importlib.util.spec_from_file_location("_launch_bench_host_t",
                                                  REPO / "launch" / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def timed(*args, **kwargs):
        raise AssertionError("the run was timed instead of refused")

    monkeypatch.setattr(mod, "time_steps", timed)
    return mod


def _refused(bench_host, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        bench_host.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("mib", ["0", "65537", "1099511627776"])
def test_thrash_mib_bound(bench_host, mib, capsys):
    err = _refused(bench_host, SMALL + ["--thrash-mib", mib], capsys)
    assert f"argument --thrash-mib: '{mib}': expected an integer in [1, 65536]" in err


def test_thrash_mib_over_available_memory(bench_host, monkeypatch, capsys):
    monkeypatch.setattr(cli, "available_host_bytes", lambda: 2**30)  # 1 GiB available
    err = _refused(bench_host, SMALL + ["--thrash-mib", "1024"], capsys)
    assert "--thrash-mib 1024: expected at most 90 % of the host memory available" in err


@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="no /proc/version")
def test_out_a_proc_file_refused_before_timing(bench_host, capsys):
    err = _refused(bench_host, SMALL + ["--thrash-mib", "1", "--out", "/proc/version"], capsys)
    assert "--out '/proc/version' cannot be written: it is a file of the kernel's proc" in err


@pytest.mark.parametrize("argv, match", [
    (["--gpu", "--ep", "2"], "--ep does not apply to --gpu"),
    (["--model", "qwen1.5-moe-a2.7b", "--ep", "7"], "do not split over 7 ranks"),
    (["--model", "nosuch-model"], "nosuch-model"),
    (SMALL + ["--profile-step", "nosuch"], "--profile-step 'nosuch'"),
])
def test_refused_run_leaves_no_folder(bench_host, argv, match, tmp_path, capsys):
    out = tmp_path / "new" / "sub" / "rows.jsonl"
    err = _refused(bench_host, argv + ["--rounds", "1", "--out", str(out)], capsys)
    assert match in err
    assert not (tmp_path / "new").exists()


def test_bad_out_folder_still_fails_early(bench_host, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    err = _refused(bench_host, SMALL + ["--out", str(tmp_path / "afile" / "x" / "rows.jsonl")],
                   capsys)
    assert f"'{tmp_path / 'afile'}' is not a directory" in err


def test_run_that_proceeds_makes_the_folder(bench_host, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_host, "time_steps",
                        lambda todo, thrash, rounds, sync=None: {n: (2.0, 1.0) for n in todo})
    out = tmp_path / "new" / "sub" / "rows.jsonl"
    assert bench_host.main(SMALL + ["--thrash-mib", "1", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["cold_us"] == 2.0 and r["thrash_mib"] == 1 for r in rows)
