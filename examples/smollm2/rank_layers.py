"""Which layers of a linearized student stay attention, chosen by measurement: in an all-KDA student (after stage 1),
restore each layer in turn to the teacher's own attention layer and measure the KL divergence from the teacher's
next-token distribution on training text; the layers whose restoration lowers it most stay attention.

    python -m kda_hybrid.conversion TEACHER.gguf out/smollm2/all-A --layer-types A      # the teacher, as a hybrid
    python -m kda_hybrid.conversion TEACHER.gguf out/smollm2/all-k --layer-types k      # then stage 1 on all-k
    python examples/smollm2/rank_layers.py --teacher out/smollm2/all-A --student out/smollm2/distill-1-k/final \\
        --data out/data/smollm2-chat --keep 10 --json ranking.json --write-student out/smollm2/student-ranked

--teacher is the teacher converted with every layer kept as attention (an exact copy of the teacher: it gives the
reference distribution and the attention layers to restore); --student has the same shape with every layer KDA.
Stage 1 fits each KDA layer to the teacher's own input and output of that layer, whatever the other layers are, so
a student with any placement is the all-KDA student with the chosen layers swapped back: --write-student saves the
one with the --keep best layers, ready for stage 2.

The text: --tokens tokens from the start of the data folder's `train.bin` (rows of --seq-len, packed documents kept
apart); the teacher's log-probabilities are computed once and held in memory (4 bytes x vocab per token).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from kda_hybrid.train.data import load_tokens, make_batch, missing_inputs, num_rows
from kda_hybrid.train.loop import TRAINED_TOKENS, trained_tokens

FULL, LINEAR = "full_attention", "linear_attention"
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "chat_template*", "vocab.*",
                   "merges.txt", "generation_config.json")


def load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()


def check_pair(teacher, student) -> None:
    t, s = teacher.config, student.config
    if set(t.layer_types) != {FULL}:
        raise SystemExit(f"--teacher: every layer must be attention (convert it with --layer-types A), got "
                         f"{t.layer_types.count(LINEAR)} KDA layers")
    if set(s.layer_types) != {LINEAR}:
        raise SystemExit(f"--student: every layer must be KDA (convert with --layer-types k), got "
                         f"{s.layer_types.count(FULL)} attention layers")
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "attention_type"):
        if getattr(t, key) != getattr(s, key):
            raise SystemExit(f"--teacher and --student differ in {key}: {getattr(t, key)} vs {getattr(s, key)}")


def batches(data: Path, tokens: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    meta = json.loads((data / "meta.json").read_text())
    ids = load_tokens(data / "train.bin")
    rows = min(num_rows(ids, seq_len), max(1, tokens // seq_len))
    return [make_batch(ids, [r], seq_len, meta["bos_token_id"]) for r in range(rows)]


@torch.no_grad()
def log_probs(model, batch) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return torch.log_softmax(out.logits.float(), -1)[0]


@torch.no_grad()
def mean_kl(model, data, reference: list[torch.Tensor]) -> float:
    """KL(teacher || model) per token, averaged over every position of `data`."""
    total, count = 0.0, 0
    for batch, ref in zip(data, reference):
        lp = log_probs(model, batch)
        total += float((ref.exp() * (ref - lp)).sum())
        count += ref.shape[0]
    return total / count


def with_attention(student, teacher, layers) -> None:
    """Swap the teacher's layers `layers` into the student (in place), the config's layer types with them."""
    types = list(student.config.layer_types)
    for i in layers:
        student.model.layers[i], teacher.model.layers[i] = teacher.model.layers[i], student.model.layers[i]
        types[i] = FULL if types[i] == LINEAR else LINEAR
    student.config.layer_types = types


def rank(teacher, student, data) -> dict:
    """KL of the all-KDA student and of the student with each single layer restored, ranked (largest gain first)."""
    reference = [log_probs(teacher, b) for b in data]
    base = mean_kl(student, data, reference)
    rows = []
    for i in range(student.config.num_hidden_layers):
        with_attention(student, teacher, [i])
        try:
            kl = mean_kl(student, data, reference)
        finally:
            with_attention(student, teacher, [i])  # swapped back: the same modules return
        rows.append({"layer": i, "kl": kl, "gain": base - kl})
        print(f"layer {i:3d}: KL {kl:.4f} (all-KDA {base:.4f}, gain {base - kl:+.4f})", flush=True)
    return {"tokens": sum(r.shape[0] for r in reference), "all_kda_kl": base,
            "layers": rows, "ranking": [r["layer"] for r in sorted(rows, key=lambda r: -r["gain"])]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", type=Path, required=True, help="the teacher converted with --layer-types A")
    p.add_argument("--student", type=Path, required=True, help="the all-KDA student (after stage 1)")
    p.add_argument("--data", type=Path, required=True, help="a prepare_data.py folder (its train.bin is read)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of text to measure on (default 8192)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--keep", type=int, default=None, help="attention layers of --write-student (default: a third)")
    p.add_argument("--json", type=Path, default=None, help="write the ranking here")
    p.add_argument("--write-student", type=Path, default=None, help="save the student with the --keep best layers")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    missing = missing_inputs(data=[("--data", args.data)], models=[("--teacher", args.teacher),
                                                                  ("--student", args.student)])
    if missing:
        p.error("; ".join(missing))
    if args.tokens < 1 or args.seq_len < 1:
        p.error("--tokens and --seq-len must be positive")
    if args.write_student is not None and args.write_student.exists():
        p.error(f"--write-student {args.write_student} exists; remove it or pick another folder")
    torch.set_num_threads(args.threads)
    teacher, student = load(args.teacher), load(args.student)
    check_pair(teacher, student)
    layers = student.config.num_hidden_layers
    keep = layers // 3 if args.keep is None else args.keep
    if not 0 <= keep <= layers:
        p.error(f"--keep must be in 0..{layers}")
    result = rank(teacher, student, batches(args.data, args.tokens, args.seq_len))
    chosen = sorted(result["ranking"][:keep])
    result.update(keep=keep, kept_layers=chosen,
                  layer_types="".join("A" if i in chosen else "k" for i in range(layers)),
                  teacher=str(args.teacher), student=str(args.student), data=str(args.data), seq_len=args.seq_len)
    print(f"keep {keep}: layers {chosen} -> {result['layer_types']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write_student is not None:
        with_attention(student, teacher, chosen)
        student.save_pretrained(args.write_student)
        for pattern in TOKENIZER_FILES:  # the student's tokenizer and chat template, as they are
            for path in args.student.glob(pattern):
                shutil.copyfile(path, args.write_student / path.name)
        (args.write_student / TRAINED_TOKENS).write_text(  # the training behind it: the stage-1 student's
            json.dumps({"tokens": trained_tokens(args.student)}) + "\n")
        print(f"{args.write_student}: the student with attention at {chosen}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
