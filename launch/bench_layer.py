"""MoE-layer prefill benchmark: Megatron `MoELayer` forward, flag on vs flag-off baselines.

For each layout, model and sequence length, in one process group, on the same input and the
same weights (DESIGN.md section 5, "MoE layer"):

* "on": `GatherRSMoELayer` from `megatron_overlap.megatron` specs with
  `moe_gatherrs_overlap=True` (backend `--backend`, default auto = the Triton kernels on
  GPUs; the resource manager's plan: `moe_gatherrs_num_comm_ctas=None`);
* "off": Megatron's local MoE spec: alltoall dispatcher + `SequentialMLP`;
* "off-grouped": alltoall dispatcher + `megatron_overlap.bench.baselines.
  GroupedGEMMSequentialMLP` (FC1 and FC2 as torch grouped GEMMs; the row says which);
* "off-te": alltoall dispatcher + `TEGroupedMLP`, only where Transformer Engine imports
  (otherwise skipped, and the reason printed and recorded in every row).
Exact labels: `megatron_overlap.bench.baselines.label`. "off" is built first (Megatron's
initialisation; on CPU every expert redrawn distinct, `tests.support.megatron_cpu.
init_expert_weights`), the others load its state dict strictly.

Protocol per sequence length: `--warmup` untimed forwards of each variant, then `--iters`
rounds, each timing one forward of every variant (in the order of `measure.round_order`, a
Williams design: each variant follows every other one equally often; before v5.4 a rotation
alone kept every variant's predecessor), all
ranks lined up before each forward, the GPU's L2 flushed (256 MiB zeroed) before it, CUDA
events around it; a forward's time is the slowest rank's; rows give p20/p50/p80 over the
rounds. Then every variant's output on that input is compared with "off": max|x - off| /
max|off| over all ranks <= `TOLERANCE[dtype]` (and no NaN/Inf). Memory per variant:
`megatron_overlap.bench.measure` (own peak = parameters + symmetric workspace + largest
forward transient).

Inputs: N(0, 1) hidden states (fixed seed per rank and length) routed by Megatron's router
with its initialised weights, so the loads are close to uniform (skewed routing: the operator
benchmark).

Layouts (`--layouts`): "epN" = TP 1, EP N; "tpN" = TP N (= expert TP), EP 1, sequence
parallel; "tpXepY" in general (SP when X > 1). Tokens: each DP group (world / TP ranks)
feeds one sequence of `seq` tokens, micro-batch 1: with ep2 on 2 GPUs each rank routes its
own `seq` tokens (2 * seq through the layer); with tp2 + SP the two ranks hold seq / 2 tokens
each of one sequence (seq through the layer). Rows: `tokens_per_rank` and `global_tokens`.

Rank 0 prints one line per workload and appends one JSON row per (layout, model, seq,
variant) to `--out` after each (layout, model); schema `SCHEMA`, fields documented in
`megatron_overlap.bench.make_report`. Exit status: 0 all variants agree with "off", 1 one
does not, 2 bad arguments.

Usage::

    python3 launch/bench_layer.py                      # CPU: tiny model, fp32, gloo
    torchrun --standalone --nproc_per_node 2 launch/bench_layer.py   # CPU, ep2 and tp2
    source scripts/device_setup.sh && torchrun --standalone --nproc_per_node 2 \\
        launch/bench_layer.py --out $OUT/layer.jsonl  # GPU: five models, 4096..32768

Shape symbols: S sequence length, B micro-batch (1), H hidden, T = S / TP tokens per rank
under SP.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist

LAUNCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = LAUNCH_DIR.parent
for _path in (str(REPO_ROOT), str(LAUNCH_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)  # run from a checkout; prefill.py's set-up helpers

from prefill import (
    UsageError,
    _non_negative_int,
    _positive_int,
    _quiet_megatron_import_warnings,
    _usage_error,
    ensure_launch_env,
    init_process_group,
)

from megatron_overlap.bench.cli import (
    HostMemoryError,
    alt_environment,
    check_host_memory,
    check_launch_inputs,
    make_folder,
    parse_layout,
)
from megatron_overlap.config import (
    BIAS_ACTIVATION_FUSION_ARGUMENT,
    FC1_IMPL_ARGUMENT,
    PREREDUCE_ARGUMENT,
    fc1_chunk_bytes,
    fused_path_settings,
)
from megatron_overlap.bench.measure import (
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
    sync,
    symm_workspace_bytes,
)
from megatron_overlap.bench.breakdown import (
    breakdown_table,
    host_breakdown,
    moe_layer_targets,
    profile_forwards,
)
from megatron_overlap.resource.solver import implementation_name
from megatron_overlap.symm import destroy_workspaces

SCHEMA = "megatron_overlap.layer/1"
"""`schema` field of every row; bump when a field changes meaning."""

DEFAULT_OUT = "results/bench_layer.jsonl"
GPU_MODELS = ("qwen3-30b-a3b", "deepseek-v2-lite", "qwen1.5-moe-a2.7b", "mixtral-8x7b",
              "phi-3.5-moe")
"""Default models on GPU: the fine-grained targets first (a run cut short keeps them)."""
CPU_DEFAULTS = {"models": ["tiny"], "seq_lengths": [32, 64], "warmup": 1, "iters": 2}
GPU_DEFAULTS = {"models": list(GPU_MODELS), "seq_lengths": [4096, 8192, 16384, 32768],
                "warmup": 3, "iters": 20}
VARIANTS = ("off", "on", "off-grouped", "off-te")

TOLERANCE = {
    # fp32: the same products summed in another order (pre-reduction before the return
    # all-to-all; a grouped GEMM's summation order); measured <= 5.1e-7 on CPU (prefill.py).
    "fp32": 1e-5,
    # bf16: the fused path rounds each pre-reduced routed sum once where Megatron rounds every
    # (token, expert) row and each bf16 add: a few bf16 roundings (unit roundoff 2^-9) of the
    # largest terms; measured 3.6e-3 .. 7.5e-3 on a first MoE layer (prefill.py TOLERANCE).
    # 2^-5 leaves 4x margin while a missing top-k term (0.73), a 10 % scale error or one wrong
    # row fails. Same bound for the grouped baselines (GEMM rounding only).
    "bf16": 2.0**-5,
}
"""Largest accepted max|variant - off| / max|off| of the layer output, by dtype. The router
sees the identical input in every variant, so no token changes experts between them."""


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------




def build_parser() -> argparse.ArgumentParser:
    """The launcher's argument parser (see `--help`)."""
    from megatron_overlap.config import BACKENDS

    parser = argparse.ArgumentParser(
        prog="bench_layer.py",
        description="Megatron MoELayer prefill forward: moe_gatherrs_overlap on vs flag-off "
        "baselines (same weights, same input).",
    )
    parser.add_argument("--model", nargs="+", default=None,
                        help="names in configs/models or YAML paths (default: tiny on CPU; "
                        f"{' '.join(GPU_MODELS)} on GPU)")
    parser.add_argument("--seq-lengths", type=_positive_int, nargs="+", default=None,
                        help="tokens per sequence (default 32 64 on CPU, 4096 8192 16384 "
                        "32768 on GPU)")
    parser.add_argument("--layouts", type=parse_layout, nargs="+", default=None,
                        help="epN, tpN (with sequence parallel) or tpXepY; world size must be "
                        "a multiple of TP * EP (default: ep<world> and tp<world>)")
    parser.add_argument("--baselines", nargs="+", choices=VARIANTS[:1] + VARIANTS[2:],
                        default=["off", "off-grouped", "off-te"],
                        help="flag-off variants ('off' always runs: weights and checks come "
                        "from it; 'off-te' is skipped where Transformer Engine is missing)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="moe_gatherrs_backend of the flag-on layer (default auto)")
    parser.add_argument("--prereduce", **PREREDUCE_ARGUMENT,
                        help="moe_gatherrs_prereduce of the flag-on layer: auto (default: "
                             "the resource manager picks direct or pre-reduced per call), on "
                             "(pre-reduced; Triton backend; also the bare flag) or off "
                             "(direct)")
    parser.add_argument("--fc1-impl", **FC1_IMPL_ARGUMENT)
    parser.add_argument("--bias-activation-fusion", **BIAS_ACTIVATION_FUSION_ARGUMENT)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="params and compute dtype (default: bf16 on GPU, fp32 on CPU)")
    parser.add_argument("--warmup", type=_non_negative_int, default=None,
                        help="untimed forwards of each variant per sequence length "
                        "(default 1 on CPU, 3 on GPU)")
    parser.add_argument("--iters", type=_positive_int, default=None,
                        help="timed forwards of each variant per sequence length "
                        "(default 2 on CPU, 20 on GPU)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"JSONL file rows are appended to (default {DEFAULT_OUT}; '' = none)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run (default auto: cuda if available)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="weight-init seed; inputs use seed + rank + seq (default 1234)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing each workload, profile one forward of 'on' and "
                             "'off-grouped' (torch.profiler, CPU + CUDA) and print rank 0's "
                             "top operators and kernels: where the layer's time goes")
    parser.add_argument("--host-breakdown", action="store_true",
                        help="after timing each workload, run --iters more forwards of every "
                             "variant with host timers on the layer's, dispatcher's and "
                             "experts' stages (and the flag-on 'mo.*' stages) and print the "
                             "host microseconds per stage, each the max over ranks (also in "
                             "the rows, host_breakdown_us): where a host-bound forward's "
                             "time goes")
    parser.add_argument("--cprofile", action="store_true",
                        help="after timing each workload, run --iters more forwards of 'on' "
                             "and 'off-grouped' under Python's cProfile and print rank 0's "
                             "functions by own host time: which Python code a host-bound "
                             "forward spends its time in")
    parser.add_argument("--alt-env", default="", metavar="VAR=VALUE", action=_Once,
                        help="also time the flag-on layer with $VAR set to VALUE (one of "
                             "the fused path's MEGATRON_OVERLAP_* variables, read per call, "
                             "e.g. MEGATRON_OVERLAP_TMA_STORE=0 at world 1), as variant "
                             "'on-alt': the same layer object, its forwards interleaved with "
                             "'on''s in one "
                             "process, so that the process's host speed is common to both "
                             "(rows 'on-alt' with alt_env and their own settings; the "
                             "report's speedups and targets leave them out). Not with "
                             "--profile, --host-breakdown or --cprofile")
    parser.add_argument("--trace-dir", default="",
                        help="with --profile: rank 0 also writes each profiled forward as a "
                             "chrome trace <model>_<layout>_<seq>_<variant>.json here (host "
                             "ranges 'mo.*' mark the flag-on stages)")
    return parser


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The checked command line plus what follows from it and the environment."""

    models: tuple[str, ...]
    seq_lengths: tuple[int, ...]
    layouts: tuple[tuple[int, int], ...]
    baselines: tuple[str, ...]
    backend: str
    dtype: str
    warmup: int
    iters: int
    out: str
    device: str
    seed: int
    world_size: int
    profile: bool = False
    trace_dir: str = ""
    prereduce: Union[bool, str] = "auto"
    host_breakdown: bool = False
    cprofile: bool = False
    fc1_impl: str = "auto"
    bias_activation_fusion: bool = False
    alt_env: tuple[str, str] | None = None
    """(variable, value) of the 'on-alt' variant (`--alt-env`), or None."""


ALT_ENV_VARIABLES = ("MEGATRON_OVERLAP_TMA_STORE", "MEGATRON_OVERLAP_TILE_CHOICE",
                     "MEGATRON_OVERLAP_TILE_LIST",
                     "MEGATRON_OVERLAP_FAST_LAUNCH", "MEGATRON_OVERLAP_FC1_CHUNK_MB",
                     "MEGATRON_OVERLAP_SOLVER", "MEGATRON_OVERLAP_HW_PROFILE",
                     "MEGATRON_OVERLAP_HOST_TABLES", "MEGATRON_OVERLAP_HOST_CACHE",
                     "MEGATRON_OVERLAP_HOST_SPLITS")
"""The variables `--alt-env` takes: those of the fused path, each read per call
(`megatron_overlap.config.check_environment` checks their values)."""

TRITON_ONLY_VARIABLES = ("MEGATRON_OVERLAP_TMA_STORE", "MEGATRON_OVERLAP_TILE_CHOICE",
                         "MEGATRON_OVERLAP_TILE_LIST",
                         "MEGATRON_OVERLAP_FAST_LAUNCH", "MEGATRON_OVERLAP_HOST_TABLES",
                         "MEGATRON_OVERLAP_HOST_CACHE")
"""Those of `ALT_ENV_VARIABLES` that only the Triton backend reads (on a CPU an A/B of them
compares the same code: `resolve_args` warns)."""


class _Once(argparse.Action):
    """An option that may be given once (a second value is refused, not silently kept)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None):
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)!r} "
                         f"and {values!r}); it takes one VAR=VALUE")
        setattr(namespace, self.dest, values)


def parse_alt_env(text: str, group_sizes: tuple[int, ...] = (1,)) -> tuple[str, str] | None:
    """`--alt-env VAR=VALUE` -> (VAR, VALUE); "" -> None.

    Args:
        text: the option's value.
        group_sizes: the TP x EP group sizes of the run's layouts (a setting whose effect
            depends on it, `MEGATRON_OVERLAP_TMA_STORE`'s default, is compared over all).

    Raises:
        ValueError: not VAR=VALUE, VAR not one of `ALT_ENV_VARIABLES`, VAR already set to
            VALUE or to a value of the same effect in every layout (`_effective_setting`:
            e.g. the default spelled out), or a value the fused path refuses
            (`megatron_overlap.config.check_environment` with it set).
    """
    if not text:
        return None
    var, sep, value = text.partition("=")
    if not sep or not var.startswith("MEGATRON_OVERLAP_"):
        raise ValueError(f"--alt-env {text!r}: expected MEGATRON_OVERLAP_<NAME>=<value>")
    if var not in ALT_ENV_VARIABLES:
        raise ValueError(f"--alt-env {text!r}: {var} is not a variable of the fused path; "
                         f"expected one of {', '.join(ALT_ENV_VARIABLES)}")
    if os.environ.get(var) == value:
        raise ValueError(f"--alt-env {text!r}: {var} is {value!r} already, so 'on-alt' "
                         "would run what 'on' runs; unset it or set another value for 'on'")
    from megatron_overlap.config import check_environment

    with alt_environment((var, value)):
        try:
            check_environment()
            alt = _effective_setting(var, group_sizes)
        except (ValueError, ImportError) as err:
            raise ValueError(f"--alt-env {text!r}: {err}") from None
    try:
        current = _effective_setting(var, group_sizes)
    except (ValueError, ImportError):
        current = None  # (the launch's own check reports the current value)
    if alt == current:
        if hasattr(current, "link_bandwidth_gbps"):
            shown = f"the hardware profile {current.name!r}"
        elif isinstance(current, tuple):  # a per-group-size setting (the GPU's epilogue)
            shown = "; ".join(f"{_name(var)} on the GPU at TP x EP group size {g}: {v!r}"
                              for g, v in zip(group_sizes, current))
        else:
            shown = repr(current)
        raise ValueError(f"--alt-env {text!r}: {var}={value!r} means what the current "
                         f"setting means ({shown}), so 'on-alt' would run what 'on' "
                         "runs; give another value")
    if (isinstance(current, tuple) and any(a == c for a, c in zip(alt, current))
            and int(os.environ.get("RANK", "0")) == 0):
        same = [g for g, a, c in zip(group_sizes, alt, current) if a == c]
        print(f"bench_layer: note: --alt-env {text!r}: at TP x EP group size "
              f"{', '.join(map(str, same))} it means what the current setting means, so "
              "those layouts' 'on-alt' rows repeat 'on'", file=sys.stderr)
    return var, value


def _elem_bytes(run: RunConfig) -> int:
    """Bytes per element of the run's `--dtype` (the rows' `tma_store`: the GEMM2 output
    rows' size)."""
    return (torch.bfloat16 if run.dtype == "bf16" else torch.float32).itemsize


def _name(var: str) -> str:
    """The `fused_path_settings` key of a MEGATRON_OVERLAP_* variable."""
    return var[len("MEGATRON_OVERLAP_"):].lower()


def _effective_setting(var: str, group_sizes: tuple[int, ...] = (1,)):
    """What the fused path makes of `var` now (`fused_path_settings` for each TP x EP group
    size in `group_sizes`, the FC1 chunk, the solver's name, the hardware profile): two
    values with the same effect compare equal (e.g. unset and the default)."""
    from megatron_overlap.resource.profile import load_profile

    name = _name(var)
    settings = [fused_path_settings(size) for size in group_sizes]
    if name in settings[0]:
        return tuple(s[name] for s in settings)
    if name == "fc1_chunk_mb":
        return fc1_chunk_bytes()
    if name == "solver":
        return implementation_name()
    return load_profile()  # MEGATRON_OVERLAP_HW_PROFILE


def resolve_args(args: argparse.Namespace, world_size: int) -> RunConfig:
    """Fill device-dependent defaults and check the layouts against the world size.

    Raises:
        ValueError: naming the bad option: a layout whose TP * EP does not divide the world
            size, `--device cuda` without CUDA, `--device cpu` with CUDA visible.
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
        raise ValueError("--device cpu: CUDA is visible; the CPU patches of Megatron refuse to "
                         "run then (hide the GPUs with CUDA_VISIBLE_DEVICES=)")
    layouts = args.layouts or list(dict.fromkeys([(1, world_size), (world_size, 1)]))
    for tp, ep in layouts:
        if world_size % (tp * ep):
            raise ValueError(f"--layouts tp{tp}ep{ep}: world size {world_size} is not a "
                             f"multiple of tp * ep = {tp * ep}")
    alt_env = parse_alt_env(args.alt_env, tuple(sorted({tp * ep for tp, ep in layouts})))
    if (alt_env is not None and alt_env[0] in TRITON_ONLY_VARIABLES and device == "cpu"
            and int(os.environ.get("RANK", "0")) == 0):
        print(f"bench_layer: note: --alt-env {alt_env[0]}: on the CPU the flag-on layer "
              "runs the reference backend, which does not read it; 'on-alt' runs the same "
              "code as 'on', so their difference is noise", file=sys.stderr)
    if alt_env is not None and (args.profile or args.host_breakdown or args.cprofile):
        raise ValueError("--alt-env times 'on-alt' only: run --profile, --host-breakdown or "
                         "--cprofile without it")
    if args.trace_dir and not args.profile:
        raise ValueError("--trace-dir writes the traces of --profile: add --profile")
    if args.trace_dir:
        try:  # now, not after the timing
            os.makedirs(args.trace_dir, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--trace-dir {args.trace_dir}: cannot create it "
                             f"({err.strerror})") from None
    defaults = CPU_DEFAULTS if device == "cpu" else GPU_DEFAULTS
    return RunConfig(
        models=tuple(dict.fromkeys(args.model or defaults["models"])),  # each once
        seq_lengths=tuple(dict.fromkeys(args.seq_lengths or defaults["seq_lengths"])),
        layouts=tuple(dict.fromkeys(layouts)),
        baselines=tuple(v for v in VARIANTS if v == "off" or v in args.baselines),
        backend=args.backend,
        prereduce=args.prereduce,
        dtype=args.dtype if args.dtype != "auto" else ("fp32" if device == "cpu" else "bf16"),
        warmup=defaults["warmup"] if args.warmup is None else args.warmup,
        iters=defaults["iters"] if args.iters is None else args.iters,
        out=args.out,
        device=device,
        seed=args.seed,
        world_size=world_size,
        profile=args.profile,
        trace_dir=args.trace_dir,
        host_breakdown=args.host_breakdown,
        cprofile=args.cprofile,
        fc1_impl=args.fc1_impl,
        bias_activation_fusion=args.bias_activation_fusion,
        alt_env=alt_env,
    )


def check_shape(shape: Any, tp: int, ep: int, seq_lengths: tuple[int, ...]) -> None:
    """Check that a model's MoE layer splits over a layout.

    Raises:
        ValueError: experts not divisible by EP, FFN widths by TP, a sequence length not by
            TP (sequence parallel) or longer than the model's `max_position_embeddings` (as
            `prefill.py`: a prefill the model cannot take).
    """
    for field, value, size, option in (
        ("num_moe_experts", shape.num_moe_experts, ep, "ep"),
        ("moe_ffn_hidden_size", shape.moe_ffn_hidden_size, tp, "tp"),
        ("moe_shared_expert_intermediate_size",
         shape.moe_shared_expert_intermediate_size or tp, tp, "tp"),
    ):
        if value % size:
            raise ValueError(f"--layouts {option}{size}: {shape.name}.{field}={value} is not "
                             f"divisible by {size}")
    for seq in seq_lengths:
        if seq % tp:
            raise ValueError(f"--seq-lengths {seq}: not divisible by tp {tp} (sequence parallel)")
        if seq > shape.max_position_embeddings:
            raise ValueError(f"--seq-lengths {seq}: longer than {shape.name}."
                             f"max_position_embeddings={shape.max_position_embeddings}")


# --------------------------------------------------------------------------------------
# Layouts and layers
# --------------------------------------------------------------------------------------


def layout_name(tp: int, ep: int, world_size: int) -> str:
    """E.g. "tp1/ep2/dp2/sp0" (as prefill.py)."""
    return f"tp{tp}/ep{ep}/dp{world_size // tp}/sp{int(tp > 1)}"


def init_layout(run: RunConfig, tp: int, ep: int) -> dict:
    """(Re)create Megatron's model-parallel groups for one layout and seed the RNGs.

    CPU: `tests.support.megatron_cpu` patches + `init_parallel_state` (test-support code by
    policy; only launchers import it). GPU: `initialize_model_parallel` +
    `model_parallel_cuda_manual_seed`, and with SP Megatron's torch norm allowed (no TE/apex
    there; only the shared experts' norm-free linears care, but the patch is harmless).

    Returns:
        {"rank", "tp_rank", "ep_rank", "dp_rank"} of this process.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        destroy_workspaces()
        ps.destroy_model_parallel()
    if run.device == "cpu":
        from tests.support.megatron_cpu import apply_cpu_patches, init_parallel_state

        apply_cpu_patches()
        init_parallel_state(tp, ep, seed=run.seed)
    else:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=tp,
                                     create_gloo_process_groups=False)
        torch.manual_seed(run.seed)  # the router weight is initialised on the CPU
        model_parallel_cuda_manual_seed(run.seed)
    return {
        "rank": dist.get_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
    }


def build_config(shape: Any, run: RunConfig, tp: int, ep: int, *, flag: bool, initialize: bool):
    """`GatherRSTransformerConfig` of one MoE layer of `shape` (num_layers 1)."""
    from megatron_overlap.megatron import GatherRSTransformerConfig
    from megatron_overlap.models import transformer_config_kwargs

    kwargs = transformer_config_kwargs(shape, num_layers=shape.first_k_dense_layers + 1)
    kwargs.update(num_layers=1, moe_layer_freq=1)
    bf16 = run.dtype == "bf16"
    return GatherRSTransformerConfig(
        **kwargs,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        sequence_parallel=tp > 1,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=run.device == "cpu",
        perform_initialization=initialize,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        moe_gatherrs_overlap=flag,
        moe_gatherrs_backend=run.backend,
        moe_gatherrs_prereduce=run.prereduce if flag else False,
        bias_activation_fusion=run.bias_activation_fusion,
    )


def build_layers(shape: Any, run: RunConfig, tp: int, ep: int,
                 device: torch.device) -> tuple[dict, dict]:
    """Every variant's MoE layer, same weights, on the device, in eval mode.

    Returns:
        ({variant: layer} in `VARIANTS` order, {variant: reason} of skipped baselines).

    Raises:
        RuntimeError: a strict state-dict load fails (a parameter-name break).
    """
    from megatron_overlap.bench import baselines
    from megatron_overlap.megatron import use_gatherrs_in_moe_spec

    experts = shape.num_moe_experts
    layers, skipped = {}, {}
    off = baselines.moe_spec("off", experts)(
        config=build_config(shape, run, tp, ep, flag=False, initialize=True), layer_number=1)
    if run.device == "cpu":
        from tests.support.megatron_cpu import init_expert_weights

        init_expert_weights(off, seed=run.seed, std=off.config.init_method_std)
    state = off.state_dict()
    layers["off"] = off
    cfg_plain = build_config(shape, run, tp, ep, flag=False, initialize=False)
    for variant in VARIANTS[1:]:
        if variant != "on" and variant not in run.baselines:
            continue
        if variant == "on":
            spec = use_gatherrs_in_moe_spec(baselines.moe_spec("off", experts))
            layer = spec(config=build_config(shape, run, tp, ep, flag=True, initialize=False),
                         layer_number=1)
            layer.load_state_dict(state, strict=True)
            layer.experts.fc1_impl = run.fc1_impl
        elif variant == "off-grouped":
            layer = baselines.moe_spec(variant, experts)(config=cfg_plain, layer_number=1)
            layer.load_state_dict(state, strict=True)
        else:  # off-te
            reason = baselines.te_unavailable_reason()
            if reason is None:
                try:
                    layer = _build_te_layer(shape, run, tp, ep, state)
                except Exception as err:  # noqa: BLE001 - recorded, never fatal
                    reason = f"building TEGroupedMLP failed: {type(err).__name__}: {err}"
            if reason is not None:
                skipped[variant] = reason
                continue
        layers[variant] = layer
    return {name: layer.to(device).eval() for name, layer in layers.items()}, skipped


def _build_te_layer(shape: Any, run: RunConfig, tp: int, ep: int, state: dict):
    """The "off-te" layer with the "off" weights (keys mapped; only `_extra_state` entries
    may be missing or unexpected). Untested here: no machine of ours has TE."""
    from megatron_overlap.bench import baselines

    config = build_config(shape, run, tp, ep, flag=False, initialize=False)
    config.moe_grouped_gemm = True
    layer = baselines.moe_spec("off-te", shape.num_moe_experts)(config=config, layer_number=1)
    mapped = baselines.sequential_to_te_state_dict(state, layer.num_local_experts)
    result = layer.load_state_dict(mapped, strict=False)
    bad = [k for k in (*result.missing_keys, *result.unexpected_keys)
           if not k.endswith("_extra_state")]
    if bad:
        raise RuntimeError(f"TEGroupedMLP state-dict keys do not match: {bad}")
    return layer


def make_input(shape: Any, run: RunConfig, tp: int, ranks: dict, seq: int,
               device: torch.device) -> torch.Tensor:
    """[S / TP, 1, H] hidden states (N(0, 1); sequence parallel: this rank's slice), the
    layer dtype, one generator per (rank, seq)."""
    gen = torch.Generator().manual_seed(run.seed + 7919 * (ranks["rank"] + 1) + seq)
    x = torch.randn(seq // tp, 1, shape.hidden_size, generator=gen)
    return x.to(dtype=torch.bfloat16 if run.dtype == "bf16" else torch.float32, device=device)


def fused_calls(layer: torch.nn.Module) -> int:
    """Fused-op launches of a flag-on layer so far (its dispatcher counts its plans)."""
    return layer.token_dispatcher.num_plans


# --------------------------------------------------------------------------------------
# One workload
# --------------------------------------------------------------------------------------


def time_workload(layers: dict, x: torch.Tensor, run: RunConfig, device: torch.device) -> dict:
    """Warm up, time `--iters` rounds of every variant, check agreement with "off". With
    `run.alt_env`, also the variant "on-alt": `layers["on"]` with the variable set around
    each of its forwards (`alt_environment`), in the same rounds.

    Returns:
        {"ms": {variant: [slowest rank's ms per round]}, "errors": {variant: `max_error`
        against "off"}, "fused_calls": launches of the fused op in a variant's timed rounds,
        "flag_on_state": {flag-on variant: (last_fc1, last_fc2_weight, plan, last_combine,
        last_tile) after its last forward} (`describe`, `make_rows`), and per
        variant, max over ranks: "fwd_extra_bytes", "peak_abs_bytes", "persistent_bytes",
        "param_bytes", "symm_workspace_bytes" (None on CPU but param_bytes)}.

    Raises:
        RuntimeError: the flag-on layer did not launch the fused op once per forward.
    """
    # 'on-alt' (--alt-env): the flag-on layer itself, each forward under the variable
    if run.alt_env is not None:
        layers = {**layers, "on-alt": layers["on"]}
    names = list(layers)
    envs = {name: run.alt_env if name == "on-alt" else None for name in names}
    timers = {name: Timer(device, flush_l2=True) for name in names}
    persistent = dict.fromkeys(names)

    def forward(name):
        with alt_environment(envs[name]):
            return layers[name](x)

    with torch.inference_mode():
        for i in range(run.warmup):
            for name in names:
                before = allocated_bytes(device)
                forward(name)
                if i == 0:
                    persistent[name] = max(0, allocated_bytes(device) - before)
        calls_before = fused_calls(layers["on"])
        for r in range(run.iters):
            for name in round_order(names, r):
                timers[name].measure(lambda name=name: forward(name))
        calls = fused_calls(layers["on"]) - calls_before
        expected = run.iters * (2 if run.alt_env is not None else 1)
        if calls != expected:
            raise RuntimeError(f"the flag-on layer launched the fused op {calls} times in "
                               f"{expected} timed forwards")
        outputs, flag_on_state = {}, {}
        for name in names:
            outputs[name] = forward(name)[0]
            if name in ("on", "on-alt"):  # what its own forward ran (`describe`)
                layer = layers[name]
                flag_on_state[name] = (layer.experts.last_fc1, layer.experts.last_fc2_weight,
                                       layer.token_dispatcher.plan,
                                       layer.token_dispatcher.last_combine,
                                       layer.token_dispatcher.last_tile)
        errors = {name: max_error(outputs[name], outputs["off"]) for name in names
                  if name != "off"}
    del outputs
    cuda = device.type == "cuda"

    def rank_max(values: dict) -> dict:
        keys = [k for k in names if values.get(k) is not None]
        maxima = reduce_max([float(values[k]) for k in keys], device) if keys else []
        out = dict.fromkeys(names)
        out.update({k: int(v) for k, v in zip(keys, maxima)})
        return out

    symm = symm_workspace_bytes() if cuda else 0
    return {
        "ms": {name: reduce_max(timers[name].times_ms(), device) for name in names},
        "host_ms": {name: reduce_max(timers[name].host_ms, device) for name in names},
        "errors": errors,
        "fused_calls": run.iters,  # per flag-on variant (checked above: on-alt as many again)
        "flag_on_state": flag_on_state,
        "param_bytes": rank_max({n: param_bytes(layers[n]) for n in names}),
        "fwd_extra_bytes": rank_max({n: timers[n].fwd_extra_bytes if cuda else None
                                     for n in names}),
        "peak_abs_bytes": rank_max({n: timers[n].peak_bytes if cuda else None for n in names}),
        "persistent_bytes": rank_max(persistent if cuda else {}),
        "symm_workspace_bytes": rank_max({n: (symm if n in ("on", "on-alt") else 0)
                                          if cuda else None for n in names}),
    }


def cprofile_workload(layers: dict, x: torch.Tensor, device: torch.device, title: str,
                      iters: int, row_limit: int = 30) -> str:
    """`iters` forwards of "on" and "off-grouped" (those present) under `cProfile`, each
    after the ranks line up; returns rank 0's `pstats` tables (functions by own time, then
    by cumulative time) per variant. Every rank runs the forwards (they hold collectives);
    the profiler's own overhead inflates every function call, so read shares, not
    absolute times."""
    import cProfile
    import pstats

    texts = []
    with torch.inference_mode():
        for name in ("on", "off-grouped"):
            if name not in layers:
                continue
            prof = cProfile.Profile()
            for _ in range(iters):
                sync(device)
                prof.enable()
                layers[name](x)
                prof.disable()
            sync(device)
            stats = pstats.Stats(prof).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
            rows = [(tt, ct, nc, f"{os.path.join(*f.split(os.sep)[-2:])}:{line}({fn})",
                     "megatron_overlap" in f or f"{os.sep}triton{os.sep}" in f)
                    for (f, line, fn), (cc, nc, tt, ct, _) in stats.items()]
            for order, col, ours in (("own", 0, False), ("cumulative", 1, False),
                                     ("own (megatron_overlap and triton only)", 0, True)):
                lines = [f"== cprofile {title} {name}: top {row_limit} by {order} time, "
                         f"us per forward ({iters} forwards)",
                         f"{'own':>9}{'cum':>9}{'calls':>7}  function"]
                picked = [r for r in rows if r[4] or not ours]
                for tt, ct, nc, where, _ in sorted(picked, key=lambda r: -r[col])[:row_limit]:
                    lines.append(f"{tt / iters * 1e6:9.1f}{ct / iters * 1e6:9.1f}"
                                 f"{nc / iters:7.1f}  {where}")
                texts.append("\n".join(lines))
    return "\n".join(texts)


def profile_workload(layers: dict, x: torch.Tensor, device: torch.device, title: str,
                     row_limit: int = 25, trace_prefix: str = "") -> str:
    """One profiled forward of the "on" and "off-grouped" variants (those present), after
    the timing (`megatron_overlap.bench.breakdown.profile_forwards`): rank 0's operator /
    kernel table per variant; with `trace_prefix`, rank 0 also writes
    `<trace_prefix>_<variant>.json` (chrome trace)."""
    return profile_forwards({name: (lambda layer=layers[name]: layer(x))
                             for name in ("on", "off-grouped") if name in layers},
                            device, title, row_limit, trace_prefix)


def describe(layers: dict, backend: str, te_version: str | None,
             flag_on_state: dict | None = None) -> dict:
    """{variant: (label, experts_impl)} after the variants ran (`baselines.label`); the
    flag-on variants from `flag_on_state` ({variant: (last_fc1, last_fc2_weight, plan,
    last_combine, last_tile)} after its own forward, `time_workload`) where given, else from the
    layer now."""
    from megatron_overlap.bench.baselines import label

    out = {}
    if flag_on_state and "on-alt" in flag_on_state:
        layers = {**layers, "on-alt": layers["on"]}
    for name, layer in layers.items():
        experts = layer.experts
        if name in ("on", "on-alt"):
            fc1, fc2_weight, plan = ((flag_on_state or {}).get(name) or (
                experts.last_fc1, experts.last_fc2_weight, layer.token_dispatcher.plan))[:3]
            plan_text = "-" if plan is None else f"{plan.num_comm_ctas} comm CTAs ({plan.source})"
            impl = f"{fc1}; FC2 in the fused op, weights {fc2_weight}"
            text = label("on", fc1=fc1, fc2_weight=fc2_weight, backend=backend, plan=plan_text)
        elif name == "off-grouped":
            impl = experts.last_impl
            text = label(name, impl=impl)
        elif name == "off-te":
            impl = f"TEGroupedMLP (Transformer Engine {te_version})"
            text = label(name, te_version=te_version)
        else:
            impl = "SequentialMLP loop (Megatron's)"
            text = label("off")
        out[name] = (text, impl)
    return out


def resolved_backend(run: RunConfig, layer_on: torch.nn.Module) -> str:
    """The backend the flag-on layer's fused op takes here (as its dispatcher decides).

    Raises:
        UsageError: `--backend triton` where the Triton kernels cannot run (says why).
    """
    import warnings

    from megatron.core import parallel_state as ps

    from megatron_overlap.ops import resolve_backend

    w2 = layer_on.experts.local_experts[0].linear_fc2.weight.detach().unsqueeze(0)
    h = w2.new_empty(0, w2.shape[2])
    group = ps.get_expert_tensor_and_model_parallel_group()
    group = group if dist.get_world_size(group) > 1 else None
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            return resolve_backend(run.backend, h, w2, group)
    except (RuntimeError, NotImplementedError) as err:
        raise UsageError(f"--backend {run.backend}: {err}") from err


def make_rows(result: dict, seq: int, info: dict, details: dict, run: RunConfig) -> list:
    """One row per variant of one workload (fields: `megatron_overlap.bench.make_report`)."""
    ms = result["ms"]
    p50 = {name: percentile(v, 50) for name, v in ms.items()}
    cuda = run.device == "cuda"
    rows = []
    alt_settings = {}
    if "on-alt" in ms:  # the settings its forwards ran with (info: the process's)
        with alt_environment(run.alt_env):
            alt_settings = {"fc1_chunk_bytes": fc1_chunk_bytes(),
                            **fused_path_settings(info["tp"] * info["ep"],
                                                  info["backend"] == "triton" and cuda,
                                                  info["hidden_size"] * _elem_bytes(run)),
                            "resource_solver": implementation_name()}
    for name, times in ms.items():
        flag_on = name in ("on", "on-alt")
        errors = result["errors"].get(name)
        agree = errors is None or (errors["max_rel_diff"] <= TOLERANCE[run.dtype]
                                   and errors["nonfinite"] == 0)
        own = None
        if cuda:
            own = own_peak(result["param_bytes"][name], result["symm_workspace_bytes"][name],
                           result["fwd_extra_bytes"][name])
        rows.append({
            "schema": SCHEMA,
            "benchmark": "layer",
            **info,
            **(alt_settings if name == "on-alt" else {}),
            "seq_length": seq,
            "tokens_per_rank": seq // info["tp"],
            "global_tokens": seq * info["dp"],
            "variant": name,
            "label": details[name][0],
            "experts_impl": details[name][1],
            "moe_gatherrs_overlap": flag_on,
            "backend": info["backend"] if flag_on else "megatron-alltoall",
            "fused_calls": result["fused_calls"] if flag_on else 0,
            # "direct" / "prereduced" / "reference": what its last combine ran
            "combine_mode": result["flag_on_state"][name][3] if flag_on else None,
            # the GEMM2 tile its last Triton combine ran (`TileConfig.name`; None: none ran)
            "gemm2_tile": (result["flag_on_state"][name][4].name
                           if flag_on and result["flag_on_state"][name][4] is not None
                           else None),
            # on-alt: the variable set around its forwards (--alt-env)
            "alt_env": "=".join(run.alt_env) if name == "on-alt" else None,
            "timing_order": TIMING_ORDER,
            "ms_p20": percentile(times, 20),
            "ms_p50": p50[name],
            "ms_p80": percentile(times, 80),
            "ms_mean": statistics.fmean(times),
            "ms_all": times,
            "host_ms_p50": percentile(result["host_ms"][name], 50),
            "host_breakdown_us": result.get("host_breakdown_us", {}).get(name),
            "tokens_per_s": seq * info["dp"] / (p50[name] / 1e3),
            "speedup_over_on": p50[name] / p50["on"],
            "param_bytes": result["param_bytes"][name],
            "symm_workspace_bytes": result["symm_workspace_bytes"][name],
            "fwd_extra_bytes": result["fwd_extra_bytes"][name],
            "persistent_bytes": result["persistent_bytes"][name],
            "peak_abs_bytes": result["peak_abs_bytes"][name],
            "own_peak_bytes": own,
            "peak_mem_gib": own / 2**30 if own is not None else None,
            "errors": errors,
            "max_rel_diff": errors["max_rel_diff"] if errors else 0.0,
            "tolerance": TOLERANCE[run.dtype],
            "criterion": f"max|x - off| / max|off| <= {TOLERANCE[run.dtype]:.1e}, all finite",
            "agree": agree,
        })
    return rows


def summary_line(rows: list) -> str:
    """One line per workload: p50 of every variant, t_variant / t_on, agreement."""
    first = rows[0]
    on = next(r for r in rows if r["variant"] == "on")
    parts = [f"{r['variant']} {r['ms_p50']:.3f} ms"
             + ("" if r["variant"] == "on" else f" (t/t_on {r['speedup_over_on']:.2f})")
             for r in rows]
    mem = ""
    off = next(r for r in rows if r["variant"] == "off")
    if on["own_peak_bytes"] and off["own_peak_bytes"]:
        mem = f"; own peak on/off {on['own_peak_bytes'] / off['own_peak_bytes'] - 1:+.1%}"
    bad = [r["variant"] for r in rows if not r["agree"]]
    return (f"layer {first['model']} {first['layout']} seq {first['seq_length']}: "
            + ", ".join(parts) + mem
            + ("; agree" if not bad else f"; DISAGREE: {bad}"))


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def benchmark(run: RunConfig, shapes: list, device: torch.device) -> int:
    """Every layout, model and sequence length; rank 0 prints and writes as it goes."""
    import gc

    from megatron_overlap.bench.measure import _version

    status = 0
    rank0 = dist.get_rank() == 0
    if rank0 and run.out:
        append_rows(run.out, [])  # an unwritable --out fails now
    env = environment(device)
    te_version = _version("transformer_engine")
    printed_skips = set()
    for tp, ep in run.layouts:
        ranks = init_layout(run, tp, ep)
        for shape in shapes:
            torch.manual_seed(run.seed)
            layers, skipped = build_layers(shape, run, tp, ep, device)
            if "off-te" in layers:  # never run by us (no TE anywhere): probe it first
                probe = make_input(shape, run, tp, ranks, run.seq_lengths[0], device)
                try:
                    with torch.inference_mode():
                        layers["off-te"](probe)
                except Exception as err:  # noqa: BLE001 - recorded as a skip, not fatal
                    skipped["off-te"] = f"TEGroupedMLP forward failed: {type(err).__name__}: {err}"
                    del layers["off-te"]
            for variant, reason in skipped.items():
                if rank0 and (variant, reason) not in printed_skips:
                    printed_skips.add((variant, reason))
                    print(f"skipping {variant}: {reason}", flush=True)
            backend = resolved_backend(run, layers["on"])
            info = {
                "model": shape.name,
                "layout": layout_name(tp, ep, run.world_size),
                "world_size": run.world_size, "tp": tp, "ep": ep, "dp": run.world_size // tp,
                "sequence_parallel": tp > 1, "micro_batch_size": 1, "dtype": run.dtype,
                "hidden_size": shape.hidden_size, "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
                "num_moe_experts": shape.num_moe_experts, "moe_router_topk": shape.moe_router_topk,
                "local_experts": shape.num_moe_experts // ep,
                "shared_expert_size": shape.moe_shared_expert_intermediate_size,
                "backend_requested": run.backend, "backend": backend,
                "prereduce": run.prereduce,
                "fc1_impl": run.fc1_impl,  # the flag-on experts' FC1 setting
                "bias_activation_fusion": run.bias_activation_fusion,
                "fc1_chunk_bytes": fc1_chunk_bytes(),
                # the fused path's variables: tma_store (the GEMM2 epilogue), tile_list,
                # host_tables, fast_launch, host_cache, host_splits
                # (tma_store: the epilogue of the flag-on GEMM2's default tile, false off the GPU
                # path; gemm2_tile: the tile its calls ran)
                **fused_path_settings(tp * ep, backend == "triton" and run.device == "cuda",
                                      shape.hidden_size * _elem_bytes(run)),
                "resource_solver": implementation_name(),  # the plan's solver: "cpp" | "python"
                "variants": list(layers), "skipped_baselines": skipped,
                "warmup": run.warmup, "iters": run.iters, "seed": run.seed, "l2_flush": True,
                **env,
            }
            rows = []
            for seq in run.seq_lengths:
                x = make_input(shape, run, tp, ranks, seq, device)
                # A fresh fused-op workspace per sequence length, as a run at this length
                # alone has (grown from a shorter length's, its receive buffer would carry
                # the 1/8 growth headroom into symm_workspace_bytes). Collective: every rank
                # runs the same lengths in the same order.
                destroy_workspaces()
                result = time_workload(layers, x, run, device)
                if run.host_breakdown:
                    result["host_breakdown_us"] = host_breakdown(
                        {name: (lambda layer=layer: layer(x), moe_layer_targets(layer))
                         for name, layer in layers.items()}, device, run.iters)
                    if rank0:
                        print(breakdown_table(result["host_breakdown_us"],
                                              f"{shape.name} {info['layout']} seq {seq}"),
                              flush=True)
                if run.cprofile:
                    text = cprofile_workload(layers, x, device,
                                             f"{shape.name} {info['layout']} seq {seq}",
                                             run.iters)
                    if rank0:
                        print(text, flush=True)
                if run.profile:
                    prefix = ""
                    if run.trace_dir:
                        os.makedirs(run.trace_dir, exist_ok=True)
                        prefix = os.path.join(run.trace_dir,
                                              f"{shape.name}_"
                                              f"{info['layout'].replace('/', '-')}_{seq}")
                    text = profile_workload(layers, x, device,
                                            f"{shape.name} {info['layout']} seq {seq}",
                                            trace_prefix=prefix)
                    if rank0:
                        print(text, flush=True)
                details = describe(layers, backend, te_version, result["flag_on_state"])
                new = make_rows(result, seq, info, details, run)
                rows += new
                if rank0:
                    print(summary_line(new), flush=True)
                    for row in new:
                        if not row["agree"]:
                            print(f"ERROR: {row['variant']} disagrees with off: "
                                  f"{row['errors']}", file=sys.stderr, flush=True)
            if not all(r["agree"] for r in rows):
                status = 1
            if rank0 and run.out:
                append_rows(run.out, rows)
            del layers
            gc.collect()
            destroy_workspaces()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank0 and run.out:
        print(f"rows appended to {run.out}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 agree, 1 disagree, 2 bad arguments)."""
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
            for tp, ep in run.layouts:
                check_shape(shape, tp, ep, run.seq_lengths)
            if run.device == "cpu":  # one MoE layer per variant ("on" and the baselines)
                from megatron_overlap.bench.baselines import te_unavailable_reason

                built = [b for b in run.baselines
                         if b != "off-te" or te_unavailable_reason() is None]
                check_host_memory(
                    approx_param_count(shape, moe_layer_only=True) * (4 if run.dtype == "fp32"
                                                                      else 2),
                    len(built) + 1, f"{shape.name} MoE layer")
        make_folder(args.out)  # the run proceeds: --out's folder now
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

            destroy_workspaces()
            ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
