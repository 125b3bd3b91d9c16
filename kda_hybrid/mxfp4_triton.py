"""MXFP4 weights times activations in one Triton kernel (GPU; CPU tests run it under TRITON_INTERPRET=1).

    y = mxfp4_linear_triton(x, weight_packed, weight_scale)   # == F.linear(x, dequantize_mxfp4(packed, scale))

Each program computes a [BM, BN] tile of y = x W^T: it walks K in BK steps, loads BN x BK / 2 stored bytes and BN x
BK / 32 scale bytes of W, decodes them in registers (E2M1 nibbles, low nibble first, times 2 ** (scale - 127)) and
multiplies with tl.dot, accumulating in fp32. The full-precision weight is never written to memory: a routed expert
costs what its 4.25 bits per weight cost to read, where the PyTorch path (mxfp4_torch.dequantize_mxfp4, the
twin this kernel is tested against) writes and reads an expanded copy per call.

The decoded weights are exact in the dot's input dtype (fp32, bf16; a power of two times an E2M1 value), so the
kernel differs from its twin only in the order of the fp32 sums. The backward (for the activations only: MXFP4
weights are stored, not trained) multiplies by the twin's expanded weight.
"""

from __future__ import annotations

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("kda_hybrid.mxfp4_triton needs the triton package (GPU kernels)") from err

from .kda_triton_runtime import LazyKernel, dot_precision
from .mxfp4_torch import check_mxfp4, dequantize_mxfp4

BLOCK_K = 64  # K per step: two scale groups, 32 bytes per weight row
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x; the decoded weights are exact in each


@LazyKernel
def _mxfp4_matmul_kernel(
    x, packed, scale, y, M, N, K, stride_xm, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """y[M, N] = x[M, K] @ W[N, K]^T, W decoded tile by tile from packed [N, K / 2] and scale [N, K / 32]."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    row_x = o_m.to(tl.int64) * stride_xm
    row_w = o_n.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        b_x = tl.load(x + row_x[:, None] + o_k[None, :], mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
        o_b = k0 // 2 + tl.arange(0, BK // 2)
        b_p = tl.load(packed + row_w[:, None] * (K // 2) + o_b[None, :],
                      mask=m_n[:, None] & (o_b < K // 2)[None, :], other=0)
        # element 2j of a row is the low nibble of byte j, 2j + 1 the high one; E2M1 code (bit 3 the sign) ->
        # 0, 0.5 (subnormal), 1, 1.5, 2, 3, 4, 6
        code = tl.reshape(tl.join(b_p & 15, b_p >> 4), (BN, BK)).to(tl.int32)
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        b_w = tl.where((code & 8) != 0, -mag, mag)
        o_s = k0 // 32 + tl.arange(0, BK // 32)
        b_s = tl.load(scale + row_w[:, None] * (K // 32) + o_s[None, :],
                      mask=m_n[:, None] & (o_s < K // 32)[None, :], other=127)
        factor = tl.exp2(b_s.to(tl.float32) - 127.0)
        b_w = tl.reshape(tl.reshape(b_w, (BN, BK // 32, 32)) * factor[:, :, None], (BN, BK))
        acc += tl.dot(b_x, tl.trans(b_w.to(b_x.dtype)), input_precision=DOT_PREC)
    tl.store(y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :], acc.to(y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def _check(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor):
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"mxfp4_linear_triton: x must be one of {KERNEL_DTYPES}, got {x.dtype}")
    check_mxfp4(packed, scale, "mxfp4_linear_triton", values=False)
    if x.shape[-1] != packed.shape[1] * 2:
        raise ValueError(f"mxfp4_linear_triton: x [..., K] and packed [N, K / 2] must agree, got {tuple(x.shape)} "
                         f"and {tuple(packed.shape)}")
    if not (x.device == packed.device == scale.device):
        raise ValueError(f"mxfp4_linear_triton: tensors on {x.device}, {packed.device}, {scale.device}")


def _forward(x2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    M, K = x2.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return y
    BM = 16 if M <= 16 else 64  # tl.dot's smallest tile; decode (a few tokens per expert) wastes the rest
    BN = 64 if N >= 64 else 16
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _mxfp4_matmul_kernel[grid](x2, packed.contiguous(), scale.contiguous(), y, M, N, K, x2.stride(0), y.stride(0),
                               BM=BM, BN=BN, BK=BLOCK_K, DOT_PREC=dot_precision(x2.dtype))
    return y


class _MXFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, packed, scale):
        ctx.save_for_backward(packed, scale)
        return _forward(x2, packed, scale)

    @staticmethod
    def backward(ctx, dy):
        packed, scale = ctx.saved_tensors
        return dy @ dequantize_mxfp4(packed, scale, dy.dtype), None, None


def mxfp4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """F.linear(x, W) for the MXFP4 weight W = (packed [N, K / 2], scale [N, K / 32]); x [..., K] -> [..., N] in x's
    dtype; differentiable in x."""
    _check(x, packed, scale)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _MXFP4Linear.apply(x2, packed, scale).view(*x.shape[:-1], packed.shape[0])
