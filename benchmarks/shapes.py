"""Model shapes shared by the benchmarks and examples."""

from kda_hybrid import KDAHybridConfig


def tiny_6p5m(**over) -> KDAHybridConfig:
    """The 6.5M-parameter shape of docs/architecture.md §7: hidden 256, 8 layers = 6 KDA + 2 MLA (1-based 4 and 8, the
    Kimi pattern), KDA 4 heads x 64, MLA 4 heads (latent 128, nope 64, rope 32, v 64), dense SwiGLU 512,
    vocab 1536 (6.48M parameters)."""
    cfg = dict(
        vocab_size=1536, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        linear_num_heads=4, linear_head_dim=64, attention_type="mla", num_attention_heads=4,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg.update(over)
    return KDAHybridConfig(**cfg)
