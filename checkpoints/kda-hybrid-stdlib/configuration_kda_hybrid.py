"""Configuration of KDA hybrid models (the Kimi Linear architecture): KDA layers with a few full-attention
layers, dense or DeepSeek-V3-style MoE MLPs. Accepts a Kimi-Linear config.json's own keys as well."""

from __future__ import annotations

from transformers import PretrainedConfig

LINEAR = "linear_attention"
FULL = "full_attention"

# Keys of an original Kimi-Linear config.json that this config understands (or deliberately ignores).
_KIMI_ONLY_KEYS = (
    "linear_attn_config", "num_experts_per_token", "num_shared_experts", "moe_renormalize",
    "moe_router_activation_func", "mla_use_nope", "mla_use_output_gate", "moe_layer_freq", "use_grouped_topk",
    "num_expert_group", "topk_group", "num_nextn_predict_layers", "topk_method", "model_type",
)


# RoPE variants of transformers' ROPE_INIT_FUNCTIONS whose inverse frequencies are fixed at construction
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _fail(name, expected, got):
    raise ValueError(f"KDAHybridConfig: {name} must be {expected}, got {got!r}")


class KDAHybridConfig(PretrainedConfig):
    r"""Configuration of a KDA hybrid causal LM.

    Layer pattern: `layer_types[i]` is "linear_attention" (KDA) or "full_attention" (MLA or GQA). Default:
    every 4th layer (1-based 4, 8, ...) is full attention, as in Kimi-Linear-48B-A3B.

    A Kimi-Linear config.json dict can be passed as is: `KDAHybridConfig(**kimi_dict)` reads
    `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`, `num_heads`, `head_dim`,
    `short_conv_kernel_size`), `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`,
    `mla_use_nope`, ... and builds the same architecture. `to_kimi_linear_dict()` goes back.
    """

    model_type = "kda_hybrid"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
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
        kimi = {k: kwargs.pop(k) for k in _KIMI_ONLY_KEYS if k in kwargs}
        kwargs.pop("architectures_kimi", None)
        lac = kimi.get("linear_attn_config")
        if lac is not None:
            if not isinstance(lac, dict) or "kda_layers" not in lac or "full_attn_layers" not in lac:
                _fail("linear_attn_config", "a dict with kda_layers and full_attn_layers (1-based)", lac)
            linear_num_heads = lac.get("num_heads", linear_num_heads)
            linear_head_dim = lac.get("head_dim", linear_head_dim)
            linear_conv_kernel_size = lac.get("short_conv_kernel_size", linear_conv_kernel_size)
            if layer_types is None:
                layer_types = [None] * num_hidden_layers
                for key, kind in (("kda_layers", LINEAR), ("full_attn_layers", FULL)):
                    for one_based in lac[key]:
                        if not (isinstance(one_based, int) and 1 <= one_based <= num_hidden_layers):
                            _fail(f"linear_attn_config.{key} entries", f"1-based ints in 1..{num_hidden_layers}",
                                  one_based)
                        layer_types[one_based - 1] = kind
                missing = [i + 1 for i, t in enumerate(layer_types) if t is None]
                if missing:
                    _fail("linear_attn_config", "to cover every layer", f"layers {missing} in neither list")
        if "num_experts_per_token" in kimi:
            num_experts_per_tok = kimi["num_experts_per_token"]
        if "num_shared_experts" in kimi:
            n_shared_experts = kimi["num_shared_experts"]
        if "moe_renormalize" in kimi:
            norm_topk_prob = kimi["moe_renormalize"]
        if kimi.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            _fail("moe_router_activation_func", "'sigmoid' (the only router this model implements)",
                  kimi["moe_router_activation_func"])
        if kimi.get("mla_use_output_gate"):
            _fail("mla_use_output_gate", "False (Kimi-Linear has no MLA output gate)", True)
        if kimi.get("num_expert_group", 1) != 1 or kimi.get("topk_group", 1) != 1:
            _fail("num_expert_group/topk_group", "1 (grouped top-k with one group is plain top-k)",
                  (kimi.get("num_expert_group"), kimi.get("topk_group")))
        if kimi.get("model_type", "kimi_linear") not in ("kimi_linear", "kda_hybrid"):
            _fail("model_type", "'kda_hybrid' or 'kimi_linear'", kimi["model_type"])
        if lac is not None or kimi.get("mla_use_nope"):
            attention_type = "mla"  # a Kimi-Linear config: NoPE MLA
        if "moe_layer_freq" in kimi and kimi["moe_layer_freq"] != 1:
            _fail("moe_layer_freq", "1", kimi["moe_layer_freq"])

        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        if layer_types is None:
            layer_types = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(num_hidden_layers)]
        self.layer_types = list(layer_types)
        self.linear_num_heads = linear_num_heads
        self.linear_head_dim = linear_head_dim
        self.linear_conv_kernel_size = linear_conv_kernel_size
        self.attention_type = attention_type
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.rope_theta = rope_theta
        # transformers standardises this dict (adds rope_type and rope_theta) in PretrainedConfig.__init__ and its
        # ROPE_INIT_FUNCTIONS read it, so scaled RoPE (llama3, yarn, linear) is computed exactly as in the source
        self.rope_parameters = dict(rope_parameters) if rope_parameters is not None else None
        if self.rope_parameters is not None and "rope_theta" in self.rope_parameters:
            self.rope_theta = self.rope_parameters["rope_theta"]  # one base: the dict's, as transformers reads it
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
        self._validate()
        super().__init__(
            pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings, **kwargs,
        )

    # ------------------------------------------------------------------------------------------------
    def _validate(self):
        def positive_int(name):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                _fail(name, "a positive int", value)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "linear_num_heads",
                     "linear_head_dim", "linear_conv_kernel_size", "num_attention_heads", "num_key_value_heads"):
            positive_int(name)
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("layer_types", f"a list of num_hidden_layers={self.num_hidden_layers} entries",
                  f"{len(self.layer_types)} entries")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            _fail("layer_types entries", f"'{LINEAR}' or '{FULL}'", bad[0])
        if self.attention_type not in ("mla", "gqa"):
            _fail("attention_type", "'mla' or 'gqa'", self.attention_type)
        if self.attention_type == "gqa":
            positive_int("head_dim")
            if self.num_attention_heads % self.num_key_value_heads:
                _fail("num_attention_heads", f"a multiple of num_key_value_heads={self.num_key_value_heads}",
                      self.num_attention_heads)
            if self.head_dim % 2:
                _fail("head_dim", "even (RoPE rotates pairs)", self.head_dim)
            if self.rope_parameters is not None:
                rope_type = self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))
                if rope_type not in STATIC_ROPE_TYPES:
                    _fail("rope_parameters.rope_type", f"one of {STATIC_ROPE_TYPES} (RoPE whose frequencies do not "
                          "depend on the sequence length)", rope_type)
        for name in ("attention_bias", "attention_out_bias", "attention_qk_norm", "linear_attention_bias"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, "a bool", getattr(self, name))
        if self.attention_type == "mla" and self.attention_qk_norm:
            _fail("attention_qk_norm", "False with attention_type='mla' (a GQA option)", self.attention_qk_norm)
        else:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                positive_int(name)
            if not (isinstance(self.qk_rope_head_dim, int) and self.qk_rope_head_dim >= 0):
                _fail("qk_rope_head_dim", "an int >= 0", self.qk_rope_head_dim)
            if self.q_lora_rank is not None:
                positive_int("q_lora_rank")
        if self.num_experts is not None:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                positive_int(name)
            if self.num_experts_per_tok > self.num_experts:
                _fail("num_experts_per_tok", f"<= num_experts={self.num_experts}", self.num_experts_per_tok)
            if not (isinstance(self.n_shared_experts, int) and self.n_shared_experts >= 0):
                _fail("n_shared_experts", "an int >= 0", self.n_shared_experts)
            if not (isinstance(self.first_k_dense_replace, int) and 0 <= self.first_k_dense_replace):
                _fail("first_k_dense_replace", "an int >= 0", self.first_k_dense_replace)
        if self.hidden_act not in ("silu", "swish"):
            _fail("hidden_act", "'silu'", self.hidden_act)
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            _fail("rms_norm_eps", "a positive float", self.rms_norm_eps)

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
