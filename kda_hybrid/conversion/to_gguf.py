"""Our Kimi Linear and Kimi K3 models as llama.cpp GGUF files (`--to gguf`): metadata, tensors and tokenizer in the
form llama.cpp's `kimi-linear` and `kimi-k3` graphs load, written with the `gguf` package (the `[gguf]` extra; the
K3 names it does not know yet are spelled here, as llama.cpp's loader reads them).

What llama.cpp's graph can express is checked first (`check_expressible`), so a model it would run differently is
refused before anything is written. Tensors arrive from the conversion plan under the original Kimi Linear names
and are streamed: each one is transformed and appended to a data file as it comes (only one layer's routed
experts are held, to stack them), and the GGUF file is the header, the tensor table and that data. Tensor layout
(numpy shapes; GGUF stores them reversed, as ggml's ne):

    q/k/v_conv1d [C, 1, W]            -> ssm_conv1d_q/k/v  (1, C, 1, W)      f32
    A_log        [1, 1, H, 1]         -> ssm_a             -exp(A_log)       f32
    dt_bias      [H * K]              -> ssm_dt.bias                         f32
    kv_b_proj    [H * (nope + v), r]  -> attn_k_b (H, r, nope), attn_v_b (H, v, r)   (absorbed MLA decode)
    experts.{e}.w1/w2/w3 (E of them)  -> ffn_gate/down/up_exps (E, ., .)
    lm_head (or the tied embedding)   -> output
  K3 only:
    A_log        [1, 1, H, 1]         -> ssm_a             (H,) -exp(A_log)  f32
    g_proj       (KDA / MLA layer)    -> ssm_g / attn_gate
    <x>_res_norm * <x>_res_proj       -> attn_res_score / ffn_res_score / output_res_score   (one vector) f32
    MXFP4 experts.{e}.{w}.weight_packed + weight_scale -> ggml MXFP4 blocks (E, rows, blocks * 17 bytes): per 32
        inputs one E8M0 byte, then 16 bytes holding codes j (low nibble) and j + 16 (high); bits moved, not recoded
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from .layout import ConversionError

KIMI_LINEAR_ARCH, KIMI_K3_ARCH = "kimi-linear", "kimi-k3"
_ALIGN = 32  # GGUF's default general.alignment
_EXPERT_PROJ = {"w1": "gate", "w2": "down", "w3": "up"}
_F32_NAMES = (".ssm_conv1d_q.weight", ".ssm_conv1d_k.weight", ".ssm_conv1d_v.weight", ".ffn_gate_inp.weight")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ConversionError("--to gguf needs the gguf package: pip install 'kda-hybrid[gguf]' (or pip install "
                              "gguf)") from None
    return gguf


# ---------------------------------------------------------------------------------------------------------
# What llama.cpp's kimi-linear and kimi-k3 graphs can run
# ---------------------------------------------------------------------------------------------------------
def check_expressible(config) -> str:
    """The llama.cpp architecture that runs `config` (a KDAHybridConfig): "kimi-k3" when a K3 switch is on, else
    "kimi-linear"; ConversionError naming every property its graph cannot express. Nothing is written before
    this passes."""
    problems = []
    k3 = config.uses_k3_features
    if config.attention_type != "mla":
        problems.append(f"attention_type={config.attention_type!r}: llama.cpp's graph has MLA full-attention "
                        "layers without RoPE only, not GQA/RoPE attention")
    elif config.linear_num_heads != config.num_attention_heads:
        problems.append(f"KDA heads ({config.linear_num_heads}) differ from MLA heads ({config.num_attention_heads}): "
                        "llama.cpp sizes both from one head count")
    if config.linear_kv_heads != config.linear_num_heads:
        problems.append(f"linear_num_kv_heads={config.linear_num_kv_heads}: llama.cpp's KDA layers have one key/value "
                        "head per head (expand the model first: from_attention.expand_shared_kv)")
    if config.attention_bias or getattr(config, "linear_attention_bias", False):
        problems.append("projection biases: llama.cpp's graph has none")
    if k3:  # llama.cpp's kimi-k3 graph: SiTU everywhere and the full-rank KDA gate are not optional there
        if config.hidden_act != "situ":
            problems.append(f"hidden_act={config.hidden_act!r} with K3 switches on: llama.cpp's kimi-k3 MLPs are "
                            "SiTU-GLU")
        if not config.use_full_rank_gate:
            problems.append("use_full_rank_gate=False with K3 switches on: llama.cpp's kimi-k3 KDA layers read one "
                            "full-rank output gate (ssm_g)")
    elif config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r}: llama.cpp's kimi-linear MLPs are SwiGLU (silu)")
    if config.num_experts is not None:
        if not config.norm_topk_prob and not k3:
            problems.append("norm_topk_prob=False: llama.cpp's kimi-linear graph always renormalises the top-k "
                            "router weights")
        if config.router_weights_from_biased_scores:
            problems.append("router_weights_from_biased_scores=True: llama.cpp takes the routing weights from the "
                            "unbiased scores (convert with --unbiased-router only if that is how the model was "
                            "trained)")
    if problems:
        arch = KIMI_K3_ARCH if k3 else KIMI_LINEAR_ARCH
        raise ConversionError(f"this model cannot run in llama.cpp's {arch} graph:\n  - " + "\n  - ".join(problems))
    return KIMI_K3_ARCH if k3 else KIMI_LINEAR_ARCH


def metadata(config, arch: str) -> list[tuple[str, object]]:
    """(key, value) of every architecture key llama.cpp's `arch` loader reads, from `config`."""
    g = _gguf()
    k = g.Keys
    L = config.num_hidden_layers
    full = set(config.full_attention_layers)
    moe = config.num_experts is not None
    rows = [
        (k.LLM.BLOCK_COUNT, L),
        (k.LLM.CONTEXT_LENGTH, config.max_position_embeddings),
        (k.LLM.EMBEDDING_LENGTH, config.hidden_size),
        (k.LLM.FEED_FORWARD_LENGTH, config.intermediate_size),
        (k.LLM.VOCAB_SIZE, config.vocab_size),
        (k.Attention.HEAD_COUNT, config.num_attention_heads),
        # MLA is served as one shared latent "head" (MQA); 0 marks a KDA (recurrent) layer
        (k.Attention.HEAD_COUNT_KV, [1 if i in full else 0 for i in range(L)]),
        (k.Attention.LAYERNORM_RMS_EPS, config.rms_norm_eps),
        (k.Attention.KV_LORA_RANK, config.kv_lora_rank),
        (k.Attention.KEY_LENGTH, config.kv_lora_rank + config.qk_rope_head_dim),
        (k.Attention.KEY_LENGTH_MLA, config.qk_nope_head_dim + config.qk_rope_head_dim),
        (k.Attention.VALUE_LENGTH_MLA, config.v_head_dim),
        (k.Rope.DIMENSION_COUNT, config.qk_rope_head_dim),
        (k.SSM.CONV_KERNEL, config.linear_conv_kernel_size),
        (k.KDA.HEAD_DIM, config.linear_head_dim),
        (k.LLM.EXPERT_FEED_FORWARD_LENGTH, config.moe_intermediate_size),
        (k.LLM.EXPERT_SHARED_COUNT, config.n_shared_experts if moe else 0),
        # a dense model: every layer is one of the "first k dense" ones
        (k.LLM.LEADING_DENSE_BLOCK_COUNT, config.first_k_dense_replace if moe else L),
        (k.LLM.EXPERT_WEIGHTS_SCALE, float(config.routed_scaling_factor)),
        (k.LLM.EXPERT_GATING_FUNC, int(g.ExpertGatingFuncType.SIGMOID)),
    ]
    if config.q_lora_rank is not None:
        rows.append((k.Attention.Q_LORA_RANK, config.q_lora_rank))
    if moe:
        rows += [(k.LLM.EXPERT_COUNT, config.num_experts), (k.LLM.EXPERT_USED_COUNT, config.num_experts_per_tok),
                 (k.LLM.EXPERT_WEIGHTS_NORM, bool(config.norm_topk_prob))]
    if arch == KIMI_K3_ARCH:  # spelled as llama.cpp's loader reads them (gguf 0.19 has no K3 constants)
        rows += [(k.Attention.VALUE_LENGTH, config.kv_lora_rank),  # the MLA cache holds the latent
                 ("{arch}.attn_res.block_size", config.attn_res_block_size or 0),
                 ("{arch}.activation.situ_beta", float(config.activation_situ_beta)),
                 ("{arch}.activation.situ_linear_beta", float(config.activation_situ_linear_beta))]
        if config.gate_lower_bound is not None:
            rows.append(("{arch}.kda.gate_lower_bound", float(config.gate_lower_bound)))
        if moe and config.routed_expert_hidden_size is not None:
            rows.append(("{arch}.expert_latent_length", config.routed_expert_hidden_size))
    return [(key.format(arch=arch), value) for key, value in rows]


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------
def _pre_tokenizer(tok: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json, judged by what it does (llama.cpp's own converter
    recognises tokenizers by a hash of known releases, so a tokenizer trained here is never known to it)."""
    pre, norm = tok.get("pre_tokenizer"), tok.get("normalizer")
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if (norm is None and len(steps) == 1 and isinstance(steps[0], dict) and steps[0].get("type") == "ByteLevel"
            and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space", False)):
        return "gpt-2"  # byte-level BPE split by GPT-2's regex: llama.cpp's "gpt-2" pre-tokenizer is that regex
    raise ConversionError(f"tokenizer.json: no llama.cpp pre-tokenizer is known to split text as this one does "
                          f"(normalizer {json.dumps(norm)[:120]}, pre_tokenizer {json.dumps(pre)[:200]}); only "
                          "byte-level BPE with GPT-2's regex and no prefix space is mapped")


def tokenizer_metadata(folder: Path, vocab_size: int) -> list[tuple[str, object]]:
    """(key, value) of llama.cpp's tokenizer keys for the tokenizer in `folder` (a tokenizer.json BPE), padded to
    the model's `vocab_size` rows; with its chat template when it has one."""
    g = _gguf()
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no tokenizer.json; llama.cpp needs the tokenizer inside the GGUF file")
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("ignore_merges"):
        raise ConversionError(f"{path}: a {model.get('type')} model (byte_fallback={model.get('byte_fallback')}, "
                              f"ignore_merges={model.get('ignore_merges')}); only byte-level BPE is mapped to "
                              "llama.cpp's gpt2 tokenizer")
    pre = _pre_tokenizer(tok)
    by_id = {i: (t, g.TokenType.NORMAL) for t, i in model["vocab"].items()}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], g.TokenType.CONTROL if added.get("special")
                              else g.TokenType.USER_DEFINED)
    if max(by_id) >= vocab_size:
        raise ConversionError(f"{path}: token id {max(by_id)} is outside the model's {vocab_size} embedding rows")
    tokens = [by_id.get(i, (f"[PAD{i}]", g.TokenType.UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    rows: list[tuple[str, object]] = [
        (g.Keys.Tokenizer.MODEL, "gpt2"), (g.Keys.Tokenizer.PRE, pre),
        (g.Keys.Tokenizer.LIST, [t for t, _ in tokens]), (g.Keys.Tokenizer.TOKEN_TYPE, [int(t) for _, t in tokens]),
        (g.Keys.Tokenizer.MERGES, merges),
    ]
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(folder)
    probe = hf("a").input_ids
    for key, token_id in ((g.Keys.Tokenizer.BOS_ID, hf.bos_token_id), (g.Keys.Tokenizer.EOS_ID, hf.eos_token_id),
                          (g.Keys.Tokenizer.PAD_ID, hf.pad_token_id), (g.Keys.Tokenizer.UNK_ID, hf.unk_token_id)):
        if token_id is not None:
            rows.append((key, int(token_id)))
    rows += [(g.Keys.Tokenizer.ADD_BOS, bool(probe) and probe[0] == hf.bos_token_id),
             (g.Keys.Tokenizer.ADD_EOS, bool(probe) and probe[-1] == hf.eos_token_id)]
    if isinstance(hf.chat_template, str):
        rows.append((g.Keys.Tokenizer.CHAT_TEMPLATE, hf.chat_template))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------
class GGUFSink:
    """Takes the conversion plan's tensors (Kimi Linear names), writes them in llama.cpp's layout for `arch` into a
    data file beside `path` as they come, and at `close()` writes the GGUF file `path` (header, metadata, tensor
    table, then the data). `dtype`: the dtype of the matrices (f32, f16 or bf16); vectors, norms, convolutions and
    the router stay f32, MXFP4 experts stay MXFP4."""

    def __init__(self, path: Path, config, arch: str, dtype: torch.dtype, kv: list[tuple[str, object]], *,
                 name: str):
        self.g = _gguf()
        self.path, self.data_path = path, path.with_name(path.name + ".data")
        self.config, self.arch, self.dtype, self.kv, self.name = config, arch, dtype, kv, name
        self.full = set(config.full_attention_layers)
        self.table: list[tuple[str, tuple[int, ...], int, int]] = []  # name, numpy shape, ggml type, bytes
        self.pending: dict[tuple, dict] = {}  # tensors that become one: a layer's experts, a residual's two halves
        self.embedding: torch.Tensor | None = None
        self.has_output = False
        self.data = open(self.data_path, "wb")

    def add(self, name: str, tensor: torch.Tensor) -> None:
        for out, t in self._transform(name, tensor):
            self._write(out, t)

    def _collect(self, key: tuple, part, tensor: torch.Tensor, need: int) -> dict | None:
        """Hold `tensor` as `part` of `key` until `need` parts are in; then all of them."""
        group = self.pending.setdefault(key, {})
        group[part] = tensor
        if len(group) < need:
            return None
        return self.pending.pop(key)

    def _transform(self, name: str, t: torch.Tensor):
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            self.embedding = t if self.config.tie_word_embeddings else None
            return [("token_embd.weight", t)]
        if name == "lm_head.weight":
            self.has_output = True
            return [("output.weight", t)]
        if name == "model.norm.weight":
            return [("output_norm.weight", t)]
        if name.startswith("model.output_attn_res_"):  # K3: the final residual read
            return self._residual(("output",), "output_res_score.weight", parts[-2].rsplit("_", 1)[1], t)
        if parts[:2] != ["model", "layers"]:
            raise ConversionError(f"--to gguf: no llama.cpp tensor for {name}")
        b, rest = int(parts[2]), ".".join(parts[3:])
        if rest.startswith("block_sparse_moe.experts."):  # experts.{e}.{w}.weight[_packed|_scale]
            return self._expert(b, int(parts[5]), parts[6], parts[7], t)
        if rest.startswith(("self_attention_res_", "mlp_res_")):
            kind = "attn" if rest.startswith("self_attention") else "ffn"
            return self._residual((b, kind), f"blk.{b}.{kind}_res_score.weight", parts[-2].rsplit("_", 1)[1], t)
        sa = "self_attn."
        if rest in (sa + "q_conv1d.weight", sa + "k_conv1d.weight", sa + "v_conv1d.weight"):
            C, W = t.shape[0], t.shape[-1]
            return [(f"blk.{b}.ssm_conv1d_{rest[len(sa)]}.weight", t.reshape(1, C, 1, W))]
        if rest == sa + "A_log":  # K3's graph reads a plain [H] vector
            a = -torch.exp(t.float())
            return [(f"blk.{b}.ssm_a", a.reshape(-1) if self.arch == KIMI_K3_ARCH else a)]
        if rest == sa + "g_proj.weight":  # K3: the KDA layers' full-rank gate, the MLA layers' output gate
            return [(f"blk.{b}.{'attn_gate' if b in self.full else 'ssm_g'}.weight", t)]
        if rest == sa + "kv_b_proj.weight":
            H, nope, v = self.config.num_attention_heads, self.config.qk_nope_head_dim, self.config.v_head_dim
            kv = t.view(H, nope + v, t.shape[-1])
            return [(f"blk.{b}.attn_k_b.weight", kv[:, :nope].transpose(1, 2).contiguous()),
                    (f"blk.{b}.attn_v_b.weight", kv[:, nope:].contiguous())]
        out = _LAYER_NAMES.get(rest)
        if out is None:
            raise ConversionError(f"--to gguf: no llama.cpp tensor for {name}")
        return [(f"blk.{b}.{out}", t)]

    def _residual(self, key, out: str, half: str, t: torch.Tensor):
        """K3's Block Attention Residuals read `<x>_res_norm.weight * <x>_res_proj.weight` only as their product."""
        got = self._collect(key, half, t, 2)
        return [] if got is None else [(out, got["norm"].float().reshape(-1) * got["proj"].float().reshape(-1))]

    def _expert(self, b: int, e: int, w: str, kind: str, t: torch.Tensor):
        """A layer's routed experts, stacked into one [E, ., .] tensor once all of them are in."""
        E = self.config.num_experts
        mxfp4 = kind in ("weight_packed", "weight_scale")
        got = self._collect((b, w), (e, kind), t, 2 * E if mxfp4 else E)
        if got is None:
            return []
        out = f"blk.{b}.ffn_{_EXPERT_PROJ[w]}_exps.weight"
        if mxfp4:
            return [(out, _MXFP4(torch.stack([mxfp4_blocks(got[(i, "weight_packed")], got[(i, "weight_scale")])
                                              for i in range(E)])))]
        return [(out, torch.stack([got[(i, "weight")] for i in range(E)]))]

    def _write(self, name: str, t) -> None:
        g = self.g
        if isinstance(t, _MXFP4):  # ggml blocks as bytes; the table gets the element shape
            array, kind = t.blocks.numpy(), g.GGMLQuantizationType.MXFP4
            shape = tuple(g.quant_shape_from_byte_shape(array.shape, kind))
        else:
            vector = t.dim() <= 1 or name.endswith("_norm.weight") or name.endswith(_F32_NAMES) \
                or not name.endswith(".weight")
            dtype = torch.float32 if vector else self.dtype
            t = t.detach().to("cpu", dtype).contiguous()
            if dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, as llama.cpp stores them
                array, kind = t.view(torch.int16).numpy(), g.GGMLQuantizationType.BF16
            else:
                array = t.numpy()
                kind = g.GGMLQuantizationType.F16 if dtype == torch.float16 else g.GGMLQuantizationType.F32
            shape = tuple(array.shape)
        self.data.write(array.tobytes())
        self.data.write(b"\0" * (-array.nbytes % _ALIGN))
        self.table.append((name, shape, kind, array.nbytes))

    def close(self) -> None:
        if self.pending:
            raise ConversionError(f"--to gguf: incomplete tensor groups (experts or residual halves) for "
                                  f"{sorted(map(str, self.pending))}")
        if not self.has_output:  # tied embeddings: llama.cpp's graphs read an output matrix
            if self.embedding is None:
                raise ConversionError("--to gguf: neither lm_head.weight nor a tied embedding")
            self._write("output.weight", self.embedding)
        self.data.close()
        g = self.g
        writer = g.GGUFWriter(str(self.path), self.arch)
        writer.add_name(self.name)
        writer.add_file_type({torch.float32: g.LlamaFileType.ALL_F32, torch.float16: g.LlamaFileType.MOSTLY_F16,
                              torch.bfloat16: g.LlamaFileType.MOSTLY_BF16}[self.dtype])
        for key, value in self.kv:
            _add_kv(writer, key, value)
        for name, shape, kind, nbytes in self.table:
            # element shapes for every type: gguf converts a byte shape only for uint8 arrays, so say float32
            writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        writer.write_padding(out, out.tell())
        with open(self.data_path, "rb") as data:
            while chunk := data.read(1 << 24):
                out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
        writer.close()
        self.data_path.unlink()


class _MXFP4:
    """ggml MXFP4 blocks of a stacked expert tensor, uint8 [E, rows, blocks * 17]."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks


def mxfp4_blocks(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K3's MXFP4 (packed [rows, cols / 2]: element 2j in the low nibble of byte j, 2j + 1 in the high one; scale
    [rows, cols / 32] E8M0) -> ggml's block_mxfp4 bytes [rows, cols / 32 * 17]: per block the scale byte, then byte
    j holding element j (low nibble) and element j + 16 (high). The codes and scales are the same numbers in both
    (ggml doubles its code table and halves its scale), so only bits move."""
    rows, half = packed.shape
    n = half * 2 // 32
    codes = torch.stack((packed & 0x0F, packed >> 4), -1).reshape(rows, n, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scale.reshape(rows, n, 1), qs), -1).reshape(rows, n * 17).contiguous()


# the remaining per-layer tensors, Kimi Linear name -> llama.cpp name
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.f_a_proj.weight": "ssm_f_a.weight",
    "self_attn.f_b_proj.weight": "ssm_f_b.weight",
    "self_attn.g_a_proj.weight": "ssm_g_a.weight",
    "self_attn.g_b_proj.weight": "ssm_g_b.weight",
    "self_attn.b_proj.weight": "ssm_beta.weight",
    "self_attn.dt_bias": "ssm_dt.bias",
    "self_attn.o_norm.weight": "ssm_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "block_sparse_moe.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "block_sparse_moe.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "block_sparse_moe.routed_expert_down_proj.weight": "ffn_routed_down.weight",  # K3 latent MoE
    "block_sparse_moe.routed_expert_up_proj.weight": "ffn_routed_up.weight",
    "block_sparse_moe.routed_expert_norm.weight": "ffn_routed_norm.weight",
}


def _add_kv(writer, key: str, value) -> None:
    """One metadata key with the GGUF type llama.cpp reads it as (integers u32, lists as gguf types them)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: no GGUF type for {type(value).__name__}")
