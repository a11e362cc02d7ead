"""`launch/compile_sm90.py`: the GEMM2 + scatter kernel compiles for Hopper on a machine
without a GPU (Triton's own ptxas), in the default configuration and with the TMA-store
epilogue and rotated waves, within sm_90's shared memory; its bad arguments exit 2. What the
GPU machine's Triton makes of the epilogue (synchronous or not) is version-dependent and
not asserted here (docs/perf_notes.md v5.2)."""

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
    for name, args in (("default", ()), ("tma", ("--tma-store", "--rotate"))):
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


@pytest.mark.parametrize("args, message", [
    (("--ffn", "0"), "--ffn: '0': expected an integer >= 1"),
    (("--rotate", "--dynamic"), "--rotate needs the static schedule"),
    (("--compare", "/nonexistent"), "not a checkout of this repository"),
])
def test_bad_arguments_exit_2(args, message):
    proc = _run(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
