"""Triton KDA kernels against the token-by-token fp32 reference.

On CUDA the kernels run compiled (and are also checked in bf16); without CUDA they run in the Triton
interpreter (fp32 only, slow: shapes stay small). `kda_triton` applies `triton.jit` at the first launch, so
setting TRITON_INTERPRET here works whether or not `kda_hybrid` was imported earlier in the session; the
variable is set only while these tests run (module fixture), not for the rest of the suite.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from kda_hybrid import chunk_kda, fused_recurrent_kda, kda_ops, kda_triton_twins
from kda_hybrid.kda_torch import chunk_kda_torch, recurrent_kda_reference

from .helpers import (
    GRAD_NAMES,
    assert_all_close,
    assert_close_rel,
    assert_matches_reference,
    assert_same_nonfinite_then_close,
    chunk_grads,
    make_inputs,
    max_err,
    op_grads,
)

pytestmark = pytest.mark.triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

if not kda_ops.triton_available():
    pytest.skip(f"Triton kernels unavailable: {kda_ops._TRITON_IMPORT_ERROR!r}", allow_module_level=True)

from kda_hybrid import kda_triton, kda_triton_fwd, kda_triton_runtime  # noqa: E402  (importable: checked just above)


def _make_stdlib_interpretable(mp):
    """triton.language's own @jit helpers (tl.sum, tl.cumsum, ...) were decorated when triton was imported;
    if that happened before TRITON_INTERPRET=1 (fla imports triton while another test module is collected),
    they are compiled-mode JITFunctions that refuse to run inside an interpreted kernel. Swap them, for this
    module only, for interpreted twins of the same Python functions. Private combine functions stay: the
    interpreter recognises tl.standard._sum_combine by identity to reduce with numpy."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for mod in (tl, tl.standard):
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and not name.startswith("_"):
                mp.setattr(mod, name, InterpretedFunction(obj.fn))


@pytest.fixture(autouse=True, scope="module")
def _triton_mode():
    """Interpreter on CPU, for the duration of this module only."""
    if CUDA:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        _make_stdlib_interpretable(mp)
        yield


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch):
    """Every float tensor from torch.empty / empty_like starts as NaN, so a tile a kernel forgets to write
    (or a masked row it reads) shows up as NaN in the result."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(fn):
        def wrapper(*args, **kwargs):
            x = fn(*args, **kwargs)
            return x.fill_(float("nan")) if x.is_floating_point() else x
        return wrapper

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))


def to_device(xs):
    return [None if x is None else x.to(DEVICE) for x in xs]


# Sizes: T not a multiple of the chunk (1, 17, 100) and exactly one chunk (64); K != V; the interpreter
# runs about 1 s per 64-token chunk and head, which bounds the list.
FWD_CASES = [
    pytest.param(2, 1, 1, 16, 16, False, False, id="B2-T1-H1-K16-V16"),
    pytest.param(1, 17, 2, 16, 32, True, True, id="B1-T17-H2-K16-V32-h0-l2"),
    pytest.param(2, 64, 1, 32, 16, True, False, id="B2-T64-H1-K32-V16-h0"),
    pytest.param(1, 100, 2, 32, 32, False, True, id="B1-T100-H2-K32-V32-l2"),
]


@pytest.mark.parametrize("B,T,H,K,V,init_state,l2norm", FWD_CASES)
def test_chunk_forward_matches_reference(B, T, H, K, V, init_state, l2norm):
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=init_state))
    if l2norm:  # un-normalised keys, so the fused norm matters
        k = k * torch.linspace(0.5, 3.0, K, device=DEVICE)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o, s = chunk_kda(q, k, v, g, beta, backend="triton", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close_rel(o, o_ref, name="o")
    assert_close_rel(s, s_ref, name="final state")


@pytest.mark.parametrize("name,value", [("k", float("nan")), ("v", float("inf")), ("beta", float("nan"))])
def test_chunk_nonfinite_token_reaches_no_earlier_token(name, value):
    """A NaN or inf at t=40 of 70 tokens in one head (the interpreter had made all 70 outputs NaN): earlier outputs
    equal the reference's, later ones and the final state are non-finite where the reference's are."""
    xs = dict(zip(("q", "k", "v", "g", "beta"), to_device(make_inputs(1, 70, 2, 16, 16)[:5])))
    xs[name][0, 40, 0] = value  # head 1 stays finite
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(**xs, backend="triton", **kw)
    o_ref, s_ref = chunk_kda(**xs, backend="reference", **kw)
    assert_same_nonfinite_then_close(o, o_ref, name="o")
    assert_same_nonfinite_then_close(s, s_ref, name="final state")
    assert torch.isfinite(o[0, :40]).all()


def test_chunk_without_final_state_returns_none():
    q, k, v, g, beta, _ = to_device(make_inputs(1, 17, 1, 16, 16))
    o, s = kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25)
    o_ref, _ = recurrent_kda_reference(q, k, v, g, beta, 0.25)
    assert s is None
    assert_close_rel(o, o_ref)


@pytest.mark.parametrize("gate", [20.0], ids=["gate20"])
def test_chunk_strong_decay_is_finite_and_exact(gate):
    """g about -20 per token per channel: the cumulative decay reaches ~ -1000 inside a chunk."""
    q, k, v, g, beta, h0 = to_device(make_inputs(1, 100, 1, 16, 16, gate=gate, init_state=True))
    assert g.min() < -gate
    assert_matches_reference("triton", q, k, v, g, beta, h0)


def test_chunk_varlen_equals_per_sequence():
    """Chunks never cross a boundary: 5 + 64 + 70 tokens packed, each with its own initial state."""
    lens, H, K, V = (5, 64, 70), 1, 16, 16
    q, k, v, g, beta, _ = to_device(make_inputs(1, sum(lens), H, K, V))
    h0 = torch.randn(len(lens), H, K, V, device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, backend="triton", **kw)
    for i, (b, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, s_i = chunk_kda(q[:, b:e], k[:, b:e], v[:, b:e], g[:, b:e], beta[:, b:e],
                             initial_state=h0[i: i + 1], backend="reference", **kw)
        assert_close_rel(o[:, b:e], o_i, name=f"seq {i} o")
        assert_close_rel(s[i: i + 1], s_i, name=f"seq {i} state")


# Backward cases: T = 1, 17, 64, 100 (one token, partial chunk, exactly one chunk, chunk + partial), packed
# sequences (5 + 64 + 70), with and without initial state, l2norm and final-state gradient, and g about -20
# per token. Tolerance 2e-5 of each gradient's own max: measured against fp64 autograd of the recurrence, the
# kernels' dq, dk, dv, dbeta, dh0 are within ~2e-6 and dg within ~1.5e-5 at gate 20 (T = 130), the same as
# autograd through the chunked torch twin (1.4e-5 there): under strong decay dg is a reverse cumsum of
# per-token terms much larger than itself; the fp32 recurrence stays at ~1e-7.
GRAD_CASES = [
    pytest.param(2, 1, 1, 16, 16, True, True, True, 5.0, None, id="B2-T1-h0-l2"),
    pytest.param(1, 17, 2, 16, 16, True, True, True, 5.0, None, id="B1-T17-H2-h0-l2"),
    pytest.param(1, 64, 1, 32, 16, False, False, False, 1.0, None, id="B1-T64-K32-V16-raw-no-ht"),
    pytest.param(1, 100, 1, 16, 32, True, False, True, 1.0, None, id="B1-T100-K16-V32-h0"),
    pytest.param(1, None, 1, 16, 16, True, True, True, 1.0, (5, 64, 70), id="varlen-5-64-70-h0-l2"),
    pytest.param(1, 100, 1, 16, 16, True, True, True, 20.0, None, id="T100-gate20-h0-l2"),
]


@pytest.mark.parametrize("B,T,H,K,V,init_state,l2norm,final_state,gate,lens", GRAD_CASES)
def test_chunk_gradients_match_reference(B, T, H, K, V, init_state, l2norm, final_state, gate, lens):
    """All six gradients (q, k, v, g, beta, initial state) of the Triton backward, through the l2norm and the
    final state, against autograd of the token-by-token reference."""
    T = sum(lens) if lens else T
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=init_state, gate=gate))
    cu = None
    if lens:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        h0 = torch.randn(len(lens), H, K, V, device=DEVICE) if init_state else None
    if l2norm:  # un-normalised keys, so the norm's own gradient matters
        k = k * torch.linspace(0.5, 3.0, K, device=DEVICE)
    args = [x if x is None else x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    ds = torch.randn(B if cu is None else len(lens), H, K, V, generator=gen).to(DEVICE)

    kw = dict(output_final_state=final_state, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
    ds = ds if final_state else None
    got_all, ref_all = chunk_grads("triton", args, do, ds, **kw), chunk_grads("reference", args, do, ds, **kw)
    for name, got, ref in zip("q k v g beta h0".split(), got_all, ref_all):
        if ref is None:
            continue
        assert torch.isfinite(got).all(), name
        assert_close_rel(got, ref, rel=2e-5, name=f"d{name}")


def test_backward_runs_triton_kernels_only(monkeypatch):
    """The backward is the Triton one: the PyTorch twins are never called (they would make it 20x slower)."""
    from kda_hybrid import kda_torch

    def boom(*args, **kwargs):
        raise AssertionError("the Triton backward called a PyTorch KDA implementation")

    for name in ("chunk_kda_torch", "_chunk_fwd", "recurrent_kda_reference", "_recurrent"):
        monkeypatch.setattr(kda_torch, name, boom)
        monkeypatch.setattr(kda_triton, name, boom, raising=False)  # also a name imported into kda_triton
    args = [x.detach().requires_grad_() for x in to_device(make_inputs(1, 17, 1, 16, 16, init_state=True))]
    o, s = kda_triton.chunk_kda_triton(*args[:5], 0.25, args[5], True)
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in args)


@pytest.mark.slow
def test_chunk_gradients_long_multi_head():
    """Several chunks per sequence and heads, K != V, every gradient."""
    B, T, H, K, V = 2, 200, 2, 32, 16
    args = [x.detach().requires_grad_() for x in to_device(make_inputs(B, T, H, K, V, init_state=True, gate=3.0))]
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    ds = torch.randn(B, H, K, V, generator=gen).to(DEVICE)

    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    got_all, ref_all = chunk_grads("triton", args, do, ds, **kw), chunk_grads("reference", args, do, ds, **kw)
    assert_all_close(got_all, ref_all, GRAD_NAMES, rel=2e-5)


def test_decode_in_place_token_by_token_equals_chunked():
    """The decode kernel, one token a step, updating the caller's state tensor in place."""
    B, T, H, K, V = 2, 17, 2, 32, 16
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_full, s_full = chunk_kda(q, k, v, g, beta, initial_state=h0, backend="triton", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, backend="reference", **kw)
    state, outs = h0.clone(), []
    for t in range(T):
        sl = slice(t, t + 1)
        o_t, s_t = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                                       inplace_final_state=True, backend="triton", **kw)
        assert s_t.data_ptr() == state.data_ptr()
        outs.append(o_t)
    assert_close_rel(torch.cat(outs, 1), o_ref, name="decode o")
    assert_close_rel(state, s_ref, name="decode state")
    assert_close_rel(o_full, o_ref, name="chunk o")
    assert_close_rel(state, s_full, name="decode vs chunk state")


def test_decode_multi_token_varlen_and_state_left_alone():
    """Several tokens per call, packed sequences; without inplace_final_state the input state is untouched."""
    lens, H, K, V = (3, 1, 6), 2, 16, 32
    q, k, v, g, beta, _ = to_device(make_inputs(1, sum(lens), H, K, V))
    h0 = torch.randn(len(lens), H, K, V, device=DEVICE)
    h0_copy = h0.clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o, s = fused_recurrent_kda(q, k, v, g, beta, backend="triton", **kw)
    o_ref, s_ref = fused_recurrent_kda(q, k, v, g, beta, backend="reference", **kw)
    assert torch.equal(h0, h0_copy)
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)
    o2, s2 = fused_recurrent_kda(q, k, v, g, beta, backend="triton", **kw, inplace_final_state=True)
    assert s2.data_ptr() == h0.data_ptr()
    assert_close_rel(h0, s_ref)


def test_decode_needing_grad_falls_back_to_chunk():
    args = to_device(make_inputs(1, 3, 1, 16, 16, init_state=True))
    args = [x.detach().requires_grad_() for x in args]
    o, s = fused_recurrent_kda(*args[:5], initial_state=args[5], output_final_state=True, backend="triton")
    (o.sum() + s.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in args)


# ------------------------------------------------------------------------------------------------
# CUDA only: 16-bit inputs. Bound: the kernel's error against the fp32 reference on the original fp32
# inputs may be at most 2x (+ a floor at output rounding) the error of the exact-fp32 torch path fed the
# same 16-bit-rounded inputs (flash-attention's rule): what is left is the kernel's own rounding.
# ------------------------------------------------------------------------------------------------



@pytest.mark.skipif(not CUDA, reason="16-bit kernels need CUDA (the interpreter is fp32 only)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [100, 1000])
def test_chunk_low_precision_error_bound(T, dtype):
    B, H, K, V = 2, 4, 128, 128
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    low = [x.to(dtype) for x in (q, k, v, g, beta)]
    o, s = chunk_kda(*low, backend="triton", **kw)
    o_t, s_t = chunk_kda_torch(*low, K ** -0.5, h0, True, True)
    assert o.dtype == dtype and s.dtype == torch.float32
    floor = torch.finfo(dtype).eps * o_ref.abs().max().item()
    assert max_err(o, o_ref) <= 2 * max_err(o_t, o_ref) + floor
    assert max_err(s, s_ref) <= 2 * max_err(s_t, s_ref) + 1e-3 * s_ref.abs().max().item()


@pytest.mark.skipif(not CUDA, reason="16-bit kernels need CUDA (the interpreter is fp32 only)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunk_backward_low_precision_error_bound(dtype):
    """Every gradient on 16-bit inputs: the Triton backward (tf32 products) against autograd of the fp32
    reference may be off by at most 2x the chunked torch twin's error on the same 16-bit inputs, plus the
    rounding of the 16-bit gradient itself."""
    B, T, H, K, V = 2, 300, 4, 128, 128
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True))
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(B, T, H, V, generator=gen).to(DEVICE)
    ds = torch.randn(B, H, K, V, generator=gen).to(DEVICE)

    def grads(fn, cast):
        """op_grads on the inputs cast to `cast` (the state stays fp32), the output compared in fp32."""
        xs = [x.detach().to(cast).requires_grad_() for x in (q, k, v, g, beta)] + [h0.detach().requires_grad_()]

        def run():
            o, s = fn(*xs)
            return o.float(), s

        return [x.float() for x in op_grads(run, xs, do, ds)[2]]

    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = grads(lambda *x: chunk_kda(*x[:5], initial_state=x[5], backend="reference", **kw), torch.float32)
    tri = grads(lambda *x: chunk_kda(*x[:5], initial_state=x[5], backend="triton", **kw), dtype)
    twin = grads(lambda *x: chunk_kda_torch(*x[:5], K ** -0.5, x[5], True, True), dtype)
    for name, a, b, t in zip("q k v g beta h0".split(), tri, ref, twin):
        floor = torch.finfo(dtype).eps * b.abs().max().item()
        assert max_err(a, b) <= 2 * max_err(t, b) + floor, name


@pytest.mark.skipif(not CUDA, reason="16-bit kernels need CUDA (the interpreter is fp32 only)")
def test_decode_bf16_in_place():
    B, T, H, K, V = 4, 8, 4, 128, 128
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True))
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, backend="reference", **kw)
    low = [x.bfloat16() for x in (q, k, v, g, beta)]
    o_t, s_t = chunk_kda_torch(*low, K ** -0.5, h0, True, True)
    state, outs = h0.clone(), []
    for t in range(T):
        o_i, _ = fused_recurrent_kda(*(x[:, t: t + 1] for x in low), initial_state=state,
                                     inplace_final_state=True, backend="triton", **kw)
        outs.append(o_i)
    o = torch.cat(outs, 1)
    floor = torch.finfo(torch.bfloat16).eps * o_ref.abs().max().item()
    assert max_err(o, o_ref) <= 2 * max_err(o_t, o_ref) + floor
    assert max_err(state, s_ref) <= 2 * max_err(s_t, s_ref) + 1e-5 * s_ref.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("T", [300, 1000] if CUDA else [200])
def test_chunk_long_sequences(T):
    q, k, v, g, beta, h0 = to_device(make_inputs(2, T, 2, 32, 32, init_state=True))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, backend="triton", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)


def test_interpreter_env_is_scoped():
    """Outside CUDA this module runs kernels in the interpreter; the variable is visible to them."""
    if not CUDA:
        assert os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------------
# Without a GPU: compile every kernel for sm_90 (H100/H200) with triton's bundled ptxas, so type errors
# and shared-memory overruns that the interpreter cannot see show up on CPU. Runs in a subprocess: this
# module's interpreter mode must not leak into the compiler.
# ------------------------------------------------------------------------------------------------

SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on sm_90


def _compile_all_for_sm90(dtype: str) -> list[str]:
    """Compile the nine KDA kernels (six forward, three backward) at K = V = 128 for `dtype` inputs, with the
    launchers' warps and stages, and the WY solve's chunk_size-32 form, and the MXFP4 matmul at both of its row
    tiles; returns one line per kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kda_hybrid import kda_triton_bwd as ktb

    kt = kda_triton_fwd
    prec = "ieee" if dtype == "fp32" else "tf32"
    fp32_buffers = ("G", "Akk", "Aqk", "Ai", "w", "u", "h0", "ht", "h", "v_new", "dht", "dh0", "dh", "dv_new",
                    "dq", "dk", "dbeta", "dG", "dAqk", "dAkk")
    types = dict(cu_seqlens="*i32", chunk_indices="*i32", chunk_offsets="*i32", state_indices="*i32", scale="fp32",
                 T="i32", H="i32", HV="i32",
                 **{n: "*fp32" for n in fp32_buffers})
    base = dict(K=128, BT=64, BK=128)
    jobs = [
        (kt._kda_gate_cumsum_kernel, base, 3),
        (kt._kda_intra_fwd_kernel, dict(base, BC=16, DOT_PREC=prec), 3),
        (kt._kda_solve_wu_kernel, dict(base, V=128, BC=16, BV=128, DOT_PREC=prec), 3),
        (kt._kda_solve_wu_kernel, dict(base, BT=32, V=128, BC=16, BV=128, DOT_PREC=prec), 3),  # chunk_size 32
        (kt._kda_state_scan_kernel, dict(base, V=128, BV=32, HAS_H0=True, STORE_HT=True, DOT_PREC=prec),
         kt.SCAN_NUM_STAGES),
        (kt._kda_output_kernel, dict(base, V=128, BV=64, DOT_PREC=prec), 3),
        (kt._kda_fused_recurrent_kernel, dict(K=128, V=128, BK=128, BV=32, IS_VARLEN=False, HAS_H0=True,
                                              STORE_HT=True, USE_QK_L2NORM=True, L2_EPS=1e-6, HAS_INDICES=True,
                                              HT_AT_INDEX=True, STATE_V_FIRST=False), 3),
        (ktb._kda_state_bwd_kernel, dict(base, V=128, BV=32, HAS_DHT=True, STORE_DH0=True, DOT_PREC=prec),
         kt.STATE_BWD_NUM_STAGES),
        (ktb._kda_chunk_bwd_kernel, dict(base, V=128, BV=kt.CHUNK_BWD_BV, DOT_PREC=prec),
         kt.CHUNK_BWD_NUM_STAGES, kt.CHUNK_BWD_NUM_WARPS),
        (ktb._kda_intra_bwd_kernel, dict(base, BC=16, DOT_PREC=prec), 3),
    ]
    from kda_hybrid import mxfp4_triton

    mx_types = dict(packed="*u8", scale="*u8", M="i32", N="i32", K="i32", stride_xm="i32", stride_ym="i32")
    jobs += [(mxfp4_triton._mxfp4_matmul_kernel, dict(BM=bm, BN=64, BK=mxfp4_triton.BLOCK_K, DOT_PREC=prec), 3)
             for bm in (16, 64)]  # the launcher's two row tiles (decode, prefill)
    lines = []
    for lazy, consts, stages, *warps in jobs:
        fn = triton.jit(lazy.fn)
        own = mx_types if lazy is mxfp4_triton._mxfp4_matmul_kernel else types
        sig = {n: "constexpr" if n in consts else own.get(n, "*" + dtype) for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=warps[0] if warps else 4, num_stages=stages))
        shared = kernel.metadata.shared
        assert shared <= SM90_MAX_SHARED, f"{lazy.fn.__name__} needs {shared} B of shared memory"
        lines.append(f"{lazy.fn.__name__} shared={shared}")
    return lines


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on CUDA the kernels are compiled and run by the other tests")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_sm90(dtype):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from tests.test_triton import _compile_all_for_sm90; "
            f"print('\\n'.join(_compile_all_for_sm90({dtype!r})))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert run.returncode == 0, run.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# Stage twins: every Triton stage launcher against its PyTorch twin in kda_triton_twins (same signature), fed the
# same inputs (the twins' own intermediates), so that a wrong result points at one kernel. Grouped value
# heads (H = 1, HV = 2) in every stage, packed sequences of 5 and 70 tokens (a partial chunk, a whole chunk,
# a 6-token tail), g about -20 per token in one head's tokens (strong decay) and one g = -inf reset.
# ------------------------------------------------------------------------------------------------

STAGE_LENS = (5, 70)


def _stage_inputs():
    H, HV, K, V = 1, 2, 16, 32
    T = sum(STAGE_LENS)
    q, k, v, g, beta, _ = make_inputs(1, T, HV, K, V, seed=3)
    q, k = q[:, :, :H], k[:, :, :H]
    g[:, :, 1] = g[:, :, 1] * 20.0  # value head 1: strong decay
    g[0, 40, 0] = float("-inf")  # a full reset of value head 0 inside the second sequence's first chunk
    cu = torch.tensor([0, *torch.tensor(STAGE_LENS).cumsum(0).tolist()], dtype=torch.int32)
    h0 = torch.randn(len(STAGE_LENS), HV, K, V, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, T, HV, V, generator=gen)
    dht = torch.randn(len(STAGE_LENS), HV, K, V, generator=gen)
    return [x.to(DEVICE).contiguous() for x in (q, k, v, g, beta, h0, cu, do, dht)]  # launchers take contiguous


def _twin_intermediates(chunk_size):
    """Every intermediate of the forward and backward, from the twins."""
    q, k, v, g, beta, h0, cu, do, dht = _stage_inputs()
    st, scale = kda_triton_twins, 0.25
    layout = kda_triton_runtime.chunk_layout(cu, 1, q.shape[1], q.device, chunk_size=chunk_size)
    G = st.gate_cumsum_ref(g, layout)
    Akk, Aqk = st.gated_products_ref(q, k, G, beta, scale, layout)
    Ai, w, u = st.wy_solve_ref(k, v, G, beta, Akk, layout)
    h, v_new, ht = st.state_scan_ref(k, w, u, G, h0, True, layout)
    o = st.output_ref(q, G, Aqk, h, v_new, scale, layout, v.dtype)
    dh, dv_new, dh0 = st.state_scan_bwd_ref(q, k, w, G, Aqk, do, dht, scale, layout, True)
    dq, dk, dv, dbeta, dG, dAqk, dAkk = st.chunk_bwd_ref(q, k, v, G, beta, h, dh, v_new, dv_new, w, u, Ai, do,
                                                         scale, layout)
    dq2, dk2, dbeta2, dg = st.gated_products_bwd_ref(q, k, g, G, beta, dAqk, dAkk, dq, dk, dbeta, dG, scale,
                                                     layout)
    return {name: value for name, value in locals().items() if name not in ("st",)}


@pytest.fixture(scope="module")
def stage_data():
    return _twin_intermediates(64)


def _lower_mask(layout, T, strict):
    """[1, T, 1, BT]: the columns of each row's chunk row that the kernels read (c <= position of the row in
    its chunk, c < it if strict)."""
    mask = torch.zeros(1, T, 1, layout.chunk_size, dtype=torch.bool)
    for sl, _, _ in kda_triton_twins._chunks(layout):
        for p, t in enumerate(range(sl.start, sl.stop)):
            mask[0, t, 0, : p + (0 if strict else 1)] = True
    return mask.to(DEVICE)


def _check_stage(name, got, ref, rel=1e-5, mask=None):
    if mask is not None:
        got, ref = torch.where(mask, got, 0.0), torch.where(mask, ref, 0.0)
    assert torch.isfinite(got).all(), f"{name}: non-finite values (an unwritten tile or a NaN exponent)"
    assert_close_rel(got, ref, rel=rel, name=name)


def test_twin_pipeline_matches_reference(stage_data):
    """The twins composed end to end equal the token-by-token reference (o, final state, every gradient), so
    they are oracles worth testing the kernels against. GVA: the reference gets q, k repeated per value head."""
    d = stage_data
    q, k, v, g, beta, h0 = (d[n].detach().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0"))
    rep = v.shape[2] // q.shape[2]
    o, s = recurrent_kda_reference(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta, 0.25,
                                   h0, True, cu_seqlens=d["cu"])
    ((o * d["do"]).sum() + (s * d["dht"]).sum()).backward()
    assert_close_rel(d["o"], o, name="o")
    assert_close_rel(d["ht"], s, name="final state")
    B, T, H, K = q.shape
    dq = d["dq2"].view(B, T, H, rep, K).sum(3)
    dk = d["dk2"].view(B, T, H, rep, K).sum(3)
    for name, got, ref in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", d["dv"], v.grad),
                           ("dg", d["dg"], g.grad), ("dbeta", d["dbeta2"], beta.grad), ("dh0", d["dh0"], h0.grad)):
        assert torch.isfinite(ref).all(), name
        assert_close_rel(got, ref, rel=2e-5, name=name)


def test_stage_gate_cumsum(stage_data):
    d = stage_data
    _check_stage("G", kda_triton_fwd.gate_cumsum_fwd(d["g"], d["layout"]), d["G"])


def test_stage_gated_products(stage_data):
    d = stage_data
    Akk, Aqk = kda_triton_fwd.gated_products_fwd(d["q"], d["k"], d["G"], d["beta"], d["scale"], d["layout"])
    T = d["q"].shape[1]
    _check_stage("A_kk", Akk, d["Akk"], mask=_lower_mask(d["layout"], T, strict=True))
    _check_stage("A_qk", Aqk, d["Aqk"], mask=_lower_mask(d["layout"], T, strict=False))


def test_stage_wy_solve(stage_data):
    d = stage_data
    Ai, w, u = kda_triton_fwd.wy_solve_fwd(d["k"], d["v"], d["G"], d["beta"], d["Akk"], d["layout"])
    for name, got in (("Ai", Ai), ("w", w), ("u", u)):
        _check_stage(name, got, d[name])


def test_stage_state_scan(stage_data):
    d = stage_data
    h, v_new, ht = kda_triton_fwd.state_scan_fwd(d["k"], d["w"], d["u"], d["G"], d["h0"], True, d["layout"])
    for name, got in (("h", h), ("v_new", v_new), ("ht", ht)):
        _check_stage(name, got, d[name])


def test_stage_output(stage_data):
    d = stage_data
    o = kda_triton_fwd.output_fwd(d["q"], d["G"], d["Aqk"], d["h"], d["v_new"], d["scale"], d["layout"], d["v"].dtype)
    _check_stage("o", o, d["o"])


def test_stage_state_scan_bwd(stage_data):
    from kda_hybrid import kda_triton_bwd

    d = stage_data
    dh, dv_new, dh0 = kda_triton_bwd._state_scan_bwd(d["q"], d["k"], d["w"], d["G"], d["Aqk"], d["do"], d["dht"],
                                                     d["scale"], d["layout"], True)
    for name, got in (("dh", dh), ("dv_new", dv_new), ("dh0", dh0)):
        _check_stage(name, got, d[name])


def test_stage_chunk_bwd(stage_data):
    from kda_hybrid import kda_triton_bwd

    d = stage_data
    outs = kda_triton_bwd._chunk_bwd(*(d[n] for n in ("q", "k", "v", "G", "beta", "h", "dh", "v_new", "dv_new",
                                                      "w", "u", "Ai", "do", "scale", "layout")))
    T = d["q"].shape[1]
    masks = dict(dAqk=_lower_mask(d["layout"], T, strict=False), dAkk=_lower_mask(d["layout"], T, strict=True))
    for name, got in zip(("dq", "dk", "dv", "dbeta", "dG", "dAqk", "dAkk"), outs):
        _check_stage(name, got, d[name], rel=2e-5 if name == "dG" else 1e-5, mask=masks.get(name))


def test_stage_gated_products_bwd(stage_data):
    from kda_hybrid import kda_triton_bwd

    d = stage_data
    ins = [d[n].clone() for n in ("dq", "dk", "dbeta", "dG")]  # updated in place by the kernel
    outs = kda_triton_bwd._gated_products_bwd(d["q"], d["k"], d["g"], d["G"], d["beta"], d["dAqk"], d["dAkk"],
                                              *ins, d["scale"], d["layout"])
    for name, got in zip(("dq2", "dk2", "dbeta2", "dg"), outs):
        _check_stage(name, got, d[name], rel=2e-5 if name == "dg" else 1e-5)


# ------------------------------------------------------------------------------------------------
# fla's options on the Triton entry points (issue 17) and g = -inf resets (issue 14), against fla's naive
# references (fla.ops.kda.naive / gate) and our token-by-token reference, outputs and every gradient.
# ------------------------------------------------------------------------------------------------


def _compare_all(got, ref, names, rel=2e-5):
    o, s, grads = got
    o_ref, s_ref, grads_ref = ref
    assert_close_rel(o, o_ref, name="o")
    if s_ref is not None:
        assert_close_rel(s, s_ref, name="final state")
    assert_all_close(grads, grads_ref, [f"d{name}" for name in names], rel=rel)


def test_reset_gate_minus_inf_chunk_and_decode():
    """g = -inf (a full reset: the state is cleared) at a token inside a chunk, at a chunk's first token, and in
    one channel only: the Triton chunk path (output, final state, all gradients) and the decode kernel give the
    reference's result, no NaN."""
    B, T, H, K, V = 1, 70, 1, 16, 16
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True, seed=7))
    g[0, 3, 0, :] = float("-inf")
    g[0, 64, 0, :] = float("-inf")
    g[0, 69, 0, 5] = float("-inf")
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(8)
    do, dht = torch.randn(B, T, H, V, generator=gen).to(DEVICE), torch.randn(B, H, K, V, generator=gen).to(DEVICE)

    def run(fn):
        return lambda: fn(*leaves[:5], 0.25, leaves[5], True)

    got = op_grads(run(kda_triton.chunk_kda_triton), leaves, do, dht)
    ref = op_grads(run(recurrent_kda_reference), leaves, do, dht)
    assert torch.isfinite(ref[2][3]).all()
    _compare_all(got, ref, "q k v g beta h0".split())
    with torch.no_grad():
        o, s = kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, 0.25, h0, True)
    assert_close_rel(o, ref[0], name="decode o")
    assert_close_rel(s, ref[1], name="decode state")


def test_triton_entry_points_reject_float64_and_unknown_chunk_size():
    q, k, v, g, beta, _ = make_inputs(1, 3, 1, 16, 16, dtype=torch.float64)
    for fn in (kda_triton.chunk_kda_triton, kda_triton.fused_recurrent_kda_triton):
        with pytest.raises(TypeError, match="float64"):
            fn(q, k, v, g, beta, 0.25)
    q, k, v, g, beta, _ = make_inputs(1, 3, 1, 16, 16)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64 for KDA, got 48"):
        kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25, chunk_size=48)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25, allow_neg_eigval=True)


def _fla_naive():
    naive = pytest.importorskip("fla.ops.kda.naive")
    gate = pytest.importorskip("fla.ops.kda.gate")
    return naive, gate


# (gate form, beta form): raw g through fla's gate, beta through sigmoid (2 sigmoid with allow_neg_eigval)
OPTION_CASES = [
    pytest.param("softplus", None, id="gva-gate-softplus"),
    pytest.param("lower_bound", "sigmoid", id="gva-gate-lowerbound-beta-sigmoid"),
    pytest.param("lower_bound_no_A", "neg_eigval", id="gva-gate-lowerbound-noA-neg-eigval"),
]


@pytest.mark.parametrize("gate_form,beta_form", OPTION_CASES)
def test_chunk_options_match_fla_naive(gate_form, beta_form):
    """GVA (H = 1, HV = 2), use_gate_in_kernel with A_log / dt_bias (both gate forms), use_beta_sigmoid_in_kernel
    and allow_neg_eigval, against fla's naive_kda_gate / naive_kda_lowerbound_gate + naive_recurrent_kda:
    output, final state and the gradients of q, k, v, raw g, raw beta, A_log, dt_bias, h0."""
    naive, gate = _fla_naive()
    B, T, H, HV, K, V = 1, 20, 1, 2, 16, 16
    q, k, v, g, beta, h0 = make_inputs(B, T, HV, K, V, init_state=True, seed=9)
    q, k = q[:, :, :H].contiguous(), k[:, :, :H].contiguous()
    gen = torch.Generator().manual_seed(10)
    g_raw = torch.randn(B, T, HV, K, generator=gen)
    beta_raw = torch.randn(B, T, HV, generator=gen) if beta_form else beta
    A_log = torch.randn(HV, generator=gen) * 0.5
    dt_bias = torch.randn(HV * K, generator=gen) * 0.5
    do, dht = torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)
    lower_bound = None if gate_form == "softplus" else -3.0
    use_A = gate_form != "lower_bound_no_A"
    leaves = [x.requires_grad_() for x in to_device((q, k, v, g_raw, beta_raw, h0, dt_bias))]
    a_log = to_device([A_log])[0].requires_grad_() if use_A else None
    leaves_all = leaves + ([a_log] if use_A else [])
    do, dht = to_device((do, dht))

    def ours():
        return kda_triton.chunk_kda_triton(
            *leaves[:5], 0.25, leaves[5], True, use_gate_in_kernel=True, A_log=a_log, dt_bias=leaves[6],
            lower_bound=lower_bound, use_beta_sigmoid_in_kernel=beta_form is not None,
            allow_neg_eigval=beta_form == "neg_eigval")

    def fla():
        if lower_bound is None:
            g_act = gate.naive_kda_gate(leaves[3], a_log, leaves[6])
        else:
            g_act = gate.naive_kda_lowerbound_gate(leaves[3], a_log, leaves[6], lower_bound=lower_bound)
        b = leaves[4]
        if beta_form is not None:
            b = torch.sigmoid(b) * (2.0 if beta_form == "neg_eigval" else 1.0)
        return naive.naive_recurrent_kda(leaves[0], leaves[1], leaves[2], g_act, b, 0.25, leaves[5], True)

    names = "q k v g beta h0 dt_bias".split() + (["A_log"] if use_A else [])
    _compare_all(op_grads(ours, leaves_all, do, dht), op_grads(fla, leaves_all, do, dht), names)


def test_decode_options_gva_gate_state_v_first_match_fla_naive():
    """The decode kernel with GVA, the in-kernel gate, beta sigmoid and state_v_first ([N, HV, V, K] states),
    varlen, in place, against fla's naive gate + naive_recurrent_kda per sequence."""
    naive, gate = _fla_naive()
    lens, H, HV, K, V = (3, 1, 4), 1, 2, 16, 32
    T = sum(lens)
    q, k, v, _, _, _ = to_device(make_inputs(1, T, HV, K, V, seed=11))
    q, k = q[:, :, :H].contiguous(), k[:, :, :H].contiguous()
    gen = torch.Generator().manual_seed(12)
    g_raw, beta_raw = to_device((torch.randn(1, T, HV, K, generator=gen), torch.randn(1, T, HV, generator=gen)))
    A_log, dt_bias = to_device((torch.randn(HV, generator=gen) * 0.5, torch.randn(HV * K, generator=gen) * 0.5))
    h0 = to_device([torch.randn(len(lens), HV, K, V, generator=gen)])[0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    state = h0.transpose(-1, -2).contiguous()  # V-first
    o, s = kda_triton.fused_recurrent_kda_triton(
        q, k, v, g_raw, beta_raw, 0.25, state, True, False, cu, True, use_gate_in_kernel=True, A_log=A_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True)
    assert s.data_ptr() == state.data_ptr() and s.shape == (len(lens), HV, V, K)
    g_act, b_act = gate.naive_kda_gate(g_raw, A_log, dt_bias), torch.sigmoid(beta_raw)
    for i, (b, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, s_i = naive.naive_recurrent_kda(q[:, b:e], k[:, b:e], v[:, b:e], g_act[:, b:e], b_act[:, b:e], 0.25,
                                             h0[i: i + 1], True)
        assert_close_rel(o[:, b:e], o_i, name=f"seq {i} o")
        assert_close_rel(s[i: i + 1].transpose(-1, -2), s_i, name=f"seq {i} state")


def test_chunk_state_v_first_and_intermediate_states():
    """state_v_first: [N, HV, V, K] states in and out, gradient to h0 included; return_intermediate_states:
    the state entering every chunk (h[:, 0] = h0, h[:, 1] = the reference's state after 64 tokens)."""
    B, T, H, K, V = 2, 70, 1, 16, 32
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, H, K, V, init_state=True, seed=13))
    with torch.no_grad():
        o, s, h = kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25, h0.transpose(-1, -2).contiguous(), True,
                                              state_v_first=True, return_intermediate_states=True)
        o_ref, s_ref = recurrent_kda_reference(q, k, v, g, beta, 0.25, h0, True)
        _, s64 = recurrent_kda_reference(q[:, :64], k[:, :64], v[:, :64], g[:, :64], beta[:, :64], 0.25, h0, True)
    assert s.shape == (B, H, V, K) and h.shape == (B, 2, H, V, K)
    assert_close_rel(o, o_ref)
    assert_close_rel(s.transpose(-1, -2), s_ref, name="final state")
    assert_close_rel(h[:, 0].transpose(-1, -2), h0, name="h[:, 0]")
    assert_close_rel(h[:, 1].transpose(-1, -2), s64, name="h[:, 1]")
    leaf = h0.transpose(-1, -2).contiguous().requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25, leaf, True, state_v_first=True,
                                    return_intermediate_states=True)
    o, s = kda_triton.chunk_kda_triton(q, k, v, g, beta, 0.25, leaf, True, state_v_first=True)
    (o.sum() + (s * s).sum()).backward()
    h0_ref = h0.clone().requires_grad_()
    o_r, s_r = recurrent_kda_reference(q, k, v, g, beta, 0.25, h0_ref, True)
    (o_r.sum() + (s_r * s_r).sum()).backward()
    assert_close_rel(leaf.grad.transpose(-1, -2), h0_ref.grad, rel=2e-5, name="dh0")


def test_decode_state_pool_indices():
    """ssm_state_indices: sequence n reads and (in place) writes pool row indices[n]; -1 is a padding slot (o = 0,
    no row touched). Without in place, the final states come back per sequence (zeros for a padding slot)."""
    B, T, H, K, V = 3, 2, 2, 16, 16
    q, k, v, g, beta, _ = to_device(make_inputs(B, T, H, K, V, seed=14))
    pool = torch.randn(4, H, K, V, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32, device=DEVICE)
    pool0 = pool.clone()
    o_ref, s_ref = recurrent_kda_reference(q, k, v, g, beta, 0.25, pool0[[2, 0, 0]], True)
    o2, s2 = kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, 0.25, pool, True, ssm_state_indices=idx)
    assert torch.equal(pool, pool0)
    assert_close_rel(o2[[0, 2]], o_ref[[0, 2]])
    assert torch.equal(o2[1], torch.zeros_like(o2[1])) and torch.equal(s2[1], torch.zeros_like(s2[1]))
    assert_close_rel(s2[[0, 2]], s_ref[[0, 2]])
    o, s = kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, 0.25, pool, False, False, None, True,
                                                 ssm_state_indices=idx)
    assert s is None and torch.equal(o, o2)
    assert_close_rel(pool[2], s_ref[0], name="pool row 2")
    assert_close_rel(pool[0], s_ref[2], name="pool row 0")
    assert torch.equal(pool[[1, 3]], pool0[[1, 3]])
    with pytest.raises(ValueError, match="ssm_state_indices"):
        kda_triton.fused_recurrent_kda_triton(q, k, v, g, beta, 0.25, pool, ssm_state_indices=idx[:2])


def test_chunk_cu_seqlens_cpu_gives_the_same_result():
    """cu_seqlens_cpu (fla's option: the chunk list is built from a host copy, no device sync) changes nothing;
    the layout is built once in the forward and reused by the backward."""
    lens, H, K, V = (5, 3), 1, 16, 16
    args = [x.detach().requires_grad_() for x in to_device(make_inputs(1, sum(lens), H, K, V))[:5]]
    cu_cpu = torch.tensor([0, 5, 8], dtype=torch.int32)
    o, _ = kda_triton.chunk_kda_triton(*args, 0.25, cu_seqlens=cu_cpu.to(DEVICE), cu_seqlens_cpu=cu_cpu)
    o.sum().backward()
    o_ref, _ = recurrent_kda_reference(*args, 0.25, cu_seqlens=cu_cpu)
    assert_close_rel(o, o_ref)
    assert all(torch.isfinite(x.grad).all() for x in args)


def test_stage_wy_solve_chunk32():
    """chunk_size 32: the solve kernel's two-block form (row and column blocks 2, 3 masked) against its twin."""
    d = _twin_intermediates(32)
    Ai, w, u = kda_triton_fwd.wy_solve_fwd(d["k"], d["v"], d["G"], d["beta"], d["Akk"], d["layout"])
    for name, got in (("Ai", Ai), ("w", w), ("u", u)):
        _check_stage(name, got, d[name])


def test_chunk_size_32_matches_reference():
    """fla's chunk_size=32 on the whole Triton pipeline (T = 40: a chunk and an 8-token tail, GVA, l2norm):
    output, final state and every gradient against the reference."""
    B, T, H, HV, K, V = 1, 40, 1, 2, 16, 16
    q, k, v, g, beta, h0 = to_device(make_inputs(B, T, HV, K, V, init_state=True, seed=16))
    q, k = q[:, :, :H].contiguous(), k[:, :, :H].contiguous()
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    gen = torch.Generator().manual_seed(17)
    do, dht = to_device((torch.randn(B, T, HV, V, generator=gen), torch.randn(B, HV, K, V, generator=gen)))

    def ours():
        return kda_triton.chunk_kda_triton(*leaves[:5], 0.25, leaves[5], True, True, chunk_size=32)

    def ref():
        qr, kr = (x.repeat_interleave(HV // H, 2) for x in leaves[:2])
        return recurrent_kda_reference(qr, kr, *leaves[2:5], 0.25, leaves[5], True, True)

    _compare_all(op_grads(ours, leaves, do, dht), op_grads(ref, leaves, do, dht), "q k v g beta h0".split())


@pytest.mark.parametrize("T,packed", [(40, True), pytest.param(80, False, marks=pytest.mark.slow)])
def test_k3_model_on_the_triton_kernels_is_as_exact_as_the_torch_path(T, packed, monkeypatch):
    """A whole tiny Kimi K3 model (bounded sigmoid gate, full-rank output gate, gated q-LoRA MLA, SiTU-GLU, latent
    MoE, Block AttnRes) with its KDA layers on the Triton chunk kernels: on packed documents (varlen, 25 + 15
    tokens per row), and (slow) on 80 tokens, two chunks of 64.
    Oracle: the same model in float64 on the PyTorch path. Through six layers and back, fp32 logits and
    gradients carry ~5e-5 relative rounding on either fp32 path (measured: torch 4.7e-5, Triton 3.1e-5 at worst),
    so the Triton path must be within 1e-4 of float64 on every tensor, and its median error over the tensors no
    more than 2x the PyTorch fp32 path's (per tensor the two differ either way, up to 2.2x on a gate gradient)."""
    import copy
    import functools

    from kda_hybrid import layers_kda_hybrid

    from .helpers import k3_model

    model = k3_model().train()
    exact = copy.deepcopy(model).double()
    model.to(DEVICE)
    ids = torch.randint(3, 97, (2, T), generator=torch.Generator().manual_seed(0))
    pos = torch.cat((torch.arange(25), torch.arange(T - 25))).repeat(2, 1) if packed else None

    def run(m, device):
        m.zero_grad(set_to_none=True)
        logits = m(input_ids=ids.to(device), position_ids=None if pos is None else pos.to(device),
                   use_cache=False).logits
        logits.square().mean().backward()
        out = [logits] + [p.grad for n, p in m.named_parameters() if p.grad is not None]
        return [t.detach().double().cpu() for t in out]

    truth, fp32 = run(exact, "cpu"), run(model, DEVICE)
    names = ["logits"] + [n for n, p in model.named_parameters() if p.grad is not None]
    calls = []
    original = kda_ops.chunk_kda

    def on_triton(*args, **kw):
        calls.append(1)
        return original(*args, **{**kw, "backend": "triton"})

    monkeypatch.setattr(layers_kda_hybrid, "chunk_kda", functools.wraps(original)(on_triton))
    triton = run(model, DEVICE)
    assert len(calls) == 4 and len(triton) == len(truth) == len(names) > 40  # four KDA layers on the kernels
    errors = {}
    for name, t, f, x in zip(names, triton, fp32, truth):
        scale = x.abs().max().clamp_min(1e-30)
        errors[name] = float((t - x).abs().max() / scale), float((f - x).abs().max() / scale)
        assert errors[name][0] <= 1e-4, f"{name}: Triton {errors[name][0]:.2e} from float64, torch fp32 " \
                                        f"{errors[name][1]:.2e}"
    median_t, median_f = (float(torch.tensor([e[i] for e in errors.values()]).median()) for i in (0, 1))
    assert median_t <= 2 * median_f, (median_t, median_f)
    assert not all(e[0] == e[1] for e in errors.values())  # the kernels ran: not the torch path's own numbers


# --------------------------------------------------------------------------------------------------
# The fused MXFP4 matmul (kda_hybrid/mxfp4_triton.py) against its twin, the expanded weight
# --------------------------------------------------------------------------------------------------


def _mxfp4_weight(N, K, seed):
    """Random MXFP4 bytes holding every byte value (so every E2M1 code in both nibbles) and scales 2^-12..2^5."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=gen)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scale = torch.randint(115, 133, (N, K // 32), dtype=torch.uint8, generator=gen)
    return packed, scale


# M past one 16-row tile and past one 64-row tile; N not a multiple of the 16 / 64 column tiles; K = 96 is one
# and a half 64-wide steps (the masked tail), K = 256 four
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (5, 40, 96), (33, 70, 128), (70, 16, 256)])
def test_mxfp4_kernel_equals_the_expanded_weight(M, N, K):
    from kda_hybrid.mxfp4_torch import dequantize_mxfp4
    from kda_hybrid.mxfp4_triton import mxfp4_linear_triton

    packed, scale = _mxfp4_weight(N, K, seed=M)
    x = torch.randn(2, M, K, generator=torch.Generator().manual_seed(K))  # leading dims kept
    x.view(-1, K)[0, :K // 2] = 0.0  # a zero run: exact zeros stay zeros through the decode
    exact = F.linear(x.double(), dequantize_mxfp4(packed, scale, torch.float64))
    twin = F.linear(x, dequantize_mxfp4(packed, scale))
    got = mxfp4_linear_triton(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE)).cpu()
    assert got.shape == (2, M, N) and got.dtype == torch.float32 and torch.isfinite(got).all()
    # the decoded weights are exact in fp32: kernel and twin differ only in the order of their fp32 sums
    err, twin_err = (got.double() - exact).abs().max(), (twin.double() - exact).abs().max()
    assert_close_rel(got.double(), exact, rel=2e-6, name="kernel")
    assert err <= 4 * twin_err + 1e-12, (float(err), float(twin_err))


def test_mxfp4_kernel_gradient_is_the_expanded_weights():
    from kda_hybrid.mxfp4_torch import dequantize_mxfp4
    from kda_hybrid.mxfp4_triton import mxfp4_linear_triton

    packed, scale = _mxfp4_weight(24, 64, seed=3)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    dy = torch.randn(7, 24, generator=torch.Generator().manual_seed(5))
    mxfp4_linear_triton(x.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE)).backward(dy.to(DEVICE))
    assert_close_rel(x.grad, dy @ dequantize_mxfp4(packed, scale), rel=1e-6, name="dx")


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 64, dtype=torch.int32)), "x must be one of"),
    (dict(x=torch.zeros(2, 32)), "must agree"),
    (dict(scale=torch.zeros(8, 3, dtype=torch.uint8)), "must agree"),
    (dict(packed=torch.zeros(8, 32, dtype=torch.int8)), "2-D uint8"),
])
def test_mxfp4_kernel_refuses_bad_inputs_before_launching(bad, match):
    from kda_hybrid.mxfp4_triton import mxfp4_linear_triton

    args = dict(x=torch.zeros(2, 64), packed=torch.zeros(8, 32, dtype=torch.uint8),
                scale=torch.full((8, 2), 127, dtype=torch.uint8))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        mxfp4_linear_triton(**{k: v.to(DEVICE) for k, v in args.items()})


def test_k3_mxfp4_experts_on_the_kernel_equal_the_torch_path(monkeypatch):
    """A tiny K3 with MXFP4 routed experts, every expert matmul on the fused kernel (MXFP4Linear.backend "triton";
    CUDA tensors get it by default). Oracle: the same model in float64 (the expanded weights are exact in any
    dtype). Through six layers fp32 logits and input gradients carry rounding on either fp32 path (measured here:
    up to 2e-4 of the scale on the input gradient, either path), so the kernel path must be as close to float64 as
    the expanded-weight fp32 path is, within 3x, and that path within 1e-3 (a sane model, not a chaotic one)."""
    import copy

    from kda_hybrid import layers_kda_hybrid
    from kda_hybrid.layers_kda_hybrid import MXFP4Linear

    from .helpers import k3_model

    model = k3_model(expert_quantization="mxfp4")
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, MXFP4Linear):
            m.weight_packed.copy_(torch.randint(0, 256, m.weight_packed.shape, dtype=torch.uint8, generator=gen))
            m.weight_scale.copy_(torch.randint(118, 126, m.weight_scale.shape, dtype=torch.uint8, generator=gen))
    model.to(DEVICE)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def run(m):
        embeds = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = m(inputs_embeds=embeds, use_cache=False).logits
        logits.square().mean().backward()
        return logits.detach().double().cpu(), embeds.grad.double().cpu()

    truth = run(copy.deepcopy(model).double())
    fp32 = run(copy.deepcopy(model))
    calls = []
    original = layers_kda_hybrid.mxfp4_linear

    def on_triton(x, packed, scale, backend):
        assert backend == "triton"
        calls.append(1)
        return original(x, packed, scale, backend)

    monkeypatch.setattr(layers_kda_hybrid, "mxfp4_linear", on_triton)
    for m in model.modules():
        if isinstance(m, MXFP4Linear):
            m.backend = "triton"
    got = run(model)
    assert len(calls) > 0 and len(calls) % 3 == 0  # w1, w3, w2 of each expert a token used
    for name, g, f, x in zip(("logits", "input gradient"), got, fp32, truth):
        assert not torch.equal(g, f)  # the kernel ran: not the torch path's own numbers
        scale = x.abs().max()
        err, err_fp32 = float((g - x).abs().max() / scale), float((f - x).abs().max() / scale)
        assert err_fp32 <= 1e-3 and err <= 3 * err_fp32, f"{name}: kernel {err:.2e} from float64, torch fp32 " \
                                                         f"{err_fp32:.2e}"
