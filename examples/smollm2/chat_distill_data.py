"""Chat-formatted distillation documents that keep the data rule: a passage of the training split (stdlib code or a
pydoc_data topic) as the user turn, the teacher's own greedy reply as the assistant turn.

    python examples/smollm2/chat_distill_data.py --teacher out/smollm2/all-A \\
        --out out/data/smollm2-chat/chats.jsonl --count 400

Why (docs/records/smollm2/README.md): a student distilled on raw stdlib text learns that text and not the chat turn,
and answers chat prompts with newlines. These documents put the chat template around text the rule allows; nothing
else
enters, and the held-out files of prepare_data.py --pydoc stay out (passages come from the training split only,
chosen by the same path hash). Appends one JSON line per document (flushed), so a killed run continues where it
stopped; the order of passages is fixed by --seed.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import warnings
from pathlib import Path

import torch

from kda_hybrid.train.corpus import corpus_files, is_validation, pydoc_documents, read_text, stdlib_root

ASKS_CODE = ("Explain what this Python code does:", "What is this Python code for?",
             "Summarize this Python code in a few sentences:")
ASKS_PROSE = ("Summarize this passage from the Python documentation:", "Explain this in simple terms:",
              "What does this part of the Python documentation say?")


def passages(seed: int, max_chars: int) -> list[tuple[str, str]]:
    """(name, user message) for training-split passages: stdlib files cut at a blank line under max_chars, and
    pydoc topics' first paragraphs, shuffled by seed."""
    rng = random.Random(seed)
    out = []
    root = stdlib_root()
    for f in corpus_files(root):
        rel = f.relative_to(root).as_posix()
        text = read_text(f)
        if is_validation(rel) or not text or rel == "pydoc_data/topics.py":
            continue
        start = rng.randrange(max(1, len(text) - max_chars))
        cut = text[start:start + max_chars]
        cut = cut[cut.find("\n") + 1:] if start else cut
        cut = cut[:cut.rfind("\n\n")] if "\n\n" in cut else cut
        if len(cut.strip()) > 80:
            out.append((rel, f"{rng.choice(ASKS_CODE)}\n\n```python\n{cut.strip()}\n```"))
    for name, text in pydoc_documents():
        if is_validation(name):
            continue
        cut = text.strip()[:max_chars]
        cut = cut[:cut.rfind("\n\n")] if "\n\n" in cut else cut
        if len(cut) > 80:
            out.append((name, f"{rng.choice(ASKS_PROSE)}\n\n{cut}"))
    rng.shuffle(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="the teacher checkpoint (e.g. the all-A conversion)")
    p.add_argument("--out", type=Path, required=True, help="JSON lines file, appended to")
    p.add_argument("--count", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-chars", type=int, default=900, help="longest passage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(args.teacher, trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(args.teacher, trust_remote_code=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = args.out.read_text().count("\n") if args.out.exists() else 0
    todo = passages(args.seed, args.max_chars)[done:args.count]
    t0 = time.perf_counter()
    with args.out.open("a") as f:
        for i, (name, user) in enumerate(todo, start=done):
            ids = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     pad_token_id=tok.eos_token_id)
            new = out[0, ids.shape[1]:]
            reply = tok.decode(new, skip_special_tokens=True).strip()
            # False when the reply was cut at --max-new-tokens: its turn is then left open (prepare_data.py --chats)
            complete = bool((new == tok.eos_token_id).any())
            f.write(json.dumps({"source": name, "user": user, "assistant": reply, "complete": complete}) + "\n")
            f.flush()
            print(f"{i + 1}/{args.count} {name}: {len(reply)} chars [{time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
