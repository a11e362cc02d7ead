"""Alltoall token dispatcher whose combine half is the fused GEMM2 + GatherRS operation.

The dispatch half is Megatron's `MoEAlltoAllTokenDispatcher` (its permute, all-to-alls, TP
all-gather and sort, unchanged) with every rank's tokens per expert kept on the host, from
which every rank knows the tokens per local expert per source rank and the row layout of
every receive buffer (also with one local expert, where Megatron does not keep them).
`preprocess` gathers these counts over the tp_ep group once and copies them to the host
once; Megatron's split sizes are derived from that copy on the host (`megatron_splits`)
instead of by Megatron's device operations and its up to five device-to-host copies
(`MEGATRON_OVERLAP_HOST_SPLITS=0`: Megatron's `preprocess` as it is, then the counts it
gathered copied to the host by us). When the reference path will run, each routed row's
*slot* (`metadata.source_slots`, 4 bytes a row) also travels with the tokens, so the
expert side can pre-reduce a token's rows; the Triton path needs no slots (its rows are
summed where their token lives) and skips them.

The combine half (`gemm2_gatherrs_combine`) replaces Megatron's `combine_preprocess`
(unsort + TP reduce-scatter), `token_combine` (EP all-to-all) and the un-permute of
`combine_postprocess`.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe import token_dispatcher as _megatron_dispatcher
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_overlap._host import current_stream
from megatron_overlap.config import check_environment, host_splits_enabled
from megatron_overlap.metadata import (
    GatherRSMetadata,
    build_metadata,
    megatron_splits,
    source_slots,
    triton_metadata,
)
from megatron_overlap.megatron.config import gatherrs_options, validate_gatherrs_config
from megatron_overlap.ops import gemm2_gatherrs, prepare_gemm2_gatherrs
from megatron_overlap.ops.gemm2_gatherrs import (
    all_gather_flat,
    all_gather_varsize,
    gather_routing_maps,
    triton_unavailable_reason,
)
from megatron_overlap.profiling import span
from megatron_overlap.resource import Plan


def _as_list(splits) -> List[int]:
    """Split sizes (tensor, numpy array or list) as Python ints."""
    if isinstance(splits, torch.Tensor):
        return [int(x) for x in splits.tolist()]
    return [int(x) for x in splits]


def tokens_per_rank(counts: np.ndarray, num_experts: int, topk: int,
                    dropless: bool) -> Optional[List[int]]:
    """Every rank's token count from the exchanged [R, >= E] tokens-per-expert counts: a
    rank's routed pairs / top-k, exact when every token has exactly top-k experts (dropless
    routing). None when routing may drop (`dropless` False: a capacity factor is set) or
    the pairs are not a multiple of top-k: the caller then gathers the counts.

    Decided from data every rank of the group holds alike (the exchanged counts and the
    config), so every rank takes the same branch and launches the same collectives."""
    pairs = np.asarray(counts)[:, :num_experts].sum(axis=1)
    if not dropless or topk < 1 or np.any(pairs % topk):
        return None
    return [int(x) // topk for x in pairs]


def refill(buffer: Optional[torch.Tensor], src: torch.Tensor, *,
           pin_memory: bool) -> torch.Tensor:
    """`src` copied into `buffer` (non-blocking), or into a new host buffer of src's shape and
    dtype when `buffer` is None or does not match; returns the buffer.

    The buffer is allocated outside inference mode: one made under `torch.inference_mode()`
    (an inference forward) could not be refilled by a later forward outside it (a training
    step), which torch refuses ("inplace update to inference tensor outside
    InferenceMode"); a normal tensor is refilled in either mode."""
    if buffer is None or buffer.shape != src.shape or buffer.dtype != src.dtype:
        with torch.inference_mode(False):
            buffer = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin_memory)
    buffer.copy_(src, non_blocking=True)  # a normal tensor: in place in either mode
    return buffer


try:  # the C++ index (csrc/layout.cpp), built by setup.py; else the numpy twin below
    from megatron_overlap.ops._layout import local_expert_sort_index as _sort_index_cpp
except ImportError:
    _sort_index_cpp = None


def local_expert_sort_index_numpy(rows_per_expert_per_chunk: np.ndarray,
                                  out: np.ndarray) -> None:
    """The numpy twin of the C++ `local_expert_sort_index` (same arguments, same values,
    fewer checks): out[d] = the arriving row (chunk-major: source chunk, then local expert)
    that goes to expert-major position d (local expert, then source chunk)."""
    rows = np.asarray(rows_per_expert_per_chunk, dtype=np.int64)
    by_chunk = rows.T.reshape(-1)  # arriving order
    source_start = (np.cumsum(by_chunk) - by_chunk).reshape(rows.shape[1], -1).T.reshape(-1)
    sizes = rows.reshape(-1)  # leaving order
    dest_start = np.cumsum(sizes) - sizes
    out[:] = np.repeat(source_start - dest_start, sizes) + np.arange(out.shape[0])


def sort_by_local_expert(tokens: torch.Tensor, probs: torch.Tensor,
                         rows_per_expert_per_chunk: np.ndarray):
    """Megatron's sort of the dispatched rows by local expert, as one gather per tensor.

    What `MoEAlltoAllTokenDispatcher.dispatch_postprocess` does with the unfused
    `sort_chunks_by_idxs(tokens, num_global_tokens_per_local_expert.ravel(),
    sort_input_by_local_experts, probs=probs)` (megatron-core 0.19: a split into R * L
    chunks and a cat of them, for each tensor), bit for bit, with the gather index built on
    the host (C++ `local_expert_sort_index` where built) in pinned memory, one copy to the
    device and one `index_select` per tensor (measured on one H200 with launch/bench_sort.py,
    Qwen3-30B-A3B's 128 experts at EP2, 32768 rows: host 225 -> 65 us warm, 426 -> 314 us
    cold, GPU 316 -> 115 us; docs/perf_notes.md v5.7).

    Args:
        tokens: [N, H] rows in arriving order (source chunk, then local expert).
        probs: [N] (or [N, ...]) their router probabilities, same order and device.
        rows_per_expert_per_chunk: [L, R] int64 host array, chunk order (sum N).

    Returns:
        (tokens, probs) in expert-major order (local expert, then source chunk).
    """
    num_rows = tokens.shape[0]
    index = torch.empty(num_rows, dtype=torch.int32, pin_memory=tokens.is_cuda)
    (_sort_index_cpp or local_expert_sort_index_numpy)(rows_per_expert_per_chunk,
                                                       index.numpy())
    # pinned: the host allocator keeps the block until this copy is done
    index = index.to(tokens.device, non_blocking=True)
    return tokens.index_select(0, index), probs.index_select(0, index)


class GatherRSAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher with the return path fused into GEMM2 + GatherRS.

    Same constructor as `MoEAlltoAllTokenDispatcher`. After `dispatch_postprocess`,
    `metadata` holds this call's `GatherRSMetadata` (TP/EP group sizes and ranks, tokens per
    local expert per source rank, every rank's tokens per expert, the routing map; slots for
    the reference path). `prepare_combine` (called by `GatherRSMoELayer` while FC1 runs) asks
    the resource manager for a plan (kept in `plan`) and does the Triton call's host work;
    `gemm2_gatherrs_combine` runs the fused operation.

    Raises:
        ValueError: the config is not supported by the fused path (`validate_gatherrs_config`),
            or an environment variable of the fused path has a bad value (every variable
            `megatron_overlap.config.check_environment` checks: `MEGATRON_OVERLAP_` +
            `TILE_LIST`, `HOST_TABLES`, `HOST_CACHE`, `HOST_SPLITS`, `TMA_STORE`,
            `FAST_LAUNCH`, `HW_PROFILE`, `SOLVER`, `FC1_CHUNK_MB`): checked here, on every
            device, so that a typo does not wait for the first GPU launch.
        ImportError: `MEGATRON_OVERLAP_SOLVER=cpp` without the built C++ solver.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        validate_gatherrs_config(config)
        check_environment()
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.options = gatherrs_options(config)
        # Planned with where the reference path runs (no combine mode to choose there, and
        # the mode model's host time is saved).
        self._direct_options = dataclasses.replace(self.options, prereduce=False)
        self.metadata: Optional[GatherRSMetadata] = None
        self.plan: Optional[Plan] = None
        self._prepared = None  # a prepared Triton call (prepare_combine), or None
        self._sent = None  # combine_send's call (Triton) or output (elsewhere), or None
        self._was_prepared = False
        self.num_plans = 0  # resource-manager calls so far (one per forward)
        self.last_combine = None  # what ran the last combine: "reference", "direct", "prereduced"
        # the GEMM2 TileConfig of the last Triton combine (None: none yet, or the reference)
        self.last_tile = None
        self._keep_counts = False  # preprocess keeps Megatron's gathered counts (Triton path)
        self._triton = False  # this forward's combine runs the Triton kernels
        self._megatron_counts = None
        self._num_sms = None
        self._counts_pinned = None  # reused pinned host buffer of the counts (CUDA)
        self._counts_event = None  # reused event: the counts' copy into it is done
        self._counts_ready = self._counts_host = None  # this forward's queued copy
        self._host_splits = False  # this forward derives Megatron's splits on the host
        self._host_sync_point = None  # ... at this point of Megatron's (see preprocess)
        self._splits_done = False  # ... and has done so
        self._per_local_expert = None  # [R, L] rows per source chunk and local expert

    # ---- dispatch half: Megatron's, plus the counts (and slots for the reference path) -

    def _triton_will_run(self, hidden_states: torch.Tensor) -> bool:
        """Whether this forward's combine will run the Triton kernels, which need no slots:
        a backend other than "reference", and `triton_unavailable_reason` finds nothing with
        autograd off (with autograd on, the expert weights require grad: the reference path
        runs)."""
        if self.options.backend == "reference" or torch.is_grad_enabled():
            return False
        group = self.tp_ep_group if self.tp_size * self.ep_size > 1 else None
        return triton_unavailable_reason(hidden_states, hidden_states, group) is None

    def preprocess(self, routing_map):
        """Megatron's `preprocess` on the host-splits path (`dispatch_preprocess` sets
        `_host_splits`: $MEGATRON_OVERLAP_HOST_SPLITS on, and no CUDA graph of the
        preprocess): every rank's tokens per expert (with the slot columns where the
        reference path runs) gathered over the tp_ep group and queued for one copy to the
        host; Megatron's splits are derived from that copy where Megatron would first
        synchronize (`_maybe_dtoh_and_synchronize`). Returns None (Megatron's tokens per
        local expert come from that point).

        Otherwise Megatron's `preprocess`; on the Triton path (`_keep_counts`) it also keeps
        the [R * E] tokens-per-expert tensor that Megatron all-gathers over the tp_ep group
        there (`gather_from_sequence_parallel_region` of `num_local_tokens_per_expert`), in
        `_megatron_counts`; None if that gather did not happen exactly once with that size
        (then `dispatch_preprocess` gathers its own)."""
        if self._host_splits:
            return self._preprocess_host_splits(routing_map)
        self._megatron_counts = None
        if not getattr(self, "_keep_counts", False):
            return super().preprocess(routing_map)
        seen = []
        original = _megatron_dispatcher.gather_from_sequence_parallel_region

        def keep(input_, *args, **kwargs):
            out = original(input_, *args, **kwargs)
            seen.append(out)
            return out

        _megatron_dispatcher.gather_from_sequence_parallel_region = keep
        try:
            result = super().preprocess(routing_map)
        finally:
            _megatron_dispatcher.gather_from_sequence_parallel_region = original
        size = self.tp_size * self.ep_size * routing_map.shape[1]
        if len(seen) == 1 and seen[0].numel() == size:
            self._megatron_counts = seen[0]
        return result

    def _preprocess_host_splits(self, routing_map):
        num_ranks = self.tp_size * self.ep_size
        self._splits_done = False
        self._count_and_queue(routing_map)
        dropping = self.config.moe_expert_capacity_factor is not None
        # Megatron's rule (`preprocess`): the first point whose code reads a split on the host
        # (a capacity's num_out_tokens before the permute; the EP all-to-all's splits; the
        # sort's chunk sizes; the tokens per local expert at the end).
        self._host_sync_point = (
            "before_permutation_1" if dropping else "before_ep_alltoall" if num_ranks > 1
            else "before_permutation_2" if self.num_local_experts > 1 else "before_finish")
        self.num_out_tokens = (None if dropping
                               else routing_map.size(0) * self.config.moe_router_topk)
        return None

    def _count_and_queue(self, routing_map: torch.Tensor,
                         gathered: Optional[torch.Tensor] = None) -> None:
        """This rank's slots where the reference path reads them (`_row_slot`,
        `_dest_token_mask`; None on the Triton path) and every rank's tokens per expert,
        [R, E] (Triton path) or [R, E + EP] (reference path: the slot columns after the
        experts), gathered over the tp_ep group and queued for the host (`_queue_counts`).
        `gathered`: Megatron's own gathered [R * E] counts to use instead (Triton path only,
        where no slot columns are needed)."""
        num_ranks = self.tp_size * self.ep_size
        if self._triton:
            self._row_slot = self._dest_token_mask = None
            counts = routing_map.sum(dim=0) if gathered is None else gathered  # int64
        else:
            self._row_slot, self._dest_token_mask, slots_per_ep = source_slots(
                routing_map, self.ep_size)
            counts = torch.cat([routing_map.sum(dim=0), slots_per_ep]).to(torch.int64)
        if num_ranks > 1 and gathered is None:
            with span("mo.counts_all_gather"):
                out = counts.new_empty(num_ranks * counts.numel())
                all_gather_flat(out, counts, group=self.tp_ep_group)
                counts = out
        self._queue_counts(counts.view(num_ranks, -1))

    def _queue_counts(self, counts: torch.Tensor) -> None:
        """Start the copy of the [R, C] counts to the host (`_counts_to_host` finishes it)."""
        if counts.is_cuda:
            # Into pinned memory asynchronously, with an event: only this copy is waited for.
            # A blocking .cpu() would wait for everything queued by then, and the GPU would
            # idle while the host builds the metadata and enqueues FC1 (measured: ~1.2 ms at
            # 4096 tokens, Qwen3). Buffer and event are reused: the previous forward read
            # the buffer (a copy, in _counts_to_host) before this copy is queued.
            host = self._counts_pinned = refill(self._counts_pinned, counts, pin_memory=True)
            if self._counts_event is None:
                self._counts_event = torch.cuda.Event()
            self._counts_event.record(current_stream(counts.device))
            self._counts_ready = self._counts_event
            self._counts_host = host
        else:
            self._counts_ready, self._counts_host = None, counts

    def _counts_to_host(self) -> None:
        """Wait for `_queue_counts`'s copy; `_counts` = [R, C] int64 numpy, this forward's."""
        with span("mo.counts_to_host"):
            if self._counts_ready is not None:
                self._counts_ready.synchronize()
            # a copy: the pinned buffer is refilled by the next forward
            self._counts = self._counts_host.numpy().copy()
        self._counts_ready = self._counts_host = None

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        """Megatron's, except on the host-splits path: there nothing is copied, and at the
        sync point the counts' copy is waited for, Megatron's splits (`input_splits`,
        `output_splits`, `output_splits_tp`, `num_global_tokens_per_local_expert`, a
        capacity's `num_out_tokens`) are set from it on the host, as the types Megatron
        copies them to (numpy arrays, contiguous CPU tensors of their own), and the [L] int64
        CPU tensor of tokens per local expert is returned. (The metadata is built later, in
        `dispatch_postprocess`: at R > 1 this point is just before the EP all-to-all is
        queued, for which the GPU waits.)"""
        if not self._host_splits:
            return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)
        if point != self._host_sync_point:
            return tokens_per_expert
        self._counts_to_host()
        counts, num_experts = self._counts, self.num_experts
        if self.tp_size * self.ep_size == 1:  # no splits; the counts are the local experts'
            # (copies: the metadata keeps `counts`)
            tokens, per_local = counts[0, :num_experts].copy(), counts[:, :num_experts].copy()
        else:
            splits = megatron_splits(counts, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                     ep_size=self.ep_size, ep_rank=self.ep_rank,
                                     num_experts=num_experts)
            self.input_splits = splits.input_splits
            self.output_splits = splits.output_splits
            self.output_splits_tp = splits.output_splits_tp
            tokens, per_local = splits.tokens_per_local_expert, splits.per_local_expert
        self._per_local_expert = per_local  # [R, L] chunk order (the sort's sizes)
        if self.num_local_experts > 1:  # contiguous, as Megatron's
            self.num_global_tokens_per_local_expert = torch.from_numpy(
                np.ascontiguousarray(per_local))
        if self.num_out_tokens is None:  # a capacity: the routed rows that were kept
            me = self.ep_rank * self.tp_size + self.tp_rank
            self.num_out_tokens = int(counts[me, :num_experts].sum())
        self._splits_done = True
        return torch.from_numpy(tokens)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """Megatron's `dispatch_preprocess` with this class's `preprocess` (see there); on
        the path without host splits, then every rank's routing counts (Megatron's own on
        the Triton path) and this rank's slots where the reference path will read them.

        Raises:
            RuntimeError: the dispatcher's `drop_and_pad` is on (the fused path is dropless
                or drops without padding; `validate_gatherrs_config` refuses the config
                option, this the attribute set after construction).
        """
        if self.drop_and_pad:  # e.g. switched on after construction for decoding
            raise RuntimeError(
                "moe_gatherrs_overlap=True does not support drop-and-pad dispatch "
                "(moe_pad_expert_input_to_capacity, or the dispatcher's drop_and_pad set at "
                "run time, e.g. by megatron.core.inference's set_decode_expert_padding)")
        triton = self._triton = self._triton_will_run(hidden_states)
        self._host_splits = (host_splits_enabled()
                             and self.cuda_dtoh_point == "before_permutation_1")
        if self._host_splits:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self._keep_counts = triton and self.tp_size * self.ep_size > 1
        try:
            out = super().dispatch_preprocess(hidden_states, routing_map, probs)
        finally:
            self._keep_counts = False
        gathered, self._megatron_counts = self._megatron_counts, None
        self._count_and_queue(self.routing_map, gathered)
        return out

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """Megatron's EP all-to-all of tokens and probs; the slots follow the same splits."""
        tokens, probs = super().token_dispatch(permutated_local_input_tokens, permuted_probs)
        if self.ep_size > 1 and self._row_slot is not None:
            out_splits, in_splits = _as_list(self.output_splits), _as_list(self.input_splits)
            received = self._row_slot.new_empty(sum(out_splits))
            dist.all_to_all_single(received, self._row_slot, out_splits, in_splits,
                                   group=self.ep_group)
            self._row_slot = received
        return tokens, probs

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """Megatron's TP all-gather + sort by local expert (applied to the slots too, where
        the reference path needs them); on the host-splits path the sort is
        `sort_by_local_expert` (one gather per tensor), and at world 1, where it is the
        identity, it does not run. Then builds `metadata`.

        Raises:
            RuntimeError: on the host-splits path, Megatron's code never reached the sync
                point (a megatron-core whose dispatcher calls `_maybe_dtoh_and_synchronize`
                at other points than 0.19's).
        """
        if self._host_splits:
            if self.tp_size * self.ep_size > 1:
                self._check_splits_done()  # (before a collective sized by them)
            tokens, probs = global_input_tokens, global_probs
            if self.tp_size > 1:  # Megatron's TP all-gather, as Megatron calls it
                sizes = self.output_splits_tp.tolist()
                gather = _megatron_dispatcher.gather_from_sequence_parallel_region
                tokens = gather(tokens, group=self.tp_group, output_split_sizes=sizes)
                probs = gather(probs, group=self.tp_group, output_split_sizes=sizes)
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2",
                                                                 self.tokens_per_expert)
            # The sort by local expert: one gather per tensor; with one source chunk (world
            # 1) it is the identity and does not run.
            if self.num_local_experts > 1 and self.tp_size * self.ep_size > 1:
                with span("mo.sort_by_local_expert"):
                    tokens, probs = sort_by_local_expert(tokens, probs,
                                                         self._per_local_expert.T)
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish",
                                                                 tokens_per_expert)
            self.tokens_per_expert = None
            self._check_splits_done()
            self._splits_done = False
        else:
            tokens, tokens_per_expert, probs = super().dispatch_postprocess(
                global_input_tokens, global_probs
            )
            self._counts_to_host()  # [R, E] (Triton path) or [R, E + EP] (slot columns)
        row_slot = self._row_slot  # None on the Triton path: counts and routing map suffice
        if row_slot is not None:
            row_slot = self._gather_and_sort_slots(row_slot)
        with span("mo.build_metadata"):
            self.metadata = self._build_metadata(row_slot)
        self._row_slot = None
        return tokens, tokens_per_expert, probs

    def _check_splits_done(self) -> None:
        if not self._splits_done:
            raise RuntimeError(
                f"the host-splits dispatch never reached Megatron's sync point "
                f"{self._host_sync_point!r} (this megatron-core's dispatcher does not call "
                "_maybe_dtoh_and_synchronize there); set MEGATRON_OVERLAP_HOST_SPLITS=0")

    def _build_metadata(self, row_slot):
        if row_slot is None:  # Triton path: counts and routing map from this forward
            return triton_metadata(
                self._counts, tp_size=self.tp_size, tp_rank=self.tp_rank,
                ep_size=self.ep_size, ep_rank=self.ep_rank, topk=self.config.moe_router_topk,
                routing_map=self.routing_map, copy=False)  # _counts: this forward's own copy
        return build_metadata(
            counts=self._counts,
            row_slot=row_slot,
            dest_token_mask=self._dest_token_mask,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            topk=self.config.moe_router_topk,
            routing_map=self.routing_map,
            validate=False,  # counts come from this very routing map
        )

    def _gather_and_sort_slots(self, row_slot: torch.Tensor) -> torch.Tensor:
        """The received rows' slots in `h` order: Megatron's TP all-gather and sort by local
        expert, applied to them as to the tokens."""
        num_experts = self.num_experts
        nle = self.num_local_experts
        local = slice(self.ep_rank * nle, (self.ep_rank + 1) * nle)
        # [TP, EP, L] rows received from each (tp, ep) source, like Megatron's
        # num_global_tokens_per_local_expert; _counts rows are in group order (ep, tp).
        per_source = self._counts[:, :num_experts][:, local].reshape(
            self.ep_size, self.tp_size, nle
        ).transpose(1, 0, 2)
        if self.tp_size > 1:
            sizes = [int(x) for x in per_source[:, :, :].sum(axis=(1, 2))]
            row_slot = torch.cat(all_gather_varsize(row_slot, sizes, self.tp_group))
        if nle > 1:
            row_slot, _ = sort_chunks_by_idxs(
                row_slot.unsqueeze(1),
                torch.from_numpy(np.ascontiguousarray(per_source.reshape(-1))),
                self.sort_input_by_local_experts.cpu(),
            )
            row_slot = row_slot.view(-1)
        return row_slot

    # ---- combine half: one fused operation ---------------------------------------------

    def prepare_combine(self, h_like: torch.Tensor, w2: torch.Tensor) -> None:
        """Plan the combine and do its host work now (`GatherRSMoELayer` calls it right after
        FC1 is enqueued, so the host work overlaps FC1 on the GPU). Optional:
        `gemm2_gatherrs_combine` does it otherwise.

        Args:
            h_like: FC1's output h, or any tensor with its dtype, device and autograd state
                (e.g. the dispatched tokens).
            w2: [L, H, F] FC2 weights of the local experts.
        """
        if self.metadata is None:
            raise RuntimeError("prepare_combine called before dispatch_postprocess")
        if self._num_sms is None and h_like.is_cuda:
            self._num_sms = torch.cuda.get_device_properties(h_like.device).multi_processor_count
        me = self.ep_rank * self.tp_size + self.tp_rank  # rows of my tokens, x TP partials:
        recv_rows = int(self._counts[me, : self.num_experts].sum())
        from megatron_overlap.ops.triton_gemm2_gatherrs import call_resources, plan_call

        # the call's tile and plan (for its TP x EP group): the resource manager's choice
        # (`plan_call`), for its preparation
        with span("mo.plan"):
            choice = plan_call(
                self.metadata, self.options if self._triton else self._direct_options,
                device=h_like.device, num_sms=self._num_sms, hidden=w2.shape[1],
                ffn=w2.shape[2], elem_bytes=h_like.element_size(),
                recv_rows=recv_rows * self.tp_size, choose=self._triton,
                resources=lambda t: call_resources(
                    h_like.dtype, w2.shape[2], w2.shape[1], self.tp_size,
                    self.config.moe_router_topk, self.num_experts, t))
        self.plan, tile = choice.plan, choice.tile
        self.last_tile = tile if self._triton else None
        self.num_plans += 1
        group = self.tp_ep_group if self.metadata.group_size > 1 else None
        maps = None
        # _triton: decided in dispatch_preprocess; plan.mode: from options.prereduce and the
        # group-wide counts, so every rank gathers (or not) alike.
        if self._triton and self.plan.mode == "prereduce":
            # The pre-reduced mode needs every rank's routing map; the token counts follow
            # from the exchanged counts, so the gather needs no host sync.
            with span("mo.routing_maps"):
                num_experts = self.num_experts
                dropless = getattr(self.config, "moe_expert_capacity_factor", None) is None
                sizes = tokens_per_rank(self._counts, num_experts, self.config.moe_router_topk,
                                        dropless)
                maps = gather_routing_maps(self.routing_map, group, sizes)
        with span("mo.prepare"):
            self._prepared = prepare_gemm2_gatherrs(h_like, w2, self.metadata, group=group,
                                                    options=self.options, plan=self.plan,
                                                    routing_maps=maps, tile=tile)
        self.last_combine = ("reference" if self._prepared is None else
                             "prereduced" if self._prepared.MODE == "prereduce" else "direct")
        self._was_prepared = True

    def gemm2_gatherrs_combine(self, h: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        """FC2 + un-permute + top-k combine + TP reduce-scatter + EP return all-to-all:
        `combine_send` then `combine_finish`.

        Args:
            h: [N, F] FC1 output after activation and probs, in `dispatch_postprocess` order.
            w2: [L, H, F] FC2 weights of the local experts.

        Returns:
            The routed-expert output of this rank's T tokens, in the layer input's shape
            (`hidden_shape`, e.g. [S, B, H]), dtype of h.

        Raises:
            RuntimeError: called before `dispatch_postprocess` (no metadata for this
                forward), or a bounded GPU wait expired (see `gemm2_gatherrs`).
        """
        self.combine_send(h, w2)
        return self.combine_finish()

    def combine_send(self, h: torch.Tensor, w2: torch.Tensor) -> None:
        """The first half of `gemm2_gatherrs_combine` (same arguments and errors): on the
        Triton path, the GEMM2 + scatter is queued and the call keeps no reference to h,
        so a caller that lets go of h too (`GatherRSMoELayer` does) frees its memory for
        the combine's output (allocated by `combine_finish`); elsewhere the whole combine
        runs here. Call `combine_finish` next.

        Raises (besides `gemm2_gatherrs_combine`'s): RuntimeError when the previous
        `combine_send` was not followed by `combine_finish` (that call's workspace is then
        unusable: its peers wait for a finalize that will not run)."""
        if self.metadata is None:
            raise RuntimeError("combine_send called before dispatch_postprocess")
        if self._sent is not None:
            pending, self._sent = self._sent, None
            reason = ("combine_send called again before combine_finish: the previous "
                      "forward's combine was never finished")
            if not isinstance(pending, torch.Tensor):
                # Its finalize never ran: the peers would wait for this rank's buffer.
                pending.ws.poison(reason)
            raise RuntimeError(reason)
        if not self._was_prepared:
            self.prepare_combine(h, w2)
        prepared, self._prepared, self._was_prepared = self._prepared, None, False
        group = self.tp_ep_group if self.metadata.group_size > 1 else None
        with span("mo.gemm2_gatherrs"):
            if prepared is not None:
                # Prepared by prepare_combine for this very metadata: run it (it checks h
                # and w2 against what it was prepared for) without gemm2_gatherrs's
                # argument checks, which hold by construction here.
                prepared.send(h, w2, keep_operands=False)
                self._sent = prepared
            else:
                self._sent = gemm2_gatherrs(h, w2, self.metadata, group=group,
                                            options=self.options, plan=self.plan,
                                            prepared=None)
        self.metadata = None

    def combine_finish(self) -> torch.Tensor:
        """The second half of `gemm2_gatherrs_combine`: the finalize of the call that
        `combine_send` queued; returns what `gemm2_gatherrs_combine` returns.

        Raises:
            RuntimeError: no `combine_send` before, or a bounded GPU wait expired.
        """
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("combine_finish called without a combine_send before it")
        with span("mo.gemm2_gatherrs"):
            out = sent if isinstance(sent, torch.Tensor) else sent.finish()
        return out.view(self.hidden_shape)

    def combine_preprocess(self, hidden_states):
        """Folded into `gemm2_gatherrs_combine`."""
        raise RuntimeError(
            "GatherRSAlltoAllTokenDispatcher fuses combine_preprocess, token_combine and the "
            "un-permute into gemm2_gatherrs_combine; build the layer with "
            "megatron_overlap.megatron.GatherRSMoELayer"
        )

    def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
        """Folded into `gemm2_gatherrs_combine`."""
        return self.combine_preprocess(hidden_states)

    def combine_postprocess(self, hidden_states):
        """The fused op already returns token order; only the layer-input shape remains."""
        return hidden_states.view(self.hidden_shape)
