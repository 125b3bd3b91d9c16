"""GGUF in: a llama.cpp model file of the Llama / Mistral / Qwen2 / Qwen3 family as a conversion source.

    python -m kda_hybrid.conversion SmolLM2-135M-Instruct.Q4_1.gguf student --layer-types kkA

The file is read through transformers' own GGUF loader (`from_pretrained(..., gguf_file=)`, which needs the
`gguf` package): its config, its tensors dequantised to float32 under transformers' names (llama.cpp's q/k row
permutation undone), and its tokenizer with the chat template. So the converted model starts from exactly the
model transformers loads from that file, and with every layer `A` computes exactly what it computes.

Unlike a safetensors folder, a GGUF file is not streamed: its quantised blocks are dequantised whole, so the
conversion holds the model once in float32 (540 MB for a 135M model).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .checkpoint import MemorySource
from .from_attention import ATTENTION_SOURCES
from .layout import ConversionError

logger = logging.getLogger("kda_hybrid.conversion")

SUFFIX = ".gguf"


def find_gguf(src: Path) -> Path | None:
    """The GGUF file `src` names: `src` itself (a `.gguf` file) or the one `.gguf` file of a folder without a
    config.json (a folder with config.json is a safetensors checkpoint, whatever else it holds). None otherwise."""
    src = Path(src)
    if src.is_file():
        return src if src.suffix.lower() == SUFFIX else None
    if not src.is_dir() or (src / "config.json").is_file():
        return None
    found = sorted(p for p in src.iterdir() if p.is_file() and p.suffix.lower() == SUFFIX)
    if len(found) > 1:
        raise ConversionError(f"{src}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); pass "
                              "the one to convert")
    return found[0] if found else None


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConversionError("reading a GGUF file needs the gguf package: pip install gguf") from None


def gguf_config(path: Path) -> dict:
    """The file's transformers config as a config.json dict (reads the metadata only, not the tensors). Refuses
    an architecture other than the attention families this converter turns into hybrids."""
    from transformers import AutoConfig

    _require_gguf_package()
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError) as err:
        raise ConversionError(f"{path}: not a GGUF file transformers can read ({err})") from None
    raw = config.to_dict()
    if raw.get("model_type") not in ATTENTION_SOURCES:
        raise ConversionError(f"{path}: a GGUF of model_type {raw.get('model_type')!r}; GGUF input converts the "
                              f"{'/'.join(ATTENTION_SOURCES)} families")
    return raw


def gguf_source(path: Path, progress: bool = True):
    """(a Source over the float32 tensors under transformers' names, the tokenizer): the model and tokenizer
    `from_pretrained(folder, gguf_file=name)` gives. progress=False silences the loaders' progress bars."""
    import contextlib
    import warnings
    from unittest import mock

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    _require_gguf_package()
    logger.info("reading %s (dequantising to float32)", path)
    with contextlib.ExitStack() as quiet, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not progress:
            # the dequantisation bar is a plain tqdm in transformers' GGUF module; the weight-loading bar obeys
            # transformers' switch
            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            if hasattr(gguf_utils, "tqdm"):
                quiet.enter_context(mock.patch.object(gguf_utils, "tqdm", lambda items, **kw: items))
            if hf_logging.is_progress_bar_enabled():
                hf_logging.disable_progress_bar()
                quiet.callback(hf_logging.enable_progress_bar)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tensors = {name: t.detach() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding itself, not a second tensor
    return MemorySource([tensors]), tokenizer
