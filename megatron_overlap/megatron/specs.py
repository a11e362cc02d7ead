"""Layer-spec helpers: build GPT layer specs whose MoE layers can use the fused combine path.

Two ways in:
  * build the specs with our helpers (`get_gpt_layer_local_spec`,
    `get_gpt_decoder_block_spec`): Megatron's helpers of the same name, rewritten;
  * or rewrite a spec you already have with `use_gatherrs_in_spec(spec)`.

The rewritten MoE layer is `GatherRSMoELayer` with `GatherRSSequentialMLP` experts; both are
stock Megatron behaviour while `config.moe_gatherrs_overlap` is False, so a model built from
these specs switches path with the config flag alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.models.gpt import gpt_layer_specs as _mc_specs
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_overlap.megatron.experts import GatherRSSequentialMLP
from megatron_overlap.megatron.moe_layer import GatherRSMoELayer


def _rewrite_experts(experts: Any) -> Any:
    if isinstance(experts, functools.partial) and experts.func in (
        SequentialMLP,
        GatherRSSequentialMLP,
    ):
        return functools.partial(GatherRSSequentialMLP, *experts.args, **experts.keywords)
    if isinstance(experts, ModuleSpec) and experts.module in (SequentialMLP, GatherRSSequentialMLP):
        return dataclasses.replace(experts, module=GatherRSSequentialMLP)
    name = getattr(experts, "func", getattr(experts, "module", experts))
    raise ValueError(
        f"the fused combine path supports SequentialMLP experts (Megatron's local spec), got "
        f"{getattr(name, '__name__', name)!r}; build the spec with use_transformer_engine=False "
        "(Transformer Engine grouped experts are not supported yet)"
    )


def use_gatherrs_in_moe_spec(mlp_spec: Any) -> Any:
    """Rewrite one MLP spec; a MoE spec gets `GatherRSMoELayer`, anything else is returned as is.

    Accepts the Megatron >= 0.18 form `functools.partial(MoELayer, submodules=MoESubmodules)`
    and the older `ModuleSpec(module=MoELayer, submodules=...)`.

    Raises:
        ValueError: a MoE spec whose experts are not `SequentialMLP`.
    """
    if isinstance(mlp_spec, functools.partial) and isinstance(mlp_spec.func, type):
        if issubclass(mlp_spec.func, MoELayer):
            submodules: MoESubmodules = mlp_spec.keywords["submodules"]
            keywords = dict(mlp_spec.keywords)
            keywords["submodules"] = dataclasses.replace(
                submodules, experts=_rewrite_experts(submodules.experts)
            )
            return functools.partial(GatherRSMoELayer, *mlp_spec.args, **keywords)
    if isinstance(mlp_spec, ModuleSpec) and isinstance(mlp_spec.module, type):
        if issubclass(mlp_spec.module, MoELayer):
            submodules = mlp_spec.submodules
            return dataclasses.replace(
                mlp_spec,
                module=GatherRSMoELayer,
                submodules=dataclasses.replace(
                    submodules, experts=_rewrite_experts(submodules.experts)
                ),
            )
    return mlp_spec


def use_gatherrs_in_spec(spec: Any) -> Any:
    """Return a copy of a layer spec, block spec or list of layer specs with every MoE layer
    rewritten by `use_gatherrs_in_moe_spec`; the input is not modified.

    Raises:
        TypeError: `spec` is none of: `ModuleSpec` of a transformer layer,
            `TransformerLayerSubmodules`, `TransformerBlockSubmodules`, list/tuple of those.
        ValueError: see `use_gatherrs_in_moe_spec`.
    """
    if isinstance(spec, (list, tuple)):
        return type(spec)(use_gatherrs_in_spec(s) for s in spec)
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=use_gatherrs_in_spec(spec.layer_specs))
    if isinstance(spec, TransformerLayerSubmodules):
        return dataclasses.replace(spec, mlp=use_gatherrs_in_moe_spec(spec.mlp))
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerLayerSubmodules):
        return dataclasses.replace(spec, submodules=use_gatherrs_in_spec(spec.submodules))
    raise TypeError(
        f"cannot rewrite a {type(spec).__name__}; expected a transformer layer ModuleSpec, "
        "TransformerLayerSubmodules, TransformerBlockSubmodules or a list of layer specs"
    )


def get_gpt_layer_local_spec(*args, **kwargs) -> ModuleSpec:
    """Megatron's `get_gpt_layer_local_spec` (same arguments) with the fused-path MoE layer.

    Raises:
        ValueError: see `use_gatherrs_in_moe_spec`.
    """
    return use_gatherrs_in_spec(_mc_specs.get_gpt_layer_local_spec(*args, **kwargs))


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = False, *args,
                               **kwargs) -> TransformerBlockSubmodules:
    """Megatron's `get_gpt_decoder_block_spec(config, use_transformer_engine, ...)` (same
    arguments; `use_transformer_engine` defaults to False here) with the fused-path MoE
    layers (dense layers of `moe_layer_freq` stay dense).

    Raises:
        ValueError: a MoE layer whose experts are not `SequentialMLP`, e.g. with
            `use_transformer_engine=True` (Transformer Engine grouped experts are not
            supported; see `use_gatherrs_in_moe_spec`).
    """
    return use_gatherrs_in_spec(_mc_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine, *args, **kwargs))
