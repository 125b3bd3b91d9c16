"""Generate with a KDA hybrid model and report speed and cache memory.

    python examples/generate.py                          # the shipped checkpoint, checkpoints/kda-hybrid-stdlib
    python examples/generate.py --prompt "class Stack:" --max-new-tokens 96 --greedy
    python examples/generate.py --model path/or/repo     # any kda_hybrid checkpoint or Hub repo
    python examples/generate.py --random                 # a fresh 6.5M-parameter model (random weights)

A checkpoint is loaded through AutoModelForCausalLM(trust_remote_code=True), exactly as a user without this
package installed would load it, with its own tokenizer; sampling follows the checkpoint's generation_config
unless --greedy. Prints the text, tokens/s, and the cache memory report beside what an all-full-attention
model of the same shape would hold for the same tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, format_bytes

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "checkpoints" / "kda-hybrid-stdlib"


def full_attention_bytes(config, tokens: int, batch: int = 1) -> int:
    """KV bytes (fp32) of the same model with every layer full attention (same attention type and dims)."""
    per_token_layer = cache_bytes(config, "float32")["kv_per_token_per_layer"]
    return per_token_layer * config.num_hidden_layers * tokens * batch


def load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not args.random:
        path = args.model or DEFAULT_MODEL
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        except (OSError, ValueError):
            tokenizer = None
        return model.eval(), tokenizer
    from kda_hybrid import KDAHybridForCausalLM
    from kda_hybrid.bench.shapes import tiny_6p5m

    torch.manual_seed(args.seed)
    return KDAHybridForCausalLM(tiny_6p5m()).eval(), None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"checkpoint folder or Hub repo id (default: {DEFAULT_MODEL.name} of this repo)")
    p.add_argument("--random", action="store_true", help="a fresh random 6.5M model instead of a checkpoint")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--prompt-tokens", type=int, default=64, help="random prompt length when there is no tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of the generation_config's sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load(args)
    cfg = model.config
    if tokenizer is not None:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        gen = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(3, cfg.vocab_size, (1, args.prompt_tokens), generator=gen)
    n_params = sum(p.numel() for p in model.parameters())
    pattern = "".join("A" if t == "full_attention" else "k" for t in cfg.layer_types)
    print(f"model: {n_params / 1e6:.2f}M parameters, layers {pattern} (k = KDA, A = {cfg.attention_type.upper()})")

    torch.manual_seed(args.seed)
    kw = dict(max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, pad_token_id=cfg.pad_token_id)
    if args.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=None)
    if tokenizer is None:  # random weights: no end of text to stop at, so a fixed length to time
        kw["min_new_tokens"] = args.max_new_tokens
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, **kw)
    dt = time.perf_counter() - t0
    new = out.sequences[0, input_ids.shape[1]:]
    if tokenizer is not None:
        print("\n" + tokenizer.decode(out.sequences[0], skip_special_tokens=True) + "\n")
    else:
        print(f"\nprompt token ids ... -> {new.tolist()}\n")
    print(f"{len(new)} new tokens in {dt:.2f} s = {len(new) / dt:.1f} tokens/s (prefill of {input_ids.shape[1]} "
          "included)")

    report = out.cache.memory_report()
    tokens = report["tokens"]
    twin = full_attention_bytes(cfg, tokens)
    print(f"\ncache after {tokens} tokens:")
    print(f"  KDA states ({report['kda_layers']} layers, fixed size): {format_bytes(report['kda_state_bytes'])}")
    print(f"  attention KV ({report['attention_layers']} layers, "
          f"{report['kv_bytes_per_token_per_sequence']} B/token): {format_bytes(report['attention_kv_bytes'])}")
    print(f"  total: {format_bytes(report['total_bytes'])}")
    print(f"  an all-full-attention model of this shape would hold {format_bytes(twin)} now, "
          f"growing {format_bytes(full_attention_bytes(cfg, 1))}/token")
    for ctx in (8192, 131072):
        ours = report["kda_state_bytes"] + report["kv_bytes_per_token_per_sequence"] * ctx
        twin = full_attention_bytes(cfg, ctx)
        print(f"  at {ctx} tokens: ours {format_bytes(ours)} vs all-attention {format_bytes(twin)}")


if __name__ == "__main__":
    main()
