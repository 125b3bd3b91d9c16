#!/usr/bin/env bash
# Build llama.cpp's Python binding from the PyPI sdist into the active environment, once per machine: the engine
# the slow tests in tests/test_llama_cpp.py compare against (they skip without it). 25-60 minutes on 2 cores.
# The sdist's vendor/llama.cpp holds llama.cpp's own converter too: pass --keep-source DIR to unpack it there.
set -euo pipefail
version=0.3.36
keep=""
if [ "${1:-}" = "--keep-source" ]; then keep="${2:?--keep-source needs a folder}"; fi
if python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
    echo "llama-cpp-python $version is already installed"
else
    # native CPU build (AVX2/AVX-512 where the machine has them), both cores, no cache of a differently built wheel
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
        pip install --no-cache-dir "llama-cpp-python==$version"
fi
if [ -n "$keep" ]; then
    mkdir -p "$keep"
    pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$keep"
    tar xzf "$keep/llama_cpp_python-$version.tar.gz" -C "$keep"
    echo "llama.cpp sources: $keep/llama_cpp_python-$version/vendor/llama.cpp"
fi
python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
