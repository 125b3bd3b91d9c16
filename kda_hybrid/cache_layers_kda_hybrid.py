"""The layers of a `KDAHybridCache` (docs/architecture.md §8): what one model layer keeps between forwards.

- `KVLayerState`, a full-attention layer: growing keys and values [B, heads, T, dim] (for MLA the compressed latent
  and the shared rotary key), in buffers with spare room.
- `KDALayerState`, a KDA layer: the fixed-size q, k, v short-conv states [B, H*K, kernel - 1] and the fp32
  recurrent state [B, H, K, V], and while past recording is active, each forward's inputs so that `crop` can
  replay the kept tokens exactly.
- `KDAHybridCacheLayer`, the protocol both implement and the cache relies on.

A layer's state changes only through its own methods: `KVLayerState.update(keys, values)`,
`KDALayerState.update(conv_states, recurrent_state)` and `KDALayerState.record(...)`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kda_ops import fused_recurrent_kda


@dataclass
class _Segment:
    """One recorded forward of a KDA layer: enough to recompute its states for any prefix of its tokens."""

    conv_before: list[torch.Tensor]  # q, k, v conv states before the forward, [B, C, kernel - 1] each
    state_before: torch.Tensor  # [B, Hkv, K, V] fp32
    conv_inputs: list[torch.Tensor]  # compacted pre-conv inputs of the forward, [B, C, T] each
    q: torch.Tensor  # compacted KDA inputs: q [B, T, H, K], k, g [B, T, Hkv, K], v [B, T, Hkv, V], beta [B, T, Hkv]
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    mask: torch.Tensor  # [B, T] bool, the forward's real-token mask in original positions

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[1]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> _Segment:
        """The same record with every tensor (all batch-first) replaced by fn(tensor)."""
        values = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values[f.name] = [fn(t) for t in v] if isinstance(v, list) else fn(v)
        return _Segment(**values)


def shift_conv_state(conv_before: torch.Tensor, inputs: torch.Tensor, n_real: torch.Tensor) -> torch.Tensor:
    """The last (kernel - 1) inputs seen after appending the first n_real[b] columns of `inputs` ([B, C, T],
    real tokens first) to `conv_before` ([B, C, kernel - 1]). Returns [B, C, kernel - 1]."""
    width = conv_before.shape[-1]
    full = torch.cat((conv_before, inputs.to(conv_before.dtype)), dim=-1)  # [B, C, kernel - 1 + T]
    idx = n_real.view(-1, 1) + torch.arange(width, device=full.device)  # window ending at the last real token
    return full.gather(-1, idx.unsqueeze(1).expand(-1, full.shape[1], -1))


def conv_states_after(conv_before: list[torch.Tensor], conv_inputs: list[torch.Tensor],
                      n_real: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The q, k, v conv states after a forward: per tensor, the last (kernel - 1) inputs of conv_before
    [B, C, kernel - 1] followed by conv_inputs [B, C, T]; with n_real [B] (padded rows, real tokens first), the
    last (kernel - 1) up to each row's last real token."""
    if n_real is not None:
        return [shift_conv_state(c, x, n_real) for c, x in zip(conv_before, conv_inputs)]
    width = conv_before[0].shape[-1]
    return [torch.cat((c, x), -1)[..., -width:].clone() if x.shape[-1] < width else x[..., -width:].contiguous()
            for c, x in zip(conv_before, conv_inputs)]


class KDAHybridCacheLayer(ABC):
    """What one layer of a `KDAHybridCache` implements: the explicit protocol the cache relies on (the part
    transformers' `CacheLayerMixin` / `LinearAttentionCacheLayerMixin` play for its own caches).

    Every tensor a layer holds, live state and rollback records alike, has the batch on dim 0: the batch
    operations and offloading go through `map_tensors` and need nothing else from a layer.
    """

    is_sliding = False
    # Not compileable: the KV buffers grow by reallocation and recorded forwards are Python lists, so tensor
    # addresses are not static across steps (what cudagraphs need).
    is_compileable = False
    supports_early_init = True
    record_past = False

    def __init__(self):
        self.offloaded_from: torch.device | None = None  # where offload() moved the tensors from

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """Whether the layer holds tensors (after a forward or early_initialization)."""

    @property
    @abstractmethod
    def is_croppable(self) -> bool:
        """Whether crop() can put the layer back exactly as it was."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The live state (what the next forward reads), [] when not initialized."""

    @abstractmethod
    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every tensor the layer holds (state and rollback records) by fn(tensor)."""

    @abstractmethod
    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise if crop(tokens_to_remove) (a count <= 0) cannot be done exactly. Changes nothing."""

    @abstractmethod
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens; called only after check_crop passed on every layer."""

    @abstractmethod
    def early_initialization(self, batch_size: int, config, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the state of an empty layer ahead of the first forward (equal to no state)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every token (the next forward starts from nothing)."""

    @abstractmethod
    def release(self) -> None:
        """Drop every tensor: back to the uninitialized layer, which any batch size may fill."""

    @abstractmethod
    def activate_past_recording(self) -> None:
        """Start keeping what crop() needs (nothing, for a layer whose crop needs nothing)."""

    @property
    def batch_size(self) -> int:
        tensors = self.tensors()
        return tensors[0].shape[0] if tensors else -1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def offload(self) -> None:
        """Move every tensor to the CPU (blocking, so the CPU copies are complete when this returns)."""
        if not self.is_initialized or self.offloaded_from is not None:
            return
        device = self.tensors()[0].device
        self.map_tensors(lambda t: t.to("cpu"))
        self.offloaded_from = device

    def prefetch(self) -> None:
        """Move the tensors back to the device offload() took them from."""
        if self.offloaded_from is None:
            return
        device, self.offloaded_from = self.offloaded_from, None
        self.map_tensors(lambda t: t.to(device, non_blocking=True))


class KDALayerState(KDAHybridCacheLayer):
    """Conv and recurrent states of one KDA layer (fixed size), and while recording, the forwards to undo."""

    def __init__(self):
        super().__init__()
        self.conv_states: list[torch.Tensor] | None = None  # q, k, v: [B, H*K, kernel - 1]
        self.recurrent_state: torch.Tensor | None = None  # [B, H, K, V] fp32
        self.record_past = False
        self.segments: list[_Segment] = []

    @property
    def is_initialized(self) -> bool:
        return self.recurrent_state is not None

    @property
    def is_croppable(self) -> bool:
        return self.record_past

    @property
    def recorded_tokens(self) -> int:
        """Tokens crop() can remove: those of the forwards recorded since recording began or the last crop."""
        return sum(seg.num_tokens for seg in self.segments)

    def tensors(self):
        if not self.is_initialized:
            return []
        return [*self.conv_states, self.recurrent_state]

    def map_tensors(self, fn):
        if self.is_initialized:
            self.conv_states = [fn(c) for c in self.conv_states]
            self.recurrent_state = fn(self.recurrent_state)
        self.segments = [seg.map(fn) for seg in self.segments]

    def activate_past_recording(self):
        self.record_past = True

    def update(self, conv_states: list[torch.Tensor], recurrent_state: torch.Tensor) -> None:
        """The states after a forward: conv_states (q, k, v, [B, H*K, kernel - 1] each; see conv_states_after) and
        the recurrent state [B, H, K, V] fp32 (a decode step may have updated the cached one in place)."""
        if len(conv_states) != 3:
            raise ValueError(f"a KDA layer keeps 3 conv states (q, k, v), got {len(conv_states)}")
        self.conv_states, self.recurrent_state = list(conv_states), recurrent_state

    def record(self, *, conv_before, state_before, conv_inputs, q, k, v, g, beta, mask) -> None:
        """While past recording is active, keep one forward for crop(): the states it started from (clones), its
        compacted pre-conv inputs [B, C, T] and KDA inputs (q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H]),
        and its real-token mask [B, T]. Does nothing when recording is off."""
        if self.record_past:
            self.segments.append(_Segment(conv_before=conv_before, state_before=state_before, conv_inputs=conv_inputs,
                                          q=q, k=k, v=v, g=g, beta=beta, mask=mask))

    def check_crop(self, tokens_to_remove: int):
        n = -tokens_to_remove
        if n and not self.record_past:
            raise RuntimeError(
                "crop() of a KDA layer needs the states of the removed tokens: call cache.activate_past_recording() "
                "before the forward whose tokens you want to roll back"
            )
        if n > self.recorded_tokens:
            raise RuntimeError(
                f"cannot crop {n} tokens: only the last {self.recorded_tokens} are recorded (the forwards since "
                "activate_past_recording() or the last crop)"
            )

    def crop(self, tokens_to_remove: int):
        n = -tokens_to_remove
        while n:
            seg = self.segments.pop()
            T = seg.num_tokens
            if n >= T:  # the whole forward goes: restore the states it started from
                self.conv_states, self.recurrent_state = seg.conv_before, seg.state_before
                n -= T
                continue
            kept = seg.mask[:, : T - n].sum(1)  # real tokens kept per row
            keep = torch.arange(T, device=kept.device) < kept[:, None]  # compacted layout: real tokens first
            g = seg.g * keep[..., None, None]
            beta = seg.beta * keep[..., None]
            # the state does not depend on the queries: k in their place (shared keys and values have fewer
            # heads than the queries)
            _, state = fused_recurrent_kda(
                seg.k, seg.k, seg.v, g, beta, initial_state=seg.state_before.clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, inplace_final_state=True, backend="torch", check_inputs=False,
            )
            self.recurrent_state = state
            self.conv_states = [shift_conv_state(c, x, kept) for c, x in zip(seg.conv_before, seg.conv_inputs)]
            n = 0
        self.segments = []  # what is left is committed: later crops only undo later forwards

    def early_initialization(self, batch_size, config, dtype, device):
        if self.is_initialized:
            return
        convs, state = kda_state_shapes(config)
        self.conv_states = [torch.zeros(batch_size, *conv, dtype=dtype, device=device) for conv in convs]
        self.recurrent_state = torch.zeros(batch_size, *state, dtype=torch.float32, device=device)

    def reset(self):
        if self.is_initialized:  # zeroed in place: a zero state is the state of no tokens
            for t in self.tensors():
                t.zero_()
        self.segments = []

    def release(self):
        self.conv_states = self.recurrent_state = None
        self.segments = []
        self.offloaded_from = None


class KVLayerState(KDAHybridCacheLayer):
    """Growing keys/values of one full-attention layer, [B, heads, T, dim] (for MLA: latent and shared key).

    Stored in buffers with spare room (capacity doubles when full), so appending a decode step writes one
    token instead of copying the whole cache as torch.cat would: per-token decode cost stays flat in context.
    """

    def __init__(self):
        super().__init__()
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

    @property
    def is_croppable(self) -> bool:
        return True  # dropping the last tokens of a KV cache is exact

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

    def mark_nonfinite(self, bad: torch.Tensor):
        """NaN at the newest tokens where `bad` [B, T] (the last update's tokens): the attention layer computed that
        update from zeros in their place (_CausalThroughNonFinite), and a later query that sees one must be NaN."""
        T = bad.shape[1]
        marked = []
        for buf in (self._keys, self._values):
            if buf.requires_grad:
                # the attention just saved views of this buffer for its backward (a forward with gradients into a
                # cache): writing it in place would fail that backward's version check, so mark a copy
                buf = buf.clone()
            rows = buf[..., self.length - T : self.length, :]
            rows.copy_(torch.where(bad[:, None, :, None], torch.full((), float("nan"), dtype=buf.dtype,
                                                                    device=buf.device), rows))
            marked.append(buf)
        self._keys, self._values = marked

    def _grow(self, old: torch.Tensor | None, new: torch.Tensor, capacity: int) -> torch.Tensor:
        buf = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
        if old is not None:
            buf[..., : self.length, :] = old[..., : self.length, :]
        return buf

    def map_tensors(self, fn):
        if self.is_initialized:  # the live tokens only: a batch copy need not carry the growth headroom
            self._keys, self._values = fn(self.keys), fn(self.values)

    def activate_past_recording(self):
        pass  # dropping the last tokens needs no record

    def check_crop(self, tokens_to_remove: int):
        if -tokens_to_remove > self.length:
            raise RuntimeError(f"cannot crop {-tokens_to_remove} tokens from an attention layer holding {self.length}")

    def crop(self, tokens_to_remove: int):
        self.length += tokens_to_remove

    def early_initialization(self, batch_size, config, dtype, device):
        if self.is_initialized:
            return
        (kh, kd), (vh, vd) = kv_shapes(config)
        self._keys = torch.empty(batch_size, kh, 0, kd, dtype=dtype, device=device)
        self._values = torch.empty(batch_size, vh, 0, vd, dtype=dtype, device=device)

    def reset(self):
        self.release()

    def release(self):
        self._keys = self._values = None
        self.length = 0
        self.offloaded_from = None

    def allocated_bytes(self) -> int:
        return 0 if self._keys is None else sum(t.numel() * t.element_size() for t in (self._keys, self._values))


def kda_state_shapes(config) -> tuple[list[tuple[int, int]], tuple[int, int, int]]:
    """Per sequence, the shapes a KDA layer keeps: its 3 conv states (q: H*K, k and v: Hkv*K channels, each
    kernel - 1 wide), in the activation dtype, and the fp32 recurrent state (Hkv, K, V), V = K in this
    architecture (Hkv = H unless keys and values are shared by query heads: linear_num_kv_heads)."""
    H, Hkv, K = config.linear_num_heads, config.linear_kv_heads, config.linear_head_dim
    width = config.linear_conv_kernel_size - 1
    return [(H * K, width), (Hkv * K, width), (Hkv * K, width)], (Hkv, K, K)


def kv_shapes(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, dim) of the two tensors a full-attention layer caches: MLA's latent and shared rotary key, or GQA's
    keys and values."""
    if config.attention_type == "mla":
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
    return (config.num_key_value_heads, config.head_dim), (config.num_key_value_heads, config.head_dim)


# bytes per value of the activation dtypes a config names
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8}


def _dtype_name(dtype) -> str:
    """'bfloat16' from torch.bfloat16, 'torch.bfloat16' or 'bfloat16'; 'float32' when unknown."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in _DTYPE_BYTES else "float32"


def cache_bytes(config, dtype=None) -> dict:
    """Inference memory of one sequence, in bytes, with activations (and the KV cache) in `dtype` (default: the
    config's `dtype`, else float32).

    kv_per_token: the full-attention cache, which grows with every token. MLA caches the compressed latent and
    the shared key part, (kv_lora_rank + qk_rope_head_dim) values per token per layer; GQA caches keys and
    values, 2 * num_key_value_heads * head_dim.
    kda_state: the fixed KDA state per sequence, per KDA layer an fp32 recurrent state [Hkv, K, V] plus the q, k, v
    short-conv states, (conv - 1) * (H + 2 Hkv) * K values in `dtype` (Hkv = H unless keys and values are shared).
    """
    name = _dtype_name(dtype if dtype is not None else getattr(config, "dtype", None))
    width = _DTYPE_BYTES[name]
    n_attention = sum(t == "full_attention" for t in config.layer_types)
    n_kda = len(config.layer_types) - n_attention
    kv_values = sum(heads * dim for heads, dim in kv_shapes(config))  # the shapes the cache allocates
    convs, (H, K, V) = kda_state_shapes(config)
    kda_layer = H * K * V * 4 + sum(channels * taps for channels, taps in convs) * width
    return {
        "dtype": name,
        "kv_per_token": n_attention * kv_values * width,
        "kda_state": n_kda * kda_layer,
        "kv_per_token_per_layer": kv_values * width,
        "kda_state_per_layer": kda_layer,
        "attention_layers": n_attention,
        "kda_layers": n_kda,
    }


__all__ = ["KDAHybridCacheLayer", "KDALayerState", "KVLayerState", "cache_bytes", "conv_states_after",
           "kda_state_shapes", "kv_shapes", "shift_conv_state"]
