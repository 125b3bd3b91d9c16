"""Packed-document training pieces that examples/train.py, examples/prepare_data.py, the benchmarks and the tests
share: the token stream cut into rows, the packed loss, validation over processes, and the byte-level BPE builder.

    from kda_hybrid.train.data import load_tokens, loss_sum, make_batch, num_rows, rows_for_step, target_count

    tokens = load_tokens("data/stdlib/train.bin")                  # uint16 stream: <|bos|> text <|eos|> ...
    batch = make_batch(tokens, rows_for_step(0, 4, num_rows(tokens, 512), seed=0), 512, bos_id=1)
    (loss_sum(model, batch) / target_count(batch)).backward()      # mean over the batch's targets

A row holds several documents end to end; position_ids restart at 0 at every <|bos|>, which the model turns into
varlen KDA (`cu_seqlens`) and per-document attention, and the first token of each document is never a target, so
neither state nor loss crosses a document boundary (docs/training.md).

Not a module a checkpoint carries: nothing in the modeling code imports it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the label of a document's first token (and cross_entropy's default ignore_index)


def missing_inputs(*, data=(), models=(), files=()) -> list[str]:
    """What of a script's inputs is not on this machine, one line each (empty: all there). data: (flag, folder) pairs,
    prepare_data.py folders (their meta.json); models: (flag, path) pairs, checkpoint folders (config.json) or .gguf
    files; files: (flag, path) pairs. Scripts check before their first minute of work, and never download: a
    missing path is not looked up on the Hub."""
    def named(flag, path):  # "--data out/x", or "--model NAME=out/x" for a flag given as "--model NAME="
        return f"{flag}{'' if flag.endswith('=') else ' '}{path}"

    bad = [f"{named(flag, path)}: no prepare_data.py folder there (no meta.json)" for flag, path in data
           if not (Path(path) / "meta.json").is_file()]
    bad += [f"{named(flag, path)}: no checkpoint folder (with config.json) or .gguf file there" for flag, path in models
            if not ((Path(path) / "config.json").is_file() or Path(path).suffix == ".gguf" and Path(path).is_file())]
    bad += [f"{named(flag, path)}: no such file" for flag, path in files if not Path(path).is_file()]
    return bad


# ------------------------------------------------------------------------------------------------------
# Packed rows from a token stream
# ------------------------------------------------------------------------------------------------------


def load_tokens(path: str | Path) -> np.ndarray:
    """The uint16 token file `path` (written by examples/prepare_data.py), memory-mapped read-only."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def num_rows(tokens: np.ndarray, seq_len: int) -> int:
    """Full rows of `seq_len` tokens in `tokens`; the tail shorter than a row is dropped."""
    if not (isinstance(seq_len, int) and seq_len > 0):
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return len(tokens) // seq_len


def make_batch(tokens: np.ndarray, rows, seq_len: int, bos_id: int) -> dict[str, torch.Tensor]:
    """input_ids, position_ids (restarting at each `bos_id` and at each row start) and labels (the input ids, with
    IGNORE_INDEX where a document starts: that token is not predicted from the previous document), each [len(rows),
    seq_len], for the rows `rows` (indices of full rows of `tokens`)."""
    rows = [int(r) for r in rows]
    n = num_rows(tokens, seq_len)
    if not rows or min(rows) < 0 or max(rows) >= n:
        raise ValueError(f"rows must be a non-empty list of row indices in [0, {n}) ({len(tokens)} tokens / seq_len "
                         f"{seq_len}), got {rows[:8]}{' ...' if len(rows) > 8 else ''}")
    ids = np.stack([np.asarray(tokens[r * seq_len:(r + 1) * seq_len], dtype=np.int64) for r in rows])
    starts = ids == bos_id
    starts[:, 0] = True
    t = np.arange(seq_len)
    last_start = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    labels = np.where(starts, IGNORE_INDEX, ids)
    return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(t - last_start),
            "labels": torch.from_numpy(labels)}


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that are predicted: labels[:, 1:] that are not ignored (position t predicts token t + 1)."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def rows_for_step(step: int, batch_size: int, n_rows: int, seed: int) -> np.ndarray:
    """The global batch of `step`: consecutive slices of one fixed permutation of the rows per epoch, so a run
    resumed at `step` sees the same rows as an uninterrupted one."""
    if n_rows <= 0 or batch_size <= 0:
        raise ValueError(f"n_rows and batch_size must be positive, got n_rows={n_rows}, batch_size={batch_size}")
    out = []
    first = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(first + len(out), n_rows)
        perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out.extend(perm[offset:offset + batch_size - len(out)].tolist())
    return np.asarray(out)


def loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropies (fp32) over the batch's targets.

    The rows go in end to end as one row ([1, B * T]; each row starts a document, as its position_ids restart)
    and without attention_mask, so the model always takes its packed path: varlen KDA and per-document attention.
    Same result as B separate rows; on CPU it avoids the depthwise conv1d backward of the unpacked path, which
    costs up to 10x the whole rest of the step (measured at 0.9 s per call, [4, 256, 515]).
    """
    logits = model(input_ids=batch["input_ids"].reshape(1, -1), position_ids=batch["position_ids"].reshape(1, -1),
                   use_cache=False).logits
    labels = batch["labels"].reshape(1, -1)  # row starts are document starts: never targets across rows
    return F.cross_entropy(logits[0, :-1].float(), labels[0, 1:], ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(accelerator, model, tokens: np.ndarray, *, seq_len: int, micro_batch_size: int, bos_id: int,
             max_rows: int = 0) -> tuple[float, int]:
    """(mean loss per target, targets) over every full row of `tokens` (or the first `max_rows`), rows split over
    `accelerator`'s processes (anything with process_index, num_processes, device and reduce(tensor, "sum"), as
    accelerate's Accelerator), `micro_batch_size` rows per forward, in fp32 unless the caller autocasts.

    Under FSDP every forward is collective (and DDP may sync buffers in one), so every process runs the same
    number of them: one with no rows left forwards row 0 and drops its result."""
    model.eval()
    n = num_rows(tokens, seq_len)
    n = min(n, max_rows) if max_rows else n
    if n == 0:
        raise ValueError(f"evaluate: no full row of seq_len {seq_len} in {len(tokens)} tokens")
    total = torch.zeros(2, dtype=torch.float64)
    world = accelerator.num_processes
    mine = list(range(accelerator.process_index, n, world))
    forwards = math.ceil(math.ceil(n / world) / micro_batch_size)  # the same on every process
    for i in range(0, forwards * micro_batch_size, micro_batch_size):
        rows = mine[i:i + micro_batch_size]
        batch = make_batch(tokens, rows or [0], seq_len, bos_id)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        s = loss_sum(model, batch).double().item()
        if rows:
            total[0] += s
            total[1] += target_count(batch)
    total = accelerator.reduce(total.to(accelerator.device), "sum").cpu()
    model.train()
    return float(total[0] / total[1]), int(total[1])


class SingleProcess:
    """What `evaluate` needs of an accelerator, for one process on one device (reports and scripts)."""

    process_index, num_processes = 0, 1

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor


@torch.no_grad()
def cache_bytes_at(model, contexts=(1024, 8192, 32768)) -> dict:
    """Inference cache of one sequence: {"kda_state_bytes", "kv_bytes_per_token", "<n>": bytes at n tokens}, from
    memory_report() after real prefills of 1024 and 2048 tokens (checked to be fixed KDA state plus exactly linear
    attention KV), extended to `contexts`."""
    reports = {}
    for n in (1024, 2048):
        ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        reports[n] = model(ids, use_cache=True).cache.memory_report()
    fixed, per_token = reports[1024]["kda_state_bytes"], reports[1024]["kv_bytes_per_token_per_sequence"]
    for n, r in reports.items():  # the model behaves as the extension assumes
        if r["kda_state_bytes"] != fixed or r["attention_kv_bytes"] != per_token * n:
            raise AssertionError(f"cache is not fixed + linear in the context: {r}")
    return {"kda_state_bytes": fixed, "kv_bytes_per_token": per_token,
            **{str(n): fixed + per_token * n for n in contexts}}


# ------------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------------


def bpe_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str], bos: str):
    """A `tokenizers.Tokenizer`: byte-level BPE (any text round-trips) trained on `texts`, the special tokens at ids
    0, 1, ... in order, and encode() prepending `bos`. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if bos not in special_tokens:
        raise ValueError(f"bos must be one of special_tokens {special_tokens}, got {bos!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    assert [tok.token_to_id(t) for t in special_tokens] == list(range(len(special_tokens)))
    return tok


__all__ = [
    "IGNORE_INDEX", "bpe_tokenizer", "evaluate", "load_tokens", "loss_sum", "make_batch", "num_rows",
    "rows_for_step", "target_count",
]
