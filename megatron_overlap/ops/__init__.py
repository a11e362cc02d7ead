"""Operators. `gemm2_gatherrs` is the fused MoE return path (DESIGN.md §3)."""

from megatron_overlap.ops.gemm2_gatherrs import (
    gemm2_gatherrs,
    prepare_gemm2_gatherrs,
    resolve_backend,
)

__all__ = ["gemm2_gatherrs", "prepare_gemm2_gatherrs", "resolve_backend"]
