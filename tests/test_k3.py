"""Kimi K3 in the model: the released config.json read field by field (and refused where it says something this
model does not implement), the K3 layers against an independent token-by-token reference written from the
formulas (tests/k3_reference.py), the Kimi Linear special case bit for bit, and the cache paths (decode, chunked
prefill, padding, rollback, packed documents) on a K3-shaped model."""

import copy
import gzip
import json
import os

import pytest
import torch

from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.configuration_kda_hybrid import FIELDS
from kda_hybrid.kimi_config_kda_hybrid import GENERIC_KEYS, k3_quantization_config
from kda_hybrid.layers_kda_hybrid import MXFP4Linear
from kda_hybrid.mxfp4_torch import dequantize_mxfp4

from . import k3_reference as ref
from .helpers import (
    FIXTURES,
    K3_CONFIG,
    VOCAB,
    assert_bit_exact,
    assert_close_rel,
    k3_model,
    k3_mxfp4_model,
    k3_text_config,
    read_folder,
    tiny_kimi_config,
    tiny_model,
)


def reference_logits(model, ids):
    tensors = {k: v.detach().double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    return ref.k3_reference_logits(tensors, model.config.to_kimi_linear_dict(), ids)


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

def test_released_k3_config_reads_every_field():
    c = KDAHybridConfig(**K3_CONFIG)
    assert c.num_hidden_layers == 93 and len(c.linear_attention_layers) == 69 and len(c.full_attention_layers) == 24
    assert c.full_attention_layers[:3] == [3, 7, 11] and c.full_attention_layers[-2:] == [91, 92]  # 1-based 92, 93
    assert (c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_size) == (96, 128, 4)
    assert (c.gate_lower_bound, c.use_full_rank_gate, c.mla_use_output_gate) == (-5.0, True, True)
    assert (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert (c.num_experts, c.num_experts_per_tok, c.n_shared_experts) == (896, 16, 2)
    assert (c.moe_intermediate_size, c.routed_expert_hidden_size, c.latent_moe_use_norm) == (3072, 3584, True)
    assert (c.q_lora_rank, c.kv_lora_rank, c.attn_res_block_size, c.expert_quantization) == (1536, 512, 12, "mxfp4")
    assert (c.rms_norm_eps, c.routed_scaling_factor, c.first_k_dense_replace) == (1e-5, 1.0, 1)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.tie_word_embeddings) == (163584, 163586, 163839, False)
    # transformers' quantizers never see K3's quantization_config: this model computes from the stored MXFP4 itself
    assert getattr(c, "quantization_config", None) is None and "quantization_config" not in c.to_dict()


def test_k3_config_writes_back_every_architecture_key():
    text = K3_CONFIG["text_config"]
    back = KDAHybridConfig(**K3_CONFIG).to_kimi_k3_dict()
    assert back["model_type"] == "kimi_k3" and back["architectures"] == ["KimiK3ForConditionalGeneration"]
    ours = back["text_config"]
    for key, value in ours.items():
        if key not in ("architectures",):
            assert text[key] == value, key
    generic = set(text) - set(ours)
    assert generic <= GENERIC_KEYS | {"num_key_value_heads"}, generic - GENERIC_KEYS
    assert ours["quantization_config"] == k3_quantization_config() == text["quantization_config"]
    def architecture(c):
        return {k: v for k, v in c.to_dict().items() if k not in GENERIC_KEYS}

    assert architecture(KDAHybridConfig(**back)) == architecture(KDAHybridConfig(**K3_CONFIG))
    assert "auto_map" not in KDAHybridConfig(**K3_CONFIG).to_dict()  # Moonshot's module names are not ours


def test_kimi_linear_configs_write_no_k3_key():
    """A Kimi Linear config reads and writes back exactly as before K3: no K3 key appears."""
    kimi = tiny_kimi_config()
    back = KDAHybridConfig(**kimi).to_kimi_linear_dict()
    assert not KDAHybridConfig(**kimi).uses_k3_features
    for key in ("use_full_rank_gate", "gate_lower_bound"):
        assert key not in back["linear_attn_config"]
    for key in ("mla_use_output_gate", "activation_situ_beta", "routed_expert_hidden_size", "latent_moe_use_norm",
                "attn_res_block_size", "quantization_config"):
        assert key not in back


@pytest.mark.parametrize("where, key", [("text", "attn_res_new_switch"), ("lac", "use_shiny_gate"),
                                        ("root", "audio_config")])
def test_a_key_this_model_does_not_implement_is_an_error_naming_it(where, key):
    cfg = copy.deepcopy(K3_CONFIG)
    {"text": cfg["text_config"], "lac": cfg["text_config"]["linear_attn_config"], "root": cfg}[where][key] = 1
    with pytest.raises(ValueError, match=key):
        KDAHybridConfig(**cfg)


@pytest.mark.parametrize("over, field, expected", [
    (dict(linear_attn_config={"gate_lower_bound": 0.0}), "gate_lower_bound", "< 0"),
    (dict(linear_attn_config={"gate_lower_bound": float("nan")}), "gate_lower_bound", "finite"),
    (dict(linear_attn_config={"use_full_rank_gate": 1}), "use_full_rank_gate", "True or False"),
    (dict(hidden_act="silu"), "activation_situ_beta", "hidden_act='situ'"),
    (dict(activation_situ_linear_beta=-1.0), "activation_situ_linear_beta", "> 0"),
    (dict(routed_expert_hidden_size=0), "routed_expert_hidden_size", "positive int"),
    (dict(routed_expert_hidden_size=None), "latent_moe_use_norm", "without a latent MoE"),
    (dict(attn_res_block_size=0), "attn_res_block_size", "positive int"),
    (dict(num_experts=None, latent_moe_use_norm=False, quantization_config=None), "routed_expert_hidden_size",
     "without routed experts"),
    (dict(moe_intermediate_size=3000), "moe_intermediate_size", "multiple of 32"),
    (dict(quantization_config=dict(k3_quantization_config(), format="nvfp4-pack-quantized")), "quantization_config",
     "format='nvfp4-pack-quantized'"),
    (dict(quantization_config=dict(k3_quantization_config(), ignore=["re:.*lm_head.*"])), "quantization_config",
     "unquantised"),
    (dict(mla_use_output_gate="yes"), "mla_use_output_gate", "True or False"),
])
def test_bad_k3_value_is_refused_naming_the_field(over, field, expected):
    cfg = copy.deepcopy(K3_CONFIG)
    text = cfg["text_config"]
    if "linear_attn_config" in over:
        text["linear_attn_config"].update(over.pop("linear_attn_config"))
    text.update(over)
    with pytest.raises(ValueError, match=field) as err:
        KDAHybridConfig(**cfg)
    assert expected in str(err.value)


def test_the_k3_state_dict_is_the_released_text_inventory():
    """Our parameter names and shapes for the released K3 config are the released text tensors (the inventory of
    the 96 shards, 497,052 tensors, `language_model.` stripped), one for one. The one difference: A_log, [128] as
    released (96 heads, then a zero tail), [1, 1, 96, 1] here. Dtypes: MXFP4 uint8 exactly where released, fp32 where
    this model keeps fp32."""
    from kda_hybrid.conversion import kimi_inventory

    with gzip.open(FIXTURES / "kimi_k3_text_tensors.tsv.gz", "rt") as f:
        rows = [line.rstrip("\n").split("\t") for line in f]
    released = {name.removeprefix("language_model."): (tuple(json.loads(shape)), dtype) for name, shape, dtype in rows}
    assert len(released) == len(rows) == 497_052
    ours = kimi_inventory(K3_CONFIG)
    assert list(ours) == list(released)  # the same names in the same order
    for name, spec in ours.items():
        shape, dtype = released[name]
        if name.endswith(".A_log"):
            assert (shape, spec.shape) == ((128,), (1, 1, 96, 1)), name
        else:
            assert spec.shape == shape, name
        assert spec.quantized == (dtype == "u8"), name
        if spec.fp32:
            assert dtype == "fp32", name


# --------------------------------------------------------------------------------------------------
# Against the reference written from the formulas
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over", [
    pytest.param({}, id="k3"),
    pytest.param(dict(attn_res_block_size=None), id="no-attnres"),
    pytest.param(dict(routed_expert_hidden_size=None, latent_moe_use_norm=False), id="no-latent"),
    pytest.param(dict(latent_moe_use_norm=False), id="latent-no-norm"),
    pytest.param(dict(attn_res_block_size=4), id="attnres-4"),
    pytest.param(dict(activation_situ_linear_beta=None), id="situ-uncapped-up"),
    pytest.param(dict(q_lora_rank=None), id="no-q-lora"),
])
def test_k3_model_equals_the_token_by_token_reference(over):
    model = k3_model(**over).double()
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, reference_logits(model, ids), **F64_TOL)


# The model keeps its gates, norms, router scores and softmaxes in fp32 even when its weights are float64, as it
# does for bf16 weights; the reference is float64 throughout. Observed: at most 1.2e-6 on logits of std ~1.
F64_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tensor, config_change", [
    ("model.layers.4.mlp_res_proj.weight", None),
    ("model.layers.0.self_attn.g_proj.weight", None),
    ("model.layers.3.self_attn.g_proj.weight", None),
    ("model.layers.2.block_sparse_moe.routed_expert_norm.weight", None),
    ("model.output_attn_res_proj.weight", None),
    (None, {"gate_lower_bound": -2.0}),
    (None, {"activation_situ_beta": 3.0}),
])
def test_the_reference_comparison_sees_a_small_change_in_any_k3_piece(tensor, config_change):
    """The comparison above can fail: one K3 tensor scaled by 1.05, or one K3 constant changed, moves the logits
    beyond ten times its tolerance (the model-vs-reference error is under 1.2e-6)."""
    model = k3_model().double()
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    tensors = {k: v.detach().double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    config = model.config.to_kimi_linear_dict()
    if tensor is not None:
        tensors[tensor] = tensors[tensor] * 1.05
    else:
        for key, value in config_change.items():
            (config["linear_attn_config"] if key in config["linear_attn_config"] else config)[key] = value
    with torch.no_grad():
        got = model(ids).logits
    assert (got - ref.k3_reference_logits(tensors, config, ids)).abs().max() > 10 * F64_TOL["atol"]


def test_k3_model_in_fp32_is_close_to_the_float64_reference():
    """fp32 over more than one chunk (70 tokens > 64): the chunked CPU path, not only token by token."""
    model = k3_model()
    ids = torch.randint(1, VOCAB, (1, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model(ids).logits.double()
    torch.testing.assert_close(got, reference_logits(model, ids), rtol=2e-4, atol=2e-4)


def test_every_switch_off_is_kimi_linear_bit_for_bit():
    """A K3 config with every K3 switch off builds today's Kimi Linear model: the same parameters, and the same
    logits bit for bit (the same computation)."""
    off = dict(gate_lower_bound=None, use_full_rank_gate=False, mla_use_output_gate=False, hidden_act="silu",
               routed_expert_hidden_size=None, latent_moe_use_norm=False, attn_res_block_size=None)
    base = tiny_kimi_config()
    k3_off = dict(base, **{k: v for k, v in off.items() if k not in ("gate_lower_bound", "use_full_rank_gate")})
    k3_off["linear_attn_config"] = dict(base["linear_attn_config"], gate_lower_bound=None, use_full_rank_gate=False)
    a, b = KDAHybridConfig(**base), KDAHybridConfig(**k3_off)
    assert not a.uses_k3_features and not b.uses_k3_features
    assert a.to_kimi_linear_dict() == b.to_kimi_linear_dict()
    torch.manual_seed(0)
    ma = KDAHybridForCausalLM(a).eval()
    mb = KDAHybridForCausalLM(b).eval()
    assert list(ma.state_dict()) == list(mb.state_dict())
    mb.load_state_dict(ma.state_dict())
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ma(ids).logits, mb(ids).logits)


# --------------------------------------------------------------------------------------------------
# Cache paths: nothing of AttnRes is cached, and every path stays exact
# --------------------------------------------------------------------------------------------------

def test_k3_decode_and_chunked_prefill_equal_one_forward():
    model = k3_model()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        parts = [out.logits]
        mid = model(ids[:, 5:9], cache=out.cache)  # a chunk of 4 (latent MLA path)
        parts.append(mid.logits)
        for t in range(9, 12):  # token by token (KDA decode step)
            parts.append(model(ids[:, t:t + 1], cache=mid.cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_k3_left_padding_and_crop_rollback_are_exact():
    model = k3_model()
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), 1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 7, dtype=torch.long)), 1)
    with torch.no_grad():
        plain = model(ids).logits
        pad = model(padded, attention_mask=mask).logits[:, 3:]
        torch.testing.assert_close(pad, plain, rtol=1e-4, atol=1e-5)
        out = model(ids[:, :4], use_cache=True)
        cache = out.cache
        cache.activate_past_recording()
        model(ids[:, 4:], cache=cache)
        cache.crop(-3)  # roll back the last 3 tokens and continue: as if they had never been seen
        again = model(ids[:, 4:], cache=cache).logits
    torch.testing.assert_close(again, plain[:, 4:], rtol=1e-4, atol=1e-5)


def test_k3_packed_documents_equal_separate_forwards():
    model = k3_model()
    a = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    b = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(8))
    pos = torch.cat((torch.arange(5), torch.arange(6)))[None]
    with torch.no_grad():
        packed = model(torch.cat((a, b), 1), position_ids=pos).logits
        sep = torch.cat((model(a).logits, model(b).logits), 1)
    torch.testing.assert_close(packed, sep, rtol=1e-4, atol=1e-5)


def test_k3_greedy_generate_matches_its_own_full_forward():
    model = k3_model()
    ids = torch.randint(3, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        full = model(out.sequences).logits[:, 4:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-5)
    assert torch.equal(out.sequences[:, 5:], full.argmax(-1))


def test_k3_trains_and_gradients_reach_every_parameter():
    model = k3_model().train()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(10))
    model(ids, labels=ids).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    # routed experts a batch does not choose get no gradient, nor layer 0's first read (one source: its softmax is
    # 1 whatever the query, as in K3, which ships these tensors too); everything else must
    assert all(".experts." in n or n.startswith("model.layers.0.self_attention_res_") for n in dead), dead
    assert any(n.startswith("model.layers.0.self_attention_res_") for n in dead)


# --------------------------------------------------------------------------------------------------
# MXFP4 experts as stored
# --------------------------------------------------------------------------------------------------

def test_mxfp4_dequantisation_equals_the_reference_and_known_bytes():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    packed, scale = ref.quantize_mxfp4(w)
    torch.testing.assert_close(dequantize_mxfp4(packed, scale).double(), ref.dequantize_mxfp4(packed, scale).double(),
                               rtol=0, atol=0)
    one = torch.full((1, 16), 0x21, dtype=torch.uint8)  # low nibble 1 (0.5), high nibble 2 (1.0)
    got = dequantize_mxfp4(one, torch.tensor([[127]], dtype=torch.uint8))
    assert got[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]


def test_mxfp4_experts_compute_from_the_stored_bytes():
    """A K3 model with MXFP4 experts equals the reference fed the same packed bytes, and holds the experts as uint8
    (a quarter of bf16's bytes plus one scale byte per 32 weights)."""
    model = k3_model(quantization_config=k3_quantization_config()).double()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MXFP4Linear):
                w = torch.randn(m.out_features, m.in_features, generator=gen) * 0.3
                m.weight_packed, m.weight_scale = ref.quantize_mxfp4(w)
    expert = model.model.layers[1].block_sparse_moe.experts[0]
    assert expert.w1.weight_packed.dtype == torch.uint8 and not list(expert.parameters())
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, reference_logits(model, ids), **F64_TOL)


@pytest.mark.parametrize("bad", ["nan-scale", "shape"])
def test_a_bad_mxfp4_tensor_is_refused_before_anything_is_loaded(bad):
    model = k3_model(quantization_config=k3_quantization_config())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    key = "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"
    if bad == "nan-scale":
        sd[key][0, 0] = 255
        match = "255"
    else:
        sd[key.replace("scale", "packed")] = sd[key.replace("scale", "packed")][:, :-1].clone()
        match = "weight_packed"
    before = model.model.layers[1].block_sparse_moe.experts[0].w1.weight_scale.clone()
    with pytest.raises(ValueError, match=match):
        model.load_state_dict(sd)
    assert torch.equal(model.model.layers[1].block_sparse_moe.experts[0].w1.weight_scale, before)


def test_k3_state_dict_is_its_inventory():
    from kda_hybrid.conversion import kimi_inventory

    model = k3_model(quantization_config=k3_quantization_config())
    sd = model.state_dict()
    inventory = kimi_inventory(model.config)
    assert sorted(sd) == sorted(inventory)
    assert all(tuple(sd[name].shape) == spec.shape for name, spec in inventory.items())
    assert all((sd[name].dtype == torch.uint8) == spec.quantized for name, spec in inventory.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k3_mxfp4_model_round_trips_through_save_and_auto_loading(tmp_path, dtype):
    """save_pretrained, then AutoModelForCausalLM with remote code (and dtype=bf16): the MXFP4 bytes load as stored
    (uint8, never cast or expanded), every K3 field survives, the logits are the same."""
    from transformers import AutoModelForCausalLM

    model = k3_mxfp4_model()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=dtype).eval()
    for name in ("gate_lower_bound", "use_full_rank_gate", "mla_use_output_gate", "hidden_act",
                 "activation_situ_beta", "activation_situ_linear_beta", "routed_expert_hidden_size",
                 "latent_moe_use_norm", "attn_res_block_size", "expert_quantization"):
        assert getattr(loaded.config, name) == getattr(model.config, name), name
    got_sd, want_sd = loaded.state_dict(), model.state_dict()
    for name, want in want_sd.items():
        if want.dtype == torch.uint8:
            assert got_sd[name].dtype == torch.uint8 and torch.equal(got_sd[name], want), name
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want = model.to(dtype)(ids).logits.float()
        got = loaded(ids).logits.float()
    assert torch.equal(got, want)  # the same weights and the same computation: bit for bit


def test_expert_and_cache_bytes_of_the_released_k3_are_its_tensors():
    """expert_bytes / cache_bytes (the functions the README's K3 figures come from) against the released layout:
    the MXFP4 bytes are the inventory's uint8 bytes exactly; the KDA state and MLA bytes per token are K3's."""
    from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, expert_bytes

    with gzip.open(FIXTURES / "kimi_k3_text_tensors.tsv.gz", "rt") as f:
        u8 = 0
        for line in f:
            name, shape, dtype = line.rstrip("\n").split("\t")
            if dtype == "u8":
                n = 1
                for d in json.loads(shape):
                    n *= d
                u8 += n
    config = KDAHybridConfig(**K3_CONFIG)
    experts = expert_bytes(config)
    assert experts["stored"] == u8
    assert experts["weights"] == 92 * 896 * 3 * 3072 * 3584  # 92 MoE layers, 896 experts, w1 w2 w3 of 3072 x 3584
    assert experts["bf16"] == 2 * experts["weights"]
    cache = cache_bytes(config, "bfloat16")
    assert (cache["kda_layers"], cache["attention_layers"]) == (69, 24)
    assert cache["kda_state_per_layer"] == 96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2
    assert cache["kv_per_token"] == 24 * (512 + 64) * 2


def test_a_k3_model_of_any_size_builds_from_kimi_k3_and_runs_the_readme_example():
    small = KDAHybridConfig.kimi_k3(vocab_size=2048, hidden_size=256, num_hidden_layers=8, linear_num_heads=4,
                                    linear_head_dim=64, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
    released = KDAHybridConfig(**K3_CONFIG)
    for name in ("gate_lower_bound", "use_full_rank_gate", "mla_use_output_gate", "hidden_act",
                 "activation_situ_beta", "activation_situ_linear_beta", "latent_moe_use_norm", "attn_res_block_size",
                 "n_shared_experts", "rms_norm_eps"):
        assert getattr(small, name) == getattr(released, name), name
    assert small.routed_expert_hidden_size == 128 and small.expert_quantization is None  # trainable bf16/fp32 experts
    model = KDAHybridForCausalLM(small).eval()
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


# --------------------------------------------------------------------------------------------------
# Converting a K3 checkpoint folder (the released layout, tiny shapes)
# --------------------------------------------------------------------------------------------------

def write_k3_folder(folder, *, seed=0, a_log_tail=0.0, scale_255=False):
    """A K3 folder in the released layout at tiny shapes: the root config with MXFP4 quantization_config,
    `language_model.` names in 3 shards with an index, A_log padded to head_dim with zeros, MXFP4 routed experts,
    and a vision tower the text model must skip. Returns (root config, the text tensors without the prefix)."""
    from safetensors.torch import save_file

    root = copy.deepcopy(K3_CONFIG)
    root["text_config"] = dict(k3_text_config(), quantization_config=k3_quantization_config())
    root.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tiny vocabulary's
    text = ref.random_k3_tensors(root["text_config"], seed=seed, mxfp4=True)
    heads, head_dim = 2, 16
    for name in [n for n in text if n.endswith(".A_log")]:
        padded = torch.zeros(head_dim)
        padded[:heads] = text[name].reshape(-1)[:heads]
        padded[heads:] = a_log_tail
        text[name] = padded
    if scale_255:
        text["model.layers.1.block_sparse_moe.experts.2.w2.weight_scale"][0, 0] = 255
    full = {"language_model." + n: t.contiguous() for n, t in text.items()}
    full["vision_tower.encoder.blocks.0.attn.qkv.weight"] = torch.randn(12, 4)
    full["mm_projector.proj.0.weight"] = torch.randn(4, 4)
    names = list(full)
    shards = [names[i::3] for i in range(3)]
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, part in enumerate(shards, 1):
        file = f"model-{k:05d}-of-00003.safetensors"
        save_file({n: full[n] for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(root))
    return root, text


def test_a_k3_folder_converts_and_loads_equal_to_the_reference(tmp_path):
    from transformers import AutoModelForCausalLM

    from kda_hybrid.conversion import convert

    _, text = write_k3_folder(tmp_path / "k3")
    dst = convert(tmp_path / "k3", tmp_path / "ours", progress=False)
    model = AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True).eval()
    assert model.config.expert_quantization == "mxfp4" and model.config.attn_res_block_size == 2
    sd = model.state_dict()
    for name, t in text.items():  # every text tensor arrives byte for byte (A_log without its padding)
        got = sd[name]
        want = t[:2].reshape(1, 1, 2, 1) if name.endswith(".A_log") else t
        assert got.dtype == want.dtype and torch.equal(got, want), name
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        got = model.double()(ids).logits
    tensors = {k: v.double() if v.is_floating_point() else v for k, v in text.items()}
    torch.testing.assert_close(got, ref.k3_reference_logits(tensors, dict(k3_text_config()), ids), **F64_TOL)


def test_a_k3_conversion_lists_the_skipped_vision_tensors(tmp_path):
    from kda_hybrid.conversion import convert
    from kda_hybrid.conversion.publish import MANIFEST

    write_k3_folder(tmp_path / "k3")
    dst = convert(tmp_path / "k3", tmp_path / "ours", progress=False)
    manifest = json.loads((dst / MANIFEST).read_text())
    assert manifest["source_format"] == "kimi_k3"
    assert manifest["skipped_tensors"] == ["mm_projector.proj.0.weight",
                                           "vision_tower.encoder.blocks.0.attn.qkv.weight"]


@pytest.mark.parametrize("fault, match", [
    (dict(a_log_tail=0.5), "must be zeros"),
    (dict(scale_255=True), "255"),
])
def test_a_corrupt_k3_folder_is_refused_with_nothing_written(tmp_path, fault, match):
    from kda_hybrid.conversion import ConversionError, convert

    write_k3_folder(tmp_path / "k3", **fault)
    with pytest.raises(ConversionError, match=match):
        convert(tmp_path / "k3", tmp_path / "ours", progress=False)
    assert not (tmp_path / "ours").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3"]  # no staging folder left either


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to SIGKILL conversions cheaply")
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_k3_conversion_killed_anywhere_leaves_old_or_new_output(tmp_path, overwrite):
    """The released K3 layout (3 shards, `language_model.` names, MXFP4 experts, a vision tower skipped) converts
    crash-safe as every conversion does: SIGKILLed at each file-system step of the publish and at random points of
    the streaming, the destination holds the old output or the whole new one, and the rerun completes."""
    from .test_conversion import _assert_killed_runs_recover

    _, text = write_k3_folder(tmp_path / "k3")
    _assert_killed_runs_recover(tmp_path, tmp_path / "k3", overwrite=overwrite, fallback=False, n_random=2, seed=0,
                                tensors=len(text))


def test_a_k3_model_is_not_written_as_kimi_linear(tmp_path):
    from kda_hybrid.conversion import ConversionError, convert

    write_k3_folder(tmp_path / "k3")
    with pytest.raises(ConversionError, match="no Kimi Linear layout"):
        convert(tmp_path / "k3", tmp_path / "out", target="kimi_linear", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_kimi_linear_model_is_not_written_as_k3(tmp_path):
    from kda_hybrid.conversion import ConversionError, convert

    tiny_model("mla", True).save_pretrained(tmp_path / "kl")
    with pytest.raises(ConversionError, match="no K3 feature is on"):
        convert(tmp_path / "kl", tmp_path / "out", target="kimi_k3", progress=False)
    assert not (tmp_path / "out").exists()


def test_k3_to_ours_and_back_is_byte_identical(tmp_path):
    """K3 folder -> kda_hybrid -> `--to kimi_k3`: every text tensor comes back under its released name with its
    dtype and bytes (A_log padded again with zeros, convs and o_norm fp32, MXFP4 uint8); the vision side was
    skipped on the way in, and the text_config reads back as the same model."""
    from kda_hybrid.conversion import convert
    from kda_hybrid.conversion.__main__ import main as cli_main

    root, _ = write_k3_folder(tmp_path / "k3")
    ours = convert(tmp_path / "k3", tmp_path / "ours", progress=False, max_shard_size="30KB")
    assert cli_main([str(ours), str(tmp_path / "back"), "--to", "kimi_k3", "--max-shard-size", "20KB",
                     "--no-progress"]) == 0
    want = {n: t for n, t in read_folder(tmp_path / "k3").items() if n.startswith("language_model.")}
    assert_bit_exact(read_folder(tmp_path / "back"), want)
    assert len(list((tmp_path / "back").glob("*.safetensors"))) > 1  # streamed into several shards
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == "kimi_k3" and "vision_config" not in back
    assert back["text_config"]["quantization_config"] == root["text_config"]["quantization_config"]
    fields = FIELDS  # the architecture: every field of ours
    again, first = KDAHybridConfig(**back).to_dict(), KDAHybridConfig(**root).to_dict()
    assert {k: again.get(k) for k in fields} == {k: first.get(k) for k in fields}
    # and the written folder converts again, equal to the first conversion
    twice = convert(tmp_path / "back", tmp_path / "twice", progress=False)
    first_sd, twice_sd = read_folder(ours), read_folder(twice)
    assert sorted(first_sd) == sorted(twice_sd)
    assert all(torch.equal(first_sd[n], twice_sd[n]) for n in first_sd)


def test_a_bf16_k3_model_written_as_k3_stores_the_released_dtypes(tmp_path):
    from kda_hybrid.conversion import convert

    config = KDAHybridConfig.kimi_k3(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, linear_num_heads=2,
                                     linear_head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32,
                                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64)
    model = KDAHybridForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "ours")
    convert(tmp_path / "ours", tmp_path / "k3", target="kimi_k3", progress=False)
    got = read_folder(tmp_path / "k3")
    sd = model.state_dict()
    assert sorted(got) == sorted("language_model." + n for n in sd)
    for name, t in sd.items():
        stored = got["language_model." + name]
        if name.endswith(".A_log"):
            assert stored.shape == (16,) and stored.dtype == torch.float32
            assert torch.equal(stored[:2], t.reshape(-1)) and not stored[2:].any()
        elif name.endswith(("_conv1d.weight", ".self_attn.o_norm.weight")):
            assert stored.dtype == torch.float32 and torch.equal(stored, t.float()), name
        else:
            assert stored.dtype == t.dtype and torch.equal(stored, t), name
    assert "quantization_config" not in json.loads((tmp_path / "k3" / "config.json").read_text())["text_config"]


def test_the_released_2_8t_layout_converts_as_meta_tensors():
    """The whole released text inventory (497,052 tensors, 1.3 TiB of experts) through the converter's plan and
    rules as meta tensors: every name and shape maps, A_log loses its padding, MXFP4 stays uint8; no data, so the
    conversion's memory is what it holds per tensor, never the model."""
    from kda_hybrid.conversion import convert_state_dict, kimi_inventory

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "u8": torch.uint8}
    with gzip.open(FIXTURES / "kimi_k3_text_tensors.tsv.gz", "rt") as f:
        tensors = {name: torch.empty(json.loads(shape), dtype=dtypes[dtype], device="meta")
                   for name, shape, dtype in (line.rstrip("\n").split("\t") for line in f)}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.empty(1024, 3, 14, 14, device="meta")
    out = convert_state_dict(tensors, K3_CONFIG, source="kimi_k3")
    inventory = kimi_inventory(K3_CONFIG)
    assert list(out) == list(inventory)
    assert all(tuple(out[n].shape) == spec.shape for n, spec in inventory.items())
    assert all((out[n].dtype == torch.uint8) == spec.quantized for n, spec in inventory.items())
    assert out["model.layers.0.self_attn.A_log"].shape == (1, 1, 96, 1)


def test_the_model_card_names_the_k3_features_and_only_for_k3():
    from kda_hybrid.checkpoint_kda_hybrid import model_card

    k3 = model_card(KDAHybridConfig(**K3_CONFIG))
    for phrase in ("Kimi K3 architecture", "decay -5 * sigmoid (bounded)", "full-rank output gate",
                   "sigmoid output gate", "SiTU-GLU (beta 4, linear beta 25)", "latent width 3584 (normed)",
                   "MXFP4 experts", "Block Attention Residuals, blocks of 12 layers"):
        assert phrase in k3, phrase
    kimi = model_card(KDAHybridConfig(**tiny_kimi_config()))
    assert "Kimi Linear architecture" in kimi and "SwiGLU" in kimi
    for phrase in ("K3", "SiTU", "Block Attention", "output gate", "bounded", "MXFP4"):
        assert phrase not in kimi, phrase


# --------------------------------------------------------------------------------------------------
# Independent oracle for the gate; every generate mode on K3
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_a_log", [True, False])
def test_the_bounded_gate_equals_fla_naive_lowerbound_gate(with_a_log):
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    from kda_hybrid.kda_torch import kda_gate

    gen = torch.Generator().manual_seed(3)
    g = torch.randn(2, 7, 3, 16, generator=gen) * 4
    a_log = torch.rand(3, generator=gen) * 2.7 if with_a_log else None
    dt_bias = torch.randn(3 * 16, generator=gen) * 0.5
    want = naive_kda_lowerbound_gate(g, a_log, dt_bias, lower_bound=-5.0)
    got = kda_gate(g, a_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (got > -5).all() and (got < 0).all()


def _greedy(model, ids, n, **kw):
    from .helpers import generate_with_logits

    return generate_with_logits(model, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


def test_k3_assisted_and_prompt_lookup_decoding_equal_greedy():
    from .helpers import assert_same_generation

    model = k3_model()
    draft = k3_model(seed=5)
    base = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([base, base[:, :5], base], 1)  # repeats give prompt lookup real candidates
    plain = _greedy(model, ids, 12)
    assert_same_generation(_greedy(model, ids, 12, assistant_model=draft), plain, msg="assisted")
    assert_same_generation(_greedy(model, ids, 12, assistant_model=model), plain, msg="self-assisted")
    assert_same_generation(_greedy(model, ids, 12, prompt_lookup_num_tokens=3), plain, msg="prompt lookup")


def test_k3_beam_search_with_cache_equals_without():
    from .helpers import assert_same_generation

    model = k3_model()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(num_beams=3, num_return_sequences=2)
    assert_same_generation(_greedy(model, ids, 6, **kw), _greedy(model, ids, 6, use_cache=False, **kw))


def test_k3_unmerged_lora_trains_and_merges_to_the_same_model():
    peft = pytest.importorskip("peft")
    model = k3_model().train()
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base = model.eval()(input_ids=ids).logits
    model.train()
    # KDA and MLA projections and K3's own gates, the latent MoE's down-projection and an AttnRes read
    targets = ["q_proj", "g_proj", "o_proj", "routed_expert_down_proj", "self_attention_res_proj"]
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      init_lora_weights=False))
    wrapped = {n.rsplit(".", 1)[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(targets)
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    loss = lora(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1).step()
    assert any(not torch.equal(p, before[n]) for n, p in lora.named_parameters() if p.requires_grad)
    lora.eval()
    with torch.no_grad():
        unmerged = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)
    assert (unmerged - base).abs().max() > 1e-2  # the adapters change the model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_k3_memory_report_is_the_config_formula_kda_fixed_mla_linear(dtype):
    """The cache's memory report of a K3 model (read off the tensors it holds) equals cache_bytes(config), the
    formula behind the README's K3 figures: the KDA state (fp32 S, conv tails in the model's dtype) does not grow,
    the MLA latent grows by kv_per_token per token."""
    from kda_hybrid.checkpoint_kda_hybrid import cache_bytes

    model = k3_model(dtype=dtype)
    want = cache_bytes(model.config, dtype)
    reports = []
    for T in (5, 17):
        ids = torch.randint(1, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            reports.append(model(ids, use_cache=True).past_key_values.memory_report())
    a, b = reports
    assert a["kda_state_bytes"] == b["kda_state_bytes"] == want["kda_state"] > 0
    assert a["kv_bytes_per_token_per_sequence"] == b["kv_bytes_per_token_per_sequence"] == want["kv_per_token"] > 0
    assert b["attention_kv_bytes"] - a["attention_kv_bytes"] == 12 * want["kv_per_token"]


def test_k3_cache_offload_and_prefetch_give_the_same_next_step():
    from kda_hybrid import KDAHybridCache

    model = k3_model()
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(9))
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
        want = model(ids[:, -1:], cache=copy.deepcopy(cache)).logits
        for i in range(len(cache)):
            cache.offload(i)
        for i in range(len(cache)):
            cache.prefetch(i)
        assert torch.equal(model(ids[:, -1:], cache=cache).logits, want)


def test_the_trainer_trains_a_k3_model_on_packed_documents(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(10)
    docs = [{"input_ids": torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()}
            for n in torch.randint(5, 20, (12,), generator=gen)]
    model = k3_model().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=DataCollatorWithFlattening())
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    for part in ("g_proj", "self_attention_res_proj", "mlp_res_proj", "routed_expert_down_proj"):
        assert any(part in k for k in changed), part


@pytest.mark.slow  # inductor compiles the forward and backward graphs of a K3 model: about a minute on CPU
def test_k3_compiled_forward_and_training_step_match_eager():
    """torch.compile(model) on a tiny K3 (bounded gate, full-rank gates, SiTU, latent MoE, AttnRes): forward logits,
    loss and the gradients of one step equal eager within fp32 rounding of fused kernels (as the Kimi Linear test in
    test_ecosystem.py bounds them)."""
    torch._dynamo.reset()
    eager = k3_model().train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(11)
    ids, labels = torch.randint(3, VOCAB, (2, 40), generator=gen), torch.randint(3, VOCAB, (2, 40), generator=gen)
    results = []
    for m, fwd in ((eager, eager), (model, compiled)):
        out = fwd(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(),
                        {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    torch._dynamo.reset()
    (logits0, loss0, grads0), (logits1, loss1, grads1) = results
    torch.testing.assert_close(logits1, logits0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert grads0.keys() == grads1.keys() and any("self_attention_res_proj" in n for n in grads0)
    # relative to each gradient's scale: elementwise 1e-6 absolute fails on embedding rows of 1e-5 that inductor sums
    # in another order (the worst tensor measured 2.5e-5 of its scale); a wrong backward is off by far more
    for name in grads0:
        assert_close_rel(grads1[name], grads0[name], rel=1e-4, name=name)


def test_the_reference_passes_its_own_self_checks():
    """tests/k3_reference.py's checks of itself (causality, batch independence, MXFP4 codes and rounding, A_log
    forms, AttnRes bookkeeping at K3's 93 layers, formula spot checks), which otherwise ran only as a script."""
    threads = torch.get_num_threads()  # the script pins one thread; the session's count is conftest's
    try:
        ref.self_check()
    finally:
        torch.set_num_threads(threads)
