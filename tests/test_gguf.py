"""GGUF in: a tiny Llama written by this test as llama.cpp writes one (q/k rows permuted for its RoPE, Q8_0
embedding, Q4_1 projections, f32 norms, a byte-level BPE tokenizer and a chat template in the metadata), converted
with `python -m kda_hybrid.conversion FILE DST --layer-types ...`. Oracle: transformers' own GGUF loader
(`from_pretrained(folder, gguf_file=...)`); the all-attention conversion equals it bit for bit."""

import sys
import warnings

import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kda_hybrid.conversion import ConversionError, convert  # noqa: E402
from kda_hybrid.conversion.__main__ import main as cli  # noqa: E402

from ._gguf import CHAT_TEMPLATE, SPECIALS, write_tiny_gguf  # noqa: E402


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
