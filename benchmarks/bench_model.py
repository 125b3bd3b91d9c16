"""The 6.5M-parameter model (kda_hybrid.shapes.tiny_6p5m) against transformers' native KimiLinearForCausalLM with
the same weights, on CPU: forward of 8192 tokens, and decode ms/token at 256 and 4096 tokens of context.

    python benchmarks/bench_model.py                 # 1 thread, as docs/architecture.md §7's anchors
    python benchmarks/bench_model.py --threads 2 --forward-tokens 4096 --out bench_model.md

fla is blocked in this process (kda_hybrid.benchmarking.native_twin) so the native model runs its PyTorch
fallbacks (with fla installed it binds Triton kernels that crash on CPU tensors); our model never needs fla.
"""

from __future__ import annotations

import statistics
import time

import torch

from kda_hybrid import KDAHybridCache, KDAHybridForCausalLM
from kda_hybrid.benchmarking import Report, benchmark_parser, native_twin
from kda_hybrid.shapes import tiny_6p5m


@torch.no_grad()
def time_forward(model, ids, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def time_decode(model, ctx, steps, make_cache):
    """Prefill `ctx` tokens, then `steps` single-token forwards; median seconds per token."""
    ids = torch.randint(3, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0))
    cache = make_cache()
    out = model(ids, cache=cache, use_cache=True) if cache is not None else model(ids, use_cache=True)
    cache = out.cache
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, cache=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def main():
    p = benchmark_parser(__doc__, repeats=3, repeats_help="forward timings of ours (native: 1), the figure their min")
    p.add_argument("--forward-tokens", type=int, default=8192)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip-native", action="store_true")
    args = p.parse_args()
    report = Report(args)
    torch.manual_seed(0)
    ours = KDAHybridForCausalLM(tiny_6p5m()).eval()
    n_params = sum(p.numel() for p in ours.parameters())
    models = {"ours": (ours, lambda: KDAHybridCache(ours.config))}
    if not args.skip_native:
        native = native_twin(ours)
        models["transformers native"] = (native, lambda: None)
    ids = torch.randint(3, ours.config.vocab_size, (1, args.forward_tokens), generator=torch.Generator().manual_seed(1))
    report.print(f"# {n_params / 1e6:.2f}M-parameter KDA hybrid (6 KDA + 2 MLA), fp32, {args.threads} thread(s)")
    rows = {}
    for name, (model, make_cache) in models.items():
        fwd = time_forward(model, ids, repeats=1 if name != "ours" else args.repeats)
        dec = {c: time_decode(model, c, args.steps, make_cache) for c in args.contexts}
        rows[name] = (fwd, dec)
    ctx_cols = " | ".join(f"decode ms/token @ {c}" for c in args.contexts)
    report.print(f"\n| model | forward {args.forward_tokens} tokens (s) | {ctx_cols} |")
    report.print("|---|---|" + "---|" * len(args.contexts))
    for name, (fwd, dec) in rows.items():
        report.print(f"| {name} | {fwd:.2f} | " + " | ".join(f"{dec[c] * 1e3:.1f}" for c in args.contexts) + " |")
    if "transformers native" in rows:
        (f_o, d_o), (f_n, d_n) = rows["ours"], rows["transformers native"]
        report.print(f"\nforward: ours {f_n / f_o:.1f}x faster than native (target >= 5x)")
        for c in args.contexts:
            report.print(f"decode @ {c}: ours {d_n[c] / d_o[c]:.1f}x faster than native")
    d_o = rows["ours"][1]
    lo, hi = min(args.contexts), max(args.contexts)
    report.print(f"ours: decode @ {hi} / decode @ {lo} = {d_o[hi] / d_o[lo]:.2f} (target <= 1.15)")
    report.write({name: {"forward_s": fwd, "decode_s": dec} for name, (fwd, dec) in rows.items()})


if __name__ == "__main__":
    main()
