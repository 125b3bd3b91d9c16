"""Distil a full-attention teacher into the KDA hybrid converted from it, in two stages, on packed documents.

    python -m kda_hybrid.conversion runs/teacher-llama runs/student --layer-types kkkA     # convert (once)
    python examples/distill.py --stage 1 --teacher runs/teacher-llama --student runs/student \\
        --data data/stdlib --out runs/distill-1 --steps 100 --lr 1e-3
    python examples/distill.py --stage 2 --teacher runs/teacher-llama --student runs/distill-1/final \\
        --data data/stdlib --out runs/distill-2 --steps 200 --lr 3e-4 [--lora-rank 16]

Stage 1, attention transfer: only the KDA layers train. Each one reads the teacher's input to the attention layer it
replaces and is fitted to that layer's output (mean squared error per token, averaged over the layers), so all
layers learn at once from the teacher's own residual stream and no error compounds through the student.
Stage 2, end to end: the whole student (or LoRA adapters on its linear layers, `--lora-rank`) trains on the KL
divergence from the teacher's next-token distribution (`--temperature`, `--kl-weight`) plus the LM loss
(`--ce-weight`); `--trainable kda` (the KDA layers only) or `kda+norms` (and the RMSNorm gains) keep the student a
small delta from its teacher, and with `--lora-rank` its inherited linear layers (MLPs, kept attention) adapt too,
as LoRA adapters whose merged change the delta carries as factors (`python -m kda_hybrid.conversion.delta build
--low-rank`); `--inherited-lr-ratio` trains the inherited weights at a fraction of `--lr`. This is the
two-stage recipe of LoLCATs (Zhang et al., 2024) and RADLADS (Goldstein et al., 2025); see docs/from_attention.md.

The loop is kda_hybrid.train.loop's, the one examples/train.py runs: the same packed batches (documents never see each
other: the teacher gets a block-diagonal causal mask, the student its varlen path), gradient accumulation,
DDP/FSDP2 under torchrun or accelerate, bf16 autocast, `--save-every` checkpoints, `--resume`, validation and
`final/`. log.jsonl records the stage's loss and its parts (attn_mse; kl and ce) every step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_hybrid.layers_kda_hybrid import packed_cu_seqlens
from kda_hybrid.train.data import IGNORE_INDEX, load_tokens, make_batch, missing_inputs, num_rows
from kda_hybrid.train.loop import add_arguments, fit, resumable_checkpoint, trained_tokens


def load(path: str):
    """A model folder, or a GGUF file (dequantised to float32 by transformers' GGUF loader: the teacher exactly as
    the converter read it)."""
    from transformers import AutoModelForCausalLM

    if str(path).lower().endswith(".gguf"):
        file = Path(path)
        return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)


def kda_layer_indices(student) -> list[int]:
    return [i for i, t in enumerate(student.config.layer_types) if t == "linear_attention"]


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, T, T] additive mask: token q sees token k <= q of its own document (position_ids restart at 0 at every
    document). transformers' Llama does not split packed documents from position_ids alone under sdpa/eager."""
    doc = torch.cumsum(position_ids == 0, dim=-1)  # [B, T] document number
    T = position_ids.shape[-1]
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return torch.zeros(allowed.shape, dtype=dtype, device=doc.device).masked_fill(~allowed, torch.finfo(dtype).min)[
        :, None]


def teacher_forward(teacher, ids, pos, body_only=False):
    """The teacher's forward on packed rows, never attending across a document boundary; body_only: the decoder
    stack without the LM head."""
    run = teacher.model if body_only else teacher
    if getattr(teacher.config, "model_type", None) == "kda_hybrid":  # handles packed position_ids itself
        return run(input_ids=ids, position_ids=pos, use_cache=False)
    return run(input_ids=ids, position_ids=pos, attention_mask=block_causal_mask(pos, torch.float32), use_cache=False)


def _hidden_arg(args, kwargs):
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _first(output):
    return output[0] if isinstance(output, tuple) else output


class _EnoughLayers(Exception):
    """Raised by the teacher's last needed layer: stage 1 reads nothing after it."""


class AttentionTransfer:
    """Stage 1 loss: for every KDA layer i of the student, the teacher's layer-i attention input is fed to the
    student's KDA layer i and the squared error to the teacher's attention output is summed over tokens, averaged
    over channels and layers.

    In one process the student's KDA layers are called directly on the teacher's captured inputs, and the teacher
    runs its body only as far as the last converted layer: no student MLP, kept attention or LM head runs, and no
    teacher layer after the last one needed (on SmolLM2 kkA: 20 KDA layers, a third of the student forward and
    the teacher's LM head saved). Under DDP / FSDP the student runs its whole forward (the wrapper must see it)
    and a forward pre-hook swaps the teacher's inputs in."""

    def __init__(self, teacher, student):
        self.teacher, self.layers = teacher.eval().requires_grad_(False), kda_layer_indices(student)
        self.student = student
        self.inputs: dict[int, torch.Tensor] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.stop_early = False
        for i in self.layers:
            t_attn = teacher.model.layers[i].self_attn
            t_attn.register_forward_pre_hook(self._keep(self.inputs, i, _hidden_arg), with_kwargs=True)
            t_attn.register_forward_hook(self._keep(self.targets, i, lambda args, kwargs, out: _first(out)),
                                         with_kwargs=True)
            s_attn = student.model.layers[i].self_attn
            s_attn.register_forward_pre_hook(self._swap_in(i), with_kwargs=True)
            s_attn.register_forward_hook(self._keep(self.outputs, i, lambda args, kwargs, out: _first(out)),
                                         with_kwargs=True)
        teacher.model.layers[self.layers[-1]].self_attn.register_forward_hook(self._stop)

    def _stop(self, module, args, output):
        if self.stop_early:
            raise _EnoughLayers

    @staticmethod
    def _keep(store, i, pick):
        def hook(module, args, kwargs, *out):
            store[i] = pick(args, kwargs, *out) if out else pick(args, kwargs)

        return hook

    def _swap_in(self, i):
        def hook(module, args, kwargs):
            if i not in self.inputs:  # a forward outside the loss (validation, generation): leave it alone
                return None
            x = self.inputs[i].to(_hidden_arg(args, kwargs).dtype)
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": x}
            return (x, *args[1:]), kwargs

        return hook

    def __call__(self, model, batch):
        ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
        self.teacher.to(ids.device)
        direct = model is self.student and not (torch.distributed.is_available() and torch.distributed.is_initialized())
        try:
            with torch.no_grad():
                self.stop_early = direct
                try:
                    teacher_forward(self.teacher, ids, pos, body_only=direct)
                except _EnoughLayers:
                    pass
                finally:
                    self.stop_early = False
            if direct:
                cu_seqlens = packed_cu_seqlens(pos)
                for i in self.layers:
                    self.student.model.layers[i].self_attn(hidden_states=self.inputs[i], cu_seqlens=cu_seqlens)
            else:
                model(input_ids=ids, position_ids=pos, use_cache=False)
            err = sum(F.mse_loss(self.outputs[i].float(), self.targets[i].float(), reduction="none").mean(-1).sum()
                      for i in self.layers) / len(self.layers)
        finally:
            self.inputs.clear(), self.targets.clear(), self.outputs.clear()
        return err, {"attn_mse": err}


class LogitDistillation:
    """Stage 2 loss over the batch's targets: kl_weight * T^2 * KL(teacher_T || student_T) + ce_weight * CE."""

    def __init__(self, teacher, temperature: float, kl_weight: float, ce_weight: float):
        self.teacher = teacher.eval().requires_grad_(False)
        self.t, self.kl_weight, self.ce_weight = temperature, kl_weight, ce_weight

    def __call__(self, student, batch):
        ids, pos = batch["input_ids"].reshape(1, -1), batch["position_ids"].reshape(1, -1)
        labels = batch["labels"].reshape(1, -1)[0, 1:]
        keep = labels != IGNORE_INDEX  # position t predicts token t + 1; a document's first token is no target
        self.teacher.to(ids.device)
        with torch.no_grad():
            t_logits = teacher_forward(self.teacher, ids, pos).logits[0, :-1][keep].float()
        s_logits = student(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1][keep].float()
        kl = F.kl_div(F.log_softmax(s_logits / self.t, -1), F.log_softmax(t_logits / self.t, -1), log_target=True,
                      reduction="sum") * self.t**2
        ce = F.cross_entropy(s_logits, labels[keep], reduction="sum")
        return self.kl_weight * kl + self.ce_weight * ce, {"kl": kl, "ce": ce}


@torch.no_grad()
def calibrate_kda_outputs(teacher, student, batches) -> dict[int, torch.Tensor]:
    """Scale each KDA head's output to the size of the teacher attention head it replaces. Over `batches` (packed
    rows: input_ids, position_ids), head h's contribution to a layer's output (o_proj applied to the head's slice of
    its input alone) is measured in the teacher's and in the student's own forward, and the student's o_proj
    columns of that head are multiplied by the ratio of the two RMS, teacher / student. Every KDA layer is measured
    in the same forwards, before any is scaled. Returns {layer: factors [heads]}.

    A converted KDA layer starts out of scale with the attention it replaces: on SmolLM2-135M kkA the factors span
    0.02-1.27 (median 0.29: most heads several times louder than the teacher's), and the converted student does
    worse than with no KDA output at all (docs/records/smollm2/README.md)."""
    layers = kda_layer_indices(student)
    s_proj = {i: student.model.layers[i].self_attn.o_proj for i in layers}
    t_proj = {i: teacher.model.layers[i].self_attn.o_proj for i in layers}
    heads = student.config.linear_num_heads
    for i in layers:
        if t_proj[i].weight.shape != s_proj[i].weight.shape or s_proj[i].in_features % heads:
            raise ValueError(f"layer {i}: the teacher's o_proj is {tuple(t_proj[i].weight.shape)}, the student's "
                             f"{tuple(s_proj[i].weight.shape)} ({heads} heads): not a conversion of this teacher")
    sums = {(who, i): torch.zeros(heads, dtype=torch.float64) for who in ("teacher", "student") for i in layers}

    def hook(key):
        def pre(module, args):
            w = module.weight.float()
            x = args[0].detach().float().reshape(-1, heads, w.shape[1] // heads)  # [N, H, V]
            y = torch.einsum("nhv,dhv->nhd", x, w.view(w.shape[0], heads, -1))  # each head's share of the output
            sums[key] += y.double().pow(2).mean(-1).sum(0)

        return pre

    hooks = [proj.register_forward_pre_hook(hook((who, i)))
             for who, projs in (("teacher", t_proj), ("student", s_proj)) for i, proj in projs.items()]
    try:
        for batch in batches:
            ids, pos = batch["input_ids"], batch["position_ids"]
            teacher_forward(teacher, ids, pos, body_only=True)
            student.model(input_ids=ids, position_ids=pos, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    factors = {}
    for i in layers:
        factor = (sums["teacher", i] / sums["student", i]).sqrt()
        if not torch.isfinite(factor).all():
            raise ValueError(f"layer {i}: a KDA head's output is zero or not finite on the calibration rows")
        w = s_proj[i].weight
        w.mul_(factor.to(w.dtype).repeat_interleave(w.shape[1] // heads))
        factors[i] = factor.float()
    return factors


def calibration_batches(args, meta) -> list[dict[str, torch.Tensor]]:
    """--calibrate-rows rows of the training split, spread evenly over it, one batch each."""
    tokens = load_tokens(Path(args.data) / "train.bin")
    n = num_rows(tokens, args.seq_len)
    rows = sorted({k * n // args.calibrate_rows for k in range(args.calibrate_rows)})
    return [make_batch(tokens, [row], args.seq_len, meta["bos_token_id"]) for row in rows]


def build_student(args, teacher=None, meta=None):
    """The student to train: --student, calibrated against `teacher` first when --calibrate-rows (not when resuming
    from a checkpoint, which holds the weights), then frozen / wrapped as --stage, --trainable and --lora-rank say."""
    student = load(args.student)
    if student.config.model_type != "kda_hybrid" or not kda_layer_indices(student):
        raise ValueError(f"--student {args.student}: expected a KDA hybrid with KDA layers (convert the teacher with "
                         "python -m kda_hybrid.conversion --layer-types ...)")
    if args.calibrate_rows and not (args.resume and resumable_checkpoint(Path(args.out))):
        factors = torch.cat(list(calibrate_kda_outputs(teacher, student, calibration_batches(args, meta)).values()))
        print(f"calibrated the KDA heads' output scale on {args.calibrate_rows} rows: factors "
              f"{factors.min():.3g} .. {factors.median():.3g} (median) .. {factors.max():.3g}")
    if args.stage == 1 or args.trainable in ("kda", "kda+norms"):
        student.requires_grad_(False)
        for i in kda_layer_indices(student):
            student.model.layers[i].self_attn.requires_grad_(True)
        if args.stage == 2 and args.trainable == "kda+norms":
            for module in student.modules():  # the RMSNorm gains: a few thousand weights, so the delta stays small
                if type(module).__name__.endswith("RMSNorm"):
                    module.requires_grad_(True)
        if args.lora_rank:  # adapters on what the student inherited (not the KDA layers, which train whole)
            whole = {name for name, p in student.named_parameters() if p.requires_grad}
            student = _with_lora(student, args.lora_rank, inherited_linears(student))
            for name, p in student.get_base_model().named_parameters():
                p.requires_grad_(name in whole or p.requires_grad)  # get_peft_model froze all but the adapters
    elif args.lora_rank:
        student = _with_lora(student, args.lora_rank, "all-linear")
    return student


def inherited_linears(student) -> list[str]:
    """The names of the student's nn.Linear layers outside its KDA layers and its LM head: the MLPs and the kept
    attention layers' projections, the teacher's weights as the conversion carried them over."""
    kda = set(kda_layer_indices(student))
    return [name for name, module in student.named_modules() if isinstance(module, torch.nn.Linear)
            and name != "lm_head" and not (_layer_of(name) in kda and ".self_attn." in f".{name}.")]


def _with_lora(student, rank: int, targets):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(student, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=(1, 2), required=True,
                   help="1: attention transfer (KDA layers only); 2: logit distillation + LM loss")
    p.add_argument("--teacher", required=True, help="the full-attention model (any causal LM folder, or a .gguf)")
    p.add_argument("--student", required=True, help="the KDA hybrid converted from it (or stage 1's final/)")
    p.add_argument("--temperature", type=float, default=1.0, help="stage 2: softmax temperature of the KL term")
    p.add_argument("--kl-weight", type=float, default=1.0, help="stage 2: weight of the KL term")
    p.add_argument("--ce-weight", type=float, default=1.0, help="stage 2: weight of the LM loss")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="stage 2: LoRA adapters of this rank (0: none): on every linear layer (--trainable all, "
                        "which then trains nothing else), or on the inherited ones (--trainable kda / kda+norms)")
    p.add_argument("--lora-lr-ratio", type=float, default=None,
                   help="stage 2 with --lora-rank: the adapters at this multiple of --lr (default 1; adapters start "
                        "at zero and a rank-R update moves the weights it wraps slowly, so LoRA is usually trained "
                        "at several times the rate of whole weights)")
    p.add_argument("--calibrate-rows", type=int, default=0,
                   help="before training, scale each KDA head's output to the RMS of the teacher's attention head "
                        "on this many training rows (0: off; for a student fresh from the converter)")
    p.add_argument("--inherited-lr-ratio", type=float, default=None,
                   help="stage 2 with --trainable all or kda+norms: the trained weights the student inherited from "
                        "the teacher (all but its KDA layers) at this fraction of --lr, the new KDA layers at --lr")
    p.add_argument("--trainable", choices=("all", "kda", "kda+norms"), default="all",
                   help="stage 2: train every weight, the KDA layers only (the rest stays the teacher's, so the "
                        "student ships as the teacher plus its KDA layers: python -m kda_hybrid.conversion.delta), "
                        "or the KDA layers and the RMSNorm gains (a delta a few hundred KB larger)")
    args = add_arguments(p).parse_args(argv)
    missing = missing_inputs(data=[("--data", args.data)], models=[("--teacher", args.teacher),
                                                                  ("--student", args.student)])
    if missing:
        p.error("; ".join(missing))
    if args.temperature <= 0 or min(args.kl_weight, args.ce_weight, args.lora_rank, args.calibrate_rows) < 0:
        p.error("--temperature must be > 0 and --kl-weight, --ce-weight, --lora-rank, --calibrate-rows >= 0")
    if args.inherited_lr_ratio is not None and (args.stage != 2 or args.trainable == "kda"
                                                or (args.trainable == "all" and args.lora_rank)
                                                or not 0 < args.inherited_lr_ratio <= 1):
        p.error("--inherited-lr-ratio takes a ratio in (0, 1] and applies to stage 2 with --trainable all (no "
                "--lora-rank) or kda+norms: what trains of the inherited weights (--trainable kda freezes them; LoRA "
                "adapters are new weights, at --lr)")
    if args.lora_lr_ratio is not None and (not args.lora_rank or not args.lora_lr_ratio > 0):
        p.error("--lora-lr-ratio takes a ratio > 0 and applies with --lora-rank (the adapters' learning rate)")
    if args.stage == 1 and args.lora_rank:
        p.error("--lora-rank applies to stage 2 (stage 1 trains the KDA layers whole)")
    if args.fsdp and args.lora_rank:
        p.error("--fsdp with --lora-rank is not supported (train LoRA with DDP)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    state = {}

    def build(meta):
        state["teacher"] = load(args.teacher).eval()
        state["student"] = build_student(args, state["teacher"], meta)
        return state["student"]

    def loss(model, batch):
        if "loss" not in state:  # hooks go on the model the loop trains (after accelerate's prepare they still do)
            teacher, student = state["teacher"], state["student"]
            base = student.get_base_model() if hasattr(student, "get_base_model") else student
            state["loss"] = (AttentionTransfer(teacher, base) if args.stage == 1 else
                             LogitDistillation(teacher, args.temperature, args.kl_weight, args.ce_weight))
        return state["loss"](model, batch)

    lr_scale = None
    if args.inherited_lr_ratio is not None or args.lora_lr_ratio is not None:
        def lr_scale(name: str) -> float:  # new weights at --lr: the KDA layers, LoRA adapters (x --lora-lr-ratio)
            if ".lora_" in name:
                return 1.0 if args.lora_lr_ratio is None else args.lora_lr_ratio
            layer = _layer_of(name)
            new = layer is not None and ".self_attn." in name and \
                state["student"].config.layer_types[layer] == "linear_attention"
            return 1.0 if new or args.inherited_lr_ratio is None else args.inherited_lr_ratio

    args.inherited_tokens = trained_tokens(args.student)  # the student's own training (stage 1 before stage 2)
    return fit(args, build, loss_fn=loss, lr_scale=lr_scale)


def _layer_of(name: str) -> int | None:
    """The decoder layer index in a parameter name (`...layers.{i}.`), or None."""
    parts = name.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


if __name__ == "__main__":
    main()
