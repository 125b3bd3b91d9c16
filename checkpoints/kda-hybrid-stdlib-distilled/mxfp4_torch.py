"""MXFP4 as K3 stores its routed experts, in PyTorch: the format's checks and its expansion to a float weight (the
twin of mxfp4_triton's fused kernel, and the CPU path of layers_kda_hybrid.MXFP4Linear).

Element 2j of a weight row is the low nibble of packed byte j, element 2j + 1 the high one; each nibble is an E2M1
(FP4) code, and each run of MXFP4_GROUP = 32 inputs is scaled by an E8M0 byte s, the factor 2 ** (s - 127); s = 255
is NaN in E8M0 and refused.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# E2M1 (FP4) code -> value; bit 3 is the sign
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs per E8M0 scale


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str = "weight", values: bool = True):
    """ValueError unless packed / scale are MXFP4 as stored (2-D uint8, [out, in / 2] and [out, in / 32]) and, with
    `values` (at load; a kernel launch skips it: reading the scales back is a device sync), no NaN scale (E8M0
    byte 255)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8 or packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"{name}: MXFP4 weight_packed / weight_scale must be 2-D uint8, got {packed.dtype} "
                         f"{tuple(packed.shape)} / {scale.dtype} {tuple(scale.shape)}")
    if packed.shape[0] != scale.shape[0] or packed.shape[1] * 2 != scale.shape[1] * MXFP4_GROUP:
        raise ValueError(f"{name}: MXFP4 weight_packed [out, in / 2] and weight_scale [out, in / {MXFP4_GROUP}] must "
                         f"agree, got {tuple(packed.shape)} and {tuple(scale.shape)}")
    if values and not scale.is_meta and bool((scale == 255).any()):
        bad = (scale == 255).nonzero()[0].tolist()
        raise ValueError(f"{name}: MXFP4 weight_scale holds 255 (NaN in E8M0) at {bad}; the checkpoint is corrupt")


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> [out, in] in dtype: element 2j of a row is the low nibble of byte j, 2j + 1 the high one; each run of
    32 inputs is scaled by 2 ** (scale - 127). Exact in bf16 and fp32 (a power of two times an E2M1 value)."""
    out = packed.shape[0]
    # one lookup per byte: a [256, 2] table of (low, high) values in the output dtype (exact: E2M1 values and powers
    # of two are exact in bf16, fp16 within its range, fp32); 8x faster than decoding each nibble
    pairs = F.embedding(packed.to(torch.int32), _mxfp4_pairs(dtype, packed.device))  # [out, in / 2, 2]
    factor = torch.exp2(scale.to(torch.float32) - 127.0).to(dtype)  # [out, in / 32]
    w = pairs.view(out, -1, MXFP4_GROUP) * factor[..., None]
    return w.view(out, -1)


@functools.cache
def _mxfp4_pairs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: for each byte, the E2M1 values of its low and high nibble."""
    lut = torch.tensor(_E2M1, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((lut[byte & 15], lut[byte >> 4]), -1).to(device=device, dtype=dtype)
