"""Our shipped checkpoints beside llama.cpp on the GGUF files `--to gguf` writes, in one process, 1 thread on both
sides (--threads), fp32 weights, an f32 KV cache in llama.cpp: how closely the engines agree (max logit difference
over a prompt and a one-token-at-a-time decode of it, relative to the logit scale; greedy tokens) and how fast each
prefills the prompt and decodes. Needs llama_cpp (scripts/install_llama_cpp.sh).

    python benchmarks/bench_llama_cpp.py                          # both shipped checkpoints, 256-token prompt
    python benchmarks/bench_llama_cpp.py --context 1024 --out benchmarks/results/llama_cpp.md

Decode is the median ms/token of --decode greedy steps after the prompt (ours: model.generate with the cache;
llama.cpp: Llama.generate), prefill the median of --repeats whole-prompt forwards.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.conversion import convert

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = ("kda-hybrid-stdlib", "kda-k3-stdlib")


def prompt_ids(tok, n: int) -> list[int]:
    """`n` tokens of real text: the standard library's own source, as the checkpoints were trained on."""
    import inspect
    import json

    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    ids = tok(text).input_ids
    if len(ids) < n:
        raise SystemExit(f"--context {n}: the prompt text has only {len(ids)} tokens")
    return ids[:n]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, args, report: Report, work: Path) -> dict:
    from llama_cpp import Llama

    folder = ROOT / "checkpoints" / name
    path = convert(folder, work / f"{name}.gguf", target="gguf", dtype="float32", progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = prompt_ids(tok, args.context)
    llm = Llama(str(path), n_ctx=args.context + args.decode + 8, n_batch=args.context, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=True, type_k=0, type_v=0, verbose=False)
    # agreement: the prompt in one pass, then its second half one token at a time through llama.cpp's cache
    half = len(ids) // 2
    llm.eval(ids[:half])
    for t in ids[half:]:
        llm.eval([t])
    theirs = np.array(llm.scores[: len(ids)])
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    rel = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    same_argmax = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    llm.reset()
    steps = args.decode
    theirs_tokens = [t for _, t in zip(range(steps), llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0))]
    greedy = dict(do_sample=False, repetition_penalty=1.0, min_new_tokens=steps, max_new_tokens=steps)
    with torch.no_grad():
        ours_tokens = model.generate(torch.tensor([ids]), **greedy)[0, len(ids):].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(theirs_tokens, ours_tokens)) if a != b), steps)

    # speed: prefill of the whole prompt, then decode ms/token (generate minus its prefill)
    def llama_prefill():
        llm.reset()
        llm.eval(ids)

    def llama_generate():
        llm.reset()
        for _, _t in zip(range(steps), llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0)):
            pass

    with torch.no_grad():
        ours_prefill = timed(lambda: model(torch.tensor([ids]), use_cache=True), args.repeats)
        ours_gen = timed(lambda: model.generate(torch.tensor([ids]), **greedy), args.repeats)
    llama_prefill_s = timed(llama_prefill, args.repeats)
    llama_gen = timed(llama_generate, args.repeats)
    row = dict(model=name, rel=rel, argmax=same_argmax, greedy_agree=agree, steps=steps,
               prefill_ours=ours_prefill, prefill_llama=llama_prefill_s,
               decode_ours_ms=1e3 * (ours_gen - ours_prefill) / (steps - 1),
               decode_llama_ms=1e3 * (llama_gen - llama_prefill_s) / (steps - 1))
    report.print(f"| {name} | {rel:.1e} | {same_argmax:.3f} | {agree}/{steps} | {ours_prefill * 1e3:.0f} / "
                 f"{llama_prefill_s * 1e3:.0f} ({ours_prefill / llama_prefill_s:.2f}x) | {row['decode_ours_ms']:.2f} / "
                 f"{row['decode_llama_ms']:.2f} ({row['decode_ours_ms'] / row['decode_llama_ms']:.2f}x) |")
    return row


def main():
    p = benchmark_parser(__doc__, repeats=3)
    p.add_argument("--context", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--decode", type=int, default=32, help="greedy decode steps (default 32)")
    p.add_argument("--models", nargs="+", default=list(CHECKPOINTS), choices=CHECKPOINTS)
    args = p.parse_args()
    report = Report(args)
    report.print(f"| checkpoint | max logit diff / scale | same argmax | greedy tokens equal | prefill {args.context} "
                 "ms ours / llama.cpp | decode ms/token ours / llama.cpp |")
    report.print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        rows = [measure(name, args, report, Path(work)) for name in args.models]
    report.write({"rows": rows})


if __name__ == "__main__":
    main()
