"""Triton kernels for the Kimi Delta Attention chunked backward (the forward kernels and their launchers are in
`kda_triton_fwd`, the autograd Function in `kda_triton`, the stages' PyTorch twins in `kda_triton_twins`;
docs/architecture.md §1, §9).

`ChunkKDAFunction` saves G, A_qk, Ai = (I + A_kk)^-1, w, u from the forward; the backward is four stages:
  4. state scan (forward, rerun)  `kda_triton_fwd.state_scan_fwd`: the states entering every chunk and v_new
  6. reverse state scan           `_state_scan_bwd`: dh (gradient of each chunk's outgoing state), dv_new,
                                  dh0; the final-state gradient dht seeds it
  7. chunk gradients              `_chunk_bwd`: dv; dq, dk, dbeta, dG through S, w, u, Ai, exp(G); dA_qk, dA_kk
  8. gated products backward      `_gated_products_bwd`: back through A_kk, A_qk (anchored as in the forward),
                                  then dg = reverse cumsum of dG within the chunk (0 where g was floored)
With grouped value heads the kernels write dq, dk per value head; torch sums each group.
"""

from __future__ import annotations

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("kda_hybrid.kda_triton_bwd needs the triton package (GPU kernels)") from err

from .kda_triton_fwd import (
    CHUNK_BWD_BV,
    CHUNK_BWD_NUM_STAGES,
    CHUNK_BWD_NUM_WARPS,
    GATE_FLOOR,
    NEG_INF,
    STATE_BWD_NUM_STAGES,
    SUB_CHUNK,
    scan_block_v,
    state_scan_fwd,
)
from .kda_triton_runtime import LazyKernel, block

# --------------------------------------------------------------------------------------------------
# Kernels. Per chunk, with S the state entering it, dS' the gradient of the state leaving it and
# qg = scale q exp G, kd = k exp(G_last - G), kb = beta k exp G:
#   dv_new = A_qk^T do + kd dS'                  dS = exp(G_last) dS' + qg^T do - w^T dv_new   (reverse scan)
#   dqg = do S^T   dw = -dv_new S^T   dkd = v_new dS'^T   dA_qk = do v_new^T
#   dkb = Ai^T dw  dvb = Ai^T dv_new  dA_kk = -(dkb w^T + dvb u^T)   (= -Ai^T dAi Ai^T, strict lower part)
# then through the gated products A_kk, A_qk (intra kernel) and G = cumsum(g): dg = reverse cumsum of dG.
# q and k are read from head i_h // (HV // H) of the value head i_h each program serves.
# --------------------------------------------------------------------------------------------------


@LazyKernel
def _kda_state_bwd_kernel(
    q, k, w, G, Aqk, do, dht, dh0, dh, dv_new, cu_seqlens, chunk_offsets, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Reverse scan over the chunks of one (V block, sequence, head): store dh[chunk] = dS' (gradient of the
    state leaving the chunk) and dv_new, step dS' back through the chunk; dh0 is what enters the first."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hq = i_h // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    NT = tl.cdiv(L, BT)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_i = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        b_dh += tl.load(dht + (i_n * HV + i_h) * K * V + o_kv, mask=m_kv, other=0.0)
    for i_s in range(0, NT):
        i_t = NT - 1 - i_s
        tl.store(dh + ((c0 + i_t) * HV + i_h) * K * V + o_kv, b_dh, mask=m_kv)
        o_t = i_t * BT + o_i
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        o_tk = ((bos + o_t) * HV + i_h)[:, None] * K + o_k[None, :]
        o_tv = ((bos + o_t) * HV + i_h)[:, None] * V + o_v[None, :]
        i_last = tl.minimum(i_t * BT + BT, L) - 1
        b_gl = tl.load(G + ((bos + i_last) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
        o_tq = ((bos + o_t) * H + i_hq)[:, None] * K + o_k[None, :]
        b_kd = tl.load(k + o_tq, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(
            tl.where(m_tk, b_gl[None, :] - b_g, NEG_INF))  # exp(G_last - G) <= 1
        b_qg = tl.load(q + o_tq, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(
            tl.where(m_tk, b_g, NEG_INF)) * scale
        b_w = tl.load(w + o_tk, mask=m_tk, other=0.0)
        b_do = tl.load(do + o_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_A = tl.load(Aqk + ((bos + o_t) * HV + i_h)[:, None] * BT + o_i[None, :],
                      mask=m_t[:, None] & (o_i[:, None] >= o_i[None, :]), other=0.0)
        b_dvn = (tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
                 + tl.dot(b_kd, b_dh, input_precision=DOT_PREC))
        tl.store(dv_new + o_tv, b_dvn, mask=m_tv)
        b_dh = (b_dh * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
                - tl.dot(tl.trans(b_w), b_dvn, input_precision=DOT_PREC))
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_h) * K * V + o_kv, b_dh, mask=m_kv)


@LazyKernel
def _kda_chunk_bwd_kernel(
    q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, dq, dk, dv, dbeta, dG, dAqk, dAkk,
    cu_seqlens, chunk_indices, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Everything of one (chunk, head) that goes through the state, the WY inverse and the gates outside A:
    dv (final), and the parts of dq, dk, dbeta, dG (per token, before the cumsum) that do not come from
    A_kk, A_qk; plus dA_qk = do v_new^T and dA_kk for the intra kernel. V is looped in BV columns."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hq = i_h // (HV // H)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    o_k = tl.arange(0, BK)
    m_t = o_t < L
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    o_tk = ((bos + o_t) * HV + i_h)[:, None] * K + o_k[None, :]
    o_tA = ((bos + o_t) * HV + i_h)[:, None] * BT + o_i[None, :]
    o_hk = (i_c.to(tl.int64) * HV + i_h) * K * V + o_k[:, None] * V
    b_Ai = tl.load(Ai + o_tA, mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + (bos + o_t) * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dAq = tl.zeros([BT, BT], dtype=tl.float32)
    b_dAk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        o_tv = ((bos + o_t) * HV + i_h)[:, None] * V + o_v[None, :]
        b_h = tl.load(h + o_hk + o_v[None, :], mask=m_kv, other=0.0)
        b_dh = tl.load(dh + o_hk + o_v[None, :], mask=m_kv, other=0.0)
        b_do = tl.load(do + o_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn = tl.load(v_new + o_tv, mask=m_tv, other=0.0)
        b_dvn = tl.load(dv_new + o_tv, mask=m_tv, other=0.0)
        b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=DOT_PREC)
        b_dw -= tl.dot(b_dvn, tl.trans(b_h), input_precision=DOT_PREC)
        b_dkd += tl.dot(b_vn, tl.trans(b_dh), input_precision=DOT_PREC)
        b_dAq += tl.dot(b_do, tl.trans(b_vn), input_precision=DOT_PREC)
        b_dgl += tl.sum(b_h * b_dh, 1)
        b_dvb = tl.dot(tl.trans(b_Ai), b_dvn, input_precision=DOT_PREC)  # d(beta v)
        tl.store(dv + o_tv, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_v = tl.load(v + o_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dbeta += tl.sum(b_dvb * b_v, 1)
        b_u = tl.load(u + o_tv, mask=m_tv, other=0.0)
        b_dAk -= tl.dot(b_dvb, tl.trans(b_u), input_precision=DOT_PREC)
    b_dkb = tl.dot(tl.trans(b_Ai), b_dw, input_precision=DOT_PREC)  # d(beta k exp G)
    b_w = tl.load(w + o_tk, mask=m_tk, other=0.0)
    b_dAk -= tl.dot(b_dkb, tl.trans(b_w), input_precision=DOT_PREC)

    i_last = tl.minimum(i_t * BT + BT, L) - 1
    b_gl = tl.load(G + ((bos + i_last) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
    b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
    o_tq = ((bos + o_t) * H + i_hq)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + o_tq, mask=m_tk, other=0.0).to(tl.float32)
    b_q = tl.load(q + o_tq, mask=m_tk, other=0.0).to(tl.float32) * scale
    b_eg = tl.exp(tl.where(m_tk, b_g, NEG_INF))  # exp(G) <= 1
    b_ed = tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, NEG_INF))  # exp(G_last - G) <= 1
    b_kdkb = b_k * b_eg * b_dkb
    b_kddkd = b_k * b_ed * b_dkd
    b_dbeta += tl.sum(b_kdkb, 1)
    # kd_r = k_r exp(G_last - G_r) puts +x on G_last and -x on G_r; for the last row both are the same entry of
    # dG: left out, rather than added and cancelled (with strong decay that rounding would swamp a tiny dg)
    b_kddkd = tl.where((o_t != i_last)[:, None], b_kddkd, 0.0)
    b_dG = b_beta[:, None] * b_kdkb + b_q * b_eg * b_dqg - b_kddkd
    # G_last scales the carried state and every kd row; its gradient lands on the chunk's last valid row
    b_dgl = b_dgl * tl.exp(b_gl) + tl.sum(b_kddkd, 0)
    b_dG += tl.where((o_t == i_last)[:, None], b_dgl[None, :], 0.0)
    tl.store(dq + o_tk, b_eg * b_dqg * scale, mask=m_tk)
    tl.store(dk + o_tk, b_beta[:, None] * b_eg * b_dkb + b_ed * b_dkd, mask=m_tk)
    tl.store(dG + o_tk, b_dG, mask=m_tk)
    tl.store(dbeta + (bos + o_t) * HV + i_h, b_dbeta, mask=m_t)
    tl.store(dAqk + o_tA, b_dAq, mask=m_t[:, None])
    tl.store(dAkk + o_tA, b_dAk, mask=m_t[:, None])


@LazyKernel
def _kda_intra_bwd_kernel(
    q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, cu_seqlens, chunk_indices, scale,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Back through A_kk[r, c] = beta_r k_r.(k_c E_rc) and A_qk[r, c] = (scale q_r).(k_c E_rc), E_rc = exp(G_r - G_c),
    for one (chunk, head); adds to dq, dk, dbeta, dG in place and turns dG into dg (reverse cumsum in the chunk).
    Row side X_r = sum_c dA[r, c] k_c E_rc, column side Y_c = sum_r dA[r, c] x_r E_rc (x = beta k or scale q):
    off-diagonal sub-blocks anchored as in the forward (X at the first row of the row block, Y at the last row
    of the column block: both factors <= 1), diagonal sub-blocks column by column from exact differences."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hq = i_h // (HV // H)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    NB: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_lower = o_c[:, None] > o_c[None, :]
    m_lower_eq = o_c[:, None] >= o_c[None, :]
    b_carry = tl.zeros([BK], dtype=tl.float32)  # sum of dG over the rows after the current block
    for i_b in tl.static_range(NB):
        i_i = NB - 1 - i_b  # last row block first: the reverse cumsum runs from the chunk end
        o_r = i_t * BT + i_i * BC + o_c
        m_r = o_r < L
        m_rk = m_r[:, None] & m_k[None, :]
        o_rk = ((bos + o_r) * HV + i_h)[:, None] * K + o_k[None, :]
        o_rA = ((bos + o_r) * HV + i_h)[:, None] * BT
        o_rq = ((bos + o_r) * H + i_hq)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + o_rq, mask=m_rk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + o_rq, mask=m_rk, other=0.0).to(tl.float32)
        b_g = tl.load(G + o_rk, mask=m_rk, other=0.0)
        b_beta = tl.load(beta + (bos + o_r) * HV + i_h, mask=m_r, other=0.0).to(tl.float32)
        # anchors, clamped into the sequence (rows past the end are masked everywhere they are used)
        o_a = tl.minimum(i_t * BT + i_i * BC, L - 1)
        o_e = tl.minimum(i_t * BT + i_i * BC + BC - 1, L - 1)
        b_ga = tl.load(G + ((bos + o_a) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_ge = tl.load(G + ((bos + o_e) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_Xk = tl.zeros([BC, BK], dtype=tl.float32)
        b_Xq = tl.zeros([BC, BK], dtype=tl.float32)
        b_Y = tl.zeros([BC, BK], dtype=tl.float32)
        for i_j in tl.static_range(NB):
            o_s = i_t * BT + i_j * BC + o_c
            m_s = o_s < L
            m_sk = m_s[:, None] & m_k[None, :]
            o_sk = ((bos + o_s) * HV + i_h)[:, None] * K + o_k[None, :]
            o_sq = ((bos + o_s) * H + i_hq)[:, None] * K + o_k[None, :]
            if i_j < i_i:  # columns in block j, rows in block i
                b_ks = tl.load(k + o_sq, mask=m_sk, other=0.0).to(tl.float32)
                b_gs = tl.load(G + o_sk, mask=m_sk, other=0.0)
                b_kc = b_ks * tl.exp(tl.where(m_sk, b_ga[None, :] - b_gs, NEG_INF))  # exp(G_a - G_c) <= 1
                b_dAk = tl.load(dAkk + o_rA + (i_j * BC + o_c)[None, :], mask=m_r[:, None], other=0.0)
                b_dAq = tl.load(dAqk + o_rA + (i_j * BC + o_c)[None, :], mask=m_r[:, None], other=0.0)
                b_Xk += tl.dot(b_dAk, b_kc, input_precision=DOT_PREC)
                b_Xq += tl.dot(b_dAq, b_kc, input_precision=DOT_PREC)
            if i_j > i_i:  # rows in block j, columns in block i
                b_ks = tl.load(k + o_sq, mask=m_sk, other=0.0).to(tl.float32)
                b_qs = tl.load(q + o_sq, mask=m_sk, other=0.0).to(tl.float32) * scale
                b_gs = tl.load(G + o_sk, mask=m_sk, other=0.0)
                b_bs = tl.load(beta + (bos + o_s) * HV + i_h, mask=m_s, other=0.0).to(tl.float32)
                b_rs = tl.exp(tl.where(m_sk, b_gs - b_ge[None, :], NEG_INF))  # exp(G_r - G_e) <= 1
                o_sA = ((bos + o_s) * HV + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :]
                b_dAk = tl.load(dAkk + o_sA, mask=m_s[:, None], other=0.0)
                b_dAq = tl.load(dAqk + o_sA, mask=m_s[:, None], other=0.0)
                b_Y += tl.dot(tl.trans(b_dAk), b_ks * b_rs * b_bs[:, None], input_precision=DOT_PREC)
                b_Y += tl.dot(tl.trans(b_dAq), b_qs * b_rs, input_precision=DOT_PREC)
        b_Xk *= tl.exp(tl.where(m_rk, b_g - b_ga[None, :], NEG_INF))  # exp(G_r - G_a) <= 1
        b_Xq *= tl.exp(tl.where(m_rk, b_g - b_ga[None, :], NEG_INF))
        b_Y *= tl.exp(tl.where(m_rk, b_ge[None, :] - b_g, NEG_INF))  # exp(G_e - G_c) <= 1
        # diagonal sub-block, one column j at a time (E[r, j] for r > j from exact differences). The diagonal of
        # A_qk (E_rr = 1) does not depend on G: it goes to dq and dk only, so dG never holds its +x - x
        b_dAk = tl.load(dAkk + o_rA + (i_i * BC + o_c)[None, :], mask=m_r[:, None] & m_lower, other=0.0)
        b_dAq = tl.load(dAqk + o_rA + (i_i * BC + o_c)[None, :], mask=m_r[:, None] & m_lower_eq, other=0.0)
        b_dAq_rr = tl.sum(tl.where(m_lower_eq & ~m_lower, b_dAq, 0.0), 1)  # dA_qk[r, r]
        b_dAq = tl.where(m_lower, b_dAq, 0.0)
        b_bk = b_beta[:, None] * b_k
        for j in range(BC):
            o_j = tl.minimum(i_t * BT + i_i * BC + j, L - 1)  # a column past the end meets only masked rows
            o_jk = ((bos + o_j) * HV + i_h) * K + o_k
            b_kj = tl.load(k + ((bos + o_j) * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_gj = tl.load(G + o_jk, mask=m_k, other=0.0)
            b_e = tl.exp(tl.where((o_c >= j)[:, None] & m_rk, b_g - b_gj[None, :], NEG_INF))
            m_col = (o_c == j)[None, :]
            b_ak = tl.sum(tl.where(m_col, b_dAk, 0.0), 1)[:, None] * b_e  # dA_kk[r, j] E_rj
            b_aq = tl.sum(tl.where(m_col, b_dAq, 0.0), 1)[:, None] * b_e
            b_Xk += b_ak * b_kj[None, :]
            b_Xq += b_aq * b_kj[None, :]
            b_yj = tl.sum(b_ak * b_bk + b_aq * b_q, 0)
            b_Y = tl.where((o_c == j)[:, None], b_Y + b_yj[None, :], b_Y)
        b_dq = tl.load(dq + o_rk, mask=m_rk, other=0.0) + (b_Xq + b_dAq_rr[:, None] * b_k) * scale
        b_dk = tl.load(dk + o_rk, mask=m_rk, other=0.0) + b_beta[:, None] * b_Xk + b_Y + b_dAq_rr[:, None] * b_q
        b_db = tl.load(dbeta + (bos + o_r) * HV + i_h, mask=m_r, other=0.0) + tl.sum(b_k * b_Xk, 1)
        b_dG = tl.load(dG + o_rk, mask=m_rk, other=0.0) + b_bk * b_Xk + b_q * b_Xq - b_k * b_Y
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + b_carry[None, :]
        b_carry += tl.sum(b_dG, 0)
        # a gate at the floor (g = -inf, a reset) has gradient 0, as exp(-inf) * x has; the cumsum holds only
        # the rounding of terms that cancel there
        b_graw = tl.load(g + o_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_dg = tl.where(b_graw < GATE_FLOOR, 0.0, b_dg)
        tl.store(dq + o_rk, b_dq, mask=m_rk)
        tl.store(dk + o_rk, b_dk, mask=m_rk)
        tl.store(dbeta + (bos + o_r) * HV + i_h, b_db, mask=m_r)
        tl.store(dG + o_rk, b_dg, mask=m_rk)


# --------------------------------------------------------------------------------------------------
# Launchers: one per kernel (twins: kda_triton_twins.<stage>_ref, same signatures), then the whole backward.
# --------------------------------------------------------------------------------------------------


def _state_scan_bwd(q, k, w, G, Aqk, do, dht, scale, layout, need_dh0):
    """Stage 6: dh [NC, HV, K, V] (gradient of the state leaving each chunk), dv_new [B, T, HV, V] and dh0
    [N, HV, K, V] (None unless need_dh0), fp32. dht (or None) is the gradient of the final state."""
    cu, chunk_indices, chunk_offsets = layout[:3]
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    N, NC = cu.numel() - 1, chunk_indices.shape[0]
    BK = block(K)
    BVS = scan_block_v(BK, block(V))
    f32 = dict(device=q.device, dtype=torch.float32)
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    dh = torch.empty(NC, HV, K, V, **f32)
    dv_new = torch.empty(B, T, HV, V, **f32)
    dh0 = torch.empty(N, HV, K, V, **f32) if need_dh0 else None
    _kda_state_bwd_kernel[(triton.cdiv(V, BVS), N, HV)](
        q, k, w, G, Aqk, do, dht if dht is not None else dh, dh0 if dh0 is not None else dh, dh, dv_new,
        cu, chunk_offsets, scale, H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BVS, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, DOT_PREC=layout.dot_precision, num_warps=4, num_stages=STATE_BWD_NUM_STAGES)
    return dh, dv_new, dh0


def _chunk_bwd(q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, scale, layout):
    """Stage 7: (dq, dk [B, T, HV, K] per value head, dv in v's dtype, dbeta [B, T, HV], dG [B, T, HV, K] per
    token before the cumsum, dA_qk, dA_kk [B, T, HV, BT]), the parts that do not go through A_kk, A_qk; fp32
    but dv. dA_qk and dA_kk are whole rows: the next stage reads their lower (A_qk) / strict lower (A_kk)
    triangles only."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    f32 = dict(device=q.device, dtype=torch.float32)
    dq = torch.empty(B, T, HV, K, **f32)
    dk = torch.empty(B, T, HV, K, **f32)
    dG = torch.empty(B, T, HV, K, **f32)
    dbeta = torch.empty(B, T, HV, **f32)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, HV, layout.chunk_size, **f32)
    dAkk = torch.empty(B, T, HV, layout.chunk_size, **f32)
    _kda_chunk_bwd_kernel[(chunk_indices.shape[0], HV)](
        q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do.contiguous(), dq, dk, dv, dbeta, dG, dAqk, dAkk,
        cu, chunk_indices, scale, H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=block(K),
        BV=min(block(V), CHUNK_BWD_BV), DOT_PREC=layout.dot_precision, num_warps=CHUNK_BWD_NUM_WARPS,
        num_stages=CHUNK_BWD_NUM_STAGES)
    return dq, dk, dv, dbeta, dG, dAqk, dAkk


def _gated_products_bwd(q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, scale, layout):
    """Stage 8: adds the gradients through A_kk, A_qk to dq, dk, dbeta, dG IN PLACE and turns dG into dg (the
    reverse cumsum within each chunk; 0 where g < GATE_FLOOR). Returns (dq, dk, dbeta, dg), the same tensors."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, H, K = q.shape
    HV = G.shape[2]
    _kda_intra_bwd_kernel[(chunk_indices.shape[0], HV)](
        q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, cu, chunk_indices, scale, H=H, HV=HV, K=K,
        BT=layout.chunk_size, BC=SUB_CHUNK, BK=block(K), DOT_PREC=layout.dot_precision)
    return dq, dk, dbeta, dG


def chunk_kda_bwd(q, k, v, g, beta, scale, initial_state, layout, saved, do, dht, need_dh0):
    """Chunked backward: recompute h and v_new (one forward scan), reverse scan for dh, then the per-chunk
    stages. Returns dq, dk, dv, dg, dbeta in their inputs' dtypes and dh0 (fp32, None unless need_dh0)."""
    G, Aqk, Ai, w, u = saved
    B, T, H, K = q.shape
    HV = v.shape[2]
    h, v_new, _ = state_scan_fwd(k, w, u, G, initial_state, False, layout)
    dh, dv_new, dh0 = _state_scan_bwd(q, k, w, G, Aqk, do, dht, scale, layout, need_dh0)
    dq, dk, dv, dbeta, dG, dAqk, dAkk = _chunk_bwd(q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, scale,
                                                   layout)
    dq, dk, dbeta, dg = _gated_products_bwd(q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, scale, layout)
    if HV != H:  # each q/k head served HV // H value heads
        dq, dk = (x.view(B, T, H, HV // H, K).sum(3) for x in (dq, dk))
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg, dbeta, dh0
