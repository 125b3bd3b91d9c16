"""What every Triton kernel of the package needs, apart from the kernels themselves: whether triton interprets
(TRITON_INTERPRET=1 on CPU), `LazyKernel` (`triton.jit` at first launch, once per mode), tile sides, the dot
precision for an input dtype, and how packed sequences split into chunks (`chunk_layout`). Imported by the KDA
kernels (`kda_triton_fwd`, `kda_triton_bwd`, `kda_triton`) and the MXFP4 matmul (`mxfp4_triton`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton
except ImportError as err:
    raise ImportError("kda_hybrid.kda_triton_runtime needs the triton package (GPU kernels)") from err

from .kda_torch import CHUNK_SIZE

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the KDA kernels take as inputs


def triton_interpreted() -> bool:
    """Whether triton runs kernels in its interpreter: triton's own reading of TRITON_INTERPRET (its knobs accept
    1/true/on/y/yes in any case), so kda_ops and the launcher never disagree."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # triton < 3.4 has no knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "y", "yes")


class LazyKernel:
    """`triton.jit` applied at first launch, once per mode (compiled / interpreted)."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = {}

    def __getitem__(self, grid):
        mode = triton_interpreted()
        kernel = self._jitted.get(mode)
        if kernel is None:
            kernel = self._jitted[mode] = triton.jit(self.fn)
        return kernel[grid]


def block(n: int) -> int:
    """Register tile side for a head dim: a power of two >= 16 (the smallest tl.dot operand)."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-fp32 products (the tests hold them to 1e-5); 16-bit inputs carry 8-11 bits
    # already, and tf32's 10-bit products keep the kernel's error below the rounding of the inputs.
    return "ieee" if dtype == torch.float32 else "tf32"


class ChunkLayout(NamedTuple):
    """How the packed tokens split into chunks, and the products' precision: what every stage is given."""

    cu_seqlens: torch.Tensor  # [N + 1] int32 offsets of the sequences in the packed B*T tokens
    chunk_indices: torch.Tensor  # [NC, 2] int32: (sequence, chunk within it) of every global chunk
    chunk_offsets: torch.Tensor  # [N] int32: global index of each sequence's first chunk
    dot_precision: str  # tl.dot input precision, from the inputs' dtype (dot_precision)
    chunk_size: int  # BT


def chunk_layout(cu_seqlens: torch.Tensor | None, B: int, T: int, device, cu_seqlens_cpu=None,
                  dtype: torch.dtype = torch.float32, chunk_size: int = CHUNK_SIZE) -> ChunkLayout:
    """The ChunkLayout of B sequences of T tokens, or of the packed sequences of cu_seqlens (B = 1). The chunk
    list is built on the host: from cu_seqlens_cpu when given (no device sync), else from a copy of
    cu_seqlens. Built once per forward; the backward reuses it. `dtype`: the dtype of q, k, v as given."""
    BT = chunk_size
    if cu_seqlens is None:
        NT = triton.cdiv(T, BT)
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        seq = torch.arange(B, device=device, dtype=torch.int32)
        chunk_indices = torch.stack([seq.repeat_interleave(NT), torch.arange(NT, device=device,
                                                                              dtype=torch.int32).repeat(B)], 1)
        return ChunkLayout(cu, chunk_indices.contiguous(), seq * NT, dot_precision(dtype), BT)
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    lens = (host[1:] - host[:-1]).tolist()
    nts = [triton.cdiv(n, BT) for n in lens]
    chunk_indices = torch.tensor([(i, t) for i, nt in enumerate(nts) for t in range(nt)], dtype=torch.int32)
    offsets = torch.tensor([0, *nts[:-1]], dtype=torch.int64).cumsum(0).to(torch.int32)
    return ChunkLayout(cu_seqlens.to(torch.int32), chunk_indices.to(device), offsets.to(device),
                       dot_precision(dtype), BT)
