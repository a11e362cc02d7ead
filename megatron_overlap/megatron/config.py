"""The `moe_gatherrs_overlap` flag: config extension, checks and command-line arguments.

The flag is a separate boolean next to `moe_token_dispatcher_type="alltoall"` (which stays
as it is: Megatron compares it with `== "alltoall"` in several places). Everything here reads
the fields with `getattr(config, name, default)`, so a plain `TransformerConfig` (or the
`MLATransformerConfig` that `core_transformer_config_from_args` may build) works too once the
fields are set on it with `apply_gatherrs_args`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Union

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_overlap.bench.cli import float_in, positive_int
from megatron_overlap.config import (
    BACKENDS,
    DEFAULT_TIMEOUT_S,
    TIMEOUT_RANGE_S,
    PREREDUCE_ARGUMENT,
    GatherRSOptions,
)

FLAG = "moe_gatherrs_overlap"


@dataclass
class GatherRSTransformerConfig(TransformerConfig):
    """`TransformerConfig` with the fused GEMM2 + GatherRS combine options.

    With `moe_gatherrs_overlap=False` (the default) every module built from it behaves as
    stock Megatron-Core. With it on, MoE layers built by `megatron_overlap.megatron.specs`
    run their return path (FC2, un-permute + top-k combine, TP reduce-scatter, EP return
    all-to-all) as one fused operation.

    Raises:
        ValueError: the flag is on together with a setting the fused path does not support
            (see `validate_gatherrs_config`), or an option is out of range.
    """

    moe_gatherrs_overlap: bool = False
    """Run the MoE return path as one fused GEMM2 + GatherRS operation."""

    moe_gatherrs_backend: str = "auto"
    """`"auto"`, `"triton"` or `"reference"` (see `GatherRSOptions.backend`)."""

    moe_gatherrs_num_comm_ctas: Optional[int] = None
    """CTAs taking the remote-bound GEMM2 tiles first (`GatherRSOptions.num_comm_ctas`);
    `None`: the resource manager's choice per launch."""

    moe_gatherrs_timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on every GPU spin-wait of the fused kernels, in seconds (1e-6 to 1e6)."""

    moe_gatherrs_prereduce: Union[bool, str] = "auto"
    """The combine mode (`GatherRSOptions.prereduce`): "auto" (the resource manager picks
    direct or pre-reduced per call), True (pre-reduce each token's rows before they travel;
    Triton backend only) or False (direct)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        gatherrs_options(self)  # range checks of the options, flag on or off
        if gatherrs_enabled(self):
            validate_gatherrs_config(self)


def gatherrs_enabled(config: TransformerConfig) -> bool:
    """Whether the fused combine path is switched on for `config`.

    Raises:
        TypeError: the flag is set to something other than a bool (a string "false" would
            otherwise switch it on).
    """
    value = getattr(config, FLAG, False)
    if not isinstance(value, bool):
        raise TypeError(f"{FLAG}={value!r} must be a bool (True or False)")
    return value


def gatherrs_options(config: TransformerConfig) -> GatherRSOptions:
    """The `GatherRSOptions` that `config`'s `moe_gatherrs_*` fields describe.

    Raises:
        ValueError, TypeError: an option is out of range (see `GatherRSOptions`).
    """
    return GatherRSOptions(
        backend=getattr(config, "moe_gatherrs_backend", "auto"),
        num_comm_ctas=getattr(config, "moe_gatherrs_num_comm_ctas", None),
        timeout_s=getattr(config, "moe_gatherrs_timeout_s", DEFAULT_TIMEOUT_S),
        prereduce=getattr(config, "moe_gatherrs_prereduce", "auto"),
    )


def _unsupported(option: str, value, supported: str) -> ValueError:
    return ValueError(
        f"moe_gatherrs_overlap=True does not support {option}={value!r}; supported: {supported}"
    )


def validate_gatherrs_config(config: TransformerConfig) -> None:
    """Check that the fused combine path supports `config`.

    Raises:
        ValueError: naming the first unsupported option, its value and the supported values.
    """
    if config.num_moe_experts is None:
        raise _unsupported("num_moe_experts", None, "an MoE model (num_moe_experts >= 1)")
    if config.moe_token_dispatcher_type != "alltoall":
        raise _unsupported("moe_token_dispatcher_type", config.moe_token_dispatcher_type,
                           "'alltoall'")
    # Each of these must be off (False / None); the text says what is supported instead.
    must_be_off = (
        ("moe_pad_expert_input_to_capacity", "False (dropless, or capacity without padding)"),
        ("moe_router_padding_for_quantization", "False"),
        ("moe_shared_expert_overlap",
         "False (shared experts run unoverlapped and are added by the MoE layer)"),
        ("moe_latent_size", "None"),
        ("moe_permute_fusion", "False (the slots follow the unfused permute order)"),
        ("add_bias_linear", "False (an expert FC2 bias is not fused yet)"),
        ("fp8", "None (bf16, fp16 or fp32)"),
        ("fp4", "None (bf16, fp16 or fp32)"),
        ("overlap_dispatch_backward_with_experts_wgrad", "False"),
    )
    for option, supported in must_be_off:
        value = getattr(config, option, None)
        if value:
            raise _unsupported(option, value, supported)
    if getattr(config, "transformer_impl", "local") == "inference_optimized":
        raise _unsupported("transformer_impl", "inference_optimized",
                           "'local' or 'transformer_engine'")
    gatherrs_options(config)


def add_gatherrs_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`extra_args_provider` for Megatron-LM style launchers: adds `--moe-gatherrs-*`.

    Example: `pretrain(..., extra_args_provider=add_gatherrs_args)`, then
    `apply_gatherrs_args(config, args)` on the config the launcher built.
    """
    group = parser.add_argument_group("megatron_overlap", "fused GEMM2 + GatherRS MoE combine")
    group.add_argument("--moe-gatherrs-overlap", action="store_true",
                       help="Run the MoE return path as one fused GEMM2 + GatherRS operation.")
    group.add_argument("--moe-gatherrs-backend", choices=BACKENDS, default="auto",
                       help="Fused-path backend (default: auto).")
    group.add_argument("--moe-gatherrs-num-comm-ctas", type=positive_int, default=None,
                       help="Communication CTAs (default: chosen by the resource manager).")
    group.add_argument("--moe-gatherrs-timeout-s", type=float_in(*TIMEOUT_RANGE_S),
                       default=DEFAULT_TIMEOUT_S,
                       help="Bound on every GPU spin-wait, seconds.")
    group.add_argument("--moe-gatherrs-prereduce", **PREREDUCE_ARGUMENT,
                       help="Combine mode: auto (default: the resource manager picks direct "
                            "or pre-reduced per call), on (sum each token's rows before they "
                            "travel; Triton backend only; also the bare flag) or off "
                            "(direct).")
    return parser


def apply_gatherrs_args(config: TransformerConfig, args: argparse.Namespace) -> TransformerConfig:
    """Copy the parsed `--moe-gatherrs-*` arguments onto `config` and check them.

    Raises:
        ValueError, TypeError: see `validate_gatherrs_config` (only when the flag is on) and
            `GatherRSOptions`; ValueError if `args` lacks the fields. The config is left
            unchanged when it raises.
    """
    names = ("moe_gatherrs_overlap", "moe_gatherrs_backend", "moe_gatherrs_num_comm_ctas",
             "moe_gatherrs_timeout_s", "moe_gatherrs_prereduce")
    missing = [n for n in names if not hasattr(args, n)]
    if missing:
        raise ValueError(f"args lacks {missing}: parse the command line with "
                         "extra_args_provider=megatron_overlap.megatron.add_gatherrs_args")
    absent = object()
    saved = {n: getattr(config, n, absent) for n in names}
    try:
        for name in names:
            setattr(config, name, getattr(args, name))
        gatherrs_options(config)
        if gatherrs_enabled(config):
            validate_gatherrs_config(config)
    except (TypeError, ValueError):
        for name, value in saved.items():  # a rejected call leaves the config as it was
            if value is absent:
                delattr(config, name)
            else:
                setattr(config, name, value)
        raise
    return config
