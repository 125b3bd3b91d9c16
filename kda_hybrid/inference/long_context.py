"""Long prompts in bounded memory: run a prompt through the cache a chunk at a time.

A one-shot forward holds every layer's activations for the whole prompt at once (and, without
`logits_to_keep`, a [B, T, vocab] logits tensor). Run chunk by chunk under `no_grad`, peak activation memory is
set by the chunk; what still grows with the prompt is the cache, and in a KDA hybrid only its full-attention
layers grow (docs/architecture.md §2-§3): the KDA layers' state is a fixed [B, H, K, V] per layer.

    from kda_hybrid.inference.long_context import prefill

    last_logits, cache = prefill(model, input_ids, chunk_size=4096)   # any prompt length
    next_token = last_logits.argmax(-1)                                 # [B]
    out = model.generate(torch.cat((input_ids, next_token[:, None]), 1), cache=cache, max_new_tokens=64)

`generate(..., prefill_chunk_size=N)` does the same inside transformers; this helper is for code that drives
the model itself (scoring, a server keeping caches, continuing a cache with more text).
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 4096  # 6.5M model at 128K context: bounded chunk activations, few Python round trips


@torch.no_grad()
def prefill(
    model,
    input_ids: torch.LongTensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cache=None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, object]:
    """Run `input_ids` [B, T] through `model` `chunk_size` tokens at a time and return
    (logits of the last position [B, vocab], cache).

    - `cache`: continue this cache (it then holds past + T tokens); None starts a new one (the model builds its
      own: a `KDAHybridCache` for KDA hybrid models, transformers' default for others).
    - `attention_mask`: [B, past + T] (1 = real token, 0 = padding), the same convention as `generate()`; each
      chunk's forward sees the mask up to the chunk's end. None: no padding.

    Equals one forward over the whole prompt (same cache states, same last logits up to float reordering);
    works for any causal LM of transformers 5 that takes `cache=` and `logits_to_keep=`.
    """
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    if attention_mask is not None and tuple(attention_mask.shape) != (B, past + T):
        raise ValueError(f"attention_mask must be [B, past + T] = {(B, past + T)} (past = tokens already in the "
                         f"cache), got {tuple(attention_mask.shape)}")
    logits = None
    for start in range(0, T, chunk_size):
        end = min(T, start + chunk_size)
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask[:, : past + end]}
        out = model(input_ids=input_ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1, **kwargs)
        cache = out.cache
        logits = out.logits
    return logits[:, -1], cache


__all__ = ["DEFAULT_CHUNK_SIZE", "prefill"]
