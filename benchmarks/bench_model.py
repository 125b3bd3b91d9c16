"""The 6.5M-parameter KDA hybrid (kda_hybrid.bench.shapes.tiny_6p5m) on CPU, side by side in one process with

1. a same-size transformers `LlamaForCausalLM` (kda_hybrid.bench.shapes.llama_twin_6p5m: hidden 256, 8 layers, 4 heads x
   64, SwiGLU 512): at each of --contexts, prefill = one forward of the prompt with a cache, decode = median time of
   --steps single-token forwards on the model's own cache; --repeats runs, the models interleaved within each run so
   that drift hits both alike; printed as ratios ours / Llama (below 1: ours is faster), median and range over runs;
2. transformers' native `KimiLinearForCausalLM` with the same weights as ours: a forward of --forward-tokens tokens
   without cache, and decode at --native-contexts (one run: the native model is slow).

    python benchmarks/bench_model.py                          # 1 thread, fp32, contexts 256 4096 16384
    python benchmarks/bench_model.py --contexts 256 1024 --steps 8 --repeats 3 --skip-native
    python benchmarks/bench_model.py --out benchmarks/results/bench_model.md

Both sections call the models the same way: `model(ids, use_cache=True, logits_to_keep=1)` for the prompt (each
model builds its own cache), then `model(token, cache=cache, use_cache=True, logits_to_keep=1)` per step. fla is
blocked in this process (kda_hybrid.bench.report.native_twin) so the native model runs its PyTorch fallbacks
(with fla installed it binds Triton kernels that crash on CPU tensors); our model never needs fla.
"""

from __future__ import annotations

import statistics

import torch
from transformers import LlamaForCausalLM

from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.bench.compare import Contestant, measure, prompt, report_targets, time_forward, versus_llama
from kda_hybrid.bench.native import native_twin
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.bench.shapes import llama_twin_6p5m, tiny_6p5m

# ours / Llama targets of the short- and long-context work (issue: faster than a same-size Llama at every context):
# context -> (what, most ours / Llama may be); a ratio below 1 is ours faster (0.25 = 4x faster)
TARGETS = {256: {"decode": 1.0, "prefill": 1.2}, 4096: {"prefill": 1 / 1.5}, 16384: {"decode": 0.25, "prefill": 0.4}}


def versus_native(report: Report, ours: Contestant, native: Contestant, args) -> dict:
    """Section 2: ours against transformers' native kimi_linear with the same weights."""
    ids = prompt(ours.model.config.vocab_size, args.forward_tokens)
    rows = {}
    measure(native, prompt(native.model.config.vocab_size, 64), 2)  # warm-up, as ours had in section 1
    for c, repeats in ((ours, args.repeats), (native, 1)):
        fwd = time_forward(c.model, ids, repeats)
        dec = {n: measure(c, prompt(c.model.config.vocab_size, n), args.steps)[1] for n in args.native_contexts}
        rows[c.name] = (fwd, dec)
    ctx_cols = " | ".join(f"decode ms/token @ {n}" for n in args.native_contexts)
    report.print(f"\n## Against transformers' native kimi_linear (same weights, fla blocked): one run; forward "
                 f"without cache, fastest of {args.repeats} for ours\n")
    report.print(f"| model | forward {args.forward_tokens} tokens (s) | {ctx_cols} |")
    report.print("|---|---|" + "---|" * len(args.native_contexts))
    for name, (fwd, dec) in rows.items():
        report.print(f"| {name} | {fwd:.2f} | " + " | ".join(f"{dec[n] * 1e3:.1f}" for n in args.native_contexts)
                     + " |")
    (f_o, d_o), (f_n, d_n) = rows[ours.name], rows[native.name]
    report.print(f"\nforward: ours {f_n / f_o:.1f}x faster than native (target >= 5x)")
    for n in args.native_contexts:
        report.print(f"decode @ {n}: ours {d_n[n] / d_o[n]:.1f}x faster than native")
    return {name: {"forward_s": fwd, "decode_s": dec} for name, (fwd, dec) in rows.items()}


def main():
    parser = benchmark_parser(__doc__, repeats=5, repeats_help="runs of the Llama comparison (and forwards of "
                                                               "ours against native); figures are medians over runs")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 16384],
                   help="prompt lengths for prefill and decode against Llama (default 256 4096 16384)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per measurement (default 24)")
    parser.add_argument("--forward-tokens", type=int, default=8192, help="forward length against native (default 8192)")
    parser.add_argument("--native-contexts", type=int, nargs="+", default=[256, 4096],
                   help="decode contexts against native (default 256 4096)")
    parser.add_argument("--skip-native", action="store_true", help="no comparison with native kimi_linear")
    parser.add_argument("--compile-decode", action="store_true",
                        help="add ours with the decode step under torch.compile(dynamic=True) (compiles once, ~1 min)")
    args = parser.parse_args()
    for name in ("contexts", "native_contexts"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive token counts, got {getattr(args, name)}")
    if args.steps < 1 or args.forward_tokens < 1:
        parser.error(f"--steps and --forward-tokens must be positive, got {args.steps} and {args.forward_tokens}")
    report = Report(args)

    torch.manual_seed(0)
    ours = Contestant("ours", KDAHybridForCausalLM(tiny_6p5m()).eval())
    torch.manual_seed(0)
    llama = Contestant("Llama", LlamaForCausalLM(llama_twin_6p5m()).eval())
    # Variants of ours join this list and get their own columns and ratios.
    contestants = [ours, llama]
    if args.compile_decode:  # the same weights; the cache grows every step, so the compiled graph is dynamic in T
        contestants.insert(1, Contestant("ours, compiled decode", ours.model,
                                         step=torch.compile(ours.model, dynamic=True)))
    n_ours = sum(w.numel() for w in ours.model.parameters())
    n_llama = sum(w.numel() for w in llama.model.parameters())
    report.print(f"# CPU fp32, batch 1, {args.threads} thread(s); ours: {n_ours / 1e6:.2f}M-parameter KDA hybrid "
                 f"(6 KDA + 2 MLA); Llama: {n_llama / 1e6:.2f}M, attention "
                 f"{llama.model.config._attn_implementation}; {args.steps} decode steps per measurement")

    runs = versus_llama(report, contestants, llama, args)
    report_targets(report, runs, ours.name, llama.name, args.contexts, TARGETS)
    d_o = {n: statistics.median(r[1] for r in runs[ours.name][n]) for n in args.contexts}
    lo, hi = min(args.contexts), max(args.contexts)
    report.print(f"ours: decode @ {hi} / decode @ {lo} = {d_o[hi] / d_o[lo]:.2f}")
    native = None
    if not args.skip_native:
        native = versus_native(report, ours, Contestant("transformers native", native_twin(ours.model)), args)
    report.write({"versus_llama": {name: {str(n): [{"prefill_s": pre, "decode_s": dec} for pre, dec in rs]
                                          for n, rs in by_ctx.items()} for name, by_ctx in runs.items()},
                  "versus_native": native})


if __name__ == "__main__":
    main()
