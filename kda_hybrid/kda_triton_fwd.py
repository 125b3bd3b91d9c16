"""Triton kernels for Kimi Delta Attention, forward and decode: the chunked form (prefill, training) and a
fused recurrent decode step, with one launcher per kernel; the backward kernels are in `kda_triton_bwd`, the
autograd Function and the public entry points in `kda_triton`. The exact PyTorch twins are
`kda_torch.chunk_kda_torch` / `kda_torch.recurrent_kda_reference` end to end, and stage by stage the
functions of `kda_triton_twins` (docs/architecture.md §1, §9).

Layout: q, k [B, T, H, K]; g [B, T, HV, K]; v [B, T, HV, V]; beta [B, T, HV]; states [N, HV, K, V] fp32.
HV is a multiple of H (grouped value heads, GVA): value head i reads q/k head i // (HV // H) by index
arithmetic, q and k are never repeated in memory. Batched inputs are viewed as one packed sequence of B*T
tokens with B equal-length segments, so every chunk kernel has a single (varlen) code path: a chunk never
crosses a sequence boundary.

Chunked forward: five stages, one kernel each, each with a launcher `_<stage>_fwd` that can be called on its
own and a plain-PyTorch twin of the same signature in `kda_triton_twins` (`<stage>_ref`), per chunk of BT = 64:
  1. gate cumsum      `gate_cumsum_fwd`      G = within-chunk cumulative sum of max(g, GATE_FLOOR) (fp32)
  2. gated products   `gated_products_fwd`   A_kk = strict lower beta_r k_r.k_c exp(G_r - G_c),
                                              A_qk = lower scale q_r.k_c exp(G_r - G_c)
  3. WY solve         `wy_solve_fwd`         Ai = (I + A_kk)^-1 by 16x16 blocks, w = Ai (beta k exp G),
                                              u = Ai (beta v)
  4. state scan       `state_scan_fwd`       sequential over chunks: v_new = u - w S,
                                              S = exp(G_last) S + (k exp(G_last - G))^T v_new
  5. output           `output_fwd`           o = (scale q exp G) S + A_qk v_new
Decode: `_kda_fused_recurrent_kernel` loops over the tokens of a sequence with the state in registers.

Overflow: every exponent evaluated is <= 0 (up to rounding). exp(G_r - G_c) for an off-diagonal 16x16 sub-block
is split at the first row a of the row sub-block as exp(G_r - G_a) * exp(G_a - G_c), both factors <= 1
because c < a <= r and G is non-increasing; diagonal sub-blocks are formed column by column from the exact
differences. With g = -20 per token G reaches -1280 in a chunk; products that underflow to 0 are < 1e-38.
A reset, g = -inf (allowed: g <= 0), would make G_r - G_c = -inf - (-inf) = NaN; the gate cumsum floors g at
GATE_FLOOR = -110 first, where exp already underflows to exactly 0 in fp32 (e^-110 < 1e-47, the smallest
subnormal is 1.4e-45), so every product across the reset is 0, as in the recurrence, and the gradient of a
floored gate is 0, as exp(-inf)'s is.

Torch does allocation, the final dtype casts, the q/k L2 norm, the in-kernel gate and beta activations and
the state layout transposes (elementwise torch ops in front of the kernels, differentiated by autograd).
`fused_recurrent_kda_triton` has no backward: when a gradient is needed it calls the chunked function.

Kernels are decorated with `LazyKernel` where they are defined, which applies `triton.jit` at their first
launch, not at import: triton decides between the compiler and the interpreter (TRITON_INTERPRET=1, CPU tests)
when `triton.jit` runs, and this module is often imported (by `kda_ops`) before a test sets the variable.
The head counts H, HV are runtime arguments (one compilation serves every count); head dims, tile sizes and
flags are compile-time constants.
"""

from __future__ import annotations

import torch

try:  # inside try: transformers' remote-code import check skips try blocks, so Hub loads work without triton
    import triton
    import triton.language as tl
except ImportError as err:
    raise ImportError("kda_hybrid.kda_triton_fwd needs the triton package (GPU kernels); kda_torch does not") from err

from .kda_torch import L2NORM_EPS  # one chunk size for every path
from .kda_triton_runtime import LazyKernel, block

# CHUNK_SIZE / CHUNK_SIZES (64 by default, fla's 32 too) come from kda_torch: the WY solve works on
# BT / SUB_CHUNK = 2 or 4 diagonal blocks
SUPPORTS_GVA = True  # the kernels index q/k head i_h // (HV // H): kda_ops dispatches grouped value heads here
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
# floor on g before the cumsum: exp(-110) = 0 in fp32, and |G| stays small enough after a reset that the
# differences G_r - G_c of the tokens after it keep ~7.6e-6 absolute precision (one ulp at 110)
GATE_FLOOR_VALUE = -110.0
GATE_FLOOR = tl.constexpr(GATE_FLOOR_VALUE)


# --------------------------------------------------------------------------------------------------
# Kernels. Chunk kernels: program (i_c, i_h) = (global chunk, value head); chunk_indices[i_c] = (sequence,
# chunk in sequence); rows of a chunk past the end of its sequence are masked (they belong to the next
# sequence).
# --------------------------------------------------------------------------------------------------


@LazyKernel
def _kda_gate_cumsum_kernel(
    g, G, cu_seqlens, chunk_indices,
    HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """G = cumsum of max(g, GATE_FLOOR) within each chunk, fp32 (the floor turns a -inf reset into a finite
    exponent that still underflows to 0, see GATE_FLOOR)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_tk = (o_t < eos - bos)[:, None] & (o_k < K)[None, :]
    o_tk = ((bos + o_t) * HV + i_h)[:, None] * K + o_k[None, :]
    b_g = tl.maximum(tl.load(g + o_tk, mask=m_tk, other=0.0).to(tl.float32), GATE_FLOOR)
    tl.store(G + o_tk, tl.cumsum(b_g, axis=0), mask=m_tk)


@LazyKernel
def _kda_intra_fwd_kernel(
    q, k, G, beta, Akk, Aqk, cu_seqlens, chunk_indices, scale,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """A_kk[r, c] = beta_r sum_d k_r k_c exp(G_r - G_c) (c < r) and A_qk[r, c] = scale sum_d q_r k_c exp(...)
    (c <= r), stored row-major [T, HV, BT] per chunk; only sub-blocks on or below the diagonal are written.
    Program (chunk, value head i_h); q and k are read from head i_h // (HV // H) (GVA)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hq = i_h // (HV // H)
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
        o_rk = ((bos + o_r) * HV + i_h)[:, None] * K + o_k[None, :]
        o_rq = ((bos + o_r) * H + i_hq)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + o_rq, mask=m_rk, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + o_rq, mask=m_rk, other=0.0).to(tl.float32)
        b_g = tl.load(G + o_rk, mask=m_rk, other=0.0)
        b_beta = tl.load(beta + (bos + o_r) * HV + i_h, mask=m_r, other=0.0).to(tl.float32)
        o_rA = ((bos + o_r) * HV + i_h)[:, None] * BT
        # anchor: the first row of this row sub-block (clamped into the sequence: if it lies past the end, so
        # do all the rows, and nothing computed from it is stored)
        o_a = tl.minimum(i_t * BT + i_i * BC, L - 1)
        b_ga = tl.load(G + ((bos + o_a) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_rf = tl.exp(tl.where(m_rk, b_g - b_ga[None, :], NEG_INF))  # exp(G_r - G_a) <= 1
        b_qa = b_q * b_rf
        b_ka = b_k * b_rf * b_beta[:, None]
        for i_j in tl.static_range(BT // BC):
            if i_j < i_i:
                o_s = i_t * BT + i_j * BC + o_c
                m_sk = (o_s < L)[:, None] & m_k[None, :]
                o_sk = ((bos + o_s) * HV + i_h)[:, None] * K + o_k[None, :]
                b_ks = tl.load(k + ((bos + o_s) * H + i_hq)[:, None] * K + o_k[None, :], mask=m_sk,
                               other=0.0).to(tl.float32)
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
            b_kj = tl.load(k + ((bos + o_j) * H + i_hq) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_gj = tl.load(G + ((bos + o_j) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
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


@LazyKernel
def _kda_solve_wu_kernel(
    k, v, G, beta, Akk, Ai, w, u, cu_seqlens, chunk_indices,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Ai = (I + A_kk)^-1 for one chunk (BT = 4 BC, or 2 BC with blocks 2, 3 masked): the diagonal 16x16
    blocks by forward substitution, those below by block back-substitution; then w = Ai (beta k exp G) and
    u = Ai (beta v). Ai is stored (whole rows, zeros above the diagonal) for the backward. k is read from head
    i_h // (HV // H)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hq = i_h // (HV // H)
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
    # row blocks 2, 3 exist only for BT = 4 BC (64); with BT = 2 BC (32) they are masked out (their rows are the
    # next chunk's) and so are column blocks 2, 3 of the stores (past the end of a row of BT)
    m_r0, m_r1 = o_r0 < L, o_r1 < L
    m_r2, m_r3 = (o_r2 < L) & (o_c + 2 * BC < BT), (o_r3 < L) & (o_c + 3 * BC < BT)
    m_c2, m_c3 = (o_c + 2 * BC < BT)[None, :], (o_c + 3 * BC < BT)[None, :]
    # row r, column block j of A_kk: Akk[(bos + r) * HV + i_h, j * BC + c]
    p_A0 = Akk + ((bos + o_r0) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_A1 = Akk + ((bos + o_r1) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_A2 = Akk + ((bos + o_r2) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_A3 = Akk + ((bos + o_r3) * HV + i_h)[:, None] * BT + o_c[None, :]
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
    p_I0 = Ai + ((bos + o_r0) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_I1 = Ai + ((bos + o_r1) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_I2 = Ai + ((bos + o_r2) * HV + i_h)[:, None] * BT + o_c[None, :]
    p_I3 = Ai + ((bos + o_r3) * HV + i_h)[:, None] * BT + o_c[None, :]
    b_0 = tl.zeros([BC, BC], dtype=tl.float32)
    tl.store(p_I0, b_X0, mask=m_r0[:, None])
    tl.store(p_I0 + BC, b_0, mask=m_r0[:, None])
    tl.store(p_I0 + 2 * BC, b_0, mask=m_r0[:, None] & m_c2)
    tl.store(p_I0 + 3 * BC, b_0, mask=m_r0[:, None] & m_c3)
    tl.store(p_I1, b_Ai10, mask=m_r1[:, None])
    tl.store(p_I1 + BC, b_X1, mask=m_r1[:, None])
    tl.store(p_I1 + 2 * BC, b_0, mask=m_r1[:, None] & m_c2)
    tl.store(p_I1 + 3 * BC, b_0, mask=m_r1[:, None] & m_c3)
    tl.store(p_I2, b_Ai20, mask=m_r2[:, None])
    tl.store(p_I2 + BC, b_Ai21, mask=m_r2[:, None])
    tl.store(p_I2 + 2 * BC, b_X2, mask=m_r2[:, None])
    tl.store(p_I2 + 3 * BC, b_0, mask=m_r2[:, None])
    tl.store(p_I3, b_Ai30, mask=m_r3[:, None])
    tl.store(p_I3 + BC, b_Ai31, mask=m_r3[:, None])
    tl.store(p_I3 + 2 * BC, b_Ai32, mask=m_r3[:, None])
    tl.store(p_I3 + 3 * BC, b_X3, mask=m_r3[:, None])

    # right-hand sides beta k exp(G) (exp(G) <= 1: G is the decay from the chunk start) and beta v
    o_rk0 = ((bos + o_r0) * HV + i_h)[:, None] * K + o_k[None, :]
    o_rq0 = ((bos + o_r0) * H + i_hq)[:, None] * K + o_k[None, :]
    o_rk1 = ((bos + o_r1) * HV + i_h)[:, None] * K + o_k[None, :]
    o_rq1 = ((bos + o_r1) * H + i_hq)[:, None] * K + o_k[None, :]
    o_rk2 = ((bos + o_r2) * HV + i_h)[:, None] * K + o_k[None, :]
    o_rq2 = ((bos + o_r2) * H + i_hq)[:, None] * K + o_k[None, :]
    o_rk3 = ((bos + o_r3) * HV + i_h)[:, None] * K + o_k[None, :]
    o_rq3 = ((bos + o_r3) * H + i_hq)[:, None] * K + o_k[None, :]
    m_rk0, m_rk1 = m_r0[:, None] & m_k[None, :], m_r1[:, None] & m_k[None, :]
    m_rk2, m_rk3 = m_r2[:, None] & m_k[None, :], m_r3[:, None] & m_k[None, :]
    b_b0 = tl.load(beta + (bos + o_r0) * HV + i_h, mask=m_r0, other=0.0).to(tl.float32)[:, None]
    b_b1 = tl.load(beta + (bos + o_r1) * HV + i_h, mask=m_r1, other=0.0).to(tl.float32)[:, None]
    b_b2 = tl.load(beta + (bos + o_r2) * HV + i_h, mask=m_r2, other=0.0).to(tl.float32)[:, None]
    b_b3 = tl.load(beta + (bos + o_r3) * HV + i_h, mask=m_r3, other=0.0).to(tl.float32)[:, None]
    b_kb0 = b_b0 * tl.load(k + o_rq0, mask=m_rk0, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk0, mask=m_rk0, other=0.0))
    b_kb1 = b_b1 * tl.load(k + o_rq1, mask=m_rk1, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk1, mask=m_rk1, other=0.0))
    b_kb2 = b_b2 * tl.load(k + o_rq2, mask=m_rk2, other=0.0).to(tl.float32) * tl.exp(
        tl.load(G + o_rk2, mask=m_rk2, other=0.0))
    b_kb3 = b_b3 * tl.load(k + o_rq3, mask=m_rk3, other=0.0).to(tl.float32) * tl.exp(
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

    o_rv0 = ((bos + o_r0) * HV + i_h)[:, None] * V + o_v[None, :]
    o_rv1 = ((bos + o_r1) * HV + i_h)[:, None] * V + o_v[None, :]
    o_rv2 = ((bos + o_r2) * HV + i_h)[:, None] * V + o_v[None, :]
    o_rv3 = ((bos + o_r3) * HV + i_h)[:, None] * V + o_v[None, :]
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


@LazyKernel
def _kda_state_scan_kernel(
    k, w, u, G, h0, ht, h, v_new, cu_seqlens, chunk_offsets,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The only sequential part, one program per (V block, sequence, head): for each chunk, store the entering
    state S to h, v_new = u - w S, then S <- exp(G_last) S + (k exp(G_last - G))^T v_new. S stays fp32.
    i_h is the value head; k is read from head i_h // (HV // H)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hq = i_h // (HV // H)
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
        b_h += tl.load(h0 + (i_n * HV + i_h) * K * V + o_kv, mask=m_kv, other=0.0)
    for i_t in range(0, NT):
        tl.store(h + ((c0 + i_t) * HV + i_h) * K * V + o_kv, b_h, mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < L
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        o_tk = ((bos + o_t) * HV + i_h)[:, None] * K + o_k[None, :]
        o_tv = ((bos + o_t) * HV + i_h)[:, None] * V + o_v[None, :]
        b_w = tl.load(w + o_tk, mask=m_tk, other=0.0)
        b_u = tl.load(u + o_tv, mask=m_tv, other=0.0)
        b_vn = b_u - tl.dot(b_w, b_h, input_precision=DOT_PREC)
        tl.store(v_new + o_tv, b_vn, mask=m_tv)
        i_last = tl.minimum(i_t * BT + BT, L) - 1
        b_gl = tl.load(G + ((bos + i_last) * HV + i_h) * K + o_k, mask=m_k, other=0.0)
        b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
        b_k = tl.load(k + ((bos + o_t) * H + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_kd = b_k * tl.exp(tl.where(m_tk, b_gl[None, :] - b_g, NEG_INF))  # exp(G_last - G) <= 1
        b_h = b_h * tl.exp(b_gl)[:, None] + tl.dot(tl.trans(b_kd), b_vn, input_precision=DOT_PREC)
    if STORE_HT:
        tl.store(ht + (i_n * HV + i_h) * K * V + o_kv, b_h, mask=m_kv)


@LazyKernel
def _kda_output_kernel(
    q, G, Aqk, h, v_new, o, cu_seqlens, chunk_indices, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """o = (scale q exp G) S_chunk + tril(A_qk) v_new, one program per (V block, chunk, value head)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hq = i_h // (HV // H)
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
    o_tk = ((bos + o_t) * HV + i_h)[:, None] * K + o_k[None, :]
    o_tv = ((bos + o_t) * HV + i_h)[:, None] * V + o_v[None, :]
    b_q = tl.load(q + ((bos + o_t) * H + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_g = tl.load(G + o_tk, mask=m_tk, other=0.0)
    b_qg = b_q * tl.exp(tl.where(m_tk, b_g, NEG_INF)) * scale
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_A = m_t[:, None] & (o_i[:, None] >= o_i[None, :])
    b_A = tl.load(Aqk + ((bos + o_t) * HV + i_h)[:, None] * BT + o_i[None, :], mask=m_A, other=0.0)
    b_vn = tl.load(v_new + o_tv, mask=m_tv, other=0.0)
    b_o = tl.dot(b_qg, b_h, input_precision=DOT_PREC) + tl.dot(b_A, b_vn, input_precision=DOT_PREC)
    tl.store(o + o_tv, b_o.to(o.dtype.element_ty), mask=m_tv)


@LazyKernel
def _kda_fused_recurrent_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, state_indices, scale, T,
    H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    L2_EPS: tl.constexpr, HAS_INDICES: tl.constexpr, HT_AT_INDEX: tl.constexpr, STATE_V_FIRST: tl.constexpr,
):
    """Token-by-token KDA for one (V block, sequence, value head); the [K, BV] state slice stays in registers
    and is written once at the end (ht may alias h0: each program reads and writes only its own slice).
    q, k are read from head i_h // (HV // H). With HAS_INDICES the state of sequence n is row
    state_indices[n] of h0 (a state pool) and, with HT_AT_INDEX (in place), of ht; a negative index is a
    padding slot: nothing is read or written (outputs stay as allocated: zeros). STATE_V_FIRST: states are
    [V, K] instead of [K, V]."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hq = i_h // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    i_s = i_n.to(tl.int64)
    if HAS_INDICES:
        i_s = tl.load(state_indices + i_n).to(tl.int64)
        eos = tl.where(i_s < 0, bos, eos)  # padding slot: no tokens, no state
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    if STATE_V_FIRST:
        o_st = o_v[None, :] * K + o_k[:, None]
    else:
        o_st = o_k[:, None] * V + o_v[None, :]
    m_s = m_kv & ((tl.zeros([BK, BV], dtype=tl.int64) + i_s) >= 0)  # padding slot: no state read or written
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + (i_s * HV + i_h) * K * V + o_st, mask=m_s, other=0.0)
    for i_t in range(bos, eos):
        o_tq = (i_t * H + i_hq) * K + o_k
        b_q = tl.load(q + o_tq, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + o_tq, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + (i_t * HV + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (i_t * HV + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_t * HV + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + L2_EPS)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + L2_EPS)
        b_h *= tl.exp(b_g)[:, None]  # g = -inf (a reset) gives exp = 0 exactly: the state is cleared
        b_delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
        b_h += b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_h * (b_q * scale)[:, None], 0)
        tl.store(o + (i_t * HV + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        if HT_AT_INDEX:
            tl.store(ht + (i_s * HV + i_h) * K * V + o_st, b_h, mask=m_s)
        else:
            tl.store(ht + (i_n.to(tl.int64) * HV + i_h) * K * V + o_st, b_h, mask=m_s)


# --------------------------------------------------------------------------------------------------
# Launchers: one per kernel (a stage of the pipeline; `kda_triton_twins.<stage>_ref` is its PyTorch twin, same
# signature), then the chunked forward and the decode step. `layout` = chunk_layout(...).
# --------------------------------------------------------------------------------------------------


def check_head_dims(K: int, V: int) -> None:
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels hold a head in registers: K, V <= {MAX_HEAD_DIM}, got {K}, {V}")


def scan_block_v(BK: int, BV: int) -> int:
    # the scans hold a [BK, BVS] fp32 state slice in registers: 32 columns keep K = 128 at 32 values a thread
    return min(BV, 64 if BK <= 64 else 32)


def gate_cumsum_fwd(g, layout):
    """Stage 1: G [B, T, HV, K] fp32, the within-chunk cumsum of max(g, GATE_FLOOR)."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, HV, K = g.shape
    G = torch.empty(B, T, HV, K, device=g.device, dtype=torch.float32)
    _kda_gate_cumsum_kernel[(chunk_indices.shape[0], HV)](g, G, cu, chunk_indices, HV=HV, K=K, BT=layout.chunk_size,
                                                          BK=block(K))
    return G


def gated_products_fwd(q, k, G, beta, scale, layout):
    """Stage 2: (A_kk, A_qk) [B, T, HV, BT] fp32; row t holds its chunk's row. Only the sub-blocks on or below
    the diagonal are written (the later stages read nothing else)."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, H, K = q.shape
    HV = G.shape[2]
    f32 = dict(device=q.device, dtype=torch.float32)
    Akk = torch.empty(B, T, HV, layout.chunk_size, **f32)
    Aqk = torch.empty(B, T, HV, layout.chunk_size, **f32)
    _kda_intra_fwd_kernel[(chunk_indices.shape[0], HV)](
        q, k, G, beta, Akk, Aqk, cu, chunk_indices, scale, H=H, HV=HV, K=K, BT=layout.chunk_size, BC=SUB_CHUNK,
        BK=block(K), DOT_PREC=layout.dot_precision)
    return Akk, Aqk


def wy_solve_fwd(k, v, G, beta, Akk, layout):
    """Stage 3: (Ai = (I + A_kk)^-1 [B, T, HV, BT] with zeros above the diagonal, w [B, T, HV, K],
    u [B, T, HV, V]), fp32."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    f32 = dict(device=k.device, dtype=torch.float32)
    Ai = torch.empty(B, T, HV, layout.chunk_size, **f32)
    w = torch.empty(B, T, HV, K, **f32)
    u = torch.empty(B, T, HV, V, **f32)
    _kda_solve_wu_kernel[(chunk_indices.shape[0], HV)](
        k, v, G, beta, Akk, Ai, w, u, cu, chunk_indices, H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BC=SUB_CHUNK,
        BK=block(K), BV=block(V), DOT_PREC=layout.dot_precision)
    return Ai, w, u


def state_scan_fwd(k, w, u, G, initial_state, output_final_state, layout):
    """Stage 4: states entering every chunk h [NC, HV, K, V], v_new [B, T, HV, V] and the final state
    [N, HV, K, V] (None unless output_final_state), fp32."""
    cu, chunk_indices, chunk_offsets = layout[:3]
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    N, NC = cu.numel() - 1, chunk_indices.shape[0]
    BK, BV = block(K), block(V)
    f32 = dict(device=k.device, dtype=torch.float32)
    BVS = scan_block_v(BK, BV)
    h = torch.empty(NC, HV, K, V, **f32)  # state entering each chunk
    v_new = torch.empty(B, T, HV, V, **f32)
    ht = torch.empty(N, HV, K, V, **f32) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    _kda_state_scan_kernel[(triton.cdiv(V, BVS), N, HV)](
        k, w, u, G, h0 if h0 is not None else h, ht if ht is not None else h, h, v_new, cu, chunk_offsets,
        H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BVS, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        DOT_PREC=layout.dot_precision, num_warps=4, num_stages=SCAN_NUM_STAGES)
    return h, v_new, ht


def output_fwd(q, G, Aqk, h, v_new, scale, layout, dtype):
    """Stage 5: o [B, T, HV, V] in `dtype` (v's)."""
    cu, chunk_indices = layout.cu_seqlens, layout.chunk_indices
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, device=q.device, dtype=dtype)
    BVO = min(block(V), 64)
    _kda_output_kernel[(triton.cdiv(V, BVO), chunk_indices.shape[0], HV)](
        q, G, Aqk, h, v_new, o, cu, chunk_indices, scale, H=H, HV=HV, K=K, V=V, BT=layout.chunk_size, BK=block(K),
        BV=BVO, DOT_PREC=layout.dot_precision)
    return o


def chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, layout):
    """Chunked forward on contiguous inputs (q, k already normalised if asked): the five stages. Returns o,
    the final state, the chunk states h and what the backward reuses: (G, A_qk, Ai = (I + A_kk)^-1, w, u)."""
    check_head_dims(q.shape[-1], v.shape[-1])
    G = gate_cumsum_fwd(g, layout)
    Akk, Aqk = gated_products_fwd(q, k, G, beta, scale, layout)
    Ai, w, u = wy_solve_fwd(k, v, G, beta, Akk, layout)
    del Akk
    h, v_new, ht = state_scan_fwd(k, w, u, G, initial_state, output_final_state, layout)
    o = output_fwd(q, G, Aqk, h, v_new, scale, layout, v.dtype)
    return o, ht, h, (G, Aqk, Ai, w, u)


def fused_recurrent_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                             cu_seqlens, inplace_final_state, ssm_state_indices=None, state_v_first=False):
    """Decode launcher: one program per (V block, sequence, value head). Returns o and the final state (None
    unless asked); with inplace_final_state the final state is written into initial_state and that tensor
    returned. With ssm_state_indices [N], initial_state is a pool [P, HV, K, V] and sequence n uses row
    ssm_state_indices[n] (negative: padding, skipped: o = 0 there, the pool row untouched)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    check_head_dims(K, V)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    indices = ssm_state_indices
    o = (torch.zeros if indices is not None else torch.empty)(B, T, HV, V, device=q.device, dtype=v.dtype)
    inplace = inplace_final_state and initial_state is not None and initial_state.is_contiguous()
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if inplace:
        ht = initial_state
    elif output_final_state:
        # padding slots write nothing: their rows are zeros (the state of a sequence with no tokens)
        ht = (torch.zeros if indices is not None else torch.empty)(shape, device=q.device, dtype=torch.float32)
    else:
        ht = None
    h0 = initial_state
    if h0 is not None and not h0.is_contiguous():
        h0 = h0.contiguous()
    BK = block(K)
    # 32 state columns a program: K = 128 costs 32 fp32 registers a thread, and B * H * V / 32 programs
    # (512 at B = 1, H = 16, V = 128) are enough to stream the state at full bandwidth
    BV = min(block(V), 32)
    _kda_fused_recurrent_kernel[(triton.cdiv(V, BV), N, HV)](
        q, k, v, g, beta, o, h0 if h0 is not None else o, ht if ht is not None else o,
        cu_seqlens if cu_seqlens is not None else o, indices if indices is not None else o, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, USE_QK_L2NORM=use_qk_l2norm, L2_EPS=L2NORM_EPS,
        HAS_INDICES=indices is not None, HT_AT_INDEX=inplace and indices is not None, STATE_V_FIRST=state_v_first)
    return o, (ht if output_final_state else None)
