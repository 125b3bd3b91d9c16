"""This checkout's model against the same model at an earlier git revision, interleaved in one process (1 thread,
fp32, the 6.5M shape of kda_hybrid.bench.shapes with the same weights): prefill = one forward of a T-token prompt with a
cache, decode = median of --steps single-token forwards on that cache, alternating old and new every round so that
drift hits both alike. Prints min and median per side and the median of the per-round ratios new / old.

    python benchmarks/ab_revision.py --rev 95509b5                       # T = 256 and 4096, 10 rounds
    python benchmarks/ab_revision.py --rev HEAD~3 --contexts 256 --rounds 40
    python benchmarks/ab_revision.py --rev 3ffbc00 --count    # aten ops and Python calls per decode step

--count measures what a busy machine cannot blur: the tensor ops (each a dispatch, microseconds on CPU) and the
Python function calls of one decode step, old against new, and the ops whose counts differ.

The old package comes from `git archive <rev> kda_hybrid` into a temporary folder, imported under another name;
nothing is installed or written in the repository.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from io import BytesIO
from pathlib import Path

import torch

from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.bench.shapes import TINY_6P5M

ROOT = Path(__file__).resolve().parents[1]


def old_package(rev: str, where: Path):
    """kda_hybrid as of `rev`, imported as kda_hybrid_at_rev from `where`."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kda_hybrid"], check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(tar.stdout)) as t:
        t.extractall(where, filter="data")
    package = where / "kda_hybrid_at_rev"
    (where / "kda_hybrid").rename(package)
    spec = importlib.util.spec_from_file_location("kda_hybrid_at_rev", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its relative imports resolve through it
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def measure(model, ids, steps):
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    cache, tok, times = out.cache, out.logits[:, -1:].argmax(-1), []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(tok, cache=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
        cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    return prefill, statistics.median(times)


@torch.no_grad()
def count_step(model, ids) -> tuple[Counter, int]:
    """(aten op -> calls, Python function calls) of one decode step after a prefill of `ids` and two steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    for _ in range(2):
        cache = model(tok, cache=cache, use_cache=True, logits_to_keep=1).cache
    with Ops() as ops:
        model(tok, cache=cache, use_cache=True, logits_to_keep=1)
    calls = [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        model(tok, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        sys.setprofile(None)
    return ops.calls, calls[0]


def print_counts(old, new, ids):
    (old_ops, old_py), (new_ops, new_py) = count_step(old, ids), count_step(new, ids)
    print("| per decode step | old | new | new - old |")
    print("|---|---|---|---|")
    print(f"| aten ops | {sum(old_ops.values())} | {sum(new_ops.values())} | "
          f"{sum(new_ops.values()) - sum(old_ops.values()):+d} |")
    print(f"| Python function calls | {old_py} | {new_py} | {new_py - old_py:+d} |")
    differ = {op: new_ops[op] - old_ops[op] for op in sorted(set(old_ops) | set(new_ops)) if old_ops[op] != new_ops[op]}
    print("ops whose count differs (new - old):", ", ".join(f"{op} {d:+d}" for op, d in differ.items()) or "none")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare against")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 4096])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--count", action="store_true", help="count ops and Python calls per decode step instead of timing")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old_pkg = old_package(args.rev, Path(tmp))
        torch.manual_seed(0)
        new = KDAHybridForCausalLM(KDAHybridConfig(**TINY_6P5M)).eval()
        old = old_pkg.KDAHybridForCausalLM(old_pkg.KDAHybridConfig(**TINY_6P5M)).eval()
        old.load_state_dict(new.state_dict())
        if args.count:
            ids = torch.randint(3, TINY_6P5M["vocab_size"], (1, args.contexts[0]),
                                generator=torch.Generator().manual_seed(0))
            print(f"# this checkout against {args.rev}: one decode step after {args.contexts[0]} tokens")
            return print_counts(old, new, ids)
        print(f"# this checkout against {args.rev}: {args.rounds} interleaved rounds, {args.threads} thread(s), fp32")
        print("| context | what | old min / median ms | new min / median ms | new / old, median of rounds |")
        print("|---|---|---|---|---|")
        for T in args.contexts:
            ids = torch.randint(3, TINY_6P5M["vocab_size"], (1, T), generator=torch.Generator().manual_seed(T))
            for m in (old, new):
                measure(m, ids, 2)  # warm-up
            runs = {"old": [], "new": []}
            for _ in range(args.rounds):
                for name, m in (("old", old), ("new", new)):
                    runs[name].append(measure(m, ids, args.steps))
            for i, what in enumerate(("prefill", "decode")):
                o, n = ([r[i] * 1e3 for r in runs[k]] for k in ("old", "new"))
                ratio = statistics.median(b / a for a, b in zip(o, n))
                print(f"| {T} | {what} | {min(o):.2f} / {statistics.median(o):.2f} | "
                      f"{min(n):.2f} / {statistics.median(n):.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
