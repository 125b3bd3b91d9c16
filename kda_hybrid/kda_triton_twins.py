"""Plain-PyTorch twins of the Triton KDA pipeline's stages, one per kernel launcher, same signatures and
outputs (docs/architecture.md §1, §9):

    Triton launcher (kda_triton_fwd / _bwd)        twin here
    gate_cumsum_fwd(g, layout)                     gate_cumsum_ref
    gated_products_fwd(q, k, G, beta, scale, ly)   gated_products_ref
    wy_solve_fwd(k, v, G, beta, Akk, ly)           wy_solve_ref
    state_scan_fwd(k, w, u, G, h0, final, ly)      state_scan_ref
    output_fwd(q, G, Aqk, h, v_new, scale, ly, dt) output_ref
    _state_scan_bwd(q, k, w, G, Aqk, do, dht, ...)  state_scan_bwd_ref
    _chunk_bwd(q, k, v, G, beta, h, dh, ...)        chunk_bwd_ref
    _gated_products_bwd(q, k, g, G, beta, ...)      gated_products_bwd_ref (functional: returns new tensors,
                                                    where the launcher updates dq, dk, dbeta, dG in place)

Each twin loops over the chunks of `layout` (a kda_triton_runtime.ChunkLayout: cu_seqlens [N + 1], chunk_indices
[NC, 2] = (sequence, chunk), ...; its dot_precision is ignored, the twins are fp32) in Python and computes
one chunk (all value heads at once) the direct way: exp(G_r - G_c) from the exact differences (no
anchoring), inverses with torch.linalg, gradients of the gated products by autograd. Slow and simple on
purpose: they are the oracles the kernels are tested against stage by stage, so a wrong result on a new GPU
points at one kernel. Layouts as the kernels: q, k [B, T, H, K]; g, G [B, T, HV, K]; v [B, T, HV, V]; beta
[B, T, HV]; per-row chunk matrices [B, T, HV, BT]; states [NC or N, HV, K, V]; all fp32. This module never
imports triton.
"""

from __future__ import annotations

import torch

GATE_FLOOR = -110.0  # as kda_triton_fwd.GATE_FLOOR_VALUE: exp(-110) = 0 in fp32, a g = -inf reset stays finite


def _chunks(layout):
    """(row slice into the flattened B*T tokens, sequence index, global chunk index) for every chunk."""
    bounds = layout.cu_seqlens.tolist()
    for i_c, (i_n, i_t) in enumerate(layout.chunk_indices.tolist()):
        bos, eos = bounds[i_n], bounds[i_n + 1]
        s = bos + i_t * layout.chunk_size
        yield slice(s, min(s + layout.chunk_size, eos)), i_n, i_c


def _rows(x, sl, HV=None):
    """Rows `sl` of the flattened tokens of x [B, T, heads, D] as fp32 [HV, n, D]; q/k heads repeated to HV
    (the kernels index them, the twin just expands)."""
    x = x.flatten(0, 1)[sl].float()
    if HV is not None and x.shape[1] != HV:
        x = x.repeat_interleave(HV // x.shape[1], dim=1)
    return x.transpose(0, 1)


def _put(out, sl, x):
    """Write [HV, n, D] back into rows `sl` of out [B, T, HV, D']; columns past D are set to 0."""
    flat = out.view(-1, *out.shape[2:])
    flat[sl] = 0
    flat[sl, :, : x.shape[-1]] = x.transpose(0, 1).to(out.dtype)


def _exp_diff(G, lower_eq):
    """E[h, r, c, k] = exp(G_r - G_c) where c < r (c <= r with lower_eq), else 0. G: [HV, n, K]."""
    n = G.shape[1]
    keep = torch.ones(n, n, dtype=torch.bool, device=G.device).tril(0 if lower_eq else -1)
    D = G[:, :, None, :] - G[:, None, :, :]
    return torch.exp(torch.where(keep[None, :, :, None], D, float("-inf")))


# --------------------------------------------------------------------------------------------------
# Forward stages
# --------------------------------------------------------------------------------------------------


def gate_cumsum_ref(g, layout):
    """G [B, T, HV, K] fp32: within-chunk cumsum of max(g, GATE_FLOOR)."""
    G = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
    for sl, _, _ in _chunks(layout):
        _put(G, sl, _rows(g, sl).clamp_min(GATE_FLOOR).cumsum(1))
    return G


def _gated_products_chunk(q, k, G, beta, scale):
    """A_kk [HV, n, n] strict lower, A_qk lower; q, k, G [HV, n, K]; beta [HV, n]."""
    Akk = torch.einsum("hrk,hck,hrck->hrc", k, k, _exp_diff(G, False)) * beta[:, :, None]
    Aqk = torch.einsum("hrk,hck,hrck->hrc", q * scale, k, _exp_diff(G, True))
    return Akk, Aqk


def gated_products_ref(q, k, G, beta, scale, layout):
    """(A_kk, A_qk) [B, T, HV, BT]: A_kk[r, c] = beta_r sum_d k_r k_c exp(G_r - G_c) for c < r, A_qk[r, c] =
    scale sum_d q_r k_c exp(G_r - G_c) for c <= r, 0 elsewhere."""
    B, T, HV, _ = G.shape
    Akk = torch.zeros(B, T, HV, layout.chunk_size, device=G.device)
    Aqk = torch.zeros(B, T, HV, layout.chunk_size, device=G.device)
    for sl, _, _ in _chunks(layout):
        a_kk, a_qk = _gated_products_chunk(_rows(q, sl, HV), _rows(k, sl, HV), _rows(G, sl),
                                           _rows(beta[..., None], sl)[..., 0], scale)
        _put(Akk, sl, a_kk)
        _put(Aqk, sl, a_qk)
    return Akk, Aqk


def wy_solve_ref(k, v, G, beta, Akk, layout):
    """(Ai = (I + strict_lower(A_kk))^-1 [B, T, HV, BT], w = Ai (beta k exp G) [B, T, HV, K],
    u = Ai (beta v) [B, T, HV, V])."""
    B, T, HV, K = G.shape
    Ai = torch.zeros(B, T, HV, layout.chunk_size, device=G.device)
    w = torch.zeros(B, T, HV, K, device=G.device)
    u = torch.zeros(*v.shape, device=G.device)
    for sl, _, _ in _chunks(layout):
        n = sl.stop - sl.start
        A = _rows(Akk, sl)[..., :n].tril(-1)
        eye = torch.eye(n, device=G.device).expand_as(A)
        ai = torch.linalg.solve_triangular(eye + A, eye, upper=False)
        b = _rows(beta[..., None], sl)
        _put(Ai, sl, ai)
        _put(w, sl, ai @ (b * _rows(k, sl, HV) * _rows(G, sl).exp()))
        _put(u, sl, ai @ (b * _rows(v, sl)))
    return Ai, w, u


def state_scan_ref(k, w, u, G, initial_state, output_final_state, layout):
    """(h [NC, HV, K, V] the state entering each chunk, v_new = u - w S [B, T, HV, V], final state or None)."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, HV, K = G.shape
    V = u.shape[-1]
    N = cu.numel() - 1
    h = torch.zeros(chunk_indices.shape[0], HV, K, V, device=G.device)
    v_new = torch.zeros(B, T, HV, V, device=G.device)
    states = [torch.zeros(HV, K, V, device=G.device) if initial_state is None else initial_state[n].float()
              for n in range(N)]
    for sl, i_n, i_c in _chunks(layout):  # chunks of a sequence come in order
        S = states[i_n]
        h[i_c] = S
        vn = _rows(u, sl) - _rows(w, sl) @ S
        _put(v_new, sl, vn)
        g_c = _rows(G, sl)
        g_last = g_c[:, -1:, :]  # [HV, 1, K]
        kd = _rows(k, sl, HV) * torch.exp(g_last - g_c)
        states[i_n] = g_last.exp().transpose(1, 2) * S + kd.transpose(1, 2) @ vn
    return h, v_new, (torch.stack(states) if output_final_state else None)


def output_ref(q, G, Aqk, h, v_new, scale, layout, dtype):
    """o = (scale q exp G) S + tril(A_qk) v_new [B, T, HV, V] in `dtype`."""
    B, T, HV, _ = G.shape
    o = torch.zeros(B, T, HV, v_new.shape[-1], device=G.device, dtype=dtype)
    for sl, _, i_c in _chunks(layout):
        n = sl.stop - sl.start
        qg = _rows(q, sl, HV) * scale * _rows(G, sl).exp()
        _put(o, sl, qg @ h[i_c] + _rows(Aqk, sl)[..., :n].tril() @ _rows(v_new, sl))
    return o


# --------------------------------------------------------------------------------------------------
# Backward stages
# --------------------------------------------------------------------------------------------------


def state_scan_bwd_ref(q, k, w, G, Aqk, do, dht, scale, layout, need_dh0):
    """(dh [NC, HV, K, V] gradient of the state leaving each chunk, dv_new [B, T, HV, V], dh0 or None):
    dv_new = A_qk^T do + kd dS', dS = exp(G_last) dS' + qg^T do - w^T dv_new, in reverse chunk order."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, HV, K = G.shape
    V = do.shape[-1]
    N = cu.numel() - 1
    dh = torch.zeros(chunk_indices.shape[0], HV, K, V, device=G.device)
    dv_new = torch.zeros(B, T, HV, V, device=G.device)
    grads = [torch.zeros(HV, K, V, device=G.device) if dht is None else dht[n].float() for n in range(N)]
    for sl, i_n, i_c in reversed(list(_chunks(layout))):
        n = sl.stop - sl.start
        dS = grads[i_n]
        dh[i_c] = dS
        g_c = _rows(G, sl)
        g_last = g_c[:, -1:, :]
        kd = _rows(k, sl, HV) * torch.exp(g_last - g_c)
        qg = _rows(q, sl, HV) * scale * g_c.exp()
        d_o = _rows(do, sl)
        dvn = _rows(Aqk, sl)[..., :n].tril().transpose(1, 2) @ d_o + kd @ dS
        _put(dv_new, sl, dvn)
        grads[i_n] = (g_last.exp().transpose(1, 2) * dS + qg.transpose(1, 2) @ d_o
                      - _rows(w, sl).transpose(1, 2) @ dvn)
    return dh, dv_new, (torch.stack(grads) if need_dh0 else None)


def chunk_bwd_ref(q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, scale, layout):
    """(dq, dk [B, T, HV, K] per value head, dv in v's dtype, dbeta, dG, dA_qk, dA_kk [B, T, HV, BT]): the
    gradients that go through S, w, u, Ai and exp(G) but not through A_kk, A_qk; dA_qk = do v_new^T and
    dA_kk = -Ai^T dAi Ai^T as whole rows (columns past the chunk's end 0)."""
    B, T, HV, K = G.shape
    f32 = dict(device=G.device, dtype=torch.float32)
    dq, dk, dG = (torch.zeros(B, T, HV, K, **f32) for _ in range(3))
    dbeta = torch.zeros(B, T, HV, **f32)
    dv = torch.zeros(v.shape, device=G.device, dtype=v.dtype)
    dAqk = torch.zeros(B, T, HV, layout.chunk_size, **f32)
    dAkk = torch.zeros(B, T, HV, layout.chunk_size, **f32)
    for sl, _, i_c in _chunks(layout):
        n = sl.stop - sl.start
        S, dS = h[i_c], dh[i_c]
        g_c = _rows(G, sl)
        g_last = g_c[:, -1:, :]
        k_c, q_c = _rows(k, sl, HV), _rows(q, sl, HV) * scale
        b = _rows(beta[..., None], sl)
        ai = _rows(Ai, sl)[..., :n]
        d_o, vn, dvn = _rows(do, sl), _rows(v_new, sl), _rows(dv_new, sl)
        eg, ed = g_c.exp(), torch.exp(g_last - g_c)
        dqg = d_o @ S.transpose(1, 2)
        dw = -dvn @ S.transpose(1, 2)
        dkd = vn @ dS.transpose(1, 2)
        dvb = ai.transpose(1, 2) @ dvn  # d(beta v)
        dkb = ai.transpose(1, 2) @ dw  # d(beta k exp G)
        d_ai = dw @ (b * k_c * eg).transpose(1, 2) + dvn @ (b * _rows(v, sl)).transpose(1, 2)
        _put(dAkk, sl, -ai.transpose(1, 2) @ d_ai @ ai.transpose(1, 2))
        _put(dAqk, sl, d_o @ vn.transpose(1, 2))
        _put(dv, sl, dvb * b)
        _put(dbeta[..., None], sl, (dvb * _rows(v, sl)).sum(-1, keepdim=True)
             + (k_c * eg * dkb).sum(-1, keepdim=True))
        _put(dq, sl, eg * dqg * scale)
        _put(dk, sl, b * eg * dkb + ed * dkd)
        # G_r enters exp(G_r) (in qg and kb) and exp(G_last - G_r) (kd); G_last also scales the state
        dg = b * k_c * eg * dkb + q_c * eg * dqg - k_c * ed * dkd
        dg[:, -1] += (g_last.exp()[:, 0] * (S * dS).sum(-1)) + (k_c * ed * dkd).sum(1)
        _put(dG, sl, dg)
    return dq, dk, dv, dbeta, dG, dAqk, dAkk


def gated_products_bwd_ref(q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, scale, layout):
    """(dq + d through A, dk + ..., dbeta + ..., dg): autograd of the direct gated products with upstream
    gradients the lower (A_qk) / strict lower (A_kk) triangles of dA, added to the inputs' dq, dk, dbeta, dG,
    then dg = reverse cumsum of dG within each chunk, 0 where g < GATE_FLOOR. New tensors (inputs untouched)."""
    HV = G.shape[2]
    dq, dk, dbeta, dg = dq.clone(), dk.clone(), dbeta.clone(), torch.zeros_like(dG)
    for sl, _, _ in _chunks(layout):
        n = sl.stop - sl.start
        xs = [_rows(q, sl, HV), _rows(k, sl, HV), _rows(G, sl), _rows(beta[..., None], sl)[..., 0]]
        xs = [x.detach().requires_grad_() for x in xs]
        with torch.enable_grad():
            a_kk, a_qk = _gated_products_chunk(*xs, scale)
            loss = ((a_kk * _rows(dAkk, sl)[..., :n].tril(-1)).sum()
                    + (a_qk * _rows(dAqk, sl)[..., :n].tril()).sum())
            d_q, d_k, d_G, d_b = torch.autograd.grad(loss, xs)
        _put(dq, sl, _rows(dq, sl) + d_q)
        _put(dk, sl, _rows(dk, sl) + d_k)
        _put(dbeta[..., None], sl, _rows(dbeta[..., None], sl) + d_b[..., None])
        total = _rows(dG, sl) + d_G
        d = total.flip(1).cumsum(1).flip(1)
        _put(dg, sl, torch.where(_rows(g, sl) < GATE_FLOOR, 0.0, d))
    return dq, dk, dbeta, dg
