"""One packed training step (forward + backward) of the 6.5M shape (benchmarks/shapes.py), hybrid and all-MLA
twin, batched exactly as examples/train.py batches them: 4 rows x 512 tokens of a prepare_data.py token stream,
documents packed end to end (varlen KDA, per-document attention).

    python examples/prepare_data.py --out out/data/stdlib            # once
    python benchmarks/bench_train_step.py --data out/data/stdlib
    git worktree add /tmp/kda-old <commit>                             # A/B against another checkout:
    python benchmarks/bench_train_step.py --data out/data/stdlib --repo /tmp/kda-old

Side by side in one run: the checkout's default packed path (attention per document under sdpa) against the same
with attention under a block-diagonal mask over the whole packed row (what eager uses), where the checkout has
both. Prints one JSON line
of median seconds per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="folder written by examples/prepare_data.py")
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent),
                   help="checkout whose kda_hybrid and examples/train.py to time (default: this one)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per model (the first is dropped as warmup)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    repo = Path(args.repo).resolve()
    for sub in ("", "benchmarks", "examples"):
        sys.path.insert(0, str(repo / sub))
    import numpy as np
    import torch
    import train
    from shapes import tiny_6p5m

    import kda_hybrid.modeling_kda_hybrid as modeling
    from kda_hybrid import KDAHybridForCausalLM

    torch.set_num_threads(args.threads)
    tokens = train.load_tokens(Path(args.data) / "train.bin")
    n_rows = train.num_rows(tokens, 512)
    paths = {"default": None}  # the checkout's own packed path
    if hasattr(modeling, "PACKED_ATTENTION_MAX_DOCS"):  # it attends per document; also time the masked path
        paths = {"default": modeling.PACKED_ATTENTION_MAX_DOCS, "masked": 0}
    result = {"repo": str(repo), "threads": args.threads}
    for name, all_attention in (("hybrid", False), ("twin", True)):
        config = tiny_6p5m(vocab_size=2048)
        if all_attention:
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        torch.manual_seed(0)
        model = KDAHybridForCausalLM(config).train()
        times = {path: [] for path in paths}
        for step in range(args.steps):
            batch = train.make_batch(tokens, train.rows_for_step(step, 4, n_rows, 0), 512, 1)
            for path, max_docs in paths.items():  # interleaved, so drift hits both alike
                if max_docs is not None:
                    modeling.PACKED_ATTENTION_MAX_DOCS = max_docs
                t0 = time.perf_counter()
                train.loss_sum(model, batch).backward()
                times[path].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
        for path, ts in times.items():
            result[f"{name}_{path}_s"] = round(statistics.median(ts[1:]), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
