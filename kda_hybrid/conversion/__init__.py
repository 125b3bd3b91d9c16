"""Checkpoint conversion between Moonshot's original Kimi-Linear layout, transformers' native `kimi_linear`
and ours (`kda_hybrid`). Streams shard by shard, validates every tensor name and shape against the inventory
computed from the config, and publishes the output folder atomically.

    from kda_hybrid.conversion import convert
    convert("Kimi-Linear-48B-A3B-Instruct", "kimi-linear-kda-hybrid", source="kimi_linear")

CLI: `python -m kda_hybrid.conversion --from kimi_linear SRC DST` (see `--help`). Not carried by
checkpoints, so it may live in a sub-package (docs/architecture.md §6).
"""

from .configs import KDA_HYBRID, KIMI_LINEAR, TRANSFORMERS, native_to_kimi_dict
from .convert import convert, convert_state_dict
from .formats import detect_format
from .layout import ConversionError, kimi_inventory

__all__ = [
    "ConversionError",
    "KDA_HYBRID",
    "KIMI_LINEAR",
    "TRANSFORMERS",
    "convert",
    "convert_state_dict",
    "detect_format",
    "kimi_inventory",
    "native_to_kimi_dict",
]
