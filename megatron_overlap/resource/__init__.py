"""Resource manager: picks the communication CTAs and the SM partition before every launch.

This version returns a fixed plan; the analytical wave-quantized model (DESIGN.md §4, C++
solver in `csrc/`) replaces `plan_gemm2_gatherrs`'s body without changing its signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata

DEFAULT_NUM_COMM_CTAS = 16
"""Fixed choice until the solver lands: on 2x H200 (NV18) Triton peer stores moved ~238 GB/s
with 16 CTAs against ~257 GB/s with 32 (DESIGN.md §4), so 16 is near the link's knee."""


@dataclass(frozen=True)
class Plan:
    """One launch's resource split.

    Attributes:
        num_comm_ctas: the most CTAs of the fused kernel that may be in the communication
            role (gathering and storing to peers) at once: the SM partition.
        num_ctas: grid of the fused persistent kernel (one CTA per SM), or None when the SM
            count is unknown (CPU / reference backend).
        source: "override" (options.num_comm_ctas), or "fixed" (DEFAULT_NUM_COMM_CTAS).
    """

    num_comm_ctas: int
    num_ctas: Optional[int]
    source: str


def plan_gemm2_gatherrs(
    meta: GatherRSMetadata, options: GatherRSOptions, *, num_sms: Optional[int] = None
) -> Plan:
    """Choose the SM partition of one fused GEMM2 + GatherRS launch; measures nothing.

    Args:
        meta: routing metadata of the call (tokens per local expert per source rank, TP/EP).
        options: `GatherRSOptions`; `num_comm_ctas` overrides the choice.
        num_sms: streaming multiprocessors of the GPU, if known.

    Raises:
        ValueError: the override exceeds the SM count.
    """
    del meta  # the fixed plan does not look at the routing yet
    source = "fixed" if options.num_comm_ctas is None else "override"
    num_comm = DEFAULT_NUM_COMM_CTAS if options.num_comm_ctas is None else options.num_comm_ctas
    if num_sms is not None and num_comm > num_sms:
        raise ValueError(
            f"moe_gatherrs_num_comm_ctas={num_comm} exceeds the GPU's {num_sms} SMs; expected "
            f"1..{num_sms}"
        )
    return Plan(num_comm_ctas=num_comm, num_ctas=num_sms, source=source)
