"""MoE layer that switches its return path to the fused GEMM2 + GatherRS op by config flag."""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from megatron_overlap.megatron.config import gatherrs_enabled, validate_gatherrs_config
from megatron_overlap.megatron.dispatcher import GatherRSAlltoAllTokenDispatcher
from megatron_overlap.megatron.experts import GatherRSSequentialMLP
from megatron_overlap.profiling import span


class GatherRSMoELayer(MoELayer):
    """Megatron's `MoELayer`; with `config.moe_gatherrs_overlap` on, its return path is fused.

    Flag off: nothing is overridden in effect; every method defers to `MoELayer` (stock
    alltoall dispatcher and experts, bit for bit). Flag on: the dispatcher is a
    `GatherRSAlltoAllTokenDispatcher`, the experts stop after FC1 + activation, and FC2,
    `combine_preprocess`, `token_combine` and the un-permute run as one `gemm2_gatherrs`.

    Same constructor as `MoELayer`.

    Raises:
        ValueError: flag on with an unsupported config, or with experts other than
            `GatherRSSequentialMLP` (build the spec with `megatron_overlap.megatron.specs`).
    """

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        if gatherrs_enabled(config):
            validate_gatherrs_config(config)
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        self.gatherrs = gatherrs_enabled(config)
        if self.gatherrs:
            if not isinstance(self.experts, GatherRSSequentialMLP):
                raise ValueError(
                    f"moe_gatherrs_overlap=True needs GatherRSSequentialMLP experts, got "
                    f"{type(self.experts).__name__}; build the layer spec with "
                    "megatron_overlap.megatron.specs"
                )
            self.token_dispatcher = GatherRSAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=self.config,
                pg_collection=pg_collection,
            )

    def routed_experts_compute(self, hidden_states, probs):
        """Flag on: dispatch postprocess, FC1 + activation, then the fused return path."""
        if not self.gatherrs:
            return super().routed_experts_compute(hidden_states, probs)
        with span("mo.dispatch_postprocess"):
            dispatched_input, tokens_per_expert, permuted_probs = (
                self.token_dispatcher.dispatch_postprocess(hidden_states, probs)
            )
        with span("mo.fc1"):
            h = self.experts.forward_fc1(dispatched_input, tokens_per_expert, permuted_probs)
        # FC1's inputs are not needed any more (autograd keeps what it saved): their memory
        # is free for the combine's buffers, as h's is for its output once the GEMM2 is
        # queued. (Megatron's layer holds both until its experts return.)
        del dispatched_input, permuted_probs
        w2 = self.experts.fc2_weight()
        # Plan + host work of the fused op after FC1 is enqueued: the host prepares while the
        # GPU runs FC1 (before FC1, the GPU would idle: the dispatch ends with a host sync).
        self.token_dispatcher.prepare_combine(h, w2)
        self.token_dispatcher.combine_send(h, w2)
        del h
        output = self.token_dispatcher.combine_finish()
        return output, None

    def combine(self, output):
        """Flag on: the return all-to-all already happened inside the fused op."""
        if not self.gatherrs:
            return super().combine(output)
        return output
