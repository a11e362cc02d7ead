"""launch/bench_finalize.py on the CPU: its four ways of loading a token's rows from two
buffers agree bit for bit in Triton's interpreter, and its arguments are checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "bench_finalize.py"


def _run(*args, interpret=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_the_four_ways_agree_in_the_interpreter():
    proc = _run("--tiny")
    assert proc.returncode == 0 and "tiny: agree" in proc.stdout, proc.stdout + proc.stderr


def test_bad_arguments():
    proc = _run("--iters", "0")
    assert proc.returncode == 2 and "--iters 0: expected an integer >= 1" in proc.stderr
    import torch

    if not torch.cuda.is_available():
        proc = _run()  # timing without CUDA
        assert proc.returncode == 2 and "timing needs CUDA" in proc.stderr, proc.stderr
        proc = _run("--tiny", interpret=False)  # the check without the interpreter
        assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr
