"""Model shapes (configs/models/*.yaml) and their translation to Megatron-Core arguments.

Each YAML file describes one real MoE model as read from its Hugging Face ``config.json``
(the ``source`` field): attention layout, dense and per-expert FFN widths, expert count,
top-k, shared experts, and the few routing/normalization facts that change the numbers an
MoE layer computes. Parallel layout and dtype are not part of a shape; the caller adds them.

Shape symbols: H hidden size, F per-expert FFN width, E routed experts, K top-k.

Errors: every bad input (missing or unknown YAML key, wrong type, inconsistent values,
unknown model name) raises ``ValueError`` naming the field or key, the value and what was
expected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

__all__ = [
    "CONFIG_DIR",
    "ModelShape",
    "available_models",
    "gpt_model_kwargs",
    "load_model_shape",
    "transformer_config_kwargs",
]

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"
"""Directory of the shipped model YAMLs (``<repo>/configs/models``)."""

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
_ACTIVATIONS = ("swiglu",)
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_POSITIVE_INTS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "moe_ffn_hidden_size",
    "num_moe_experts",
    "moe_router_topk",
    "vocab_size",
    "max_position_embeddings",
)
_OPTIONAL_POSITIVE_INTS = ("kv_channels", "moe_shared_expert_intermediate_size")
_BOOLS = ("moe_shared_expert_gate", "moe_router_pre_softmax", "qk_layernorm", "add_qkv_bias")
_POSITIVE_FLOATS = ("rotary_base", "norm_epsilon")


@dataclass(frozen=True)
class ModelShape:
    """The shape of one MoE transformer, one field per YAML key.

    Raises:
        ValueError: a field has the wrong type or an inconsistent value (see ``__post_init__``).
    """

    name: str
    """Model name; equals the YAML file stem for the shipped configs."""
    source: str
    """URL of the ``config.json`` (or model card) the numbers were read from."""
    num_layers: int
    """Transformer layers in the full model (``num_hidden_layers``)."""
    hidden_size: int
    """H, the residual-stream width, in elements."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to ``num_attention_heads`` for MHA."""
    kv_channels: int | None
    """Head dim in elements; ``None`` means ``hidden_size // num_attention_heads``."""
    ffn_hidden_size: int
    """FFN width of the dense layers, in elements (Megatron needs it even with none)."""
    moe_ffn_hidden_size: int
    """F, the FFN width of one routed expert, in elements (before the SwiGLU doubling)."""
    num_moe_experts: int
    """E, routed experts per MoE layer."""
    moe_router_topk: int
    """K, routed experts chosen per token."""
    moe_shared_expert_intermediate_size: int | None
    """Total FFN width of all shared experts, in elements; ``None`` when there are none."""
    moe_shared_expert_gate: bool
    """Shared-expert output scaled by a per-token sigmoid gate (Qwen2-MoE)."""
    first_k_dense_layers: int
    """Leading layers with a dense FFN instead of MoE (DeepSeek ``first_k_dense_replace``)."""
    moe_router_pre_softmax: bool
    """Megatron routing semantics: True = softmax over all E, then top-K, weights used as
    they are; False = top-K of the logits, softmax over those K (= renormalized top-K)."""
    vocab_size: int
    """Tokenizer vocabulary, in tokens."""
    max_position_embeddings: int
    """Longest sequence the model card supports, in tokens."""
    rotary_base: float
    """RoPE theta."""
    normalization: str
    """``"RMSNorm"`` or ``"LayerNorm"``."""
    norm_epsilon: float
    """Epsilon of every norm."""
    activation: str
    """FFN activation; only ``"swiglu"`` (SiLU-gated linear unit)."""
    qk_layernorm: bool
    """Per-head norm on queries and keys (Qwen3)."""
    add_qkv_bias: bool
    """Bias on the Q/K/V projections."""
    router_note: str | None = None
    """Optional: how the model's own routing maps onto ``moe_router_pre_softmax``."""
    attention_note: str | None = None
    """Optional: where our attention differs from the model's (e.g. MLA approximated)."""
    mla: Mapping[str, int | None] | None = dataclasses.field(default=None, hash=False)
    """Optional: multi-head latent attention sizes, recorded only (keys ``_MLA_KEYS``)."""

    def __post_init__(self) -> None:
        for key in ("name", "source"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key}={value!r}: expected a non-empty string")
        for key in ("router_note", "attention_note"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key}={value!r}: expected a string or null")
        for key in _POSITIVE_INTS:
            _check_positive_int(key, getattr(self, key))
        for key in _OPTIONAL_POSITIVE_INTS:
            if getattr(self, key) is not None:
                _check_positive_int(key, getattr(self, key))
        for key in _BOOLS:
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: expected true or false")
        for key in _POSITIVE_FLOATS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"{key}={value!r}: expected a positive number (write floats as 1.0e-6; "
                    "YAML reads 1e-6 as a string)"
                )
        if not isinstance(self.first_k_dense_layers, int) or isinstance(
            self.first_k_dense_layers, bool
        ):
            raise ValueError(
                f"first_k_dense_layers={self.first_k_dense_layers!r}: expected an integer"
            )
        if not 0 <= self.first_k_dense_layers < self.num_layers:
            raise ValueError(
                f"first_k_dense_layers={self.first_k_dense_layers}: expected 0 <= value < "
                f"num_layers={self.num_layers} (at least one MoE layer)"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups={self.num_query_groups}: expected a divisor of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"kv_channels=None with hidden_size={self.hidden_size} not divisible by "
                f"num_attention_heads={self.num_attention_heads}: give kv_channels explicitly"
            )
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk}: expected <= "
                f"num_moe_experts={self.num_moe_experts}"
            )
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ValueError(
                "moe_shared_expert_gate=True: expected moe_shared_expert_intermediate_size "
                "to be set (a gate needs a shared expert)"
            )
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(
                f"normalization={self.normalization!r}: expected one of {_NORMALIZATIONS}"
            )
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: expected one of {_ACTIVATIONS}")
        if self.mla is not None:
            object.__setattr__(self, "mla", MappingProxyType(_checked_mla(self.mla)))

    @property
    def head_dim(self) -> int:
        """Attention head dim in elements: ``kv_channels`` or ``hidden_size // heads``."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads


_FIELDS = tuple(f.name for f in dataclasses.fields(ModelShape))
_OPTIONAL_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelShape) if f.default is not dataclasses.MISSING
)


def approx_param_count(shape: ModelShape, num_layers: int | None = None, *,
                       moe_layer_only: bool = False) -> int:
    """Parameters of a `GPTModel` with this shape and `num_layers` layers (default: the
    shape's; the first `first_k_dense_layers` dense, the rest MoE), or of one MoE layer
    alone (`moe_layer_only`: router, routed and shared experts). An estimate for sizing
    (within a few % for the shipped shapes): the weight matrices (gated FFNs: 3 matrices
    of H x width; attention: Q, K, V and the output projection; untied input and output
    embeddings), norms and biases left out; MLA counted as the plain attention this package
    builds.

    Raises:
        ValueError: num_layers < 1.
    """
    layers = shape.num_layers if num_layers is None else num_layers
    if layers < 1:
        raise ValueError(f"num_layers={layers}: expected >= 1")
    h = shape.hidden_size
    moe = (shape.num_moe_experts * 3 * h * shape.moe_ffn_hidden_size
           + shape.num_moe_experts * h
           + 3 * h * (shape.moe_shared_expert_intermediate_size or 0))
    if moe_layer_only:
        return moe
    hd = shape.head_dim
    attention = (h * shape.num_attention_heads * hd * 2
                 + h * shape.num_query_groups * hd * 2)
    dense = min(shape.first_k_dense_layers, layers)
    return (2 * shape.vocab_size * h + layers * attention
            + dense * 3 * h * shape.ffn_hidden_size + (layers - dense) * moe)


def _check_positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: expected a positive integer")


def _checked_mla(mla: Any) -> dict[str, int | None]:
    if not isinstance(mla, Mapping):
        raise ValueError(f"mla={mla!r}: expected a mapping with keys {_MLA_KEYS}")
    unknown = sorted(set(mla) - set(_MLA_KEYS))
    if unknown:
        raise ValueError(f"mla: unknown keys {unknown}; expected a subset of {_MLA_KEYS}")
    for key, value in mla.items():
        if value is not None:
            _check_positive_int(f"mla.{key}", value)
    return dict(mla)


def available_models(config_dir: str | Path | None = None) -> list[str]:
    """Names (file stems) of the ``*.yaml`` model shapes in ``config_dir``, sorted.

    Args:
        config_dir: directory to list; defaults to ``CONFIG_DIR`` (``<repo>/configs/models``).

    Raises:
        ValueError: ``config_dir`` is not a directory.
    """
    directory = CONFIG_DIR if config_dir is None else Path(config_dir)
    if not directory.is_dir():
        raise ValueError(f"config_dir={str(directory)!r}: expected a directory of *.yaml files")
    return sorted(p.stem for p in directory.glob("*.yaml"))


def load_model_shape(name_or_path: str | Path) -> ModelShape:
    """Load and validate one model shape.

    Args:
        name_or_path: a name from ``available_models()`` (e.g. ``"qwen3-30b-a3b"``) or the path
            of a YAML file (anything ending in ``.yaml``/``.yml`` or naming an existing file).

    Returns:
        The validated ``ModelShape``.

    Raises:
        ValueError: unknown name (the message lists the available ones), unreadable or
            non-mapping YAML, missing or unknown keys (named with the file), or a bad value.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix in (".yaml", ".yml") or path.is_file()):
        path = CONFIG_DIR / f"{text}.yaml"
        if not path.is_file():
            raise ValueError(
                f"model {text!r}: unknown; expected one of {available_models()} or a YAML path"
            )
    if not path.is_file():
        raise ValueError(f"model file {text!r}: does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of shape fields, got {type(data).__name__}")
    missing = sorted(set(_FIELDS) - set(_OPTIONAL_FIELDS) - set(data))
    unknown = sorted(set(data) - set(_FIELDS))
    if missing or unknown:
        raise ValueError(f"{path}: missing keys {missing}, unknown keys {unknown}")
    try:
        return ModelShape(**data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def transformer_config_kwargs(shape: ModelShape, *, num_layers: int | None = None) -> dict:
    """Keyword arguments for ``megatron.core...transformer_config.TransformerConfig``.

    Only model-shape fields; the caller adds the parallel layout (``tensor_model_parallel_size``,
    ``expert_model_parallel_size``, ``sequence_parallel``), dtypes and init options.

    Args:
        shape: the model shape.
        num_layers: build fewer layers than the full model (benchmarks); the first
            ``first_k_dense_layers`` stay dense, so it must exceed that count.

    Returns:
        A dict with num_layers, hidden_size, ffn_hidden_size, attention layout, MoE sizes,
        ``moe_layer_freq`` (1, or ``[0]*first_k_dense + [1]*rest``), normalization,
        ``gated_linear_unit=True`` + ``activation_func=F.silu`` (SwiGLU), no linear biases, and
        ``moe_token_dispatcher_type="alltoall"``.

    Raises:
        ValueError: ``num_layers`` is not an integer > ``first_k_dense_layers`` (and >= 1).
    """
    import torch.nn.functional as F  # noqa: N812 - Megatron's own spelling

    layers = shape.num_layers if num_layers is None else num_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"num_layers={num_layers!r}: expected an integer >= 1")
    if layers <= shape.first_k_dense_layers:
        raise ValueError(
            f"num_layers={layers}: expected > first_k_dense_layers="
            f"{shape.first_k_dense_layers} of {shape.name} (at least one MoE layer)"
        )
    dense = shape.first_k_dense_layers
    moe_layer_freq: int | list[int] = [0] * dense + [1] * (layers - dense) if dense else 1
    return {
        "num_layers": layers,
        "hidden_size": shape.hidden_size,
        "ffn_hidden_size": shape.ffn_hidden_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_query_groups": shape.num_query_groups,
        "kv_channels": shape.head_dim,
        "num_moe_experts": shape.num_moe_experts,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size,
        "moe_router_topk": shape.moe_router_topk,
        "moe_router_pre_softmax": shape.moe_router_pre_softmax,
        "moe_shared_expert_intermediate_size": shape.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": shape.moe_shared_expert_gate,
        "moe_layer_freq": moe_layer_freq,
        "moe_token_dispatcher_type": "alltoall",
        "normalization": shape.normalization,
        "layernorm_epsilon": float(shape.norm_epsilon),
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "qk_layernorm": shape.qk_layernorm,
        "add_bias_linear": False,
        "add_qkv_bias": shape.add_qkv_bias,
    }


def gpt_model_kwargs(shape: ModelShape) -> dict:
    """Keyword arguments for ``megatron.core.models.gpt.GPTModel`` besides config and spec.

    Returns:
        ``vocab_size``, ``max_sequence_length`` (= ``max_position_embeddings``, tokens),
        ``position_embedding_type="rope"`` and ``rotary_base`` (RoPE theta). RoPE scaling
        (YaRN, LongRoPE) is not modelled.
    """
    rotary_base = shape.rotary_base
    # GPTModel annotates rotary_base as int; keep integral thetas integral.
    if float(rotary_base).is_integer():
        rotary_base = int(rotary_base)
    return {
        "vocab_size": shape.vocab_size,
        "max_sequence_length": shape.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": rotary_base,
    }
