"""The hybrid model on CPU with tiny configs: cached decode equal to the full forward, every generate() mode,
padding, save/load and dtypes, gradients, chunked prefill, packed documents and the attention paths. (Config
validation: test_config.py; the cache's own API: test_cache.py.)"""

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from kda_hybrid import KDAHybridCache, KDAHybridForCausalLM, kda_ops, layers_kda_hybrid
from kda_hybrid.cache_layers_kda_hybrid import KDALayerState, KVLayerState

from .helpers import VOCAB, assert_same_generation, generate_with_logits, prompt, tiny_model

VARIANTS = [
    pytest.param("mla", False, id="mla-dense"),
    pytest.param("mla", True, id="mla-moe"),
    pytest.param("gqa", False, id="gqa-dense"),
    pytest.param("gqa", True, id="gqa-moe"),
]


def greedy(model, ids, n=8, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def greedy_logits(model, ids, n=8, **kw):
    """greedy() with the logits of every step (helpers.Generation), for assert_same_generation."""
    return generate_with_logits(model, ids, max_new_tokens=n, do_sample=False, **kw)


def kda_states(cache):
    return [(layer.conv_states, layer.recurrent_state) for layer in cache.layers if isinstance(layer, KDALayerState)]


# --------------------------------------------------------------------------------------------------
# Cached decode == full forward
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,moe", VARIANTS)
def test_greedy_with_cache_equals_without(attention, moe):
    model = tiny_model(attention, moe)
    ids = prompt()
    out = model.generate(ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out_nc = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False, output_logits=True,
                            return_dict_in_generate=True)
    assert torch.equal(out.sequences, out_nc.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(out_nc.logits), rtol=1e-4, atol=1e-4)
    # and the incremental logits equal one full forward over the generated sequence
    full = model(out.sequences).logits[:, ids.shape[1] - 1 : -1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("state_layout", ["contiguous", "strided"])
def test_decode_step_equals_the_general_path(state_layout, monkeypatch):
    """A decode token (KDA layers' _decode_step: one conv over q/k/v, then kda_ops.recurrent_step, whose batched
    in-place step runs for a contiguous state; a strided state takes the op's general recurrent path) against the
    same token through the general path, which a rollback record forces: logits, conv and recurrent states equal,
    in two rows, over several steps."""
    calls = {"step": 0, "batched": 0}
    step, batched = layers_kda_hybrid.KDAHybridDeltaAttention._decode_step, kda_ops.recurrent_step_

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[name] += out is not None
            return out
        return wrapper

    monkeypatch.setattr(layers_kda_hybrid.KDAHybridDeltaAttention, "_decode_step", counted("step", step))
    monkeypatch.setattr(kda_ops, "recurrent_step_", counted("batched", batched))
    model = tiny_model("mla")
    ids = prompt(B=2, T=12)
    caches = []
    with torch.no_grad():
        for record in (False, True):
            cache = KDAHybridCache(model.config)
            model(ids[:, :9], cache=cache)
            if record:
                cache.activate_past_recording()
            elif state_layout == "strided":
                for layer in cache.layers:
                    if isinstance(layer, KDALayerState):  # same values, transposed storage
                        layer.recurrent_state = layer.recurrent_state.transpose(-1, -2).contiguous().transpose(-1, -2)
            caches.append((cache, [model(ids[:, t : t + 1], cache=cache).logits for t in range(9, 12)]))
    (fast, fast_logits), (general, general_logits) = caches
    kda_layers = sum(t == "linear_attention" for t in model.config.layer_types)
    assert calls == {"step": 3 * kda_layers, "batched": 0 if state_layout == "strided" else 3 * kda_layers}
    torch.testing.assert_close(torch.cat(fast_logits, 1), torch.cat(general_logits, 1), rtol=1e-5, atol=1e-6)
    for (c1, s1), (c2, s2) in zip(kda_states(fast), kda_states(general)):
        torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
        for a, b in zip(c1, c2):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [7, 24], ids=["chunk7-latent", "chunk24-continuation"])
@pytest.mark.parametrize("attention,moe", VARIANTS[:1] + VARIANTS[3:])
def test_prefill_in_chunks_equals_one_prefill(attention, moe, chunk):
    """Chunks of 7 take MLA's latent (absorbed) path, chunks of 24 its mask-free continuation attention."""
    model = tiny_model(attention, moe)
    ids = prompt(T=40)
    with torch.no_grad():
        one = model(ids, use_cache=True)
        cache = KDAHybridCache(model.config)
        logits = [model(ids[:, i : i + chunk], cache=cache).logits for i in range(0, 40, chunk)]
    torch.testing.assert_close(torch.cat(logits, 1), one.logits, rtol=1e-4, atol=1e-5)
    for (c1, s1), (c2, s2) in zip(kda_states(cache), kda_states(one.cache)):
        torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
        for a, b in zip(c1, c2):
            torch.testing.assert_close(a, b)
    assert cache.get_seq_length() == 40


def test_returned_cache_reused_for_second_turn():
    model = tiny_model("mla", True)
    turn1, turn2 = prompt(B=1, T=12), prompt(B=1, T=6, seed=5)
    out1 = model.generate(turn1, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    ids2 = torch.cat([out1.sequences, turn2], dim=1)
    resumed = greedy_logits(model, ids2, n=7, cache=out1.cache)
    fresh = greedy_logits(model, ids2, n=7)
    assert_same_generation(resumed, fresh)


def test_past_key_values_alias_and_output_fields():
    model = tiny_model()
    ids = prompt()
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        cache = KDAHybridCache(model.config)
        with pytest.warns(FutureWarning, match="past_key_values"):
            out = model(ids, past_key_values=cache)
        assert out.cache is cache and cache.get_seq_length() == ids.shape[1]
        torch.testing.assert_close(out.logits, ref.logits)
        # logits_to_keep, inputs_embeds, hidden states
        last = model(ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, ref.logits[:, -1:])
        emb = model.get_input_embeddings()(ids)
        torch.testing.assert_close(model(inputs_embeds=emb).logits, ref.logits)
        hs = model(ids, output_hidden_states=True).hidden_states
        assert len(hs) == model.config.num_hidden_layers + 1


def test_labels_give_shifted_lm_loss():
    model = tiny_model()
    ids = prompt()
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


# --------------------------------------------------------------------------------------------------
# Padding
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,moe", VARIANTS)
def test_left_padded_batch_equals_each_row_alone(attention, moe):
    model = tiny_model(attention, moe)
    rows = [prompt(B=1, T=11, seed=2)[0], prompt(B=1, T=6, seed=3)[0], prompt(B=1, T=1, seed=4)[0]]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    batched = greedy_logits(model, ids, n=8, attention_mask=mask)
    for i, r in enumerate(rows):
        assert_same_generation(batched.row(i), greedy_logits(model, r[None], n=8), msg=f"row {i}")


def test_left_padding_batch_size_one_equals_no_padding():
    model = tiny_model("gqa")
    ids = prompt(B=1, T=7)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)], 1)
    assert_same_generation(greedy_logits(model, padded, attention_mask=mask), greedy_logits(model, ids))


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_right_padding_leaves_same_cache_as_no_padding(attention):
    model = tiny_model(attention)
    ids = prompt(B=1, T=10)
    padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], 1).long()
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        out = model(padded, attention_mask=mask, use_cache=True)
    torch.testing.assert_close(out.logits[:, :10], ref.logits, rtol=1e-5, atol=1e-5)
    for (c1, s1), (c2, s2) in zip(kda_states(out.cache), kda_states(ref.cache)):
        torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-6)
        # conv states are projections (reductions over D = 64) of hidden states that went through earlier layers as
        # a [1, 14] and a [1, 10] batch: BLAS may block the two shapes differently, so they agree to fp32 rounding
        # (measured 9e-8 absolute, 1.2e-6 relative; sqrt(64) * 2^-23 * |x| |w| * layers bounds it), not bit for bit
        for a, b in zip(c1, c2):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for l1, l2 in zip(out.cache.layers, ref.cache.layers):
        if isinstance(l1, KVLayerState):  # the attention cache holds the pads too, masked on later steps
            torch.testing.assert_close(l1.keys[..., :10, :], l2.keys)


def test_mixed_padding_in_a_batch():
    """Row 0 right-padded, row 1 left-padded, row 2 unpadded: each row's logits equal its own run."""
    model = tiny_model("mla", True)
    r = [prompt(B=1, T=n, seed=n)[0] for n in (5, 7, 9)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    ids[0, :5], mask[0, :5] = r[0], 1
    ids[1, 2:], mask[1, 2:] = r[1], 1
    ids[2], mask[2] = r[2], 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        for i, (lo, hi) in enumerate([(0, 5), (2, 9), (0, 9)]):
            alone = model(r[i][None]).logits[0]
            torch.testing.assert_close(out[i, lo:hi], alone, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Other generate() modes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,moe", [VARIANTS[0], VARIANTS[3]])
def test_beam_search_with_cache_equals_without(attention, moe):
    model = tiny_model(attention, moe)
    ids = prompt()
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, num_return_sequences=2)
    # the returned sequences, and the raw logits of every running beam at every step (beam search's scores are
    # cumulative log-probabilities; its logits are the model's, row b * num_beams + k for beam k of row b)
    assert_same_generation(generate_with_logits(model, ids, **kw), generate_with_logits(model, ids, use_cache=False,
                                                                                        **kw))


def test_sampling_with_seed_is_reproducible():
    model = tiny_model("gqa", True)
    ids = prompt()
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, temperature=1.3))
    assert torch.equal(*runs)
    torch.manual_seed(124)
    assert not torch.equal(runs[0], model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20,
                                                   temperature=1.3))


@pytest.mark.parametrize("attention,moe", [VARIANTS[0], VARIANTS[3]])
def test_assisted_decoding_equals_greedy(attention, moe):
    model = tiny_model(attention, moe)
    draft = tiny_model(attention, False, seed=7, num_hidden_layers=2, hidden_size=32)
    ids = prompt(B=1, T=10)
    # assisted decoding returns the target model's logits of each accepted token, from its verification forward
    # over the draft's candidates: another route than greedy's one token per step
    assert_same_generation(greedy_logits(model, ids, n=15, assistant_model=draft), greedy_logits(model, ids, n=15))


def test_assisted_decoding_with_the_model_as_its_own_draft():
    """Every draft token is accepted: exercises rollback of zero tokens and long accepted runs."""
    model = tiny_model()
    ids = prompt(B=1, T=6)
    assert_same_generation(greedy_logits(model, ids, n=12, assistant_model=model), greedy_logits(model, ids, n=12))


def test_prompt_lookup_decoding_equals_greedy():
    model = tiny_model("mla", True)
    base = prompt(B=1, T=8)[0]
    ids = torch.cat([base, base[:5], base, base[:3]])[None]  # repeats give the lookup real candidates
    assert_same_generation(greedy_logits(model, ids, n=15, prompt_lookup_num_tokens=4), greedy_logits(model, ids, n=15))


def test_pipeline_text_generation(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", unk_token="<unk>")
    model = tiny_model()
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    out = pipe("w1 w2 w3", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("w1 w2 w3")
    new = pipe("w1 w2 w3", max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    expected = greedy(model, tokenizer("w1 w2 w3", return_tensors="pt").input_ids, n=5)[0, -5:]
    assert new.split() == tokenizer.convert_ids_to_tokens(expected)


# --------------------------------------------------------------------------------------------------
# Save / load, dtypes
# --------------------------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path):
    model = tiny_model("mla", True)
    model.save_pretrained(tmp_path)
    ids = prompt()
    assert (tmp_path / "modeling_kda_hybrid.py").exists() and (tmp_path / "kda_ops.py").exists()
    for cls in (KDAHybridForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path).eval()
        for name, tensor in model.state_dict().items():  # the weights themselves: bit for bit
            assert torch.equal(loaded.state_dict()[name], tensor), name
        with torch.no_grad():
            # same kernels and shapes, but the loaded tensors sit at other memory alignments (safetensors offsets),
            # where vectorised CPU kernels may split a reduction differently: fp32 rounding, measured 3e-8 absolute
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "kda_hybrid"
    assert type(AutoModel.from_pretrained(tmp_path)).__name__ == "KDAHybridModel"
    # the same computation at other memory alignments, as the logits above: their tolerance
    assert_same_generation(greedy_logits(loaded, ids), greedy_logits(model, ids), rtol=1e-5, atol=1e-6)


def test_fp32_parameters_survive_casting(tmp_path):
    model = tiny_model("mla", True).to(torch.bfloat16)
    kda = model.model.layers[0].self_attn
    moe = model.model.layers[1].block_sparse_moe
    assert kda.q_proj.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == kda.dt_bias.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    model.save_pretrained(tmp_path)
    loaded = KDAHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.layers[0].self_attn.A_log.dtype == torch.float32
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(loaded(prompt()).logits).all()


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,moe", [VARIANTS[1], VARIANTS[2]])
def test_gradients_finite_and_checkpointing_matches(attention, moe):
    model = tiny_model(attention, moe).train()
    ids = prompt(T=70)  # crosses a chunk boundary

    def grads():
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    assert all(torch.isfinite(g).all() for g in plain.values())
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n in names if "A_log" in n or "dt_bias" in n or "conv1d" in n} <= set(plain)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    checkpointed = []  # every decoder layer runs through the checkpoint function (equal gradients alone would
    for layer in model.model.layers:  # also hold if enabling it changed nothing)
        run = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _run=run, **k: checkpointed.append(1) or _run(*a, **k)
    ckpt = grads()
    assert len(checkpointed) == model.config.num_hidden_layers
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7, msg=n)


# --------------------------------------------------------------------------------------------------
# Chunked prefill and packed documents
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_generate_with_prefill_chunk_size_equals_one_shot(attention):
    """transformers' chunked prefill runs the prompt through the cache 20 tokens at a time, left padding too."""
    model = tiny_model(attention, True)
    ids = prompt(B=1, T=50)
    one_shot = greedy_logits(model, ids)
    assert_same_generation(greedy_logits(model, ids, prefill_chunk_size=20), one_shot, msg="chunked")
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids], 1)
    mask = (padded != 0).long()
    mask[:, 6:] = 1
    assert_same_generation(greedy_logits(model, padded, attention_mask=mask, prefill_chunk_size=20), one_shot,
                           msg="left-padded, chunked")


@pytest.mark.parametrize("attention,moe", [VARIANTS[1], VARIANTS[2]])
def test_packed_documents_equal_separate_runs(attention, moe):
    """position_ids restarting inside a row (DataCollatorWithFlattening): no state, conv or attention leaks
    across documents, and gradients flow."""
    model = tiny_model(attention, moe)
    docs = [prompt(B=1, T=n, seed=n)[0] for n in (5, 70, 1, 20)]  # 70 crosses a chunk boundary
    ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in docs])[None]
    out = model(ids, position_ids=position_ids)
    assert out.cache is None
    start = 0
    with torch.no_grad():
        for d in docs:
            alone = model(d[None]).logits[0]
            torch.testing.assert_close(out.logits[0, start:start + len(d)], alone, rtol=1e-4, atol=1e-5)
            start += len(d)
    # two rows of packed documents at once
    ids2 = torch.stack([torch.cat(docs[:2] + docs[2:3] + docs[2:3])[:48], torch.cat(docs[1:])[:48]])
    pos2 = torch.stack([torch.cat([torch.arange(5), torch.arange(43)]), torch.cat([torch.arange(48)])])
    with torch.no_grad():
        batched = model(ids2, position_ids=pos2).logits
        torch.testing.assert_close(batched[0, :5], model(ids2[:1, :5]).logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batched[0, 5:], model(ids2[:1, 5:]).logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(batched[1], model(ids2[1:]).logits[0], rtol=1e-4, atol=1e-5)
    model.train()
    model(ids, position_ids=position_ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_packed_attention_per_document_equals_block_diagonal_mask(attention, monkeypatch):
    """Under sdpa the attention layers of a packed batch run one fused call per document (packed_attention, no
    mask); eager, and sdpa past PACKED_ATTENTION_MAX_DOCS documents, use transformers' block-diagonal mask. Same
    logits and gradients (GQA: 4 query heads over 2 key/value heads)."""
    import kda_hybrid.layers_kda_hybrid as layers
    import kda_hybrid.modeling_kda_hybrid as modeling

    docs = [prompt(B=1, T=n, seed=n)[0] for n in (5, 70, 1, 20, 50)]
    ids = torch.stack([torch.cat(docs[:3])[:64], torch.cat(docs[3:])[:64]])  # 2 rows, documents restart in rows
    position_ids = torch.stack([torch.cat([torch.arange(5), torch.arange(59)]), torch.cat([torch.arange(20),
                                                                                           torch.arange(44)])])

    def run(model):
        model.zero_grad()
        out = model(ids, position_ids=position_ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = tiny_model(attention, False).train()
    calls, original = [], layers.packed_attention
    monkeypatch.setattr(layers, "packed_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    assert model.config._attn_implementation == "sdpa"
    n_attention = model.config.layer_types.count("full_attention")
    logits, grads = run(model)
    assert len(calls) == n_attention >= 1  # every attention layer took the per-document path
    monkeypatch.setattr(modeling, "PACKED_ATTENTION_MAX_DOCS", 0)  # sdpa with the mask
    masked_logits, masked_grads = run(model)
    assert len(calls) == n_attention
    model.set_attn_implementation("eager")
    eager_logits, eager_grads = run(model)
    for other_logits, other_grads in ((masked_logits, masked_grads), (eager_logits, eager_grads)):
        torch.testing.assert_close(logits, other_logits, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, other_grads[name], rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------------------------------
# Attention paths: decided once per forward (KDAHybridModel._attention_inputs), each equal to the reference
# --------------------------------------------------------------------------------------------------


def _paths_taken(model, *args, **kwargs):
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["layer_inputs"].path), with_kwargs=True)
             for layer in model.model.layers if layer.layer_type == "full_attention"]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    assert len(set(seen)) == 1  # every attention layer of a forward takes the same path
    return seen[0]


def test_attention_path_table():
    """The conditions of KDAHybridMLAttention's docstring table, each to its path."""
    model = tiny_model("mla")
    ids = prompt(B=2, T=40)
    packed = torch.cat((torch.arange(15), torch.arange(25)))[None]

    def with_cache(n_past, n_new, **kw):
        cache = KDAHybridCache(model.config)
        with torch.no_grad():
            model(ids[:, :n_past], cache=cache)
        return _paths_taken(model, ids[:, n_past:n_past + n_new], cache=cache, **kw)

    assert _paths_taken(model, ids) == "masked"  # no cache
    assert with_cache(9, 1) == with_cache(9, 16) == "latent"
    assert with_cache(9, 17) == "continuation"
    padded = torch.ones(2, 26, dtype=torch.long)
    padded[1, :3] = 0
    assert with_cache(9, 17, attention_mask=padded) == "masked"
    assert _paths_taken(model, ids[:1], position_ids=packed) == "packed"
    model.train()
    model.config.attention_dropout = 0.1
    assert with_cache(9, 17) == "masked"  # continuation attention has no dropout
    model.config.attention_dropout = 0.0
    model.eval()
    model.set_attn_implementation("eager")
    assert with_cache(9, 5) == "latent"
    assert with_cache(9, 5, output_attentions=True) == "masked"  # the latent path computes no weights
    assert with_cache(9, 17) == "masked"
    assert _paths_taken(model, ids[:1], position_ids=packed) == "masked"  # block-diagonal mask
    gqa = tiny_model("gqa")
    cache = KDAHybridCache(gqa.config)
    with torch.no_grad():
        gqa(ids[:, :9], cache=cache)
    assert _paths_taken(gqa, ids[:, 9:10], cache=cache) == "masked"


@pytest.mark.parametrize("keys_first", [False, True], ids=["queries-x-keys", "keys-x-queries"])
@pytest.mark.parametrize("T", [3, 20])
def test_mla_paths_equal_the_masked_reference(T, keys_first, monkeypatch):
    """One MLA layer over a cache of 11 tokens (row 1: its first 3 are padding): every path gives the eager
    masked reference's output (T = 3 is the model's latent case, T = 20 its continuation case), with the latent
    scores in either product order (keys x queries from LATENT_KEYS_FIRST cached tokens on)."""
    monkeypatch.setattr(layers_kda_hybrid, "LATENT_KEYS_FIRST", 1 if keys_first else 10**9)
    model = tiny_model("mla")
    attn = next(layer.self_attn for layer in model.model.layers if layer.layer_type == "full_attention")
    past = 11
    g = torch.Generator().manual_seed(3)
    x_past, x = torch.randn(2, past, 64, generator=g), torch.randn(2, T, 64, generator=g)
    keys = torch.arange(past + T)
    causal = (keys <= (past + torch.arange(T))[:, None])[None, None].expand(2, 1, T, past + T)
    padding = torch.ones(2, past + T, dtype=torch.bool)
    padding[1, :3] = False
    padded = causal & padding[:, None, None, :]
    prefill_mask = torch.ones(past, past, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :past]

    def run(path, mask, impl):
        attn.config._attn_implementation = impl
        cache = KVLayerState()
        with torch.no_grad():
            attn(x_past, attention_mask=prefill_mask, cache_layer=cache)
            return attn(x, attention_mask=mask, cache_layer=cache, path=path)[0]

    try:
        for mask, name in ((causal, "no padding"), (padded, "padding")):
            reference = run("masked", mask, "eager")
            for path, path_mask, impl in (("masked", mask, "sdpa"), ("latent", mask, "eager"),
                                          ("latent", mask, "sdpa")):
                torch.testing.assert_close(run(path, path_mask, impl), reference, rtol=1e-5, atol=1e-6,
                                           msg=f"{path} {impl} {name}")
        reference = run("masked", causal, "eager")
        for path in ("latent", "continuation"):  # mask None: no padding, causal among the new tokens
            torch.testing.assert_close(run(path, None, "sdpa"), reference, rtol=1e-5, atol=1e-6, msg=path)
    finally:
        attn.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prepare_cpu_decode_compiled_reads_one_token_through_the_compiled_kernel(monkeypatch, tmp_path, attention):
    """prepare_cpu_decode(compiled=True): every Linear above the size threshold keeps the usual layout and computes
    each one-token product through the compiled kernel (counted), smaller ones are laid out column-major; greedy
    generation gives the same tokens and logits within 1e-5 of the plain model's; a prefill (many tokens) and
    anything under gradients never call the kernel; save_pretrained writes the same tensors."""
    from kda_hybrid import modeling_kda_hybrid

    monkeypatch.setattr(modeling_kda_hybrid, "COMPILED_MATVEC_MIN_BYTES", 4096)
    model = tiny_model(attention, tie_word_embeddings=True)
    ids = prompt(B=1, T=20, seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    greedy = dict(max_new_tokens=6, do_sample=False)
    want = generate_with_logits(model, ids, **greedy)
    n = model.prepare_cpu_decode(compiled=True)
    # the KDA layers decode through the compiled layer step (test_compiled_decode.py): their Linears are read there
    stepped = [m for layer in model.model.layers if layer.__dict__.get("_compiled_decode") for m in layer.modules()
               if isinstance(m, torch.nn.Linear)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m not in stepped]
    kv_b = {id(getattr(m, "kv_b_proj", None)) for m in model.modules()}  # MLA reads its weight directly: not routed
    fast = [m for m in linears if m.weight.numel() * 4 >= 4096 and id(m) not in kv_b]
    assert stepped and fast and n == len(stepped) + len(fast) + sum(m.out_features >= m.in_features
                                                                    for m in linears if m not in fast)
    assert all(m.weight.is_contiguous() for m in stepped)
    assert all(m._decode_matvec and m.weight.is_contiguous() for m in fast)

    real, calls = layers_kda_hybrid.compiled_matvec(), []
    monkeypatch.setattr(layers_kda_hybrid, "compiled_matvec", lambda: lambda x, w: calls.append(w) or real(x, w))
    with torch.no_grad():
        model(ids)
    assert calls == []  # a prefill: matrix-matrix products, the modules' own forwards
    got = generate_with_logits(model, ids, **greedy)
    assert_same_generation(got, want, rtol=1e-5, atol=1e-5)
    assert {w.data_ptr() for w in calls} == {m.weight.data_ptr() for m in fast}  # every opted-in weight
    calls.clear()
    with torch.enable_grad():
        model(ids[:, :1]).logits.sum().backward()
    assert calls == []
    model.save_pretrained(tmp_path)
    loaded = KDAHybridForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in before.items())


def test_prepare_cpu_decode_compiled_falls_back_to_the_layout_when_compiling_fails(monkeypatch):
    from kda_hybrid import decode_kda_hybrid, modeling_kda_hybrid

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(modeling_kda_hybrid, "COMPILED_MATVEC_MIN_BYTES", 4096)
    monkeypatch.setattr(modeling_kda_hybrid, "compiled_matvec", lambda: broken)
    monkeypatch.setattr(decode_kda_hybrid, "compiled_kda_layer_step", lambda strict=False: broken)
    model, plain = tiny_model("gqa"), tiny_model("gqa")
    with pytest.warns(UserWarning) as warned:
        n = model.prepare_cpu_decode(compiled=True)
    assert [str(w.message).split(" (")[0] for w in warned] == [
        "prepare_cpu_decode(compiled=True): compiling the layer steps failed",
        "prepare_cpu_decode(compiled=True): torch.compile failed"]
    assert all("no C++ compiler" in str(w.message) for w in warned)
    assert n == plain.prepare_cpu_decode() > 0
    assert not any(m.__dict__.get("_decode_matvec") or m.__dict__.get("_compiled_decode") for m in model.modules())


@pytest.mark.parametrize("tied", [False, True])
def test_prepare_cpu_decode_changes_layout_not_values(tmp_path, tied):
    """prepare_cpu_decode() lays wide weights out column-major for one-token matrix-vector reads: the same
    parameters (tied ones stay one tensor), the same values and state_dict, the same generation; narrow ones and a
    second call are left alone; save_pretrained writes what a plain model writes."""
    model = tiny_model("mla", tie_word_embeddings=tied)
    ids = prompt(B=2, T=40, seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    greedy = dict(max_new_tokens=8, do_sample=False)
    want = generate_with_logits(model, ids, **greedy)
    n = model.prepare_cpu_decode()
    wide = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features >= m.in_features]
    narrow = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features < m.in_features]
    assert n == len({id(m.weight) for m in wide}) > 0 and model.prepare_cpu_decode() == 0
    assert all(m.weight.stride() == (1, m.out_features) for m in wide)
    assert all(m.weight.is_contiguous() for m in narrow)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert_same_generation(generate_with_logits(model, ids, **greedy), want)
    model.save_pretrained(tmp_path)
    assert all(m.weight.stride() == (1, m.out_features) for m in wide)  # laid out again after the save
    loaded = KDAHybridForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in before.items())


def test_lay_out_for_cpu_decode_gives_a_transformers_llama_the_same_layout():
    """The layout helper benchmarks give their baseline (bench_smollm2.py --layout): a transformers Llama's wide
    Linears column-major once (its tied head and embedding are one tensor), narrow ones untouched, the same
    greedy generation and logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kda_hybrid.modeling_kda_hybrid import lay_out_for_cpu_decode

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    ids = prompt(B=2, T=12, seed=3)
    greedy = dict(max_new_tokens=6, do_sample=False)
    want = generate_with_logits(llama, ids, **greedy)
    linears = [m for m in llama.modules() if isinstance(m, torch.nn.Linear)]
    wide = [m for m in linears if m.out_features >= m.in_features]
    narrow = [m for m in linears if m.out_features < m.in_features]
    assert narrow and lay_out_for_cpu_decode(linears) == len({id(m.weight) for m in wide}) > 0
    assert lay_out_for_cpu_decode(linears) == 0  # a second call: nothing left to lay out
    assert all(m.weight.stride() == (1, m.out_features) for m in wide)
    assert all(m.weight.is_contiguous() for m in narrow)
    assert llama.lm_head.weight is llama.model.embed_tokens.weight
    assert_same_generation(generate_with_logits(llama, ids, **greedy), want)
