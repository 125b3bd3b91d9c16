"""Push a KDA hybrid checkpoint (weights, modeling code, tokenizer, model card) to the Hugging Face Hub.

    python examples/push_to_hub.py --model ./my-checkpoint --repo-id your-name/my-kda-model [--private]
    python examples/push_to_hub.py --model ./my-checkpoint --repo-id your-name/my-kda-model --dry-run
    python examples/push_to_hub.py --tiny --repo-id your-name/tiny-kda --dry-run   # a random tiny model

Log in first (`hf auth login`, or HF_TOKEN). The repo then loads anywhere, without this package:

    AutoModelForCausalLM.from_pretrained("your-name/my-kda-model", trust_remote_code=True)

`--dry-run` saves into a temporary folder exactly what `push_to_hub` would upload and lists it (files, sizes);
it makes no network request. HF_ENDPOINT points the push at another Hub (a local one in our tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kda_hybrid  # noqa: F401 - registers the classes, so save_pretrained writes auto_map and copies the code
from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
from kda_hybrid.checkpoint_kda_hybrid import write_model_card


def tiny_model() -> KDAHybridForCausalLM:
    """A random 4-layer model (3 KDA + 1 MLA, MoE): for trying the flow, not for text."""
    config = KDAHybridConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        linear_num_heads=2, linear_head_dim=32, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    return KDAHybridForCausalLM(config).eval()


def load(args):
    if args.tiny:
        model = tiny_model()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True, dtype="auto")
    tokenizer = None
    source = args.tokenizer or args.model
    if source is not None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as err:  # a folder with weights only
            if args.tokenizer:
                raise
            print(f"no tokenizer in {source} ({type(err).__name__}); pushing the model only", file=sys.stderr)
    return model, tokenizer


def save(model, tokenizer, folder: str, max_shard_size: str):
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def dry_run(model, tokenizer, args):
    with tempfile.TemporaryDirectory() as folder:
        save(model, tokenizer, folder, args.max_shard_size)
        write_model_card(model.config, folder, model_id=args.repo_id)  # the card push_to_hub uploads
        files = sorted(os.listdir(folder))
        sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in files}
        width = max(map(len, files))
        for name in files:
            print(f"  {name:<{width}}  {sizes[name]:>14,} B")
        total = sum(sizes.values())
        visibility = "private" if args.private else "public unless the namespace defaults to private"
        print(f"would upload {len(files)} files, {total:,} bytes, to {args.repo_id} ({visibility})")


def push(model, tokenizer, args):
    # push_to_hub saves into a temporary folder (weights, config, code, generation config, README.md card)
    # and commits it; the tokenizer goes in a second commit.
    commit = model.push_to_hub(args.repo_id, private=args.private, max_shard_size=args.max_shard_size,
                               commit_message=args.commit_message)
    print(f"model: {commit.commit_url}" if hasattr(commit, "commit_url") else f"model: {commit}")
    if tokenizer is not None:
        commit = tokenizer.push_to_hub(args.repo_id, private=args.private, commit_message="Upload tokenizer")
        print(f"tokenizer: {commit.commit_url}" if hasattr(commit, "commit_url") else f"tokenizer: {commit}")
    print(f'load with: AutoModelForCausalLM.from_pretrained("{args.repo_id}", trust_remote_code=True)')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="checkpoint folder or Hub repo id to push")
    what.add_argument("--tiny", action="store_true", help="push a random tiny model instead")
    parser.add_argument("--tokenizer", help="tokenizer folder or repo id (default: the --model source)")
    parser.add_argument("--repo-id", required=True, help="destination, e.g. your-name/my-kda-model")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--max-shard-size", default="5GB", help="shard the safetensors above this size")
    parser.add_argument("--commit-message", default="Upload KDA hybrid model")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    args = parser.parse_args(argv)

    model, tokenizer = load(args)
    if args.dry_run:
        dry_run(model, tokenizer, args)
    else:
        push(model, tokenizer, args)


if __name__ == "__main__":
    main()
