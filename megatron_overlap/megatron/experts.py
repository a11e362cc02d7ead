"""Experts that run FC1 + activation (+ router probs) and hand FC2 to the dispatcher.

`GatherRSSequentialMLP` *is* Megatron's `SequentialMLP`: same constructor, same parameters,
same names and shapes (checkpoints load unchanged), and with the flag off `forward` is
inherited untouched. With the flag on, `GatherRSMoELayer` calls `forward_fc1` and
`fc2_weight` instead, and the dispatcher runs FC2 inside the fused GEMM2 + GatherRS op.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP


class _SkipFC2(torch.nn.Module):
    """Stands in for `linear_fc2` while FC1 runs: returns its input and no bias."""

    def forward(self, x: torch.Tensor):
        return x, None


@contextlib.contextmanager
def _fc2_skipped(experts: Sequence[MLP]) -> Iterator[None]:
    """Within the block, each expert MLP's forward stops before FC2.

    Reusing Megatron's own `MLP.forward` (rather than a copy of its activation code) keeps
    every activation variant (GLU, bias, clamps, fused kernels, per-token probs) exactly as
    with the flag off.
    """
    saved = [e._modules["linear_fc2"] for e in experts]
    try:
        for e in experts:
            e._modules["linear_fc2"] = _SkipFC2()
        yield
    finally:
        for e, fc2 in zip(experts, saved):
            e._modules["linear_fc2"] = fc2


class GatherRSSequentialMLP(SequentialMLP):
    """`SequentialMLP` that can stop before FC2 (parameters identical to `SequentialMLP`)."""

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
            in the rows' order: the `h` operand of `gemm2_gatherrs`.
        """
        with _fc2_skipped(self.local_experts):
            h, bias = SequentialMLP.forward(
                self, permuted_local_hidden_states, tokens_per_expert, permuted_probs
            )
        assert bias is None
        return h

    def fc2_weight(self) -> torch.Tensor:
        """[L, H, F] FC2 weights of the local experts (each is `linear_fc2.weight`, [H, F])."""
        return torch.stack([e.linear_fc2.weight for e in self.local_experts])
