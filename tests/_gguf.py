"""A tiny Llama written as llama.cpp writes a GGUF (q/k rows permuted for its RoPE, Q8_0 embedding, Q4_1
projections, f32 norms, a byte-level BPE tokenizer and a chat template in the metadata), for the GGUF conversion
and delta tests. Needs the gguf package (callers importorskip it)."""

import gguf
import numpy as np
import torch

D, LAYERS, HEADS, KV_HEADS, FFN = 64, 3, 4, 2, 128  # rows of 64 / 128: whole Q4_1 and Q8_0 blocks of 32
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def _tokens_and_merges():
    alphabet = _byte_alphabet()
    space = alphabet[ord(" ")]
    merges = [f"{space} t", "i n", f"{space} a", "e r", f"{space}t h", "d e", "de f"]
    merged = ["".join(m.split(" ")) for m in merges]
    return SPECIALS + alphabet + merged, merges


def _permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores q/k rows with each head's two rotary halves interleaved (its RoPE pairs
    neighbours); transformers' GGUF loader undoes this."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, *, tied=True, seed=0, arch="llama"):
    tokens, merges = _tokens_and_merges()
    V, hd = len(tokens), D // HEADS
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.1):
        return (torch.randn(*shape, generator=gen) * std).numpy()

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (V - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    Q8, Q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1

    def quantized(name, x, qtype):
        w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)

    quantized("token_embd.weight", rand(V, D), Q8)
    w.add_tensor("output_norm.weight", 1 + rand(D))
    if not tied:
        quantized("output.weight", rand(V, D), Q8)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + rand(D))
        w.add_tensor(p + "ffn_norm.weight", 1 + rand(D))
        q = _permute_for_gguf(torch.from_numpy(rand(HEADS * hd, D)), HEADS).numpy()
        k = _permute_for_gguf(torch.from_numpy(rand(KV_HEADS * hd, D)), KV_HEADS).numpy()
        quantized(p + "attn_q.weight", q, Q4)
        quantized(p + "attn_k.weight", k, Q4)
        quantized(p + "attn_v.weight", rand(KV_HEADS * hd, D), Q4)
        quantized(p + "attn_output.weight", rand(D, HEADS * hd), Q4)
        quantized(p + "ffn_gate.weight", rand(FFN, D), Q4)
        quantized(p + "ffn_up.weight", rand(FFN, D), Q4)
        quantized(p + "ffn_down.weight", rand(D, FFN), Q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
