"""`FastLauncher`: which launches reuse a compiled kernel, with which arguments, and when
the normal JIT path runs instead (the GPU tests run every kernel through it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_overlap.kernels.launch import FAST_LAUNCH_ENV, FastLauncher, fast_launch_enabled


class _Compiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        # Triton's runner passes grid[0], grid[1], grid[2] to the launcher.
        return lambda *args: self.log.append(("compiled", (grid[0], grid[1], grid[2]), args))


class _JitFn:
    """Stands in for a triton.jit function: (x_ptr, n, BLOCK: constexpr, EVEN: constexpr)."""

    arg_names = ["x_ptr", "n", "BLOCK", "EVEN"]
    constexprs = [2, 3]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _Compiled(self.log)
        return run


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(FastLauncher, "_on_gpu", staticmethod(lambda t: True))
    monkeypatch.setattr(FastLauncher, "_device", staticmethod(lambda: 0))
    monkeypatch.delenv(FAST_LAUNCH_ENV, raising=False)
    return FastLauncher(_JitFn())


def test_reuses_compiled_kernel_per_key(launcher):
    x = torch.zeros(64, dtype=torch.float32)
    launcher((4,), x, 100, BLOCK=32, EVEN=False, num_warps=4)
    launcher((5,), x, 200, BLOCK=32, EVEN=False, num_warps=4)  # same key (int32, !=1, !%16)
    launcher((6,), x, 96, BLOCK=32, EVEN=False, num_warps=4)  # multiple of 16: new key
    launcher((7,), x, 2**40, BLOCK=32, EVEN=False, num_warps=4)  # int64: new key
    launcher((8,), x, 200, BLOCK=64, EVEN=False, num_warps=4)  # constexpr: new key
    launcher((9,), x, 200, BLOCK=32, EVEN=False, num_warps=8)  # option: new key
    launcher((10,), x.double(), 200, BLOCK=32, EVEN=False, num_warps=4)  # dtype: new key
    launcher((11,), x, np.int64(300), BLOCK=32, EVEN=False, num_warps=4)  # numpy int: as 200
    log = launcher.fn.log
    assert [entry[0] for entry in log] == ["jit", "compiled", "jit", "jit", "jit", "jit", "jit",
                                           "compiled"]
    # The compiled launcher gets every parameter in order, constexprs included.
    assert log[1][1] == (5, 1, 1) and log[1][2][1:] == (200, 32, False)
    assert len(launcher._cache) == 6
    launcher((3, 2), x, 200, BLOCK=32, EVEN=False, num_warps=4)  # a 2-D grid, padded
    assert log[-1][:2] == ("compiled", (3, 2, 1))


def test_numpy_ints_and_unkeyed_arguments(launcher):
    x = torch.zeros(4)
    launcher((1,), x, np.int32(7), BLOCK=16, EVEN=True)  # reaches Triton as a Python int
    assert type(launcher.fn.log[-1][2][1]) is int
    launcher((1,), x, 2.5, BLOCK=16, EVEN=True)
    launcher((1,), x, 3.5, BLOCK=16, EVEN=True)  # floats: one key
    launcher((1,), x, "s", BLOCK=16, EVEN=True)  # no key: the JIT, not an error
    launcher((1,), x, "s", BLOCK=16, EVEN=True)
    assert [e[0] for e in launcher.fn.log] == ["jit", "jit", "compiled", "jit", "jit"]
    launcher((1,), x, 3, BLOCK=16, EVEN=[1])  # an unhashable keyword value: the JIT too
    assert launcher.fn.log[-1][0] == "jit"


def test_normal_path_off_gpu_and_when_disabled(monkeypatch):
    fn = _JitFn()
    x = torch.zeros(4)
    FastLauncher(fn)((1,), x, 3, BLOCK=16, EVEN=True)
    FastLauncher(fn)((1,), x, 3, BLOCK=16, EVEN=True)  # CPU tensor: always the JIT
    monkeypatch.setattr(FastLauncher, "_on_gpu", staticmethod(lambda t: True))
    monkeypatch.setattr(FastLauncher, "_device", staticmethod(lambda: 0))
    monkeypatch.setenv(FAST_LAUNCH_ENV, "0")
    launcher = FastLauncher(fn)
    launcher((1,), x, 3, BLOCK=16, EVEN=True)
    launcher((1,), x, 3, BLOCK=16, EVEN=True)
    assert [entry[0] for entry in fn.log] == ["jit"] * 4


def test_env_and_signature_errors(monkeypatch):
    monkeypatch.setenv(FAST_LAUNCH_ENV, "yes")
    with pytest.raises(ValueError, match="MEGATRON_OVERLAP_FAST_LAUNCH='yes'"):
        fast_launch_enabled()
    bad = _JitFn()
    bad.constexprs = [1]
    with pytest.raises(ValueError, match="constexpr parameters last"):
        FastLauncher(bad)


def test_real_kernels_have_constexprs_last():
    from megatron_overlap.kernels import gemm2_gatherrs as k

    for fn in (k._gemm_scatter_kernel, k._prepare_kernel, k._index_kernel, k._finalize_kernel):
        FastLauncher(fn)


def test_host_int_helpers_match_triton():
    """The launch path's plain-Python `_cdiv` / `_pow2` equal `triton.cdiv` /
    `triton.next_power_of_2` (which are ConstexprFunctions, ~6 us per host call)."""
    import triton

    from megatron_overlap.ops.triton_gemm2_gatherrs import _cdiv, _pow2

    assert [_pow2(n) for n in range(0, 4100)] == [triton.next_power_of_2(n)
                                                  for n in range(0, 4100)]
    assert all(_cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 600) for b in range(1, 70))


class _CudaLauncherLike:
    """The attributes of Triton 3.6's `CudaLauncher` that `_direct_launch` reads."""

    def __init__(self, log, scratch=128, profile=0):
        self.log = log
        self.num_ctas, self.global_scratch_size, self.global_scratch_align = 1, scratch, 128
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.profile_scratch_size = profile

    def launch(self, *args):
        self.log.append(args)


class _CompiledLike:
    def __init__(self, log, **kw):
        self.run = _CudaLauncherLike(log, **kw)
        self.function, self.packed_metadata = 4242, (8, 1, 65536)


@pytest.fixture
def triton36(monkeypatch):
    """Triton's version read as 3.6.0, its stream getter and scratch allocator faked."""
    import sys

    import triton
    from triton import knobs
    from triton.runtime import _allocation

    driver_mod = sys.modules["triton.runtime.driver"]  # (the package attribute is the object)

    class _Active:
        @staticmethod
        def get_current_stream(device):
            return 1000 + device

    class _Driver:
        active = _Active()

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(driver_mod, "driver", _Driver())
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    before = _allocation._allocator.get()
    triton.set_allocator(lambda size, align, stream: ("scratch", size, align, stream))
    yield knobs.runtime
    triton.set_allocator(before)


def test_direct_launch_passes_what_tritons_runner_passes(triton36):
    from megatron_overlap.kernels.launch import _direct_launch

    log = []
    go = _direct_launch(_CompiledLike(log), 3)
    x = torch.zeros(4)
    assert go((2, 3, 1), [x, 7, 32, False]) is True
    # grid, stream of device 3, function, cooperative / PDL flags, the global scratch of
    # grid x num_ctas x size bytes from Triton's allocator, no profile scratch, the packed
    # metadata, no launch metadata or hooks, then every argument (constexprs included)
    assert log == [(2, 3, 1, 1003, 4242, False, True, ("scratch", 6 * 128, 128, 1003), None,
                    (8, 1, 65536), None, None, None, x, 7, 32, False)]
    assert _direct_launch(_CompiledLike(log, scratch=0), 0)((1, 1, 1), [])
    assert log[-1][7] is None  # no scratch asked, none allocated
    triton36.launch_enter_hook = lambda metadata: None  # a profiler: Triton's own runner
    assert go((1, 1, 1), [x]) is False and len(log) == 2


def test_direct_launch_declines_other_tritons_and_profile_scratch(triton36, monkeypatch):
    import triton

    from megatron_overlap.kernels.launch import _direct_launch

    assert _direct_launch(_CompiledLike([], profile=64), 0) is None
    assert _direct_launch(object(), 0) is None  # not a compiled kernel it knows
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert _direct_launch(_CompiledLike([]), 0) is None


def test_cached_kernels_launch_directly_only_in_direct_mode(launcher, monkeypatch):
    """Mode "direct": a cached kernel goes through `_direct_launch` (made once per key);
    where that declines (a hook appeared) `CompiledKernel[grid]` runs. The default mode
    never calls it."""
    from megatron_overlap.kernels import launch as launch_mod

    direct_log, made = [], []

    def fake_direct(compiled, device):
        made.append(device)

        def go(grid, args):
            direct_log.append((grid, tuple(args)))
            return len(direct_log) < 2  # the second direct launch: a hook appeared

        return go

    monkeypatch.setattr(launch_mod, "_direct_launch", fake_direct)
    x = torch.zeros(64, dtype=torch.float32)
    launcher((4,), x, 100, BLOCK=32, EVEN=False, num_warps=4)  # default mode: compiles
    launcher((4,), x, 150, BLOCK=32, EVEN=False, num_warps=4)  # default mode: compiled[grid]
    assert made == [] and direct_log == []
    monkeypatch.setenv(FAST_LAUNCH_ENV, "direct")
    for n in (200, 300):
        launcher((4,), x, n, BLOCK=32, EVEN=False, num_warps=4)
    log = launcher.fn.log
    assert [entry[0] for entry in log] == ["jit", "compiled", "compiled"]  # 300: declined
    assert made == [0]  # one `_direct_launch` per key
    assert direct_log == [((4, 1, 1), (x, 200, 32, False)), ((4, 1, 1), (x, 300, 32, False))]
    assert log[2][2] == (x, 300, 32, False)


def test_fast_launch_modes(monkeypatch):
    from megatron_overlap.kernels.launch import fast_launch_mode

    for value, mode in (("", "1"), ("1", "1"), ("0", "0"), ("direct", "direct")):
        monkeypatch.setenv(FAST_LAUNCH_ENV, value)
        assert fast_launch_mode() == mode and fast_launch_enabled() == (mode != "0")
    monkeypatch.setenv(FAST_LAUNCH_ENV, "Direct")
    with pytest.raises(ValueError, match="expected '0', '1' or 'direct'"):
        fast_launch_mode()


def test_key_keeps_every_distinction_triton_makes(launcher):
    """The flat key: 1 / True / 0 / False / None / a float, an int's type range, a
    multiple of 16, a tensor's dtype and 16-byte alignment: each a kernel of its own (a
    JIT launch the first time, the cached kernel the second); numpy scalars as the Python
    ones."""
    x = torch.zeros(64, dtype=torch.float32)
    odd = x[1:]  # 4 bytes past a 16-byte boundary
    values = [1, True, 0, False, None, 2.5, 7, 2**31, 2**63]  # (0: a multiple of 16)
    tensors = [x, odd, x.double()]
    cases = [(x, v) for v in values] + [(t, 7) for t in tensors[1:]]
    for case in cases:
        launcher((1,), *case, BLOCK=16, EVEN=True)
    log = launcher.fn.log
    assert [e[0] for e in log] == ["jit"] * len(cases), "two arguments lists shared a key"
    for case in cases:
        launcher((1,), *case, BLOCK=16, EVEN=True)
    assert [e[0] for e in log[len(cases):]] == ["compiled"] * len(cases)
    launcher((1,), x, np.int64(7), BLOCK=16, EVEN=True)
    launcher((1,), x, np.float64(2.5), BLOCK=16, EVEN=True)
    assert [e[0] for e in log[-2:]] == ["compiled", "compiled"]
    assert type(log[-1][2][1]) is float and type(log[-2][2][1]) is int
    launcher((1,), x, 32, BLOCK=16, EVEN=True)  # a multiple of 16 as 0 is: Triton's too
    assert log[-1][0] == "compiled"
