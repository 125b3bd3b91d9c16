"""One packed training step (forward + backward) of the 6.5M shape (kda_hybrid.bench.shapes.tiny_6p5m), hybrid and
all-MLA twin, batched exactly as examples/train.py batches them (kda_hybrid.train.data): 4 rows x 512 tokens of a
prepare_data.py token stream, documents packed end to end (varlen KDA, per-document attention).

    python examples/prepare_data.py --out out/data/stdlib            # once
    python benchmarks/bench_train_step.py --data out/data/stdlib
    git worktree add /tmp/kda-old <commit>                             # A/B against another checkout:
    python benchmarks/bench_train_step.py --data out/data/stdlib --repo /tmp/kda-old

Side by side in one run: the checkout's default packed path (attention per document under sdpa) against the same
with attention under a block-diagonal mask over the whole packed row (what eager uses), where the checkout has
both. `--repo` runs this script again with that checkout's kda_hybrid first on PYTHONPATH (it needs the
kda_hybrid.train.data and kda_hybrid.bench.shapes modules). Prints one JSON line of median seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import kda_hybrid
import kda_hybrid.modeling_kda_hybrid as modeling
from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.bench.shapes import tiny_6p5m
from kda_hybrid.train.data import load_tokens, loss_sum, make_batch, num_rows, rows_for_step


def rerun_with(repo: Path) -> int:
    """This command again, without --repo, with `repo` first on PYTHONPATH; returns its exit status."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--repo":
            skip = True
        elif not a.startswith("--repo="):
            argv.append(a)
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, __file__, *argv, "--expect-package", str(repo / "kda_hybrid")],
                          env={**os.environ, "PYTHONPATH": path}).returncode


def main():
    p = benchmark_parser(__doc__, repeats=6, repeats_help="timed steps per model (the first is dropped as warmup)")
    p.add_argument("--data", required=True, help="folder written by examples/prepare_data.py")
    p.add_argument("--repo", type=Path, help="time this checkout's kda_hybrid instead of the one imported here")
    p.add_argument("--expect-package", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.repo:
        sys.exit(rerun_with(args.repo.resolve()))
    package = Path(kda_hybrid.__file__).resolve().parent
    if args.expect_package and package != Path(args.expect_package).resolve():
        raise SystemExit(f"--repo: imported kda_hybrid from {package}, not from {args.expect_package}")
    if args.repeats < 2:
        raise SystemExit(f"--repeats must be at least 2 (the first step is warmup), got {args.repeats}")
    report = Report(args)
    tokens = load_tokens(Path(args.data) / "train.bin")
    n_rows = num_rows(tokens, 512)
    paths = {"default": None}  # the checkout's own packed path
    if hasattr(modeling, "PACKED_ATTENTION_MAX_DOCS"):  # it attends per document; also time the masked path
        paths = {"default": modeling.PACKED_ATTENTION_MAX_DOCS, "masked": 0}
    result = {"package": str(package), "threads": args.threads}
    for name, all_attention in (("hybrid", False), ("twin", True)):
        config = tiny_6p5m(vocab_size=2048)
        if all_attention:
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        torch.manual_seed(0)
        model = KDAHybridForCausalLM(config).train()
        times = {path: [] for path in paths}
        for step in range(args.repeats):
            batch = make_batch(tokens, rows_for_step(step, 4, n_rows, 0), 512, 1)
            for path, max_docs in paths.items():  # interleaved, so drift hits both alike
                if max_docs is not None:
                    modeling.PACKED_ATTENTION_MAX_DOCS = max_docs
                t0 = time.perf_counter()
                loss_sum(model, batch).backward()
                times[path].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
        for path, ts in times.items():
            result[f"{name}_{path}_s"] = round(statistics.median(ts[1:]), 3)
    report.print(json.dumps(result))
    report.write(result)


if __name__ == "__main__":
    main()
