"""Bring your own model: Llama / Mistral / Qwen2 / Qwen3 checkpoints built with transformers itself, converted into
KDA hybrids. All-attention conversions must compute what the source computes; KDA layers must start from the
source's projections and load anywhere with trust_remote_code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import repeat_kv

from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.conversion import ConversionError, convert
from kda_hybrid.conversion.__main__ import main as cli

from ._attention_sources import FAMILIES, VOCAB, ids, save_source
from .helpers import assert_same_generation, generate_with_logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_attention_conversion_computes_what_the_source_computes(tmp_path, family):
    source, folder = save_source(tmp_path, family)
    out = convert(folder, tmp_path / "hybrid", layer_types="A", progress=False)
    model = KDAHybridForCausalLM.from_pretrained(out).eval()
    assert model.config.layer_types == ["full_attention"] * 4
    x = ids()
    with torch.no_grad():
        want, got = source(x).logits, model(x).logits
        # fp32 through 4 layers of the same arithmetic in a different order: measured <= 2e-6 here
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert_same_generation(generate_with_logits(model, x, **greedy), generate_with_logits(source, x, **greedy),
                               rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer_config.json").is_file()  # side files carried over


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kda_layers_start_from_the_source_projections(tmp_path, family):
    source, folder = save_source(tmp_path, family)
    out = convert(folder, tmp_path / "hybrid", layer_types="kkkA", progress=False)
    model = KDAHybridForCausalLM.from_pretrained(out).eval()
    src = source.state_dict()
    groups = source.config.num_attention_heads // source.config.num_key_value_heads
    head_dim = model.config.head_dim
    for i in range(3):
        a, kda = f"model.layers.{i}.self_attn.", model.model.layers[i].self_attn
        assert torch.equal(kda.q_proj.weight, src[a + "q_proj.weight"])
        assert torch.equal(kda.o_proj.weight, src[a + "o_proj.weight"])
        for name in ("k_proj", "v_proj"):  # kv head j serves query heads j * groups ... (j + 1) * groups - 1
            w = getattr(kda, name).weight.unflatten(0, (-1, head_dim))
            kv = src[a + name + ".weight"].unflatten(0, (-1, head_dim))
            for h in range(w.shape[0]):
                assert torch.equal(w[h], kv[h // groups])
            if family == "qwen2":
                b = getattr(kda, name).bias.unflatten(0, (-1, head_dim))
                assert torch.equal(b[1], src[a + name + ".bias"].unflatten(0, (-1, head_dim))[1 // groups])
            # and as transformers' own repeat_kv expands the source's keys/values for its query heads
            x = torch.randn(2, 5, source.config.hidden_size)
            ref = getattr(source.model.layers[i].self_attn, name)(x).unflatten(-1, (-1, head_dim)).transpose(1, 2)
            got = getattr(kda, name)(x).unflatten(-1, (-1, head_dim)).transpose(1, 2)
            torch.testing.assert_close(got, repeat_kv(ref, groups), rtol=1e-6, atol=1e-6)
        # identity convolutions, data-independent decay, neutral gate: see from_attention.KDAInit
        assert torch.equal(kda.q_conv1d.weight[..., -1], torch.ones_like(kda.q_conv1d.weight[..., -1]))
        assert not kda.q_conv1d.weight[..., :-1].any() and not kda.f_b_proj.weight.any()
        assert not kda.b_proj.weight.any() and not kda.g_b_proj.weight.any()
    for name, t in src.items():  # everything else is the source's, bit for bit
        if not name.startswith(tuple(f"model.layers.{i}.self_attn." for i in range(3))):
            assert torch.equal(model.state_dict()[name], t), name
    with torch.no_grad():
        logits = model(ids()).logits
    assert torch.isfinite(logits).all()


def test_converted_hybrid_loads_and_generates_with_remote_code_in_a_fresh_process(tmp_path):
    _, folder = save_source(tmp_path, "llama")
    out = convert(folder, tmp_path / "hybrid", layer_types="kA", progress=False)
    script = (
        "import sys, torch\n"
        "sys.modules['kda_hybrid'] = None  # the package must not be needed: the folder carries its code\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "out = m.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=6, do_sample=False, pad_token_id=0)\n"
        "print('layers', ''.join('k' if t == 'linear_attention' else 'A' for t in m.config.layer_types), "
        "tuple(out.shape))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers kAkA (1, 10)" in proc.stdout


@pytest.mark.parametrize("case, over, layer_types, message", [
    ("sliding-window", dict(sliding_window=8), "A", "sliding-window attention"),
    ("short-pattern", {}, "kkA", "expected 4 letters"),
    ("bad-letter", {}, "kxkA", "a string of 'k' (KDA) and 'A'"),
    ("mlp-bias", dict(mlp_bias=True), "A", "mlp_bias"),
], ids=lambda x: x if isinstance(x, str) and len(x) < 20 else "")
def test_refusals_come_before_anything_is_written(tmp_path, case, over, layer_types, message):
    family = "mistral" if case == "sliding-window" else "llama"
    _, folder = save_source(tmp_path, family, **over)
    with pytest.raises(ConversionError, match=re.escape(message)):
        convert(folder, tmp_path / "hybrid", layer_types=layer_types, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [family]  # no output, no temporary folder


def test_layer_types_are_required_for_an_attention_source_and_refused_for_kimi(tmp_path, capsys):
    _, folder = save_source(tmp_path, "qwen2")
    assert cli([str(folder), str(tmp_path / "hybrid"), "--no-progress"]) == 1
    assert "pass layer_types (--layer-types)" in capsys.readouterr().err
    assert cli([str(folder), str(tmp_path / "hybrid"), "--layer-types", "kA", "--no-progress"]) == 0
    hybrid = tmp_path / "hybrid"
    assert cli([str(hybrid), str(tmp_path / "again"), "--layer-types", "kA", "--no-progress"]) == 1
    assert "applies to llama/mistral/qwen2/qwen3 sources" in capsys.readouterr().err


def test_all_attention_hybrid_exports_back_to_the_same_llama(tmp_path):
    from safetensors.torch import load_file

    from kda_hybrid.conversion.to_attention import export_llama

    source, folder = save_source(tmp_path, "llama")
    hybrid = convert(folder, tmp_path / "hybrid", layer_types="A", progress=False)
    back = export_llama(hybrid, tmp_path / "back")
    assert json.loads((back / "config.json").read_text())["model_type"] == "llama"
    original, exported = load_file(folder / "model.safetensors"), load_file(back / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n], original[n]) for n in original)
    with pytest.raises(ConversionError, match="every layer must be full attention"):
        export_llama(convert(folder, tmp_path / "kA", layer_types="kA", progress=False), tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


def test_fp32_tensors_stay_exact_through_dtype_casts(tmp_path):
    """model.to(bfloat16) keeps RoPE's inv_freq, A_log, dt_bias and the router's weight and bias fp32 and exact: a
    cast there and back would round them (RoPE angles at position 4096 off by up to 16 rad)."""
    from kda_hybrid import KDAHybridConfig

    config = KDAHybridConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                             linear_num_heads=2, linear_head_dim=16, attention_type="gqa", num_attention_heads=4,
                             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16})
    model = KDAHybridForCausalLM(config)
    names = ("inv_freq", "A_log", "dt_bias", "gate.weight", "e_score_correction_bias")
    exact = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()] if n.endswith(names)}
    assert {n.rsplit(".", 1)[-1] for n in exact} >= {"inv_freq", "A_log", "dt_bias", "e_score_correction_bias"}
    model.to(torch.bfloat16).half().to(torch.bfloat16)
    now = dict([*model.named_parameters(), *model.named_buffers()])
    for name, t in exact.items():
        assert now[name].dtype == torch.float32 and torch.equal(now[name], t), name
    assert model.lm_head.weight.dtype == torch.bfloat16  # the rest did cast
