"""Figures of docs/records/stdlib-distillation/README.md: a Llama-architecture teacher, the hybrid converted from it
before and after each distillation stage, and a hybrid of the same shape trained from scratch on the distillation's
token budget.

    python examples/stdlib/distill_report.py --data out/data/stdlib \\
        --model teacher=out/runs/teacher/final --model converted=out/runs/student0 \\
        --model "stage 1"=out/runs/distill-1/final --model "stage 2"=out/runs/distill-2/final \\
        --model "from scratch"=out/runs/scratch280/final \\
        --stage-logs out/runs/distill-1 out/runs/distill-2 \\
        --plot docs/records/stdlib-distillation/distillation_loss.png \\
        --json docs/records/stdlib-distillation/distillation_metrics.json \\
        --samples docs/records/stdlib-distillation/distillation_samples.md --sample-from teacher "stage 2"

For each model: parameters, validation loss / perplexity on every full row of val.bin (the 12 held-out stdlib files;
kda_hybrid.train.data.evaluate, fp32, documents never see each other) and the inference cache of one sequence at
1K / 8K / 32K tokens (kda_hybrid.train.data.cache_bytes_at). Every model is read as a kda_hybrid checkpoint (the
teacher in the all-attention form it was trained in; its Llama export computes the same logits, which
kda_hybrid.conversion.to_attention.export_llama checks before writing). The plot shows both stages' training
losses against the step; the samples are the same prompts continued by the models named in --sample-from.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from kda_hybrid.train.data import SingleProcess, cache_bytes_at, evaluate, load_tokens

CONTEXTS = (1024, 8192, 32768)
PROMPTS = ("def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import os\n\n\ndef walk(top):\n")


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def metrics(model, data: Path, seq_len: int) -> dict:
    meta = json.loads((data / "meta.json").read_text())
    loss, targets = evaluate(SingleProcess(), model, load_tokens(data / "val.bin"), seq_len=seq_len,
                             micro_batch_size=8, bos_id=meta["bos_token_id"])
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    return {"layers": "".join("A" if t == "full_attention" else "k" for t in model.config.layer_types),
            "params": n_params, "val_loss": loss, "val_ppl": math.exp(loss), "val_targets": targets,
            "cache_bytes": cache_bytes_at(model, CONTEXTS)}


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def plot(stage_logs: list[Path], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    rows = read_log(stage_logs[0])
    steps = [r for r in rows if "loss" in r]
    axes[0].plot([r["step"] for r in steps], [r["attn_mse"] for r in steps], color="tab:blue")
    axes[0].set_title("stage 1: attention transfer (KDA layers only)")
    axes[0].set_ylabel("MSE to the teacher's attention output")
    axes[0].set_yscale("log")
    rows = read_log(stage_logs[1])
    steps = [r for r in rows if "loss" in r]
    for key, color in (("kl", "tab:orange"), ("ce", "tab:green")):
        axes[1].plot([r["step"] for r in steps], [r[key] for r in steps], color=color, alpha=0.8,
                     label={"kl": "KL to the teacher", "ce": "LM cross-entropy"}[key])
    val = [r for r in rows if "val_loss" in r]
    axes[1].plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color="tab:green",
                 label="validation cross-entropy")
    axes[1].set_title("stage 2: logit distillation + LM loss (whole student)")
    axes[1].set_ylabel("nats / token")
    axes[1].legend()
    for ax in axes:
        ax.set_xlabel("step (4 rows x 512 tokens)")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


@torch.no_grad()
def samples(models: dict, folder: Path, names: list[str], max_new_tokens: int = 96) -> str:
    """The same prompts continued by each named model, sampled as the shipped checkpoints' generation_config
    does (temperature 0.7, top-p 0.95, repetition penalty 1.1), seed 0 for every continuation; greedy decoding of
    models this small mostly repeats one line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = ["# Samples", "", f"{max_new_tokens} new tokens per prompt, sampled with temperature 0.7, top-p 0.95, "
           "repetition penalty 1.1, seed 0 (examples/stdlib/distill_report.py).", ""]
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        for name in names:
            torch.manual_seed(0)
            seq = models[name].generate(ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.7,
                                        top_p=0.95, top_k=0, repetition_penalty=1.1,
                                        pad_token_id=tok.pad_token_id)
            out += [f"**{name}**", "", "```python", tok.decode(seq[0], skip_special_tokens=True), "```", ""]
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--model", action="append", required=True, metavar="NAME=FOLDER",
                   help="a model to evaluate (repeat; order kept)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--stage-logs", type=Path, nargs=2, metavar=("STAGE1", "STAGE2"))
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--samples", type=Path)
    p.add_argument("--sample-from", nargs="*", default=[])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folders = {}
    for item in args.model:
        name, sep, folder = item.partition("=")
        if not sep or not Path(folder).is_dir():
            p.error(f"--model: expected NAME=FOLDER with an existing folder, got {item!r}")
        folders[name] = Path(folder)
    unknown = [n for n in args.sample_from if n not in folders]
    if unknown:
        p.error(f"--sample-from: {unknown} are not among the --model names {list(folders)}")
    if args.plot and not args.stage_logs:
        p.error("--plot needs --stage-logs")
    models = {name: load(folder) for name, folder in folders.items()}
    report = {name: {"folder": str(folders[name]), **metrics(m, args.data, args.seq_len)} for name, m in models.items()}
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    if args.plot:
        plot(args.stage_logs, args.plot)
    if args.samples:
        args.samples.write_text(samples(models, folders[args.sample_from[0]], args.sample_from) + "\n")


if __name__ == "__main__":
    main()
