"""kda-hybrid: Kimi Delta Attention hybrid language models for Hugging Face transformers."""

from .kda_ops import chunk_kda, fused_recurrent_kda, triton_available

__version__ = "0.1.0"

__all__ = ["chunk_kda", "fused_recurrent_kda", "triton_available"]
