"""Public Kimi Delta Attention ops: input validation and the one dispatch point between backends.

    chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto") -> (o, final_state | None)
    fused_recurrent_kda(...same arguments...)                                 -> (o, final_state | None)

Layout: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [B, H, K, V] fp32. With
`cu_seqlens` (int, [N + 1], B = 1) the tokens of N sequences are packed along T and states are [N, H, K, V].

Backends: "reference" (token by token, the ground truth), "torch" (chunked / recurrent PyTorch, the CPU
path), "triton" (GPU kernels), "auto" (triton for CUDA tensors when triton is importable, else torch),
chosen from the tensors' device at call time, never at import.
"""

from __future__ import annotations

import torch

from .kda_torch import chunk_kda_torch, fused_recurrent_kda_torch, recurrent_kda_reference

try:  # optional: `import kda_hybrid` must work without triton (CPU wheels, macOS)
    from .kda_triton import chunk_kda_triton, fused_recurrent_kda_triton

    _TRITON_IMPORT_ERROR = None
except Exception as err:  # noqa: BLE001 - any failure (missing triton, no driver) means "not available"
    chunk_kda_triton = fused_recurrent_kda_triton = None
    _TRITON_IMPORT_ERROR = err

BACKENDS = ("auto", "torch", "triton", "reference")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available() -> bool:
    return chunk_kda_triton is not None


def _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K] (4 dims), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with [B, T, H] = {(B, T, H)}, got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
            torch.int32, torch.int64,
        ):
            raise ValueError(
                "cu_seqlens must be a 1-D int32/int64 tensor [N + 1], got "
                + (f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                   else type(cu_seqlens).__name__)
            )
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must hold at least 2 offsets [0, ..., T], got {cu_seqlens.tolist()}")
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
        if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {bounds}")
        if bounds[-1] != T:
            raise ValueError(f"cu_seqlens must end at T={T}, got {bounds[-1]}")
        N = len(bounds) - 1
    if initial_state is not None:
        V = v.shape[-1]
        if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (N, H, K, V):
            got = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {got}")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32 (the state is kept in fp32), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")


def _resolve(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "backend='triton' needs the triton package and a GPU; import failed with "
                f"{_TRITON_IMPORT_ERROR!r}. Install triton (pip install triton) or use backend='torch'."
            )
        if device.type != "cuda" and not _triton_interpreted():
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors, got {device.type}; use backend='torch' on CPU "
                "(or set TRITON_INTERPRET=1 before importing triton to run the kernels in the interpreter)"
            )
    return backend


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def _triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Kimi Delta Attention (prefill and training). Returns (o [B, T, H, V], final state or None)."""
    _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend)
    impls = {"reference": recurrent_kda_reference, "triton": chunk_kda_triton, "torch": chunk_kda_torch}
    return _dispatch(impls, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens)


def _dispatch(impls, backend, q, k, v, g, beta, scale, *rest, **extra):
    """Default the scale, pick the backend for q's device and run it with autocast off (the recurrence is
    computed in fp32 whatever autocast would pick). `extra` goes to the torch and triton implementations."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = _resolve(backend, q.device)
    with _no_autocast(q.device):
        if backend == "reference":
            return impls["reference"](q, k, v, g, beta, scale, *rest)
        return impls[backend](q, k, v, g, beta, scale, *rest, **extra)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    inplace_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent Kimi Delta Attention (decode: a few tokens on a carried state).

    With `inplace_final_state=True` (inference only) the returned final state IS `initial_state`,
    updated in place, so a decode loop allocates no new state per step.
    """
    _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend)
    return _fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                cu_seqlens, backend, inplace_final_state)


def _fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto", inplace_final_state=False):
    """fused_recurrent_kda without the input checks, for callers that build their inputs (the model's decode
    step, where the ~20 checks cost as much as the step's recurrence on CPU)."""
    impls = {"reference": recurrent_kda_reference, "triton": fused_recurrent_kda_triton,
             "torch": fused_recurrent_kda_torch}
    return _dispatch(impls, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm_in_kernel, cu_seqlens, inplace_final_state=inplace_final_state)
