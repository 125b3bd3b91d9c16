"""KDA hybrid causal LM (the Kimi Linear architecture) for transformers: decoder, base model, causal LM.

Layers (layers_kda_hybrid.py, docs/architecture.md §2-§4): KDA delta-rule linear attention in most layers, full attention
(NoPE MLA, or GQA with RoPE) every few layers, dense SwiGLU or DeepSeek-V3-style MoE MLPs. Parameter names
follow the original Kimi-Linear checkpoint so that conversion is renaming only.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .cache_kda_hybrid import KDAHybridCache
from .configuration_kda_hybrid import KDAHybridConfig
from .layers_kda_hybrid import (
    KDAHybridAttention,
    KDAHybridDeltaAttention,
    KDAHybridGatedRMSNorm,
    KDAHybridMLAttention,
    KDAHybridMLP,
    KDAHybridMoE,
    KDAHybridRMSNorm,
    KDAHybridRotaryEmbedding,
    KDAHybridRouter,
    PACKED_ATTENTION_MAX_DOCS,
    packed_cu_seqlens,
)
from .model_card_kda_hybrid import write_model_card


# ------------------------------------------------------------------------------------------------------
# Decoder
# ------------------------------------------------------------------------------------------------------


class KDAHybridDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = KDAHybridDeltaAttention(config, layer_idx)
        elif config.attention_type == "mla":
            self.self_attn = KDAHybridMLAttention(config, layer_idx)
        else:
            self.self_attn = KDAHybridAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = KDAHybridMoE(config)
        else:
            self.mlp = KDAHybridMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, token_mask=None, cache=None, position_embeddings=None,
                cu_seqlens=None, attention_cu_seqlens=None, **kwargs):
        """cu_seqlens: packed documents for the KDA layers; attention_cu_seqlens: the same for the attention layers
        when they run per document (sdpa), else None and `attention_mask` is block-diagonal."""
        layer_idx = self.self_attn.layer_idx
        cache_layer = cache.layers[layer_idx] if cache is not None else None
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == "linear_attention":
            hidden_states = self.self_attn(hidden_states, token_mask=token_mask, cache_layer=cache_layer,
                                           cu_seqlens=cu_seqlens)
        else:
            hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask, cache_layer=cache_layer,
                                           position_embeddings=position_embeddings,
                                           cu_seqlens=attention_cu_seqlens)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        mlp = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return residual + mlp(hidden_states)


class KDAHybridPreTrainedModel(PreTrainedModel):
    config_class = KDAHybridConfig
    config: KDAHybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDAHybridDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True
    _is_stateful = False  # crop() rolls KDA states back exactly, so assisted decoding is allowed
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "e_score_correction_bias", "gate.weight"]

    def save_pretrained(self, save_directory, is_main_process=True, **kwargs):
        if self.is_remote_code():  # auto_map for both Auto classes, whichever class is saved
            module = type(self).__module__.rsplit(".", 1)[-1]
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}),
                                    "AutoModel": f"{module}.KDAHybridModel",
                                    "AutoModelForCausalLM": f"{module}.KDAHybridForCausalLM",
                                    "AutoModelForSequenceClassification":
                                        f"{module}.KDAHybridForSequenceClassification",
                                    "AutoModelForTokenClassification": f"{module}.KDAHybridForTokenClassification"}
        super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_model_card(self.config, save_directory)  # README.md; a card the user wrote is kept

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        write_model_card(self.config, working_dir, model_id=repo_id)  # replaces push_to_hub's placeholder card
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # depthwise short conv: default PyTorch init (uniform in +-1/sqrt(kernel)), as fla does
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            module.weight.uniform_(-bound, bound)
        elif isinstance(module, (KDAHybridRMSNorm, KDAHybridGatedRMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, KDAHybridRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, KDAHybridDeltaAttention):
            # decay rates exp(A_log) in [1, 16] and dt in [1e-3, 1e-1] (Mamba2 / fla initialisation)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


class KDAHybridModel(KDAHybridPreTrainedModel):
    def __init__(self, config: KDAHybridConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(KDAHybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = KDAHybridRotaryEmbedding(config) if config.attention_type == "gqa" else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDAHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: KDAHybridCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if past_key_values is not None:
            warnings.warn("`past_key_values` is deprecated; pass `cache=`", FutureWarning, stacklevel=2)
            if cache is None:
                cache = past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        # Packed documents (position_ids restarting inside a row, no attention_mask, as transformers'
        # DataCollatorWithFlattening produces): KDA states and convs restart at every document and the causal
        # mask is block-diagonal. A packed batch has no single state to continue from, so it takes no cache.
        cu_seqlens = None
        if position_ids is not None and attention_mask is None and cache is None:
            cu_seqlens = packed_cu_seqlens(position_ids)
            if cu_seqlens is not None:
                use_cache = False
        if use_cache and cache is None:
            cache = KDAHybridCache(self.config)
        if cache is not None and not isinstance(cache, KDAHybridCache):
            raise TypeError(f"cache must be a KDAHybridCache, got {type(cache).__name__}")
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device).unsqueeze(0)

        token_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            if attention_mask.shape != (B, past + T) and attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must be [B, past + T] = {(B, past + T)}, got "
                                 f"{tuple(attention_mask.shape)}")
            step = attention_mask[:, -T:].bool()
            if not bool(step.all()):
                token_mask = step
        # Chunked prefill on a cache without padding: MLA layers attend with continuation_attention and need no
        # [T, past + T] mask (at 128K context, building one costs GiBs)
        plain_continuation = (
            past > 0 and T > 1 and cu_seqlens is None and self.config.attention_type == "mla"
            and self.config._attn_implementation == "sdpa"
            and (attention_mask is None or (attention_mask.dim() == 2 and bool(attention_mask.all())))
        )
        # Packed documents under sdpa: attention runs per document (packed_attention), no block-diagonal mask
        attention_cu_seqlens = None
        if (cu_seqlens is not None and self.config._attn_implementation == "sdpa"
                and len(cu_seqlens) - 1 <= PACKED_ATTENTION_MAX_DOCS):
            attention_cu_seqlens = cu_seqlens
        causal_mask = None
        if self.config.full_attention_layers and not plain_continuation and attention_cu_seqlens is None:
            causal_mask = create_causal_mask(
                config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                position_ids=position_ids,
            )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if self.rotary_emb is not None else None

        hidden_states = inputs_embeds
        all_hidden = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=causal_mask, token_mask=token_mask, cache=cache,
                                  position_embeddings=position_embeddings, cu_seqlens=cu_seqlens, use_cache=use_cache,
                                  attention_cu_seqlens=attention_cu_seqlens)
            if output_hidden_states:
                all_hidden += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden = all_hidden[:-1] + (hidden_states,)
        if cache is not None:
            cache.advance(T)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None,
                                       hidden_states=all_hidden)


class KDAHybridForCausalLM(KDAHybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # the base model's plan is in KDAHybridConfig
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KDAHybridConfig):
        super().__init__(config)
        self.model = KDAHybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() builds a DynamicCache for ordinary models; this model needs its hybrid cache."""
        user_cache = model_kwargs.get("cache")
        if user_cache is not None and not isinstance(user_cache, KDAHybridCache):
            raise TypeError(f"cache must be a KDAHybridCache, got {type(user_cache).__name__}")
        if user_cache is None and generation_config.use_cache is not False and \
                generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                             "KDA hybrid models use their own KDAHybridCache (leave cache_implementation unset)")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if user_cache is None and model_kwargs.get("cache") is not None:
            cache = KDAHybridCache(self.config)
            if generation_config.is_assistant:
                cache.activate_past_recording()
            model_kwargs["cache"] = cache

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDAHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: KDAHybridCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            past_key_values=past_key_values,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)


# ------------------------------------------------------------------------------------------------------
# Classification heads
# ------------------------------------------------------------------------------------------------------


class KDAHybridForSequenceClassification(GenericForSequenceClassification, KDAHybridPreTrainedModel):
    """The decoder + a linear `score` head read at each row's last non-padding token (transformers' generic head:
    the rightmost token that is not `pad_token_id`, so left and right padding both work; a batch of more than
    one row needs `pad_token_id`)."""

    def __init__(self, config: KDAHybridConfig):
        # the generic head builds its body with AutoModel.from_config, which a remote-code config cannot reach
        # without trust_remote_code: build this package's decoder directly
        KDAHybridPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = KDAHybridModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class KDAHybridForTokenClassification(GenericForTokenClassification, KDAHybridPreTrainedModel):
    """The decoder + dropout + a linear `score` head on every token (transformers' generic head; dropout
    `config.classifier_dropout`, default 0.1)."""

    def __init__(self, config: KDAHybridConfig):
        KDAHybridPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = KDAHybridModel(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()


__all__ = [
    "KDAHybridPreTrainedModel",
    "KDAHybridModel",
    "KDAHybridForCausalLM",
    "KDAHybridForSequenceClassification",
    "KDAHybridForTokenClassification",
]
