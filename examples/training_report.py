"""Figures of docs/training.md from two runs of examples/train.py (the hybrid and its all-attention twin).

    python examples/training_report.py --data out/data/stdlib --runs out/runs/hybrid out/runs/full \\
        --names "KDA hybrid" "all-MLA twin" \\
        --plot docs/records/stdlib-training/training_loss.png --json docs/records/stdlib-training/training_metrics.json

For each run: parameters (total and without the embedding and LM head), validation loss / perplexity of the
saved `final/` checkpoint on every full row of val.bin (the loop's own figure is in log.jsonl), and cache bytes at
1K / 8K / 32K tokens: `memory_report()` after a real 1024-token and 2048-token prefill, checked to be fixed
(KDA) plus exactly linear (attention), then extended linearly to 8K and 32K. Plus the loss-curve PNG.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kda_hybrid.train.data import SingleProcess, cache_bytes_at, evaluate, load_tokens

CONTEXTS = (1024, 8192, 32768)


def read_log(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@torch.no_grad()
def run_metrics(run: Path, data: Path, seq_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final", trust_remote_code=True, dtype=torch.float32).eval()
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    meta = json.loads((data / "meta.json").read_text())
    val_loss, count = evaluate(SingleProcess(), model, load_tokens(data / "val.bin"), seq_len=seq_len,
                               micro_batch_size=8, bos_id=meta["bos_token_id"])
    model.eval()
    train_log, val_log = read_log(run)
    args = json.loads((run / "args.json").read_text())
    return {
        "layers": "".join("A" if t == "full_attention" else "k" for t in cfg.layer_types),
        "params": n_params, "params_without_embeddings": n_params - embed,
        "steps": train_log[-1]["step"], "train_tokens": train_log[-1]["tokens"],
        "wall_s": train_log[-1]["elapsed_s"], "final_train_loss_avg20": sum(r["loss"] for r in train_log[-20:]) / 20,
        "val_loss_in_loop_fp32": val_log[-1]["val_loss"] if val_log else None,
        "val_loss_saved_weights": val_loss, "val_ppl_saved_weights": math.exp(val_loss),
        "val_targets": count, "save_dtype": args["save_dtype"],
        "cache_bytes": cache_bytes_at(model, CONTEXTS),
    }


def plot(runs: list[Path], names: list[str], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for run, name, color in zip(runs, names, ("tab:blue", "tab:orange")):
        train_log, val_log = read_log(run)
        steps = [r["step"] for r in train_log]
        losses = [r["loss"] for r in train_log]
        smooth, acc = [], None
        for x in losses:  # EMA over ~10 steps: per-step losses of 2K-token batches are noisy
            acc = x if acc is None else 0.9 * acc + 0.1 * x
            smooth.append(acc)
        ax.plot(steps, losses, color=color, alpha=0.2, linewidth=0.8)
        ax.plot(steps, smooth, color=color, linewidth=1.6, label=f"{name}: train (EMA)")
        ax.plot([r["step"] for r in val_log], [r["val_loss"] for r in val_log], "o--", color=color,
                markersize=4, label=f"{name}: validation")
    ax.set_xlabel("step (4 rows x 512 tokens)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("Python stdlib, 6.5M-shape models, same data and steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--runs", type=Path, nargs=2, required=True)
    p.add_argument("--names", nargs=2, default=["KDA hybrid", "all-MLA twin"])
    p.add_argument("--plot", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    plot(args.runs, args.names, args.plot)
    metrics = {}
    for run, name in zip(args.runs, args.names):
        seq_len = json.loads((run / "args.json").read_text())["seq_len"]
        metrics[name] = run_metrics(run, args.data, seq_len)
    args.json.write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
