"""Long context on CPU: prefill time and peak RSS vs prompt length, decode ms/token vs context, cache bytes vs
context, for the 6.5M-parameter KDA hybrid (kda_hybrid.bench.shapes) and twins of the same size:

    ours (6 KDA + 2 MLA)   the Kimi pattern, kda_hybrid.bench.shapes.tiny_6p5m()
    ours KDA-only          the same shape with all 8 layers KDA
    ours all-MLA           the same shape with all 8 layers MLA (our code, only layer_types differ)
    Llama (all attention)  transformers' LlamaForCausalLM of kda_hybrid.bench.shapes.llama_twin_6p5m(): hidden 256,
                           8 layers, 4 heads x 64, SwiGLU 512 (6.03M)
    native kimi_linear     transformers' KimiLinearForCausalLM with our hybrid's weights, fla blocked (PyTorch
                           fallbacks, kda_hybrid.bench.report.native_twin); slow, so its lengths stop at --native-max

    python benchmarks/long_context.py            # full run, ~20-25 min on 1 thread
    python benchmarks/long_context.py --quick    # smaller lengths, < 5 min

Every (model, prompt length) runs in a fresh subprocess so that its peak RSS (getrusage ru_maxrss) is its own.
The prompt goes through `kda_hybrid.inference.long_context.prefill` in chunks of --chunk tokens (what
`generate(prefill_chunk_size=...)` does), or in one forward for the "one-shot" series; then --decode-steps
single-token forwards are timed (median); --repeats prefills per point give their median. The tables end with
ours / Llama at every length both ran (benchmarks/bench_model.py has the same ratios for one-forward prefills,
median and range over interleaved runs). Writes --out (default benchmarks/results/long_context.md: the
environment and the markdown tables, also printed) and beside it the same name with .csv and _*.png. Timings
are wall clock and process CPU time on whatever machine runs this; on a shared machine prefer the CPU-time
columns.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kda_hybrid.bench.report import Report, benchmark_parser

RESULTS = Path(__file__).resolve().parent / "results"
K = 1024
VOCAB = 1536

# (series id, label, model, chunked?, full-run lengths in K tokens, quick-run lengths, time budget in s)
SERIES = [
    ("ours", "ours (6 KDA + 2 MLA), chunked", "hybrid", True, [1, 2, 4, 8, 16, 32, 64, 128], [1, 4, 16], 1500),
    ("ours_oneshot", "ours (6 KDA + 2 MLA), one forward", "hybrid", False, [1, 4, 16], [1, 4, 16], 300),
    ("ours_kda", "ours KDA-only (8 KDA), chunked", "kda", True, [1, 2, 4, 8, 16, 32, 64, 128], [1, 4, 16, 64], 600),
    ("ours_mla", "ours all-MLA (8 MLA), chunked", "mla", True, [1, 2, 4, 8, 16], [1, 4], 300),
    ("llama", "Llama all-attention (8 layers), chunked", "llama", True, [1, 2, 4, 8, 16, 32, 64], [1, 4, 16], 900),
    ("native", "native kimi_linear (fla blocked), chunked", "native", True, [1, 2, 4, 8, 16], [1, 4], 400),
]


# ------------------------------------------------------------------------------------------------------
# Worker: one model, one prompt length, in a fresh process
# ------------------------------------------------------------------------------------------------------


def build(name: str, seed: int = 0):
    import torch
    from transformers import LlamaForCausalLM

    from kda_hybrid import KDAHybridForCausalLM
    from kda_hybrid.bench.native import native_twin
    from kda_hybrid.bench.shapes import llama_twin_6p5m, tiny_6p5m

    torch.manual_seed(seed)
    if name in ("hybrid", "native"):
        model = KDAHybridForCausalLM(tiny_6p5m())
        if name == "native":
            model = native_twin(model)
    elif name == "kda":
        model = KDAHybridForCausalLM(tiny_6p5m(layer_types=["linear_attention"] * 8))
    elif name == "mla":
        model = KDAHybridForCausalLM(tiny_6p5m(layer_types=["full_attention"] * 8))
    elif name == "llama":
        model = LlamaForCausalLM(llama_twin_6p5m())
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.eval()


def cache_bytes(cache) -> int:
    """Bytes of every tensor a cache holds (ours reports it; transformers' caches are walked)."""
    if hasattr(cache, "memory_report"):
        return cache.memory_report()["total_bytes"]
    import torch

    seen = {}

    def walk(x):
        if torch.is_tensor(x):
            seen[x.data_ptr()] = x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    for layer in cache.layers:
        walk(vars(layer))
    return sum(seen.values())


def maxrss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    model = build(spec["model"])
    from kda_hybrid.inference.long_context import prefill

    tokens, chunk = spec["tokens"], spec["chunk"] or spec["tokens"]
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # warm-up: lazy initialisation, first-call allocations
        logits, cache = prefill(model, ids[:, :64], chunk_size=chunk)
        model(logits.argmax(-1, keepdim=True), cache=cache, use_cache=True, logits_to_keep=1)
    del logits, cache
    base = maxrss_bytes()

    prefill_walls, prefill_cpus = [], []
    for _ in range(spec["repeats"]):  # a fresh cache each time; the last one is decoded from
        logits = cache = None  # free the previous prefill's cache first: peak RSS stays one prefill's
        t0, c0 = time.perf_counter(), time.process_time()
        logits, cache = prefill(model, ids, chunk_size=chunk)
        prefill_walls.append(time.perf_counter() - t0)
        prefill_cpus.append(time.process_time() - c0)
    prefill_wall, prefill_cpu = statistics.median(prefill_walls), statistics.median(prefill_cpus)
    peak = maxrss_bytes()
    nbytes = cache_bytes(cache)

    walls, cpus = [], []
    tok = logits.argmax(-1, keepdim=True)  # [B, 1]
    with torch.no_grad():
        for step in range(spec["decode_warmup"] + spec["decode_steps"]):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(tok, cache=cache, use_cache=True, logits_to_keep=1)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            if step >= spec["decode_warmup"]:
                walls.append(wall)
                cpus.append(cpu)
    report = cache.memory_report() if hasattr(cache, "memory_report") else None
    allocated = cache_bytes(cache) if report is None else \
        report["kda_state_bytes"] + report.get("attention_kv_allocated_bytes", report["attention_kv_bytes"])
    return dict(
        tokens=tokens, chunk=spec["chunk"] or "", params=sum(p.numel() for p in model.parameters()),
        prefill_wall_s=round(prefill_wall, 3), prefill_cpu_s=round(prefill_cpu, 3),
        peak_rss_mib=round(peak / 2**20, 1), base_rss_mib=round(base / 2**20, 1),
        cache_bytes=nbytes, decode_ms=round(statistics.median(walls) * 1e3, 3),
        decode_cpu_ms=round(statistics.median(cpus) * 1e3, 3), cache_allocated_after_decode=allocated,
    )


# ------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------


def run_series(series, args, log) -> tuple[list[dict], str | None]:
    sid, label, model, chunked, full, quick, budget = series
    budget *= args.budget_scale
    lengths = [n * K for n in (args.lengths or (quick if args.quick else full))]
    if sid == "native":
        lengths = [n for n in lengths if n <= args.native_max]
    rows, stopped, started, last = [], None, time.perf_counter(), None
    for n in lengths:
        elapsed = time.perf_counter() - started
        if last is not None:  # attention is quadratic in the prompt: predict this length from the last one
            predicted = last["prefill_wall_s"] * (n / last["tokens"]) ** 2 + 15
            if elapsed + predicted > budget:
                stopped = (f"stopped before {n // K}K: {elapsed:.0f} s spent + {predicted:.0f} s predicted > "
                           f"its {budget:.0f} s budget")
                break
        spec = dict(model=model, tokens=n, chunk=args.chunk if chunked else None, threads=args.threads,
                    decode_steps=args.decode_steps, decode_warmup=3, repeats=args.repeats)
        # the same interpreter and environment as this process, so the same kda_hybrid
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            stopped = f"failed at {n // K}K (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"
            break
        row = dict(series=sid, label=label, **json.loads(proc.stdout.strip().splitlines()[-1]))
        log(f"  {label:45s} {n // K:4d}K  prefill {row['prefill_wall_s']:8.2f} s wall {row['prefill_cpu_s']:8.2f} s cpu"
            f"  peak RSS {row['peak_rss_mib']:7.0f} MiB  decode {row['decode_ms']:6.2f} ms"
            f"  cache {row['cache_bytes'] / 2**20:8.2f} MiB")
        rows.append(row)
        last = row
    if stopped:
        log(f"  {label}: {stopped}")
    return rows, stopped


def _at(rows, sid, tokens, key):
    for r in rows:
        if r["series"] == sid and r["tokens"] == tokens:
            return r[key]
    return None


def targets(rows) -> list[str]:
    """The issue's targets, evaluated on what was measured."""
    out = []
    kda = [r["cache_bytes"] for r in rows if r["series"] == "ours_kda"]
    if kda:
        ctx = [r["tokens"] for r in rows if r["series"] == "ours_kda"]
        out.append(f"KDA-only cache bytes constant in context: {'MET' if len(set(kda)) == 1 else 'MISSED'} "
                   f"({kda[0]} B at {ctx[0] // K}K ... {kda[-1]} B at {ctx[-1] // K}K)")
    for ctx in (64 * K, 16 * K):
        ours = _at(rows, "ours", ctx, "cache_bytes")
        if ours is None:
            continue
        for sid, name in (("llama", "Llama all-attention twin"), ("ours_mla", "all-MLA twin")):
            twin, how = _at(rows, sid, ctx, "cache_bytes"), "measured"
            if twin is None:  # a KV cache is exactly linear in tokens: scale the longest measured one
                longest = max((r for r in rows if r["series"] == sid), key=lambda r: r["tokens"], default=None)
                if longest is None:
                    continue
                twin, how = longest["cache_bytes"] * ctx // longest["tokens"], \
                    f"bytes/token measured at {longest['tokens'] // K}K x {ctx // K}K"
            ratio = ours / twin
            out.append(f"hybrid cache at {ctx // K}K = {ratio:.1%} of the {name} ({ours / 2**20:.1f} MiB vs "
                       f"{twin / 2**20:.1f} MiB, {how}); target <= 30%: {'MET' if ratio <= 0.30 else 'MISSED'}")
        break
    for sid, name in (("ours", "ours (6 KDA + 2 MLA)"), ("ours_kda", "ours KDA-only")):
        lo = _at(rows, sid, 1 * K, "decode_cpu_ms")
        hi_ctx = 64 * K if _at(rows, sid, 64 * K, "decode_cpu_ms") else max(
            (r["tokens"] for r in rows if r["series"] == sid and r["tokens"] <= 64 * K), default=None)
        if lo and hi_ctx:
            hi = _at(rows, sid, hi_ctx, "decode_cpu_ms")
            verdict = ("MET" if hi / lo <= 1.3 else "MISSED") if hi_ctx == 64 * K else "not measured at 64K"
            out.append(f"{name}: decode at {hi_ctx // K}K / at 1K = {hi:.2f} / {lo:.2f} ms CPU = {hi / lo:.2f}x; "
                       f"target <= 1.3x at 64K: {verdict}")
    peak = _at(rows, "ours", 128 * K, "peak_rss_mib")
    if peak is not None:
        out.append(f"peak RSS of a 128K-token prefill (ours, chunked): {peak / 1024:.2f} GiB; target < 4 GB: "
                   f"{'MET' if peak * 2**20 < 4e9 else 'MISSED'}")
    return out


def markdown(rows, labels) -> str:
    sids = [s for s in labels if any(r["series"] == s for r in rows)]
    lengths = sorted({r["tokens"] for r in rows})
    metrics = [
        ("Prefill time, s (wall / process CPU)", lambda r: f"{r['prefill_wall_s']:.1f} / {r['prefill_cpu_s']:.1f}"),
        ("Peak RSS of the whole process, MiB", lambda r: f"{r['peak_rss_mib']:.0f}"),
        ("Decode, ms/token (median wall / CPU)", lambda r: f"{r['decode_ms']:.2f} / {r['decode_cpu_ms']:.2f}"),
        ("Cache, MiB", lambda r: f"{r['cache_bytes'] / 2**20:.2f}"),
    ]
    parts = []
    for title, fmt in metrics:
        parts.append(f"**{title}**\n\n| prompt | " + " | ".join(labels[s] for s in sids) + " |")
        parts.append("|---|" + "---|" * len(sids))
        for n in lengths:
            cells = []
            for s in sids:
                r = next((r for r in rows if r["series"] == s and r["tokens"] == n), None)
                cells.append(fmt(r) if r else "")
            parts.append(f"| {n // K}K | " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def versus_llama(rows) -> str:
    """ours / Llama at every length both were measured (both chunked, each in its own process); below 1: ours is
    faster. benchmarks/bench_model.py gives the same ratios for one-forward prefills, median of several runs."""
    lengths = sorted({r["tokens"] for r in rows if r["series"] == "ours"} & {r["tokens"] for r in rows
                                                                              if r["series"] == "llama"})
    if not lengths:
        return ""
    keys = [("prefill_wall_s", "prefill wall"), ("prefill_cpu_s", "prefill CPU"), ("decode_ms", "decode wall"),
            ("decode_cpu_ms", "decode CPU"), ("cache_bytes", "cache bytes")]
    parts = ["**ours (6 KDA + 2 MLA) / Llama all-attention, both chunked; below 1: ours is faster (smaller)**", "",
             "| prompt | " + " | ".join(label for _, label in keys) + " |", "|---|" + "---|" * len(keys)]
    for n in lengths:
        cells = [f"{_at(rows, 'ours', n, k) / _at(rows, 'llama', n, k):.2f}" for k, _ in keys]
        parts.append(f"| {n // K}K | " + " | ".join(cells) + " |")
    return "\n".join([*parts, ""])


def plots(rows, labels, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sids = [s for s in labels if any(r["series"] == s for r in rows)]
    figs = [
        ("prefill_time", "Prefill time (process CPU, s)", lambda r: r["prefill_cpu_s"], True),
        ("peak_rss", "Peak RSS of the process (MiB)", lambda r: r["peak_rss_mib"], False),
        ("decode", "Decode (median process CPU, ms/token)", lambda r: r["decode_cpu_ms"], False),
        ("cache", "Cache (MiB)", lambda r: r["cache_bytes"] / 2**20, True),
    ]
    paths = []
    for name, ylabel, get, logy in figs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in sids:
            pts = sorted((r["tokens"], get(r)) for r in rows if r["series"] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels[s])
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / K:g}K"))
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("prompt / context tokens")
        ax.set_ylabel(ylabel)
        ax.set_title(f"6.5M-parameter shape, CPU fp32, batch 1: {ylabel.split(' (')[0].lower()}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{stem}_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main():
    p = benchmark_parser(__doc__, repeats=1, out=RESULTS / "long_context.md",
                         repeats_help="prefills per (model, length) in its process; the figure is their median")
    p.add_argument("--quick", action="store_true", help="smaller lengths (< 5 min)")
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk size (default 4096)")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--native-max", type=int, default=16 * K,
                   help="longest prompt for native kimi_linear (default 16384: ~1 min there on CPU)")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="scales each series' time budget; a length predicted to overrun it is skipped")
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in K tokens, for every series run")
    p.add_argument("--only", nargs="+", choices=[s[0] for s in SERIES], help="run only these series")
    p.add_argument("--report", action="store_true", help="measure nothing: rebuild plots and tables from the CSV")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    report = Report(args)
    out_csv = args.out.with_suffix(".csv")
    labels = {s[0]: s[1] for s in SERIES}
    chosen = [s for s in SERIES if not args.only or s[0] in args.only]
    report.print(f"# CPU fp32, batch 1, {args.threads} thread(s) per measurement, chunk {args.chunk}, "
                 f"{args.repeats} prefill(s) per point")
    rows, notes, t_start = [], [], time.perf_counter()
    for series in chosen if not args.report else []:
        print(f"{series[1]}:", flush=True)
        got, stopped = run_series(series, args, lambda s: print(s, flush=True))
        rows += got
        if stopped:
            notes.append(f"{series[1]}: {stopped}")
    if args.only or args.lengths or args.report:  # keep the other rows of an earlier run
        if out_csv.exists():
            with out_csv.open() as f:
                done = {(r["series"], r["tokens"]) for r in rows}
                old = [dict(r) for r in csv.DictReader(f) if (r["series"], int(r["tokens"])) not in done]
            for r in old:
                for k in ("tokens", "params", "cache_bytes", "cache_allocated_after_decode"):
                    r[k] = int(r[k])
                for k in ("prefill_wall_s", "prefill_cpu_s", "peak_rss_mib", "base_rss_mib", "decode_ms",
                          "decode_cpu_ms"):
                    r[k] = float(r[k])
            rows = old + rows
    rows.sort(key=lambda r: ([s[0] for s in SERIES].index(r["series"]), r["tokens"]))
    fields = ["series", "label", "tokens", "chunk", "params", "prefill_wall_s", "prefill_cpu_s", "peak_rss_mib",
              "base_rss_mib", "decode_ms", "decode_cpu_ms", "cache_bytes", "cache_allocated_after_decode"]
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    pngs = plots(rows, labels, args.out.parent, args.out.stem)
    report.print(f"# measured in {time.perf_counter() - t_start:.0f} s\n")
    report.print(markdown(rows, labels))
    ratios = versus_llama(rows)
    if ratios:
        report.print(ratios)
    report.print("**Targets**\n")
    for line in [*(f"- {v}" for v in targets(rows)), "", *(f"- {n}" for n in notes)]:
        report.print(line)
    report.write()
    print("wrote", out_csv, *pngs)


if __name__ == "__main__":
    main()
