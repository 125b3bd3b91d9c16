"""The repository as a reader meets it: every relative link of its Markdown resolves, every repository path the
docs, scripts and examples name exists, and no code edits sys.path (scripts import their own folder's siblings,
shared pieces live in the package, tests load scripts by path: tests/helpers.load_script)."""

from __future__ import annotations

import re
import subprocess

import pytest

from .helpers import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:examples|benchmarks|docs|scripts|tests|deltas|checkpoints)/[\w./-]*\w"
                       r"\.(?:py|sh|md|txt|json|png|jsonl))\b")


def tracked(*suffixes) -> list[str]:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.split() if f.endswith(suffixes) and (REPO / f).is_file()]


def test_every_relative_markdown_link_resolves():
    broken = []
    for f in tracked(".md"):
        for target in LINK.findall((REPO / f).read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not ((REPO / f).parent / target).exists():
                broken.append(f"{f}: {target}")
    assert not broken, broken


# what a run writes, named before it has run
# written by a script when it runs, not before: benchmarks/gpu_check.sh on a GPU machine, the second SmolLM2 recipe,
# its stage-3 A/B
OUTPUTS = {"benchmarks/results_gpu.md", "docs/records/smollm2/layer_ranking.json",
           "docs/records/smollm2/teacher_corpus_metrics.json", "docs/records/smollm2/teacher_corpus_transcripts.md",
           "docs/records/smollm2/quality_vs_tokens.png", "docs/records/smollm2/stage3_metrics.json"}


def test_every_repository_path_the_docs_and_scripts_name_exists():
    """CHANGELOG.md is history: it names paths as they were."""
    missing = set()
    for f in tracked(".md", ".py", ".sh", ".txt"):
        if f == "CHANGELOG.md" or f.startswith(("tests/fixtures/", "deltas/", "checkpoints/")):
            continue
        for path in REPO_PATH.findall((REPO / f).read_text(errors="replace")):
            if not (REPO / path).exists() and path not in OUTPUTS:
                missing.add(f"{f}: {path}")
    assert not missing, sorted(missing)


def test_no_code_edits_sys_path():
    edits = [f for f in tracked(".py", ".sh") if re.search(r"sys\.path\.(insert|append)|sys\.path\s*=|sys\.path\s*\+=",
                                                            (REPO / f).read_text())]
    assert not edits, edits


def test_every_shell_script_parses():
    """The recipe and CI scripts run for hours before reaching their last lines: a syntax error there must fail here."""
    scripts = tracked(".sh") + [".ci/run"]
    assert scripts
    bad = {f: r.stderr for f in scripts if (r := subprocess.run(["bash", "-n", str(REPO / f)], capture_output=True,
                                                                 text=True)).returncode}
    assert not bad, bad
