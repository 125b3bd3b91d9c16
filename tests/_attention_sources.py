"""Small Llama / Mistral / Qwen2 / Qwen3 source models for the attention-to-hybrid conversion tests: what each
family brings that the converted GQA layer must reproduce exactly, with every parameter non-default."""

from __future__ import annotations

import json

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)

# What each family brings that the GQA layer must reproduce exactly
FAMILIES = {
    # Llama 3 RoPE scaling (original_max_position_embeddings below the test's positions), untied head
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # head_dim that is not hidden / heads, no sliding window
    "mistral": (MistralConfig, MistralForCausalLM, dict(head_dim=24, sliding_window=None)),
    # q/k/v biases (no o_proj bias), tied embeddings
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    # per-head q/k RMSNorm, head_dim 32 != 64 / 4, tied embeddings
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=32, tie_word_embeddings=True)),
}


def source_model(family: str, seed: int = 0, **over):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra, **over})).eval()
    with torch.no_grad():  # every parameter non-default, so a dropped or misplaced tensor shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
    return model


def save_source(tmp_path, family: str, **over):
    model = source_model(family, **over)
    folder = tmp_path / family
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return model, folder


def ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
