"""Judge linearized students by what they generate, not only by perplexity (docs/records/smollm2/README.md).

    python examples/smollm2/smollm2_report.py --data out/data/smollm2 --model teacher=out/smollm2/all-A \\
        --model "kkA stage 2"=out/smollm2/distill-2-kkA/final ... --prompts examples/smollm2/chat_prompts.txt \\
        --json docs/records/smollm2/smollm2_metrics.json --transcripts docs/records/smollm2/smollm2_transcripts.md

For every model (the first --model is the teacher), on data none of them trained on (prepare_data.py --pydoc's
held-out split; with --heldout-chats, teacher_corpus.py's held-out prompts and replies):
- NLL per token on held-out prose (pydoc_data topics) and held-out code (stdlib files), each as a ratio to the
  teacher's; with --heldout-chats also on the teacher's sampled held-out replies (reply tokens only, the prompt
  through the chat template);
- greedy agreement with the teacher: per chat prompt (through the chat template; --prompts, or the distinct
  prompts of --heldout-chats), the fraction of the first --new-tokens generated tokens identical to the teacher's
  at the same position (a sequence that stopped counts as its pad token from then on), averaged over the prompts;
  the mean and the median length of the identical prefix (the first divergence);
- teacher-forced top-1 agreement: the teacher's greedy reply fed to the model after the prompt, the fraction of
  reply positions where the model's most likely token is the teacher's (pooled over prompts);
- the cache of one sequence at 32K tokens (kda_hybrid.checkpoint_kda_hybrid.cache_bytes), as a ratio to the
  teacher's;
- with --heldout-followups (the held-out chats of a teacher_corpus.py corpus of conversations,
  examples/smollm2/followup_prompts.txt): the same three measures on a later turn, after the earlier turns and the
  teacher's sampled replies to them (the conversation's "history"): NLL of the teacher's sampled replies to that
  turn, greedy agreement and teacher-forced top-1 on the teacher's greedy reply to it (one conversation per
  held-out prompt: its first sample that reached a later turn). Whether a model answers from the conversation or
  copies from it ("What is the capital of France?" >> "And of Italy?").
--transcripts writes the full replies of the teacher and of the --transcript-models to the first
--transcript-prompts prompts, side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, format_bytes
from kda_hybrid.train.data import IGNORE_INDEX, load_tokens, make_batch, missing_inputs, num_rows
from kda_hybrid.train.loop import trained_tokens

CONTEXT = 32768


def load(folder: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return model, tokenizer


@torch.no_grad()
def nll(model, tokens: np.ndarray, seq_len: int, bos_id: int, max_rows: int = 0) -> float:
    """Mean next-token NLL over every target of the token stream (rows of seq_len, documents packed, never seeing
    each other; a document's first token is no target)."""
    total, count = 0.0, 0
    rows = num_rows(tokens, seq_len)
    for row in range(min(rows, max_rows) if max_rows else rows):
        batch = make_batch(tokens, [row], seq_len, bos_id)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, :-1]
        labels = batch["labels"][0, 1:]
        keep = labels != IGNORE_INDEX
        total += float(torch.nn.functional.cross_entropy(logits[keep].float(), labels[keep], reduction="sum"))
        count += int(keep.sum())
    return total / count


def messages(prompt: str | list[dict]) -> list[dict]:
    """A prompt as chat messages: a user message, or a conversation ending with one (kept as it is)."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def chat_prompt(chat: dict) -> list[dict]:
    """A held-out chat's messages before its reply: its earlier turns ("history"), if any, and its user turn."""
    return chat.get("history", []) + [{"role": "user", "content": chat["user"]}]


@torch.no_grad()
def chat_nll(model, tokenizer, chats: list[dict]) -> float:
    """Mean NLL per reply token of held-out chats ({"user", "assistant", "complete"}, and "history" for a later turn
    of a conversation): the prompt (the earlier turns, then the user turn) through the chat template, then the reply
    as the template renders it (with its end of turn when the reply was complete)."""
    total, count = 0.0, 0
    for chat in chats:
        user = chat_prompt(chat)
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        if chat.get("complete", True):
            full = tokenizer.apply_chat_template(user + [{"role": "assistant", "content": chat["assistant"]}],
                                                 tokenize=False)
            if not full.startswith(prompt):
                raise SystemExit("the chat template renders a reply that does not extend its generation prompt")
            reply = full[len(prompt):]
        else:
            reply = chat["assistant"]
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p_ids + r_ids])
        logits = model(input_ids=ids).logits[0, len(p_ids) - 1:-1]
        total += float(torch.nn.functional.cross_entropy(logits.float(), ids[0, len(p_ids):], reduction="sum"))
        count += len(r_ids)
    return total / count


def read_chats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def followup_prompts(chats: list[dict]) -> list[list[dict]]:
    """One conversation per held-out prompt of a corpus of conversations: the earlier turns and the user turn of
    its first sample that reached a later turn (a sample whose first reply was cut short has no later turn)."""
    first: dict = {}
    for chat in sorted(chats, key=lambda c: (c["prompt"], c["sample"])):
        if chat.get("history"):
            first.setdefault(chat["prompt"], chat_prompt(chat))
    return list(first.values())


@torch.no_grad()
def forced_agreement(model, tokenizer, prompts: list, replies: list[list[int]], pad: int) -> float:
    """Teacher-forced top-1 agreement: each teacher reply (up to its end, pads dropped) after its prompt; the
    fraction of reply positions where the model's argmax is the teacher's token, pooled over the prompts."""
    same = total = 0
    for prompt, reply in zip(prompts, replies):
        reply = reply[:next((i for i, t in enumerate(reply) if t == pad), len(reply))]
        if not reply:
            continue
        p_ids = chat_ids(tokenizer, prompt)
        ids = torch.cat([p_ids, torch.tensor([reply])], 1)
        guess = model(input_ids=ids).logits[0, p_ids.shape[1] - 1:-1].argmax(-1)
        same += int((guess == torch.tensor(reply)).sum())
        total += len(reply)
    return same / total


def read_prompts(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def chat_ids(tokenizer, prompt: str | list[dict]) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages(prompt), add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


@torch.no_grad()
def greedy(model, tokenizer, prompts: list, new_tokens: int) -> list[list[int]]:
    """Exactly `new_tokens` ids per prompt: greedy, and after the end-of-turn token the pad id."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for prompt in prompts:
        ids = chat_ids(tokenizer, prompt)
        seq = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)[0, ids.shape[1]:]
        out.append(seq.tolist() + [pad] * (new_tokens - seq.numel()))
    return out


def agreement(ours: list[list[int]], teacher: list[list[int]]) -> tuple[float, float]:
    """(mean fraction of positions identical, mean length of the identical prefix)."""
    same, prefix = _agreement(ours, teacher)
    return float(np.mean(same)), float(np.mean(prefix))


def median_prefix(ours: list[list[int]], teacher: list[list[int]]) -> float:
    """The median length of the identical prefix: the median first divergence."""
    return float(np.median(_agreement(ours, teacher)[1]))


def _agreement(ours, teacher) -> tuple[list[float], list[int]]:
    same = [np.mean([a == b for a, b in zip(x, y)]) for x, y in zip(ours, teacher)]
    prefix = []
    for x, y in zip(ours, teacher):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return same, prefix


def judged(model, tokenizer, prompts: list, teacher_out: list[list[int]] | None, new_tokens: int) -> tuple[list, dict]:
    """The teacher's greedy replies (this model's when `teacher_out` is None: the model is the teacher) and this
    model's figures against them: greedy agreement, mean identical prefix, median first divergence, teacher-forced
    top-1."""
    generated = greedy(model, tokenizer, prompts, new_tokens)
    teacher_out = generated if teacher_out is None else teacher_out
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    same, prefix = agreement(generated, teacher_out)
    return teacher_out, {"agreement": same, "agreed_prefix": prefix,
                         "median_first_divergence": median_prefix(generated, teacher_out),
                         "forced_top1": forced_agreement(model, tokenizer, prompts, teacher_out, pad)}


FOLLOWUP_KEYS = {"agreement": "followup_agreement", "agreed_prefix": "followup_prefix",
                 "median_first_divergence": "followup_median_divergence", "forced_top1": "followup_top1"}
TEACHER_FIGURES = ("layer_types", "cache_32k_bytes")  # --keep: the same for the teacher of both runs, exactly
TEACHER_NLLS = ("nll_prose", "nll_code", "nll_chat", "nll_followup")  # ... and these within NLL_TOLERANCE (relative)
# The same teacher, data and code on two CPUs (AMD EPYC with and without AVX-512) gave NLLs 4e-6 apart, relative (the
# float sums of each CPU's kernels; the agreement figures were identical); another data split, teacher or code moves
# them by far more.
NLL_TOLERANCE = 1e-4


def check_teacher(stored: dict, measured: dict, teacher: str) -> None:
    """SystemExit unless the stored report's teacher is this run's, giving the same figures (--keep: what makes the
    rows comparable); called as soon as the teacher is measured, before the other models' minutes."""
    if next(iter(stored), None) != teacher:
        raise SystemExit(f"--keep: the stored report's teacher is {next(iter(stored), None)!r}, this run's "
                         f"{teacher!r}")
    old, new = stored[teacher], measured[teacher]
    differ = [k for k in TEACHER_FIGURES if old.get(k) != new[k]]
    differ += [k for k in TEACHER_NLLS if k in old and k in new
               and not math.isclose(old[k], new[k], rel_tol=NLL_TOLERANCE, abs_tol=0.0)]
    if differ:
        raise SystemExit(f"--keep: the teacher gives other figures than the stored report's ({', '.join(differ)}): "
                         "another teacher, data or code; measure every model again")


def kept(stored: dict, measured: dict, teacher: str) -> dict:
    """stored's models with those of `measured` in their place (new ones after them), for --keep (check_teacher)."""
    check_teacher(stored, measured, teacher)
    return {**{name: measured.get(name, r) for name, r in stored.items()},
            **{name: r for name, r in measured.items() if name not in stored}}


@torch.no_grad()
def reply(model, tokenizer, prompt: str | list[dict], max_new_tokens: int) -> str:
    ids = chat_ids(tokenizer, prompt)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def check_inputs(p: argparse.ArgumentParser, args) -> dict[str, str]:
    """{name: folder} of --model, every input checked before the first model is measured (minutes each): the
    errors all at once, through the parser (exit 2)."""
    bad = [f"--model {m!r}: give NAME=FOLDER" for m in args.model if "=" not in m or not m.split("=", 1)[0]]
    pairs = [m.split("=", 1) for m in args.model if "=" in m]
    names = [n for n, _ in pairs]
    bad += [f"--model {n!r} is named twice" for n in dict.fromkeys(n for n in names if names.count(n) > 1)]
    bad += missing_inputs(models=[(f"--model {n}=", f) for n, f in pairs],
                          files=[(flag, path) for flag, path in (("--data", args.data / "val_prose.bin"),
                                                                 ("--data", args.data / "val_code.bin"),
                                                                 ("--prompts", args.prompts),
                                                                 ("--heldout-chats", args.heldout_chats),
                                                                 ("--heldout-followups", args.heldout_followups))
                                 if path is not None])
    unknown = [n for n in args.transcript_models or () if n not in names]
    if unknown:
        bad.append(f"--transcript-models {unknown}: not among this run's --model names {names}")
    if min(args.new_tokens, args.seq_len, args.threads, args.transcript_tokens) < 1 or args.eval_rows < 0:
        bad.append("--new-tokens, --seq-len, --threads and --transcript-tokens must be at least 1, --eval-rows >= 0")
    if bad:
        p.error("; ".join(bad))
    return dict(pairs)


def write_report(args, results: dict, chats: list, meta: dict, prose, code, prompts: int) -> str:
    """The table of `results` (the teacher first) into --json with the run's settings; returns the table."""
    base = next(iter(results.values()))
    chat_head = " NLL held-out chats (x teacher) |" if chats else ""
    later = "nll_followup" in base  # the conversations' later turns: measured now, or kept with the teacher's
    later_head = " later turns: NLL (x teacher) | later turns: agreement (median divergence) | later turns: top-1 |" \
        if later else ""
    lines = [f"| model | layers | NLL prose (x teacher) | NLL code (x teacher) |{chat_head} greedy agreement, first "
             f"{args.new_tokens} tokens | identical prefix, mean / median | teacher-forced top-1 | cache at 32K "
             f"(x teacher) |{later_head}", "|---|---|---|---|" + "---|" * bool(chats) + "---|---|---|---|"
             + "---|" * 3 * later]
    for name, r in results.items():
        chat_cell = f" {r['nll_chat']:.3f} ({r['nll_chat'] / base['nll_chat']:.2f}) |" \
            if chats and "nll_chat" in r and "nll_chat" in base else " - |" * bool(chats)
        lines.append(f"| {name} | {r['layer_types'][:6]}... | "
                     f"{r['nll_prose']:.3f} ({r['nll_prose'] / base['nll_prose']:.2f}) "
                     f"| {r['nll_code']:.3f} ({r['nll_code'] / base['nll_code']:.2f}) |{chat_cell} "
                     f"{r['agreement']:.1%} | {r['agreed_prefix']:.1f} / {r.get('median_first_divergence', 0):.0f} | "
                     f"{r.get('forced_top1', float('nan')):.1%} | {format_bytes(r['cache_32k_bytes'])} "
                     f"({r['cache_32k_bytes'] / base['cache_32k_bytes']:.2f}) |")
        if later:
            lines[-1] += f" {r['nll_followup']:.3f} ({r['nll_followup'] / base['nll_followup']:.2f}) | " \
                f"{r['followup_agreement']:.1%} ({r['followup_median_divergence']:.0f}) | {r['followup_top1']:.1%} |" \
                if "nll_followup" in r else " - | - | - |"
    table = "\n".join(lines)
    held_out = {"code_files": [n for n in meta["val"]["names"] if not n.startswith("pydoc_data/topics/")],
                "prose_topics": [n for n in meta["val"]["names"] if n.startswith("pydoc_data/topics/")],
                "code_tokens": int(code.size), "prose_tokens": int(prose.size)}
    text = json.dumps({"models": results, "table": table, "prompts": prompts, "new_tokens": args.new_tokens,
                       "held_out": held_out, "ppl_prose_teacher": math.exp(base["nll_prose"])}, indent=1) + "\n"
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(args.json)  # atomically: a kill leaves the last complete report
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a prepare_data.py --pydoc folder")
    p.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER",
                   help="a checkpoint; the first one is the teacher")
    p.add_argument("--prompts", type=Path, help="one chat prompt per line (# comments); default: the distinct "
                                                 "prompts of --heldout-chats")
    p.add_argument("--heldout-chats", type=Path, help="teacher_corpus.py's chats-heldout.jsonl (its single turns; "
                                                       "later turns of conversations go to --heldout-followups)")
    p.add_argument("--heldout-followups", type=Path,
                   help="the chats-heldout.jsonl of a teacher_corpus.py corpus of conversations (--prompts "
                        "examples/smollm2/followup_prompts.txt): its later turns, measured apart")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-rows", type=int, default=0, help="NLL on the first N rows of each split (0: all)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--transcripts", type=Path)
    p.add_argument("--transcript-models", nargs="*", default=None, help="names (default: the teacher and the last)")
    p.add_argument("--transcript-prompts", type=int, default=6)
    p.add_argument("--transcript-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep", action="store_true",
                   help="keep the models of an existing --json that this run does not measure; the teacher is "
                        "measured first and must give the stored figures (its NLLs within 1e-4, relative: another "
                        "CPU's float sums), or the run stops there, before writing")
    args = p.parse_args(argv)
    if args.prompts is None and args.heldout_chats is None:
        p.error("give --prompts, --heldout-chats or both")
    models = check_inputs(p, args)
    torch.set_num_threads(args.threads)
    meta = json.loads((args.data / "meta.json").read_text())
    bos_id = meta["bos_token_id"]
    prose, code = load_tokens(args.data / "val_prose.bin"), load_tokens(args.data / "val_code.bin")
    # single turns only: the later turns of conversations are --heldout-followups' (the same file may be given to both)
    chats = [c for c in read_chats(args.heldout_chats) if not c.get("history")] if args.heldout_chats else []
    prompts = read_prompts(args.prompts) if args.prompts else list(dict.fromkeys(c["user"] for c in chats))
    followups = [c for c in read_chats(args.heldout_followups) if c.get("history")] if args.heldout_followups else []
    conversations = followup_prompts(followups)
    if args.heldout_followups and not conversations:
        p.error(f"--heldout-followups {args.heldout_followups}: no chat in it has earlier turns (\"history\")")
    teacher_followup = None
    results, teacher_out, names = {}, None, list(models)
    stored = json.loads(args.json.read_text())["models"] if args.keep and args.json.exists() else None
    for name, folder in models.items():
        t0 = time.perf_counter()
        model, tokenizer = load(folder)
        cache = cache_bytes(model.config, "bfloat16")
        r = {"folder": folder, "layer_types": "".join("k" if t == "linear_attention" else "A"
                                                      for t in model.config.layer_types),
             "nll_prose": nll(model, prose, args.seq_len, bos_id, args.eval_rows),
             "nll_code": nll(model, code, args.seq_len, bos_id, args.eval_rows),
             "cache_32k_bytes": cache["kda_state"] + CONTEXT * cache["kv_per_token"],
             "tokens_trained": trained_tokens(folder)}
        if chats:
            r["nll_chat"] = chat_nll(model, tokenizer, chats)
        teacher_out, figures = judged(model, tokenizer, prompts, teacher_out, args.new_tokens)
        r.update(figures)
        if conversations:
            r["nll_followup"] = chat_nll(model, tokenizer, followups)
            teacher_followup, figures = judged(model, tokenizer, conversations, teacher_followup, args.new_tokens)
            r.update({FOLLOWUP_KEYS[k]: v for k, v in figures.items()})
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["measured"] = time.strftime("%Y-%m-%d")
        results[name] = r
        chat = f", chats {r['nll_chat']:.3f}" if chats else ""
        later = (f"; later turns: NLL {r['nll_followup']:.3f}, agreement {r['followup_agreement']:.3f} (median "
                 f"{r['followup_median_divergence']:.0f}), top-1 {r['followup_top1']:.3f}") if conversations else ""
        print(f"{name}: NLL prose {r['nll_prose']:.3f}, code {r['nll_code']:.3f}{chat}, agreement "
              f"{r['agreement']:.3f} (prefix {r['agreed_prefix']:.1f}, median {r['median_first_divergence']:.0f}), "
              f"teacher-forced top-1 {r['forced_top1']:.3f}, cache at 32K {format_bytes(r['cache_32k_bytes'])}"
              f"{later} [{r['seconds']} s]", flush=True)
        del model
        # after every model, so a killed run keeps what it measured (run the rest again with --keep); kept() checks
        # the teacher, measured first, before the other models' minutes
        rows = results if stored is None else kept(stored, results, names[0])
        table = write_report(args, rows, chats, meta, prose, code, len(prompts))
    results = rows
    print("\n" + table)
    if args.transcripts:
        chosen = args.transcript_models or [names[0], names[-1]]
        shown = prompts[:args.transcript_prompts] + conversations[:args.transcript_prompts]
        replies = {}
        for name in chosen:
            model, tokenizer = load(models[name])
            replies[name] = [reply(model, tokenizer, q, args.transcript_tokens) for q in shown]
            del model
        parts = [f"# SmolLM2-135M-Instruct and its KDA student: chat transcripts\n\nGreedy, {args.transcript_tokens} "
                 "new tokens at most, the report's first prompts (--prompts, or the held-out chats' prompts"
                 + "; then later turns of held-out conversations, after the earlier turns shown" * bool(conversations)
                 + ") "
                 "(`python examples/smollm2/smollm2_report.py ...`, see docs/records/smollm2/README.md).\n"]
        for i, q in enumerate(shown):
            if isinstance(q, str):
                parts.append(f"## {q}\n")
            else:  # a later turn: the conversation before it, the teacher's sampled replies included
                parts.append(f"## {q[-1]['content']}\n\nafter " + " / ".join(
                    f"{m['role']}: {m['content']!r}" for m in q[:-1]) + "\n")
            for name in chosen:
                text = replies[name][i].replace("\n", "\n> ")
                parts.append(f"**{name}** ({results[name]['layer_types'][:3]}...):\n\n> {text}\n")
        args.transcripts.write_text("\n".join(parts))
    return results


if __name__ == "__main__":
    main()
