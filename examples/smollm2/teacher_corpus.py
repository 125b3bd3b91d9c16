"""A distillation corpus from the teacher itself: its sampled replies, through its chat template, to the user prompts
written for this project (examples/smollm2/distill_prompts.txt), and its continuations of short seeds; with
--prompts examples/smollm2/followup_prompts.txt, conversations of several user turns, each reply sampled in the
context of the earlier turns and the teacher's own earlier replies.

    python examples/smollm2/teacher_corpus.py --teacher PATH --out out/data/smollm2-teacher-corpus
    python examples/smollm2/teacher_corpus.py --teacher model.gguf --samples 4 --temperature 0.8 --top-p 0.95 --out DIR
    python examples/smollm2/teacher_corpus.py --teacher model.gguf --engine llama_cpp --samples 2 \
        --prompts examples/smollm2/followup_prompts.txt --out out/data/smollm2-followups

--teacher is a checkpoint folder or a .gguf file (read by transformers' GGUF loader; the `gguf` package). With
--engine llama_cpp a .gguf teacher runs in llama.cpp (llama-cpp-python), one sequence at a time, about 3x the
batched transformers rate on 2 cores; both engines sample as transformers does (temperature, then top-p over the
tempered distribution, no top-k), and each record names its engine. The data
rule of docs/records/smollm2/README.md holds: nothing enters but the prompts written here and what the teacher says
to them.

Output in --out (outside git):
    samples.jsonl         the log: one JSON line per (prompt, sample), written a batch at a time (flushed, fsynced)
    manifest.json         prompt-set sha256, teacher sha256, sampling settings, counts of prompts, samples, tokens
                          and samples by engine
    chats-train.jsonl, chats-heldout.jsonl    {"user", "assistant", "complete"}: prepare_data.py --chats reads them;
                          a conversation's row also has "history", the turns before (user, assistant, ...), and
                          ends at its first reply cut short (a later turn would follow a reply that never ended)
    continuations-train.jsonl, continuations-heldout.jsonl    {"seed", "text", "complete"}

A prompt is held out when the sha256 of its text falls in the first --held-out fraction (about 10%): the same prompts
whatever the file's order, and never in a training file. Every run plans the same batches (jobs sorted by prompt
length, cut into --batch-size), seeds each batch's sampling from --seed and the batch's index, and skips the batches
the log already holds whole: a killed run resumes where it stopped and ends with the corpus an uninterrupted run
writes (a batch cut off mid-write is dropped and redone). A log made with another teacher, prompt set or sampling
settings is refused before anything is written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = Path(__file__).resolve().parent / "distill_prompts.txt"
FOLLOWUPS = Path(__file__).resolve().parent / "followup_prompts.txt"  # conversations: --prompts FOLLOWUPS
TURN_SEPARATOR = " >> "  # between the user turns of a '## followup:' line
KINDS = ("chat", "followup", "seed")
SAMPLING_KEYS = ("samples", "temperature", "top_p", "max_new_tokens", "seed_samples", "held_out", "seed",
                 "batch_size")


@dataclass(frozen=True)
class Prompt:
    kind: str  # "chat" (a user message), "followup" (user turns, TURN_SEPARATOR between) or "seed" (text to continue)
    category: str
    text: str

    @property
    def turns(self) -> list[str]:
        """The user turns: one for a chat prompt, two or more for a followup line."""
        return [t.strip() for t in self.text.split(TURN_SEPARATOR)] if self.kind == "followup" else [self.text]

    def split(self, held_out: float) -> str:
        """"heldout" for about `held_out` of all prompts, chosen by the text alone (not its place in the file)."""
        return "heldout" if int(hashlib.sha256(self.text.encode()).hexdigest()[:13], 16) / 16**13 < held_out \
            else "train"


def read_prompts(path: Path) -> list[Prompt]:
    """The prompts of a file in distill_prompts.txt's format ('## chat: category' / '## seed: category' sections,
    one prompt a line, '#' comments; '## followup: category' sections hold conversations, their user turns on one
    line with ' >> ' between them); duplicates, prompts outside a section and a followup line with an empty turn
    or a single turn are errors."""
    prompts, section, seen = [], None, set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if line.startswith("## "):
            kind, _, category = line[3:].partition(":")
            if kind.strip() not in KINDS or not category.strip():
                raise SystemExit(f"{path}:{number}: a section is '## chat: <category>', '## followup: <category>' or "
                                 "'## seed: <category>'")
            section = (kind.strip(), category.strip())
            continue
        if not line or line.startswith("#"):
            continue
        if section is None:
            raise SystemExit(f"{path}:{number}: a prompt before any '## chat:', '## followup:' or '## seed:' section")
        if line in seen:
            raise SystemExit(f"{path}:{number}: duplicate prompt {line!r}")
        seen.add(line)
        prompt = Prompt(section[0], section[1], line)
        if prompt.kind == "followup" and (len(prompt.turns) < 2 or not all(prompt.turns)):
            raise SystemExit(f"{path}:{number}: a followup line is two or more non-empty user turns with "
                             f"{TURN_SEPARATOR.strip()!r} between them, got {line!r}")
        prompts.append(prompt)
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def teacher_sha256(teacher: Path) -> str:
    """The file's sha256 for a .gguf; for a folder, the sha256 of its weights, config and tokenizer files' hashes."""
    if teacher.is_file():
        return sha256_file(teacher)
    names = sorted(p.name for p in teacher.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja")))
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise SystemExit(f"--teacher {teacher}: no weights (.safetensors / .bin) in the folder")
    return hashlib.sha256("".join(f"{n} {sha256_file(teacher / n)}\n" for n in names).encode()).hexdigest()


def load_teacher(teacher: Path, tokenizer_only: bool = False):
    """(the transformers model, or None with `tokenizer_only`; its tokenizer, padding on the left)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=teacher.parent, gguf_file=teacher.name) if teacher.is_file() \
        else dict(pretrained_model_name_or_path=teacher)
    model = None if tokenizer_only else AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(**where)
    tok.padding_side = "left"  # batched generation: every row's last token at the end
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise SystemExit(f"--teacher {teacher}: its tokenizer has no chat template")
    return model, tok


class LlamaCppTeacher:
    """A .gguf teacher run by llama.cpp: `sample(ids, seed)` -> the new token ids, up to and including EOS.
    llama.cpp's own chain applies top-p before the temperature; here the temperature divides the logits first (a
    logits processor) and llama.cpp's temperature is 1, so the distribution is transformers' (no top-k, min-p,
    typical or penalties)."""

    def __init__(self, path: Path, *, threads: int, context: int, temperature: float, top_p: float,
                 max_new_tokens: int, eos: int):
        try:
            from llama_cpp import Llama, LogitsProcessorList
        except ImportError:
            raise SystemExit("--engine llama_cpp needs llama-cpp-python (scripts/install_llama_cpp.sh)") from None
        self.llm = Llama(str(path), n_ctx=context, n_batch=512, n_threads=threads, verbose=False)
        self.scale = LogitsProcessorList([lambda _ids, logits: logits / temperature])
        self.top_p, self.max_new_tokens, self.eos = top_p, max_new_tokens, eos

    def sample(self, ids: list[int], seed: int) -> list[int]:
        self.llm.set_seed(seed)
        out = []
        for token in self.llm.generate(ids, top_k=0, top_p=self.top_p, min_p=0.0, typical_p=1.0, temp=1.0,
                                       repeat_penalty=1.0, logits_processor=self.scale):
            out.append(token)
            if token == self.eos or len(out) == self.max_new_tokens:
                return out
        return out


def plan(prompts: list[Prompt], tok, samples: int, seed_samples: int, batch_size: int) -> list[list[tuple]]:
    """Batches of jobs (prompt index, sample index, input ids), the same for the same prompts and settings: sorted
    by input length, so that a batch pads little."""
    jobs = []
    for i, p in enumerate(prompts):
        ids = tok(p.text, add_special_tokens=False)["input_ids"] if p.kind == "seed" else conversation_ids(tok, p, [])
        jobs += [(i, s, list(ids)) for s in range(seed_samples if p.kind == "seed" else samples)]
    jobs.sort(key=lambda j: (len(j[2]), j[0], j[1]))
    return [jobs[k:k + batch_size] for k in range(0, len(jobs), batch_size)]


def conversation_ids(tok, prompt: Prompt, replies: list[str]) -> list[int]:
    """The input ids for the teacher's next reply: the prompt's user turns, each answered by `replies` so far, up to
    the next user turn, through the chat template."""
    messages = []
    for user, assistant in zip(prompt.turns, replies + [None]):
        messages.append({"role": "user", "content": user})
        if assistant is not None:
            messages.append({"role": "assistant", "content": assistant})
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


def context_bound(tok, prompts: list[Prompt], batches: list[list[tuple]], max_new_tokens: int) -> int:
    """Tokens llama.cpp's context must hold: the longest first input and its reply; for a conversation, its user
    turns through the template with every reply at most max_new_tokens (and 16 tokens of slack per reply, for a
    reply whose decoded text tokenizes longer)."""
    bound = max(len(ids) for b in batches for *_, ids in b) + max_new_tokens
    for p in prompts:
        if p.kind == "followup":
            empty = [m for u in p.turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": ""})]
            base = len(tok.apply_chat_template(empty, tokenize=True, return_dict=True)["input_ids"])
            bound = max(bound, base + len(p.turns) * (max_new_tokens + 16))
    return bound


def reply_record(tok, gen: torch.Tensor) -> dict:
    """One sampled reply: its tokens up to and including the end of turn, whether it ended, its text."""
    ended = (gen == tok.eos_token_id).nonzero()
    n = int(ended[0]) + 1 if len(ended) else len(gen)
    return {"tokens": n, "complete": bool(len(ended)), "text": tok.decode(gen[:n], skip_special_tokens=True).strip()}


def sample_batch(model, tok, prompts: list[Prompt], jobs: list[tuple], args, b: int) -> list[list[dict]]:
    """Each job's replies (reply_record), one per user turn: every turn of the batch's conversations is sampled
    together, in the context of the earlier turns and replies; a conversation stops at a reply cut short (or
    empty)."""
    replies: list[list[dict]] = [[] for _ in jobs]
    active, turn = list(range(len(jobs))), 0
    while active:
        batch = [jobs[k] if turn == 0 else (jobs[k][0], jobs[k][1], conversation_ids(
            tok, prompts[jobs[k][0]], [r["text"] for r in replies[k]])) for k in active]
        for k, gen in zip(active, generate(model, tok, batch, args, b, turn)):
            replies[k].append(reply_record(tok, gen))
        turn += 1
        active = [k for k in active if turn < len(prompts[jobs[k][0]].turns) and replies[k][-1]["complete"]
                  and replies[k][-1]["text"]]
    return replies


def read_log(path: Path, batches: list[list[tuple]]) -> set[int]:
    """The batches the log holds whole; the log is cut back to them (a batch cut off by a kill is dropped)."""
    if not path.exists():
        return set()
    done, keep, size = set(), [], 0
    lines = path.read_bytes().split(b"\n")
    records = []
    for raw in lines[:-1]:  # the last element follows the last newline: empty, or a line cut mid-write
        try:
            records.append((raw, json.loads(raw)))
        except ValueError:
            break
    by_batch: dict[int, list[bytes]] = {}
    for raw, rec in records:
        by_batch.setdefault(rec["batch"], []).append(raw)
    for b, rows in sorted(by_batch.items()):
        if b < len(batches) and len(rows) == len(batches[b]):
            done.add(b)
            keep += rows
            size += sum(len(r) + 1 for r in rows)
    if size != path.stat().st_size:
        with open(path, "wb") as f:  # only whole batches stay
            f.write(b"".join(r + b"\n" for r in keep))
            f.flush()
            os.fsync(f.fileno())
    return done


def generate(model, tok, jobs: list[tuple], args, b: int, turn: int = 0) -> list[torch.Tensor]:
    """The new tokens of each job of batch `b`, sampled from seeds that depend on --seed, the batch and the turn of
    the conversation (and, in llama.cpp, the job) only."""
    later = f"/{turn}" if turn else ""  # the first turn's seeds are those of the corpus before conversations
    if isinstance(model, LlamaCppTeacher):
        return [torch.tensor(model.sample(ids, random.Random(f"{args.seed}/{b}/{i}/{s}{later}").getrandbits(31)))
                for i, s, ids in jobs]
    width = max(len(ids) for _, _, ids in jobs)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, _, ids in jobs])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, _, ids in jobs])
    torch.manual_seed(random.Random(f"{args.seed}/{b}{later}").getrandbits(63))
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                             top_p=args.top_p, top_k=0, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    return list(out[:, width:])


def hold_lock(out: Path):
    """An exclusive lock on out/.lock, held while the returned file is open (until the process ends): a second run
    on the same corpus is refused before it reads or writes the log."""
    import fcntl

    f = open(out / ".lock", "w")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SystemExit(f"{out}: another teacher_corpus.py run is writing this corpus (it holds {out / '.lock'})") \
            from None
    return f


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def check_manifest(out: Path, manifest: dict) -> None:
    """Refuse a log made with another teacher, prompt set or sampling settings (before anything is written)."""
    path = out / "manifest.json"
    if not path.exists():
        if (out / "samples.jsonl").exists():
            raise SystemExit(f"{out}: a samples.jsonl without manifest.json: not a corpus this tool wrote")
        return
    old = json.loads(path.read_text())
    for key in ("teacher_sha256", "prompts_sha256", "sampling"):
        if old.get(key) != manifest[key]:
            raise SystemExit(f"{out}: made with another {key.replace('_', ' ')} ({old.get(key)!r}, now "
                             f"{manifest[key]!r}); use another --out, or remove it to start over")


def export(out: Path, prompts: list[Prompt], held_out: float) -> dict:
    """chats-{split}.jsonl and continuations-{split}.jsonl from the log, in prompt order; returns the counts."""
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    records.sort(key=lambda r: (r["prompt"], r["sample"]))
    counts: dict = {}
    files = {}
    try:
        for r in records:
            p = prompts[r["prompt"]]
            name = f"{'continuations' if p.kind == 'seed' else 'chats'}-{p.split(held_out)}.jsonl"
            if name not in files:
                files[name] = open(out / (name + ".tmp"), "w")
            row = {"seed": p.text, "text": r["text"]} if p.kind == "seed" else \
                {"user": p.turns[len(r.get("replies", [r])) - 1], "assistant": r["text"]}
            if len(r.get("replies", [])) > 1:  # the turns before the last reply
                row["history"] = [m for u, a in zip(p.turns, r["replies"][:-1]) for m in (
                    {"role": "user", "content": u}, {"role": "assistant", "content": a["text"]})]
            row.update(complete=r["complete"], category=p.category, prompt=r["prompt"], sample=r["sample"])
            files[name].write(json.dumps(row) + "\n")
            c = counts.setdefault(name, {"records": 0, "tokens": 0})
            c["records"] += 1
            c["tokens"] += r["tokens"]
    finally:
        for f in files.values():
            f.close()
    for name in files:
        os.replace(out / (name + ".tmp"), out / name)
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, required=True, help="checkpoint folder or .gguf file")
    p.add_argument("--out", type=Path, required=True, help="corpus folder (outside git)")
    p.add_argument("--prompts", type=Path, default=PROMPTS,
                   help="prompt file (default: distill_prompts.txt beside this script)")
    p.add_argument("--samples", type=int, default=4, help="replies sampled per chat prompt (default 4)")
    p.add_argument("--seed-samples", type=int, default=2, help="continuations sampled per seed (default 2)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--held-out", type=float, default=0.1, help="fraction of prompts held out (default 0.1)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("transformers", "llama_cpp"), default="transformers",
                   help="what runs the teacher: transformers (batched), or llama.cpp for a .gguf teacher")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads (default: all cores)")
    p.add_argument("--max-batches", type=int, default=None, help="stop after this many new batches (then resume)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("samples", "seed_samples", "max_new_tokens", "batch_size", "threads"):
        if getattr(args, name) < (0 if name == "seed_samples" else 1):
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    if not (args.temperature > 0 and 0 < args.top_p <= 1 and 0 <= args.held_out < 1):
        p.error("--temperature must be > 0, --top-p in (0, 1], --held-out in [0, 1)")
    if not args.teacher.exists():
        p.error(f"--teacher {args.teacher}: no such file or folder")
    if args.engine == "llama_cpp" and not args.teacher.is_file():
        p.error(f"--engine llama_cpp runs a .gguf teacher; {args.teacher} is a folder")
    prompts = read_prompts(args.prompts)
    sampling = {k: getattr(args, k) for k in SAMPLING_KEYS}
    manifest = {"tool": "examples/smollm2/teacher_corpus.py", "teacher": str(args.teacher),
                "teacher_sha256": teacher_sha256(args.teacher),
                "prompts_sha256": hashlib.sha256("\n".join(f"{q.kind}\t{q.category}\t{q.text}"
                                                           for q in prompts).encode()).hexdigest(),
                "sampling": sampling}
    check_manifest(args.out, manifest)

    torch.set_num_threads(args.threads)
    model, tok = load_teacher(args.teacher, tokenizer_only=args.engine == "llama_cpp")
    batches = plan(prompts, tok, args.samples, args.seed_samples, args.batch_size)
    if model is None:
        model = LlamaCppTeacher(args.teacher, threads=args.threads, temperature=args.temperature, top_p=args.top_p,
                                context=context_bound(tok, prompts, batches, args.max_new_tokens),
                                max_new_tokens=args.max_new_tokens, eos=tok.eos_token_id)
    args.out.mkdir(parents=True, exist_ok=True)
    lock = hold_lock(args.out)  # noqa: F841  (held until the process ends)
    log = args.out / "samples.jsonl"
    done = read_log(log, batches)
    todo = [b for b in range(len(batches)) if b not in done][: args.max_batches]
    write_json(args.out / "manifest.json", {**manifest, "complete": False})
    from tqdm import tqdm

    bar = tqdm(total=len(batches), initial=len(done), unit="batch", disable=args.no_progress, desc="teacher corpus")
    started, new_tokens = time.perf_counter(), 0
    with open(log, "ab") as f:
        for b in todo:
            jobs = batches[b]
            rows = []
            for (i, s, _), replies in zip(jobs, sample_batch(model, tok, prompts, jobs, args, b)):
                n = sum(r["tokens"] for r in replies)
                rows.append({"batch": b, "prompt": i, "sample": s, "split": prompts[i].split(args.held_out),
                             "tokens": n, "complete": replies[-1]["complete"], "engine": args.engine,
                             "text": replies[-1]["text"]})
                if prompts[i].kind == "followup":  # every turn's reply; "tokens" counts them all
                    rows[-1]["replies"] = replies
                new_tokens += n
            f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - started):.0f}")
    bar.close()
    counts = export(args.out, prompts, args.held_out)
    complete = len(read_log(log, batches)) == len(batches)
    split_prompts = {s: sum(q.split(args.held_out) == s for q in prompts) for s in ("train", "heldout")}
    engines = Counter(json.loads(line).get("engine", "transformers") for line in log.read_text().splitlines())
    write_json(args.out / "manifest.json", {**manifest, "complete": complete, "prompts": len(prompts),
                                             "prompts_by_split": split_prompts, "files": counts,
                                             "batches": len(batches),
                                             "samples_by_engine": dict(sorted(engines.items()))})
    rate = new_tokens / (time.perf_counter() - started) if todo else 0.0
    print(f"{args.out}: {sum(c['records'] for c in counts.values())} samples, "
          f"{sum(c['tokens'] for c in counts.values())} teacher tokens ({new_tokens} new this run, {rate:.0f} "
          f"tokens/s){'' if complete else ' (incomplete: run again to continue)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
