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

from .kimi_config_kda_hybrid import (
    ALIASES,
    FULL,
    LINEAR,
    MXFP4,
    MXFP4_GROUP,
    fail,
    kimi_k3_dict,
    kimi_linear_dict,
    read_kimi_keys,
    uses_k3_features,
)

# The largest KDA head dim the Triton kernels take: kda_triton_fwd.MAX_HEAD_DIM (they hold a head's K = V in one
# register tile). Checked here so a config that cannot run on GPU fails at construction, not in a kernel launch.
MAX_LINEAR_HEAD_DIM = 256

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLA_ROPE = "None with attention_type='mla' (NoPE: no RoPE)"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _derived_head_dim(hidden_size, num_attention_heads):
    """head_dim when none is given: hidden_size // num_attention_heads (None when those are not positive ints)."""
    if _is_int(hidden_size) and _is_int(num_attention_heads) and num_attention_heads > 0:
        return hidden_size // num_attention_heads
    return None


def _reads_kimi_keys(init):
    """__init__ sees our own keyword arguments only, whatever names the caller's dict used."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **read_kimi_keys(kwargs, inspect.signature(init).parameters))

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
            fail("rope_parameters", MLA_ROPE, rope_parameters)
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
            fail("rope_parameters", MLA_ROPE, rope)
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
                fail(name, "a positive int", value)
            if limit is not None and value > limit[0]:
                fail(name, f"<= {limit[0]} ({limit[1]})", value)

        def non_negative_int(name):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 0):
                fail(name, "an int >= 0", value)

        def real(name, expected, ok):
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value) and ok(value)):
                fail(name, expected, value)

        def boolean(name, value):
            if not isinstance(value, bool):
                fail(name, "True or False", value)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "linear_num_heads",
                     "linear_conv_kernel_size", "num_attention_heads", "num_key_value_heads",
                     "max_position_embeddings"):
            positive_int(name)
        positive_int("linear_head_dim", (MAX_LINEAR_HEAD_DIM, "the Triton KDA kernels hold a head in registers"))
        if not isinstance(self.layer_types, list):
            fail("layer_types", f"a list of num_hidden_layers={self.num_hidden_layers} entries", self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"a list of num_hidden_layers={self.num_hidden_layers} entries",
                  f"{len(self.layer_types)} entries")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            fail("layer_types entries", f"'{LINEAR}' or '{FULL}'", bad[0])
        if self.attention_type not in ("mla", "gqa"):
            fail("attention_type", "'mla' or 'gqa'", self.attention_type)
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
                fail("num_attention_heads", f"a multiple of num_key_value_heads={self.num_key_value_heads}",
                      self.num_attention_heads)
            if self.head_dim % 2:
                fail("head_dim", "even (RoPE rotates pairs)", self.head_dim)
        if getattr(self, "rope_parameters", None) is not None:
            if not isinstance(self.rope_parameters, dict):
                fail("rope_parameters", "None or a dict in transformers' form ({'rope_type': ..., ...})",
                      self.rope_parameters)
            rope_type = self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))
            if rope_type not in STATIC_ROPE_TYPES:
                fail("rope_parameters.rope_type", f"one of {STATIC_ROPE_TYPES} (RoPE whose frequencies do not "
                      "depend on the sequence length)", rope_type)
        for name in ("attention_out_bias", "attention_qk_norm", "linear_attention_bias"):
            boolean(name, getattr(self, name))
        if self.attention_type == "mla" and self.attention_qk_norm:
            fail("attention_qk_norm", "False with attention_type='mla' (a GQA option)", self.attention_qk_norm)
        real("rope_theta", "a finite number > 0 (the RoPE base)", lambda v: v > 0)
        for name in ("num_experts_per_tok", "moe_intermediate_size"):
            positive_int(name)
        non_negative_int("n_shared_experts")
        non_negative_int("first_k_dense_replace")
        if self.num_experts is not None:
            positive_int("num_experts")
            if self.num_experts_per_tok > self.num_experts:
                fail("num_experts_per_tok", f"<= num_experts={self.num_experts}", self.num_experts_per_tok)
        real("routed_scaling_factor", "a finite number > 0", lambda v: v > 0)
        if self.hidden_act not in ("silu", "swish", "situ"):
            fail("hidden_act", "'silu' or 'situ'", self.hidden_act)
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            if getattr(self, name) is not None:
                if self.hidden_act != "situ":
                    fail(name, "None unless hidden_act='situ' (it would be ignored)", getattr(self, name))
                real(name, "None or a finite number > 0", lambda v: v > 0)
        if self.gate_lower_bound is not None:
            real("gate_lower_bound", "None or a finite number < 0 (the KDA log decay lies in (bound, 0))",
                 lambda v: v < 0)
        for name in ("use_full_rank_gate", "mla_use_output_gate", "latent_moe_use_norm"):
            boolean(name, getattr(self, name))
        if self.mla_use_output_gate and self.attention_type != "mla":
            fail("mla_use_output_gate", "False with attention_type='gqa' (an MLA option)", self.mla_use_output_gate)
        if self.routed_expert_hidden_size is not None:
            positive_int("routed_expert_hidden_size")
            if self.num_experts is None:
                fail("routed_expert_hidden_size", "None without routed experts (num_experts None)",
                      self.routed_expert_hidden_size)
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            fail("latent_moe_use_norm", "False without a latent MoE (routed_expert_hidden_size None)",
                  self.latent_moe_use_norm)
        if self.attn_res_block_size is not None:
            positive_int("attn_res_block_size")
        if self.expert_quantization is not None:
            if self.expert_quantization != MXFP4:
                fail("expert_quantization", f"None or {MXFP4!r}", self.expert_quantization)
            if self.num_experts is None:
                fail("expert_quantization", "None without routed experts (num_experts None)", self.expert_quantization)
            widths = {"moe_intermediate_size": self.moe_intermediate_size,
                      "routed_expert_hidden_size or hidden_size": self.routed_expert_hidden_size or self.hidden_size}
            for name, width in widths.items():
                if width % MXFP4_GROUP:
                    fail(name, f"a multiple of {MXFP4_GROUP} with MXFP4 experts (one scale per {MXFP4_GROUP} inputs)",
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
                    fail(name, f"None or a token id in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size})",
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
        return kimi_linear_dict(self)

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
        return uses_k3_features(self)

    def to_kimi_k3_dict(self) -> dict:
        """This config as a Kimi K3 root config.json (model_type "kimi_k3"): the text backbone as its text_config
        (what to_kimi_linear_dict() writes, with K3's topk_method and MTP keys). The root carries no vision_config:
        the converter keeps a source K3 root's vision keys."""
        return kimi_k3_dict(self)


__all__ = ["KDAHybridConfig"]
