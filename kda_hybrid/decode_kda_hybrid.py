"""A decoder layer's one-token step as torch.compile'd graphs: the CPU decode path of
`prepare_cpu_decode(compiled=True)` (docs/architecture.md §10).

A decode step of a small model on the CPU costs its tensor ops more than its arithmetic: a KDA layer with its MLP
ran about 60 small ops besides its 13 matrix-vector products, an MLA layer about 200. Compiled, a KDA layer is one
graph (norms, projections as row reductions that stream the weights, the q/k/v conv, gates, L2 norms, the in-place
recurrent step, the gated norm, the MLP and both residual adds): a handful of fused loops. A full-attention layer
(MLA or GQA) is two graphs around the cache update (norm and projections; attention over the cache, output
projection and MLP), the cache length a dynamic size. The graphs are traced from the same methods the eager step
runs (`KDAHybridDeltaAttention.decode_token`, the attentions' `project` and `attend_cached`, `KDAHybridMLP.forward`),
with `_matvec` in place of `decode_linear`: the same values up to the order of sums.

One compilation serves every layer of a kind in a model (parameters are graph inputs, not constants: the layers
share the traced code) and inductor caches it on disk for the next process. Only what the graphs compute exactly as
the modules would takes them: one token in one row, a cache to continue, no gradient, no autocast, no padding or
attention mask, no attention weights asked for, no rollback record, a dense MLP, and
every module of the layer its plain class (no peft wrapper, hook, quantised or sharded weight): checked at every
call, so a layer wrapped after prepare_cpu_decode takes its eager path again. MLA's latent attention switches its
product order at LATENT_KEYS_FIRST cached tokens: the first step past it compiles once more.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .cache_layers_kda_hybrid import KVLayerState
from .kda_torch import compute_dtype
from .layers_kda_hybrid import (
    KDAHybridAttention,
    KDAHybridDeltaAttention,
    KDAHybridGatedRMSNorm,
    KDAHybridMLAttention,
    KDAHybridMLP,
    KDAHybridRMSNorm,
    plain_weight,
    rows_dot,
)


def _matvec(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for x [1, ..., in] holding one token: a row reduction over the weight, which inductor turns into one
    vectorised pass (no BLAS call)."""
    y = rows_dot(x.reshape(-1), module.weight)
    if module.bias is not None:
        y = y + module.bias
    return y.view(*x.shape[:-1], -1)


def _mlp_tail(layer, x, o):
    """The rest of the decoder layer after its attention output o: residual add, norm, MLP, residual add."""
    x = x + o
    return x + layer.mlp(layer.post_attention_layernorm(x), _matvec)


def _kda_layer_step(layer, x, conv_before, state):
    """KDAHybridDecoderLayer.forward for one token through a KDA layer and a dense MLP: (output [1, 1, D], the new
    conv states, the new recurrent state; updated in place)."""
    o, conv_states, state = layer.self_attn.decode_token(layer.input_layernorm(x), layer.self_attn.conv_taps(),
                                                         conv_before, state, _matvec)
    return _mlp_tail(layer, x, o), conv_states, state


def _attention_head(layer, x, position_embeddings):
    """The first half of a full-attention layer's token: (the normed input, the queries, the two tensors the cache
    appends). No non-finite bookkeeping (_CausalThroughNonFinite) is needed for one token in one row: a NaN or inf
    in x makes the normed input NaN in some channel, so every projection, the cached entries and the output are NaN,
    as that bookkeeping makes them (test_a_nonfinite_token_takes_the_same_values)."""
    h = layer.input_layernorm(x)
    return (h, *layer.self_attn.project(h, position_embeddings, _matvec))


def _attention_tail(layer, x, h, q, keys, values):
    """The second half, over the cache after this token's update (its length a dynamic size: one graph for every
    context length)."""
    return _mlp_tail(layer, x, layer.self_attn.attend_cached(h, q, keys, values, _matvec))


@functools.cache
def compiled_kda_layer_step(strict: bool = False):
    """The compiled _kda_layer_step. compile_step calls it `strict` (fullgraph: a graph break is an error there,
    not a silent slow path); decode calls the lenient one, which shares those compilations and, past dynamo's
    recompile limit (a process that decodes many differently shaped models), runs the same code eagerly instead of
    failing."""
    return torch.compile(_kda_layer_step, fullgraph=strict)


@functools.cache
def compiled_attention_steps(strict: bool = False):
    """The compiled halves of a full-attention layer's token, around the cache update between them (`strict`: as
    in compiled_kda_layer_step)."""
    return torch.compile(_attention_head, fullgraph=strict), torch.compile(_attention_tail, fullgraph=strict)


_CONTAINERS = (KDAHybridDeltaAttention, KDAHybridMLAttention, KDAHybridAttention, KDAHybridMLP)
_LEAVES = (nn.Linear, nn.Conv1d, KDAHybridRMSNorm, KDAHybridGatedRMSNorm)


def _plain_modules(module) -> bool:
    """Every module under `module` is one the compiled steps read directly, as its plain class: no peft wrapper, no
    hook, no quantised or sharded weight. Checked at every call (a direct walk: nn.Module.modules() would cost more
    than the rest of a layer's Python)."""
    for m in module._modules.values():
        if m is None:
            continue
        kind = type(m)
        if kind in _LEAVES:
            if plain_weight(m, kind) is None:
                return False
        elif kind not in _CONTAINERS or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ \
                or "_hf_hook" in m.__dict__ or not _plain_modules(m):
            return False
    return True


def fusable(layer) -> bool:
    """Whether `layer` (a KDAHybridDecoderLayer) is one the compiled steps can compute: a dense MLP, every module
    plain, on the CPU."""
    return not layer.is_moe and layer.input_layernorm.weight.device.type == "cpu" and _plain_modules(layer)


def _attention_decode(layer, x, layer_inputs, state) -> torch.Tensor | None:
    mla = type(layer.self_attn) is KDAHybridMLAttention
    if layer_inputs.mask is not None or layer_inputs.cu_seqlens is not None or layer_inputs.output_attentions \
            or layer_inputs.path != ("latent" if mla else "masked") or state.length == 0 or layer.training:
        return None
    head, tail = compiled_attention_steps()
    h, q, keys, values = head(layer, x, layer_inputs.position_embeddings)
    return tail(layer, x, h, q, *state.update(keys, values))


def compile_step(layer) -> None:
    """Compile `layer`'s steps now, on a dummy token and dummy states (the model's cache is not touched): the
    first generate() then pays nothing (every KDA layer of a model shares one graph, every attention layer two,
    their context length a dynamic size from the start)."""
    w = layer.input_layernorm.weight
    x = w.new_zeros(1, 1, w.shape[0])
    attn = layer.self_attn
    if layer.layer_type == "linear_attention":
        K = attn.head_dim
        conv = [w.new_zeros(1, proj.out_features, attn.conv_size - 1)  # as a prefill leaves them
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
        state = w.new_zeros(1, attn.k_proj.out_features // K, K, K, dtype=compute_dtype(w.dtype))
        for _ in range(2):  # then as a decode step leaves them (views of one tensor)
            _, conv, state = compiled_kda_layer_step(strict=True)(layer, x, conv, state)
        return
    head, tail = compiled_attention_steps(strict=True)
    rope = None if type(attn) is KDAHybridMLAttention else (w.new_ones(1, 1, attn.head_dim),
                                                             w.new_zeros(1, 1, attn.head_dim))
    h, q, keys, values = head(layer, x, rope)
    state = KVLayerState()
    for n in range(4):  # 3 cached tokens in a buffer of 4, then 4 in 4: the two stride patterns a cache shows
        cached = state.update(keys, values)
        if n >= 2:
            for t in cached:  # the length and the buffer's capacity dynamic: one graph for every context length
                torch._dynamo.mark_dynamic(t, 2)
                torch._dynamo.mark_dynamic(t._base, 2)
            tail(layer, x, h, q, *cached)


def layer_decode(layer, hidden_states, layer_inputs, cache) -> torch.Tensor | None:
    """The compiled step of `layer` for this call, the cache updated; None when the call is not one it computes
    exactly (the caller then runs the layer's own forward)."""
    if cache is None or hidden_states.numel() != hidden_states.shape[-1] or torch.is_grad_enabled() \
            or hidden_states.device.type != "cpu" or torch.is_autocast_enabled("cpu") \
            or layer_inputs.cu_seqlens is not None:
        return None
    state = cache.layers[layer.self_attn.layer_idx]
    if not state.is_initialized or state.record_past or not _plain_modules(layer) \
            or hidden_states.dtype != layer.input_layernorm.weight.dtype:
        return None
    if layer.layer_type != "linear_attention":
        return _attention_decode(layer, hidden_states, layer_inputs, state)
    if layer_inputs.token_mask is not None:
        return None
    out, conv_states, recurrent = compiled_kda_layer_step()(layer, hidden_states, state.conv_states,
                                                            state.recurrent_state)
    state.update(conv_states, recurrent)
    return out
