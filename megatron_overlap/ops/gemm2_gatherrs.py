"""The fused GEMM2 + GatherRS operation: backend choice and dispatch.

Shape symbols as in `megatron_overlap.metadata`.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.reference import gemm2_gatherrs_reference
from megatron_overlap.resource import Plan

_warned: set = set()


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that actually runs for `backend` on `device`.

    `"auto"` resolves to `"reference"` in this version (the Triton kernels are not part of
    it yet) with a one-time warning that says so; `"triton"` raises.

    Raises:
        ValueError: unknown backend name.
        NotImplementedError: `"triton"` requested; it is not available in this version.
    """
    if backend == "reference":
        return "reference"
    if backend == "auto":
        reason = "the Triton GEMM2 + GatherRS kernels are not part of this version"
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(
                f"moe_gatherrs_backend='auto' runs the reference path on {device}: {reason}",
                stacklevel=3,
            )
        return "reference"
    if backend == "triton":
        raise NotImplementedError(
            "moe_gatherrs_backend='triton' is not available in this version of megatron_overlap; "
            "use 'reference' or 'auto'"
        )
    raise ValueError(f"backend={backend!r}; expected one of 'auto', 'triton', 'reference'")


def gemm2_gatherrs(
    h: torch.Tensor,
    w2: torch.Tensor,
    meta: GatherRSMetadata,
    *,
    group: Optional[dist.ProcessGroup],
    options: GatherRSOptions,
    plan: Optional[Plan] = None,
) -> torch.Tensor:
    """FC2 + un-permute + top-k combine + TP reduce-scatter + EP return, as one operation.

    Args:
        h: [N, F] FC1 output after activation and router probabilities, rows grouped by local
            expert, then source chunk, then token (Megatron's post-dispatch order).
        w2: [L, H, F] FC2 weights of the local experts (`linear_fc2.weight` layout).
        meta: routing metadata (`metadata.build_metadata`).
        group: the tp_ep process group (R = TP * EP ranks); None when R == 1.
        options: backend, communication CTAs, timeout.
        plan: the resource manager's plan for this launch (unused by the reference path).

    Returns:
        [T, H] in h's dtype: the routed experts' contribution to this rank's tokens.

    Raises:
        TypeError, ValueError: bad operands (see `reference.check_operands`).
        NotImplementedError: backend "triton" in this version.
    """
    backend = resolve_backend(options.backend, h.device)
    del plan  # only the fused kernels use it
    assert backend == "reference"
    return gemm2_gatherrs_reference(h, w2, meta, group)
