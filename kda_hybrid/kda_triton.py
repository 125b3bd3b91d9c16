"""Triton kernels for Kimi Delta Attention: the chunked form (prefill, training) and a fused recurrent
decode step. The exact PyTorch twins are `kda_torch.chunk_kda_torch` / `kda_torch.recurrent_kda_reference`;
the chunked kernels mirror `kda_torch._chunk_fwd` step by step (docs/architecture.md §1).

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

Chunked backward, all Triton (`ChunkKDAFunction` saves G, A_qk, Ai = (I + A_kk)^-1, w, u from the forward):
  4. `_kda_state_scan_kernel`   rerun: the states entering every chunk and v_new (not kept from the forward)
  6. `_kda_state_bwd_kernel`    reverse scan over chunks: dh (gradient of each chunk's outgoing state), dv_new,
                                dh0; the final-state gradient dht seeds it
  7. `_kda_chunk_bwd_kernel`    per chunk: dv; dq, dk, dbeta, dG through S, w, u, Ai, exp(G); dA_qk, dA_kk
  8. `_kda_intra_bwd_kernel`    per chunk: back through the gated products A_kk, A_qk (anchored as in 2), then
                                dg = reverse cumsum of dG within the chunk
Torch does only allocation, the final dtype casts, and the q/k L2 norm (torch ops in front of the Function,
differentiated by autograd). `fused_recurrent_kda_triton` has no backward: when a gradient is needed it calls
the chunked function.

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

from .kda_torch import L2NORM_EPS, l2norm

CHUNK_SIZE = 64  # tokens per chunk (BT), as kda_torch.CHUNK_SIZE
SUB_CHUNK = 16  # BC: side of the sub-blocks of A; 16 is the smallest tl.dot tile
MAX_HEAD_DIM = 256  # K and V are held whole in one register tile
# The scan's loop loads ~100 KB of tiles per chunk at K = V = 128 in fp32: triton's default 3-stage pipeline
# needs 247 KB of shared memory (over sm_90's 227 KB); 2 stages need 140 KB (compiled for sm_90 with ptxas).
SCAN_NUM_STAGES = 2
STATE_BWD_NUM_STAGES = 2
CHUNK_BWD_BV = 32
CHUNK_BWD_NUM_WARPS = 8
CHUNK_BWD_NUM_STAGES = 2
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
    k, v, G, beta, Akk, Ai, w, u, cu_seqlens, chunk_indices,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Ai = (I + A_kk)^-1 for one chunk (BT = 4 BC): the four diagonal 16x16 blocks by forward substitution,
    the six below by block back-substitution; then w = Ai (beta k exp G) and u = Ai (beta v). Ai is stored
    (whole rows, zeros above the diagonal) for the backward."""
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

    # Ai row r: [Ai_i0 .. Ai_ii, 0 ..] for r in row block i, the layout of Akk
    p_I0 = Ai + ((bos + o_r0) * H + i_h)[:, None] * BT + o_c[None, :]
    p_I1 = Ai + ((bos + o_r1) * H + i_h)[:, None] * BT + o_c[None, :]
    p_I2 = Ai + ((bos + o_r2) * H + i_h)[:, None] * BT + o_c[None, :]
    p_I3 = Ai + ((bos + o_r3) * H + i_h)[:, None] * BT + o_c[None, :]
    b_0 = tl.zeros([BC, BC], dtype=tl.float32)
    tl.store(p_I0, b_X0, mask=m_r0[:, None])
    tl.store(p_I0 + BC, b_0, mask=m_r0[:, None])
    tl.store(p_I0 + 2 * BC, b_0, mask=m_r0[:, None])
    tl.store(p_I0 + 3 * BC, b_0, mask=m_r0[:, None])
    tl.store(p_I1, b_Ai10, mask=m_r1[:, None])
    tl.store(p_I1 + BC, b_X1, mask=m_r1[:, None])
    tl.store(p_I1 + 2 * BC, b_0, mask=m_r1[:, None])
    tl.store(p_I1 + 3 * BC, b_0, mask=m_r1[:, None])
    tl.store(p_I2, b_Ai20, mask=m_r2[:, None])
    tl.store(p_I2 + BC, b_Ai21, mask=m_r2[:, None])
    tl.store(p_I2 + 2 * BC, b_X2, mask=m_r2[:, None])
    tl.store(p_I2 + 3 * BC, b_0, mask=m_r2[:, None])
    tl.store(p_I3, b_Ai30, mask=m_r3[:, None])
    tl.store(p_I3 + BC, b_Ai31, mask=m_r3[:, None])
    tl.store(p_I3 + 2 * BC, b_Ai32, mask=m_r3[:, None])
    tl.store(p_I3 + 3 * BC, b_X3, mask=m_r3[:, None])

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


# --------------------------------------------------------------------------------------------------
# Backward kernels. Per chunk, with S the state entering it, dS' the gradient of the state leaving it and
# qg = scale q exp G, kd = k exp(G_last - G), kb = beta k exp G:
#   dv_new = A_qk^T do + kd dS'                  dS = exp(G_last) dS' + qg^T do - w^T dv_new   (reverse scan)
#   dqg = do S^T   dw = -dv_new S^T   dkd = v_new dS'^T   dA_qk = do v_new^T
#   dkb = Ai^T dw  dvb = Ai^T dv_new  dA_kk = -(dkb w^T + dvb u^T)   (= -Ai^T dAi Ai^T, strict lower part)
# then through the gated products A_kk, A_qk (intra kernel) and G = cumsum(g): dg = reverse cumsum of dG.
# --------------------------------------------------------------------------------------------------


def _kda_state_bwd_kernel(
    q, k, w, G, Aqk, do, dht, dh0, dh, dv_new, cu_seqlens, chunk_offsets, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Reverse scan over the chunks of one (V block, sequence, head): store dh[chunk] = dS' (gradient of the
    state leaving the chunk) and dv_new, step dS' back through the chunk; dh0 is what enters the first."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
        b_dh += tl.load(dht + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.0)
    for i_s in range(0, NT):
        i_t = NT - 1 - i_s
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + o_kv, b_dh, mask=m_kv)
        o_t = i_t * BT + o_i
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        o_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
        o_tv = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
        i_last = tl.minimum(i_t * BT + BT, L) - 1
        b_gl = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
        b_kd = tl.load(k + o_tk, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(
            tl.where(m_tk, b_gl[None, :] - b_g, NEG_INF))  # exp(G_last - G) <= 1
        b_qg = tl.load(q + o_tk, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(
            tl.where(m_tk, b_g, NEG_INF)) * scale
        b_w = tl.load(w + o_tk, mask=m_tk, other=0.0)
        b_do = tl.load(do + o_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_A = tl.load(Aqk + ((bos + o_t) * H + i_h)[:, None] * BT + o_i[None, :],
                      mask=m_t[:, None] & (o_i[:, None] >= o_i[None, :]), other=0.0)
        b_dvn = (tl.dot(tl.trans(b_A), b_do, input_precision=DOT_PREC)
                 + tl.dot(b_kd, b_dh, input_precision=DOT_PREC))
        tl.store(dv_new + o_tv, b_dvn, mask=m_tv)
        b_dh = (b_dh * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
                - tl.dot(tl.trans(b_w), b_dvn, input_precision=DOT_PREC))
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + o_kv, b_dh, mask=m_kv)


def _kda_chunk_bwd_kernel(
    q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, dq, dk, dv, dbeta, dG, dAqk, dAkk,
    cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Everything of one (chunk, head) that goes through the state, the WY inverse and the gates outside A:
    dv (final), and the parts of dq, dk, dbeta, dG (per token, before the cumsum) that do not come from
    A_kk, A_qk; plus dA_qk = do v_new^T and dA_kk for the intra kernel. V is looped in BV columns."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
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
    o_tk = ((bos + o_t) * H + i_h)[:, None] * K + o_k[None, :]
    o_tA = ((bos + o_t) * H + i_h)[:, None] * BT + o_i[None, :]
    o_hk = (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V
    b_Ai = tl.load(Ai + o_tA, mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
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
        o_tv = ((bos + o_t) * H + i_h)[:, None] * V + o_v[None, :]
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
    b_gl = tl.load(G + ((bos + i_last) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
    b_k = tl.load(k + o_tk, mask=m_tk, other=0.0).to(tl.float32)
    b_q = tl.load(q + o_tk, mask=m_tk, other=0.0).to(tl.float32) * scale
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
    tl.store(dbeta + (bos + o_t) * H + i_h, b_dbeta, mask=m_t)
    tl.store(dAqk + o_tA, b_dAq, mask=m_t[:, None])
    tl.store(dAkk + o_tA, b_dAk, mask=m_t[:, None])


def _kda_intra_bwd_kernel(
    q, k, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, cu_seqlens, chunk_indices, scale,
    H, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Back through A_kk[r, c] = beta_r k_r.(k_c E_rc) and A_qk[r, c] = (scale q_r).(k_c E_rc), E_rc = exp(G_r - G_c),
    for one (chunk, head); adds to dq, dk, dbeta, dG in place and turns dG into dg (reverse cumsum in the chunk).
    Row side X_r = sum_c dA[r, c] k_c E_rc, column side Y_c = sum_r dA[r, c] x_r E_rc (x = beta k or scale q):
    off-diagonal sub-blocks anchored as in the forward (X at the first row of the row block, Y at the last row
    of the column block: both factors <= 1), diagonal sub-blocks column by column from exact differences."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
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
        o_rk = ((bos + o_r) * H + i_h)[:, None] * K + o_k[None, :]
        o_rA = ((bos + o_r) * H + i_h)[:, None] * BT
        b_q = tl.load(q + o_rk, mask=m_rk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + o_rk, mask=m_rk, other=0.0).to(tl.float32)
        b_g = tl.load(G + o_rk, mask=m_rk, other=0.0)
        b_beta = tl.load(beta + (bos + o_r) * H + i_h, mask=m_r, other=0.0).to(tl.float32)
        # anchors, clamped into the sequence (rows past the end are masked everywhere they are used)
        o_a = tl.minimum(i_t * BT + i_i * BC, L - 1)
        o_e = tl.minimum(i_t * BT + i_i * BC + BC - 1, L - 1)
        b_ga = tl.load(G + ((bos + o_a) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_ge = tl.load(G + ((bos + o_e) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_Xk = tl.zeros([BC, BK], dtype=tl.float32)
        b_Xq = tl.zeros([BC, BK], dtype=tl.float32)
        b_Y = tl.zeros([BC, BK], dtype=tl.float32)
        for i_j in tl.static_range(NB):
            o_s = i_t * BT + i_j * BC + o_c
            m_s = o_s < L
            m_sk = m_s[:, None] & m_k[None, :]
            o_sk = ((bos + o_s) * H + i_h)[:, None] * K + o_k[None, :]
            if i_j < i_i:  # columns in block j, rows in block i
                b_ks = tl.load(k + o_sk, mask=m_sk, other=0.0).to(tl.float32)
                b_gs = tl.load(G + o_sk, mask=m_sk, other=0.0)
                b_kc = b_ks * tl.exp(tl.where(m_sk, b_ga[None, :] - b_gs, NEG_INF))  # exp(G_a - G_c) <= 1
                b_dAk = tl.load(dAkk + o_rA + (i_j * BC + o_c)[None, :], mask=m_r[:, None], other=0.0)
                b_dAq = tl.load(dAqk + o_rA + (i_j * BC + o_c)[None, :], mask=m_r[:, None], other=0.0)
                b_Xk += tl.dot(b_dAk, b_kc, input_precision=DOT_PREC)
                b_Xq += tl.dot(b_dAq, b_kc, input_precision=DOT_PREC)
            if i_j > i_i:  # rows in block j, columns in block i
                b_ks = tl.load(k + o_sk, mask=m_sk, other=0.0).to(tl.float32)
                b_qs = tl.load(q + o_sk, mask=m_sk, other=0.0).to(tl.float32) * scale
                b_gs = tl.load(G + o_sk, mask=m_sk, other=0.0)
                b_bs = tl.load(beta + (bos + o_s) * H + i_h, mask=m_s, other=0.0).to(tl.float32)
                b_rs = tl.exp(tl.where(m_sk, b_gs - b_ge[None, :], NEG_INF))  # exp(G_r - G_e) <= 1
                o_sA = ((bos + o_s) * H + i_h)[:, None] * BT + (i_i * BC + o_c)[None, :]
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
            o_jk = ((bos + o_j) * H + i_h) * K + o_k
            b_kj = tl.load(k + o_jk, mask=m_k, other=0.0).to(tl.float32)
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
        b_db = tl.load(dbeta + (bos + o_r) * H + i_h, mask=m_r, other=0.0) + tl.sum(b_k * b_Xk, 1)
        b_dG = tl.load(dG + o_rk, mask=m_rk, other=0.0) + b_bk * b_Xk + b_q * b_Xq - b_k * b_Y
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True) + b_carry[None, :]
        b_carry += tl.sum(b_dG, 0)
        tl.store(dq + o_rk, b_dq, mask=m_rk)
        tl.store(dk + o_rk, b_dk, mask=m_rk)
        tl.store(dbeta + (bos + o_r) * H + i_h, b_db, mask=m_r)
        tl.store(dG + o_rk, b_dg, mask=m_rk)


_kda_gate_cumsum_kernel = _LazyKernel(_kda_gate_cumsum_kernel)
_kda_intra_fwd_kernel = _LazyKernel(_kda_intra_fwd_kernel)
_kda_solve_wu_kernel = _LazyKernel(_kda_solve_wu_kernel)
_kda_state_scan_kernel = _LazyKernel(_kda_state_scan_kernel)
_kda_output_kernel = _LazyKernel(_kda_output_kernel)
_kda_fused_recurrent_kernel = _LazyKernel(_kda_fused_recurrent_kernel)
_kda_state_bwd_kernel = _LazyKernel(_kda_state_bwd_kernel)
_kda_chunk_bwd_kernel = _LazyKernel(_kda_chunk_bwd_kernel)
_kda_intra_bwd_kernel = _LazyKernel(_kda_intra_bwd_kernel)


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


def _check_head_dims(K: int, V: int) -> None:
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels hold a head in registers: K, V <= {MAX_HEAD_DIM}, got {K}, {V}")


def _scan_block_v(BK: int, BV: int) -> int:
    # the scans hold a [BK, BVS] fp32 state slice in registers: 32 columns keep K = 128 at 32 values a thread
    return min(BV, 64 if BK <= 64 else 32)


def _chunk_state_scan(k, w, u, G, initial_state, output_final_state, layout):
    """Kernel 4: states entering every chunk h [NC, H, K, V], v_new [B, T, H, V] and the final state."""
    cu, chunk_indices, chunk_offsets = layout
    B, T, H, K = k.shape
    V = u.shape[-1]
    N, NC = cu.numel() - 1, chunk_indices.shape[0]
    BK, BV = _block(K), _block(V)
    f32 = dict(device=k.device, dtype=torch.float32)
    BVS = _scan_block_v(BK, BV)
    h = torch.empty(NC, H, K, V, **f32)  # state entering each chunk
    v_new = torch.empty(B, T, H, V, **f32)
    ht = torch.empty(N, H, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    _kda_state_scan_kernel[(triton.cdiv(V, BVS), N, H)](
        k, w, u, G, h0 if h0 is not None else h, ht if ht is not None else h, h, v_new, cu, chunk_offsets,
        H=H, K=K, V=V, BT=CHUNK_SIZE, BK=BK, BV=BVS, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        DOT_PREC=_dot_precision(k.dtype),
        num_warps=4, num_stages=SCAN_NUM_STAGES)
    return h, v_new, ht


def _chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Chunked forward on contiguous [B, T, H, *] inputs (q, k already normalised if asked). Returns o, the
    final state and what the backward reuses: (G, A_qk, Ai = (I + A_kk)^-1, w, u), all fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_head_dims(K, V)
    layout = _chunk_layout(cu_seqlens, B, T, q.device)
    cu, chunk_indices, _ = layout
    NC = chunk_indices.shape[0]
    BT, BC, BK, BV = CHUNK_SIZE, SUB_CHUNK, _block(K), _block(V)
    prec = _dot_precision(v.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)

    G = torch.empty(B, T, H, K, **f32)
    _kda_gate_cumsum_kernel[(NC, H)](g, G, cu, chunk_indices, H=H, K=K, BT=BT, BK=BK)
    Akk = torch.empty(B, T, H, BT, **f32)  # [B, T, H, BT]: row t holds its chunk's row of A
    Aqk = torch.empty(B, T, H, BT, **f32)
    _kda_intra_fwd_kernel[(NC, H)](q, k, G, beta, Akk, Aqk, cu, chunk_indices, scale,
                                   H=H, K=K, BT=BT, BC=BC, BK=BK, DOT_PREC=prec)
    Ai = torch.empty(B, T, H, BT, **f32)
    w = torch.empty(B, T, H, K, **f32)
    u = torch.empty(B, T, H, V, **f32)
    _kda_solve_wu_kernel[(NC, H)](k, v, G, beta, Akk, Ai, w, u, cu, chunk_indices,
                                  H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=BV, DOT_PREC=prec)
    del Akk
    h, v_new, ht = _chunk_state_scan(k, w, u, G, initial_state, output_final_state, layout)

    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    BVO = min(BV, 64)
    _kda_output_kernel[(triton.cdiv(V, BVO), NC, H)](
        q, G, Aqk, h, v_new, o, cu, chunk_indices, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BVO, DOT_PREC=prec)
    return o, ht, (G, Aqk, Ai, w, u)


def _chunk_kda_bwd(q, k, v, beta, scale, initial_state, cu_seqlens, saved, do, dht, need_dh0):
    """Chunked backward: recompute h and v_new (one forward scan), reverse scan for dh, then the per-chunk
    kernels. Returns dq, dk, dv, dg, dbeta in their inputs' dtypes and dh0 (fp32, None unless need_dh0)."""
    G, Aqk, Ai, w, u = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = _chunk_layout(cu_seqlens, B, T, q.device)
    cu, chunk_indices, chunk_offsets = layout
    N, NC = cu.numel() - 1, chunk_indices.shape[0]
    BT, BC, BK, BV = CHUNK_SIZE, SUB_CHUNK, _block(K), _block(V)
    prec = _dot_precision(v.dtype)
    f32 = dict(device=q.device, dtype=torch.float32)
    h, v_new, _ = _chunk_state_scan(k, w, u, G, initial_state, False, layout)

    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    dh = torch.empty(NC, H, K, V, **f32)  # gradient of the state leaving each chunk
    dv_new = torch.empty(B, T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if need_dh0 else None
    BVS = _scan_block_v(BK, BV)
    _kda_state_bwd_kernel[(triton.cdiv(V, BVS), N, H)](
        q, k, w, G, Aqk, do, dht if dht is not None else dh, dh0 if dh0 is not None else dh, dh, dv_new,
        cu, chunk_offsets, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BVS, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, DOT_PREC=prec, num_warps=4, num_stages=STATE_BWD_NUM_STAGES)

    dq = torch.empty(B, T, H, K, **f32)
    dk = torch.empty(B, T, H, K, **f32)
    dG = torch.empty(B, T, H, K, **f32)  # per-token gradient of G, then (intra kernel) dg in place
    dbeta = torch.empty(B, T, H, **f32)
    dv = torch.empty_like(v)
    dAqk = torch.empty(B, T, H, BT, **f32)
    dAkk = torch.empty(B, T, H, BT, **f32)
    _kda_chunk_bwd_kernel[(NC, H)](
        q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do, dq, dk, dv, dbeta, dG, dAqk, dAkk,
        cu, chunk_indices, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=min(BV, CHUNK_BWD_BV), DOT_PREC=prec,
        num_warps=CHUNK_BWD_NUM_WARPS, num_stages=CHUNK_BWD_NUM_STAGES)
    _kda_intra_bwd_kernel[(NC, H)](
        q, k, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, cu, chunk_indices, scale,
        H=H, K=K, BT=BT, BC=BC, BK=BK, DOT_PREC=prec)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dG, dbeta, dh0


def _fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                             cu_seqlens, inplace_final_state):
    """Decode launcher: one program per (V block, sequence, head). Returns o and the final state (None unless
    asked); with inplace_final_state the final state is written into initial_state and that tensor returned."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    _check_head_dims(K, V)
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
    """Triton forward and backward; saves the fp32 G, A_qk, Ai, w, u of the forward (the backward recomputes
    the per-chunk states with one more forward scan instead of keeping them)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        o, ht, saved = _chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, beta, initial_state, *saved)
        ctx.scale, ctx.cu_seqlens, ctx.g_dtype = scale, cu_seqlens, g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, initial_state, *saved = ctx.saved_tensors
        need_dh0 = initial_state is not None and ctx.needs_input_grad[6]
        dq, dk, dv, dg, dbeta, dh0 = _chunk_kda_bwd(q, k, v, beta, ctx.scale, initial_state, ctx.cu_seqlens,
                                                    saved, do, dht, need_dh0)
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta.to(beta.dtype), None, dh0, None, None


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
