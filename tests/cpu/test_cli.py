"""`megatron_overlap.bench.cli`'s checks of the launchers' inputs: the bounded integer type,
the host-memory check of a cache thrash, and `check_launch_inputs` (no folder made with
`create=False`; an existing --out that is no regular file refused)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from megatron_overlap.bench import cli
from megatron_overlap.bench.cli import (
    THRASH_MIB_MAX,
    check_launch_inputs,
    check_thrash_memory,
    int_in,
    make_folder,
)


def test_int_in():
    parse = int_in(1, 8)
    assert parse("1") == 1 and parse("8") == 8
    for text in ("0", "9", "x", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer in \[1, 8\]"):
            parse(text)


def test_thrash_memory_bound():
    gib = 2**30
    check_thrash_memory(1024, available=2 * gib)  # 1 GiB of 2: fits
    with pytest.raises(ValueError, match=r"--thrash-mib 2048: expected at most 90 % of the "
                                         r"host memory available now \(2048 MiB available"):
        check_thrash_memory(2048, available=2 * gib)
    with pytest.raises(ValueError, match="--mib 1900"):
        check_thrash_memory(1900, "--mib", available=2 * gib)  # 90 % of 2048 is 1843
    assert THRASH_MIB_MAX == 65536  # the documented cap of --thrash-mib (64 GiB)


def test_thrash_memory_unknown_is_no_check(monkeypatch):
    monkeypatch.setattr(cli, "available_host_bytes", lambda: None)
    check_thrash_memory(THRASH_MIB_MAX)


def test_no_folder_made_without_create(tmp_path):
    out = tmp_path / "new" / "sub" / "rows.jsonl"
    check_launch_inputs(str(out), create=False)
    assert not (tmp_path / "new").exists()
    make_folder(str(out))  # what the launcher does once the run proceeds
    assert (tmp_path / "new" / "sub").is_dir() and not out.exists()
    # the default still makes the folder (the other launchers' behaviour)
    check_launch_inputs(str(tmp_path / "other" / "rows.jsonl"))
    assert (tmp_path / "other").is_dir()


def test_bad_folder_still_fails_without_create(tmp_path):
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / "afile" / "rows.jsonl", tmp_path / "afile" / "sub" / "rows.jsonl"):
        with pytest.raises(ValueError, match=f"'{tmp_path / 'afile'}' is not a directory"):
            check_launch_inputs(str(out), create=False)
    (tmp_path / "results").mkdir()
    with pytest.raises(ValueError, match="is a directory: give a file path"):
        # "new/../results" is the directory "results" once "new" exists
        check_launch_inputs(str(tmp_path / "new" / ".." / "results"), create=False)
    assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="cannot create its folder"):
        check_launch_inputs("/dev/null/x/rows.jsonl", create=False)
    if os.path.isdir("/proc/self"):
        with pytest.raises(ValueError, match="kernel's proc file system"):
            check_launch_inputs("/proc/self/newdir/rows.jsonl", create=False)


def test_existing_folder_checks_the_file_without_create(tmp_path):
    out = tmp_path / "rows.jsonl"
    check_launch_inputs(str(out), create=False)
    assert not out.exists()  # the file made for the check is removed again
    out.write_text('{"a": 1}\n')
    check_launch_inputs(str(out), create=False)
    assert out.read_text() == '{"a": 1}\n'


@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("path, kind", [("/proc/version", "proc"),
                                        ("/proc/self/status", "proc"),
                                        ("/sys/kernel/mm/transparent_hugepage/enabled",
                                         "sysfs")])
def test_kernel_files_are_refused(path, kind, create):
    """Root can open these for appending; a row written to them fails (or, in /sys, is
    taken as a setting)."""
    if not os.path.isfile(path):
        pytest.skip(f"no {path} here")
    with pytest.raises(ValueError, match=f"--out '{path}' cannot be written: it is a file of "
                                         f"the kernel's {kind} file system"):
        check_launch_inputs(path, **({} if create else {"create": False}))


def _block_devices() -> list:
    found = []
    for name in sorted(os.listdir("/dev")) if os.path.isdir("/dev") else []:
        try:
            if stat.S_ISBLK(os.stat(os.path.join("/dev", name)).st_mode):
                found.append(os.path.join("/dev", name))
        except OSError:
            pass
    return found


def test_block_device_refused():
    """(refused before it is opened: never written)"""
    devices = _block_devices()
    if not devices:
        pytest.skip("no block device here")
    with pytest.raises(ValueError, match="it is a block device"):
        check_launch_inputs(devices[0], "--rows")


def test_character_device_and_fifo_accepted(tmp_path):
    if os.path.exists("/dev/null"):
        check_launch_inputs("/dev/null")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="cannot be written"):  # no reader: no waiting
        check_launch_inputs(str(fifo))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        check_launch_inputs(str(fifo))
    finally:
        os.close(reader)


def test_pseudo_file_system():
    assert cli.pseudo_file_system("/nonexistent/x") is None
    assert cli.pseudo_file_system(os.getcwd()) is None or os.getcwd().startswith(
        ("/proc", "/sys"))
    if os.path.isfile("/proc/version"):
        assert cli.pseudo_file_system("/proc/version") == "proc"


@pytest.mark.parametrize("argv", [
    ["bench_op.py"],                 # no CUDA: refused after the input checks
    ["oracle.py"],                   # the GPU run: the same
    ["bench_fc1.py", "--ep", "7"],   # an EP that does not divide the experts
], ids=["bench_op", "oracle", "bench_fc1"])
def test_refused_launcher_runs_leave_no_out_folder(tmp_path, argv):
    import subprocess
    import sys

    from tests.support.launch import launcher_env

    if argv[0] != "bench_fc1.py":
        import torch

        if torch.cuda.is_available():
            pytest.skip("refused for lack of CUDA only on a CPU machine")
    launch = Path(__file__).resolve().parents[2] / "launch"
    proc = subprocess.run([sys.executable, str(launch / argv[0]), *argv[1:], "--out",
                           "new/rows.jsonl"], cwd=tmp_path, env=launcher_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert not (tmp_path / "new").exists()


def test_oracle_dry_run_still_makes_its_out_folder(tmp_path):
    import subprocess
    import sys

    from tests.support.launch import launcher_env

    launch = Path(__file__).resolve().parents[2] / "launch"
    proc = subprocess.run([sys.executable, str(launch / "oracle.py"), "--dry-run", "--out",
                           "new/rows.jsonl"], cwd=tmp_path, env=launcher_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert (tmp_path / "new" / "rows.jsonl").stat().st_size > 0


@pytest.mark.parametrize("layout", ["ep01", "pp2", "ep\u0662"])
def test_bench_op_refuses_a_bad_layout_name_before_any_gpu_work(tmp_path, layout):
    """A misspelt --layouts is named as such on any machine (before v6.0 a CPU machine said
    only "needs CUDA GPUs", and a GPU machine said it after starting the process group)."""
    import subprocess
    import sys

    from tests.support.launch import launcher_env

    launch = Path(__file__).resolve().parents[2] / "launch"
    proc = subprocess.run([sys.executable, str(launch / "bench_op.py"), "--layouts", "ep",
                           layout, "--out", "new/rows.jsonl"], cwd=tmp_path,
                          env=launcher_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"--layouts: layout {layout!r}: expected epN" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "new").exists()
