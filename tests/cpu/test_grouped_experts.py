"""Stacked expert weights, the zero-copy FC2 view, its fallback, and the grouped FC1.

* `stacked_view` / `stack_parameters_` / `stacked_weights` / `expert_matmul` on plain
  tensors (no process group);
* through real Megatron modules under gloo (world 1: every layout/fallback case; world 2:
  EP = 2 and TP = 2 with SP): flag-on experts keep their weights in one storage, `fc2_weight`
  is a zero-copy view with strides (H * F, F, 1), re-pointed parameters fall back to
  `torch.stack`, autograd gets a differentiable stack, `.to()` re-stacks, strict state-dict
  loads work both ways (and through `torch.save` / `torch.load`), and the grouped FC1
  (forced on the CPU with `fc1_impl="grouped"`) matches Megatron's per-expert loop and the
  flag-off layer.

Tolerances (relative to the largest |reference|): the grouped FC1 against the loop: 1e-6 in
fp32 (same products, at most a different summation order inside the GEMM; measured 0 on
torch 2.13 CPU) and 2^-8 in bf16 (one bf16 rounding of the output, unit roundoff 2^-9, x2);
whole layers flag on vs off: `test_megatron_flag.TOLERANCE` (1e-5 fp32, 2^-6 bf16, reasons
there).
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatron_overlap.config import FC1_CHUNK_ENV
from megatron_overlap.megatron.grouped_experts import (
    StackedViewCache,
    expert_matmul,
    expert_parts,
    expert_weights,
    grouped_mm_name,
    mlp_parts_replaced,
    stack_parameters_,
    stacked_view,
    stacked_weights,
    swiglu_in_place_applies,
    swiglu_probs_in_place,
)
from tests.support.asserts import describe_mismatch
from tests.support.dist import for_each_case, run_distributed

LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
FC1_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8}

# --------------------------------------------------------------------------------------
# Plain tensors
# --------------------------------------------------------------------------------------


def test_stacked_view_of_stacked_rows():
    base = torch.arange(4 * 3 * 5, dtype=torch.float32).view(4, 3, 5)
    view = stacked_view([base[i] for i in range(4)])
    assert view is not None
    assert view.data_ptr() == base.data_ptr() and view.stride() == (15, 5, 1)
    assert torch.equal(view, base)


def test_stacked_view_none_when_not_laid_out():
    base = torch.randn(6, 3, 5)
    assert stacked_view([base[0], base[2], base[4]]) is None  # gaps
    assert stacked_view([base[1], base[0]]) is None  # out of order
    assert stacked_view([torch.randn(3, 5), torch.randn(3, 5)]) is None  # two storages
    assert stacked_view([base[0].t(), base[1].t()]) is None  # not contiguous


def test_stacked_view_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        stacked_view([])
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        stacked_view([torch.randn(3, 5), torch.randn(5, 3)])
    with pytest.raises(TypeError, match="expected a tensor"):
        stacked_view([torch.randn(3), [1.0, 2.0, 3.0]])


def test_stack_parameters_rehomes_in_place():
    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(4)]
    params[2].partition_dim = 1  # a Megatron-style attribute must survive
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    assert stack_parameters_(params) is True
    assert stacked_view(params) is not None
    assert [id(p) for p in params] == ids
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(p.requires_grad for p in params) and params[2].partition_dim == 1
    assert stack_parameters_(params) is False  # already stacked: no copy


def test_stacked_weights_view_stack_and_autograd():
    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(3)]
    stack_parameters_(params)
    with torch.no_grad():
        w, how = stacked_weights(params)
    assert how == "view" and w.data_ptr() == params[0].data_ptr()
    w, how = stacked_weights(params)  # autograd recording: differentiable copy
    assert how == "stack" and w.data_ptr() != params[0].data_ptr()
    (w * torch.arange(3.0).view(3, 1, 1)).sum().backward()
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full((3, 5), float(i)))
    params[1].data = params[1].data.clone()  # re-pointed (as DDP's buffer would)
    with torch.no_grad():
        w, how = stacked_weights(params)
    assert how == "stack" and torch.equal(w, torch.stack([p.detach() for p in params]))


def test_stacked_view_cache_hits_and_follows_moves():
    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(3)]
    stack_parameters_(params)
    cache = StackedViewCache()
    with torch.no_grad():
        w1, how1 = cache.get(params)
        w2, how2 = cache.get(params)
        assert how1 == how2 == "view" and w2 is w1  # hit: the same view object
        params[2].data.fill_(7.0)  # in-place updates show through the view
        assert torch.equal(w2[2], torch.full((3, 5), 7.0))
        # the same address with another shape or dtype (a view put in place): a miss each
        w1_data = params[1].data
        params[1].data = w1_data.view(5, 3)
        with pytest.raises(ValueError):
            cache.get(params)  # (the stack refuses the mixed shapes)
        params[1].data = w1_data
        assert cache.get(params)[1] == "view"
        square = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
        stack_parameters_(square)
        assert cache.get(square)[1] == "view"
        square[1].data = square[1].data.t()  # same address, shape and dtype; other strides
        w_t, how_t = cache.get(square)
        assert how_t == "stack" and torch.equal(w_t[1], square[1].detach())
        half = [torch.nn.Parameter(torch.randn(3, 5).bfloat16()) for _ in range(2)]
        stack_parameters_(half)
        assert cache.get(half)[1] == "view"
        half[0].data = half[0].data.view(torch.float16)  # same address and shape
        with pytest.raises(ValueError, match="float16"):
            cache.get(half)  # a miss: the stack refuses the mixed dtypes
        params[1].data = params[1].data.clone()  # re-pointed: miss, then a copy
        w3, how3 = cache.get(params)
        assert how3 == "stack" and w3 is not w1
        assert torch.equal(w3, torch.stack([p.detach() for p in params]))
        stack_parameters_(params)  # re-homed into a new storage: a new view
        w4, how4 = cache.get(params)
        assert how4 == "view" and w4.data_ptr() == params[0].data_ptr()
        assert torch.equal(w4, torch.stack([p.detach() for p in params]))
    w5, how5 = cache.get(params)  # autograd recording: a differentiable copy, never cached
    assert how5 == "stack" and w5.requires_grad
    cache.clear()


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(4, 6, bias=False)
        self.linear_fc2 = torch.nn.Linear(3, 4, bias=False)


class _PropertyExpert(_Expert):
    @property
    def linear_fc3(self):  # not a registered child: the attribute path
        return self.linear_fc2


def test_expert_parts_and_weights_are_the_attribute_path():
    experts = torch.nn.Module()
    experts.local_experts = torch.nn.ModuleList([_Expert(), _PropertyExpert(), _Expert()])
    for part in ("linear_fc1", "linear_fc2"):
        mods = [getattr(e, part) for e in experts.local_experts]
        assert all(a is b for a, b in zip(expert_parts(experts, part), mods, strict=True))
        ws = expert_weights(experts, part)
        assert len(ws) == 3 and all(a is m.weight for a, m in zip(ws, mods, strict=True))
    # a swapped module, a re-assigned parameter: seen at once (nothing is remembered)
    experts.local_experts[2].linear_fc1 = torch.nn.Linear(4, 6, bias=False)
    assert expert_parts(experts, "linear_fc1")[2] is experts.local_experts[2].linear_fc1
    experts.local_experts[0].linear_fc2.weight = torch.nn.Parameter(torch.zeros(4, 3))
    assert expert_weights(experts, "linear_fc2")[0] is experts.local_experts[0].linear_fc2.weight
    with pytest.raises(AttributeError, match="linear_fc3"):
        expert_parts(experts, "linear_fc3")  # experts 0 and 2 have none, as getattr says
    experts.local_experts = torch.nn.ModuleList([_PropertyExpert()])
    assert expert_parts(experts, "linear_fc3")[0] is experts.local_experts[0].linear_fc2
    assert expert_weights(experts, "linear_fc3")[0] is experts.local_experts[0].linear_fc2.weight
    # the fallbacks: a weight registered as None, one that is a plain attribute, a child
    # registered as None (AttributeError, as the attribute access raises on None.weight)
    expert = experts.local_experts[0]
    expert.linear_fc1.weight = None
    assert expert_weights(experts, "linear_fc1") == [None]
    del expert.linear_fc1._parameters["weight"]
    expert.linear_fc1.__dict__["weight"] = "plain"
    assert expert_weights(experts, "linear_fc1") == ["plain"]
    expert.linear_fc1 = None
    assert expert_parts(experts, "linear_fc1") == [None]
    with pytest.raises(AttributeError, match="weight"):
        expert_weights(experts, "linear_fc1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_matmul_matches_per_expert_matmul(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=gen).to(dtype)
    w = torch.randn(4, 24, 16, generator=gen).to(dtype)
    counts = [10, 0, 25, 5]  # an empty expert too
    y, impl = expert_matmul(x, w, torch.tensor(counts))
    ref = torch.cat([b @ w[i].t() for i, b in enumerate(torch.split(x, counts))])
    assert impl in (grouped_mm_name(), "loop")
    assert describe_mismatch(y.float(), ref.float(), rel_tol=FC1_TOLERANCE[dtype]) is None
    empty, impl = expert_matmul(x[:0], w, [0, 0, 0, 0])
    assert empty.shape == (0, 24) and impl.startswith("none")


def test_expert_matmul_takes_offsets_made_earlier():
    """`offsets=group_offsets(counts, device)` (one upload shared by several grouped GEMMs of
    a forward) gives the same result as offsets made inside; offsets of the wrong length,
    dtype or device are refused."""
    from megatron_overlap.megatron.grouped_experts import group_offsets, shared_offsets

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 16, generator=gen)
    w = torch.randn(4, 24, 16, generator=gen)
    counts = [10, 0, 25, 5]
    offs = group_offsets(counts, x.device)
    assert offs.dtype == torch.int32 and offs.tolist() == [10, 10, 35, 40]
    y, _ = expert_matmul(x, w, counts)
    y_shared, _ = expert_matmul(x, w, counts, offs)
    assert torch.equal(y, y_shared)
    if grouped_mm_name() != "loop":
        assert torch.equal(shared_offsets(counts, x), offs)
    assert shared_offsets([0, 0, 0, 0], x[:0]) is None  # no rows: no grouped GEMM, no upload
    for bad in (offs[:3], offs.long(), offs.float()):
        with pytest.raises(ValueError, match="group_offsets of the counts"):
            expert_matmul(x, w, counts, bad)


def test_grouped_gemms_of_one_forward_upload_their_offsets_once(monkeypatch):
    """The SwiGLU FC1's two halves share one offsets upload where the linear half runs in
    one chunk (each further chunk has its own counts: its own upload), and the `off-grouped`
    baseline's FC2 shares FC1's."""
    from megatron_overlap.megatron import grouped_experts as ge
    from megatron_overlap.megatron.grouped_experts import swiglu_fc1_split

    if grouped_mm_name() == "loop":
        pytest.skip("no grouped GEMM in this torch: no offsets")
    uploads = []
    real = ge.group_offsets
    monkeypatch.setattr(ge, "group_offsets",
                        lambda counts, device: uploads.append(list(counts)) or real(counts,
                                                                                     device))
    gen = torch.Generator().manual_seed(5)
    counts = [3, 0, 7, 4]
    w1 = torch.randn(4, 12, 8, generator=gen)
    x = torch.randn(14, 8, generator=gen)
    probs = torch.rand(14, generator=gen)
    swiglu_fc1_split(x, w1, counts, probs, 2**40)
    assert uploads == [counts]
    uploads.clear()
    _, _, n = swiglu_fc1_split(x, w1, counts, probs, 5 * 6 * x.element_size())
    assert n == 3 and len(uploads) == 1 + n and uploads[0] == counts


def test_expert_matmul_rejects_bad_input():
    x, w = torch.randn(10, 16), torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        expert_matmul(x, w, [3, 3])
    with pytest.raises(ValueError, match="tokens_per_expert"):
        expert_matmul(x, w, [10, 0, 0])
    with pytest.raises(ValueError, match=r"weight \[L, O, K\]"):
        expert_matmul(x, torch.randn(2, 8, 15), [5, 5])
    with pytest.raises(TypeError, match="dtype|bfloat16"):
        expert_matmul(x, w.bfloat16(), [5, 5])


# --------------------------------------------------------------------------------------
# Real Megatron modules under gloo
# --------------------------------------------------------------------------------------

H, FFN = 32, 24


@dataclass(frozen=True)
class Case:
    tp: int = 1
    ep: int = 1
    num_experts: int = 4
    topk: int = 2
    dtype: torch.dtype = torch.float32
    activation: str = "swiglu"  # swiglu | geglu | gelu | relu
    checks: str = "layer"  # layer | layout (world-1 layout / fallback / checkpoint checks)


def _config(case: Case, flag: bool):
    from megatron_overlap.megatron import GatherRSTransformerConfig

    act, gated = {
        "swiglu": (F.silu, True),
        "geglu": (F.gelu, True),
        "gelu": (F.gelu, False),
        "relu": (F.relu, False),
    }[case.activation]
    return GatherRSTransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=48,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_router_pre_softmax=case.topk == 1,  # Megatron requires it for top-1
        moe_token_dispatcher_type="alltoall",
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.tp,
        sequence_parallel=case.tp > 1,
        gated_linear_unit=gated,
        activation_func=act,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=case.dtype,
        bf16=case.dtype == torch.bfloat16,
        moe_gatherrs_overlap=flag,
        moe_gatherrs_backend="reference",
    )


def _layers(case: Case):
    """(stock layer, flag-off layer of our spec, flag-on layer), all with the same weights."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from megatron_overlap.megatron import use_gatherrs_in_moe_spec
    from tests.support.megatron_cpu import init_expert_weights

    stock_spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts)
    stock = stock_spec(config=_config(case, False))
    init_expert_weights(stock, seed=7, std=0.2)
    ours_spec = use_gatherrs_in_moe_spec(stock_spec)
    off = ours_spec(config=_config(case, False))
    on = ours_spec(config=_config(case, True))
    off.load_state_dict(stock.state_dict(), strict=True)
    on.load_state_dict(stock.state_dict(), strict=True)
    return stock.eval(), off.eval(), on.eval()


def _weights(layer, name):
    return [getattr(e, name).weight for e in layer.experts.local_experts]


def _input(case: Case, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    seq = 16 // case.tp if case.tp > 1 else 16
    return torch.randn(seq, 2, H, generator=gen).to(case.dtype)


def _layer_case(case: Case, rank: int, device: str = "cpu") -> dict:
    stock, _, on = _layers(case)
    stock.to(device)
    on.to(device)  # on CUDA: Module.to moves each weight; _apply re-stacks them
    x = _input(case, rank).to(device)
    on.experts.fc1_impl = "grouped"
    with torch.no_grad():
        ref, _ = stock(x)
        grouped, _ = on(x)
        last_fc1 = on.experts.last_fc1
        last_fc2 = on.experts.last_fc2_weight
        on.experts.fc1_impl = "loop"
        loop, _ = on(x)
    return {
        "grouped_vs_stock": describe_mismatch(grouped, ref, rel_tol=LAYER_TOLERANCE[case.dtype]),
        "loop_vs_stock": describe_mismatch(loop, ref, rel_tol=LAYER_TOLERANCE[case.dtype]),
        "last_fc1": last_fc1,
        "last_fc2_weight": last_fc2,
        "fc2_view": stacked_view(_weights(on, "linear_fc2")) is not None,
        "fc1_view": stacked_view(_weights(on, "linear_fc1")) is not None,
        "device": str(_weights(on, "linear_fc2")[0].device.type),
    }


def _fc1_direct(experts, x, counts, probs, impl):
    experts.fc1_impl = impl
    with torch.no_grad():
        h = experts.forward_fc1(x, counts, probs)
    return h, experts.last_fc1


def _layout_case(case: Case, rank: int) -> dict:
    """World-1 checks of the weight layout, the fallbacks and checkpoints."""
    del rank
    stock, off, on = _layers(case)
    experts = on.experts
    res = {}
    # Flag off: untouched (L separate allocations); flag on: one storage per projection.
    res["off_stacks"] = off.experts.stacks_weights
    res["off_fc2_view"] = stacked_view(_weights(off, "linear_fc2")) is not None
    res["on_stacks"] = experts.stacks_weights
    res["on_fc1_view"] = stacked_view(_weights(on, "linear_fc1")) is not None
    w2_params = _weights(on, "linear_fc2")
    with torch.no_grad():
        w2 = experts.fc2_weight()
    res["fc2_how"] = experts.last_fc2_weight
    res["fc2_zero_copy"] = w2.data_ptr() == w2_params[0].data_ptr()
    res["fc2_strides"] = (tuple(w2.shape), w2.stride())
    res["fc2_values"] = torch.equal(w2, torch.stack([p.detach() for p in w2_params]))
    # State dicts both ways, strictly, and through torch.save / torch.load.
    sd = on.state_dict()
    res["sd_keys_equal"] = sorted(sd) == sorted(stock.state_dict())
    off.load_state_dict(sd, strict=True)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    key0 = next(k for k in loaded if k.endswith("local_experts.0.linear_fc2.weight"))
    key1 = key0.replace("local_experts.0.", "local_experts.1.")
    res["saved_views_share_storage"] = (
        loaded[key0].untyped_storage().data_ptr() == loaded[key1].untyped_storage().data_ptr()
    )
    stock.load_state_dict(loaded, strict=True)
    on.load_state_dict(stock.state_dict(), strict=True)  # copy_ in place: layout kept
    res["view_after_load"] = stacked_view(_weights(on, "linear_fc2")) is not None
    res["values_after_load"] = all(
        torch.equal(a, b) for a, b in zip(_weights(on, "linear_fc2"), _weights(stock, "linear_fc2"))
    )
    # Fallback: a re-pointed parameter (as Megatron's DDP buffer does) -> torch.stack.
    w2_params[1].data = w2_params[1].data.clone()
    with torch.no_grad():
        w2_fallback = experts.fc2_weight()
    res["fallback_how"] = experts.last_fc2_weight
    res["fallback_values"] = torch.equal(
        w2_fallback, torch.stack([p.detach() for p in w2_params])
    )
    res["fallback_strides"] = w2_fallback.stride()
    experts.stack_weights_()
    with torch.no_grad():
        experts.fc2_weight()
    res["restacked_how"] = experts.last_fc2_weight
    # Autograd recording: a differentiable stack, gradients reach every expert.
    w2 = experts.fc2_weight()
    res["grad_how"] = experts.last_fc2_weight
    w2.sum().backward()
    res["grads"] = all(p.grad is not None and bool((p.grad == 1).all()) for p in w2_params)
    # .to(dtype) moves every parameter separately; _apply re-stacks.
    on.to(torch.bfloat16)
    res["view_after_to"] = stacked_view(_weights(on, "linear_fc2")) is not None and (
        stacked_view(_weights(on, "linear_fc1")) is not None
    )
    res["dtype_after_to"] = str(_weights(on, "linear_fc2")[0].dtype)
    on.to(torch.float32)
    # forward_fc1: grouped (forced) vs Megatron's loop; auto on CPU = loop.
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([5, 0, 9, 6])
    x = torch.randn(20, H, generator=gen).to(case.dtype)
    probs = torch.rand(20, generator=gen)
    h_loop, how_loop = _fc1_direct(experts, x, counts, probs, "loop")
    h_grouped, how_grouped = _fc1_direct(experts, x, counts, probs, "grouped")
    _, how_auto = _fc1_direct(experts, x, counts, probs, "auto")
    res["fc1_mismatch"] = describe_mismatch(h_grouped, h_loop, rel_tol=FC1_TOLERANCE[case.dtype])
    res["fc1_how"] = (how_loop, how_grouped, how_auto)
    # The in-place SwiGLU against Megatron's own MLP.forward (FC1 / FC2 passed through):
    # equal values (an exact zero may differ in sign), -0.0, large and tiny inputs and fp32
    # probs included.
    width = experts.local_experts[0].linear_fc1.weight.shape[0]
    mlps = list(experts.local_experts)
    res["swiglu_applies"] = swiglu_in_place_applies(experts.config)
    res["swiglu_equal"] = []
    for dtype in (torch.float32, torch.bfloat16):
        fc1 = torch.randn(23, width, generator=gen) * 8
        fc1[0] = -0.0
        fc1[1, : width // 2] = 1e-30
        fc1 = fc1.to(dtype)
        row_probs = torch.rand(23, generator=gen)
        with torch.no_grad(), mlp_parts_replaced(mlps[:1], fc1=True, fc2=True):
            reference, _ = mlps[0].forward(fc1.clone(), row_probs)
        in_place = swiglu_probs_in_place(fc1.clone(), row_probs)
        res["swiglu_equal"].append(in_place.dtype == reference.dtype == dtype
                                   and torch.equal(in_place, reference))
    # Row chunks (0.0013 MiB = 14 fp32 rows of FC1's linear half, 24 wide: chunks of rows
    # 0-10 and 10-20, splitting expert 2's rows 5-14) give one chunk's values, within the
    # GEMM's rounding (other shapes may take other kernels).
    assert case.dtype == torch.float32 and width == 48, (case.dtype, width)
    saved_chunk = os.environ.get(FC1_CHUNK_ENV)
    os.environ[FC1_CHUNK_ENV] = "0.0013"
    try:
        h_chunks, how_chunks = _fc1_direct(experts, x, counts, probs, "grouped")
    finally:
        if saved_chunk is None:
            del os.environ[FC1_CHUNK_ENV]
        else:
            os.environ[FC1_CHUNK_ENV] = saved_chunk
    res["fc1_chunks_mismatch"] = describe_mismatch(h_chunks, h_grouped,
                                                   rel_tol=FC1_TOLERANCE[case.dtype])
    res["fc1_chunks_how"] = how_chunks
    # Frozen FC1 weights but probabilities that autograd records (a trainable router): the
    # grouped FC1 runs, its activation through MLP.forward, and the gradient reaches probs.
    fc1_params = [e.linear_fc1.weight for e in experts.local_experts]
    for param in fc1_params:
        param.requires_grad_(False)
    try:
        experts.fc1_impl = "grouped"
        grad_probs = probs.clone().requires_grad_(True)
        h_frozen = experts.forward_fc1(x.detach(), counts, grad_probs)
        res["frozen_how"] = experts.last_fc1
        h_frozen.sum().backward()
        res["frozen_probs_grad"] = grad_probs.grad is not None and bool(
            grad_probs.grad.abs().sum() > 0)
        # (one [n, 2F] GEMM there, the split halves' GEMMs in h_grouped: GEMM rounding)
        res["frozen_mismatch"] = describe_mismatch(h_frozen.detach(), h_grouped,
                                                   rel_tol=FC1_TOLERANCE[case.dtype])
        # Megatron's MLP.forward in chunks of as many rows as the split SwiGLU's (14 rows of
        # [rows, F] at 0.0013 MiB: 2 chunks; [rows, 2F] would make 3)
        os.environ[FC1_CHUNK_ENV] = "0.0013"
        h_frozen_chunks = experts.forward_fc1(x.detach(), counts, grad_probs)
        res["frozen_chunks_how"] = experts.last_fc1
        res["frozen_chunks_mismatch"] = describe_mismatch(
            h_frozen_chunks.detach(), h_grouped, rel_tol=FC1_TOLERANCE[case.dtype])
    finally:
        if saved_chunk is None:
            os.environ.pop(FC1_CHUNK_ENV, None)
        else:
            os.environ[FC1_CHUNK_ENV] = saved_chunk
        for param in fc1_params:
            param.requires_grad_(True)
    experts.fc1_impl = "grouped"
    x.requires_grad_(True)
    experts.forward_fc1(x, counts, probs)
    res["fc1_how_grad"] = experts.last_fc1
    # The cached structural check follows a swapped module.
    with torch.no_grad():
        experts.forward_fc1(x, counts, probs)
        res["fc1_how_before_swap"] = experts.last_fc1
        saved = experts.local_experts[1].linear_fc1
        experts.local_experts[1].linear_fc1 = torch.nn.Linear(H, saved.weight.shape[0],
                                                              bias=False)
        res["fc1_reason_after_swap"] = experts._fc1_loop_reason(x)
        experts.local_experts[1].linear_fc1 = saved
        res["fc1_reason_restored"] = experts._fc1_loop_reason(x)
    experts.fc1_impl = "bogus"
    try:
        with torch.no_grad():
            experts.forward_fc1(x, counts, probs)
        res["bad_impl"] = None
    except ValueError as err:
        res["bad_impl"] = str(err)
    return res


def _worker(rank: int, world_size: int, cases: list, device: str = "cpu") -> list:
    """Run `cases` on this rank; `device="cuda"` (nccl backend) for the GPU test, which runs
    layer cases only (tests/gpu/test_grouped_experts_gpu.py)."""
    from tests.support.megatron_cpu import apply_cpu_patches, parallel_state

    if device == "cpu":
        apply_cpu_patches()
    del world_size

    def run(case: Case) -> dict:
        with parallel_state(case.tp, case.ep, seed=1234):
            if case.checks == "layout":
                return _layout_case(case, rank)
            return _layer_case(case, rank, device)

    return for_each_case(cases, run)


WORLD1 = [
    Case(checks="layout"),
    Case(),
    Case(dtype=torch.bfloat16),
    Case(activation="geglu"),
    Case(activation="gelu"),
    Case(activation="relu"),  # unsupported activation: stays on the loop
    Case(num_experts=1, topk=1),  # one local expert: the loop is one GEMM
]
WORLD2 = [
    Case(ep=2),
    Case(tp=2),
    Case(ep=2, num_experts=8, topk=3, dtype=torch.bfloat16),
]
WORLD4 = [Case(tp=2, ep=2), Case(ep=4), Case(tp=4)]


def check_layer(case: Case, res: dict, where: str) -> None:
    """Assert one layer case's result (shared with the GPU test)."""
    assert res["grouped_vs_stock"] is None, (where, res)
    assert res["loop_vs_stock"] is None, (where, res)
    assert res["fc1_view"] and res["fc2_view"], (where, res)
    assert res["last_fc2_weight"] == "view", (where, res)
    if case.activation == "relu":
        assert res["last_fc1"].startswith("loop: activation_func relu"), (where, res)
    elif case.num_experts // case.ep == 1:
        assert res["last_fc1"].startswith("loop: one local expert"), (where, res)
    else:
        assert res["last_fc1"].startswith(f"grouped FC1: {grouped_mm_name()}"), (where, res)
        # SwiGLU in place; GeGLU / GELU through Megatron's MLP.forward
        tail = ", SwiGLU in place" if case.activation == "swiglu" else ""
        assert res["last_fc1"].endswith(f"weights view{tail}"), (where, res)


def _check_layout(res: dict) -> None:
    assert res["off_stacks"] is False and res["off_fc2_view"] is False, res
    assert res["on_stacks"] is True and res["on_fc1_view"] is True, res
    assert res["fc2_how"] == "view" and res["fc2_zero_copy"], res
    assert res["fc2_strides"] == ((4, H, FFN), (H * FFN, FFN, 1)), res
    assert res["fc2_values"] and res["sd_keys_equal"], res
    assert res["saved_views_share_storage"], res
    assert res["view_after_load"] and res["values_after_load"], res
    assert res["fallback_how"] == "stack" and res["fallback_values"], res
    assert res["fallback_strides"] == (H * FFN, FFN, 1), res
    assert res["restacked_how"] == "view", res
    assert res["grad_how"] == "stack" and res["grads"], res
    assert res["view_after_to"] and res["dtype_after_to"] == "torch.bfloat16", res
    assert res["fc1_mismatch"] is None, res
    loop, grouped, auto = res["fc1_how"]
    assert loop == "loop: fc1_impl='loop'", res
    assert grouped == f"grouped FC1: {grouped_mm_name()}, weights view, SwiGLU in place", res
    assert res["swiglu_applies"] and res["swiglu_equal"] == [True, True], res
    assert res["fc1_chunks_mismatch"] is None, res
    assert res["frozen_how"] == f"grouped FC1: {grouped_mm_name()}, weights view", res
    assert res["frozen_probs_grad"] and res["frozen_mismatch"] is None, res
    assert res["frozen_chunks_how"] == (f"grouped FC1: {grouped_mm_name()}, weights view, "
                                        "2 row chunks"), res
    assert res["frozen_chunks_mismatch"] is None, res
    assert res["fc1_chunks_how"] == (f"grouped FC1: {grouped_mm_name()}, weights view, "
                                     "SwiGLU in place, linear half in 2 row chunks"), res
    assert auto.startswith("loop: fc1_impl='auto' takes the grouped GEMM on CUDA only"), res
    assert res["fc1_how_grad"].startswith("loop: autograd is recording"), res
    assert res["fc1_how_before_swap"].startswith("grouped FC1"), res
    assert "local expert 1's linear_fc1 is Linear" in res["fc1_reason_after_swap"], res
    assert res["fc1_reason_restored"] is None, res
    assert res["bad_impl"] is not None and "fc1_impl='bogus'" in res["bad_impl"], res


@pytest.mark.parametrize("world", [1, 2, 4])
def test_flag_on_experts_layout_and_grouped_fc1(world):
    cases = {1: WORLD1, 2: WORLD2, 4: WORLD4}[world]
    results = run_distributed(_worker, world, cases, timeout_s=300)
    for rank, per_rank in enumerate(results):
        for case, res in zip(cases, per_rank):
            where = f"world {world} rank {rank} {case}"
            if case.checks == "layout":
                _check_layout(res)
            else:
                check_layer(case, res, where)


@pytest.mark.parametrize("value, expected", [
    ("", 128 * 2**20), ("512", 512 * 2**20), ("0.5", 2**19), ("1e-9", 1),
    ("0", None), ("-1", None), ("abc", None), ("nan", None), ("inf", None), ("1e308", None),
    (" 64", None), ("64 ", None), ("6_4", None), ("+64", None), ("\uff16\uff14", None),
    ("\u0661\u0662\u0668", None), ("64.", 64 * 2**20), (".5", 2**19), ("1E2", 100 * 2**20),
])
def test_fc1_chunk_bytes_reads_and_checks_the_variable(monkeypatch, value, expected):
    from megatron_overlap.config import fc1_chunk_bytes

    monkeypatch.setenv(FC1_CHUNK_ENV, value)
    if expected is None:
        with pytest.raises(ValueError,
                           match=re.escape(f"{FC1_CHUNK_ENV}={value!r}: expected a number")):
            fc1_chunk_bytes()
    else:
        assert fc1_chunk_bytes() == expected


def test_swiglu_in_place_only_where_it_is_megatrons_unfused_swiglu():
    from types import SimpleNamespace

    base = dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
                use_te_activation_func=False, activation_func_clamp_value=None,
                glu_linear_offset=0.0)
    assert swiglu_in_place_applies(SimpleNamespace(**base))
    for change in (dict(gated_linear_unit=False), dict(activation_func=F.gelu),
                   dict(bias_activation_fusion=True), dict(use_te_activation_func=True),
                   dict(activation_func_clamp_value=7.0), dict(glu_linear_offset=1.0)):
        assert not swiglu_in_place_applies(SimpleNamespace(**{**base, **change})), change
    # Megatron's own formula, bf16 FC1 and fp32 probs: the same values
    gen = torch.Generator().manual_seed(3)
    fc1 = (torch.randn(9, 12, generator=gen) * 4).to(torch.bfloat16)
    probs = torch.rand(9, generator=gen)
    x_glu, x_lin = torch.chunk(fc1, 2, dim=-1)
    expected = (F.silu(x_glu) * (x_lin + 0.0) * probs.unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(swiglu_probs_in_place(fc1.clone(), probs), expected)


def test_row_chunks_bound_the_fc1_output():
    from megatron_overlap.megatron.grouped_experts import row_chunks

    # the fewest chunks of at most budget // row_bytes rows, sizes within one row of each
    # other; experts split where needed
    assert row_chunks([3, 0, 5, 2], row_bytes=10, budget=40) == [
        (0, 4, 0, 3, [3, 0, 1]), (4, 7, 2, 3, [3]), (7, 10, 2, 4, [1, 2])]
    # a budget between two row counts rounds down (5 bytes of 2-byte rows: 2 rows)
    assert row_chunks([5], row_bytes=2, budget=5) == [
        (0, 2, 0, 1, [2]), (2, 4, 0, 1, [2]), (4, 5, 0, 1, [1])]
    assert row_chunks([3, 0, 5, 2], row_bytes=10, budget=50) == [
        (0, 5, 0, 3, [3, 0, 2]), (5, 10, 2, 4, [3, 2])]
    assert row_chunks([3, 0, 5, 2], row_bytes=10, budget=0) == [
        (r, r + 1, e, e + 1, [1]) for r, e in enumerate([0, 0, 0, 2, 2, 2, 2, 2, 3, 3])]
    assert row_chunks([3, 0, 5, 2], row_bytes=10, budget=10**9) == [
        (0, 10, 0, 4, [3, 0, 5, 2])]
    assert row_chunks([0, 0], row_bytes=10, budget=10) == [(0, 0, 0, 2, [0, 0])]
    assert row_chunks([], row_bytes=10, budget=10) == [(0, 0, 0, 0, [])]
    # zero-row experts at a chunk's edges stay out of it
    assert row_chunks([2, 0, 0, 2, 0], row_bytes=1, budget=2) == [
        (0, 2, 0, 1, [2]), (2, 4, 3, 4, [2])]
    # Chunks, run one after another, give the all-at-once result.
    for counts in ([3, 0, 5, 2], [10], [0, 7, 0, 0, 3, 0]):
        # K = 8 fp32 (32-byte rows): torch's grouped GEMM takes it (16-byte alignment)
        x, w = torch.randn(sum(counts), 8), torch.randn(len(counts), 7, 8)
        whole, impl = expert_matmul(x, w, counts)
        assert impl == grouped_mm_name(), impl
        for budget in (0, 28, 3 * 28, 3 * 28 + 5, 4 * 28, 10**6):
            chunks = row_chunks(counts, row_bytes=7 * 4, budget=budget)
            assert all((r1 - r0) * 28 <= max(budget, 28) for r0, r1, *_ in chunks), chunks
            sizes = [r1 - r0 for r0, r1, *_ in chunks]
            assert max(sizes) - min(sizes) <= 1 and len(chunks) == -(
                -sum(counts) // max(1, budget // 28)), chunks
            assert [r0 for r0, *_ in chunks] + [chunks[-1][1]] == sorted(
                {r0 for r0, *_ in chunks} | {chunks[-1][1]}), chunks
            parts = [expert_matmul(x[r0:r1], w[first:end], part)[0]
                     for r0, r1, first, end, part in chunks]
            assert torch.allclose(torch.cat(parts), whole, atol=1e-5), (counts, budget)


def test_swiglu_probs_in_place_writes_into_out_and_checks_it():
    gen = torch.Generator().manual_seed(5)
    fc1 = (torch.randn(6, 8, generator=gen) * 3).to(torch.bfloat16)
    probs = torch.rand(6, generator=gen)
    expected = swiglu_probs_in_place(fc1.clone(), probs)
    big = torch.full((10, 4), 7.0, dtype=torch.bfloat16)
    got = swiglu_probs_in_place(fc1.clone(), probs, out=big[2:8])
    assert got.data_ptr() == big[2:8].data_ptr() and torch.equal(big[2:8], expected)
    assert torch.equal(big[:2], torch.full((2, 4), 7.0, dtype=torch.bfloat16))
    for bad in (torch.empty(6, 5, dtype=torch.bfloat16), torch.empty(6, 4),
                torch.empty(5, 4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="out is .* expected"):
            swiglu_probs_in_place(fc1.clone(), probs, out=bad)


def test_swiglu_fc1_split_equals_the_whole_fc1_then_swiglu():
    from megatron_overlap.megatron.grouped_experts import (
        row_chunks,
        swiglu_fc1_chunks,
        swiglu_fc1_split,
    )

    gen = torch.Generator().manual_seed(11)
    counts = [3, 0, 7, 4]
    for dtype in (torch.float32, torch.bfloat16):
        w1 = torch.randn(4, 2 * 6, 8, generator=gen).to(dtype)
        x = torch.randn(14, 8, generator=gen).to(dtype)
        probs = torch.rand(14, generator=gen)
        whole, _ = swiglu_fc1_chunks(x, w1, row_chunks(counts, 1, 2**40), probs)
        row_bytes = 6 * x.element_size()  # one row of the linear half
        for budget, chunks in ((2**40, 1), (5 * row_bytes, 3), (0, 14)):
            h, impl, n = swiglu_fc1_split(x, w1, counts, probs, budget)
            assert n == chunks and h.shape == (14, 6) and h.dtype == dtype, (budget, n)
            assert impl == grouped_mm_name(), impl
            # the same values within the GEMMs' rounding (other shapes may take other
            # kernels; fp32 accumulation in both)
            assert describe_mismatch(h, whole, rel_tol=FC1_TOLERANCE[dtype]) is None, (
                dtype, budget)
    empty, _, n = swiglu_fc1_split(x[:0], w1, [0, 0, 0, 0], probs[:0], 2**20)
    assert empty.shape == (0, 6) and n == 1
