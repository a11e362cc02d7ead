"""The fused GEMM2 + GatherRS operation: backend choice and dispatch.

Shape symbols as in `megatron_overlap.metadata`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_overlap.config import GatherRSOptions
from megatron_overlap.metadata import GatherRSMetadata
from megatron_overlap.reference import check_operands, gemm2_gatherrs_reference
from megatron_overlap.resource import Plan, plan_gemm2_gatherrs

TRITON_DTYPES = (torch.bfloat16, torch.float16)
"""Dtypes the Triton kernels take (fp32 would run its tensor-core dot in tf32)."""

_warned: set = set()


@functools.lru_cache(maxsize=None)
def _peer_access_reason(device_index: int, group_size: int) -> Optional[str]:
    """Why this node cannot host a group of `group_size` ranks with peer stores, or None."""
    num_devices = torch.cuda.device_count()
    if group_size > num_devices:
        return (f"the tp_ep group has {group_size} ranks but this node has {num_devices} GPUs; "
                "the Triton path needs the whole group on one NVLink node")
    for other in range(num_devices):
        if other != device_index and not torch.cuda.can_device_access_peer(device_index, other):
            return f"GPU {device_index} has no peer access to GPU {other}"
    return None


# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); 2.11 has only it.
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def triton_unavailable_reason(h: torch.Tensor, w2: torch.Tensor,
                              group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why the Triton kernels cannot run this call, or None when they can."""
    if not h.is_cuda:
        return f"the operands are on {h.device}, the Triton kernels need CUDA"
    if h.dtype not in TRITON_DTYPES:
        return f"dtype {h.dtype} (the Triton kernels take {TRITON_DTYPES})"
    if torch.is_grad_enabled() and (h.requires_grad or w2.requires_grad):
        return "autograd is recording (the Triton path is forward-only: inference / prefill)"
    if group is None:
        return None
    return _group_reason(group, h.device.index or 0)


@functools.lru_cache(maxsize=None)
def _group_reason(group: dist.ProcessGroup, device_index: int) -> Optional[str]:
    """The process group's part of `triton_unavailable_reason` (its size, backend and the
    node's peer access do not change during a group's life): worked out once per group
    (hashed by identity) and device, as the Megatron dispatcher asks twice per forward."""
    if dist.get_world_size(group) <= 1:
        return None
    if dist.get_backend(group) != "nccl":
        return f"the process group backend is {dist.get_backend(group)}, expected nccl"
    return _peer_access_reason(device_index, dist.get_world_size(group))


def resolve_backend(backend: str, h: torch.Tensor, w2: torch.Tensor,
                    group: Optional[dist.ProcessGroup], prereduce: bool = False) -> str:
    """The backend that runs this call: `"triton"` or `"reference"`.

    `"auto"` takes the Triton kernels where they can run and otherwise the reference path,
    with a one-time warning per reason.

    Raises:
        ValueError: unknown backend name.
        RuntimeError: `"triton"` requested where it cannot run (the message says why).
    """
    if backend == "reference":
        return "reference"
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend={backend!r}; expected one of 'auto', 'triton', 'reference'")
    reason = triton_unavailable_reason(h, w2, group)
    if reason is None:
        return "triton"
    if backend == "triton":
        raise RuntimeError(f"moe_gatherrs_backend='triton' cannot run here: {reason}")
    key = (reason, prereduce)
    if key not in _warned:
        _warned.add(key)
        dropped = " (moe_gatherrs_prereduce is dropped there)" if prereduce else ""
        warnings.warn(f"moe_gatherrs_backend='auto' runs the reference path{dropped}: {reason}",
                      stacklevel=3)
    return "reference"


def _check_types(meta, options, prepared=None, plan=None) -> None:
    if not isinstance(meta, GatherRSMetadata):
        raise TypeError(f"meta must be a GatherRSMetadata (build_metadata), got "
                        f"{type(meta).__name__}")
    if not isinstance(options, GatherRSOptions):
        raise TypeError(f"options must be a GatherRSOptions, got {type(options).__name__}")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a resource.Plan (plan_gemm2_gatherrs) or None, got "
                        f"{type(plan).__name__}")
    if prepared is not None:
        if not hasattr(prepared, "run"):
            raise TypeError(f"prepared must come from prepare_gemm2_gatherrs, got "
                            f"{type(prepared).__name__}")
        if prepared.meta is not meta:
            prepared.ws.poison(f"call {prepared.epoch} was prepared but not run (run with "
                               "other metadata)")
            raise ValueError("prepared was made for other metadata: pass the GatherRSMetadata "
                             "object it was prepared with (a prepared call keeps that call's "
                             "routing; its workspace is unusable now)")


def prepare_gemm2_gatherrs(
    h_like: torch.Tensor,
    w2: torch.Tensor,
    meta: GatherRSMetadata,
    *,
    group: Optional[dist.ProcessGroup],
    options: GatherRSOptions,
    plan: Optional[Plan] = None,
    routing_maps: Optional[Sequence[torch.Tensor]] = None,
    tile=None,
):
    """Do a call's host work ahead of time, before h is needed (e.g. while FC1 runs).

    Args:
        h_like: any tensor with h's dtype, device and autograd state (e.g. the dispatched
            tokens): it decides the backend as h would.
        w2, meta, group, options, plan: as `gemm2_gatherrs`.
        routing_maps: every rank's [T_d, E] routing map in group-rank order on h's device,
            for the pre-reduced mode. With `options.prereduce=True` they are all-gathered
            here when None (a collective and a host sync); with "auto" and None the call
            runs direct even where the plan chose "prereduce" (no hidden collective).
            Every rank must pass them alike (all or none). Ignored in the direct mode.
        tile: the call's `TileConfig` (`ops.triton_gemm2_gatherrs`); None: with `plan`
            None, the tile the resource manager picks with the plan
            (`ops.triton_gemm2_gatherrs.plan_call`: at world 1 the faster of the default
            tile and `TILE_CANDIDATES` by the wave model, $MEGATRON_OVERLAP_TILE_CHOICE);
            with a `plan` given, `default_tile(h_like.device, meta.group_size)` (the tile
            such a plan is made for). A tile given without a plan is planned with its own
            tile count and time where the hardware profile has its shape, else with
            `resource.DEFAULT_TILE`'s. Read here once for the plan and the call.

    Returns:
        A prepared Triton call to pass as `gemm2_gatherrs(..., prepared=...)` (it must be
        run: every rank of the group counts its arrivals already), or None when the
        reference backend will run the call (nothing to prepare).

    Raises:
        TypeError: meta, options or plan of the wrong type.
        ValueError: unknown backend, or w2 not [L, H, F]; RuntimeError: "triton" where it
            cannot run.
    """
    _check_types(meta, options, plan=plan)
    if not isinstance(w2, torch.Tensor) or w2.dim() != 3:
        raise ValueError(f"w2 must be a [L, H, F] tensor, got "
                         f"{tuple(w2.shape) if isinstance(w2, torch.Tensor) else type(w2)}")
    backend = resolve_backend(options.backend, h_like, w2, group, options.prereduce is True)
    if backend == "reference":
        return None
    from megatron_overlap.ops.triton_gemm2_gatherrs import (
        _Call,
        call_resources,
        compiled_resources,
        default_tile,
        epilogue_stores_tma,
        plan_call,
    )
    from megatron_overlap.resource import DEFAULT_TILE as DEFAULT_TILE_SHAPE
    from megatron_overlap.resource import load_profile
    from megatron_overlap.symm import get_workspace

    if plan is None:
        num_sms = torch.cuda.get_device_properties(h_like.device).multi_processor_count
        plan_options = options
        if options.prereduce == "auto" and routing_maps is None:  # runs direct (see below)
            plan_options = dataclasses.replace(options, prereduce=False)

        def resources(t):
            if meta.routing_map is None:
                return compiled_resources(h_like.dtype, w2.shape[2], w2.shape[1], t)
            return call_resources(h_like.dtype, w2.shape[2], w2.shape[1], meta.tp_size,
                                  meta.topk, meta.routing_map.shape[1], t)

        if tile is None:  # the resource manager picks the tile with the plan
            choice = plan_call(meta, plan_options, device=h_like.device, hidden=w2.shape[1],
                               ffn=w2.shape[2], elem_bytes=h_like.element_size(),
                               num_sms=num_sms, resources=resources)
            tile, plan = choice.tile, choice.plan
        else:  # the caller's tile: its own tile count and time where the profile has one
            shape = (tile.bm, tile.bn, tile.bk)
            plan = plan_gemm2_gatherrs(meta, plan_options, num_sms=num_sms,
                                       hidden=w2.shape[1], ffn=w2.shape[2],
                                       elem_bytes=h_like.element_size(),
                                       kernel=resources(tile),
                                       tile=shape if load_profile().has_tile_time(*shape)
                                       else DEFAULT_TILE_SHAPE,
                                       tma_store=epilogue_stores_tma(tile, w2.shape[1],
                                                                     h_like.element_size()))
    elif tile is None:
        tile = default_tile(h_like.device, meta.group_size)
    workspace = get_workspace(group, hidden=w2.shape[1], dtype=h_like.dtype,
                              device=h_like.device)
    # plan.mode is the same on every rank (options, group-wide counts). An "auto" choice of
    # the pre-reduced mode is taken only where the caller passes the routing maps (the
    # Megatron dispatcher does, gathered without a host sync); gathering them here would add
    # a collective and a host sync to every call, so such a call runs direct. Every rank
    # must pass routing_maps alike.
    prereduce = plan.mode == "prereduce" and (options.prereduce is True
                                              or routing_maps is not None)
    if prereduce:
        from megatron_overlap.ops.triton_prereduce import PreReducedCall

        if routing_maps is None:
            routing_maps = gather_routing_maps(meta.routing_map, group)
        return PreReducedCall(meta, workspace, plan, hidden=w2.shape[1], dtype=h_like.dtype,
                              device=h_like.device, timeout_s=options.timeout_s,
                              routing_maps=routing_maps, tile=tile)
    return _Call(meta, workspace, plan, hidden=w2.shape[1], dtype=h_like.dtype,
                 device=h_like.device, timeout_s=options.timeout_s, tile=tile)


def gather_routing_maps(routing_map: torch.Tensor, group: Optional[dist.ProcessGroup],
                        num_tokens: Optional[Sequence[int]] = None) -> List[torch.Tensor]:
    """Every rank's routing map in group-rank order (for the pre-reduced mode).

    Args:
        routing_map: this rank's bool [T, E] map (T may differ across ranks).
        group: the tp_ep group (None or one rank: just this map).
        num_tokens: every rank's T in group-rank order when the caller knows them (the
            Megatron dispatcher does); None: gathered here (one more collective, and a host
            sync to read them).

    Returns:
        R tensors [T_d, E] (bool) on routing_map's device: one all-gather of the maps padded
        to the largest T. Every rank must pass the same E and the same num_tokens (or None
        on all ranks); that is not checked (it would take another collective).

    Raises:
        ValueError: routing_map is not a bool/uint8 2-D tensor, or num_tokens has the wrong
            length, holds something other than integers >= 0, or not this rank's T at its
            group rank (raised before any collective).
    """
    if (not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2
            or routing_map.dtype not in (torch.bool, torch.uint8)):
        raise ValueError(f"routing_map must be a bool/uint8 [T, E] tensor, got "
                         f"{getattr(routing_map, 'dtype', type(routing_map).__name__)} "
                         f"{tuple(getattr(routing_map, 'shape', ()))}")
    world = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_rank(group)
    if num_tokens is not None:
        sizes = list(num_tokens)
        if (len(sizes) != world or any(isinstance(x, bool) or not isinstance(x, numbers.Integral)
                                       or x < 0 for x in sizes)
                or sizes[me] != routing_map.shape[0]):
            raise ValueError(f"num_tokens={num_tokens!r}: expected {world} integers >= 0 with "
                             f"this rank's {routing_map.shape[0]} tokens at index {me}")
        sizes = [int(x) for x in sizes]
    if world == 1:
        return [routing_map.view(torch.bool)]
    if num_tokens is None:
        size = torch.tensor([routing_map.shape[0]], dtype=torch.int64,
                            device=routing_map.device)
        gathered = torch.empty(world, dtype=torch.int64, device=routing_map.device)
        all_gather_flat(gathered, size, group=group)
        sizes = [int(x) for x in gathered.tolist()]
    if max(sizes) == 0:  # no tokens anywhere: nothing to gather (every rank knows it)
        return [routing_map.new_zeros(0, routing_map.shape[1]).view(torch.bool)
                for _ in range(world)]
    return [m.view(torch.bool)
            for m in all_gather_varsize(routing_map.view(torch.uint8), sizes, group)]


def all_gather_varsize(t: torch.Tensor, sizes: Sequence[int],
                       group: dist.ProcessGroup) -> List[torch.Tensor]:
    """Every rank's `t` in group order (rank r's has sizes[r] rows along dim 0, the other
    dims alike on every rank), as views of one buffer: one all-gather of the tensors padded
    to the largest size, so that it also runs on gloo, whose all-gather needs equal sizes.
    Every rank must pass the same `sizes`."""
    top = max(sizes)
    padded = t.new_zeros((top, *t.shape[1:]))
    padded[: t.shape[0]] = t
    out = t.new_empty((len(sizes) * top, *t.shape[1:]))
    all_gather_flat(out, padded, group=group)
    out = out.view(len(sizes), top, *t.shape[1:])
    return [out[r, :n] for r, n in enumerate(sizes)]


def gemm2_gatherrs(
    h: torch.Tensor,
    w2: torch.Tensor,
    meta: GatherRSMetadata,
    *,
    group: Optional[dist.ProcessGroup],
    options: GatherRSOptions,
    plan: Optional[Plan] = None,
    prepared=None,
) -> torch.Tensor:
    """FC2 + un-permute + top-k combine + TP reduce-scatter + EP return, as one operation.

    Args:
        h: [N, F] FC1 output after activation and router probabilities, rows grouped by local
            expert, then source chunk, then token (Megatron's post-dispatch order).
        w2: [L, H, F] FC2 weights of the local experts (`linear_fc2.weight` layout).
        meta: routing metadata (`metadata.build_metadata`).
        group: the tp_ep process group (R = TP * EP ranks); None when R == 1.
        options: backend, communication CTAs, timeout, combine mode (`prereduce`: a
            pre-reduced Triton call all-gathers the routing maps over `group` unless
            prepared).
        plan: the resource manager's plan; computed here when None (ignored with
            `prepared`, which carries the plan it was prepared with).
        prepared: the result of `prepare_gemm2_gatherrs` for this call, if any (a Triton
            call is then run as prepared); it must have been prepared with this very `meta`.

    Returns:
        [T, H] in h's dtype: the routed experts' contribution to this rank's tokens. The
        Triton backend takes bf16 / fp16 operands ("auto" falls back to the reference path
        for others, which takes any floating dtype).

    Raises:
        TypeError, ValueError: bad operands (see `reference.check_operands`), arguments of
            the wrong type, or `prepared` made for another `meta`.
        RuntimeError: backend "triton" where it cannot run, or a bounded GPU wait expired
            (Triton: reported by the call that finds the record, this one or a later one on
            the same workspace; `GatherRSWorkspace.check_errors()` checks now).
    """
    _check_types(meta, options, prepared, plan)
    check_operands(h, w2, meta)
    if prepared is None:
        prepared = prepare_gemm2_gatherrs(h, w2, meta, group=group, options=options, plan=plan)
    if prepared is None:
        return gemm2_gatherrs_reference(h, w2, meta, group)
    return prepared.run(h, w2)
