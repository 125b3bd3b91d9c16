"""The 6.5M-parameter model (benchmarks/shapes.py) against transformers' native KimiLinearForCausalLM with
the same weights, on CPU: forward of 8192 tokens, and decode ms/token at 256 and 4096 tokens of context.

    python benchmarks/bench_model.py                 # 1 thread, as docs/architecture.md §7's anchors
    python benchmarks/bench_model.py --threads 2 --forward-tokens 4096

fla is blocked in this process so the native model runs its PyTorch fallbacks (with fla installed it binds
Triton kernels that crash on CPU tensors); our model never needs fla.
"""

from __future__ import annotations

import argparse
import importlib.abc
import statistics
import sys
import time
from pathlib import Path


class _BlockFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fla", "causal_conv1d"):
            raise ImportError(f"{name} blocked for the native CPU fallback")
        return None


sys.meta_path.insert(0, _BlockFla())
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from transformers import KimiLinearForCausalLM  # noqa: E402

from kda_hybrid import KDAHybridCache, KDAHybridForCausalLM  # noqa: E402
from shapes import tiny_6p5m  # noqa: E402


def native_twin(ours: KDAHybridForCausalLM) -> KimiLinearForCausalLM:
    """transformers' native model with our weights (original Kimi names; transformers renames on load)."""
    import tempfile

    from safetensors.torch import save_file

    cfg = ours.config.to_kimi_linear_dict()
    with tempfile.TemporaryDirectory() as d:
        import json

        Path(d, "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, f"{d}/model.safetensors",
                  metadata={"format": "pt"})
        native = KimiLinearForCausalLM.from_pretrained(d, dtype=torch.float32)
    return native.eval()


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--forward-tokens", type=int, default=8192)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--skip-native", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = KDAHybridForCausalLM(tiny_6p5m()).eval()
    n_params = sum(p.numel() for p in ours.parameters())
    models = {"ours": (ours, lambda: KDAHybridCache(ours.config))}
    if not args.skip_native:
        native = native_twin(ours)
        models["transformers native"] = (native, lambda: None)
    ids = torch.randint(3, ours.config.vocab_size, (1, args.forward_tokens), generator=torch.Generator().manual_seed(1))
    print(f"# {n_params / 1e6:.2f}M-parameter KDA hybrid (6 KDA + 2 MLA), fp32, {args.threads} thread(s), "
          f"torch {torch.__version__}")
    rows = {}
    for name, (model, make_cache) in models.items():
        fwd = time_forward(model, ids, repeats=1 if name != "ours" else 3)
        dec = {c: time_decode(model, c, args.steps, make_cache) for c in args.contexts}
        rows[name] = (fwd, dec)
    ctx_cols = " | ".join(f"decode ms/token @ {c}" for c in args.contexts)
    print(f"\n| model | forward {args.forward_tokens} tokens (s) | {ctx_cols} |")
    print("|---|---|" + "---|" * len(args.contexts))
    for name, (fwd, dec) in rows.items():
        print(f"| {name} | {fwd:.2f} | " + " | ".join(f"{dec[c] * 1e3:.1f}" for c in args.contexts) + " |")
    if "transformers native" in rows:
        (f_o, d_o), (f_n, d_n) = rows["ours"], rows["transformers native"]
        print(f"\nforward: ours {f_n / f_o:.1f}x faster than native (target >= 5x)")
        for c in args.contexts:
            print(f"decode @ {c}: ours {d_n[c] / d_o[c]:.1f}x faster than native")
    d_o = rows["ours"][1]
    lo, hi = min(args.contexts), max(args.contexts)
    print(f"ours: decode @ {hi} / decode @ {lo} = {d_o[hi] / d_o[lo]:.2f} (target <= 1.15)")


if __name__ == "__main__":
    main()
