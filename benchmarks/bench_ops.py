"""KDA ops on CPU, side by side: our chunked torch path vs our reference, fla's naive functions and
transformers' native torch fallbacks. fp32, 1 thread (--threads), B=1, H=4, K=V=128.

    python benchmarks/bench_ops.py                 # T = 1024 and 4096, forward and forward+backward, memory
    python benchmarks/bench_ops.py --T 1024 --repeats 3 --no-memory --out bench_ops.json

Prints medians, ratios against the fastest anchor, our GFLOP/s (forward, and forward+backward) against the
machine's measured fp32 matmul rate, and peak extra memory of one forward (each in a fresh subprocess: RSS
high-water mark minus the RSS before the call). Forward+backward is timed for every implementation up to
--bwd-max-T and for ours at every T. The FLOP convention is `kda_flops`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from kda_hybrid.bench.report import Report, benchmark_parser

B, H, K, V = 1, 4, 128, 128


def inputs(T, requires_grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen))  # the model's gate range
    beta = torch.rand(B, T, H, generator=gen)
    xs = [q, k, v, g, beta]
    return [x.requires_grad_() for x in xs] if requires_grad else xs


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def implementations():
    """name -> (forward fn(q, k, v, g, beta) -> o, supports backward). All take raw q, k and normalise them."""
    from kda_hybrid import chunk_kda

    impls = {
        "ours (torch chunked)": (
            lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True, backend="torch")[0], True),
        "ours (reference)": (
            lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, use_qk_l2norm_in_kernel=True, backend="reference")[0],
            True),
    }
    try:
        from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

        impls["fla naive_recurrent_kda"] = (lambda q, k, v, g, b: naive_recurrent_kda(l2n(q), l2n(k), v, g, b)[0],
                                            True)
        impls["fla naive_chunk_kda"] = (lambda q, k, v, g, b: naive_chunk_kda(l2n(q), l2n(k), v, g, b)[0], True)
    except ImportError as err:
        print(f"# fla not available ({err}); its anchors are skipped", file=sys.stderr)
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as native

        chunk = getattr(native.chunk_kimi_delta_attention, "__wrapped__", native.chunk_kimi_delta_attention)
        rec = getattr(native.recurrent_kimi_delta_attention, "__wrapped__", native.recurrent_kimi_delta_attention)
        impls["transformers chunk fallback"] = (
            lambda q, k, v, g, b: chunk(q, k, v, g, b, use_qk_l2norm_in_kernel=True)[0], True)
        impls["transformers recurrent fallback"] = (
            lambda q, k, v, g, b: rec(q, k, v, g, b, None, False, use_qk_l2norm_in_kernel=True)[0], False)
    except ImportError as err:
        print(f"# transformers kimi_linear not available ({err})", file=sys.stderr)
    return impls


def timeit(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_gflops():
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t = timeit(lambda: a @ b, 10)
    return 2 * 1024**3 / t / 1e9


def kda_flops(T, C=64, backward=False):
    """Useful FLOPs of the chunked algorithm (matmuls only, 2 per multiply-add): per chunk and head A_kk and A_qk
    (C^2 K each), the inverse applied to [K | V] (C^2 (K + V)), w S and k^T v_new (C K V each), q S (C K V),
    A_qk v_new (C^2 V); the inverse itself, the exps and the elementwise work are not counted, and an
    implementation that skips a product (ours never forms w = A^-1 k in the forward) still counts it.
    With `backward`, forward+backward: 3x the forward, since each product's backward is two products of its
    size (the standard training count; recomputation in the backward is not counted)."""
    n = -(-T // C) * H
    macs = C * C * K * 2 + C * C * (K + V) + 3 * C * K * V + C * C * V
    return 2 * macs * n * (3 if backward else 1)


def time_impl(fwd, has_bwd, T, repeats, bwd_max_T=1024) -> tuple[float, float | None]:
    """(forward s, forward+backward s or None: none past bwd_max_T) of one implementation at length T, medians."""
    xs = inputs(T)
    with torch.no_grad():
        t_f = timeit(lambda: fwd(*xs), repeats)
    t_fb = None
    if has_bwd and T <= bwd_max_T:
        xg = inputs(T, requires_grad=True)
        t_fb = timeit(lambda: fwd(*xg).sum().backward(), max(1, repeats // 2))
    return t_f, t_fb


def time_all(T, repeats, which, bwd_max_T):
    rows = {}
    for name, (fwd, has_bwd) in implementations().items():
        if which and name not in which:
            continue
        slow = name == "ours (reference)" and T > 1024
        ours = name == "ours (torch chunked)"  # forward+backward at every T
        rows[name] = time_impl(fwd, has_bwd, T, max(1, repeats // 3) if slow else repeats,
                               T if ours else bwd_max_T)
    return rows


def option_rows(T, repeats) -> dict[str, tuple[float, float | None]]:
    """fla's options (issue: in-kernel gate, grouped value heads) against the same result composed from plain
    calls, on the torch path: name -> (fwd s, fwd+bwd s or None)."""
    from kda_hybrid import chunk_kda
    from kda_hybrid.kda_torch import kda_gate

    gen = torch.Generator().manual_seed(5)
    A_log = torch.rand(H, generator=gen).mul(3).log()
    dt_bias = torch.randn(H * K, generator=gen) * 0.1
    kw = dict(use_qk_l2norm_in_kernel=True, backend="torch")

    def gate_in_kernel(q, k, v, g, b):
        return chunk_kda(q, k, v, g, b, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, **kw)[0]

    def gate_composed(q, k, v, g, b):
        return chunk_kda(q, k, v, kda_gate(g, A_log, dt_bias), b, **kw)[0]

    def gva(q, k, v, g, b):  # one q/k head shared by the H value heads
        return chunk_kda(q[:, :, :1], k[:, :, :1], v, g, b, **kw)[0]

    def gva_composed(q, k, v, g, b):
        return chunk_kda(q[:, :, :1].expand_as(v).contiguous(), k[:, :, :1].expand_as(v).contiguous(), v, g, b,
                         **kw)[0]

    impls = {"in-kernel gate (use_gate_in_kernel)": gate_in_kernel, "gate composed (kda_gate, then chunk_kda)":
             gate_composed, f"GVA (1 q/k head, {H} value heads)": gva, "GVA composed (q/k repeated)": gva_composed}
    return {name: time_impl(fn, True, T, repeats) for name, fn in impls.items()}


def peak_memory(name, T, backward):
    """Peak extra RSS (bytes) of one call, in a fresh process (this script with --memory-probe)."""
    probe = json.dumps({"name": name, "T": T, "backward": backward})
    # the same interpreter and environment as this process, so the same kda_hybrid
    res = subprocess.run([sys.executable, __file__, "--memory-probe", probe], capture_output=True, text=True,
                         timeout=600)
    if res.returncode:
        print(f"# memory probe for {name} failed: {res.stderr[-300:]}", file=sys.stderr)
        return None
    return int(res.stdout.strip().splitlines()[-1])


def memory_probe(spec: dict) -> int:
    """In the probe process: the kernel's high-water mark of one call (VmHWM, reset through /proc/self/clear_refs
    just before it) minus the resident size before it."""

    def status(key):
        with open("/proc/self/status") as f:
            return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) * 1024

    torch.set_num_threads(1)
    impl = implementations()[spec["name"]][0]
    xs = inputs(spec["T"], requires_grad=spec["backward"])
    out = impl(*inputs(64, requires_grad=spec["backward"]))  # warm-up: first-call allocations
    if spec["backward"]:
        out.sum().backward()
    del out
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    out = impl(*xs)
    if spec["backward"]:
        out.sum().backward()
    return status("VmHWM") - base


def main():
    p = benchmark_parser(__doc__, repeats=7)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--only", nargs="*", default=None, help="implementation names to run")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--no-options", action="store_true", help="skip the fla-option rows (in-kernel gate, GVA)")
    p.add_argument("--bwd-max-T", type=int, default=1024,
                   help="longest T at which the anchors' forward+backward is timed (ours: every T)")
    p.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_probe:
        print(json.dumps(memory_probe(json.loads(args.memory_probe))))
        return
    report = Report(args)
    peak = matmul_gflops()
    report.print(f"# CPU fp32 matmul (1024^3, {args.threads} thread(s)): {peak:.1f} GFLOP/s; "
                 f"B={B} H={H} K={K} V={V}, fp32, {args.threads} thread(s), median of {args.repeats}")
    results = {"matmul_gflops": peak, "T": {}}
    for T in args.T:
        rows = time_all(T, args.repeats, args.only, args.bwd_max_T)
        anchors = {n: r for n, r in rows.items() if not n.startswith("ours")}
        best_f = min((r[0] for r in anchors.values()), default=None)
        best_fb = min((r[1] for r in anchors.values() if r[1] is not None), default=None)
        report.print(f"\n## T={T}\n")
        report.print("| implementation | fwd ms | fwd vs fastest anchor | fwd+bwd ms | fwd+bwd vs fastest anchor "
                     "| peak extra MB (fwd) |")
        report.print("|---|---|---|---|---|---|")
        results["T"][T] = {}
        for name, (t_f, t_fb) in rows.items():
            mem = None if args.no_memory else peak_memory(name, T, False)
            fb = "n/a" if t_fb is None else f"{t_fb * 1e3:.0f}"
            r_f = f"{best_f / t_f:.1f}x" if best_f else "-"
            r_fb = f"{best_fb / t_fb:.1f}x" if (best_fb and t_fb) else "-"
            m = "-" if mem is None else f"{mem / 2**20:.0f}"
            report.print(f"| {name} | {t_f * 1e3:.1f} | {r_f} | {fb} | {r_fb} | {m} |")
            results["T"][T][name] = {"fwd_s": t_f, "fwd_bwd_s": t_fb, "peak_extra_bytes": mem}
        ours = rows.get("ours (torch chunked)")
        if ours:
            gf = kda_flops(T) / ours[0] / 1e9
            line = f"\nours: {gf:.1f} GFLOP/s forward = {gf / peak:.0%} of the measured matmul rate"
            results["T"][T]["ours_fwd_gflops"] = gf
            if ours[1] is not None:
                gfb = kda_flops(T, backward=True) / ours[1] / 1e9
                line += f"; {gfb:.1f} GFLOP/s forward+backward = {gfb / peak:.0%}"
                results["T"][T]["ours_fwd_bwd_gflops"] = gfb
            report.print(line)
        if not args.no_options:
            opts = option_rows(T, args.repeats)
            report.print("\n| fla option vs composed (torch path) | fwd ms | fwd+bwd ms |\n|---|---|---|")
            for name, (t_f, t_fb) in opts.items():
                fb = "n/a" if t_fb is None else f"{t_fb * 1e3:.0f}"
                report.print(f"| {name} | {t_f * 1e3:.1f} | {fb} |")
            results["T"][T]["options"] = {n: {"fwd_s": f, "fwd_bwd_s": fb} for n, (f, fb) in opts.items()}
    report.write(results)


if __name__ == "__main__":
    main()
