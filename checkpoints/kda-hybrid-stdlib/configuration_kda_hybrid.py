"""Configuration of KDA hybrid models (the Kimi Linear and Kimi K3 architectures): KDA layers with a few
full-attention layers, dense or DeepSeek-V3-style MoE MLPs, and K3's switches (bounded decay gate, full-rank output
gates, SiTU-GLU, latent MoE, MXFP4 experts, Block Attention Residuals). The one reader and writer of Kimi-Linear and
Kimi-K3 config.json files: it takes an original one as is (and transformers-native key names), and
`to_kimi_linear_dict()` / `to_kimi_k3_dict()` write one back."""

from __future__ import annotations

import functools
import inspect
import math

from transformers import PretrainedConfig

LINEAR = "linear_attention"
FULL = "full_attention"

# The largest KDA head dim the Triton kernels take: kda_triton_fwd.MAX_HEAD_DIM (they hold a head's K = V in one
# register tile). Checked here so a config that cannot run on GPU fails at construction, not in a kernel launch.
MAX_LINEAR_HEAD_DIM = 256

# Other names of our fields: Kimi-Linear's config.json (Moonshot's remote code) and transformers' native
# KimiLinearConfig. Read by __init__, readable as attributes (attribute_map), written back by to_kimi_linear_dict.
ALIASES = {
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
    "num_local_experts": "num_experts",
    "linear_conv_kernel_dim": "linear_conv_kernel_size",
}
# Keys of a Kimi-Linear config.json (or transformers-native one) with no field of their own: checked, then
# dropped. Anything they could change is either the only value this model implements or refused.
KIMI_ONLY_KEYS = (
    "linear_attn_config", "mlp_layer_types", "moe_router_activation_func", "mla_use_nope", "moe_layer_freq",
    "use_grouped_topk", "num_expert_group", "n_group", "topk_group", "num_nextn_predict_layers", "topk_method",
    "model_type",
)
# An original config.json (with linear_attn_config) means what Moonshot's configuration_kimi.py makes of it:
# keys that decide tensor shapes must be present (its defaults are None or another model's), the rest default
# as there.
_KIMI_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_KIMI_MOE_REQUIRED = ("moe_intermediate_size", "num_experts_per_token")
_KIMI_DEFAULTS = {
    "first_k_dense_replace": 0, "num_shared_experts": 0, "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6,
    "moe_renormalize": True, "q_lora_rank": None, "num_experts": None, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "mla_use_nope": False,
}

# K3 keys of linear_attn_config, read into our fields
_KIMI_LAC_FIELDS = {"use_full_rank_gate": "use_full_rank_gate", "gate_lower_bound": "gate_lower_bound"}
_LAC_KEYS = {"kda_layers", "full_attn_layers", "head_dim", "num_heads", "short_conv_kernel_size", *_KIMI_LAC_FIELDS}
# Keys an original config.json carries that describe no architecture: transformers' (4.x and 5.x) generic
# PretrainedConfig attributes and generation defaults as serialised by Moonshot's files. An original config with a key
# that is neither one of these nor read by this class is refused, naming it: a K3 switch this class did not know would
# otherwise be stored as an attribute and silently ignored by the model.
GENERIC_KEYS = frozenset((
    "_name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "label2id", "is_decoder", "is_encoder_decoder", "length_penalty", "max_length",
    "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams", "num_return_sequences", "output_attentions",
    "output_hidden_states", "output_scores", "prefix", "problem_type", "pruned_heads", "remove_invalid_values",
    "repetition_penalty", "return_dict", "return_dict_in_generate", "sep_token_id", "suppress_tokens",
    "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k",
    "top_p", "torchscript", "typical_p", "use_bfloat16", "use_cache",
))
# Kimi K3's root config.json (model_type "kimi_k3"): the text backbone is its text_config; these root keys belong to
# the vision side or repeat the text config's, and are not part of a KDAHybridConfig (the converter lists the vision
# tensors it skips in its conversion record).
K3_ROOT_KEYS = ("vision_config", "media_placeholder_token_id", "image_placeholder", "ignore_index")
# The one quantisation K3 ships: compressed-tensors MXFP4 (E2M1 values, E8M0 scale per 32 inputs) on the routed
# experts only. Read into `expert_quantization="mxfp4"`; written back verbatim by to_kimi_k3_dict().
MXFP4 = "mxfp4"
MXFP4_GROUP = 32
K3_QUANTIZATION_IGNORE = (
    "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
    "re:.*vision_tower.*", "re:.*mm_projector.*",
)


def k3_quantization_config() -> dict:
    """K3's quantization_config (text_config), as released: MXFP4 routed experts, everything else bf16."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": MXFP4_GROUP, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    return {
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"], "weights": weights}},
        "format": "mxfp4-pack-quantized", "global_compression_ratio": None, "ignore": list(K3_QUANTIZATION_IGNORE),
        "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


def _expert_quantization_from(qc) -> str:
    """A config.json quantization_config -> expert_quantization; anything but K3's MXFP4 experts is refused (this
    model computes from no other stored format)."""
    if not isinstance(qc, dict):
        _fail("quantization_config", "a dict (K3's compressed-tensors MXFP4 experts)", qc)
    groups = qc.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()] if isinstance(groups, dict) else []
    problems = []
    if qc.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method={qc.get('quant_method')!r}")
    if qc.get("format") != "mxfp4-pack-quantized":
        problems.append(f"format={qc.get('format')!r}")
    if len(weights) != 1:
        problems.append(f"{len(weights)} config_groups")
    else:
        w = weights[0]
        for key, want in (("num_bits", 4), ("group_size", MXFP4_GROUP), ("type", "float"),
                          ("scale_dtype", "torch.uint8"), ("strategy", "group")):
            if w.get(key) != want:
                problems.append(f"weights.{key}={w.get(key)!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        problems.append(f"quantization_status={qc.get('quantization_status')!r}")
    if any(p not in (qc.get("ignore") or []) for p in K3_QUANTIZATION_IGNORE[:4]):
        problems.append(f"ignore={qc.get('ignore')!r} (must leave attention, shared experts, dense MLPs and lm_head "
                        "unquantised)")
    if problems:
        _fail("quantization_config", "K3's: compressed-tensors mxfp4-pack-quantized, 4-bit float, group_size 32, "
              "uint8 scales, on the routed experts only", "; ".join(problems))
    return MXFP4


# RoPE variants of transformers' ROPE_INIT_FUNCTIONS whose inverse frequencies are fixed at construction
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLA_ROPE = "None with attention_type='mla' (NoPE: no RoPE)"


def _fail(name, expected, got):
    raise ValueError(f"KDAHybridConfig: {name} must be {expected}, got {got!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _derived_head_dim(hidden_size, num_attention_heads):
    """head_dim when none is given: hidden_size // num_attention_heads (None when those are not positive ints)."""
    if _is_int(hidden_size) and _is_int(num_attention_heads) and num_attention_heads > 0:
        return hidden_size // num_attention_heads
    return None


def _layer_types_from_kimi(lac, num_hidden_layers) -> list[str]:
    """linear_attn_config's 1-based kda_layers / full_attn_layers -> 0-based layer_types."""
    if not isinstance(lac, dict) or "kda_layers" not in lac or "full_attn_layers" not in lac:
        _fail("linear_attn_config", "a dict with kda_layers and full_attn_layers (1-based)", lac)
    if not _is_int(num_hidden_layers) or num_hidden_layers <= 0:
        _fail("num_hidden_layers", "a positive int (linear_attn_config's layers are counted against it)",
              num_hidden_layers)
    layer_types: list[str | None] = [None] * num_hidden_layers
    for key, kind in (("kda_layers", LINEAR), ("full_attn_layers", FULL)):
        if not isinstance(lac[key], (list, tuple)):
            _fail(f"linear_attn_config.{key}", "a list of 1-based layer numbers", lac[key])
        for one_based in lac[key]:
            if not (_is_int(one_based) and 1 <= one_based <= num_hidden_layers):
                _fail(f"linear_attn_config.{key} entries", f"1-based ints in 1..{num_hidden_layers}", one_based)
            if layer_types[one_based - 1] is not None:
                raise ValueError(f"KDAHybridConfig: linear_attn_config must list each layer once, got layer "
                                 f"{one_based} (1-based) in both kda_layers and full_attn_layers")
            layer_types[one_based - 1] = kind
    missing = [i + 1 for i, t in enumerate(layer_types) if t is None]
    if missing:
        raise ValueError(f"KDAHybridConfig: linear_attn_config must put every layer 1..{num_hidden_layers} in "
                         f"kda_layers or full_attn_layers, got 1-based layers {missing} are in neither")
    return layer_types


def _read_kimi_keys(kwargs: dict) -> dict:
    """Our keyword arguments for a dict that may carry Kimi-Linear or transformers-native keys."""
    kw = dict(kwargs)
    if kw.get("model_type") == "kimi_k3" or "text_config" in kw:
        kw = _k3_text_config(kw)
    if "quantization_config" in kw:  # never left for transformers: its quantizers would take over loading
        qc = kw.pop("quantization_config")
        if qc is not None:
            quant = _expert_quantization_from(qc)
            if kw.get("expert_quantization") not in (None, quant):
                _fail("expert_quantization", f"{quant!r} (what quantization_config says) when both are given",
                      kw["expert_quantization"])
            kw["expert_quantization"] = quant
    lac = kw.get("linear_attn_config")
    if lac is not None:  # an original Kimi-Linear config.json: its layers, then its required keys and defaults
        _refuse_unknown_keys(kw)
        layer_types = _layer_types_from_kimi(lac, kw.get("num_hidden_layers"))
        missing = [k for k in ("head_dim", "num_heads", "short_conv_kernel_size") if k not in lac]
        if missing:
            _fail("linear_attn_config", "a dict with head_dim, num_heads and short_conv_kernel_size (Kimi-Linear has "
                  "no defaults for them)", f"{lac} without {missing}")
        if kw.get("layer_types") is not None and list(kw["layer_types"]) != layer_types:
            _fail("layer_types", f"{layer_types} (what linear_attn_config says) when both are given",
                  kw["layer_types"])
        kw["layer_types"] = layer_types
        for ours, key in (("linear_num_heads", "num_heads"), ("linear_head_dim", "head_dim"),
                          ("linear_conv_kernel_size", "short_conv_kernel_size")):
            given = kw.get(ours, kw.get("linear_conv_kernel_dim") if ours == "linear_conv_kernel_size" else None)
            if given is not None and given != lac[key]:
                _fail(ours, f"linear_attn_config.{key}={lac[key]!r} when both are given", given)
            kw[ours] = lac[key]
        kw.pop("linear_conv_kernel_dim", None)
        for key, ours in _KIMI_LAC_FIELDS.items():
            if key in lac:
                if ours in kw and kw[ours] != lac[key]:
                    _fail(ours, f"linear_attn_config.{key}={lac[key]!r} when both are given", kw[ours])
                kw[ours] = lac[key]
        absent = [k for k in _KIMI_REQUIRED if kw.get(k) is None]
        if kw.get("num_experts"):
            absent += [k for k in _KIMI_MOE_REQUIRED if kw.get(k, kw.get(ALIASES.get(k))) is None]
        if absent:
            _fail("a Kimi-Linear config (one with linear_attn_config)", "complete: these keys decide tensor shapes and "
                  "have no Kimi-Linear default", f"no {', '.join(absent)}")
        for key, default in _KIMI_DEFAULTS.items():
            if key not in kw and ALIASES.get(key) not in kw:
                kw[key] = default
        kw["attention_type"] = kw.get("attention_type", "mla")
        if kw["attention_type"] != "mla":
            _fail("attention_type", "'mla' for a Kimi-Linear config", kw["attention_type"])
    mlp_types = kw.pop("mlp_layer_types", None)
    if mlp_types is not None:  # transformers-native: some "dense" layers, then "sparse" ones
        n_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
        if any(t != "sparse" for t in mlp_types[n_dense:]):
            _fail("mlp_layer_types", "'dense' layers followed only by 'sparse' ones (Kimi's first_k_dense_replace)",
                  mlp_types)
        if kw.get("first_k_dense_replace") is not None and kw["first_k_dense_replace"] != n_dense and n_dense < len(
                mlp_types):
            _fail("first_k_dense_replace", f"{n_dense} (what mlp_layer_types says) when both are given",
                  kw["first_k_dense_replace"])
        kw["first_k_dense_replace"] = n_dense
    for alias, ours in ALIASES.items():
        if alias in kw:
            value = kw.pop(alias)
            # the Hub config carries model_max_length (the tokenizer's limit) beside max_position_embeddings
            if ours in kw and kw[ours] != value and alias != "model_max_length":
                _fail(ours, f"equal to {alias}={value!r} when both are given", kw[ours])
            kw.setdefault(ours, value)
    kimi = {k: kw.pop(k) for k in KIMI_ONLY_KEYS if k in kw}
    kw.pop("architectures_kimi", None)
    if kimi.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _fail("moe_router_activation_func", "'sigmoid' (the only router this model implements)",
              kimi["moe_router_activation_func"])
    if kimi.get("mla_use_nope", True) is not True:
        _fail("mla_use_nope", "True: full-attention layers are NoPE MLA here, RoPE MLA is not implemented"
              + (" (False is Kimi-Linear's default when the key is absent)" if "mla_use_nope" not in kwargs else ""),
              kimi["mla_use_nope"])
    groups = (kimi.get("num_expert_group", kimi.get("n_group", 1)), kimi.get("topk_group", 1))
    if groups != (1, 1):
        _fail("num_expert_group/topk_group", "1 (grouped top-k with one group is plain top-k)", groups)
    if kimi.get("model_type", "kimi_linear") not in ("kimi_linear", "kda_hybrid"):
        _fail("model_type", "'kda_hybrid' or 'kimi_linear'", kimi["model_type"])
    if kimi.get("topk_method", "noaux_tc") not in ("noaux_tc", None):
        _fail("topk_method", "'noaux_tc' (sigmoid scores plus the correction bias pick the experts)",
              kimi["topk_method"])
    if kimi.get("moe_layer_freq", 1) != 1:
        _fail("moe_layer_freq", "1 (every layer after first_k_dense_replace is MoE)", kimi["moe_layer_freq"])
    if kimi.get("num_nextn_predict_layers", 0) not in (0, None):
        _fail("num_nextn_predict_layers", "0 (multi-token-prediction layers are not implemented)",
              kimi["num_nextn_predict_layers"])
    return kw


def _k3_text_config(root: dict) -> dict:
    """Kimi K3's root config.json -> its text backbone's keys (text_config, with the root's token ids and
    tie_word_embeddings where text_config lacks them)."""
    if root.get("model_type") not in (None, "kimi_k3"):
        _fail("model_type", "'kimi_k3' for a config with a text_config", root.get("model_type"))
    text = root.get("text_config")
    if not isinstance(text, dict):
        _fail("text_config", "a dict (a Kimi K3 config.json's text backbone)", text)
    unknown = sorted(set(root) - GENERIC_KEYS - set(K3_ROOT_KEYS) - {
        "text_config", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"})
    if unknown:
        _fail("a Kimi K3 root config", f"keys of Kimi K3's config.json only ({', '.join(K3_ROOT_KEYS)}, text_config, "
              "token ids, generic transformers keys)", f"unknown keys {unknown}")
    out = dict(text)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in root:
            if key in out and out[key] != root[key]:
                _fail(f"text_config.{key}", f"the root's {key}={root[key]!r} when both are given", out[key])
            out[key] = root[key]
    if out.get("model_type", "kimi_linear") != "kimi_linear":
        _fail("text_config.model_type", "'kimi_linear' (K3's text backbone)", out.get("model_type"))
    for key in ("auto_map", "architectures", "_name_or_path", "transformers_version"):  # Moonshot's files, not ours
        out.pop(key, None)
    for key in ("dtype", "torch_dtype"):
        if key in root and key not in out:
            out[key] = root[key]
    return out


def _refuse_unknown_keys(kw: dict):
    """An original (Moonshot) config.json may carry only keys this class reads or generic transformers keys."""
    fields = set(inspect.signature(KDAHybridConfig.__init__).parameters)  # ours (through functools.wraps)
    known = fields | set(ALIASES) | set(KIMI_ONLY_KEYS) | GENERIC_KEYS | {"rope_scaling"}
    unknown = sorted(set(kw) - known)
    if unknown:
        _fail("an original Kimi config.json", "made of keys this model implements (a key it does not know could "
              "change the architecture and would be ignored)", f"unknown keys {unknown}")
    lac_unknown = sorted(set(kw["linear_attn_config"]) - _LAC_KEYS) if isinstance(kw["linear_attn_config"], dict) \
        else []
    if lac_unknown:
        _fail("linear_attn_config", f"a dict of {sorted(_LAC_KEYS)}", f"unknown keys {lac_unknown}")
    if kw.get("rope_scaling") is not None:
        _fail("rope_scaling", "None (Kimi's MLA is NoPE)", kw["rope_scaling"])
    kw.pop("rope_scaling", None)


def _reads_kimi_keys(init):
    """__init__ sees our own keyword arguments only, whatever names the caller's dict used."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **_read_kimi_keys(kwargs))

    return __init__


class KDAHybridConfig(PretrainedConfig):
    r"""Configuration of a KDA hybrid causal LM.

    Layer pattern: `layer_types[i]` is "linear_attention" (KDA) or "full_attention" (MLA or GQA). Default:
    every 4th layer (1-based 4, 8, ...) is full attention, as in Kimi-Linear-48B-A3B.

    A Kimi-Linear config.json dict can be passed as is: `KDAHybridConfig(**kimi_dict)` reads
    `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`, `num_heads`, `head_dim`,
    `short_conv_kernel_size`, all required), `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`,
    `mla_use_nope`, ... and builds the same architecture; keys that decide tensor shapes must be present, the
    others default as in Moonshot's configuration_kimi.py. transformers-native names (`mlp_layer_types`,
    `num_local_experts`, `linear_conv_kernel_dim`) are read too. `to_kimi_linear_dict()` goes back. Every field
    is validated at construction (ValueError naming the field, what it must be and what it was).
    """

    model_type = "kda_hybrid"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = dict(ALIASES)
    # Tensor parallelism (transformers' styles; docs/ecosystem.md): every layer kind splits by heads or by
    # hidden units, and each block ends in one rowwise all-reduce. KDA and attention layers are both `self_attn`.
    # KDA: q/k/v, the gates' second halves (f_b, g_b), beta (b_proj) colwise by head; the depthwise convs and the
    # per-head A_log [1, 1, H, 1] / dt_bias [H * K] sharded on their head dim (a parameter entry shards only,
    # colwise shards dim ndim - 2, embedding_rowwise dim 0); `self_attn` runs with local parameters so A_log /
    # dt_bias read as this process's heads; o_norm (shared by heads) replicated, its gradient summed.
    # MLA: q (or q_b) and kv_b colwise by head, the latent projection replicated (mla_kv_a_proj sums the gradient
    # of its shared rope part). GQA: q/k/v colwise (num_key_value_heads must divide by the TP size). MLP and every
    # expert: gate/up (w1/w3) colwise, down (w2) rowwise; the router replicated.
    base_model_tp_plan = {
        "layers.*.self_attn": "local_params",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.k_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.v_conv1d.weight": "embedding_rowwise",
        "layers.*.self_attn.A_log": "colwise",
        "layers.*.self_attn.dt_bias": "colwise",
        "layers.*.self_attn.f_b_proj": "colwise",
        "layers.*.self_attn.g_b_proj": "colwise",
        "layers.*.self_attn.b_proj": "colwise",
        "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "layers.*.block_sparse_moe.shared_experts.gate_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.up_proj": "colwise",
        "layers.*.block_sparse_moe.shared_experts.down_proj": "rowwise",
        "layers.*.block_sparse_moe.experts.*.w1": "colwise",
        "layers.*.block_sparse_moe.experts.*.w3": "colwise",
        "layers.*.block_sparse_moe.experts.*.w2": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    @_reads_kimi_keys
    def __init__(
        self,
        vocab_size: int = 32000,  # token vocabulary
        hidden_size: int = 1024,  # model width D
        intermediate_size: int = 2816,  # dense SwiGLU width
        num_hidden_layers: int = 8,  # decoder layers
        layer_types: list[str] | None = None,  # per layer: "linear_attention" (KDA) or "full_attention"
        # --- KDA layers ---
        linear_num_heads: int = 8,  # KDA heads H
        linear_head_dim: int = 128,  # KDA head dim (K = V)
        linear_conv_kernel_size: int = 4,  # causal depthwise short-conv width on q, k, v
        # --- full-attention layers ---
        attention_type: str = "mla",  # "mla" (Kimi Linear NoPE MLA) or "gqa" (grouped-query attention + RoPE)
        num_attention_heads: int = 8,  # attention heads
        num_key_value_heads: int | None = None,  # GQA key/value heads (default: num_attention_heads)
        head_dim: int | None = None,  # GQA head dim (default: hidden_size // num_attention_heads)
        rope_theta: float = 10000.0,  # GQA RoPE base
        rope_parameters: dict | None = None,  # GQA RoPE in transformers' form ({"rope_type": "llama3", ...})
        attention_qk_norm: bool = False,  # GQA: RMSNorm over each head's query and key before RoPE (Qwen3)
        attention_out_bias: bool | None = None,  # bias on the attention o_proj (None: as attention_bias)
        q_lora_rank: int | None = None,  # MLA low-rank query (None: one q_proj)
        kv_lora_rank: int = 512,  # MLA compressed latent width (cached)
        qk_nope_head_dim: int = 128,  # MLA per-head key/query part from the latent
        qk_rope_head_dim: int = 64,  # MLA shared key part (cached; not rotated under NoPE)
        v_head_dim: int = 128,  # MLA value head dim
        attention_bias: bool = False,  # bias on the full-attention projections
        linear_attention_bias: bool = False,  # bias on the KDA q/k/v projections (from Qwen2-style sources)
        attention_dropout: float = 0.0,
        # --- MLP / MoE ---
        num_experts: int | None = None,  # routed experts; None or 0: dense MLP everywhere
        num_experts_per_tok: int = 8,  # experts per token (top-k)
        moe_intermediate_size: int = 1024,  # expert width
        n_shared_experts: int = 1,  # shared experts (one SwiGLU of n * moe_intermediate_size)
        first_k_dense_replace: int = 1,  # first k layers keep a dense MLP
        routed_scaling_factor: float = 1.0,  # multiplies routed weights
        norm_topk_prob: bool = True,  # renormalise the top-k weights
        router_weights_from_biased_scores: bool = False,  # True: Kimi Hub code (weights from score + bias)
        hidden_act: str = "silu",  # GLU activation of every MLP and expert: "silu" (SwiGLU) or "situ" (K3 SiTU-GLU)
        # --- Kimi K3 switches (each off: Kimi Linear) ---
        gate_lower_bound: float | None = None,  # KDA decay lb * sigmoid(exp(A_log) (z + dt_bias)) in (lb, 0)
        use_full_rank_gate: bool = False,  # KDA output gate from one g_proj [H * V, D] (else g_b_proj(g_a_proj))
        mla_use_output_gate: bool = False,  # MLA output o_proj(attn * sigmoid(g_proj(x)))
        activation_situ_beta: float | None = None,  # SiTU gate cap b * tanh(g / b) (None: 1.0)
        activation_situ_linear_beta: float | None = None,  # SiTU up-projection cap b * tanh(u / b) (None: none)
        routed_expert_hidden_size: int | None = None,  # latent MoE: experts work in this width (None: hidden_size)
        latent_moe_use_norm: bool = False,  # latent MoE: RMSNorm on the routed sum before the up-projection
        attn_res_block_size: int | None = None,  # Block Attention Residuals: layers per block (None: residual sum)
        expert_quantization: str | None = None,  # "mxfp4": routed experts stored as MXFP4 (K3's quantization_config)
        # --- the rest ---
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 1048576,  # NoPE MLA has no limit; used by GQA RoPE and generation
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        if layer_types is None and _is_int(num_hidden_layers):
            layer_types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(num_hidden_layers)]
        self.layer_types = list(layer_types) if isinstance(layer_types, (list, tuple)) else layer_types
        self.linear_num_heads = linear_num_heads
        self.linear_head_dim = linear_head_dim
        self.linear_conv_kernel_size = linear_conv_kernel_size
        self.attention_type = attention_type
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        head_dim_given = head_dim is not None
        self.head_dim = _derived_head_dim(hidden_size, num_attention_heads) if head_dim is None else head_dim
        self.rope_theta = rope_theta
        # transformers standardises this dict (adds rope_type and rope_theta) in PretrainedConfig.__init__ and its
        # ROPE_INIT_FUNCTIONS read it, so scaled RoPE (llama3, yarn, linear) is computed exactly as in the source
        # Only GQA rotates: an MLA (NoPE) config has no rope_parameters at all, so transformers neither standardises
        # nor validates RoPE for it (its unused head_dim may be odd)
        if attention_type == "gqa":
            self.rope_parameters = dict(rope_parameters) if isinstance(rope_parameters, dict) else rope_parameters
            if isinstance(self.rope_parameters, dict) and "rope_theta" in self.rope_parameters:
                self.rope_theta = self.rope_parameters["rope_theta"]  # one base: the dict's, as transformers reads it
        elif rope_parameters is not None:
            _fail("rope_parameters", MLA_ROPE, rope_parameters)
        self.attention_qk_norm = attention_qk_norm
        self.attention_out_bias = attention_bias if attention_out_bias is None else attention_out_bias
        self.linear_attention_bias = linear_attention_bias
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.num_experts = num_experts or None
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.n_shared_experts = n_shared_experts
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.router_weights_from_biased_scores = router_weights_from_biased_scores
        self.hidden_act = hidden_act
        self.gate_lower_bound = gate_lower_bound
        self.use_full_rank_gate = use_full_rank_gate
        self.mla_use_output_gate = mla_use_output_gate
        self.activation_situ_beta = activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.routed_expert_hidden_size = routed_expert_hidden_size
        self.latent_moe_use_norm = latent_moe_use_norm
        self.attn_res_block_size = attn_res_block_size
        self.expert_quantization = expert_quantization
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self._validate(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       tie_word_embeddings=tie_word_embeddings, head_dim_given=head_dim_given)
        super().__init__(
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )

    # ------------------------------------------------------------------------------------------------
    def validate(self):
        """Every field checked again as the constructor checks it, with the same messages: a config changed after
        construction (config.rope_parameters = {...}, config.num_experts_per_tok = 9) is refused here instead of
        building a model that silently ignores the change or fails deep inside a forward. transformers' own class
        validators run after these. Called by every model's constructor and by save_pretrained. A GQA rope_parameters
        dict assigned later is standardised as the constructor's is (rope_type and rope_theta filled in, and
        rope_theta the dict's)."""
        rope = getattr(self, "rope_parameters", None)
        if self.attention_type == "mla" and rope is not None:
            _fail("rope_parameters", MLA_ROPE, rope)
        self._validate(pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id,
                       eos_token_id=self.eos_token_id, tie_word_embeddings=self.tie_word_embeddings,
                       head_dim_given=self.attention_type == "gqa" or self.head_dim != _derived_head_dim(
                           self.hidden_size, self.num_attention_heads))
        if self.attention_type == "gqa" and isinstance(rope, dict):
            rope.setdefault("rope_type", rope.get("type", "default"))
            rope.setdefault("rope_theta", self.rope_theta)
            self.rope_theta = rope["rope_theta"]
        super().validate()  # after ours, so that a field both check gets the constructor's message

    def _validate(self, **special):
        """Every field, before the config exists: errors name the field, what it must be and what it was."""

        def positive_int(name, limit=None):
            value = getattr(self, name)
            if not (_is_int(value) and value > 0):
                _fail(name, "a positive int", value)
            if limit is not None and value > limit[0]:
                _fail(name, f"<= {limit[0]} ({limit[1]})", value)

        def non_negative_int(name):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 0):
                _fail(name, "an int >= 0", value)

        def real(name, expected, ok):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and ok(value)):
                _fail(name, expected, value)

        def boolean(name, value):
            if not isinstance(value, bool):
                _fail(name, "True or False", value)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "linear_num_heads",
                     "linear_conv_kernel_size", "num_attention_heads", "num_key_value_heads",
                     "max_position_embeddings"):
            positive_int(name)
        positive_int("linear_head_dim", (MAX_LINEAR_HEAD_DIM, "the Triton KDA kernels hold a head in registers"))
        if not isinstance(self.layer_types, list):
            _fail("layer_types", f"a list of num_hidden_layers={self.num_hidden_layers} entries", self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("layer_types", f"a list of num_hidden_layers={self.num_hidden_layers} entries",
                  f"{len(self.layer_types)} entries")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            _fail("layer_types entries", f"'{LINEAR}' or '{FULL}'", bad[0])
        if self.attention_type not in ("mla", "gqa"):
            _fail("attention_type", "'mla' or 'gqa'", self.attention_type)
        # fields of the other attention type are unused, but checked alike: a config never carries nonsense (an MLA
        # config's head_dim derived as hidden_size // heads may be 0 and is then never read)
        if self.attention_type == "gqa" or special["head_dim_given"]:
            positive_int("head_dim")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            positive_int(name)
        non_negative_int("qk_rope_head_dim")
        if self.q_lora_rank is not None:
            positive_int("q_lora_rank")
        if self.attention_type == "gqa":
            if self.num_attention_heads % self.num_key_value_heads:
                _fail("num_attention_heads", f"a multiple of num_key_value_heads={self.num_key_value_heads}",
                      self.num_attention_heads)
            if self.head_dim % 2:
                _fail("head_dim", "even (RoPE rotates pairs)", self.head_dim)
        if getattr(self, "rope_parameters", None) is not None:
            if not isinstance(self.rope_parameters, dict):
                _fail("rope_parameters", "None or a dict in transformers' form ({'rope_type': ..., ...})",
                      self.rope_parameters)
            rope_type = self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))
            if rope_type not in STATIC_ROPE_TYPES:
                _fail("rope_parameters.rope_type", f"one of {STATIC_ROPE_TYPES} (RoPE whose frequencies do not "
                      "depend on the sequence length)", rope_type)
        for name in ("attention_out_bias", "attention_qk_norm", "linear_attention_bias"):
            boolean(name, getattr(self, name))
        if self.attention_type == "mla" and self.attention_qk_norm:
            _fail("attention_qk_norm", "False with attention_type='mla' (a GQA option)", self.attention_qk_norm)
        real("rope_theta", "a finite number > 0 (the RoPE base)", lambda v: v > 0)
        for name in ("num_experts_per_tok", "moe_intermediate_size"):
            positive_int(name)
        non_negative_int("n_shared_experts")
        non_negative_int("first_k_dense_replace")
        if self.num_experts is not None:
            positive_int("num_experts")
            if self.num_experts_per_tok > self.num_experts:
                _fail("num_experts_per_tok", f"<= num_experts={self.num_experts}", self.num_experts_per_tok)
        real("routed_scaling_factor", "a finite number > 0", lambda v: v > 0)
        if self.hidden_act not in ("silu", "swish", "situ"):
            _fail("hidden_act", "'silu' or 'situ'", self.hidden_act)
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            if getattr(self, name) is not None:
                if self.hidden_act != "situ":
                    _fail(name, "None unless hidden_act='situ' (it would be ignored)", getattr(self, name))
                real(name, "None or a finite number > 0", lambda v: v > 0)
        if self.gate_lower_bound is not None:
            real("gate_lower_bound", "None or a finite number < 0 (the KDA log decay lies in (bound, 0))",
                 lambda v: v < 0)
        for name in ("use_full_rank_gate", "mla_use_output_gate", "latent_moe_use_norm"):
            boolean(name, getattr(self, name))
        if self.mla_use_output_gate and self.attention_type != "mla":
            _fail("mla_use_output_gate", "False with attention_type='gqa' (an MLA option)", self.mla_use_output_gate)
        if self.routed_expert_hidden_size is not None:
            positive_int("routed_expert_hidden_size")
            if self.num_experts is None:
                _fail("routed_expert_hidden_size", "None without routed experts (num_experts None)",
                      self.routed_expert_hidden_size)
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            _fail("latent_moe_use_norm", "False without a latent MoE (routed_expert_hidden_size None)",
                  self.latent_moe_use_norm)
        if self.attn_res_block_size is not None:
            positive_int("attn_res_block_size")
        if self.expert_quantization is not None:
            if self.expert_quantization != MXFP4:
                _fail("expert_quantization", f"None or {MXFP4!r}", self.expert_quantization)
            if self.num_experts is None:
                _fail("expert_quantization", "None without routed experts (num_experts None)", self.expert_quantization)
            widths = {"moe_intermediate_size": self.moe_intermediate_size,
                      "routed_expert_hidden_size or hidden_size": self.routed_expert_hidden_size or self.hidden_size}
            for name, width in widths.items():
                if width % MXFP4_GROUP:
                    _fail(name, f"a multiple of {MXFP4_GROUP} with MXFP4 experts (one scale per {MXFP4_GROUP} inputs)",
                          width)
        real("rms_norm_eps", "a positive float", lambda v: v > 0)
        real("initializer_range", "a finite number >= 0 (a standard deviation)", lambda v: v >= 0)
        real("attention_dropout", "a probability in [0, 1)", lambda v: 0 <= v < 1)
        for name in ("attention_bias", "norm_topk_prob", "router_weights_from_biased_scores", "use_cache"):
            boolean(name, getattr(self, name))
        boolean("tie_word_embeddings", special["tie_word_embeddings"])
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = special[name]
            ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            for token in ids:
                if token is not None and not (_is_int(token) and 0 <= token < self.vocab_size):
                    _fail(name, f"None or a token id in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size})",
                          value)

    # ------------------------------------------------------------------------------------------------
    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.num_experts is not None and layer_idx >= self.first_k_dense_replace

    def to_kimi_linear_dict(self) -> dict:
        """This config as an original Kimi-Linear config.json (model_type "kimi_linear", 1-based layer lists)."""
        if self.attention_type != "mla":
            raise ValueError("only MLA models have a Kimi-Linear equivalent; this config uses attention_type='gqa'")
        if self.attention_bias:
            raise ValueError("attention_bias=True has no Kimi-Linear equivalent (its projections have no bias)")
        out = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": self.use_cache,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "linear_attn_config": {
                "kda_layers": [i + 1 for i in self.linear_attention_layers],
                "full_attn_layers": [i + 1 for i in self.full_attention_layers],
                "head_dim": self.linear_head_dim,
                "num_heads": self.linear_num_heads,
                "short_conv_kernel_size": self.linear_conv_kernel_size,
            },
        }
        lac = out["linear_attn_config"]
        if self.use_full_rank_gate:
            lac["use_full_rank_gate"] = True
        if self.gate_lower_bound is not None:
            lac["gate_lower_bound"] = self.gate_lower_bound
        for name in ("mla_use_output_gate", "latent_moe_use_norm"):
            if getattr(self, name):
                out[name] = True
        for name in ("activation_situ_beta", "activation_situ_linear_beta", "routed_expert_hidden_size",
                     "attn_res_block_size"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.expert_quantization == MXFP4:
            out["quantization_config"] = k3_quantization_config()
        # the router keys a release carries, for dense models too: llama.cpp's converter and loader read them for
        # every Kimi Linear model (a dense one is all "first k dense" layers, with no num_experts)
        out.update(
            num_experts_per_token=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            num_shared_experts=self.n_shared_experts,
            first_k_dense_replace=self.num_hidden_layers if self.num_experts is None else self.first_k_dense_replace,
            routed_scaling_factor=self.routed_scaling_factor,
            moe_renormalize=self.norm_topk_prob,
            moe_router_activation_func="sigmoid",
            moe_layer_freq=1,
            use_grouped_topk=True,
            num_expert_group=1,
            topk_group=1,
        )
        if self.num_experts is not None:
            out["num_experts"] = self.num_experts
        return out

    @classmethod
    def kimi_k3(cls, **kwargs) -> KDAHybridConfig:
        """A Kimi-K3-architecture config of any size: K3's switches as released (decay gate bound -5, full-rank KDA
        and MLA output gates, SiTU-GLU with betas 4 and 25, AttnRes blocks of 12 layers, 2 shared experts, a latent
        MoE of half the model width with its norm, rms_norm_eps 1e-5) under the sizes given; any keyword overrides.
        Without num_experts every MLP is dense (no latent MoE)."""
        k3 = dict(gate_lower_bound=-5.0, use_full_rank_gate=True, mla_use_output_gate=True, hidden_act="situ",
                  activation_situ_beta=4.0, activation_situ_linear_beta=25.0, attn_res_block_size=12,
                  rms_norm_eps=1e-5)
        if kwargs.get("num_experts"):
            k3.update(n_shared_experts=2, latent_moe_use_norm=True,
                      routed_expert_hidden_size=kwargs.get("hidden_size", 1024) // 2)
        return cls(**{**k3, **kwargs})

    @property
    def uses_k3_features(self) -> bool:
        """Whether any Kimi K3 switch is on (with all off, the model is Kimi Linear's, bit for bit)."""
        return bool(self.gate_lower_bound is not None or self.use_full_rank_gate or self.mla_use_output_gate
                    or self.hidden_act == "situ" or self.routed_expert_hidden_size is not None
                    or self.latent_moe_use_norm or self.attn_res_block_size is not None
                    or self.expert_quantization is not None)

    def to_kimi_k3_dict(self) -> dict:
        """This config as a Kimi K3 root config.json (model_type "kimi_k3"): the text backbone as its text_config
        (what to_kimi_linear_dict() writes, with K3's topk_method and MTP keys). The root carries no vision_config:
        the converter keeps a source K3 root's vision keys."""
        text = self.to_kimi_linear_dict()
        if self.num_experts is not None:
            text["topk_method"] = "noaux_tc"
        text["num_nextn_predict_layers"] = 0
        return {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }


__all__ = ["KDAHybridConfig"]
