"""Public entry points a transformers user walks beside the common ones: cache_implementation and transformers'
own caches, generate() with use_cache=False or inputs_embeds over a cache, continuous batching, EOS inside a
batch, resize_token_embeddings, dtype="auto", explicit all-ones and fully padded masks. Each either gives the
answer of the plain path or raises an error that says what is supported."""

import importlib
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from kda_hybrid import KDAHybridCache

from .helpers import VOCAB, assert_same_generation, generate_with_logits, prompt, tiny_model


def greedy(model, ids, n=5, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kw)


def greedy_logits(model, ids, n=5, **kw):
    """greedy() with the logits of every step (helpers.Generation), for assert_same_generation."""
    return generate_with_logits(model, ids, max_new_tokens=n, do_sample=False, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_model("mla", True)


def prefilled(model, ids):
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


# --------------------------------------------------------------------------------------------------
# Caches: cache_implementation, transformers' caches, use_cache=False, inputs_embeds over a cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["static", "offloaded", "offloaded_static", "sliding_window", "quantized"])
def test_cache_implementations_other_than_dynamic_are_refused(model, impl):
    with pytest.raises(ValueError, match=f"cache_implementation='{impl}' is not supported.*KDAHybridCache"):
        greedy(model, prompt(), cache_implementation=impl)


def test_cache_implementation_dynamic_is_the_hybrid_cache(model):
    ids = prompt()
    out = greedy(model, ids, cache_implementation="dynamic", return_dict_in_generate=True)
    assert isinstance(out.cache, KDAHybridCache) and out.cache.get_seq_length() == ids.shape[1] + 4
    assert torch.equal(out.sequences, greedy(model, ids))


@pytest.mark.parametrize("make", [lambda c: DynamicCache(config=c), lambda c: DynamicCache(),
                                  lambda c: StaticCache(config=c, max_cache_len=32)],
                         ids=["dynamic", "dynamic-no-config", "static"])
def test_transformers_caches_are_a_clear_error(model, make):
    ids = prompt()
    with pytest.raises(TypeError, match="KDAHybridCache.*no KDA conv or recurrent states"):
        greedy(model, ids, cache=make(model.config))
    with pytest.raises(TypeError, match="KDAHybridCache.*no KDA conv or recurrent states"):
        model(ids, cache=make(model.config))


def test_generate_with_a_cache_and_use_cache_false_is_an_error(model):
    """Without use_cache every step feeds the whole sequence; the model used to add each of those runs to the given
    cache on top of the last (the cache ended holding 75 tokens for a 13-token prompt and 5 new ones) and so gave
    other tokens than plain greedy decoding. LlamaForCausalLM does the same with a DynamicCache."""
    ids = prompt(T=13)
    cache = prefilled(model, ids[:, :9])
    with pytest.raises(ValueError, match="use_cache=False"):
        greedy(model, ids, cache=cache, use_cache=False)
    assert cache.get_seq_length() == 9  # nothing ran
    with pytest.raises(ValueError, match="use_cache=False"):
        greedy(model, ids, cache=KDAHybridCache(model.config), use_cache=False)
    assert_same_generation(greedy_logits(model, ids, cache=cache), greedy_logits(model, ids))  # the cache continues


def test_forward_returns_a_given_cache_whatever_use_cache(model):
    """A forward with cache=c fills c; it comes back as outputs.cache even under use_cache=False (LlamaForCausalLM
    returns its given cache too), and no cache is made or returned when none was given."""
    ids = prompt(T=8)
    with torch.no_grad():
        cache = KDAHybridCache(model.config)
        assert model(ids, cache=cache, use_cache=False).cache is cache and cache.get_seq_length() == 8
        assert model(ids, use_cache=False).cache is None


@pytest.mark.parametrize("layer_types", [None, ["linear_attention"] * 2], ids=["hybrid", "kda-only"])
def test_inputs_embeds_over_a_cache_hold_the_whole_sequence(layer_types):
    """transformers' rule: inputs_embeds restarting from a cache are the whole sequence. The whole sequence
    continues exactly; no more embeddings than the cache holds used to end in 'inputs_embeds must hold at least one
    token ... (2, 0, 64)' (hybrid) and now say what generate() expects."""
    over = {} if layer_types is None else {"num_hidden_layers": 2, "layer_types": layer_types}
    model = tiny_model("mla", **over)
    ids = prompt(T=13)
    embeds = model.get_input_embeddings()(ids).detach()
    expected = greedy_logits(model, ids)
    got = greedy_logits(model, None, inputs_embeds=embeds, cache=prefilled(model, ids[:, :9]))
    assert got.sequences.shape == (2, 5)  # from inputs_embeds generate returns the new tokens only
    assert_same_generation(got, expected)
    for new in (embeds[:, 9:], embeds[:, :9]):  # the new tokens only; as many as the cache holds
        cache = prefilled(model, ids[:, :9])
        with pytest.raises(ValueError, match=r"inputs_embeds of shape .* with a cache holding 9 tokens.*whole "):
            greedy(model, None, inputs_embeds=new, cache=cache)
        assert cache.get_seq_length() == 9


@pytest.mark.parametrize("call", ["generate_batch", "paged"])
def test_continuous_batching_is_refused_clearly(model, call):
    """transformers' paged cache has attention layers only: it failed with 'Invalid layer type: linear_attention'
    (its native kimi_linear and qwen3_next too)."""
    ids = prompt(B=1)
    with pytest.raises(NotImplementedError, match="continuous batching .* not supported.*generate\\(\\)"):
        if call == "paged":
            greedy(model, ids, cache_implementation="paged")
        else:
            model.generate_batch(ids.tolist(), max_new_tokens=3)


# --------------------------------------------------------------------------------------------------
# generate(): EOS inside a batch, inputs_embeds with left padding
# --------------------------------------------------------------------------------------------------


def test_eos_in_one_row_pads_it_and_the_others_continue_as_alone(model):
    ids = prompt()
    eos = int(greedy(model, ids, n=8)[0, ids.shape[1] + 2])  # row 0's third new token
    out = greedy_logits(model, ids, n=8, eos_token_id=eos, pad_token_id=0)
    row0 = out.new[0].tolist()
    stop = row0.index(eos)
    assert stop <= 2 and all(t == 0 for t in row0[stop + 1:]) and len(row0) == 8
    alone = greedy_logits(model, ids[1:], n=8, eos_token_id=eos, pad_token_id=0)
    assert eos not in alone.new[0].tolist()
    assert_same_generation(out.row(1), alone)  # row 1's logits, batched with a finished row, as alone


def test_inputs_embeds_with_left_padding_equal_each_row_alone(model):
    ids = prompt(T=9)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    embeds = model.get_input_embeddings()(ids).detach()
    embeds[1, :3] = float("nan")  # padding, whatever it holds, reaches no real token
    out = greedy_logits(model, None, inputs_embeds=embeds, attention_mask=mask, pad_token_id=0)
    assert out.sequences.shape == (2, 5)  # the new tokens only
    assert_same_generation(out.row(0), greedy_logits(model, ids[:1]), msg="row 0")
    assert_same_generation(out.row(1), greedy_logits(model, ids[1:, 3:]), msg="row 1 (3 NaN pads)")


# --------------------------------------------------------------------------------------------------
# resize_token_embeddings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("new,multiple,size", [(120, None, 120), (50, None, 50), (100, 64, 128)])
def test_resize_token_embeddings_then_generate_save_load(tie, new, multiple, size, tmp_path):
    model = tiny_model("mla", tie_word_embeddings=tie)
    ids = prompt().clamp(max=40)
    before = model(ids).logits
    model.resize_token_embeddings(new, pad_to_multiple_of=multiple)
    assert model.config.vocab_size == model.lm_head.weight.shape[0] == size
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    logits = model(ids).logits
    assert logits.shape[-1] == size
    keep = min(size, VOCAB)  # the kept rows are the old ones
    torch.testing.assert_close(logits[..., :keep], before[..., :keep], rtol=1e-5, atol=1e-6)
    generated = greedy_logits(model, ids, n=4)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.vocab_size == size
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-6)
    assert_same_generation(greedy_logits(loaded, ids, n=4), generated, rtol=1e-5, atol=1e-6)  # the logits' tolerance


def test_resize_below_a_special_token_is_refused_before_any_change(tmp_path):
    """KDAHybridConfig refuses special token ids outside the vocabulary, so shrinking below eos_token_id used to
    give a model that saved and then failed to load ('eos_token_id must be None or a token id in 0..49')."""
    model = tiny_model("mla", eos_token_id=90)
    for new, multiple in ((50, None), (81, 8)):  # 81 pads to 88 rows: token 90 is outside
        with pytest.raises(ValueError, match="eos_token_id=90 outside the vocabulary"):
            model.resize_token_embeddings(new, pad_to_multiple_of=multiple)
        assert model.config.vocab_size == model.model.embed_tokens.weight.shape[0] == VOCAB
    model.resize_token_embeddings(84, pad_to_multiple_of=13)  # 91 rows hold token 90
    assert model.config.vocab_size == 91
    model.config.eos_token_id = None  # the way the error names
    model.resize_token_embeddings(50)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.vocab_size == 50 and loaded.config.eos_token_id is None


# --------------------------------------------------------------------------------------------------
# dtype="auto" and bf16 loading
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"dtype": "auto"}, {}, {"dtype": "auto", "low_cpu_mem_usage": True}],
                         ids=["auto", "default", "auto-low-cpu-mem"])
def test_bf16_checkpoint_loads_in_bf16_with_fp32_kept_parameters(kwargs, tmp_path):
    reference = tiny_model("mla", True)
    cast = tiny_model("mla", True).to(torch.bfloat16)
    cast.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs).eval()
    kda, moe = loaded.model.layers[0].self_attn, loaded.model.layers[1].block_sparse_moe
    assert kda.q_proj.weight.dtype == loaded.lm_head.weight.dtype == torch.bfloat16
    assert kda.A_log.dtype == kda.dt_bias.dtype == moe.gate.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    ids = prompt()
    with torch.no_grad():
        logits = loaded(ids).logits
        assert torch.equal(logits, cast(ids).logits)  # the same bf16 model as the in-memory cast
        expected = reference(ids).logits
    # bf16 weights and activations through 4 layers against fp32: measured 1.9% of the logit scale
    assert (logits.float() - expected).abs().max() <= 0.05 * expected.abs().max()


def test_fp32_checkpoint_with_dtype_auto_stays_fp32(tmp_path):
    model = tiny_model("gqa", False)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    ids = prompt()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Masks: explicit all ones, a fully padded row
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_all_ones_mask_equals_no_mask(attention, impl):
    model = tiny_model(attention, True, attn_implementation=impl)
    ids = prompt(B=3)
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        masked = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        assert torch.equal(masked.logits, plain.logits)
        assert torch.equal(model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool)).logits, plain.logits)
        step = prompt(B=3, T=1, seed=4)
        decoded = model(step, cache=plain.cache).logits
        assert torch.equal(model(step, cache=masked.cache, attention_mask=torch.ones(3, 10)).logits, decoded)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_fully_padded_row_is_an_empty_sequence(attention):
    """A row whose mask is all zeros: finite (zero) logits, the other rows as without it, and its cache state that
    of no tokens, so its next token runs as a fresh sequence."""
    model = tiny_model(attention, True)
    ids = prompt(B=3)
    mask = torch.ones_like(ids)
    mask[1] = 0
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        plain = model(ids, use_cache=True)
        assert torch.isfinite(out.logits).all()
        assert torch.equal(out.logits[1], torch.zeros_like(out.logits[1]))
        torch.testing.assert_close(out.logits[[0, 2]], plain.logits[[0, 2]], rtol=1e-5, atol=1e-6)
        step = prompt(B=3, T=1, seed=4)
        nxt = model(step, cache=out.cache, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1))
        torch.testing.assert_close(nxt.logits[1], model(step[1:2]).logits[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nxt.logits[[0, 2]], model(step, cache=plain.cache).logits[[0, 2]],
                                   rtol=1e-5, atol=1e-6)


MOVED_PATHS = {  # the previous release's documented module paths -> a name each must still give, and its home
    "kda_hybrid.long_context": ("prefill", "kda_hybrid.inference.long_context"),
    "kda_hybrid.training": ("make_batch", "kda_hybrid.train.data"),
    "kda_hybrid.trainer": ("fit", "kda_hybrid.train.loop"),
    "kda_hybrid.shapes": ("tiny_6p5m", "kda_hybrid.bench.shapes"),
    "kda_hybrid.benchmarking": ("native_twin", "kda_hybrid.bench.native"),
    "kda_hybrid.model_card_kda_hybrid": ("write_model_card", "kda_hybrid.checkpoint_kda_hybrid"),
}


def test_moved_module_paths_import_with_a_warning_naming_the_new_path():
    """Each moved path imports (in a fresh process: a module is imported once per process), warns once with a
    DeprecationWarning that names the new path and points at the importing line, and gives the new module's
    objects themselves; a name it lacks is an AttributeError naming the new path."""
    code = textwrap.dedent("""
        import importlib, sys, warnings
        warnings.simplefilter("always")
        for old, (name, new) in MOVED_PATHS.items():
            with warnings.catch_warnings(record=True) as seen:
                got = getattr(importlib.import_module(old), name)  # the line the warning must point at
            moved = [w for w in seen if issubclass(w.category, DeprecationWarning) and f"{old} moved" in str(w.message)]
            assert len(moved) == 1, (old, [str(w.message) for w in seen])
            assert new in str(moved[0].message), moved[0].message
            assert moved[0].filename == __file__, (old, moved[0].filename, __file__)
            assert got is getattr(importlib.import_module(new), name), old
            old_module = sys.modules[old]
            assert name in dir(old_module), old
            try:
                old_module.no_such_name
            except AttributeError as e:
                assert "moved to" in str(e) and new in str(e), e
            else:
                raise AssertionError(f"{old}: a missing name must raise AttributeError")
        from kda_hybrid.trainer import fit  # the from-import form
        assert fit is importlib.import_module("kda_hybrid.train.loop").fit
    """)
    script = Path(tempfile.mkdtemp()) / "use_old_paths.py"
    script.write_text(f"MOVED_PATHS = {MOVED_PATHS!r}\n" + code)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_unknown_submodule_still_fails_as_before():
    with pytest.raises(ModuleNotFoundError, match="kda_hybrid.no_such_module"):
        importlib.import_module("kda_hybrid.no_such_module")
