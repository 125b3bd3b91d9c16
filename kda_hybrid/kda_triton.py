"""The Triton KDA ops: `chunk_kda_triton` (prefill, training; differentiable through `ChunkKDAFunction`) and
`fused_recurrent_kda_triton` (decode), fla's options by fla's names. The kernels and their launchers are in
`kda_triton_fwd` (forward, decode) and `kda_triton_bwd` (backward); their PyTorch twins in `kda_triton_twins`
(docs/architecture.md §1, §9). kda_ops dispatches here for CUDA tensors (or under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton  # noqa: F401 - a clear error here, before the kernel modules
except ImportError as err:
    raise ImportError("kda_hybrid.kda_triton needs the triton package (GPU kernels); kda_torch does not") from err

from .kda_torch import CHUNK_SIZE, CHUNK_SIZES, kda_gate, l2norm, records_autograd
from .kda_triton_bwd import chunk_kda_bwd
from .kda_triton_fwd import chunk_kda_fwd, fused_recurrent_kda_fwd
from .kda_triton_runtime import KERNEL_DTYPES, chunk_layout

# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class ChunkKDAFunction(torch.autograd.Function):
    """Triton forward and backward; saves the fp32 G, A_qk, Ai, w, u of the forward (the backward recomputes
    the per-chunk states with one more forward scan instead of keeping them). Returns (o, final state, chunk
    states h [NC, HV, K, V]); h is not differentiable (inference only: return_intermediate_states)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                chunk_size):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        # the products' precision follows v: q, k arrive in fp32 after the L2 norm whatever the input dtype
        layout = chunk_layout(cu_seqlens, q.shape[0], q.shape[1], q.device, cu_seqlens_cpu, v.dtype, chunk_size)
        o, ht, h, saved = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, layout)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *saved)
        ctx.scale, ctx.layout, ctx.g_dtype = scale, layout, g.dtype
        ctx.mark_non_differentiable(h)
        return o, ht, h

    @staticmethod
    def backward(ctx, do, dht, _dh):
        q, k, v, g, beta, initial_state, *saved = ctx.saved_tensors
        need_dh0 = initial_state is not None and ctx.needs_input_grad[6]
        dq, dk, dv, dg, dbeta, dh0 = chunk_kda_bwd(q, k, v, g, beta, ctx.scale, initial_state, ctx.layout,
                                                    saved, do, dht, need_dh0)
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta.to(beta.dtype), None, dh0, None, None, None, None


# --------------------------------------------------------------------------------------------------
# Public functions. kda_ops validates shapes; the options below are checked here (fla's names and errors).
# --------------------------------------------------------------------------------------------------


def _check_kernel_inputs(name, tensors, HV, H, chunk_size=CHUNK_SIZE):
    for arg, x in tensors:
        if x is not None and x.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name}: the Triton kernels take float32, bfloat16 or float16; {arg} is {x.dtype} "
                            "(float64 runs on backend='torch' or 'reference')")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if HV % H:
        raise ValueError(f"{name}: the value heads (HV={HV}, from v) must be a multiple of the q/k heads (H={H})")


def _activations(g, beta, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                 allow_neg_eigval):
    """The in-kernel gate and beta activations of fla's chunk_kda, as fp32 torch ops (autograd gives the
    gradients to g, A_log, dt_bias, beta):
        g = -exp(A_log) * softplus(g + dt_bias)                     (lower_bound None)
        g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))       (A_log None: lower_bound * sigmoid(g + dt_bias))
        beta = sigmoid(beta), or 2 * sigmoid(beta) with allow_neg_eigval."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
    if use_gate_in_kernel:
        HV, K = g.shape[2], g.shape[3]
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        if A_log is not None and A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got shape {tuple(A_log.shape)}")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV * K = {HV * K} elements, got shape {tuple(dt_bias.shape)}")
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.float()) * (2.0 if allow_neg_eigval else 1.0)
    return g, beta


def chunk_kda_triton(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, cu_seqlens_cpu=None, chunk_size=CHUNK_SIZE,
                     use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                     return_intermediate_states=False):
    """Chunked KDA with Triton kernels, fla's options by fla's names. q, k [B, T, H, K]; v [B, T, HV, V];
    g [B, T, HV, K]; beta [B, T, HV]; states [N, HV, K, V] fp32 ([N, HV, V, K] with state_v_first).
    Returns (o [B, T, HV, V] in v's dtype, final state or None), plus the states entering every chunk
    [1 or B, NT, HV, K, V] fp32 with return_intermediate_states (inference only, not differentiable).
    The q/k L2 norm, gate and beta activations run as torch ops in front of the kernels (autograd)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    _check_kernel_inputs("chunk_kda_triton", (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                              ("initial_state", initial_state)), HV, H, chunk_size)
    if return_intermediate_states and records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
        raise ValueError("return_intermediate_states=True is for inference only: call it under torch.no_grad() "
                         "or torch.inference_mode()")
    g, beta = _activations(g, beta, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())  # kept fp32: no second rounding of 16-bit inputs
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()
    o, ht, h = ChunkKDAFunction.apply(q, k, v, g, beta, float(scale), initial_state, output_final_state,
                                      cu_seqlens, cu_seqlens_cpu, chunk_size)
    if state_v_first:
        ht = ht.transpose(-1, -2) if ht is not None else None
        h = h.transpose(-1, -2)
    ht = ht if output_final_state else None
    if not return_intermediate_states:
        return o, ht
    return o, ht, h.reshape(1 if cu_seqlens is not None else B, -1, *h.shape[1:])


def fused_recurrent_kda_triton(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False, *,
                               ssm_state_indices=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                               lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                               state_v_first=False):
    """Recurrent KDA (decode) with one fused Triton kernel; the q/k L2 norm is fused too. Layouts and options as
    chunk_kda_triton; ssm_state_indices [N] (int) makes initial_state a state pool [P, HV, K, V] (see
    `fused_recurrent_kda_fwd`). Forward only: when a gradient is needed it returns `chunk_kda_triton` (same
    values, differentiable; never in place)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    _check_kernel_inputs("fused_recurrent_kda_triton", (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                                                        ("initial_state", initial_state)), HV, H)
    opts = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                state_v_first=state_v_first)
    needs_grad = records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias)
    if ssm_state_indices is not None:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if needs_grad:
            raise NotImplementedError("ssm_state_indices with gradients is not supported by the Triton kernels "
                                      "yet; use backend='torch'")
        if not isinstance(ssm_state_indices, torch.Tensor) or ssm_state_indices.dim() != 1 or \
                ssm_state_indices.dtype not in (torch.int32, torch.int64) or ssm_state_indices.numel() != N:
            got = (f"{ssm_state_indices.dtype} shape {tuple(ssm_state_indices.shape)}"
                   if isinstance(ssm_state_indices, torch.Tensor) else type(ssm_state_indices).__name__)
            raise ValueError(f"ssm_state_indices must be a 1-D int tensor with one pool row per sequence "
                             f"({N}), got {got} (per-token indices are not supported by the Triton kernels yet)")
        if initial_state is None:
            raise ValueError("ssm_state_indices needs initial_state: the state pool [P, HV, K, V]")
        ssm_state_indices = ssm_state_indices.to(device=q.device, dtype=torch.int32).contiguous()
    if needs_grad:
        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, cu_seqlens, **opts)
    g, beta = _activations(g, beta, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval)
    return fused_recurrent_kda_fwd(q, k, v, g, beta, float(scale), initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel, cu_seqlens, inplace_final_state, ssm_state_indices,
                                    state_v_first)
