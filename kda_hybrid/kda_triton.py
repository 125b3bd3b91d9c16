"""Triton kernels for Kimi Delta Attention: the chunked form (prefill, training) and a fused recurrent
decode step. The exact PyTorch twins are `kda_torch.chunk_kda_torch` / `kda_torch.recurrent_kda_reference`;
the chunked kernels mirror `kda_torch._chunk_fwd` step by step (DESIGN.md §1).

Layout: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; states [N, H, K, V] fp32. Batched inputs are
viewed as one packed sequence of B*T tokens with B equal-length segments, so every chunk kernel has a
single (varlen) code path: a chunk never crosses a sequence boundary.

Chunked forward, per chunk of BT = 64 tokens and head (one kernel each):
  1. `_kda_gate_cumsum_kernel`  G = within-chunk cumulative sum of g (fp32)
  2. `_kda_intra_fwd_kernel`    A_kk = strict lower beta_r k_r.k_c exp(G_r - G_c), A_qk = lower scale q_r.k_c ...
  3. `_kda_solve_wu_kernel`     (I + A_kk)^-1 by 16x16 blocks, w = Ai (beta k exp G), u = Ai (beta v)
  4. `_kda_state_scan_kernel`   sequential over chunks: v_new = u - w S, S = exp(G_last) S + (k exp(G_last - G))^T v_new
  5. `_kda_output_kernel`       o = (scale q exp G) S + A_qk v_new
Decode: `_kda_fused_recurrent_kernel` loops over the tokens of a sequence with the state in registers.

Overflow: every exponent evaluated is <= 0 (up to rounding). exp(G_r - G_c) for an off-diagonal 16x16 sub-block
is split at the first row a of the row sub-block as exp(G_r - G_a) * exp(G_a - G_c), both factors <= 1
because c < a <= r and G is non-increasing; diagonal sub-blocks are formed column by column from the exact
differences. With g = -20 per token G reaches -1280 in a chunk; products that underflow to 0 are < 1e-38.

Gradients: `ChunkKDAFunction.backward` recomputes the forward with the differentiable PyTorch twin
(`chunk_kda_torch`) and back-propagates through it; there is no Triton backward kernel yet.
`fused_recurrent_kda_triton` has no backward: when a gradient is needed it calls the chunked function.

Kernels are wrapped with `triton.jit` at their first launch, not at import: triton decides between the
compiler and the interpreter (TRITON_INTERPRET=1, CPU tests) when the decorator runs, and this module is
often imported (by `kda_ops`) before a test sets the variable. The head count H is a runtime argument (one
compilation serves every H); head dims, tile sizes and flags are compile-time constants.
"""

from __future__ import annotations

import os

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("kda_hybrid.kda_triton needs the triton package (GPU kernels); the PyTorch path does not") from err

from .kda_torch import L2NORM_EPS, chunk_kda_torch, l2norm

CHUNK_SIZE = 64  # tokens per chunk (BT), as kda_torch.CHUNK_SIZE
SUB_CHUNK = 16  # BC: side of the sub-blocks of A; 16 is the smallest tl.dot tile
MAX_HEAD_DIM = 256  # K and V are held whole in one register tile
# The scan's loop loads ~100 KB of tiles per chunk at K = V = 128 in fp32: triton's default 3-stage pipeline
# needs 247 KB of shared memory (over sm_90's 227 KB); 2 stages need 140 KB (compiled for sm_90 with ptxas).
SCAN_NUM_STAGES = 2
# masked exponents are set to -inf before exp (exp(-inf) = 0): the discarded lanes never hold inf
NEG_INF = tl.constexpr(float("-inf"))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _LazyKernel:
    """`triton.jit` applied at first launch, once per mode (compiled / interpreted)."""

    def __init__(self, fn):
        self.fn = fn
        self._jitted = {}

    def __getitem__(self, grid):
        mode = _interpreted()
        kernel = self._jitted.get(mode)
        if kernel is None:
            kernel = self._jitted[mode] = triton.jit(self.fn)
        return kernel[grid]


# --------------------------------------------------------------------------------------------------
# Kernels. Chunk kernels: program (i_c, i_h) = (global chunk, head); chunk_indices[i_c] = (sequence, chunk in
# sequence); rows of a chunk past the end of its sequence are masked (they belong to the next sequence).
# --------------------------------------------------------------------------------------------------


def _kda_gate_cumsum_kernel(
    g, G, cu_seqlens, chunk_indices,
    H, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_tk = (o_t < eos - bos)[:, None] & (o_k < K)[None, :]
    o_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.load(g + o_tk, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(G + o_tk, tl.cumsum(b_g, axis=0), mask=m_tk)


def _kda_intra_fwd_kernel(
    q, k, G, beta, Akk, Aqk, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """A_kk[r, c] = beta_r sum_d k_r k_c exp(G_r - G_c) (c < r) and A_qk[r, c] = scale sum_d q_r k_c exp(...)
    (c <= r), stored row-major [T, H, BT] per chunk; only sub-blocks on or below the diagonal are written."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_lower = o_c[:, None] > o_c[None, :]
    m_lower_eq = o_c[:, None] >= o_c[None, :]
    for i_i in tl.static_range(BT // BC):
        o_r = i_t * BT + i_i * BC + o_c
        m_r = o_r < L
        m_rk = m_r[:, None] & m_k[None, :]
        o_rk = ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + o_rk, mask=m_rk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + o_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_g = tl.load(G + o_rk, mask=m_rk, other=0.0)
        b_beta = tl.load(beta + (bos + o_r) * H + i_h, mask=m_r, other=0.0).to(tl.float32)
        o_rA = ((bos + o_r) * H + i_h)[:, None] * BT
        # anchor: the first row of this row sub-block (clamped into the sequence: if it lies past the end, so
        # do all the rows, and nothing computed from it is stored)
        o_a = tl.minimum(i_t * BT + i_i * BC, L - 1)
        b_ga = tl.load(G + ((bos + o_a) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_rf = tl.exp(tl.where(m_rk, b_g - b_ga[None, :], NEG_INF))  # exp(G_r - G_a) <= 1
        b_qa = b_q * b_rf
        b_ka = b_k * b_rf * b_beta[:, None]
        for i_j in tl.static_range(BT // BC):
            if i_j < i_i:
                o_s = i_t * BT + i_j * BC + o_c
                m_sk = (o_s < L)[:, None] & m_k[None, :]
                o_sk = ((bos + o_s) * H + i_h)[:, None] * K + o_k[None, :]
                b_ks = tl.load(k + o_sk, mask=m_sk, other=0.0).to(tl.float32)
                b_gs = tl.load(G + o_sk, mask=m_sk, other=0.0)
                b_cf = tl.trans(b_ks * tl.exp(tl.where(m_sk, b_ga[None, :] - b_gs, NEG_INF)))  # exp(G_a - G_c) <= 1
                b_Akk = tl.dot(b_ka, b_cf, input_precision=DOT_PREC)
                b_Aqk = tl.dot(b_qa, b_cf, input_precision=DOT_PREC)
                o_A = o_rA + (i_j * BC + o_c)[None, :]
                tl.store(Akk + o_A, b_Akk, mask=m_r[:, None])
                tl.store(Aqk + o_A, b_Aqk, mask=m_r[:, None])
        # diagonal sub-block, one column c at a time from the exact differences G_r - G_c (r >= c)
        b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
        b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):
            # a column past the end only meets rows past the end (r >= c): clamp it to a valid row
            o_j = tl.minimum(i_t * BT + i_i * BC + j, L - 1)
            o_jk = ((bos + o_j) * H + i_h) * K + o_k
            b_kj = tl.load(k + o_jk, mask=m_k, other=0.0).to(tl.float32)
            b_gj = tl.load(G + o_jk, mask=m_k, other=0.0)
            b_e = tl.exp(tl.where((o_c >= j)[:, None] & m_rk, b_g - b_gj[None, :], NEG_INF))
            b_ke = b_e * b_kj[None, :]
            m_col = o_c[None, :] == j
            b_Akk = tl.where(m_col, tl.sum(b_k * b_ke, 1)[:, None], b_Akk)
            b_Aqk = tl.where(m_col, tl.sum(b_q * b_ke, 1)[:, None], b_Aqk)
        b_Akk = tl.where(m_lower, b_Akk * b_beta[:, None], 0.0)
        b_Aqk = tl.where(m_lower_eq, b_Aqk, 0.0)
        o_A = o_rA + (i_i * BC + o_c)[None, :]
        tl.store(Akk + o_A, b_Akk, mask=m_r[:, None])
        tl.store(Aqk + o_A, b_Aqk, mask=m_r[:, None])


def _kda_solve_wu_kernel(
    k, v, G, beta, Akk, w, u, cu_seqlens, chunk_indices,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Ai = (I + A_kk)^-1 for one chunk (BT = 4 BC): the four diagonal 16x16 blocks by forward substitution,
    the six below by block back-substitution; then w = Ai (beta k exp G) and u = Ai (beta v)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_r0 = i_t * BT + o_c
    o_r1 = o_r0 + BC
    o_r2 = o_r0 + 2 * BC
    o_r3 = o_r0 + 3 * BC
    m_r0, m_r1, m_r2, m_r3 = o_r0 < L, o_r1 < L, o_r2 < L, o_r3 < L
    # row r, column block j of A_kk: Akk[(bos + r) * H + i_h, j * BC + c]
    p_A0 = Akk + ((bos + o_r0) * H + i_h)[:, None] * BT + o_c[None, :]
    p_A1 = Akk + ((bos + o_r1) * H + i_h)[:, None] * BT + o_c[None, :]
    p_A2 = Akk + ((bos + o_r2) * H + i_h)[:, None] * BT + o_c[None, :]
    p_A3 = Akk + ((bos + o_r3) * H + i_h)[:, None] * BT + o_c[None, :]
    b_A00 = tl.load(p_A0, mask=m_r0[:, None], other=0.0)
    b_A10 = tl.load(p_A1, mask=m_r1[:, None], other=0.0)
    b_A11 = tl.load(p_A1 + BC, mask=m_r1[:, None], other=0.0)
    b_A20 = tl.load(p_A2, mask=m_r2[:, None], other=0.0)
    b_A21 = tl.load(p_A2 + BC, mask=m_r2[:, None], other=0.0)
    b_A22 = tl.load(p_A2 + 2 * BC, mask=m_r2[:, None], other=0.0)
    b_A30 = tl.load(p_A3, mask=m_r3[:, None], other=0.0)
    b_A31 = tl.load(p_A3 + BC, mask=m_r3[:, None], other=0.0)
    b_A32 = tl.load(p_A3 + 2 * BC, mask=m_r3[:, None], other=0.0)
    b_A33 = tl.load(p_A3 + 3 * BC, mask=m_r3[:, None], other=0.0)

    # diagonal blocks: X = (I + A_ii)^-1, row r = e_r - A_ii[r, :] X (rows above r are final)
    b_I = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_X0, b_X1, b_X2, b_X3 = b_I, b_I, b_I, b_I
    for r in range(1, BC):
        m_row = (o_c == r)[:, None]
        b_X0 = tl.where(m_row, b_X0 - tl.sum(tl.sum(tl.where(m_row, b_A00, 0.0), 0)[:, None] * b_X0, 0)[None, :], b_X0)
        b_X1 = tl.where(m_row, b_X1 - tl.sum(tl.sum(tl.where(m_row, b_A11, 0.0), 0)[:, None] * b_X1, 0)[None, :], b_X1)
        b_X2 = tl.where(m_row, b_X2 - tl.sum(tl.sum(tl.where(m_row, b_A22, 0.0), 0)[:, None] * b_X2, 0)[None, :], b_X2)
        b_X3 = tl.where(m_row, b_X3 - tl.sum(tl.sum(tl.where(m_row, b_A33, 0.0), 0)[:, None] * b_X3, 0)[None, :], b_X3)
    # blocks below the diagonal: Ai_ij = -X_i sum_{j <= m < i} A_im Ai_mj (the solve stays in full fp32)
    b_Ai10 = -tl.dot(tl.dot(b_X1, b_A10, input_precision="ieee"), b_X0, input_precision="ieee")
    b_Ai21 = -tl.dot(tl.dot(b_X2, b_A21, input_precision="ieee"), b_X1, input_precision="ieee")
    b_Ai32 = -tl.dot(tl.dot(b_X3, b_A32, input_precision="ieee"), b_X2, input_precision="ieee")
    b_Ai20 = -tl.dot(b_X2, tl.dot(b_A20, b_X0, input_precision="ieee")
                     + tl.dot(b_A21, b_Ai10, input_precision="ieee"), input_precision="ieee")
    b_Ai31 = -tl.dot(b_X3, tl.dot(b_A31, b_X1, input_precision="ieee")
                     + tl.dot(b_A32, b_Ai21, input_precision="ieee"), input_precision="ieee")
    b_Ai30 = -tl.dot(b_X3, tl.dot(b_A30, b_X0, input_precision="ieee")
                     + tl.dot(b_A31, b_Ai10, input_precision="ieee")
                     + tl.dot(b_A32, b_Ai20, input_precision="ieee"), input_precision="ieee")

    # right-hand sides beta k exp(G) (exp(G) <= 1: G is the decay from the chunk start) and beta v
    o_rk0 = ((bos + o_r0) * H + i_h)[:, None] * K + o_k[None, :]
    o_rk1 = ((bos + o_r1) * H + i_h)[:, None] * K + o_k[None, :]
    o_rk2 = ((bos + o_r2) * H + i_h)[:, None] * K + o_k[None, :]
    o_rk3 = ((bos + o_r3) * H + i_h)[:, None] * K + o_k[None, :]
    m_rk0, m_rk1 = m_r0[:, None] & m_k[None, :], m_r1[:, None] & m_k[None, :]
    m_rk2, m_rk3 = m_r2[:, None] & m_k[None, :], m_r3[:, None] & m_k[None, :]
    b_b0 = tl.load(beta + (bos + o_r0) * H + i_h, mask=m_r0, other=0.0).to(tl.float32)[:, None]
    b_b1 = tl.load(beta + (bos + o_r1) * H + i_h, mask=m_r1, other=0.0).to(tl.float32)[:, None]
    b_b2 = tl.load(beta + (bos + o_r2) * H + i_h, mask=m_r2, other=0.0).to(tl.float32)[:, None]
    b_b3 = tl.load(beta + (bos + o_r3) * H + i_h, mask=m_r3, other=0.0).to(tl.float32)[:, None]
    b_kb0 = b_b0 * tl.load(k + o_rk0, mask=m_rk0, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk0, mask=m_rk0, other=0.0))
    b_kb1 = b_b1 * tl.load(k + o_rk1, mask=m_rk1, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk1, mask=m_rk1, other=0.0))
    b_kb2 = b_b2 * tl.load(k + o_rk2, mask=m_rk2, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk2, mask=m_rk2, other=0.0))
    b_kb3 = b_b3 * tl.load(k + o_rk3, mask=m_rk3, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk3, mask=m_rk3, other=0.0))
    b_w0 = tl.dot(b_X0, b_kb0, input_precision=DOT_PREC)
    b_w1 = tl.dot(b_Ai10, b_kb0, input_precision=DOT_PREC) + tl.dot(b_X1, b_kb1, input_precision=DOT_PREC)
    b_w2 = (tl.dot(b_Ai20, b_kb0, input_precision=DOT_PREC) + tl.dot(b_Ai21, b_kb1, input_precision=DOT_PREC)
            + tl.dot(b_X2, b_kb2, input_precision=DOT_PREC))
    b_w3 = (tl.dot(b_Ai30, b_kb0, input_precision=DOT_PREC) + tl.dot(b_Ai31, b_kb1, input_precision=DOT_PREC)
            + tl.dot(b_Ai32, b_kb2, input_precision=DOT_PREC) + tl.dot(b_X3, b_kb3, input_precision=DOT_PREC))
    tl.store(w + o_rk0, b_w0, mask=m_rk0)
    tl.store(w + o_rk1, b_w1, mask=m_rk1)
    tl.store(w + o_rk2, b_w2, mask=m_rk2)
    tl.store(w + o_rk3, b_w3, mask=m_rk3)

    o_rv0 = ((bos + o_r0) * H + i_h)[:, None] * V + o_v[None, :]
    o_rv1 = ((bos + o_r1) * H + i_h)[:, None] * V + o_v[None, :]
    o_rv2 = ((bos + o_r2) * H + i_h)[:, None] * V + o_v[None, :]
    o_rv3 = ((bos + o_r3) * H + i_h)[:, None] * V + o_v[None, :]
    m_rv0, m_rv1 = m_r0[:, None] & m_v[None, :], m_r1[:, None] & m_v[None, :]
    m_rv2, m_rv3 = m_r2[:, None] & m_v[None, :], m_r3[:, None] & m_v[None, :]
    b_vb0 = b_b0 * tl.load(v + o_rv0, mask=m_rv0, other=0.0).to(tl.float32)
    b_vb1 = b_b1 * tl.load(v + o_rv1, mask=m_rv1, other=0.0).to(tl.float32)
    b_vb2 = b_b2 * tl.load(v + o_rv2, mask=m_rv2, other=0.0).to(tl.float32)
    b_vb3 = b_b3 * tl.load(v + o_rv3, mask=m_rv3, other=0.0).to(tl.float32)
    b_u0 = tl.dot(b_X0, b_vb0, input_precision=DOT_PREC)
    b_u1 = tl.dot(b_Ai10, b_vb0, input_precision=DOT_PREC) + tl.dot(b_X1, b_vb1, input_precision=DOT_PREC)
    b_u2 = (tl.dot(b_Ai20, b_vb0, input_precision=DOT_PREC) + tl.dot(b_Ai21, b_vb1, input_precision=DOT_PREC)
            + tl.dot(b_X2, b_vb2, input_precision=DOT_PREC))
    b_u3 = (tl.dot(b_Ai30, b_vb0, input_precision=DOT_PREC) + tl.dot(b_Ai31, b_vb1, input_precision=DOT_PREC)
            + tl.dot(b_Ai32, b_vb2, input_precision=DOT_PREC) + tl.dot(b_X3, b_vb3, input_precision=DOT_PREC))
    tl.store(u + o_rv0, b_u0, mask=m_rv0)
    tl.store(u + o_rv1, b_u1, mask=m_rv1)
    tl.store(u + o_rv2, b_u2, mask=m_rv2)
    tl.store(u + o_rv3, b_u3, mask=m_rv3)


def _kda_state_scan_kernel(
    k, w, u, G, h0, ht, h, v_new, cu_seqlens, chunk_offsets,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The only sequential part, one program per (V block, sequence, head): for each chunk, store the entering
    state S to h, v_new = u - w S, then S <- exp(G_last) S + (k exp(G_last - G))^T v_new. S stays fp32."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    NT = tl.cdiv(L, BT)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.0)
    for i_t in range(0, NT):
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        o_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
        o_tv = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + o_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + o_tv, mask=m_tv, other=0.0)
        b_vn = b_u - tl.dot(b_w, b_h, input_precision=DOT_PREC)
        tl.store(v_new + o_tv, b_vn, mask=m_tv)
        i_last = tl.minimum(i_t * BT + BT, L) - 1
        b_gl = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
        b_k = tl.load(k + o_tk, mask=m_tk, other=0.0).to(tl.float32)
        b_kd = b_k * tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, NEG_INF))  # exp(G_last - G) <= 1
        b_h = b_h * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kd), b_vn, input_precision=DOT_PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)


def _kda_output_kernel(
    q, G, Aqk, h, v_new, o, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """o = (scale q exp G) S_chunk + tril(A_qk) v_new, one program per (V block, chunk, head)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    L = eos - bos
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    o_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    o_tv = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
    b_q = tl.load(q + o_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
    b_qg = b_q * tl.exp(tl.where(m_tk, b_g, NEG_INF)) * scale
    b_h = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_A = m_t[:, None] & (o_i[:, None] >= o_i[None, :])
    b_A = tl.load(Aqk + ((bos + o_t) * H + i_h)[:, None] * BT + o_i[None, :], mask=m_A, other=0.0)
    b_vn = tl.load(v_new + o_tv, mask=m_tv, other=0.0)
    b_o = tl.dot(b_qg, b_h, input_precision=DOT_PREC) + tl.dot(b_A, b_vn, input_precision=DOT_PREC)
    tl.store(o + o_tv, b_o.to(o.dtype.element_ty), mask=m_tv)


def _kda_fused_recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    L2_EPS: tl.constexpr,
):
    """Token-by-token KDA for one (V block, sequence, head); the [K, BV] state slice stays in registers and
    is written once at the end (ht may alias h0: each program reads and writes only its own slice)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_kv = (i_n * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + o_kv, mask=m_kv, other=0.0)
    for i_t in range(bos, eos):
        o_tk = (i_t * H + i_h) * K + o_k
        o_tv = (i_t * H + i_h) * V + o_v
        b_q = tl.load(q + o_tk, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + o_tk, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + o_tk, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + o_tv, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_t * H + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + L2_EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + L2_EPS)
        b_h *= tl.exp(b_g)[:, None]
        b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h += b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + o_tv, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + o_kv, b_h, mask=m_kv)


_kda_gate_cumsum_kernel = _LazyKernel(_kda_gate_cumsum_kernel)
_kda_intra_fwd_kernel = _LazyKernel(_kda_intra_fwd_kernel)
_kda_solve_wu_kernel = _LazyKernel(_kda_solve_wu_kernel)
_kda_state_scan_kernel = _LazyKernel(_kda_state_scan_kernel)
_kda_output_kernel = _LazyKernel(_kda_output_kernel)
_kda_fused_recurrent_kernel = _LazyKernel(_kda_fused_recurrent_kernel)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _block(n: int) -> int:
    """Register tile side for a head dim: a power of two >= 16 (the smallest tl.dot operand)."""
    return max(16, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get full-fp32 products (the tests hold them to 1e-5); 16-bit inputs carry 8-11 bits
    # already, and tf32's 10-bit products keep the kernel's error below the rounding of the inputs.
    return "ieee" if dtype == torch.float32 else "tf32"


def _chunk_layout(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> tuple:
    """(cu_seqlens over the packed B*T tokens, chunk_indices [NC, 2] = (sequence, chunk), chunk_offsets [N])."""
    BT = CHUNK_SIZE
    if cu_seqlens is None:
        NT = triton.cdiv(T, BT)
        cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
        seq = torch.arange(B, device=device, dtype=torch.int32)
        chunk_indices = torch.stack([seq.repeat_interleave(NT), torch.arange(NT, device=device,
                                                                              dtype=torch.int32).repeat(B)], 1)
        return cu, chunk_indices.contiguous(), seq * NT
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    nts = [triton.cdiv(n, BT) for n in lens]
    chunk_indices = torch.tensor([(i, t) for i, nt in enumerate(nts) for t in range(nt)], dtype=torch.int32)
    offsets = torch.tensor([0, *nts[:-1]], dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu_seqlens.to(torch.int32), chunk_indices.to(device), offsets.to(device)


def _chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Chunked forward on [B, T, H, *] inputs (q, k already normalised if asked). Returns o, final state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels hold a head in registers: K, V <= {MAX_HEAD_DIM}, got {K}, {V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, chunk_indices, chunk_offsets = _chunk_layout(cu_seqlens, B, T, q.device)
    N, NC = cu.numel() - 1, chunk_indices.shape[0]
    BT, BC, BK, BV = CHUNK_SIZE, SUB_CHUNK, _block(K), _block(V)
    prec = _dot_precision(v.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)

    G = torch.empty(B, T, H, K, **f32)
    _kda_gate_cumsum_kernel[(NC, H)](g, G, cu, chunk_indices, H=H, K=K, BT=BT, BK=BK)
    Akk = torch.empty(B, T, H, BT, **f32)  # [B, T, H, BT]: row t holds its chunk's row of A
    Aqk = torch.empty(B, T, H, BT, **f32)
    _kda_intra_fwd_kernel[(NC, H)](q, k, G, beta, Akk, Aqk, cu, chunk_indices, scale,
                                   H=H, K=K, BT=BT, BC=BC, BK=BK, DOT_PREC=prec)
    w = torch.empty(B, T, H, K, **f32)
    u = torch.empty(B, T, H, V, **f32)
    _kda_solve_wu_kernel[(NC, H)](k, v, G, beta, Akk, w, u, cu, chunk_indices,
                                  H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=BV, DOT_PREC=prec)

    # the scan holds a [BK, BVS] fp32 state slice in registers: 32 columns keep K = 128 at 32 values a thread
    BVS = min(BV, 64 if BK <= 64 else 32)
    h = torch.empty(NC, H, K, V, **f32)  # state entering each chunk
    v_new = torch.empty(B, T, H, V, **f32)
    ht = torch.empty(N, H, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    _kda_state_scan_kernel[(triton.cdiv(V, BVS), N, H)](
        k, w, u, G, h0 if h0 is not None else h, ht if ht is not None else h, h, v_new, cu, chunk_offsets,
        H=H, K=K, V=V, BT=BT, BK=BK, BV=BVS, HAS_H0=h0 is not None, STORE_HT=ht is not None, DOT_PREC=prec,
        num_warps=4, num_stages=SCAN_NUM_STAGES)

    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    BVO = min(BV, 64)
    _kda_output_kernel[(triton.cdiv(V, BVO), NC, H)](
        q, G, Aqk, h, v_new, o, cu, chunk_indices, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BVO, DOT_PREC=prec)
    return o, ht


def _fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                             cu_seqlens, inplace_final_state):
    """Decode launcher: one program per (V block, sequence, head). Returns o and the final state (None unless
    asked); with inplace_final_state the final state is written into initial_state and that tensor returned."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels hold a head in registers: K, V <= {MAX_HEAD_DIM}, got {K}, {V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    inplace = inplace_final_state and initial_state is not None and initial_state.is_contiguous()
    if inplace:
        ht = initial_state
    elif output_final_state:
        ht = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
    else:
        ht = None
    h0 = initial_state
    if h0 is not None and not h0.is_contiguous():
        h0 = h0.contiguous()
    BK = _block(K)
    # 32 state columns a program: K = 128 costs 32 fp32 registers a thread, and B * H * V / 32 programs
    # (512 at B = 1, H = 16, V = 128) are enough to stream the state at full bandwidth
    BV = min(_block(V), 32)
    _kda_fused_recurrent_kernel[(triton.cdiv(V, BV), N, H)](
        q, k, v, g, beta, o, h0 if h0 is not None else o, ht if ht is not None else o,
        cu_seqlens if cu_seqlens is not None else o, scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, USE_QK_L2NORM=use_qk_l2norm, L2_EPS=L2NORM_EPS)
    return o, (ht if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------------


class ChunkKDAFunction(torch.autograd.Function):
    """Triton forward; the backward recomputes the forward with the PyTorch twin and differentiates it."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        o, ht = _chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.cu_seqlens = scale, cu_seqlens
        if ht is not None:
            return o, ht
        return o, None

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state.detach().requires_grad_(initial_state.requires_grad)
        with torch.enable_grad():
            o, ht = chunk_kda_torch(*inputs, ctx.scale, h0, dht is not None, False, ctx.cu_seqlens)
            outputs, grads = [o], [do]
            if dht is not None:
                outputs.append(ht)
                grads.append(dht)
            wrt = [x for x in (*inputs, h0) if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outputs, wrt, grads, allow_unused=True)) if wrt else iter(())
        dq, dk, dv, dg, dbeta, dh0 = (
            next(got) if x is not None and x.requires_grad else None for x in (*inputs, h0)
        )
        return dq, dk, dv, dg, dbeta, None, dh0, None, None


# --------------------------------------------------------------------------------------------------
# Public functions (signatures fixed by kda_ops; inputs arrive validated)
# --------------------------------------------------------------------------------------------------


def chunk_kda_triton(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Chunked KDA with Triton kernels. Returns (o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or
    None). The q/k L2 norm runs as torch ops in front of the kernels, so its gradient comes from autograd."""
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())  # kept fp32: no second rounding of 16-bit inputs
    o, ht = ChunkKDAFunction.apply(q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens)
    return o, (ht if output_final_state else None)


def fused_recurrent_kda_triton(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False):
    """Recurrent KDA (decode) with one fused Triton kernel; the q/k L2 norm is fused too. Forward only: when a
    gradient is needed it returns `chunk_kda_triton` (same values, differentiable; never in place)."""
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    if needs_grad:
        return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, cu_seqlens)
    return _fused_recurrent_kda_fwd(q, k, v, g, beta, float(scale), initial_state, output_final_state,
                                    use_qk_l2norm_in_kernel, cu_seqlens, inplace_final_state)
