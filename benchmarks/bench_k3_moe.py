"""One Kimi K3 latent MoE layer, routed experts stored as MXFP4 (computed from the stored bytes) against the same
layer with bf16 experts (the same dequantised values), side by side in one process: resident expert bytes and
forward time, in bf16 activations, 1 thread (--threads). On CPU each used expert is dequantised per call; with
--device cuda the MXFP4 layer runs the fused Triton kernel (mxfp4_triton.py), and a third column times the same
layer expanding each used expert per call (MXFP4Linear.backend = "torch").

    python benchmarks/bench_k3_moe.py                       # decode (1 token) and prefill (256 tokens)
    python benchmarks/bench_k3_moe.py --experts 64 --out k3_moe.md
    python benchmarks/bench_k3_moe.py --device cuda --experts 64 --tokens 1 16 256 2048

Shape (default): K3's proportions scaled down: hidden 2048, latent 1024, expert width 768, top-8 of --experts,
2 shared experts. The bytes scale exactly with the expert count and sizes (checkpoint_kda_hybrid.expert_bytes
computes the released model's); the time is what one CPU core does at this shape.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from kda_hybrid import KDAHybridConfig
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.checkpoint_kda_hybrid import format_bytes
from kda_hybrid.layers_kda_hybrid import KDAHybridMoE, MXFP4Linear
from kda_hybrid.mxfp4_torch import dequantize_mxfp4


def layers(num_experts: int, seed: int = 0) -> tuple[KDAHybridMoE, KDAHybridMoE]:
    """(MXFP4 layer, bf16 layer) with identical weights: random MXFP4 bytes, and their exact bf16 expansion."""
    common = dict(vocab_size=64, hidden_size=2048, num_hidden_layers=2, linear_num_heads=2, linear_head_dim=64,
                  num_attention_heads=2, kv_lora_rank=32, num_experts=num_experts, num_experts_per_tok=8,
                  moe_intermediate_size=768, first_k_dense_replace=0)
    torch.manual_seed(seed)
    mx = KDAHybridMoE(KDAHybridConfig.kimi_k3(**common, expert_quantization="mxfp4")).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    for m in mx.modules():
        if isinstance(m, MXFP4Linear):
            m.weight_packed = torch.randint(0, 256, m.weight_packed.shape, dtype=torch.uint8, generator=gen)
            m.weight_scale = torch.randint(118, 124, m.weight_scale.shape, dtype=torch.uint8, generator=gen)
    dense = KDAHybridMoE(KDAHybridConfig.kimi_k3(**common)).to(torch.bfloat16)
    state = copy.deepcopy(mx.state_dict())
    for name in [n for n in state if n.endswith(".weight_packed")]:
        base = name.removesuffix(".weight_packed")
        state[base + ".weight"] = dequantize_mxfp4(state.pop(name), state.pop(base + ".weight_scale"), torch.bfloat16)
    dense.load_state_dict(state)
    return mx.eval(), dense.eval()


def expert_bytes(layer: KDAHybridMoE) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.experts.parameters(), *layer.experts.buffers()])


def median_ms(fn, repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def set_backend(layer: KDAHybridMoE, backend: str):
    for m in layer.modules():
        if isinstance(m, MXFP4Linear):
            m.backend = backend


def main():
    parser = benchmark_parser(__doc__, repeats=10)
    parser.add_argument("--experts", type=int, default=32, help="routed experts (default 32; K3 has 896)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256], help="tokens per forward")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = Report(args)
    mx, dense = (m.to(device) for m in layers(args.experts))
    b_mx, b_dense = expert_bytes(mx), expert_bytes(dense)
    report.print(f"routed experts ({args.experts}): MXFP4 {format_bytes(b_mx)}, bf16 {format_bytes(b_dense)} "
                 f"(MXFP4 / bf16 = {b_mx / b_dense:.3f}), on {device}")
    cuda = device.type == "cuda"
    report.print("| tokens | MXFP4 ms | bf16 ms | MXFP4 / bf16 | max abs diff |" +
                 (" MXFP4 expanded per call ms | fused / expanded |" if cuda else ""))
    report.print("|---|---|---|---|---|" + ("---|---|" if cuda else ""))
    rows = []
    for T in args.tokens:
        x = torch.randn(1, T, 2048, generator=torch.Generator().manual_seed(T)).to(device, torch.bfloat16)
        with torch.no_grad():
            diff = (mx(x).float() - dense(x).float()).abs().max().item()
            t_mx = median_ms(lambda x=x: mx(x), args.repeats, device)
            t_dense = median_ms(lambda x=x: dense(x), args.repeats, device)
            row = {"tokens": T, "mxfp4_ms": t_mx, "bf16_ms": t_dense, "max_abs_diff": diff}
            line = f"| {T} | {t_mx:.2f} | {t_dense:.2f} | {t_mx / t_dense:.2f} | {diff:.2e} |"
            if cuda:  # the same layer, each used expert expanded per call instead of the fused kernel
                set_backend(mx, "torch")
                row["mxfp4_expanded_ms"] = t_exp = median_ms(lambda x=x: mx(x), args.repeats, device)
                set_backend(mx, "auto")
                line += f" {t_exp:.2f} | {t_mx / t_exp:.2f} |"
        rows.append(row)
        report.print(line)
    report.write({"experts": args.experts, "mxfp4_bytes": b_mx, "bf16_bytes": b_dense, "rows": rows})


if __name__ == "__main__":
    main()
