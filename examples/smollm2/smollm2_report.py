"""Judge linearized students by what they generate, not only by perplexity (docs/records/smollm2/README.md).

    python examples/smollm2/smollm2_report.py --data out/data/smollm2 --model teacher=out/smollm2/all-A \\
        --model "kkA stage 2"=out/smollm2/distill-2-kkA/final ... --prompts examples/smollm2/chat_prompts.txt \\
        --json docs/records/smollm2/smollm2_metrics.json --transcripts docs/records/smollm2/smollm2_transcripts.md

For every model (the first --model is the teacher), on data none of them trained on (prepare_data.py --pydoc's
held-out split):
- NLL per token on held-out prose (pydoc_data topics) and held-out code (stdlib files), each as a ratio to the
  teacher's;
- greedy agreement with the teacher: per chat prompt (through the chat template), the fraction of the first
  --new-tokens generated tokens identical to the teacher's at the same position (a sequence that stopped counts
  as its pad token from then on), averaged over the prompts; and the mean length of the identical prefix;
- the cache of one sequence at 32K tokens (kda_hybrid.checkpoint_kda_hybrid.cache_bytes), as a ratio to the
  teacher's.
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
from kda_hybrid.train.data import IGNORE_INDEX, load_tokens, make_batch, num_rows

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


def read_prompts(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


@torch.no_grad()
def greedy(model, tokenizer, prompts: list[str], new_tokens: int) -> list[list[int]]:
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
    same = [np.mean([a == b for a, b in zip(x, y)]) for x, y in zip(ours, teacher)]
    prefix = []
    for x, y in zip(ours, teacher):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return float(np.mean(same)), float(np.mean(prefix))


TEACHER_FIGURES = ("layer_types", "nll_prose", "nll_code", "cache_32k_bytes")


def kept(stored: dict, measured: dict, teacher: str) -> dict:
    """stored's models with those of `measured` in their place (new ones after them), for --keep; SystemExit unless
    the teacher of both runs is the same model giving the same figures, which is what makes the rows comparable."""
    if next(iter(stored), None) != teacher:
        raise SystemExit(f"--keep: the stored report's teacher is {next(iter(stored), None)!r}, this run's "
                         f"{teacher!r}")
    differ = [k for k in TEACHER_FIGURES if stored[teacher].get(k) != measured[teacher][k]]
    if differ:
        raise SystemExit(f"--keep: the teacher gives other figures than the stored report's ({', '.join(differ)}): "
                         "another teacher, data or code; measure every model again")
    return {**{name: measured.get(name, r) for name, r in stored.items()},
            **{name: r for name, r in measured.items() if name not in stored}}


@torch.no_grad()
def reply(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = chat_ids(tokenizer, prompt)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a prepare_data.py --pydoc folder")
    p.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER",
                   help="a checkpoint; the first one is the teacher")
    p.add_argument("--prompts", type=Path, required=True, help="one chat prompt per line (# comments)")
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
                        "measured again and must give the stored figures exactly, or the run stops before writing")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = dict(m.split("=", 1) for m in args.model)
    unknown = [n for n in args.transcript_models or () if n not in models]
    if unknown:
        p.error(f"--transcript-models {unknown}: not among this run's --model names {list(models)}")
    meta = json.loads((args.data / "meta.json").read_text())
    bos_id = meta["bos_token_id"]
    prose, code = load_tokens(args.data / "val_prose.bin"), load_tokens(args.data / "val_code.bin")
    prompts = read_prompts(args.prompts)
    results, teacher_out, names = {}, None, list(models)
    for name, folder in models.items():
        t0 = time.perf_counter()
        model, tokenizer = load(folder)
        cache = cache_bytes(model.config, "bfloat16")
        r = {"folder": folder, "layer_types": "".join("k" if t == "linear_attention" else "A"
                                                      for t in model.config.layer_types),
             "nll_prose": nll(model, prose, args.seq_len, bos_id, args.eval_rows),
             "nll_code": nll(model, code, args.seq_len, bos_id, args.eval_rows),
             "cache_32k_bytes": cache["kda_state"] + CONTEXT * cache["kv_per_token"]}
        generated = greedy(model, tokenizer, prompts, args.new_tokens)
        if teacher_out is None:
            teacher_out = generated
        r["agreement"], r["agreed_prefix"] = agreement(generated, teacher_out)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["measured"] = time.strftime("%Y-%m-%d")
        results[name] = r
        print(f"{name}: NLL prose {r['nll_prose']:.3f}, code {r['nll_code']:.3f}, agreement {r['agreement']:.3f} "
              f"(prefix {r['agreed_prefix']:.1f}), cache at 32K {format_bytes(r['cache_32k_bytes'])} "
              f"[{r['seconds']} s]", flush=True)
        del model
    if args.keep and args.json.exists():
        results = kept(json.loads(args.json.read_text())["models"], results, names[0])
    base = results[names[0]]
    lines = ["| model | layers | NLL prose (x teacher) | NLL code (x teacher) | greedy agreement, first "
             f"{args.new_tokens} tokens | identical prefix (tokens) | cache at 32K (x teacher) |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['layer_types'][:6]}... | "
                     f"{r['nll_prose']:.3f} ({r['nll_prose'] / base['nll_prose']:.2f}) "
                     f"| {r['nll_code']:.3f} ({r['nll_code'] / base['nll_code']:.2f}) | {r['agreement']:.1%} | "
                     f"{r['agreed_prefix']:.1f} | {format_bytes(r['cache_32k_bytes'])} "
                     f"({r['cache_32k_bytes'] / base['cache_32k_bytes']:.2f}) |")
    table = "\n".join(lines)
    print("\n" + table)
    held_out = {"code_files": [n for n in meta["val"]["names"] if not n.startswith("pydoc_data/topics/")],
                "prose_topics": [n for n in meta["val"]["names"] if n.startswith("pydoc_data/topics/")],
                "code_tokens": int(code.size), "prose_tokens": int(prose.size)}
    args.json.write_text(json.dumps({"models": results, "table": table, "prompts": len(prompts),
                                     "new_tokens": args.new_tokens, "held_out": held_out,
                                     "ppl_prose_teacher": math.exp(base["nll_prose"])}, indent=1) + "\n")
    if args.transcripts:
        chosen = args.transcript_models or [names[0], names[-1]]
        replies = {}
        for name in chosen:
            model, tokenizer = load(models[name])
            replies[name] = [reply(model, tokenizer, q, args.transcript_tokens)
                             for q in prompts[:args.transcript_prompts]]
            del model
        parts = [f"# SmolLM2-135M-Instruct and its KDA student: chat transcripts\n\nGreedy, {args.transcript_tokens} "
                 "new tokens at most, the first prompts of examples/smollm2/chat_prompts.txt "
                 "(`python examples/smollm2/smollm2_report.py ...`, see docs/records/smollm2/README.md).\n"]
        for i, q in enumerate(prompts[:args.transcript_prompts]):
            parts.append(f"## {q}\n")
            for name in chosen:
                text = replies[name][i].replace("\n", "\n> ")
                parts.append(f"**{name}** ({results[name]['layer_types'][:3]}...):\n\n> {text}\n")
        args.transcripts.write_text("\n".join(parts))
    return results


if __name__ == "__main__":
    main()
