"""`KDAHybridCache`: one cache for both kinds of layer of a KDA hybrid model.

- Full-attention layers keep a growing KV cache. For MLA it holds the compressed latent [B, 1, T, kv_lora_rank]
  and the shared key part [B, 1, T, qk_rope_head_dim] (576 values per token for Kimi-Linear-48B), never the
  per-head keys and values (about 18x larger). For GQA it holds keys and values [B, H_kv, T, D].
- KDA layers keep a fixed-size state: the last (conv_kernel - 1) inputs of each of the q, k, v short
  convolutions [B, H*K, kernel - 1] and the fp32 recurrent state [B, H, K, V]. It does not grow with context.

Rollback (`crop`) is exact: while past recording is active (transformers activates it for assisted and
prompt-lookup decoding) every KDA layer logs, per forward, its state before the forward and the forward's
inputs; cropping replays the kept tokens from that state, so the conv and recurrent states are those of a
run that never saw the removed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .kda_ops import fused_recurrent_kda


@dataclass
class _Segment:
    """One recorded forward of a KDA layer: enough to recompute its states for any prefix of its tokens."""

    conv_before: list[torch.Tensor]  # q, k, v conv states before the forward, [B, C, kernel - 1] each
    state_before: torch.Tensor  # [B, H, K, V] fp32
    conv_inputs: list[torch.Tensor]  # compacted pre-conv inputs of the forward, [B, C, T] each
    q: torch.Tensor  # compacted KDA inputs: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    mask: torch.Tensor  # [B, T] bool, the forward's real-token mask in original positions


def shift_conv_state(conv_before: torch.Tensor, inputs: torch.Tensor, n_real: torch.Tensor) -> torch.Tensor:
    """The last (kernel - 1) inputs seen after appending the first n_real[b] columns of `inputs` ([B, C, T],
    real tokens first) to `conv_before` ([B, C, kernel - 1]). Returns [B, C, kernel - 1]."""
    width = conv_before.shape[-1]
    full = torch.cat((conv_before, inputs.to(conv_before.dtype)), dim=-1)  # [B, C, kernel - 1 + T]
    idx = n_real.view(-1, 1) + torch.arange(width, device=full.device)  # window ending at the last real token
    return full.gather(-1, idx.unsqueeze(1).expand(-1, full.shape[1], -1))


class KDALayerState:
    """Conv and recurrent states of one KDA layer (fixed size)."""

    is_sliding = False
    is_compileable = False

    def __init__(self):
        self.conv_states: list[torch.Tensor] | None = None  # q, k, v: [B, H*K, kernel - 1]
        self.recurrent_state: torch.Tensor | None = None  # [B, H, K, V] fp32
        self.record_past = False
        self.segments: list[_Segment] = []

    @property
    def is_initialized(self) -> bool:
        return self.recurrent_state is not None

    def tensors(self):
        if not self.is_initialized:
            return []
        return [*self.conv_states, self.recurrent_state]

    def _apply(self, fn):
        if self.is_initialized:
            self.conv_states = [fn(c) for c in self.conv_states]
            self.recurrent_state = fn(self.recurrent_state)
        self.segments = []

    def reset(self):
        if self.is_initialized:
            for t in self.tensors():
                t.zero_()
        self.segments = []

    def record(self, segment: _Segment):
        if self.record_past:
            self.segments.append(segment)

    def crop(self, tokens_to_remove: int):
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (or 0), got {tokens_to_remove}")
        n = -tokens_to_remove
        if n and not self.record_past:
            raise RuntimeError(
                "crop() of a KDA layer needs the states of the removed tokens: call cache.activate_past_recording() "
                "before the forward whose tokens you want to roll back"
            )
        while n:
            if not self.segments:
                raise RuntimeError(f"cannot crop {n} more tokens: only the forwards since the last crop are recorded")
            seg = self.segments.pop()
            T = seg.mask.shape[1]
            if n >= T:  # the whole forward goes: restore the states it started from
                self.conv_states, self.recurrent_state = seg.conv_before, seg.state_before
                n -= T
                continue
            kept = seg.mask[:, : T - n].sum(1)  # real tokens kept per row
            keep = torch.arange(T, device=kept.device) < kept[:, None]  # compacted layout: real tokens first
            g = seg.g * keep[..., None, None]
            beta = seg.beta * keep[..., None]
            _, state = fused_recurrent_kda(
                seg.q, seg.k, seg.v, g, beta, initial_state=seg.state_before.clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, inplace_final_state=True, backend="torch",
            )
            self.recurrent_state = state
            self.conv_states = [shift_conv_state(c, x, kept) for c, x in zip(seg.conv_before, seg.conv_inputs)]
            n = 0
        self.segments = []  # what is left is committed: later crops only undo later forwards

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class KVLayerState:
    """Growing keys/values of one full-attention layer, [B, heads, T, dim] (for MLA: latent and shared key).

    Stored in buffers with spare room (capacity doubles when full), so appending a decode step writes one
    token instead of copying the whole cache as torch.cat would: per-token decode cost stays flat in context.
    """

    is_sliding = False
    is_compileable = False
    record_past = False

    def __init__(self):
        self._keys: torch.Tensor | None = None  # [B, heads, capacity, dim]
        self._values: torch.Tensor | None = None
        self.length = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[..., : self.length, :]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None else self._values[..., : self.length, :]

    @property
    def is_initialized(self) -> bool:
        return self._keys is not None

    def tensors(self):
        return [self.keys, self.values] if self.is_initialized else []

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = keys.shape[-2]
        if self._keys is None or self.length + n > self._keys.shape[-2]:
            capacity = max(self.length + n, 2 * (self._keys.shape[-2] if self._keys is not None else 0))
            self._keys = self._grow(self._keys, keys, capacity)
            self._values = self._grow(self._values, values, capacity)
        self._keys[..., self.length : self.length + n, :] = keys
        self._values[..., self.length : self.length + n, :] = values
        self.length += n
        return self.keys, self.values

    def _grow(self, old: torch.Tensor | None, new: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
        if old is not None:
            buf[..., : self.length, :] = old[..., : self.length, :]
        return buf

    def _apply(self, fn):
        if self.is_initialized:
            self._keys, self._values = fn(self.keys), fn(self.values)

    def reset(self):
        self._keys = self._values = None
        self.length = 0

    def crop(self, tokens_to_remove: int):
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (or 0), got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def allocated_bytes(self) -> int:
        return 0 if self._keys is None else sum(t.numel() * t.element_size() for t in (self._keys, self._values))


class KDAHybridCache(Cache):
    """Cache of a KDA hybrid model: KV for full-attention layers, conv + recurrent states for KDA layers.

    `generate()` builds one by itself; build one explicitly to keep it across calls:

        cache = KDAHybridCache(model.config)
        out = model(input_ids, cache=cache)          # cache now holds the prompt
        out = model(next_ids, cache=out.cache)       # continue
    """

    def __init__(self, config, **kwargs):
        layers = [KVLayerState() if t == "full_attention" else KDALayerState() for t in config.layer_types]
        super().__init__(layers=layers)
        self.config = config
        self.layer_types = list(config.layer_types)
        self._seen_tokens = 0

    # ---- sizes -----------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self._seen_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def advance(self, num_tokens: int):
        """Called by the model once per forward, after every layer has consumed its tokens."""
        self._seen_tokens += num_tokens

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._seen_tokens > 0

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_linear(self) -> list[bool]:
        return [t == "linear_attention" for t in self.layer_types]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self._seen_tokens > 0

    @property
    def is_croppable(self) -> bool:
        """Exact rollback needs the KDA layers to have recorded the forwards to undo."""
        return all(layer.record_past for layer in self.layers if isinstance(layer, KDALayerState))

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            tensors = layer.tensors()
            if tensors:
                return tensors[0].shape[0]
        return -1

    # ---- generation utilities --------------------------------------------------------------------------
    def activate_past_recording(self):
        for layer in self.layers:
            if isinstance(layer, KDALayerState):
                layer.record_past = True

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self._seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers 5 convention: a count <= 0)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop() takes a negative count (minus the tokens to remove, transformers 5 convention) or 0, got {tokens_to_remove}"
            )
        if -tokens_to_remove > self._seen_tokens:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache holding {self._seen_tokens}")
        for layer in self.layers:
            layer.crop(tokens_to_remove)
        self._seen_tokens += tokens_to_remove

    def reorder_cache(self, beam_idx: torch.LongTensor):
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor):
        for layer in self.layers:
            layer._apply(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        for layer in self.layers:
            layer._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    # ---- memory report ---------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes held, by layer kind, and how the total grows per token (per sequence in the batch)."""
        kda = sum(layer.nbytes() for layer in self.layers if isinstance(layer, KDALayerState))
        kv = sum(layer.nbytes() for layer in self.layers if isinstance(layer, KVLayerState))
        per_token = 0
        if self._seen_tokens and self.batch_size > 0:
            per_token = kv // (self._seen_tokens * self.batch_size)
        kv_allocated = sum(layer.allocated_bytes() for layer in self.layers if isinstance(layer, KVLayerState))
        return {
            "tokens": self._seen_tokens,
            "attention_kv_allocated_bytes": kv_allocated,  # includes the growth headroom of the KV buffers
            "kda_state_bytes": kda,
            "attention_kv_bytes": kv,
            "total_bytes": kda + kv,
            "kv_bytes_per_token_per_sequence": per_token,
            "kda_layers": self.layer_types.count("linear_attention"),
            "attention_layers": self.layer_types.count("full_attention"),
        }

    def __repr__(self):
        r = self.memory_report()
        return (f"KDAHybridCache(tokens={r['tokens']}, kda_layers={r['kda_layers']}, "
                f"attention_layers={r['attention_layers']}, bytes={r['total_bytes']})")


__all__ = ["KDAHybridCache"]
