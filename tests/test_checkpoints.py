"""Checkpoint folders: the shipped checkpoints (load, compute what was measured, carry the package's code), the
one metadata writer (converter and save_pretrained folders load alike, through every Auto class) and the
package layout a checkpoint relies on (the modules it carries are the package's top level)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

import kda_hybrid
from kda_hybrid.checkpoint_kda_hybrid import AUTO_MAP, CARRIED_MODULES
from kda_hybrid.conversion import convert

from ._native import save_checkpoint
from .helpers import random_state_dict, tiny_kimi_config

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(kda_hybrid.__file__).parent
TEST_ONLY_TOP_LEVEL = {"kda_triton_twins.py"}  # the Triton stages' PyTorch twins: oracles, carried by no checkpoint
PACKAGE_ONLY_TOP_LEVEL = {"_moved.py"}  # the previous release's import paths, kept for one release


# the shipped checkpoints and their loss on the snippet below, fp32 on CPU (an untrained model gives ln 2048 = 7.6;
# the first 250-step checkpoint 3.96): a change of weights, tokenizer or model code moves it by far more than 1e-4
SHIPPED = {"kda-hybrid-stdlib": 1.94535, "kda-hybrid-stdlib-distilled": 2.39638, "kda-k3-stdlib": 1.60441}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_checkpoint_loads_computes_its_loss_and_generates(name):
    """A shipped checkpoint loads as a user loads it (remote code, its own tokenizer) and computes what it was
    measured to: its loss on a stdlib-style snippet, within float tolerance of the recorded value. Greedy
    generation with its generation_config (repetition penalty) decodes through the cache as a full forward over
    the generated sequence computes, and picks the argmax of the processed scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = REPO / "checkpoints" / name
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert model.config.model_type == "kda_hybrid" and len(tokenizer) == model.config.vocab_size == 2048
    assert model.model.layers[0].self_attn.A_log.dtype == torch.float32
    snippet = "import os\n\n\ndef main(self, path):\n    if not os.path.exists(path):\n        return None\n"
    ids = tokenizer(snippet, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = float(model(ids, labels=ids).loss)
        out = model.generate(ids[:, :4], max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                             output_logits=True, output_scores=True)
        full = model(out.sequences).logits[:, 3:-1]
    assert loss == pytest.approx(SHIPPED[name], rel=1e-4, abs=0), loss
    assert out.sequences.shape == (1, 12) and torch.equal(out.sequences[:, :4], ids[:, :4])
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-4, atol=1e-4)  # cached decode = forward
    assert torch.equal(out.sequences[:, 4:], torch.stack(out.scores, 1).argmax(-1))


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_checkpoint_code_is_the_package_code(name):
    """The shipped folders hold the flat modules trust_remote_code runs as relative links into kda_hybrid/, so the
    repository has the code once and a folder cannot drift from it (transformers copies what a link points at;
    tests/test_hub.py loads them in a process that cannot import the package); every module the modeling file
    needs must be there, and the model card names them."""
    import kda_hybrid
    from kda_hybrid.checkpoint_kda_hybrid import carried_modules

    folder = REPO / "checkpoints" / name
    package = Path(kda_hybrid.__file__).parent.resolve()
    fix = f"run: python scripts/refresh_checkpoint_code.py --link {folder.relative_to(REPO)}"
    wrong = [m for m in carried_modules() if not (folder / m).is_symlink()
             or os.path.isabs(os.readlink(folder / m)) or (folder / m).resolve() != package / m]
    assert not wrong, f"not relative links to the package's modules: {wrong}; {fix}"
    ours = sorted(p.name for p in folder.glob("*.py"))
    extra = set(ours) - set(carried_modules())
    assert ours == sorted(carried_modules()), f"modules the package does not carry: {extra}"
    readme = (folder / "README.md").read_text()
    unnamed = [m for m in carried_modules() if f"`{m}`" not in readme]
    assert not unnamed, f"the model card does not name the carried modules {unnamed}"


def test_saving_a_model_loaded_from_a_linked_folder_writes_real_files(tmp_path):
    """What leaves the repository is self-contained: save_pretrained and the converter write the modules as files."""
    from transformers import AutoModelForCausalLM

    from kda_hybrid.checkpoint_kda_hybrid import carried_modules

    src = REPO / "checkpoints" / "kda-hybrid-stdlib"
    model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True)
    model.save_pretrained(tmp_path / "saved")
    convert(src, tmp_path / "converted", progress=False)
    for folder in (tmp_path / "saved", tmp_path / "converted"):
        for m in carried_modules():
            path = folder / m
            assert path.is_file() and not path.is_symlink(), (folder.name, m)
            assert path.read_bytes() == (src / m).read_bytes(), (folder.name, m)


def _load_every_head(folder: Path) -> dict[str, torch.nn.Module]:
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    kw = dict(trust_remote_code=True, dtype=torch.float32)
    return {"AutoModel": AutoModel.from_pretrained(folder, **kw),
            "AutoModelForCausalLM": AutoModelForCausalLM.from_pretrained(folder, **kw),
            "AutoModelForSequenceClassification": AutoModelForSequenceClassification.from_pretrained(
                folder, num_labels=3, **kw),
            "AutoModelForTokenClassification": AutoModelForTokenClassification.from_pretrained(
                folder, num_labels=3, **kw)}


def test_converter_and_save_pretrained_folders_load_alike(tmp_path):
    """A converted checkpoint and the save_pretrained folder of the model loaded from it hold the same metadata
    (auto_map with every head, the same code files byte for byte, a generated model card) and load through every
    Auto class with trust_remote_code, classification heads included, to the same base weights."""
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "kimi", random_state_dict(cfg), cfg)
    converted = convert(src, tmp_path / "converted", progress=False)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted, trust_remote_code=True, dtype=torch.float32)
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    configs = {f: json.loads((f / "config.json").read_text()) for f in (converted, saved)}
    for folder, config in configs.items():
        assert config["auto_map"] == AUTO_MAP, folder.name
        assert sorted(p.name for p in folder.glob("*.py")) == sorted(CARRIED_MODULES), folder.name
        assert "kda-hybrid: generated model card" in (folder / "README.md").read_text(), folder.name
    for name in CARRIED_MODULES:
        assert (converted / name).read_bytes() == (saved / name).read_bytes() == (PACKAGE / name).read_bytes(), name
    heads = {f.name: _load_every_head(f) for f in (converted, saved)}
    base = heads["converted"]["AutoModel"].state_dict()
    for folder, models in heads.items():
        for auto, loaded in models.items():
            assert type(loaded).__name__ == AUTO_MAP[auto].split(".")[1], (folder, auto)
            body = loaded.model if hasattr(loaded, "model") else loaded
            for key, tensor in base.items():
                assert torch.equal(body.state_dict()[key], tensor), (folder, auto, key)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, level) of every `from ... import ...` in `path` (at any depth)."""
    tree = ast.parse(path.read_text())
    return [(node.module or "", [a.name for a in node.names], node.level)
            for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]


def test_the_top_level_is_what_a_checkpoint_carries():
    """kda_hybrid/ shows its structure: at the top, the modules a checkpoint carries (the modeling file and all it
    imports, found by transformers' own rule) plus the Triton twins and the moved paths' finder; tooling lives in
    sub-packages."""
    top = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py"}
    assert top == set(CARRIED_MODULES) | TEST_ONLY_TOP_LEVEL | PACKAGE_ONLY_TOP_LEVEL
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == {
        "bench", "conversion", "inference", "train"}
    for name in CARRIED_MODULES:  # flat: a checkpoint folder has no sub-packages to import from
        bad = [m for m, _, level in _imports(PACKAGE / name) if level > 1 or (level == 1 and "." in m)]
        assert not bad, (name, bad)


def test_carried_modules_import_no_circle_and_the_model_no_private_names():
    """The carried modules' imports form no circle (eager or lazy), and no carried module imports a private name
    from another (the model, the cache, the ops, the Triton kernels and their runtime, MXFP4): each uses the
    others' public API."""
    graph = {name[:-3]: {m for m, _, level in _imports(PACKAGE / name) if level == 1} for name in CARRIED_MODULES}

    def visit(node, path):
        assert node not in path, f"import circle: {' -> '.join([*path, node])}"
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])

    for node in graph:
        visit(node, [])
    for module in CARRIED_MODULES:
        private = [(m, n) for m, names, level in _imports(PACKAGE / module) if level == 1
                   for n in names if n.startswith("_")]
        assert not private, (module, private)


@pytest.mark.parametrize("name", list(SHIPPED))
def test_every_folder_under_checkpoints_is_a_checkpoint(name):
    """Everything under checkpoints/ is a checkpoint: weights and an auto_map naming every Auto class (that each
    loads and computes is test_shipped_checkpoint_loads_computes_its_loss_and_generates; that its code is the package's,
    test_shipped_checkpoint_code_is_the_package_code)."""
    folder = REPO / "checkpoints" / name
    assert (folder / "model.safetensors").is_file()
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == AUTO_MAP
    assert {p.name for p in (REPO / "checkpoints").iterdir()} == set(SHIPPED)
