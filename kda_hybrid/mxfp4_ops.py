"""MXFP4 linear layers' one dispatch point, as kda_ops is KDA's: the fused Triton kernel (mxfp4_triton) for CUDA
tensors when triton is installed, else the weight expanded in PyTorch (mxfp4_torch) for the call.

    y = mxfp4_linear(x, weight_packed, weight_scale)            # == F.linear(x, dequantize_mxfp4(packed, scale))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mxfp4_torch import dequantize_mxfp4

try:  # optional, as the KDA kernels are: the fused MXFP4 matmul for CUDA tensors
    from .mxfp4_triton import KERNEL_DTYPES as MXFP4_KERNEL_DTYPES
    from .mxfp4_triton import mxfp4_linear_triton
except Exception:  # noqa: BLE001 - any failure (missing triton, no driver) means "not available"
    mxfp4_linear_triton, MXFP4_KERNEL_DTYPES = None, ()

MXFP4_BACKENDS = ("auto", "torch", "triton")


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """F.linear(x, dequantize_mxfp4(packed, scale, x.dtype)). "auto": on CUDA (fp32 / bf16 / fp16 activations)
    the fused Triton kernel of mxfp4_triton, which decodes the weight tile by tile and never writes it out; else
    "torch", the weight expanded for this call. "triton" elsewhere needs TRITON_INTERPRET=1 (tests)."""
    if backend not in MXFP4_BACKENDS:
        raise ValueError(f"backend must be one of {MXFP4_BACKENDS}, got {backend!r}")
    if backend == "auto":
        fused = x.device.type == "cuda" and x.dtype in MXFP4_KERNEL_DTYPES
        backend = "triton" if fused else "torch"
    if backend == "triton":
        if mxfp4_linear_triton is None:
            raise RuntimeError("backend='triton' needs the triton package (pip install triton); use 'torch'")
        return mxfp4_linear_triton(x, packed, scale)
    return F.linear(x, dequantize_mxfp4(packed, scale, x.dtype))
