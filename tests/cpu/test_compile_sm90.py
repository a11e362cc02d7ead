"""`launch/compile_sm90.py`: the GEMM2 + scatter kernel compiles for Hopper on a machine
without a GPU (Triton's own ptxas), in the default configuration, as `WIDE_TILE` and with
the TMA-store epilogue and rotated waves, within sm_90's shared memory, and the register
epilogue's and the pre-reduced send's global stores are 16 bytes wide; its bad arguments
exit 2. What the GPU machine's Triton makes of the epilogue (synchronous or not) is
version-dependent and not asserted here (docs/perf_notes.md v5.2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "compile_sm90.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def cuda_backend():
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its CUDA backend")


@pytest.mark.slow
def test_kernel_compiles_for_sm90_with_and_without_the_tma_epilogue(cuda_backend):
    summaries = {}
    for name, args in (("default", ("--reduce-send",)), ("tma", ("--tma-store", "--rotate")),
                       ("wide", ("--tile", "256x128x64", "--num-stages", "4"))):
        proc = _run(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[name] = json.loads(proc.stdout)
    for name, s in summaries.items():
        assert s["fits_sm90"] and 0 < s["shared_bytes"] <= 232448, (name, s)
        assert s["ptx_counts"]["wgmma.mma_async"] > 0, (name, s)
    # Only the TMA epilogue issues a TMA store (the default stores from registers), and it
    # needs the epilogue tile's shared memory on top of the K loop's.
    assert summaries["default"]["tma_store_wait"] == "none", summaries["default"]
    assert summaries["tma"]["tma_store_wait"] in ("synchronous", "asynchronous")
    assert summaries["tma"]["ptx_counts"]["st.global"] < summaries["default"]["ptx_counts"][
        "st.global"], summaries
    # The register epilogue stores its tile 16 bytes per instruction: 128 x 256 (or 256 x 128)
    # bf16 over 256 threads is 16 st.global.v4.b32 each, not 128 one-element stores (v5.0 to
    # v6.3 lost the pointer's alignment hint in an if: docs/perf_notes.md v6.4). Likewise the
    # pre-reduced send's peer stores.
    for name in ("default", "wide"):
        stores = summaries[name]["global_stores"]
        assert stores.get("st.global.v4.b32", 0) >= 16 and "st.global.b16" not in stores, (
            name, stores)
    stores = summaries["default"]["reduce_send"]["global_stores"]
    assert stores.get("st.global.v4.b32", 0) > 0 and "st.global.b16" not in stores, stores
    # Every arrival signal waits for the TMA stores' writes first (wait, proxy fence, barrier).
    assert summaries["default"]["signals_after_bulk_wait"] is None, summaries["default"]
    assert summaries["tma"]["signals_after_bulk_wait"] is True, summaries["tma"]


def test_signal_order_check_fails_without_the_wait():
    """`signals_after_bulk_wait` on PTX shaped like the kernel's: a signal after a TMA store
    with the wait, the fence or the barrier missing (or a store between) is caught."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_sm90", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    store = "@%p54 cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%rd1, {%r1, %r2}], [%r3];"
    wait, fence, bar = "cp.async.bulk.wait_group 0;", "fence.proxy.async.global;", "bar.sync 0;"
    signal = "@%p60 atom.global.sys.release.add.u64 %rd48, [ %rd49 + 0 ], %rd50;"
    check = module.signals_after_bulk_wait
    assert check("\n".join([store, wait, fence, bar, signal])) is True
    assert check("\n".join([wait, fence, bar, signal, store])) is True  # a loop's next store
    assert check("\n".join([signal])) is None  # no TMA store at all
    for broken in ([store, bar, signal], [store, wait, bar, signal], [store, wait, fence, signal],
                   [wait, fence, store, bar, signal],
                   [store, "cp.async.bulk.wait_group.read 0;", fence, bar, signal],
                   [signal, store]):
        assert check("\n".join(broken)) is False, broken


@pytest.mark.parametrize("args, message", [
    (("--topk", "0"), "--topk: '0': expected an integer >= 1"),
    (("--tile", "128x96x64"), "expected BMxBNxBK, each a power of two in [16, 256]"),
    (("--num-warps", "3"), "--num-warps 3: expected a power of two in [1, 32]"),
    (("--experts-pow2", "100"), "--experts-pow2 100: expected a power of two in [16, 128]"),
    (("--topk", "1000"), "--topk 1000: expected at most --experts-pow2 (128)"),
    (("--out", __file__), "is a file: give a folder"),
    (("--rotate", "--dynamic"), "--rotate and --tma-store need the static schedule"),
    (("--tma-store", "--dynamic"), "--rotate and --tma-store need the static schedule"),
    (("--compare", "/nonexistent"), "not a checkout of this repository"),
])
def test_bad_arguments_exit_2(args, message):
    proc = _run(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
