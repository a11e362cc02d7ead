"""Flag on vs flag off through real Megatron modules, under gloo, world 1, 2 and 4.

Every case builds the stock module (Megatron's local spec: alltoall dispatcher +
`SequentialMLP`), copies its state dict into the fused-path module (the strict load itself
checks that parameter names and shapes are unchanged), runs both on the same input and
compares. Flag off through our spec must be bit-for-bit the stock module.

Tolerances, relative to the largest |output| of the case:
  * fp32: 1e-5 — the fused path sums the same products in another order (pre-reduction
    before the return all-to-all); a few fp32 ulps over <= top-k terms;
  * bf16: 2 ** -6 — flag off rounds every (token, expert) row to bf16 and scatter-adds in
    bf16; flag on rounds each pre-reduced row once and sums in fp32; both sit within a few
    bf16 half-ulps (2 ** -9) of the exact sum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional, Union

import pytest
import torch
import torch.nn.functional as F

from tests.support.asserts import describe_mismatch
from tests.support.dist import for_each_case, run_distributed
from tests.support.megatron_cpu import init_expert_weights

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}


@dataclass(frozen=True)
class LayerCase:
    tp: int
    ep: int
    num_experts: int
    topk: int
    sp: bool = True
    shared: Optional[int] = None  # shared-expert ffn size
    dtype: torch.dtype = torch.float32
    seq: int = 12
    batch: int = 2
    check_grads: bool = False
    model: bool = False  # a 2-layer GPTModel instead of one MoELayer
    capacity_factor: Optional[float] = None
    backend: str = "reference"
    prereduce: Union[bool, str] = "auto"  # GatherRSOptions.prereduce (True: Triton only)


def _config(case: LayerCase, flag: bool, num_layers: int = 1):
    from megatron_overlap.megatron import GatherRSTransformerConfig

    return GatherRSTransformerConfig(
        num_layers=num_layers,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        moe_ffn_hidden_size=24,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1,
        moe_shared_expert_intermediate_size=case.shared,
        moe_expert_capacity_factor=case.capacity_factor,
        moe_token_dispatcher_type="alltoall",
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.tp,
        sequence_parallel=case.sp and case.tp > 1,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=case.dtype,
        bf16=case.dtype == torch.bfloat16,
        moe_gatherrs_overlap=flag,
        moe_gatherrs_backend=case.backend,
        moe_gatherrs_prereduce=case.prereduce,
    )


def _input(case: LayerCase, layout) -> torch.Tensor:
    # SP off: the TP ranks of a group hold the same tokens (Megatron's assumption).
    seed = layout.rank if (case.sp and case.tp > 1) else layout.rank // case.tp
    gen = torch.Generator().manual_seed(1000 + seed)
    seq = case.seq // case.tp if (case.sp and case.tp > 1) else case.seq
    return torch.randn(seq, case.batch, 32, generator=gen).to(case.dtype)


def _run_layer_case(case: LayerCase, layout, device: str = "cpu") -> dict:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec

    stock_spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
    ours_spec = use_gatherrs_in_moe_spec(stock_spec)
    stock = stock_spec(config=_config(case, False))
    init_expert_weights(stock, seed=99, std=0.2)  # distinct experts on every EP rank
    ours_off = ours_spec(config=_config(case, False))
    ours_on = ours_spec(config=_config(case, True))
    ours_off.load_state_dict(stock.state_dict(), strict=True)
    ours_on.load_state_dict(stock.state_dict(), strict=True)
    for layer in (stock, ours_off, ours_on):
        layer.to(device)

    x = _input(case, layout).to(device)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x)
    results = {}
    outputs, grads = {}, {}
    for name, layer in (("stock", stock), ("off", ours_off), ("on", ours_on)):
        layer.train(case.check_grads)  # Megatron refuses TP without SP in training only
        xi = x.clone().requires_grad_(case.check_grads)
        with torch.set_grad_enabled(case.check_grads):
            out, bias = layer(xi)
        assert bias is None
        outputs[name] = out.detach()
        if case.check_grads:
            (out * grad_out).sum().backward()
            fc1 = layer.experts.local_experts[0].linear_fc1.weight.grad
            grads[name] = (xi.grad, fc1)
    results["off_bitwise"] = torch.equal(outputs["off"], outputs["stock"])
    tol = TOLERANCE[case.dtype]
    results["mismatch"] = describe_mismatch(outputs["on"], outputs["stock"], rel_tol=tol)
    results["same_shape"] = outputs["on"].shape == outputs["stock"].shape
    results["dispatcher"] = type(ours_on.token_dispatcher).__name__
    results["stock_dispatcher_when_off"] = type(ours_off.token_dispatcher).__name__
    results["num_plans"] = ours_on.token_dispatcher.num_plans
    results["last_combine"] = ours_on.token_dispatcher.last_combine
    results["plan_mode"] = ours_on.token_dispatcher.plan.mode
    tile = ours_on.token_dispatcher.last_tile  # the Triton combine's GEMM2 tile (else None)
    results["last_tile"] = None if tile is None else tile.name
    if case.check_grads:
        results["grad_x_mismatch"] = describe_mismatch(grads["on"][0], grads["stock"][0],
                                                       rel_tol=tol)
        results["grad_fc1_mismatch"] = describe_mismatch(grads["on"][1], grads["stock"][1],
                                                         rel_tol=tol)
    return results


def _run_model_case(case: LayerCase, layout, device: str = "cpu") -> dict:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as stock_specs
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_overlap.megatron import specs

    vocab, seq = 64, case.seq
    cfg_off, cfg_on = _config(case, False, num_layers=2), _config(case, True, num_layers=2)

    def build(cfg, spec):
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                        max_sequence_length=seq, position_embedding_type="rope")

    stock = build(cfg_off, stock_specs.get_gpt_decoder_block_spec(cfg_off, False))
    for module in stock.modules():
        if isinstance(module, MoELayer):
            init_expert_weights(module, seed=99, std=0.2)
    ours = build(cfg_on, specs.get_gpt_decoder_block_spec(cfg_on))
    ours.load_state_dict(stock.state_dict(), strict=True)
    stock.eval().to(device)
    ours.eval().to(device)
    gen = torch.Generator().manual_seed(2000 + layout.dp_rank)
    tokens = torch.randint(0, vocab, (case.batch, seq), generator=gen)
    positions = torch.arange(seq).unsqueeze(0).expand(case.batch, -1).to(device)
    tokens = tokens.to(device)
    with torch.no_grad():
        logits_off = stock(tokens, positions, None)
        logits_on = ours(tokens, positions, None)
    moe_layers = [m for m in ours.modules() if type(m).__name__ == "GatherRSMoELayer"]
    return {
        "mismatch": describe_mismatch(logits_on, logits_off, rel_tol=TOLERANCE[case.dtype]),
        "same_shape": logits_on.shape == logits_off.shape,
        "num_fused_layers": sum(m.gatherrs for m in moe_layers),
        "num_plans": sum(m.token_dispatcher.num_plans for m in moe_layers),
    }


def _worker(rank: int, world_size: int, cases: list, device: str = "cpu") -> list:
    """Run `cases` on this rank; `device="cuda"` (with the nccl backend) for the GPU tests."""
    from tests.support.megatron_cpu import (
        allow_sequence_parallel_torch_norm,
        apply_cpu_patches,
        parallel_state,
    )

    if device == "cpu":
        apply_cpu_patches()
    else:
        allow_sequence_parallel_torch_norm()  # no TE/apex on the GPU machines
        # Megatron's un-permute scatter-adds with atomics on CUDA unless deterministic
        # algorithms are on; "flag off is stock bit for bit" needs a fixed order there.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)

    def run(case: LayerCase) -> dict:
        with parallel_state(case.tp, case.ep, seed=1234) as layout:
            return (_run_model_case if case.model else _run_layer_case)(case, layout, device)

    return for_each_case(cases, run)


def _cases(world: int) -> list:
    if world == 1:
        return [
            LayerCase(1, 1, num_experts=4, topk=2, check_grads=True),
            LayerCase(1, 1, num_experts=4, topk=2, shared=16),
            LayerCase(1, 1, num_experts=1, topk=1),
            LayerCase(1, 1, num_experts=4, topk=2, dtype=torch.bfloat16),
            LayerCase(1, 1, num_experts=4, topk=2, capacity_factor=1.0),
            LayerCase(1, 1, num_experts=4, topk=2, model=True),
        ]
    if world == 2:
        return [
            LayerCase(1, 2, num_experts=4, topk=2, check_grads=True),
            LayerCase(1, 2, num_experts=2, topk=1),  # one local expert
            LayerCase(1, 2, num_experts=8, topk=3, shared=16),
            LayerCase(2, 1, num_experts=4, topk=2, sp=True, check_grads=True),
            LayerCase(2, 1, num_experts=4, topk=2, sp=False),
            LayerCase(1, 2, num_experts=4, topk=2, dtype=torch.bfloat16),
            LayerCase(2, 1, num_experts=4, topk=2, dtype=torch.bfloat16),
            LayerCase(1, 2, num_experts=4, topk=2, model=True),
            LayerCase(2, 1, num_experts=4, topk=2, model=True),
        ]
    return [
        LayerCase(2, 2, num_experts=8, topk=2, check_grads=True),
        LayerCase(2, 2, num_experts=4, topk=2, sp=False, shared=16),
        LayerCase(1, 4, num_experts=4, topk=2),  # one local expert
        LayerCase(1, 4, num_experts=16, topk=4, shared=16),
        LayerCase(4, 1, num_experts=4, topk=3),
        LayerCase(2, 2, num_experts=8, topk=2, model=True),
        LayerCase(1, 4, num_experts=8, topk=2, model=True),
    ]


def check_results(world: int, cases: list, results: list) -> None:
    """Assert every rank's result of every case (shared with the GPU tests)."""
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            where = f"world {world} rank {rank} {case}"
            assert res["same_shape"], where
            assert res["mismatch"] is None, (where, res["mismatch"])
            if case.model:
                assert res["num_fused_layers"] == 2, (where, res)
                assert res["num_plans"] == 2, (where, res)  # one plan per MoE forward
                continue
            assert res["off_bitwise"], (where, "flag off is not stock Megatron bit for bit")
            assert res["dispatcher"] == "GatherRSAlltoAllTokenDispatcher", where
            assert res["stock_dispatcher_when_off"] == "MoEAlltoAllTokenDispatcher", where
            assert res["num_plans"] == 1, where
            if case.backend == "reference":
                want = "reference"
                # planned without a mode choice: the reference path has none
                assert res["plan_mode"] == "direct", (where, res["plan_mode"])
            elif case.prereduce == "auto":  # the plan's choice, the same on every rank
                modes = {r[cases.index(case)]["plan_mode"] for r in results}
                assert len(modes) == 1, (where, "ranks chose different modes", modes)
                want = "prereduced" if res["plan_mode"] == "prereduce" else "direct"
            else:
                want = "prereduced" if case.prereduce else "direct"
            assert res["last_combine"] == want, (where, res["last_combine"], want)
            for key in ("grad_x_mismatch", "grad_fc1_mismatch"):
                assert res.get(key) is None, (where, key, res[key])


def test_unsupported_configs_raise():
    from megatron_overlap.megatron import GatherRSTransformerConfig

    base = _config(LayerCase(1, 1, num_experts=4, topk=2), True)
    bad = {
        "moe_token_dispatcher_type": "allgather",
        "moe_shared_expert_overlap": True,
        "moe_pad_expert_input_to_capacity": True,
        "add_bias_linear": True,
    }
    for option, value in bad.items():
        kwargs = {f.name: getattr(base, f.name) for f in base.__dataclass_fields__.values()
                  if f.init}
        kwargs[option] = value
        if option == "moe_pad_expert_input_to_capacity":
            kwargs["moe_expert_capacity_factor"] = 1.0
        if option == "moe_shared_expert_overlap":
            kwargs["moe_shared_expert_intermediate_size"] = 16
        with pytest.raises(ValueError, match=option):
            GatherRSTransformerConfig(**kwargs)
    with pytest.raises(ValueError, match="moe_gatherrs_backend"):
        replace(base, moe_gatherrs_backend="cuda")
    with pytest.raises(ValueError, match="moe_gatherrs_num_comm_ctas"):
        replace(base, moe_gatherrs_num_comm_ctas=0)
    with pytest.raises(ValueError, match="moe_gatherrs_num_comm_ctas=1000000000 must be <= 65536"):
        replace(base, moe_gatherrs_num_comm_ctas=10**9)
    with pytest.raises(ValueError, match="moe_gatherrs_timeout_s"):
        replace(base, moe_gatherrs_timeout_s=0)
    with pytest.raises(ValueError, match="moe_gatherrs_timeout_s"):
        replace(base, moe_gatherrs_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="moe_gatherrs_timeout_s=1000000000000"):
        replace(base, moe_gatherrs_timeout_s=1e12)  # past int64 nanoseconds
    with pytest.raises(ValueError, match="moe_gatherrs_timeout_s"):
        replace(base, moe_gatherrs_timeout_s=1e-9)
    with pytest.raises(TypeError, match="must be a bool"):
        replace(base, moe_gatherrs_overlap="false")
    with pytest.raises(ValueError, match="moe_gatherrs_prereduce='yes' must be True, False or "
                                         "'auto'"):
        replace(base, moe_gatherrs_prereduce="yes")
    # Megatron itself refuses moe_permute_fusion without TE, so check ours directly.
    from megatron_overlap.megatron import validate_gatherrs_config

    fused = replace(base, moe_gatherrs_overlap=False)
    fused.moe_permute_fusion = True
    with pytest.raises(ValueError, match="moe_permute_fusion"):
        validate_gatherrs_config(fused)
    # Flag off: the same unsupported settings are stock Megatron's business, not ours.
    off = replace(base, moe_gatherrs_overlap=False, moe_permute_fusion=False)
    assert off.moe_gatherrs_overlap is False


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flag_on_matches_flag_off(world):
    cases = _cases(world)
    check_results(world, cases, run_distributed(_worker, world, cases, timeout_s=400))


@pytest.mark.parametrize("var, value, match", [
    ("MEGATRON_OVERLAP_TILE_LIST", "bogus", "MEGATRON_OVERLAP_TILE_LIST='bogus'"),
    ("MEGATRON_OVERLAP_HW_PROFILE", "nonexistent", "hardware profile 'nonexistent'"),
    ("MEGATRON_OVERLAP_SOLVER", "bogus", "MEGATRON_OVERLAP_SOLVER='bogus'"),
    ("MEGATRON_OVERLAP_FAST_LAUNCH", "yes", "MEGATRON_OVERLAP_FAST_LAUNCH='yes'"),
    ("MEGATRON_OVERLAP_FC1_CHUNK_MB", "0", "MEGATRON_OVERLAP_FC1_CHUNK_MB='0'"),
    ("MEGATRON_OVERLAP_TMA_STORE", "on", "MEGATRON_OVERLAP_TMA_STORE='on'"),
    ("MEGATRON_OVERLAP_HOST_TABLES", "cpp", "MEGATRON_OVERLAP_HOST_TABLES='cpp'"),
    ("MEGATRON_OVERLAP_HOST_SPLITS", "on", "MEGATRON_OVERLAP_HOST_SPLITS='on'"),
])
def test_bad_environment_fails_at_construction(monkeypatch, var, value, match):
    """A typo in a fused-path variable is an error when the dispatcher is built, on any
    device, not at the first GPU launch."""
    from megatron_overlap.megatron.dispatcher import GatherRSAlltoAllTokenDispatcher

    monkeypatch.setenv(var, value)
    config = _config(LayerCase(1, 1, num_experts=4, topk=2), True)
    with pytest.raises(ValueError, match=match):
        GatherRSAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config)


def _counts_worker(rank: int, world_size: int, layouts: list) -> list:
    """For each (TP, EP): the [R, E] counts the dispatcher keeps from Megatron's `preprocess`
    against an all-gather of every rank's tokens per expert (and None when not asked)."""
    import torch.distributed as dist
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    apply_cpu_patches()
    out = []
    for tp, ep in layouts:
        case = LayerCase(tp, ep, num_experts=4 * ep, topk=2)
        with parallel_state(tp, ep, seed=1234):
            spec = use_gatherrs_in_moe_spec(get_moe_module_spec(use_te=False,
                                                                num_experts=case.num_experts))
            dispatcher = spec(config=_config(case, True)).token_dispatcher
            gen = torch.Generator().manual_seed(rank)
            scores = torch.rand(5 + 3 * rank, case.num_experts, generator=gen)
            rmap = torch.zeros_like(scores, dtype=torch.bool)
            rmap.scatter_(1, scores.topk(case.topk, dim=1).indices, True)
            dispatcher.preprocess(rmap)
            unasked = dispatcher._megatron_counts
            dispatcher._keep_counts = True
            dispatcher.preprocess(rmap)
            kept = dispatcher._megatron_counts
            want = [torch.zeros(case.num_experts, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(want, rmap.sum(dim=0).to(torch.int64))
            out.append(unasked is None and kept is not None
                       and torch.equal(kept.view(world_size, -1).to(torch.int64),
                                       torch.stack(want)))
    return out


def _as_list(value):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return [int(v) for v in value] if getattr(value, "ndim", 1) == 1 else value.tolist()


def _splits_worker(rank: int, world_size: int, cases: list) -> list:
    """For each (TP, EP, capacity factor): the splits, tokens per local expert and dispatched
    rows of stock Megatron's dispatcher against the flag-on dispatcher's, on the host-splits
    path (Triton and reference) and on the path without it ($MEGATRON_OVERLAP_HOST_SPLITS=0),
    for the same routing map (every rank a different token count)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    apply_cpu_patches()
    out = []
    fields = ("input_splits", "output_splits", "output_splits_tp",
              "num_global_tokens_per_local_expert")
    for tp, ep, num_experts, capacity in cases:
        case = LayerCase(tp, ep, num_experts=num_experts, topk=min(2, num_experts),
                         capacity_factor=capacity)
        with parallel_state(tp, ep, seed=1234):
            stock_spec = get_moe_module_spec(use_te=False, num_experts=num_experts)
            ours_spec = use_gatherrs_in_moe_spec(stock_spec)
            gen = torch.Generator().manual_seed(rank)
            num_tokens = 5 + 3 * rank
            scores = torch.rand(num_tokens, num_experts, generator=gen)
            rmap = torch.zeros_like(scores, dtype=torch.bool)
            rmap.scatter_(1, scores.topk(case.topk, dim=1).indices, True)
            if capacity is not None:  # what a capacity does to the routing map: rows dropped
                rmap &= torch.rand(rmap.shape, generator=gen) > 0.3
            hidden = torch.randn(num_tokens, 32, generator=gen)
            runs = {}
            for name, flag, triton, host_splits in (
                    ("stock", False, None, None), ("host", True, True, "1"),
                    ("host-reference", True, False, "1"), ("megatron", True, True, "0"),
                    ("megatron-reference", True, False, "0")):
                os.environ["MEGATRON_OVERLAP_HOST_SPLITS"] = host_splits or ""
                spec = ours_spec if flag else stock_spec
                d = spec(config=_config(case, flag)).token_dispatcher
                if triton is not None:
                    d._triton_will_run = lambda h, triton=triton: triton
                x, probs = d.dispatch_preprocess(hidden, rmap, scores * rmap)
                x, probs = d.token_dispatch(x, probs)
                x, tokens_per_expert, probs = d.dispatch_postprocess(x, probs)
                runs[name] = {
                    "values": {f: _as_list(getattr(d, f, None)) for f in fields},
                    "tokens_per_expert": (type(tokens_per_expert).__name__,
                                          tokens_per_expert.tolist()),
                    "num_out_tokens": int(d.num_out_tokens),
                    "rows": x, "probs": probs,
                    "host_splits": getattr(d, "_host_splits", None),
                    "metadata_counts": (None if not flag else
                                        d.metadata.rows_per_expert_per_chunk.tolist()),
                }
            os.environ.pop("MEGATRON_OVERLAP_HOST_SPLITS")
            stock = runs.pop("stock")
            res = {}
            stock_per_local = stock["values"]["num_global_tokens_per_local_expert"]
            for name, run in runs.items():
                res[name] = {
                    "host_splits": run["host_splits"],
                    "same_values": run["values"] == stock["values"],
                    "values": (run["values"], stock["values"]),
                    "same_tokens_per_expert": (run["tokens_per_expert"]
                                               == stock["tokens_per_expert"]),
                    "same_num_out_tokens": run["num_out_tokens"] == stock["num_out_tokens"],
                    "same_rows": (torch.equal(run["rows"], stock["rows"])
                                  and torch.equal(run["probs"], stock["probs"])),
                    "metadata_is_transpose": (stock_per_local is None or run["metadata_counts"]
                                              == [list(c) for c in zip(*stock_per_local)]),
                }
            out.append(res)
    return out


SPLIT_CASES = {
    1: [(1, 1, 4, None), (1, 1, 1, None), (1, 1, 4, 1.0)],
    2: [(1, 2, 8, None), (2, 1, 4, None), (1, 2, 2, None), (1, 2, 4, 1.0)],
    4: [(2, 2, 8, None), (1, 4, 8, None), (4, 1, 4, None), (2, 2, 4, 1.5)],
}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_host_splits_match_megatron(world):
    """The flag-on dispatcher's host-derived splits (`megatron_splits`, one copy of the
    gathered counts) are Megatron's own: `input_splits`, `output_splits`,
    `output_splits_tp`, `num_global_tokens_per_local_expert` (also the metadata's
    `rows_per_expert_per_chunk` transposed), the tokens per local expert (a CPU tensor, as
    Megatron's), `num_out_tokens` (dropless and with a capacity) and the dispatched rows
    and probs, bit for bit; at world 1, 2 (EP, TP, one local expert, capacity) and 4 (TP x
    EP, EP, TP); on the Triton and reference paths, with the host splits on and off."""
    cases = SPLIT_CASES[world]
    results = run_distributed(_splits_worker, world, cases, timeout_s=300)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            for name, r in res.items():
                where = (f"world {world} rank {rank} (tp, ep, experts, capacity) {case} "
                         f"{name}")
                assert r["host_splits"] is (not name.startswith("megatron")), (where, r)
                assert r["same_values"], (where, r["values"])
                for key in ("same_tokens_per_expert", "same_num_out_tokens", "same_rows",
                            "metadata_is_transpose"):
                    assert r[key], (where, key)


def _one_rank_counts_worker(rank: int, world_size: int, _unused) -> list:
    """At world 1 (no gather of Megatron's to reuse) the counts the dispatcher keeps for
    the Triton path ([1, E]: no slot columns) and for the reference path ([1, E + EP])."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    apply_cpu_patches()
    case = LayerCase(1, 1, num_experts=4, topk=2)
    out = []
    with parallel_state(1, 1, seed=1234):
        spec = use_gatherrs_in_moe_spec(get_moe_module_spec(use_te=False,
                                                            num_experts=case.num_experts))
        dispatcher = spec(config=_config(case, True)).token_dispatcher
        scores = torch.rand(9, case.num_experts, generator=torch.Generator().manual_seed(3))
        rmap = torch.zeros_like(scores, dtype=torch.bool)
        rmap.scatter_(1, scores.topk(case.topk, dim=1).indices, True)
        hidden = torch.randn(9, 32)  # (hidden_size of `_config`)
        for triton in (True, False):
            dispatcher._triton_will_run = lambda h, triton=triton: triton
            dispatcher.dispatch_preprocess(hidden, rmap, scores * rmap)
            counts = dispatcher._counts_host
            out.append((tuple(counts.shape), counts.dtype == torch.int64,
                        counts[0, :case.num_experts].tolist() == rmap.sum(0).tolist()))
    return out


def _drop_and_pad_worker(rank: int, world_size: int, _unused) -> str:
    """The message of a flag-on dispatch whose `drop_and_pad` was switched on after
    construction (as megatron.core.inference's `set_decode_expert_padding` does)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    apply_cpu_patches()
    case = LayerCase(1, 1, num_experts=4, topk=2)
    with parallel_state(1, 1, seed=1234):
        spec = use_gatherrs_in_moe_spec(get_moe_module_spec(use_te=False, num_experts=4))
        dispatcher = spec(config=_config(case, True)).token_dispatcher
        dispatcher.drop_and_pad = True
        rmap = torch.zeros(6, 4, dtype=torch.bool)
        rmap[:, :2] = True
        try:
            dispatcher.dispatch_preprocess(torch.randn(6, 32), rmap, rmap.float())
        except RuntimeError as err:
            return str(err)
    return "no error"


def test_drop_and_pad_at_run_time_is_refused():
    """A drop-and-pad dispatch (refused in the config; here switched on afterwards) is a
    RuntimeError naming it, not a dropless dispatch with the wrong splits."""
    [message] = run_distributed(_drop_and_pad_worker, 1, None, timeout_s=120)
    assert "does not support drop-and-pad" in message, message


def test_one_rank_counts_have_slot_columns_only_on_the_reference_path():
    """At world 1 the Triton path's counts are [1, E] (one reduction, no slot columns to
    build: v5.4), the reference path's [1, E + EP]."""
    results = run_distributed(_one_rank_counts_worker, 1, None, timeout_s=120)
    assert results == [[((1, 4), True, True), ((1, 5), True, True)]], results


def test_dispatcher_keeps_megatron_counts():
    """The Triton path reuses the tokens-per-expert all-gather of Megatron's `preprocess`
    (group order, [R, E]) instead of its own; checked on EP2 and TP2 (SP)."""
    results = run_distributed(_counts_worker, 2, [(1, 2), (2, 1)], timeout_s=120)
    assert results == [[True, True], [True, True]], results


def test_reused_host_buffers_survive_leaving_inference_mode():
    """The dispatcher's reused counts buffer (`refill`) and a workspace's in-place tensors
    are made outside inference mode: a buffer first filled by an inference forward is
    refilled by a later forward outside it (torch refuses in-place updates of inference
    tensors there)."""
    import torch

    from megatron_overlap.megatron.dispatcher import refill
    from megatron_overlap.symm import GatherRSWorkspace

    with torch.inference_mode():
        buf = refill(None, torch.arange(6).view(2, 3), pin_memory=False)
        ws = GatherRSWorkspace(None, hidden=8, dtype=torch.float32, device="cpu")
    assert refill(buf, torch.arange(6, 12).view(2, 3), pin_memory=False) is buf
    assert buf.tolist() == [[6, 7, 8], [9, 10, 11]]
    other = refill(buf, torch.zeros(3, dtype=torch.int32), pin_memory=False)
    assert other is not buf and other.dtype == torch.int32  # new shape and dtype: new buffer
    ws.error.zero_()
    ws.finalize_done.zero_()
    ws._error_host.copy_(ws.error)
    with torch.inference_mode(False):
        plain = torch.zeros(2)
    with torch.inference_mode():
        inference = torch.zeros(2)
    plain.add_(1)
    with pytest.raises(RuntimeError, match="[Ii]nference"):  # what the buffers avoid
        inference.add_(1)
