"""The common model contract transformers checks for its built-in models, in this repo's words: loading from the
meta device equals a fresh model (buffers included), output fields (hidden states, attentions, tuples, gradients),
4-D masks, padding that holds NaN, position_ids and masks against the cache, and bad input at the boundary."""

import functools
import math

import pytest
import torch
from accelerate import init_empty_weights, load_checkpoint_and_dispatch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.utils import logging

from kda_hybrid import KDAHybridCache, KDAHybridForCausalLM
from kda_hybrid.cache_layers_kda_hybrid import KDALayerState

from . import helpers
from .helpers import assert_same_generation, generate_with_logits, prompt

# KDAHybridConfig's default routed scaling (1.0), which these tests were written with; the rest is helpers.tiny_model
tiny_model = functools.partial(helpers.tiny_model, routed_scaling_factor=1.0)


def left_padded(lengths, seed=2):
    """ids and 2-D mask for rows of the given real lengths, left-padded with token 0."""
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, T - n:] = prompt(1, n, seed + i)[0]
        mask[i, T - n:] = 1
    return ids, mask


def cache_tensors(cache):
    return [t for layer in cache.layers for t in layer.tensors()]


def assert_same_cache(a, b, **tol):
    ta, tb = cache_tensors(a), cache_tensors(b)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb):
        torch.testing.assert_close(x, y, **tol)


# --------------------------------------------------------------------------------------------------
# Loading from the meta device equals a fresh model, buffers included
# --------------------------------------------------------------------------------------------------


def _load(path, folder, config):
    if path == "accelerate":  # parameters on meta, buffers real (init_empty_weights' default), then dispatch
        with init_empty_weights():
            model = KDAHybridForCausalLM(config)
        return load_checkpoint_and_dispatch(model, str(folder), device_map={"": "cpu"})
    kwargs = {"from_pretrained": {}, "low_cpu_mem_usage": {"low_cpu_mem_usage": True},
              "device_map_cpu": {"device_map": "cpu"}, "device_map_auto": {"device_map": "auto"}}[path]
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


@pytest.fixture(scope="module", params=[("mla", False), ("gqa", False), ("gqa", True)],
                ids=["mla", "gqa", "gqa-moe"])
def saved(request, tmp_path_factory):
    attention, moe = request.param
    model = tiny_model(attention, moe)
    folder = tmp_path_factory.mktemp(f"{attention}-{moe}")
    model.save_pretrained(folder)
    return model, folder


@pytest.mark.parametrize("path", ["from_pretrained", "low_cpu_mem_usage", "device_map_cpu", "device_map_auto",
                                  "accelerate"])
def test_every_loading_path_equals_the_fresh_model(saved, path):
    model, folder = saved
    loaded = _load(path, folder, model.config).eval()
    fresh_state, loaded_state = model.state_dict(), loaded.state_dict()
    assert fresh_state.keys() == loaded_state.keys()
    for name, tensor in fresh_state.items():
        assert torch.equal(loaded_state[name], tensor), name
    fresh_buffers, loaded_buffers = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert fresh_buffers.keys() == loaded_buffers.keys()
    for name, tensor in fresh_buffers.items():
        assert loaded_buffers[name].dtype == tensor.dtype and torch.equal(loaded_buffers[name], tensor), name
    if model.config.attention_type == "gqa":  # and the buffer is RoPE's, from its formula (not from our code)
        dim, theta = model.config.head_dim, model.config.rope_theta
        expected = torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float32)
        torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, expected, rtol=1e-6, atol=0)
    ids = prompt()
    with torch.no_grad():
        # same weights and kernels; loaded tensors sit at other memory alignments, where vectorised CPU kernels
        # may split reductions differently: fp32 rounding only (measured <= 6e-8)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    greedy = dict(max_new_tokens=4, do_sample=False)
    assert_same_generation(generate_with_logits(loaded, ids, **greedy), generate_with_logits(model, ids, **greedy),
                           rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Output fields
# --------------------------------------------------------------------------------------------------


def test_output_flags_from_the_config_as_from_the_call():
    model = tiny_model("gqa", attn_implementation="eager")
    ids = prompt()
    with torch.no_grad():
        by_call = model(ids, output_hidden_states=True, output_attentions=True)
        model.config.output_hidden_states = model.config.output_attentions = True
        by_config = model(ids)
        assert model(ids, output_hidden_states=False, output_attentions=False).hidden_states is None  # call wins
    L, A = model.config.num_hidden_layers, len(model.config.full_attention_layers)
    assert len(by_config.hidden_states) == L + 1 and len(by_config.attentions) == A
    for a, b in zip(by_call.hidden_states, by_config.hidden_states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same computation twice
    for a, b in zip(by_call.attentions, by_config.attentions):
        assert (a is None) == (b is None)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_attentions_one_entry_per_attention_layer_under_eager(attention):
    """As transformers' hybrid models (kimi_linear, qwen3_next) record them: one entry per full-attention layer,
    none for KDA layers (which have no attention weights)."""
    model = tiny_model(attention, attn_implementation="eager", num_hidden_layers=8)
    ids, mask = left_padded([9, 6])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True, use_cache=True)
    H = model.config.num_attention_heads
    assert len(out.attentions) == len(model.config.full_attention_layers) == 2
    for weights in out.attentions:
        assert weights.shape == (2, H, 9, 9)
        real_rows = weights[1, :, 3:]  # row 1 has 3 pads in front
        torch.testing.assert_close(real_rows.sum(-1), torch.ones_like(real_rows[..., 0]))
        assert torch.all(real_rows[..., :3] == 0)  # no weight on padding
        future = torch.ones(9, 9, dtype=torch.bool).triu(1)
        assert torch.all(weights[0][:, future] == 0) and torch.all(real_rows[:, future[3:]] == 0)  # causal
    # a decode step (the cache path) gives the weights of the last row of a full forward over the same tokens
    nxt = prompt(2, 1, seed=9)
    full_mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1)
    with torch.no_grad():
        step = model(nxt, attention_mask=full_mask, cache=out.cache, output_attentions=True)
        full = model(torch.cat((ids, nxt), 1), attention_mask=full_mask, output_attentions=True)
    for s, f in zip(step.attentions, full.attentions, strict=True):
        torch.testing.assert_close(s[1], f[1, :, -1:], rtol=1e-5, atol=1e-6)


def test_attentions_under_sdpa_are_none_with_a_warning():
    """As transformers' built-in models: sdpa computes no weights, a warning says so (and how to get them)."""
    model = tiny_model("mla")
    assert model.config._attn_implementation == "sdpa"
    records = []
    handler = logging.logging.Handler()
    handler.emit = records.append
    target = logging.get_logger(type(model.model).__module__)
    logging.logging.Logger.warning_once.cache_clear()  # warning_once: once per process, so forget earlier ones
    target.addHandler(handler)
    try:
        with torch.no_grad():
            out = model(prompt(), output_attentions=True)
    finally:
        target.removeHandler(handler)
    assert out.attentions == (None,) * len(model.config.full_attention_layers)
    assert any("attn_implementation='eager'" in r.getMessage() for r in records)


@pytest.mark.parametrize("use_cache", [False, True])
def test_return_dict_false_is_to_tuple(use_cache):
    model = tiny_model("gqa", attn_implementation="eager")
    ids = prompt()
    kw = dict(labels=ids, output_hidden_states=True, output_attentions=True, use_cache=use_cache)
    with torch.no_grad():
        as_dict = model(ids, **kw).to_tuple()
        as_tuple = model(ids, return_dict=False, **kw)
        model.config.return_dict = False
        from_config = model(ids, **kw)
        base = model.model(ids, use_cache=use_cache)
    model.config.return_dict = True
    assert isinstance(as_tuple, tuple) and isinstance(from_config, tuple) and isinstance(base, tuple)
    for got in (as_tuple, from_config):
        assert len(got) == len(as_dict) == (5 if use_cache else 4)  # loss, logits, [cache], hidden, attentions
        for a, b in zip(got, as_dict):
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same computation
            elif isinstance(a, KDAHybridCache):
                assert isinstance(b, KDAHybridCache) and a.get_seq_length() == b.get_seq_length() == 9
            else:
                assert len(a) == len(b) and all((x is None) == (y is None) for x, y in zip(a, b))


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_returned_hidden_states_are_the_graph_tensors(attention):
    """retain_grad works and autograd reaches every returned hidden state: they are the tensors the graph used,
    not copies; the last one is what lm_head read."""
    model = tiny_model(attention, True).train()
    ids, mask = left_padded([9, 7])
    out = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True)
    for h in out.hidden_states:
        h.retain_grad()
    out.loss.backward()
    again = model(ids, attention_mask=mask, labels=ids, output_hidden_states=True)  # the same computation
    grads = torch.autograd.grad(again.loss, again.hidden_states)  # fails on a tensor the graph did not use
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for h, g in zip(out.hidden_states, grads):
        assert h.grad is not None and torch.equal(h.grad, g) and bool(g.abs().sum() > 0)
    torch.testing.assert_close(model.lm_head(out.hidden_states[-1]), out.logits, rtol=0, atol=0)


def test_generate_returns_attentions_and_hidden_states():
    model = tiny_model("mla", attn_implementation="eager")
    ids = prompt(B=1, T=6)
    greedy = dict(max_new_tokens=4, do_sample=False)
    got = generate_with_logits(model, ids, output_attentions=True, output_hidden_states=True, **greedy)
    # weights asked for: MLA decodes on its masked path instead of the latent one (test_model's path table)
    assert_same_generation(got, generate_with_logits(model, ids, **greedy), rtol=1e-5, atol=1e-6)
    out = got.output
    assert len(out.attentions) == len(out.hidden_states) == 4
    for step, weights in enumerate(out.attentions):
        assert len(weights) == len(model.config.full_attention_layers)
        for w in weights:
            assert w.shape[-2:] == (6 if step == 0 else 1, 6 + step)


@pytest.mark.parametrize("mode", [dict(prompt_lookup_num_tokens=3), "assistant"], ids=["prompt-lookup", "assisted"])
def test_assisted_generation_returns_the_attentions_of_greedy(mode):
    """Assisted decoding (an assistant model, prompt lookup) returns one attentions entry per generated token, each
    with the attention layers' weights, equal to greedy decoding's (transformers skips them when the first entry
    of a forward's attentions is None, which a KDA layer's entry had been: an empty tuple came back)."""
    model = tiny_model("mla", attn_implementation="eager")
    kw = dict(assistant_model=tiny_model("mla", seed=1, attn_implementation="eager")) if mode == "assistant" else mode
    ids = prompt(B=1, T=9)
    common = dict(max_new_tokens=5, do_sample=False, output_attentions=True)
    greedy = generate_with_logits(model, ids, **common)
    assisted = generate_with_logits(model, ids, **common, **kw)
    assert_same_generation(assisted, greedy, rtol=1e-5, atol=1e-6)  # the attentions' tolerance below
    greedy, assisted = greedy.output, assisted.output
    assert len(assisted.attentions) == len(greedy.attentions) == 5
    for step, (a, g) in enumerate(zip(assisted.attentions, greedy.attentions)):
        assert len(a) == len(g) == len(model.config.full_attention_layers)
        for wa, wg in zip(a, g):
            assert wa.shape == wg.shape, step
            torch.testing.assert_close(wa, wg, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# 4-D attention masks
# --------------------------------------------------------------------------------------------------


def _four_d(model, ids, mask, kind):
    if kind == "transformers":  # as transformers builds it for the model's attention implementation
        return create_causal_mask(config=model.config, inputs_embeds=model.get_input_embeddings()(ids),
                                  attention_mask=mask, cache=None, position_ids=None)
    T = ids.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    if kind == "bool":
        return allowed
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf") if kind == "float-inf" else -1e9)


@pytest.mark.parametrize("kind", ["bool", "float-inf", "float-big", "transformers"])
@pytest.mark.parametrize("attention,impl", [("mla", "sdpa"), ("gqa", "eager")])
def test_four_d_mask_equals_two_d_mask_equals_unpadded(attention, impl, kind):
    model = tiny_model(attention, True, attn_implementation=impl)
    ids, mask = left_padded([9, 5])
    ids[0, 7:], mask[0, 7:] = 0, 0  # row 0 right-padded as well: real tokens 0..6
    m4 = _four_d(model, ids, mask, kind)
    with torch.no_grad():
        two_d = model(ids, attention_mask=mask, use_cache=True)
        four_d = model(ids, attention_mask=m4, use_cache=True)
        for row, (lo, hi) in enumerate([(0, 7), (4, 9)]):
            alone = model(ids[row:row + 1, lo:hi]).logits[0]
            torch.testing.assert_close(four_d.logits[row, lo:hi], alone, rtol=1e-4, atol=1e-5)
    real = mask.bool()  # pad rows may differ (an all -inf row is NaN under eager): they reach nothing real
    torch.testing.assert_close(four_d.logits[real], two_d.logits[real], rtol=1e-5, atol=1e-6)
    for layer_4, layer_2 in zip(four_d.cache.layers, two_d.cache.layers):  # KDA states as well
        if isinstance(layer_4, KDALayerState):
            for a, b in zip(layer_4.tensors(), layer_2.tensors()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_four_d_masks_the_kda_layers_cannot_follow_are_refused_before_any_state_changes():
    model = tiny_model("gqa")
    ids = prompt(B=1, T=8)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    block = causal.clone()
    block[4:, :4] = False  # two packed documents
    window = causal & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)  # sliding window of 3
    per_head = causal[None].repeat(4, 1, 1)
    per_head[1, 5, 2] = False
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
        before = [t.clone() for t in cache_tensors(cache)]
        for bad in (block[None, None], window[None, None], per_head[None]):
            with pytest.raises(ValueError, match="attention_mask"):
                model(ids, attention_mask=bad)
        for bad, error in ((causal[None, None].long(), TypeError), (causal[None, None, :, :7], ValueError)):
            with pytest.raises(error, match="4-D attention_mask"):
                model(ids, attention_mask=bad)
        one = torch.ones(1, 1, 1, 9, dtype=torch.bool)  # a decode step over the cache: right shape works...
        with pytest.raises(ValueError, match="4-D attention_mask"):  # ... a mask for 8 keys does not
            model(ids[:, :1], cache=cache, attention_mask=one[..., :8])
    assert cache.get_seq_length() == 8
    for a, b in zip(before, cache_tensors(cache)):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------------
# Padding holding NaN or inf never reaches real tokens or the cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("attention,moe,impl", [("mla", False, "sdpa"), ("gqa", True, "eager"),
                                                ("mla", True, "eager")])
def test_nan_padding_embeddings_reach_no_real_token(attention, moe, impl, poison):
    model = tiny_model(attention, moe, attn_implementation=impl)
    ids, mask = left_padded([9, 5])
    ids[0, 6:], mask[0, 6:] = 0, 0  # row 0 right-padded: both kinds of padding
    clean = model.get_input_embeddings()(ids).detach()
    dirty = clean.masked_fill(~mask.bool()[..., None], poison)
    nxt = prompt(2, 1, seed=7)
    step_mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1)
    with torch.no_grad():
        ref = model(inputs_embeds=clean, attention_mask=mask, use_cache=True)
        out = model(inputs_embeds=dirty, attention_mask=mask, use_cache=True)
        real = mask.bool()
        assert torch.isfinite(out.logits[real]).all()
        torch.testing.assert_close(out.logits[real], ref.logits[real], rtol=1e-5, atol=1e-6)
        for t in cache_tensors(out.cache):
            assert torch.isfinite(t).all()
        assert_same_cache(out.cache, ref.cache, rtol=1e-5, atol=1e-6)  # the pads' KV are zeros-derived, finite
        ref_step = model(nxt, attention_mask=step_mask, cache=ref.cache).logits
        out_step = model(nxt, attention_mask=step_mask, cache=out.cache).logits
    torch.testing.assert_close(out_step, ref_step, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# position_ids and masks against the cache
# --------------------------------------------------------------------------------------------------


def test_position_ids_past_zero_are_positions_not_packing():
    """Rows that start past 0 are one document each (transformers reads packing only from restarts inside a row):
    the call gets its cache; GQA's RoPE is relative, so shifted positions give the same logits."""
    model = tiny_model("gqa")
    ids = prompt(B=2, T=9)
    shifted = torch.stack([torch.arange(5, 14), torch.arange(2, 11)])
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        out = model(ids, position_ids=shifted, use_cache=True)
    assert out.cache is not None and out.cache.get_seq_length() == 9
    # RoPE rotates q and k by the same offset: equal up to fp32 rounding of sin/cos at other angles
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    for a, b in zip(kda_only(out.cache), kda_only(ref.cache)):  # the first KDA layer precedes any attention
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def kda_only(cache):
    return [t for layer in cache.layers if isinstance(layer, KDALayerState) for t in layer.tensors()]


def test_packed_position_ids_with_a_cache_asked_for_is_an_error():
    model = tiny_model("mla")
    ids = prompt(B=1, T=9)
    packed = torch.cat((torch.arange(4), torch.arange(5)))[None]
    with torch.no_grad():
        assert model(ids, position_ids=packed).cache is None  # not asked for (config default): packed, no cache
        with pytest.raises(ValueError, match="use_cache=False"):
            model(ids, position_ids=packed, use_cache=True)
        cache = KDAHybridCache(model.config)
        with pytest.raises(ValueError, match="packed"):
            model(ids, position_ids=packed, cache=cache)
    assert cache.get_seq_length() == 0 and not cache_tensors(cache)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_decode_mask_must_cover_the_cache(attention):
    """After a left-padded prompt, a [B, 1] decode mask would attend to the cached pads: refused, cache unchanged;
    the [B, past + 1] mask is the one that works."""
    model = tiny_model(attention)
    ids, mask = left_padded([9, 4])
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        before = [t.clone() for t in cache_tensors(cache)]
        nxt = prompt(2, 1, seed=4)
        with pytest.raises(ValueError, match=r"attention_mask must be \[B, past \+ T\] = \(2, 10\)"):
            model(nxt, attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache)
        assert cache.get_seq_length() == 9
        for a, b in zip(before, cache_tensors(cache)):
            assert torch.equal(a, b)
        step = model(nxt, attention_mask=torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1), cache=cache)
        alone = model(torch.cat((ids[1:, 5:], nxt[1:]), 1)).logits[0, -1]
    torch.testing.assert_close(step.logits[1, -1], alone, rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_training_takes_no_cache_and_leaves_a_given_one_untouched():
    """As built-in models: checkpointed layers cannot fill a cache (the backward replays them), so none is used,
    and a cache passed in is neither written nor counted as holding the tokens."""
    model = tiny_model("mla").train()
    model.gradient_checkpointing_enable()
    ids = prompt()
    cache = KDAHybridCache(model.config)
    out = model(ids, cache=cache, use_cache=True, labels=ids)
    out.loss.backward()
    assert out.cache is None and cache.get_seq_length() == 0 and not cache_tensors(cache)
    with torch.no_grad():  # without gradients nothing is checkpointed: the cache works as in eval
        assert model(ids, cache=cache).cache.get_seq_length() == 9


@pytest.mark.parametrize("with_mask", [False, True])
def test_kda_only_model_continues_a_cache_through_generate(with_mask):
    """transformers cuts a restarted prompt to its new tokens only when the cache has an attention layer; a model of
    KDA layers only (a draft, a KDA-only model) must not run the whole sequence again on top of its cache."""
    model = tiny_model("mla", layer_types=["linear_attention"] * 4)
    first = model.generate(prompt(1, 12), max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    ids = torch.cat((first.sequences, prompt(1, 6, seed=5)), 1)
    kw = dict(max_new_tokens=7, do_sample=False)
    if with_mask:  # explicit: generate would read a generated pad token (id 0) as padding in the fresh run
        kw["attention_mask"] = torch.ones_like(ids)
    resumed = generate_with_logits(model, ids, cache=first.cache, **kw)
    fresh = generate_with_logits(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, do_sample=False)
    assert first.cache.get_seq_length() == ids.shape[1] + 6
    assert_same_generation(resumed, fresh)


# --------------------------------------------------------------------------------------------------
# Bad input at the boundary: clear errors, before any state changes
# --------------------------------------------------------------------------------------------------

BAD_INPUTS = [
    ("empty-T", dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "at least one"),
    ("empty-B", dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), ValueError, "at least one"),
    ("float-ids", dict(input_ids=torch.ones(2, 9)), TypeError, "input_ids must be an integer tensor"),
    ("bool-ids", dict(input_ids=torch.ones(2, 9, dtype=torch.bool)), TypeError, "input_ids"),
    ("1d-ids", dict(input_ids=torch.ones(9, dtype=torch.long)), ValueError, r"input_ids must be \[B, T\]"),
    ("both", dict(input_ids=torch.ones(2, 9, dtype=torch.long), inputs_embeds=torch.zeros(2, 9, 64)), ValueError,
     "exactly one"),
    ("embeds-width", dict(inputs_embeds=torch.zeros(2, 9, 32)), ValueError, "hidden_size=64"),
    ("int-embeds", dict(inputs_embeds=torch.zeros(2, 9, 64, dtype=torch.long)), TypeError, "inputs_embeds"),
    ("empty-embeds", dict(inputs_embeds=torch.zeros(2, 0, 64)), ValueError, "at least one"),
    ("1d-positions", dict(position_ids=torch.arange(9)), ValueError, r"position_ids must be \[B, T\]"),
    ("long-positions", dict(position_ids=torch.arange(10)[None]), ValueError, "position_ids"),
    ("float-positions", dict(position_ids=torch.arange(9.0)[None]), TypeError, "position_ids must be an integer"),
    ("mask-length", dict(attention_mask=torch.ones(2, 10)), ValueError, r"attention_mask must be \[B, past \+ T\]"),
    ("mask-batch", dict(attention_mask=torch.ones(3, 9)), ValueError, "attention_mask"),
    ("mask-3d", dict(attention_mask=torch.ones(2, 9, 9)), ValueError, "2-D"),
    ("mask-list", dict(attention_mask=[[1] * 9] * 2), TypeError, "attention_mask must be a tensor"),
]


@pytest.mark.parametrize("name,kwargs,error,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_a_clear_error_before_any_state_changes(name, kwargs, error, match):
    model = tiny_model("gqa")
    cache = KDAHybridCache(model.config)
    kwargs = dict(kwargs)
    if "input_ids" not in kwargs and "inputs_embeds" not in kwargs:
        kwargs["input_ids"] = prompt()
    with torch.no_grad(), pytest.raises(error, match=match):
        model(cache=cache, **kwargs)
    assert cache.get_seq_length() == 0 and not cache_tensors(cache)


def test_nothing_is_lost_to_the_boundary_checks():
    """Mask forms transformers passes stay accepted: bool, int and float 2-D masks, [B, T] on an empty cache,
    [1, T] position_ids for a batch."""
    model = tiny_model("gqa")
    ids, mask = left_padded([9, 6])
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        for m in (mask.bool(), mask.float()):
            torch.testing.assert_close(model(ids, attention_mask=m).logits, ref, rtol=0, atol=0)
        plain = prompt()
        torch.testing.assert_close(model(plain, position_ids=torch.arange(9)[None]).logits, model(plain).logits,
                                   rtol=0, atol=0)
    assert math.isfinite(float(ref[mask.bool()].sum()))
