"""Model shape YAMLs: they load, match the model cards, and build a Megatron TransformerConfig."""

from pathlib import Path

import pytest
import yaml

from megatron_overlap.models import (
    CONFIG_DIR,
    ModelShape,
    available_models,
    gpt_model_kwargs,
    load_model_shape,
    transformer_config_kwargs,
)

REAL_MODELS = [
    "deepseek-v2-lite",
    "mixtral-8x7b",
    "phi-3.5-moe",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
]
_DROP = object()  # marks a key to delete in _write


def test_all_models_listed():
    assert available_models() == sorted(REAL_MODELS + ["tiny"])


@pytest.mark.parametrize("name", available_models())
def test_every_yaml_loads_and_names_itself(name):
    shape = load_model_shape(name)
    assert shape.name == name
    if name in REAL_MODELS:
        assert shape.source.startswith("https://huggingface.co/")


@pytest.mark.parametrize(
    "name, expected",
    [
        # Values from each model's config.json (the YAML `source`).
        (
            "mixtral-8x7b",
            dict(
                hidden_size=4096,
                num_layers=32,
                moe_ffn_hidden_size=14336,
                num_moe_experts=8,
                moe_router_topk=2,
                num_query_groups=8,
                moe_shared_expert_intermediate_size=None,
            ),
        ),
        (
            "qwen1.5-moe-a2.7b",
            dict(
                hidden_size=2048,
                num_layers=24,
                moe_ffn_hidden_size=1408,
                num_moe_experts=60,
                moe_router_topk=4,
                moe_shared_expert_intermediate_size=5632,
                moe_shared_expert_gate=True,
                moe_router_pre_softmax=True,
            ),
        ),
        (
            "phi-3.5-moe",
            dict(
                hidden_size=4096,
                num_layers=32,
                moe_ffn_hidden_size=6400,
                num_moe_experts=16,
                moe_router_topk=2,
                vocab_size=32064,
                normalization="LayerNorm",
            ),
        ),
        (
            "qwen3-30b-a3b",
            dict(
                hidden_size=2048,
                num_layers=48,
                moe_ffn_hidden_size=768,
                num_moe_experts=128,
                moe_router_topk=8,
                num_attention_heads=32,
                num_query_groups=4,
                kv_channels=128,
                qk_layernorm=True,
            ),
        ),
        (
            "deepseek-v2-lite",
            dict(
                hidden_size=2048,
                num_layers=27,
                moe_ffn_hidden_size=1408,
                num_moe_experts=64,
                moe_router_topk=6,
                moe_shared_expert_intermediate_size=2 * 1408,
                first_k_dense_layers=1,
                ffn_hidden_size=10944,
                vocab_size=102400,
            ),
        ),
    ],
)
def test_shapes_match_model_cards(name, expected):
    shape = load_model_shape(name)
    assert {key: getattr(shape, key) for key in expected} == expected


def test_deepseek_records_mla():
    shape = load_model_shape("deepseek-v2-lite")
    assert shape.mla["kv_lora_rank"] == 512 and shape.mla["q_lora_rank"] is None
    assert "Latent Attention" in shape.attention_note


@pytest.mark.parametrize("name", available_models())
def test_transformer_config_constructs(name):
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = load_model_shape(name)
    kwargs = transformer_config_kwargs(shape, num_layers=2)
    config = TransformerConfig(**kwargs, tensor_model_parallel_size=1, use_cpu_initialization=True)
    assert config.num_moe_experts == shape.num_moe_experts
    assert config.kv_channels == shape.head_dim
    assert config.moe_layer_freq == ([0, 1] if shape.first_k_dense_layers else 1)
    assert gpt_model_kwargs(shape)["vocab_size"] == shape.vocab_size


def test_full_depth_moe_layer_freq():
    kwargs = transformer_config_kwargs(load_model_shape("deepseek-v2-lite"))
    assert kwargs["moe_layer_freq"] == [0] + [1] * 26


def _write(tmp_path: Path, **changes) -> Path:
    """tiny.yaml with `changes` applied, written to tmp_path/bad.yaml."""
    data = yaml.safe_load((CONFIG_DIR / "tiny.yaml").read_text())
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not _DROP}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_explicit_path_loads(tmp_path):
    assert load_model_shape(_write(tmp_path)).hidden_size == 64
    assert load_model_shape(str(_write(tmp_path))).num_moe_experts == 8


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(hidden_size=_DROP), ["missing", "hidden_size", "bad.yaml"]),
        (dict(hiden_size=64), ["unknown", "hiden_size", "bad.yaml"]),
        (dict(moe_router_topk=9), ["moe_router_topk=9", "num_moe_experts=8"]),
        (dict(num_query_groups=3), ["num_query_groups=3"]),
        (dict(kv_channels=None, hidden_size=66), ["kv_channels", "hidden_size=66"]),
        (dict(normalization="BatchNorm"), ["normalization", "BatchNorm"]),
        (dict(norm_epsilon="1e-6"), ["norm_epsilon", "1e-6"]),
        (dict(num_moe_experts=0), ["num_moe_experts=0"]),
        (dict(vocab_size=True), ["vocab_size=True"]),
        (dict(first_k_dense_layers=2), ["first_k_dense_layers=2", "num_layers=2"]),
        (
            dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=True),
            ["moe_shared_expert_gate"],
        ),
        (dict(mla={"kv_rank": 1}), ["mla", "kv_rank"]),
    ],
)
def test_bad_yaml_names_the_field(tmp_path, changes, words):
    with pytest.raises(ValueError) as err:
        load_model_shape(_write(tmp_path, **changes))
    for word in words:
        assert word in str(err.value)


def test_unknown_name_lists_available():
    with pytest.raises(ValueError) as err:
        load_model_shape("mixtral-8x22b")
    assert "mixtral-8x22b" in str(err.value) and "qwen3-30b-a3b" in str(err.value)


@pytest.mark.parametrize("num_layers", [0, -1, 1.5, True])
def test_bad_num_layers(num_layers):
    with pytest.raises(ValueError, match="num_layers"):
        transformer_config_kwargs(load_model_shape("tiny"), num_layers=num_layers)


def test_num_layers_must_leave_a_moe_layer():
    with pytest.raises(ValueError, match="first_k_dense_layers=1"):
        transformer_config_kwargs(load_model_shape("deepseek-v2-lite"), num_layers=1)


def test_shape_is_frozen():
    shape = load_model_shape("tiny")
    with pytest.raises(AttributeError):
        shape.hidden_size = 128  # type: ignore[misc]
    assert isinstance(shape, ModelShape)
