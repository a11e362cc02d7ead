"""Pure-PyTorch twin of the fused GEMM2 + GatherRS operation (DESIGN.md §3).

Runs on any device and any torch.distributed backend (gloo on CPU, NCCL on GPU), is
autograd-capable, and is what the tests and benchmarks compare the fused kernels against.

Shape symbols: N routed rows on this rank, F ffn size per TP rank, H hidden, L local
experts, T local tokens, S pre-reduced slots sent, R = TP * EP ranks (see `metadata`).

The steps are the fused op's, done one after another:
  1. GEMM2: y[N, H] = h[N, F] @ w2[l]^T for the rows of each local expert l (dtype of h,
     fp32 accumulation inside the matmul), as Megatron's FC2 (`RowParallelLinear`) does;
  2. Gather: for each slot, the sum of its rows' y in ascending local-expert order, in fp32,
     rounded once to the dtype of h (the bytes that travel);
  3. return all-to-all / reduce-scatter: every slot goes to its source rank over the tp_ep
     group (this is both the EP return all-to-all and, for TP > 1, the TP reduce-scatter of
     partial sums);
  4. finalize: on each rank, out[T, H] = sum over senders in group-rank order of their
     partial rows, in fp32, then cast to the dtype of h. Fixed order: deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from megatron_overlap.metadata import GatherRSMetadata


def check_operands(h: torch.Tensor, w2: torch.Tensor, meta: GatherRSMetadata) -> None:
    """Validate the operands of `gemm2_gatherrs` against its metadata.

    Raises:
        TypeError: h or w2 is not a floating-point tensor, or their dtypes differ.
        ValueError: a shape does not match (the message names both sides).
    """
    for name, t in (("h", h), ("w2", w2)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if h.dtype != w2.dtype:
        raise TypeError(f"h.dtype={h.dtype} and w2.dtype={w2.dtype} must match")
    if h.dim() != 2:
        raise ValueError(f"h must be [rows, ffn], got shape {tuple(h.shape)}")
    if w2.dim() != 3 or w2.shape[0] != meta.num_local_experts or w2.shape[2] != h.shape[1]:
        raise ValueError(
            f"w2 must be [local experts={meta.num_local_experts}, hidden, ffn={h.shape[1]}], "
            f"got shape {tuple(w2.shape)}"
        )
    num_rows = int(meta.tokens_per_local_expert.sum())
    if h.shape[0] != num_rows:
        raise ValueError(f"h has {h.shape[0]} rows, the routing metadata says {num_rows}")


def gather_slots(y: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """Sum the rows of each slot in a fixed order.

    Args:
        y: [N, H] expert outputs.
        gather_index: [S, K] int64 row indices, -1 padded (`GatherRSMetadata.gather_index`).

    Returns:
        [S, H] fp32: for each slot, y[gather_index[s, 0]] + y[gather_index[s, 1]] + ...
    """
    num_slots, num_contrib = gather_index.shape
    acc = torch.zeros(num_slots, y.shape[1], dtype=torch.float32, device=y.device)
    for k in range(num_contrib):
        idx = gather_index[:, k]
        valid = (idx >= 0).unsqueeze(1)
        acc = acc + torch.where(valid, y[idx.clamp(min=0)].float(), 0.0)
    return acc


def gemm2_gatherrs_reference(
    h: torch.Tensor,
    w2: torch.Tensor,
    meta: GatherRSMetadata,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """FC2 of every local expert + un-permute + top-k combine + TP reduce-scatter + EP return.

    Args:
        h: [N, F] FC1 output after activation and router probabilities, rows in Megatron's
            post-dispatch order (local expert, source chunk, token); bf16/fp16/fp32.
        w2: [L, H, F] FC2 weight of each local expert, Megatron's `linear_fc2.weight` layout.
        meta: routing metadata of this call (`metadata.build_metadata`).
        group: the tp_ep process group (R ranks); may be None when R == 1.

    Returns:
        [T, H] in h's dtype: the MoE layer's routed-expert output for this rank's tokens,
        matching Megatron's alltoall path (FC2, `combine_preprocess`, `token_combine`,
        `combine_postprocess`) within bf16 rounding.

    Raises:
        TypeError, ValueError: see `check_operands`; ValueError if group's size is not R,
            or `meta` is Triton-only (built without slots).
    """
    check_operands(h, w2, meta)
    if meta.gather_index is None:
        raise ValueError(
            "this metadata was built for the Triton backend only (no slots, "
            "build_metadata(row_slot=None)), but the reference path is running: the backend "
            "choice changed between dispatch and combine (e.g. autograd was switched on)")
    if meta.group_size > 1:
        if group is None or dist.get_world_size(group) != meta.group_size:
            raise ValueError(
                f"group must be the tp_ep process group of size {meta.group_size}, got "
                f"{None if group is None else dist.get_world_size(group)}"
            )

    rows = [int(n) for n in meta.tokens_per_local_expert]
    y = torch.cat([h_l @ w2[l].t() for l, h_l in enumerate(torch.split(h, rows))])
    return gatherrs_reference(y, meta, group)


def gatherrs_reference(
    y: torch.Tensor, meta: GatherRSMetadata, group: Optional[dist.ProcessGroup]
) -> torch.Tensor:
    """Steps 2-4 of `gemm2_gatherrs_reference` on GEMM2 outputs y [N, H]: gather (pre-reduce),
    return all-to-all / reduce-scatter of the slots, finalize. Returns [T, H] in y's dtype.

    Also the "pre-reduced, not overlapped" baseline of the operator benchmark (DESIGN.md §5).
    """
    send = gather_slots(y, meta.gather_index).to(y.dtype)
    if meta.group_size > 1:
        # torch's autograd all-to-all (its gradient is the reverse all-to-all); waited on
        # here, so the result is a plain tensor
        recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(
            send.contiguous(), meta.split_sizes(meta.recv_slots),
            meta.split_sizes(meta.send_slots), group))
    else:
        recv = send

    out = torch.zeros(meta.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    offset = 0
    for n in meta.recv_slots:
        n = int(n)
        index = meta.recv_token_index[offset : offset + n]
        out = out.index_add(0, index, recv[offset : offset + n].float())
        offset += n
    return out.to(y.dtype)
