"""scripts/gpu_epilogue_ab.sh on a machine without a GPU: it names its phases, refuses to run
with NVLink multicast possibly on, says there is no GPU, and creates nothing then."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_epilogue_ab.sh"
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
                    NVSHMEM_DISABLE_NVLS="1")


def _run(args, env_extra, cwd):
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST}
    env.update(env_extra, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args, env_extra, message", [
    ([], {}, "usage: bash scripts/gpu_epilogue_ab.sh tests|protocol|op|layer"),
    (["bogus"], NO_MULTICAST, "usage: bash scripts/gpu_epilogue_ab.sh"),
    (["op"], {}, "NVLink multicast is not switched off"),
    (["layer"], NO_MULTICAST, "gpu_epilogue_ab.sh: no GPU"),
])
def test_refusals(args, env_extra, message, tmp_path):
    proc = _run(args, dict(env_extra, OUT="rel_out"), tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "rel_out").exists()
    assert not (SCRIPT.parents[1] / "rel_out").exists()
