"""Figures of docs/training.md from two runs of examples/train.py (the hybrid and its all-attention twin).

    python examples/training_report.py --data out/data/stdlib --runs out/runs/hybrid out/runs/full \\
        --names "KDA hybrid" "all-MLA twin" --plot docs/training_loss.png --json docs/training_metrics.json

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

from kda_hybrid.training import load_tokens, loss_sum, make_batch, num_rows, target_count

CONTEXTS = (1024, 8192, 32768)


def read_log(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@torch.no_grad()
def cache_bytes(model, vocab_size: int) -> dict:
    """{tokens: bytes} from memory_report() after real prefills of 1024 and 2048 tokens, extended to CONTEXTS."""
    reports = {}
    for n in (1024, 2048):
        ids = torch.randint(3, vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        reports[n] = model(ids, use_cache=True).cache.memory_report()
    fixed, per_token = reports[1024]["kda_state_bytes"], reports[1024]["kv_bytes_per_token_per_sequence"]
    for n, r in reports.items():  # the model behaves as the extension assumes
        assert r["kda_state_bytes"] == fixed and r["attention_kv_bytes"] == per_token * n, r
    return {"kda_state_bytes": fixed, "kv_bytes_per_token": per_token,
            **{str(n): fixed + per_token * n for n in CONTEXTS}}


@torch.no_grad()
def run_metrics(run: Path, data: Path, seq_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final", trust_remote_code=True, dtype=torch.float32).eval()
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    meta = json.loads((data / "meta.json").read_text())
    tokens = load_tokens(data / "val.bin")
    n_rows = num_rows(tokens, seq_len)
    total, count = 0.0, 0
    for i in range(0, n_rows, 8):
        batch = make_batch(tokens, range(i, min(i + 8, n_rows)), seq_len, meta["bos_token_id"])
        total += float(loss_sum(model, batch))
        count += target_count(batch)
    train_log, val_log = read_log(run)
    args = json.loads((run / "args.json").read_text())
    return {
        "layers": "".join("A" if t == "full_attention" else "k" for t in cfg.layer_types),
        "params": n_params, "params_without_embeddings": n_params - embed,
        "steps": train_log[-1]["step"], "train_tokens": train_log[-1]["tokens"],
        "wall_s": train_log[-1]["elapsed_s"], "final_train_loss_avg20": sum(r["loss"] for r in train_log[-20:]) / 20,
        "val_loss_in_loop_fp32": val_log[-1]["val_loss"] if val_log else None,
        "val_loss_saved_weights": total / count, "val_ppl_saved_weights": math.exp(total / count),
        "val_targets": count, "save_dtype": args["save_dtype"],
        "cache_bytes": cache_bytes(model, cfg.vocab_size),
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
