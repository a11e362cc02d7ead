"""Full-model prefill of a Megatron-Core `GPTModel`: `moe_gatherrs_overlap` off vs on.

Builds, per model, GPT models with identical weights in one process group and times
forward-only prefill of all of them, alternating, on the same inputs (DESIGN.md section 5,
"full-model prefill"):

* "off" (always): Megatron's stock spec (`megatron.core.models.gpt.gpt_layer_specs.
  get_gpt_decoder_block_spec(config, use_transformer_engine=HAVE_TE)`) with a
  `GatherRSTransformerConfig(moe_gatherrs_overlap=False)`: Megatron's alltoall dispatcher and
  (without Transformer Engine) `SequentialMLP` experts;
* "off-grouped" (`--baselines off off-grouped`): the same spec with
  `megatron_overlap.bench.baselines.GroupedGEMMSequentialMLP` experts (FC1 and FC2 as torch
  grouped GEMMs), so the flag is not only compared with a per-expert loop;
* "on": `megatron_overlap.megatron.specs.get_gpt_decoder_block_spec(config)` with
  `moe_gatherrs_overlap=True`.
Every model after "off" loads its weights with `load_state_dict(strict=True)` (the
parameter names are identical by design, so a strict load succeeding is the
checkpoint-compatibility check).

For each sequence length it warms every model up, times `--iters` rounds of one forward
of each, in the order of `measure.round_order` (a Williams design: drift hits all, and each
model follows every other one equally often; before v5.4 the order was off, on,
off-grouped in every round), then checks that each
agrees with "off": the first MoE layer's output (its input is identical in all models) and
the logits, against an fp32 copy of the flag-off model in bf16 runs (see `judge`,
`TOLERANCE`). Rank 0 prints a table and appends one JSON row per (model, layout, seq,
variant) to `--out` after each model (so a run cut short keeps the finished models). Row
fields: `megatron_overlap.bench.make_report` (the schema) and `make_rows` here. Exit status
1 when a variant disagrees with "off", 2 on bad arguments.

Usage::

    python3 launch/prefill.py                          # CPU: tiny model, world 1
    torchrun --standalone --nproc_per_node 2 launch/prefill.py --tp 1 --ep 2
    # GPU (docs/gpu.md):
    source scripts/device_setup.sh && torchrun --nproc_per_node 2 launch/prefill.py \\
        --model mixtral-8x7b --num-layers 2 --seq-lengths 4096 --tp 1 --ep 2
    # several models, 2 MoE layers each (plus their leading dense layers), both baselines:
    source scripts/device_setup.sh && torchrun --nproc_per_node 2 launch/prefill.py \\
        --model qwen3-30b-a3b deepseek-v2-lite --num-moe-layers 2 --attention sdpa \\
        --seq-lengths 4096 8192 16384 32768 --baselines off off-grouped --tp 1 --ep 2

Shape symbols: B micro-batch, S sequence length, V vocabulary (padded), V_tp = V / TP.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import socket
import statistics
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without `pip install`

from megatron_overlap.bench.cli import (  # noqa: E402
    HostMemoryError,
    check_host_memory,
    check_folder,
    check_launch_inputs,
    make_folder,
    non_negative_int,
    positive_int,
)
from megatron_overlap.bench.measure import (  # after the sys.path line
    TIMING_ORDER,
    Timer,
    round_order,
    allocated_bytes,
    append_rows,
    arm_stack_dumps,
    environment,
    max_error,
    own_peak,
    param_bytes,
    percentile,
    reduce_max,
    symm_workspace_bytes,
)
from megatron_overlap.config import (  # noqa: E402
    BIAS_ACTIVATION_FUSION_ARGUMENT,
    FC1_IMPL_ARGUMENT,
    PREREDUCE_ARGUMENT,
    fc1_chunk_bytes,
    fused_path_settings,
)
from megatron_overlap.resource.solver import implementation_name  # noqa: E402

SCHEMA = "megatron_overlap.prefill/1"
"""`schema` field of every JSON row; bump when a field changes meaning."""

DEFAULT_OUT = "results/prefill.jsonl"
ATTENTIONS = ("local", "sdpa")
CPU_DEFAULTS = {"model": "tiny", "seq_lengths": [64, 128]}
GPU_DEFAULTS = {"model": "mixtral-8x7b", "seq_lengths": [4096]}
VARIANTS = ("off", "on", "off-grouped")
"""Models per run, in timing order: "off" and "on" always, "off-grouped" with `--baselines`."""

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


_positive_int = positive_int  # launch/bench_layer.py imports these names from here
_non_negative_int = non_negative_int


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
        nargs="+",
        default=None,
        help="names in configs/models or YAML paths, run one after another in one process "
        "(default: tiny on CPU, mixtral-8x7b on GPU); a model given twice runs twice, with "
        "the same seed (a repeatability check); a repeated --seq-lengths value runs once",
    )
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument(
        "--num-layers",
        type=_positive_int,
        default=None,
        help="build this many layers instead of the model's (>= 1, and more "
        "than the model's leading dense layers)",
    )
    layers.add_argument(
        "--num-moe-layers",
        type=_positive_int,
        default=None,
        help="build each model's leading dense layers (DeepSeek-V2-Lite: 1) plus this many "
        "MoE layers, so every model gets the same number of MoE layers",
    )
    parser.add_argument(
        "--baselines",
        nargs="+",
        choices=("off", "off-grouped"),
        default=["off"],
        help="flag-off models to time against flag on: 'off' = Megatron's stock spec "
        "(always built: the weights and the agreement checks come from it), 'off-grouped' = "
        "the same with GroupedGEMMSequentialMLP experts (default: off)",
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
        "--prereduce",
        **PREREDUCE_ARGUMENT,
        help="moe_gatherrs_prereduce of the flag-on model: auto (default: the resource "
             "manager picks direct or pre-reduced per call), on (pre-reduced; Triton "
             "backend; also the bare flag) or off (direct)",
    )
    parser.add_argument("--fc1-impl", **FC1_IMPL_ARGUMENT)
    parser.add_argument("--bias-activation-fusion", **BIAS_ACTIVATION_FUSION_ARGUMENT)
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
        "--host-breakdown",
        action="store_true",
        help="after timing each sequence length, run --iters more forwards of every model "
        "with host timers on the embedding, each decoder layer's norms, attention and MLP, "
        "the MoE layers' stages (and the flag-on 'mo.*' stages), summed over the layers "
        "(megatron_overlap.bench.breakdown), and print the host microseconds per stage, "
        "each the max over ranks (also in the rows, host_breakdown_us): where a host-bound "
        "model forward's time goes",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after timing each sequence length, profile one forward of 'on' and of "
        "'off-grouped' (or 'off' without it) with torch.profiler (CPU + CUDA) and print rank "
        "0's top operators and kernels",
    )
    parser.add_argument(
        "--trace-dir",
        default="",
        help="with --profile: rank 0 also writes each profiled forward as a chrome trace "
        "<DIR>/<model>_<layout>_<seq>_<variant>.json, the layout's '/' as '-', e.g. "
        "mixtral-8x7b_tp1-ep2-dp2-sp0_4096_on.json (launch/trace_summary.py reads them; the "
        "folder is checked before the run and made when it starts)",
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

    models: tuple[str, ...]
    num_layers: int | None
    num_moe_layers: int | None
    baselines: tuple[str, ...]
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
    prereduce: Union[bool, str] = "auto"
    fc1_impl: str = "auto"
    bias_activation_fusion: bool = False
    host_breakdown: bool = False
    profile: bool = False
    trace_dir: str = ""


def resolve_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Fill device-dependent defaults and check the layout against the world size.

    Raises:
        ValueError: naming the bad option and value: world size not a multiple of TP * EP,
            `--device cuda` without CUDA, `--device cpu` with CUDA visible (the CPU patches
            refuse that), sequence parallel with TP = 1.
    """
    if args.prereduce is True and args.backend == "reference":
        raise ValueError("--prereduce on needs the Triton backend (--backend triton or "
                         "auto), got --backend reference")
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
    if args.trace_dir and not args.profile:
        raise ValueError("--trace-dir writes the traces of --profile: add --profile")
    if args.trace_dir:  # checked now, made only once the run proceeds (`main`)
        check_folder(args.trace_dir, "--trace-dir")
        if args.out and os.path.abspath(args.out) == os.path.abspath(args.trace_dir):
            raise ValueError(f"--trace-dir {args.trace_dir!r} is also --out: give the traces "
                             "a folder of their own")
    return RunConfig(
        models=tuple(args.model or [defaults["model"]]),  # a repeat runs again (same seed)
        num_layers=args.num_layers,
        num_moe_layers=args.num_moe_layers,
        baselines=tuple(dict.fromkeys(["off", *args.baselines])),
        seq_lengths=tuple(dict.fromkeys(args.seq_lengths or defaults["seq_lengths"])),
        micro_batch_size=args.micro_batch_size,
        tp=args.tp,
        ep=args.ep,
        dp=world_size // args.tp,
        sequence_parallel=sp,
        backend=args.backend,
        prereduce=args.prereduce,
        fc1_impl=args.fc1_impl,
        bias_activation_fusion=args.bias_activation_fusion,
        host_breakdown=args.host_breakdown,
        profile=args.profile,
        trace_dir=args.trace_dir,
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


def num_layers_for(shape: Any, run: RunConfig) -> int:
    """Layers to build for `shape`: `--num-layers`, else the model's leading dense layers +
    `--num-moe-layers`, else the model's own count.

    Raises:
        ValueError: not more layers than the model's leading dense layers (see
            `megatron_overlap.models.transformer_config_kwargs`).
    """
    from megatron_overlap.models import transformer_config_kwargs

    layers = run.num_layers
    if layers is None and run.num_moe_layers is not None:
        layers = shape.first_k_dense_layers + run.num_moe_layers
    return transformer_config_kwargs(shape, num_layers=layers)["num_layers"]


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
        **transformer_config_kwargs(shape, num_layers=num_layers_for(shape, run)),
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
        moe_gatherrs_prereduce=run.prereduce if flag else False,
        bias_activation_fusion=run.bias_activation_fusion,
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


def build_gpt(
    shape: Any, run: RunConfig, *, flag: bool, dtype: str, initialize: bool, baseline: str = "off"
):
    """One `GPTModel`: Megatron's stock block spec (flag off), ours (flag on), or with
    `baseline="off-grouped"` Megatron's local spec with `GroupedGEMMSequentialMLP` experts.

    Stock and ours use `use_transformer_engine=HAVE_TE` (the local spec on machines without
    TE), and `--attention sdpa` swaps the core attention of all (`with_core_attention`).
    """
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as mc_specs

    from megatron_overlap.megatron import specs
    from megatron_overlap.models import gpt_model_kwargs

    config = build_config(shape, run, flag=flag, dtype=dtype, initialize=initialize)
    if baseline == "off-grouped" and not flag:
        from megatron_overlap.bench.baselines import gpt_block_spec

        spec = gpt_block_spec("off-grouped", config)
    else:
        make_spec = (
            specs.get_gpt_decoder_block_spec if flag else mc_specs.get_gpt_decoder_block_spec
        )
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
    """Move to the device (on GPU only the router weight, made on the CPU, moves), cast every
    floating parameter to the config's `params_dtype` (as Megatron's Float16Module does: its
    torch LayerNorm, e.g. Phi-3.5-MoE's, is made in fp32 otherwise) and eval()."""
    dtype = getattr(getattr(model, "config", None), "params_dtype", None)
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


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
    """The `GPTModel` of every variant (`VARIANTS`: "off", "on", and the extra
    `--baselines`) with identical weights, in eval mode.

    Returns:
        ({variant: model} in timing order, number of MoE layers of the flag-on model on the
        fused path).

    Raises:
        RuntimeError: a strict state-dict load fails (`copy_weights`), or the flag-on model
            has no MoE layer on the fused path.
    """
    from megatron_overlap.megatron import GatherRSMoELayer

    model_off = build_gpt(shape, run, flag=False, dtype=run.dtype, initialize=True)
    if run.device == "cpu":
        redraw_cpu_experts(model_off, run.seed)
    models = {"off": to_device(model_off, device)}
    for variant in VARIANTS[1:]:
        if variant != "on" and variant not in run.baselines:
            continue
        model = build_gpt(
            shape, run, flag=variant == "on", dtype=run.dtype, initialize=False, baseline=variant
        )
        copy_weights(model_off, model, f"the {variant} model")
        models[variant] = to_device(model, device)
    fused = [
        m for m in models["on"].modules() if isinstance(m, GatherRSMoELayer) and m.gatherrs
    ]
    if not fused:
        raise RuntimeError("flag-on model has no MoE layer on the fused path")
    for layer in fused:
        layer.experts.fc1_impl = run.fc1_impl
    return models, len(fused)


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


def combine_modes(model: torch.nn.Module) -> list:
    """What the last combine of each flag-on MoE layer ran ("direct", "prereduced",
    "reference"), sorted, without repeats."""
    from megatron_overlap.megatron import GatherRSMoELayer

    return sorted({
        m.token_dispatcher.last_combine
        for m in model.modules()
        if isinstance(m, GatherRSMoELayer) and m.gatherrs and m.token_dispatcher.last_combine
    })


def gemm2_tiles(model: torch.nn.Module) -> list:
    """The GEMM2 tiles (`TileConfig.name`) the last Triton combine of each flag-on MoE layer
    ran, sorted, without repeats ([] where none ran: the reference path)."""
    from megatron_overlap.megatron import GatherRSMoELayer

    return sorted({
        m.token_dispatcher.last_tile.name
        for m in model.modules()
        if isinstance(m, GatherRSMoELayer) and m.gatherrs
        and m.token_dispatcher.last_tile is not None
    })


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


def forward(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor):
    """Prefill logits [B, S, V_tp] (vocab-parallel shard; causal mask built by Megatron)."""
    return model(tokens, positions, attention_mask=None)


LOGITS_CHUNK_TOKENS = 1024
"""`logits_error` compares this many sequence positions at a time: its fp32 temporaries stay
at ~4 * B * 1024 * V_tp * 4 bytes (2.5 GB for Qwen's 151936-token vocabulary) however long
the sequence."""


def logits_error(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> dict:
    """`max_error` of two logit tensors plus whole-vocabulary and per-token measures.

    Args:
        out, ref: [B, S, V_tp] logits of the same inputs (this rank's vocabulary shard).
        tolerance: relative bound used to count tokens (`tokens_over_tol`).

    Returns:
        `max_error`'s fields, rel_fro_diff (||out - ref||_F / ||ref||_F over all tokens and
        the whole vocabulary), tokens_over_tol (tokens whose largest |out - ref| over the
        vocabulary exceeds tolerance * max_abs_ref) and tokens (global tokens compared).
        Computed `LOGITS_CHUNK_TOKENS` positions at a time (memory), in fp32/fp64.

    Raises:
        ValueError: the shapes differ or are not [B, S, V_tp].
    """
    from megatron.core import parallel_state as ps

    if out.shape != ref.shape or out.dim() != 3:
        raise ValueError(f"logits must be equal [B, S, V_tp]; got {tuple(out.shape)} and "
                         f"{tuple(ref.shape)}")
    device = out.device
    maxima = torch.zeros(2, dtype=torch.float64, device=device)  # max|diff|, max|ref|
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # sq diff, sq ref, over, tokens
    nonfinite = torch.zeros((), dtype=torch.float64, device=device)
    token_diff = torch.empty(out.shape[:2], dtype=torch.float32, device=device)  # [B, S]
    for start in range(0, out.shape[1], LOGITS_CHUNK_TOKENS):
        part = slice(start, start + LOGITS_CHUNK_TOKENS)
        o, r = out[:, part].float(), ref[:, part].float()
        diff = (o - r).abs().nan_to_num(nan=float("inf"))
        token_diff[:, part] = diff.amax(dim=-1)
        maxima = torch.maximum(maxima, torch.stack([diff.max(), r.abs().max()]).double())
        nonfinite += (~torch.isfinite(o)).sum() + (~torch.isfinite(r)).sum()
        sums[0] += diff.square().sum(dtype=torch.float64)
        sums[1] += r.square().sum(dtype=torch.float64)
        del o, r, diff
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    dist.all_reduce(nonfinite)
    max_abs_diff, max_abs_ref = maxima.tolist()
    result = {
        "max_abs_diff": max_abs_diff,
        "max_abs_ref": max_abs_ref,
        "max_rel_diff": max_abs_diff / max_abs_ref if max_abs_ref > 0 else float("inf"),
        "nonfinite": int(nonfinite.item()),
    }
    # The largest difference of a token over the whole vocabulary (all TP shards).
    dist.all_reduce(token_diff, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    sums[2] = (token_diff > tolerance * max_abs_ref).sum().double()
    sums[3] = float(token_diff.numel())
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
    """Errors of every variant against "off" on one input (see `judge`).

    Returns:
        {variant: errors} for every variant but "off", errors = {"moe1_on_vs_off" (first MoE
        layer output), "on_vs_off" (logits), "off_vs_ref" and "on_vs_ref" (logits against the
        fp32 reference; None without it)}, where "on" stands for the variant. The variants'
        logits are made and compared one at a time (memory).
    """
    tokens, positions = inputs
    tolerance = TOLERANCE[run.dtype]
    with first_moe_output(models["off"]) as captured:
        logits_off = forward(models["off"], tokens, positions)
    moe1_off = captured[0]
    ref = forward(reference, tokens, positions) if reference is not None else None
    off_vs_ref = logits_error(logits_off, ref, tolerance) if ref is not None else None
    errors = {}
    for name, model in models.items():
        if name == "off":
            continue
        with first_moe_output(model) as captured:
            logits = forward(model, tokens, positions)
        errors[name] = {
            "moe1_on_vs_off": max_error(captured[0], moe1_off),
            "on_vs_off": logits_error(logits, logits_off, tolerance),
            "off_vs_ref": off_vs_ref,
            "on_vs_ref": logits_error(logits, ref, tolerance) if ref is not None else None,
        }
        del logits
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
    """Warm up, then time rounds of one forward of each model (`measure.round_order`) on the
    same inputs.

    Returns:
        {"ms": {variant: per-forward ms, max over ranks}, "host_ms": {variant: per-forward
        host ms (`Timer.host_ms`: the time the host takes to run and enqueue the forward, its
        waits in host syncs included), max over ranks}, and per variant, max over ranks, in
        bytes (`megatron_overlap.bench.measure`; None on CPU): "peak_bytes" (absolute),
        "fwd_extra_bytes", "persistent_bytes" (allocated across the variant's first warm-up
        forward of this sequence length; None without warm-up), "symm_workspace_bytes"
        (flag on only; the workspace is made afresh for each length); "fused_calls":
        fused-op launches during the timed forwards, "combine_modes": `combine_modes` of the
        flag-on model, "gemm2_tiles": `gemm2_tiles` of the flag-on model}.

    Raises:
        RuntimeError: the flag-on model did not launch the fused op once per fused MoE layer
            per forward (then it did not run the path being measured).
    """
    tokens, positions = inputs
    # A fresh fused-op workspace per sequence length, as a run at this length alone has
    # (its receive buffer is then exactly this length's size; grown from a shorter one's it
    # would carry the 1/8 growth headroom into symm_workspace_bytes). Collective: every rank
    # times the same lengths in the same order.
    from megatron_overlap.symm import destroy_workspaces

    destroy_workspaces()
    timers = {name: Timer(device) for name in models}
    persistent = {name: None for name in models}
    for i in range(run.warmup):
        for name, model in models.items():
            before = allocated_bytes(device)
            forward(model, tokens, positions)
            if i == 0:
                persistent[name] = max(0, allocated_bytes(device) - before)
            progress.update(1)
    calls_before = fused_forward_count(models["on"])
    for r in range(run.iters):
        for name in round_order(list(models), r):  # (each model after every other)
            timers[name].measure(lambda m=models[name]: forward(m, tokens, positions))
            progress.update(1)
    fused_calls = fused_forward_count(models["on"]) - calls_before
    expected = run.iters * fused_layers
    if fused_calls != expected:
        raise RuntimeError(
            f"the flag-on model launched the fused op {fused_calls} times in {run.iters} "
            f"forwards of {fused_layers} fused MoE layers; expected {expected}"
        )

    def rank_max(values: dict) -> dict:
        if device.type != "cuda":
            return {name: None for name in values}
        names = [n for n, v in values.items() if v is not None]
        maxima = reduce_max([float(values[n]) for n in names], device) if names else []
        out = {name: None for name in values}
        out.update({n: int(v) for n, v in zip(names, maxima)})
        return out

    symm = symm_workspace_bytes() if device.type == "cuda" else 0
    return {
        "ms": {name: reduce_max(timer.times_ms(), device) for name, timer in timers.items()},
        "host_ms": {name: reduce_max(timer.host_ms, device) for name, timer in timers.items()},
        "peak_bytes": rank_max({name: t.peak_bytes for name, t in timers.items()}),
        "fwd_extra_bytes": rank_max({name: t.fwd_extra_bytes for name, t in timers.items()}),
        "persistent_bytes": rank_max(persistent),
        "symm_workspace_bytes": rank_max({n: (symm if n == "on" else 0) for n in models}),
        "fused_calls": fused_calls,
        "combine_modes": combine_modes(models["on"]),
        "gemm2_tiles": gemm2_tiles(models["on"]),
    }


def breakdown_seq(models: dict, inputs: tuple, run: RunConfig, device: torch.device,
                  title: str, print_table: bool) -> dict:
    """`--host-breakdown` of one sequence length: `run.iters` more forwards of every model
    with host timers on its stages (`megatron_overlap.bench.breakdown.host_breakdown`,
    `model_targets`); returns {variant: {stage: host us per forward}} (max over ranks) and
    prints the table where `print_table`. Collective."""
    from megatron_overlap.bench.breakdown import breakdown_table, host_breakdown, model_targets

    tokens, positions = inputs
    result = host_breakdown(
        {name: (lambda m=model: forward(m, tokens, positions), model_targets(model))
         for name, model in models.items()}, device, run.iters)
    if print_table:
        print("\n" + breakdown_table(result, title), flush=True)
    return result


def profile_seq(models: dict, inputs: tuple, run: RunConfig, device: torch.device,
                title: str, stem: str) -> str:
    """`--profile` of one sequence length: one profiled forward of "on" and of "off-grouped"
    (or "off" where it did not run) (`megatron_overlap.bench.breakdown.profile_forwards`);
    rank 0's tables. With `run.trace_dir`, rank 0 writes `<trace_dir>/<stem>_<variant>.json`.
    Collective."""
    from megatron_overlap.bench.breakdown import profile_forwards

    tokens, positions = inputs
    baseline = "off-grouped" if "off-grouped" in models else "off"
    prefix = os.path.join(run.trace_dir, stem) if run.trace_dir else ""
    return profile_forwards(
        {name: (lambda m=models[name]: forward(m, tokens, positions)) for name in ("on", baseline)},
        device, title, trace_prefix=prefix)


# --------------------------------------------------------------------------------------
# Reporting (rank 0)
# --------------------------------------------------------------------------------------


def layout_name(run: RunConfig) -> str:
    """E.g. "tp2/ep1/dp1/sp1"."""
    return f"tp{run.tp}/ep{run.ep}/dp{run.dp}/sp{int(run.sequence_parallel)}"


def variant_details(models: dict, backend: str) -> dict:
    """{variant: {"label": exact description (`megatron_overlap.bench.baselines.label`),
    "experts_impl": what the first MoE layer's experts ran in the last forward,
    "param_bytes": the model's parameters and buffers on this rank}}."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_overlap.bench.baselines import label

    details = {}
    for name, model in models.items():
        layer = next(m for m in model.modules() if isinstance(m, MoELayer))
        experts = layer.experts
        if name == "on":
            plan = layer.token_dispatcher.plan
            plan_text = "-" if plan is None else f"{plan.num_comm_ctas} comm CTAs ({plan.source})"
            impl = f"{experts.last_fc1}; FC2 weights {experts.last_fc2_weight}"
            text = label("on", fc1=experts.last_fc1, fc2_weight=experts.last_fc2_weight,
                         backend=backend, plan=plan_text)
        elif name == "off-grouped":
            impl = experts.last_impl
            text = label(name, impl=impl)
        else:
            impl = f"{type(experts).__name__} (Megatron's)"
            text = label("off")
            if type(experts).__name__ != "SequentialMLP":  # Transformer Engine spec
                text = f"Megatron-Core alltoall dispatcher + {type(experts).__name__} (TE spec)"
        details[name] = {"label": text, "experts_impl": impl, "param_bytes": param_bytes(model)}
    return details


def make_rows(
    timing: dict, errors: dict, seq: int, info: dict, run: RunConfig, details: dict
) -> list[dict]:
    """One JSON row per variant ("off", "on", ...) of one sequence length.

    Args:
        timing: `time_seq` result; errors: `check_seq` result.
        info: fields common to the run (`environment()` plus model, layers, backend, ...).
        details: `variant_details` result.
    """
    tokens = seq * run.micro_batch_size * run.dp
    p50 = {name: percentile(ms, 50) for name, ms in timing["ms"].items()}
    cuda = run.device == "cuda"
    rows = []
    for name, ms in timing["ms"].items():
        on = name == "on"
        own = errors["on"] if name == "off" else errors[name]  # "off" reports on vs off
        agree, criterion = judge(own, run.dtype)
        memory = {
            key: timing[key][name]
            for key in ("persistent_bytes", "symm_workspace_bytes", "fwd_extra_bytes")
        }
        memory["param_bytes"] = details[name]["param_bytes"]
        own_peak_bytes = None
        if cuda:
            own_peak_bytes = own_peak(
                memory["param_bytes"], memory["symm_workspace_bytes"], memory["fwd_extra_bytes"]
            )
        rows.append(
            {
                "schema": SCHEMA,
                "benchmark": "prefill",
                **info,
                "seq_length": seq,
                "global_tokens": tokens,
                "variant": name,
                "label": details[name]["label"],
                "experts_impl": details[name]["experts_impl"],
                "moe_gatherrs_overlap": on,
                "backend": info["backend"] if on else "megatron-alltoall",
                "fused_calls": timing["fused_calls"] if on else 0,
                "combine_modes": timing["combine_modes"] if on else [],
                "gemm2_tiles": timing["gemm2_tiles"] if on else [],
                "timing_order": TIMING_ORDER,
                "ms_p20": percentile(ms, 20),
                "ms_p50": p50[name],
                "ms_p80": percentile(ms, 80),
                "ms_mean": statistics.fmean(ms),
                "ms_all": ms,
                "host_ms_p50": percentile(timing["host_ms"][name], 50),
                "host_breakdown_us": timing.get("host_breakdown_us", {}).get(name),
                "tokens_per_s": tokens / (p50[name] / 1e3),
                "speedup_off_over_on": p50["off"] / p50["on"],
                "speedup_over_on": p50[name] / p50["on"],
                "peak_mem_gib": timing["peak_bytes"][name] / 2**30 if cuda else None,
                "peak_abs_bytes": timing["peak_bytes"][name],
                **memory,
                "own_peak_bytes": own_peak_bytes,
                "max_rel_diff": own["on_vs_off"]["max_rel_diff"],
                "errors": own,
                "tolerance": TOLERANCE[run.dtype],
                "criterion": criterion,
                "agree": agree,
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown table, one line per (model, layout, seq): off and on side by side, then
    off-grouped where it ran.

    `fro vs fp32` = relative Frobenius error of off / on against the fp32 reference (bf16);
    `peak GiB` = absolute `max_memory_allocated` (every model resident); `own peak` = the
    variant's own peak (`megatron_overlap.bench.measure`), on's extra over off in %.
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
        "own peak GiB off/on (+%)",
        "ms off-grouped",
        "t_grouped/t_on",
        "grouped agrees",
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
        peak = own = "-"
        if off["peak_mem_gib"] is not None:
            peak = f"{off['peak_mem_gib']:.2f}/{on['peak_mem_gib']:.2f}"
        if off.get("own_peak_bytes") and on.get("own_peak_bytes"):
            extra = 100.0 * (on["own_peak_bytes"] / off["own_peak_bytes"] - 1.0)
            own = (f"{off['own_peak_bytes'] / 2**30:.2f}/{on['own_peak_bytes'] / 2**30:.2f} "
                   f"({extra:+.1f}%)")
        grouped = pair.get("off-grouped")
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
            own,
            f"{grouped['ms_p50']:.2f}" if grouped else "-",
            f"{grouped['speedup_over_on']:.3f}" if grouped else "-",
            ("yes" if grouped["agree"] else "NO") if grouped else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def reseed(run: RunConfig) -> None:
    """Seed the RNGs as `init_megatron` does, so every model of a run starts from the same
    generator state (a model's weights do not depend on which models ran before it)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(run.seed)
    if run.device == "cpu":
        model_parallel_cuda_manual_seed(run.seed, inference_rng_tracker=True, force_reset_rng=True)
    else:
        model_parallel_cuda_manual_seed(run.seed)


def release_memory(device: torch.device) -> None:
    """Between models: free the fused op's workspaces (collective) and cached GPU memory."""
    import gc

    from megatron_overlap.symm import destroy_workspaces

    gc.collect()
    destroy_workspaces()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def benchmark(run: RunConfig, shapes: list, device: torch.device) -> int:
    """Every model in turn (`benchmark_model`); rank 0 reports and writes each model's rows
    as soon as they are made. Returns the exit status (0 all agree, 1 otherwise)."""
    ranks = init_megatron(run)
    is_rank0 = ranks.rank == 0
    if is_rank0 and run.out:
        append_rows(run.out, [])  # an unwritable --out fails now, not after the benchmark
    status = 0
    for index, shape in enumerate(shapes):
        if index:
            reseed(run)
        rows = benchmark_model(run, shape, ranks, device)
        if is_rank0:
            report(rows, run, next(row for row in rows if row["variant"] == "on"))
        if not all(row["agree"] for row in rows):
            status = 1
        release_memory(device)
    return status


def benchmark_model(run: RunConfig, shape: Any, ranks: Ranks, device: torch.device) -> list:
    """Build, time and compare one model's variants at every sequence length; its rows.

    Timing first (only the timed models resident, so the peak memory is theirs), then the
    agreement checks (with the fp32 reference model, built only then).
    """
    num_layers = num_layers_for(shape, run)
    models, fused_layers = build_models(shape, run, device)
    backend = resolved_backend(run, models["on"])
    progress = make_progress(
        len(run.seq_lengths) * len(models) * (run.warmup + run.iters), ranks.rank == 0
    )
    inputs = {seq: make_inputs(shape, run, ranks, seq, device) for seq in run.seq_lengths}
    with torch.inference_mode():
        timings = {}
        for seq in run.seq_lengths:
            timings[seq] = time_seq(models, fused_layers, run, inputs[seq], device, progress)
            title = f"{shape.name} {layout_name(run)} seq {seq}"
            if run.host_breakdown:
                timings[seq]["host_breakdown_us"] = breakdown_seq(
                    models, inputs[seq], run, device, title, print_table=ranks.rank == 0)
            if run.profile:
                text = profile_seq(models, inputs[seq], run, device, title,
                                   f"{shape.name}_{layout_name(run).replace('/', '-')}_{seq}")
                if ranks.rank == 0:
                    print("\n" + text, flush=True)
    progress.close()
    details = variant_details(models, backend)
    reference_used = choose_reference(run, models, timings, device)
    reference = None
    if reference_used == "fp32":
        reference = build_reference(shape, run, models["off"], device)
    with torch.inference_mode():
        errors = {seq: check_seq(models, reference, run, inputs[seq]) for seq in run.seq_lengths}
    elem_bytes = (torch.bfloat16 if run.dtype == "bf16" else torch.float32).itemsize
    info = {
        "model": shape.name,
        "num_layers": num_layers,
        "num_dense_layers": min(shape.first_k_dense_layers, num_layers),
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
        "prereduce": run.prereduce,
        "fc1_impl": run.fc1_impl,  # the flag-on experts' FC1 setting
        "bias_activation_fusion": run.bias_activation_fusion,
        "fc1_chunk_bytes": fc1_chunk_bytes(),
        # the fused path's variables: tma_store (the GEMM2 epilogue), tile_list,
        # host_tables, fast_launch, host_cache, host_splits
        # the MoE layers' TP x EP group (tma_store: the epilogue of the flag-on GEMM2's
        # default tile, false off the GPU path; gemm2_tiles: the tiles its calls ran)
        **fused_path_settings(run.tp * run.ep, backend == "triton" and run.device == "cuda",
                              shape.hidden_size * elem_bytes),
        "resource_solver": implementation_name(),  # the plan's solver: "cpp" | "python"
        "backend": backend,
        "reference": reference_used,
        "fused_moe_layers": fused_layers,
        "variants": list(models),
        "warmup": run.warmup,
        "iters": run.iters,
        "seed": run.seed,
        **environment(device),
    }
    del models, reference
    return [
        row
        for seq in run.seq_lengths
        for row in make_rows(timings[seq], errors[seq], seq, info, run, details)
    ]


def report(rows: list[dict], run: RunConfig, info: dict) -> None:
    """Rank 0: the table, the JSON rows, and an error line per disagreeing sequence length."""
    print(
        f"\nprefill: {info['model']}, {info['num_layers']} layers "
        f"({info['fused_moe_layers']} MoE), {info['layout']}, "
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
        if row["variant"] != "off" and not row["agree"]:
            errors = row["errors"]
            what = "flag on and off" if row["variant"] == "on" else f"{row['variant']} and off"
            print(
                f"ERROR: {what} disagree at seq {row['seq_length']} "
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
        arm_stack_dumps()  # $MO_STACK_DUMP_S: periodic stacks of a stuck run
        from megatron_overlap.models import approx_param_count, load_model_shape

        check_launch_inputs(args.out, create=False)  # the folder: made below
        run = resolve_args(args, int(os.environ["WORLD_SIZE"]))
        shapes = [load_model_shape(name) for name in run.models]
        for shape in shapes:
            layers = num_layers_for(shape, run)  # checks --num-layers / --num-moe-layers
            check_shape(shape, run)
            if run.device == "cpu":  # one model per variant ("on" and the baselines)
                check_host_memory(
                    approx_param_count(shape, layers) * (4 if run.dtype == "fp32" else 2),
                    len(run.baselines) + 1, f"{shape.name}, {layers} layers")
        # the run proceeds (every check above passed): --out's and --trace-dir's folders now
        make_folder(args.out)
        if run.trace_dir:
            make_folder(os.path.join(run.trace_dir, "trace.json"), "--trace-dir")
        device = init_process_group(run.device)
    except (ValueError, ImportError, HostMemoryError) as err:
        return _usage_error(parser, str(err))
    try:
        return benchmark(run, shapes, device)
    except UsageError as err:
        return _usage_error(parser, str(err))
    finally:
        with contextlib.suppress(Exception):
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
