"""examples/smollm2/teacher_corpus.py: the distillation corpus the teacher writes itself. A tiny Llama with the test
tokenizer (chat template included) as the teacher; resume after a kill equals an uninterrupted run; the manifest
records what made the corpus and refuses another teacher or other settings; held-out prompts stay out of the
training files."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ._tokenizer import VOCAB_SIZE, tiny_tokenizer
from .helpers import load_script

tc = load_script("examples/smollm2/teacher_corpus.py", "teacher_corpus_example")

PROMPTS = """# test prompts
## chat: everyday
What is a good breakfast?
How do I boil an egg?
Name three colours.
## chat: code
What does len() return?
Write a function that adds two numbers.
## seed: story
The old lighthouse keeper had not seen a ship in
"""


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher") / "llama"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _run(teacher, out, prompts, *extra):
    return tc.main(["--teacher", str(teacher), "--out", str(out), "--prompts", str(prompts), "--samples", "2",
                    "--max-new-tokens", "12", "--batch-size", "3", "--threads", "1", "--no-progress",
                    "--held-out", "0.3", *extra])


def _kill_mid_write(log: Path) -> None:
    """What a kill mid-write leaves: the log's last line cut short, its batch no longer whole."""
    lines = log.read_bytes().split(b"\n")
    log.write_bytes(b"\n".join(lines[:-2]) + b"\n" + lines[-2][:10])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_corpus_resumes_after_a_kill_to_what_one_run_writes(teacher, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    _run(teacher, tmp_path / "whole", prompts)
    whole = _files(tmp_path / "whole")
    manifest = json.loads(whole["manifest.json"])
    assert manifest["complete"] is True and manifest["prompts"] == 6
    assert manifest["teacher_sha256"] == tc.teacher_sha256(teacher)
    assert manifest["sampling"]["temperature"] == 0.8 and manifest["sampling"]["samples"] == 2
    log = [json.loads(line) for line in whole["samples.jsonl"].decode().splitlines()]
    assert len(log) == 5 * 2 + 1 * 2  # two replies per chat prompt, two continuations of the seed
    assert sum(r["tokens"] for r in log) == sum(c["tokens"] for c in manifest["files"].values()) > 0

    # the same corpus in steps: one batch, then a kill mid-batch (a whole line and a cut one lost), then the rest
    part = tmp_path / "parts"
    _run(teacher, part, prompts, "--max-batches", "1")
    assert json.loads((part / "manifest.json").read_text())["complete"] is False
    _run(teacher, part, prompts, "--max-batches", "2")
    _kill_mid_write(part / "samples.jsonl")
    _run(teacher, part, prompts)
    assert _files(part) == whole


def test_held_out_prompts_stay_out_of_the_training_files(teacher, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    _run(teacher, tmp_path / "c", prompts)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    held = {q.text for q in tc.read_prompts(prompts) if q.split(0.3) == "heldout"}
    assert 0 < len(held) < 6 and manifest["prompts_by_split"]["heldout"] == len(held)
    for name in manifest["files"]:
        rows = [json.loads(line) for line in (tmp_path / "c" / name).read_text().splitlines()]
        texts = {r.get("user", r.get("seed")) for r in rows}
        assert (texts <= held) if "heldout" in name else not (texts & held), name
        if name.startswith("chats"):
            assert all({"user", "assistant", "complete"} <= r.keys() for r in rows)  # prepare_data.py --chats


def _one_batch(teacher, tmp_path) -> tuple[Path, Path, dict[str, bytes]]:
    """The test prompts, a corpus folder holding its first batch, and that folder's files."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    out = tmp_path / "c"
    _run(teacher, out, prompts, "--max-batches", "1")
    return prompts, out, _files(out)


def test_another_teacher_or_other_settings_are_refused_before_anything_is_written(teacher, tmp_path):
    prompts, out, before = _one_batch(teacher, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    model = LlamaForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)
    model.save_pretrained(other)
    with pytest.raises(SystemExit, match="another teacher sha256"):
        _run(other, out, prompts)
    with pytest.raises(SystemExit, match="another sampling"):
        _run(teacher, out, prompts, "--temperature", "0.7")
    prompts.write_text(PROMPTS + "What is rain?\n")
    with pytest.raises(SystemExit, match="another prompts sha256"):
        _run(teacher, out, prompts)
    assert _files(out) == before


def test_prompt_files_are_checked():
    bad = Path(__file__).parent / "_no_such_prompts.txt"
    try:
        bad.write_text("a prompt before a section\n")
        with pytest.raises(SystemExit, match="before any"):
            tc.read_prompts(bad)
        bad.write_text("## chat: x\nsame\nsame\n")
        with pytest.raises(SystemExit, match="duplicate prompt"):
            tc.read_prompts(bad)
        for line in ("one turn only", "a >> ", "a >>  >> b"):
            bad.write_text(f"## followup: x\n{line}\n")
            with pytest.raises(SystemExit, match="two or more non-empty user turns"):
                tc.read_prompts(bad)
        bad.write_text("## chat: x\na >> b\n## followup: y\nc >> d\n")  # a chat line keeps its ' >> '
        assert [q.turns for q in tc.read_prompts(bad)] == [["a >> b"], ["c", "d"]]
    finally:
        bad.unlink(missing_ok=True)


def test_the_committed_prompt_set_is_broad():
    """At least 500 chat prompts over at least 20 categories, plus seeds; none repeated (read_prompts refuses)."""
    prompts = tc.read_prompts(tc.PROMPTS)
    chats = [q for q in prompts if q.kind == "chat"]
    categories = {q.category for q in chats}
    assert len(chats) >= 500 and len(categories) >= 20, (len(chats), len(categories))
    assert min(sum(q.category == c for q in chats) for c in categories) >= 20
    assert sum(q.kind == "seed" for q in prompts) >= 40
    held = sum(q.split(0.1) == "heldout" for q in chats)
    assert 0.05 * len(chats) < held < 0.15 * len(chats)


FOLLOWUPS = """## followup: places
What is the capital of France? >> And of Italy?
Name a large river. >> Where does it end? >> Is it longer than the Nile?
## chat: everyday
How do I boil an egg?
## followup: writing
Write a line about rain. >> Now make it about snow.
Give me a number. >> Double it.
"""


@pytest.fixture(scope="module")
def ending_teacher(teacher, tmp_path_factory):
    """The tiny teacher made to end its replies early (the end-of-turn token about one time in four at every
    position: hidden channel 0 held constant through the layers and read by the EOS row of the head alone), so that
    conversations reach their later turns within a few tokens, and some replies are still cut short."""
    folder = tmp_path_factory.mktemp("ending") / "llama"
    shutil.copytree(teacher, folder)
    model = LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[2, 0] = 0.6
    model.save_pretrained(folder)
    return folder


def _conversation_run(teacher, tmp_path, name, *extra):
    prompts = tmp_path / "followups.txt"
    prompts.write_text(FOLLOWUPS)
    _run(teacher, tmp_path / name, prompts, "--samples", "4", *extra)
    return prompts, tmp_path / name


def test_conversations_reply_to_every_turn_in_context_and_resume(ending_teacher, tmp_path, monkeypatch):
    """A followup line's later turns are sampled after the earlier turns and the teacher's own replies, through the
    chat template (the inputs generate() is given, recorded); a conversation stops at a reply cut short; the rows
    carry every earlier turn as "history"; and a killed run resumes to what one run writes."""
    calls = []
    real = tc.generate

    def spy(model, tok, jobs, args, b, turn=0):
        gens = real(model, tok, jobs, args, b, turn)
        calls.extend((b, turn, i, s, ids, gen) for (i, s, ids), gen in zip(jobs, gens))
        return gens

    monkeypatch.setattr(tc, "generate", spy)
    prompts, out = _conversation_run(ending_teacher, tmp_path, "whole")
    monkeypatch.setattr(tc, "generate", real)
    whole = _files(out)
    _, tok = tc.load_teacher(ending_teacher, tokenizer_only=True)
    listed = tc.read_prompts(prompts)
    log = [json.loads(line) for line in whole["samples.jsonl"].decode().splitlines()]
    assert len(log) == 5 * 4
    turns_done = Counter()
    for r in log:
        q = listed[r["prompt"]]
        mine = sorted((turn, ids, gen) for b, turn, i, s, ids, gen in calls if (b, i, s) == (r["batch"], r["prompt"],
                                                                                               r["sample"]))
        assert [turn for turn, *_ in mine] == list(range(len(mine)))
        if q.kind == "chat":
            assert "replies" not in r and len(mine) == 1
            continue
        replies = r["replies"]
        assert len(replies) == len(mine) and r["text"] == replies[-1]["text"]
        assert r["tokens"] == sum(x["tokens"] for x in replies) and r["complete"] == replies[-1]["complete"]
        for k, (_, ids, gen) in enumerate(mine):  # each turn's input: the conversation so far
            messages = [m for u, a in zip(q.turns[:k], replies) for m in ({"role": "user", "content": u},
                                                                         {"role": "assistant", "content": a["text"]})]
            expected = tok.apply_chat_template(messages + [{"role": "user", "content": q.turns[k]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
            assert ids == list(expected["input_ids"])
            assert replies[k] == tc.reply_record(tok, gen)
        # it went on while the replies ended, and stopped at the first one cut short (or empty)
        assert all(x["complete"] and x["text"] for x in replies[:-1])
        assert len(replies) == len(q.turns) or not (replies[-1]["complete"] and replies[-1]["text"])
        turns_done[len(replies)] += 1
    assert turns_done[1] and turns_done[2] and turns_done[3], turns_done  # cut at the first turn; both later turns

    for split in ("train", "heldout"):
        for row in map(json.loads, (out / f"chats-{split}.jsonl").read_text().splitlines()):
            r = next(x for x in log if (x["prompt"], x["sample"]) == (row["prompt"], row["sample"]))
            q, replies = listed[r["prompt"]], r.get("replies", [r])
            assert row["user"] == q.turns[len(replies) - 1] and row["assistant"] == r["text"]
            assert row["history"] == [m for u, a in zip(q.turns, replies[:-1]) for m in (
                {"role": "user", "content": u}, {"role": "assistant", "content": a["text"]})] if len(replies) > 1 \
                else "history" not in row

    part = tmp_path / "parts"
    _run(ending_teacher, part, prompts, "--samples", "4", "--max-batches", "2")
    _kill_mid_write(part / "samples.jsonl")
    _run(ending_teacher, part, prompts, "--samples", "4")
    assert _files(part) == whole


def test_the_committed_followup_set_is_broad():
    """At least 250 conversations over at least 14 categories, every line two or more user turns, about a tenth
    held out; no first turn is a prompt of the single-turn sets (the report's held-out prompts stay unseen)."""
    prompts = tc.read_prompts(tc.FOLLOWUPS)
    assert {q.kind for q in prompts} == {"followup"}
    categories = {q.category for q in prompts}
    assert len(prompts) >= 250 and len(categories) >= 14, (len(prompts), len(categories))
    assert all(len(q.turns) >= 2 for q in prompts)
    single = {q.text.lower() for q in tc.read_prompts(tc.PROMPTS)} | {
        line.strip().lower() for line in (tc.PROMPTS.parent / "chat_prompts.txt").read_text().splitlines()}
    assert not {q.turns[0].lower() for q in prompts} & single
    held = sum(q.split(0.1) == "heldout" for q in prompts)
    assert 0.05 * len(prompts) < held < 0.15 * len(prompts)


def test_the_llama_cpp_engine_takes_a_gguf_teacher_only(teacher, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    with pytest.raises(SystemExit) as refused:
        _run(teacher, tmp_path / "c", prompts, "--engine", "llama_cpp")
    assert refused.value.code == 2 and not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def gguf_teacher(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    from ._gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


def test_llama_cpp_corpus_resumes_to_what_one_run_writes(gguf_teacher, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    _run(gguf_teacher, tmp_path / "whole", prompts, "--engine", "llama_cpp")
    whole = _files(tmp_path / "whole")
    log = [json.loads(line) for line in whole["samples.jsonl"].decode().splitlines()]
    assert len(log) == 12 and {r["engine"] for r in log} == {"llama_cpp"}
    assert json.loads(whole["manifest.json"])["samples_by_engine"] == {"llama_cpp": 12}
    assert all(0 < r["tokens"] <= 12 for r in log)
    assert len({r["text"] for r in log}) > 1  # sampled, not one reply repeated
    part = tmp_path / "parts"
    _run(gguf_teacher, part, prompts, "--engine", "llama_cpp", "--max-batches", "2")
    _kill_mid_write(part / "samples.jsonl")
    _run(gguf_teacher, part, prompts, "--engine", "llama_cpp")
    assert _files(part) == whole


def test_llama_cpp_conversations_fit_the_context_and_resume(gguf_teacher, tmp_path, monkeypatch):
    """Through llama.cpp, every turn's input and reply fit the context the run opened (context_bound), later turns
    are reached, and a killed run resumes to what one run writes."""
    seen = []
    real = tc.LlamaCppTeacher.sample

    def spy(self, ids, seed):
        out = real(self, ids, seed)
        seen.append((len(ids) + len(out), self.llm.n_ctx()))
        return out

    monkeypatch.setattr(tc.LlamaCppTeacher, "sample", spy)
    prompts, out = _conversation_run(gguf_teacher, tmp_path, "whole", "--engine", "llama_cpp", "--max-new-tokens",
                                     "96")
    monkeypatch.setattr(tc.LlamaCppTeacher, "sample", real)
    log = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert max(len(r.get("replies", [r])) for r in log) >= 2
    assert all(used <= ctx for used, ctx in seen) and len(seen) > len(log)
    part = tmp_path / "parts"
    _run(gguf_teacher, part, prompts, "--samples", "4", "--engine", "llama_cpp", "--max-new-tokens", "96",
         "--max-batches", "3")
    _run(gguf_teacher, part, prompts, "--samples", "4", "--engine", "llama_cpp", "--max-new-tokens", "96")
    assert _files(part) == _files(out)


def _nucleus(logits, temperature: float, top_p: float) -> set[int]:
    """transformers' top-p set: the most likely tokens of softmax(logits / temperature) until their mass reaches
    top_p."""
    probs = torch.softmax(torch.as_tensor(logits, dtype=torch.float64) / temperature, -1)
    order = probs.argsort(descending=True)
    mass = probs[order].cumsum(0)
    return set(order[: int((mass < top_p).sum()) + 1].tolist())


def test_llama_cpp_sampling_tempers_before_the_nucleus(gguf_teacher):
    """transformers' order: the temperature divides the logits, then top-p keeps the nucleus of that distribution
    (llama.cpp's own chain takes the nucleus of the untempered one). At temperature 2 the tempered nucleus is the
    larger: every first token sampled lies in it, and some lie outside the untempered one. A top-p so small that
    only the most likely token survives gives llama.cpp's greedy reply whatever the seed."""
    from llama_cpp import Llama, LogitsProcessorList

    _, tok = tc.load_teacher(gguf_teacher, tokenizer_only=True)
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    llm = Llama(str(gguf_teacher), n_ctx=128, n_threads=1, verbose=False)
    seen = []
    next(llm.generate(ids, temp=0.0, logits_processor=LogitsProcessorList([lambda _, x: seen.append(x.copy()) or x])))
    logits = seen[0]
    tempered, untempered = _nucleus(logits, 2.0, 0.5), _nucleus(logits, 1.0, 0.5)
    assert untempered < tempered
    teacher = tc.LlamaCppTeacher(gguf_teacher, threads=1, context=128, temperature=2.0, top_p=0.5, max_new_tokens=1,
                                 eos=tok.eos_token_id)
    first = [teacher.sample(ids, seed)[0] for seed in range(200)]
    assert set(first) <= tempered and set(first) - untempered, (sorted(set(first)), sorted(untempered))

    greedy = []
    for token in llm.generate(ids, temp=0.0):
        greedy.append(token)
        if token == tok.eos_token_id or len(greedy) == 10:
            break
    teacher = tc.LlamaCppTeacher(gguf_teacher, threads=1, context=128, temperature=2.0, top_p=1e-6, max_new_tokens=10,
                                 eos=tok.eos_token_id)
    assert [teacher.sample(ids, seed) for seed in (1, 2, 3)] == [greedy] * 3


def test_a_second_run_on_the_same_corpus_is_refused(teacher, tmp_path):
    prompts, out, before = _one_batch(teacher, tmp_path)
    held = tc.hold_lock(out)  # as a run in progress holds it
    try:
        with pytest.raises(SystemExit, match="another teacher_corpus.py run is writing"):
            _run(teacher, out, prompts)
    finally:
        held.close()
    assert _files(out) == before
    _run(teacher, out, prompts)  # released: the run goes on
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
