"""examples/distill.py: stage 1 trains only the KDA layers to reproduce the teacher's attention outputs, stage 2 the
whole student (or LoRA adapters) on KL to the teacher plus the LM loss; both on kda_hybrid.train.loop's loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from kda_hybrid.conversion import convert

from .helpers import load_script

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN = 40


def run_example(script: str, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(REPO / "examples" / script), *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A corpus of small Python-like files, its tokenizer and token files; a tiny random Llama teacher on that
    vocabulary and the kAkA hybrid converted from it."""
    src = tmp_path_factory.mktemp("corpus")
    for i in range(120):
        body = "".join(f"    y = x * {j} + {i % 5}\n" for j in range(i % 7))
        (src / f"m{i:03d}.py").write_text(f"def f_{i}(x):\n{body}    return x\n")
    root = tmp_path_factory.mktemp("distill")
    data = root / "data"
    run_example("prepare_data.py", "--out", str(data), "--source", str(src), "--vocab-size", "300")
    meta = json.loads((data / "meta.json").read_text())
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=meta["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    teacher.save_pretrained(root / "teacher")
    convert(root / "teacher", root / "student", layer_types="kA", progress=False)
    convert(root / "teacher", root / "student-shared", layer_types="kA", shared_kv=True, progress=False)
    return root, data


def distill_args(setup, stage: int, student: Path, out: Path, *extra: str) -> list[str]:
    root, data = setup
    return ["--stage", str(stage), "--teacher", str(root / "teacher"), "--student", str(student), "--data", str(data),
            "--out", str(out), "--steps", "3", "--seq-len", str(SEQ_LEN), "--batch-size", "4",
            "--micro-batch-size", "2", "--lr", "1e-2", "--warmup", "1", "--eval-every", "3",
            "--mixed-precision", "no", "--cpu", "--threads", "1", *extra]


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("student", ["student", "student-shared"])  # KDA keys and values per query head, or shared
def test_stage_1_trains_only_the_kda_layers_and_lowers_the_attention_error(setup, tmp_path, student):
    root, _ = setup
    run_example("distill.py", *distill_args(setup, 1, root / student, tmp_path, "--steps", "6"))
    before = load_file(root / student / "model.safetensors")
    after = load_file(tmp_path / "final" / "model.safetensors")
    kda = ("model.layers.0.self_attn.", "model.layers.2.self_attn.")  # kAkA: layers 0 and 2 are KDA
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.startswith(kda) for n in changed), sorted(changed)[:5]
    assert {n for n in before if n.startswith(kda) and n.endswith("q_proj.weight")} <= changed
    steps = [r for r in log(tmp_path) if "loss" in r]
    assert all(r["attn_mse"] == r["loss"] for r in steps)
    assert steps[-1]["attn_mse"] < steps[0]["attn_mse"], steps  # lr 1e-2 on a fixed teacher: measured -30% by step 6


def test_stage_2_with_lora_saves_a_plain_merged_hybrid(setup, tmp_path):
    root, _ = setup
    run_example("distill.py", *distill_args(setup, 2, root / "student", tmp_path, "--lora-rank", "4"))
    after = load_file(tmp_path / "final" / "model.safetensors")
    before = load_file(root / "student" / "model.safetensors")
    assert set(after) == set(before)  # merged: no lora_A / lora_B / base_model prefixes
    assert not torch.equal(after["model.layers.1.self_attn.q_proj.weight"],
                           before["model.layers.1.self_attn.q_proj.weight"])
    steps = [r for r in log(tmp_path) if "loss" in r]
    for r in steps:  # loss = kl + ce with unit weights; parts are each a per-target mean
        assert r["loss"] == pytest.approx(r["kl"] + r["ce"], abs=2e-5)
        assert r["kl"] >= 0


def test_stage_2_lora_milestones_leave_the_training_alone(setup, tmp_path):
    """A milestone saves the adapters merged into a copy: the run goes on training the same adapters, so its final
    model is the one a run without milestones ends with, and the milestone is a plain merged hybrid too."""
    root, _ = setup
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    run_example("distill.py", *distill_args(setup, 2, root / "student", plain, "--lora-rank", "4"))
    run_example("distill.py", *distill_args(setup, 2, root / "student", kept, "--lora-rank", "4",
                                            "--milestones", "1"))
    a, b = load_file(plain / "final" / "model.safetensors"), load_file(kept / "final" / "model.safetensors")
    for name in a:  # the same steps on the same batches
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    milestone = load_file(kept / "step-1" / "model.safetensors")
    assert set(milestone) == set(a) and not torch.equal(milestone["model.layers.1.mlp.up_proj.weight"],
                                                        a["model.layers.1.mlp.up_proj.weight"])
    assert [r["loss"] for r in log(plain) if "loss" in r] == [r["loss"] for r in log(kept) if "loss" in r]


@pytest.mark.slow  # the loop's resume is tested in test_train.py; this checks distill.py's losses survive it too
def test_stage_2_resume_equals_uninterrupted(setup, tmp_path):
    root, _ = setup
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_example("distill.py", *distill_args(setup, 2, root / "student", whole))
    run_example("distill.py", *distill_args(setup, 2, root / "student", split, "--max-minutes", "1e-9"))
    assert len([r for r in log(split) if "loss" in r]) == 1  # stopped after the first step, checkpointed
    run_example("distill.py", *distill_args(setup, 2, root / "student", split, "--resume"))
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(split / "final" / "model.safetensors")
    for name in a:  # same steps, same batches, optimizer state restored: equal up to float summation order
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=2e-6)


def _distill_module():
    return load_script("examples/distill.py", "distill_example")


def test_stage_1_direct_path_equals_the_whole_student_forward(setup):
    """In one process stage 1 calls the student's KDA layers directly on the teacher's captured inputs and stops
    the teacher after the last converted layer; the loss equals the one of the whole student forward with the
    inputs swapped in (the path DDP / FSDP take), to float rounding (the same layers on the same inputs)."""
    from transformers import AutoModelForCausalLM

    from kda_hybrid.train.data import load_tokens, make_batch

    distill = _distill_module()
    root, data = setup
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(root / "student", trust_remote_code=True, dtype=torch.float32)
    batch = make_batch(load_tokens(data / "train.bin"), [0, 1], SEQ_LEN, bos_id=1)
    assert int((batch["position_ids"] == 0).sum()) > 2  # several documents per row: the packed path is exercised
    loss = distill.AttentionTransfer(teacher, student)
    calls = []
    student.model.register_forward_hook(lambda *a: calls.append("student stack"))
    teacher.lm_head.register_forward_hook(lambda *a: calls.append("teacher head"))
    teacher.model.layers[3].register_forward_hook(lambda *a: calls.append("teacher layer 3"))  # after the last k
    direct, _ = loss(student, batch)
    assert calls == []

    class Wrapped(torch.nn.Module):  # what DDP hands the loss: not the student object itself
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    whole, _ = loss(Wrapped(student), batch)
    assert "student stack" in calls
    torch.testing.assert_close(direct, whole, rtol=1e-6, atol=0)
    direct.backward()
    grads = {n for n, p in student.named_parameters() if p.grad is not None}
    assert grads and all(n.startswith(("model.layers.0.self_attn.", "model.layers.2.self_attn.")) for n in grads)


@pytest.mark.parametrize("trainable", ["kda", "kda+norms"])
def test_stage_2_trainable_kda_changes_only_the_kda_layers(setup, tmp_path, trainable):
    """kda+norms also trains every RMSNorm gain outside the KDA layers (the decoder layers' two, the final one; here
    at --inherited-lr-ratio 0.5 of the learning rate), and nothing else the teacher gave."""
    root, _ = setup
    extra = ["--inherited-lr-ratio", "0.5"] if trainable == "kda+norms" else []
    run_example("distill.py", *distill_args(setup, 2, root / "student", tmp_path, "--trainable", trainable, *extra))
    before = load_file(root / "student" / "model.safetensors")
    after = load_file(tmp_path / "final" / "model.safetensors")
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    kda = {n for n in changed if n.startswith(("model.layers.0.self_attn.", "model.layers.2.self_attn."))}
    norms = {n for n in before if n.endswith(("layernorm.weight", "model.norm.weight"))}
    assert kda and changed - kda == (norms if trainable == "kda+norms" else set())
    assert len(norms) == 2 * 4 + 1


def test_stage_2_kda_with_lora_changes_each_inherited_linear_by_a_low_rank_update(setup, tmp_path):
    """--trainable kda+norms --lora-rank 2: the KDA layers train whole, the RMSNorm gains too, and every inherited
    linear layer (the MLPs, the kept attention layers' projections) changes by its merged rank-2 adapter; the
    embeddings and the LM head stay the teacher's. `delta build --low-rank 2` stores those changes as factors."""
    root, _ = setup
    run_example("distill.py", *distill_args(setup, 2, root / "student", tmp_path, "--trainable", "kda+norms",
                                            "--lora-rank", "2", "--inherited-lr-ratio", "0.5"))
    before = load_file(root / "student" / "model.safetensors")
    after = load_file(tmp_path / "final" / "model.safetensors")
    assert set(after) == set(before)  # merged
    kda = ("model.layers.0.self_attn.", "model.layers.2.self_attn.")  # kAkA
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    linears = {n for n in before if n.endswith("_proj.weight") and not n.startswith(kda)}
    norms = {n for n in before if n.endswith(("layernorm.weight", "model.norm.weight"))}
    assert len(linears) == 4 * 3 + 2 * 4 and len(norms) == 2 * 4 + 1
    assert changed == {n for n in before if n.startswith(kda)} | linears | norms  # not embed_tokens, not lm_head
    for name in linears:
        change = after[name].double() - before[name].double()
        assert int(torch.linalg.matrix_rank(change, rtol=1e-4)) == 2, name


def test_stage_2_inherited_lr_ratio_scales_the_steps_of_the_inherited_weights(setup, tmp_path):
    """--inherited-lr-ratio 0.25: one AdamW step moves each weight by about its learning rate (Adam's first update is
    lr * sign of the gradient), so the largest change of the inherited weights (embeddings, attention layer, MLPs,
    norms) is a quarter of the largest change of the new KDA layers'; with the ratio off both move by lr."""
    root, _ = setup

    def largest_changes(out, *extra):
        run_example("distill.py", *distill_args(setup, 2, root / "student", out, "--steps", "1", "--eval-every", "0",
                                                "--weight-decay", "0", *extra))
        before = load_file(root / "student" / "model.safetensors")
        after = load_file(out / "final" / "model.safetensors")
        kda = ("model.layers.0.self_attn.", "model.layers.2.self_attn.")  # kAkA
        change = {n: float((after[n].float() - before[n].float()).abs().max()) for n in before}
        return (max(v for n, v in change.items() if n.startswith(kda)),
                max(v for n, v in change.items() if not n.startswith(kda)))

    new, inherited = largest_changes(tmp_path / "scaled", "--inherited-lr-ratio", "0.25")
    assert new == pytest.approx(1e-2, rel=0.02) and inherited == pytest.approx(0.25e-2, rel=0.02)
    new, inherited = largest_changes(tmp_path / "plain")
    assert new == pytest.approx(1e-2, rel=0.02) and inherited == pytest.approx(1e-2, rel=0.02)


def test_stage_2_lora_lr_ratio_scales_the_steps_of_the_adapters(setup, tmp_path):
    """LoRA's B starts at zero, so after one AdamW step (lr * sign of B's gradient) each wrapped matrix has changed by
    scale * dB @ A, A being the same seeded draw in both runs: --lora-lr-ratio 4 makes every inherited linear's merged
    change 4x the default's, while the KDA layers move by lr in both runs and the norm gains by lr * 0.5."""
    root, _ = setup
    kda = ("model.layers.0.self_attn.", "model.layers.2.self_attn.")  # kAkA
    before = load_file(root / "student" / "model.safetensors")

    def changes(out, *extra):
        run_example("distill.py", *distill_args(setup, 2, root / "student", out, "--steps", "1", "--eval-every", "0",
                                                "--weight-decay", "0", "--trainable", "kda+norms", "--lora-rank", "2",
                                                "--inherited-lr-ratio", "0.5", *extra))
        after = load_file(out / "final" / "model.safetensors")
        return {n: (after[n].double() - before[n].double()).abs().max().item() for n in before}

    plain, fast = changes(tmp_path / "plain"), changes(tmp_path / "fast", "--lora-lr-ratio", "4")
    linears = [n for n in before if n.endswith("_proj.weight") and not n.startswith(kda)]
    assert len(linears) == 4 * 3 + 2 * 4 and all(plain[n] > 0 for n in linears)
    for n in linears:
        assert fast[n] == pytest.approx(4 * plain[n], rel=1e-3), n
    for n in before:
        if n.startswith(kda) or n.endswith("layernorm.weight"):
            assert fast[n] == pytest.approx(plain[n], rel=1e-3, abs=1e-7), n
    assert max(plain[n] for n in before if n.startswith(kda)) == pytest.approx(1e-2, rel=0.02)
    assert max(plain[n] for n in before if n.endswith("layernorm.weight")) == pytest.approx(0.5e-2, rel=0.02)


def test_inherited_lr_ratio_is_refused_where_it_means_nothing(setup, tmp_path):
    root, _ = setup
    distill = _distill_module()
    for extra in (["--trainable", "kda"], ["--lora-rank", "4"], ["--inherited-lr-ratio", "0"]):
        args = distill_args(setup, 2, root / "student", tmp_path / "x", *extra)
        if "--inherited-lr-ratio" not in extra:
            args += ["--inherited-lr-ratio", "0.5"]
        with pytest.raises(SystemExit):
            distill.parse_args(args)
    with pytest.raises(SystemExit):
        distill.parse_args(distill_args(setup, 1, root / "student", tmp_path / "x", "--inherited-lr-ratio", "0.5"))
    for extra in (["--lora-lr-ratio", "4"], ["--lora-rank", "2", "--lora-lr-ratio", "0"]):  # no adapters; not > 0
        with pytest.raises(SystemExit):
            distill.parse_args(distill_args(setup, 2, root / "student", tmp_path / "x", *extra))
    assert not (tmp_path / "x").exists()


def test_stage_1_resume_after_a_stop_equals_uninterrupted(setup, tmp_path):
    """With --calibrate-rows too: the first run calibrates, the resumed run takes the weights from its checkpoint."""
    root, _ = setup
    whole, split = tmp_path / "whole", tmp_path / "split"
    cal = ("--calibrate-rows", "2")
    assert "calibrated the KDA heads" in run_example("distill.py", *distill_args(setup, 1, root / "student", whole,
                                                                                 *cal)).stdout
    first = run_example("distill.py", *distill_args(setup, 1, root / "student", split, *cal, "--max-minutes", "1e-9"))
    assert "calibrated the KDA heads" in first.stdout
    assert len([r for r in log(split) if "loss" in r]) == 1
    resumed = run_example("distill.py", *distill_args(setup, 1, root / "student", split, *cal, "--resume"))
    assert "calibrated" not in resumed.stdout
    a, b = load_file(whole / "final" / "model.safetensors"), load_file(split / "final" / "model.safetensors")
    assert [r["loss"] for r in log(whole) if "loss" in r] == [r["loss"] for r in log(split) if "loss" in r]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=2e-6)


def test_prepare_data_pydoc_holds_out_prose_apart_from_code(tmp_path):
    """--pydoc: the documentation topics Python ships join the corpus as prose, held out by the same path rule,
    with val_prose.bin / val_code.bin beside val.bin; --document-token starts and ends every document."""
    from pydoc_data.topics import topics

    from kda_hybrid.train.data import load_tokens

    src = tmp_path / "src"
    src.mkdir()
    for i in range(150):
        (src / f"m{i:03d}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n")
    out = tmp_path / "data"
    run_example("prepare_data.py", "--out", str(out), "--source", str(src), "--vocab-size", "300", "--pydoc",
                "--document-token", "<|pad|>")
    meta = json.loads((out / "meta.json").read_text())
    held = meta["val"]["names"]
    prose = [n for n in held if n.startswith("pydoc_data/topics/")]
    assert prose and len(prose) < len(topics) and any(not n.startswith("pydoc_data/") for n in held)
    assert meta["val_prose"]["files"] == len(prose) and meta["val_code"]["files"] == len(held) - len(prose)
    assert meta["train"]["files"] == 150 + len([t for t in topics.values() if t.strip()]) - len(held)
    assert meta["bos_token_id"] == meta["eos_token_id"] == 0  # <|pad|>: the loop restarts positions there
    for split in ("train", "val", "val_code", "val_prose"):
        tokens = load_tokens(out / f"{split}.bin")
        assert tokens.size == meta[split]["tokens"] and tokens[0] == 0 and tokens[-1] == 0
        assert int((tokens == 0).sum()) == 2 * meta[split]["files"]  # start and end of every document
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    name = prose[0].removeprefix("pydoc_data/topics/")
    assert topics[name].strip()[:40] in tok.decode(load_tokens(out / "val_prose.bin").tolist())


def _report_module():
    return load_script("examples/smollm2/smollm2_report.py", "smollm2_report")


def test_report_agreement_counts_positions_and_the_identical_prefix():
    """examples/smollm2/smollm2_report.py's greedy agreement: per prompt the fraction of positions with the teacher's
    token, averaged over prompts; and the mean length of the identical prefix."""
    report = _report_module()
    teacher = [[5, 6, 7, 2], [8, 9, 2, 2]]
    student = [[5, 6, 1, 2], [3, 9, 2, 2]]  # prompt 1: 3 of 4 same, prefix 2; prompt 2: 3 of 4, prefix 0
    assert report.agreement(student, teacher) == (0.75, 1.0)
    assert report.agreement(teacher, teacher) == (1.0, 4.0)


def test_report_median_divergence_forced_agreement_and_chat_nll(tmp_path):
    """The median first divergence; teacher-forced top-1 agreement (the teacher on its own greedy replies: 1; a model
    with another head: less); the held-out chat NLL counts the reply tokens only, equal to the NLL of those tokens in
    the whole chat rendered by the template at once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ._tokenizer import VOCAB_SIZE, tiny_tokenizer

    report = _report_module()
    assert report.median_prefix([[1, 2, 3], [1, 9, 9], [9, 9, 9]], [[1, 2, 3], [1, 2, 3], [1, 2, 3]]) == 1.0
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    tok = tiny_tokenizer()
    prompts = ["What is a good breakfast?", "Name three colours."]
    replies = report.greedy(model, tok, prompts, 8)
    assert report.forced_agreement(model, tok, prompts, replies, tok.pad_token_id) == 1.0
    other = LlamaForCausalLM(model.config).eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.lm_head.weight.normal_()
    assert report.forced_agreement(other, tok, prompts, replies, tok.pad_token_id) < 1.0

    chat = {"user": prompts[0], "assistant": "Eggs and toast.", "complete": True}
    got = report.chat_nll(model, tok, [chat])
    messages = [{"role": "user", "content": chat["user"]}, {"role": "assistant", "content": chat["assistant"]}]
    full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    start = len(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1], -1)
    want = -float(logp[torch.arange(start - 1, len(full) - 1), torch.tensor(full[start:])].mean())
    assert got == pytest.approx(want, rel=1e-5)


def _report_inputs(tmp_path):
    """A tiny teacher and student with the tokenizer, a data folder's held-out splits, two held-out chats."""
    from ._tokenizer import VOCAB_SIZE, tiny_tokenizer
    from .helpers import tiny_model

    folders = {}
    for name, seed in (("teacher", 0), ("student", 1)):
        folders[name] = tmp_path / name
        tiny_model("gqa", seed=seed, vocab_size=VOCAB_SIZE, eos_token_id=2).save_pretrained(folders[name])
        tiny_tokenizer().save_pretrained(folders[name])
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for split in ("val_prose", "val_code"):
        rng.integers(3, VOCAB_SIZE, 200).astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps({"bos_token_id": 1, "val": {"names": ["a.py", "pydoc_data/topics/x"]}}))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"user": u, "assistant": a, "complete": True, "prompt": i, "sample": 0}) + "\n"
                             for i, (u, a) in enumerate([("Name a colour.", "Blue."), ("Say hi.", "Hi there.")])))
    return folders, data, chats


def test_report_writes_after_every_model_so_a_killed_run_keeps_its_rows(tmp_path, monkeypatch):
    """--json is replaced (atomically) after every model: a run killed while loading the student leaves the
    teacher's row and no temporary file; the student measured then with --keep gives the report of a whole run."""
    report = _report_module()
    folders, data, chats = _report_inputs(tmp_path)
    threads = str(torch.get_num_threads())

    def run(name, *extra):
        return report.main(["--data", str(data), "--model", f"teacher={folders['teacher']}", "--model",
                            f"student={folders['student']}", "--heldout-chats", str(chats), "--new-tokens", "4",
                            "--seq-len", "64", "--json", str(tmp_path / name), "--threads", threads, *extra])

    whole = run("whole.json")
    load = report.load

    def killed_at_the_student(folder):
        if Path(folder).name == "student":
            raise KeyboardInterrupt
        return load(folder)

    monkeypatch.setattr(report, "load", killed_at_the_student)
    with pytest.raises(KeyboardInterrupt):
        run("split.json")
    assert list(json.loads((tmp_path / "split.json").read_text())["models"]) == ["teacher"]
    assert [p.name for p in tmp_path.glob("split.json*")] == ["split.json"]
    monkeypatch.setattr(report, "load", load)
    rest = run("split.json", "--keep")
    assert list(rest) == ["teacher", "student"]
    for name in whole:
        assert {k: v for k, v in rest[name].items() if k != "seconds"} == \
            {k: v for k, v in whole[name].items() if k != "seconds"}
    stored = json.loads((tmp_path / "split.json").read_text())
    assert stored["table"] == json.loads((tmp_path / "whole.json").read_text())["table"]


def test_report_measures_later_turns_of_conversations_apart(tmp_path):
    """--heldout-followups: per held-out prompt the first sample that reached a later turn; the later turn's NLL,
    greedy agreement and teacher-forced top-1 after the earlier turns (the teacher's own: 1.0; another model: its
    figures beside); the single-turn figures are the same as a run without it; --keep beside a stored report of
    single turns leaves its rows' later-turn cells empty."""
    report = _report_module()
    folders, data, chats = _report_inputs(tmp_path)

    def turn(prompt, sample, first, reply, history=True):
        h = [{"role": "user", "content": first}, {"role": "assistant", "content": reply}] if history else None
        row = {"user": "And the next one?" if history else first, "assistant": "Two.", "complete": True,
               "prompt": prompt, "sample": sample}
        return {**row, "history": h} if h else row

    followups = tmp_path / "followups.jsonl"
    rows = [turn(3, 0, "Count to one.", "One.", history=False),  # cut short at its first turn: no later turn
            turn(3, 1, "Count to one.", "One, that is all."), turn(3, 2, "Count to one.", "One!"),
            turn(5, 0, "Name a month.", "May."), turn(5, 1, "Name a month.", "June.")]
    followups.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.followup_prompts(report.read_chats(followups)) == [
        rows[1]["history"] + [{"role": "user", "content": "And the next one?"}],
        rows[3]["history"] + [{"role": "user", "content": "And the next one?"}]]

    threads = str(torch.get_num_threads())  # main() sets the process's threads: leave them as the other tests have them

    def run(name, *extra):
        return report.main(["--data", str(data), "--model", f"teacher={folders['teacher']}", "--model",
                            f"student={folders['student']}", "--heldout-chats", str(chats), "--new-tokens", "6",
                            "--seq-len", "64", "--json", str(tmp_path / name), "--threads", threads, *extra])

    single = run("single.json")
    with open(chats, "a") as f:  # a later turn in --heldout-chats is left to --heldout-followups
        f.write(json.dumps(rows[1]) + "\n")
    assert {k: v for k, v in run("mixed.json")["student"].items() if k != "seconds"} == \
        {k: v for k, v in single["student"].items() if k != "seconds"}
    both = run("both.json", "--heldout-followups", str(followups), "--transcripts", str(tmp_path / "t.md"),
               "--transcript-prompts", "1", "--transcript-tokens", "4")
    shown = (tmp_path / "t.md").read_text()
    assert "## Name a colour." in shown and "## And the next one?\n\nafter user: 'Count to one.' / assistant: " \
        "'One, that is all.'" in shown and shown.count("**student**") == 2
    teacher, student = both["teacher"], both["student"]
    assert teacher["followup_agreement"] == teacher["followup_top1"] == 1.0
    assert teacher["followup_prefix"] == teacher["followup_median_divergence"] == 6
    assert student["followup_top1"] < 1.0 and student["nll_followup"] > 0
    for name in single:  # the single-turn figures are untouched
        assert {k: v for k, v in both[name].items() if k not in ("seconds", "nll_followup") and "followup" not in k} \
            == {k: v for k, v in single[name].items() if k != "seconds"}
    model, tok = report.load(str(folders["teacher"]))
    later = [r for r in rows if "history" in r]  # every sample of a later turn, after its own history
    assert teacher["nll_followup"] == pytest.approx(report.chat_nll(model, tok, later), rel=1e-6)
    alone = report.chat_nll(model, tok, [{k: v for k, v in r.items() if k != "history"} for r in later])
    assert teacher["nll_followup"] != pytest.approx(alone, rel=1e-3)
    table = json.loads((tmp_path / "both.json").read_text())["table"]
    assert "later turns: top-1" in table and "100.0% (6) | 100.0% |" in table

    (tmp_path / "kept.json").write_text((tmp_path / "single.json").read_text())
    kept = report.main(["--data", str(data), "--model", f"teacher={folders['teacher']}", "--heldout-chats", str(chats),
                        "--heldout-followups", str(followups), "--new-tokens", "6", "--seq-len", "64", "--threads",
                        threads, "--json",
                        str(tmp_path / "kept.json"), "--keep"])
    assert list(kept) == ["teacher", "student"] and "nll_followup" not in kept["student"]
    assert json.loads((tmp_path / "kept.json").read_text())["table"].splitlines()[-1].endswith(" - | - | - |")


def test_report_refuses_bad_inputs_before_measuring_anything(tmp_path, capsys):
    """Every input is checked before the first model is measured (minutes each): all errors at once, exit 2,
    nothing written."""
    report = _report_module()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        report.main(["--data", str(data), "--model", f"teacher={model}", "--model", f"teacher={model}",
                     "--model", f"gone={tmp_path / 'nope'}", "--model", "no-folder", "--heldout-chats",
                     str(tmp_path / "none.jsonl"), "--transcript-models", "other", "--json", str(tmp_path / "r.json")])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    for part in ("'teacher' is named twice", "gone=", "no checkpoint folder (with config.json) or .gguf file there",
                 "val_prose.bin: no such file", "val_code.bin: no such file", "'no-folder': give NAME=FOLDER",
                 "none.jsonl: no such file", "--transcript-models ['other']"):
        assert part in err, part
    assert not (tmp_path / "r.json").exists()


def test_distill_and_rank_layers_refuse_missing_inputs_before_loading_anything(tmp_path, capsys):
    """A path that is not on this machine is named at once (not looked up on the Hub after a minute of loading)."""
    gguf = tmp_path / "teacher.gguf"
    gguf.write_bytes(b"GGUF")  # a .gguf file is a teacher; only its presence is checked here
    rl = load_script("examples/smollm2/rank_layers.py", "rank_layers_example")
    with pytest.raises(SystemExit) as refused:
        rl.main(["--teacher", str(tmp_path / "nope"), "--student", str(tmp_path), "--data", str(tmp_path)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"--teacher {tmp_path / 'nope'}: no checkpoint folder" in err and f"--student {tmp_path}: no" in err
    assert f"--data {tmp_path}: no prepare_data.py folder there (no meta.json)" in err
    r = subprocess.run([sys.executable, str(REPO / "examples" / "distill.py"), "--stage", "2", "--teacher", str(gguf),
                        "--student", str(tmp_path / "student"), "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                        "--steps", "1"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--teacher" not in r.stderr.split("error:")[-1]
    assert "--student" in r.stderr and "--data" in r.stderr and not (tmp_path / "o").exists()


def test_report_keep_replaces_measured_rows_only_beside_the_same_teacher():
    """--keep: rows measured now replace the stored ones (new ones come after), the others stay; refused when the
    teacher's figures differ from the stored report's (the rows would not be comparable)."""
    report = _report_module()
    teacher = {"layer_types": "AAA", "nll_prose": 2.0, "nll_code": 1.5, "cache_32k_bytes": 100, "agreement": 1.0}
    stored = {"teacher": teacher, "old": {"nll_prose": 5.0}, "redo": {"nll_prose": 4.0}}
    merged = report.kept(stored, {"teacher": dict(teacher), "redo": {"nll_prose": 3.0}, "new": {"nll_prose": 2.5}},
                         "teacher")
    assert list(merged) == ["teacher", "old", "redo", "new"]
    assert merged["old"]["nll_prose"] == 5.0 and merged["redo"]["nll_prose"] == 3.0
    with pytest.raises(SystemExit, match="nll_code"):
        report.kept(stored, {"teacher": {**teacher, "nll_code": 1.6}}, "teacher")
    # the same teacher on another CPU: NLLs a few 1e-6 apart (relative) still compare; counts and layers exactly
    assert report.kept(stored, {"teacher": {**teacher, "nll_prose": 2.0 * (1 + 4e-6)}}, "teacher")["old"]
    with pytest.raises(SystemExit, match="nll_prose"):
        report.kept(stored, {"teacher": {**teacher, "nll_prose": 2.0 * (1 + 1e-3)}}, "teacher")
    with pytest.raises(SystemExit, match="cache_32k_bytes"):
        report.kept(stored, {"teacher": {**teacher, "cache_32k_bytes": 101}}, "teacher")
    with pytest.raises(SystemExit, match="teacher"):
        report.kept(stored, {"other": teacher}, "other")


def test_prepare_data_chats_join_the_training_split_through_the_chat_template(tmp_path):
    """--chats: each chat, rendered by the tokenizer's chat template, is a training document --chat-repeat times,
    a conversation (teacher_corpus.py's "history") with its earlier turns, from one file or several; the held-out
    splits are those of the same corpus without chats; a bad line (a malformed history too) or a tokenizer without a
    chat template is refused before anything is written."""
    from transformers import AutoTokenizer

    from kda_hybrid.train.data import load_tokens

    src = tmp_path / "src"
    src.mkdir()
    for i in range(150):
        (src / f"m{i:03d}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n")
    plain = tmp_path / "plain"
    run_example("prepare_data.py", "--out", str(plain), "--source", str(src), "--vocab-size", "300",
                "--document-token", "<|pad|>")
    tok = AutoTokenizer.from_pretrained(plain)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"source": f"m{i:03d}.py", "user": f"What is f_{i}?",
                                         "assistant": f"It adds {i} to x.", "complete": i < 2}) + "\n"
                             for i in range(3)))  # the last reply was cut short: its turn stays open

    turns = tmp_path / "turns.jsonl"
    history = [{"role": "user", "content": "Name f_5."}, {"role": "assistant", "content": "f_5 adds 5."}]
    turns.write_text(json.dumps({"user": "And f_6?", "assistant": "f_6 adds 6.", "history": history}) + "\n")

    def prepare(out, *extra, check=True, files=(chats,)):
        return subprocess.run([sys.executable, str(REPO / "examples" / "prepare_data.py"), "--out", str(out),
                               "--source", str(src), "--tokenizer", str(tokenizer), "--document-token", "<|pad|>",
                               "--chats", *map(str, files), *extra], capture_output=True, text=True, check=check,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    tokenizer = plain  # no chat template: refused
    r = prepare(tmp_path / "refused", check=False)
    assert r.returncode != 0 and "no chat template" in r.stderr and not (tmp_path / "refused").exists()
    tok.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer = tmp_path / "templated"
    tok.save_pretrained(tokenizer)
    out = tmp_path / "data"
    prepare(out, "--chat-repeat", "2")
    meta, base = json.loads((out / "meta.json").read_text()), json.loads((plain / "meta.json").read_text())
    files = meta["train"]["chats"]["files"]
    assert meta["train"]["chats"]["count"] == 3 and [(f["count"], f["repeat"]) for f in files] == [(3, 2)]
    assert meta["train"]["files"] == base["train"]["files"] + 6
    assert (out / "val.bin").read_bytes() == (plain / "val.bin").read_bytes()
    text = tok.decode(load_tokens(out / "train.bin").tolist())
    for i in range(2):
        assert text.count(f"<user>What is f_{i}?</user>\n<assistant>It adds {i} to x.</assistant>") == 2
    assert text.count("<user>What is f_2?</user>\n<assistant>It adds 2 to x.<|pad|>") == 2
    assert text.count("return x + 7\n") == 1  # the corpus documents all still there, once
    both = tmp_path / "both"
    prepare(both, "--chat-repeat", "1", "3", files=(chats, turns))  # a count per file
    meta = json.loads((both / "meta.json").read_text())
    assert [(f["count"], f["repeat"]) for f in meta["train"]["chats"]["files"]] == [(3, 1), (1, 3)]
    assert meta["train"]["files"] == base["train"]["files"] + 6
    text = tok.decode(load_tokens(both / "train.bin").tolist())
    assert text.count("<user>Name f_5.</user>\n<assistant>f_5 adds 5.</assistant>\n<user>And f_6?</user>\n"
                      "<assistant>f_6 adds 6.</assistant>") == 3
    assert text.count("<user>What is f_0?</user>\n<assistant>It adds 0 to x.</assistant>") == 1
    r = prepare(tmp_path / "bad", "--chat-repeat", "1", "2", "3", check=False, files=(chats, turns))
    assert r.returncode != 0 and "one per --chats file" in r.stderr and not (tmp_path / "bad").exists()
    for bad in (history[:1], [history[1], history[0]], [{**history[0], "content": " "}, history[1]],
                [{**history[0], "name": "x"}, history[1]], "Name f_5."):
        turns.write_text(json.dumps({"user": "And f_6?", "assistant": "f_6 adds 6.", "history": bad}) + "\n")
        r = prepare(tmp_path / "bad", check=False, files=(chats, turns))
        assert r.returncode != 0 and "turns.jsonl:1: 'history'" in r.stderr and not (tmp_path / "bad").exists()
    chats.write_text(chats.read_text() + '{"user": "no reply"}\n')
    r = prepare(tmp_path / "bad", check=False)
    assert r.returncode != 0 and "chats.jsonl:4" in r.stderr and not (tmp_path / "bad").exists()


def test_prepare_data_texts_join_the_training_split_as_documents(tmp_path):
    """--texts: each {"seed", "text"} line is one training document, the seed and the text joined by a space (the
    teacher corpus's continuations), {"text"} alone as it is; the held-out splits are the corpus's own; a bad line is
    refused before anything is written."""
    from transformers import AutoTokenizer

    from kda_hybrid.train.data import load_tokens

    src = tmp_path / "src"
    src.mkdir()
    for i in range(150):
        (src / f"m{i:03d}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n")
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"seed": "Once upon a", "text": "time there was x.", "complete": True}) + "\n"
                     + json.dumps({"text": "A plain document."}) + "\n")

    def prepare(out, check=True):
        return subprocess.run([sys.executable, str(REPO / "examples" / "prepare_data.py"), "--out", str(out),
                               "--source", str(src), "--vocab-size", "300", "--document-token", "<|pad|>",
                               "--texts", str(texts)], capture_output=True, text=True, check=check,
                              env={**os.environ, "PYTHONPATH": str(REPO)})

    out = tmp_path / "data"
    prepare(out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["texts"]["count"] == 2
    text = AutoTokenizer.from_pretrained(out).decode(load_tokens(out / "train.bin").tolist())
    assert text.count("<|pad|>Once upon a time there was x.<|pad|>") == 1
    assert text.count("<|pad|>A plain document.<|pad|>") == 1
    assert text.count("return x + 7\n") == 1
    texts.write_text(texts.read_text() + '{"seed": "no text"}\n')
    r = prepare(tmp_path / "bad", check=False)
    assert r.returncode != 0 and "texts.jsonl:3" in r.stderr and not (tmp_path / "bad").exists()


def test_calibration_scales_each_kda_head_to_the_teachers_rms(setup):
    """calibrate_kda_outputs: per KDA layer and head, the factor is the RMS of the head's share of the teacher's
    o_proj output over the student's (measured here with the test's own hooks), applied to that head's o_proj
    columns and to nothing else; calibrating again leaves the first layer (whose input did not change) alone."""
    from transformers import AutoModelForCausalLM

    from kda_hybrid.train.data import load_tokens, make_batch

    distill = _distill_module()
    root, data = setup
    teacher = AutoModelForCausalLM.from_pretrained(root / "teacher", dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(root / "student", trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        student.model.layers[2].self_attn.o_proj.weight.mul_(7.0)  # a louder layer: its factors must say so
    tokens = load_tokens(data / "train.bin")
    batches = [make_batch(tokens, [row], SEQ_LEN, bos_id=1) for row in (0, 5)]
    heads, seen = student.config.linear_num_heads, {}
    for who, model in (("teacher", teacher), ("student", student)):
        for i in (0, 2):
            model.model.layers[i].self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, key=(who, i): seen.setdefault(key, []).append(a[0].detach()))
    with torch.no_grad():
        for b in batches:
            distill.teacher_forward(teacher, b["input_ids"], b["position_ids"])
            student(input_ids=b["input_ids"], position_ids=b["position_ids"])

    def head_rms(key, weight):
        x = torch.cat(seen.pop(key), 1)[0]  # [N, H * V]
        width = x.shape[-1] // heads
        return torch.stack([(x[:, h * width:(h + 1) * width] @ weight[:, h * width:(h + 1) * width].T).pow(2).mean()
                            for h in range(heads)]).sqrt()

    sd = student.state_dict()
    expected = {i: head_rms(("teacher", i), teacher.state_dict()[f"model.layers.{i}.self_attn.o_proj.weight"])
                / head_rms(("student", i), sd[f"model.layers.{i}.self_attn.o_proj.weight"]) for i in (0, 2)}
    before = {n: p.clone() for n, p in sd.items()}
    factors = distill.calibrate_kda_outputs(teacher, student, batches)
    assert set(factors) == {0, 2}
    after = student.state_dict()
    for i in (0, 2):
        torch.testing.assert_close(factors[i], expected[i], rtol=1e-4, atol=0)
        assert not torch.allclose(factors[i], torch.ones(heads), rtol=0.05)
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        w0 = before.pop(name)
        width = w0.shape[1] // heads
        for h in range(heads):  # head h owns o_proj's input columns h * width .. (h + 1) * width
            cols = slice(h * width, (h + 1) * width)
            torch.testing.assert_close(after[name][:, cols], w0[:, cols] * expected[i][h], rtol=1e-4, atol=0)
    assert all(torch.equal(after[n], t) for n, t in before.items())
    again = distill.calibrate_kda_outputs(teacher, student, batches)
    torch.testing.assert_close(again[0], torch.ones(heads), rtol=1e-4, atol=0)
    other = AutoModelForCausalLM.from_config(type(teacher.config)(**{
        **teacher.config.to_dict(), "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8}))
    with pytest.raises(ValueError, match="not a conversion of this teacher"):
        distill.calibrate_kda_outputs(other, student, batches[:1])
