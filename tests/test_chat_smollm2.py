"""examples/smollm2/chat_smollm2.py's conversations, on a tiny GGUF teacher and its KDA student: every turn goes on
from the model's cache, and what it generates is what the model says given the whole conversation from scratch."""

import warnings

import pytest
import torch

pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from kda_hybrid.conversion import convert  # noqa: E402

from ._gguf import write_tiny_gguf  # noqa: E402
from .helpers import load_script  # noqa: E402

load_script("examples/smollm2/smollm2.py", "smollm2")  # the chat script's sibling import
chat = load_script("examples/smollm2/chat_smollm2.py", "chat_smollm2_example")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(teacher, student, tokenizer): the tiny GGUF in transformers, and converted with two KDA layers of three."""
    root = tmp_path_factory.mktemp("chat")
    gguf = write_tiny_gguf(root / "tiny.gguf")
    convert(gguf, root / "student", layer_types="kkA", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        teacher = AutoModelForCausalLM.from_pretrained(root, gguf_file=gguf.name, dtype=torch.float32).eval()
        student = AutoModelForCausalLM.from_pretrained(root / "student", trust_remote_code=True,
                                                       dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(root, gguf_file=gguf.name)
    return teacher, student, tokenizer


@pytest.mark.parametrize("which", ["teacher", "student"])
def test_each_turn_goes_on_from_the_cache_as_the_whole_conversation_would(models, which):
    teacher, student, tokenizer = models
    model = teacher if which == "teacher" else student
    conversation = chat.Conversation(model, tokenizer)
    texts, replies, steps = ["hello there", "and then what?", "ok"], [], []
    for text in texts:
        before = None if conversation.ids is None else conversation.ids.clone()
        answer, n, _ = conversation.reply(text, max_new_tokens=6)
        assert 0 < n <= 6
        if before is not None:  # the tokens so far are kept as they were: only new ones were fed
            assert torch.equal(conversation.ids[:, :before.shape[1]], before)
        replies.append(answer)
        steps.append((conversation.ids.shape[1] - n, conversation.logits))
    # the tokens are the conversation in the chat template, each reply as generated (cut replies closed by EOS)
    shown = tokenizer.decode(conversation.ids[0])
    for text, answer in zip(texts, replies):
        assert f"user\n{text}" in shown and answer in shown
    assert shown.count(tokenizer.eos_token) >= 2 * len(texts) - 1  # the last reply is not closed yet
    # oracle: one forward over the whole conversation without a cache gives the logits each cached step saw
    with torch.no_grad():
        logits = model(conversation.ids, use_cache=False).logits[0]
    for start, seen in steps:
        torch.testing.assert_close(seen, logits[start - 1:start - 1 + len(seen)], atol=1e-4, rtol=1e-4)
        assert torch.equal(conversation.ids[0, start:start + len(seen)], seen.argmax(-1))  # greedy


def test_a_template_that_rewrites_earlier_turns_is_refused(models):
    teacher, _, tokenizer = models
    conversation = chat.Conversation(teacher, tokenizer)
    conversation.reply("hello", max_new_tokens=2)

    class Rewriting:  # a template that shows only the last user turn
        eos_token, eos_token_id = tokenizer.eos_token, tokenizer.eos_token_id

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            last = [m for m in messages if m["role"] == "user"][-1]
            return tokenizer.apply_chat_template([last], add_generation_prompt=add_generation_prompt, tokenize=False)

    conversation.tokenizer = Rewriting()
    with pytest.raises(ValueError, match="cannot go on from the cache"):
        conversation.next_input("again")


def test_turns_reads_lines_until_an_empty_one(monkeypatch):
    lines = iter(["first", "  second  ", "", "never"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert list(chat.turns(["given"], interactive=True)) == ["given", "first", "second"]
    assert list(chat.turns(["only"], interactive=False)) == ["only"]
