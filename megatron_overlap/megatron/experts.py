"""Experts that run FC1 + activation (+ router probs) and hand FC2 to the dispatcher.

`GatherRSSequentialMLP` *is* Megatron's `SequentialMLP`: same constructor, same parameters,
same names and shapes (checkpoints load unchanged), and with the flag off `forward` is
inherited untouched and the parameters are not touched. With the flag on, `GatherRSMoELayer`
calls `forward_fc1` and `fc2_weight` instead, and the dispatcher runs FC2 inside the fused
GEMM2 + GatherRS op.

Flag on, for speed (see `grouped_experts` for the mechanics and what checkpoints see):
* at construction (and after every `.to()` / `.cuda()` / `.half()`, which move each
  parameter separately) the local experts' `linear_fc1.weight`s and `linear_fc2.weight`s
  are re-homed into one contiguous [L, I, H] and one [L, H, F] storage;
* `fc2_weight()` then returns a zero-copy [L, H, F] view (strides (H * F, F, 1), which the
  fused kernel's TMA descriptor over [L * H, F] needs) instead of a `torch.stack` copy
  (~470 MB per Mixtral-8x7B layer at EP = 2); if something re-pointed the parameters
  (Megatron's DDP buffer, `load_state_dict(assign=True)`) it falls back to `torch.stack`;
* `forward_fc1` runs FC1 of all local experts as grouped GEMMs on CUDA
  (`grouped_fc1_activation`: for Megatron's unfused SwiGLU FC1's gate half for all rows
  and its linear half in chunks of rows, the activation and probs computed in place with
  Megatron's operations; otherwise Megatron's own activation code over chunks of rows),
  instead of one `MLP.forward` per expert (64-128 small GEMMs for the fine-grained
  models), where `grouped_fc1_unsupported_reason` allows; otherwise Megatron's loop.

Shape symbols: N rows, H hidden, F per-expert FFN width per expert-TP rank, L local experts.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_overlap.config import FC1_IMPLS
from megatron_overlap.megatron.config import gatherrs_enabled
from megatron_overlap.megatron.grouped_experts import (
    StackedViewCache,
    cached_fc1_reason,
    expert_weights,
    grouped_fc1_activation,
    mlp_parts_replaced,
    restack_experts_,
)



class GatherRSSequentialMLP(SequentialMLP):
    """`SequentialMLP` that can stop before FC2 (parameters identical to `SequentialMLP`).

    Same constructor as `SequentialMLP`. Attributes besides `SequentialMLP`'s:
        fc1_impl: one of `FC1_IMPLS` (default "auto").
        stacks_weights: whether the expert weights are kept stacked (flag on).
        last_fc1: what the last `forward_fc1` ran ("grouped FC1: ...", or "loop: <reason>").
        last_fc2_weight: how the last `fc2_weight` was made: "view" or "stack".
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection,
                         name=name)
        self.fc1_impl = "auto"
        self.last_fc1: str | None = None
        self.last_fc2_weight: str | None = None
        self.stacks_weights = gatherrs_enabled(config)
        # Per-forward host work kept off the critical path (the layer is host-bound at a few
        # thousand tokens): the stacked views, and the structural part of the FC1 check.
        self.fc1_stack_cache = StackedViewCache()
        self.fc2_stack_cache = StackedViewCache()
        self._fc1_check = None  # (the linear_fc1 modules, their structural reason)
        if self.stacks_weights:
            self.stack_weights_()

    # ---- weight layout -----------------------------------------------------------------

    def stack_weights_(self) -> None:
        """Re-home the local experts' FC1 and FC2 weights into one storage each, in place
        (`grouped_experts.restack_experts_`; no copy when they are stacked already). Call it
        again after anything that re-points them, e.g. `load_state_dict(assign=True)`.
        Experts without weight parameters (`skip_weight_param_allocation`) are left alone."""
        restack_experts_(self)

    def _apply(self, fn, recurse=True):
        # Module.to()/cuda()/half()/float() convert every parameter on its own, which would
        # scatter the stacked storage into L allocations: re-stack afterwards.
        module = super()._apply(fn, recurse)
        if self.stacks_weights:
            self.stack_weights_()
        return module

    # ---- the flag-on forward -----------------------------------------------------------

    def _fc1_loop_reason(self, x: torch.Tensor) -> str | None:
        """Why forward_fc1 runs Megatron's loop, or None for the grouped GEMM."""
        if self.fc1_impl not in FC1_IMPLS:
            raise ValueError(f"fc1_impl={self.fc1_impl!r}; expected one of {FC1_IMPLS}")
        if self.fc1_impl == "loop":
            return "fc1_impl='loop'"
        if self.fc1_impl == "auto" and not x.is_cuda:
            return f"fc1_impl='auto' takes the grouped GEMM on CUDA only (rows on {x.device})"
        return cached_fc1_reason(self, x)  # the structural part remembered per module set

    def forward_fc1(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> torch.Tensor:
        """FC1, activation and router probabilities of every local expert.

        Args:
            permuted_local_hidden_states: [N, H] tokens grouped by local expert.
            tokens_per_expert: [L] rows per local expert.
            permuted_probs: [N] router probability of each row.

        Returns:
            [N, F] intermediate activations (F = moe_ffn_hidden_size / TP), probs applied,
            in the rows' order: the `h` operand of `gemm2_gatherrs`. Grouped GEMMs
            (`grouped_fc1_activation`) or Megatron's per-expert loop (see `fc1_impl`,
            `last_fc1`); the two agree within the GEMMs' rounding.

        Raises:
            ValueError: `fc1_impl` is not one of `FC1_IMPLS`.
        """
        reason = self._fc1_loop_reason(permuted_local_hidden_states)
        if reason is None:
            h, self.last_fc1 = grouped_fc1_activation(
                self, permuted_local_hidden_states, tokens_per_expert, permuted_probs
            )
            return h
        self.last_fc1 = f"loop: {reason}"
        with mlp_parts_replaced(self.local_experts, fc2=True):
            h, bias = SequentialMLP.forward(
                self, permuted_local_hidden_states, tokens_per_expert, permuted_probs
            )
        assert bias is None
        return h

    def fc2_weight(self) -> torch.Tensor:
        """[L, H, F] FC2 weights of the local experts (each is `linear_fc2.weight`, [H, F]).

        Contiguous (strides (H * F, F, 1)): a zero-copy view of the stacked parameters when
        they are still stacked and autograd is not recording, else a `torch.stack` copy
        (`last_fc2_weight` says which).
        """
        w2, self.last_fc2_weight = self.fc2_stack_cache.get(
            expert_weights(self, "linear_fc2")
        )
        return w2
