"""Configuration of KDA hybrid models (the Kimi Linear architecture): KDA layers with a few full-attention
layers, dense or DeepSeek-V3-style MoE MLPs. The one reader and writer of Kimi-Linear config.json files: it takes
an original one as is (and transformers-native key names), and `to_kimi_linear_dict()` writes one back."""

from __future__ import annotations

import functools
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
    "linear_attn_config", "mlp_layer_types", "moe_router_activation_func", "mla_use_nope", "mla_use_output_gate",
    "moe_layer_freq", "use_grouped_topk", "num_expert_group", "n_group", "topk_group", "num_nextn_predict_layers",
    "topk_method", "model_type",
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
    lac = kw.get("linear_attn_config")
    if lac is not None:  # an original Kimi-Linear config.json: its layers, then its required keys and defaults
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
    if kimi.get("mla_use_output_gate"):
        _fail("mla_use_output_gate", "False (Kimi-Linear has no MLA output gate)", kimi["mla_use_output_gate"])
    if kimi.get("mla_use_nope", True) is not True:
        _fail("mla_use_nope", "True: full-attention layers are NoPE MLA here, RoPE MLA is not implemented"
              + (" (False is Kimi-Linear's default when the key is absent)" if "mla_use_nope" not in kwargs else ""),
              kimi["mla_use_nope"])
    groups = (kimi.get("num_expert_group", kimi.get("n_group", 1)), kimi.get("topk_group", 1))
    if groups != (1, 1):
        _fail("num_expert_group/topk_group", "1 (grouped top-k with one group is plain top-k)", groups)
    if kimi.get("model_type", "kimi_linear") not in ("kimi_linear", "kda_hybrid"):
        _fail("model_type", "'kda_hybrid' or 'kimi_linear'", kimi["model_type"])
    if kimi.get("moe_layer_freq", 1) != 1:
        _fail("moe_layer_freq", "1 (every layer after first_k_dense_replace is MoE)", kimi["moe_layer_freq"])
    if kimi.get("num_nextn_predict_layers", 0) not in (0, None):
        _fail("num_nextn_predict_layers", "0 (multi-token-prediction layers are not implemented)",
              kimi["num_nextn_predict_layers"])
    return kw


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
        hidden_act: str = "silu",
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
        if self.hidden_act not in ("silu", "swish"):
            _fail("hidden_act", "'silu'", self.hidden_act)
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
        if self.num_experts is None:  # all dense: every layer is one of the "first k dense" layers
            out["first_k_dense_replace"] = self.num_hidden_layers
        else:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_token=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                num_shared_experts=self.n_shared_experts,
                first_k_dense_replace=self.first_k_dense_replace,
                routed_scaling_factor=self.routed_scaling_factor,
                moe_renormalize=self.norm_topk_prob,
                moe_router_activation_func="sigmoid",
                moe_layer_freq=1,
                use_grouped_topk=True,
                num_expert_group=1,
                topk_group=1,
            )
        return out


__all__ = ["KDAHybridConfig"]
