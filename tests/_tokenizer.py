"""A small real fast tokenizer for tests: byte-level BPE trained in memory on Python stdlib docstrings.

Byte-level, so any text round-trips; deterministic (same docstrings, same merges) for a given Python version.
Special tokens: <pad> = 0, <s> = 1, </s> = 2 (the ids tiny test configs use), and role markers for a chat template.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os.path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from kda_hybrid.train.data import bpe_tokenizer  # the builder of the shipped tokenizer too

VOCAB_SIZE = 384  # 256 byte symbols + 5 specials + ~120 merges: fast to train, still merges real words
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _corpus() -> list[str]:
    texts = []
    for module in (json, os.path, functools, itertools, collections):
        texts.append(module.__doc__ or "")
        for name in sorted(dir(module)):
            doc = getattr(getattr(module, name), "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return texts


@functools.lru_cache(maxsize=1)
def _trained_json() -> str:
    # plain encode() prepends <s>, as Llama-style tokenizers do; the chat template writes its own <s>
    tok = bpe_tokenizer(_corpus(), VOCAB_SIZE, SPECIAL_TOKENS, "<s>")
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS[:3]] == [PAD_ID, BOS_ID, EOS_ID]
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh `PreTrainedTokenizerFast` (vocab 384, bos/eos/pad, chat template); trained once per process."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_json()),
        bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
