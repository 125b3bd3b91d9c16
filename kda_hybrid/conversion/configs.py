"""Config side of the conversion. The common currency is a `KDAHybridConfig`, the one reader of Kimi-Linear
config.json files (original, transformers-native and ours) and, with `to_kimi_linear_dict()`, the one writer:
every source config is parsed into one, the tensor inventory is computed from it, every target config comes
from it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..kimi_config_kda_hybrid import ALIASES, KIMI_ONLY_KEYS
from .layout import FILE_KEYS, ConversionError, as_config

KIMI_LINEAR, TRANSFORMERS, KDA_HYBRID, KIMI_K3 = "kimi_linear", "transformers", "kda_hybrid", "kimi_k3"
GGUF = "gguf"  # a llama.cpp file (to_gguf.py), target only
_READ_KEYS = (*ALIASES, *KIMI_ONLY_KEYS)  # names KDAHybridConfig reads besides its own fields


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None


def native_config(native: dict):
    """A transformers-native KimiLinearConfig (as a config.json dict) -> our config.

    transformers writes only the keys that differ from its defaults, so the dict is completed by its own
    `KimiLinearConfig` first (its defaults and key aliases apply); its `to_dict()` uses Kimi-Linear and native
    key names, which our config reads. Its `head_dim` is the MLA rope dim, not ours (a GQA head dim): dropped.
    transformers' native MLA never rotates (NoPE)."""
    from transformers import KimiLinearConfig  # the config module only: no modeling code, no fla

    from ..configuration_kda_hybrid import FIELDS

    try:
        full = KimiLinearConfig(**{k: v for k, v in native.items() if k not in FILE_KEYS}).to_dict()
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json: transformers' KimiLinearConfig refuses it: {err}") from None
    known = FIELDS | set(_READ_KEYS)
    ours = {k: v for k, v in full.items() if k in known and k not in FILE_KEYS and k != "head_dim"}
    return as_config({**ours, "mla_use_nope": True})


def native_to_kimi_dict(native: dict) -> dict:
    """A transformers-native KimiLinearConfig (as a config.json dict) -> an original Kimi-Linear dict."""
    return kimi_dict(native_config(native))


def kimi_dict(config) -> dict:
    try:
        return config.to_kimi_linear_dict()
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None


def kda_hybrid_config(config, *, router_weights_from_biased_scores: bool, dtype: str | None):
    """Our config to write for a source config (a KDAHybridConfig or a config.json dict in any naming)."""
    config = copy.deepcopy(as_config(config))
    config.router_weights_from_biased_scores = bool(router_weights_from_biased_scores)
    config.architectures = ["KDAHybridForCausalLM"]
    if dtype is not None:
        config.dtype = dtype
    return config


def kimi_linear_config(config, *, source_config: dict | None, dtype: str | None) -> dict:
    """The original-format config.json to write: `source_config` when the source is already original (its extra
    keys kept), else what our config writes."""
    out = dict(source_config) if source_config is not None else kimi_dict(config)
    out.setdefault("architectures", ["KimiLinearForCausalLM"])
    out["model_type"] = "kimi_linear"
    if dtype is not None:
        out.pop("dtype", None)
        out["torch_dtype"] = dtype
    return out


def kimi_k3_config(config, *, dtype: str | None) -> dict:
    """The K3 root config.json to write for a K3-architecture config: its text backbone as `text_config` (with the
    MXFP4 `quantization_config` when the experts are MXFP4), no vision_config (the text model has no vision
    tower; a K3 source's vision tensors are skipped and listed in the conversion record)."""
    from ..kimi_config_kda_hybrid import k3_quantization_config

    try:
        out = config.to_kimi_k3_dict()
    except ValueError as err:
        raise ConversionError(f"config.json: {err}") from None
    text = out["text_config"]
    if config.expert_quantization == "mxfp4":
        text["quantization_config"] = k3_quantization_config()
    if dtype is not None:
        out["dtype"] = text["dtype"] = dtype
    return out
