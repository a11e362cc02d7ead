"""Flag-off baselines of the layer and model benchmarks, and their exact labels.

A Megatron user without our flag has the alltoall dispatcher and one of these experts
modules; the benchmarks compare the flag-on layer against each (DESIGN.md section 5):

* "off": Megatron's local spec, `SequentialMLP` (experts.py:1260): one `MLP.forward` per
  local expert, i.e. two GEMMs per expert, one after another;
* "off-grouped": `GroupedGEMMSequentialMLP` (here): `SequentialMLP`'s parameters, but FC1
  and FC2 each run as one torch grouped GEMM over all local experts, so that the flag is
  not only compared against a slow loop. Its FC1 + activation is the very code the flag-on
  experts run (`megatron_overlap.megatron.grouped_experts`), so "off-grouped" vs "on"
  isolates the return path (FC2 + combine);
* "off-te": Megatron's `TEGroupedMLP` (Transformer Engine grouped GEMM), only where
  Transformer Engine imports (`te_unavailable_reason`).

Every variant has the same weights: the benchmarks build "off" first and load its state
dict into the others (`load_state_dict(strict=True)`; for TE through
`sequential_to_te_state_dict`).

Shape symbols: N rows, H hidden, F per-expert FFN width per expert-TP rank, L local experts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_overlap.megatron.grouped_experts import (
    StackedViewCache,
    cached_fc1_reason,
    expert_counts,
    expert_matmul,
    expert_weights,
    grouped_fc1_activation,
    grouped_mm_name,
    restack_experts_,
    shared_offsets,
)
from megatron_overlap.profiling import span

__all__ = [
    "BASELINES",
    "GroupedGEMMSequentialMLP",
    "gpt_block_spec",
    "label",
    "moe_spec",
    "sequential_to_te_state_dict",
    "te_unavailable_reason",
]

BASELINES = ("off", "off-grouped", "off-te")
"""Flag-off variant names, in the order the benchmarks run them."""


def label(variant: str, **details: Any) -> str:
    """The exact description of a variant, as it goes into every result row.

    Args:
        variant: "on" or one of `BASELINES`.
        details: for "off-grouped": `impl` (what the GEMMs ran, e.g.
            `GroupedGEMMSequentialMLP.last_impl`); for "off-te": `te_version`; for "on":
            `fc1` (`GatherRSSequentialMLP.last_fc1`), `fc2_weight` ("view"/"stack"),
            `backend` ("triton"/"reference") and `plan` (the resource manager's plan).

    Raises:
        ValueError: unknown variant.
    """
    if variant == "off":
        return ("Megatron-Core alltoall dispatcher + SequentialMLP (local spec; one "
                "MLP.forward per local expert, torch matmuls)")
    if variant == "off-grouped":
        impl = details.get("impl") or f"grouped GEMM: {grouped_mm_name()}"
        return ("Megatron-Core alltoall dispatcher + GroupedGEMMSequentialMLP "
                f"(SequentialMLP parameters; FC1 and FC2 as torch grouped GEMMs; {impl})")
    if variant == "off-te":
        return ("Megatron-Core alltoall dispatcher + TEGroupedMLP (Transformer Engine "
                f"{details.get('te_version', '?')} grouped GEMM)")
    if variant == "on":
        return ("moe_gatherrs_overlap=True: alltoall dispatch + GatherRSSequentialMLP "
                f"({details.get('fc1', '?')}) + fused GEMM2+GatherRS (backend "
                f"{details.get('backend', '?')}, FC2 weights {details.get('fc2_weight', '?')}, "
                f"plan {details.get('plan', '?')})")
    raise ValueError(f"variant={variant!r}; expected 'on' or one of {BASELINES}")


class GroupedGEMMSequentialMLP(SequentialMLP):
    """Baseline experts: `SequentialMLP`'s parameters, FC1 and FC2 as torch grouped GEMMs.

    Same constructor, parameter names and shapes as `SequentialMLP` (state dicts load both
    ways, strictly). At construction (and after `.to()` and friends) the FC1 and FC2
    weights are re-homed into one [L, I, H] and one [L, H, F] storage, so the grouped GEMMs
    read them in place (`grouped_experts.stacked_weights`; a `torch.stack` copy if
    something re-pointed them).

    forward(x [N, H], tokens_per_expert [L], probs [N]) -> ([N, H], None), as
    `SequentialMLP.forward`: FC1 and the activation with probs as the flag-on experts run
    them (`grouped_fc1_activation`: grouped GEMMs through `expert_matmul`, torch
    `nn.functional.grouped_mm` where it exists, else `torch._grouped_mm`, else a per-expert
    loop; for Megatron's unfused SwiGLU FC1's two halves, the linear one in chunks of
    rows), FC2 as one grouped GEMM. Where
    `grouped_fc1_unsupported_reason` says no (one local expert, unsupported activation,
    autograd recording, ...) it runs `SequentialMLP.forward` itself. `last_impl` says what
    the last forward ran.

    Its per-forward host work is the flag-on experts' (`GatherRSSequentialMLP`): the same
    remembered zero-copy weight views (`grouped_experts.StackedViewCache`) and the same
    cached structural part of the FC1 check, so that where the host paces the layer (a
    few thousand tokens) "on" vs "off-grouped" still compares the return paths only.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection,
                         name=name)
        self.last_impl: str | None = None
        self.fc1_stack_cache = StackedViewCache()  # read by grouped_fc1_activation
        self.fc2_stack_cache = StackedViewCache()
        self._fc1_check = None  # (the linear_fc1 modules, their structural reason)
        restack_experts_(self)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        restack_experts_(self)  # Module.to() moves each parameter on its own
        return module

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """See the class docstring."""
        x = permuted_local_hidden_states
        reason = cached_fc1_reason(self, x)  # as GatherRSSequentialMLP's
        if reason is not None:
            self.last_impl = f"SequentialMLP loop: {reason}"
            return super().forward(x, tokens_per_expert, permuted_probs)
        # the rows per expert and their device offsets once, for FC1 and FC2 alike
        with span("fc1.counts"):  # (the counts' host read, as in the flag-on FC1's span)
            counts = expert_counts(tokens_per_expert, len(self.local_experts), x.shape[0])
        with span("grouped_mm.offsets"):  # (as the flag-on FC1 times its upload)
            offsets = shared_offsets(counts, x)
        h, fc1 = grouped_fc1_activation(self, x, counts, permuted_probs, offsets)
        w2, how = self.fc2_stack_cache.get(expert_weights(self, "linear_fc2"))
        y, impl = expert_matmul(h, w2, counts, offsets)
        self.last_impl = f"{fc1}; grouped FC2: {impl}, weights {how}"
        return y, None


# --------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------


def te_unavailable_reason() -> str | None:
    """Why the "off-te" baseline cannot be built here (None when it can)."""
    from megatron.core.extensions import transformer_engine as te_ext

    if not getattr(te_ext, "HAVE_TE", False):
        return "Transformer Engine does not import on this machine"
    if getattr(te_ext, "TEColumnParallelGroupedLinear", None) is None:
        return "this Transformer Engine has no grouped linear (needs >= 1.7)"
    return None


def _experts_builder(variant: str):
    from megatron.core.models.backends import LocalSpecProvider

    local = LocalSpecProvider().grouped_mlp_modules(False)  # partial(SequentialMLP, ...)
    if variant == "off":
        return local
    if variant == "off-grouped":
        return functools.partial(GroupedGEMMSequentialMLP, *local.args, **local.keywords)
    if variant == "off-te":
        reason = te_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the off-te baseline needs Transformer Engine: {reason}")
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider().grouped_mlp_modules(True)
    raise ValueError(f"variant={variant!r}; expected one of {BASELINES}")


def _is_moe_spec(mlp_spec: Any) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return (isinstance(mlp_spec, functools.partial) and isinstance(mlp_spec.func, type)
            and issubclass(mlp_spec.func, MoELayer))


def _replace_experts(mlp_spec: Any, experts: Any) -> Any:
    """`partial(MoELayer, submodules=MoESubmodules(...))` (Megatron >= 0.18) with other
    experts; any other spec is returned as is."""
    if not _is_moe_spec(mlp_spec):
        return mlp_spec
    keywords = dict(mlp_spec.keywords)
    keywords["submodules"] = dataclasses.replace(keywords["submodules"], experts=experts)
    return functools.partial(mlp_spec.func, *mlp_spec.args, **keywords)


def moe_spec(variant: str, num_experts: int) -> Any:
    """MoE layer builder of a baseline: Megatron's local MoE spec
    (`get_moe_module_spec(use_te=False)`: alltoall-capable `MoELayer`, torch router, local
    shared experts) with the variant's experts. Call it with `config=...`.

    Raises:
        ValueError: unknown variant. RuntimeError: "off-te" without Transformer Engine.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=num_experts)
    if not _is_moe_spec(spec):
        raise RuntimeError(f"unexpected Megatron MoE spec form {spec!r} (expected "
                           "functools.partial(MoELayer, submodules=...), Megatron >= 0.18)")
    return _replace_experts(spec, _experts_builder(variant))


def gpt_block_spec(variant: str, config: Any) -> Any:
    """Megatron's `get_gpt_decoder_block_spec(config, use_transformer_engine=False)` with the
    variant's experts in every MoE layer (dense layers unchanged).

    Raises:
        ValueError: unknown variant. RuntimeError: "off-te" without Transformer Engine, or
            no MoE layer spec of the form this function rewrites.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    experts = _experts_builder(variant)
    layers = []
    for layer in block.layer_specs:
        mlp = _replace_experts(layer.submodules.mlp, experts)
        layers.append(dataclasses.replace(
            layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp)))
    if not any(_is_moe_spec(layer.submodules.mlp) for layer in block.layer_specs):
        raise RuntimeError("no MoE layer spec of the form functools.partial(MoELayer, ...) in "
                           "Megatron's block spec; the baseline would silently be 'off'")
    return dataclasses.replace(block, layer_specs=layers)


def sequential_to_te_state_dict(state_dict: dict, num_local_experts: int) -> dict:
    """Rename `SequentialMLP` expert keys to `TEGroupedMLP`'s.

    `...experts.local_experts.{i}.linear_fc{1,2}.weight` -> `...experts.linear_fc{1,2}.
    weight{i}` (TE's GroupedLinear keeps one parameter per GEMM); other keys unchanged.

    Raises:
        ValueError: a local expert index >= num_local_experts, or a key under
            `local_experts` that is not an FC weight (e.g. a bias: not supported).
    """
    out = {}
    for key, value in state_dict.items():
        if ".local_experts." not in key:
            out[key] = value
            continue
        head, tail = key.split(".local_experts.", 1)
        index, rest = tail.split(".", 1)
        if not index.isdigit() or int(index) >= num_local_experts:
            raise ValueError(f"{key}: expert index {index} not in [0, {num_local_experts})")
        if rest not in ("linear_fc1.weight", "linear_fc2.weight"):
            raise ValueError(f"{key}: only expert FC weights map to TEGroupedMLP")
        out[f"{head}.{rest}{index}"] = value
    return out
