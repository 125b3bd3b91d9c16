"""`KDAHybridCache`: one cache for both kinds of layer of a KDA hybrid model (docs/architecture.md §8).

- Full-attention layers keep a growing KV cache. For MLA it holds the compressed latent [B, 1, T, kv_lora_rank]
  and the shared key part [B, 1, T, qk_rope_head_dim] (576 values per token for Kimi-Linear-48B), never the
  per-head keys and values (about 18x larger). For GQA it holds keys and values [B, H_kv, T, D].
- KDA layers keep a fixed-size state: the last (conv_kernel - 1) inputs of each of the q, k, v short
  convolutions [B, H*K, kernel - 1] and the fp32 recurrent state [B, H, K, V]. It does not grow with context.

Rollback (`crop`) is exact: while past recording is active (transformers activates it for assisted and
prompt-lookup decoding) every KDA layer logs, per forward, its state before the forward and the forward's
inputs; cropping replays the kept tokens from that state, so the conv and recurrent states are those of a
run that never saw the removed tokens.

Every operation that changes the cache (crop, reorder_cache, batch_select_indices, batch_repeat_interleave,
early_initialization) checks its arguments and every layer first, and changes nothing when it raises.

The cache also keeps a fingerprint of the token ids it consumed (two 31-bit polynomial hashes per row, 16 bytes
per sequence whatever the context length), so that `generate()` can refuse a cache that does not hold the start
of the `input_ids` it is given (`check_generation_inputs`), and `check_compatible` refuses a cache built for
another model or batch, before any tensor meets another of the wrong shape. What the fingerprint cannot see is
not checked: a direct forward (it gets only the new tokens), a cache filled from inputs_embeds, one cropped past
its records, generate(prefill_chunk_size=...) and all-KDA layer patterns (transformers then passes no split
between cached and new tokens).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .cache_layers_kda_hybrid import KDAHybridCacheLayer, KDALayerState, KVLayerState, kv_shapes
from .fingerprint_kda_hybrid import TokenFingerprint


def _as_int(name: str, value) -> int:
    """`value` as a Python int (int, numpy integer, 0-d integer tensor); bools and floats are refused."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None



def _shape_fields(config) -> dict[str, object]:
    """The config values that fix the shapes of what the cache holds (compared by check_compatible)."""
    out = {}
    if "linear_attention" in config.layer_types:
        for name in ("linear_num_heads", "linear_kv_heads", "linear_head_dim", "linear_conv_kernel_size"):
            out[name] = getattr(config, name)
    if "full_attention" in config.layer_types:
        out["attention_type"] = config.attention_type
        names = ("kv_lora_rank", "qk_rope_head_dim") if config.attention_type == "mla" else (
            "num_key_value_heads", "head_dim")
        for name in names:
            out[name] = getattr(config, name)
    return out


class KDAHybridCache(Cache):
    """Cache of a KDA hybrid model: KV for full-attention layers, conv + recurrent states for KDA layers.

    `generate()` builds one by itself; build one explicitly to keep it across calls:

        cache = KDAHybridCache(model.config)
        out = model(input_ids, cache=cache)          # cache now holds the prompt
        out = model(next_ids, cache=out.cache)       # continue

    Every public member of transformers' `Cache` either works or raises NotImplementedError saying why
    (tests/test_cache.py calls each one).
    """

    def __init__(self, config):
        layers = [KVLayerState() if t == "full_attention" else KDALayerState() for t in config.layer_types]
        super().__init__(layers=layers)
        self.config = config
        self.layer_types = list(config.layer_types)
        self._seen_tokens = 0
        self._record_past = False
        self.fingerprint = TokenFingerprint()  # of the consumed token ids: refuses another prompt's cache
        self._staged_ids: torch.Tensor | None = None  # the running forward's input_ids, hashed by advance()

    # ---- checks at the model boundary ------------------------------------------------------------------
    def check_compatible(self, config, batch_size: int | None = None) -> None:
        """Raise ValueError when this cache cannot serve a model with `config` on a batch of `batch_size`
        sequences: another layer pattern, other head counts or dims, or (once it holds tokens) another batch."""
        if config is not self.config:  # (the usual case, the model's own config, has nothing to compare)
            self._check_config(config)
        if batch_size is not None and self._seen_tokens > 0 and self.batch_size not in (-1, batch_size):
            raise ValueError(
                f"the cache holds {self.batch_size} sequences but the input has batch size {batch_size}: continue "
                "it with the same rows (cache.batch_select_indices / batch_repeat_interleave reshape it), or pass "
                "a new KDAHybridCache"
            )

    def _check_config(self, config) -> None:
        types = list(config.layer_types)
        if types != self.layer_types:
            first = next((i for i, (a, b) in enumerate(zip(types, self.layer_types)) if a != b),
                         min(len(types), len(self.layer_types)))
            raise ValueError(
                f"this cache was built for layer_types {self.layer_types} ({len(self.layer_types)} layers), the model "
                f"has {types} ({len(types)} layers; first difference at layer {first}): build a new "
                "KDAHybridCache(model.config)"
            )
        want, have = _shape_fields(config), _shape_fields(self.config)
        diffs = [f"{name}: cache {have[name]!r}, model {want[name]!r}"  # (MLA and GQA fields differ by name)
                 for name in want if name in have and have[name] != want[name]]
        if diffs:
            raise ValueError(f"this cache was built for other head shapes ({'; '.join(diffs)}): build a new "
                             "KDAHybridCache(model.config)")

    def prepare_for_forward(self, config, batch_size: int, input_ids: torch.Tensor | None) -> None:
        """Called by the model at the top of each forward: check_compatible, bring offloaded layers back, and keep
        the input ids so that advance() adds them to the fingerprint (inputs_embeds only: None)."""
        self.check_compatible(config, batch_size)
        if self._seen_tokens == 0:  # an empty cache takes any batch: drop tensors left by reset() for another
            for layer in self.layers:
                if layer.batch_size not in (-1, batch_size):
                    layer.release()
        for layer in self.layers:
            layer.prefetch()
        self._staged_ids = input_ids

    def check_generation_inputs(self, input_ids: torch.Tensor, next_sequence_length: int | None,
                                is_first_iteration: bool) -> None:
        """Called from `prepare_inputs_for_generation`. At the prefill of generate() with a cache that already
        holds L tokens, transformers treats `input_ids` as the whole sequence (next_sequence_length = new tokens)
        and feeds only input_ids[:, L:]: raise ValueError unless input_ids[:, :L] are the tokens this cache
        consumed, so that a second, unrelated prompt cannot silently continue the first."""
        L = self._seen_tokens
        if not is_first_iteration or next_sequence_length is None or L == 0:
            return  # decode steps, assistants, and input_ids that hold only the new tokens
        if input_ids.dim() != 2 or input_ids.shape[1] <= L:
            raise ValueError(
                f"generate() got input_ids of shape {tuple(input_ids.shape)} with a cache holding {L} tokens: pass "
                f"the {L} cached tokens followed by at least one new token ([B, {L} + new]), or a new cache"
            )
        self.check_compatible(self.config, input_ids.shape[0])
        # (nothing to compare with when the cache consumed inputs_embeds or was cropped past its records)
        rows = self.fingerprint.differing_rows(input_ids[:, :L])
        if rows:
            raise ValueError(
                f"input_ids[:, :{L}] are not the {L} tokens this cache holds (rows {rows} differ): to continue a "
                "conversation pass the previous sequences (generate()'s output) followed by the new tokens; for "
                "an unrelated prompt pass a new KDAHybridCache (or call cache.reset())"
            )

    # ---- sizes -----------------------------------------------------------------------------------------
    def _check_layer_idx(self, layer_idx) -> int:
        idx = _as_int("layer_idx", layer_idx)
        if not 0 <= idx < len(self.layers):
            raise ValueError(f"layer_idx must be in [0, {len(self.layers)}), got {idx}")
        return idx

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens consumed (every layer, KDA included, has seen the same ones)."""
        if layer_idx is not None:
            self._check_layer_idx(layer_idx)
        return self._seen_tokens

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + _as_int("query_length", query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        if layer_idx is not None:
            self._check_layer_idx(layer_idx)
        return -1  # no layer has a maximum: KV grows, KDA states have no sequence dimension

    def _recording(self) -> bool:
        """Whether forwards are recorded for crop(): from activate_past_recording() on, until the KDA layers' own
        flags are cleared (transformers' generate() clears each layer's record_past directly when it hands the
        cache back; the cache then stops keeping the token records crop() would need as well)."""
        if not self._record_past:
            return False
        kda = [layer for layer in self.layers if isinstance(layer, KDALayerState)]
        self._record_past = not kda or any(layer.record_past for layer in kda)
        if not self._record_past:
            self.fingerprint.records = []
        return self._record_past

    def advance(self, num_tokens: int):
        """Called by the model once per forward, after every layer has consumed its tokens."""
        ids, self._staged_ids = self._staged_ids, None
        if ids is None or ids.dim() != 2 or ids.shape[1] != num_tokens or ids.is_floating_point():
            self.fingerprint.forget()
        else:
            self.fingerprint.extend(ids, record=self.fingerprint.known and self._recording())
        self._seen_tokens += num_tokens

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is not None:
            self._check_layer_idx(layer_idx)
        return self._seen_tokens > 0

    def __len__(self) -> int:
        return len(self.layers)

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
        """Whether the cache holds tokens."""
        return self._seen_tokens > 0

    @property
    def is_croppable(self) -> bool:
        """Exact rollback needs the KDA layers to have recorded the forwards to undo."""
        return all(layer.is_croppable for layer in self.layers)

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.layers[self._check_layer_idx(layer_idx)].record_past

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            if layer.batch_size > 0:
                return layer.batch_size
        return -1

    # ---- per-layer state access (transformers' Cache API) -----------------------------------------------
    def _kda_layer(self, layer_idx, what: str) -> KDALayerState:
        layer = self.layers[self._check_layer_idx(layer_idx)]
        if not isinstance(layer, KDALayerState):
            raise ValueError(f"{what}: layer {layer_idx} is a full-attention layer; it has no conv or recurrent state")
        return layer

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Conv state `state_idx` (0: q, 1: k, 2: v; [B, H*K, kernel - 1]) of KDA layer `layer_idx`, None if the
        cache holds no tokens."""
        layer = self._kda_layer(layer_idx, "get_conv_state")
        idx = _as_int("state_idx", state_idx)
        if not 0 <= idx < 3:
            raise ValueError(f"state_idx must be 0 (q), 1 (k) or 2 (v) for a KDA layer, got {idx}")
        return layer.conv_states[idx] if self._seen_tokens and layer.is_initialized else None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """Recurrent state [B, H, K, V] fp32 of KDA layer `layer_idx`, None if the cache holds no tokens."""
        layer = self._kda_layer(layer_idx, "get_recurrent_state")
        if _as_int("state_idx", state_idx) != 0:
            raise ValueError(f"state_idx must be 0: a KDA layer has one recurrent state, got {state_idx}")
        return layer.recurrent_state if self._seen_tokens and layer.is_initialized else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        raise NotImplementedError(
            "the model's attention layers append to their KVLayerState (cache.layers[i].update) and the token count "
            "advances once the whole forward ends (advance()); an update of one layer from outside would leave the "
            "layers holding different numbers of tokens"
        )

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        raise NotImplementedError(
            "KDA layers write their conv states themselves, together with the rollback record crop() replays; "
            "a state set from outside would make crop() restore the wrong one"
        )

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        raise NotImplementedError(
            "KDA layers write their recurrent states themselves, together with the rollback record crop() "
            "replays; a state set from outside would make crop() restore the wrong one"
        )

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int):
        raise NotImplementedError("KDA hybrid models have no sparse-attention indexer: the cache keeps no indexer keys")

    def increase_count(self, layer_idx: int, state_idx: int):
        raise NotImplementedError(
            "KDAHybridCache counts tokens itself (advance() after each forward); transformers' increase_count is for "
            "its linear caches, whose conv states models update in place without telling the cache")

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: a KDA layer records each forward whole while recording (activate_past_recording), so it keeps no
        fixed number of per-step recurrent states for transformers to compute."""
        if layer_idx is not None:
            self._check_layer_idx(layer_idx)
        return 0

    # ---- offloading ------------------------------------------------------------------------------------
    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        """Move layer `layer_idx` to the CPU (no layer is sliding, so `only_non_sliding` changes nothing). The next
        forward brings it back by itself; prefetch() does it ahead of time."""
        self.layers[self._check_layer_idx(layer_idx)].offload()

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True):
        """Bring back the first offloaded layer at or after `layer_idx` (circling back to layer 0), if any."""
        start = self._check_layer_idx(layer_idx)
        n = len(self.layers)
        for i in range(n):
            layer = self.layers[(start + i) % n]
            if layer.offloaded_from is not None:
                layer.prefetch()
                return

    # ---- generation utilities --------------------------------------------------------------------------
    def activate_past_recording(self, recurrent_states_to_keep: int | None = None):
        """Keep what crop() needs from the next forward on. `recurrent_states_to_keep` (transformers 5.25+: how
        many steps its linear caches may roll back) is accepted and needs nothing more here: a KDA layer records
        each forward whole, so any crop within the recorded forwards is exact."""
        if recurrent_states_to_keep is not None and not (
                isinstance(recurrent_states_to_keep, int) and not isinstance(recurrent_states_to_keep, bool)
                and recurrent_states_to_keep >= 0):
            raise ValueError(f"recurrent_states_to_keep must be None or an int >= 0, got {recurrent_states_to_keep!r}")
        self._record_past = True
        for layer in self.layers:
            layer.activate_past_recording()

    def early_initialization(self, batch_size: int, num_heads: int | list[int] | None = None,
                             head_dim: int | list[int] | None = None, dtype: torch.dtype | None = None,
                             device: torch.device | str | None = None):
        """Allocate every empty layer for `batch_size` sequences ahead of the first forward (the result equals
        lazy allocation). The shapes come from the config (MLA caches two tensors of different widths, so one
        `num_heads`/`head_dim` cannot describe them); if given, they must match the full-attention layers' keys."""
        batch_size = _as_int("batch_size", batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._seen_tokens and batch_size != self.batch_size:
            raise ValueError(f"the cache holds {self.batch_size} sequences, cannot initialize it for {batch_size}")
        (kh, kd), _ = kv_shapes(self.config)
        n = len(self.layers)
        for name, given, want in (("num_heads", num_heads, kh), ("head_dim", head_dim, kd)):
            if given is None:
                continue
            values = list(given) if isinstance(given, (list, tuple)) else [given] * n
            if len(values) != n:
                raise ValueError(f"{name} as a list must have one entry per layer ({n}), got {len(values)}")
            wrong = [(i, v) for i, (v, t) in enumerate(zip(values, self.layer_types))
                     if t == "full_attention" and v != want]
            if wrong:
                raise ValueError(f"{name} must be {want} for the full-attention layers of this config, got {wrong} "
                                 "(layer, value)")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        for layer in self.layers:
            layer.early_initialization(batch_size, self.config, dtype, torch.device(device or "cpu"))

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self._seen_tokens = 0
        self.fingerprint.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (transformers 5 convention: a count <= 0). Checks every
        layer first: when it raises, nothing has changed."""
        n = _as_int("tokens_to_remove", tokens_to_remove)
        if n > 0:
            raise ValueError(
                f"crop() takes a negative count (minus the tokens to remove, transformers 5 convention) or 0, got {n}"
            )
        if -n > self._seen_tokens:
            raise ValueError(f"cannot remove {-n} tokens from a cache holding {self._seen_tokens}")
        for layer in self.layers:
            layer.check_crop(n)
        for layer in self.layers:
            layer.crop(n)
        self.fingerprint.crop(n, remaining=self._seen_tokens + n)
        self._seen_tokens += n

    def _check_indices(self, name: str, indices, one_per_row: bool) -> torch.Tensor:
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"{name} must be a 1-D integer tensor of row indices, got {type(indices).__name__}")
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise TypeError(f"{name} must hold integer row indices, got dtype {indices.dtype}")
        if indices.dim() != 1 or indices.numel() == 0:
            raise ValueError(f"{name} must be a non-empty 1-D tensor of row indices, got shape {tuple(indices.shape)}")
        B = self.batch_size
        if B < 0:
            return indices
        if one_per_row and indices.numel() != B:
            raise ValueError(f"{name} must hold one index per cached row ({B}), got {indices.numel()}")
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= B:
            raise ValueError(f"{name} must lie in [0, {B}) (the cached rows), got values from {lo} to {hi}")
        return indices

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        for layer in self.layers:
            layer.map_tensors(fn)
        self.fingerprint.map_rows(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Row b becomes old row beam_idx[b] (beam search): one index per cached row."""
        idx = self._check_indices("beam_idx", beam_idx, one_per_row=True)
        self._map_batch(lambda t: t.index_select(0, idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep the rows `indices` (in that order)."""
        idx = self._check_indices("indices", indices, one_per_row=False)
        self._map_batch(lambda t: t.index_select(0, idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        """Repeat every row `repeats` times in place (row b becomes rows b * repeats ... b * repeats + repeats - 1)."""
        r = _as_int("repeats", repeats)
        if r < 1:
            raise ValueError(f"repeats must be >= 1, got {r}")
        self._map_batch(lambda t: t.repeat_interleave(r, dim=0))

    # ---- memory report ---------------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """Bytes held, by layer kind, and how the total grows per token (per sequence in the batch). The rollback
        records kept while past recording is active are not counted."""
        kda = sum(layer.nbytes() for layer in self.layers if isinstance(layer, KDALayerState))
        kv = sum(layer.nbytes() for layer in self.layers if isinstance(layer, KVLayerState))
        per_token = 0
        if self._seen_tokens and self.batch_size > 0:
            per_token = kv // (self._seen_tokens * self.batch_size)
        kv_allocated = sum(layer.allocated_bytes() for layer in self.layers if isinstance(layer, KVLayerState))
        fingerprint = self.fingerprint.nbytes()
        return {
            "tokens": self._seen_tokens,
            "attention_kv_allocated_bytes": kv_allocated,  # includes the growth headroom of the KV buffers
            "kda_state_bytes": kda,
            "attention_kv_bytes": kv,
            "total_bytes": kda + kv,
            "kv_bytes_per_token_per_sequence": per_token,
            "token_fingerprint_bytes": fingerprint,  # 16 per sequence, fixed: not in total_bytes
            "kda_layers": self.layer_types.count("linear_attention"),
            "attention_layers": self.layer_types.count("full_attention"),
        }

    def __repr__(self):
        r = self.memory_report()
        return (f"KDAHybridCache(tokens={r['tokens']}, kda_layers={r['kda_layers']}, "
                f"attention_layers={r['attention_layers']}, bytes={r['total_bytes']})")


__all__ = ["KDAHybridCache", "KDAHybridCacheLayer"]
