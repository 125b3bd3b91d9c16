"""kda-hybrid: Kimi Delta Attention hybrid language models for Hugging Face transformers."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from . import _moved
from .cache_kda_hybrid import KDAHybridCache
from .configuration_kda_hybrid import KDAHybridConfig
from .inference.long_context import prefill
from .kda_ops import chunk_kda, fused_recurrent_kda, triton_available
from .modeling_kda_hybrid import (
    KDAHybridForCausalLM,
    KDAHybridForSequenceClassification,
    KDAHybridForTokenClassification,
    KDAHybridModel,
    KDAHybridPreTrainedModel,
)

__version__ = "0.1.0"

_moved.install()  # the previous release's module paths (kda_hybrid.trainer, ...) still import, with a warning

AutoConfig.register(KDAHybridConfig.model_type, KDAHybridConfig, exist_ok=True)
AutoModel.register(KDAHybridConfig, KDAHybridModel, exist_ok=True)
AutoModelForCausalLM.register(KDAHybridConfig, KDAHybridForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(KDAHybridConfig, KDAHybridForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(KDAHybridConfig, KDAHybridForTokenClassification, exist_ok=True)
# save_pretrained writes auto_map and copies the (flat) modules, so checkpoints load with trust_remote_code
KDAHybridConfig.register_for_auto_class()
KDAHybridModel.register_for_auto_class("AutoModel")
KDAHybridForCausalLM.register_for_auto_class("AutoModelForCausalLM")
KDAHybridForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
KDAHybridForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")

__all__ = [
    "KDAHybridCache",
    "KDAHybridConfig",
    "KDAHybridForCausalLM",
    "KDAHybridForSequenceClassification",
    "KDAHybridForTokenClassification",
    "KDAHybridModel",
    "KDAHybridPreTrainedModel",
    "chunk_kda",
    "fused_recurrent_kda",
    "prefill",
    "triton_available",
]
