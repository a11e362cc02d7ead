"""megatron_overlap: a fused, tile-signaled GEMM2 + GatherRS MoE return path for Megatron-Core.

Importing the package touches no GPU and compiles nothing. The Megatron integration lives in
`megatron_overlap.megatron` (imported on demand: it imports Megatron-Core).
"""

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata, build_metadata, source_slots
from megatron_overlap.ops import gemm2_gatherrs
from megatron_overlap.reference import gemm2_gatherrs_reference

__version__ = "0.1.0"

__all__ = [
    "GatherRSMetadata",
    "GatherRSOptions",
    "build_metadata",
    "gemm2_gatherrs",
    "gemm2_gatherrs_reference",
    "source_slots",
    "__version__",
]
