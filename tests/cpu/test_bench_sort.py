"""`launch/bench_sort.py` without a GPU: its argument checks and its refusal without CUDA
(its timing needs CUDA; its variants' agreement is `test_layout_cpp`'s and the GPU test's)."""

from __future__ import annotations

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
])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_sort.main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_cases_cover_the_sorted_layouts():
    """Every workload has R * L chunks of N rows, with R > 1 (a real sort) except the
    world-1 one (the identity the dispatcher skips)."""
    assert {r for _, r, _, _ in bench_sort.CASES} == {1, 2}
    assert all(n > 0 and experts > 1 for _, _, experts, n in bench_sort.CASES)
