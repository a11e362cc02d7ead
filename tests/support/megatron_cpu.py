"""Run real Megatron-Core (0.19) MoE modules on CPU processes joined by gloo. Tests only.

Megatron-Core assumes CUDA in a handful of places that are not about the math. The
patches below make exactly those places work on a CPU-only torch with the gloo backend, so
that stock Megatron modules (and our subclasses of them) run unchanged in CI. They follow
/work/shared/MEGATRON_NOTES.md, "Running it on a CPU with gloo"; each names the Megatron
file:line (megatron-core 0.19.2, paths below ``megatron/core/``) it addresses.

Every patch is made where Megatron looks the name up, and nowhere else:

* ``torch.cuda.*`` (streams, events, ``current_device()`` used as a device): Megatron code
  spells these ``torch.cuda.X`` through its module-global ``torch``. Each affected Megatron
  module gets a *view* of torch as its global ``torch``, identical to torch except for
  ``torch.cuda``, whose ``Stream``/``Event``/``current_stream``/``stream``/``synchronize``
  are no-ops and ``current_device()`` is ``"cpu"``. torch itself, and every other module
  (ours included), still see the real ``torch.cuda``.
* functions (``all_to_all``, ``_gather_along_first_dim``, ``get_default_causal_mask``) are
  replaced in their defining module and in every loaded ``megatron`` module that bound the
  same function object with ``from x import f``.
* the torch-norm refusal is a class attribute (``WrappedTorchNorm.__new__``).

The CUDA RNG tracker is not patched: `init_parallel_state` seeds with Megatron's own
inference RNG tracker, whose ``fork()`` is a no-op context and which never touches the
CUDA generator (tensor_parallel/random.py:391-406).

Also here: `init_expert_weights`, because Megatron's CPU initialisation gives expert j of
*every* EP rank the same weights (each rank draws its local experts from the same point of
the CPU generator), which would hide a token sent to the wrong EP rank; and the TP layout
helpers `shard_weight` / `full_weight`.

Usage (inside a rank started by `tests.support.dist.run_distributed`)::

    apply_cpu_patches()
    with parallel_state(tp=2, ep=2, seed=1234) as layout:  # or init_/destroy_parallel_state
        layer = get_moe_module_spec(use_te=False, num_experts=8)(config=config)
        init_expert_weights(layer, seed=1234, std=0.2)
        out, _ = layer(x)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "CUDA_VIEW_MODULES",
    "ParallelLayout",
    "apply_cpu_patches",
    "cpu_patches_applied",
    "destroy_parallel_state",
    "draw_expert_weights",
    "full_weight",
    "init_expert_weights",
    "allow_sequence_parallel_torch_norm",
    "init_parallel_state",
    "parallel_state",
    "shard_weight",
]

# --------------------------------------------------------------------------------------
# torch.cuda as Megatron sees it on a CPU machine
# --------------------------------------------------------------------------------------


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` / the current stream: ordering is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if isinstance(event, _NullEvent) else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is already complete when recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def wait(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NullStream()


class _CudaView(types.ModuleType):
    """``torch.cuda`` with stream/event/synchronize no-ops and ``current_device() == "cpu"``.

    Any other attribute is the real ``torch.cuda`` one (``is_available()`` stays False).
    """

    Stream = _NullStream
    Event = _NullEvent

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda as seen by CPU-patched Megatron modules")

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        del device
        return _CURRENT_STREAM

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager[None]:
        del stream
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        del device

    @staticmethod
    def current_device() -> str:
        # Megatron uses it as a device argument (device=torch.cuda.current_device()).
        return "cpu"

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchView(types.ModuleType):
    """The ``torch`` module, except that ``.cuda`` is a `_CudaView`."""

    def __init__(self) -> None:
        super().__init__("torch", "torch as seen by CPU-patched Megatron modules")
        self.cuda = _CudaView()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_VIEW = _TorchView()

#: Megatron modules (under ``megatron.core.``) that get the torch view as their ``torch``,
#: each with the 0.19.2 lines that need it.
CUDA_VIEW_MODULES: dict[str, str] = {
    # torch.cuda.Stream() for the count D2H copy, then current_stream/stream around it.
    "transformer.moe.token_dispatcher": "token_dispatcher.py:469, 922-925",
    # self.weight.data.to(device=torch.cuda.current_device()) in gating().
    "transformer.moe.router": "router.py:98, 100",
    # torch.empty(..., device=torch.cuda.current_device()) for gather/scatter/a2a outputs.
    "tensor_parallel.mappings": "mappings.py:95, 145, 152, 185, 447",
    # backward of the TP linears: sequence-parallel reduce-scatter output (647) and the
    # gradient-accumulation-fusion dummy wgrad (708, 718), device=torch.cuda.current_device().
    "tensor_parallel.layers": "layers.py:647, 708, 718",
    # RotaryEmbedding.get_emb: device=torch.cuda.current_device() for the frequencies.
    "models.common.embeddings.rotary_pos_embedding": "rotary_pos_embedding.py:162",
    # GlobalMemoryBuffer.get_tensor: device=torch.cuda.current_device(); used for the
    # sequence-parallel all-gather of the TP linears' input and for the attention scores.
    "utils": "utils.py:715",
}

# --------------------------------------------------------------------------------------
# Function replacements
# --------------------------------------------------------------------------------------


def _all_to_all_with_list_splits(original: Callable[..., Any]) -> Callable[..., Any]:
    """mappings.all_to_all (mappings.py:558) taking split sizes as lists.

    The alltoall dispatcher keeps its split counts as CPU tensors on a CPU run (moe_utils.py:
    1184 only converts CUDA tensors to numpy), and gloo's ``all_to_all_single`` accepts only
    sequences of ints. The backward re-uses the (now list) splits saved on the autograd ctx.
    """

    def all_to_all(
        group: Any,
        input_: torch.Tensor,
        output_split_sizes_: Any = None,
        input_split_sizes: Any = None,
        use_nccl_stream: bool = False,
    ) -> torch.Tensor:
        return original(
            group,
            input_,
            _as_int_list(output_split_sizes_),
            _as_int_list(input_split_sizes),
            use_nccl_stream,
        )

    return all_to_all


def _as_int_list(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def _gather_along_first_dim_padded(original: Callable[..., Any]) -> Callable[..., Any]:
    """mappings._gather_along_first_dim (mappings.py:118) for unequal sizes on gloo.

    With ``output_split_sizes`` Megatron calls ``torch.distributed.all_gather`` with tensors
    of different sizes (mappings.py:154); gloo's all_gather needs equal sizes. Unequal sizes
    are padded to the largest, gathered, and sliced back; equal sizes take Megatron's path.
    """

    def _gather_along_first_dim(
        input_: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        sizes = None if output_split_sizes is None else [int(s) for s in output_split_sizes]
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return original(input_, group, sizes, use_global_buffer)
        max_rows = max(sizes)
        padded = input_.new_zeros((max_rows, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([part[:rows] for part, rows in zip(gathered, sizes)], dim=0)

    return _gather_along_first_dim


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """transformer/utils.py:37-39 get_default_causal_mask, built on the CPU, not "cuda"."""
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _torch_norm_new_allowing_sp(original_new: Callable[..., Any]) -> Callable[..., Any]:
    """WrappedTorchNorm.__new__ (torch_norm.py:33) accepting ``sequence_parallel=True``.

    torch_norm.py:50 refuses sequence parallel because it cannot tag the norm's parameters
    for the sequence-parallel gradient all-reduce, as TE/apex norms do. The forward math does
    not depend on it: build the norm from a config copy with ``sequence_parallel=False`` and
    set the tag (``param.sequence_parallel = True``) ourselves.
    """

    def __new__(cls: type, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


# --------------------------------------------------------------------------------------
# Applying the patches
# --------------------------------------------------------------------------------------

_applied = False


def cpu_patches_applied() -> bool:
    """Whether `apply_cpu_patches` has run in this process."""
    return _applied


def apply_cpu_patches() -> None:
    """Patch Megatron-Core for CPU processes joined by gloo. Idempotent; process-wide.

    Patches (megatron-core 0.19.2 line numbers, see the module docstring for the rules):

    1. ``torch.cuda`` view in `CUDA_VIEW_MODULES` (token_dispatcher.py:469, 922-925;
       router.py:98; mappings.py:95-185, 447; layers.py:647, 708, 718;
       rotary_pos_embedding.py:162; utils.py:715).
    2. ``all_to_all`` splits -> lists (mappings.py:558, called at token_dispatcher.py:698,
       711, 857; tensors from moe_utils.py:1184 on CPU).
    3. ``_gather_along_first_dim`` pads unequal sizes (mappings.py:154).
    4. ``get_default_causal_mask`` on CPU (transformer/utils.py:39; bound by name in
       fusions/fused_softmax.py:8).
    5. ``WrappedTorchNorm`` allows sequence parallel (transformer/torch_norm.py:50).

    Raises:
        RuntimeError: torch was built with CUDA support and a GPU is visible (these patches
            would hide real device work).
    """
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_patches() is for CPU-only runs, but CUDA is available")

    for name in CUDA_VIEW_MODULES:
        module = importlib.import_module(f"megatron.core.{name}")
        if module.torch is not torch and module.torch is not _TORCH_VIEW:
            raise RuntimeError(f"megatron.core.{name}.torch is not the torch module")
        module.torch = _TORCH_VIEW

    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import utils as transformer_utils

    _replace_function(mappings.all_to_all, _all_to_all_with_list_splits(mappings.all_to_all))
    _replace_function(
        mappings._gather_along_first_dim,
        _gather_along_first_dim_padded(mappings._gather_along_first_dim),
    )
    # fused_softmax binds the name at import; load it so that its copy is replaced too.
    importlib.import_module("megatron.core.fusions.fused_softmax")
    _replace_function(transformer_utils.get_default_causal_mask, _cpu_default_causal_mask)

    allow_sequence_parallel_torch_norm()
    _applied = True


_norm_patched = False


def allow_sequence_parallel_torch_norm() -> None:
    """Let Megatron's torch norm (the fallback without TE/apex) run with sequence parallel.

    Idempotent, CPU or GPU. Without TE or apex, Megatron refuses a GPT layer with TP > 1 and
    sequence parallel (torch_norm.py:50) because it cannot tag the norm's parameters for the
    sequence-parallel gradient all-reduce; the forward pass is unaffected (see
    `_torch_norm_new_allowing_sp`). GPU tests and the prefill launcher (forward only) need it
    on the GPU machines, which have neither TE nor apex.
    """
    global _norm_patched
    if _norm_patched:
        return
    from megatron.core.transformer import torch_norm

    norm_cls = torch_norm.WrappedTorchNorm
    original_new = norm_cls.__dict__["__new__"]
    original_new = getattr(original_new, "__func__", original_new)
    norm_cls.__new__ = staticmethod(_torch_norm_new_allowing_sp(original_new))
    _norm_patched = True


def _replace_function(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    """Rebind every loaded ``megatron`` module attribute that *is* `original`.

    Covers the defining module and every ``from x import f`` copy (modules imported later
    copy the replacement from the defining module).
    """
    replacement.__name__ = original.__name__
    replacement.__qualname__ = original.__qualname__
    replacement.__doc__ = original.__doc__
    replacement.__module__ = original.__module__
    found = False
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("megatron") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)
                found = True
    assert found, f"{original.__module__}.{original.__qualname__} not bound in any module"


# --------------------------------------------------------------------------------------
# Parallel state
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the Megatron layout set up by `init_parallel_state`.

    ``tp_ep_rank`` is the rank in Megatron's expert tensor-and-model-parallel group (the
    group of the alltoall dispatcher's ``tp_ep_group``).
    """

    world_size: int
    rank: int
    tp: int
    ep: int
    dp: int
    tp_rank: int
    ep_rank: int
    etp_rank: int
    dp_rank: int
    tp_ep_rank: int


def init_parallel_state(tp: int, ep: int, *, seed: int) -> ParallelLayout:
    """Initialise Megatron's model-parallel groups and seed the RNGs, CPU-safely.

    Calls ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
    expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)`` (no extra gloo copies
    of the DP groups: the default group is gloo already), then seeds:

    * ``torch.manual_seed(seed)`` on every rank: with ``use_cpu_initialization=True`` Megatron
      builds every full (master) weight from the CPU generator on each rank and keeps its
      shard (tensor_parallel/layers.py:184), so the same seed on all ranks is what makes the
      shards consistent. Seed per-rank *data* with a separate ``torch.Generator``.
    * ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True,
      force_reset_rng=True)``: Megatron's inference RNG tracker has no-op ``add``/``fork``
      (tensor_parallel/random.py:391-406), so nothing reads the CUDA generator; the regular
      tracker calls ``torch.cuda.get_rng_state()`` (random.py:303), which fails on CPU.

    Args:
        tp: tensor- (and expert-tensor-) parallel size.
        ep: expert-parallel size.
        seed: weight-init seed, the same on all ranks.

    Returns:
        This rank's `ParallelLayout`.

    Raises:
        RuntimeError: the default process group is not initialised, or model parallel is
            already initialised (call `destroy_parallel_state` first).
        ValueError: tp or ep < 1, or the world size is not divisible by tp * ep.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        raise RuntimeError("init_parallel_state needs the default process group (gloo) first")
    if ps.model_parallel_is_initialized():
        raise RuntimeError("model parallel is already initialised; call destroy_parallel_state")
    world_size = dist.get_world_size()
    if tp < 1 or ep < 1 or world_size % (tp * ep) != 0:
        raise ValueError(
            f"need tp >= 1, ep >= 1 and world_size % (tp * ep) == 0; got tp={tp}, ep={ep}, "
            f"world_size={world_size}"
        )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    return ParallelLayout(
        world_size=world_size,
        rank=dist.get_rank(),
        tp=tp,
        ep=ep,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_ep_rank=dist.get_rank(group=ps.get_expert_tensor_and_model_parallel_group()),
    )


def destroy_parallel_state() -> None:
    """Undo `init_parallel_state`: forget Megatron's groups and global memory buffer.

    Safe to call when nothing is initialised. The default process group is left alone, and so
    is the RNG tracker (the next `init_parallel_state` replaces it). Megatron does not destroy
    its non-gloo subgroups (parallel_state.py:2506); they stay alive until the process exits.
    """
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


@contextlib.contextmanager
def parallel_state(tp: int, ep: int, *, seed: int) -> Iterator[ParallelLayout]:
    """`init_parallel_state` ... `destroy_parallel_state` as a context manager."""
    layout = init_parallel_state(tp, ep, seed=seed)
    try:
        yield layout
    finally:
        destroy_parallel_state()


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------


def shard_weight(
    full: torch.Tensor, dim: int, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """Rank `rank`'s TP shard of `full`, split as Megatron splits master weights.

    `_initialize_affine_weight_cpu` (tensor_parallel/layers.py:214-219) cuts `full` along
    `dim` into `stride * world_size` equal chunks and gives rank r chunks r, r + world_size,
    ...; gated FC1 uses stride 2 (mlp.py:206), so each rank holds ``[gate_r; up_r]``.

    Raises:
        ValueError: `full.shape[dim]` is not divisible by `stride * world_size`, or `rank`
            is not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if full.shape[dim] % (stride * world_size) != 0:
        raise ValueError(
            f"dim {dim} of shape {tuple(full.shape)} is not divisible by stride * world_size "
            f"= {stride} * {world_size}"
        )
    chunks = full.chunk(stride * world_size, dim=dim)
    return torch.cat(chunks[rank::world_size], dim=dim)


def full_weight(shards: Sequence[torch.Tensor], dim: int | None, stride: int) -> torch.Tensor:
    """Inverse of `shard_weight`: the full weight from all TP shards, in TP-rank order.

    `dim` None means replicated: the shards must be identical (checked exactly) and the
    first is returned.

    Raises:
        ValueError: no shards, or replicated shards that differ.
    """
    if not shards:
        raise ValueError("no shards")
    if dim is None:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ValueError(f"replicated weight differs between TP rank 0 and {rank}")
        return shards[0]
    per_rank = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([chunks[j] for j in range(stride) for chunks in per_rank], dim=dim)


def draw_expert_weights(
    seed: int, expert: int, *, hidden: int, ffn: int, gated: bool, std: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full fp32 weights of global expert `expert`, a function of (seed, expert) only.

    Returns:
        ``fc1_IH`` [I, H] with I = 2F for a gated unit (gate rows first, then up) or F, and
        ``fc2_HF`` [H, F]; normal(0, std).
    """
    generator = torch.Generator().manual_seed(seed * 65_537 + expert)
    fc1_IH = torch.randn(2 * ffn if gated else ffn, hidden, generator=generator) * std
    fc2_HF = torch.randn(hidden, ffn, generator=generator) * std
    return fc1_IH, fc2_HF


def init_expert_weights(layer: torch.nn.Module, *, seed: int, std: float) -> None:
    """Overwrite the local experts of a `MoELayer` with `draw_expert_weights`, sharded.

    Every expert then has distinct weights, and the full weights are the same whatever the
    TP/EP layout (Megatron's CPU init repeats the same experts on every EP rank).

    Args:
        layer: a `MoELayer` whose experts are a `SequentialMLP` (local spec) without biases.
        seed: the same on all ranks.
        std: standard deviation of the weights.

    Raises:
        TypeError: the experts are not a `SequentialMLP` or have biases.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = layer.experts
    if not isinstance(experts, SequentialMLP):
        raise TypeError(f"expected SequentialMLP experts, got {type(experts).__name__}")
    config = layer.config
    etp_rank, etp = experts.tp_group.rank(), experts.tp_group.size()
    for expert, mlp in zip(layer.local_expert_indices, experts.local_experts):
        full = draw_expert_weights(
            seed,
            expert,
            hidden=config.hidden_size,
            ffn=config.moe_ffn_hidden_size,
            gated=config.gated_linear_unit,
            std=std,
        )
        for linear, full_weight_ in zip((mlp.linear_fc1, mlp.linear_fc2), full):
            if getattr(linear, "bias", None) is not None:
                raise TypeError("init_expert_weights does not handle expert biases")
            weight = linear.weight
            shard = shard_weight(
                full_weight_, weight.partition_dim, weight.partition_stride, etp_rank, etp
            )
            with torch.no_grad():
                weight.copy_(shard.to(weight.dtype))
