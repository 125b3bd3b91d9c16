"""torch.compile past the first KDA chunk: inference (no grad) through the chunked ops and the model, with and
without a cache, prefill then decode, static and dynamic shapes. The no-grad chunk scan works in place; AOT
autograd's functionalisation of it had returned a stale view (kE = kc.mul_(E) after another view of the same buffer
was written with out=), so every chunk after the first was wrong under aot_eager and inductor alike, while the
existing compile tests used inputs shorter than one chunk. aot_eager runs that functionalisation without
inductor's code generation (seconds instead of a minute), so the fast tests use it; the inductor matrix is slow."""

import pytest
import torch

from kda_hybrid import KDAHybridCache, chunk_kda

from .helpers import assert_close_rel, make_inputs, prompt, tiny_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _chunk(q, k, v, g, beta, h0):
    return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                     backend="torch")


# per-token gates of about -0.8, -4 and -16: 32-token chunks decaying ~26 (anchored at the chunk end), ~120
# (anchored halfway) and ~500 (the hierarchical products), each one of the no-grad scan's three forms
@pytest.mark.parametrize("gate", [1.0, 4.5, 20.0], ids=["end-anchor", "halfway", "hierarchy"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_chunk_inference_equals_eager_past_one_chunk(backend, gate):
    """B = 2, T = 100 (three whole 32-token chunks and a partial one), an initial state, no grad."""
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 16, 16, gate=gate, init_state=True)
    with torch.no_grad():
        o, s = _chunk(q, k, v, g, beta, h0)
        o_c, s_c = torch.compile(_chunk, backend=backend)(q, k, v, g, beta, h0)
        o_ref, s_ref = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, backend="reference")
    assert_close_rel(o_c, o, name="o")
    assert_close_rel(s_c, s, name="final state")
    assert_close_rel(o_c, o_ref, name="o against the reference")


def test_compiled_varlen_chunk_and_recurrent_inference_equal_eager():
    """Packed sequences (5, 70, 40 tokens: buckets of several chunks) through the compiled chunked op, and the
    in-place token-by-token op on a caller's state, no grad, under aot_eager's functionalisation."""
    from kda_hybrid import fused_recurrent_kda

    q, k, v, g, beta, _ = make_inputs(1, 115, 2, 16, 16)
    h0 = torch.randn(3, 2, 16, 16)
    cu = torch.tensor([0, 5, 75, 115])

    def packed(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                         use_qk_l2norm_in_kernel=True, backend="torch")

    def in_place(q, k, v, g, beta, state):
        o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, inplace_final_state=True,
                                   use_qk_l2norm_in_kernel=True, backend="torch")
        return o

    with torch.no_grad():
        for got, want in zip(torch.compile(packed, backend="aot_eager")(q, k, v, g, beta, h0),
                             packed(q, k, v, g, beta, h0)):
            assert_close_rel(got, want)
        x = [t[:, :7].expand(2, -1, -1, *t.shape[3:]).contiguous() for t in (q, k, v, g, beta)]
        s_eager, s_comp = h0[:2].clone(), h0[:2].clone()
        o_eager = in_place(*x, s_eager)
        o_comp = torch.compile(in_place, backend="aot_eager")(*x, s_comp)
    assert_close_rel(o_comp, o_eager, name="o")
    assert_close_rel(s_comp, s_eager, name="state written in place")


def _generate(forward, model, ids, steps, with_cache):
    """Prefill `ids` then `steps` greedy tokens one at a time (with a cache), or the whole growing sequence each
    step (without): the logits of every step, concatenated."""
    logits = []
    with torch.no_grad():
        if with_cache:
            cache = KDAHybridCache(model.config)
            out = forward(input_ids=ids, cache=cache, use_cache=True).logits
            logits.append(out)
            for _ in range(steps):
                out = forward(input_ids=out[:, -1:].argmax(-1), cache=cache, use_cache=True).logits
                logits.append(out)
        else:
            seq = ids
            for _ in range(steps + 1):
                out = forward(input_ids=seq, use_cache=False).logits
                logits.append(out[:, -1:])
                seq = torch.cat([seq, out[:, -1:].argmax(-1)], 1)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
def test_compiled_model_inference_past_one_chunk_aot_eager(with_cache):
    """The issue's model: hidden 48, weights ~N(0, 0.2) (large enough that a wrong chunk shows at once), B = 2,
    a 100-token prompt, then 3 tokens."""
    model = tiny_model("mla", hidden_size=48)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    ids = prompt(B=2, T=100, seed=3)
    eager = _generate(model, model, ids, 3, with_cache)
    compiled = _generate(torch.compile(model, backend="aot_eager"), model, ids, 3, with_cache)
    assert_close_rel(compiled, eager, rel=1e-5)


@pytest.mark.slow  # inductor compiles of the prefill and the decode step, per case: about a minute each on CPU
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_compiled_model_inference_past_one_chunk_inductor(attention, dynamic):
    """torch.compile(model) with inductor: a 100-token prefill into a cache and 4 decode steps, and the same prompt
    without a cache, for B = 2: greedy tokens equal eager's, logits within fp32 rounding of the fused kernels
    (inductor reorders reductions: 1e-4 of the logit scale bounds that, far below a wrong chunk's error of ~1)."""
    model = tiny_model(attention)
    ids = prompt(B=2, T=100, seed=4)
    compiled = torch.compile(model, dynamic=dynamic)
    for with_cache in (True, False):
        eager = _generate(model, model, ids, 4, with_cache)
        got = _generate(compiled, model, ids, 4, with_cache)
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        assert_close_rel(got, eager, rel=1e-4)


def _loss_and_grads(forward, model, ids, with_cache):
    """Forward + backward of the LM loss on `ids` (into a fresh cache, or none): the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    cache = KDAHybridCache(model.config) if with_cache else None
    loss = forward(input_ids=ids, labels=ids, cache=cache, use_cache=with_cache).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_compiled_training_step_equals_eager_in_train_and_eval_mode(attention, mode, with_cache):
    """Gradients through a compiled model in eval() mode (attribution, RL with dropout off) crashed when a cache
    was given: the compiled graph always runs the non-finite guard, which marked the cache's rows in place after
    the attention had saved them for backward. 70 tokens (three KDA chunks), B = 2, aot_eager's
    functionalisation (where the version check failed) in train and eval mode."""
    model = tiny_model(attention)
    model.train(mode == "train")
    ids = prompt(B=2, T=70, seed=5)
    loss, grads = _loss_and_grads(model, model, ids, with_cache)
    loss_c, grads_c = _loss_and_grads(torch.compile(model, backend="aot_eager"), model, ids, with_cache)
    assert_close_rel(loss_c, loss, rel=1e-5, name="loss")
    assert grads_c.keys() == grads.keys() and len(grads) > 0
    for name, g in grads.items():
        assert_close_rel(grads_c[name], g, rel=1e-4, name=name)
