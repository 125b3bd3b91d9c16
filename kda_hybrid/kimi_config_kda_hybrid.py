"""Kimi Linear and Kimi K3 config.json keys, declared once: `KIMI_KEYS` names each field's key (ours, theirs, where
it lives, which generation, Moonshot's default), `FIXED_KEYS` the keys whose only implemented value is checked and
written; the reader (`read_kimi_keys`: an original, transformers-native or K3 root config.json -> our keyword
arguments), both writers (`kimi_linear_dict`, `kimi_k3_dict`) and `uses_k3_features` iterate them.
`configuration_kda_hybrid.KDAHybridConfig` calls them; nothing here imports it."""

from __future__ import annotations

from dataclasses import dataclass

from .config_rules_kda_hybrid import fail, is_int

LINEAR = "linear_attention"
FULL = "full_attention"
ROOT, LAC = "root", "linear_attn_config"  # where a key lives in Kimi's (text) config.json
REQUIRED = object()  # no Moonshot default: the key decides tensor shapes and must be present in an original file
OURS = object()  # Moonshot's configuration_kimi.py default is ours


@dataclass(frozen=True)
class KimiKey:
    """Our field `ours` is key `theirs` of Kimi's config.json, at `where` (ROOT or LAC). `k3`: a Kimi K3 switch,
    written only when on (off is Kimi Linear). `default`: what Moonshot's configuration_kimi.py makes of an
    original file without the key (REQUIRED: none; `moe`: required only with routed experts)."""

    ours: str
    theirs: str = ""
    where: str = ROOT
    k3: bool = False
    default: object = OURS
    moe: bool = False

    @property
    def name(self) -> str:
        return self.theirs or self.ours


# In the order the writer emits them (root keys, then linear_attn_config's, then the K3 switches, then the MoE keys).
KIMI_KEYS = (
    KimiKey("vocab_size", default=REQUIRED), KimiKey("hidden_size", default=REQUIRED),
    KimiKey("intermediate_size", default=REQUIRED), KimiKey("num_hidden_layers", default=REQUIRED),
    KimiKey("num_attention_heads", default=REQUIRED), KimiKey("hidden_act"), KimiKey("rms_norm_eps", default=1e-6),
    KimiKey("initializer_range"), KimiKey("max_position_embeddings"),
    KimiKey("tie_word_embeddings", default=False), KimiKey("use_cache"), KimiKey("pad_token_id", default=0),
    KimiKey("bos_token_id", default=1), KimiKey("eos_token_id", default=2), KimiKey("q_lora_rank", default=None),
    KimiKey("kv_lora_rank", default=REQUIRED), KimiKey("qk_nope_head_dim", default=REQUIRED),
    KimiKey("qk_rope_head_dim", default=REQUIRED), KimiKey("v_head_dim", default=REQUIRED),
    KimiKey("linear_head_dim", "head_dim", LAC, default=REQUIRED),
    KimiKey("linear_num_heads", "num_heads", LAC, default=REQUIRED),
    KimiKey("linear_conv_kernel_size", "short_conv_kernel_size", LAC, default=REQUIRED),
    KimiKey("use_full_rank_gate", where=LAC, k3=True), KimiKey("gate_lower_bound", where=LAC, k3=True),
    KimiKey("mla_use_output_gate", k3=True), KimiKey("latent_moe_use_norm", k3=True),
    KimiKey("activation_situ_beta", k3=True), KimiKey("activation_situ_linear_beta", k3=True),
    KimiKey("routed_expert_hidden_size", k3=True), KimiKey("attn_res_block_size", k3=True),
    KimiKey("num_experts_per_tok", "num_experts_per_token", moe=True, default=REQUIRED),
    KimiKey("moe_intermediate_size", moe=True, default=REQUIRED),
    KimiKey("n_shared_experts", "num_shared_experts", default=0), KimiKey("first_k_dense_replace", default=0),
    KimiKey("routed_scaling_factor", default=1.0), KimiKey("norm_topk_prob", "moe_renormalize", default=True),
    KimiKey("num_experts", default=None),
)
# Keys with no field: the only value this model implements, checked on reading (why: the message) and written.
# `also`: other values that mean the same; `absent`: what an original file without the key means.
FIXED_KEYS = {
    "moe_router_activation_func": dict(value="sigmoid", why="the only router this model implements"),
    "moe_layer_freq": dict(value=1, why="every layer after first_k_dense_replace is MoE"),
    "use_grouped_topk": dict(value=True, also=(False, None), why="one group: plain top-k either way"),
    "num_expert_group": dict(value=1, why="grouped top-k with one group is plain top-k"),
    "topk_group": dict(value=1, why="grouped top-k with one group is plain top-k"),
    "topk_method": dict(value="noaux_tc", also=(None,), why="sigmoid scores plus the correction bias pick the experts"),
    "num_nextn_predict_layers": dict(value=0, also=(None,), why="multi-token-prediction layers are not implemented"),
}
# transformers-native KimiLinearConfig names of our fields, and the tokenizer's limit a Hub config carries
NATIVE_ALIASES = {"num_local_experts": "num_experts", "linear_conv_kernel_dim": "linear_conv_kernel_size",
                  "model_max_length": "max_position_embeddings"}
# Other names of our fields: read by the config, readable as attributes (attribute_map), written back by the writer.
ALIASES = {**{k.theirs: k.ours for k in KIMI_KEYS if k.where == ROOT and k.theirs}, **NATIVE_ALIASES}
# Keys of a Kimi-Linear config.json (or transformers-native one) with no field of their own: checked, then dropped.
KIMI_ONLY_KEYS = ("linear_attn_config", "mlp_layer_types", "mla_use_nope", "n_group", "model_type", *FIXED_KEYS)
LAC_KEYS = {"kda_layers", "full_attn_layers", *(k.name for k in KIMI_KEYS if k.where == LAC)}
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
K3_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")  # the root's win

# The one quantisation K3 ships: compressed-tensors MXFP4 (E2M1 values, E8M0 scale per 32 inputs) on the routed
# experts only. Read into `expert_quantization="mxfp4"`; written back verbatim by the K3 writer.
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


def expert_quantization_from(qc) -> str:
    """A config.json quantization_config -> expert_quantization; anything but K3's MXFP4 experts is refused (this
    model computes from no other stored format)."""
    if not isinstance(qc, dict):
        fail("quantization_config", "a dict (K3's compressed-tensors MXFP4 experts)", qc)
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
        fail("quantization_config", "K3's: compressed-tensors mxfp4-pack-quantized, 4-bit float, group_size 32, "
             "uint8 scales, on the routed experts only", "; ".join(problems))
    return MXFP4


# ------------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------------


def layer_types_from_kimi(lac, num_hidden_layers) -> list[str]:
    """linear_attn_config's 1-based kda_layers / full_attn_layers -> 0-based layer_types."""
    if not isinstance(lac, dict) or "kda_layers" not in lac or "full_attn_layers" not in lac:
        fail("linear_attn_config", "a dict with kda_layers and full_attn_layers (1-based)", lac)
    if not is_int(num_hidden_layers) or num_hidden_layers <= 0:
        fail("num_hidden_layers", "a positive int (linear_attn_config's layers are counted against it)",
             num_hidden_layers)
    layer_types: list[str | None] = [None] * num_hidden_layers
    for key, kind in (("kda_layers", LINEAR), ("full_attn_layers", FULL)):
        if not isinstance(lac[key], (list, tuple)):
            fail(f"linear_attn_config.{key}", "a list of 1-based layer numbers", lac[key])
        for one_based in lac[key]:
            if not (is_int(one_based) and 1 <= one_based <= num_hidden_layers):
                fail(f"linear_attn_config.{key} entries", f"1-based ints in 1..{num_hidden_layers}", one_based)
            if layer_types[one_based - 1] is not None:
                raise ValueError(f"KDAHybridConfig: linear_attn_config must list each layer once, got layer "
                                 f"{one_based} (1-based) in both kda_layers and full_attn_layers")
            layer_types[one_based - 1] = kind
    missing = [i + 1 for i, t in enumerate(layer_types) if t is None]
    if missing:
        raise ValueError(f"KDAHybridConfig: linear_attn_config must put every layer 1..{num_hidden_layers} in "
                         f"kda_layers or full_attn_layers, got 1-based layers {missing} are in neither")
    return layer_types


def read_kimi_keys(kwargs: dict, fields) -> dict:
    """Our keyword arguments for a dict that may carry Kimi-Linear, K3 or transformers-native keys. `fields`: the
    config's own field names (an original file with any other unknown key is refused)."""
    kw = dict(kwargs)
    if kw.get("model_type") == "kimi_k3" or "text_config" in kw:
        kw = _k3_text_config(kw)
    if "quantization_config" in kw:  # never left for transformers: its quantizers would take over loading
        qc = kw.pop("quantization_config")
        if qc is not None:
            quant = expert_quantization_from(qc)
            if kw.get("expert_quantization") not in (None, quant):
                fail("expert_quantization", f"{quant!r} (what quantization_config says) when both are given",
                     kw["expert_quantization"])
            kw["expert_quantization"] = quant
    if kw.get("linear_attn_config") is not None:
        _refuse_unknown_keys(kw, fields)
        _read_original(kw)
    _read_mlp_layer_types(kw)
    for alias, ours in ALIASES.items():
        if alias in kw:
            value = kw.pop(alias)
            # the Hub config carries model_max_length (the tokenizer's limit) beside max_position_embeddings
            if ours in kw and kw[ours] != value and alias != "model_max_length":
                fail(ours, f"equal to {alias}={value!r} when both are given", kw[ours])
            kw.setdefault(ours, value)
    kimi = {k: kw.pop(k) for k in KIMI_ONLY_KEYS if k in kw}
    kw.pop("architectures_kimi", None)
    _check_kimi_only_keys(kimi, given=kwargs)
    return kw


def _read_original(kw: dict) -> None:
    """An original Kimi-Linear config.json: its layers and linear_attn_config's fields, then what Moonshot's
    configuration_kimi.py makes of absent keys (shape keys required, the rest its defaults)."""
    lac = kw["linear_attn_config"]
    layer_types = layer_types_from_kimi(lac, kw.get("num_hidden_layers"))
    missing = [k.name for k in KIMI_KEYS if k.where == LAC and k.default is REQUIRED and k.name not in lac]
    if missing:
        fail("linear_attn_config", "a dict with head_dim, num_heads and short_conv_kernel_size (Kimi-Linear has "
             "no defaults for them)", f"{lac} without {sorted(missing)}")
    if kw.get("layer_types") is not None and list(kw["layer_types"]) != layer_types:
        fail("layer_types", f"{layer_types} (what linear_attn_config says) when both are given", kw["layer_types"])
    kw["layer_types"] = layer_types
    for key in (k for k in KIMI_KEYS if k.where == LAC and k.name in lac):
        given = kw.get(key.ours, kw.get("linear_conv_kernel_dim") if key.ours == "linear_conv_kernel_size" else None)
        if given is not None and given != lac[key.name]:
            fail(key.ours, f"linear_attn_config.{key.name}={lac[key.name]!r} when both are given", given)
        kw[key.ours] = lac[key.name]
    kw.pop("linear_conv_kernel_dim", None)
    absent = [k.name for k in KIMI_KEYS if k.where == ROOT and k.default is REQUIRED and not k.moe
              and kw.get(k.name) is None]
    if kw.get("num_experts"):
        absent += [k.name for k in KIMI_KEYS if k.moe and kw.get(k.name, kw.get(k.ours)) is None]
    if absent:
        fail("a Kimi-Linear config (one with linear_attn_config)", "complete: these keys decide tensor shapes and "
             "have no Kimi-Linear default", f"no {', '.join(absent)}")
    for key in KIMI_KEYS:
        if key.where == ROOT and key.default not in (REQUIRED, OURS) and key.name not in kw and key.ours not in kw:
            kw[key.name] = key.default
    kw.setdefault("mla_use_nope", False)  # Moonshot's default: RoPE MLA, which is refused below
    kw["attention_type"] = kw.get("attention_type", "mla")
    if kw["attention_type"] != "mla":
        fail("attention_type", "'mla' for a Kimi-Linear config", kw["attention_type"])


def _read_mlp_layer_types(kw: dict) -> None:
    """transformers-native mlp_layer_types: some "dense" layers, then "sparse" ones -> first_k_dense_replace."""
    mlp_types = kw.pop("mlp_layer_types", None)
    if mlp_types is None:
        return
    n_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    if any(t != "sparse" for t in mlp_types[n_dense:]):
        fail("mlp_layer_types", "'dense' layers followed only by 'sparse' ones (Kimi's first_k_dense_replace)",
             mlp_types)
    if kw.get("first_k_dense_replace") is not None and kw["first_k_dense_replace"] != n_dense and n_dense < len(
            mlp_types):
        fail("first_k_dense_replace", f"{n_dense} (what mlp_layer_types says) when both are given",
             kw["first_k_dense_replace"])
    kw["first_k_dense_replace"] = n_dense


def _check_kimi_only_keys(kimi: dict, given: dict) -> None:
    """The keys without a field hold what this model implements."""
    if kimi.get("mla_use_nope", True) is not True:
        fail("mla_use_nope", "True: full-attention layers are NoPE MLA here, RoPE MLA is not implemented"
             + (" (False is Kimi-Linear's default when the key is absent)" if "mla_use_nope" not in given else ""),
             kimi["mla_use_nope"])
    groups = (kimi.get("num_expert_group", kimi.get("n_group", 1)), kimi.get("topk_group", 1))
    if groups != (1, 1):
        fail("num_expert_group/topk_group", "1 (grouped top-k with one group is plain top-k)", groups)
    if kimi.get("model_type", "kimi_linear") not in ("kimi_linear", "kda_hybrid"):
        fail("model_type", "'kda_hybrid' or 'kimi_linear'", kimi["model_type"])
    for key, rule in FIXED_KEYS.items():
        if key in kimi and kimi[key] != rule["value"] and kimi[key] not in rule.get("also", ()):
            fail(key, f"{rule['value']!r} ({rule['why']})", kimi[key])


def _k3_text_config(root: dict) -> dict:
    """Kimi K3's root config.json -> its text backbone's keys (text_config, with the root's token ids and
    tie_word_embeddings where text_config lacks them)."""
    if root.get("model_type") not in (None, "kimi_k3"):
        fail("model_type", "'kimi_k3' for a config with a text_config", root.get("model_type"))
    text = root.get("text_config")
    if not isinstance(text, dict):
        fail("text_config", "a dict (a Kimi K3 config.json's text backbone)", text)
    unknown = sorted(set(root) - GENERIC_KEYS - set(K3_ROOT_KEYS) - {"text_config", *K3_TOKEN_KEYS})
    if unknown:
        fail("a Kimi K3 root config", f"keys of Kimi K3's config.json only ({', '.join(K3_ROOT_KEYS)}, text_config, "
             "token ids, generic transformers keys)", f"unknown keys {unknown}")
    out = dict(text)
    for key in K3_TOKEN_KEYS:
        if key in root:
            if key in out and out[key] != root[key]:
                fail(f"text_config.{key}", f"the root's {key}={root[key]!r} when both are given", out[key])
            out[key] = root[key]
    if out.get("model_type", "kimi_linear") != "kimi_linear":
        fail("text_config.model_type", "'kimi_linear' (K3's text backbone)", out.get("model_type"))
    for key in ("auto_map", "architectures", "_name_or_path", "transformers_version"):  # Moonshot's files, not ours
        out.pop(key, None)
    for key in ("dtype", "torch_dtype"):
        if key in root and key not in out:
            out[key] = root[key]
    return out


def _refuse_unknown_keys(kw: dict, fields) -> None:
    """An original (Moonshot) config.json may carry only keys this class reads or generic transformers keys."""
    known = set(fields) | set(ALIASES) | set(KIMI_ONLY_KEYS) | GENERIC_KEYS | {"rope_scaling"}
    unknown = sorted(set(kw) - known)
    if unknown:
        fail("an original Kimi config.json", "made of keys this model implements (a key it does not know could "
             "change the architecture and would be ignored)", f"unknown keys {unknown}")
    lac = kw["linear_attn_config"]
    lac_unknown = sorted(set(lac) - LAC_KEYS) if isinstance(lac, dict) else []
    if lac_unknown:
        fail("linear_attn_config", f"a dict of {sorted(LAC_KEYS)}", f"unknown keys {lac_unknown}")
    if kw.get("rope_scaling") is not None:
        fail("rope_scaling", "None (Kimi's MLA is NoPE)", kw["rope_scaling"])
    kw.pop("rope_scaling", None)


# ------------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------------


def _is_on(value) -> bool:
    """A K3 switch is on unless it holds Kimi Linear's value (False or None)."""
    return value is not None and value is not False


def uses_k3_features(config) -> bool:
    """Whether any Kimi K3 switch is on (with all off, the model is Kimi Linear's, bit for bit)."""
    return (config.hidden_act == "situ" or config.expert_quantization is not None
            or any(_is_on(getattr(config, k.ours)) for k in KIMI_KEYS if k.k3))


def kimi_linear_dict(config) -> dict:
    """`config` as an original Kimi-Linear config.json (model_type "kimi_linear", 1-based layer lists)."""
    if config.attention_type != "mla":
        raise ValueError("only MLA models have a Kimi-Linear equivalent; this config uses attention_type='gqa'")
    if config.attention_bias:
        raise ValueError("attention_bias=True has no Kimi-Linear equivalent (its projections have no bias)")
    if config.linear_kv_heads != config.linear_num_heads:
        raise ValueError(f"linear_num_kv_heads={config.linear_num_kv_heads} (KDA keys and values shared by query "
                         "heads) has no Kimi-Linear equivalent (one key/value head per KDA head)")
    out = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear"}
    lac = {"kda_layers": [i + 1 for i in config.linear_attention_layers],
           "full_attn_layers": [i + 1 for i in config.full_attention_layers]}
    for key in KIMI_KEYS:
        value = getattr(config, key.ours)
        if key.ours == "num_experts_per_tok" and config.expert_quantization == MXFP4:  # after the K3 switches
            out["quantization_config"] = k3_quantization_config()
        if key.k3 and not _is_on(value):
            continue
        if key.ours == "num_experts" and value is None:
            continue
        if key.ours == "first_k_dense_replace" and config.num_experts is None:
            value = config.num_hidden_layers  # a dense model: every layer is "first k dense"
        (lac if key.where == LAC else out)[key.name] = value
        if key.ours == "num_attention_heads":
            out["num_key_value_heads"] = value  # MLA: one key/value per query head
        if key.ours == "v_head_dim":
            out["mla_use_nope"] = True
            out[LAC] = lac
    # the router keys a release carries, for dense models too: llama.cpp's converter and loader read them for
    # every Kimi Linear model (a dense one is all "first k dense" layers, with no num_experts)
    out.update({key: rule["value"] for key, rule in FIXED_KEYS.items() if key not in ("topk_method",
                                                                                      "num_nextn_predict_layers")})
    if "num_experts" in out:
        out["num_experts"] = out.pop("num_experts")
    return out


def kimi_k3_dict(config) -> dict:
    """`config` as a Kimi K3 root config.json (model_type "kimi_k3"): the text backbone as its text_config (what
    kimi_linear_dict writes, with K3's topk_method and MTP keys). The root carries no vision_config: the converter
    keeps a source K3 root's vision keys."""
    text = kimi_linear_dict(config)
    if config.num_experts is not None:
        text["topk_method"] = FIXED_KEYS["topk_method"]["value"]
    text["num_nextn_predict_layers"] = FIXED_KEYS["num_nextn_predict_layers"]["value"]
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            **{key: getattr(config, key) for key in K3_TOKEN_KEYS}, "text_config": text}
