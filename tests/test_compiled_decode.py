"""prepare_cpu_decode(compiled=True)'s compiled layer steps (decode_kda_hybrid): which layers take them, that
decode through them equals the eager step (every KDA variant, MLA and GQA, the cache included), that prepare
compiles everything decode needs, and every case they must leave to the eager path."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from kda_hybrid import KDAHybridCache, decode_kda_hybrid

from .helpers import assert_same_generation, generate_with_logits, prompt, tiny_model

GREEDY = dict(max_new_tokens=6, do_sample=False)
K3_KDA = dict(use_full_rank_gate=True, gate_lower_bound=-5.0, hidden_act="situ", activation_situ_beta=4.0,
              activation_situ_linear_beta=25.0, linear_attention_bias=True, mla_use_output_gate=True,
              q_lora_rank=16)


@pytest.fixture
def step_calls(monkeypatch):
    """The layers each compiled step call ran (KDA steps and attention heads), in order."""
    kda, (head, tail) = decode_kda_hybrid.compiled_kda_layer_step(), decode_kda_hybrid.compiled_attention_steps()
    calls = []

    def counted(fn):
        def call(layer, *args):
            calls.append(layer)
            return fn(layer, *args)
        return call

    monkeypatch.setattr(decode_kda_hybrid, "compiled_kda_layer_step", lambda strict=False: counted(kda))
    monkeypatch.setattr(decode_kda_hybrid, "compiled_attention_steps", lambda strict=False: (counted(head), tail))
    return calls


def stepped_layers(model):
    return [layer for layer in model.model.layers if layer.__dict__.get("_compiled_decode")]


def with_random_biases(model):
    with torch.no_grad():  # biases (K3's linear_attention_bias, Qwen2's attention_bias) start at zero: make them count
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.1)
    return model


def decode_cache(model, ids, tokens):
    """The cache after a prefill of `ids` and one decode step per token of `tokens`."""
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        for token in tokens:
            model(token.view(1, 1), cache=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("attention,over", [("gqa", dict(attention_bias=True, attention_qk_norm=True)), ("mla", {}),
                                            ("mla", K3_KDA)], ids=["gqa", "mla", "k3-kda-mla"])
def test_compiled_steps_decode_as_the_eager_steps(step_calls, attention, over):
    """Every layer of a dense model opts in; greedy generation through the compiled steps gives the eager model's
    tokens and logits within 1e-5, one step call per layer per decoded token after the first (the prefill runs
    eagerly); the cache's KDA states and KV tensors after the steps equal the eager ones."""
    model = with_random_biases(tiny_model(attention, **over))
    ids = prompt(B=1, T=20, seed=7)
    want = generate_with_logits(model, ids, **GREEDY)
    tokens = want.sequences[0, 20:-1]
    eager_cache = decode_cache(model, ids, tokens)
    model.prepare_cpu_decode(compiled=True)
    assert stepped_layers(model) == list(model.model.layers)
    step_calls.clear()  # prepare's own compiling calls
    got = generate_with_logits(model, ids, **GREEDY)
    assert_same_generation(got, want, rtol=1e-5, atol=1e-5)
    index = {id(layer): i for i, layer in enumerate(model.model.layers)}
    assert [index[id(layer)] for layer in step_calls] == [0, 1, 2, 3] * (GREEDY["max_new_tokens"] - 1)

    step_calls.clear()
    cache = decode_cache(model, ids, tokens)
    assert len(step_calls) == len(tokens) * len(model.model.layers)
    for i, (got_layer, want_layer) in enumerate(zip(cache.layers, eager_cache.layers)):
        for got_t, want_t in zip(got_layer.tensors(), want_layer.tensors(), strict=True):
            torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-6, msg=f"cache of layer {i}")


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_prepare_compiles_what_decode_needs(attention):
    """After prepare_cpu_decode(compiled=True), a generation whose KV buffers grow several times (and whose prefill
    left the KDA conv states in another layout than a decode step does) compiles nothing more."""
    model = tiny_model(attention)
    model.prepare_cpu_decode(compiled=True)
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        model.generate(prompt(B=1, T=5, seed=1), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert counters["stats"]["unique_graphs"] == graphs


def test_moe_layers_keep_their_eager_step():
    model = tiny_model("mla", moe=True)  # layer 0 dense, the rest MoE
    model.prepare_cpu_decode(compiled=True)
    assert stepped_layers(model) == [model.model.layers[0]]


def test_what_the_compiled_steps_do_not_compute_takes_the_eager_step(step_calls):
    """A batch of two rows, a padding mask, gradients and autocast run the eager step (equal to a plain model's);
    a hook added after prepare_cpu_decode is honoured (the compiled step would skip it)."""
    plain, model = tiny_model("gqa"), tiny_model("gqa")
    model.prepare_cpu_decode(compiled=True)
    step_calls.clear()
    ids = prompt(B=2, T=12, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for kw in (dict(), dict(attention_mask=mask)):
        assert_same_generation(generate_with_logits(model, ids, **GREEDY, **kw),
                               generate_with_logits(plain, ids, **GREEDY, **kw), rtol=1e-5, atol=1e-5)
    assert step_calls == []

    one = ids[:1]
    for m in (plain, model):  # hooks that change outputs, added after prepare_cpu_decode
        m.model.layers[1].self_attn.g_b_proj.register_forward_hook(lambda mod, args, out: out * 3)
        m.model.layers[3].mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    assert_same_generation(generate_with_logits(model, one, **GREEDY), generate_with_logits(plain, one, **GREEDY),
                           rtol=1e-5, atol=1e-5)
    stepped = {id(layer) for layer in step_calls}
    assert stepped == {id(model.model.layers[0]), id(model.model.layers[2])}

    cache = KDAHybridCache(model.config)
    with torch.enable_grad():
        model(one, cache=cache, use_cache=True)
        model(one[:, :1], cache=cache, use_cache=True).logits.sum().backward()  # a decode step with gradients
    assert all(p.grad is not None for p in model.model.layers[0].mlp.parameters())
    calls = len(step_calls)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(one[:, :1], cache=cache, use_cache=True)
    assert len(step_calls) == calls


def test_lora_added_after_prepare_is_computed():
    """peft LoRA (unmerged) wrapped around the projections after prepare_cpu_decode: decode computes the adapters,
    as on a model never prepared."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "up_proj"], init_lora_weights=False)
    base = tiny_model("mla")
    plain = get_peft_model(copy.deepcopy(base), config).eval()
    base.prepare_cpu_decode(compiled=True)
    torch.manual_seed(0)
    wrapped = get_peft_model(base, copy.deepcopy(config)).eval()
    wrapped.load_state_dict(plain.state_dict())
    ids = prompt(B=1, T=10, seed=4)
    assert_same_generation(generate_with_logits(wrapped, ids, **GREEDY), generate_with_logits(plain, ids, **GREEDY),
                           rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_nonfinite_token_takes_the_same_values(attention):
    """A decode token with an infinite embedding: the compiled attention steps have no non-finite bookkeeping
    (_CausalThroughNonFinite), and need none for one token in one row: logits and caches equal a plain model's,
    NaN where it has NaN, for that token and the next."""
    plain, model = tiny_model(attention), tiny_model(attention)
    model.prepare_cpu_decode(compiled=True)
    ids = prompt(B=1, T=8, seed=5)
    caches = []
    for m in (plain, model):
        cache = KDAHybridCache(m.config)
        with torch.no_grad():
            m(ids, cache=cache, use_cache=True)
            embeds = m.get_input_embeddings()(ids[:, :1]).clone()
            embeds[..., 0] = float("inf")
            logits = [m(inputs_embeds=embeds, cache=cache, use_cache=True).logits,
                      m(ids[:, 1:2], cache=cache, use_cache=True).logits]
        caches.append((logits, cache))
    (want_logits, want_cache), (got_logits, got_cache) = caches
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    for got_layer, want_layer in zip(got_cache.layers, want_cache.layers):
        for got_t, want_t in zip(got_layer.tensors(), want_layer.tensors(), strict=True):
            torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_compile_failure_warns_and_keeps_the_eager_step(monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(decode_kda_hybrid, "compiled_kda_layer_step", lambda strict=False: broken)
    model, plain = tiny_model("mla"), tiny_model("mla")
    with pytest.warns(UserWarning, match="compiling the layer steps failed .*no C\\+\\+ compiler"):
        model.prepare_cpu_decode(compiled=True)
    assert stepped_layers(model) == []
    ids = prompt(B=1, T=10, seed=2)
    assert_same_generation(generate_with_logits(model, ids, **GREEDY), generate_with_logits(plain, ids, **GREEDY),
                           rtol=1e-5, atol=1e-5)
