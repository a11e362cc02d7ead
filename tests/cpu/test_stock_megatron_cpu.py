"""Stock Megatron-Core MoE on CPU processes joined by gloo: proves tests/support works.

* `MoELayer` (alltoall dispatcher, local-spec `SequentialMLP` experts, SwiGLU, fp32) for
  (world, tp, ep) in {(1,1,1), (2,1,2), (2,2,1), (4,2,2), (4,1,4), (4,4,1)}, with 1 to 4
  local experts, against the dense formula on the full (gathered) expert weights, using the
  layer's own router output so that only the expert math and data movement are compared::

      out[t] = sum_{e in topk(t)} probs[t, e] * W2_e @ (silu(G_e @ x_t) * (U_e @ x_t))

* a 2-layer `GPTModel` (local spec, MoE MLP) prefill at TP=1, 2 and 4: identical full
  weights across layouts (checked exactly) and the same logits.

Every world size is launched once (`run_distributed` start-up dominates: ~12 s for 4 ranks
on 2 cores without the forkserver preload); each launch runs all cases of that world size
and the tests below read its cached results.

Shape symbols: S sequence (per rank), B batch, T = S * B tokens, H hidden, F expert ffn,
E experts, K top-k, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig

from tests.support.asserts import assert_close
from tests.support.dist import for_each_case, run_distributed
from tests.support.megatron_cpu import (
    ParallelLayout,
    apply_cpu_patches,
    draw_expert_weights,
    full_weight,
    init_expert_weights,
    parallel_state,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU/gloo harness: apply_cpu_patches refuses to run where CUDA is available",
)

H = 32  # hidden
F_EXPERT = 48  # expert ffn (moe_ffn_hidden_size); per TP rank F_EXPERT / tp
K = 2  # top-k
B = 2  # micro-batch
ITERATIONS = 2  # forwards per MoE case, fresh random input (and token count) each time
SEED = 1234
INIT_STD = 0.2

# Tolerances, fp32 everywhere (outputs are O(1): |out| <= ~6 with INIT_STD).
# MoE layer vs the dense formula (evaluated in float64): Megatron's result differs only by
# fp32 rounding in another summation order (FC2 partial sums reduce-scattered over TP ranks,
# probs applied before FC2 instead of after, top-k sum order). The chain is a length-H then a
# length-F dot product, so the rounding error is ~ sqrt(H + F) * 2^-24 * |out| ~ 3.2e-6 at
# |out| = 6; measured max 1.2e-6 over all cases. 1e-5 is ~3x that estimate, while swapping
# gate/up or sending tokens to the wrong expert moves outputs by > 5 (measured).
MOE_TOL = {"atol": 1e-5, "rtol": 1e-5}
# GPTModel logits (|logit| <= ~4.3), TP=2/4 vs TP=1: the same kind of reordering in every
# TP-split GEMM and all-reduce of 2 layers plus the output layer; measured max 1.4e-6.
# 2e-5 is ~15x that; a wrong shard (e.g. SwiGLU gate/up swapped) changes logits by O(0.1).
GPT_TOL = {"atol": 2e-5, "rtol": 2e-5}


# ----------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoECase:
    """One MoELayer layout; `num_experts // ep` local experts per rank."""

    world: int
    tp: int
    ep: int
    num_experts: int
    topk: int = K

    @property
    def name(self) -> str:
        local = self.num_experts // self.ep
        return f"w{self.world}-tp{self.tp}-ep{self.ep}-E{self.num_experts}-local{local}"


@dataclasses.dataclass(frozen=True)
class GPTCase:
    """One GPTModel layout. EP=1: with EP>1 Megatron's CPU init gives expert j of every EP
    rank the same weights, so the full weights would differ from the TP=1 model."""

    world: int
    tp: int
    num_experts: int = 4

    @property
    def name(self) -> str:
        return f"gpt-w{self.world}-tp{self.tp}"


MOE_CASES = [
    MoECase(world=1, tp=1, ep=1, num_experts=4),  # 4 local experts
    MoECase(world=2, tp=1, ep=2, num_experts=2, topk=1),  # 1 local expert, top-1
    MoECase(world=2, tp=2, ep=1, num_experts=4),  # expert TP, 4 local
    MoECase(world=4, tp=2, ep=2, num_experts=6),  # TP x EP, 3 local
    MoECase(world=4, tp=1, ep=4, num_experts=4),  # 1 local expert
    MoECase(world=4, tp=4, ep=1, num_experts=4),  # expert TP 4, 4 local
]
GPT_CASES = [GPTCase(world=1, tp=1), GPTCase(world=2, tp=2), GPTCase(world=4, tp=4)]
WORLD_SIZES = sorted({c.world for c in MOE_CASES} | {c.world for c in GPT_CASES})


# ----------------------------------------------------------------------------------------
# Worker side (runs in every rank)
# ----------------------------------------------------------------------------------------


def _config(tp: int, ep: int, num_experts: int, topk: int, **overrides: Any) -> TransformerConfig:
    kwargs: dict[str, Any] = {
        "num_layers": 1,
        "hidden_size": H,
        "num_attention_heads": 4,
        "ffn_hidden_size": 64,
        "moe_ffn_hidden_size": F_EXPERT,
        "num_moe_experts": num_experts,
        "moe_router_topk": topk,
        "moe_token_dispatcher_type": "alltoall",
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp,
        "sequence_parallel": tp > 1,
        "use_cpu_initialization": True,
        "params_dtype": torch.float32,
        "add_bias_linear": False,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # ~1/sqrt(H) instead of Megatron's 0.02, so that activations and outputs are O(1) and
        # the absolute tolerances below mean what they say (at 0.02 the MoE output is ~1e-3).
        "init_method_std": INIT_STD,
    }
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _shard_info(param: torch.Tensor) -> tuple[torch.Tensor, int | None, int]:
    """(local shard, partition dim or None when replicated, partition stride)."""
    if getattr(param, "tensor_model_parallel", False):
        return param.detach().clone(), int(param.partition_dim), int(param.partition_stride)
    return param.detach().clone(), None, 1


def _run_moe_case(rank: int, case: MoECase) -> dict[str, Any]:
    with parallel_state(case.tp, case.ep, seed=SEED) as layout:
        # Megatron requires softmax-before-top-k for top-1 (transformer_config.py:2328).
        config = _config(
            case.tp, case.ep, case.num_experts, case.topk, moe_router_pre_softmax=case.topk == 1
        )
        layer = get_moe_module_spec(use_te=False, num_experts=case.num_experts)(config=config)
        assert isinstance(layer, MoELayer)
        # Megatron's CPU init repeats the same expert weights on every EP rank: make every
        # expert distinct (and the full weights layout-independent) so that a token sent to
        # the wrong EP rank cannot go unnoticed.
        init_expert_weights(layer, seed=SEED, std=INIT_STD)
        layer.eval()
        routed: list[tuple[torch.Tensor, torch.Tensor]] = []
        layer.router.register_forward_hook(
            lambda _module, _inputs, output: routed.append(
                (output[0].detach().clone(), output[1].detach().clone())
            )
        )
        # Per-rank data (seeded by rank); the sequence-shard length varies with the
        # iteration and the DP rank (uneven token counts across EP ranks) and is equal within
        # a TP group, as sequence parallelism requires.
        data = torch.Generator().manual_seed(SEED + 1 + rank)
        iterations = []
        for it in range(ITERATIONS):
            seq = 3 + 2 * it + layout.dp_rank
            x_SBH = torch.randn(seq, B, H, generator=data)
            with torch.no_grad():
                out_SBH, bias = layer(x_SBH)
            assert bias is None
            probs_TE, routing_map_TE = routed.pop()
            iterations.append(
                {
                    "x": x_SBH.reshape(-1, H),
                    "probs": probs_TE,
                    "routing_map": routing_map_TE,
                    "out": out_SBH.reshape(-1, H),
                }
            )
        experts = {
            global_index: {
                "fc1": _shard_info(mlp.linear_fc1.weight),
                "fc2": _shard_info(mlp.linear_fc2.weight),
            }
            for global_index, mlp in zip(layer.local_expert_indices, layer.experts.local_experts)
        }
        return {
            "layout": layout,
            "experts_type": type(layer.experts).__name__,
            "iterations": iterations,
            "experts": experts,
        }


def _run_gpt_case(rank: int, case: GPTCase) -> dict[str, Any]:
    del rank
    with parallel_state(case.tp, 1, seed=SEED) as layout:
        config = _config(case.tp, 1, case.num_experts, K, num_layers=2, num_query_groups=4)
        spec = get_gpt_layer_local_spec(num_experts=case.num_experts, moe_grouped_gemm=False)
        vocab, seq = 64, 8
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=seq,
            parallel_output=False,
            position_embedding_type="rope",
        )
        assert sum(isinstance(m, MoELayer) for m in model.modules()) == 2
        model.eval()
        data = torch.Generator().manual_seed(SEED + 7)  # same tokens on every rank
        input_ids_BS = torch.randint(0, vocab, (B, seq), generator=data)
        position_ids_BS = torch.arange(seq).unsqueeze(0).expand(B, seq)
        with torch.no_grad():
            logits_BSV = model(input_ids_BS, position_ids_BS, attention_mask=None)
        params = {name: _shard_info(p) for name, p in model.named_parameters()}
        return {"layout": layout, "logits": logits_BSV, "params": params}


def _run_case(rank: int, case: MoECase | GPTCase) -> dict[str, Any]:
    if isinstance(case, MoECase):
        return _run_moe_case(rank, case)
    return _run_gpt_case(rank, case)


def _worker(rank: int, world_size: int, cases: Sequence[MoECase | GPTCase]) -> list[Any]:
    """Entry point of every rank: all cases of one world size, in order."""
    del world_size
    apply_cpu_patches()
    return for_each_case(cases, functools.partial(_run_case, rank))


# ----------------------------------------------------------------------------------------
# Reference and checks (pytest process)
# ----------------------------------------------------------------------------------------


def dense_moe_reference(
    x_TH: torch.Tensor,
    probs_TE: torch.Tensor,
    routing_map_TE: torch.Tensor,
    fc1_EIH: torch.Tensor,
    fc2_EHF: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_{e: routing_map[t,e]} probs[t,e] * W2_e (silu(G_e x_t) * (U_e x_t)).

    `fc1_EIH` is [E, 2F, H] with the gate rows first (I = 2F), `fc2_EHF` is [E, H, F].
    Computed in float64 so that it is a reference for fp32 results.
    """
    x = x_TH.double()
    out_TH = torch.zeros_like(x)
    for e in range(fc1_EIH.shape[0]):
        rows = routing_map_TE[:, e].nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        gate_TF, up_TF = (x[rows] @ fc1_EIH[e].double().T).chunk(2, dim=-1)
        y_TH = (F.silu(gate_TF) * up_TF) @ fc2_EHF[e].double().T
        out_TH[rows] += probs_TE[rows, e].double().unsqueeze(1) * y_TH
    return out_TH.to(x_TH.dtype)


_LAUNCHES: dict[int, tuple[list[Any], list[MoECase | GPTCase]] | AssertionError] = {}


def _launch(world: int) -> tuple[list[Any], list[MoECase | GPTCase]]:
    """Run every case of world size `world` in one launch; the outcome (results or the
    failure) is cached for the session, so a broken launch is not repeated per test."""
    if world not in _LAUNCHES:
        cases: list[MoECase | GPTCase] = [c for c in MOE_CASES if c.world == world]
        cases += [c for c in GPT_CASES if c.world == world]
        try:
            _LAUNCHES[world] = (run_distributed(_worker, world, cases, timeout_s=120), cases)
        except AssertionError as failure:
            _LAUNCHES[world] = failure
    outcome = _LAUNCHES[world]
    if isinstance(outcome, AssertionError):
        raise outcome
    return outcome


def _results_of(case: MoECase | GPTCase) -> list[dict[str, Any]]:
    """Per-rank results of `case` (rank order)."""
    per_rank, cases = _launch(case.world)
    index = cases.index(case)
    return [rank_results[index] for rank_results in per_rank]


# ----------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: c.name)
def test_moe_layer_matches_dense_formula(case: MoECase) -> None:
    results = _results_of(case)
    layouts: list[ParallelLayout] = [r["layout"] for r in results]
    assert all(r["experts_type"] == "SequentialMLP" for r in results)
    assert [lay.tp_rank for lay in layouts] == [r % case.tp for r in range(case.world)]
    assert {lay.etp_rank for lay in layouts} == set(range(case.tp))

    # Full expert weights, each gathered over the expert-TP ranks that own it (world = tp *
    # ep in every case, so each expert has exactly one shard per expert-TP rank).
    fc1, fc2 = [], []
    for e in range(case.num_experts):
        owners = sorted(
            (r for r in results if e in r["experts"]), key=lambda r: r["layout"].etp_rank
        )
        assert len(owners) == case.tp, f"expert {e}: {len(owners)} shards for tp={case.tp}"
        (_, dim1, stride1), (_, dim2, stride2) = (
            owners[0]["experts"][e][k] for k in ("fc1", "fc2")
        )
        assert (dim1, stride1, dim2, stride2) == (0, 2, 1, 1)
        fc1.append(full_weight([r["experts"][e]["fc1"][0] for r in owners], dim1, stride1))
        fc2.append(full_weight([r["experts"][e]["fc2"][0] for r in owners], dim2, stride2))
    fc1_EIH, fc2_EHF = torch.stack(fc1), torch.stack(fc2)
    for e in range(case.num_experts):  # shards as init_expert_weights put them (exact)
        fc1_IH, fc2_HF = draw_expert_weights(
            SEED, e, hidden=H, ffn=F_EXPERT, gated=True, std=INIT_STD
        )
        torch.testing.assert_close(fc1_EIH[e], fc1_IH, rtol=0, atol=0)
        torch.testing.assert_close(fc2_EHF[e], fc2_HF, rtol=0, atol=0)
    assert fc1_EIH.shape == (case.num_experts, 2 * F_EXPERT, H)
    assert fc2_EHF.shape == (case.num_experts, H, F_EXPERT)

    for rank, result in enumerate(results):
        for it, step in enumerate(result["iterations"]):
            routing_map_TE = step["routing_map"]
            assert routing_map_TE.dtype == torch.bool
            assert (routing_map_TE.sum(dim=1) == case.topk).all(), "every token has K experts"
            assert (step["probs"][~routing_map_TE] == 0).all(), "probs are dense, 0 off-route"
            expected_TH = dense_moe_reference(
                step["x"], step["probs"], routing_map_TE, fc1_EIH, fc2_EHF
            )
            assert expected_TH.abs().max() > 1e-3, "degenerate reference"
            assert_close(
                step["out"], expected_TH, **MOE_TOL, what=f"{case.name} rank {rank} iter {it}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_tp_ep_group_rank_is_ep_major(world: int) -> None:
    """Megatron's tp_ep group (order "tp-cp-ep-dp-pp"): rank = ep_rank * tp + tp_rank."""
    for case in (c for c in MOE_CASES if c.world == world):
        for result in _results_of(case):
            lay: ParallelLayout = result["layout"]
            assert lay.tp_ep_rank == lay.ep_rank * lay.tp + lay.tp_rank, (case.name, lay)
            assert lay.etp_rank == lay.tp_rank, (case.name, lay)
            assert lay.rank == lay.dp_rank * lay.tp + lay.tp_rank, (case.name, lay)


def _full_params(case: GPTCase) -> dict[str, torch.Tensor]:
    results = _results_of(case)
    names = results[0]["params"].keys()
    full = {}
    for name in names:
        shards = [r["params"][name] for r in results]  # EP=1, DP=1: rank == tp_rank
        _, dim, stride = shards[0]
        full[name] = full_weight([s[0] for s in shards], dim, stride)
    return full


@pytest.mark.slow
@pytest.mark.parametrize("case", GPT_CASES[1:], ids=lambda c: c.name)
def test_gpt_cpu_init_gives_same_full_weights_across_tp(case: GPTCase) -> None:
    reference = _full_params(GPT_CASES[0])
    full = _full_params(case)
    assert full.keys() == reference.keys()
    for name, weight in full.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", GPT_CASES[1:], ids=lambda c: c.name)
def test_gpt_prefill_logits_match_across_tp(case: GPTCase) -> None:
    (reference,) = _results_of(GPT_CASES[0])
    expected_BSV = reference["logits"]
    assert expected_BSV.shape == (B, 8, 64)
    for rank, result in enumerate(_results_of(case)):
        assert_close(result["logits"], expected_BSV, **GPT_TOL, what=f"{case.name} rank {rank}")


def _probe_patches(rank: int, world_size: int) -> dict[str, Any]:
    """What the patches changed, after applying them twice."""
    del rank, world_size
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import token_dispatcher

    apply_cpu_patches()
    norm_new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    all_to_all = mappings.all_to_all
    apply_cpu_patches()
    try:
        torch.cuda.current_device()
        real_cuda_untouched = False
    except (AssertionError, RuntimeError):
        real_cuda_untouched = True
    return {
        "idempotent": torch_norm.WrappedTorchNorm.__dict__["__new__"] is norm_new
        and mappings.all_to_all is all_to_all,
        "dispatcher_sees_patched_a2a": token_dispatcher.all_to_all is mappings.all_to_all,
        "megatron_device": mappings.torch.cuda.current_device(),
        "real_cuda_untouched": real_cuda_untouched,
    }


@pytest.mark.slow
def test_cpu_patches_are_idempotent_and_local_to_megatron() -> None:
    (probe,) = run_distributed(_probe_patches, 1)
    assert probe == {
        "idempotent": True,
        "dispatcher_sees_patched_a2a": True,
        "megatron_device": "cpu",
        "real_cuda_untouched": True,
    }


# ----------------------------------------------------------------------------------------
# The runner itself (cheap: the forkserver is warm by now)
# ----------------------------------------------------------------------------------------


def _echo(rank: int, world_size: int, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    return rank, world_size, torch.distributed.get_rank(), args, kwargs


def _fail_on_rank(rank: int, world_size: int, bad_rank: int) -> list[int]:
    def run_case(case: int) -> int:
        if rank == bad_rank and case == 2:
            raise ValueError(f"boom on rank {rank}")
        torch.distributed.barrier()  # the healthy ranks block on the failed one
        return case

    del world_size
    return for_each_case([1, 2, 3], run_case)


def _die(rank: int, world_size: int) -> None:
    del world_size
    if rank == 1:
        os._exit(3)
    torch.distributed.barrier()


def _hang(rank: int, world_size: int) -> None:
    del rank, world_size
    time.sleep(3600)


def test_runner_returns_results_in_rank_order() -> None:
    results = run_distributed(_echo, 2, "a", key=3)
    assert results == [(0, 2, 0, ("a",), {"key": 3}), (1, 2, 1, ("a",), {"key": 3})]


def test_runner_reports_failing_rank_and_case_and_kills_the_rest() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_fail_on_rank, 2, 1, timeout_s=60)
    message = str(info.value)
    assert "----- rank 1 -----" in message
    assert "ValueError: boom on rank 1" in message
    assert "case 1 failed: 2" in message
    assert time.monotonic() - start < 30, "the blocked rank was not killed promptly"


def test_runner_reports_a_rank_that_died() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 -----\nprocess exited without reporting"):
        run_distributed(_die, 2, timeout_s=60)


def test_runner_times_out_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(_hang, 1, timeout_s=2)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "rank 0 -----\ndid not finish within timeout_s=2; killed" in message
    assert "in _hang" in message, "the stuck rank's stack is reported"
