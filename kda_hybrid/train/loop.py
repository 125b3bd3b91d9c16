"""The training loop of examples/train.py and examples/distill.py: packed batches, gradient accumulation, DDP
through accelerate or FSDP2 (`--fsdp`), bf16 autocast, checkpoints and `--resume`, validation, the final
`save_pretrained`. Not carried by checkpoints (modeling never imports it).

    fit(args, build_model)                       # next-token loss (training.loss_sum)
    fit(args, build_model, loss_fn=my_loss)      # any loss summed over the batch's tokens

`args` is the namespace of `add_arguments` (the options of examples/train.py). `build_model(meta)` builds the model
to train after the seeds are set (meta: the data folder's meta.json). `loss_fn(model, batch)` returns the loss
SUMMED over the batch's targets (a scalar tensor), or that and a dict of named parts (also sums) to log; the loop
divides by the number of target tokens in the global batch, so any number of processes and micro-batches give the
same gradient (up to float summation order). Parameters with requires_grad=False are not trained.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from .data import evaluate, load_tokens, loss_sum, make_batch, num_rows, rows_for_step, target_count


def lr_at(step: int, args) -> float:
    """Linear warmup over `warmup` steps, then cosine from lr down to lr * min_lr_ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def param_groups(model, weight_decay: float, lr_scale=None):
    """Weight decay on matrices only: not on norms, biases or the KDA decay parameters (A_log, dt_bias). `lr_scale`
    (parameter name -> factor, default 1 for every one): each group's learning rate is the schedule's times its
    factor (`lr_scale` in the group; the loop applies it every step)."""
    scales = [1.0] if lr_scale is None else []
    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = not (p.dim() < 2 or name.endswith(("A_log", "dt_bias")) or "norm" in name)
        scale = 1.0 if lr_scale is None else float(lr_scale(name))
        scales += [scale] * (scale not in scales)
        groups.setdefault((decay, scale), []).append(p)
    # without lr_scale: the decay and no-decay groups of every run so far, in that order, even when one is empty (a
    # resumed optimizer's groups must match)
    return [{"params": groups.get((decay, scale), []), "weight_decay": weight_decay if decay else 0.0,
             "lr_scale": scale} for scale in scales for decay in (True, False)
            if lr_scale is None or (decay, scale) in groups]


# ------------------------------------------------------------------------------------------------------
# FSDP2 (--fsdp): torch.distributed.fsdp.fully_shard, sharded checkpoints through torch.distributed.checkpoint
# ------------------------------------------------------------------------------------------------------


def shard_model(model, accelerator):
    """fully_shard each block the model names in `_no_split_modules` (the decoder layers), then the root (embeddings,
    final norm, head). Forward and backward all-gather one layer at a time; gradients are reduce-scattered (averaged
    over processes, as DDP does) and AdamW then keeps only its shard of the moments."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("--fsdp needs a distributed launch (torchrun --nproc_per_node N examples/train.py "
                         "--fsdp ...); this is a single process")
    if accelerator.distributed_type.name == "FSDP":
        raise ValueError("--fsdp and an accelerate FSDP config both shard the model: use one of them")
    model.to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in blocks]
    if not units:
        raise ValueError(f"--fsdp: no module of the classes in {type(model).__name__}._no_split_modules={blocks}")
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def save_sharded(model, optimizer, path: Path):
    """Every process writes its shards of the model and of the optimizer state (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_sharded(model, optimizer, path: Path):
    """Reads a save_sharded checkpoint back into the sharded model and optimizer (collective; any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(accelerator, model, fsdp: bool) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict on the main process (collective under FSDP; others get an empty dict)."""
    if not fsdp:
        return accelerator.get_state_dict(model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


TRAINED_TOKENS = "trained_tokens.json"


def trained_tokens(folder) -> int:
    """Training tokens behind the model in `folder`, over every run that led to it (batch x seq_len per step):
    its trained_tokens.json (save_final writes it); for a `step-N` or `final` folder of a run from before that file,
    the run's args.json (N or its steps, times batch x seq_len, plus what its starting model had); 0 for a folder no
    run wrote (a conversion)."""
    folder = Path(folder)
    if (folder / TRAINED_TOKENS).is_file():
        return int(json.loads((folder / TRAINED_TOKENS).read_text())["tokens"])
    run = folder.parent / "args.json"
    if not run.is_file() or not (folder.name == "final" or folder.name.startswith("step-")):
        return 0
    args = json.loads(run.read_text())
    step = args["steps"] if folder.name == "final" else int(folder.name.removeprefix("step-"))
    start = args.get("student") or args.get("model")
    return step * args["batch_size"] * args["seq_len"] + (trained_tokens(start) if start else 0)


def save_final(accelerator, model, model_cls, args, out: Path, step: int):
    """save_pretrained of the trained weights (full state dict, also under FSDP), tokenizer, generation config, and
    the training tokens behind them (TRAINED_TOKENS: this run's `step` steps plus `args.inherited_tokens`, what
    the starting model had)."""
    from transformers import AutoTokenizer, GenerationConfig

    state = full_state_dict(accelerator, model, args.fsdp)
    if not accelerator.is_main_process:
        return
    unwrapped = accelerator.unwrap_model(model)
    if hasattr(unwrapped, "merge_and_unload"):  # a peft model (LoRA): the base model with the adapters merged, in a
        unwrapped = copy.deepcopy(unwrapped).merge_and_unload()  # copy: merging in place unloads them from the run
        state = unwrapped.state_dict()
    fresh = model_cls(unwrapped.config)  # the model's own class: fully_shard swaps in an FSDP subclass
    fresh.load_state_dict({k: v.float() for k, v in state.items()})
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.save_dtype]
    fresh.to(dtype)  # A_log and dt_bias stay fp32 (the model keeps them so through .to)
    fresh.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.95, top_k=50, repetition_penalty=1.1, max_new_tokens=128,
        bos_token_id=fresh.config.bos_token_id, eos_token_id=fresh.config.eos_token_id,
        pad_token_id=fresh.config.pad_token_id,
    )
    fresh.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(args.data).save_pretrained(out)
    tokens = getattr(args, "inherited_tokens", 0) + step * args.batch_size * args.seq_len
    (out / TRAINED_TOKENS).write_text(json.dumps({"tokens": tokens, "step": step}) + "\n")


def save_milestone(accelerator, model, model_cls, args, folder: Path, step: int):
    """save_final into `folder` through a sibling `.tmp` folder renamed when complete: a folder that exists is whole
    (a kill while writing leaves only the .tmp, which the next save replaces)."""
    tmp = folder.with_name(folder.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    save_final(accelerator, model, model_cls, args, tmp, step)
    if accelerator.is_main_process:
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    accelerator.wait_for_everyone()


def gradient_sync(accelerator, model, sync: bool, fsdp: bool):
    """Reduce gradients over processes only on the last micro-batch of a step (accumulate locally before)."""
    if fsdp:
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else accelerator.no_sync(model)


def read_log(path: Path, upto_step: int) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] <= upto_step]


def resumable_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint under `out` (trainer_state.json is written last, so its presence means
    complete): `checkpoint`, or, after a kill between the renames that put a new one in place, `checkpoint.tmp`
    (the new one) or `checkpoint.old` (the previous one). None when there is none."""
    best, best_step = None, -1
    for name in ("checkpoint", "checkpoint.tmp", "checkpoint.old"):
        state = out / name / "trainer_state.json"
        if state.exists():
            step = json.loads(state.read_text())["step"]
            if step > best_step:
                best, best_step = out / name, step
    return best


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX). Without them PyTorch emulates bf16
    products: on an AMD EPYC without AVX-512, a 512 x 576 by 576 x 1,536 product took 730 ms in bf16 against 5.8 ms
    in fp32 (2 threads), where a CPU with AVX512-BF16 ran it 2.3x faster than fp32."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe is not None and probe() for probe in probes)


def precision_warning(mixed: str, on_cpu: bool, native_bf16: bool) -> str | None:
    """The warning for bf16 autocast on a CPU that only emulates bf16 products (None when there is none)."""
    if mixed != "bf16" or not on_cpu or native_bf16:
        return None
    return ("warning: --mixed-precision bf16 on a CPU without AVX512-BF16 or AMX: its bf16 matrix products are "
            "emulated, up to 100x slower than fp32 (kda_hybrid.train.loop.cpu_has_native_bf16); --mixed-precision no "
            "trains faster here")


def fit(args, build_model, *, loss_fn=None, lr_scale=None) -> dict:
    """Train `build_model(meta)` as the module docstring says (`lr_scale`: param_groups'); returns {step, log,
    params}."""
    loss_fn = loss_fn or loss_sum
    if args.threads:
        torch.set_num_threads(args.threads)
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() and not args.cpu else "no"
    # Autocast here rather than Accelerator(mixed_precision=...), which wraps forward for evaluation too; weights,
    # gradients and optimizer state stay fp32, and validation runs in fp32.
    accelerator = Accelerator(mixed_precision="no", cpu=args.cpu)
    set_seed(args.seed)
    world, rank = accelerator.num_processes, accelerator.process_index
    if args.batch_size % (world * args.micro_batch_size):
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of processes x --micro-batch-size "
                         f"= {world} x {args.micro_batch_size}")
    out = Path(args.out)
    data = Path(args.data)
    meta = json.loads((data / "meta.json").read_text())
    bos_id = meta["bos_token_id"]
    train_tokens, val_tokens = load_tokens(data / "train.bin"), load_tokens(data / "val.bin")
    n_rows = num_rows(train_tokens, args.seq_len)

    model = build_model(meta)
    if args.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2 name
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    model_cls = type(model.get_base_model()) if hasattr(model, "get_base_model") else type(model)  # peft: the base
    if args.fsdp:
        model = shard_model(model, accelerator)  # before the optimizer, which must hold the sharded parameters
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay, lr_scale), lr=args.lr, betas=(0.9, 0.95),
                                  eps=1e-8)
    if not args.fsdp:
        model, optimizer = accelerator.prepare(model, optimizer)

    ckpt = out / "checkpoint"
    start = 0
    found = resumable_checkpoint(out) if args.resume else None
    if found is not None:
        if args.fsdp:
            load_sharded(model, optimizer, found)
        else:
            accelerator.load_state(str(found))
        start = json.loads((found / "trainer_state.json").read_text())["step"]
    log_path = out / "log.jsonl"
    log = read_log(log_path, start) if args.resume else []
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        log_path.write_text("".join(json.dumps(r) + "\n" for r in log))
        (out / "args.json").write_text(json.dumps(vars(args), indent=1) + "\n")
        engine = "FSDP2" if args.fsdp else accelerator.distributed_type.name
        accelerator.print(f"{n_params / 1e6:.2f}M parameters, {world} process(es) ({engine}), {n_rows} rows of "
                          f"{args.seq_len}, steps {start}..{args.steps}, mixed precision {mixed}")
        warning = precision_warning(mixed, accelerator.device.type == "cpu", cpu_has_native_bf16())
        if warning:
            accelerator.print(warning)

    def write_log(record):
        log.append(record)
        if accelerator.is_main_process:
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def save_checkpoint(step):
        accelerator.wait_for_everyone()
        tmp = out / "checkpoint.tmp"
        if accelerator.is_main_process and tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while saving
        accelerator.wait_for_everyone()
        if args.fsdp:
            save_sharded(model, optimizer, tmp)
        else:
            accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")  # last: tmp is complete
            # the old checkpoint goes only once the new one is in place: a kill between the renames leaves one
            # complete checkpoint that resumable_checkpoint finds (it had deleted the old one first)
            old = out / "checkpoint.old"
            if old.exists():
                shutil.rmtree(old)
            if ckpt.exists():
                ckpt.rename(old)
            tmp.rename(ckpt)
            if old.exists():
                shutil.rmtree(old)
        accelerator.wait_for_everyone()

    per_rank = args.batch_size // world
    t0 = time.perf_counter()
    deadline = t0 + args.max_minutes * 60 if args.max_minutes else None
    bar = tqdm(total=args.steps, initial=start, disable=not accelerator.is_main_process, dynamic_ncols=True)
    step = start
    while step < args.steps:
        rows = rows_for_step(step, args.batch_size, n_rows, args.seed)
        global_targets = target_count(make_batch(train_tokens, rows, args.seq_len, bos_id))
        mine = rows[rank * per_rank:(rank + 1) * per_rank]
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        local = torch.zeros((), dtype=torch.float64)
        local_parts: dict[str, torch.Tensor] = {}
        micro = [mine[i:i + args.micro_batch_size] for i in range(0, per_rank, args.micro_batch_size)]
        for j, micro_rows in enumerate(micro):
            batch = make_batch(train_tokens, micro_rows, args.seq_len, bos_id)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            with gradient_sync(accelerator, model, j == len(micro) - 1, args.fsdp):
                with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=mixed == "bf16"):
                    s, parts = _split(loss_fn(model, batch))
                # DDP/FSDP average gradients over processes; times `world` makes that the global-batch mean
                accelerator.backward(s * (world / global_targets))
            local += s.detach().double().cpu()
            for name, value in parts.items():
                local_parts[name] = local_parts.get(name, 0) + value.detach().double().cpu()
        if args.grad_clip:
            accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss = float(accelerator.reduce(local.to(accelerator.device), "sum").cpu()) / global_targets
        elapsed = time.perf_counter() - t0
        record = {"step": step, "loss": round(loss, 5), "lr": lr, "tokens": step * args.batch_size * args.seq_len,
                  "elapsed_s": round(elapsed, 2), "precision": "bf16 autocast" if mixed == "bf16" else "fp32"}
        for name, value in sorted(local_parts.items()):
            total = float(accelerator.reduce(value.to(accelerator.device), "sum").cpu())
            record[name] = round(total / global_targets, 5)
        write_log(record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            val_loss, _ = evaluate(accelerator, model, val_tokens, seq_len=args.seq_len,
                                   micro_batch_size=args.micro_batch_size, bos_id=bos_id, max_rows=args.eval_rows)
            write_log({"step": step, "val_loss": round(val_loss, 5), "val_ppl": round(math.exp(val_loss), 3)})
            accelerator.print(f"\nstep {step}: val loss {val_loss:.4f}, ppl {math.exp(val_loss):.2f}")
        if step in args.milestones and step < args.steps:  # a model kept at this step (the last one is final/)
            save_milestone(accelerator, model, model_cls, args, out / f"step-{step}", step)
        out_of_time = deadline is not None and time.perf_counter() > deadline
        if step == args.steps or out_of_time or (args.save_every and step % args.save_every == 0):
            save_checkpoint(step)
        if out_of_time and step < args.steps:
            accelerator.print(f"\n--max-minutes reached at step {step}; continue with --resume")
            break
    bar.close()
    if step == args.steps:
        save_final(accelerator, model, model_cls, args, out / "final", step)
    accelerator.wait_for_everyone()
    # the process group goes before the interpreter exits: torchrun children that left gloo's to interpreter
    # teardown were seen to abort in it ("terminate called without an active exception", exit -6) after their run
    # had finished and saved. A single process has no group: nothing to do.
    accelerator.end_training()
    return {"step": step, "log": log, "params": n_params}


def _split(result) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss_fn's result: a tensor, or (tensor, {name: tensor})."""
    if isinstance(result, tuple):
        loss, parts = result
        return loss, dict(parts)
    return result, {}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The loop's options (data, schedule, batching, precision, parallelism, checkpoints), on parser `p`."""
    p.add_argument("--data", required=True, help="folder written by examples/prepare_data.py")
    p.add_argument("--out", required=True, help="output folder (log.jsonl, checkpoint/, final/)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16, help="rows per step over all processes")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows per forward on each process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto",
                   help="bf16 autocast for training forwards; auto: on GPUs that support bf16, else fp32")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and optimizer state with torch FSDP2 (under torchrun)")
    p.add_argument("--eval-every", type=int, default=100, help="validation every N steps and at the end (0: never)")
    p.add_argument("--eval-rows", type=int, default=0, help="validate on the first N rows only (0: all)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (always at the end)")
    p.add_argument("--milestones", type=int, nargs="*", default=[],
                   help="also save the model as it is after these steps into --out/step-N (as final/ is saved)")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint when it exists")
    p.add_argument("--max-minutes", type=float, default=0, help="checkpoint and stop after this much wall time")
    p.add_argument("--save-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch's default)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    return p
