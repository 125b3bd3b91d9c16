"""Where a decode step of SmolLM2-135M-Instruct and of its KDA students spends its time, on the real shape.

    python examples/smollm2/profile_smollm2_decode.py --student hybrid=out/smollm2-hybrid
    python examples/smollm2/profile_smollm2_decode.py --student hybrid=out/smollm2-hybrid --shared-kv --rounds 6

For each model: a prefill of --context tokens, then torch.profiler over --steps decode steps (the fastest of
--repeats such runs): self CPU time per step, split into aten::mm (the weight matrix-vector products) and
everything else, the number of ops per step, and the top ops. --shared-kv adds, for each student, a speed what-if:
its KDA layers' k_proj and v_proj cut to the teacher's KV heads and repeated to every query head after the
projection, as a KDA layer with GQA-style shared keys and values would compute (its outputs differ from the
student's: timing only), and times decode steps of every model interleaved over --rounds rounds. 1 thread, fp32,
batch 1; a benchmark, not a test.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from kda_hybrid.bench.report import Report, benchmark_parser


class _SharedHeads(nn.Module):
    """A projection to `groups` heads of `head_dim`, each repeated `repeat` times:
    [..., in] -> [..., groups * repeat * head_dim]."""

    def __init__(self, linear: nn.Linear, groups: int, repeat: int, head_dim: int):
        super().__init__()
        def first_of_group(t):  # [groups * repeat * K, ...] -> [groups * K, ...]: each group's first head
            return t.detach().unflatten(0, (groups, repeat, head_dim))[:, 0].flatten(0, 1)

        weight = first_of_group(linear.weight)
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None)
        with torch.no_grad():
            self.proj.weight.copy_(weight)
            if linear.bias is not None:
                self.proj.bias.copy_(first_of_group(linear.bias))
        self.groups, self.repeat, self.head_dim = groups, repeat, head_dim

    def forward(self, x):
        y = self.proj(x).unflatten(-1, (self.groups, 1, self.head_dim))
        return y.expand(*y.shape[:-2], self.repeat, self.head_dim).flatten(-3)


def shared_kv(student, kv_heads: int):
    """A copy of `student` whose KDA layers project k and v to `kv_heads` heads (see _SharedHeads)."""
    model = copy.deepcopy(student)
    for module in model.modules():
        if hasattr(module, "f_a_proj"):  # a KDA layer
            H, K = module.num_heads, module.head_dim
            if H % kv_heads:
                raise ValueError(f"{H} KDA heads do not split into {kv_heads} KV groups")
            module.k_proj = _SharedHeads(module.k_proj, kv_heads, H // kv_heads, K)
            module.v_proj = _SharedHeads(module.v_proj, kv_heads, H // kv_heads, K)
    return model


def _prefilled(model, context: int):
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    out = model(ids, use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def profile_decode(model, context: int, steps: int):
    from torch.profiler import ProfilerActivity, profile

    cache, tok = _prefilled(model, context)
    for _ in range(2):
        cache = model(tok, cache=cache, use_cache=True, logits_to_keep=1).cache
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            cache = model(tok, cache=cache, use_cache=True, logits_to_keep=1).cache
    return prof.key_averages()


@torch.no_grad()
def decode_ms(model, context: int, steps: int) -> float:
    cache, tok = _prefilled(model, context)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, cache=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return statistics.median(times) * 1e3


def main():
    parser = benchmark_parser(__doc__, repeats=3, repeats_help="profiled runs per model, the fastest kept")
    parser.add_argument("--student", action="append", required=True, metavar="NAME=FOLDER")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="decode steps per profile / timing (default 10)")
    parser.add_argument("--top", type=int, default=8, help="ops listed per model (default 8)")
    parser.add_argument("--shared-kv", action="store_true", help="add the students' shared-KV what-if (timed)")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds for --shared-kv")
    args = parser.parse_args()
    report = Report(args)
    from bench_smollm2 import load  # beside this script (imported here: tests import shared_kv alone)

    teacher = load()
    models = {"SmolLM2": teacher, **{n: load(f) for n, f in (s.split("=", 1) for s in args.student)}}
    if args.shared_kv:
        kv_heads = teacher.config.num_key_value_heads
        for name in list(models)[1:]:
            models[f"{name} shared-kv (what-if)"] = shared_kv(models[name], kv_heads)
    report.print(f"# decode steps after {args.context} tokens, {args.steps} profiled, {args.threads} thread(s), fp32")
    report.print("| model | parameters | self CPU ms / step | aten::mm ms | mm calls | other ms | ops / step |")
    report.print("|---|---|---|---|---|---|---|")
    tops = {}
    for name, model in models.items():
        # the least disturbed of --repeats runs: a fresh cache's growth (the teacher's KV concatenation
        # allocates every step) and the profiler's own start put milliseconds on some runs and not others
        ev = min((profile_decode(model, args.context, args.steps) for _ in range(args.repeats)),
                 key=lambda ev: sum(e.self_cpu_time_total for e in ev))
        total = sum(e.self_cpu_time_total for e in ev) / args.steps / 1e3
        mm = [e for e in ev if e.key == "aten::mm"]
        mm_ms = sum(e.self_cpu_time_total for e in mm) / args.steps / 1e3
        report.print(f"| {name} | {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M | {total:.2f} | "
                     f"{mm_ms:.2f} | {sum(e.count for e in mm) / args.steps:.0f} | {total - mm_ms:.2f} | "
                     f"{sum(e.count for e in ev) / args.steps:.0f} |")
        tops[name] = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:args.top]
    for name, top in tops.items():
        report.print(f"\n{name}, top ops (self CPU ms / step, calls / step): " + ", ".join(
            f"{e.key} {e.self_cpu_time_total / args.steps / 1e3:.2f} ({e.count / args.steps:.0f})" for e in top))
    if args.shared_kv:
        times = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                times[name].append(decode_ms(model, args.context, args.steps))
        report.print(f"\n# decode ms/token after {args.context} tokens, {args.rounds} interleaved rounds "
                     f"(median of {args.steps} steps each)")
        report.print("| model | min ms | median ms | / SmolLM2, median of rounds |")
        report.print("|---|---|---|---|")
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, times["SmolLM2"]))
            report.print(f"| {name} | {min(t):.2f} | {statistics.median(t):.2f} | {ratio:.3f} |")
    report.write()


if __name__ == "__main__":
    main()
