"""Everything that touches Megatron-Core: the flag, the dispatcher, the experts, the specs."""

from megatron_overlap.megatron.config import (
    GatherRSTransformerConfig,
    add_gatherrs_args,
    apply_gatherrs_args,
    gatherrs_enabled,
    gatherrs_options,
    validate_gatherrs_config,
)
from megatron_overlap.megatron.dispatcher import GatherRSAlltoAllTokenDispatcher
from megatron_overlap.megatron.experts import GatherRSSequentialMLP
from megatron_overlap.megatron.moe_layer import GatherRSMoELayer
from megatron_overlap.megatron.specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    use_gatherrs_in_moe_spec,
    use_gatherrs_in_spec,
)

__all__ = [
    "GatherRSAlltoAllTokenDispatcher",
    "GatherRSMoELayer",
    "GatherRSSequentialMLP",
    "GatherRSTransformerConfig",
    "add_gatherrs_args",
    "apply_gatherrs_args",
    "gatherrs_enabled",
    "gatherrs_options",
    "get_gpt_decoder_block_spec",
    "get_gpt_layer_local_spec",
    "use_gatherrs_in_moe_spec",
    "use_gatherrs_in_spec",
    "validate_gatherrs_config",
]
