"""A NaN or inf at one token reaches no earlier token: the chunked KDA ops and the model are causal through
non-finite values as the token-by-token recurrence and one-query-at-a-time attention are. In a chunk's (or a
batch of queries') matmuls a NaN times the 0 of a causal mask is NaN, which is how a bad token had made every
earlier output of its chunk (torch), or of the whole call (Triton interpreter), or of the forward (attention) NaN.
The Triton backend's case is in test_triton.py (it needs that module's interpreter fixture)."""

import math

import pytest
import torch

from kda_hybrid import KDAHybridCache, chunk_kda

from .helpers import assert_close_rel, assert_same_nonfinite_then_close, make_inputs, tiny_model

NAN, INF = math.nan, math.inf
BAD_T = 40  # in the second 32-token compute chunk, not at its start


def _poisoned(name, value, B=2, T=70, H=2, K=16, V=16, t=BAD_T, row=0, head=1):
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, init_state=True)
    xs = dict(q=q, k=k, v=v, g=g, beta=beta)
    xs[name][row, t, head] = value
    return xs, h0


@pytest.mark.parametrize("name,value", [("k", NAN), ("k", INF), ("v", NAN), ("v", -INF), ("beta", NAN),
                                        ("beta", INF), ("g", NAN), ("q", NAN), ("q", INF)])
def test_chunk_torch_is_causal_through_a_nonfinite_input(name, value):
    """Outputs before the bad token are those of the reference (itself those of the clean prefix), later ones and
    the final state of that sequence and head are non-finite as the reference's are; the other row and head are
    untouched."""
    xs, h0 = _poisoned(name, value)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, check_inputs=False)
    o, s = chunk_kda(**xs, backend="torch", **kw)
    o_ref, s_ref = chunk_kda(**xs, backend="reference", **kw)
    assert_same_nonfinite_then_close(o, o_ref, name="o")
    assert_same_nonfinite_then_close(s, s_ref, name="final state")
    assert torch.isfinite(o[0, :BAD_T]).all() and not torch.isfinite(o[0, BAD_T, 1]).all()
    # the clean prefix alone, a differently shaped computation: within tolerance
    prefix = {key: x[:, :BAD_T] for key, x in xs.items()}
    o_pre, _ = chunk_kda(**prefix, backend="torch", **kw)
    assert_close_rel(o[:, :BAD_T], o_pre, name="prefix")


def test_chunk_legitimate_infinities_are_not_poison():
    """g = -inf is a full reset (decay 0) and +-inf through the in-kernel gate or beta sigmoid are finite gates:
    the outputs stay finite and equal the reference's."""
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, init_state=True)
    g = g.clone()
    g[0, BAD_T, 0] = -INF
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for backend in ("torch", "reference"):
        o, s = chunk_kda(q, k, v, g, beta, backend=backend, **kw)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_same_nonfinite_then_close(*(chunk_kda(q, k, v, g, beta, backend=b, **kw)[0] for b in ("torch", "reference")))
    raw_g, raw_beta = torch.randn(1, 70, 2, 16), torch.randn(1, 70, 2)
    raw_g[0, 10, 0, 3], raw_g[0, 50, 1, 0], raw_beta[0, 20, 0], raw_beta[0, 60, 1] = INF, -INF, INF, -INF
    opts = dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2 * 16),
                use_beta_sigmoid_in_kernel=True, **kw)
    o, s = chunk_kda(q, k, v, raw_g, raw_beta, backend="torch", **opts)
    o_ref, s_ref = chunk_kda(q, k, v, raw_g, raw_beta, backend="reference", **opts)
    assert torch.isfinite(o).all()
    assert_same_nonfinite_then_close(o, o_ref)
    assert_same_nonfinite_then_close(s, s_ref, name="final state")


def test_chunk_varlen_nonfinite_stays_in_its_sequence():
    """Packed sequences (5, 70, 40 tokens): a NaN in the second one leaves the first and third exact and finite,
    its own earlier tokens too; the states entering chunks after it are NaN, earlier ones not."""
    lens = (5, 70, 40)
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), 2, 16, 16)
    h0 = torch.randn(3, 2, 16, 16)
    cu = torch.tensor([0, 5, 75, 115])
    v = v.clone()
    v[0, 5 + BAD_T, 0, 3] = NAN
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, s = chunk_kda(q, k, v, g, beta, backend="torch", **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert_same_nonfinite_then_close(o, o_ref)
    assert_same_nonfinite_then_close(s, s_ref, name="final state")
    assert torch.isfinite(s[[0, 2]]).all() and not torch.isfinite(s[1, 0]).all() and torch.isfinite(s[1, 1]).all()
    with torch.no_grad():
        *_, h = chunk_kda(q, k, v, g, beta, backend="torch", return_intermediate_states=True, chunk_size=32, **kw)
        *_, h_ref = chunk_kda(q, k, v, g, beta, backend="reference", return_intermediate_states=True,
                              chunk_size=32, **kw)
    # chunks: seq 0 one (start 0), seq 1 three (starts 5, 37, 69: the last after the NaN at 45), seq 2 two
    assert h.shape[1] == 6
    assert_same_nonfinite_then_close(h, h_ref, name="chunk states")
    assert not torch.isfinite(h[0, 3, 0]).all() and torch.isfinite(h[0, [0, 1, 2, 4, 5]]).all()


@pytest.mark.parametrize("attention,impl,moe", [("mla", "sdpa", False), ("mla", "eager", True),
                                                ("gqa", "sdpa", True), ("gqa", "eager", False)])
def test_model_nan_embedding_reaches_no_earlier_token(attention, impl, moe):
    """A NaN in inputs_embeds at t=7 of a 70-token row (several KDA chunks): logits 0-6 equal the clean prefix's,
    every later one is NaN (each attends to token 7 or carries a state that holds it), the other row equals its
    own run; decode over the cache stays NaN for that row (the cache holds the NaN, as the recurrence does) and
    finite for the other."""
    model = tiny_model(attention, moe=moe, attn_implementation=impl)
    ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(0))
    emb = model.get_input_embeddings()(ids).detach().clone()
    emb[0, 7] = NAN
    with torch.no_grad():
        cache = KDAHybridCache(model.config)
        logits = model(inputs_embeds=emb, cache=cache, use_cache=True).logits
        clean = model(inputs_embeds=emb[:1, :7]).logits
        other = model(inputs_embeds=emb[1:]).logits
        step = model(torch.tensor([[5], [6]]), cache=cache, use_cache=True).logits
    assert_close_rel(logits[:1, :7], clean, name="prefix")
    assert not torch.isfinite(logits[0, 7:]).any(-1).any()
    assert_close_rel(logits[1:], other, name="other row")
    assert not torch.isfinite(step[0]).any() and torch.isfinite(step[1]).all()


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_model_nan_in_one_packed_document_stays_there(attention):
    """Packed documents (position_ids restart, sdpa per document): a NaN in the second document's token 3 leaves the
    first document and that document's first three tokens exact."""
    model = tiny_model(attention)
    ids = torch.randint(1, 97, (1, 50), generator=torch.Generator().manual_seed(1))
    position_ids = torch.cat([torch.arange(20), torch.arange(30)])[None]
    emb = model.get_input_embeddings()(ids).detach().clone()
    emb[0, 23] = NAN
    with torch.no_grad():
        logits = model(inputs_embeds=emb, position_ids=position_ids).logits
        first = model(inputs_embeds=emb[:, :20]).logits
        second = model(inputs_embeds=emb[:, 20:23]).logits
    assert_close_rel(logits[:, :20], first, name="first document")
    assert_close_rel(logits[:, 20:23], second, name="second document before the NaN")
    assert not torch.isfinite(logits[0, 23:]).any(-1).any()


def test_attention_weights_rows_after_a_nan_are_nan_and_earlier_rows_exact():
    """output_attentions under eager: the rows of queries that see the NaN token are NaN, the earlier rows equal the
    clean prefix's weights."""
    model = tiny_model("gqa", attn_implementation="eager")
    ids = torch.randint(1, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    emb = model.get_input_embeddings()(ids).detach().clone()
    emb[0, 7] = NAN
    with torch.no_grad():
        w = model(inputs_embeds=emb, output_attentions=True).attentions[0]
        w_clean = model(inputs_embeds=emb[:, :7], output_attentions=True).attentions[0]
    assert_close_rel(w[:, :, :7, :7], w_clean)
    assert torch.equal(w[:, :, :7, 7:], torch.zeros_like(w[:, :, :7, 7:]))
    assert torch.isnan(w[:, :, 7:]).all()


def test_chunk_nonfinite_value_channel_in_the_state_v_first_layout():
    """A NaN in one value channel poisons that channel only (the delta rule keeps value channels apart), in fla's
    state_v_first layout [N, HV, V, K] too."""
    xs, h0 = _poisoned("v", NAN, B=1)
    xs["v"][0, BAD_T, 1] = 0.0
    xs["v"][0, BAD_T, 1, 5] = NAN
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(**xs, initial_state=h0.transpose(-1, -2).contiguous(), state_v_first=True, backend="torch",
                     **kw)
    o_ref, s_ref = chunk_kda(**xs, initial_state=h0, backend="reference", **kw)
    assert_same_nonfinite_then_close(o, o_ref)
    assert_same_nonfinite_then_close(s, s_ref.transpose(-1, -2), name="final state")
    assert torch.isfinite(o[0, BAD_T:, 1, :5]).all() and torch.isnan(o[0, BAD_T:, 1, 5]).all()
