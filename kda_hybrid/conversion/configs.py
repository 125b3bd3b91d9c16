"""Config side of the conversion. The common currency is an original Kimi-Linear config.json dict (1-based
`linear_attn_config` layer lists, Kimi key names): every source config is turned into one, the tensor
inventory is computed from it, and every target config is built from it."""

from __future__ import annotations

import json
from pathlib import Path

from .layout import ConversionError

KIMI_LINEAR, TRANSFORMERS, KDA_HYBRID = "kimi_linear", "transformers", "kda_hybrid"
SOURCE_FORMATS = (KIMI_LINEAR, TRANSFORMERS, KDA_HYBRID)
TARGET_FORMATS = (KDA_HYBRID, KIMI_LINEAR)

# Keys that describe a file, not the architecture; never passed from one format's config to another's.
_FILE_KEYS = ("auto_map", "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
              "dtype")

# Names only a transformers-native kimi_linear checkpoint uses (fused or moved tensors).
_NATIVE_MARKERS = (".self_attn.conv1d.weight", ".self_attn.forget_gate.", ".mlp.experts.gate_up_proj",
                   ".mlp.experts.down_proj", ".mlp.gate.weight")


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None


def detect_format(config: dict, tensor_names) -> str:
    """Which naming a checkpoint uses: ours, transformers' native one, or the original Hub one."""
    if config.get("model_type") == KDA_HYBRID:
        return KDA_HYBRID
    if config.get("model_type") != "kimi_linear":
        raise ConversionError(f"config.json: model_type {config.get('model_type')!r} is not a Kimi Linear model "
                              f"(expected 'kimi_linear' or '{KDA_HYBRID}')")
    if any(marker in name for name in tensor_names for marker in _NATIVE_MARKERS):
        return TRANSFORMERS
    # transformers writes its own keys (layer_types, mlp_layer_types, linear_num_heads) into config.json;
    # the original remote-code config has only linear_attn_config.
    if "layer_types" in config or "mlp_layer_types" in config or "linear_num_heads" in config:
        return TRANSFORMERS
    return KIMI_LINEAR


def native_to_kimi_dict(native: dict) -> dict:
    """A transformers-native KimiLinearConfig (as a config.json dict) -> an original Kimi-Linear dict.

    Parsed with transformers' own `KimiLinearConfig` so its defaults and key aliases apply, then rewritten
    from its attributes: layer_types -> 1-based `linear_attn_config` lists, mlp_layer_types ->
    `first_k_dense_replace`, num_local_experts / num_experts_per_tok / n_shared_experts / norm_topk_prob /
    n_group -> num_experts / num_experts_per_token / num_shared_experts / moe_renormalize / num_expert_group.
    """
    from transformers import KimiLinearConfig  # the config module only: no modeling code, no fla

    cfg = KimiLinearConfig(**{k: v for k, v in native.items() if k not in _FILE_KEYS})
    layer_types, mlp_types = list(cfg.layer_types), list(cfg.mlp_layer_types)
    bad = sorted({t for t in layer_types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ConversionError(f"config.json: layer_types entries must be linear_attention/full_attention, got {bad}")
    n_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    if any(t != "sparse" for t in mlp_types[n_dense:]):
        raise ConversionError("config.json: mlp_layer_types must be some 'dense' layers followed only by 'sparse' "
                              f"ones (Kimi's first_k_dense_replace), got {mlp_types}")
    if cfg.attention_bias:
        raise ConversionError("config.json: attention_bias=True has no Kimi Linear equivalent")
    out = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "initializer_range": cfg.initializer_range,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": cfg.use_cache,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,  # transformers' native MLA never rotates (NoPE)
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
            "head_dim": cfg.linear_head_dim,
            "num_heads": cfg.linear_num_heads,
            "short_conv_kernel_size": cfg.linear_conv_kernel_dim,
        },
        "num_experts": cfg.num_local_experts,
        "num_experts_per_token": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": n_dense,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": cfg.norm_topk_prob,
        "moe_router_activation_func": "sigmoid",
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": cfg.n_group,
        "topk_group": cfg.topk_group,
    }
    return out


def source_to_kimi_dict(config: dict, source_format: str) -> dict:
    """The source's config.json as an original Kimi-Linear dict, whatever its format."""
    if source_format == KIMI_LINEAR:
        if "linear_attn_config" not in config:
            raise ConversionError("config.json: an original Kimi-Linear config needs 'linear_attn_config'")
        return dict(config)
    if source_format == TRANSFORMERS:
        return native_to_kimi_dict(config)
    from ..configuration_kda_hybrid import KDAHybridConfig

    ours = KDAHybridConfig(**{k: v for k, v in config.items() if k not in _FILE_KEYS})
    try:
        return ours.to_kimi_linear_dict()
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def source_router_semantics(config: dict, source_format: str) -> bool:
    """Default `router_weights_from_biased_scores` for a source: what its reference implementation does."""
    if source_format == KIMI_LINEAR:
        return True  # Moonshot's modeling_kimi.py gathers weights from the bias-corrected scores
    if source_format == TRANSFORMERS:
        return False  # transformers' KimiLinearTopkRouter (and vLLM) gather from the unbiased scores
    return bool(config.get("router_weights_from_biased_scores", False))


def kda_hybrid_config(kimi: dict, *, router_weights_from_biased_scores: bool, dtype: str | None):
    """Our `KDAHybridConfig` for a Kimi-Linear dict."""
    from ..configuration_kda_hybrid import KDAHybridConfig

    args = {k: v for k, v in kimi.items() if k not in _FILE_KEYS}
    if "model_max_length" in args:  # the Hub config's name for the context limit
        args.setdefault("max_position_embeddings", args.pop("model_max_length"))
    try:
        config = KDAHybridConfig(**args, router_weights_from_biased_scores=router_weights_from_biased_scores)
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json: {err}") from None
    config.architectures = ["KDAHybridForCausalLM"]
    if dtype is not None:
        config.dtype = dtype
    return config


def kimi_linear_config(kimi: dict, *, source_config: dict, source_format: str, dtype: str | None) -> dict:
    """The original-format config.json to write: the source's own when it is already original, else `kimi`."""
    out = dict(source_config) if source_format == KIMI_LINEAR else dict(kimi)
    out.setdefault("architectures", ["KimiLinearForCausalLM"])
    out["model_type"] = "kimi_linear"
    if dtype is not None:
        out.pop("dtype", None)
        out["torch_dtype"] = dtype
    return out
