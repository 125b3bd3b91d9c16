"""GGUF in: a tiny Llama written by this test as llama.cpp writes one (q/k rows permuted for its RoPE, Q8_0
embedding, Q4_1 projections, f32 norms, a byte-level BPE tokenizer and a chat template in the metadata), converted
with `python -m kda_hybrid.conversion FILE DST --layer-types ...`. Oracle: transformers' own GGUF loader
(`from_pretrained(folder, gguf_file=...)`); the all-attention conversion equals it bit for bit."""

import sys
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kda_hybrid.conversion import ConversionError, convert  # noqa: E402
from kda_hybrid.conversion.__main__ import main as cli  # noqa: E402

D, LAYERS, HEADS, KV_HEADS, FFN = 64, 3, 4, 2, 128  # rows of 64 / 128: whole Q4_1 and Q8_0 blocks of 32
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def _tokens_and_merges():
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    merges = [f"{space} t", "i n", f"{space} a", "e r", f"{space}t h", "d e", "de f"]
    merged = ["".join(m.split(" ")) for m in merges]
    return SPECIALS + alphabet + merged, merges


def _permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores q/k rows with each head's two rotary halves interleaved (its RoPE pairs
    neighbours); transformers' GGUF loader undoes this."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, tied=True, seed=0, arch="llama"):
    tokens, merges = _tokens_and_merges()
    V, hd = len(tokens), D // HEADS
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.1):
        return (torch.randn(*shape, generator=gen) * std).numpy()

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    Q8, Q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1

    def quantized(name, x, qtype):
        w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)

    quantized("token_embd.weight", rand(V, D), Q8)
    w.add_tensor("output_norm.weight", 1 + rand(D))
    if not tied:
        quantized("output.weight", rand(V, D), Q8)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + rand(D))
        w.add_tensor(p + "ffn_norm.weight", 1 + rand(D))
        q = _permute_for_gguf(torch.from_numpy(rand(HEADS * hd, D)), HEADS).numpy()
        k = _permute_for_gguf(torch.from_numpy(rand(KV_HEADS * hd, D)), KV_HEADS).numpy()
        quantized(p + "attn_q.weight", q, Q4)
        quantized(p + "attn_k.weight", k, Q4)
        quantized(p + "attn_v.weight", rand(KV_HEADS * hd, D), Q4)
        quantized(p + "attn_output.weight", rand(D, HEADS * hd), Q4)
        quantized(p + "ffn_gate.weight", rand(FFN, D), Q4)
        quantized(p + "ffn_up.weight", rand(FFN, D), Q4)
        quantized(p + "ffn_down.weight", rand(D, FFN), Q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(*args, dtype=torch.float32, **kw).eval()


def _tokenizer(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(*args, **kw)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf")


@pytest.fixture(scope="module")
def teacher(tiny_gguf):
    return _load(tiny_gguf.parent, gguf_file=tiny_gguf.name)


def _ids(teacher):
    return torch.randint(len(SPECIALS), teacher.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tied", [True, False])
def test_all_attention_conversion_of_a_gguf_equals_transformers_gguf_llama(tmp_path, tied):
    src = write_tiny_gguf(tmp_path / "m.gguf", tied=tied)
    teacher = _load(src.parent, gguf_file=src.name)
    assert type(teacher).__name__ == "LlamaForCausalLM" and teacher.config.tie_word_embeddings is tied
    assert cli([str(src), str(tmp_path / "out"), "--layer-types", "A", "--no-progress"]) == 0
    student = _load(tmp_path / "out", trust_remote_code=True)
    assert student.config.model_type == "kda_hybrid" and student.config.tie_word_embeddings is tied
    ids = _ids(teacher)
    with torch.no_grad():
        assert torch.equal(student(input_ids=ids).logits, teacher(input_ids=ids).logits)
    # the dequantised weights are real (Q4_1 rounding visible): not a float32 copy of something else
    q = student.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q, teacher.model.layers[0].self_attn.q_proj.weight)
    assert max(block.unique().numel() for block in q.detach().reshape(-1, 32)) <= 16  # 4-bit blocks of 32


def test_a_folder_holding_one_gguf_converts_with_its_tokenizer_and_chat_template(tmp_path, tiny_gguf, teacher):
    dst = tmp_path / "student"
    convert(tiny_gguf.parent, dst, layer_types="kkA", progress=False)
    student = _load(dst, trust_remote_code=True)
    assert student.config.layer_types == ["linear_attention", "linear_attention", "full_attention"]
    ours, theirs = _tokenizer(dst, trust_remote_code=True), _tokenizer(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "def the interpreter():\n  return 'tar'\n"
    assert ours(text).input_ids == theirs(text).input_ids and len(ours(text).input_ids) < len(text.encode())
    chat = [{"role": "user", "content": "the answer"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.chat_template == CHAT_TEMPLATE and ours.eos_token == "<|im_end|>"
    # the kept attention layer is the teacher's, copied
    assert torch.equal(student.model.layers[2].self_attn.q_proj.weight, teacher.model.layers[2].self_attn.q_proj.weight)
    out = student.generate(_ids(teacher)[:1], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 15)


def test_a_pattern_that_does_not_divide_the_depth_is_refused_before_the_gguf_is_read(tmp_path, tiny_gguf, capsys,
                                                                                       monkeypatch):
    convert_module = sys.modules["kda_hybrid.conversion.convert"]  # the package's `convert` is the function
    monkeypatch.setattr(convert_module, "gguf_source", lambda *a, **k: pytest.fail("tensors read before the check"))
    assert cli([str(tiny_gguf), str(tmp_path / "out"), "--layer-types", "kkkA", "--no-progress"]) == 1
    assert "expected 3 letters (the source has 3 layers) or a pattern whose length divides 3, got 4" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_gguf_inputs_are_one_clear_error_with_nothing_written(tmp_path, tiny_gguf, monkeypatch):
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ConversionError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\); pass the one"):
        convert(two, tmp_path / "out", layer_types="A", progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConversionError, match="not a GGUF file transformers can read"):
        convert(junk, tmp_path / "out", layer_types="A", progress=False)
    with pytest.raises(ConversionError, match="a GGUF file is read as what its metadata says"):
        convert(tiny_gguf, tmp_path / "out", source="kimi_linear", layer_types="A", progress=False)
    with pytest.raises(ConversionError, match="must not contain the source"):
        convert(tiny_gguf, tiny_gguf.parent.parent, layer_types="A", overwrite=True, progress=False)
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ConversionError, match="needs the gguf package: pip install gguf"):
        convert(tiny_gguf, tmp_path / "out", layer_types="A", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.gguf", "two"]
