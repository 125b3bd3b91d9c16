"""Build a training corpus for examples/train.py: the Python standard library's own sources (every machine with
Python has them), a byte-level BPE tokenizer trained on it, and the token streams.
With --pydoc, the documentation text Python ships too (pydoc_data.topics), held out by the same rule. With
--chats, chat documents (examples/smollm2/chat_distill_data.py: a training-split passage as the user turn, the teacher's
reply as the assistant turn; examples/smollm2/teacher_corpus.py: the teacher's replies, and conversations whose
earlier turns come in "history") join the training split through the tokenizer's chat template.

    python examples/prepare_data.py --out data/stdlib                       # stdlib corpus + a new tokenizer
    python examples/prepare_data.py --source my_repo --glob "**/*.py" \\
        --tokenizer checkpoints/kda-hybrid-stdlib --out data/my_repo      # fine-tuning data, existing tokenizer

Deterministic: files are read in sorted order, the validation split is fixed by a hash of each file's relative
path (so adding or removing one file moves no other), and the tokenizer is trained on the training files only.

Output folder: `train.bin` / `val.bin` (uint16 token ids; every document is <|bos|> text <|eos|>, so document
boundaries are the <|bos|> tokens), `meta.json` (counts, split, Python version) and the tokenizer
(`tokenizer.json` + `tokenizer_config.json`, loadable with `AutoTokenizer.from_pretrained`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np

from kda_hybrid.train.corpus import (
    PYDOC_TOPICS,
    VAL_PERCENT,
    corpus_files,
    is_validation,
    pydoc_documents,
    read_text,
    stdlib_root,
)
from kda_hybrid.train.data import bpe_tokenizer

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]  # ids 0, 1, 2: the ids of kda_hybrid.bench.shapes' configs
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
def train_tokenizer(texts: list[str], vocab_size: int):
    """bpe_tokenizer with <|pad|> <|bos|> <|eos|> at ids 0-2; encode() prepends <|bos|>, as the training documents
    start with it."""
    from transformers import PreTrainedTokenizerFast

    tok = bpe_tokenizer(texts, vocab_size, SPECIAL_TOKENS, "<|bos|>")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", model_max_length=1 << 20)


def encode_documents(tokenizer, texts: list[str], document_token: int | None = None) -> np.ndarray:
    """<|bos|> text <|eos|> per document (the tokenizer adds <|bos|>), concatenated; uint16 ids. With
    `document_token` (a pretrained model's separator, e.g. SmolLM2's <|endoftext|>): that token text that token,
    no other special token added."""
    if len(tokenizer) > np.iinfo(np.uint16).max:
        raise ValueError(f"vocab of {len(tokenizer)} does not fit the uint16 token files")
    if document_token is not None:
        ids = tokenizer(texts, add_special_tokens=False).input_ids
        return np.fromiter((t for doc in ids for t in (document_token, *doc, document_token)), dtype=np.uint16)
    ids = tokenizer(texts, add_special_tokens=True).input_ids
    eos = tokenizer.eos_token_id
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.uint16)


CHAT_SHUFFLE_SEED = 0  # the order of the training documents when chats join them


def json_lines(path: Path, what: str):
    """(line number, object) for each non-empty line of a JSON lines file; ValueError naming the line of one that is
    not a JSON object, and the file when it holds none (`what`: "chats", "texts")."""
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        records.append((n, record if isinstance(record, dict) else None))
    if not records:
        raise ValueError(f"{path}: no {what}")
    return records


def _history(record: dict) -> list[dict] | None:
    """A chat's earlier turns (teacher_corpus.py's conversations), or None unless they are {"role", "content"}
    messages, user then assistant, in pairs, each a non-empty string."""
    history = record.get("history", [])
    if not isinstance(history, list) or len(history) % 2:
        return None
    for k, m in enumerate(history):
        if not (isinstance(m, dict) and m.keys() == {"role", "content"} and m["role"] == ("user", "assistant")[k % 2]
                and isinstance(m["content"], str) and m["content"].strip()):
            return None
    return history


def read_chats(path: Path) -> list[tuple[list[dict], bool]]:
    """The chats of a JSON lines file ({"user": ..., "assistant": ..., optional "complete": false when the reply was
    cut short, optional "history": the earlier turns of a conversation, [{"role": "user", "content": ...},
    {"role": "assistant", ...}, ...]} per line) as (messages, complete); ValueError naming the line of anything
    else."""
    chats = []
    for n, record in json_lines(path, "chats"):
        if not (record is not None and all(isinstance(record.get(k), str) and record[k].strip()
                                           for k in ("user", "assistant"))):
            raise ValueError(f"{path}:{n}: expected an object with non-empty strings 'user' and 'assistant'")
        if not isinstance(record.get("complete", True), bool):
            raise ValueError(f"{path}:{n}: 'complete' must be true or false, got {record['complete']!r}")
        history = _history(record)
        if history is None:
            raise ValueError(f"{path}:{n}: 'history' must be a list of user and assistant turns in pairs, "
                             "{\"role\": ..., \"content\": a non-empty string} each, user first")
        messages = history + [{"role": "user", "content": record["user"]},
                              {"role": "assistant", "content": record["assistant"]}]
        chats.append((messages, record.get("complete", True)))
    return chats


def read_texts(path: Path) -> list[str]:
    """The documents of a JSON lines file of {"text": ...} or {"seed": ..., "text": ...} (teacher_corpus.py's
    continuations: the seed, a space, the teacher's continuation as stored, stripped); ValueError naming the line of
    anything else."""
    texts = []
    for n, record in json_lines(path, "texts"):
        if not (record is not None and isinstance(record.get("text"), str) and record["text"].strip()
                and isinstance(record.get("seed", ""), str)):
            raise ValueError(f"{path}:{n}: expected an object with a non-empty string 'text' (and an optional "
                             "string 'seed')")
        texts.append(f"{record['seed']} {record['text']}" if record.get("seed") else record["text"])
    return texts


def render_chat(tokenizer, messages: list[dict], complete: bool) -> str:
    """The chat through the tokenizer's template; a reply cut short ends without its end-of-turn (the template's
    prompt for the assistant turn, then the reply), so no document teaches a turn to end where the teacher's did
    not."""
    if complete:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) + \
        messages[-1]["content"]


def prepare(out: Path, source: Path | None = None, pattern: str = "**/*.py", tokenizer_path: str | None = None,
            vocab_size: int = 2048, max_files: int | None = None, pydoc: bool = False,
            document_token: str | None = None, chats: Path | list[Path] | None = None,
            chat_repeat: int | list[int] = 1, texts: Path | None = None) -> dict:
    chat_files = [chats] if isinstance(chats, Path) else list(chats or [])
    repeats = [chat_repeat] if isinstance(chat_repeat, int) else list(chat_repeat)
    if len(repeats) == 1:  # one count for every file
        repeats *= max(1, len(chat_files))
    if len(repeats) != max(1, len(chat_files)) or min(repeats) < 1:
        raise ValueError(f"--chat-repeat takes one count >= 1, or one per --chats file, got {chat_repeat}")
    if chat_files and not tokenizer_path:
        raise ValueError("--chats needs --tokenizer (a checkpoint whose tokenizer has a chat template)")
    per_file = [read_chats(f) for f in chat_files]  # every file checked before anything is written
    chat_messages = [chat for chats_of_file in per_file for chat in chats_of_file]
    chat_repeats = [r for chats_of_file, r in zip(per_file, repeats) for _ in chats_of_file]
    extra_texts = read_texts(texts) if texts is not None else []
    root = source or stdlib_root()
    files = corpus_files(root, pattern)[:max_files]
    splits: dict[str, list[str]] = {"train": [], "val": []}
    names: dict[str, list[str]] = {"train": [], "val": []}
    documents = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        if pydoc and rel == PYDOC_TOPICS:  # prose in a dict literal: read as the topics' text instead
            continue
        documents.append((rel, read_text(f)))
    if pydoc:
        documents += pydoc_documents()
    for rel, text in documents:
        if not text or not text.strip():
            continue
        split = "val" if is_validation(rel) else "train"
        splits[split].append(text)
        names[split].append(rel)
    if not splits["train"] or not splits["val"]:
        raise ValueError(f"{root}: need files in both splits, got {len(splits['train'])} train / "
                         f"{len(splits['val'])} validation (pattern {pattern!r})")
    if tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=True)
    else:
        tokenizer = train_tokenizer(splits["train"], vocab_size)
    if chat_messages or extra_texts:
        if chat_messages and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chats: the tokenizer of {tokenizer_path} has no chat template")
        rendered = [render_chat(tokenizer, messages, complete) for messages, complete in chat_messages]
        train = list(zip(splits["train"], names["train"])) + [
            (text, f"chat:{i}") for r in range(max(repeats)) for i, text in enumerate(rendered)
            if r < chat_repeats[i]] + [
            (text, f"text:{i}") for i, text in enumerate(extra_texts)]
        # chats and texts spread over the rows instead of filling the last ones (an epoch's row order is a permutation)
        order = np.random.default_rng(CHAT_SHUFFLE_SEED).permutation(len(train))
        splits["train"] = [train[i][0] for i in order]
        names["train"] = [train[i][1] for i in order]
    doc_id = None
    if document_token is not None:
        doc_id = tokenizer.convert_tokens_to_ids(document_token)
        if doc_id is None or tokenizer.convert_ids_to_tokens(doc_id) != document_token:
            raise ValueError(f"--document-token {document_token!r} is not a token of the tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    meta = {
        "source": "python-stdlib" if source is None else str(root), "pattern": pattern,
        "python": platform.python_version(), "vocab_size": len(tokenizer),
        # the token every document starts with: the training loop restarts positions there
        "bos_token_id": tokenizer.bos_token_id if doc_id is None else doc_id,
        "eos_token_id": tokenizer.eos_token_id if doc_id is None else doc_id,
        "pad_token_id": tokenizer.pad_token_id, "val_percent": VAL_PERCENT, "pydoc": pydoc,
    }
    parts = {"train": splits["train"], "val": splits["val"]}
    if pydoc:  # held-out code and held-out prose apart, for the distillation report
        prose = [n.startswith("pydoc_data/topics/") for n in names["val"]]
        parts["val_code"] = [t for t, p in zip(splits["val"], prose) if not p]
        parts["val_prose"] = [t for t, p in zip(splits["val"], prose) if p]
    for split, docs in parts.items():
        tokens = encode_documents(tokenizer, docs, doc_id)
        tokens.tofile(out / f"{split}.bin")
        meta[split] = {"files": len(docs), "bytes": sum(len(t.encode()) for t in docs), "tokens": int(tokens.size),
                       "sha1": hashlib.sha1(tokens.tobytes()).hexdigest()}
    meta["val"]["names"] = names["val"]
    if chat_messages:
        meta["train"]["chats"] = {"files": [{"file": str(f), "sha1": hashlib.sha1(f.read_bytes()).hexdigest(),
                                             "count": len(c), "repeat": r}
                                            for f, c, r in zip(chat_files, per_file, repeats)],
                                  "count": len(chat_messages)}
    if extra_texts:
        meta["train"]["texts"] = {"file": str(texts), "sha1": hashlib.sha1(texts.read_bytes()).hexdigest(),
                                  "count": len(extra_texts)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--source", type=Path, help="folder of text files (default: this Python's standard library)")
    p.add_argument("--glob", default="**/*.py", help="files under --source to read, in sorted order")
    p.add_argument("--tokenizer", help="use this tokenizer (a checkpoint folder) instead of training one")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary when training a tokenizer")
    p.add_argument("--max-files", type=int, help="only the first N files (quick experiments, tests)")
    p.add_argument("--pydoc", action="store_true",
                   help="add the documentation text Python ships (pydoc_data.topics) as prose documents, and write "
                        "val_code.bin / val_prose.bin beside val.bin")
    p.add_argument("--document-token", help="start and end every document with this token of the tokenizer "
                                            "(e.g. '<|endoftext|>' for SmolLM2) instead of its bos / eos")
    p.add_argument("--chats", type=Path, nargs="+", help="JSON lines of {\"user\", \"assistant\"} chats, and "
                   "of conversations with their earlier turns in \"history\" (examples/smollm2/chat_distill_data.py, "
                   "examples/smollm2/teacher_corpus.py), to add to the training split through the tokenizer's chat "
                   "template, one file or several, in this order; the training documents are then shuffled")
    p.add_argument("--chat-repeat", type=int, nargs="+", default=[1],
                   help="each chat joins the training split this many times: one count for every --chats file, or "
                        "one per file")
    p.add_argument("--texts", type=Path, help="JSON lines of {\"text\"} or {\"seed\", \"text\"} documents "
                                              "(teacher_corpus.py's continuations) to add to the training split")
    args = p.parse_args(argv)
    try:
        meta = prepare(args.out, args.source, args.glob, args.tokenizer, args.vocab_size, args.max_files,
                       args.pydoc, args.document_token, args.chats, args.chat_repeat, args.texts)
    except ValueError as e:  # bad input: one line, before anything is written
        p.error(str(e))
    for split in [k for k in ("train", "val", "val_code", "val_prose") if k in meta]:
        m = meta[split]
        print(f"{split}: {m['files']} files, {m['bytes'] / 1e6:.2f} MB, {m['tokens']:,} tokens "
              f"({m['bytes'] / m['tokens']:.2f} bytes/token)", file=sys.stderr)


if __name__ == "__main__":
    main()
