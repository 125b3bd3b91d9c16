"""What a KDA hybrid checkpoint folder holds besides its weights: the config's `auto_map` (every Auto class), the
flat modeling modules `trust_remote_code` runs, and the README.md model card (Hub metadata, architecture table,
inference memory, how to load). `write_checkpoint_metadata` is the one writer: `save_pretrained`, the converter
and scripts/refresh_checkpoint_code.py all call it, so their folders load alike.

    write_checkpoint_metadata(config, folder)  # auto_map + config.json + code files + model card
    write_model_card(config, save_directory)   # README.md only, unless a card the user wrote is already there

This module is carried flat into checkpoints with the modeling code, so it imports only the standard library and
its sibling modules.

A card this module wrote carries `GENERATED_MARKER`; such a card (and the placeholder card that transformers'
`push_to_hub` saves) is regenerated on the next save, keeping any extra tags. Delete the marker line to keep
hand edits.
"""

from __future__ import annotations

import os
import re
import shutil

from .cache_layers_kda_hybrid import cache_bytes

GENERATED_MARKER = "<!-- kda-hybrid: generated model card; delete this line to keep your edits on the next save -->"
DEFAULT_LICENSE = "mit"
TAGS = ("kda-hybrid", "kimi-linear", "linear-attention", "hybrid", "custom_code")
# what transformers' push_to_hub saves as README.md when the repo has none (huggingface_hub's model card template)
_PLACEHOLDER_SIGNS = (
    "This model card has been automatically generated",
    "<!-- Provide a quick summary of what the model is/does. -->",
)
# the class each Auto class loads from a checkpoint folder (module.class, modules flat in the folder)
AUTO_MAP = {
    "AutoConfig": "configuration_kda_hybrid.KDAHybridConfig",
    "AutoModel": "modeling_kda_hybrid.KDAHybridModel",
    "AutoModelForCausalLM": "modeling_kda_hybrid.KDAHybridForCausalLM",
    "AutoModelForSequenceClassification": "modeling_kda_hybrid.KDAHybridForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_kda_hybrid.KDAHybridForTokenClassification",
}
def carried_modules(entry: str = "modeling_kda_hybrid.py") -> tuple[str, ...]:
    """The modules a checkpoint carries: the modeling file and every sibling it imports with `from .x import`,
    recursively (what save_pretrained copies), read from this module's folder so the list never goes stale."""
    here = os.path.dirname(os.path.abspath(__file__))
    found, todo = set(), [entry, "configuration_kda_hybrid.py"]  # the config's own imports are carried too
    while todo:
        name = todo.pop()
        if name in found or not os.path.exists(os.path.join(here, name)):
            continue
        found.add(name)
        with open(os.path.join(here, name), encoding="utf-8") as f:
            todo += [m + ".py" for m in re.findall(r"^\s*from \.(\w+) import", f.read(), flags=re.M)]
    return tuple(sorted(found))


CARRIED_MODULES = carried_modules()


def expert_bytes(config) -> dict:
    """Bytes of the routed experts of every MoE layer, as stored (`stored`: MXFP4, one byte per two weights plus one
    E8M0 scale byte per 32 weights, when config.expert_quantization is "mxfp4", else bf16) and as bf16 (`bf16`), with
    `weights` their count. Each expert: w1, w3 [moe_intermediate_size, width] and w2 [width, moe_intermediate_size],
    width = routed_expert_hidden_size (latent MoE) or hidden_size."""
    if config.num_experts is None:
        return {"weights": 0, "stored": 0, "bf16": 0}
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    width = config.routed_expert_hidden_size or config.hidden_size
    weights = moe_layers * config.num_experts * 3 * config.moe_intermediate_size * width
    mxfp4 = weights // 2 + weights // 32
    return {"weights": weights, "stored": mxfp4 if config.expert_quantization == "mxfp4" else 2 * weights,
            "bf16": 2 * weights}


def format_bytes(n: int) -> str:
    """'512 B', '1.5 KiB', '3.2 GiB': the one size format of the package (model cards, the converter, examples)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _layer_pattern(layer_types) -> str:
    """'[K K K A] x 12' for a repeating pattern, else the full letter string (K = KDA, A = full attention)."""
    letters = ["A" if t == "full_attention" else "K" for t in layer_types]
    n = len(letters)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and letters == letters[:period] * (n // period):
            return f"`[{' '.join(letters[:period])}] x {n // period}`"
    return f"`{' '.join(letters)}`"


def _architecture_rows(config) -> list[tuple[str, str]]:
    attention_layers = [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"]
    n_kda = len(config.layer_types) - len(attention_layers)
    H, K = config.linear_num_heads, config.linear_head_dim
    if config.attention_type == "mla":
        q = "one q_proj" if config.q_lora_rank is None else f"q_lora_rank {config.q_lora_rank}"
        attention = (
            f"MLA without positional encoding (NoPE): {config.num_attention_heads} heads, kv_lora_rank "
            f"{config.kv_lora_rank}, qk_nope {config.qk_nope_head_dim} + qk_rope {config.qk_rope_head_dim}, "
            f"v {config.v_head_dim}, {q}"
        )
    else:
        attention = (
            f"GQA with RoPE (theta {config.rope_theta:g}): {config.num_attention_heads} query heads, "
            f"{config.num_key_value_heads} key/value heads, head dim {config.head_dim}"
        )
    if config.mla_use_output_gate:
        attention += ", sigmoid output gate"
    glu = "SwiGLU" if config.hidden_act == "silu" else f"{config.hidden_act}-GLU"
    if config.hidden_act == "situ":
        glu = f"SiTU-GLU (beta {config.activation_situ_beta:g}, linear beta {config.activation_situ_linear_beta:g})"
    if config.num_experts:
        dense = f"first {config.first_k_dense_replace} layer(s) dense {glu} ({config.intermediate_size}); "
        latent = ""
        if config.routed_expert_hidden_size is not None:
            latent = (f", experts in a latent width {config.routed_expert_hidden_size}"
                      f"{' (normed)' if config.latent_moe_use_norm else ''}")
        stored = ", MXFP4 experts" if config.expert_quantization == "mxfp4" else ""
        mlp = (
            f"{dense if config.first_k_dense_replace else ''}MoE: {config.num_experts} routed experts, top "
            f"{config.num_experts_per_tok}, {config.n_shared_experts} shared, expert width "
            f"{config.moe_intermediate_size}{latent}{stored}, sigmoid router, routed scale "
            f"{config.routed_scaling_factor:g}"
        )
    else:
        mlp = f"dense {glu}, width {config.intermediate_size}"
    gates = []
    if config.gate_lower_bound is not None:
        gates.append(f"decay {config.gate_lower_bound:g} * sigmoid (bounded)")
    if config.use_full_rank_gate:
        gates.append("full-rank output gate")
    kda_gates = f", {', '.join(gates)}" if gates else ""
    shared = "" if config.linear_kv_heads == H else f" over {config.linear_kv_heads} shared key/value heads (states)"
    residual = ("sum" if config.attn_res_block_size is None
                else f"Block Attention Residuals, blocks of {config.attn_res_block_size} layers")
    return [
        ("Layers", f"{len(config.layer_types)}: {n_kda} KDA + {len(attention_layers)} full attention"),
        ("Layer pattern", f"{_layer_pattern(config.layer_types)} (K = KDA, A = full attention)"),
        ("Full-attention layers (1-based)", ", ".join(map(str, attention_layers)) or "none"),
        ("Hidden size", str(config.hidden_size)),
        ("KDA heads", f"{H} heads{shared}, K = V = {K}, short conv {config.linear_conv_kernel_size}, fp32 "
                      f"state{kda_gates}"),
        ("Full attention", attention),
        ("MLP", mlp),
        ("Residual stream", residual),
        ("Vocabulary", str(config.vocab_size)),
        ("Tied embeddings", str(bool(getattr(config, "tie_word_embeddings", False)))),
    ]


def _front_matter(license: str, tags, base_model) -> str:
    lines = ["---", f"license: {license}", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    lines += [f"- {tag}" for tag in tags]
    if base_model:
        lines.append(f"base_model: {base_model}")
    return "\n".join(lines + ["---"])


def model_card(config, *, license: str = DEFAULT_LICENSE, model_id: str | None = None, tags=(),
               base_model: str | None = None, dtype=None) -> str:
    """README.md text for a checkpoint of `config`: YAML front matter (license, library_name, pipeline_tag, tags),
    architecture, inference memory and how to load. `tags` are added to the standard ones."""
    all_tags = list(TAGS) + [t for t in tags if t not in TAGS]
    memory = cache_bytes(config, dtype)
    name = model_id or "your-name/your-kda-model"
    title = model_id.rstrip("/").split("/")[-1] if model_id else "KDA hybrid model"
    rows = "\n".join(f"| {k} | {v} |" for k, v in _architecture_rows(config))
    family = ("Kimi K3 architecture (arXiv 2607.24653), Kimi Linear's successor" if config.uses_k3_features
              else "Kimi Linear architecture (arXiv 2510.26692)")
    per_token, fixed = memory["kv_per_token"], memory["kda_state"]
    lengths = (4096, 32768, 131072)
    at_length = ", ".join(f"{n // 1024}K tokens: {format_bytes(fixed + per_token * n)}" for n in lengths)
    all_attention = memory["kv_per_token_per_layer"] * len(config.layer_types)
    kv_split = f"{memory['attention_layers']} layers x {memory['kv_per_token_per_layer']:,}"
    kda_split = f"{memory['kda_layers']} layers x {memory['kda_state_per_layer']:,}"
    return f"""{_front_matter(license, all_tags, base_model)}

{GENERATED_MARKER}

# {title}

A hybrid causal language model in the {family}: most layers use Kimi Delta
Attention (KDA), a gated delta-rule linear attention whose whole past is a fixed-size state per head, and a few
layers keep full softmax attention with a growing KV cache.

## Architecture

| | |
|---|---|
{rows}

## Inference memory (one sequence, {memory['dtype']} activations)

| | bytes |
|---|---|
| Full-attention KV cache, per token (grows) | {per_token:,} ({kv_split}) |
| KDA state, per sequence (fixed) | {fixed:,} ({kda_split}: fp32 recurrent state + short-conv state) |
| With full attention in all {len(config.layer_types)} layers, per token | {all_attention:,} |

Total cache: {at_length}. Multiply by the batch size.

## How to load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "{name}"  # or the path of this folder
# trust_remote_code for the tokenizer too: AutoTokenizer reads config.json, which names custom code
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True, dtype="auto")
inputs = tokenizer("The capital of France is", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```

`trust_remote_code=True` runs the modeling code stored in this repository
({", ".join(f"`{m}`" for m in CARRIED_MODULES)}; flat modules, no package to install). Triton is optional:
GPU tensors use the Triton KDA kernels when `triton` imports, everything else (and every CPU tensor) takes the
PyTorch path. `pipeline("text-generation", model=repo,
trust_remote_code=True)` works as well.
"""


def _existing_tags(text: str) -> list[str]:
    """Tags of a README's YAML front matter (block list or flow list), best effort."""
    match = re.match(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", text, flags=re.DOTALL)
    if not match:
        return []
    front = match.group(1)
    flow = re.search(r"^tags:\s*\[(.*?)\]\s*$", front, flags=re.MULTILINE)
    if flow:
        return [t.strip().strip("'\"") for t in flow.group(1).split(",") if t.strip()]
    block = re.search(r"^tags:\s*\n((?:[ \t]*-[^\n]*\n?)+)", front, flags=re.MULTILINE)
    if not block:
        return []
    return [line.strip()[1:].strip().strip("'\"") for line in block.group(1).splitlines() if line.strip()]


def write_model_card(config, save_directory, *, overwrite: bool = False, **kwargs) -> str | None:
    """Write `save_directory/README.md` (see `model_card` for kwargs). A README.md already there is replaced only
    if this module generated it, if it is transformers' placeholder card, or with `overwrite=True`; its tags are
    kept. Returns the path written, or None when a user's card was left alone."""
    path = os.path.join(os.fspath(save_directory), "README.md")
    tags = list(kwargs.pop("tags", ()))
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            existing = f.read()
        ours = GENERATED_MARKER in existing or any(sign in existing for sign in _PLACEHOLDER_SIGNS)
        if not (ours or overwrite):
            return None
        tags += [t for t in _existing_tags(existing) if t not in tags]
    text = model_card(config, tags=tags, **kwargs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def write_checkpoint_metadata(config, folder, *, save_config: bool = True, model_id: str | None = None,
                              code: bool = True) -> list[str]:
    """Make `folder` a checkpoint that loads with `trust_remote_code=True` through every Auto class: set
    `config.auto_map` to AUTO_MAP (other entries kept), write config.json (unless `save_config=False`, for
    save_pretrained, which writes it itself after this), copy the carried modules as real files (a symlink in
    their place is replaced, never written through) and write the model card (a card the user wrote is kept).
    `code=False`: config and card only (a model class that is not this package's). Returns the names of the
    modules that changed."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    changed = []
    if code:
        config.auto_map = {**(getattr(config, "auto_map", None) or {}), **AUTO_MAP}
        here = os.path.dirname(os.path.abspath(__file__))
        for name in CARRIED_MODULES:
            src, dst = os.path.join(here, name), os.path.join(folder, name)
            with open(src, "rb") as f:
                data = f.read()
            if not os.path.islink(dst) and os.path.isfile(dst):
                with open(dst, "rb") as f:
                    if f.read() == data:
                        continue
            if os.path.lexists(dst):
                os.unlink(dst)
            shutil.copyfile(src, dst)
            changed.append(name)
    if save_config:
        config.save_pretrained(folder)
    write_model_card(config, folder, model_id=model_id)
    return changed


__all__ = ["AUTO_MAP", "cache_bytes", "format_bytes", "model_card", "write_checkpoint_metadata", "write_model_card"]
