"""kda-hybrid: Kimi Delta Attention hybrid language models for Hugging Face transformers."""

import re
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "kda_hybrid" / "__init__.py").read_text()).group(1)

setup(
    name="kda-hybrid",
    version=version,
    description="Kimi Delta Attention hybrid language models (Kimi Linear architecture) for Hugging Face transformers",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["kda_hybrid", "kda_hybrid.*"]),
    install_requires=[
        # 2.13 is the CPU build this project is developed on; any 2.4+ works. Keep the upper bound open
        # only as far as a build that exists: a bare `torch` pulls a multi-GB CUDA wheel on CPU machines.
        "torch>=2.4,<2.15",
        "transformers>=5.0,<6",
        "accelerate>=1.0",
        "safetensors>=0.4",
        "huggingface_hub>=1.0",
        "tokenizers>=0.21",
        "tqdm",
        "triton>=3.2; platform_system == 'Linux'",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            # independent oracles: fla's naive KDA (plain torch) and transformers' native kimi_linear
            "flash-linear-attention==0.6.*",
            "einops",
            "peft>=0.21",  # LoRA fine-tuning test (tests/test_train.py)
            "accelerate>=1.0",
            "matplotlib",  # training report and long-context plots
            "ruff",  # .ci/run lints with the config in pyproject.toml
            "torchao>=0.18",  # int8 weight-only quantised decode (tests/test_ecosystem.py); pulls no torch of its own
        ],
        "bench": ["matplotlib", "psutil"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: MIT License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
