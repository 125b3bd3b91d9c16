"""KDA ops on CPU: the torch chunked path and the recurrent path against our reference and fla's naive
recurrence (an independent oracle), gradients against autograd of the reference, and input validation."""

import pytest
import torch
import torch.nn.functional as F

from kda_hybrid import chunk_kda, fused_recurrent_kda

naive = pytest.importorskip("fla.ops.kda.naive", reason="flash-linear-attention (test extra) provides the oracle")


def make_inputs(B, T, H, K, V, *, gate=1.0, seed=0, dtype=torch.float32, init_state=False, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    # unit-norm keys, as the model feeds them: the delta rule is only contractive for beta * |k|^2 <= 2
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    # log-sigmoid gates as the model produces them, scaled: gate=20 reaches about -20 per token
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) * gate
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) if init_state else None
    xs = [x.to(dtype) for x in (q, k, v, g, beta)]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
        if h0 is not None:
            h0.requires_grad_()
    return (*xs, h0)


def assert_close_rel(actual, expected, rel=1e-5, name="output"):
    """max |actual - expected| <= rel * max |expected| (error relative to the output scale)."""
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual.float() - expected.float()).abs().max()
    assert err <= rel * scale, f"{name}: max abs error {err:.3e} > {rel:.0e} * scale {scale:.3e}"


def assert_matches_reference(backend, q, k, v, g, beta, h0):
    """chunk_kda on `backend` (with an initial state, its final state, qk l2norm in the kernel): finite, and output
    and final state within assert_close_rel of the token-by-token reference."""
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, backend=backend, **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)


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


def test_mixed_decay_takes_hierarchical_path():
    """One channel with huge decay forces the anchored hierarchy; the others keep ordinary decay."""
    q, k, v, g, beta, _ = make_inputs(1, 200, 2, 32, 32)
    g = g.clone()
    g[..., 0, 3] = -30.0
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="torch")
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


def assert_gradients_match_reference(args, do, ds, **kw):
    """Gradients of (o * do).sum() + (s * ds).sum() for q, k, v, g, beta and the initial state: the torch chunked
    path against autograd through the token-by-token reference."""
    q, k, v, g, beta, h0 = args

    def grads(backend):
        for x in args:
            x.grad = None
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, backend=backend, **kw)
        ((o * do).sum() + (s * ds).sum()).backward()
        return [x.grad.clone() for x in args]

    for name, got, ref in zip("q k v g beta h0".split(), grads("torch"), grads("reference")):
        assert torch.isfinite(got).all(), name
        assert_close_rel(got, ref, rel=2e-5, name=f"d{name}")


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
        for x in args:
            x.grad = None
        o, s = fn(*args)
        ((o * do).sum() + (s * ds).sum()).backward()
        return [o.detach(), s.detach()] + [x.grad.clone() for x in args]

    def op(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")

    eager, compiled = run(op), run(torch.compile(op))
    for name, got, ref in zip("o s dq dk dv dg dbeta dh0".split(), compiled, eager):
        assert_close_rel(got, ref, name=name)


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
    ("int-dtype", lambda d: d.update(q=d["q"].long()), {}, "float32, bfloat16 or float16"),
    ("mixed-qkv-dtype", lambda d: d.update(v=d["v"].double()), {}, "v must be float32"),
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


# ------------------------------------------------------------------------------------------------
# Property-based: any shape, any gate strength, chunked == token by token.
# ------------------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 150), H=st.integers(1, 3), K=st.sampled_from([4, 8, 16, 24]),
    V=st.sampled_from([4, 8, 16, 40]), gate=st.floats(0.0, 40.0), seed=st.integers(0, 2**16),
    init_state=st.booleans(),
)
def test_property_chunk_equals_reference(B, T, H, K, V, gate, seed, init_state):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, gate=gate, seed=seed, init_state=init_state)
    assert_matches_reference("torch", q, k, v, g, beta, h0)
