"""The flag-on experts on CUDA: grouped FC1 through torch's grouped GEMM, zero-copy FC2 view.

Runs tests/cpu/test_grouped_experts.py's layer cases on GPUs (NCCL), in bf16 (the dtype
torch's CUDA grouped GEMM takes): layers built on the CPU and moved with `.to("cuda")` (so
the re-stacking after `Module.to` is exercised), grouped FC1 (forced and "auto") and the
per-expert loop both within the stated bf16 tolerance of stock Megatron, the grouped GEMM
really `torch.nn.functional.grouped_mm` (or `torch._grouped_mm`), FC2 weights a view.
Skipped without CUDA; world 2 needs two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from tests.cpu import test_grouped_experts as suite
from tests.support.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = {
    1: [suite.Case(dtype=torch.bfloat16), suite.Case(dtype=torch.bfloat16, activation="geglu"),
        suite.Case(dtype=torch.bfloat16, num_experts=8, topk=4)],
    2: [suite.Case(ep=2, dtype=torch.bfloat16), suite.Case(tp=2, dtype=torch.bfloat16),
        suite.Case(ep=2, num_experts=16, topk=8, dtype=torch.bfloat16)],
    4: [suite.Case(tp=2, ep=2, dtype=torch.bfloat16), suite.Case(ep=4, dtype=torch.bfloat16),
        suite.Case(tp=4, dtype=torch.bfloat16)],
}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_grouped_fc1_and_fc2_view_on_gpu(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    assert suite.grouped_mm_name() != "loop", "this torch has no grouped GEMM"
    cases = CASES[world]
    results = run_distributed(suite._worker, world, cases, timeout_s=300, backend="nccl",
                              device="cuda")
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            assert res["device"] == "cuda", res
            suite.check_layer(case, res, f"world {world} rank {rank} {case}")
