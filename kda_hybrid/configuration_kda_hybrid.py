"""Configuration of KDA hybrid models (the Kimi Linear and Kimi K3 architectures): KDA layers with a few
full-attention layers, dense or DeepSeek-V3-style MoE MLPs, and K3's switches (bounded decay gate, full-rank output
gates, SiTU-GLU, latent MoE, MXFP4 experts, Block Attention Residuals).

Declared as transformers 5.x declares configs: typed fields grouped by concern, each with the rule its value alone
must meet (checked at construction and on every assignment: a ValueError naming the field, what it must be and
what it was), and a few named validators for the rules between fields (`validate_layers`, `validate_attention`,
`validate_moe`, `validate_k3`, `validate_special_tokens`; run at construction, by `validate()`, by every model's
constructor and by save_pretrained). Kimi Linear / K3 config.json keys are read and written through the one key
table of `kimi_config_kda_hybrid`."""

from __future__ import annotations

import dataclasses
import functools

from transformers import PretrainedConfig

from .config_rules_kda_hybrid import (
    boolean,
    fail,
    field,
    is_int,
    layer_types,
    linear_head_dim,
    non_negative_int,
    one_of,
    optional,
    positive_int,
    real,
)
from .kimi_config_kda_hybrid import (
    ALIASES,
    FULL,
    LINEAR,
    MXFP4,
    MXFP4_GROUP,
    kimi_k3_dict,
    kimi_linear_dict,
    read_kimi_keys,
    uses_k3_features,
)

# RoPE variants of transformers' ROPE_INIT_FUNCTIONS whose inverse frequencies are fixed at construction
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MLA_ROPE = "None with attention_type='mla' (NoPE: no RoPE)"
# Fields whose None means "derived from others" while the config is built (after that, None is refused)
DERIVED = ("num_key_value_heads", "head_dim", "attention_out_bias", "layer_types")


def _derived_head_dim(hidden_size, num_attention_heads):
    """head_dim when none is given: hidden_size // num_attention_heads (None when those are not positive ints)."""
    if is_int(hidden_size) and is_int(num_attention_heads) and num_attention_heads > 0:
        return hidden_size // num_attention_heads
    return None


def _reads_kimi_keys(init):
    """__init__ sees our own keyword arguments only, whatever names the caller's dict used."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **read_kimi_keys(kwargs, FIELDS))

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
    `num_local_experts`, `linear_conv_kernel_dim`) and a Kimi K3 root config.json are read too;
    `to_kimi_linear_dict()` / `to_kimi_k3_dict()` go back. Every field meets its rule at construction and on
    assignment; the rules between fields are checked at construction and by `validate()`.
    """

    model_type = "kda_hybrid"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    attribute_map = dict(ALIASES)
    # Tensor parallelism (transformers' styles; docs/ecosystem.md): every layer kind splits by heads or by
    # hidden units, and each block ends in one rowwise all-reduce. KDA and attention layers are both `self_attn`.
    # KDA: q/k/v, the gates' second halves (f_b, g_b), beta (b_proj) colwise by head; the depthwise convs and the
    # per-head A_log [1, 1, H, 1] / dt_bias [H * K] sharded on their head dim (a parameter entry shards only,
    # colwise shards dim ndim - 2, embedding_rowwise dim 0); `self_attn` runs with local parameters so A_log /
    # dt_bias read as this process's heads; o_norm (shared by heads) replicated, its gradient summed. Shared
    # keys and values: linear_num_kv_heads must divide by the TP size (each process keeps its query heads' groups).
    # MLA: q (or q_b) and kv_b colwise by head, the latent projection replicated (mla_kv_a_proj sums the gradient
    # of its shared rope part). GQA: q/k/v colwise (num_key_value_heads must divide by the TP size). MLP and every
    # expert: gate/up (w1/w3) colwise, down (w2) rowwise; the router replicated.
    base_model_tp_plan = {
        "layers.*.self_attn": "local_params",
        **{f"layers.*.self_attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")},
        **{f"layers.*.self_attn.{n}_conv1d.weight": "embedding_rowwise" for n in "qkv"},
        **{f"layers.*.self_attn.{n}": "colwise" for n in ("A_log", "dt_bias", "f_b_proj", "g_b_proj", "b_proj")},
        "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        **{f"layers.*.{m}.{n}": style for m in ("mlp", "block_sparse_moe.shared_experts")
           for n, style in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))},
        **{f"layers.*.block_sparse_moe.experts.*.{n}": style
           for n, style in (("w1", "colwise"), ("w3", "colwise"), ("w2", "rowwise"))},
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # --- core ---
    vocab_size: int = field(32000, positive_int)  # token vocabulary
    hidden_size: int = field(1024, positive_int)  # model width D
    intermediate_size: int = field(2816, positive_int)  # dense GLU width
    num_hidden_layers: int = field(8, positive_int)  # decoder layers
    # per layer "linear_attention" (KDA) or "full_attention"; None: every 4th layer (1-based 4, 8, ...) attention
    layer_types: list[str] | None = field(None, layer_types)
    hidden_act: str = field("silu", one_of("silu", "swish", "situ", shown="'silu' or 'situ'"))  # GLU activation
    rms_norm_eps: float = field(1e-5, real("a positive float", lambda v: v > 0))
    initializer_range: float = field(0.02, real("a finite number >= 0 (a standard deviation)", lambda v: v >= 0))
    max_position_embeddings: int = field(1048576, positive_int)  # NoPE MLA has no limit; GQA RoPE and generate
    tie_word_embeddings: bool = field(False, boolean)
    use_cache: bool = field(True, boolean)
    pad_token_id: int | None = None  # token ids: validate_special_tokens (their bound is vocab_size)
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # --- KDA layers ---
    linear_num_heads: int = field(8, positive_int)  # KDA heads H
    linear_head_dim: int = field(128, linear_head_dim)  # KDA head dim (K = V)
    # KDA key/value heads (None: linear_num_heads). Fewer: keys, values, the decay gate and beta per key/value head,
    # one recurrent state each, read by linear_num_heads / linear_num_kv_heads query heads (as GQA's repeat_kv
    # pairs them: query head h reads key/value head h // groups); no Kimi Linear or llama.cpp form
    linear_num_kv_heads: int | None = field(None, optional(positive_int))
    linear_conv_kernel_size: int = field(4, positive_int)  # causal depthwise short-conv width on q, k, v
    linear_attention_bias: bool = field(False, boolean)  # bias on the KDA q/k/v projections (Qwen2-style sources)
    # --- full-attention layers ---
    attention_type: str = field("mla", one_of("mla", "gqa"))  # Kimi Linear NoPE MLA, or GQA + RoPE
    num_attention_heads: int = field(8, positive_int)
    num_key_value_heads: int | None = field(None, positive_int)  # GQA (None: num_attention_heads)
    head_dim: int | None = field(None, positive_int)  # GQA head dim (None: hidden_size // num_attention_heads)
    rope_theta: float = field(10000.0, real("a finite number > 0 (the RoPE base)", lambda v: v > 0))  # GQA
    attention_qk_norm: bool = field(False, boolean)  # GQA: RMSNorm over each head's q and k before RoPE (Qwen3)
    attention_bias: bool = field(False, boolean)  # bias on the full-attention projections
    attention_out_bias: bool | None = field(None, boolean)  # bias on o_proj (None: as attention_bias)
    attention_dropout: float = field(0.0, real("a probability in [0, 1)", lambda v: 0 <= v < 1))
    q_lora_rank: int | None = field(None, optional(positive_int))  # MLA low-rank query (None: one q_proj)
    kv_lora_rank: int = field(512, positive_int)  # MLA compressed latent width (cached)
    qk_nope_head_dim: int = field(128, positive_int)  # MLA per-head key/query part from the latent
    qk_rope_head_dim: int = field(64, non_negative_int)  # MLA shared key part (cached; not rotated under NoPE)
    v_head_dim: int = field(128, positive_int)  # MLA value head dim
    # --- MLP / MoE ---
    num_experts: int | None = field(None, optional(positive_int))  # routed experts; None or 0: dense MLPs
    num_experts_per_tok: int = field(8, positive_int)  # top-k
    moe_intermediate_size: int = field(1024, positive_int)  # expert width
    n_shared_experts: int = field(1, non_negative_int)  # one SwiGLU of n * moe_intermediate_size
    first_k_dense_replace: int = field(1, non_negative_int)  # the first k layers keep a dense MLP
    routed_scaling_factor: float = field(1.0, real("a finite number > 0", lambda v: v > 0))
    norm_topk_prob: bool = field(True, boolean)  # renormalise the top-k weights
    router_weights_from_biased_scores: bool = field(False, boolean)  # True: Kimi Hub code (score + bias)
    # --- Kimi K3 switches (each off: Kimi Linear) ---
    # KDA decay lb * sigmoid(exp(A_log) (z + dt_bias)) in (lb, 0)
    gate_lower_bound: float | None = field(None, optional(real(
        "None or a finite number < 0 (the KDA log decay lies in (bound, 0))", lambda v: v < 0)))
    use_full_rank_gate: bool = field(False, boolean)  # KDA output gate from one g_proj [H * V, D]
    mla_use_output_gate: bool = field(False, boolean)  # MLA output o_proj(attn * sigmoid(g_proj(x)))
    activation_situ_beta: float | None = field(None, optional(real("None or a finite number > 0", lambda v: v > 0)))
    activation_situ_linear_beta: float | None = field(None, optional(real("None or a finite number > 0",
                                                                          lambda v: v > 0)))
    routed_expert_hidden_size: int | None = field(None, optional(positive_int))  # latent MoE width
    latent_moe_use_norm: bool = field(False, boolean)  # latent MoE: RMSNorm on the routed sum
    attn_res_block_size: int | None = field(None, optional(positive_int))  # Block Attention Residuals
    expert_quantization: str | None = field(None, one_of(None, MXFP4, shown=f"None or {MXFP4!r}"))

    def __post_init__(self, rope_parameters=None, **kwargs):
        derived = {}
        if self.layer_types is None and is_int(self.num_hidden_layers):
            derived["layer_types"] = [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers)]
        if self.num_key_value_heads is None:
            derived["num_key_value_heads"] = self.num_attention_heads
        if self.head_dim is None:
            derived["head_dim"] = _derived_head_dim(self.hidden_size, self.num_attention_heads)
        if self.attention_out_bias is None:
            derived["attention_out_bias"] = self.attention_bias
        for name, value in derived.items():  # not checked alone: validate() does (an MLA head_dim may be 0)
            object.__setattr__(self, name, value)
        # transformers standardises rope_parameters (adds rope_type and rope_theta) in its __post_init__ and its
        # ROPE_INIT_FUNCTIONS read it, so scaled RoPE (llama3, yarn, linear) is computed exactly as in the source.
        # Only GQA rotates: an MLA (NoPE) config has no rope_parameters at all, so transformers neither standardises
        # nor validates RoPE for it (its unused head_dim may be odd)
        if self.attention_type == "gqa":
            self.rope_parameters = dict(rope_parameters) if isinstance(rope_parameters, dict) else rope_parameters
            if isinstance(self.rope_parameters, dict) and "rope_theta" in self.rope_parameters:
                self.rope_theta = self.rope_parameters["rope_theta"]  # one base: the dict's, as transformers reads it
        elif rope_parameters is not None:
            fail("rope_parameters", MLA_ROPE, rope_parameters)
        self._validate_between_fields()  # before transformers' own checks, so its messages are ours
        super().__post_init__(**kwargs)
        self.validate()

    def __setattr__(self, name, value):
        """Every assignment meets its field's rule (at construction and after: config.num_experts_per_tok = 0
        is refused here, not deep in a forward); the rules between fields are validate()'s."""
        name = ALIASES.get(name, name)
        if name == "num_experts" and value == 0 and is_int(value):
            value = None  # 0 routed experts: dense
        if name == "layer_types" and isinstance(value, tuple):
            value = list(value)
        rule = RULES.get(name)
        building = not self.__dict__.get("_post_init_done", False)
        if rule is not None and not (value is None and building and name in DERIVED):
            rule(name, value)
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------------------
    # Rules between fields
    # ------------------------------------------------------------------------------------------------
    def validate(self):
        """The rules between fields, then transformers' own class validators. Called at construction, by every
        model's constructor and by save_pretrained. A GQA rope_parameters dict assigned later is standardised as
        the constructor's is (rope_type and rope_theta filled in, and rope_theta the dict's)."""
        self._validate_between_fields()
        rope = getattr(self, "rope_parameters", None)
        if self.attention_type == "gqa" and isinstance(rope, dict):
            rope.setdefault("rope_type", rope.get("type", "default"))
            rope.setdefault("rope_theta", self.rope_theta)
            self.rope_theta = rope["rope_theta"]
        super().validate()  # after ours, so that a field both check gets our message

    def _validate_between_fields(self):
        self.validate_layers()
        self.validate_attention()
        self.validate_moe()
        self.validate_k3()
        self.validate_special_tokens()

    def _head_dim_read(self) -> bool:
        """Whether head_dim means anything: GQA's, or one given (an MLA config's derived hidden_size // heads may
        be 0 and is never read)."""
        return self.attention_type == "gqa" or self.head_dim != _derived_head_dim(self.hidden_size,
                                                                                  self.num_attention_heads)

    def validate_layers(self):
        n = self.num_hidden_layers
        if not isinstance(self.layer_types, list):
            fail("layer_types", f"a list of num_hidden_layers={n} entries", self.layer_types)
        if len(self.layer_types) != n:
            fail("layer_types", f"a list of num_hidden_layers={n} entries", f"{len(self.layer_types)} entries")
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            fail("layer_types entries", f"'{LINEAR}' or '{FULL}'", bad[0])

    def validate_attention(self):
        if self.linear_num_heads % self.linear_kv_heads:
            fail("linear_num_heads", f"a multiple of linear_num_kv_heads={self.linear_kv_heads}", self.linear_num_heads)
        if self.attention_type == "gqa":
            positive_int("head_dim", self.head_dim)
            if self.num_attention_heads % self.num_key_value_heads:
                fail("num_attention_heads", f"a multiple of num_key_value_heads={self.num_key_value_heads}",
                     self.num_attention_heads)
            if self.head_dim % 2:
                fail("head_dim", "even (RoPE rotates pairs)", self.head_dim)
        rope = getattr(self, "rope_parameters", None)
        if self.attention_type == "mla" and rope is not None:
            fail("rope_parameters", MLA_ROPE, rope)
        if rope is not None:
            if not isinstance(rope, dict):
                fail("rope_parameters", "None or a dict in transformers' form ({'rope_type': ..., ...})", rope)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in STATIC_ROPE_TYPES:
                fail("rope_parameters.rope_type", f"one of {STATIC_ROPE_TYPES} (RoPE whose frequencies do not "
                     "depend on the sequence length)", rope_type)
        if self.attention_type == "mla" and self.attention_qk_norm:
            fail("attention_qk_norm", "False with attention_type='mla' (a GQA option)", self.attention_qk_norm)
        if self.mla_use_output_gate and self.attention_type != "mla":
            fail("mla_use_output_gate", "False with attention_type='gqa' (an MLA option)", self.mla_use_output_gate)

    def validate_moe(self):
        if self.num_experts is not None and self.num_experts_per_tok > self.num_experts:
            fail("num_experts_per_tok", f"<= num_experts={self.num_experts}", self.num_experts_per_tok)
        if self.routed_expert_hidden_size is not None and self.num_experts is None:
            fail("routed_expert_hidden_size", "None without routed experts (num_experts None)",
                 self.routed_expert_hidden_size)
        if self.latent_moe_use_norm and self.routed_expert_hidden_size is None:
            fail("latent_moe_use_norm", "False without a latent MoE (routed_expert_hidden_size None)",
                 self.latent_moe_use_norm)

    def validate_k3(self):
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            if getattr(self, name) is not None and self.hidden_act != "situ":
                fail(name, "None unless hidden_act='situ' (it would be ignored)", getattr(self, name))
        if self.expert_quantization is not None:
            if self.num_experts is None:
                fail("expert_quantization", "None without routed experts (num_experts None)", self.expert_quantization)
            widths = {"moe_intermediate_size": self.moe_intermediate_size,
                      "routed_expert_hidden_size or hidden_size": self.routed_expert_hidden_size or self.hidden_size}
            for name, width in widths.items():
                if width % MXFP4_GROUP:
                    fail(name, f"a multiple of {MXFP4_GROUP} with MXFP4 experts (one scale per {MXFP4_GROUP} inputs)",
                         width)

    def validate_special_tokens(self):
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            for token in ids:
                if token is not None and not (is_int(token) and 0 <= token < self.vocab_size):
                    fail(name, f"None or a token id in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size})", value)

    # ------------------------------------------------------------------------------------------------
    # Derived views and the Kimi writers
    # ------------------------------------------------------------------------------------------------
    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def linear_kv_heads(self) -> int:
        """The KDA layers' key/value heads: linear_num_kv_heads, or linear_num_heads when None."""
        return self.linear_num_kv_heads or self.linear_num_heads

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


RULES = {f.name: f.metadata["rule"] for f in dataclasses.fields(KDAHybridConfig) if "rule" in f.metadata}
# this class's own fields (not PretrainedConfig's) and rope_parameters (GQA's, set in __post_init__): what a config.json
# may name besides Kimi's keys and transformers' generic ones
FIELDS = frozenset(f.name for f in dataclasses.fields(KDAHybridConfig)) - {
    f.name for f in dataclasses.fields(PretrainedConfig)} | {"rope_parameters"}
KDAHybridConfig.__init__ = _reads_kimi_keys(KDAHybridConfig.__init__)

__all__ = ["KDAHybridConfig"]
