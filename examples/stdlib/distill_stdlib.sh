#!/usr/bin/env bash
# The distillation experiment of docs/records/stdlib-distillation/README.md, end to end on one CPU thread per run (about 2 hours here):
# a Llama-architecture teacher on the stdlib corpus with the shipped hybrid's budget (1,400 steps x 2,048 tokens),
# its conversion to kkkAkkkA, two distillation stages on 280 steps (20% of the teacher's tokens), and a hybrid of the
# same shape trained from scratch on those 280 steps; then the report. Runs resume where they stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-out/data/stdlib}
RUNS=${RUNS:-out/runs}
COMMON=(--data "$DATA" --seq-len 512 --batch-size 4 --micro-batch-size 4 --save-every 50 --save-dtype bf16
        --threads 1 --resume)

[ -f "$DATA/meta.json" ] || python examples/prepare_data.py --out "$DATA" --tokenizer checkpoints/kda-hybrid-stdlib
# teacher: every layer GQA + RoPE, i.e. a Llama (exported as LlamaForCausalLM below)
python examples/train.py "${COMMON[@]}" --out "$RUNS/teacher" --steps 1400 --lr 3e-3 --warmup 20 --eval-every 200 \
    --all-attention --config-json '{"attention_type": "gqa", "num_key_value_heads": 4}'
[ -d "$RUNS/teacher-llama" ] || python -c "from kda_hybrid.conversion.to_attention import export_llama; \
export_llama('$RUNS/teacher/final', '$RUNS/teacher-llama')"
[ -d "$RUNS/student0" ] || python -m kda_hybrid.conversion "$RUNS/teacher-llama" "$RUNS/student0" \
    --layer-types kkkAkkkA --no-progress
python examples/distill.py "${COMMON[@]}" --stage 1 --teacher "$RUNS/teacher-llama" --student "$RUNS/student0" \
    --out "$RUNS/distill-1" --steps 80 --lr 1e-3 --warmup 8 --eval-every 80 --seed 1
python examples/distill.py "${COMMON[@]}" --stage 2 --teacher "$RUNS/teacher-llama" \
    --student "$RUNS/distill-1/final" --out "$RUNS/distill-2" --steps 200 --lr 1e-3 --warmup 10 --eval-every 100 \
    --seed 2
# the same shape from scratch, on the distillation's 280 steps
python examples/train.py "${COMMON[@]}" --out "$RUNS/scratch-kkkAkkkA" --steps 280 --lr 3e-3 --warmup 20 \
    --eval-every 140 --config-json '{"attention_type": "gqa", "num_key_value_heads": 4, "layer_types":
    ["linear_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention",
     "linear_attention", "linear_attention", "full_attention"]}'
python examples/stdlib/distill_report.py --data "$DATA" \
    --model teacher="$RUNS/teacher/final" --model "converted (before distillation)"="$RUNS/student0" \
    --model "after stage 1"="$RUNS/distill-1/final" --model "after stage 2"="$RUNS/distill-2/final" \
    --model "from scratch, 280 steps"="$RUNS/scratch-kkkAkkkA/final" \
    --stage-logs "$RUNS/distill-1" "$RUNS/distill-2" --plot docs/records/stdlib-distillation/distillation_loss.png \
    --json docs/records/stdlib-distillation/distillation_metrics.json --samples docs/records/stdlib-distillation/distillation_samples.md \
    --sample-from teacher "after stage 2"
