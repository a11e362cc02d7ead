"""Stacked expert weights and grouped expert GEMMs for `SequentialMLP`-shaped experts.

Megatron's `SequentialMLP` (experts.py:1260) keeps one `MLP` per local expert, each with its
own `linear_fc1.weight` [I, H] and `linear_fc2.weight` [H, F], and runs them one expert at a
time. Two things here make the same parameters usable by one grouped GEMM per projection
without changing their names, shapes or values:

* `stack_parameters_`: re-homes a list of equally shaped parameters into one contiguous
  [L, ...] storage (`param.data = stacked[i]`); the `Parameter` objects (and their Megatron
  attributes, optimizer references, state-dict names) stay the same.
* `stacked_view`: at call time, a zero-copy [L, ...] view over such parameters *if they are
  still laid out that way* (same storage, equally spaced, contiguous). Anything that
  re-points a parameter (Megatron's DDP parameter buffer, `load_state_dict(assign=True)`,
  `param.data = ...`) breaks the layout; `stacked_weights` then falls back to `torch.stack`
  (a copy), which is always correct.

What `torch.save` and checkpoints do with the views: a `state_dict()` of re-homed
parameters holds L views of one storage. `torch.save` writes each storage once, so the file
is the same size as before and `torch.load` returns views of one storage again; but saving
a *single* expert's tensor on its own writes the whole [L, ...] storage (clone it first).
`load_state_dict` copies in place (`param.copy_`) and keeps the layout; safetensors'
`save_file` refuses tensors that share storage (clone, or use its `save_model`). Megatron's
distributed checkpointing (`sharded_state_dict`) sees the same per-expert tensors as before.

Shape symbols: N rows (tokens routed to this rank's experts), H hidden size, F per-expert
FFN width on this expert-TP rank, I = 2F for a gated linear unit (else F), L local experts.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.mlp import MLP

from megatron_overlap.config import fc1_chunk_bytes
from megatron_overlap.profiling import span

__all__ = [
    "expert_counts",
    "expert_matmul",
    "expert_parts",
    "expert_weights",
    "group_offsets",
    "grouped_fc1_activation",
    "grouped_fc1_unsupported_reason",
    "grouped_mm_name",
    "mlp_parts_replaced",
    "restack_experts_",
    "row_chunks",
    "shared_offsets",
    "stack_parameters_",
    "stacked_view",
    "stacked_weights",
    "swiglu_fc1_chunks",
    "swiglu_fc1_split",
    "swiglu_in_place_applies",
    "swiglu_probs_in_place",
]

GROUPED_ACTIVATIONS = (F.silu, F.gelu)
"""`config.activation_func` values the grouped FC1 path takes (gated: SwiGLU / GeGLU)."""

_refused: dict = {}  # (device type, dtype, K, O) -> the grouped GEMM's error, once it refused


# --------------------------------------------------------------------------------------
# Stacked parameters
# --------------------------------------------------------------------------------------


def _check_same_layout(tensors: Sequence[torch.Tensor], what: str) -> None:
    if len(tensors) == 0:
        raise ValueError(f"{what}: expected at least one tensor, got none")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{i}]: expected a tensor, got {type(t).__name__}")
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if (t.shape, t.dtype, t.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                f"{what}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}; expected "
                f"{tuple(first.shape)} {first.dtype} on {first.device} like {what}[0]"
            )


def stacked_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A zero-copy [L, *shape] view over `tensors`, or None when they are not laid out so.

    The view exists when every tensor is contiguous, all live in one storage, and tensor i
    starts exactly i * numel elements after tensor 0 (checked on `data_ptr()`s). It is then
    contiguous: strides (numel, *tensors[0].stride()); e.g. FC2 weights [H, F] give
    [L, H, F] with strides (H * F, F, 1). The view is detached (no autograd history).

    Args:
        tensors: L >= 1 tensors of equal shape, dtype and device.

    Raises:
        ValueError: empty, or shapes / dtypes / devices differ.
        TypeError: an element is not a tensor.
    """
    _check_same_layout(tensors, "tensors")
    first = tensors[0]
    if first.numel() == 0 or not all(t.is_contiguous() for t in tensors):
        return None
    step_bytes = first.numel() * first.element_size()
    storage_ptr = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if t.untyped_storage().data_ptr() != storage_ptr:
            return None
        if t.data_ptr() != first.data_ptr() + i * step_bytes:
            return None
    shape = (len(tensors), *first.shape)
    strides = (first.numel(), *first.stride())
    return first.detach().as_strided(shape, strides, first.storage_offset())


def stack_parameters_(params: Sequence[torch.nn.Parameter]) -> bool:
    """Re-home `params` into one contiguous [L, *shape] storage, in place.

    After the call `stacked_view(params)` is not None. Values, `Parameter` objects, their
    attributes and `requires_grad` are unchanged; only `.data` moves (one copy, so the
    expert weights briefly take twice their memory). Already stacked parameters are left
    alone (no copy).

    Args:
        params: L >= 1 parameters of equal shape, dtype and device.

    Returns:
        True when a copy was made, False when they were stacked already.

    Raises:
        ValueError, TypeError: as `stacked_view`.
    """
    if stacked_view(params) is not None:
        return False
    with torch.no_grad():
        stacked = torch.stack([p.detach() for p in params])
        for i, p in enumerate(params):
            p.data = stacked[i]
    return True


def expert_parts(experts: torch.nn.Module, part: str) -> list:
    """`[getattr(e, part) for e in experts.local_experts]`, read from the modules' own
    registries (`_modules`) where they hold it.

    Every forward asks for the local experts' FC1 / FC2 modules and weights. Through
    `nn.Module.__getattr__` each access costs ~0.7 us of host time (measured on the dev
    CPU, 64 experts as Qwen3-30B-A3B has per rank at EP = 2: 49 us for their `linear_fc1`
    modules, 87 us for those modules' weights); the lookups here take ~5 and ~9 us (one
    comprehension each; v5.9: with `StackedViewCache`'s key, a flag-on forward's weight
    checks at 128 local experts fell from ~172 to ~107 us on the dev CPU, warm).
    Same objects: `nn.Module` attribute access resolves a registered child module or
    parameter from exactly these dicts; anything else (a property, a plain attribute)
    falls back to `getattr`.

    Args:
        experts: a `SequentialMLP` (its `local_experts` is a `ModuleList`).
        part: the name of a child module of each local expert, e.g. "linear_fc1".
    """
    experts_dict = experts.local_experts._modules
    try:  # the common case, in one comprehension (the per-forward host cost)
        return [e._modules[part] for e in experts_dict.values()]
    except (KeyError, AttributeError):
        pass
    out = []
    for e in experts_dict.values():
        child = e._modules.get(part)
        out.append(child if child is not None else getattr(e, part))
    return out


def expert_weights(experts: torch.nn.Module, part: str) -> list:
    """`[getattr(e, part).weight for e in experts.local_experts]` at `expert_parts`'s cost
    (see there): [L] tensors.

    Raises:
        AttributeError: a local expert has no such module, or it has no `weight` (as the
            attribute access would).
    """
    parts = expert_parts(experts, part)
    try:  # the common case, in one comprehension (the per-forward host cost)
        out = [child._parameters["weight"] for child in parts]
        if not any(w is None for w in out):
            return out
    except (KeyError, AttributeError, TypeError):
        pass
    out = []
    for child in parts:
        params = getattr(child, "_parameters", None)
        w = params.get("weight") if isinstance(params, dict) else None
        out.append(w if w is not None else getattr(child, "weight"))
    return out


def restack_experts_(experts: torch.nn.Module) -> None:
    """Re-home the local experts' FC1 and FC2 weights into one storage each, in place
    (`stack_parameters_`; no copy where they are stacked already), after dropping the
    views that `experts.fc1_stack_cache` / `fc2_stack_cache` (`StackedViewCache`, where
    present) keep of the old storage. Experts without weight parameters
    (`skip_weight_param_allocation`) are left alone."""
    for cache in (getattr(experts, "fc1_stack_cache", None),
                  getattr(experts, "fc2_stack_cache", None)):
        if cache is not None:
            cache.clear()
    for part in ("linear_fc1", "linear_fc2"):
        params = expert_weights(experts, part)
        if all(isinstance(p, torch.nn.Parameter) for p in params):
            stack_parameters_(params)


def _autograd_recording(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def stacked_weights(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The [L, *shape] stack of `tensors`, zero-copy where possible.

    Returns:
        (stack, how): how = "view" (`stacked_view`, no copy; only while autograd is not
        recording for these tensors, since the view has no gradient path to tensors 1..L-1)
        or "stack" (`torch.stack`, a contiguous copy, differentiable). Either way the result
        is contiguous.

    Raises:
        ValueError, TypeError: as `stacked_view`.
    """
    if not _autograd_recording(tensors):
        view = stacked_view(tensors)
        if view is not None:
            return view, "view"
    else:
        _check_same_layout(tensors, "tensors")
    return torch.stack(list(tensors)), "stack"


# --------------------------------------------------------------------------------------
# Grouped GEMM
# --------------------------------------------------------------------------------------


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None)
    if fn is not None:
        return fn, "torch.nn.functional.grouped_mm"
    fn = getattr(torch, "_grouped_mm", None)
    if fn is not None:
        return fn, "torch._grouped_mm"
    return None, "loop"


def grouped_mm_name() -> str:
    """Which grouped GEMM this torch has: "torch.nn.functional.grouped_mm",
    "torch._grouped_mm", or "loop" (neither: one matmul per expert)."""
    return _grouped_mm_fn()[1]


def expert_counts(tokens_per_expert: torch.Tensor | Sequence[int], num_experts: int,
                  num_rows: int) -> list[int]:
    """`tokens_per_expert` as a list of ints (a tensor read to the host once), checked.

    Raises:
        ValueError: not `num_experts` non-negative counts summing to `num_rows`.
    """
    if isinstance(tokens_per_expert, torch.Tensor):
        counts = [int(c) for c in tokens_per_expert.tolist()]
    else:
        counts = [int(c) for c in tokens_per_expert]
    if len(counts) != num_experts or any(c < 0 for c in counts) or sum(counts) != num_rows:
        raise ValueError(
            f"tokens_per_expert={counts}: expected {num_experts} non-negative counts summing "
            f"to the {num_rows} rows of x"
        )
    return counts


def group_offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """[L] int32 running sums of `counts` on `device` (one host-to-device copy): the `offs`
    operand of torch's grouped GEMM, for `expert_matmul(..., offsets=...)` when several
    grouped GEMMs of one forward share the same rows per expert (FC1's two halves, FC2)."""
    offs = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    return offs.to(device, non_blocking=True)


def shared_offsets(counts: Sequence[int], x: torch.Tensor) -> torch.Tensor | None:
    """`group_offsets(counts, x.device)` where `expert_matmul` of x's rows will run torch's
    grouped GEMM (it exists, there are rows, and it has not refused x's dtype and width
    before), else None: one upload for every grouped GEMM of a forward over these counts."""
    if x.shape[0] == 0 or _grouped_mm_fn()[0] is None:
        return None
    if any(key[:3] == (x.device.type, x.dtype, x.shape[1]) for key in _refused):
        return None
    return group_offsets(counts, x.device)


def expert_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, str]:
    """y = x_l @ weight[l]^T for each expert l's block of rows, as one grouped GEMM.

    Args:
        x: [N, K] rows grouped by expert (expert 0's rows first), any float dtype.
        weight: [L, O, K] per-expert weights in Megatron's [out, in] layout, x's dtype and
            device (e.g. stacked `linear_fc1.weight`s, O = I, K = H).
        tokens_per_expert: [L] rows of each expert (tensor or sequence of ints), sum N.
        offsets: `group_offsets(tokens_per_expert, x.device)` made earlier in the same
            forward (saves its host-to-device copy), or None to make them here. Only the
            grouped GEMM reads them; they must be of these counts (not checked
            element-wise: that would need the device values).

    Returns:
        (y [N, O] in x's dtype, impl): impl names what ran: `grouped_mm_name()`, or "loop"
        (one matmul per expert) where torch has no grouped GEMM or refused this device /
        dtype / alignment (warned once per device type, dtype and K, O).

    Raises:
        ValueError: shapes disagree, the counts do not sum to N, or offsets is not an [L]
            int32 tensor on x's device.
        TypeError: dtypes or devices differ.
    """
    if offsets is not None and (offsets.shape != (weight.shape[0],)
                                or offsets.dtype != torch.int32 or offsets.device != x.device):
        raise ValueError(f"offsets is {tuple(offsets.shape)} {offsets.dtype} on "
                         f"{offsets.device}; expected ({weight.shape[0]},) int32 on {x.device} "
                         "(group_offsets of the counts)")
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise ValueError(
            f"x must be [N, K] and weight [L, O, K]; got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}"
        )
    if x.dtype != weight.dtype or x.device != weight.device:
        raise TypeError(
            f"x is {x.dtype} on {x.device} but weight is {weight.dtype} on {weight.device}"
        )
    num_experts = weight.shape[0]
    counts = expert_counts(tokens_per_expert, num_experts, x.shape[0])
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[1]), "none (no rows)"
    fn, name = _grouped_mm_fn()
    key = (x.device.type, x.dtype, x.shape[1], weight.shape[1])  # refusals: dtype/alignment
    if fn is not None and key not in _refused:
        if offsets is None:
            with span("grouped_mm.offsets"):
                offsets = group_offsets(counts, x.device)
        try:
            with span("grouped_mm.call"):
                return fn(x, weight.transpose(1, 2), offs=offsets), name
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            # torch's checks (dtype, alignment, architecture) raise before any work is queued
            _refused[key] = str(err)
            warnings.warn(
                f"{name} refused {x.dtype} on {x.device.type} ({err}); the expert GEMMs run "
                "one matmul per expert there",
                stacklevel=2,
            )
    blocks = torch.split(x, counts)
    return torch.cat([block @ weight[i].t() for i, block in enumerate(blocks)]), "loop"


# --------------------------------------------------------------------------------------
# FC1 + activation of all local experts at once
# --------------------------------------------------------------------------------------


class _Passthrough(torch.nn.Module):
    """Stands in for an MLP's `linear_fc1` / `linear_fc2`: returns its input and no bias."""

    def forward(self, x: torch.Tensor):
        return x, None


@contextlib.contextmanager
def mlp_parts_replaced(mlps: Sequence[MLP], *, fc1: bool = False,
                       fc2: bool = False) -> Iterator[None]:
    """Within the block, the chosen linear layers of each MLP return their input unchanged.

    With fc2=True, `MLP.forward` stops after the activation (and the router probabilities);
    with fc1=True as well, it applies only the activation to a precomputed FC1 output.
    Reusing Megatron's own `MLP.forward` (mlp.py:257) rather than a copy of its activation
    code keeps every activation variant (GLU, clamps, offsets, fused kernels, per-token
    probs and their dtype handling) exactly as with the flag off.
    """
    names = [n for n, on in (("linear_fc1", fc1), ("linear_fc2", fc2)) if on]
    saved = [{n: m._modules[n] for n in names} for m in mlps]
    try:
        for m in mlps:
            for n in names:
                m._modules[n] = _Passthrough()
        yield
    finally:
        for m, parts in zip(mlps, saved):
            m._modules.update(parts)


def swiglu_in_place_applies(config) -> bool:
    """Whether `swiglu_probs_in_place` computes what Megatron's unfused `MLP.forward`
    (mlp.py:317-340) does for this config: SwiGLU (`gated_linear_unit`, `F.silu`) through
    Megatron's torch ops (no `bias_activation_fusion`, no Transformer Engine activation), no
    clamp (`activation_func_clamp_value`) and no `glu_linear_offset`. Every other config
    runs Megatron's own `MLP.forward`."""
    return (bool(getattr(config, "gated_linear_unit", False))
            and config.activation_func is F.silu
            and not getattr(config, "bias_activation_fusion", False)
            and not getattr(config, "use_te_activation_func", False)
            and getattr(config, "activation_func_clamp_value", None) is None
            and getattr(config, "glu_linear_offset", 0.0) == 0.0)


def swiglu_probs_in_place(fc1: torch.Tensor, probs: torch.Tensor,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU and the router-probability scale of Megatron's unfused `MLP.forward`, with the
    same operations and roundings, computed in FC1's output.

    Megatron: `x_glu, x_lin = chunk(fc1, 2)`; `silu(x_glu) * (x_lin + 0.0)` (two new
    [n, F] tensors and their product), `* probs[:, None]` (an fp32 [n, F] for fp32 probs),
    `.to(fc1.dtype)`: up to 3 [n, F] held at once besides FC1's [n, 2F] (5 with it), ~13
    [n, F] of memory traffic and 5 launches for bf16 FC1 and fp32 probs. Here: `silu` in
    place in x_glu, `x_glu *= x_lin`, then one `torch.mul` with `out=` in fc1's dtype
    (computed in the promoted dtype, rounded once on the store, as `.to` rounds): one new
    [n, F], ~7 [n, F] of traffic, 3 launches. Equal values (tested against `MLP.forward` in
    fp32 and bf16); an exact zero may differ in sign, as Megatron's `x_lin + 0.0` turns
    -0.0 into +0.0 first.

    Args:
        fc1: [..., 2F] FC1 output (overwritten; autograd must not record it).
        probs: [...] router probabilities (autograd must not record them either: `out=`
            has no gradient; `grouped_fc1_activation` then takes `MLP.forward`).
        out: where to write the result ([..., F], fc1's dtype and device; e.g. a block of
            rows of a larger output), or None for a new tensor.

    Returns:
        [..., F] in fc1's dtype: `out` when given.

    Raises:
        ValueError: `out` has another shape, dtype or device.
    """
    half = fc1.shape[-1] // 2
    shape = (*fc1.shape[:-1], half)
    if out is None:
        out = torch.empty(shape, dtype=fc1.dtype, device=fc1.device)
    elif out.shape != shape or out.dtype != fc1.dtype or out.device != fc1.device:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected "
                         f"{shape} {fc1.dtype} on {fc1.device} (fc1's rows, half its width)")
    return _swiglu_probs_(fc1[..., :half], fc1[..., half:], probs, out)


def _swiglu_probs_(x_glu: torch.Tensor, x_lin: torch.Tensor, probs: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """out = silu(x_glu) * x_lin * probs[..., None] with Megatron's roundings; x_glu is
    overwritten, out may be x_glu itself."""
    F.silu(x_glu, inplace=True)
    x_glu.mul_(x_lin)
    return torch.mul(x_glu, probs.unsqueeze(-1), out=out)


def grouped_fc1_unsupported_reason(experts: torch.nn.Module,
                                   x: torch.Tensor | None = None) -> str | None:
    """Why `grouped_fc1_activation` cannot stand in for the experts' FC1 loop, or None.

    Supported: a `SequentialMLP` with >= 2 local experts whose `linear_fc1` are Megatron
    `ColumnParallelLinear`s without bias and without GTP sharding, `activation_func` F.silu
    or F.gelu (gated or not) computed by Megatron's torch code (not TE's), no fp8/fp4, no
    `moe_apply_probs_on_input`, and autograd not recording (the grouped path is for
    inference / prefill; training keeps Megatron's per-expert loop and its backward).

    Args:
        experts: a `SequentialMLP` (or subclass).
        x: the rows about to go through FC1 (for the autograd check), if known.
    """
    return fc1_structural_reason(experts) or autograd_reason(experts, x)


def cached_fc1_reason(experts: torch.nn.Module, x: torch.Tensor | None = None) -> str | None:
    """`grouped_fc1_unsupported_reason(experts, x)` with its structural part remembered on
    `experts` (attribute `_fc1_check`) per set of `linear_fc1` modules (compared by
    identity, so no id can be reused meanwhile): that part loops over every expert, once
    per forward on the host's critical path otherwise. The autograd part, which changes
    with the caller's grad mode, is asked every time."""
    key = tuple(expert_parts(experts, "linear_fc1"))
    cached = getattr(experts, "_fc1_check", None)
    if cached is None or cached[0] != key:
        cached = (key, fc1_structural_reason(experts))
        experts._fc1_check = cached
    return cached[1] or autograd_reason(experts, x)


def fc1_structural_reason(experts: torch.nn.Module) -> str | None:
    """The part of `grouped_fc1_unsupported_reason` that depends only on the config and the
    modules (not on the grad mode)."""
    config = experts.config
    mlps = list(experts.local_experts)
    if len(mlps) < 2:
        return "one local expert (its FC1 is one GEMM already)"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "fp8/fp4 experts"
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input"
    if getattr(config, "use_te_activation_func", False):
        return "use_te_activation_func (Transformer Engine activation module)"
    if config.activation_func not in GROUPED_ACTIVATIONS:
        name = getattr(config.activation_func, "__name__", repr(config.activation_func))
        return f"activation_func {name} (grouped FC1 supports silu/swiglu and gelu)"
    for i, mlp in enumerate(mlps):
        fc1 = mlp.linear_fc1
        if type(fc1) is not ColumnParallelLinear:
            return f"local expert {i}'s linear_fc1 is {type(fc1).__name__}, not ColumnParallelLinear"
        if fc1.weight is None or getattr(fc1, "bias", None) is not None:
            return f"local expert {i}'s linear_fc1 has no weight parameter or has a bias"
        if getattr(fc1, "gtp_remat_size", 1) > 1:
            return f"local expert {i}'s linear_fc1 is GTP-sharded"
    return None


def autograd_reason(experts: torch.nn.Module, x: torch.Tensor | None = None) -> str | None:
    """The autograd part of `grouped_fc1_unsupported_reason` (the rest,
    `fc1_structural_reason`, depends only on the config and the modules, so callers may
    cache it: `cached_fc1_reason`): a reason while autograd records for the FC1 weights or
    x, else None."""
    if not torch.is_grad_enabled():
        return None
    params = expert_weights(experts, "linear_fc1")
    if _autograd_recording(params + ([x] if x is not None else [])):
        return "autograd is recording (training keeps Megatron's per-expert loop)"
    return None


_DATA_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_STRIDE = torch.Tensor.stride


class StackedViewCache:
    """`stacked_weights` for a list of tensors that is asked for every forward, with the
    zero-copy view remembered while no tensor moves.

    The stacking check (`stacked_view`) looks at every tensor's storage (~5 us each: 0.3 ms
    for 64 experts, on the host, every forward). A hit needs each tensor's `data_ptr()`,
    shape, strides and dtype unchanged (a view of other strides, shape or dtype put in
    place at the same address, e.g. `p.data = p.data.t()`, misses). That is sound: the
    remembered view keeps the old storage
    alive, so a re-pointed tensor cannot reappear at its old address. Only views are
    remembered ("stack" copies are redone each call); `clear()` drops the view (and the
    storage it keeps alive), e.g. after the parameters were re-homed.
    """

    def __init__(self) -> None:
        self._key = None
        self._view: torch.Tensor | None = None

    def clear(self) -> None:
        self._key = self._view = None

    def get(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, str]:
        """Same result as `stacked_weights(tensors)`."""
        if _autograd_recording(tensors):
            self.clear()
            return stacked_weights(tensors)
        # each tensor's address, shape, strides and dtype (as four tuples: fewer objects
        # per forward than a tuple per tensor)
        key = (tuple(map(_DATA_PTR, tensors)), tuple(map(_SHAPE, tensors)),
               tuple(map(_STRIDE, tensors)), tuple(map(_DTYPE, tensors)))
        if key == self._key and self._view is not None:
            return self._view, "view"
        stack, how = stacked_weights(tensors)
        if how == "view":
            self._key, self._view = key, stack
        else:
            self.clear()
        return stack, how


def row_chunks(counts: Sequence[int], row_bytes: int, budget: int):
    """The rows of all experts (grouped by expert, as `counts` says) in the fewest chunks of
    consecutive rows of at most `budget` bytes of output each (at least one row a chunk),
    their sizes differing by at most one row.

    Args:
        counts: [L] rows per expert, >= 0.
        row_bytes: output bytes of one row (> 0).
        budget: the largest output of one chunk, in bytes.

    Returns:
        [(row0, row1, first expert, end expert, [rows of each expert in the chunk])], in row
        order; an expert may span two chunks. No rows: one chunk of 0 rows over all experts
        (what `expert_matmul` takes for an empty batch).
    """
    counts = [int(c) for c in counts]
    total = sum(counts)
    if total == 0:
        return [(0, 0, 0, len(counts), counts)]
    cap = max(1, budget // max(row_bytes, 1))  # rows a chunk may hold
    n = -(-total // cap)
    base, extra = divmod(total, n)  # n near-equal sizes, each <= cap
    ends = list(itertools.accumulate(counts))
    starts = [e - c for e, c in zip(ends, counts)]
    chunks, row0 = [], 0
    for i in range(n):
        row1 = row0 + base + (i < extra)
        first = bisect.bisect_right(ends, row0)   # the first expert ending after row0
        end = bisect.bisect_left(starts, row1)    # experts that start before row1
        chunk_counts = [min(ends[e], row1) - max(starts[e], row0) for e in range(first, end)]
        chunks.append((row0, row1, first, end, chunk_counts))
        row0 = row1
    return chunks


def _whole(chunks, counts: Sequence[int]):
    """`row_chunks`' chunks, with a single chunk (all rows) widened to every expert: the same
    product (an expert without rows adds none) whose grouped GEMM takes the offsets of all
    the counts (`row_chunks` starts a chunk at the first expert with rows and ends it after
    the last). Returns (chunks, whether it is that one chunk)."""
    if len(chunks) != 1:
        return chunks, False
    row0, row1 = chunks[0][:2]
    return [(row0, row1, 0, len(counts), list(counts))], True


def swiglu_fc1_chunks(x: torch.Tensor, w1: torch.Tensor, chunks, probs: torch.Tensor
                      ) -> tuple[torch.Tensor, str]:
    """FC1 of every chunk of rows (`row_chunks`) as one grouped GEMM each, then
    `swiglu_probs_in_place` into the chunk's rows of one [N, F] output allocated first:
    the peak is [N, F] plus one chunk's [rows, 2F] FC1 output (no concatenation). The
    grouped FC1 runs `swiglu_fc1_split` instead (the same peak at the same budget with half
    as many chunks and only half the FLOPs chunked; faster on the GPU, docs/perf_notes.md
    v4.9); this one stays for launch/bench_fc1.py's comparison.

    Args:
        x: [N, H] rows grouped by local expert.
        w1: [L, 2F, H] stacked FC1 weights (x's dtype and device).
        chunks: `row_chunks(counts, 2F * x.element_size(), budget)` of the rows.
        probs: [N] router probability of each row (autograd must not record it).

    Returns:
        ([N, F] in x's dtype, the last chunk's `expert_matmul` impl).
    """
    h = x.new_empty(x.shape[0], w1.shape[1] // 2)
    impl = "none (no rows)"
    for row0, row1, first, end, chunk_counts in chunks:
        fc1, impl = expert_matmul(x[row0:row1], w1[first:end], chunk_counts)
        swiglu_probs_in_place(fc1, probs[row0:row1], out=h[row0:row1])
        del fc1
    return h, impl


def swiglu_fc1_split(x: torch.Tensor, w1: torch.Tensor, counts: Sequence[int],
                     probs: torch.Tensor, budget: int,
                     offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, str, int]:
    """FC1 + SwiGLU x probs with FC1's two halves as separate grouped GEMMs: the gate half
    (`w1[:, :F]`, what Megatron's `chunk(fc1, 2)` calls x_glu) for all rows at once, straight
    into the [N, F] output; then the linear half (`w1[:, F:]`) in chunks of rows
    (`row_chunks`, at most `budget` bytes of [rows, F] each), each chunk's SwiGLU and
    probability scale computed in place in the output's rows (`swiglu_probs_in_place`'s
    operations and roundings). Peak: [N, F] plus one chunk's [rows, F] (with torch's grouped
    GEMM; its per-expert loop fallback concatenates, 2 [N, F] for a moment); only the
    linear half's GEMM runs in chunks.

    Args:
        x: [N, H] rows grouped by local expert.
        w1: [L, 2F, H] stacked FC1 weights (x's dtype and device).
        counts: [L] rows per local expert (sum N).
        probs: [N] router probability of each row (autograd must not record it).
        budget: the largest [rows, F] chunk of the linear half, in bytes.
        offsets: `group_offsets(counts, x.device)` if the caller has them, else None: made
            here (`shared_offsets`) and used by the gate half and, where it runs in one chunk,
            the linear half (one upload instead of two).

    Returns:
        ([N, F] in x's dtype, the last `expert_matmul` impl, the number of chunks).
    """
    half = w1.shape[1] // 2
    if offsets is None:
        with span("grouped_mm.offsets"):
            offsets = shared_offsets(counts, x)
    with span("fc1.gate_half"):
        h, impl = expert_matmul(x, w1[:, :half], counts, offsets)
    # one chunk: over every expert, with the gate half's offsets
    chunks, whole = _whole(row_chunks(counts, half * x.element_size(), budget), counts)
    for row0, row1, first, end, chunk_counts in chunks:
        with span("fc1.linear_half"):
            x_lin, impl = expert_matmul(x[row0:row1], w1[first:end, half:], chunk_counts,
                                        offsets if whole else None)
        with span("fc1.swiglu"):
            rows = h[row0:row1]
            _swiglu_probs_(rows, x_lin, probs[row0:row1], rows)
        del x_lin
    return h, impl, len(chunks)


def grouped_fc1_activation(
    experts: torch.nn.Module,
    x: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    probs: torch.Tensor,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, str]:
    """FC1 of all local experts as grouped GEMMs, then Megatron's activation and probs.

    Equals `SequentialMLP.forward` stopped before FC2 (within the GEMM's rounding: grouped
    GEMMs instead of L matmuls, both accumulating in fp32), because everything after FC1 in
    `MLP.forward` is row-wise: the activation (GLU chunks the last dim) and the per-row
    probability scale run over all N rows at once.

    * Megatron's unfused SwiGLU (`swiglu_in_place_applies`; autograd not recording probs):
      `swiglu_fc1_split`, FC1's gate half as one grouped GEMM straight into the [N, F]
      output, its linear half in chunks of rows of at most `fc1_chunk_bytes()` of [rows, F]
      (128 MiB unless $MEGATRON_OVERLAP_FC1_CHUNK_MB says otherwise), each chunk's SwiGLU
      and probability scale in place (`swiglu_probs_in_place`'s operations and roundings).
      Peak: [N, F] plus one chunk.
    * Otherwise expert 0's own `MLP.forward` with FC1 and FC2 passed through
      (`mlp_parts_replaced`), on chunks of as many rows (`row_chunks`: at most
      `fc1_chunk_bytes()` of [rows, F], F = I / 2 with a GLU): a chunk's transient (its
      [rows, I] FC1 output and up to 3 x [rows, F] of Megatron's unfused GLU with probs)
      comes on top of the earlier chunks' outputs, and their concatenation holds [N, F]
      twice at the end.

    Args:
        experts: a `SequentialMLP` for which `grouped_fc1_unsupported_reason` is None.
        x: [N, H] rows grouped by local expert.
        tokens_per_expert: [L] rows per local expert.
        probs: [N] router probability of each row.
        offsets: `group_offsets` of the counts on x's device, if the caller made them for
            other grouped GEMMs of the same rows (the `off-grouped` baseline's FC2), else
            None (made here once, `shared_offsets`, for every grouped GEMM over all rows).

    Returns:
        ([N, F] activations with probs applied, x's dtype; what ran the GEMMs:
        "grouped FC1: <impl>" with impl from `expert_matmul`, plus ", weights view|stack",
        then ", SwiGLU in place" and ", linear half in <n> row chunks" (n > 1) for the
        split SwiGLU, or ", <n> row chunks" (n > 1) through `MLP.forward`).

    Raises:
        ValueError: $MEGATRON_OVERLAP_FC1_CHUNK_MB is not a number > 0.
    """
    with span("fc1.weights"):
        mlps = list(experts.local_experts)
        fc1_weights = expert_weights(experts, "linear_fc1")
        cache = getattr(experts, "fc1_stack_cache", None)
        w1, how = (cache.get(fc1_weights) if cache is not None
                   else stacked_weights(fc1_weights))
    with span("fc1.counts"):
        counts = expert_counts(tokens_per_expert, len(mlps), x.shape[0])
    # FC1's output in chunks of at most fc1_chunk_bytes(): the [N, I] FC1 output of all
    # rows at once would be a peak the per-expert loop never has.
    # (probs recorded by autograd, e.g. a trainable router with frozen experts: Megatron's
    # MLP.forward keeps their gradient, an out= product would refuse)
    in_place = (swiglu_in_place_applies(experts.config)
                and not (torch.is_grad_enabled() and probs.requires_grad))
    if in_place:
        h, impl, n = swiglu_fc1_split(x, w1, counts, probs, fc1_chunk_bytes(), offsets)
        split = f", linear half in {n} row chunks" if n > 1 else ""
        return h, f"grouped FC1: {impl}, weights {how}, SwiGLU in place{split}"
    # Megatron's MLP.forward (expert 0's, FC1 / FC2 passed through) on each chunk of rows;
    # chunks of as many rows as the split SwiGLU's: at most fc1_chunk_bytes() of [rows, F]
    # (F = the activation's width: I / 2 with a GLU)
    width = w1.shape[1] // 2 if experts.config.gated_linear_unit else w1.shape[1]
    chunks, whole = _whole(row_chunks(counts, width * x.element_size(), fc1_chunk_bytes()),
                           counts)
    if whole and offsets is None:
        with span("grouped_mm.offsets"):
            offsets = shared_offsets(counts, x)
    outs, impl = [], "none (no rows)"
    for row0, row1, first, end, chunk_counts in chunks:
        fc1, impl = expert_matmul(x[row0:row1], w1[first:end], chunk_counts,
                                  offsets if whole else None)
        with mlp_parts_replaced(mlps[:1], fc1=True, fc2=True):
            # not __call__: expert 0's hooks stay quiet
            out, bias = mlps[0].forward(fc1, probs[row0:row1])
        assert bias is None
        del fc1
        outs.append(out)
    h = outs[0] if len(outs) == 1 else torch.cat(outs)
    split = f", {len(chunks)} row chunks" if len(chunks) > 1 else ""
    return h, f"grouped FC1: {impl}, weights {how}{split}"
