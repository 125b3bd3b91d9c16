"""KDA ops on CPU: the torch chunked path and the recurrent path against our reference and fla's naive
recurrence (an independent oracle), gradients against autograd of the reference, and input validation."""

import pytest
import torch
import torch.nn.functional as F

from kda_hybrid import chunk_kda, fused_recurrent_kda
from kda_hybrid.kda_torch import recurrent_step_

from .helpers import (
    GRAD_NAMES,
    assert_all_close,
    assert_close_rel,
    assert_matches_reference,
    chunk_grads,
    make_inputs,
    op_grads,
)

naive = pytest.importorskip("fla.ops.kda.naive", reason="flash-linear-attention (test extra) provides the oracle")


SHAPES = [
    pytest.param(2, T, H, K, V, id=f"B2-T{T}-H{H}-K{K}-V{V}")
    for T in (1, 63, 64, 65, 130, 300)
    for (H, K, V) in ((1, 32, 32), (3, 16, 24))
]


@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("init_state", [False, True], ids=["h0=0", "h0"])
@pytest.mark.parametrize("B,T,H,K,V", SHAPES)
def test_chunk_matches_reference_and_fla(B, T, H, K, V, init_state, l2norm):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, init_state=init_state)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o, s = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    if l2norm:  # un-normalised keys for the fused norm; fla's naive recurrence takes normalised q, k
        k = k * torch.linspace(0.5, 3.0, K)
        kw["use_qk_l2norm_in_kernel"] = True
        o, s = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
        o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
        qn, kn = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    else:
        qn, kn = q, k
    o_fla, s_fla = naive.naive_recurrent_kda(qn, kn, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close_rel(o_ref, o_fla, name="reference vs fla o")
    assert_close_rel(s_ref, s_fla, name="reference vs fla state")
    assert_close_rel(o, o_ref, name="torch o")
    assert_close_rel(s, s_ref, name="torch state")


@pytest.mark.parametrize("T", [64, 128, 256])
def test_chunk_matches_fla_naive_chunk(T):
    """fla's own chunked oracle (needs T a multiple of 64)."""
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 32, 32, init_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    o_fla, s_fla = naive.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close_rel(o, o_fla, rel=2e-5)
    assert_close_rel(s, s_fla, rel=2e-5)


@pytest.mark.parametrize("gate", [5.0, 20.0, 60.0], ids=lambda x: f"gate{x:g}")
def test_strong_decay_is_finite_and_exact(gate):
    """g down to about -20 (and -60) per token per channel: Gamma reaches -1000s inside a chunk."""
    q, k, v, g, beta, h0 = make_inputs(1, 512, 2, 64, 64, gate=gate, init_state=True)
    assert g.min() < -gate  # the test really exercises strong decay
    assert_matches_reference("torch", q, k, v, g, beta, h0)


def test_state_carried_across_groups_of_chunks():
    """Longer than one group of chunks (kda_torch.GROUP_TOKENS): the state crosses group boundaries."""
    from kda_hybrid import kda_torch

    T = 2 * kda_torch.GROUP_TOKENS + 77
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 8, 8, init_state=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)


def test_mixed_decay_takes_hierarchical_path(monkeypatch):
    """One channel with huge decay (-30 per token: 960 over a 32-token chunk, past MAX_ANCHORED_DECAY) forces the
    anchored hierarchy; the others keep ordinary decay."""
    from kda_hybrid import kda_torch

    calls = []
    hierarchy = kda_torch._gated_products
    monkeypatch.setattr(kda_torch, "_gated_products", lambda *a: calls.append(1) or hierarchy(*a))
    q, k, v, g, beta, _ = make_inputs(1, 200, 2, 32, 32)
    g = g.clone()
    g[..., 0, 3] = -30.0
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="torch")
    assert calls, "the hierarchy was not taken"
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="reference")
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs_compute_in_fp32(dtype):
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 32, 32, init_state=True, dtype=dtype)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert o.dtype == dtype and s.dtype == torch.float32
    # the same low-precision inputs, upcast, through the fp32 reference: only the output cast differs
    o_ref, s_ref = chunk_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0,
                             output_final_state=True, backend="reference")
    assert_close_rel(s, s_ref)
    torch.testing.assert_close(o, o_ref.to(dtype))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_cpu_bf16_autocast_keeps_fp32_recurrence(grad):
    """Under autocast the ops still compute in fp32 (training with bf16 autocast calls them)."""
    q, k, v, g, beta, h0 = make_inputs(1, 100, 2, 16, 16, init_state=True, requires_grad=grad)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="reference")
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
        o1, s1 = fused_recurrent_kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0,
                                     output_final_state=True, backend="torch")
    assert o.dtype == s.dtype == torch.float32
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)
    assert_close_rel(o1, o_ref[:, :1])


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("lens", [(5, 64, 70), (1, 1, 130), (200,)], ids=lambda lens: "-".join(map(str, lens)))
def test_varlen_equals_per_sequence(lens, backend):
    H, K, V = 2, 16, 24
    T = sum(lens)
    q, k, v, g, beta, _ = make_inputs(1, T, H, K, V)
    h0 = torch.randn(len(lens), H, K, V)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     use_qk_l2norm_in_kernel=True, backend=backend)
    for i, (b, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_i, s_i = chunk_kda(q[:, b:e], k[:, b:e], v[:, b:e], g[:, b:e], beta[:, b:e], initial_state=h0[i : i + 1],
                             output_final_state=True, use_qk_l2norm_in_kernel=True, backend="reference")
        assert_close_rel(o[:, b:e], o_i, name=f"seq {i} o")
        assert_close_rel(s[i : i + 1], s_i, name=f"seq {i} state")


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_decode_token_by_token_equals_one_chunked_call(backend):
    B, T, H, K, V = 2, 70, 2, 32, 16
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, init_state=True)
    o_full, s_full = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, backend="torch")
    state, outs = h0.clone(), []
    for t in range(T):
        sl = slice(t, t + 1)
        o_t, state = fused_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True, backend=backend)
        outs.append(o_t)
    assert_close_rel(torch.cat(outs, 1), o_full)
    assert_close_rel(state, s_full)


def test_decode_inplace_state_update():
    q, k, v, g, beta, h0 = make_inputs(3, 1, 2, 16, 16, init_state=True)
    expected_o, expected_s = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True,
                                                 backend="reference")
    state = h0.clone()
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True,
                               inplace_final_state=True, backend="torch")
    assert s.data_ptr() == state.data_ptr()
    assert_close_rel(o, expected_o)
    assert_close_rel(state, expected_s)
    # without the flag the caller's state is left alone
    state2 = h0.clone()
    fused_recurrent_kda(q, k, v, g, beta, initial_state=state2, output_final_state=True, backend="torch")
    assert torch.equal(state2, h0)


@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_single_token_step_matches_fla_naive(l2norm, dtype):
    """T = 1 in place, through the op and through kda_torch.recurrent_step_ (the batched [B * H] products of the
    model's decode step), against fla's naive recurrence: K != V, a non-default scale, bf16 inputs with the fp32
    state; the state is the caller's tensor."""
    q, k, v, g, beta, h0 = make_inputs(3, 1, 2, 16, 24, init_state=True, dtype=dtype)
    k = k * torch.linspace(0.5, 3.0, 16).to(dtype) if l2norm else k
    state = h0.clone()
    o, s = fused_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=state, inplace_final_state=True,
                               use_qk_l2norm_in_kernel=l2norm, backend="torch")
    assert s is state and o.dtype == dtype
    qn, kn = ((x.float() / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k)) if l2norm
              else (q.float(), k.float()))
    o_fla, s_fla = naive.naive_recurrent_kda(qn, kn, v.float(), g.float(), beta.float(), scale=0.3,
                                             initial_state=h0, output_final_state=True)
    assert_close_rel(o, o_fla, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)  # bf16: the output rounding
    assert_close_rel(state, s_fla)
    state = h0.clone()
    o_step = recurrent_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, 0.3, use_qk_l2norm_in_kernel=l2norm)
    assert o_step.dtype == dtype
    assert_close_rel(o_step, o_fla[:, 0], rel=1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert_close_rel(state, s_fla)


def assert_gradients_match_reference(args, do, ds, **kw):
    """Gradients of (o * do).sum() + (s * ds).sum() for q, k, v, g, beta and the initial state: the torch chunked
    path against autograd through the token-by-token reference."""
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    got_all, ref_all = chunk_grads("torch", args, do, ds, **kw), chunk_grads("reference", args, do, ds, **kw)
    assert_all_close(got_all, ref_all, GRAD_NAMES, rel=2e-5)


@pytest.mark.parametrize("gate", [1.0, 20.0], ids=["gate1", "gate20"])
@pytest.mark.parametrize("T", [1, 65, 130])
def test_chunk_gradients_match_reference(T, gate):
    B, H, K, V = 1, 2, 16, 24
    args = make_inputs(B, T, H, K, V, init_state=True, requires_grad=True, gate=gate)
    assert_gradients_match_reference(args, torch.randn(B, T, H, V), torch.randn(B, H, K, V))


def test_varlen_gradients_match_reference():
    """Packed sequences of very different lengths (3 padding buckets): gradients of every input and of the initial
    states equal autograd through the token-by-token reference, which runs each sequence on its own."""
    lens = (3, 64, 1, 150, 40)
    H, K, V = 2, 16, 24
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), H, K, V, requires_grad=True)
    h0 = torch.randn(len(lens), H, K, V, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    assert_gradients_match_reference((q, k, v, g, beta, h0), torch.randn_like(v), torch.randn(len(lens), H, K, V),
                                     cu_seqlens=cu)


def test_fused_recurrent_gradients_flow():
    args = make_inputs(1, 5, 2, 8, 8, init_state=True, requires_grad=True)
    o, s = fused_recurrent_kda(*args[:5], initial_state=args[5], output_final_state=True, backend="torch")
    (o.sum() + s.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in args)


def test_auto_picks_torch_on_cpu():
    q, k, v, g, beta, _ = make_inputs(1, 10, 1, 8, 8)
    o_auto, _ = chunk_kda(q, k, v, g, beta)
    o_torch, _ = chunk_kda(q, k, v, g, beta, backend="torch")
    torch.testing.assert_close(o_auto, o_torch, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# torch.compile (inductor, the default backend): forward and backward equal eager.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", [0.5, 30.0], ids=["one-matmul", "hierarchical"])
def test_torch_compile_chunk_equals_eager(gate):
    """gate=30 takes the anchored hierarchy of _gated_products, which once wrote into views of a preallocated
    matrix (aot_autograd refused it). Inductor fuses the elementwise exp/mul chains into its own C++ loops (its
    vectorised exp differs from aten's by an ulp or so) and leaves the matmuls to aten, so compiled and eager
    differ by fp32 rounding only: rel 1e-5 of the output scale, as torch vs reference elsewhere in this file."""
    from kda_hybrid.kda_torch import MAX_BLOCK_DECAY

    args = make_inputs(1, 130, 2, 16, 16, gate=gate, init_state=True, requires_grad=True)
    chunk_decay = -args[3].detach()[:, :128].unflatten(1, (2, 64)).sum(2).min()
    assert (chunk_decay > MAX_BLOCK_DECAY) == (gate > 1)  # the path named by the test id is the one taken
    do, ds = torch.randn(1, 130, 2, 16), torch.randn(1, 2, 16, 16)

    def run(fn):
        o, s, grads = op_grads(lambda: fn(*args), args, do, ds)
        return [o, s, *grads]

    def op(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")

    eager, compiled = run(op), run(torch.compile(op))
    assert_all_close(compiled, eager, ["o", "s", *GRAD_NAMES], rel=1e-5)


def test_torch_compile_fused_recurrent_equals_eager():
    """The decode op compiled: in place on the caller's state (no grad) and differentiable (grad)."""
    q, k, v, g, beta, h0 = make_inputs(2, 3, 2, 16, 16, init_state=True)

    def op(q, k, v, g, beta, h0, inplace):
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   inplace_final_state=inplace, backend="torch")

    compiled = torch.compile(op)
    with torch.no_grad():
        o_ref, s_ref = op(q, k, v, g, beta, h0.clone(), False)
        state = h0.clone()
        o, s = compiled(q, k, v, g, beta, state, True)
    assert s is state
    assert_close_rel(o, o_ref)
    assert_close_rel(state, s_ref)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, s = compiled(*args, False)
    (o.sum() + s.square().sum()).backward()
    grads = [x.grad for x in args]
    for x in args:
        x.grad = None
    o, s = op(*args, False)
    (o.sum() + s.square().sum()).backward()
    for name, got, x in zip("q k v g beta h0".split(), grads, args):
        assert_close_rel(got, x.grad, name=f"d{name}")


# ------------------------------------------------------------------------------------------------
# Validation: every bad input is a ValueError that names what was expected and what was given.
# ------------------------------------------------------------------------------------------------

def _good():
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


BAD = [
    ("q-rank", lambda d: d.update(q=d["q"][0]), {}, "q must be"),
    ("k-shape", lambda d: d.update(k=d["k"][..., :3]), {}, "k must have"),
    ("g-shape", lambda d: d.update(g=d["g"][:, :4]), {}, "g must have"),
    ("v-heads", lambda d: d.update(v=d["v"][:, :, :1]), {}, "v must be"),
    ("beta-shape", lambda d: d.update(beta=d["beta"][..., None]), {}, "beta must be"),
    ("int-dtype", lambda d: d.update(q=d["q"].long()), {}, "float32, bfloat16, float16 or float64"),
    ("mixed-qkv-dtype", lambda d: d.update(v=d["v"].double()), {}, "share one dtype"),
    ("qk-dtypes", lambda d: d.update(k=d["k"].half()), {}, "share one dtype"),
    ("state-shape", None, dict(initial_state=torch.zeros(1, 2, 4, 5)), "initial_state must be"),
    ("state-dtype", None, dict(initial_state=torch.zeros(1, 2, 4, 6, dtype=torch.bfloat16)), "float32"),
    ("cu-not-start-0", None, dict(cu_seqlens=torch.tensor([1, 8])), "start at 0"),
    ("cu-not-increasing", None, dict(cu_seqlens=torch.tensor([0, 5, 5, 8])), "strictly increasing"),
    ("cu-wrong-end", None, dict(cu_seqlens=torch.tensor([0, 5])), "end at T=8"),
    ("cu-float", None, dict(cu_seqlens=torch.tensor([0.0, 8.0])), "int32/int64"),
    ("scale", None, dict(scale=-1.0), "scale must be"),
    ("backend", None, dict(backend="cuda"), "backend must be one of"),
]


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("name,mutate,kwargs,match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise(op, name, mutate, kwargs, match):
    d = _good()
    if mutate:
        mutate(d)
    with pytest.raises(ValueError, match=match):
        op(d["q"], d["k"], d["v"], d["g"], d["beta"], **kwargs)


def test_cu_seqlens_needs_batch_one():
    q, k, v, g, beta, _ = make_inputs(2, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))


def test_varlen_state_count_checked():
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match=r"\(2, 1, 4, 4\)"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 1, 4, 4))


def test_forced_triton_on_cpu_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta, _ = make_inputs(1, 8, 1, 4, 4)
    with pytest.raises(RuntimeError, match="backend='torch'"):
        chunk_kda(q, k, v, g, beta, backend="triton")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "yes", "0", "false", "off", ""])
def test_triton_interpret_parsed_as_triton_does(monkeypatch, value):
    """kda_ops refuses backend='triton' on CPU exactly when triton would compile instead of interpreting: the
    decision is triton's own reading of TRITON_INTERPRET (once refused backend='triton' for TRITON_INTERPRET=true
    while the kernels ran in the interpreter)."""
    triton = pytest.importorskip("triton")
    from kda_hybrid import kda_ops

    monkeypatch.setenv("TRITON_INTERPRET", value)
    interpreted = triton.knobs.runtime.interpret
    assert kda_ops._triton_interpreted() == interpreted
    if interpreted:
        assert kda_ops._resolve("triton", torch.device("cpu")) == "triton"
    else:
        with pytest.raises(RuntimeError, match="needs CUDA tensors"):
            kda_ops._resolve("triton", torch.device("cpu"))


def test_chunk_size_defined_once():
    from kda_hybrid import kda_ops, kda_torch

    assert kda_ops.CHUNK_SIZE is kda_torch.CHUNK_SIZE and kda_torch.CHUNK_SIZE in kda_torch.CHUNK_SIZES


# ------------------------------------------------------------------------------------------------
# Property-based: any shape, any gate strength, chunked == token by token.
# ------------------------------------------------------------------------------------------------

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 150), H=st.integers(1, 3), K=st.sampled_from([4, 8, 16, 24]),
    V=st.sampled_from([4, 8, 16, 40]), gate=st.floats(0.0, 40.0), seed=st.integers(0, 2**16),
    init_state=st.booleans(),
)
@example(B=1, T=150, H=2, K=4, V=40, gate=24.055433918232886, seed=780, init_state=False)  # fp32 chunk-form limit
def test_property_chunk_equals_reference(B, T, H, K, V, gate, seed, init_state):
    """The chunked path against the token-by-token reference in float64 (q/k L2-normalised in the op, an initial
    state or none): output and final state within 1e-5 of their scale. The pinned example (K = 4, gates near -20 per
    token) is a hypothesis find: the chunked form works with within-chunk cumulative log decays, whose fp32 rounding
    grows with their magnitude; 64-token chunks were 1.2e-5 off there (as fla's naive_chunk_kda still is), the
    32-token compute chunks 1.6e-6, the fp32 token-by-token scan 1.1e-7."""
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, gate=gate, seed=seed, init_state=init_state)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    exact = chunk_kda(*(x.double() for x in (q, k, v, g, beta)), backend="reference",
                      **{**kw, "initial_state": None if h0 is None else h0.double()})
    assert_close_rel(o, exact[0], name="output")
    assert_close_rel(s, exact[1], name="state")


# ------------------------------------------------------------------------------------------------
# Full resets (g = -inf), gate validation, the in-place contract, empty inputs.
# ------------------------------------------------------------------------------------------------


def _with_resets(g):
    """g = -inf (exp(g) = 0: the channel forgets everything) at a few tokens and channels, one a whole token."""
    g = g.detach().clone()
    T = g.shape[1]
    g[:, T // 2, 0, :5] = float("-inf")
    g[:, 0, -1, 3] = float("-inf")
    g[:, -1, :, :] = float("-inf")
    g[:, (2 * T) // 3, 1 % g.shape[2], 7] = -200.0  # finite, but exp(-200) = 0 in fp32: the same full reset
    return g


@pytest.mark.parametrize("op,backend", [(chunk_kda, "torch"), (chunk_kda, "reference"),
                                        (fused_recurrent_kda, "torch")], ids=["chunk-torch", "chunk-ref", "recurrent"])
@pytest.mark.parametrize("T", [1, 64, 130])
def test_full_reset_gate_matches_fla(op, backend, T):
    """g = -inf is allowed (g <= 0): outputs, final state and every gradient equal fla's naive recurrence (whose
    S * exp(-inf) = 0 is the definition), finite everywhere; the chunked path once gave NaN everywhere."""
    q, k, v, g, beta, h0 = make_inputs(1, T, 2, 16, 16, init_state=True)
    g = _with_resets(g)
    args = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    do, ds = torch.randn_like(v), torch.randn_like(h0)

    def run(fn):
        o, s, grads = op_grads(lambda: fn(*args), args, do, ds)
        return [o, s, *grads]

    ours = run(lambda *a: op(*a[:5], initial_state=a[5], output_final_state=True, backend=backend))
    fla = run(lambda *a: naive.naive_recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True))
    assert_all_close(ours, fla, ["o", "s", *GRAD_NAMES], rel=2e-5)


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf")], ids=["positive", "nan", "inf"])
def test_gate_must_be_a_log_decay(op, bad):
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    g = g.clone()
    g[0, 3, 1, 2] = bad
    with pytest.raises(ValueError, match=r"g must be a log decay <= 0.*check_inputs=False"):
        op(q, k, v, g, beta)
    o, _ = op(q, k, v, g, beta, check_inputs=False, backend="reference")  # the opt-out: computed as given
    assert o.shape == v.shape


def test_gate_check_skipped_for_in_kernel_gate():
    """With use_gate_in_kernel the raw g may be positive: the computed gate is <= 0 by construction."""
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    o, _ = chunk_kda(q, k, v, g.abs() + 1, beta, use_gate_in_kernel=True, A_log=torch.zeros(2))
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "cu_seqlens"])
def test_inplace_final_state_contract(backend, varlen):
    """inplace_final_state=True: initial_state becomes the final state and is the returned tensor, with or without
    cu_seqlens, on every backend; when autograd records the call it is left untouched and a new state returned."""
    B, T, H, K, V = (1, 7, 2, 8, 8) if varlen else (3, 2, 2, 8, 8)
    q, k, v, g, beta, _ = make_inputs(B, T, H, K, V)
    cu = torch.tensor([0, 2, 7]) if varlen else None
    h0 = torch.randn(2 if varlen else B, H, K, V)
    o_ref, s_ref = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                       backend="reference")
    state = h0.clone()
    for output_final_state in (True, False):  # the state comes back either way, as fla's kernel returns it
        state.copy_(h0)
        o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=output_final_state,
                                   inplace_final_state=True, cu_seqlens=cu, backend=backend)
        assert s is state
        assert_close_rel(o, o_ref)
        assert_close_rel(state, s_ref)
    k.requires_grad_()
    state.copy_(h0)
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, inplace_final_state=True, cu_seqlens=cu,
                               backend=backend)
    assert s is not state and torch.equal(state, h0)
    assert_close_rel(s.detach(), s_ref)
    s.sum().backward()
    assert k.grad is not None
    with pytest.raises(ValueError, match="pass initial_state"):
        fused_recurrent_kda(q, k, v, g, beta, inplace_final_state=True, cu_seqlens=cu, backend=backend)


@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("B,T", [(1, 0), (0, 5), (0, 0)])
def test_empty_inputs_give_empty_results(op, B, T):
    q, k, v, g, beta, _ = make_inputs(B, T, 2, 4, 6)
    o, s = op(q, k, v, g, beta, output_final_state=True)
    assert o.shape == (B, T, 2, 6) and s.shape == (B, 2, 4, 6) and not s.any()
    h0 = torch.randn(B, 2, 4, 6)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (B, T, 2, 6) and torch.equal(s, h0)
    o, s = op(q, k, v, g, beta)
    assert o.shape == (B, T, 2, 6) and s is None


# ------------------------------------------------------------------------------------------------
# fla's options (issue: fla's KDA op API): each against fla's naive references and against the same result
# composed from plain calls, outputs and every gradient.
# ------------------------------------------------------------------------------------------------

gate_ref = pytest.importorskip("fla.ops.kda.gate", reason="fla's gate references")


def fla_inputs(B, T, H, HV, K, V, *, seed=0, dtype=torch.float32):
    """q, k with H heads; v, g, beta and the state with HV heads (grouped value heads when HV > H)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen))
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


def outputs_and_grads(fn, args, seed=1):
    """(o, final state) of fn(*args) and the gradients of a random projection of both for every arg."""
    for x in args:
        x.grad = None
    o, s = fn(*args)[:2]
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum()
    loss.backward()
    return [o.detach(), s.detach()] + [x.grad.clone() for x in args]


NAMES = "o s dq dk dv dg dbeta dh0".split()
OPS = [(chunk_kda, "torch"), (chunk_kda, "reference"), (fused_recurrent_kda, "torch")]
OP_IDS = ["chunk-torch", "chunk-ref", "recurrent"]


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
@pytest.mark.parametrize("T", [1, 70])
def test_grouped_value_heads_match_fla(op, backend, T):
    """HV = 3 H: each q/k head serves three value heads (fla's GVA), against fla's naive recurrence (which
    repeats q, k itself) and against our call on q, k repeated by hand."""
    args = fla_inputs(1, T, 2, 6, 16, 8)

    def ours(q, k, v, g, beta, h0):
        return op(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)

    got = outputs_and_grads(ours, args)
    fla = outputs_and_grads(lambda *a: naive.naive_recurrent_kda(*a[:5], initial_state=a[5],
                                                                 output_final_state=True), args)
    assert_all_close(got, fla, NAMES)
    composed = outputs_and_grads(lambda q, k, *rest: ours(q.repeat_interleave(3, 2), k.repeat_interleave(3, 2),
                                                          *rest), args)
    assert_all_close(got, composed, NAMES)


def test_grouped_value_heads_match_fla_naive_chunk():
    q, k, v, g, beta, h0 = (x.detach() for x in fla_inputs(2, 128, 2, 4, 16, 16))
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    o_fla, s_fla = naive.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert_close_rel(o, o_fla, rel=2e-5)
    assert_close_rel(s, s_fla, rel=2e-5)


def _gate_params(HV, K, seed=3):
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.randn(HV, generator=gen).mul(0.5).requires_grad_()
    dt_bias = torch.randn(HV * K, generator=gen).requires_grad_()
    return A_log, dt_bias


GATES = {
    "softplus": (dict(), lambda g, A, dt: gate_ref.naive_kda_gate(g, A, dt)),
    "softplus-no-bias": (dict(no_bias=True), lambda g, A, dt: gate_ref.naive_kda_gate(g, A, None)),
    "lower-bound": (dict(lower_bound=-5.0), lambda g, A, dt: gate_ref.naive_kda_lowerbound_gate(g, A, dt, -5.0)),
    "lower-bound-no-A": (dict(lower_bound=-3.0, no_A=True),
                         lambda g, A, dt: gate_ref.naive_kda_lowerbound_gate(g, None, dt, -3.0)),
}


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
@pytest.mark.parametrize("gate", list(GATES))
def test_in_kernel_gate_matches_fla(op, backend, gate):
    """use_gate_in_kernel: the raw g through fla's gate formulas (naive_kda_gate, naive_kda_lowerbound_gate)
    then fla's naive recurrence; gradients to g, A_log and dt_bias too. Grouped heads (HV = 2 H) on top."""
    kw, fla_gate = GATES[gate]
    args = fla_inputs(1, 37, 2, 4, 8, 8)
    with torch.no_grad():
        args[3].copy_(torch.randn(args[3].shape, generator=torch.Generator().manual_seed(5)) * 2)  # raw: any sign
    A_log, dt_bias = _gate_params(4, 8)
    params = [A_log] * (not kw.get("no_A")) + [dt_bias] * (not kw.get("no_bias"))
    A = A_log if not kw.get("no_A") else None
    dt = dt_bias if not kw.get("no_bias") else None

    def ours(q, k, v, g, beta, h0, *_):
        return op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A,
                  dt_bias=dt, lower_bound=kw.get("lower_bound"), backend=backend)

    def fla(q, k, v, g, beta, h0, *_):
        return naive.naive_recurrent_kda(q, k, v, fla_gate(g, A, dt), beta, initial_state=h0, output_final_state=True)

    names = NAMES + ["dA_log"] * (A is not None) + ["ddt_bias"] * (dt is not None)
    got = outputs_and_grads(ours, args + params)
    assert_all_close(got, outputs_and_grads(fla, args + params), names)
    composed = outputs_and_grads(lambda q, k, v, g, beta, h0, *_: op(
        q, k, v, fla_gate(g, A, dt), beta, initial_state=h0, output_final_state=True, backend=backend), args + params)
    assert_all_close(got, composed, names)


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "2sigmoid"])
def test_beta_sigmoid_in_kernel_matches_fla(op, backend, neg):
    """use_beta_sigmoid_in_kernel: beta given as logits; allow_neg_eigval doubles it (beta in (0, 2): the
    transition I - beta k k^T may have a negative eigenvalue). Gradient to the raw logits."""
    args = fla_inputs(1, 40, 2, 2, 8, 8)
    with torch.no_grad():
        args[4].copy_(torch.randn(args[4].shape, generator=torch.Generator().manual_seed(7)) * 3)
    f = 2.0 if neg else 1.0
    got = outputs_and_grads(lambda q, k, v, g, beta, h0: op(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=neg, backend=backend), args)
    fla = outputs_and_grads(lambda q, k, v, g, beta, h0: naive.naive_recurrent_kda(
        q, k, v, g, f * torch.sigmoid(beta), initial_state=h0, output_final_state=True), args)
    assert_all_close(got, fla, NAMES)


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
def test_state_v_first_is_the_transposed_state(op, backend):
    args = fla_inputs(1, 20, 2, 2, 8, 4)

    def v_first(q, k, v, g, beta, h0):
        return op(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                  state_v_first=True, backend=backend)

    o, s = v_first(*args)
    assert s.shape == (1, 2, 4, 8) and s.is_contiguous()
    got = outputs_and_grads(lambda *a: (lambda o, s: (o, s.transpose(-1, -2)))(*v_first(*a)), args)
    ref = outputs_and_grads(lambda q, k, v, g, beta, h0: op(q, k, v, g, beta, initial_state=h0,
                                                            output_final_state=True, backend=backend), args)
    assert_all_close(got, ref, NAMES)


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
def test_deprecated_transpose_state_layout_is_state_v_first_with_flas_warning(op, backend):
    """fla's old name for state_v_first: the same call with its DeprecationWarning, fla's error when both are given,
    and the same behaviour as fla's own op for the same keywords."""
    q, k, v, g, beta, h0 = (x.detach() for x in fla_inputs(1, 20, 2, 2, 8, 4))
    h0 = h0.transpose(-1, -2).contiguous()
    kw = dict(initial_state=h0, output_final_state=True, backend=backend)
    want = op(q, k, v, g, beta, state_v_first=True, **kw)
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated and renamed to "
                                                "`state_v_first`"):
        got = op(q, k, v, g, beta, transpose_state_layout=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated"):
        op(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True, **kw)


def test_state_v_first_in_place_decode():
    q, k, v, g, beta, h0 = (x.detach() for x in fla_inputs(2, 1, 2, 2, 8, 4))
    _, s_ref = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state = h0.transpose(-1, -2).contiguous()
    _, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, state_v_first=True, inplace_final_state=True)
    assert s is state
    assert_close_rel(state.transpose(-1, -2), s_ref)


@pytest.mark.parametrize("chunk_size", [32, 64])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "cu_seqlens"])
def test_intermediate_states_are_the_states_entering_each_chunk(chunk_size, varlen):
    """return_intermediate_states: h[:, n] is the state entering chunk n, i.e. the final state of the tokens
    before it (composed from plain calls), on the torch and reference backends; in k's dtype, as fla returns."""
    B, T = (1, 150) if varlen else (2, 100)
    q, k, v, g, beta, _ = (x.detach() for x in fla_inputs(B, T, 2, 2, 8, 8))
    cu = torch.tensor([0, 40, 150]) if varlen else None
    h0 = torch.randn(2, 2, 8, 8)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, chunk_size=chunk_size,
              return_intermediate_states=True)
    with torch.inference_mode():
        o, s, h = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
        o_r, s_r, h_r = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    spans = [(0, 40), (40, 150)] if varlen else [(0, T)]
    expected = []
    for i, (b, e) in enumerate(spans):
        rows = slice(None) if not varlen else slice(i, i + 1)
        for start in range(b, e, chunk_size):
            if start == b:
                expected.append(h0[rows])
            else:
                sl = slice(b, start)
                expected.append(chunk_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                          initial_state=h0[rows], output_final_state=True, backend="reference")[1])
    expected = torch.stack(expected, 1) if not varlen else torch.cat(expected).unsqueeze(0)
    assert h.shape == h_r.shape == expected.shape and h.dtype == k.dtype
    assert_close_rel(h, expected)
    assert_close_rel(h_r, expected)
    assert_close_rel(o, o_r)
    assert_close_rel(s, s_r)
    with pytest.raises(ValueError, match="inference only"):
        chunk_kda(q.requires_grad_(), k, v, g, beta, backend="torch", **kw)


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "cu_seqlens"])
def test_state_pool_rows_read_and_written(backend, varlen):
    """ssm_state_indices: sequence i starts from pool[idx[i]] and writes its final state back there; -1 is a
    padding slot (zero outputs, pool untouched); rows no sequence names are untouched."""
    H, K, V = 2, 8, 8
    lens = (1, 1, 1) if not varlen else (2, 1, 3)
    B, T = (3, 1) if not varlen else (1, sum(lens))
    q, k, v, g, beta, _ = (x.detach() for x in fla_inputs(B, T, H, H, K, V))
    cu = torch.tensor([0, 2, 3, 6]) if varlen else None
    pool = torch.randn(5, H, K, V)
    idx = torch.tensor([3, -1, 0])
    expected_pool, expected_o = pool.clone(), torch.zeros(B, T, H, V)
    for i, (b, e) in enumerate(zip([0, *torch.tensor(lens).cumsum(0).tolist()[:-1]], torch.tensor(lens).cumsum(0))):
        if idx[i] < 0:
            continue
        tok = (slice(i, i + 1), slice(None)) if not varlen else (slice(None), slice(b, int(e)))
        o_i, s_i = fused_recurrent_kda(*(x[tok] for x in (q, k, v, g, beta)), initial_state=pool[idx[i] : idx[i] + 1],
                                       output_final_state=True, backend="reference")
        expected_o[tok] = o_i
        expected_pool[idx[i]] = s_i[0]
    work = pool.clone()
    o, s = fused_recurrent_kda(q, k, v, g, beta, initial_state=work, ssm_state_indices=idx, inplace_final_state=True,
                               cu_seqlens=cu, backend=backend)
    assert s is work
    assert_close_rel(o, expected_o)
    assert_close_rel(work, expected_pool)
    assert torch.equal(work[[1, 2, 4]], pool[[1, 2, 4]])  # padding and unnamed rows untouched
    work = pool.clone()
    o2, s2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=work, ssm_state_indices=idx, output_final_state=True,
                                 cu_seqlens=cu, backend=backend)
    assert torch.equal(work, pool) and s2.shape == (3, H, K, V)
    assert_close_rel(o2, expected_o)
    assert_close_rel(s2[[0, 2]], expected_pool[[3, 0]])


@pytest.mark.parametrize("idx,match", [([3, 3, 0], "must not repeat"), ([5, -1, 0], r"rows in \[0, 5\)"),
                                       ([1, -2, 0], r"rows in \[0, 5\)"), ([1, 0], "one pool row per sequence")])
def test_state_pool_indices_validated(idx, match):
    q, k, v, g, beta, _ = (x.detach() for x in fla_inputs(3, 1, 2, 2, 8, 8))
    pool = torch.randn(5, 2, 8, 8)
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=torch.tensor(idx),
                            inplace_final_state=True)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("op,backend", OPS, ids=OP_IDS)
def test_float64_gradcheck(op, backend):
    """float64 runs in float64 on the torch and reference paths, so torch.autograd.gradcheck (finite differences
    against the analytic gradient) checks every gradient, with the options composed on top: grouped heads, the
    in-kernel gate (A_log, dt_bias), beta logits, and a full reset in one channel."""
    args = fla_inputs(1, 6, 1, 2, 4, 3, dtype=torch.float64)
    A_log, dt_bias = (x.detach().double().requires_grad_() for x in _gate_params(2, 4))

    kw = dict(chunk_size=32) if op is chunk_kda else {}  # T = 6 pads to one chunk: the smaller, the faster
    # the chunked path costs ~100 small kernels a call: fast_mode checks a random projection of the Jacobian
    # (v^T J u against finite differences along u) instead of every column, ~30x fewer evaluations
    fast = backend == "torch" and op is chunk_kda

    def fn(q, k, v, g, beta, h0, A_log, dt_bias):
        o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
                  dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend, **kw)
        assert o.dtype == s.dtype == torch.float64
        return o, s

    assert torch.autograd.gradcheck(fn, (*args, A_log, dt_bias), fast_mode=fast)
    g = args[3].detach().clone()
    g[0, 2, 1, 1] = float("-inf")
    args[3] = g.requires_grad_()
    assert torch.autograd.gradcheck(lambda q, k, v, g, beta, h0: op(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend, **kw), tuple(args),
        fast_mode=fast)


def test_float64_refused_on_triton(monkeypatch):
    from kda_hybrid import kda_ops

    monkeypatch.setattr(kda_ops, "chunk_kda_triton", lambda *a, **kw: pytest.fail("kernel must not run"))
    monkeypatch.setattr(kda_ops, "_triton_interpreted", lambda: True)
    q, k, v, g, beta, h0 = (x.detach() for x in fla_inputs(1, 4, 1, 1, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64 inputs run on backend='torch' or 'reference' only"):
        chunk_kda(q, k, v, g, beta, backend="triton")


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "cu_seqlens"])
def test_chunk_size_32_and_cu_seqlens_cpu(varlen):
    q, k, v, g, beta, _ = (x.detach() for x in fla_inputs(1, 150, 2, 2, 8, 8))
    g = g * 20  # strong decay: the hierarchical path at both chunk sizes
    cu = torch.tensor([0, 33, 150]) if varlen else None
    kw = dict(output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    for chunk_size in (32, 64):
        o, s = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size, backend="torch", **kw)
        assert_close_rel(o, o_ref)
        assert_close_rel(s, s_ref)
    if varlen:
        o2, s2 = chunk_kda(q, k, v, g, beta, cu_seqlens_cpu=cu.clone(), backend="torch", **kw)
        assert torch.equal(o2, chunk_kda(q, k, v, g, beta, backend="torch", **kw)[0])


@pytest.mark.parametrize("chunk_size", [16, 128, 48, True])
def test_chunk_size_other_values_raise_fla_error(chunk_size):
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64 for KDA"):
        chunk_kda(q, k, v, g, beta, chunk_size=chunk_size)


@pytest.mark.parametrize("kw", [dict(safe_gate=True), dict(disable_recompute=True), dict(use_graph=True),
                                dict(max_num_seqs=4), dict(lower_bound=-5.0)], ids=lambda kw: next(iter(kw)))
def test_gpu_strategy_options_are_no_ops(kw):
    """fla options that only pick a GPU kernel strategy: accepted, and the result is bit-identical (the same
    computation on the same shapes)."""
    q, k, v, g, beta, h0 = make_inputs(2, 70, 2, 8, 8, init_state=True)
    base = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    got = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, base))


BAD_OPTIONS = [
    (dict(use_gate_in_kernel=True), "`A_log` must be provided"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), r"A_log must be a float tensor of 2 elements"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2)), "dt_bias must be a float tensor"),
    (dict(A_log=torch.zeros(2)), "pass use_gate_in_kernel=True"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True), "`lower_bound` must be specified"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0), r"safe range \[-5, 0\)"),
    (dict(lower_bound=0.5), "lower_bound must be a negative number"),
    (dict(allow_neg_eigval=True), "requires `use_beta_sigmoid_in_kernel=True`"),
    (dict(return_intermediate_states=True, disable_recompute=True), "disable_recompute=False"),
    (dict(cp_context=object()), "cp_context"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 8])), "pass cu_seqlens too"),
    (dict(cu_seqlens=torch.tensor([0, 8]), cu_seqlens_cpu=torch.tensor([0, 4, 8])), "cu_seqlens' shape"),
    (dict(max_num_seqs=0), "max_num_seqs"),
]


@pytest.mark.parametrize("kw,match", BAD_OPTIONS, ids=[m[:24] for _, m in BAD_OPTIONS])
def test_bad_options_raise(kw, match):
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    with pytest.raises(ValueError, match=match):
        chunk_kda(q, k, v, g, beta, **kw)


def test_options_are_keyword_only_and_typed():
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    with pytest.raises(TypeError):
        chunk_kda(q, k, v, g, beta, None)
    with pytest.raises(TypeError, match="use_gate_in_kernel must be a bool"):
        chunk_kda(q, k, v, g, beta, use_gate_in_kernel=1)
    with pytest.raises(TypeError):
        fused_recurrent_kda(q, k, v, g, beta, num_accepted_tokens=torch.ones(1))


def test_triton_dispatch_passes_options_and_surfaces_missing_ones(monkeypatch):
    """backend='triton' gets fla's keywords; an option its entry point does not take, or a NotImplementedError it
    raises, is a clear NotImplementedError (no silent fall back to another backend)."""
    from kda_hybrid import kda_ops

    seen = {}

    def old_kernel(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        seen.update(scale=scale, initial_state=initial_state)
        return v.clone(), None

    def refusing_kernel(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, use_beta_sigmoid_in_kernel=False, **kw):
        raise NotImplementedError("beta logits are not fused yet")

    monkeypatch.setattr(kda_ops, "_triton_interpreted", lambda: True)
    monkeypatch.setattr(kda_ops, "chunk_kda_triton", old_kernel)
    q, k, v, g, beta, _ = make_inputs(1, 8, 2, 4, 6)
    o, _ = chunk_kda(q, k, v, g, beta, backend="triton")
    assert torch.equal(o, v) and seen["scale"] == 0.5
    with pytest.raises(NotImplementedError, match="does not implement use_beta_sigmoid_in_kernel"):
        chunk_kda(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, backend="triton")
    monkeypatch.setattr(kda_ops, "chunk_kda_triton", refusing_kernel)
    with pytest.raises(NotImplementedError, match="beta logits are not fused yet"):
        chunk_kda(q, k, v, g, beta, use_beta_sigmoid_in_kernel=True, backend="triton")
    q2, k2 = q[:, :, :1], k[:, :, :1]  # H = 1 q/k head for HV = 2 value heads
    monkeypatch.setattr(kda_ops, "chunk_kda_triton", old_kernel)
    monkeypatch.setattr(kda_ops, "_triton_supports_gva", lambda: False)
    with pytest.raises(NotImplementedError, match="grouped value heads"):
        chunk_kda(q2, k2, v, g, beta, backend="triton")
    monkeypatch.setattr(kda_ops, "_triton_supports_gva", lambda: True)
    assert torch.equal(chunk_kda(q2, k2, v, g, beta, backend="triton")[0], v)


# --------------------------------------------------------------------------------------------------
# The torch chunked path's fast forms (kda_torch): the anchored gated products, the blocked WY inverse and the
# custom backwards of the inverse and of the state scan.
# --------------------------------------------------------------------------------------------------


def _max_chunk_decay(g, C=64):
    """Largest decay -sum(g) across one whole chunk of one channel."""
    T = g.shape[1] // C * C
    return (-g.detach()[:, :T].unflatten(1, (-1, C)).sum(2)).max().item()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_anchored_form_past_the_one_anchor_bound(grad, monkeypatch):
    """Chunk decays in (MAX_BLOCK_DECAY, MAX_ANCHORED_DECAY] (the 6.5M model's gates at init reach ~100) take the
    anchored one-matmul form, factors exp(G - G_last / 2) within e^+-60, and never the hierarchy; output, final and
    intermediate states and every gradient match the token-by-token reference."""
    from kda_hybrid import kda_torch

    q, k, v, g, beta, h0 = make_inputs(1, 200, 2, 32, 32, gate=1.6, init_state=True, requires_grad=grad)
    assert kda_torch.MAX_BLOCK_DECAY < _max_chunk_decay(g) <= kda_torch.MAX_ANCHORED_DECAY
    monkeypatch.setattr(kda_torch, "_gated_products", lambda *a: pytest.fail("took the hierarchy"))
    if grad:
        assert_gradients_match_reference((q, k, v, g, beta, h0), torch.randn_like(v), torch.randn_like(h0))
        return
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, return_intermediate_states=True)
    with torch.no_grad():
        got = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
        ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert_all_close(list(got), list(ref), ["o", "s", "chunk states"], rel=1e-5)


@pytest.mark.parametrize("anchor", ["end", "halfway"])
@pytest.mark.parametrize("B,l2norm,states", [(1, True, False), (2, False, False), (1, True, True)],
                         ids=["B1-l2norm", "B2-raw", "B1-chunk-states"])
def test_no_grad_anchor_at_chunk_end_or_halfway(anchor, B, l2norm, states, monkeypatch):
    """Without autograd, chunks decaying at most e^-MAX_BLOCK_DECAY are anchored at their end (the scan carries
    exp(G_last) S); made 0 here, the same ordinary decays take the halfway anchor (the scan carries exp(G_last / 2) S).
    Both against the float64 token-by-token reference: output, final state (and the states entering every chunk of
    64 while computing in chunks of 64, with states; q unnormalised and only scaled, with raw)."""
    from kda_hybrid import kda_torch

    q, k, v, g, beta, h0 = make_inputs(B, 150, 2, 16, 24, init_state=True)
    assert 0 < _max_chunk_decay(g, 32) < kda_torch.MAX_BLOCK_DECAY  # ordinary decays: the end anchor by default
    if anchor == "halfway":
        monkeypatch.setattr(kda_torch, "MAX_BLOCK_DECAY", 0.0)
    monkeypatch.setattr(kda_torch, "_gated_products", lambda *a: pytest.fail("took the hierarchy"))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
              return_intermediate_states=states)
    with torch.no_grad():
        got = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
    ref = chunk_kda(*(x.double() for x in (q, k, v, g, beta)), backend="reference",
                    **{**kw, "initial_state": h0.double()})
    assert_all_close(list(got), list(ref), ["o", "s", "chunk states"][: len(got)], rel=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_state_crosses_anchored_and_hierarchical_groups(grad, monkeypatch):
    """Groups of chunks (GROUP_TOKENS, made 64 here) take their form each on their own: ordinary decay (anchored),
    then g = -20 per token (the hierarchy), then a full reset g = -inf in a padded last chunk. The state crosses
    every switch: outputs, final state and gradients match the reference."""
    from kda_hybrid import kda_torch

    monkeypatch.setattr(kda_torch, "GROUP_TOKENS", 64)
    q, k, v, g, beta, h0 = make_inputs(1, 170, 2, 16, 8, init_state=True)
    g = g.clone()
    g[:, 64:128] *= 20
    g[:, 150, 1, 3] = float("-inf")
    args = [x.requires_grad_(grad) for x in (q, k, v, g, beta, h0)]
    do, ds = torch.randn_like(v), torch.randn_like(h0)
    if grad:
        assert_gradients_match_reference(args, do, ds)
        return
    assert_matches_reference("torch", q, k, v, g, beta, h0)


@pytest.mark.parametrize("gate", [1.0, 30.0], ids=["anchored", "hierarchical"])
def test_float64_gradcheck_across_chunks_and_groups(gate, monkeypatch):
    """gradcheck (finite differences) of the torch chunked path over three chunks of 32 in two groups, so that the
    custom backwards of the state scan (_StateScan) and of the WY inverse are checked across chunk boundaries."""
    from kda_hybrid import kda_torch

    monkeypatch.setattr(kda_torch, "GROUP_TOKENS", 64)
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 4, 3, gate=gate, init_state=True, dtype=torch.float64)
    args = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=32,
                         use_qk_l2norm_in_kernel=True, backend="torch")

    assert torch.autograd.gradcheck(fn, tuple(args), fast_mode=True)


@pytest.mark.parametrize("C", [32, 64])
def test_unit_lower_inverse_reads_only_the_strict_lower_triangle(C):
    """The blocked inverse equals solve_triangular's (I + strict_lower(A))^-1 whatever lies on and above the diagonal
    (inf and NaN there, as A_kk's masked products may overflow), and its two-matmul backward equals autograd through
    solve_triangular."""
    from kda_hybrid.kda_torch import _unit_lower_inverse, _UnitLowerInverse

    gen = torch.Generator().manual_seed(3)
    L = (torch.randn(6, C, C, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
    eye = torch.eye(C, dtype=torch.float64).expand_as(L)
    junk = torch.full_like(L, float("inf")).triu(1) + torch.where(torch.eye(C, dtype=torch.bool), float("nan"), 0.0)
    ref = torch.linalg.solve_triangular(eye + L, eye, upper=False)
    torch.testing.assert_close(_unit_lower_inverse(L + junk), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(_unit_lower_inverse(L).triu(1), torch.zeros_like(L))

    A = L.clone().requires_grad_()
    dAi = torch.randn(6, C, C, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad(_UnitLowerInverse.apply(A), A, dAi)
    (want,) = torch.autograd.grad(torch.linalg.solve_triangular(eye + A.tril(-1), eye, upper=False), A, dAi)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("B", [1, 2])
def test_channels_first_inputs_equal_contiguous(B):
    """q, k, v as a conv1d output leaves them ([B, 3 H K, T] split into three [B, T, H, K] views whose
    token dimension is the dense one) take one transpose each into token-major order: output and final state equal
    those of contiguous copies bit for bit (the same kernels on the same shapes after it), gradients to rounding."""
    T, H, K = 70, 2, 16
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, K, init_state=True)
    conv_out = torch.cat([x.permute(0, 2, 3, 1).reshape(B, H * K, T) for x in (q, k, v)], dim=1)  # [B, 3 H K, T]
    views = [x.view(B, H, K, T).permute(0, 3, 1, 2) for x in conv_out.split(H * K, dim=1)]
    assert views[0].stride(1) == 1 and not views[0].is_contiguous()
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, backend="torch")
    o, s = chunk_kda(*views, g, beta, **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, **kw)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)

    do = torch.randn_like(o)
    leaves = [conv_out.detach().requires_grad_(), q.detach().requires_grad_(), k.detach().requires_grad_(),
              v.detach().requires_grad_()]
    views = [x.view(B, H, K, T).permute(0, 3, 1, 2) for x in leaves[0].split(H * K, dim=1)]
    (chunk_kda(*views, g, beta, **kw)[0] * do).sum().backward()
    (chunk_kda(*leaves[1:], g, beta, **kw)[0] * do).sum().backward()
    got = [x.view(B, H, K, T).permute(0, 3, 1, 2) for x in leaves[0].grad.split(H * K, dim=1)]
    assert_all_close(got, [x.grad for x in leaves[1:]], ["dq", "dk", "dv"], rel=1e-6)
