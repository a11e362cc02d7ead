"""Peer-store probe: k CTAs copy a local buffer into a peer's symmetric-memory buffer.

Used by `launch/calibrate.py` to measure the link bandwidth B_link and one CTA's store
bandwidth B_cta of the hardware profile (DESIGN.md §4 quotes such a sweep: 4 CTAs ~63 GB/s,
16 ~238, full grid ~330 on 2x H200 NV18). Each CTA walks the buffer in BLOCK-element chunks,
grid-stride, loading from local HBM and storing through the peer pointer: the same kind of
stores the fused kernel's epilogue issues for a remote-bound tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192
"""Elements per CTA step (16 KiB of bf16: half of one 128 x 128 output tile)."""


@triton.jit
def _peer_store_kernel(src_ptr, dst_ptr, num_elems, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, num_elems, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_elems
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def peer_store(src: torch.Tensor, dst: torch.Tensor, *, num_ctas: int,
               block: int = BLOCK) -> None:
    """Copy `src` into `dst` with `num_ctas` CTAs (asynchronous, current stream).

    Args:
        src: contiguous local tensor.
        dst: contiguous tensor of the same number of elements and dtype, usually a peer's
            symmetric-memory buffer (`handle.get_buffer(peer, ...)`).
        num_ctas: grid size, >= 1.
        block: elements per CTA step (a power of two).

    Raises:
        ValueError: sizes, dtypes or num_ctas do not fit.
    """
    if src.numel() != dst.numel() or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must have the same number of elements and dtype")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1:
        raise ValueError(f"num_ctas={num_ctas!r}: expected an int >= 1")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block}: expected a power of two")
    _peer_store_kernel[(num_ctas,)](src, dst, src.numel(), BLOCK=block, num_warps=8)
