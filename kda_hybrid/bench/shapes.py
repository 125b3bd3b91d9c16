"""Model shapes the benchmarks, examples and docs share (docs/architecture.md §7).

    from kda_hybrid.bench.shapes import llama_twin_6p5m, tiny_6p5m

    ours = KDAHybridForCausalLM(tiny_6p5m())
    llama = LlamaForCausalLM(llama_twin_6p5m())   # the same-size all-attention baseline

Not a module a checkpoint carries: nothing in the modeling code imports it.
"""

from __future__ import annotations

from ..configuration_kda_hybrid import KDAHybridConfig

TINY_6P5M = dict(
    vocab_size=1536, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
    linear_num_heads=4, linear_head_dim=64, attention_type="mla", num_attention_heads=4,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


def tiny_6p5m(**over) -> KDAHybridConfig:
    """The 6.5M-parameter shape: hidden 256, 8 layers = 6 KDA + 2 MLA (1-based 4 and 8, the Kimi pattern), KDA 4
    heads x 64, MLA 4 heads (latent 128, nope 64, rope 32, v 64), dense SwiGLU 512, vocab 1536 (6,470,040 parameters).
    `over` replaces any of these keys or adds other `KDAHybridConfig` arguments."""
    return KDAHybridConfig(**{**TINY_6P5M, **over})


def llama_twin_6p5m(**over):
    """A transformers `LlamaConfig` of the same size as `tiny_6p5m()`: hidden 256, 8 layers, 4 heads x 64 (no GQA:
    4 key/value heads), SwiGLU 512, vocab 1536, untied embeddings and the same special-token ids
    (6,033,664 parameters). Every layer is full attention, so its KV cache grows 8 layers x 2 x 4 x 64 values per token.
    `over` replaces any of these keys."""
    from transformers import LlamaConfig

    cfg = dict(
        vocab_size=TINY_6P5M["vocab_size"], hidden_size=TINY_6P5M["hidden_size"],
        intermediate_size=TINY_6P5M["intermediate_size"], num_hidden_layers=TINY_6P5M["num_hidden_layers"],
        num_attention_heads=4, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=512 * 1024,  # rope table only; long_context.py goes to 128K and beyond
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return LlamaConfig(**{**cfg, **over})


__all__ = ["TINY_6P5M", "llama_twin_6p5m", "tiny_6p5m"]
