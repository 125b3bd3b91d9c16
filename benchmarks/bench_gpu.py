"""KDA on one CUDA GPU, side by side: our Triton kernels vs fla's (`fla.ops.kda.chunk_kda`,
`fused_recurrent_kda`) and causal SDPA (flash attention) at the same shape. bf16 inputs, K = V = 128,
q/k L2 norm in the kernel, model-like gates g = logsigmoid(randn) (about -0.7 per token per channel).

    python benchmarks/bench_gpu.py            # B 1..8, H 16 and 32, T 2K..64K (capped by memory)
    python benchmarks/bench_gpu.py --quick    # a few shapes, about 3 minutes with compilation
    python benchmarks/bench_gpu.py --peak-bw-tbs 3.35   # HBM peak when the device is not in the table

Times are medians of CUDA-event-timed runs after warm-up. TFLOP/s for KDA use a model count of the chunked
algorithm (FLOPS_PER_TOKEN below; backward counted as 2x forward), for SDPA 4 B H T^2 D / 2 (causal).
Decode: one token for each of B sequences per step, state updated in place; bandwidth = state bytes read
and written (2 B H K V 4) per step over the step time, as a fraction of the device's HBM peak.
Writes --out (default benchmarks/results_gpu.md): the environment (command, versions), then the tables.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_hybrid.bench.report import Report, benchmark_parser

K = V = 128
BT = 64
# model FLOP count per token and head of the chunked forward: A_kk and A_qk (2 BT K: two lower-triangular
# BT x BT x K products), w and u (BT (K + V)), w S, the state update and q S (6 K V), A_qk v_new (BT V)
FLOPS_PER_TOKEN = 2 * BT * K + BT * (K + V) + 6 * K * V + BT * V

# HBM peak bandwidth in TB/s by device name (first match, lower case), for the decode roofline
PEAK_BW_TBS = [
    ("h200", 4.8), ("h100 pcie", 2.0), ("h100", 3.35), ("h800", 3.35), ("gh200", 4.0), ("b200", 8.0),
    ("a100-sxm4-80gb", 2.039), ("a100 80gb pcie", 1.935), ("a100", 1.555), ("l40s", 0.864), ("l4", 0.3),
    ("a10", 0.6), ("4090", 1.008), ("3090", 0.936),
]


def timeit(fn, warmup=3, reps=10):
    """Median milliseconds of `reps` CUDA-event-timed calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_inputs(B, T, H, requires_grad=False, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, V, device="cuda", generator=gen, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, device="cuda", generator=gen)).to(dtype)
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(dtype)
    xs = [q, k, v, g, beta]
    return [x.requires_grad_() for x in xs] if requires_grad else xs


def load_fla():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda import fused_recurrent_kda as fla_recurrent
        return fla_chunk, fla_recurrent
    except Exception as err:  # noqa: BLE001 - fla is optional: report and carry on without it
        print(f"fla unavailable ({err!r}); its columns are n/a")
        return None, None


def safe(fn):
    """Run a timing; a failure (OOM, missing kernel) becomes None and a one-line note."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        print(f"    failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
        torch.cuda.empty_cache()
        return None


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def ratio(a, b):
    return None if a is None or b is None else a / b


def chunk_row(B, H, T, with_backward, reps, fla_chunk) -> dict:
    """One chunked shape: ours, fla (when given) and causal SDPA timed on the same inputs. Its tensors live in this
    call's frame only, so they are freed when it returns."""
    from kda_hybrid import chunk_kda

    xs = make_inputs(B, T, H, requires_grad=with_backward)
    do = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    kw = dict(use_qk_l2norm_in_kernel=True)

    def ours():
        o, _ = chunk_kda(*xs, backend="triton", **kw)
        if with_backward:
            o.backward(do)

    def fla():
        o, _ = fla_chunk(*xs, **kw)
        if with_backward:
            o.backward(do)

    qs, ks, vs = (x.detach().transpose(1, 2).contiguous().requires_grad_(with_backward) for x in xs[:3])
    do_s = do.transpose(1, 2).contiguous()

    def sdpa():
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        if with_backward:
            o.backward(do_s)

    t_ours = safe(lambda: timeit(ours, reps=reps))
    t_fla = safe(lambda: timeit(fla, reps=reps)) if fla_chunk is not None else None
    t_sdpa = safe(lambda: timeit(sdpa, reps=reps))
    mult = 3 if with_backward else 1
    kda_flops = mult * B * T * H * FLOPS_PER_TOKEN
    sdpa_flops = mult * 4 * B * H * T * T * K / 2
    return dict(
        B=B, H=H, T=T, ours=t_ours, fla=t_fla, sdpa=t_sdpa, vs_fla=ratio(t_ours, t_fla),
        tflops=None if t_ours is None else kda_flops / t_ours / 1e9,
        sdpa_tflops=None if t_sdpa is None else sdpa_flops / t_sdpa / 1e9,
    )


def bench_chunk(shapes, with_backward, reps):
    fla_chunk, _ = load_fla()
    rows = []
    for B, H, T in shapes:
        print(f"chunk B={B} H={H} T={T}{' fwd+bwd' if with_backward else ''}", flush=True)
        row = chunk_row(B, H, T, with_backward, reps, fla_chunk)
        torch.cuda.empty_cache()  # the row's inputs and outputs are gone with chunk_row's frame
        rows.append(row)
        print(f"    ours {fmt(row['ours'])} ms  fla {fmt(row['fla'])} ms  sdpa {fmt(row['sdpa'])} ms  "
              f"ours/fla {fmt(row['vs_fla'], '.2f')}", flush=True)
    return rows


def decode_row(B, H, peak_tbs, reps, fla_recurrent) -> dict:
    """One decode shape: a step of B sequences, ours updating the state in place, fla (when given) returning it."""
    from kda_hybrid import fused_recurrent_kda

    q, k, v, g, beta = make_inputs(B, 1, H)
    state = torch.randn(B, H, K, V, device="cuda") * 0.1
    state_fla = state.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)

    def ours():
        fused_recurrent_kda(q, k, v, g, beta, initial_state=state, inplace_final_state=True, backend="triton", **kw)

    def fla():
        fla_recurrent(q, k, v, g, beta, initial_state=state_fla, **kw)

    with torch.no_grad():
        t_ours = safe(lambda: timeit(ours, warmup=10, reps=max(reps, 50)))
        t_fla = safe(lambda: timeit(fla, warmup=10, reps=max(reps, 50))) if fla_recurrent else None
    state_bytes = 2 * B * H * K * V * 4  # fp32 state read and written once per step
    bw = None if t_ours is None else state_bytes / (t_ours * 1e-3) / 1e12
    return dict(
        B=B, H=H, ours=t_ours, fla=t_fla, vs_fla=ratio(t_ours, t_fla),
        tok_s=None if t_ours is None else B / (t_ours * 1e-3),
        bw_tbs=bw, bw_frac=None if bw is None else bw / peak_tbs,
    )


def bench_decode(batches, heads, peak_tbs, reps):
    _, fla_recurrent = load_fla()
    rows = []
    for H in heads:
        for B in batches:
            print(f"decode B={B} H={H}", flush=True)
            row = decode_row(B, H, peak_tbs, reps, fla_recurrent)
            rows.append(row)
            print(f"    ours {fmt(row['ours'], '.4f')} ms ({fmt(row['tok_s'], '.0f')} tok/s, "
                  f"{fmt(row['bw_tbs'], '.2f')} TB/s = {fmt(row['bw_frac'], '.0%')} of peak)  "
                  f"fla {fmt(row['fla'], '.4f')} ms", flush=True)
    return rows


def peak_bandwidth(name: str, override: float | None) -> float:
    if override:
        return override
    low = name.lower()
    for key, tbs in PEAK_BW_TBS:
        if key in low:
            return tbs
    print(f"no HBM peak known for {name!r}; assuming 2.0 TB/s (pass --peak-bw-tbs)")
    return 2.0


def fits(B, H, T, budget_bytes, backward):
    """Bytes per token and head, fp32 unless said (K = V = 128, chunk 64). Forward: G, w (4 K each), A_kk, A_qk,
    Ai rows (3 x 4 x 64), u, v_new (4 V each), the per-chunk states (4 K V / 64), o (bf16) and autograd's fp32
    normalised q, k: about 5.1 KB. The Triton backward adds the recomputed states and their gradients
    (2 x 4 K V / 64), v_new, dv_new, dq, dk, dG, dA_qk, dA_kk and the bf16 input gradients: about 13 KB in all
    (the former torch-recompute backward needed about 28 KB)."""
    per = B * T * H * (13_000 if backward else 5_100)
    return per < budget_bytes


def markdown(device, peak, fwd, fwdbwd, dec) -> list[str]:
    lines = [
        "# KDA on GPU: our Triton kernels vs fla vs causal SDPA",
        "",
        f"Device: {device} (HBM peak {peak} TB/s).",
        "",
        "bf16 inputs, K = V = 128, q/k L2 norm in kernel, g = logsigmoid(randn). Median ms of CUDA-event timings.",
        "Our backward is Triton throughout (reverse state scan, per-chunk gradients, intra-chunk gated products).",
        "",
    ]
    for title, rows in (("Chunked forward", fwd), ("Chunked forward + backward", fwdbwd)):
        if not rows:
            continue
        lines += [f"## {title}", "",
                  "| B | H | T | ours ms | fla ms | ours/fla | SDPA ms | ours TFLOP/s | SDPA TFLOP/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['B']} | {r['H']} | {r['T']} | {fmt(r['ours'])} | {fmt(r['fla'])} | "
                         f"{fmt(r['vs_fla'], '.2f')} | {fmt(r['sdpa'])} | {fmt(r['tflops'], '.1f')} | "
                         f"{fmt(r['sdpa_tflops'], '.1f')} |")
        lines.append("")
    if dec:
        lines += ["## Decode (one token per sequence per step, state in place)", "",
                  "| B | H | ours ms/step | tokens/s | state TB/s | of HBM peak | fla ms/step | ours/fla |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in dec:
            lines.append(f"| {r['B']} | {r['H']} | {fmt(r['ours'], '.4f')} | {fmt(r['tok_s'], '.0f')} | "
                         f"{fmt(r['bw_tbs'], '.2f')} | {fmt(r['bw_frac'], '.0%')} | {fmt(r['fla'], '.4f')} | "
                         f"{fmt(r['vs_fla'], '.2f')} |")
        lines.append("")
    return lines


def main():
    ap = benchmark_parser(__doc__, repeats=10, out=Path(__file__).resolve().parent / "results_gpu.md",
                          repeats_help="CUDA-event-timed calls per shape (--quick: at most 5)")
    ap.add_argument("--quick", action="store_true", help="a few shapes (about 3 minutes with compilation)")
    ap.add_argument("--peak-bw-tbs", type=float, default=None, help="HBM peak in TB/s (default: by device name)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "for CPU numbers run benchmarks/bench_ops.py")
        sys.exit(1)
    report = Report(args)
    device = torch.cuda.get_device_name()
    peak = peak_bandwidth(device, args.peak_bw_tbs)
    budget = int(torch.cuda.get_device_properties(0).total_memory * 0.6)
    print(f"{device}: HBM peak {peak} TB/s, {budget / 2**30:.0f} GiB budget")

    if args.quick:
        # one head count: fla compiles and autotunes per H, which dominates a short run
        fwd_shapes = [(1, 16, 2048), (1, 16, 8192), (4, 16, 8192), (1, 16, 32768)]
        bwd_shapes = [(1, 16, 2048), (1, 16, 8192)]
        dec_batches, dec_heads = [1, 8, 64], [16]
        reps = min(args.repeats, 5)
    else:
        fwd_shapes = [(B, H, T) for H in (16, 32) for B in (1, 2, 4, 8)
                      for T in (2048, 4096, 8192, 16384, 32768, 65536)]
        bwd_shapes = [(B, H, T) for H in (16, 32) for B in (1, 4, 8) for T in (2048, 8192, 32768)]
        dec_batches, dec_heads = [1, 8, 32, 128, 256], [16, 32]
        reps = args.repeats
    fwd_shapes = [s for s in fwd_shapes if fits(*s, budget, backward=False)]
    bwd_shapes = [s for s in bwd_shapes if fits(*s, budget, backward=True)]

    t0 = time.time()
    fwd = bench_chunk(fwd_shapes, with_backward=False, reps=reps)
    fwdbwd = bench_chunk(bwd_shapes, with_backward=True, reps=max(3, reps // 2))
    dec = bench_decode(dec_batches, dec_heads, peak, reps)
    print(f"total {time.time() - t0:.0f} s")
    for line in markdown(device, peak, fwd, fwdbwd, dec):
        report.print(line)
    report.write({"device": device, "peak_bw_tbs": peak, "forward": fwd, "forward_backward": fwdbwd, "decode": dec})


if __name__ == "__main__":
    main()
