"""Turn a pretrained full-attention model (Llama, Mistral, Qwen2, Qwen3 as saved by transformers) into a KDA hybrid.

    python -m kda_hybrid.conversion SRC DST --layer-types kkkAkkkA

One letter per layer (or a pattern repeated to the depth): `A` keeps the layer's attention, unchanged, as this
package's GQA + RoPE layer; `k` makes it a KDA layer whose q/k/v/o projections are the attention's (k and v
heads repeated for GQA) and whose KDA-only parts start from the values in `kda_init` below. Embeddings, norms,
MLPs and the LM head are copied. With every layer `A` the output computes exactly what the source computes.

The converted KDA layers are a starting point for distillation (examples/distill.py), not a finished model: the
projections carry what the teacher learnt; what a softmax does with them is learnt again. This is the recipe of
"Linearizing Large Language Models" (LoLCATs, Zhang et al. 2024), "The Mamba in the Llama" (Wang et al. 2024)
and RADLADS (Goldstein et al. 2025): reuse the attention weights, then transfer attention, then distil.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..kda_torch import inverse_softplus
from .checkpoint import FolderSource, Header, name_list

logger = logging.getLogger("kda_hybrid.conversion")

ATTENTION_SOURCES = ("llama", "mistral", "qwen2", "qwen3")
KDA_LETTER, ATTENTION_LETTER = "k", "A"
CONV_KERNEL = 4  # Kimi Linear's short-convolution width


class AttentionConversionError(ValueError):
    """A source model or a layer-type string that cannot be converted as asked."""


def is_attention_source(config: dict) -> bool:
    return config.get("model_type") in ATTENTION_SOURCES


def parse_layer_types(spec: str, num_layers: int) -> list[str]:
    """'kkkA' -> ['linear_attention'] * 3 + ['full_attention'], repeated to `num_layers` when the pattern is
    shorter and divides it."""
    if not isinstance(spec, str) or not spec or set(spec) - {KDA_LETTER, ATTENTION_LETTER}:
        raise AttentionConversionError(
            f"layer types: expected a string of '{KDA_LETTER}' (KDA) and '{ATTENTION_LETTER}' (attention), one "
            f"per layer, got {spec!r}")
    if num_layers % len(spec):
        raise AttentionConversionError(
            f"layer types: expected {num_layers} letters (the source has {num_layers} layers) or a pattern whose "
            f"length divides {num_layers}, got {len(spec)} ({spec!r})")
    pattern = spec * (num_layers // len(spec))
    return ["linear_attention" if c == KDA_LETTER else "full_attention" for c in pattern]


def _required(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise AttentionConversionError(f"config.json: '{key}' is required")
    return cfg[key]


def _biases(cfg: dict) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of the source family."""
    family = cfg["model_type"]
    if family == "qwen2":  # Qwen2 hard-codes q/k/v biases and no o_proj bias
        return True, False
    if family == "mistral":
        return False, False
    bias = bool(cfg.get("attention_bias", False))  # Llama and Qwen3: one flag for all four projections
    return bias, bias


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5.x writes `rope_parameters`; older config.json files have `rope_theta` + `rope_scaling`."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise AttentionConversionError(f"config.json: partial_rotary_factor={factor} is not supported (expected 1.0)")
    return rope


def hybrid_config(cfg: dict, layer_types: str | list[str], shared_kv: bool = False):
    """The KDAHybridConfig of the converted model. Refuses, before anything is read or written, what the GQA
    layer could not reproduce exactly. shared_kv: the KDA layers keep the source's key/value heads
    (linear_num_kv_heads, one recurrent state per key/value head read by its query heads) instead of one per
    query head."""
    from ..configuration_kda_hybrid import KDAHybridConfig

    family = cfg.get("model_type")
    if family not in ATTENTION_SOURCES:
        raise AttentionConversionError(f"config.json: model_type {family!r} is not one of {ATTENTION_SOURCES}")
    n_layers = _required(cfg, "num_hidden_layers")
    types = parse_layer_types(layer_types, n_layers) if isinstance(layer_types, str) else list(layer_types)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise AttentionConversionError(f"config.json: hidden_act={cfg['hidden_act']!r} (only SiLU MLPs convert)")
    if cfg.get("mlp_bias"):
        raise AttentionConversionError("config.json: mlp_bias=True is not supported (the MLP has no biases)")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None
    if window is not None:
        raise AttentionConversionError(
            f"config.json: sliding-window attention (sliding_window={window}) is not implemented by the GQA layer, "
            "so its outputs would differ from the source beyond that many tokens; set \"sliding_window\": null in "
            "a copy of config.json to convert it as full attention")
    heads = _required(cfg, "num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    hidden = _required(cfg, "hidden_size")
    head_dim = cfg.get("head_dim") or hidden // heads
    qkv_bias, o_bias = _biases(cfg)
    if o_bias and "linear_attention" in types:
        raise AttentionConversionError("config.json: the source's o_proj has a bias, which a KDA layer's o_proj "
                                       "has not; convert with every layer 'A' or drop the bias first")
    eps = cfg.get("rms_norm_eps", 1e-6)
    return KDAHybridConfig(
        vocab_size=_required(cfg, "vocab_size"), hidden_size=hidden,
        intermediate_size=_required(cfg, "intermediate_size"), num_hidden_layers=n_layers, layer_types=types,
        linear_num_heads=heads, linear_head_dim=head_dim, linear_conv_kernel_size=CONV_KERNEL,
        linear_num_kv_heads=kv_heads if shared_kv and kv_heads != heads else None,
        linear_attention_bias=qkv_bias,
        attention_type="gqa", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rope_parameters=_rope_parameters(cfg), attention_bias=qkv_bias, attention_out_bias=o_bias,
        attention_qk_norm=family == "qwen3", num_experts=None, rms_norm_eps=eps,
        initializer_range=cfg.get("initializer_range", 0.02),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        pad_token_id=cfg.get("pad_token_id"), bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


# ---------------------------------------------------------------------------------------------------------
# Initial values of the KDA-only parameters
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KDAInit:
    """How a `k` layer's KDA-only parts start, chosen so that on short contexts the layer reads back what the
    attention would: nothing forgotten, nothing blurred by the convolution, the output gate neutral.

    - short convolutions: identity (weight 1 on the current token, 0 on the three before), so the layer sees the
      attention's own q, k, v (through SiLU, which the convolution path always applies).
    - decay: data-independent at first (f_b_proj = 0, so g = -exp(A_log) softplus(dt_bias)); A_log = 0 and
      dt_bias such that each channel keeps exp(-dt) per token with dt log-spaced over [1/4096, 1/64] (half-lives
      of 44 to 2,839 tokens): short contexts are remembered almost whole, as softmax attention sees them, and the
      spread of time scales gives distillation somewhere to start (the same log-spacing Mamba2 and fla use).
      f_a_proj is random (std = initializer_range) and f_b_proj zero, like a LoRA pair: the start is exact and
      both get gradients from the first step.
    - beta = sigmoid(0) = 0.5 (b_proj = 0): a half-strength delta-rule write, the neutral point.
    - output gate: g_b_proj = 0, so sigmoid(.) = 0.5 everywhere; o_norm's weight is 2 so the gated norm starts at
      exactly RMSNorm(o). g_a_proj random (std = initializer_range), as f_a_proj.
    """

    dt_min: float = 1.0 / 4096
    dt_max: float = 1.0 / 64
    seed: int = 0


def kda_init_tensors(config, prefix: str, dtype: torch.dtype, init: KDAInit, layer_idx: int) -> dict:
    H, Hkv, K, D = config.linear_num_heads, config.linear_kv_heads, config.linear_head_dim, config.hidden_size
    gen = torch.Generator().manual_seed(init.seed * 100_003 + layer_idx)
    std = config.initializer_range

    def identity_conv(heads):  # tap j reads x[t - (kernel - 1 - j)]: the last tap is the current token
        conv = torch.zeros(heads * K, 1, config.linear_conv_kernel_size)
        conv[..., -1] = 1.0
        return conv

    dt = torch.exp(torch.linspace(math.log(init.dt_min), math.log(init.dt_max), K)).repeat(Hkv)  # [Hkv*K]
    out = {
        "q_conv1d.weight": identity_conv(H), "k_conv1d.weight": identity_conv(Hkv),
        "v_conv1d.weight": identity_conv(Hkv),
        "A_log": torch.zeros(1, 1, Hkv, 1, dtype=torch.float32),
        "dt_bias": inverse_softplus(dt).float(),  # softplus(dt_bias) = dt
        "f_a_proj.weight": torch.randn(K, D, generator=gen) * std,
        "f_b_proj.weight": torch.zeros(Hkv * K, K),
        "b_proj.weight": torch.zeros(Hkv, D),
        "g_a_proj.weight": torch.randn(K, D, generator=gen) * std,
        "g_b_proj.weight": torch.zeros(H * K, K),
        "o_norm.weight": torch.full((K,), 2.0),
    }
    return {prefix + name: t if name in ("A_log", "dt_bias") else t.to(dtype) for name, t in out.items()}


# ---------------------------------------------------------------------------------------------------------
# The plan: every source tensor's targets, checked against the headers before any data is read
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    source: str
    target: str
    op: str = "copy"  # "copy" | "repeat_heads" (GQA k/v heads repeated for a KDA layer)


def expected_source(config, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a transformers checkpoint of this source architecture holds, with its shape."""
    D, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    H, Hkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qkv_bias, o_bias = _biases(cfg)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        for name, rows in (("q_proj", H * hd), ("k_proj", Hkv * hd), ("v_proj", Hkv * hd)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, D)
            if qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (D, H * hd)
        if o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
        if cfg["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, D)
        shapes[p + "mlp.up_proj.weight"] = (inter, D)
        shapes[p + "mlp.down_proj.weight"] = (D, inter)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def make_steps(config, source_names) -> tuple[list[Step], list[str]]:
    """(steps, dropped): dropped are Qwen3's q/k RMSNorm weights of `k` layers (KDA L2-normalises q and k per
    head, which takes the place of that norm)."""
    steps, dropped = [], []
    for name in source_names:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[3] == "self_attn":
            layer = int(parts[2])
            if config.layer_types[layer] == "linear_attention":
                leaf = parts[4]
                if leaf in ("q_norm", "k_norm"):
                    dropped.append(name)
                    continue
                repeat = leaf in ("k_proj", "v_proj") and config.num_key_value_heads != config.linear_kv_heads
                steps.append(Step(name, name, "repeat_heads" if repeat else "copy"))
                continue
        steps.append(Step(name, name))
    return steps, dropped


def check_source(config, cfg: dict, headers: dict[str, Header]) -> None:
    expected = expected_source(config, cfg)
    # a tied checkpoint may still carry lm_head.weight (a copy of the embedding): accept and skip it then
    names = {n for n in headers if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    bad_shape = [f"{n} (expected {list(expected[n])}, got {list(headers[n].shape)})"
                 for n in sorted(names & set(expected)) if tuple(headers[n].shape) != expected[n]]
    non_float = sorted(n for n in names & set(expected) if not headers[n].dtype.is_floating_point)
    problems = [p for p in (name_list("missing tensors", missing), name_list("unexpected tensors", unexpected),
                            name_list("tensors with the wrong shape", bad_shape),
                            name_list("non-float tensors", non_float)) if p]
    if problems:
        raise AttentionConversionError(f"the {cfg['model_type']} checkpoint does not match its config:\n  "
                                       + "\n  ".join(problems))


def repeat_blocks(x: torch.Tensor, groups: int, rows: int, dim: int = 0) -> torch.Tensor:
    """x with each block of `rows` entries along `dim` (one key/value head's) repeated `groups` times in place:
    query head h reads key/value head h // groups, as transformers' repeat_kv does."""
    return x.unflatten(dim, (-1, rows)).repeat_interleave(groups, dim).flatten(dim, dim + 1).contiguous()


def repeat_heads(x: torch.Tensor, config) -> torch.Tensor:
    """[H_kv * hd, D] (or [H_kv * hd]) -> [H * hd, ...]: the source's key/value heads for a per-head KDA layer."""
    return repeat_blocks(x, config.num_attention_heads // config.num_key_value_heads, config.head_dim)


# A KDA layer's tensors (names inside its self_attn) with one entry per key/value head along `dim`, each `rows` long
KV_HEAD_TENSORS = {**{name: (0, "head_dim") for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                                                         "k_conv1d.weight", "v_conv1d.weight", "dt_bias",
                                                         "f_b_proj.weight")},
                   "b_proj.weight": (0, 1), "A_log": (2, 1)}


def expand_shared_kv(state_dict: dict, config):
    """A model whose KDA keys and values are shared (`linear_num_kv_heads` < `linear_num_heads`) as the same
    function with one key/value head per query head: (state dict, config) with every key/value head's entries (k, v
    projections and convs, the decay gate's dt_bias, f_b_proj rows and A_log entry, beta's b_proj row) repeated for
    the query heads that read it, in repeat_kv's order. Its recurrent states are the shared ones, repeated; its
    outputs the same up to the order of sums. What Kimi Linear's layout and llama.cpp can hold. Other tensors are
    passed through (not copied)."""
    groups = config.linear_num_heads // config.linear_kv_heads
    expanded = config.__class__(**{**config.to_dict(), "linear_num_kv_heads": None})
    kda = {f"model.layers.{i}.self_attn." for i in config.linear_attention_layers}
    out = {}
    for name, t in state_dict.items():
        prefix, _, leaf = name.partition("self_attn.")
        if groups > 1 and prefix + "self_attn." in kda and leaf in KV_HEAD_TENSORS:
            dim, rows = KV_HEAD_TENSORS[leaf]
            t = repeat_blocks(t, groups, config.linear_head_dim if rows == "head_dim" else rows, dim)
        out[name] = t
    return out, expanded


def stream(config, cfg: dict, source: FolderSource, sink, *, init: KDAInit, progress: bool = False) -> None:
    """Write every target tensor into `sink` (`.add(name, tensor)`), one source file open at a time."""
    check_source(config, cfg, source.headers)
    names = [n for n in source.headers if not (config.tie_word_embeddings and n == "lm_head.weight")]
    steps, dropped = make_steps(config, names)
    if dropped:
        logger.info("dropped %d q/k RMSNorm weights of KDA layers (KDA L2-normalises q and k)", len(dropped))
    by_file: dict[str, list[Step]] = {}
    for step in steps:
        by_file.setdefault(source.headers[step.source].file, []).append(step)
    main_dtype = source.headers["model.embed_tokens.weight"].dtype
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(source.nbytes(f) for f in source.files), unit="B", unit_scale=True,
                   desc="converting")
    try:
        for file in source.files:
            with source.open(file) as get:
                for step in by_file.get(file, []):
                    x = get(step.source)
                    sink.add(step.target, repeat_heads(x, config) if step.op == "repeat_heads" else x)
                    if bar is not None:
                        bar.update(x.numel() * x.element_size())
                    del x
        for i, kind in enumerate(config.layer_types):
            if kind == "linear_attention":
                for name, t in kda_init_tensors(config, f"model.layers.{i}.self_attn.", main_dtype, init, i).items():
                    sink.add(name, t)
    finally:
        if bar is not None:
            bar.close()


def target_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor the converted model's state dict holds (tied lm_head left out), from a meta-device build."""
    from ..modeling_kda_hybrid import KDAHybridForCausalLM

    with torch.device("meta"):
        model = KDAHybridForCausalLM(config)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_plan(config, cfg: dict, headers: dict[str, Header]) -> dict[str, tuple[int, ...]]:
    """The steps and the KDA initial tensors produce exactly the converted model's tensors, shapes included
    (a meta-tensor dry run; reads no data). Returns those shapes."""
    check_source(config, cfg, headers)
    names = [n for n in headers if not (config.tie_word_embeddings and n == "lm_head.weight")]
    steps, _ = make_steps(config, names)
    produced = {}
    for step in steps:
        shape = tuple(headers[step.source].shape)
        if step.op == "repeat_heads":
            shape = (shape[0] * (config.num_attention_heads // config.num_key_value_heads), *shape[1:])
        produced[step.target] = shape
    for i, kind in enumerate(config.layer_types):
        if kind == "linear_attention":
            prefix = f"model.layers.{i}.self_attn."
            produced.update({n: tuple(t.shape) for n, t in
                             kda_init_tensors(config, prefix, torch.float32, KDAInit(), i).items()})
    expected = target_shapes(config)
    if produced != expected:
        wrong = sorted(set(produced) ^ set(expected)) + sorted(
            n for n in set(produced) & set(expected) if produced[n] != expected[n])
        raise AssertionError(f"conversion plan does not produce the model's tensors: {wrong[:20]}")
    return expected
