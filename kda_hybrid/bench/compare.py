"""Side-by-side model timing that the benchmarks share: a model as measured (`Contestant`), prefill and per-token
decode on the model's own cache (`measure`), every contestant against a baseline at every context in one process
(`versus_llama`: interleaved runs, ratios with their spread) and the target lines (`report_targets`).

    from kda_hybrid.bench.compare import Contestant, report_targets, versus_llama

    runs = versus_llama(report, [ours, baseline], baseline, args, title="Against ...")  # args: contexts, repeats, steps
    report_targets(report, runs, "ours", baseline.name, args.contexts, {256: {"decode": 1.0}})
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kda_hybrid.bench.report import Report


@dataclass
class Contestant:
    """A model as measured: `step(input_ids [B, 1], cache)` runs one decode forward (default: the model itself).
    A variant of the same model (a compiled decode step, another cache dtype) is another Contestant; every
    table and ratio below is built from the list main() assembles."""

    name: str
    model: torch.nn.Module
    step: Callable | None = None

    def decode_step(self, tok, cache):
        fn = self.step if self.step is not None else self.model
        return fn(tok, cache=cache, use_cache=True, logits_to_keep=1)


def prompt(vocab_size: int, tokens: int) -> torch.Tensor:
    return torch.randint(3, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens))  # [1, T]


@torch.no_grad()
def measure(c: Contestant, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """(prefill seconds of `ids` [1, T] in one forward with a cache, median seconds of `steps` greedy decode
    forwards on that cache)."""
    t0 = time.perf_counter()
    out = c.model(ids, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    cache, tok = out.cache, out.logits[:, -1:].argmax(-1)  # [1, 1]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = c.decode_step(tok, cache)
        times.append(time.perf_counter() - t0)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return prefill, statistics.median(times)


@torch.no_grad()
def time_forward(model, ids, repeats) -> float:
    """Fastest of `repeats` forwards of `ids` without a cache, seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        times.append(time.perf_counter() - t0)
    return min(times)


def spread(values: list[float]) -> str:
    """'median [min-max]' of ratios; the median alone for one run."""
    med = statistics.median(values)
    return f"{med:.2f}" if len(values) == 1 else f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]"


def versus_llama(report: Report, contestants: list[Contestant], baseline: Contestant, args, title=None) -> dict:
    """Section 1: every contestant against `baseline` at every context; returns the raw runs. title: the section's
    heading (default: this script's same-size Llama)."""
    names = [c.name for c in contestants]
    runs = {c.name: {n: [] for n in args.contexts} for c in contestants}  # name -> context -> [(prefill, decode)]
    for c in contestants:  # warm-up: lazy initialisation, first-call allocations
        measure(c, prompt(c.model.config.vocab_size, 64), 2)
    for _ in range(args.repeats):
        for n in args.contexts:
            for c in contestants:
                runs[c.name][n].append(measure(c, prompt(c.model.config.vocab_size, n), args.steps))
    others = [c.name for c in contestants if c is not baseline]
    title = title or (f"Against a same-size Llama (transformers {type(baseline.model).__name__}, "
                      "kda_hybrid.bench.shapes.llama_twin_6p5m)")
    report.print(f"\n## {title}: median of {args.repeats} run(s), ratios with their [min-max] over runs; below 1: "
                 f"ours is faster\n")
    cols = ([f"prefill ms: {n}" for n in names] + [f"prefill {n} / {baseline.name}" for n in others]
            + [f"decode ms/token: {n}" for n in names] + [f"decode {n} / {baseline.name}" for n in others])
    report.print("| context | " + " | ".join(cols) + " |")
    report.print("|---|" + "---|" * len(cols))
    for n in args.contexts:
        cells = []
        for which in (0, 1):  # 0: prefill, 1: decode
            cells += [f"{statistics.median(r[which] for r in runs[name][n]) * 1e3:.1f}" for name in names]
            base = runs[baseline.name][n]
            cells += [spread([r[which] / b[which] for r, b in zip(runs[name][n], base)]) for name in others]
        report.print(f"| {n} | " + " | ".join(cells) + " |")
    return runs


def report_targets(report: Report, runs: dict, ours: str, baseline: str, contexts: list[int],
                   targets: dict) -> None:
    """One line per target at the measured contexts: the median ratio over runs, met or not."""
    report.print("")
    for n in contexts:
        for which, limit in targets.get(n, {}).items():
            i = 0 if which == "prefill" else 1
            ratio = statistics.median(r[i] / b[i] for r, b in zip(runs[ours][n], runs[baseline][n]))
            speed = f"{1 / ratio:.2f}x faster" if ratio < 1 else f"{ratio:.2f}x slower"
            report.print(f"{which} @ {n}: {ours} / {baseline} {ratio:.2f} ({speed}); target <= {limit:.2f}: "
                         f"{'met' if ratio <= limit else 'NOT met'}")
