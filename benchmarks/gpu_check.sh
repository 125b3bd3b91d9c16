#!/usr/bin/env bash
# One device check on a lent CUDA GPU (written for an H200, 16 cores), about 7-8 minutes (under 480 s):
#   1. report the environment; pip-install only what is missing (the device may be offline: then skip)
#   2. python -m pytest -q tests/test_triton.py tests/test_ops.py   (forward and backward kernels compiled and
#      run on CUDA, 16-bit error bounds for outputs and every gradient)
#   3. python benchmarks/bench_gpu.py --quick                       (writes benchmarks/results_gpu.md)
#   4. python benchmarks/bench_k3_moe.py --device cuda ...          (the fused MXFP4 kernel vs bf16 experts)
# Run from anywhere: bash benchmarks/gpu_check.sh. Each step has its own time limit so a hang in one still
# leaves the others' output; the exit status is that of the tests.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, never the interpreter, on the GPU
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/kda_triton_cache}"  # a rerun on the same machine skips compiles
PY="${PYTHON:-python}"
start=$SECONDS

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not found"
nproc
"$PY" - <<'PYEOF'
import importlib
import torch
print(f"python torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()}")
for name in ("triton", "fla", "pytest", "transformers", "einops"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as err:
        print(f"{name} MISSING ({type(err).__name__}: {err})")
PYEOF

missing=""
"$PY" -c "import pytest" 2>/dev/null || missing="$missing pytest"
"$PY" -c "import triton" 2>/dev/null || missing="$missing triton"
"$PY" -c "import fla.ops.kda" 2>/dev/null || missing="$missing flash-linear-attention"
if [ -n "$missing" ]; then
    echo "== installing:$missing (60 s limit; skipped if the machine is offline)"
    timeout 60 "$PY" -m pip install -q --disable-pip-version-check $missing || echo "pip install failed; continuing"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch has no CUDA here: nothing to check on the device"; exit 2
fi

echo "== tests (limit 330 s: nine kernels to compile per dtype)"
timeout 330 "$PY" -m pytest -q -p no:cacheprovider --durations=10 tests/test_triton.py tests/test_ops.py
tests_rc=$?
echo "tests exit status $tests_rc after $((SECONDS - start)) s"

echo "== quick benchmark (limit $((480 - (SECONDS - start))) s)"
left=$((480 - (SECONDS - start)))
if [ "$left" -gt 30 ]; then
    timeout "$left" "$PY" benchmarks/bench_gpu.py --quick || echo "benchmark exit status $?"
    # K3's MXFP4 experts: the fused kernel against bf16 experts and against expanding per call
    left=$((480 - (SECONDS - start)))
    [ "$left" -gt 30 ] && { timeout "$left" "$PY" benchmarks/bench_k3_moe.py --device cuda --experts 64 \
        --tokens 1 16 256 2048 --repeats 20 || echo "bench_k3_moe exit status $?"; }
    # bench_gpu.py printed its tables; the device runner returns files under $OUT
    if [ -f benchmarks/results_gpu.md ] && [ -n "${OUT:-}" ]; then
        cp benchmarks/results_gpu.md "$OUT/"
    fi
else
    echo "no time left for the benchmark"
fi
echo "== done in $((SECONDS - start)) s"
exit $tests_rc
