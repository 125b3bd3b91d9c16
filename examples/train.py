"""Train a KDA hybrid LM from scratch, or fine-tune one, on packed documents.

    python examples/prepare_data.py --out data/stdlib                 # corpus + tokenizer (once)
    python examples/train.py --data data/stdlib --out runs/hybrid --steps 600
    python examples/train.py --data data/stdlib --out runs/full --steps 600 --all-attention   # the twin
    python examples/train.py --data data/mine --model checkpoints/kda-hybrid-stdlib --out runs/ft --lr 3e-4
    torchrun --nproc_per_node 2 examples/train.py ...                 # DDP (gloo on CPU, nccl on GPU)
    torchrun --nproc_per_node 2 examples/train.py --fsdp ...          # FSDP2 (torch fully_shard), CPU or GPU
    accelerate launch --use_fsdp ... examples/train.py ...           # accelerate's FSDP (GPU), any `accelerate config`

Batches: the token stream of `--data` (documents as <|bos|> text <|eos|>, see prepare_data.py) is cut into rows of
`--seq-len` tokens; a row holds several documents end to end, marked by position_ids that restart at 0 at every
<|bos|>. The model turns that into varlen KDA (`cu_seqlens`) and a block-diagonal attention mask, and the first
token of each document is never a target, so nothing crosses a document boundary: neither state nor loss.

One step = `--batch-size` rows (the global batch, split over processes, then into micro-batches of
`--micro-batch-size` rows with gradient accumulation). The loss is the sum of token losses divided by the number
of target tokens in the whole global batch, counted from the data on every process, so 1, 2 or N processes and
any accumulation give the same gradient (up to float summation order). The learning-rate schedule is a
function of the step (warmup then cosine), so resuming needs only the step.

`--fsdp` shards parameters, gradients and optimizer state over the processes with torch's FSDP2 (`fully_shard`:
one unit per decoder layer, the embeddings, final norm and head in the root unit); it needs a distributed launch
(torchrun), works on CPU (gloo) and GPU (nccl), and its checkpoints are sharded (torch.distributed.checkpoint).
Without it, the model goes through `accelerator.prepare`: DDP, or whatever `accelerate config` chose.

Outputs in `--out`: `log.jsonl` (train loss every step, validation loss/perplexity every `--eval-every`),
`checkpoint/` (model + optimizer, every `--save-every` steps and at the end, for `--resume`) and `final/`
(save_pretrained: safetensors in `--save-dtype`, remote code, tokenizer, generation_config; a full, unsharded
state dict also after FSDP).
"""

from __future__ import annotations

import argparse
import json

import torch

from kda_hybrid.train.data import missing_inputs
from kda_hybrid.train.loop import add_arguments, fit, trained_tokens


def build_model(args, meta: dict):
    """The model to train: `--model`'s checkpoint, else the 6.5M shape with `--config-json` overrides."""
    if args.model:  # fine-tune: the checkpoint's own code and config
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype=torch.float32)
    from kda_hybrid import KDAHybridForCausalLM
    from kda_hybrid.bench.shapes import tiny_6p5m

    over = {"vocab_size": meta["vocab_size"], "bos_token_id": meta["bos_token_id"],
            "eos_token_id": meta["eos_token_id"], "pad_token_id": meta["pad_token_id"]}
    over.update(json.loads(args.config_json) if args.config_json else {})
    if args.all_attention:
        over["layer_types"] = ["full_attention"] * over.get("num_hidden_layers", tiny_6p5m().num_hidden_layers)
    config = tiny_6p5m(**over)
    torch.manual_seed(args.seed)
    return KDAHybridForCausalLM(config)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="fine-tune this checkpoint (default: train kda_hybrid.bench.shapes.tiny_6p5m)")
    p.add_argument("--config-json", help='overrides of the 6.5M shape, e.g. \'{"num_hidden_layers": 4}\'')
    p.add_argument("--all-attention", action="store_true", help="every layer full attention (the twin)")
    args = add_arguments(p).parse_args(argv)
    missing = missing_inputs(data=[("--data", args.data)])  # --model may be a Hub repo id
    if missing:
        p.error("; ".join(missing))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.inherited_tokens = trained_tokens(args.model) if args.model else 0
    return fit(args, lambda meta: build_model(args, meta))


if __name__ == "__main__":
    main()
