"""CPU engines side by side on the same checkpoint, in one process, 1 thread each (--threads): ours (eager, and with
--compiled a torch.compile'd forward), llama.cpp on the GGUF file `--to gguf` writes (f32 weights, f32 KV cache;
skipped with a note when llama_cpp is not installed: scripts/install_llama_cpp.sh), transformers' native
kimi_linear (fla blocked, its PyTorch fallback; only at contexts <= --native-max, it is slow), and the bandwidth
floor of a decode step measured in the same run (the weights' bytes over this machine's single-thread
matrix-vector read rate).

    python benchmarks/bench_cpu_engines.py                                   # shipped 6.7M, 256 and 4K tokens
    python benchmarks/bench_cpu_engines.py --model smollm2 --contexts 256 4096 16384 --out results.md
    python benchmarks/bench_cpu_engines.py --model shipped k3 --contexts 256 --compiled --cpu-layout

Models: `shipped` and `k3` are checkpoints/kda-hybrid-stdlib and checkpoints/kda-k3-stdlib; `smollm2` is a 179M
Kimi Linear model of SmolLM2-135M's shape (hidden 576, 30 layers kkA, 9 MLA and 9 KDA heads of 64, MLP 1536,
vocabulary 49,152), random weights (speed only). Per context: prefill = one forward over the whole prompt (median of
--repeats); decode = per-step time of --decode greedy steps after it, one token at a time through the cache
(median, and best); each context also reports how far llama.cpp's logits over the prompt's last 256 positions are
from ours and how many of the greedy tokens agree (both decode their own argmax). Ratios are ours / llama.cpp.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.conversion import convert

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = {"shipped": ROOT / "checkpoints" / "kda-hybrid-stdlib", "k3": ROOT / "checkpoints" / "kda-k3-stdlib"}
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, layer_types="kkA",
    linear_num_heads=9, linear_head_dim=64, attention_type="mla", num_attention_heads=9, kv_lora_rank=128,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


# prompt logits compared with llama.cpp's: the last positions only (all of a 16K prompt's, 16K x 49,152 floats on
# each side, ran the 24 GiB machine out of memory)
AGREEMENT_TAIL = 256


def model_folder(name: str, work: Path) -> Path:
    """A checkpoint folder for `name` (the 179M shape is built here with random weights and the shipped tokenizer)."""
    if name in CHECKPOINTS:
        return CHECKPOINTS[name]
    from transformers import AutoTokenizer

    shape = dict(SMOLLM2_SHAPE)
    pattern = shape.pop("layer_types")
    layer_types = ["full_attention" if pattern[i % len(pattern)] == "A" else "linear_attention"
                   for i in range(shape["num_hidden_layers"])]
    torch.manual_seed(0)
    model = KDAHybridForCausalLM(KDAHybridConfig(**shape, layer_types=layer_types)).eval()
    folder = work / name
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(CHECKPOINTS["shipped"]).save_pretrained(folder)
    return folder


def prompt_ids(n: int, vocab: int) -> list[int]:
    """`n` token ids: the shipped tokenizer's encoding of standard-library source, repeated as needed (every id
    is below 2048, so valid for every model here)."""
    import inspect
    import json as json_module

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHECKPOINTS["shipped"])
    ids = tok(inspect.getsource(json_module.decoder) + inspect.getsource(json_module.encoder)).input_ids
    ids = (ids * (n // len(ids) + 1))[:n]
    assert max(ids) < vocab
    return ids


def read_rate(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a single-thread fp32 matrix-vector product over a matrix far larger than the caches."""
    w = torch.randn(mib * 2**20 // 4 // 4096, 4096)
    x = torch.randn(4096)
    torch.mv(w, x)
    best = min(_time(lambda: torch.mv(w, x)) for _ in range(repeats))
    return w.numel() * 4 / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def ours_times(forward, config, ids, steps: int, repeats: int) -> tuple[float, list[float], torch.Tensor, list]:
    """(median prefill s, per-step decode s, the prompt's last AGREEMENT_TAIL logits, greedy tokens) of a model
    forward through our cache."""
    from kda_hybrid import KDAHybridCache

    x = torch.tensor([ids])
    prefills, logits = [], None
    with torch.no_grad():
        for _ in range(repeats):
            cache = KDAHybridCache(config)
            start = time.perf_counter()
            out = forward(input_ids=x, cache=cache, use_cache=True, logits_to_keep=AGREEMENT_TAIL)
            prefills.append(time.perf_counter() - start)
            logits = out.logits
        tok, steps_s, tokens = out.logits[:, -1:].argmax(-1), [], []
        for _ in range(steps):
            tokens.append(int(tok))
            start = time.perf_counter()
            out = forward(input_ids=tok, cache=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            steps_s.append(time.perf_counter() - start)
    return statistics.median(prefills), steps_s, logits[0], tokens


def llama_times(llm, ids, steps: int, repeats: int) -> tuple[float, list[float], list]:
    prefills = []
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        prefills.append(time.perf_counter() - start)
    steps_s, tokens = [], []
    for _ in range(steps):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(tok)
        start = time.perf_counter()
        llm.eval([tok])
        steps_s.append(time.perf_counter() - start)
    return statistics.median(prefills), steps_s, tokens


def ms(steps: list[float]) -> str:
    return f"{1e3 * statistics.median(steps):.2f} (best {1e3 * min(steps):.2f})"


def main():
    p = benchmark_parser(__doc__, repeats=3)
    p.add_argument("--model", nargs="+", default=["shipped"], choices=[*CHECKPOINTS, "smollm2"])
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 4096])
    p.add_argument("--decode", type=int, default=32, help="decode steps per context (default 32)")
    p.add_argument("--compiled", action="store_true", help="also time a torch.compile'd forward (compiles first)")
    p.add_argument("--compiled-matvec", "--compiled-steps", action="store_true",
                   help="also a copy after prepare_cpu_decode(compiled=True) (compiled layer steps and row reductions)")
    p.add_argument("--cpu-layout", action="store_true",
                   help="also time the model after prepare_cpu_decode() (wide weights column-major)")
    p.add_argument("--native-max", type=int, default=256,
                   help="longest context transformers' native kimi_linear runs at (default 256)")
    args = p.parse_args()
    report = Report(args)
    try:
        from llama_cpp import Llama
    except ImportError:
        Llama = None
        report.print("# llama.cpp: not installed (scripts/install_llama_cpp.sh builds it); its columns are empty")
    rate = read_rate()
    report.print(f"# single-thread matrix-vector read rate, measured now: {rate / 1e9:.1f} GB/s")
    report.print("| model | context | engine | prefill s | decode ms/token, median (best) | vs llama.cpp decode | "
                 "floor ms | agreement |")
    report.print("|---|---|---|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for name in args.model:
            folder = model_folder(name, work)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
            weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
            floor_ms = 1e3 * weight_bytes / rate
            engines = {"ours eager": model}
            if args.cpu_layout:  # a second copy, its wide weights column-major (KDAHybridPreTrainedModel docs)
                laid = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                            dtype=torch.float32).eval()
                laid.prepare_cpu_decode()
                engines["ours eager, prepare_cpu_decode()"] = laid
            if args.compiled_matvec:  # a copy that decodes through the compiled layer steps
                fast = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                            dtype=torch.float32).eval()
                started = time.perf_counter()
                fast.prepare_cpu_decode(compiled=True)
                report.print(f"# {name}: prepare_cpu_decode(compiled=True) took {time.perf_counter() - started:.1f} s "
                             "(compiling; inductor's disk cache serves later processes)")
                engines["ours eager, prepare_cpu_decode(compiled=True)"] = fast
            if args.compiled:
                engines["ours compiled"] = torch.compile(model)
                if args.cpu_layout:
                    engines["ours compiled, prepare_cpu_decode()"] = torch.compile(laid)
            llm = None
            if Llama is not None:
                gguf = convert(folder, work / f"{name}.gguf", target="gguf", dtype="float32", progress=False,
                               overwrite=True)
                llm = Llama(str(gguf), n_ctx=max(args.contexts) + args.decode + 8, n_batch=512,
                            n_threads=args.threads, n_threads_batch=args.threads, logits_all=True, type_k=0,
                            type_v=0, verbose=False)
            native = None  # transformers' kimi_linear has no K3 (SiTU, AttnRes, ...): Kimi Linear models only
            if any(c <= args.native_max for c in args.contexts) and not model.config.uses_k3_features:
                from kda_hybrid.bench.native import native_twin

                native = native_twin(model)
            for context in args.contexts:
                ids = prompt_ids(context, model.config.vocab_size)
                results, ours_logits, ours_tokens = {}, None, None
                for label, fwd in engines.items():
                    prefill, steps, logits, tokens = ours_times(fwd, model.config, ids, args.decode, args.repeats)
                    results[label] = (prefill, steps)
                    if ours_logits is None:
                        ours_logits, ours_tokens = logits, tokens
                if native is not None and context <= args.native_max:
                    results["transformers native"] = native_times(native, ids, args.decode, args.repeats)
                agreement = ""
                if llm is not None:
                    prefill, steps, tokens = llama_times(llm, ids, args.decode, args.repeats)
                    results["llama.cpp"] = (prefill, steps)
                    theirs = np.array(llm.scores[len(ids) - len(ours_logits): len(ids)])
                    ref = ours_logits.numpy()
                    rel = float(np.abs(theirs - ref).max() / np.abs(ref).max())
                    same = next((i for i, (a, b) in enumerate(zip(tokens, ours_tokens)) if a != b), len(tokens))
                    agreement = f"prompt logits {rel:.1e} of scale; greedy tokens {same}/{len(tokens)} equal"
                base = statistics.median(results["llama.cpp"][1]) if "llama.cpp" in results else None
                for label, (prefill, steps) in results.items():
                    ratio = f"{statistics.median(steps) / base:.2f}x" if base else "-"
                    report.print(f"| {name} | {context} | {label} | {prefill:.3f} | {ms(steps)} | {ratio} | "
                                 f"{floor_ms:.2f} | {agreement if label == 'llama.cpp' else ''} |")
                    rows.append(dict(model=name, context=context, engine=label, prefill_s=prefill,
                                     decode_ms=1e3 * statistics.median(steps), decode_best_ms=1e3 * min(steps),
                                     floor_ms=floor_ms))
            del llm
    report.write({"read_rate_bytes_per_s": rate, "rows": rows})


def native_times(native, ids, steps: int, repeats: int) -> tuple[float, list[float]]:
    """transformers' native model through its own cache (generate's path): prefill, then one token a step."""
    x = torch.tensor([ids])
    prefills = []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            out = native(input_ids=x, use_cache=True)
            prefills.append(time.perf_counter() - start)
        past, tok, steps_s = out.past_key_values, out.logits[:, -1:].argmax(-1), []
        for _ in range(steps):
            start = time.perf_counter()
            out = native(input_ids=tok, cache=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            steps_s.append(time.perf_counter() - start)
    return statistics.median(prefills), steps_s


if __name__ == "__main__":
    main()
