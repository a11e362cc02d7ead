"""megatron_overlap.bench.breakdown: the host-stage timers (patching, ranks' stage sets) and
check_folder (the launchers' --trace-dir check)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_overlap.bench import breakdown
from megatron_overlap.bench.cli import check_folder
from tests.support.dist import run_distributed


class _Stub:
    def step(self, x):
        return x + 1

    def other(self, x):
        return x * 2


def _forward(stub):
    return stub.other(stub.step(1))


def test_host_breakdown_times_and_unpatches():
    # reduce_max is collective: one gloo rank
    out = run_distributed(_world1_worker, 1)[0]
    assert set(out["v"]) == {"forward", "python.gc", "s.step", "s.other"}, out
    assert 0 < out["v"]["s.step"] < out["v"]["forward"], out


def _world1_worker(rank, world):
    stub = _Stub()
    targets = [(stub, "step", "s.step"), (stub, "other", "s.other")]
    out = breakdown.host_breakdown({"v": (lambda: _forward(stub), targets)},
                                   torch.device("cpu"), iters=3)
    assert "step" not in stub.__dict__ and "other" not in stub.__dict__  # restored
    return out


def test_patch_failure_part_way_restores_what_was_patched():
    stub = _Stub()
    stub.step = stub.step  # an instance attribute of its own: must come back as it was
    own = stub.__dict__["step"]
    targets = [(stub, "step", "a"), (stub, "missing", "b")]
    with pytest.raises(AttributeError):
        with breakdown._Patched(targets):
            pass
    assert stub.__dict__["step"] is own and "missing" not in stub.__dict__


def _uneven_worker(rank, world):
    stub = _Stub()
    # rank 0 enters one stage more than rank 1: the union is reduced, 0 where absent
    targets = [(stub, "step", "s.step")] + ([(stub, "other", "s.other")] if rank == 0 else [])
    return breakdown.host_breakdown({"v": (lambda: _forward(stub), targets)},
                                    torch.device("cpu"), iters=2)


def test_ranks_with_different_stages_reduce_the_union():
    results = run_distributed(_uneven_worker, 2, timeout_s=120)
    assert results[0] == results[1], results  # the same maxima on every rank
    stages = results[0]["v"]
    assert set(stages) == {"forward", "python.gc", "s.step", "s.other"}, stages
    assert 0 < stages["s.other"] < stages["forward"] and stages["python.gc"] < 1e6, stages


def test_iters_must_be_positive():
    with pytest.raises(ValueError, match="iters=0"):
        breakdown.host_breakdown({}, torch.device("cpu"), iters=0)


def test_check_folder(tmp_path):
    check_folder(str(tmp_path), "--trace-dir")  # an existing writable directory
    check_folder(str(tmp_path / "a" / "b"), "--trace-dir")  # creatable
    assert not (tmp_path / "a").exists()  # nothing made
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"--trace-dir .*f/sub.*cannot create it.*not a "
                                         r"directory"):
        check_folder(str(tmp_path / "f" / "sub"), "--trace-dir")
    with pytest.raises(ValueError, match="is not a directory"):
        check_folder(str(tmp_path / "f"), "--trace-dir")
    with pytest.raises(ValueError, match="empty path"):
        check_folder("", "--trace-dir")
    if os.path.isdir("/proc/self"):
        with pytest.raises(ValueError, match="kernel's proc file system"):
            check_folder("/proc/self/traces", "--trace-dir")


def _profile_worker(rank, world, prefix):
    try:
        breakdown.profile_forwards({"v": lambda: torch.ones(4).sum()}, torch.device("cpu"),
                                   "t", trace_prefix=prefix)
    except RuntimeError as err:
        return str(err)
    return None


def test_profile_forwards_raises_when_no_trace_was_written(tmp_path):
    ok = run_distributed(_profile_worker, 1, str(tmp_path / "p"))[0]
    assert ok is None and (tmp_path / "p_v.json").is_file()
    err = run_distributed(_profile_worker, 1, str(tmp_path / "missing" / "p"))[0]
    assert err is not None and "wrote no chrome trace" in err, err
