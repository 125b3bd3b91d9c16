"""Hand-off to llama.cpp: `python -m kda_hybrid.conversion SRC out.gguf --to gguf`.

The fast tests read the written file back with the gguf package (keys, tensor table, values, tokenizer) and check
that what llama.cpp's graph cannot express is refused with nothing written. The slow tests run the file in
llama.cpp itself (`llama_cpp`, built from the PyPI sdist by scripts/install_llama_cpp.sh; skipped without it) as an
independent implementation: tokenisation, logits with f32 weights and an f32 KV cache, cached decode, greedy
generation.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kda_hybrid.conversion import ConversionError, convert
from kda_hybrid.conversion.__main__ import main as cli_main
from kda_hybrid.mxfp4_torch import dequantize_mxfp4

from ._native import save_checkpoint
from ._tokenizer import tiny_tokenizer
from .helpers import k3_model, k3_mxfp4_model, k3_text_config, random_state_dict, tiny_kimi_config, tiny_model

gguf = pytest.importorskip("gguf", reason="--to gguf needs the gguf package (the [gguf] / [test] extra)")

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "kda-hybrid-stdlib"
K3_SHIPPED = SHIPPED.with_name("kda-k3-stdlib")
TEXT = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
        "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
# llama.cpp's kimi-linear graph needs KDA heads == MLA heads; the tiny Kimi config has 3 KDA heads beside 2
MOE = tiny_kimi_config(vocab_size=384, linear_attn_config={"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4],
                                                           "head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4})


# llama.cpp reads one epsilon, rms_norm_eps, for every norm of the Kimi graphs, KDA's q/k L2 norm and the MLA latent
# norms included, where the reference uses 1e-6 for those two; a model with rms_norm_eps = 1e-6 has one epsilon
# everywhere, so a comparison on it measures everything else. (Trained models barely notice: their q/k and latents
# are far larger than the epsilons; random ones do: benchmarks/llama_cpp_differences.py measures both cases.)
ONE_EPS = dict(vocab_size=384, rms_norm_eps=1e-6)
# two layers (KDA, then MLA with the MoE): llama.cpp's MXFP4 matmuls round activations to 8 bits, a noise that
# six random layers amplify (13% of the logit scale) and two layers far less (1.6%;
# benchmarks/llama_cpp_differences.py)
TWO_LAYERS = dict(num_hidden_layers=2, attn_res_block_size=None,
                  linear_attn_config=dict(k3_text_config()["linear_attn_config"], kda_layers=[1], full_attn_layers=[2]))


def _saved(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _fields(path: Path) -> tuple[dict, dict]:
    """(metadata key -> python value, tensor name -> ReaderTensor) of a GGUF file."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def _array(t) -> np.ndarray:
    """A ReaderTensor's data in numpy's (reversed-ne) shape, as float32."""
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:  # the reader gives the raw bytes
        bits = np.ascontiguousarray(t.data).view(np.uint16)
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(t.data, dtype=np.float32)


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    """A tiny Kimi Linear MoE checkpoint (Moonshot's layout) with a real tokenizer and a chat template."""
    folder = save_checkpoint(tmp_path_factory.mktemp("moe") / "kimi", random_state_dict(MOE), MOE)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def shipped_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "stdlib.gguf"
    convert(SHIPPED, out, target="gguf", dtype="float32", progress=False)
    return out


def test_the_shipped_checkpoint_becomes_a_kimi_linear_gguf(shipped_gguf):
    """Keys llama.cpp's loader requires (the router's gating function even for a dense model), one tensor per
    llama.cpp tensor with the values transformed as its graph reads them, and the tokenizer by id."""
    from safetensors.torch import load_file

    config = json.loads((SHIPPED / "config.json").read_text())
    kv, tensors = _fields(shipped_gguf)
    arch = "kimi-linear"
    assert kv["general.architecture"] == arch
    L, full = config["num_hidden_layers"], {i for i, t in enumerate(config["layer_types"]) if t == "full_attention"}
    assert kv[f"{arch}.attention.head_count_kv"] == [1 if i in full else 0 for i in range(L)]
    assert kv[f"{arch}.expert_gating_func"] == 2 and kv[f"{arch}.leading_dense_block_count"] == L
    assert kv[f"{arch}.kda.head_dim"] == config["linear_head_dim"]
    assert kv[f"{arch}.attention.key_length"] == config["kv_lora_rank"] + config["qk_rope_head_dim"]
    weights = load_file(SHIPPED / "model.safetensors")
    # every tensor accounted for: kv_b splits in two, nothing else is added or dropped
    assert len(tensors) == len(weights) + len(full)
    np.testing.assert_array_equal(_array(tensors["blk.0.ssm_a"]),
                                  -torch.exp(weights["model.layers.0.self_attn.A_log"].float()).numpy())
    conv = weights["model.layers.0.self_attn.q_conv1d.weight"].float()
    np.testing.assert_array_equal(_array(tensors["blk.0.ssm_conv1d_q.weight"]).reshape(conv.shape[0], -1),
                                  conv.reshape(conv.shape[0], -1).numpy())
    a = min(full)
    H, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    kv_b = weights[f"model.layers.{a}.self_attn.kv_b_proj.weight"].float().view(H, nope + v, -1)
    np.testing.assert_array_equal(_array(tensors[f"blk.{a}.attn_k_b.weight"]), kv_b[:, :nope].transpose(1, 2).numpy())
    np.testing.assert_array_equal(_array(tensors[f"blk.{a}.attn_v_b.weight"]), kv_b[:, nope:].numpy())
    np.testing.assert_array_equal(_array(tensors["output.weight"]), weights["lm_head.weight"].float().numpy())
    assert {t.tensor_type for t in tensors.values()} == {gguf.GGMLQuantizationType.F32}
    vocab = json.loads((SHIPPED / "tokenizer.json").read_text())
    by_id = {i: t for t, i in vocab["model"]["vocab"].items()} | {a["id"]: a["content"] for a in vocab["added_tokens"]}
    assert kv["tokenizer.ggml.tokens"] == [by_id[i] for i in range(config["vocab_size"])]
    assert kv["tokenizer.ggml.pre"] == "gpt-2" and kv["tokenizer.ggml.model"] == "gpt2"
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_eos_token"] is False


def test_a_moe_model_stacks_experts_and_keeps_its_chat_template(moe_src, tmp_path):
    out = convert(moe_src, tmp_path / "moe.gguf", target="gguf", dtype="bfloat16", progress=False,
                  router_weights_from_biased_scores=False)
    kv, tensors = _fields(out)
    weights = random_state_dict(MOE)
    assert kv["tokenizer.chat_template"] == tiny_tokenizer().chat_template
    assert kv["kimi-linear.expert_count"] == 4 and kv["kimi-linear.expert_weights_norm"] is True
    assert kv["kimi-linear.leading_dense_block_count"] == 1 and kv["kimi-linear.expert_shared_count"] == 1
    stacked = torch.stack([weights[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"] for e in range(4)])
    np.testing.assert_array_equal(_array(tensors["blk.1.ffn_down_exps.weight"]),
                                  stacked.to(torch.bfloat16).float().numpy())
    assert tensors["blk.1.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.BF16
    for name in ("blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight", "blk.0.ssm_conv1d_k.weight", "blk.0.ssm_a",
                 "blk.0.ssm_dt.bias", "blk.0.attn_norm.weight"):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32, name
    np.testing.assert_array_equal(_array(tensors["blk.1.exp_probs_b.bias"]),
                                  weights["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].numpy())


def test_tied_embeddings_write_the_output_matrix(tmp_path):
    cfg = {**MOE, "tie_word_embeddings": True}
    src = save_checkpoint(tmp_path / "tied", {k: v for k, v in random_state_dict(cfg).items() if k != "lm_head.weight"},
                          cfg)
    tiny_tokenizer().save_pretrained(src)
    _, tensors = _fields(convert(src, tmp_path / "tied.gguf", target="gguf", progress=False,
                                 router_weights_from_biased_scores=False))
    np.testing.assert_array_equal(_array(tensors["output.weight"]), _array(tensors["token_embd.weight"]))


def test_k3_models_become_kimi_k3_ggufs(tmp_path):
    """K3's switches as llama.cpp's kimi-k3 graph reads them: SiTU betas, AttnRes block size, decay bound and the
    latent width as keys; each residual query as one fused vector; A_log as a plain [H] vector; g_proj as the KDA
    gate or the MLA output gate by layer; MXFP4 experts as ggml MXFP4 blocks that decode to our weights exactly."""
    from gguf.quants import dequantize

    model = k3_mxfp4_model(**ONE_EPS)
    src = _saved(model, tmp_path / "k3")
    kv, tensors = _fields(convert(src, tmp_path / "k3.gguf", target="gguf", progress=False))
    c, arch = model.config, "kimi-k3"
    assert kv["general.architecture"] == arch
    assert (kv[f"{arch}.activation.situ_beta"], kv[f"{arch}.activation.situ_linear_beta"]) == (
        c.activation_situ_beta, c.activation_situ_linear_beta)
    assert kv[f"{arch}.attn_res.block_size"] == c.attn_res_block_size == 2
    assert kv[f"{arch}.kda.gate_lower_bound"] == c.gate_lower_bound
    assert kv[f"{arch}.expert_latent_length"] == c.routed_expert_hidden_size
    assert kv[f"{arch}.attention.value_length"] == c.kv_lora_rank
    sd = model.state_dict()
    np.testing.assert_array_equal(_array(tensors["blk.0.attn_res_score.weight"]),
                                  (sd["model.layers.0.self_attention_res_norm.weight"]
                                   * sd["model.layers.0.self_attention_res_proj.weight"].reshape(-1)).numpy())
    np.testing.assert_array_equal(_array(tensors["output_res_score.weight"]),
                                  (sd["model.output_attn_res_norm.weight"]
                                   * sd["model.output_attn_res_proj.weight"].reshape(-1)).numpy())
    np.testing.assert_array_equal(_array(tensors["blk.0.ssm_a"]),
                                  -torch.exp(sd["model.layers.0.self_attn.A_log"]).reshape(-1).numpy())
    assert "blk.0.ssm_g.weight" in tensors and "blk.3.attn_gate.weight" in tensors
    assert "blk.3.ssm_g.weight" not in tensors and "blk.0.attn_gate.weight" not in tensors
    for b in range(c.first_k_dense_replace, c.num_hidden_layers):
        for w, proj in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            t = tensors[f"blk.{b}.ffn_{proj}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
            want = torch.stack([dequantize_mxfp4(sd[f"model.layers.{b}.block_sparse_moe.experts.{e}.{w}.weight_packed"],
                                                 sd[f"model.layers.{b}.block_sparse_moe.experts.{e}.{w}.weight_scale"])
                                for e in range(c.num_experts)])
            np.testing.assert_array_equal(dequantize(np.asarray(t.data), t.tensor_type), want.numpy())
    assert {f"blk.{b}.ffn_routed_{x}.weight" for x in ("down", "up", "norm")} <= tensors.keys()


def test_k3_switches_llama_cpp_cannot_run_alone_are_refused(tmp_path):
    """llama.cpp runs K3 switches only as the whole kimi-k3 graph: SiTU MLPs and the full-rank gate are not optional
    there."""
    src = _saved(tiny_model("mla", vocab_size=384, num_attention_heads=2, gate_lower_bound=-5.0), tmp_path / "partial")
    _refused(tmp_path, src, tmp_path / "p.gguf", r"(?s)kimi-k3 graph.*hidden_act='silu'.*use_full_rank_gate=False")


def _refused(tmp_path, src, dst, match, **kw):
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConversionError, match=match):
        convert(src, dst, target="gguf", progress=False, **{"router_weights_from_biased_scores": False, **kw})
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "something was written"


def test_what_llama_cpp_cannot_run_is_refused_before_anything_is_written(tmp_path):
    gqa = tmp_path / "gqa"
    model = tiny_model("gqa")
    model.save_pretrained(gqa)
    tiny_tokenizer().save_pretrained(gqa)
    _refused(tmp_path, gqa, tmp_path / "gqa.gguf", r"MLA full-attention layers without RoPE only, not GQA")
    heads = save_checkpoint(tmp_path / "heads", random_state_dict(tiny_kimi_config()), tiny_kimi_config())
    tiny_tokenizer().save_pretrained(heads)
    _refused(tmp_path, heads, tmp_path / "heads.gguf", r"KDA heads \(3\) differ from MLA heads \(2\)")
    cfg = {**MOE, "moe_renormalize": False}
    unnormed = save_checkpoint(tmp_path / "unnormed", random_state_dict(cfg), cfg)
    tiny_tokenizer().save_pretrained(unnormed)
    # Moonshot's layout defaults to routing weights from the biased scores: both problems named at once
    _refused(tmp_path, unnormed, tmp_path / "u.gguf", r"(?s)norm_topk_prob=False.*router_weights_from_biased_scores",
             router_weights_from_biased_scores=None)


def test_bad_destinations_and_tokenizers_are_refused_before_anything_is_written(tmp_path, moe_src, capsys):
    _refused(tmp_path, moe_src, tmp_path / "out", r"one file; give a path ending in \.gguf")
    (tmp_path / "notes.gguf").write_text("mine")
    _refused(tmp_path, moe_src, tmp_path / "notes.gguf", r"already exists")
    _refused(tmp_path, moe_src, tmp_path / "notes.gguf", r"not a \.gguf file", overwrite=True)
    (tmp_path / "dir.gguf").mkdir()
    _refused(tmp_path, moe_src, tmp_path / "dir.gguf", r"not a regular file", overwrite=True)
    digits = tmp_path / "digits"
    shutil.copytree(moe_src, digits)
    tok = json.loads((digits / "tokenizer.json").read_text())
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                  tok["pre_tokenizer"]]}
    (digits / "tokenizer.json").write_text(json.dumps(tok))
    _refused(tmp_path, digits, tmp_path / "digits.gguf", r"no llama.cpp pre-tokenizer is known to split text")
    assert cli_main([str(moe_src), str(tmp_path / "cli.gguf"), "--to", "gguf", "--no-progress",
                     "--unbiased-router"]) == 0
    old = (tmp_path / "cli.gguf").read_bytes()
    assert cli_main([str(moe_src), str(tmp_path / "cli.gguf"), "--to", "gguf", "--no-progress", "--unbiased-router",
                     "--dtype", "bfloat16", "--overwrite"]) == 0
    assert (tmp_path / "cli.gguf").read_bytes() != old and not [p for p in tmp_path.iterdir() if "kdaconv" in p.name]


# ---------------------------------------------------------------------------------------------------------
# llama.cpp itself
# ---------------------------------------------------------------------------------------------------------
def _llama(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's Python binding is not installed; "
                                                        "scripts/install_llama_cpp.sh builds it (25-60 minutes)")
    f32 = 0  # GGML_TYPE_F32: an f32 KV cache, so that only the arithmetic differs
    return llama_cpp.Llama(str(path), n_ctx=512, logits_all=True, n_threads=1, n_batch=512, type_k=f32, type_v=f32,
                           verbose=False)


def _ours(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _assert_logits_close(theirs: np.ndarray, ours: np.ndarray, rel: float, what: str):
    err = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    assert err < rel, f"{what}: llama.cpp's logits differ from ours by {err:.2e} of their scale"
    assert (theirs.argmax(-1) == ours.argmax(-1)).all(), what


@pytest.mark.slow
@pytest.mark.parametrize("folder", [SHIPPED, K3_SHIPPED], ids=["kimi-linear", "k3"])
def test_llama_cpp_runs_the_shipped_checkpoints_with_our_logits(folder, tmp_path):
    """f32 weights, f32 KV cache: llama.cpp tokenises as we do, its prompt logits and its cached decode (one token
    at a time after the prompt) equal ours within 1e-4 of their scale, and greedy generations are the same."""
    llm = _llama(convert(folder, tmp_path / "model.gguf", target="gguf", dtype="float32", progress=False))
    model, tok = _ours(folder)
    ids = tok(TEXT).input_ids
    assert llm.tokenize(TEXT.encode(), add_bos=True) == ids
    llm.eval(ids[:20])
    for t in ids[20:]:  # decode through llama.cpp's recurrent state and latent KV cache
        llm.eval([t])
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    _assert_logits_close(np.array(llm.scores[: len(ids)]), ours, 1e-4, "prompt + cached decode")
    llm.reset()
    generated = [t for _, t in zip(range(32), llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0))]
    with torch.no_grad():
        # plain greedy on both sides (the checkpoints' generation_config adds a repetition penalty)
        want = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, repetition_penalty=1.0,
                              min_new_tokens=32)[0, len(ids):].tolist()
    assert generated == want


@pytest.mark.slow
def test_llama_cpp_runs_a_moe_model_with_our_logits(moe_src, tmp_path):
    """The routed experts, shared expert and router bias of a tiny MoE (weights from unbiased scores, as llama.cpp
    routes), and its chat template as llama.cpp reads it."""
    out = convert(moe_src, tmp_path / "moe.gguf", target="gguf", dtype="float32", progress=False,
                  router_weights_from_biased_scores=False)
    ours_dir = convert(moe_src, tmp_path / "ours", progress=False, router_weights_from_biased_scores=False)
    llm = _llama(out)
    model, tok = _ours(ours_dir)
    assert llm.metadata["tokenizer.chat_template"] == tiny_tokenizer().chat_template
    ids = tok(TEXT).input_ids
    assert llm.tokenize(TEXT.encode(), add_bos=True) == ids
    llm.eval(ids)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    _assert_logits_close(np.array(llm.scores[: len(ids)]), ours, 1e-4, "MoE prompt")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-experts", "bf16-experts"])
def test_llama_cpp_runs_a_tiny_k3_moe_with_our_logits(tmp_path, dtype):
    """Latent MoE with its norm, two shared experts, AttnRes over 6 layers, SiTU, both gates; weights saved in
    `dtype`, written as f32 (a bf16 value is exact in f32), so the engines differ only in arithmetic."""
    model = k3_model(dtype=dtype, **ONE_EPS)
    src = _saved(model, tmp_path / "k3")
    llm = _llama(convert(src, tmp_path / "k3.gguf", target="gguf", dtype="float32", progress=False))
    ids = tiny_tokenizer()(TEXT).input_ids
    llm.eval(ids)
    with torch.no_grad():
        ours = model.float()(torch.tensor([ids])).logits[0].numpy()
    _assert_logits_close(np.array(llm.scores[: len(ids)]), ours, 1e-4, f"K3 MoE, {dtype} experts")


@pytest.mark.slow
def test_llama_cpp_runs_mxfp4_experts_to_our_greedy_tokens(tmp_path):
    """MXFP4 experts: llama.cpp's weights decode to ours exactly (test_k3_models_become_kimi_k3_ggufs), but its CPU
    matmuls round the activations to 8 bits, so logits are compared loosely and greedy tokens exactly."""
    model = k3_mxfp4_model(**ONE_EPS, **TWO_LAYERS)
    src = _saved(model, tmp_path / "k3")
    llm = _llama(convert(src, tmp_path / "k3.gguf", target="gguf", dtype="float32", progress=False))
    ids = tiny_tokenizer()(TEXT).input_ids
    generated = [t for _, t in zip(range(16), llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0))]
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.0,
                              min_new_tokens=16)[0, len(ids):].tolist()
    assert generated == want


def test_a_dense_kimi_linear_export_carries_the_router_keys_readers_require(tmp_path):
    """llama.cpp's converter and loader read the router's function, scaling and renormalisation for every Kimi
    Linear model (their absence made llama.cpp refuse a dense export: 'key not found: expert_gating_func'), and the
    MoE sizes; a dense model has them with no num_experts, so every other reader still sees dense layers."""
    out = convert(SHIPPED, tmp_path / "kimi", target="kimi_linear", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["moe_router_activation_func"] == "sigmoid" and config["moe_renormalize"] is True
    assert config["first_k_dense_replace"] == config["num_hidden_layers"] and "num_experts" not in config
    for key in ("routed_scaling_factor", "num_shared_experts", "moe_intermediate_size", "num_experts_per_token",
                "num_expert_group", "topk_group", "use_grouped_topk", "moe_layer_freq"):
        assert key in config, key
    back = convert(out, tmp_path / "ours", progress=False)  # and it reads back as the same dense model
    assert json.loads((back / "config.json").read_text())["num_experts"] is None


@pytest.mark.parametrize("stage", ["tensors", "file"])
def test_a_failed_or_interrupted_gguf_write_leaves_nothing(tmp_path, moe_src, monkeypatch, stage):
    """A failure while streaming the tensors or while writing the file (a full disk, Ctrl-C) leaves neither a
    .gguf nor its staging folder, and an existing output untouched."""
    from kda_hybrid.conversion import to_gguf

    dst = tmp_path / "out" / "moe.gguf"
    convert(moe_src, dst, target="gguf", progress=False, router_weights_from_biased_scores=False)
    before = dst.read_bytes()

    def broken(self, *args, **kwargs):
        raise KeyboardInterrupt if stage == "file" else OSError(28, "No space left on device")

    monkeypatch.setattr(to_gguf.GGUFSink, "close" if stage == "file" else "add", broken)
    with pytest.raises(KeyboardInterrupt if stage == "file" else ConversionError,
                       match=None if stage == "file" else "no space left on the device while writing"):
        convert(moe_src, dst, target="gguf", progress=False, overwrite=True, dtype="bfloat16",
                router_weights_from_biased_scores=False)
    assert dst.read_bytes() == before and sorted(p.name for p in dst.parent.iterdir()) == ["moe.gguf"]
