"""GPU runs of the CPU suites' cases: the reference op and flag on vs off on CUDA + NCCL.

Skipped without CUDA. Run on the GPU machine (docs/gpu.md):
    source scripts/device_setup.sh && python3 -m pytest tests/gpu -q
World 2 needs two GPUs (skipped with one). bf16 cases use the same stated tolerances as the
CPU suites; on the GPU the GEMMs run on tensor cores (fp32 accumulation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.cpu import test_megatron_flag as flag_suite
from tests.cpu import test_reference_op as op_suite
from tests.support.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _needs_gpus(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reference_op_on_gpu(world):
    _needs_gpus(world)
    cases = op_suite._cases(world)
    results = run_distributed(op_suite._worker, world, cases, timeout_s=300, backend="nccl",
                              device="cuda")
    op_suite.check_results(cases, results)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flag_on_matches_flag_off_on_gpu(world):
    _needs_gpus(world)
    cases = flag_suite._cases(world)
    # Layer cases again in bf16, as the GPU runs them (model cases stay fp32: two bf16
    # layers of attention amplify differences past the layer tolerance).
    cases += [dataclasses.replace(c, dtype=torch.bfloat16, check_grads=False) for c in cases
              if c.dtype == torch.float32 and not c.model]
    results = run_distributed(flag_suite._worker, world, cases, timeout_s=300,
                              backend="nccl", device="cuda")
    flag_suite.check_results(world, cases, results)
