"""The way back: a kda_hybrid checkpoint whose every layer is GQA attention saved as a transformers
`LlamaForCausalLM` folder (same tensor names, no remote code needed).

    from kda_hybrid.conversion.to_attention import export_llama
    export_llama("runs/teacher/final", "runs/teacher-llama")

This is how examples/distill.py's teacher is made here: a Llama-architecture model trained by examples/train.py
(`--all-attention --config-json '{"attention_type": "gqa"}'`), exported, then converted into a hybrid with
`--layer-types`. The export loads the whole model in memory (meant for models that fit), checks that the Llama it
writes computes the same logits as the hybrid it came from, and publishes the folder as the converter does
(publish.Staging: crash-safe, `overwrite` replaces only an earlier output of this tool).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .layout import ConversionError
from .publish import Staging, check_destination

_CARRIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
            "tokenizer.model")


def llama_config(config):
    """The LlamaConfig of an all-attention GQA kda_hybrid config; ConversionError naming what Llama cannot hold."""
    from transformers import LlamaConfig

    problems = []
    if any(t != "full_attention" for t in config.layer_types):
        problems.append("every layer must be full attention (layer_types has linear_attention layers)")
    if config.attention_type != "gqa":
        problems.append(f"attention_type must be 'gqa', got {config.attention_type!r}")
    if config.num_experts:
        problems.append("a dense MLP is needed (num_experts is set)")
    if config.attention_qk_norm:
        problems.append("attention_qk_norm=True has no Llama equivalent (Qwen3 has it)")
    if config.attention_bias != config.attention_out_bias:
        problems.append("Llama has one attention_bias for q/k/v and o (Qwen2's q/k/v-only bias differs)")
    if problems:
        raise ConversionError("cannot export as Llama: " + "; ".join(problems))
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.rope_theta}),
        attention_bias=config.attention_bias, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        initializer_range=config.initializer_range,
    )


def export_llama(src, dst, *, overwrite: bool = False) -> Path:
    from transformers import LlamaForCausalLM

    from ..modeling_kda_hybrid import KDAHybridForCausalLM

    src, dst = Path(src), Path(dst)
    dst_real = check_destination(src, dst, overwrite=overwrite)  # the converter's rules: never the source, own outputs
    hybrid = KDAHybridForCausalLM.from_pretrained(src).eval()
    dtype = next(hybrid.parameters()).dtype
    # built in fp32 and cast only for saving: Llama's .to(bf16) would round its RoPE inv_freq buffer too
    llama = LlamaForCausalLM(llama_config(hybrid.config)).eval()
    missing, unexpected = llama.load_state_dict(hybrid.state_dict(), strict=False)
    missing = [n for n in missing if not (hybrid.config.tie_word_embeddings and n == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"cannot export as Llama: missing {missing[:10]}, unexpected {unexpected[:10]}")
    ids = torch.arange(3, 3 + min(64, hybrid.config.vocab_size - 3))[None]
    with torch.no_grad():  # same weights, same arithmetic: any difference is a mapping bug
        a, b = hybrid.float()(ids).logits, llama.float()(ids).logits
    if not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
        raise ConversionError(f"exported Llama differs from the source (max |diff| {(a - b).abs().max():.2e})")
    llama.to(dtype)
    dst_real.parent.mkdir(parents=True, exist_ok=True)
    staging = Staging(dst_real, {"source": src.name, "source_format": "kda_hybrid", "target": "llama"})
    try:  # published as every conversion is: dst is the old output or the complete new one at every instant
        llama.save_pretrained(staging.path)
        for name in _CARRIED:
            if (src / name).is_file() and not (staging.path / name).exists():
                shutil.copyfile(src / name, staging.path / name)
        staging.publish(overwrite=overwrite)
    except BaseException:
        staging.discard()
        raise
    return dst
