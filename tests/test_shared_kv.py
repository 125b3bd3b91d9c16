"""KDA layers with shared keys and values (`linear_num_kv_heads` < `linear_num_heads`): one recurrent state per
key/value head, read by its query heads, as a GQA teacher's attention reads its key/value heads. Such a layer must
compute exactly what the layer with one key/value head per query head computes when that layer's key/value weights
are the shared ones repeated (`expand_shared_kv`): forward over several chunks, padding, packed documents, the
cache (prefill, continuation, decode, rollback, compiled decode), gradients, and a conversion from a GQA source
must start from the source's own key/value projections."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from kda_hybrid import KDAHybridCache, KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.cache_layers_kda_hybrid import cache_bytes
from kda_hybrid.conversion import ConversionError, convert
from kda_hybrid.conversion.__main__ import main as cli
from kda_hybrid.conversion.from_attention import expand_shared_kv
from kda_hybrid.conversion.to_gguf import check_expressible
from kda_hybrid.kda_ops import recurrent_step

from ._attention_sources import ids as source_ids
from ._attention_sources import save_source
from .helpers import assert_same_generation, generate_with_logits, prompt, tiny_model

H, HKV, K = 4, 2, 16
GROUPS = H // HKV
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, the same sums in another order (grouped products, repeated heads)


def shared_model(**over):
    """A tiny GQA hybrid (3 KDA layers + 1 attention) with 4 KDA query heads over 2 key/value heads, every KDA
    parameter random (A_log and dt_bias too: their expansion is checked as well)."""
    model = tiny_model("gqa", linear_num_heads=H, linear_num_kv_heads=HKV, **over)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.normal_(0.0, 0.5)
    return model


def repeated(model):
    """The same function with one key/value head per query head."""
    state, config = expand_shared_kv(model.state_dict(), model.config)
    out = KDAHybridForCausalLM(config).eval()
    out.load_state_dict(state)
    return out


@pytest.fixture(scope="module")
def pair():
    model = shared_model()
    return model, repeated(model)


def test_the_config_checks_the_key_value_heads():
    with pytest.raises(ValueError, match="linear_num_heads.*multiple of linear_num_kv_heads=3"):
        KDAHybridConfig(linear_num_heads=4, linear_num_kv_heads=3)
    with pytest.raises(ValueError, match="linear_num_kv_heads"):
        KDAHybridConfig(linear_num_heads=4, linear_num_kv_heads=0)
    config = KDAHybridConfig(linear_num_heads=4, linear_num_kv_heads=2)
    assert config.linear_kv_heads == 2 and KDAHybridConfig(linear_num_heads=4).linear_kv_heads == 4
    # what a Kimi Linear file or llama.cpp cannot hold is refused, not dropped
    with pytest.raises(ValueError, match="linear_num_kv_heads=2"):
        config.to_kimi_linear_dict()
    with pytest.raises(ConversionError, match="linear_num_kv_heads=2"):
        check_expressible(KDAHybridConfig(linear_num_heads=8, num_attention_heads=8, linear_num_kv_heads=2))


def test_expansion_repeats_each_key_value_head_for_its_query_heads(pair):
    model, rep = pair
    a, b = model.model.layers[0].self_attn, rep.model.layers[0].self_attn
    assert a.k_proj.weight.shape == (HKV * K, 64) and b.k_proj.weight.shape == (H * K, 64)
    for h in range(H):  # query head h reads key/value head h // GROUPS (transformers' repeat_kv order)
        kv = h // GROUPS
        rows, kv_rows = slice(h * K, (h + 1) * K), slice(kv * K, (kv + 1) * K)
        for name in ("k_proj", "v_proj", "k_conv1d", "v_conv1d", "f_b_proj"):
            assert torch.equal(getattr(b, name).weight[rows], getattr(a, name).weight[kv_rows]), name
        assert torch.equal(b.dt_bias[rows], a.dt_bias[kv_rows])
        assert torch.equal(b.b_proj.weight[h], a.b_proj.weight[kv])
        assert torch.equal(b.A_log[0, 0, h], a.A_log[0, 0, kv])
    for name in ("q_proj", "g_b_proj", "o_proj", "q_conv1d"):  # per query head: unchanged
        assert torch.equal(getattr(a, name).weight, getattr(b, name).weight)


@torch.no_grad()
def test_forward_equals_the_repeated_head_model_over_several_chunks_padding_and_packing(pair):
    model, rep = pair
    x = prompt(B=2, T=150)  # more than two 64-token chunks
    torch.testing.assert_close(model(x).logits, rep(x).logits, **TOL)
    mask = torch.ones_like(x)
    mask[0, :37] = 0  # left padding
    torch.testing.assert_close(model(x, attention_mask=mask).logits, rep(x, attention_mask=mask).logits, **TOL)
    # packed documents: position ids restarting mid-row
    pos = torch.cat((torch.arange(90), torch.arange(60))).expand(2, -1)
    torch.testing.assert_close(model(x, position_ids=pos).logits, rep(x, position_ids=pos).logits, **TOL)


@torch.no_grad()
def test_the_cache_holds_one_state_per_key_value_head(pair):
    model, rep = pair
    x = prompt(B=2, T=100)
    full = model(x).logits
    cache = KDAHybridCache(model.config)
    first = model(x[:, :70], cache=cache).logits
    second = model(x[:, 70:], cache=cache).logits
    torch.testing.assert_close(torch.cat((first, second), 1), full, **TOL)
    layer = cache.layers[0]
    assert layer.recurrent_state.shape == (2, HKV, K, K)
    assert [tuple(c.shape) for c in layer.conv_states] == [(2, H * K, 3), (2, HKV * K, 3), (2, HKV * K, 3)]
    other = KDAHybridCache(rep.config)
    rep(x, cache=other)
    torch.testing.assert_close(layer.recurrent_state.repeat_interleave(GROUPS, 1), other.layers[0].recurrent_state,
                               **TOL)
    # what the cache costs, as cache_bytes reports it and as allocated
    small, big = cache_bytes(model.config), cache_bytes(rep.config)
    per_layer = HKV * K * K * 4 + (H + 2 * HKV) * K * 3 * 4
    assert small["kda_state_per_layer"] == per_layer < big["kda_state_per_layer"]
    assert per_layer * 2 == sum(t.numel() * t.element_size() for t in layer.tensors())
    # a cache of the other head layout is refused, not silently read
    with pytest.raises(ValueError, match="linear_kv_heads"):
        rep(x[:, :1], cache=cache)


def test_greedy_generation_equals_the_repeated_head_model_eager_and_compiled():
    model = shared_model()
    rep = repeated(model)
    x = prompt(B=2, T=20)
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = generate_with_logits(rep, x, **greedy)
    assert_same_generation(generate_with_logits(model, x, **greedy), want, **TOL)
    with warnings.catch_warnings():  # a step that fails to compile falls back to eager with a warning: an error here
        warnings.filterwarnings("error", message="prepare_cpu_decode")
        model.prepare_cpu_decode(compiled=True)  # the compiled layer step reads the grouped state too
    assert_same_generation(generate_with_logits(model, x[:1], **greedy), want.row(0), **TOL)


@torch.no_grad()
def test_crop_rolls_back_the_shared_states(pair):
    model, _ = pair
    x = prompt(B=2, T=12)
    cache = KDAHybridCache(model.config)
    model(x[:, :6], cache=cache)
    cache.activate_past_recording()
    model(x[:, 6:9], cache=cache)
    model(x[:, 9:11], cache=cache)
    cache.crop(-4)  # 11 tokens -> 7
    want = KDAHybridCache(model.config)
    model(x[:, :7], cache=want)
    for got, ref in zip(cache.layers[:3], want.layers[:3]):
        torch.testing.assert_close(got.recurrent_state, ref.recurrent_state, **TOL)
        for a, b in zip(got.conv_states, ref.conv_states):
            torch.testing.assert_close(a, b, **TOL)


def test_gradients_are_the_repeated_model_gradients_summed_over_each_group():
    model = shared_model().train()
    rep = repeated(model).train()
    x = prompt(B=2, T=80)
    for m in (model, rep):
        m(x, labels=x).loss.backward()
    a, b = model.model.layers[1].self_attn, rep.model.layers[1].self_attn

    def folded(grad, rows_per_head):  # the sum of each group's copies
        return grad.unflatten(0, (HKV, GROUPS, rows_per_head)).sum(1).flatten(0, 1)

    for name in ("k_proj", "v_proj", "f_b_proj", "k_conv1d"):
        torch.testing.assert_close(getattr(a, name).weight.grad, folded(getattr(b, name).weight.grad, K), **TOL)
    torch.testing.assert_close(a.b_proj.weight.grad, folded(b.b_proj.weight.grad, 1), **TOL)
    torch.testing.assert_close(a.dt_bias.grad, folded(b.dt_bias.grad, K), **TOL)
    torch.testing.assert_close(a.A_log.grad.flatten(), folded(b.A_log.grad.flatten(), 1), **TOL)
    torch.testing.assert_close(a.q_proj.weight.grad, b.q_proj.weight.grad, **TOL)


@pytest.mark.parametrize("inplace", [True, False])
def test_the_decode_step_op_reads_each_state_from_its_query_heads(inplace):
    gen = torch.Generator().manual_seed(0)
    B = 3
    q = torch.randn(B, H, K, generator=gen)
    k, v = torch.randn(B, HKV, K, generator=gen), torch.randn(B, HKV, K, generator=gen)
    g = -torch.rand(B, HKV, K, generator=gen)
    beta = torch.rand(B, HKV, generator=gen)
    state = torch.randn(B, HKV, K, K, generator=gen)
    rep = [t.repeat_interleave(GROUPS, 1) for t in (k, v, g, beta, state)]
    want_o, want_state = recurrent_step(q, *rep, use_qk_l2norm_in_kernel=True, inplace=False)
    o, new = recurrent_step(q, k, v, g, beta, state, use_qk_l2norm_in_kernel=True, inplace=inplace)
    torch.testing.assert_close(o, want_o, **TOL)
    torch.testing.assert_close(new.repeat_interleave(GROUPS, 1), want_state, **TOL)
    assert (new is state) == inplace and new.shape == (B, HKV, K, K)


def test_conversion_keeps_the_sources_key_value_heads(tmp_path):
    source, folder = save_source(tmp_path, "llama")  # 4 query heads over 2 key/value heads
    shared = convert(folder, tmp_path / "shared", layer_types="kkkA", shared_kv=True, progress=False)
    plain = convert(folder, tmp_path / "plain", layer_types="kkkA", progress=False)
    model = KDAHybridForCausalLM.from_pretrained(shared).eval()
    base = KDAHybridForCausalLM.from_pretrained(plain).eval()
    assert model.config.linear_num_kv_heads == source.config.num_key_value_heads == 2
    assert json.loads((shared / "kda_hybrid_conversion.json").read_text())["shared_kv"] is True
    src = source.state_dict()
    for i in range(3):
        for name in ("k_proj", "v_proj"):  # the teacher's own projections, not repeated
            assert torch.equal(model.state_dict()[f"model.layers.{i}.self_attn.{name}.weight"],
                               src[f"model.layers.{i}.self_attn.{name}.weight"])
    # expanded, the shared start is the plain conversion's start, tensor for tensor
    expanded, config = expand_shared_kv(model.state_dict(), model.config)
    assert config.to_dict() == {**base.config.to_dict(), "_name_or_path": config.to_dict()["_name_or_path"]}
    want = base.state_dict()
    assert expanded.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(expanded[name], t), name
    with torch.no_grad():
        torch.testing.assert_close(model(source_ids()).logits, base(source_ids()).logits, **TOL)
    # the command line, and a source whose heads are fixed
    assert cli([str(folder), str(tmp_path / "cli"), "--layer-types", "kkkA", "--shared-kv", "--no-progress"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["linear_num_kv_heads"] == 2
    with pytest.raises(ConversionError, match="shared_kv: expected True or False"):
        convert(folder, tmp_path / "bad", layer_types="kkkA", shared_kv=1, progress=False)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConversionError, match="shared_kv.*applies to"):
        convert(shared, tmp_path / "again", shared_kv=True, progress=False)
    assert not (tmp_path / "again").exists()
