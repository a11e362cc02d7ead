"""Running the `launch/` scripts from CPU tests: a clean environment, one or several ranks,
the JSON rows they wrote, and a wrapper that breaks the flag-on path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Wrapper that breaks the flag-on path (halves the routed experts' output of every fused MoE
#: layer), then runs the launcher given after it as __main__.
BROKEN_FLAG_ON = """
import runpy, sys
from megatron_overlap.megatron.moe_layer import GatherRSMoELayer

original = GatherRSMoELayer.routed_experts_compute

def halved(self, hidden_states, probs):
    output, bias = original(self, hidden_states, probs)
    return (output * 0.5 if self.gatherrs else output), bias

GatherRSMoELayer.routed_experts_compute = halved
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launcher_env() -> dict:
    """This process's environment without torchrun's variables, CPU only, one thread, the
    repository first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_launcher(launcher: Path, tmp_path: Path, nproc: int, args, *, out_name: str,
                 timeout_s: float, wrapper: Path = None):
    """Run `launcher` (through `wrapper` if given) on `nproc` ranks in `tmp_path` with
    `args` plus `--out tmp_path/out_name`; returns (completed process, JSON rows written)."""
    out = tmp_path / out_name
    cmd = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}"]
    cmd += [str(wrapper), str(launcher)] if wrapper else [str(launcher)]
    cmd += [*args, "--out", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=launcher_env(),
                          capture_output=True, text=True, timeout=timeout_s)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    return proc, rows


def explain(proc: subprocess.CompletedProcess) -> str:
    """Exit status and the tails of stdout and stderr, for assertion messages."""
    return (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
            f"{proc.stderr[-4000:]}")
