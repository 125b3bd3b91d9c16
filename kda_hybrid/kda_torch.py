"""Pure-PyTorch Kimi Delta Attention: the token-by-token ground truth and the fast chunked CPU path.

This module never imports triton. Every function takes the public layout

    q, k: [B, T, H, K]   v: [B, T, H, V]   g: [B, T, H, K] (log decay, <= 0)   beta: [B, T, H]
    state: [B, H, K, V] fp32

and computes in fp32 whatever the input dtype (float64 inputs: in float64, so that gradcheck runs on these
paths); outputs are cast back to v's dtype. Inputs are assumed
to be validated by `kda_ops` (the one public dispatch point).

Recurrence (one head, docs/architecture.md §1, eq. (1) of the Kimi Linear report):

    S <- diag(exp g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # inside the sqrt, as fla's and the original kernels do
CHUNK_SIZE = 64  # default tokens per chunk, for every backend; a power of two for the hierarchical gated products
CHUNK_SIZES = (32, 64)  # the chunk sizes the public ops accept (fla's, so calls move between the two unchanged)
GROUP_TOKENS = 512  # tokens per group of chunks (see _chunk_fwd_grouped); a multiple of every chunk size


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum(x^2) + eps) over the last dim (vector_norm is one fused pass)."""
    return x * _l2norm_factor(x, scale, eps)


def _l2norm_factor(x, scale=1.0, eps=L2NORM_EPS):
    """[..., 1] with l2norm(x, eps, scale) = x * factor, so that the norm and a layout copy can be one pass."""
    f = (torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + eps).rsqrt()
    return f if scale == 1.0 else f.mul(scale)


def records_autograd(*xs) -> bool:
    """Whether autograd records a call on `xs`: grad mode on and a tensor among them requiring grad (None and
    non-tensors are skipped). The one test every op uses to choose between its in-place and differentiable paths."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the recurrence and the state: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """fp32 (float64) copies of the inputs, q scaled (and q, k L2-normalised when asked)."""
    dtype = compute_dtype(v.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        return l2norm(q, scale=scale), l2norm(k), v, g, beta
    return q * scale, k, v, g, beta


def kda_gate(g, A_log=None, dt_bias=None, lower_bound=None):
    """The in-kernel gate of the public ops (use_gate_in_kernel=True), [..., HV, K] raw -> log decay <= 0:

        g = -exp(A_log) * softplus(g + dt_bias)                        (lower_bound None; A_log [HV] required)
        g = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))          (A_log None: lower_bound * sigmoid(g + dt_bias))

    dt_bias [HV * K] is optional. Computed in the recurrence's dtype; differentiable in g, A_log and dt_bias."""
    HV, K = g.shape[-2:]
    dtype = compute_dtype(g.dtype)
    x = g if g.dtype == dtype else g.to(dtype)  # no no-op casts: the gate runs per layer per decode token
    if dt_bias is not None:
        x = x + (dt_bias if dt_bias.dtype == dtype else dt_bias.to(dtype)).view(HV, K)
    a = None if A_log is None else (A_log if A_log.dtype == dtype else A_log.to(dtype)).view(HV, 1).exp()
    if lower_bound is None:
        return F.softplus(x) * a.neg()
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, for y > 0: how a gate's bias is set so that softplus(bias) is a chosen dt."""
    return y + torch.log(-torch.expm1(-y))


def _split_varlen(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


# --------------------------------------------------------------------------------------------------
# Ground truth: token by token.
# --------------------------------------------------------------------------------------------------


def _recurrent(q, k, v, g, beta, state, chunk_states=None):
    """Token-by-token scan on prepared fp32 tensors (q already scaled). state: [B, H, K, V]. With `chunk_states`
    (a list and a chunk size) the state entering every chunk is appended to the list."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        if chunk_states is not None and t % chunk_states[1] == 0:
            chunk_states[0].append(state)
        state = state * g[:, t].exp().unsqueeze(-1)  # [B, H, K, V]
        recall = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - recall)  # [B, H, V]
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def recurrent_kda_reference(
    q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=None,
):
    """The definition, one token at a time. Differentiable; slow on purpose (it is the oracle).

    With `chunk_size` it also returns the state entering every chunk of chunk_size tokens of every sequence,
    [B, NT, H, K, V] (varlen: B = 1 and the chunks of all sequences in order), as the chunked paths report them."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = q.shape
    V = v.shape[-1]
    seen = ([], chunk_size) if chunk_size else None
    spans = [(0, T)] if cu_seqlens is None else _split_varlen(cu_seqlens)
    n = B if cu_seqlens is None else 1
    outs, states = [], []
    for i, (bos, eos) in enumerate(spans):
        state = q.new_zeros(n, H, K, V) if initial_state is None else initial_state[i * n : (i + 1) * n].to(q.dtype)
        sl = slice(bos, eos)
        o, state = _recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state, seen)
        outs.append(o)
        states.append(state)
    o = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(dtype)
    final = (states[0] if len(states) == 1 else torch.cat(states)) if output_final_state else None
    if seen is None:
        return o, final
    return o, final, torch.stack(seen[0], dim=1)


# --------------------------------------------------------------------------------------------------
# Recurrent form for decoding: the same scan, in place when no gradient is needed.
# --------------------------------------------------------------------------------------------------


def _step_(q, k, v, g, beta, S):
    """One token per sequence on prepared tensors (compute dtype, q scaled, q/k normalised as asked): k, g
    [B, H, K], v [B, H, V], beta [B, H]; S [B, H, K, V] contiguous in that dtype, updated in place (decay, then the
    delta-rule write); q [B, G * H, K]: G query heads per state (query head h reads state h // G, as repeat_kv pairs
    them; G = 1 but for a KDA layer with shared keys and values). Returns o [B, G * H, V]. Batched [B * H] products,
    a dozen tensor ops in all: a decode step on CPU costs its op count, not its FLOPs. Callers hold no_grad (the
    write is in place): the model's decode step runs only without gradient, and a context entered per token would
    cost as much as two of these ops."""
    B, H, K = k.shape
    V, G = v.shape[-1], q.shape[1] // H
    S3 = S.view(B * H, K, V)
    S3.mul_(g.exp().view(B * H, K, 1))
    k = k.reshape(B * H, 1, K)
    delta = (v.reshape(B * H, 1, V) - torch.bmm(k, S3)).mul_(beta.reshape(B * H, 1, 1))  # [B * H, 1, V]
    S3.baddbmm_(k.transpose(1, 2), delta)  # S += k^T delta
    return torch.bmm(q.reshape(B * H, G, K), S3).view(B, G * H, V)


@torch.no_grad()
def _recurrent_inplace(q, k, v, g, beta, state):
    """Token-by-token scan on prepared tensors that updates `state` ([B, H, K, V]) in place; returns o [B, T, H, V].
    A state in another dtype or layout is scanned as a contiguous compute-dtype copy, written back once."""
    work = state.to(q.dtype, memory_format=torch.contiguous_format)  # `state` itself when it already is one
    o = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        o[:, t] = _step_(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], work)
    if work is not state:
        state.copy_(work)
    return o


def recurrent_step_(q, k, v, g, beta, state, scale, use_qk_l2norm_in_kernel=False):
    """One token per sequence from raw inputs, without the [B, T, ...] preparation of the op (what
    kda_ops.recurrent_step runs on CPU).

    q, k [B, H, K], v [B, H, V], g [B, H, K] (log decay), beta [B, H] in any float dtype; state [B, H, K, V]
    contiguous, in the compute dtype (fp32, or float64), updated in place. Returns o [B, H, V] in v's dtype. Not
    differentiable: callers make sure autograd records nothing here (no no_grad context per token: entering one
    costs as much as two of the step's ops). Casts only what is not in the state's dtype already (each no-op
    call costs a decode step microseconds)."""
    out_dtype, dtype = v.dtype, state.dtype
    if not q.dtype == k.dtype == v.dtype == g.dtype == beta.dtype == dtype:  # one test: the usual case casts none
        q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:  # the scale folded into q's factor: one multiply per tensor
        q, k = q * _l2norm_factor(q, scale), k * _l2norm_factor(k)
    else:
        q = q * scale
    o = _step_(q, k, v, g, beta, state)
    return o if o.dtype == out_dtype else o.to(out_dtype)


def fused_recurrent_kda_torch(
    q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False,
):
    """Recurrent KDA for short T (decode). With `inplace_final_state` and an fp32 initial_state, the
    state tensor itself is updated and returned (no allocation per step) when no gradient is needed."""
    if records_autograd(q, k, v, g, beta, initial_state):
        return recurrent_kda_reference(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
        )
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        state = q.new_zeros(N, H, K, v.shape[-1])
    elif inplace_final_state:
        state = initial_state
    else:
        state = initial_state.to(q.dtype, copy=True)
    if cu_seqlens is None:
        o = _recurrent_inplace(q, k, v, g, beta, state)
    else:  # each sequence updates its own row of the state (a view), so in place holds for packed inputs too
        o = v.new_empty(v.shape)
        for i, (bos, eos) in enumerate(_split_varlen(cu_seqlens)):
            sl = slice(bos, eos)
            o[:, sl] = _recurrent_inplace(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state[i : i + 1])
    return o.to(dtype), (state if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# Chunked form: everything but the state scan (and, without autograd, each chunk's output) is batched over the
# chunks of a group.
# --------------------------------------------------------------------------------------------------


MAX_BLOCK_DECAY = 60.0  # largest log factor on either side of an anchored product (e^60 << fp32 max e^88)
MAX_ANCHORED_DECAY = 2 * MAX_BLOCK_DECAY  # a block decaying at most this much: one matmul, anchored halfway
INVERSE_BLOCK = 16  # diagonal blocks of the WY inverse solved directly, then merged (see _unit_lower_inverse)
# Tokens per chunk of the arithmetic whatever chunk_size asks (it then only spaces the intermediate states): the
# chunked form is exact at any size, and per token it costs 2 C (K + V) + 3 K V multiply-adds, so 32-token chunks
# do 20% fewer than 64 (K = V = 128). One CPU thread, fp32, H = 4, interleaved: 15% faster at T = 4096 (K = V = 128
# and 64) and T = 256 (K = V = 64); 16-token chunks were no faster than 32.
COMPUTE_CHUNK = 32


def _gated_products(q, k, G, seg=None):
    """A_kk[r, c] = k_r . k_c exp(G_r - G_c) for c < r, and A_qk[r, c] = q_r . k_c exp(G_r - G_c) for c <= r.

    q, k, G: [..., C, K] with G non-increasing along C (cumulative log decay); C a power of two.
    Returns (A_kk, A_qk), each [..., C, C].

    exp(G_r - G_c) cannot be split naively into exp(G_r) * exp(-G_c): with g = -20 per token the second
    factor overflows within five tokens. A block of s tokens whose largest per-channel decay is at most
    MAX_ANCHORED_DECAY is done in one matmul anchored halfway through its decay (both factors within e^+-60,
    no overflow, no harmful underflow; the pairs above the diagonal, up to e^120, are masked). Otherwise the
    block is split: its lower-left quadrant pairs rows after the midpoint with columns up to it, anchored at
    the midpoint so that both factors are <= 1 (always safe), and the two diagonal halves are treated the same
    way, down to single tokens if need be. With ordinary decays one 64x64 matmul per chunk does it all;
    g = -20 per token costs a few more, smaller, levels.
    `seg` (None, or the running count of full resets [..., C, K]) zeroes the pairs a reset separates: a block
    with a reset after its first row is always split, so the one-matmul blocks never straddle one.
    """
    A_kk, A_qk = _gated_blocks(q.unsqueeze(-3), k.unsqueeze(-3), G.unsqueeze(-3),
                               None if seg is None else seg.unsqueeze(-3))
    return A_kk.squeeze(-3), A_qk.squeeze(-3)


def _exp_diff(Ga, Gb, seg_a, seg_b):
    """exp(Ga - Gb) for a token a at or after b, 0 where a full reset (zero decay) lies in (b, a]: with resets the
    cumulative log decay G leaves them out and `seg` counts them (see _chunk_fwd), so a different count means a
    reset in between. The -inf goes in before exp, never 0 * exp(...), whose gradient could meet an inf."""
    if seg_a is None:
        return torch.exp(Ga - Gb)
    return torch.exp(torch.where(seg_a == seg_b, Ga - Gb, float("-inf")))


def _gated_blocks(q, k, G, seg):
    """_gated_products on nb diagonal blocks at once: q, k, G [..., nb, s, K] -> (A_kk, A_qk) [..., nb, s, s].

    Built from the quadrants with torch.cat, never by writing into views of a preallocated matrix:
    torch.compile's aot_autograd rejects in-place writes into views of a tensor that crosses a graph break
    (the data-dependent decay test below is one), and the two forms cost the same in eager."""
    s = G.shape[-2]
    if s == 1 or (float((G[..., 0, :] - G[..., -1, :]).detach().max()) <= MAX_ANCHORED_DECAY
                  and (seg is None or bool((seg[..., 0, :] == seg[..., -1, :]).all()))):
        anchor = (G[..., :1, :] + G[..., -1:, :]) * 0.5
        row_f = torch.exp(G - anchor)  # within e^+-MAX_BLOCK_DECAY
        col_t = (k * torch.exp(anchor - G)).transpose(-1, -2)
        # above the diagonal exp(G_r - G_c) reaches e^MAX_ANCHORED_DECAY and may overflow: tril drops those
        # entries (it selects, never multiplies, so an inf there reaches neither the result nor a gradient)
        return ((k * row_f) @ col_t).tril(-1), ((q * row_f) @ col_t).tril(0)
    h = s // 2
    ref = G[..., h - 1 : h, :]  # [..., nb, 1, K]
    seg_ref = None if seg is None else seg[..., h - 1 : h, :]
    row_f = _exp_diff(G[..., h:, :], ref, *_halves(seg, seg_ref, h, True))  # rows after the midpoint, <= 1
    col_t = (k[..., :h, :] * _exp_diff(ref, G[..., :h, :], *_halves(seg, seg_ref, h, False))).transpose(-1, -2)
    lower_left = ((k[..., h:, :] * row_f) @ col_t, (q[..., h:, :] * row_f) @ col_t)  # [..., nb, h, h]
    split = (x if x is None else x.unflatten(-2, (2, h)).flatten(-4, -3) for x in (q, k, G, seg))
    halves = _gated_blocks(*split)  # [..., 2 nb, h, h]
    out = []
    for ll, d in zip(lower_left, halves):
        d = d.unflatten(-3, (-1, 2))  # [..., nb, 2, h, h]: the upper and the lower diagonal half
        upper = torch.cat((d[..., 0, :, :], torch.zeros_like(ll)), dim=-1)  # [..., nb, h, s]
        lower = torch.cat((ll, d[..., 1, :, :]), dim=-1)
        out.append(torch.cat((upper, lower), dim=-2))  # [..., nb, s, s]
    return tuple(out)


def _halves(seg, seg_ref, h, after):
    """(seg of the rows after / up to the midpoint, seg of the midpoint) in the order _exp_diff takes them."""
    if seg is None:
        return None, None
    return (seg[..., h:, :], seg_ref) if after else (seg_ref, seg[..., :h, :])


def _unit_lower_inverse(A):
    """(I + strict_lower(A))^-1 for A [M, C, C] (C a power of two), reading nothing on or above A's diagonal (A_kk's
    upper triangle may hold overflowed products). The diagonal blocks of INVERSE_BLOCK are solved in one batched
    call, then merged pairwise, [[P, 0], [L, Q]]^-1 = [[P^-1, 0], [-Q^-1 L P^-1, Q^-1]]: two small matmuls per
    merge instead of a long triangular solve. At C = 64 on one CPU thread (M = 32 chunks x heads) this took
    0.34-0.45 ms against 0.62 ms for one solve_triangular of the whole matrix (min of 30, interleaved). The blocks are
    written into one zeroed [M, C, C] result through strided views of its diagonal and lower-left blocks, not
    assembled with torch.cat: at C = 32, M = 64 the three cats of [M, C, C] had cost about as much as the solve."""
    A = A.contiguous()
    M, C, _ = A.shape
    s, off = min(C, INVERSE_BLOCK), A.storage_offset()
    diag = A.as_strided((M, C // s, s, s), (C * C, s * (C + 1), C, 1), off)  # the diagonal blocks, a view
    eye = torch.eye(s, dtype=A.dtype, device=A.device).expand(diag.shape)
    D = torch.linalg.solve_triangular(diag, eye, upper=False, unitriangular=True)  # [M, C / s, s, s]
    if s == C:
        return D.reshape(M, C, C)
    X = A.new_zeros(M, C, C)
    X.as_strided(diag.shape, diag.stride()).copy_(D)
    while s < C:  # pairs of diagonal blocks of X, merged into blocks of 2s: their lower-left block -Q L P
        blocks = (M, C // (2 * s), s, s), (C * C, 2 * s * (C + 1), C, 1)
        P, Q = X.as_strided(*blocks, 0), X.as_strided(*blocks, s * C + s)
        L = A.as_strided(*blocks, off + s * C)
        torch.neg(Q @ (L @ P), out=X.as_strided(*blocks, s * C))
        s *= 2
    return X


class _UnitLowerInverse(torch.autograd.Function):
    """_unit_lower_inverse with its gradient in two matmuls: d(X^-1) = -X^-1 dX X^-1, so dA = -Ai^T dAi Ai^T on
    the strict lower triangle (the only entries read); autograd through the blocks would replay every merge."""

    @staticmethod
    def forward(ctx, A):
        Ai = _unit_lower_inverse(A)
        ctx.save_for_backward(Ai)
        return Ai

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dAi):
        (Ai,) = ctx.saved_tensors
        At = Ai.transpose(-1, -2)
        return (At @ dAi @ At).neg_().tril_(-1)


class _StateScan(torch.autograd.Function):
    """The sequential part of the chunked forward with autograd, one node for all chunks of a group:

        v_new[n] = u[n] - w[n] S[n],   S[n + 1] = trans[n] S[n] + kT[n]^T v_new[n]

    w, u, kT [N, M, C, .], trans [N, M, K, 1], S0 [M, K, V] -> (v_new [N, M, C, V], S [N, M, K, V] the states
    entering the chunks, the final state [M, K, V]). The backward runs the same recurrence in reverse for the state
    gradients (two products a chunk) and batches every other gradient over the chunks afterwards, where autograd
    through the loop replays about ten small nodes a chunk and stacks their gradients: forward+backward at T = 4096,
    H = 4, K = V = 128 took 201 ms against 210 ms (median of 5, 1 thread; T = 1024 and 256 within noise)."""

    @staticmethod
    def forward(ctx, w, u, kT, trans, S0):
        N, M, C, _ = w.shape
        K, V = S0.shape[-2:]
        v_new = u.clone()
        S_all = S0.new_empty(N + 1, M, K, V)
        S_all[0].copy_(S0)
        for n in range(N):
            v_new[n].baddbmm_(w[n], S_all[n], alpha=-1)
            torch.mul(S_all[n], trans[n], out=S_all[n + 1])
            S_all[n + 1].baddbmm_(kT[n].transpose(-1, -2), v_new[n])
        ctx.save_for_backward(w, kT, trans, v_new, S_all)
        return v_new, S_all[:N], S_all[N]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dv_new, dS_all, dS):
        w, kT, trans, v_new, S_all = ctx.saved_tensors
        N, M, C, _ = w.shape
        K, V = S_all.shape[-2:]
        dvn = torch.zeros_like(v_new) if dv_new is None else dv_new.clone()  # becomes the gradient of v_new
        dS_next = S_all.new_empty(N, M, K, V)  # the gradient of the state leaving each chunk
        dS = S_all.new_zeros(M, K, V) if dS is None else dS.clone()
        for n in range(N - 1, -1, -1):
            dS_next[n].copy_(dS)
            dvn[n].baddbmm_(kT[n], dS)
            dS.mul_(trans[n])
            if dS_all is not None:
                dS.add_(dS_all[n])
            dS.baddbmm_(w[n].transpose(-1, -2), dvn[n], alpha=-1)
        S_in = S_all[:N]
        dw = -(dvn.flatten(0, 1) @ S_in.flatten(0, 1).transpose(-1, -2)).view(w.shape)
        dkT = (v_new.flatten(0, 1) @ dS_next.flatten(0, 1).transpose(-1, -2)).view(kT.shape)
        dtrans = (S_in * dS_next).sum(-1, keepdim=True)
        return dw, dvn, dkT, dtrans, dS


def _chunks(x, N, C):
    """[B, T, H, D] -> [N, B, H, C, D] view: chunk-major, so that once copied chunk n of every sequence and head is
    one contiguous [B*H, C, D] block, which the scan's products read and write in place."""
    return x.unflatten(1, (N, C)).permute(1, 0, 3, 2, 4)


def _strong_decay_products(q, k, gc, G, b):
    """The chunk tensors of the chunked form when some channel decays by more than an anchored product allows, or
    fully resets: q, k, gc (per-token log decays), G (their cumulative sums) [N, B, H, C, K]; b (beta) [N*B*H, C, 1].
    Returns A_kk times beta and A_qk ([N*B*H, C, C]), q exp(G), k exp(G), k exp(G_last - G) and exp(G_last).

    Full resets: a token whose decay is exactly 0 in this precision (g = -inf, which g <= 0 allows, or g < -104 in
    fp32) would put -inf - -inf = NaN into every difference of G. Such tokens leave the cumulative sum (their g
    counts as 0) and `seg` counts them per channel; _exp_diff gives 0 across a reset, which is exp(g) = 0 of the
    recurrence, with a zero gradient to g there as in the recurrence."""
    reset = gc.detach().exp() == 0
    seg = seg_last = None
    if bool(reset.any()):
        gc = gc.masked_fill(reset, 0.0)
        G = gc.cumsum(-2)
        seg = reset.cumsum(-2, dtype=torch.int32)
        seg_last = seg[..., -1:, :]
    decay = _exp_diff(G, 0.0, seg, 0)  # <= 1: decay from the chunk start to each token
    A_kk, A_qk = (x.reshape(-1, *x.shape[-2:]) for x in _gated_products(q, k, G, seg))
    # the decay from each token to the chunk end summed over the later tokens, not G_last - G: with g = -6 per
    # token that difference of two numbers near -300 cost the final state 1e-5 of its precision
    after = torch.cat((gc[..., 1:, :], torch.zeros_like(gc[..., :1, :])), dim=-2).flip(-2).cumsum(-2).flip(-2)
    return (A_kk * b, A_qk, q * decay, k * decay, k * _exp_diff(after, 0.0, seg_last, seg),
            _exp_diff(G[..., -1:, :], 0.0, seg_last, 0))


def _chunk_fwd(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, state, C, return_chunk_states=False):
    """Chunked KDA with autograd on raw inputs [B, Tg, H, .] (Tg a multiple of C) from `state` [B, H, K, V] (compute
    dtype). Returns o [N, B, H, C, V] (chunk-major), the final state (and the state entering every chunk,
    [B, H, N, K, V], with return_chunk_states). Without autograd _chunk_fwd_nograd does the same in place.

    Common case, no channel decays by more than e^-MAX_ANCHORED_DECAY over a chunk: the gated products are
    anchored halfway through each chunk's decay, a = G_last / 2 per channel, E = exp(G - a) within e^+-60:
    A_qk = (q E)(k / E)^T, A_kk = (k E)(k / E)^T, and every other factor follows from E and exp(a) by products,
    q exp(G) = (q E) exp(a), k exp(G_last - G) = (k / E) exp(a): one exp over the chunk tensors in all (an exp
    costs about 7 multiplies on one CPU thread). Otherwise (strong or zero decays) the gated products take the
    hierarchy of _gated_products and the decays are exponentiated directly."""
    B, Tg, H, K = q.shape
    V = v.shape[-1]
    N, BH = Tg // C, B * H
    dtype = state.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))

    def chunked(x, f=None):  # [B, Tg, H, D] (times f, [B, Tg, H, 1] or a number) -> contiguous [N, B, H, C, D]
        xv = _chunks(x, N, C).contiguous()
        return xv if f is None else xv * (_chunks(f, N, C) if isinstance(f, torch.Tensor) else f)

    if use_qk_l2norm_in_kernel:
        qc, kc = chunked(q, _l2norm_factor(q, scale)), chunked(k, _l2norm_factor(k, 1.0))
    else:
        qc, kc = chunked(q, scale), chunked(k)
    vc, gc = chunked(v), chunked(g)  # [N, B, H, C, V], [N, B, H, C, K]
    G = gc.cumsum(-2)
    b = _chunks(beta.unsqueeze(-1), N, C).reshape(-1, C, 1)  # [N * B * H, C, 1]
    G_last = G[..., -1:, :]  # [N, B, H, 1, K]

    if float(G_last.detach().min()) >= -MAX_ANCHORED_DECAY:
        a = G_last * 0.5  # [N, B, H, 1, K]
        ea = a.exp()  # decay from the chunk start to the anchor, and from the anchor to the chunk end
        trans = ea * ea  # exp(G_last), the decay of the state across the chunk
        E = torch.exp(G - a)
        kF = kc * torch.exp(a - G)  # not kc / E: its backward squares E, which overflows
        qE, kE = qc * E, kc * E
        kFt = kF.flatten(0, 2).transpose(1, 2)  # [N * B * H, K, C]
        A_kk, A_qk = torch.bmm(kE.flatten(0, 2), kFt), torch.bmm(qE.flatten(0, 2), kFt)  # [N * B * H, C, C]
        # tril before beta: an overflowed product above the diagonal times beta's gradient would be NaN
        A_kk, A_qk = A_kk.tril(-1) * b, A_qk.tril()
        qx, kx, kT = qE * ea, kE * ea, kF * ea
    else:
        A_kk, A_qk, qx, kx, kT, trans = _strong_decay_products(qc, kc, gc, G, b)

    # WY form: w = (I + A_kk)^-1 diag(beta) k exp(G), u = (I + A_kk)^-1 diag(beta) v, v_new = u - w S; beta scales
    # the C x C inverse's columns rather than the wider K- and V-channel operands.
    A_inv = (_UnitLowerInverse.apply(A_kk) * b.view(-1, 1, C)).view(N, BH, C, C)
    qx, kx, vc = qx.view(N, BH, C, K), kx.view(N, BH, C, K), vc.view(N, BH, C, V)
    kT = kT.view(N, BH, C, K)
    trans = trans.reshape(N, BH, K, 1)
    # The only sequential part, one autograd node: the state entering each chunk S, v_new, and
    # S' = exp(G_last) S + kT^T v_new, with chunk n of all sequences and heads one [B*H, ., .] block.
    v_new, S_all, S = _StateScan.apply(A_inv @ kx, A_inv @ vc, kT, trans, state.reshape(BH, K, V))
    o = torch.baddbmm(torch.bmm(qx.flatten(0, 1), S_all.flatten(0, 1)), A_qk, v_new.flatten(0, 1))
    o, S = o.view(N, B, H, C, V), S.view(B, H, K, V)
    if not return_chunk_states:
        return o, S
    return o, S, S_all.view(N, B, H, K, V).permute(1, 2, 0, 3, 4)  # [B, H, N, K, V]


# Never traced by torch.compile, which runs it as the eager code it is (a graph break either way: the anchor choice
# reads a value): AOT autograd's functionalisation of its in-place steps (kE = kc.mul_(E), a view an in-place op
# returned, read after another view of the same buffer was written with out=) gave a stale kE, and every chunk after
# the first was wrong (torch 2.13, aot_eager and inductor alike). Compiled, _chunk_fwd_grouped's loop runs eagerly
# around its graph break, so no is_compiling() test there can route around this function.
@torch.compiler.disable
@torch.no_grad()
def _chunk_fwd_nograd(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, state, C, out, return_chunk_states=False):
    """_chunk_fwd without autograd, every step into its own buffers in place: the output goes into `out`
    ([B, Tg, H, V], token-major, compute dtype); returns (the final state,) (and the states entering the chunks,
    [B, H, N, K, V], with return_chunk_states).

    q enters unscaled and unnormalised: both output terms are linear in each query row, so its factor (the l2 norm's
    times the scale) multiplies the output once, in the copy into `out`, instead of a pass over q. The scan carries
    P = Diag(p) S, the state times a per-channel factor p fixed per chunk, so that the query and key factors of the
    gated products serve the scan unchanged (no further passes to form q exp(G) and k exp(G)):

    - decays up to e^-MAX_BLOCK_DECAY over a chunk (the common case): anchored at the chunk end, E = exp(G - G_last)
      in [1, e^60], q E and k E as they are and k / E = k exp(G_last - G) the update's keys; p = exp(G_last), the
      state's decay, so S' = P + (k / E)^T v_new and the next chunk's P = p' S'. Two ops a chunk on the state, as
      for S' = exp(G_last) S + ..., with S itself exact at every chunk end;
    - up to e^-MAX_ANCHORED_DECAY: anchored halfway (E within e^+-60), p = exp(G_last / 2), S' = p P + ...;
    - beyond, or with full resets: the hierarchy of _gated_products and the decays exponentiated directly, P = S."""
    B, Tg, H, K = q.shape
    V = v.shape[-1]
    N, BH = Tg // C, B * H
    dtype = state.dtype
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))

    def chunked(x, f=None):  # [B, Tg, H, D] (times f, [B, Tg, H, 1] or None) -> contiguous [N, B, H, C, D]
        xv = _chunks(x, N, C)
        buf = torch.empty(xv.shape, dtype=dtype, device=x.device)
        return buf.copy_(xv) if f is None else torch.mul(xv, _chunks(f, N, C), out=buf)

    # k, then q, of chunk n, head h: one [2C, K] block, so that one product gives A_kk over A_qk
    kq = torch.empty(N, B, H, 2 * C, K, dtype=dtype, device=q.device)
    kc, qE = kq[..., :C, :], kq[..., C:, :]
    kv = _chunks(k, N, C)
    if use_qk_l2norm_in_kernel:
        fq = _l2norm_factor(q, scale)
        torch.mul(kv, _chunks(_l2norm_factor(k, 1.0), N, C), out=kc)
    else:
        fq = scale
        kc.copy_(kv)
    qv = _chunks(q, N, C)  # [N, B, H, C, K] view
    G = chunked(g).cumsum_(-2)  # a cumsum reading the permuted layout costs 1.6x the copy and a contiguous cumsum
    b = _chunks(beta.unsqueeze(-1), N, C).reshape(-1, C, 1)  # [N * B * H, C, 1]
    G_last = G[..., -1:, :]  # [N, B, H, 1, K]
    low = float(G_last.min())
    pre = post = None  # S' = pre * P + kT^T v_new, P' = post' * S' (None: 1)
    if low >= -MAX_ANCHORED_DECAY:
        end = low >= -MAX_BLOCK_DECAY
        a = G_last.clone() if end else G_last * 0.5  # [N, B, H, 1, K]; G_last itself is overwritten next
        p = a.exp()
        E = G.sub_(a).exp_()
        kT = torch.div(kc, E)  # k exp(a - G)
        kE = kc.mul_(E)
        torch.mul(E, qv, out=qE)
        A = torch.bmm(kq.view(-1, 2 * C, K), kT.flatten(0, 2).transpose(1, 2))  # [N * B * H, 2C, C]: A_kk over A_qk
        A_kk, A_qk = A[:, :C].mul_(b), A[:, C:].tril_()
        post = p
        if not end:  # the update's keys k exp(G_last - G) = (k / E) exp(G_last / 2)
            kT, pre = kT.mul_(p), p
    else:
        A_kk, A_qk, qE, kE, kT, pre = _strong_decay_products(qv, kc, _chunks(g, N, C), G, b)

    # v_new = A_inv (v - k exp(G) S) with A_inv = (I + A_kk)^-1 diag(beta) (w is never formed: C^2 K fewer
    # multiply-adds a chunk), and the output of chunk n made while its state is in cache.
    A_inv = _unit_lower_inverse(A_kk).mul_(b.view(-1, 1, C)).view(N, BH, C, C).unbind()
    A_qk = A_qk.view(N, BH, C, C).unbind()
    qE, kE = qE.reshape(N, BH, C, K).unbind(), kE.reshape(N, BH, C, K).unbind()  # views
    kT = kT.view(N, BH, C, K).transpose(-1, -2).unbind()  # [B*H, K, C] each
    pre, post = (None if x is None else x.reshape(N, BH, K, 1).unbind() for x in (pre, post))
    vv = _chunks(v, N, C)  # chunk n, [B, H, C, V]: a view of v when B = 1, else one copy
    vc = vv.squeeze(1).unbind() if B == 1 else chunked(v).view(N, BH, C, V).unbind()
    o = v.new_empty(N, BH, C, V, dtype=dtype)
    v_new, r = o.new_empty(BH, C, V), o.new_empty(BH, C, V)
    S0 = state.reshape(BH, K, V)
    S_all = state.new_empty(N + 1 if return_chunk_states else 2, BH, K, V)
    if return_chunk_states or post is None:
        S_all[0].copy_(S0)
    if post is not None:  # P and S' share a buffer (S' = P + kT^T v_new in place); the next P goes to the other
        work = S_all[:2] if not return_chunk_states else state.new_empty(2, BH, K, V)
        P = torch.mul(S0, post[0], out=work[1])
    else:
        P = S_all[0]
    for n in range(N):
        torch.baddbmm(vc[n], kE[n], P, alpha=-1, out=r)
        torch.bmm(A_inv[n], r, out=v_new)
        torch.bmm(qE[n], P, out=o[n]).baddbmm_(A_qk[n], v_new)
        if pre is None:
            S_next = P.baddbmm_(kT[n], v_new)
            if return_chunk_states:
                S_all[n + 1].copy_(S_next)
            if n + 1 < N:
                P = torch.mul(S_next, post[n + 1], out=work[n % 2])
        else:
            S_next = S_all[n + 1] if return_chunk_states else S_all[1 - n % 2]
            torch.mul(P, pre[n], out=S_next).baddbmm_(kT[n], v_new)
            if post is None:
                P = S_next
            elif n + 1 < N:
                P = torch.mul(S_next, post[n + 1], out=work[n % 2])
    o = o.view(N, B, H, C, V)
    torch.mul(o, _chunks(fq, N, C) if isinstance(fq, torch.Tensor) else fq, out=_chunks(out, N, C))
    S = S_next.view(B, H, K, V)
    if not return_chunk_states:
        return (S,)
    return S, S_all[:N].view(N, B, H, K, V).permute(1, 2, 0, 3, 4)  # [B, H, N, K, V]


def _chunk_fwd_grouped(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, state, chunk_size, chunk_states=None):
    """Chunked KDA over raw inputs [B, T, H, .] (any T: the last group is zero-padded to whole chunks, which leaves
    the state untouched), GROUP_TOKENS at a time with the state carried across groups. Returns o [B, T, H, V] and
    the final state. Every group is batched over its chunks and heads; the grouping only keeps the working set
    (about 20 tensors of GROUP_TOKENS x H x 128 fp32) in cache: at T=4096, H=4, K=V=128 on one CPU thread,
    groups of 512 tokens took 118 ms (median; 75 ms best) against 181 ms (136 ms) for all 64 chunks at once,
    256 and 1024 about as well as 512 (measured interleaved in one process, loaded machine; again
    with the anchored form: 128 to 1024 within noise of each other, 58-64 ms best).
    `chunk_states` (a list) receives the state entering every chunk, [B, H, N_group, K, V] a group."""
    B, T, H, _ = q.shape
    V, C = v.shape[-1], chunk_size
    grad = records_autograd(q, k, v, g, beta, state)
    T_pad = T + (-T % C)
    out = None if grad else v.new_empty(B, T_pad, H, V, dtype=state.dtype)
    outs, t0 = [], 0
    # split, not slices: the backward of each slice fills a zero tensor of the whole input
    for xs in zip(*(x.split(GROUP_TOKENS, dim=1) for x in (q, k, v, g, beta))):
        pad = -xs[0].shape[1] % C
        if pad:
            xs = [F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in xs]
        # the chunk states are dropped at once unless asked for: held over the next group they keep the
        # allocator from reusing their buffer, which cost the common call 5-8% (T = 1024-4096, H = 4, K = V = 128)
        Tg = xs[0].shape[1]
        if grad:
            o, state, *S = _chunk_fwd(*xs, scale, use_qk_l2norm_in_kernel, state, C, chunk_states is not None)
            outs.append(o.permute(1, 0, 3, 2, 4))  # [B, N, C, H, V]
        else:
            state, *S = _chunk_fwd_nograd(*xs, scale, use_qk_l2norm_in_kernel, state, C, out[:, t0 : t0 + Tg],
                                          chunk_states is not None)
        t0 += Tg
        if S:
            chunk_states.append(S[0])
    if grad:
        out = torch.cat(outs, dim=1).flatten(1, 2) if len(outs) > 1 else outs[0].reshape(B, T_pad, H, V)
    return (out if T == T_pad else out[:, :T]), state


def _varlen_buckets(spans: list[tuple[int, int]], chunk_size: int) -> dict[int, list[int]]:
    """Sequence indices by padded length: whole chunks, rounded up to a power of two of them. Each bucket runs as one
    batch, so a sequence is padded to at most twice its chunk count and there are at most log2(T / chunk) + 1
    batches, where one batch padded to the longest sequence could compute N x the tokens."""
    buckets: dict[int, list[int]] = {}
    for i, (b, e) in enumerate(spans):
        n_chunks = max(1, -(-(e - b) // chunk_size))
        buckets.setdefault(chunk_size << (n_chunks - 1).bit_length(), []).append(i)
    return buckets


def _chunk_varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                  chunk_states=None):
    """Packed sequences ([1, T, ...], offsets cu_seqlens) through _chunk_fwd_grouped: each bucket of
    `_varlen_buckets` is gathered into a [n, L, ...] batch with one index per input (padding reads an appended
    zero token: k = v = g = beta = 0 leaves the state untouched, so final states are exact) and the outputs
    return to packed order with one index: a few index ops forward and backward, whatever the number of
    sequences (slicing each sequence out costs one full-size zero fill per sequence in the backward).
    `chunk_states` (a list) receives the states entering every chunk, [1, NT, H, K, V] in sequence order."""
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[-1]
    spans = _split_varlen(cu_seqlens)
    padded = [torch.cat((x[0], x.new_zeros(1, *x.shape[2:]))) for x in (q, k, v, g, beta)]  # row T = zero token
    cdtype = compute_dtype(v.dtype)
    if initial_state is None:
        initial_state = q.new_zeros(len(spans), H, K, V, dtype=cdtype)
    src = torch.empty(T, dtype=torch.long)  # packed token -> its row in the concatenated bucket outputs
    outs, states, order, offset = [], [], [], 0
    per_seq = {}  # sequence -> its chunk states [n_chunks, H, K, V]
    for L, members in _varlen_buckets(spans, chunk_size).items():
        idx = torch.full((len(members), L), T, dtype=torch.long)
        for r, i in enumerate(members):
            b, e = spans[i]
            idx[r, : e - b] = torch.arange(b, e)
            src[b:e] = torch.arange(offset + r * L, offset + r * L + e - b)
        idx = idx.to(q.device)
        xs = [x[idx] for x in padded]
        seen = [] if chunk_states is not None else None
        o, state = _chunk_fwd_grouped(*xs, scale, use_qk_l2norm_in_kernel, initial_state[members].to(cdtype),
                                      chunk_size, seen)
        if seen is not None:
            S = torch.cat(seen, dim=2)  # [n, H, L / C, K, V]
            for r, i in enumerate(members):
                per_seq[i] = S[r, :, : -(-(spans[i][1] - spans[i][0]) // chunk_size)].transpose(0, 1)
        outs.append(o.reshape(-1, H, V))
        states.append(state)
        order.extend(members)
        offset += len(members) * L
    o = torch.cat(outs)[src.to(q.device)].unsqueeze(0)
    state = torch.cat(states)[torch.argsort(torch.tensor(order, device=q.device))]
    if chunk_states is not None:
        chunk_states.append(torch.cat([per_seq[i] for i in range(len(spans))]).unsqueeze(0))
    return o, state


def _token_major(x):
    """x [B, T, H, D] as a contiguous tensor when its token dimension is the dense one (channels-first, the layout
    a conv1d output leaves q, k and v in), through one 2-D transpose per sequence; other layouts unchanged. Every
    read of that layout along D touches one cache line per element: at T = 4096, H = 4, D = 64 on one thread the
    l2 norm over D took 3.5 ms against 0.1 ms contiguous, the chunk-major copy 2.1 ms against 0.1, and the
    transpose costs 0.6 ms (a 4-D .contiguous() 2.0 ms)."""
    B, T, H, D = x.shape
    if x.is_contiguous() or not (x.stride(1) == 1 and x.stride(3) == T and x.stride(2) == D * T):
        return x
    rows = [xb.flatten(1).contiguous().view(T, H, D) for xb in x.unbind()]  # [T, H * D] <- its transpose
    return rows[0].unsqueeze(0) if B == 1 else torch.stack(rows)


def chunk_kda_torch(
    q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=CHUNK_SIZE, return_intermediate_states=False,
):
    """Chunked KDA in plain PyTorch, differentiable through autograd. Exact to fp32 rounding.

    Varlen (`cu_seqlens`) packs run as zero-padded batches of similar length (`_chunk_varlen`). With
    `return_intermediate_states` a third output holds the state entering every chunk, [B, NT, H, K, V] in the
    state dtype (varlen: B = 1, the chunks of all sequences in order).
    """
    dtype = v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = (_token_major(x) for x in (q, k, v, g))
    seen = [] if return_intermediate_states else None
    chunk_size = chunk_size if return_intermediate_states else min(chunk_size, COMPUTE_CHUNK)
    if cu_seqlens is not None:
        o, state = _chunk_varlen(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                 chunk_size, seen)
        o = o.to(dtype)
        final = state if output_final_state else None
        return (o, final) if seen is None else (o, final, seen[0])

    cdtype = compute_dtype(dtype)
    state = q.new_zeros(B, H, K, V, dtype=cdtype) if initial_state is None else initial_state.to(cdtype)
    o, state = _chunk_fwd_grouped(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, state, chunk_size, seen)
    o, final = o.to(dtype), (state if output_final_state else None)
    if seen is None:
        return o, final
    return o, final, torch.cat(seen, dim=2).transpose(1, 2)  # [B, NT, H, K, V]
