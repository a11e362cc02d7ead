"""The "off-grouped" baseline experts match Megatron's `SequentialMLP` numerically.

Under gloo, world 1 (TP = EP = 1) and world 2 (EP = 2; TP = 2 with SP): the same weights in
`SequentialMLP` (Megatron's local spec) and `GroupedGEMMSequentialMLP` (strict state-dict
load both ways), compared

* as experts modules on the same permuted rows (incl. an expert without rows): fp32 within
  1e-6 (the same products; the grouped GEMM may sum in another order, measured 0 on torch
  2.13 CPU), bf16 within 2^-7 (FC1 and FC2 outputs each rounded once to bf16, possibly on
  the other side of a rounding boundary: 2 x unit roundoff 2^-9, x2 margin);
* as whole `MoELayer`s (stock alltoall dispatcher): fp32 1e-5, bf16 2^-6 (as
  test_megatron_flag.TOLERANCE);
* its per-forward host work is the flag-on experts': a second forward reuses the
  remembered weight views, a parameter move makes it stack and check again;
* under autograd the baseline falls back to `SequentialMLP.forward` (says so in
  `last_impl`) and its gradients equal the stock ones.

Plus the label text and the SequentialMLP -> TEGroupedMLP key mapping (no TE needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatron_overlap.bench.baselines import BASELINES, label, sequential_to_te_state_dict
from megatron_overlap.megatron.grouped_experts import grouped_mm_name
from tests.support.asserts import describe_mismatch
from tests.support.dist import for_each_case, run_distributed

EXPERTS_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
H, FFN = 32, 24


@dataclass(frozen=True)
class Case:
    tp: int = 1
    ep: int = 1
    num_experts: int = 4
    topk: int = 2
    dtype: torch.dtype = torch.float32
    shared: int | None = None


def _config(case: Case):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, ffn_hidden_size=48,
        moe_ffn_hidden_size=FFN, num_moe_experts=case.num_experts, moe_router_topk=case.topk,
        moe_shared_expert_intermediate_size=case.shared,
        moe_token_dispatcher_type="alltoall", tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.tp,
        sequence_parallel=case.tp > 1, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=case.dtype,
        bf16=case.dtype == torch.bfloat16,
    )


def _run_case(case: Case, rank: int) -> dict:
    from megatron_overlap.bench.baselines import moe_spec
    from tests.support.megatron_cpu import init_expert_weights

    stock = moe_spec("off", case.num_experts)(config=_config(case))
    init_expert_weights(stock, seed=11, std=0.2)
    grouped = moe_spec("off-grouped", case.num_experts)(config=_config(case))
    grouped.load_state_dict(stock.state_dict(), strict=True)
    stock.load_state_dict(grouped.state_dict(), strict=True)  # and back
    res = {"experts_type": type(grouped.experts).__name__,
           "stock_experts_type": type(stock.experts).__name__}

    # Experts modules alone, on the same rows.
    gen = torch.Generator().manual_seed(3 + rank)
    num_local = case.num_experts // case.ep
    counts = torch.tensor([5 * (i + 1) if i != 1 else 0 for i in range(num_local)])
    x = torch.randn(int(counts.sum()), H, generator=gen).to(case.dtype)
    probs = torch.rand(x.shape[0], generator=gen)
    with torch.no_grad():
        ref, _ = stock.experts(x, counts, probs)
        out, bias = grouped.experts(x, counts, probs)
    res["experts_bias_none"] = bias is None
    res["experts_mismatch"] = describe_mismatch(out, ref, rel_tol=EXPERTS_TOLERANCE[case.dtype])
    res["experts_impl"] = grouped.experts.last_impl

    # Per-forward host work as the flag-on experts': a second forward reuses the remembered
    # weight views (no stacking check); after a move (`_apply` re-stacks) they are redone.
    from megatron_overlap.megatron import grouped_experts

    checks, uploads = [], []
    original = grouped_experts.stacked_view
    original_offsets = grouped_experts.group_offsets
    grouped_experts.stacked_view = lambda t: checks.append(len(t)) or original(t)
    grouped_experts.group_offsets = (lambda c, d: uploads.append(list(c))
                                     or original_offsets(c, d))
    try:
        with torch.no_grad():
            again, _ = grouped.experts(x, counts, probs)
            res["cached_checks"] = list(checks)
            # FC1's two halves and FC2: one offsets upload for the forward
            res["offset_uploads"] = list(uploads)
            grouped.experts._apply(lambda t: t.clone())  # every parameter moves
            moved, _ = grouped.experts(x, counts, probs)
    finally:
        grouped_experts.stacked_view = original
        grouped_experts.group_offsets = original_offsets
    res["moved_checks"] = checks[len(res["cached_checks"]):]
    res["again_mismatch"] = describe_mismatch(again, out, rel_tol=0.0)
    res["moved_mismatch"] = describe_mismatch(moved, out, rel_tol=0.0)
    res["moved_impl"] = grouped.experts.last_impl

    # Whole layers (stock alltoall dispatcher).
    seq = 16 // case.tp if case.tp > 1 else 16
    hidden = torch.randn(seq, 2, H, generator=gen).to(case.dtype)
    with torch.no_grad():
        ref_layer, _ = stock.eval()(hidden)
        out_layer, _ = grouped.eval()(hidden)
    res["layer_mismatch"] = describe_mismatch(out_layer, ref_layer,
                                              rel_tol=LAYER_TOLERANCE[case.dtype])

    # Autograd: falls back to SequentialMLP.forward; gradients equal the stock ones.
    grads = {}
    for name, layer in (("stock", stock), ("grouped", grouped)):
        xi = x.clone().requires_grad_(True)
        y, _ = layer.experts(xi, counts, probs)
        y.float().square().sum().backward()
        grads[name] = (xi.grad, layer.experts.local_experts[0].linear_fc2.weight.grad)
    res["grad_impl"] = grouped.experts.last_impl
    res["grad_x"] = describe_mismatch(grads["grouped"][0], grads["stock"][0], rel_tol=0.0)
    res["grad_w2"] = describe_mismatch(grads["grouped"][1], grads["stock"][1], rel_tol=0.0)

    # The FC1 check's remembered part is the grad-mode-free one: a first forward that records
    # autograd (as a fresh module's may, e.g. in training) must not pin the loop for later
    # inference forwards.
    grouped.experts._fc1_check = None
    grouped.experts(x.clone().requires_grad_(True), counts, probs)
    with torch.no_grad():
        grouped.experts(x, counts, probs)
    res["after_grad_impl"] = grouped.experts.last_impl
    return res


def _worker(rank: int, world_size: int, cases: list) -> list:
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    del world_size
    apply_cpu_patches()

    def run(case: Case) -> dict:
        with parallel_state(case.tp, case.ep, seed=1234):
            return _run_case(case, rank)

    return for_each_case(cases, run)


CASES = {
    1: [Case(), Case(dtype=torch.bfloat16), Case(num_experts=8, topk=3, shared=16)],
    2: [Case(ep=2), Case(tp=2), Case(ep=2, num_experts=8, dtype=torch.bfloat16)],
}


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_baseline_matches_sequential_mlp(world):
    cases = CASES[world]
    results = run_distributed(_worker, world, cases, timeout_s=300)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            where = (world, rank, case, res)
            assert res["experts_type"] == "GroupedGEMMSequentialMLP", where
            assert res["stock_experts_type"] == "SequentialMLP", where
            assert res["experts_bias_none"], where
            assert res["experts_mismatch"] is None, where
            assert res["layer_mismatch"] is None, where
            assert res["experts_impl"] == (
                f"grouped FC1: {grouped_mm_name()}, weights view, SwiGLU in place; grouped FC2: "
                f"{grouped_mm_name()}, weights view"), where
            # cached: no stacking check on the second forward; redone (FC1, FC2) after a move
            assert res["cached_checks"] == [], where
            assert res["offset_uploads"] == [[5 * (i + 1) if i != 1 else 0 for i in range(
                case.num_experts // case.ep)]], where
            assert len(res["moved_checks"]) >= 2, where
            assert res["again_mismatch"] is None and res["moved_mismatch"] is None, where
            assert res["moved_impl"] == res["experts_impl"], where
            assert res["grad_impl"].startswith("SequentialMLP loop: autograd"), where
            assert res["after_grad_impl"] == res["experts_impl"], where
            assert res["grad_x"] is None and res["grad_w2"] is None, where


def test_labels_are_exact_and_distinct():
    texts = {v: label(v) for v in BASELINES} | {"on": label("on", fc1="grouped FC1: x",
                                                              backend="triton", fc2_weight="view",
                                                              plan="16 comm CTAs")}
    assert len(set(texts.values())) == len(texts)
    assert "SequentialMLP" in texts["off"] and "GroupedGEMMSequentialMLP" in texts["off-grouped"]
    assert grouped_mm_name() in texts["off-grouped"]
    assert "TEGroupedMLP" in label("off-te", te_version="2.1")
    assert "triton" in texts["on"] and "16 comm CTAs" in texts["on"]
    with pytest.raises(ValueError, match="variant"):
        label("off-loop")


def test_te_state_dict_mapping():
    sd = {
        "router.weight": 0,
        "experts.local_experts.0.linear_fc1.weight": 1,
        "experts.local_experts.1.linear_fc2.weight": 2,
        "shared_experts.linear_fc1.weight": 3,
    }
    out = sequential_to_te_state_dict(sd, num_local_experts=2)
    assert out == {
        "router.weight": 0,
        "experts.linear_fc1.weight0": 1,
        "experts.linear_fc2.weight1": 2,
        "shared_experts.linear_fc1.weight": 3,
    }
    with pytest.raises(ValueError, match="expert index"):
        sequential_to_te_state_dict(sd, num_local_experts=1)
    with pytest.raises(ValueError, match="FC weights"):
        sequential_to_te_state_dict({"experts.local_experts.0.linear_fc1.bias": 0}, 1)
