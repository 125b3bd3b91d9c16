"""The path users meet: a checkpoint folder (or Hub repo) loaded with trust_remote_code=True by a process that
cannot import kda_hybrid, fla or triton. Save -> fresh-process load; push_to_hub to a local stand-in Hub ->
fresh-process load by repo id; the model card; the push example's dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import pipeline
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

import kda_hybrid
from kda_hybrid import KDAHybridCache, KDAHybridConfig
from kda_hybrid.checkpoint_kda_hybrid import GENERATED_MARKER, cache_bytes, model_card, write_model_card

from . import helpers
from ._fake_hub import FakeHub
from ._tokenizer import EOS_ID, VOCAB_SIZE, tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(kda_hybrid.__file__).parent
EXAMPLE = REPO_ROOT / "examples" / "push_to_hub.py"
MAX_SHARD = "100KB"  # the tiny model is ~0.9 MB in fp32: about 9 shards
PROMPT = "Return the value of the named attribute"
CHAT = [{"role": "user", "content": "Which module joins paths?"}]
NEW_TOKENS = 8
MARKER = "@@kda-hub-test@@"
REMOTE_CODE_QUESTION = "Do you wish to run the custom code?"
SUBPROCESS_TIMEOUT = 240  # seconds; each child imports torch + transformers (~5 s here) and runs a tiny model
THREADS = max(1, min(2, os.cpu_count() or 1))  # as conftest: the child must add in the same order to match bits


def tiny_config(attention="mla", moe=True, **over):
    """helpers.tiny_config with MoE and the test tokenizer's vocabulary and EOS."""
    return helpers.tiny_config(attention, moe, vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, **over)


def tiny_model(attention="mla", moe=True, seed=0):
    """helpers.tiny_model (non-default norms and router biases, so every parameter must survive the trip) with
    MoE and the test tokenizer's vocabulary and EOS."""
    return helpers.tiny_model(attention, moe, seed, vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID)


# --------------------------------------------------------------------------------------------------
# The fresh process: kda_hybrid, fla and triton are absent (imports fail as for a missing package), HF_HOME is
# new (so the dynamic-modules cache is empty), cwd is a temp dir, Python runs isolated (-I: no PYTHONPATH,
# no user site, no script dir on sys.path).
# --------------------------------------------------------------------------------------------------

BLOCKER = """
import importlib.abc, importlib.util, sys
_ABSENT = {"kda_hybrid", "fla", "triton"}
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Absent())
_find_spec = importlib.util.find_spec
def _find_spec_absent(name, package=None):  # availability checks (transformers, torch) see no such package
    return None if name.partition(".")[0] in _ABSENT else _find_spec(name, package)
importlib.util.find_spec = _find_spec_absent
"""

LOADER = """
import json, sys, torch
torch.set_num_threads({threads})
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
src = {src!r}
config = AutoConfig.from_pretrained(src, trust_remote_code=True)
base = AutoModel.from_pretrained(src, trust_remote_code=True).eval()
model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(src, trust_remote_code=True)  # as the model card says
ids = tok({prompt!r}, return_tensors="pt").input_ids
with torch.no_grad():
    hidden = base(ids).last_hidden_state
    logits = model(ids).logits
greedy = model.generate(ids, max_new_tokens={n}, do_sample=False, return_dict_in_generate=True, output_logits=True)
pipe = pipeline("text-generation", model=src, trust_remote_code=True)
ops = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".kda_ops"]
result = dict(
    classes=[type(o).__module__ + "." + type(o).__name__ for o in (config, base, model, pipe.model)],
    ids=ids.tolist(), hidden=hidden.double().tolist(), logits=logits.double().tolist(),
    greedy=greedy.sequences.tolist(), greedy_logits=torch.stack(greedy.logits, 1).double().tolist(),
    chat_text=tok.apply_chat_template({chat!r}, add_generation_prompt=True, tokenize=False),
    pipe_text=pipe({prompt!r}, max_new_tokens={n}, do_sample=False)[0]["generated_text"],
    pipe_chat=pipe({chat!r}, max_new_tokens={n}, do_sample=False)[0]["generated_text"],
    triton_available=ops.triton_available(),
    leaked=sorted(m for m in sys.modules if m.partition(".")[0] in ("kda_hybrid", "fla", "triton")),
)
print(); print({marker!r}, flush=True)
# without trust_remote_code, AutoTokenizer (transformers 5) reads config.json through AutoConfig first: the
# remote-code question is asked (stdin is closed here, so it is declined) and the tokenizer still loads
plain = AutoTokenizer.from_pretrained(src)
result["plain_tokenizer_ids"] = plain({prompt!r}).input_ids
print(); print({marker!r} + json.dumps(result), flush=True)
"""


def run_python(code: str, tmp_path: Path, env_extra: dict | None = None, isolated: bool = True) -> str:
    script = tmp_path / f"child_{len(list(tmp_path.glob('child_*.py')))}.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
               TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    cmd = [sys.executable, "-I", str(script)] if isolated else [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def load_in_fresh_process(src: str, tmp_path: Path, env_extra: dict) -> dict:
    code = BLOCKER + LOADER.format(src=src, prompt=PROMPT, chat=CHAT, n=NEW_TOKENS, threads=THREADS, marker=MARKER)
    out = run_python(code, tmp_path, env_extra)
    documented, _, rest = out.partition(MARKER)
    assert REMOTE_CODE_QUESTION not in documented, "a documented call asked the trust_remote_code question"
    return json.loads(rest.rpartition(MARKER)[2].strip())


@pytest.mark.parametrize("name", ["kda-hybrid-stdlib", "kda-k3-stdlib"])
def test_shipped_folders_load_in_a_process_without_the_package(name, tmp_path):
    """The shipped folders link their modules into kda_hybrid/ (the code exists once in the repository):
    transformers copies what the links point at into its module cache, so a process that cannot import kda_hybrid
    loads them, to our logits."""
    from transformers import AutoModelForCausalLM

    src = REPO_ROOT / "checkpoints" / name
    code = BLOCKER + f"""
import json, sys, torch
torch.set_num_threads({THREADS})
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(src)!r}, trust_remote_code=True, dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(torch.arange(1, 25)[None]).logits
leaked = sorted(m for m in sys.modules if m.partition(".")[0] == "kda_hybrid")
print({MARKER!r} + json.dumps(dict(logits=logits.double().tolist(), leaked=leaked)))
"""
    got = json.loads(run_python(code, tmp_path).rpartition(MARKER)[2].strip())
    assert got["leaked"] == []
    model = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.arange(1, 25)[None]).logits.double()
    torch.testing.assert_close(torch.tensor(got["logits"], dtype=torch.float64), want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Fixtures: a tiny Kimi Linear (MLA + MoE) and a tiny K3 model, the tokenizer, what the package computes
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["kimi-linear", "k3"])
def model(request):
    """The Kimi Linear layout (MLA + MoE), and Kimi K3's (bounded gate, full-rank gates, gated q-LoRA MLA,
    SiTU-GLU, latent MoE, Block AttnRes): both must travel through save, push and a fresh-process load."""
    if request.param == "k3":
        return helpers.k3_model(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID)
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def expected(model, tokenizer):
    torch.manual_seed(0)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        logits = model(ids).logits
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    return dict(
        ids=ids, hidden=hidden, logits=logits,
        greedy=helpers.generate_with_logits(model, ids, max_new_tokens=NEW_TOKENS, do_sample=False),
        chat_text=tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
        pipe_text=pipe(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"],
        pipe_chat=pipe(CHAT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"],
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory, model, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-kda"
    model.save_pretrained(folder, max_shard_size=MAX_SHARD)
    tokenizer.save_pretrained(folder)
    return folder


def assert_same_outputs(got: dict, expected: dict):
    assert got["ids"] == expected["ids"].tolist() and got["plain_tokenizer_ids"] == expected["ids"].tolist()[0]
    # same code, weights and thread count: measured bit-identical (max diff 0.0); 1e-6 leaves room for a BLAS that
    # splits sums differently in a new process, and still fails on any real difference (weights are O(0.02-1))
    for key in ("hidden", "logits"):
        child = torch.tensor(got[key], dtype=torch.float64)
        torch.testing.assert_close(child, expected[key].double(), rtol=0, atol=1e-6)
    assert got["greedy"] == expected["greedy"].sequences.tolist()
    torch.testing.assert_close(torch.tensor(got["greedy_logits"], dtype=torch.float64),
                               expected["greedy"].logits.double(), rtol=0, atol=1e-6)  # the logits' tolerance
    assert got["chat_text"] == expected["chat_text"]
    assert got["pipe_text"] == expected["pipe_text"]
    assert got["pipe_chat"] == expected["pipe_chat"]
    assert got["triton_available"] is False  # triton blocked: the torch path ran
    assert got["leaked"] == []
    # every class came from the checkpoint's own code (transformers_modules), not from an installed package
    assert all(c.startswith("transformers_modules.") for c in got["classes"]), got["classes"]


# --------------------------------------------------------------------------------------------------
# 1. save_pretrained writes a self-contained folder, which a fresh process loads without our package
# --------------------------------------------------------------------------------------------------


def carried_modules() -> set[str]:
    """What transformers copies: the modeling module and its `from .x import` closure (kda_triton included)."""
    entry = PACKAGE_DIR / "modeling_kda_hybrid.py"
    return {entry.name, *(Path(f).name for f in get_relative_import_files(str(entry)))}


def test_saved_folder_is_self_contained(saved):
    files = {p.name for p in saved.iterdir()}
    assert all(p.is_file() for p in saved.iterdir()), "flat: no sub-folders (docs/architecture.md §6)"
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == "kda_hybrid"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_kda_hybrid.KDAHybridConfig",
        "AutoModel": "modeling_kda_hybrid.KDAHybridModel",
        "AutoModelForCausalLM": "modeling_kda_hybrid.KDAHybridForCausalLM",
        "AutoModelForSequenceClassification": "modeling_kda_hybrid.KDAHybridForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_kda_hybrid.KDAHybridForTokenClassification",
    }
    required = {"configuration_kda_hybrid.py", "modeling_kda_hybrid.py", "cache_kda_hybrid.py", "kda_ops.py",
                "kda_torch.py"} | ({"kda_triton.py"} if (PACKAGE_DIR / "kda_triton.py").exists() else set())
    assert required <= carried_modules() <= files
    for name in carried_modules():  # byte-identical copies of the package's modules
        assert (saved / name).read_bytes() == (PACKAGE_DIR / name).read_bytes(), name
    # sharded safetensors with an index that names every shard
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards == {f for f in files if f.endswith(".safetensors")}
    assert "model.safetensors" not in files
    generation = json.loads((saved / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_ID and generation["bos_token_id"] == 1
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= files
    card = (saved / "README.md").read_text()
    assert GENERATED_MARKER in card
    assert yaml.safe_load(card.split("---")[1])["library_name"] == "transformers"


def test_carried_modules_need_only_torch_and_transformers():
    # Loading by repo id, transformers runs check_imports on every carried module: an import outside try/except
    # of a package the user lacks (triton on CPU wheels and macOS) refuses the load. It skips try blocks.
    allowed = {"torch", "transformers", *sys.stdlib_module_names}
    for name in sorted(carried_modules()):
        extra = set(get_imports(str(PACKAGE_DIR / name))) - allowed
        assert not extra, (
            f"{name} imports {sorted(extra)} outside try/except: a Hub load without them fails with 'This modeling "
            f"file requires the following packages ...'. Import them inside `try: ... except ImportError: raise ...`"
        )


def test_fresh_process_loads_folder_without_package(saved, expected, tmp_path):
    got = load_in_fresh_process(str(saved), tmp_path, {"HF_HUB_OFFLINE": "1"})
    assert_same_outputs(got, expected)


# --------------------------------------------------------------------------------------------------
# 2. push_to_hub to a local stand-in Hub, then load by repo id in a fresh process
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub():
    with FakeHub() as hub:
        yield hub


PUSH = """
import runpy, sys
sys.argv = ["push_to_hub.py", "--model", {src!r}, "--repo-id", "user/tiny-kda", "--max-shard-size", {shard!r}]
runpy.run_path({example!r}, run_name="__main__")
"""


def test_push_to_hub_round_trip(saved, expected, fake_hub, tmp_path):
    hub_env = {"HF_ENDPOINT": fake_hub.url, "HF_TOKEN": "dummy"}
    push = PUSH.format(src=str(saved), shard=MAX_SHARD, example=str(EXAMPLE))
    run_python(push, tmp_path, hub_env, isolated=False)  # with our package: the author's machine

    repo = fake_hub.repos["user/tiny-kda"]
    files = repo.commits[-1].files
    assert set(files) >= {p.name for p in saved.iterdir()}
    for name in carried_modules() | {"tokenizer.json", "chat_template.jinja"}:  # code and tokenizer, byte for byte
        assert files[name] == (saved / name).read_bytes(), name
    assert json.loads(files["config.json"])["auto_map"] == json.loads((saved / "config.json").read_text())["auto_map"]
    card = files["README.md"].decode()
    assert GENERATED_MARKER in card and 'repo = "user/tiny-kda"' in card  # ours, not transformers' placeholder

    got = load_in_fresh_process("user/tiny-kda", tmp_path, hub_env)
    assert_same_outputs(got, expected)
    assert not [r for r in fake_hub.requests if r[2] >= 500]


# --------------------------------------------------------------------------------------------------
# 3. The model card
# --------------------------------------------------------------------------------------------------


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---")[1])


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_model_card_metadata_and_memory_figures(attention):
    model = tiny_model(attention)
    card = model_card(model.config, model_id="user/tiny-kda")
    meta = front_matter(card)
    assert meta["license"] == "mit" and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"kda-hybrid", "kimi-linear", "linear-attention", "hybrid", "custom_code"} <= set(meta["tags"])
    assert front_matter(model_card(model.config, license="apache-2.0"))["license"] == "apache-2.0"
    assert "trust_remote_code=True" in card and "| Layer pattern | `K K K A`" in card
    # the figures agree with what a real cache holds (memory_report), B = 3 sequences of 11 tokens
    with torch.no_grad():
        cache = model(torch.randint(3, VOCAB_SIZE, (3, 11)), cache=KDAHybridCache(model.config)).cache
    report, figures = cache.memory_report(), cache_bytes(model.config)
    assert figures["kv_per_token"] == report["kv_bytes_per_token_per_sequence"]
    assert figures["kda_state"] * 3 == report["kda_state_bytes"]
    assert f"| Full-attention KV cache, per token (grows) | {figures['kv_per_token']:,} " in card
    assert f"| KDA state, per sequence (fixed) | {figures['kda_state']:,} " in card


def test_model_card_sizes_for_kimi_linear_48b():
    # Kimi-Linear-48B-A3B: 27 layers, 7 MLA (kv_lora_rank 512 + rope 64 = 576 values/token), 20 KDA, 32 heads x 128
    config = KDAHybridConfig(
        num_hidden_layers=27, layer_types=["full_attention" if i % 4 == 3 or i == 26 else "linear_attention"
                                           for i in range(27)],
        linear_num_heads=32, linear_head_dim=128, num_attention_heads=32, kv_lora_rank=512, qk_rope_head_dim=64,
    )
    figures = cache_bytes(config, "bfloat16")
    assert figures["attention_layers"] == 7 and figures["kda_layers"] == 20
    assert figures["kv_per_token"] == 7 * 576 * 2
    assert figures["kda_state"] == 20 * (32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 2)


def test_write_model_card_respects_user_cards(tmp_path):
    config = tiny_config()
    path = Path(write_model_card(config, tmp_path))
    assert GENERATED_MARKER in path.read_text()
    # transformers' push_to_hub placeholder (with the tags passed to push_to_hub) is replaced, tags kept
    path.write_text("---\nlibrary_name: transformers\ntags:\n- my-tag\n---\n\n# Model Card for Model ID\n\n"
                    "This model card has been automatically generated.\n")
    assert write_model_card(config, tmp_path) == str(path)
    assert "my-tag" in front_matter(path.read_text())["tags"] and GENERATED_MARKER in path.read_text()
    # a card the user wrote stays, unless asked
    path.write_text("---\nlicense: other\n---\n# My model\n")
    assert write_model_card(config, tmp_path) is None and path.read_text().startswith("---\nlicense: other")
    write_model_card(config, tmp_path, overwrite=True, license="apache-2.0")
    assert front_matter(path.read_text())["license"] == "apache-2.0"


# --------------------------------------------------------------------------------------------------
# 4. The example's dry run: what would be uploaded, with no network at all
# --------------------------------------------------------------------------------------------------


def test_push_example_dry_run_lists_files(tmp_path):
    code = f"""
import runpy, sys
sys.argv = ["push_to_hub.py", "--tiny", "--repo-id", "user/tiny-kda", "--max-shard-size", "50KB", "--dry-run"]
runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
"""
    out = run_python(code, tmp_path, {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}, isolated=False)
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json", "modeling_kda_hybrid.py",
                 "README.md", "model-00001-of-"):
        assert name in out, out
    assert "would upload" in out
