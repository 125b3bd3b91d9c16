"""Public Kimi Delta Attention ops: input validation and the one dispatch point between backends.

    chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto", ...fla's options)
        -> (o, final_state | None)   or (o, final_state | None, h) with return_intermediate_states=True
    fused_recurrent_kda(...the same, plus inplace_final_state, ssm_state_indices) -> (o, final_state | None)

Layout (fla's): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; states [N, HV, K, V]
(state_v_first: [N, HV, V, K]) in the recurrence's dtype (float32; float64 for float64 inputs). HV is a multiple
of H (grouped value heads: each q/k head serves HV / H value heads). With `cu_seqlens` (int, [N + 1], B = 1) the
tokens of N sequences are packed along T. Every option keeps fla's name and meaning; docs/ops.md lists them
(same / accepted no-op / not supported) and docs/architecture.md §9 the dispatch rules.

Backends: "reference" (token by token, the ground truth), "torch" (chunked / recurrent PyTorch, the CPU
path), "triton" (GPU kernels), "auto" (triton for CUDA tensors when triton is importable, else torch),
chosen from the tensors' device at call time, never at import. The torch and reference backends compose the
options (grouped heads, in-kernel gate, beta sigmoid, state layout, state pool) around their core recurrence;
the triton backend receives them as keywords and computes them in its kernels, or raises NotImplementedError,
which surfaces as a clear error (never a silent fall back to another backend).
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from .kda_torch import (
    CHUNK_SIZE,
    CHUNK_SIZES,
    chunk_kda_torch,
    compute_dtype,
    fused_recurrent_kda_torch,
    kda_gate,
    records_autograd,
    recurrent_kda_reference,
    recurrent_step_,
)

try:  # optional: `import kda_hybrid` must work without triton (CPU wheels, macOS)
    from .kda_triton import chunk_kda_triton, fused_recurrent_kda_triton
    from .kda_triton_runtime import triton_interpreted as _triton_interpreted

    _TRITON_IMPORT_ERROR = None
    # grouped value heads have no keyword (only shapes): kernels that take HV > H say so with this flag, and
    # without it such a call is refused rather than read with the wrong strides
    from . import kda_triton_fwd as _kda_triton_kernels

    def _triton_supports_gva() -> bool:
        return bool(getattr(_kda_triton_kernels, "SUPPORTS_GVA", False))
except Exception as err:  # noqa: BLE001 - any failure (missing triton, no driver) means "not available"
    chunk_kda_triton = fused_recurrent_kda_triton = None
    _TRITON_IMPORT_ERROR = err

    def _triton_interpreted() -> bool:
        return False

    def _triton_supports_gva() -> bool:
        return False


BACKENDS = ("auto", "torch", "triton", "reference")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def triton_available() -> bool:
    return chunk_kda_triton is not None


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _renamed_state_layout(state_v_first, transpose_state_layout):
    """fla's deprecated name for state_v_first, accepted as fla accepts it (its warning, its error for both)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return transpose_state_layout


def _check_flags(**flags):
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_offsets(name, cu, T):
    """cu_seqlens (or cu_seqlens_cpu) against T; returns the offsets as a list."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
        got = f"{cu.dtype} shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{name} must be a 1-D int32/int64 tensor [N + 1], got {got}")
    if cu.numel() < 2:
        got = cu if cu.is_meta else cu.tolist()
        raise ValueError(f"{name} must hold at least 2 offsets [0, ..., T], got {got}")
    if cu.is_meta:  # shapes only: the values are unknown, so only the number of sequences is
        return None
    bounds = cu.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {bounds}")
    if bounds[-1] != T:
        raise ValueError(f"{name} must end at T={T}, got {bounds[-1]}")
    return bounds


def _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, backend, *, state_v_first,
           pool=False):
    """Shapes, dtypes and devices of the core inputs; returns N, the number of sequences. With `pool` the initial
    state is a state pool [P, HV, K, V] (ssm_state_indices), so only its trailing dims are checked here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; all inputs must share a device")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K] (4 dims), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] == 0 or v.shape[2] % max(H, 1):
        raise ValueError(f"v must be [B, T, HV, V] with [B, T] = {(B, T)} and HV a multiple of H={H} (grouped "
                         f"value heads), got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    N = B
    if cu_seqlens_cpu is not None and cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is a host copy of cu_seqlens; pass cu_seqlens too")
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_meta and not q.is_meta:
            raise ValueError(f"cu_seqlens is on meta but q is on {q.device}: meta offsets hold no values to split "
                             f"real tokens by; pass them on q's device ({q.device}) or the CPU (or make every input "
                             "meta for shapes only)")
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={B}")
        if cu_seqlens_cpu is not None:  # the host copy is read, so the device tensor needs no sync
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.shape != getattr(cu_seqlens_cpu, "shape", None):
                raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {_shape(cu_seqlens)}, got "
                                 f"{_shape(cu_seqlens_cpu)}")
            if cu_seqlens_cpu.device.type != "cpu":
                raise ValueError(f"cu_seqlens_cpu must be on the CPU, got {cu_seqlens_cpu.device}")
            _check_offsets("cu_seqlens_cpu", cu_seqlens_cpu, T)
        else:
            _check_offsets("cu_seqlens", cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        state_shape = (HV, V, K) if state_v_first else (HV, K, V)
        layout = "[P, HV, V, K]" if state_v_first else "[P, HV, K, V]"
        if pool:
            ok = isinstance(initial_state, torch.Tensor) and initial_state.dim() == 4 and \
                initial_state.shape[1:] == state_shape
            if not ok:
                raise ValueError(f"initial_state (the state pool of ssm_state_indices) must be {layout} with "
                                 f"[HV, ., .] = {state_shape}, got {_shape(initial_state)}")
        elif not isinstance(initial_state, torch.Tensor) or initial_state.shape != (N, *state_shape):
            raise ValueError(f"initial_state must be {layout.replace('P', 'N')} = {(N, *state_shape)}, got "
                             f"{_shape(initial_state)}")
        want = compute_dtype(v.dtype)
        if initial_state.dtype != want:
            raise ValueError(f"initial_state must be {want} for {v.dtype} inputs (the state is kept in "
                             f"{want}), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return N


def _check_options(q, v, *, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                   allow_neg_eigval, safe_gate):
    """The in-kernel gate and beta options, with fla's rules and fla's messages where fla has one."""
    HV, K = v.shape[2], q.shape[3]
    if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and not isinstance(lower_bound, bool)
                                        and math.isfinite(lower_bound) and lower_bound < 0):
        raise ValueError(f"lower_bound must be a negative number (a log decay) or None, got {lower_bound!r}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
        for name, x, n in (("A_log", A_log, HV), ("dt_bias", dt_bias, HV * K)):
            if x is None:
                continue
            if not isinstance(x, torch.Tensor) or x.numel() != n or not x.is_floating_point():
                raise ValueError(f"{name} must be a float tensor of {n} elements ([HV{' * K' if n != HV else ''}] = "
                                 f"{n}), got {_shape(x)}")
            if x.device != q.device:
                raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
        if safe_gate:
            if lower_bound is None:
                raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
            if not -5 <= lower_bound < 0:
                raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")
    elif A_log is not None or dt_bias is not None:
        raise ValueError("A_log and dt_bias are the in-kernel gate's parameters; pass use_gate_in_kernel=True "
                         "with them (or compute the gate yourself and pass it as g)")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def _check_gate_values(g):
    """g is a log decay: g <= 0 (-inf, a full reset, included). A positive gate grows the state without bound and
    NaN poisons every later token, so both are refused; one pass over g (a device sync on GPU)."""
    if not float(g.detach().max()) <= 0:  # one reduction; max propagates NaN, and NaN <= 0 is False
        n_nan, n_pos = int(torch.isnan(g).sum()), int((g > 0).sum())
        raise ValueError(f"g must be a log decay <= 0 (-inf allowed: a full reset); got {n_pos} values > 0 (max "
                         f"{float(g.max()) if n_pos else 0.0:.4g}) and {n_nan} NaN. Pass check_inputs=False to "
                         "skip this check")


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


def _empty(q, v, initial_state, output_final_state, N, state_v_first, inplace, intermediate, chunks=0):
    """T = 0 or B = 0: no token, so the output is empty and the final state is the initial one (zeros without).
    Also the shapes-only result of meta inputs (`chunks`: the number of intermediate states)."""
    B, T, HV, V = v.shape
    K = q.shape[-1]
    o = v.new_zeros(B, T, HV, V)
    if inplace:
        final = initial_state
    elif output_final_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        final = v.new_zeros(shape, dtype=compute_dtype(v.dtype)) if initial_state is None else initial_state.clone()
    else:
        final = None
    if intermediate:
        return o, final, q.new_zeros(B, chunks, HV, *((V, K) if state_v_first else (K, V)))
    return o, final


def _meta_result(kind, q, v, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, options, inplace,
                 intermediate, chunk_size):
    """Meta inputs (shapes only, as under `with torch.device("meta")`): outputs of the right shapes and dtypes,
    nothing computed. The number of intermediate states of a cu_seqlens pack depends on its offsets."""
    B, T = q.shape[:2]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    chunks = 0
    if intermediate:
        if cu_seqlens is None:
            chunks = -(-T // chunk_size)
        elif cu_seqlens_cpu is not None and not cu_seqlens_cpu.is_meta:
            bounds = cu_seqlens_cpu.tolist()
            chunks = sum(-(-(e - b) // chunk_size) for b, e in zip(bounds[:-1], bounds[1:]))
        else:
            raise ValueError("return_intermediate_states with meta cu_seqlens: the number of chunk states depends "
                             "on the offsets' values; pass cu_seqlens_cpu (a host copy of the offsets) too")
    if initial_state is not None and initial_state.shape[0] != N and not inplace:
        initial_state = None  # a state pool (ssm_state_indices): the final states are per sequence
    return _empty(q, v, initial_state, output_final_state or inplace, N, options.get("state_v_first", False),
                  inplace, intermediate, chunks)


_PARAMS: dict = {}


def _call_triton(fn, args, kwargs, options):
    """Run a kda_triton entry point with the public keywords. `options` are the non-default fla options: one the
    function does not take, or a NotImplementedError it raises, is a clear error naming the option."""
    params = _PARAMS.get(fn)
    if params is None:
        params = _PARAMS[fn] = inspect.signature(fn).parameters
    missing = [name for name in options if name not in params]
    hint = "; backend='torch' computes it (on CPU tensors, or .cpu() first)"
    if missing:
        raise NotImplementedError(f"backend='triton' does not implement {', '.join(missing)}{hint}")
    try:
        return fn(*args, **kwargs, **options)
    except NotImplementedError as err:
        raise NotImplementedError(f"backend='triton': {err}{hint}") from err


def _compose(q, k, v, g, beta, use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
             allow_neg_eigval):
    """fla's options as torch ops in front of the core recurrence (torch and reference backends): grouped value
    heads share q, k (repeated to HV heads: the gradient sums over each group), the gate and beta activations.
    Differentiable, so A_log and dt_bias get their gradients from autograd."""
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    if use_gate_in_kernel:
        g = kda_gate(g.to(compute_dtype(v.dtype)), A_log, dt_bias, lower_bound)
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(compute_dtype(v.dtype)))
        if allow_neg_eigval:
            beta = 2 * beta
    return q, k, v, g, beta


def _nonfinite_tokens(k, v, g, beta, options):
    """None when every token of k, v, g and beta is finite (the common case: one reduction per tensor and one host
    read); else (k, v, g, beta) with each non-finite entry replaced by 0, and `bad` [B, T, HV, V]: the value channels
    of each token that the recurrence makes non-finite from there on (all of a head's for a bad k, g or beta; one
    channel for a bad v entry: the delta rule keeps value channels apart). A full reset stays as it is: g = -inf as
    a decay; as the in-kernel gate's input, +-inf (a gate of -inf or 0); beta through the in-kernel sigmoid, +-inf
    (0 or 1). q is not read: it never enters the state, and its token's output row is its own."""
    gate_in, sig = options.get("use_gate_in_kernel", False), options.get("use_beta_sigmoid_in_kernel", False)
    if not g.numel():
        return None
    sums = torch.stack([k.sum(dtype=torch.float32), v.sum(dtype=torch.float32), beta.sum(dtype=torch.float32),
                        g.amax().float()]).tolist()
    if all(math.isfinite(x) for x in sums[:3]) and sums[3] <= (math.inf if gate_in else 0.0):
        return None  # max propagates NaN; a -inf reset passes (and a false alarm only costs the exact route below)
    k_ok, v_ok = torch.isfinite(k), torch.isfinite(v)
    g_ok = ~torch.isnan(g) if gate_in else torch.isfinite(g) | (g == -math.inf)
    b_ok = ~torch.isnan(beta) if sig else torch.isfinite(beta)
    groups = v.shape[2] // k.shape[2]
    head_ok = g_ok.all(-1) & b_ok & k_ok.all(-1).repeat_interleave(groups, dim=2)  # [B, T, HV]
    clean = [torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
             for x, m in ((k, k_ok), (v, v_ok), (g, g_ok), (beta, b_ok))]
    return (*clean, ~(head_ok[..., None] & v_ok))


def _after_nonfinite(out, bad, spans, chunk_size, v_first):
    """Outputs of a chunked call on cleaned inputs made those of the recurrence on the raw ones: from a bad token on
    (`bad` [B, T, HV, V] from _nonfinite_tokens) its sequence's outputs in those value channels are NaN, and so are
    the state's columns for them at the end and entering every later chunk. Earlier outputs stay those of the clean
    prefix: in a chunk's matmuls a NaN times the 0 of a causal mask is NaN, which is how a later token had reached
    earlier ones."""
    o, final, *h = out
    nan = torch.full((), math.nan, dtype=o.dtype, device=o.device)
    hit = torch.zeros_like(bad)
    for b, e in spans:
        hit[:, b:e] = bad[:, b:e].cumsum(1) > 0
    o = torch.where(hit, nan, o)

    def columns(states, seen):  # states [..., K, V] (or [..., V, K] with v_first), seen [..., V]
        return torch.where(seen[..., None] if v_first else seen[..., None, :], nan.to(states.dtype), states)

    if final is not None:  # [N, HV, K, V]: a sequence's hits by its last token
        seen = hit[:, -1] if len(spans) == 1 else torch.stack([hit[0, e - 1] if e > b else hit.new_zeros(
            hit.shape[2:]) for b, e in spans])
        final = columns(final, seen)
    if h:  # [B, NT, HV, ., .]: the state entering a chunk holds the tokens before its start
        cols = [[hit[:, t - 1] if t > b else hit.new_zeros(hit.shape[0], *hit.shape[2:])
                 for t in range(b, e, chunk_size)] for b, e in spans]
        h = [columns(h[0], torch.stack([c for seq in cols for c in seq], 1))]
    return (o, final, *h)


def _run(kind, q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
         cu_seqlens_cpu, backend, options, inplace_final_state=False, ssm_state_indices=None, chunk_size=CHUNK_SIZE,
         return_intermediate_states=False, finite_checked=False):
    """Default the scale, pick the backend for q's device and run it with autocast off (the recurrence is
    computed in fp32 whatever autocast would pick). `options` holds the non-default gate/beta/layout options.

    Chunked calls are causal through non-finite inputs as the recurrence is: a NaN or inf in k, v, g or beta at
    one token changes no earlier output (see _nonfinite_tokens / _after_nonfinite). The reference backend is the
    recurrence itself and token-by-token calls are causal by construction."""
    if q.is_meta:
        return _meta_result(kind, q, v, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, options,
                            inplace_final_state, return_intermediate_states, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = _resolve(backend, q.device)
    if kind == "chunk" and backend != "reference" and not finite_checked:
        found = _nonfinite_tokens(k, v, g, beta, options)
        if found is not None:
            *clean, bad = found
            out = _run(kind, q, *clean, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend, options=options,
                       chunk_size=chunk_size, return_intermediate_states=return_intermediate_states,
                       finite_checked=True)
            cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
            spans = [(0, q.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
            return _after_nonfinite(out, bad, spans, chunk_size, options.get("state_v_first", False))
    if backend == "triton":
        if q.dtype == torch.float64:
            raise ValueError("float64 inputs run on backend='torch' or 'reference' only (the Triton kernels "
                             "compute in fp32 tiles); pass float32 or use backend='torch'")
        if v.shape[2] != q.shape[2] and not _triton_supports_gva():
            raise NotImplementedError(f"backend='triton' does not implement grouped value heads (HV={v.shape[2]} "
                                      f"> H={q.shape[2]}); backend='torch' computes them (on CPU tensors, or "
                                      ".cpu() first)")
        fn = chunk_kda_triton if kind == "chunk" else fused_recurrent_kda_triton
        extra = dict(options)
        if kind == "chunk":
            if chunk_size != CHUNK_SIZE:
                extra["chunk_size"] = chunk_size
            if return_intermediate_states:
                extra["return_intermediate_states"] = True
        else:
            extra["inplace_final_state"] = inplace_final_state
            if ssm_state_indices is not None:
                extra["ssm_state_indices"] = ssm_state_indices
        if cu_seqlens_cpu is not None:
            extra["cu_seqlens_cpu"] = cu_seqlens_cpu
        with torch.autocast(device_type=q.device.type, enabled=False):
            out = _call_triton(fn, (q, k, v, g, beta), dict(
                scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens), extra)
        if kind != "chunk" and inplace_final_state:
            return _settle_inplace(out, initial_state, ssm_state_indices)
        return out

    cu = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens  # only the offsets are read: host copy
    v_first = options.get("state_v_first", False)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v, g, beta = _compose(q, k, v, g, beta, options.get("use_gate_in_kernel", False),
                                    options.get("A_log"), options.get("dt_bias"), options.get("lower_bound"),
                                    options.get("use_beta_sigmoid_in_kernel", False),
                                    options.get("allow_neg_eigval", False))
        h0 = initial_state
        pool_rows = None
        if ssm_state_indices is not None:  # gather each sequence's row of the pool; padding slots start at zero
            pool_rows = ssm_state_indices.to(device=q.device, dtype=torch.long)
            real = (pool_rows >= 0).view(-1, 1, 1, 1)
            h0 = torch.where(real, initial_state[pool_rows.clamp_min(0)], 0.0)
        if h0 is not None and v_first:
            h0 = h0.transpose(-1, -2)
        write_through = inplace_final_state and pool_rows is None and not records_autograd(q, k, v, g, beta, h0)
        if kind == "chunk":
            if backend == "reference":
                out = recurrent_kda_reference(q, k, v, g, beta, scale, h0, output_final_state,
                                              use_qk_l2norm_in_kernel, cu,
                                              chunk_size if return_intermediate_states else None)
            else:
                out = chunk_kda_torch(q, k, v, g, beta, scale, h0, output_final_state, use_qk_l2norm_in_kernel, cu,
                                      chunk_size, return_intermediate_states)
        else:
            want_state = output_final_state or inplace_final_state
            if backend == "reference":
                out = recurrent_kda_reference(q, k, v, g, beta, scale, h0, want_state, use_qk_l2norm_in_kernel, cu)
            else:
                out = fused_recurrent_kda_torch(q, k, v, g, beta, scale, h0, want_state, use_qk_l2norm_in_kernel,
                                                cu, inplace_final_state=write_through)
    o, final, *h = out
    if pool_rows is not None:
        o = _zero_padding_slots(o, pool_rows, cu)
    if final is not None and v_first:
        final = final.transpose(-1, -2)
    if inplace_final_state:
        return _settle_inplace((o, final), initial_state, ssm_state_indices)
    if final is not None and v_first:
        final = final.contiguous()
    if h:
        h = h[0].to(k.dtype)
        return o, final, (h.transpose(-1, -2).contiguous() if v_first else h)
    return o, final


def _zero_padding_slots(o, rows, cu):
    """Sequences whose pool index is -1 are padding: their outputs are zeros, as fla's kernel leaves them."""
    pad = rows < 0
    if cu is None:
        return torch.where(pad.view(-1, 1, 1, 1), 0.0, o).to(o.dtype)
    bounds = cu.tolist()
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], device=o.device)
    token_pad = pad.repeat_interleave(lengths)  # [T]
    return torch.where(token_pad.view(1, -1, 1, 1), 0.0, o).to(o.dtype)


def _settle_inplace(out, initial_state, ssm_state_indices):
    """The inplace_final_state contract, the same for every backend and input layout: the final state is written
    into initial_state (its rows ssm_state_indices, padding slots untouched) and initial_state itself returned,
    unless autograd records the call: then initial_state (which backward may need) is left as it was and the new
    state is returned. Backends that already wrote in place cost nothing here."""
    o, final, *rest = out
    if final is None or final is initial_state or records_autograd(final, initial_state, o):
        return (o, final, *rest)
    with torch.no_grad():
        if ssm_state_indices is None:
            if final.data_ptr() != initial_state.data_ptr() or final.stride() != initial_state.stride():
                initial_state.copy_(final)
        else:
            rows = ssm_state_indices.to(device=initial_state.device, dtype=torch.long)
            real = rows >= 0
            if final.shape[0] == rows.shape[0]:  # per-sequence states to scatter (a backend that returned them)
                initial_state.index_copy_(0, rows[real], final[real].to(initial_state.dtype))
    return (o, initial_state, *rest)


def _validate_common(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, backend, opts, flags,
                     check_inputs, pool=False):
    _check_flags(check_inputs=check_inputs, **flags)
    N = _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, backend,
               state_v_first=flags["state_v_first"], pool=pool)
    _check_options(q, v, use_gate_in_kernel=flags["use_gate_in_kernel"], A_log=opts["A_log"],
                   dt_bias=opts["dt_bias"], lower_bound=opts["lower_bound"],
                   use_beta_sigmoid_in_kernel=flags["use_beta_sigmoid_in_kernel"],
                   allow_neg_eigval=flags["allow_neg_eigval"], safe_gate=flags.get("safe_gate", False))
    if check_inputs and not flags["use_gate_in_kernel"] and g.numel() and not g.is_meta:
        _check_gate_values(g)  # the in-kernel gate is <= 0 by construction
    return N


def _options(use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel, allow_neg_eigval,
             state_v_first):
    """The non-default gate/beta/layout options, in fla's keyword names (passed on as they are to triton).
    lower_bound without the in-kernel gate selects only fla's safe-gate kernels: a no-op, not passed on."""
    opts = {}
    if use_gate_in_kernel:
        opts.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
        opts = {key: value for key, value in opts.items() if value is not None}
    if use_beta_sigmoid_in_kernel:
        opts["use_beta_sigmoid_in_kernel"] = True
        if allow_neg_eigval:
            opts["allow_neg_eigval"] = True
    if state_v_first:
        opts["state_v_first"] = True
    return opts


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
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
    return_intermediate_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    safe_gate: bool = False,
    disable_recompute: bool = False,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    cp_context=None,
    check_inputs: bool = True,
    backend: str = "auto",
) -> tuple:
    """Chunked Kimi Delta Attention (prefill and training). Returns (o [B, T, HV, V], final state or None), and
    the states entering every chunk [B, NT, HV, K, V] (k's dtype) as a third output with
    return_intermediate_states=True (inference only: autograd must not record the call).

    fla's options keep fla's meaning (docs/ops.md). safe_gate, disable_recompute, use_graph and max_num_seqs only
    choose fla's GPU strategy: validated as fla does, then no-ops. check_inputs=False skips the one data-dependent
    check (g <= 0 and not NaN), a pass over g and, on GPU, a device sync.
    """
    state_v_first = _renamed_state_layout(state_v_first, transpose_state_layout)
    flags = dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                 return_intermediate_states=return_intermediate_states, safe_gate=safe_gate,
                 disable_recompute=disable_recompute, use_graph=use_graph)
    if isinstance(chunk_size, bool) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if cp_context is not None:
        raise ValueError("cp_context (fla's context parallelism across devices) is not supported; run each "
                         "device's sequences with cu_seqlens and their own initial states")
    N = _validate_common(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, backend,
                         dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound), flags, check_inputs)
    if max_num_seqs is not None and not (isinstance(max_num_seqs, int) and max_num_seqs >= N):
        raise ValueError(f"max_num_seqs must be an int >= the number of sequences {N}, got {max_num_seqs!r}")
    if return_intermediate_states:
        if disable_recompute:
            raise ValueError("return_intermediate_states must be used with disable_recompute=False")
        if records_autograd(q, k, v, g, beta, initial_state, A_log, dt_bias):
            raise ValueError("return_intermediate_states is inference only: call it under torch.inference_mode() "
                             "or torch.no_grad() (the intermediate states carry no gradient)")
    options = _options(use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, state_v_first)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return _empty(q, v, initial_state, output_final_state, N, state_v_first, False, return_intermediate_states)
    return _run("chunk", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend, options=options,
                chunk_size=chunk_size, return_intermediate_states=return_intermediate_states)


def _check_state_indices(idx, initial_state, N, inplace, check_inputs):
    if initial_state is None:
        raise ValueError("ssm_state_indices selects rows of a state pool: pass the pool as initial_state")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ssm_state_indices must be a 1-D int32/int64 tensor [N] = [{N}] (one pool row per "
                         f"sequence; 2-D speculative-decoding indices are not supported), got "
                         f"{idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__} {_shape(idx)}")
    if idx.numel() != N:
        raise ValueError(f"ssm_state_indices must hold one pool row per sequence, N={N}, got {idx.numel()}")
    if idx.device != initial_state.device:
        raise ValueError(f"ssm_state_indices is on {idx.device} but the state pool is on {initial_state.device}")
    if check_inputs and not idx.is_meta:
        rows = idx.tolist()
        P = initial_state.shape[0]
        bad = [r for r in rows if not (r == -1 or 0 <= r < P)]
        if bad:
            raise ValueError(f"ssm_state_indices must be pool rows in [0, {P}) or -1 (a padding slot), got {bad}")
        real = [r for r in rows if r >= 0]
        if inplace and len(set(real)) != len(real):
            raise ValueError(f"ssm_state_indices must not repeat a row when the final states are written back "
                             f"(inplace_final_state=True), got {rows}")


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
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    transpose_state_layout: bool | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    check_inputs: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent Kimi Delta Attention (decode: a few tokens on a carried state).

    inplace_final_state=True (needs initial_state) writes the final states into initial_state and returns that
    tensor as the final state (whatever output_final_state says, as fla's kernel does), for every input
    (batched or cu_seqlens) and backend, so a decode loop allocates no state per step. When autograd records the
    call (grad enabled and an input requiring grad) initial_state is left untouched, since backward may read it,
    and the new state is returned: always use the returned state.

    ssm_state_indices [N] (serving engines' state pool): initial_state is a pool [P, HV, K, V]; sequence i starts
    from row ssm_state_indices[i] and, with inplace_final_state=True, its final state is written back there.
    Index -1 is a padding slot: its outputs are zeros and the pool is neither read nor written for it. Without
    inplace_final_state the final states come back as [N, HV, K, V] (padding rows: the zero start run on).
    """
    state_v_first = _renamed_state_layout(state_v_first, transpose_state_layout)
    flags = dict(output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first,
                 inplace_final_state=inplace_final_state)
    N = _validate_common(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, backend,
                         dict(A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound), flags, check_inputs,
                         pool=ssm_state_indices is not None)
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state=True writes the final state into initial_state: pass initial_state")
    if ssm_state_indices is not None:
        _check_state_indices(ssm_state_indices, initial_state, N, inplace_final_state, check_inputs)
    options = _options(use_gate_in_kernel, A_log, dt_bias, lower_bound, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, state_v_first)
    if q.shape[0] == 0 or q.shape[1] == 0:
        if ssm_state_indices is not None and not inplace_final_state:
            initial_state = None  # the pool is not the per-sequence final state
        return _empty(q, v, initial_state, output_final_state, N, state_v_first, inplace_final_state, False)
    return _run("recurrent", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, backend=backend, options=options,
                inplace_final_state=inplace_final_state, ssm_state_indices=ssm_state_indices)


def recurrent_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm_in_kernel=False, inplace=True,
                   backend="auto"):
    """One token per sequence on a carried state: the model's decode step, and the one entry into the recurrence
    for a single token. No input checks (the model builds its inputs; the ~20 checks of fused_recurrent_kda cost
    as much as the step itself on CPU).

    q, k [B, H, K]; v [B, HV, V]; g [B, HV, K] (log decay, <= 0); beta [B, HV]; state [B, HV, K, V]. Returns
    (o [B, HV, V] in v's dtype, the new state). With inplace=True the state is updated in place and returned,
    unless autograd records the call (then, as in fused_recurrent_kda, a new state is returned and `state` is
    left for backward). On CPU, a contiguous compute-dtype state without autograd takes the batched in-place
    step of kda_torch (a dozen tensor ops); everything else runs fused_recurrent_kda's path for T = 1.

    Grouped queries (a KDA layer whose keys and values are shared): q [B, G * H, K] over k, v, g, beta and state
    of H = HV heads, query head h reading state h // G; o [B, G * H, V]."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if inplace and _resolve(backend, q.device) == "torch" and state.is_contiguous() \
            and state.dtype == compute_dtype(v.dtype) and not records_autograd(q, k, v, g, beta, state):
        return recurrent_step_(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel), state
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each state's inputs repeated for its query heads; the repeated states stay equal
        k, v, g, beta, heads = (x.repeat_interleave(groups, 1) for x in (k, v, g, beta, state))
        o, heads = recurrent_step(q, k, v, g, beta, heads, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  inplace=False, backend=backend)
        heads = heads[:, ::groups]
        if inplace and not records_autograd(q, k, v, g, beta, state):
            return o, state.copy_(heads)
        return o, heads.contiguous()
    o, state = _run("recurrent", q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    cu_seqlens=None, cu_seqlens_cpu=None, backend=backend, options={}, inplace_final_state=inplace)
    return o[:, 0], state
