"""KDAHybridConfig: every field validated at construction (a ValueError/TypeError naming the field, what it must
be and what it was), the Kimi-Linear reader (original and transformers-native names) and writer, and the
converter reporting config errors through the same parser. Property tests: random invalid configs fail at
construction, random valid ones construct and survive save/load and the Kimi-Linear round trip."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.config_rules_kda_hybrid import MAX_LINEAR_HEAD_DIM
from kda_hybrid.configuration_kda_hybrid import KDAHybridConfig

# Small valid configs, the base every invalid case changes one field of.
MLA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, linear_num_heads=2,
           linear_head_dim=8, num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, pad_token_id=0)
GQA = dict(MLA, attention_type="gqa", num_key_value_heads=1, head_dim=16)


def kimi(**overrides):
    """A complete original Kimi-Linear config.json (the keys a Hub config carries)."""
    cfg = {
        "model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8,
        "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 8, "num_heads": 2,
                               "short_conv_kernel_size": 4},
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 16,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def lac(**overrides):
    return {**kimi()["linear_attn_config"], **overrides}


# (id, kwargs, the field the message must name, a piece of what it expected, a piece of what it got)
BAD = [
    ("rope-theta-zero", dict(GQA, rope_theta=0.0), "rope_theta", "> 0", "0.0"),
    ("rope-theta-negative", dict(GQA, rope_theta=-1e4), "rope_theta", "> 0", "-10000.0"),
    ("rope-theta-nan", dict(GQA, rope_theta=math.nan), "rope_theta", "finite", "nan"),
    ("rope-theta-mla-nan", dict(MLA, rope_theta=math.nan), "rope_theta", "finite", "nan"),
    ("routed-scaling-nan", dict(MLA, routed_scaling_factor=math.nan), "routed_scaling_factor", "finite", "nan"),
    ("routed-scaling-str", dict(MLA, routed_scaling_factor="2.4"), "routed_scaling_factor", "number", "'2.4'"),
    ("routed-scaling-bool", dict(MLA, routed_scaling_factor=True), "routed_scaling_factor", "number", "True"),
    ("init-range-negative", dict(MLA, initializer_range=-0.02), "initializer_range", ">= 0", "-0.02"),
    ("init-range-inf", dict(MLA, initializer_range=math.inf), "initializer_range", "finite", "inf"),
    ("rms-eps-nan", dict(MLA, rms_norm_eps=math.nan), "rms_norm_eps", "positive", "nan"),
    ("dropout-one", dict(MLA, attention_dropout=1.0), "attention_dropout", "[0, 1)", "1.0"),
    ("pad-at-vocab", dict(MLA, pad_token_id=64), "pad_token_id", "0..63", "64"),
    ("pad-negative", dict(MLA, pad_token_id=-1), "pad_token_id", "0..63", "-1"),
    ("pad-float", dict(MLA, pad_token_id=0.0), "pad_token_id", "token id", "0.0"),
    ("eos-list-outside", dict(MLA, eos_token_id=[2, 99]), "eos_token_id", "0..63", "[2, 99]"),
    ("bos-outside", dict(MLA, bos_token_id=64), "bos_token_id", "0..63", "64"),
    ("head-dim-beyond-triton", dict(MLA, linear_head_dim=MAX_LINEAR_HEAD_DIM + 8), "linear_head_dim",
     f"<= {MAX_LINEAR_HEAD_DIM}", str(MAX_LINEAR_HEAD_DIM + 8)),
    ("bool-as-int", dict(MLA, hidden_size=True), "hidden_size", "positive int", "True"),
    ("max-positions-zero", dict(MLA, max_position_embeddings=0), "max_position_embeddings", "positive int", "0"),
    ("use-cache-str", dict(MLA, use_cache="yes"), "use_cache", "True or False", "'yes'"),
    ("norm-topk-int", dict(MLA, norm_topk_prob=1), "norm_topk_prob", "True or False", "1"),
    ("tie-none", dict(MLA, tie_word_embeddings=None), "tie_word_embeddings", "True or False", "None"),
    ("mla-rope", dict(MLA, mla_use_nope=False), "mla_use_nope", "RoPE MLA is not implemented", "False"),
    ("kimi-nope-absent", {k: v for k, v in kimi().items() if k != "mla_use_nope"}, "mla_use_nope",
     "default when the key is absent", "False"),
    ("kimi-layer-in-both", kimi(linear_attn_config=lac(kda_layers=[1, 2, 3, 4])), "linear_attn_config",
     "each layer once", "layer 4 (1-based) in both"),
    ("kimi-no-head-dim", kimi(linear_attn_config={k: v for k, v in lac().items() if k != "head_dim"}),
     "linear_attn_config", "head_dim, num_heads", "without ['head_dim']"),
    ("kimi-no-num-heads", kimi(linear_attn_config={k: v for k, v in lac().items() if k != "num_heads"}),
     "linear_attn_config", "no defaults", "without ['num_heads']"),
    ("kimi-head-dim-beyond-triton", kimi(linear_attn_config=lac(head_dim=512)), "linear_head_dim", "<= 256", "512"),
    ("kimi-incomplete", {k: v for k, v in kimi().items() if k not in ("kv_lora_rank", "v_head_dim")},
     "Kimi-Linear config", "decide tensor shapes", "no kv_lora_rank, v_head_dim"),
    ("kimi-layer-types-disagree", kimi(layer_types=["full_attention"] * 4), "layer_types",
     "what linear_attn_config says", "full_attention"),
    ("kimi-mtp", kimi(num_nextn_predict_layers=1), "num_nextn_predict_layers", "not implemented", "1"),
    ("native-mlp-types", dict(MLA, mlp_layer_types=["dense", "sparse", "dense", "sparse"]), "mlp_layer_types",
     "followed only by 'sparse'", "'dense'"),
    ("gqa-field-in-mla", dict(MLA, head_dim=-4), "head_dim", "positive int", "-4"),
    ("mla-field-in-gqa", dict(GQA, kv_lora_rank=math.nan), "kv_lora_rank", "positive int", "nan"),
    ("moe-field-in-dense", dict(MLA, num_experts=None, moe_intermediate_size=0), "moe_intermediate_size",
     "positive int", "0"),
    ("alias-conflict", dict(MLA, num_experts_per_token=3), "num_experts_per_tok", "equal to num_experts_per_token",
     "2"),
]


@pytest.mark.parametrize("kwargs,field,expected,got", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_value_is_refused_naming_field_expected_and_got(kwargs, field, expected, got):
    with pytest.raises(ValueError) as err:
        KDAHybridConfig(**kwargs)
    message = str(err.value)
    assert message.startswith("KDAHybridConfig: ") and field in message, message
    assert expected in message and got in message, message


def test_limit_is_the_triton_kernels_limit():
    kda_triton_fwd = pytest.importorskip("kda_hybrid.kda_triton_fwd", reason="needs triton to read its MAX_HEAD_DIM")
    assert MAX_LINEAR_HEAD_DIM == kda_triton_fwd.MAX_HEAD_DIM
    KDAHybridConfig(**dict(MLA, linear_head_dim=MAX_LINEAR_HEAD_DIM))  # the limit itself is fine


def test_kimi_reader_and_writer():
    cfg = KDAHybridConfig(**kimi())
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size) == (2, 8, 4)
    assert (cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.norm_topk_prob) == (2, 1, True)
    assert cfg.num_experts_per_token == 2 and cfg.num_shared_experts == 1  # Kimi names read as attributes
    back = cfg.to_kimi_linear_dict()
    for key, value in kimi().items():
        assert back[key] == value, key
    assert KDAHybridConfig(**{k: v for k, v in back.items() if k != "architectures"}).to_dict() == cfg.to_dict()
    # An original config's absent keys mean what Moonshot's code makes of them, not our defaults.
    sparse = KDAHybridConfig(**{k: v for k, v in kimi().items()
                                if k not in ("first_k_dense_replace", "num_shared_experts", "rms_norm_eps")})
    assert (sparse.first_k_dense_replace, sparse.n_shared_experts, sparse.rms_norm_eps) == (0, 0, 1e-6)
    # transformers-native names
    without = {k: v for k, v in MLA.items() if k != "num_experts"}
    native = KDAHybridConfig(**without, num_local_experts=4, linear_conv_kernel_dim=3,
                             mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    assert (native.num_experts, native.linear_conv_kernel_size, native.first_k_dense_replace) == (4, 3, 2)
    with pytest.raises(ValueError, match="gqa"):
        KDAHybridConfig(**GQA).to_kimi_linear_dict()
    with pytest.raises(ValueError, match="attention_bias=True has no Kimi-Linear equivalent"):
        KDAHybridConfig(**dict(MLA, attention_bias=True)).to_kimi_linear_dict()


def test_converter_reports_config_errors_through_the_same_parser(tmp_path):
    from kda_hybrid.conversion import ConversionError, convert, kimi_inventory

    from ._native import save_checkpoint

    bad = kimi(routed_scaling_factor=math.nan)
    with pytest.raises(ValueError) as direct:
        KDAHybridConfig(**bad)
    with pytest.raises(ConversionError) as via_inventory:
        kimi_inventory(bad)
    assert str(via_inventory.value) == f"config.json: {direct.value}"
    import torch

    src = save_checkpoint(tmp_path / "src", {"model.norm.weight": torch.ones(32)}, bad)
    with pytest.raises(ConversionError) as via_convert:
        convert(src, tmp_path / "out", progress=False)
    assert str(via_convert.value) == f"config.json: {direct.value}"
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    native = {**kimi(), "layer_types": ["linear_attention"] * 3 + ["full_attention"],
              "linear_attn_config": lac(head_dim=1024)}
    with pytest.raises(ConversionError, match="linear_head_dim must be <= 256"):
        convert(save_checkpoint(tmp_path / "native", {}, native), tmp_path / "out", source="transformers",
                progress=False)


# ---------------------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------------------
def _not_positive_int():
    return st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.text(max_size=2))


def _not_finite_positive():
    return st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf), st.booleans(),
                     st.text(max_size=3), st.lists(st.integers(), max_size=1))


INVALID = {
    "vocab_size": _not_positive_int(), "hidden_size": _not_positive_int(), "intermediate_size": _not_positive_int(),
    "num_hidden_layers": _not_positive_int(), "linear_num_heads": _not_positive_int(),
    "linear_head_dim": st.one_of(_not_positive_int(), st.integers(min_value=MAX_LINEAR_HEAD_DIM + 1)),
    "linear_conv_kernel_size": _not_positive_int(), "num_attention_heads": _not_positive_int(),
    "kv_lora_rank": _not_positive_int(), "qk_nope_head_dim": _not_positive_int(), "v_head_dim": _not_positive_int(),
    "qk_rope_head_dim": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans()),
    "q_lora_rank": _not_positive_int(), "num_experts_per_tok": st.one_of(_not_positive_int(),
                                                                          st.integers(min_value=5)),
    "moe_intermediate_size": _not_positive_int(), "max_position_embeddings": _not_positive_int(),
    "n_shared_experts": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans()),
    "first_k_dense_replace": st.one_of(st.integers(max_value=-1), st.floats(), st.booleans()),
    "rope_theta": _not_finite_positive(), "routed_scaling_factor": _not_finite_positive(),
    "rms_norm_eps": _not_finite_positive(),
    "initializer_range": st.one_of(st.floats(max_value=-1e-9), st.just(math.nan), st.just(math.inf), st.text()),
    "attention_dropout": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0), st.just(math.nan)),
    "pad_token_id": st.one_of(st.integers(min_value=64), st.integers(max_value=-1), st.floats(), st.booleans()),
    "bos_token_id": st.one_of(st.integers(min_value=64), st.integers(max_value=-1), st.text(max_size=2)),
    "use_cache": st.one_of(st.integers(), st.none(), st.text(max_size=2)),
    "norm_topk_prob": st.one_of(st.integers(), st.none(), st.floats()),
    "router_weights_from_biased_scores": st.one_of(st.integers(), st.none()),
    "attention_type": st.text(max_size=4).filter(lambda t: t not in ("mla", "gqa")),
    "hidden_act": st.sampled_from(["gelu", "relu", "", "SiLU"]),
    "layer_types": st.one_of(st.lists(st.sampled_from(["linear_attention", "full_attention"]), max_size=3),
                             st.lists(st.sampled_from(["kda", "mla", "attention"]), min_size=4, max_size=4)),
    "mla_use_nope": st.one_of(st.just(False), st.integers(), st.none()),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_invalid_configs_fail_at_construction(data):
    field = data.draw(st.sampled_from(sorted(INVALID)), label="field")
    value = data.draw(INVALID[field], label="value")
    with pytest.raises((ValueError, TypeError)) as err:
        KDAHybridConfig(**dict(MLA, **{field: value}))
    assert field in str(err.value) or field.replace("_prob", "") in str(err.value), str(err.value)


@st.composite
def valid_kwargs(draw):
    n_layers = draw(st.integers(1, 6))
    attention = draw(st.sampled_from(["mla", "gqa"]))
    heads = draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    vocab = draw(st.integers(3, 500))
    moe = draw(st.booleans())
    experts = draw(st.integers(1, 8))
    kw = dict(
        vocab_size=vocab, hidden_size=draw(st.integers(1, 96)), intermediate_size=draw(st.integers(1, 96)),
        num_hidden_layers=n_layers,
        layer_types=draw(st.lists(st.sampled_from(["linear_attention", "full_attention"]), min_size=n_layers,
                                  max_size=n_layers)),
        linear_num_heads=draw(st.integers(1, 4)), linear_head_dim=draw(st.integers(1, MAX_LINEAR_HEAD_DIM)),
        linear_conv_kernel_size=draw(st.integers(1, 5)), attention_type=attention, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=2 * draw(st.integers(1, 16)),
        rope_theta=draw(st.floats(1e-3, 1e7)), q_lora_rank=draw(st.one_of(st.none(), st.integers(1, 16))),
        kv_lora_rank=draw(st.integers(1, 16)), qk_nope_head_dim=draw(st.integers(1, 16)),
        qk_rope_head_dim=draw(st.integers(0, 16)), v_head_dim=draw(st.integers(1, 16)),
        attention_bias=draw(st.booleans()), attention_dropout=draw(st.floats(0.0, 0.99)),
        num_experts=experts if moe else None, num_experts_per_tok=draw(st.integers(1, experts)),
        moe_intermediate_size=draw(st.integers(1, 32)), n_shared_experts=draw(st.integers(0, 2)),
        first_k_dense_replace=draw(st.integers(0, n_layers)), routed_scaling_factor=draw(st.floats(1e-3, 10.0)),
        norm_topk_prob=draw(st.booleans()), router_weights_from_biased_scores=draw(st.booleans()),
        rms_norm_eps=draw(st.floats(1e-12, 1e-2)), initializer_range=draw(st.floats(0.0, 1.0)),
        max_position_embeddings=draw(st.integers(1, 2**20)), tie_word_embeddings=draw(st.booleans()),
        use_cache=draw(st.booleans()), pad_token_id=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
        bos_token_id=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
        eos_token_id=draw(st.one_of(st.none(), st.integers(0, vocab - 1),
                                    st.lists(st.integers(0, vocab - 1), min_size=1, max_size=2))),
    )
    return kw


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_kwargs())
def test_random_valid_configs_construct_and_round_trip(tmp_path_factory, kw):
    cfg = KDAHybridConfig(**kw)
    for name, value in kw.items():
        assert getattr(cfg, name) == value, name
    folder = tmp_path_factory.mktemp("cfg")
    cfg.save_pretrained(folder)
    assert KDAHybridConfig.from_pretrained(folder).to_dict() == cfg.to_dict()
    if cfg.attention_type == "mla" and not cfg.attention_bias:
        written = {k: v for k, v in cfg.to_kimi_linear_dict().items() if k != "architectures"}
        back = KDAHybridConfig(**written, router_weights_from_biased_scores=cfg.router_weights_from_biased_scores)
        mla_fields = [k for k in kw if k not in ("attention_type", "num_key_value_heads", "head_dim", "rope_theta",
                                                 "attention_dropout", "attention_bias")]
        if cfg.num_experts is None:  # a dense model: Kimi's MoE fields are not written, ours keep defaults
            mla_fields = [k for k in mla_fields if k not in ("num_experts_per_tok", "moe_intermediate_size",
                                                              "n_shared_experts", "first_k_dense_replace",
                                                              "routed_scaling_factor", "norm_topk_prob")]
        for name in mla_fields:
            assert getattr(back, name) == getattr(cfg, name), name
        json.dumps(cfg.to_kimi_linear_dict())  # plain JSON


def _one_change(kwargs):
    """(base, name, value) when kwargs are MLA or GQA with one plain attribute changed, else None."""
    base = GQA if kwargs.get("attention_type") == "gqa" else MLA
    changed = [(k, v) for k, v in kwargs.items() if k not in base or base[k] != v or type(base[k]) is not type(v)]
    if set(kwargs) - set(base) - {k for k, _ in changed} or len(changed) != 1:
        return None
    name, value = changed[0]
    return (base, name, value) if name in vars(KDAHybridConfig(**base)) else None


# BAD cases that change one plain field of MLA or GQA: the same change made after construction
MUTABLE = [(b[0], *_one_change(b[1]), b[1]) for b in BAD if _one_change(b[1])]


def _assign_or_build(config, name, value, tmp_path):
    """(where, message) of the refusal of `config.name = value`: at the "assignment" when the field's own rule
    refuses it (the config keeps its value), else (a rule between fields, a non-field) at the "model"'s
    constructor, and the same again at save_pretrained, which writes nothing; both before any weight exists."""
    from kda_hybrid import KDAHybridForCausalLM
    from kda_hybrid.configuration_kda_hybrid import RULES

    before = repr(getattr(config, name, None))
    try:
        setattr(config, name, value)
    except ValueError as err:
        assert name in RULES, f"{name} has no rule of its own but its assignment was refused: {err}"
        assert repr(getattr(config, name, None)) == before
        return "assignment", str(err)
    with pytest.raises(ValueError) as at_model:
        KDAHybridForCausalLM(config)
    with pytest.raises(ValueError) as at_save:
        config.save_pretrained(tmp_path)
    assert str(at_save.value) == str(at_model.value)
    assert not (tmp_path / "config.json").exists()
    return "model", str(at_model.value)


@pytest.mark.parametrize("base,name,value,kwargs", [m[1:] for m in MUTABLE], ids=[m[0] for m in MUTABLE])
def test_a_field_changed_after_construction_is_refused_with_the_constructors_message(
        base, name, value, kwargs, tmp_path):
    """transformers' own common tests assign config fields after construction: a value its field refuses is refused
    on assignment, one that breaks a rule between fields by the model and save_pretrained, each with the
    constructor's message."""
    from kda_hybrid.configuration_kda_hybrid import RULES

    with pytest.raises(ValueError) as at_construction:
        KDAHybridConfig(**kwargs)
    config = KDAHybridConfig(**base)
    where = "assignment" if name in RULES else "model"
    assert _assign_or_build(config, name, value, tmp_path) == (where, str(at_construction.value))


@pytest.mark.parametrize("name,value,kwargs,on_assignment", [
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, GQA, False),
    ("rope_parameters", {"rope_type": "default"}, MLA, False),
    ("num_experts_per_tok", 9, MLA, False),
    ("layer_types", ["linear_attention", "linear_attention", "softmax", "full_attention"], MLA, False),
    ("hidden_act", "gelu", GQA, True),
], ids=["dynamic-rope", "rope-on-mla", "top-k-above-experts", "layer-type", "hidden-act"])
def test_the_issues_mutations_are_refused_as_at_construction(name, value, kwargs, on_assignment, tmp_path):
    with pytest.raises(ValueError) as at_construction:
        KDAHybridConfig(**{**kwargs, name: value})
    where = "assignment" if on_assignment else "model"
    assert _assign_or_build(KDAHybridConfig(**kwargs), name, value, tmp_path) == (where, str(at_construction.value))


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "default", "rope_theta": 5e5}])
def test_rope_parameters_assigned_after_construction_are_applied_as_if_given(rope):
    """A valid RoPE dict assigned later is standardised as the constructor does (rope_theta the dict's, or filled
    in): the model rotates exactly as one whose config was built with it (rotating with the old base, or plain
    RoPE, would be silently wrong)."""
    from kda_hybrid import KDAHybridForCausalLM

    config = KDAHybridConfig(**GQA)
    config.rope_parameters = dict(rope)
    late = KDAHybridForCausalLM(config).model.rotary_emb
    early = KDAHybridForCausalLM(KDAHybridConfig(**GQA, rope_parameters=dict(rope))).model.rotary_emb
    assert torch.equal(late.inv_freq, early.inv_freq) and late.attention_scaling == early.attention_scaling
    assert not torch.equal(late.inv_freq, KDAHybridForCausalLM(KDAHybridConfig(**GQA)).model.rotary_emb.inv_freq)


BAD_CONFIGS = [
    ("layer-types-length", dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3), "layer_types"),
    ("layer-types-name", dict(num_hidden_layers=2, layer_types=["linear_attention", "kda"]), "layer_types entries"),
    ("attention-type", dict(attention_type="mha"), "attention_type"),
    ("gqa-groups", dict(attention_type="gqa", num_attention_heads=6, num_key_value_heads=4), "multiple"),
    ("topk-gt-experts", dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    ("zero-heads", dict(linear_num_heads=0), "linear_num_heads"),
    ("float-hidden", dict(hidden_size=64.0), "hidden_size"),
    ("bad-act", dict(hidden_act="gelu"), "hidden_act"),
    ("kimi-softmax-router", dict(moe_router_activation_func="softmax"), "sigmoid"),
    ("kimi-layer-out-of-range",
     dict(num_hidden_layers=2, linear_attn_config={"kda_layers": [1], "full_attn_layers": [3]}), "1-based"),
    ("kimi-layer-missing", dict(num_hidden_layers=3, linear_attn_config={"kda_layers": [1], "full_attn_layers": [3]}),
     "neither"),
]


@pytest.mark.parametrize("name,kwargs,match", BAD_CONFIGS, ids=[b[0] for b in BAD_CONFIGS])
def test_bad_config_raises(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KDAHybridConfig(**kwargs)


def test_kimi_linear_config_keys_build_the_same_architecture():
    kimi = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024,
        "num_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "linear_attn_config": {"kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
                               "short_conv_kernel_size": 4},
    }
    cfg = KDAHybridConfig(**kimi)
    assert cfg.full_attention_layers == [3, 7, 11, 15, 19, 23, 26]
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.num_experts_per_tok, cfg.n_shared_experts) == (32, 128, 8, 1)
    assert cfg.attention_type == "mla" and cfg.is_moe_layer(1) and not cfg.is_moe_layer(0)
    back = cfg.to_kimi_linear_dict()
    for key, value in kimi.items():
        if key != "model_type":
            assert back[key] == value, key
    with torch.device("meta"):
        model = KDAHybridForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert abs(params / 1e9 - 49.1) < 0.1  # the checkpoint holds 49.1B parameters
