"""Full-model prefill of a Megatron-Core `GPTModel`: `moe_gatherrs_overlap` off vs on.

Builds two models with identical weights in one process group and times forward-only prefill
of both, alternating, on the same inputs (DESIGN.md section 5, "full-model prefill"):

* flag off: Megatron's stock spec (`megatron.core.models.gpt.gpt_layer_specs.
  get_gpt_decoder_block_spec(config, use_transformer_engine=HAVE_TE)`) with a
  `GatherRSTransformerConfig(moe_gatherrs_overlap=False)`: Megatron's alltoall dispatcher;
* flag on: `megatron_overlap.megatron.specs.get_gpt_decoder_block_spec(config)` with
  `moe_gatherrs_overlap=True`; its weights are the flag-off model's, loaded with
  `load_state_dict(strict=True)` (the parameter names are identical by design, so a strict
  load succeeding is the checkpoint-compatibility check).

For each sequence length it warms both models up, times `--iters` forwards of each
alternating off, on, off, on, ... (so drift hits both), then checks that they agree: the
first MoE layer's output (its input is identical in both models) and the logits, against an
fp32 copy of the flag-off model in bf16 runs (see `judge`, `TOLERANCE`). Rank 0 prints a
table and appends one JSON row per (model, layout, seq, variant) to `--out`. Exit status 1
when flag on and off disagree, 2 on bad arguments.

Usage::

    python3 launch/prefill.py                          # CPU: tiny model, world 1
    torchrun --standalone --nproc_per_node 2 launch/prefill.py --tp 1 --ep 2
    # GPU (docs/gpu.md):
    source scripts/device_setup.sh && torchrun --nproc_per_node 2 launch/prefill.py \\
        --model mixtral-8x7b --num-layers 2 --seq-lengths 4096 --tp 1 --ep 2

Shape symbols: B micro-batch, S sequence length, V vocabulary (padded), V_tp = V / TP.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without `pip install`

SCHEMA = "megatron_overlap.prefill/1"
"""`schema` field of every JSON row; bump when a field changes meaning."""

DEFAULT_OUT = "results/prefill.jsonl"
ATTENTIONS = ("local", "sdpa")
CPU_DEFAULTS = {"model": "tiny", "seq_lengths": [64, 128]}
GPU_DEFAULTS = {"model": "mixtral-8x7b", "seq_lengths": [4096]}

TOLERANCE = {
    # fp32 (CPU default): both paths do the same math; only the order of the top-k and TP/EP
    # partial sums differs (the fused reference path accumulates in fp32, Megatron scatter-adds
    # and reduce-scatters). Reordering n fp32 terms moves a sum by ~n * 2^-24 relative; measured
    # on CPU (tiny and hidden-512 toys, TP/EP 1/2/4, 1-8 layers): <= 5.1e-7.
    "fp32": 1e-5,
    # bf16: the fused path rounds each routed-expert sum once (fp32 accumulate) where Megatron
    # rounds after each bf16 add / partial sum, so outputs differ by a few bf16 roundings (unit
    # roundoff 2^-9) of their largest terms. Measured on the first MoE layer's output (CPU,
    # bf16, hidden 512, top-2 of 8 and top-8 of 32, TP/EP 1-2): 0 at TP = 1 with top-2, else
    # 3.6e-3 .. 7.5e-3. 2^-5 = 3.1e-2 (8 roundings) leaves 4x margin while a missing top-k term
    # (0.73), a 10 % scale error (0.10) or one wrong row (0.60) fails.
    "bf16": 2.0**-5,
}
"""Largest accepted max|on - off| / max|off|, by compute dtype, for the first MoE layer's
output, and for the logits when there is no fp32 reference (`--reference none`); also the
per-token bound of `tokens_over_tol`."""

BF16_ERROR_RATIO = 2.0
BF16_ERROR_FLOOR = 2.0**-12
"""bf16 logits with `--reference fp32`: flag on agrees when ||on - ref||_F / ||ref||_F <=
BF16_ERROR_RATIO * ||off - ref||_F / ||ref||_F + BF16_ERROR_FLOOR, ref = the flag-off model in
fp32 on the same weights and inputs ("within 2x the bf16 error of an fp32 reference", STYLE
rule 6). Why not max|on - off| of the logits: after the first MoE layer the two paths' bf16
roundings differ, so the next router sees slightly different inputs, and a token whose k-th
and (k+1)-th expert scores are nearly tied switches experts; its logits then move by O(10 %)
(measured on CPU, bf16, hidden 512, top-2 of 8, TP 2, 2048 tokens: 1 layer 6.6e-3; 2 layers
0.37, with 10 of 2048 tokens over 2^-5; 8 layers 126 tokens). Both paths flip tokens against
fp32 at the same rate, so the ratio stays near 1 for a correct path (measured 0.96-1.11, 1-8
layers, TP/EP 1-2), while a missing top-k term raises it to 11-16 (a 10 % scale error: 1.9-2.7;
the first-MoE-layer check catches that one, and single wrong rows, at any depth). The floor (far
below one bf16 rounding) only keeps a zero reference error from demanding bit equality."""

BF16_NO_REFERENCE_FRO = 2.0**-3
"""bf16 logits without the fp32 reference (`--reference none`, or too little GPU memory for
it): ||on - off||_F / ||off||_F <= 2^-3. Coarse by necessity (routing flips, see above; measured
2.2e-2 .. 2.9e-2 for correct runs of 2-8 layers, 0.5 with a missing top-k term); the
first-MoE-layer check stays exact."""

LAYOUT_HELP = """\
parallel layout (pipeline parallel is 1):
  Megatron splits the world as TP x DP for attention/dense parts and as ETP x EP x EDP for the
  experts, with ETP = TP here. So the world size must be a multiple of TP * EP, and
  DP = world / TP data-parallel replicas each prefill their own sequences (different tokens
  per DP rank, the same tokens on the TP ranks of one DP group). Examples:
    world 2: --tp 1 --ep 2  (DP 2: two sequences, experts split over the two ranks)
             --tp 2 --ep 1  (DP 1: one sequence, heads and expert FFNs split; SP on)
    world 4: --tp 2 --ep 2  (DP 2)   --tp 1 --ep 4  (DP 4)   --tp 4 --ep 1  (DP 1)
  Global tokens per forward = seq * micro-batch * DP (the tokens/s column).
  --sequence-parallel is on by default when TP > 1 (Megatron requires it for training;
  prefill/eval also runs without it: --no-sequence-parallel).
  Heads, query groups and FFN widths must divide by TP, experts by EP (any YAML path works
  for --model).
device: --device auto picks CUDA when available (NCCL, bf16, GPU init), else CPU (gloo,
  fp32, CPU init, tests/support/megatron_cpu.py patches; on GPU only its
  allow_sequence_parallel_torch_norm, with SP, since there is no TE/apex norm there).
output: rank 0 prints a markdown table and appends one JSON row per (model, layout, seq,
  variant) to --out. Exit status: 0 flag on and off agree at every sequence length (see
  judge() in this file), 1 they disagree somewhere, 2 bad arguments.
"""


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (see `--help`)."""
    from megatron_overlap.config import BACKENDS

    parser = argparse.ArgumentParser(
        prog="prefill.py",
        description="Full-model GPTModel prefill, moe_gatherrs_overlap off vs on.",
        epilog=LAYOUT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=None,
        help="name in configs/models or a YAML path (default: tiny on CPU, mixtral-8x7b on GPU)",
    )
    parser.add_argument(
        "--num-layers",
        type=_positive_int,
        default=None,
        help="build this many layers instead of the model's (>= 1, and more "
        "than the model's leading dense layers)",
    )
    parser.add_argument(
        "--seq-lengths",
        type=_positive_int,
        nargs="+",
        default=None,
        help="sequence lengths in tokens (default: 64 128 on CPU, 4096 on GPU)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=_positive_int,
        default=1,
        help="sequences per DP rank per forward (default 1)",
    )
    parser.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor (and expert-tensor) parallel size (default 1)",
    )
    parser.add_argument(
        "--ep", type=_positive_int, default=1, help="expert parallel size (default 1)"
    )
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="sequence parallel (default: on when TP > 1)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="moe_gatherrs_backend of the flag-on model (default auto)",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="params and compute dtype (default: bf16 on GPU, fp32 on CPU)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTIONS,
        default="local",
        help="core attention of both models: 'local' = Megatron's "
        "DotProductAttention (the local spec without TE; materialises "
        "[B, heads/TP, S, S] scores, so S >= 16384 needs TP or 'sdpa'); "
        "'sdpa' = the same module with torch scaled_dot_product_attention "
        "(flash on GPU). Default local",
    )
    parser.add_argument(
        "--reference",
        choices=("auto", "fp32", "none"),
        default="auto",
        help="agreement yardstick for bf16 runs: 'fp32' builds an fp32 copy of the flag-off "
        "model after timing (2x the memory of one bf16 model); 'none' compares on vs off only "
        "(coarser); auto (default) = fp32 when bf16 and it fits in GPU memory, else none",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=2,
        help="untimed forwards of each model per sequence length (default 2)",
    )
    parser.add_argument(
        "--iters",
        type=_positive_int,
        default=10,
        help="timed forwards of each model per sequence length (default 10)",
    )
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"JSONL file the rows are appended to (default {DEFAULT_OUT}; '' = do not write)",
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run (default auto: cuda if available)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="weight-init seed; inputs use seed + DP rank (default 1234)",
    )
    return parser


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The checked command line plus what follows from it and the environment."""

    model: str
    num_layers: int | None
    seq_lengths: tuple[int, ...]
    micro_batch_size: int
    tp: int
    ep: int
    dp: int
    sequence_parallel: bool
    backend: str
    dtype: str
    attention: str
    reference: str
    warmup: int
    iters: int
    out: str
    device: str
    seed: int
    world_size: int


def resolve_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Fill device-dependent defaults and check the layout against the world size.

    Raises:
        ValueError: naming the bad option and value: world size not a multiple of TP * EP,
            `--device cuda` without CUDA, `--device cpu` with CUDA visible (the CPU patches
            refuse that), sequence parallel with TP = 1.
    """
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    if device == "cpu" and torch.cuda.is_available():
        raise ValueError(
            "--device cpu: CUDA is visible; the CPU patches of Megatron refuse to run then "
            "(hide the GPUs with CUDA_VISIBLE_DEVICES= to force a CPU run)"
        )
    defaults = CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS
    if world_size % (args.tp * args.ep):
        raise ValueError(
            f"--tp {args.tp} --ep {args.ep}: world size {world_size} is not a multiple of "
            f"tp * ep = {args.tp * args.ep} (expert layout is ETP=TP x EP x EDP)"
        )
    sp = args.tp > 1 if args.sequence_parallel is None else args.sequence_parallel
    if sp and args.tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1 (got --tp 1)")
    dtype = args.dtype if args.dtype != "auto" else ("fp32" if device == "cpu" else "bf16")
    return RunConfig(
        model=args.model or defaults["model"],
        num_layers=args.num_layers,
        seq_lengths=tuple(args.seq_lengths or defaults["seq_lengths"]),
        micro_batch_size=args.micro_batch_size,
        tp=args.tp,
        ep=args.ep,
        dp=world_size // args.tp,
        sequence_parallel=sp,
        backend=args.backend,
        dtype=dtype,
        attention=args.attention,
        reference=args.reference,
        warmup=args.warmup,
        iters=args.iters,
        out=args.out,
        device=device,
        seed=args.seed,
        world_size=world_size,
    )


def check_shape(shape: Any, run: RunConfig) -> None:
    """Check that the model shape splits over the layout.

    Raises:
        ValueError: heads, query groups or FFN widths not divisible by TP, experts not
            divisible by EP, a sequence length not divisible by TP under sequence parallel,
            or longer than the model's `max_position_embeddings`.
    """
    divisible = (
        ("num_attention_heads", shape.num_attention_heads, "--tp", run.tp),
        ("num_query_groups", shape.num_query_groups, "--tp", run.tp),
        ("ffn_hidden_size", shape.ffn_hidden_size, "--tp", run.tp),
        ("moe_ffn_hidden_size", shape.moe_ffn_hidden_size, "--tp", run.tp),
        ("num_moe_experts", shape.num_moe_experts, "--ep", run.ep),
    )
    for field, value, option, size in divisible:
        if value % size:
            raise ValueError(
                f"{option} {size}: {shape.name}.{field}={value} is not divisible by {size}"
            )
    for seq in run.seq_lengths:
        if run.sequence_parallel and seq % run.tp:
            raise ValueError(
                f"--seq-lengths {seq}: not divisible by --tp {run.tp} (sequence parallel)"
            )
        if seq > shape.max_position_embeddings:
            raise ValueError(
                f"--seq-lengths {seq}: longer than {shape.name}.max_position_embeddings="
                f"{shape.max_position_embeddings}"
            )


# --------------------------------------------------------------------------------------
# Process group and Megatron parallel state
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_launch_env() -> None:
    """Plain `python3 launch/prefill.py` (no torchrun): become rank 0 of a world of 1."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def init_process_group(device: str) -> torch.device:
    """Join the default process group (NCCL on CUDA, gloo on CPU); return this rank's device.

    On CUDA the device is `cuda:LOCAL_RANK`, selected before the group is created.
    """
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank}: only {torch.cuda.device_count()} GPU(s) visible"
            )
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group(backend="gloo")
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This rank's coordinates in Megatron's layout."""

    rank: int
    tp_rank: int
    ep_rank: int
    dp_rank: int


def init_megatron(run: RunConfig) -> Ranks:
    """Create Megatron's model-parallel groups and seed the RNGs (same seed on all ranks).

    CPU: `tests.support.megatron_cpu` patches and `init_parallel_state` (test-support code by
    policy; imported only here). GPU: `initialize_model_parallel` +
    `model_parallel_cuda_manual_seed`, as Megatron-LM's `initialize_megatron` does, and, with
    sequence parallel, `allow_sequence_parallel_torch_norm` (forward-only prefill: Megatron's
    torch norm, its fallback without TE/apex, refuses SP only for the gradient reduction).
    """
    from megatron.core import parallel_state as ps

    if run.device == "cpu":
        from tests.support.megatron_cpu import apply_cpu_patches, init_parallel_state

        apply_cpu_patches()
        init_parallel_state(run.tp, run.ep, seed=run.seed)
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if run.sequence_parallel and run.tp > 1:
            from tests.support.megatron_cpu import allow_sequence_parallel_torch_norm

            allow_sequence_parallel_torch_norm()

        ps.initialize_model_parallel(
            tensor_model_parallel_size=run.tp,
            expert_model_parallel_size=run.ep,
            expert_tensor_parallel_size=run.tp,
            create_gloo_process_groups=False,
        )
        torch.manual_seed(run.seed)  # the router weight is always initialised on the CPU
        model_parallel_cuda_manual_seed(run.seed)
    assert ps.get_data_parallel_world_size() == run.dp, (ps.get_data_parallel_world_size(), run)
    return Ranks(
        rank=dist.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


# --------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: round V up to a multiple of 128 * TP."""
    step = multiple * tp
    return -(-vocab_size // step) * step


def build_config(shape: Any, run: RunConfig, *, flag: bool, dtype: str, initialize: bool):
    """`GatherRSTransformerConfig` for the model shape, layout, flag and dtype.

    Args:
        flag: `moe_gatherrs_overlap`.
        dtype: "bf16" or "fp32", params and compute.
        initialize: `perform_initialization`; only the flag-off model draws weights, the
            others load its state dict.
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.transformer.enums import AttnBackend

    from megatron_overlap.megatron import GatherRSTransformerConfig
    from megatron_overlap.models import transformer_config_kwargs

    bf16 = dtype == "bf16"
    return GatherRSTransformerConfig(
        **transformer_config_kwargs(shape, num_layers=run.num_layers),
        tensor_model_parallel_size=run.tp,
        expert_model_parallel_size=run.ep,
        expert_tensor_parallel_size=run.tp,
        sequence_parallel=run.sequence_parallel,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=run.device == "cpu",
        perform_initialization=initialize,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        # No Transformer Engine: the local spec's DotProductAttention (unfused, torch).
        attention_backend=AttnBackend.auto if HAVE_TE else AttnBackend.local,
        moe_gatherrs_overlap=flag,
        moe_gatherrs_backend=run.backend,
    )


_SDPA_CLASS: list[type] = []


def sdpa_core_attention() -> type:
    """`SDPACoreAttention`: Megatron's `DotProductAttention` computing causal self-attention
    with `torch.nn.functional.scaled_dot_product_attention` (flash/memory-efficient kernels
    on GPU) instead of materialised [B, heads/TP, S, S] scores. Same constructor, no
    parameters (so state dicts are unchanged); made on first use (imports Megatron).
    """
    if _SDPA_CLASS:
        return _SDPA_CLASS[0]
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        """`DotProductAttention.forward` (dot_product_attention.py:142) via torch SDPA.

        Shapes: query [S, B, heads/TP, D], key/value [S, B, groups/TP, D] -> [S, B, heads/TP * D].

        Raises:
            ValueError: anything but plain causal self-attention (explicit mask, bias, packed
                sequences, sliding window, softmax offset, query-key layer scaling).
        """

        def forward(
            self,
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ):
            mask_type = attn_mask_type or self.attn_mask_type
            unsupported = {
                "attention_mask": attention_mask is not None,
                "attention_bias": attention_bias is not None,
                "packed_seq_params": packed_seq_params is not None,
                "attn_mask_type": mask_type != AttnMaskType.causal,
                "window_size": self.config.window_size is not None,
                "softmax_type": self.softmax_offset is not None,
                "apply_query_key_layer_scaling": self.config.apply_query_key_layer_scaling,
            }
            bad = [name for name, flag in unsupported.items() if flag]
            if bad:
                raise ValueError(f"--attention sdpa supports plain causal attention; got {bad}")
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if groups > 1:
                key = key.repeat_interleave(groups, dim=2)
                value = value.repeat_interleave(groups, dim=2)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, D]
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale
            )
            seq, batch = context.shape[2], context.shape[0]
            return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

    _SDPA_CLASS.append(SDPACoreAttention)
    return SDPACoreAttention


def with_core_attention(block_spec: Any, core_attention: type) -> Any:
    """Copy of a `TransformerBlockSubmodules` whose self-attention uses `core_attention`.

    Raises:
        ValueError: a layer spec without `self_attention.submodules.core_attention`.
    """
    layers = []
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if not hasattr(getattr(attention, "submodules", None), "core_attention"):
            raise ValueError(f"--attention: cannot find core_attention in {layer!r}")
        submodules = dataclasses.replace(attention.submodules, core_attention=core_attention)
        attention = dataclasses.replace(attention, submodules=submodules)
        layers.append(
            dataclasses.replace(
                layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
            )
        )
    return dataclasses.replace(block_spec, layer_specs=layers)


def build_gpt(shape: Any, run: RunConfig, *, flag: bool, dtype: str, initialize: bool):
    """One `GPTModel`: Megatron's stock block spec (flag off) or ours (flag on).

    Both use `use_transformer_engine=HAVE_TE` (the local spec on machines without TE), and
    `--attention sdpa` swaps the core attention of both (`with_core_attention`).
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as mc_specs

    from megatron_overlap.megatron import specs
    from megatron_overlap.models import gpt_model_kwargs

    config = build_config(shape, run, flag=flag, dtype=dtype, initialize=initialize)
    make_spec = specs.get_gpt_decoder_block_spec if flag else mc_specs.get_gpt_decoder_block_spec
    spec = make_spec(config, use_transformer_engine=HAVE_TE)
    if run.attention == "sdpa":
        spec = with_core_attention(spec, sdpa_core_attention())
    kwargs = gpt_model_kwargs(shape)
    kwargs["vocab_size"] = padded_vocab_size(shape.vocab_size, run.tp)
    return GPTModel(config=config, transformer_layer_spec=spec, **kwargs)


def copy_weights(source: torch.nn.Module, target: torch.nn.Module, what: str) -> None:
    """`target.load_state_dict(source.state_dict(), strict=True)` (dtype cast on copy).

    Raises:
        RuntimeError: names or shapes differ: for the flag-on model that is a checkpoint-
            compatibility break (its parameter names must be Megatron's).
    """
    try:
        target.load_state_dict(source.state_dict(), strict=True)
    except RuntimeError as err:
        raise RuntimeError(f"{what} does not load the flag-off state dict strictly: {err}") from err


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move to the device (on GPU only the router weight, made on the CPU, moves) and eval()."""
    return model.to(device).eval()


def redraw_cpu_experts(model: torch.nn.Module, seed: int) -> None:
    """CPU only: give every expert distinct weights (`tests.support.megatron_cpu.
    init_expert_weights`, seed + layer number per MoE layer).

    With `use_cpu_initialization` Megatron draws each EP rank's local experts from the same
    CPU seed, so expert e and e + E/EP would be equal, and a row sent to the wrong EP rank
    would go unnoticed. (On GPU the expert-parallel RNG tracker seeds each EP rank apart.)
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tests.support.megatron_cpu import init_expert_weights

    for layer in model.modules():
        if isinstance(layer, MoELayer):
            init_expert_weights(
                layer, seed=seed + layer.layer_number, std=layer.config.init_method_std
            )


def build_models(shape: Any, run: RunConfig, device: torch.device) -> tuple[dict, int]:
    """The flag-off and flag-on `GPTModel`s with identical weights, in eval mode.

    Returns:
        ({"off": model, "on": model}, number of MoE layers of the flag-on model on the fused
        path).

    Raises:
        RuntimeError: the strict state-dict load fails (`copy_weights`), or the flag-on model
            has no MoE layer on the fused path.
    """
    from megatron_overlap.megatron import GatherRSMoELayer

    model_off = build_gpt(shape, run, flag=False, dtype=run.dtype, initialize=True)
    if run.device == "cpu":
        redraw_cpu_experts(model_off, run.seed)
    model_on = build_gpt(shape, run, flag=True, dtype=run.dtype, initialize=False)
    copy_weights(model_off, model_on, "the flag-on model")
    fused = [m for m in model_on.modules() if isinstance(m, GatherRSMoELayer) and m.gatherrs]
    if not fused:
        raise RuntimeError("flag-on model has no MoE layer on the fused path")
    return {"off": to_device(model_off, device), "on": to_device(model_on, device)}, len(fused)


def build_reference(
    shape: Any, run: RunConfig, model_off: torch.nn.Module, device: torch.device
) -> torch.nn.Module:
    """fp32 copy of the flag-off model (Megatron's path), the yardstick for bf16 rounding."""
    model = build_gpt(shape, run, flag=False, dtype="fp32", initialize=False)
    copy_weights(model_off, model, "the fp32 reference model")
    return to_device(model, device)


def fused_forward_count(model: torch.nn.Module) -> int:
    """Fused-op launches so far, summed over the model's flag-on MoE layers (each dispatcher
    counts its resource-manager plans, one per combine)."""
    from megatron_overlap.megatron import GatherRSMoELayer

    return sum(
        m.token_dispatcher.num_plans
        for m in model.modules()
        if isinstance(m, GatherRSMoELayer) and m.gatherrs
    )


class UsageError(ValueError):
    """A command-line choice that cannot run here; `main` prints it and exits with status 2."""


def resolved_backend(run: RunConfig, model_on: torch.nn.Module) -> str:
    """The fused-path backend `--backend` resolves to for this model's operands and group.

    Asks `megatron_overlap.ops.resolve_backend(backend, h, w2, group)` the question the
    dispatcher asks on every call, with an empty `h` of the model's dtype and device, one
    local expert's FC2 weight and the tp_ep group (None when it has one rank).

    Raises:
        UsageError: `--backend triton` where the Triton kernels cannot run (says why).
    """
    from megatron.core import parallel_state as ps

    from megatron_overlap.megatron import GatherRSSequentialMLP
    from megatron_overlap.ops import resolve_backend

    experts = next(m for m in model_on.modules() if isinstance(m, GatherRSSequentialMLP))
    w2 = experts.local_experts[0].linear_fc2.weight.detach().unsqueeze(0)  # [1, H, F]
    h = w2.new_empty(0, w2.shape[2])
    group = ps.get_expert_tensor_and_model_parallel_group()
    group = group if dist.get_world_size(group) > 1 else None
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # auto's "runs the reference path" notice
            return resolve_backend(run.backend, h, w2, group)
    except (RuntimeError, NotImplementedError) as err:
        raise UsageError(f"--backend {run.backend}: {err}") from err


# --------------------------------------------------------------------------------------
# Inputs, timing, agreement
# --------------------------------------------------------------------------------------


def make_inputs(shape: Any, run: RunConfig, ranks: Ranks, seq: int, device: torch.device):
    """Token ids [B, S] (uniform over the real vocabulary) and position ids [B, S].

    The same on every TP rank of a DP group; each DP rank draws its own (seed + DP rank).
    """
    gen = torch.Generator().manual_seed(run.seed + 1_000_003 * (ranks.dp_rank + 1) + seq)
    tokens = torch.randint(
        0, shape.vocab_size, (run.micro_batch_size, seq), generator=gen, dtype=torch.int64
    )
    positions = torch.arange(seq, dtype=torch.int64).unsqueeze(0).expand_as(tokens)
    return tokens.to(device), positions.contiguous().to(device)


def _sync(device: torch.device) -> None:
    """All ranks line up, and on CUDA the queued work is finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.all_reduce(torch.zeros(1, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor):
    """Prefill logits [B, S, V_tp] (vocab-parallel shard; causal mask built by Megatron)."""
    return model(tokens, positions, attention_mask=None)


class Timer:
    """Times one forward per `measure` call: CUDA events on GPU, perf_counter on CPU.

    Every measured forward starts after all ranks line up (`_sync`). Also records peak GPU
    memory (`torch.cuda.max_memory_allocated`, reset before the forward), in bytes.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, Any]] = []
        self.cpu_ms: list[float] = []
        self.peak_bytes = 0

    def measure(self, fn) -> None:
        """Run `fn()` once, timed; its output is dropped."""
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._pending.append((start, end))
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
        else:
            t0 = time.perf_counter()
            fn()
            self.cpu_ms.append((time.perf_counter() - t0) * 1e3)

    def times_ms(self) -> list[float]:
        """This rank's per-forward times in ms (waits for the GPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) for s, e in self._pending]
        return list(self.cpu_ms)


def reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over all ranks (a forward takes as long as its slowest rank)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max|out - ref|, max|ref| and their ratio over all ranks, and NaN/Inf count in either.

    Args:
        out, ref: this rank's part of two results of the same computation, any equal shape.
    """
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs().nan_to_num(nan=float("inf"))
    maxima = torch.stack([diff.max(), ref.abs().max()]).double()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    nonfinite = (~torch.isfinite(out)).sum().double() + (~torch.isfinite(ref)).sum().double()
    dist.all_reduce(nonfinite)
    max_abs_diff, max_abs_ref = maxima.tolist()
    return {
        "max_abs_diff": max_abs_diff,
        "max_abs_ref": max_abs_ref,
        "max_rel_diff": max_abs_diff / max_abs_ref if max_abs_ref > 0 else float("inf"),
        "nonfinite": int(nonfinite.item()),
    }


def logits_error(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> dict:
    """`max_error` of two logit tensors plus whole-vocabulary and per-token measures.

    Args:
        out, ref: [B, S, V_tp] logits of the same inputs (this rank's vocabulary shard).
        tolerance: relative bound used to count tokens (`tokens_over_tol`).

    Returns:
        `max_error`'s fields, rel_fro_diff (||out - ref||_F / ||ref||_F over all tokens and
        the whole vocabulary), tokens_over_tol (tokens whose largest |out - ref| over the
        vocabulary exceeds tolerance * max_abs_ref) and tokens (global tokens compared).
    """
    from megatron.core import parallel_state as ps

    result = max_error(out, ref)
    diff = (out.float() - ref.float()).abs().nan_to_num(nan=float("inf"))
    token_diff = diff.amax(dim=-1)  # [B, S] over this vocabulary shard
    dist.all_reduce(token_diff, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    sums = torch.stack(
        [
            diff.square().sum(dtype=torch.float64),
            ref.float().square().sum(dtype=torch.float64),
            (token_diff > tolerance * result["max_abs_ref"]).sum().double(),
            torch.tensor(float(token_diff.numel()), dtype=torch.float64, device=diff.device),
        ]
    )
    dist.all_reduce(sums)  # vocabulary shards and DP ranks are disjoint ...
    tp = ps.get_tensor_model_parallel_world_size()  # ... but TP ranks share their tokens
    result["rel_fro_diff"] = (sums[0] / sums[1]).sqrt().item() if sums[1] > 0 else float("inf")
    result["tokens_over_tol"] = int(sums[2].item()) // tp
    result["tokens"] = int(sums[3].item()) // tp
    return result


def judge(errors: dict, dtype: str) -> tuple[bool, str]:
    """Whether flag on and off agree; returns (agree, the criterion applied, in words).

    1. The first MoE layer's output, flag on vs off: max rel diff <= `TOLERANCE[dtype]`.
       Its input is bit-identical in both models, so this is a routing-flip-free check of the
       fused path in the real model (real shapes, real routing).
    2. The logits. fp32: max|on - off| / max|off| <= `TOLERANCE["fp32"]`. bf16 with the fp32
       reference: the flag-on logits at most `BF16_ERROR_RATIO` times as far from it as the
       flag-off ones (relative Frobenius norm, plus `BF16_ERROR_FLOOR`). bf16 without it:
       ||on - off||_F / ||off||_F <= `BF16_NO_REFERENCE_FRO` (coarse).
    3. No NaN/Inf anywhere.
    """
    tolerance = TOLERANCE[dtype]
    finite = all(e["nonfinite"] == 0 for e in errors.values() if e is not None)
    first_moe = errors["moe1_on_vs_off"]["max_rel_diff"] <= tolerance
    text = f"first MoE layer max rel diff <= {tolerance:.1e}; logits "
    if dtype == "fp32":
        logits = errors["on_vs_off"]["max_rel_diff"] <= tolerance
        text += f"max rel diff <= {tolerance:.1e}"
    elif errors["on_vs_ref"] is not None:
        bound = BF16_ERROR_RATIO * errors["off_vs_ref"]["rel_fro_diff"] + BF16_ERROR_FLOOR
        logits = errors["on_vs_ref"]["rel_fro_diff"] <= bound
        text += f"fro(on - fp32) <= {BF16_ERROR_RATIO:g} * fro(off - fp32) + {BF16_ERROR_FLOOR:.1e}"
    else:
        logits = errors["on_vs_off"]["rel_fro_diff"] <= BF16_NO_REFERENCE_FRO
        text += f"fro(on - off) <= {BF16_NO_REFERENCE_FRO:.1e} (no fp32 reference)"
    return finite and first_moe and logits, text + "; all finite"


@contextlib.contextmanager
def first_moe_output(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, the output of the model's first MoE layer is appended to the list.

    The output is `MoELayer.forward`'s first result: [S (/ TP under SP), B, H] hidden states.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    captured: list[torch.Tensor] = []
    handle = layer.register_forward_hook(
        lambda module, args, output: captured.append(output[0].detach().clone())
    )
    try:
        yield captured
    finally:
        handle.remove()


def check_seq(
    models: dict, reference: torch.nn.Module | None, run: RunConfig, inputs: tuple
) -> dict:
    """Errors on one input (see `judge`): "moe1_on_vs_off" (first MoE layer output),
    "on_vs_off" (logits), and with a reference "off_vs_ref" and "on_vs_ref" (else None)."""
    tokens, positions = inputs
    tolerance = TOLERANCE[run.dtype]
    logits, moe1 = {}, {}
    for name, model in models.items():
        with first_moe_output(model) as captured:
            logits[name] = forward(model, tokens, positions)
        moe1[name] = captured[0]
    errors = {
        "moe1_on_vs_off": max_error(moe1["on"], moe1["off"]),
        "on_vs_off": logits_error(logits["on"], logits["off"], tolerance),
        "off_vs_ref": None,
        "on_vs_ref": None,
    }
    if reference is not None:
        ref = forward(reference, tokens, positions)
        errors["off_vs_ref"] = logits_error(logits["off"], ref, tolerance)
        errors["on_vs_ref"] = logits_error(logits["on"], ref, tolerance)
    return errors


# --------------------------------------------------------------------------------------
# One sequence length
# --------------------------------------------------------------------------------------


def time_seq(
    models: dict,
    fused_layers: int,
    run: RunConfig,
    inputs: tuple,
    device: torch.device,
    progress: Any,
) -> dict:
    """Warm up, then time alternating forwards (off, on, off, on, ...) on the same inputs.

    Returns:
        {"ms": {variant: per-forward ms, max over ranks}, "peak_bytes": {variant: max over
        ranks and forwards}, "fused_calls": fused-op launches during the timed forwards}.

    Raises:
        RuntimeError: the flag-on model did not launch the fused op once per fused MoE layer
            per forward (then it did not run the path being measured).
    """
    tokens, positions = inputs
    timers = {name: Timer(device) for name in models}
    for _ in range(run.warmup):
        for model in models.values():
            forward(model, tokens, positions)
            progress.update(1)
    calls_before = fused_forward_count(models["on"])
    for _ in range(run.iters):
        for name, model in models.items():
            timers[name].measure(lambda m=model: forward(m, tokens, positions))
            progress.update(1)
    fused_calls = fused_forward_count(models["on"]) - calls_before
    expected = run.iters * fused_layers
    if fused_calls != expected:
        raise RuntimeError(
            f"the flag-on model launched the fused op {fused_calls} times in {run.iters} "
            f"forwards of {fused_layers} fused MoE layers; expected {expected}"
        )
    return {
        "ms": {name: reduce_max(timer.times_ms(), device) for name, timer in timers.items()},
        "peak_bytes": {
            name: reduce_max([float(t.peak_bytes)], device)[0] for name, t in timers.items()
        },
        "fused_calls": fused_calls,
    }


# --------------------------------------------------------------------------------------
# Reporting (rank 0)
# --------------------------------------------------------------------------------------


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "unknown")
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None


def git_sha() -> str:
    """`git rev-parse HEAD` of the checkout, "unknown" without git or a .git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    """Fields common to every row: hardware, versions, git sha, timestamp."""
    import megatron.core

    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "megatron_overlap": _version("megatron_overlap"),
        "git_sha": git_sha(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def layout_name(run: RunConfig) -> str:
    """E.g. "tp2/ep1/dp1/sp1"."""
    return f"tp{run.tp}/ep{run.ep}/dp{run.dp}/sp{int(run.sequence_parallel)}"


def make_rows(timing: dict, errors: dict, seq: int, info: dict, run: RunConfig) -> list[dict]:
    """One JSON row per variant ("off", "on") of one sequence length.

    Args:
        timing: `time_seq` result; errors: `check_seq` result.
        info: fields common to the run (`environment()` plus model, layers, backend, ...).
    """
    tokens = seq * run.micro_batch_size * run.dp
    p50 = {name: percentile(ms, 50) for name, ms in timing["ms"].items()}
    agree, criterion = judge(errors, run.dtype)
    rows = []
    for name, ms in timing["ms"].items():
        on = name == "on"
        rows.append(
            {
                "schema": SCHEMA,
                "benchmark": "prefill",
                **info,
                "seq_length": seq,
                "global_tokens": tokens,
                "variant": name,
                "moe_gatherrs_overlap": on,
                "backend": info["backend"] if on else "megatron-alltoall",
                "fused_calls": timing["fused_calls"] if on else 0,
                "ms_p20": percentile(ms, 20),
                "ms_p50": p50[name],
                "ms_p80": percentile(ms, 80),
                "ms_mean": statistics.fmean(ms),
                "ms_all": ms,
                "tokens_per_s": tokens / (p50[name] / 1e3),
                "speedup_off_over_on": p50["off"] / p50["on"],
                "peak_mem_gib": timing["peak_bytes"][name] / 2**30
                if run.device == "cuda"
                else None,
                "max_rel_diff": errors["on_vs_off"]["max_rel_diff"],
                "errors": errors,
                "tolerance": TOLERANCE[run.dtype],
                "criterion": criterion,
                "agree": agree,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table, one line per (model, layout, seq): off and on side by side.

    `fro vs fp32` = relative Frobenius error of off / on against the fp32 reference (bf16).
    """
    header = [
        "model",
        "layers",
        "layout",
        "seq",
        "ms off",
        "ms on",
        "tok/s off",
        "tok/s on",
        "t_off/t_on (>1: flag on faster)",
        "rel diff logits",
        "rel diff MoE1",
        "fro vs fp32 off/on",
        "agree",
        "peak GiB off/on",
    ]
    pairs: dict[tuple, dict] = {}
    for row in rows:
        key = (row["model"], row["layout"], row["seq_length"])
        pairs.setdefault(key, {})[row["variant"]] = row
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for pair in pairs.values():
        off, on = pair["off"], pair["on"]
        errors = off["errors"]
        fro = "-"
        if errors["on_vs_ref"] is not None:
            fro = (
                f"{errors['off_vs_ref']['rel_fro_diff']:.1e}/"
                f"{errors['on_vs_ref']['rel_fro_diff']:.1e}"
            )
        peak = "-"
        if off["peak_mem_gib"] is not None:
            peak = f"{off['peak_mem_gib']:.2f}/{on['peak_mem_gib']:.2f}"
        cells = [
            off["model"],
            str(off["num_layers"]),
            off["layout"],
            str(off["seq_length"]),
            f"{off['ms_p50']:.2f}",
            f"{on['ms_p50']:.2f}",
            f"{off['tokens_per_s']:.0f}",
            f"{on['tokens_per_s']:.0f}",
            f"{off['speedup_off_over_on']:.3f}",
            f"{off['max_rel_diff']:.2e}",
            f"{errors['moe1_on_vs_off']['max_rel_diff']:.2e}",
            fro,
            "yes" if off["agree"] else "NO",
            peak,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def append_rows(path: str, rows: list[dict]) -> None:
    """Append JSON lines to `path` (parent folders created)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


class _NoProgress:
    def update(self, n: int = 1) -> None:
        del n

    def close(self) -> None:
        pass


def make_progress(total: int, enabled: bool) -> Any:
    """tqdm bar on rank 0 when tqdm is installed, else a no-op."""
    if not enabled:
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(
        total=total, desc="prefill forwards", unit="fwd", file=sys.stderr, dynamic_ncols=True
    )


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _quiet_megatron_import_warnings() -> None:
    """Silence Megatron's expected notices (no TE/apex/absl, deprecations we cannot act on)."""
    for message in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "absl.logging is not installed",
        "full scope is deprecated",
    ):  # a TransformerConfig default, not ours
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # "GPTModel IS DEPRECATED" (gpt_model.py:68), logged once per model.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)


def reference_fits(models: dict, timings: dict, device: torch.device) -> bool:
    """Whether an fp32 copy of the flag-off model and its forward fit in free GPU memory on
    every rank: fp32 weights + twice the largest bf16 forward's activation peak, + 10 %."""
    if device.type != "cuda":
        return True
    weights = sum(p.numel() for p in models["off"].parameters()) * 4
    resident = torch.cuda.memory_allocated(device)
    activations = max(t["peak_bytes"]["off"] for t in timings.values()) - resident
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - resident
    need = 1.1 * (weights + 2 * max(activations, 0))
    fits = torch.tensor([int(need <= free)], dtype=torch.int32, device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    return bool(fits.item())


def choose_reference(run: RunConfig, models: dict, timings: dict, device: torch.device) -> str:
    """ "fp32" or "none" (see `--reference`); "none (...)" says why auto chose none."""
    if run.reference != "auto":
        return run.reference
    if run.dtype == "fp32":
        return "none"
    if not reference_fits(models, timings, device):
        return "none (auto: an fp32 copy does not fit in GPU memory)"
    return "fp32"


def benchmark(run: RunConfig, shape: Any, device: torch.device) -> int:
    """Build, time and compare the models for every sequence length; return the exit status.

    Timing first (only the flag-off and flag-on models resident, so the peak memory is
    theirs), then the agreement checks (with the fp32 reference model, built only then).
    """
    from megatron_overlap.models import transformer_config_kwargs

    num_layers = transformer_config_kwargs(shape, num_layers=run.num_layers)["num_layers"]
    ranks = init_megatron(run)
    is_rank0 = ranks.rank == 0
    if is_rank0 and run.out:
        append_rows(run.out, [])  # an unwritable --out fails now, not after the benchmark
    models, fused_layers = build_models(shape, run, device)
    backend = resolved_backend(run, models["on"])
    progress = make_progress(len(run.seq_lengths) * 2 * (run.warmup + run.iters), is_rank0)
    inputs = {seq: make_inputs(shape, run, ranks, seq, device) for seq in run.seq_lengths}
    with torch.inference_mode():
        timings = {
            seq: time_seq(models, fused_layers, run, inputs[seq], device, progress)
            for seq in run.seq_lengths
        }
    progress.close()
    reference_used = choose_reference(run, models, timings, device)
    reference = None
    if reference_used == "fp32":
        reference = build_reference(shape, run, models["off"], device)
    with torch.inference_mode():
        errors = {seq: check_seq(models, reference, run, inputs[seq]) for seq in run.seq_lengths}
    info = {
        "model": shape.name,
        "num_layers": num_layers,
        "layout": layout_name(run),
        "world_size": run.world_size,
        "tp": run.tp,
        "ep": run.ep,
        "dp": run.dp,
        "sequence_parallel": run.sequence_parallel,
        "micro_batch_size": run.micro_batch_size,
        "dtype": run.dtype,
        "attention": run.attention,
        "backend_requested": run.backend,
        "backend": backend,
        "reference": reference_used,
        "fused_moe_layers": fused_layers,
        "warmup": run.warmup,
        "iters": run.iters,
        "seed": run.seed,
        **environment(device),
    }
    rows = [
        row
        for seq in run.seq_lengths
        for row in make_rows(timings[seq], errors[seq], seq, info, run)
    ]
    if is_rank0:
        report(rows, run, info)
    return 0 if all(row["agree"] for row in rows) else 1


def report(rows: list[dict], run: RunConfig, info: dict) -> None:
    """Rank 0: the table, the JSON rows, and an error line per disagreeing sequence length."""
    print(
        f"\nprefill: {info['model']}, {info['num_layers']} layers, {info['layout']}, "
        f"micro-batch {run.micro_batch_size}, {run.dtype} on {info['gpu']}, fused backend "
        f"{info['backend']}, {run.warmup} warm-up + {run.iters} timed forwards each; "
        f"agree: {rows[0]['criterion']}",
        flush=True,
    )
    print(format_table(rows), flush=True)
    if run.out:
        append_rows(run.out, rows)
        print(f"appended {len(rows)} rows to {run.out}", flush=True)
    for row in rows:
        if row["variant"] == "on" and not row["agree"]:
            errors = row["errors"]
            print(
                f"ERROR: flag on and off disagree at seq {row['seq_length']} "
                f"({row['criterion']}): {json.dumps(errors)}",
                file=sys.stderr,
                flush=True,
            )


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """argparse-style error (usage + message on stderr, rank 0 only); returns exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 agree, 1 disagree, 2 bad arguments).

    Everything the command line decides (layout, model shape, backend) is checked before the
    process group starts; errors after that propagate with their traceback.
    """
    _quiet_megatron_import_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    ensure_launch_env()
    try:
        from megatron_overlap.models import load_model_shape, transformer_config_kwargs

        run = resolve_args(args, int(os.environ["WORLD_SIZE"]))
        shape = load_model_shape(run.model)
        transformer_config_kwargs(shape, num_layers=run.num_layers)  # checks --num-layers
        check_shape(shape, run)
        device = init_process_group(run.device)
    except ValueError as err:
        return _usage_error(parser, str(err))
    try:
        return benchmark(run, shape, device)
    except UsageError as err:
        return _usage_error(parser, str(err))
    finally:
        with contextlib.suppress(Exception):
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
