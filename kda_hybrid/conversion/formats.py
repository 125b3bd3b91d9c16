"""The checkpoint layouts `convert()` reads and writes, declared once: one `CheckpointFormat` record per layout
(kimi_linear, transformers, kda_hybrid, kimi_k3) carries how it is recognised, how its config.json becomes our
config, which routing its reference code uses, how its tensors group into ours, which tensors are not the text
model, and, for a layout that is written, its `FolderTarget` (config, export dtypes, output sink). convert.py
holds no format name comparisons; a llama.cpp GGUF file (to_gguf.py) and the Llama-family sources
(from_attention.py) have their own paths."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint_kda_hybrid import write_checkpoint_metadata
from .configs import (
    GGUF,
    KDA_HYBRID,
    KIMI_K3,
    KIMI_LINEAR,
    TRANSFORMERS,
    kda_hybrid_config,
    kimi_k3_config,
    kimi_linear_config,
    native_config,
)
from .layout import (
    K3_TEXT_PREFIX,
    K3_VISION_PREFIXES,
    ConversionError,
    as_config,
    identity_groups,
    k3_groups,
    native_groups,
)

logger = logging.getLogger("kda_hybrid.conversion")

# Names only a transformers-native kimi_linear checkpoint uses (fused or moved tensors).
_NATIVE_MARKERS = (".self_attn.conv1d.weight", ".self_attn.forget_gate.", ".mlp.experts.gate_up_proj",
                   ".mlp.experts.down_proj", ".mlp.gate.weight")
# Stored in float32 in the released K3 layout whatever the rest is (K3.md §2): the KDA short convolutions and o_norm
K3_FP32_SUFFIXES = ("_conv1d.weight", ".self_attn.o_norm.weight")


@dataclass(frozen=True)
class FolderTarget:
    """What a folder layout `convert()` writes needs: which models it takes (`k3`: True K3 only, False Kimi Linear
    only, None both; `refusal` says why otherwise), its config (built before any tensor is written), the export
    dtypes its release uses, the sink its tensors go through, how its config is written, whether the package's
    code travels with it."""

    config: Callable  # (parsed, *, raw, same_layout, biased, dtype) -> what write_config writes
    write_config: Callable  # (config, folder)
    k3: bool | None = None
    refusal: str = ""
    export_dtypes: Callable | None = None  # (plan) -> None: adjusts plan.out_dtypes
    sink: Callable | None = None  # (writer, parsed config) -> what execute() writes through; None: the writer itself
    carries_code: bool = False

    def check(self, name: str, parsed) -> None:
        if self.k3 is not None and self.k3 != parsed.uses_k3_features:
            raise ConversionError(f"target: {self.refusal}, got {name!r}")


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint layout: `claims(config, tensor_names)` recognises it (tried in FORMATS' order), `parse(config)`
    -> our config (refusing a file that lacks what the layout needs), `biased_router(config)`: whether its reference
    code gathers router weights from the bias-corrected scores, `groups(parsed, inventory, headers)`: the tensor
    grouping rules (layout.py), `skipped_prefixes`: source tensors outside the text model, `target`: how it is
    written (None: read only)."""

    name: str
    claims: Callable[[dict, object], bool]
    parse: Callable[[dict], object]
    biased_router: Callable[[dict], bool]
    groups: Callable[[object, dict, object], list]
    skipped_prefixes: tuple[str, ...] = ()
    target: FolderTarget | None = None

    def text_headers(self, headers) -> tuple[dict, list[str]]:
        """The headers the text model consumes, and the names skipped (a K3 checkpoint's vision tower)."""
        if not self.skipped_prefixes:
            return dict(headers), []
        keep = {n: h for n, h in headers.items() if not n.startswith(self.skipped_prefixes)}
        return keep, sorted(set(headers) - set(keep))


def _needs(key: str, what: str):
    def parse(config: dict):
        if key not in config:
            raise ConversionError(f"config.json: {what} needs {key!r}")
        return as_config(config)
    return parse


def _is_native(config: dict, names) -> bool:
    if config.get("model_type") != "kimi_linear":
        return False
    if any(marker in name for name in names for marker in _NATIVE_MARKERS):
        return True
    # transformers writes its own keys into config.json; the original remote-code config has only linear_attn_config
    return "layer_types" in config or "mlp_layer_types" in config or "linear_num_heads" in config


# --- how each written layout builds and writes its config ---

def _ours_config(parsed, *, biased, dtype, **_):
    return kda_hybrid_config(parsed, router_weights_from_biased_scores=biased, dtype=dtype)


def _kimi_linear_config(parsed, *, raw, same_layout, biased, dtype):
    if not biased:
        logger.warning("the original Kimi-Linear remote code gathers router weights from the bias-corrected "
                       "scores; this model was used with unbiased weights (transformers/vLLM). Outputs of the "
                       "original code will differ; transformers' native class matches.")
    return kimi_linear_config(parsed, source_config=raw if same_layout else None, dtype=dtype)


def _kimi_k3_config(parsed, *, biased, dtype, **_):
    if biased:
        logger.warning("K3's reference code gathers router weights from the unbiased scores; this model was "
                       "used with weights from the biased scores, so K3 engines will route it differently")
    return kimi_k3_config(parsed, dtype=dtype)


def _write_json_config(config: dict, folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _k3_export_dtypes(plan) -> None:
    """The released K3 dtypes: KDA convolutions and o_norm in float32 (a lossless upcast from bf16)."""
    for name in plan.out_dtypes:
        if name.endswith(K3_FP32_SUFFIXES) and plan.out_dtypes[name] != torch.uint8:
            plan.out_dtypes[name] = torch.float32


def k3_a_log_length(config) -> int:
    """Entries of a stored K3 A_log: the released checkpoint pads its 96 per-head values with zeros to 128 = the
    KDA head dim. We pad to max(heads, head dim), which reproduces the release; no source we read states the rule
    for other shapes (reading accepts any length >= heads with a zero tail)."""
    return max(config.linear_num_heads, config.linear_head_dim)


class _K3Sink:
    """Our tensors -> the released K3 layout on their way to `sink`: `language_model.` names, A_log [1, 1, H, 1] ->
    [k3_a_log_length] with a zero tail."""

    def __init__(self, sink, config):
        self.sink, self.length = sink, k3_a_log_length(config)

    def add(self, name: str, tensor: torch.Tensor):
        if name.endswith(".A_log"):
            values = tensor.reshape(-1)
            tensor = torch.cat([values, values.new_zeros(self.length - values.numel())])
        self.sink.add(K3_TEXT_PREFIX + name, tensor)


FORMATS = {f.name: f for f in (
    CheckpointFormat(
        KDA_HYBRID, claims=lambda config, names: config.get("model_type") == KDA_HYBRID, parse=as_config,
        biased_router=lambda config: bool(config.get("router_weights_from_biased_scores", False)),
        groups=lambda parsed, inventory, headers: identity_groups(inventory),
        target=FolderTarget(_ours_config, write_checkpoint_metadata, carries_code=True)),
    CheckpointFormat(
        KIMI_K3, claims=lambda config, names: config.get("model_type") == KIMI_K3,
        parse=_needs("text_config", "a Kimi K3 config"),
        biased_router=lambda config: False,  # K3's KimiMoEGate gathers from the unbiased scores
        groups=lambda parsed, inventory, headers: k3_groups(inventory, headers), skipped_prefixes=K3_VISION_PREFIXES,
        target=FolderTarget(_kimi_k3_config, _write_json_config, k3=True,
                            refusal=f"this is a Kimi Linear model (no K3 feature is on); write it as "
                                    f"{KIMI_LINEAR!r} or {KDA_HYBRID!r}", export_dtypes=_k3_export_dtypes,
                            sink=_K3Sink)),
    CheckpointFormat(  # before KIMI_LINEAR: both say model_type "kimi_linear"
        TRANSFORMERS, claims=_is_native, parse=native_config,
        biased_router=lambda config: False,  # transformers' KimiLinearTopkRouter (and vLLM): unbiased scores
        groups=lambda parsed, inventory, headers: native_groups(parsed, inventory)),
    CheckpointFormat(
        KIMI_LINEAR, claims=lambda config, names: config.get("model_type") == "kimi_linear",
        parse=_needs("linear_attn_config", "an original Kimi-Linear config"),
        biased_router=lambda config: True,  # Moonshot's modeling_kimi.py: weights from the bias-corrected scores
        groups=lambda parsed, inventory, headers: identity_groups(inventory),
        target=FolderTarget(_kimi_linear_config, _write_json_config, k3=False,
                            refusal=f"a Kimi K3 model has no Kimi Linear layout; write it as {KIMI_K3!r} or "
                                    f"{KDA_HYBRID!r}")),
)}
SOURCE_FORMATS = (KIMI_LINEAR, TRANSFORMERS, KDA_HYBRID, KIMI_K3)
TARGET_FORMATS = (KDA_HYBRID, KIMI_LINEAR, KIMI_K3, GGUF)  # the three with a FolderTarget, and llama.cpp's file


def detect_format(config: dict, tensor_names) -> str:
    """Which layout a checkpoint uses (its FORMATS name): ours, K3's, transformers' native one or the original Hub
    one."""
    for fmt in FORMATS.values():
        if fmt.claims(config, tensor_names):
            return fmt.name
    raise ConversionError(f"config.json: model_type {config.get('model_type')!r} is not a Kimi Linear model "
                          f"(expected 'kimi_linear', '{KIMI_K3}' or '{KDA_HYBRID}')")
