"""Command-line arguments and spec rewriting of the Megatron integration (single process)."""

from __future__ import annotations

import argparse
import functools

import pytest
import torch.nn.functional as F


def _config(**overrides):
    from megatron_overlap.megatron import GatherRSTransformerConfig

    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                  num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                  use_cpu_initialization=True)
    kwargs.update(overrides)
    return GatherRSTransformerConfig(**kwargs)


def test_command_line_arguments():
    from megatron_overlap.megatron import add_gatherrs_args, apply_gatherrs_args

    parser = add_gatherrs_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.moe_gatherrs_overlap, args.moe_gatherrs_backend) == (False, "auto")
    args = parser.parse_args(["--moe-gatherrs-overlap", "--moe-gatherrs-backend", "reference",
                              "--moe-gatherrs-num-comm-ctas", "24",
                              "--moe-gatherrs-timeout-s", "5"])
    config = apply_gatherrs_args(_config(), args)
    assert config.moe_gatherrs_overlap is True
    assert (config.moe_gatherrs_backend, config.moe_gatherrs_num_comm_ctas) == ("reference", 24)
    assert config.moe_gatherrs_timeout_s == 5.0
    assert config.moe_gatherrs_prereduce == "auto"  # the default: the resource manager's
    for text, value in (("on", True), ("off", False), ("auto", "auto")):
        pre = parser.parse_args(["--moe-gatherrs-overlap", "--moe-gatherrs-prereduce", text])
        assert apply_gatherrs_args(_config(), pre).moe_gatherrs_prereduce == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-gatherrs-prereduce", "yes"])
    bare = parser.parse_args(["--moe-gatherrs-overlap", "--moe-gatherrs-prereduce"])
    assert apply_gatherrs_args(_config(), bare).moe_gatherrs_prereduce is True  # as before
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-gatherrs-backend", "cuda"])
    # Out-of-range values are refused when parsed (argparse: exit 2, value named) ...
    for flag, text in (("--moe-gatherrs-num-comm-ctas", "0"), ("--moe-gatherrs-num-comm-ctas",
                                                                "-1"),
                       ("--moe-gatherrs-num-comm-ctas", "x"), ("--moe-gatherrs-timeout-s", "0"),
                       ("--moe-gatherrs-timeout-s", "nan"), ("--moe-gatherrs-timeout-s", "inf")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-gatherrs-overlap", flag, text])
    # ... and by apply_gatherrs_args for a Namespace made otherwise.
    bad = parser.parse_args(["--moe-gatherrs-overlap"])
    bad.moe_gatherrs_num_comm_ctas = 0
    with pytest.raises(ValueError, match="moe_gatherrs_num_comm_ctas=0"):
        apply_gatherrs_args(_config(), bad)
    # Flag on from the command line still checks the rest of the config.
    on = parser.parse_args(["--moe-gatherrs-overlap"])
    with pytest.raises(ValueError, match="add_bias_linear"):
        apply_gatherrs_args(_config(add_bias_linear=True), on)
    # A rejected call leaves the config as it was; a Namespace without the fields is named.
    config = _config()
    nan = parser.parse_args(["--moe-gatherrs-overlap"])
    nan.moe_gatherrs_timeout_s = float("nan")
    with pytest.raises(ValueError, match="timeout"):
        apply_gatherrs_args(config, nan)
    assert config.moe_gatherrs_overlap is False and config.moe_gatherrs_timeout_s == 30.0
    with pytest.raises(ValueError, match="add_gatherrs_args"):
        apply_gatherrs_args(config, argparse.Namespace())
    # Also on Megatron's own TransformerConfig, which has none of the fields before.
    from megatron.core.transformer import TransformerConfig

    plain = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                              use_cpu_initialization=True)
    with pytest.raises(ValueError, match="timeout"):
        apply_gatherrs_args(plain, nan)
    assert not any(hasattr(plain, n) for n in ("moe_gatherrs_overlap", "moe_gatherrs_backend",
                                                "moe_gatherrs_num_comm_ctas",
                                                "moe_gatherrs_timeout_s",
                                                "moe_gatherrs_prereduce"))


def test_decoder_block_spec_takes_megatrons_arguments():
    from megatron_overlap.megatron import GatherRSMoELayer, get_gpt_decoder_block_spec

    config = _config()
    for spec in (get_gpt_decoder_block_spec(config, pp_rank=0),
                 get_gpt_decoder_block_spec(config, False, pp_rank=0),  # Megatron's form
                 get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)):
        assert all(s.submodules.mlp.func is GatherRSMoELayer for s in spec.layer_specs)


def test_spec_rewriting():
    from megatron.core.models.gpt import gpt_layer_specs as stock
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_overlap.megatron import (
        GatherRSMoELayer,
        GatherRSSequentialMLP,
        use_gatherrs_in_moe_spec,
        use_gatherrs_in_spec,
    )

    config = _config(moe_layer_freq=[0, 1])  # a dense layer stays dense
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = stock.get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
    block = TransformerBlockSubmodules(layer_specs=layers)
    rewritten = use_gatherrs_in_spec(block)
    mlps = [s.submodules.mlp for s in rewritten.layer_specs]
    assert not (isinstance(mlps[0], functools.partial) and mlps[0].func is GatherRSMoELayer)
    assert mlps[1].func is GatherRSMoELayer
    assert mlps[1].keywords["submodules"].experts.func is GatherRSSequentialMLP
    # The input is untouched, and rewriting twice is the same as once.
    assert block.layer_specs[1].submodules.mlp.func is MoELayer
    again = use_gatherrs_in_spec(rewritten)
    assert again.layer_specs[1].submodules.mlp.func is GatherRSMoELayer
    # The older ModuleSpec form of an MoE spec.
    moe = block.layer_specs[1].submodules.mlp
    old = ModuleSpec(module=MoELayer, submodules=moe.keywords["submodules"])
    assert use_gatherrs_in_moe_spec(old).module is GatherRSMoELayer
    with pytest.raises(TypeError, match="cannot rewrite"):
        use_gatherrs_in_spec(42)
    te_like = functools.partial(MoELayer, submodules=type(moe.keywords["submodules"])(
        experts=functools.partial(dict)))
    with pytest.raises(ValueError, match="SequentialMLP experts"):
        use_gatherrs_in_moe_spec(te_like)
