"""What a checkpoint must contain: every tensor name and shape of a Kimi Linear model, computed from its
config (parsed by KDAHybridConfig), and the rules that produce those tensors from each source naming.

Our parameter names are exactly the original Kimi-Linear names, so the original format and ours share one
inventory. transformers' native `kimi_linear` renames and fuses some of them (docs/architecture.md §5); its rules split
them back. A rule maps one whole source tensor to one or more target tensors (fused tensors are split; nothing is ever
fused, so a rule never waits for a second file); rules are pure functions, so the same rules drive the
streaming file conversion and the in-memory (meta-tensor) dry run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tensors kept in float32 whatever the output dtype, as the Hub checkpoint stores them: the decay parameters
# feed exp/softplus in fp32 (docs/architecture.md §2) and the router bias is added to fp32 sigmoid scores, where bf16's
# step of 2**-8 near 1 would move expert choices (docs/architecture.md §4).
FP32_SUFFIXES = (".A_log", ".dt_bias", ".e_score_correction_bias")

KDA, MLA = "kda", "mla"
DENSE, MOE = "dense", "moe"


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted as asked; the message lists every offending name."""


@dataclass(frozen=True)
class Spec:
    """Expected shape of one target tensor; `fp32` tensors stay float32 under any `--dtype`."""

    shape: tuple[int, ...]
    fp32: bool = False
    # the router weight: models (ours, transformers') compute router logits in fp32 and keep this weight fp32,
    # so a cast never rounds an fp32 router down (a bf16 one, as in the Hub checkpoint, stays bf16)
    no_downcast: bool = False
    # stored as is (uint8): MXFP4 expert weights (`weight_packed`) and their E8M0 scales (`weight_scale`)
    quantized: bool = False


@dataclass(frozen=True)
class Rule:
    """Produce `targets` from the tensor `source` with `op` (see `apply_rule`); the source's shape is checked
    against `source_shape` before any data is read."""

    op: str  # "copy" | "split_conv" | "split_gate_up" | "split_down"
    source: str
    source_shape: tuple[int, ...]
    targets: tuple[str, ...]


# --------------------------------------------------------------------------------------------------------
# Architecture from the config (read by KDAHybridConfig, the one parser of Kimi-Linear config.json files)
# --------------------------------------------------------------------------------------------------------
# Keys that describe a file, not the architecture; never passed from one format's config to another's.
FILE_KEYS = ("auto_map", "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
             "dtype")


def as_config(cfg):
    """A KDAHybridConfig for `cfg`: one already, or a config.json dict in any of the three namings (ConversionError
    naming the field if the config is invalid)."""
    from ..configuration_kda_hybrid import KDAHybridConfig

    if isinstance(cfg, KDAHybridConfig):
        return cfg
    if not isinstance(cfg, dict):
        raise ConversionError(f"config: expected a config.json dict or a KDAHybridConfig, got {type(cfg).__name__}")
    try:
        return KDAHybridConfig(**{k: v for k, v in cfg.items() if k not in FILE_KEYS})
    except (TypeError, ValueError) as err:
        raise ConversionError(f"config.json: {err}") from None


def layer_kinds(cfg) -> tuple[list[str], list[str]]:
    """Per 0-based layer: attention kind ("kda"/"mla") and MLP kind ("dense"/"moe")."""
    config = as_config(cfg)
    attn = [KDA if t == "linear_attention" else MLA for t in config.layer_types]
    mlp = [MOE if config.is_moe_layer(i) else DENSE for i in range(config.num_hidden_layers)]
    return attn, mlp


def kimi_inventory(cfg) -> dict[str, Spec]:
    """Every tensor of a Kimi Linear checkpoint with this config (a KDAHybridConfig or a config.json dict), in
    layer order. Our parameter names are the original ones, so this is our model's state dict too."""
    config = as_config(cfg)
    if config.attention_type != "mla":
        raise ConversionError("config.json: attention_type='gqa' has no Kimi Linear equivalent")
    if config.attention_bias:
        raise ConversionError("config.json: attention_bias=True has no Kimi Linear equivalent")
    if config.linear_kv_heads != config.linear_num_heads:
        raise ConversionError(f"config.json: linear_num_kv_heads={config.linear_num_kv_heads} (KDA keys and values "
                              "shared by query heads) has no Kimi Linear equivalent; expand the model first "
                              "(kda_hybrid.conversion.from_attention.expand_shared_kv)")
    D, vocab = config.hidden_size, config.vocab_size
    inv: dict[str, Spec] = {"model.embed_tokens.weight": Spec((vocab, D))}
    for i, (attn_kind, mlp_kind) in enumerate(zip(*layer_kinds(config))):
        p = f"model.layers.{i}."
        inv[p + "input_layernorm.weight"] = Spec((D,))
        inv[p + "post_attention_layernorm.weight"] = Spec((D,))
        if config.attn_res_block_size is not None:  # K3 Block Attention Residuals: two reads per layer
            for read in ("self_attention_res", "mlp_res"):
                inv[p + f"{read}_norm.weight"] = Spec((D,))
                inv[p + f"{read}_proj.weight"] = Spec((1, D))
        attention = _kda_tensors if attn_kind == KDA else _mla_tensors
        inv.update(attention(config, p + "self_attn."))
        if mlp_kind == DENSE:
            inv.update(_dense_tensors(config, p + "mlp."))
        else:
            inv.update(_moe_tensors(config, p + "block_sparse_moe."))
    inv["model.norm.weight"] = Spec((D,))
    if config.attn_res_block_size is not None:  # the final read, before the norm (listed after it, as released)
        inv["model.output_attn_res_norm.weight"] = Spec((D,))
        inv["model.output_attn_res_proj.weight"] = Spec((1, D))
    if not config.tie_word_embeddings:
        inv["lm_head.weight"] = Spec((vocab, D))
    return inv


def _kda_tensors(config, a: str) -> dict[str, Spec]:
    D, H, K = config.hidden_size, config.linear_num_heads, config.linear_head_dim  # K = V
    conv = config.linear_conv_kernel_size
    inv = {a + f"{x}_proj.weight": Spec((H * K, D)) for x in "qkv"}
    inv.update({a + f"{x}_conv1d.weight": Spec((H * K, 1, conv)) for x in "qkv"})
    inv[a + "A_log"] = Spec((1, 1, H, 1), fp32=True)
    inv[a + "dt_bias"] = Spec((H * K,), fp32=True)
    inv[a + "f_a_proj.weight"] = Spec((K, D))
    inv[a + "f_b_proj.weight"] = Spec((H * K, K))
    inv[a + "b_proj.weight"] = Spec((H, D))
    if config.use_full_rank_gate:  # K3
        inv[a + "g_proj.weight"] = Spec((H * K, D))
    else:
        inv[a + "g_a_proj.weight"] = Spec((K, D))
        inv[a + "g_b_proj.weight"] = Spec((H * K, K))
    inv[a + "o_norm.weight"] = Spec((K,))
    inv[a + "o_proj.weight"] = Spec((D, H * K))
    return inv


def _mla_tensors(config, a: str) -> dict[str, Spec]:
    D, n_heads = config.hidden_size, config.num_attention_heads
    q_rank, kv_rank = config.q_lora_rank, config.kv_lora_rank
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    inv = {}
    if q_rank is None:
        inv[a + "q_proj.weight"] = Spec((n_heads * (nope + rope), D))
    else:
        inv[a + "q_a_proj.weight"] = Spec((q_rank, D))
        inv[a + "q_a_layernorm.weight"] = Spec((q_rank,))
        inv[a + "q_b_proj.weight"] = Spec((n_heads * (nope + rope), q_rank))
    inv[a + "kv_a_proj_with_mqa.weight"] = Spec((kv_rank + rope, D))
    inv[a + "kv_a_layernorm.weight"] = Spec((kv_rank,))
    inv[a + "kv_b_proj.weight"] = Spec((n_heads * (nope + v_dim), kv_rank))
    if config.mla_use_output_gate:  # K3
        inv[a + "g_proj.weight"] = Spec((n_heads * v_dim, D))
    inv[a + "o_proj.weight"] = Spec((D, n_heads * v_dim))
    return inv


def _dense_tensors(config, m: str) -> dict[str, Spec]:
    D, inter = config.hidden_size, config.intermediate_size
    return {m + "gate_proj.weight": Spec((inter, D)), m + "up_proj.weight": Spec((inter, D)),
            m + "down_proj.weight": Spec((D, inter))}


def _moe_tensors(config, m: str) -> dict[str, Spec]:
    D, E, inter = config.hidden_size, config.num_experts, config.moe_intermediate_size
    inv = {m + "gate.weight": Spec((E, D), no_downcast=True),
           m + "gate.e_score_correction_bias": Spec((E,), fp32=True)}
    width = config.routed_expert_hidden_size or D  # K3 latent MoE: the experts' width
    for e in range(E):
        for w, (out_dim, in_dim) in (("w1", (inter, width)), ("w2", (width, inter)), ("w3", (inter, width))):
            if config.expert_quantization == "mxfp4":  # K3: E2M1 pairs and one E8M0 scale per 32 inputs
                inv[m + f"experts.{e}.{w}.weight_packed"] = Spec((out_dim, in_dim // 2), quantized=True)
                inv[m + f"experts.{e}.{w}.weight_scale"] = Spec((out_dim, in_dim // 32), quantized=True)
            else:
                inv[m + f"experts.{e}.{w}.weight"] = Spec((out_dim, in_dim))
    if config.routed_expert_hidden_size is not None:
        inv[m + "routed_expert_down_proj.weight"] = Spec((width, D))
        if config.latent_moe_use_norm:
            inv[m + "routed_expert_norm.weight"] = Spec((width,))
        inv[m + "routed_expert_up_proj.weight"] = Spec((D, width))
    shared = inter * config.n_shared_experts
    if shared:
        s = m + "shared_experts."
        inv.update({s + "gate_proj.weight": Spec((shared, D)), s + "up_proj.weight": Spec((shared, D)),
                    s + "down_proj.weight": Spec((D, shared))})
    return inv


# --------------------------------------------------------------------------------------------------------
# Rules: how each source naming produces the inventory
# --------------------------------------------------------------------------------------------------------
# A group lists alternatives (each a list of rules) for one piece of the target; the first alternative whose
# sources are all present is used. Alternatives exist because transformers' `save_pretrained` writes the
# original names by default (`save_original_format=True`) and its fused names otherwise.
Group = list[list[Rule]]


def _copy(name: str, spec: Spec, source: str | None = None) -> Rule:
    return Rule("copy", source or name, spec.shape, (name,))


def identity_groups(inventory: dict[str, Spec]) -> list[Group]:
    """Original (or our) names -> the same names: one copy per tensor."""
    return [[[_copy(name, spec)]] for name, spec in inventory.items()]


def native_groups(cfg, inventory: dict[str, Spec]) -> list[Group]:
    """transformers-native `kimi_linear` names (fused or as saved with original names) -> original names."""
    config = as_config(cfg)
    attn, mlp = layer_kinds(config)
    groups: list[Group] = []
    done: set[str] = set()

    def add(alternatives: list[list[Rule]]):
        groups.append(alternatives)
        for rule in alternatives[0]:
            done.update(rule.targets)

    for i, (attn_kind, mlp_kind) in enumerate(zip(attn, mlp)):
        p = f"model.layers.{i}."
        if attn_kind == KDA:
            a = p + "self_attn."
            convs = tuple(a + f"{x}_conv1d.weight" for x in "qkv")
            rows, _, width = inventory[convs[0]].shape
            fused = Rule("split_conv", a + "conv1d.weight", (3 * rows, 1, width), convs)
            add([[fused], [_copy(n, inventory[n]) for n in convs]])
            for leaf in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                name = a + leaf
                add([[_copy(name, inventory[name], a + "forget_gate." + leaf)], [_copy(name, inventory[name])]])
        if mlp_kind == DENSE:
            for leaf in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
                name = p + "mlp." + leaf
                # transformers reverses its `block_sparse_moe -> mlp` rename on every layer when it saves,
                # dense ones included, so a natively saved dense MLP appears under `block_sparse_moe.`
                add([[_copy(name, inventory[name])], [_copy(name, inventory[name], p + "block_sparse_moe." + leaf)]])
        else:
            m = p + "block_sparse_moe."
            for leaf in ("gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
                         "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"):
                name = m + leaf
                if name in inventory:
                    add([[_copy(name, inventory[name], p + "mlp." + leaf)], [_copy(name, inventory[name])]])
            E = config.num_experts
            inter, D = inventory[m + "experts.0.w1.weight"].shape
            gate_up = tuple(m + f"experts.{e}.{w}.weight" for e in range(E) for w in ("w1", "w3"))
            down = tuple(m + f"experts.{e}.w2.weight" for e in range(E))
            add([[Rule("split_gate_up", p + "mlp.experts.gate_up_proj", (E, 2 * inter, D), gate_up)],
                 [_copy(n, inventory[n]) for n in gate_up]])
            add([[Rule("split_down", p + "mlp.experts.down_proj", (E, D, inter), down)],
                 [_copy(n, inventory[n]) for n in down]])
    groups.extend([[[_copy(name, spec)]] for name, spec in inventory.items() if name not in done])
    return groups


# Kimi K3's released layout: the text backbone under `language_model.`, a vision side the text model skips, A_log
# stored as [n >= heads] with a zero tail (one value per head, then zeros)
K3_TEXT_PREFIX = "language_model."
K3_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def k3_groups(inventory: dict[str, Spec], headers) -> list[Group]:
    """K3 names (`language_model.` + ours) -> ours: one copy per tensor, A_log [n] -> [1, 1, H, 1] (its tail checked
    to be zeros when the data is read). `headers` gives A_log's stored length (>= H)."""
    groups: list[Group] = []
    for name, spec in inventory.items():
        source = K3_TEXT_PREFIX + name
        if name.endswith(".A_log") and source in headers:
            stored = tuple(headers[source].shape)
            heads = spec.shape[2]
            shape = stored if len(stored) == 1 and stored[0] >= heads else (heads,)
            groups.append([[Rule("unpad_a_log", source, shape, (name,))]])
        else:
            groups.append([[_copy(name, spec, source)]])
    return groups


def apply_rule(rule: Rule, x: torch.Tensor, target_shapes=None) -> list[torch.Tensor]:
    """Run one rule (`target_shapes`: the inventory shapes of its targets). Outputs own their storage (safetensors
    refuses tensors that share memory)."""
    if rule.op == "copy":
        return [x]
    if rule.op == "unpad_a_log":  # K3: [n] = the per-head values, then zeros -> [1, 1, H, 1]
        heads = target_shapes[0][2]
        tail = x[heads:]
        if not x.is_meta and tail.numel() and bool(tail.ne(0).any()):
            raise ConversionError(f"{rule.source}: entries {heads}..{x.shape[0] - 1} must be zeros (one A_log value "
                                  f"per head for {heads} heads, then padding), got nonzero values there")
        return [x[:heads].reshape(1, 1, heads, 1).clone()]
    if rule.op == "split_conv":  # [3*H*K, 1, W] in q, k, v order
        return [t.clone() for t in x.chunk(3, dim=0)]
    if rule.op == "split_gate_up":  # [E, 2*I, D]: rows [:I] are w1 (gate), rows [I:] are w3 (up)
        inter = x.shape[1] // 2
        return [x[e, half * inter:(half + 1) * inter].clone() for e in range(x.shape[0]) for half in (0, 1)]
    if rule.op == "split_down":  # [E, D, I] -> E x w2 [D, I]
        return [x[e].clone() for e in range(x.shape[0])]
    raise AssertionError(f"unknown rule op {rule.op!r}")
