"""transformers' native Kimi Linear as an oracle on CPU: `block_fla` (the one fla blocker; tests/_native.py uses it
too) and `native_twin` (the native model with our weights).

With flash-linear-attention installed, importing transformers' kimi_linear binds fla's Triton kernels, which crash
on CPU tensors; a meta-path finder that refuses `fla` (and `causal_conv1d`) makes the native model take its
PyTorch fallbacks. Our model never needs fla.
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import tempfile
from pathlib import Path

import torch

BLOCKED = ("fla", "causal_conv1d")


class _BlockFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked so that transformers' kimi_linear uses its PyTorch fallbacks")
        return None


def block_fla() -> None:
    """Make `fla` and `causal_conv1d` unimportable in this process, from now on. Raises RuntimeError when it is
    too late: transformers' kimi_linear modeling (or fla itself) is already imported."""
    if any(isinstance(f, _BlockFla) for f in sys.meta_path):
        return
    late = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED or m.endswith("modeling_kimi_linear"))
    if late:  # the native modeling binds its kernels at import: blocking now would change nothing
        raise RuntimeError(f"block_fla() must run before these imports: {late[:5]}")
    sys.meta_path.insert(0, _BlockFla())


def native_twin(ours):
    """transformers' native `KimiLinearForCausalLM` with the weights of `ours` (a KDAHybridForCausalLM), in eval
    mode, fp32, fla blocked (see block_fla), loaded from a temporary folder in the original Kimi names."""
    from safetensors.torch import save_file

    block_fla()
    from transformers import KimiLinearForCausalLM

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(ours.config.to_kimi_linear_dict()))
        tied = ours.config.tie_word_embeddings  # the head is the embedding: saved once, as the native model ties it
        save_file({k: v.contiguous() for k, v in ours.state_dict().items() if not (tied and k == "lm_head.weight")},
                  f"{d}/model.safetensors", metadata={"format": "pt"})
        native = KimiLinearForCausalLM.from_pretrained(d, dtype=torch.float32)
    return native.eval()


__all__ = ["BLOCKED", "block_fla", "native_twin"]
