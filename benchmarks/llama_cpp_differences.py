"""Where llama.cpp and we compute differently (docs/llama_cpp.md, "Known differences"), measured on small random
Kimi K3 models written `--to gguf`: max |llama.cpp - ours| over a prompt's logits, relative to their scale.

    python benchmarks/llama_cpp_differences.py

1. One epsilon: llama.cpp uses rms_norm_eps for KDA's q/k L2 norm and the MLA latent norms (the reference: 1e-6),
   so a model with rms_norm_eps = 1e-5 differs and one with 1e-6 does not.
2. Rounded activations: the same bf16-valued weights written as f32 and as bf16 (llama.cpp rounds activations to
   bf16 for bf16 weights), and MXFP4 experts against the same experts dequantised to f32 (activations rounded to 8
   bits), through 6 random layers and through 2.
Needs llama_cpp (scripts/install_llama_cpp.sh). 1 thread.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.conversion import convert
from kda_hybrid.layers_kda_hybrid import MXFP4Linear
from kda_hybrid.mxfp4_torch import dequantize_mxfp4

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "kda-hybrid-stdlib"
TEXT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'


def tiny_k3(layers: int, *, mxfp4: bool = False, **over) -> KDAHybridForCausalLM:
    """A random K3 of `layers` layers (every third MLA), 4 experts top 2 in a latent of 32 after one dense layer,
    AttnRes blocks of 2, norms and router bias random so that each one matters."""
    types = ["full_attention" if i % 3 == 2 or i == layers - 1 else "linear_attention" for i in range(layers)]
    config = KDAHybridConfig.kimi_k3(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, layer_types=types,
        linear_num_heads=2, linear_head_dim=16, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, attn_res_block_size=2 if layers > 2 else None,
        expert_quantization="mxfp4" if mxfp4 else None, pad_token_id=0, bos_token_id=1, eos_token_id=2, **over)
    torch.manual_seed(0)
    model = KDAHybridForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1, generator=gen)
            elif name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5, generator=gen)
        for m in model.modules():
            if isinstance(m, MXFP4Linear):  # random codes, scales near 2 ** -2
                m.weight_packed = torch.randint(0, 256, m.weight_packed.shape, dtype=torch.uint8, generator=gen)
                m.weight_scale = torch.randint(123, 128, m.weight_scale.shape, dtype=torch.uint8, generator=gen)
    return model


def dequantised(model: KDAHybridForCausalLM) -> KDAHybridForCausalLM:
    """The same model with its MXFP4 experts expanded to f32 weights."""
    config = KDAHybridConfig(**{**model.config.to_dict(), "expert_quantization": None})
    plain = KDAHybridForCausalLM(config).eval()
    state = model.state_dict()
    out = {}
    for name in plain.state_dict():
        if name in state:
            out[name] = state[name]
        else:
            stem = name.removesuffix("weight")
            out[name] = dequantize_mxfp4(state[stem + "weight_packed"], state[stem + "weight_scale"])
    plain.load_state_dict(out)
    return plain


def llama_logits(model, work: Path, name: str, dtype: str, ids: list[int], threads: int) -> np.ndarray:
    from llama_cpp import Llama

    folder = work / name
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    path = convert(folder, work / f"{name}.gguf", target="gguf", dtype=dtype, progress=False, overwrite=True)
    llm = Llama(str(path), n_ctx=256, logits_all=True, n_threads=threads, type_k=0, type_v=0, verbose=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def ours(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model.float()(torch.tensor([ids])).logits[0].numpy()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main():
    args = benchmark_parser(__doc__, repeats=1).parse_args()
    report = Report(args)
    ids = AutoTokenizer.from_pretrained(TOKENIZER)(TEXT).input_ids
    report.print("| case | compared | max diff / logit scale |")
    report.print("|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)

        def row(case, compared, value):
            report.print(f"| {case} | {compared} | {value:.1e} |")
            rows.append(dict(case=case, compared=compared, value=value))

        for eps in (1e-5, 1e-6):
            m = tiny_k3(6, rms_norm_eps=eps)
            row(f"6 layers, rms_norm_eps {eps:g}, f32", "llama.cpp vs ours",
                rel(llama_logits(m, work, f"eps{eps:g}", "float32", ids, args.threads), ours(m, ids)))
        m = tiny_k3(6, rms_norm_eps=1e-6).to(torch.bfloat16).float()  # bf16 values, held in f32
        f32 = llama_logits(m, work, "bf16-as-f32", "float32", ids, args.threads)
        bf16 = llama_logits(m, work, "bf16", "bfloat16", ids, args.threads)
        row("6 layers, bf16-valued weights", "llama.cpp bf16 file vs its f32 file", rel(bf16, f32))
        for layers in (6, 2):
            m = tiny_k3(layers, mxfp4=True, rms_norm_eps=1e-6)
            q = llama_logits(m, work, f"mxfp4-{layers}", "float32", ids, args.threads)
            plain = dequantised(m)
            f = llama_logits(plain, work, f"dequant-{layers}", "float32", ids, args.threads)
            row(f"{layers} layers, MXFP4 experts", "llama.cpp MXFP4 vs llama.cpp dequantised f32", rel(q, f))
            row(f"{layers} layers, MXFP4 experts", "ours vs llama.cpp dequantised f32", rel(f, ours(m, ids)))
    report.write({"rows": rows})


if __name__ == "__main__":
    main()
