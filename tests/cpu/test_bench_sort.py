"""`launch/bench_sort.py` without a GPU: its argument checks and its refusal without CUDA
(its timing needs CUDA; its variants' agreement is `test_layout_cpp`'s and the GPU test's)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch"))

import bench_sort  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_needs_cuda(capsys):
    assert bench_sort.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--rounds", "0"], "expected an integer >= 1"),
    (["--seed", "-1"], "expected an integer >= 0"),
    (["--out", "/"], "is a directory"),
    (["--thrash-mib", "0"], "'0': expected an integer in [1, 65536]"),
    (["--thrash-mib", "65537"], "'65537': expected an integer in [1, 65536]"),
    pytest.param(["--out", "/proc/version"],
                 "--out '/proc/version' cannot be written: it is a file of the kernel's proc",
                 marks=pytest.mark.skipif(not os.path.isfile("/proc/version"),
                                          reason="no /proc/version")),
])
def test_bad_arguments(argv, match, capsys):
    """Refused before CUDA is looked for (argparse's exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        bench_sort.main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_thrash_mib_over_available_memory(monkeypatch, capsys):
    from megatron_overlap.bench import cli

    monkeypatch.setattr(cli, "available_host_bytes", lambda: 2**30)  # 1 GiB available
    with pytest.raises(SystemExit) as exc:
        bench_sort.main(["--thrash-mib", "1024"])
    assert exc.value.code == 2
    assert ("--thrash-mib 1024: expected at most 90 % of the host memory available"
            in capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refused_without_cuda_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "sub" / "sort.jsonl"
    assert bench_sort.main(["--out", str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exc:  # a bad --out folder still fails first
        bench_sort.main(["--out", str(tmp_path / "afile" / "sort.jsonl")])
    assert exc.value.code == 2
    assert f"'{tmp_path / 'afile'}' is not a directory" in capsys.readouterr().err


def test_cases_cover_the_sorted_layouts():
    """Every workload has R * L chunks of N rows, with R > 1 (a real sort) except the
    world-1 one (the identity the dispatcher skips)."""
    assert {r for _, r, _, _ in bench_sort.CASES} == {1, 2}
    assert all(n > 0 and experts > 1 for _, _, experts, n in bench_sort.CASES)
