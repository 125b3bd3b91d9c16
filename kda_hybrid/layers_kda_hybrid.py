"""Layers of the KDA hybrid model (docs/architecture.md §2-§4): norms, the KDA layer, NoPE MLA and GQA full attention,
dense SwiGLU and DeepSeek-V3-style MoE. Parameter names follow the original Kimi-Linear checkpoint."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache_layers_kda_hybrid import KDALayerState, KVLayerState, conv_states_after
from .configuration_kda_hybrid import KDAHybridConfig
from .kda_ops import chunk_kda, recurrent_step
from .kda_torch import kda_gate, l2norm
from .mxfp4_ops import mxfp4_linear
from .mxfp4_torch import MXFP4_GROUP, check_mxfp4, dequantize_mxfp4

ABSORB_MAX_QUERY = 16  # MLA: queries up to this long (decode, draft verification) attend in latent space
# MLA latent attention from this many cached tokens on: scores as keys x queries (1.6 vs 2.3 ms per layer at 16K
# cached tokens, 6.8 vs 8.0 ms at 64K, cache not in L3; 1-thread fp32); below, queries x keys (fewer copies)
LATENT_KEYS_FIRST = 4096
MLA_NORM_EPS = 1e-6  # kv_a_layernorm / q_a_layernorm epsilon of the Kimi-Linear MLA (not rms_norm_eps)


class KDAHybridRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 normalisation, weight applied in the input dtype (as the Kimi and Llama norms do); one fused op
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.variance_epsilon).to(x.dtype)


class KDAHybridGatedRMSNorm(nn.Module):
    """RMSNorm over each head's V channels (one weight [V] shared by heads) times sigmoid(gate), in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), eps=self.variance_epsilon)
        return (x32 * torch.sigmoid(gate.float())).to(x.dtype)


@dataclass
class KDALayerInputs:
    """What every KDA layer of one forward receives; KDAHybridModel.forward builds it once per forward."""

    token_mask: torch.Tensor | None = None  # [B, T] bool, False = padding; None: every token is real
    cu_seqlens: torch.Tensor | None = None  # [N + 1] offsets of packed documents over the flattened B * T tokens


ATTENTION_PATHS = ("masked", "latent", "continuation", "packed")


@dataclass
class AttentionLayerInputs:
    """What every full-attention layer of one forward receives; KDAHybridModel.forward builds it once per
    forward. `path` picks the attention computation (the table in KDAHybridMLAttention's docstring); GQA layers
    take "masked" or "packed"."""

    path: str = "masked"
    mask: torch.Tensor | None = None  # [B, 1, T, past + T] bool or additive float (create_causal_mask), or None
    cu_seqlens: torch.Tensor | None = None  # path "packed": document offsets over the flattened B * T tokens
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None  # GQA: RoPE (cos, sin) [B, T, head_dim]
    output_attentions: bool = False  # return the attention weights where the path computes them


def _apply_keeping_fp32(module: nn.Module, apply, names: tuple[str, ...]):
    """Run `apply()` (nn.Module._apply: .to(dtype), .half(), .cuda(), ...) but keep the fp32 tensors `names` of
    `module` fp32, values included: a cast to bf16 and back would round them (exp(A_log) by up to 0.4%, RoPE
    angles at position 4096 by up to 16 rad), so they are restored from the exact tensors, moved to the new
    device only."""
    exact = {n: getattr(module, n).data for n in names if getattr(module, n).dtype == torch.float32}
    apply()
    for name, old in exact.items():
        t = getattr(module, name)
        if t.dtype != torch.float32:
            if isinstance(t, nn.Parameter):
                t.data = old.to(t.device)
            else:
                setattr(module, name, old.to(t.device))
    return module


def plain_weight(module: nn.Module, kind: type) -> torch.Tensor | None:
    """`module.weight` when reading it directly computes what `module(x)` computes, else None.

    The fast paths below (MLA weight absorption, the KDA convs as multiply-adds) read a weight outside the
    module's forward. That is only the module's own function when nothing changes it: the module is exactly
    `kind` (not a peft LoRA layer, a quantised replacement or a parametrized / FSDP subclass), its weight a plain
    Parameter (not a torchao quantised tensor) on a real device (not meta), and no hook runs around its forward
    other than accelerate's device alignment of resident weights (its offload hooks bring the weight in only
    inside the forward: the weight outside is on meta).

    Tensor parallelism: a weight sharded along its output rows (a DTensor placed Shard(0): transformers' colwise
    Linear, the KDA convs' channel shards) gives this process's rows, which is what the module's forward computes
    on a replicated input (the heads this process holds)."""
    if type(module) is not kind:
        return None
    # read from __dict__: a missed getattr on a Module raises inside nn.Module.__getattr__, which costs more than
    # the rest of this check (a decode step makes three); accelerate sets _hf_hook as a plain attribute
    attrs = module.__dict__
    hook = attrs.get("_hf_hook")
    if hook is not None and not _keeps_weights_resident(hook):
        return None
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    weight = module._parameters.get("weight")
    if type(weight) is nn.Parameter:  # a plain Parameter: not a DTensor (nn.Parameter(dtensor) stays a DTensor)
        if weight.device.type == "meta":
            return None
    elif weight is not None and _is_row_sharded(weight):
        return weight.to_local()
    else:  # a torchao quantised tensor, a parametrization (weight is then no entry of _parameters), ...
        return None
    if hook is None and "forward" in attrs:  # forward replaced on the instance: a wrapper we cannot read
        return None
    return weight


def _keeps_weights_resident(hook) -> bool:
    """accelerate hooks that only move inputs and outputs between devices (dispatch without offload)."""
    kind = type(hook).__name__
    if kind == "SequentialHook":
        return all(_keeps_weights_resident(h) for h in hook.hooks)
    return kind == "AlignDevicesHook" and not hook.offload


def _is_row_sharded(weight: torch.Tensor) -> bool:
    """A DTensor placed Shard(0) (none exists unless torch.distributed.tensor was imported)."""
    tensor_module = getattr(torch.distributed, "tensor", None) if torch.distributed.is_available() else None
    dtensor = getattr(tensor_module, "DTensor", None)
    if dtensor is None or not isinstance(weight, dtensor):
        return False
    placements = weight.placements
    return len(placements) == 1 and isinstance(placements[0], tensor_module.Shard) and placements[0].dim == 0


def rows_dot(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [in] . each row of w [out, in] -> [out]: a matrix-vector product written as what it reads, which
    torch.compile turns into one vectorised pass over W's rows (no BLAS call)."""
    return (x * w).sum(-1)


@functools.cache
def compiled_matvec() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The one compiled matrix-vector kernel every opted-in Linear shares (dynamic sizes: one compilation serves
    every shape, a few recompilations at most)."""
    return torch.compile(rows_dot, dynamic=True)


def decode_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x); for one token through a Linear that prepare_cpu_decode(compiled=True) opted in
    (`module._decode_matvec`), the compiled kernel instead: on this machine's CPU it streams the models' weights
    at 16-25 GB/s where BLAS's one-row product reads 9-17 (`python benchmarks/bench_matvec_layout.py --compiled`,
    benchmarks/results/matvec_layout_compiled.md). The same values up to the order of the sum (about 1e-7
    relative, as close to a float64 product as BLAS's). Anything else (more than one token, gradients, autocast, a
    wrapped, hooked or quantised Linear) takes the module's own forward."""
    if not module.__dict__.get("_decode_matvec") or x.numel() != x.shape[-1] or torch.is_grad_enabled():
        return module(x)
    w = plain_weight(module, nn.Linear)
    if w is None or w.dtype != x.dtype or w.device != x.device or torch.is_autocast_enabled(x.device.type):
        return module(x)
    y = compiled_matvec()(x.reshape(-1), w.detach())  # a plain tensor: a Parameter's sizes would be static guards
    if module.bias is not None:
        y = y + module.bias
    return y.view(*x.shape[:-1], -1)


# ------------------------------------------------------------------------------------------------------
# KDA
# ------------------------------------------------------------------------------------------------------


def _compaction(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a [B, T] real-token mask: the permutation that moves each row's real tokens to the front (in order)
    and its inverse. Padding then sits after every real token, where it can change no state."""
    perm = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
    return perm, torch.argsort(perm, dim=1)


def packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Offsets [N + 1] of the documents packed in `position_ids` ([B, T]; a document starts wherever the
    position does not follow the previous one, and at every row start), over the flattened B * T tokens.
    None when no row restarts: each row is then one document whatever its first position (a row starting at 5
    is a continuation, as transformers' find_packed_sequence_indices reads it)."""
    restarts = torch.diff(position_ids, dim=-1) != 1  # [B, T - 1]
    if not bool(restarts.any()):
        return None
    starts = torch.cat((torch.ones_like(restarts[:, :1]), restarts), dim=1)  # every row starts a document
    idx = starts.flatten().nonzero().flatten()
    end = torch.tensor([position_ids.numel()], device=idx.device)
    return torch.cat((idx, end)).to(torch.int64)


def _gather_tokens(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return x.gather(1, perm.view(*perm.shape, *([1] * (x.dim() - 2))).expand_as(x))


def _grouped_chunk_kda(q, k, v, g, beta, state=None, *, output_final_state=False, cu_seqlens=None):
    """The layer's chunked KDA: q [B, T, H, K] over k, g [B, T, Hkv, K], v [B, T, Hkv, V], beta [B, T, Hkv] and the
    state [B, Hkv, K, V] (or None). With shared keys and values (Hkv < H), each key/value head's inputs and state
    are repeated for its H / Hkv query heads (query head h reads key/value head h // (H / Hkv), as repeat_kv), and
    the final state is each group's first copy (the copies are computed alike). g <= 0 by construction (either gate
    form): the op's gate check (a device sync on GPU) is skipped."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v, g, beta = (x.repeat_interleave(groups, 2) for x in (k, v, g, beta))
        state = None if state is None else state.repeat_interleave(groups, 1)
    o, state = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, check_inputs=False)
    if groups > 1 and state is not None:
        state = state[:, ::groups].contiguous()
    return o, state


class KDAHybridDeltaAttention(nn.Module):
    """Kimi Delta Attention layer (docs/architecture.md §2)."""

    # the Linears whose one-token products go through decode_linear (prepare_cpu_decode(compiled=True) reads this)
    DECODE_LINEARS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "g_a_proj", "g_b_proj",
                      "o_proj")

    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = H = config.linear_num_heads
        # keys, values, decay and beta per key/value head: Hkv recurrent states, each read by H / Hkv query heads
        self.num_kv_heads = Hkv = config.linear_kv_heads
        self.head_dim = K = config.linear_head_dim
        self.conv_size = config.linear_conv_kernel_size
        D = config.hidden_size
        bias = config.linear_attention_bias
        self.q_proj = nn.Linear(D, H * K, bias=bias)
        self.k_proj = nn.Linear(D, Hkv * K, bias=bias)
        self.v_proj = nn.Linear(D, Hkv * K, bias=bias)
        self.q_conv1d = nn.Conv1d(H * K, H * K, self.conv_size, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(Hkv * K, Hkv * K, self.conv_size, groups=Hkv * K, bias=False)
        self.v_conv1d = nn.Conv1d(Hkv * K, Hkv * K, self.conv_size, groups=Hkv * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, Hkv, 1, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(Hkv * K, dtype=torch.float32))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, Hkv * K, bias=False)
        self.b_proj = nn.Linear(D, Hkv, bias=False)
        self.gate_lower_bound = config.gate_lower_bound  # K3: g = bound * sigmoid(exp(A_log) (z + dt_bias))
        self.full_rank_gate = config.use_full_rank_gate
        if self.full_rank_gate:  # K3: the output gate from one full-rank projection
            self.g_proj = nn.Linear(D, H * K, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm = KDAHybridGatedRMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def _apply(self, fn, recurse=True):  # A_log and dt_bias stay fp32 through .to(dtype) / .half()
        return _apply_keeping_fp32(self, lambda: super(KDAHybridDeltaAttention, self)._apply(fn, recurse),
                                   ("A_log", "dt_bias"))

    def _conv(self, conv: nn.Conv1d, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU in the token-major layout the projections give. x: [B, T, C], state:
        [B, C, kernel - 1] (the inputs before x) -> [B, T, C].

        One multiply-add per tap over contiguous [T, C] rows: 2.8 ms for T=4096, C=256 where conv1d needs the
        channel-major copy first (4.6 ms in all, 1 thread), as fast at T=256, and 10x faster than a conv call for a
        decode token."""
        T = x.shape[1]
        weight = plain_weight(conv, nn.Conv1d)
        if weight is None:  # wrapped, hooked or quantised conv: its own forward (no padding: T outputs)
            return F.silu(conv(torch.cat((state.to(x.dtype), x.transpose(1, 2)), -1))).transpose(1, 2)
        full = torch.cat((state.transpose(1, 2).to(x.dtype), x), dim=1)  # [B, kernel - 1 + T, C]
        # [kernel, C], tap j reads x[t - (kernel - 1 - j)]; contiguous: a strided [C] factor takes a slow
        # elementwise path (a multiply-add over [256, 256] rows 3x slower, 1 thread)
        taps = weight[:, 0].t().contiguous()
        out = full[:, -T:] * taps[-1]
        for j in range(self.conv_size - 1):
            out.addcmul_(full[:, j : j + T], taps[j])
        return F.silu(out)

    def _packed_conv(self, conv: nn.Conv1d, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU over packed documents: taps never reach into the previous document.
        x: [1, C, N] (N packed tokens). One shifted multiply-add per tap, the shifted copy zeroed on the tokens
        whose tap would fall before their document's start: elementwise passes over contiguous [C, N] rows
        forward and backward (an unfolded [C, N, kernel] window and its backward cost 5x more here, and CPU
        depthwise conv1d's backward more still)."""
        N, width = x.shape[-1], self.conv_size
        pos = torch.arange(N, device=x.device)
        doc = torch.searchsorted(cu_seqlens, pos, right=True) - 1  # document of each token
        weight = plain_weight(conv, nn.Conv1d)
        if weight is None:
            # wrapped, hooked or quantised conv: one call of its own forward over the documents laid out with
            # (kernel - 1) zeros before each, so no window spans two documents; output t ends at input t
            gap = width - 1
            where = pos + gap * (doc + 1)  # each token's column in the gapped layout
            spread = x.new_zeros(*x.shape[:-1], N + gap * (cu_seqlens.numel() - 1))
            spread = spread.index_copy(-1, where, x)
            return F.silu(conv(spread).index_select(-1, where - gap))
        since_start = pos - cu_seqlens[doc]  # tokens before, same doc
        padded = F.pad(x, (width - 1, 0))
        weight = weight[:, 0, :, None]  # [C, kernel, 1]; tap j reads x[t - (kernel - 1 - j)]
        out = x * weight[:, width - 1]
        for j in range(width - 1):
            shift = width - 1 - j
            # selected, not multiplied by a 0/1 mask: nothing of the previous document, whatever its value
            out = out + torch.where(since_start >= shift, padded[..., j:j + N], 0) * weight[:, j]
        return F.silu(out)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        cache_layer: KDALayerState | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, T, D]; token_mask [B, T] bool (False = padding) or None; cu_seqlens: offsets of
        documents packed over the flattened B * T tokens (training on packed sequences; no cache, no padding)."""
        if cu_seqlens is not None:
            return self._forward_packed(hidden_states, cu_seqlens)
        if hidden_states.shape[1] == 1 and token_mask is None and cache_layer is not None \
                and cache_layer.is_initialized and not cache_layer.record_past and not torch.is_grad_enabled() \
                and not (hidden_states.is_meta or torch.is_autocast_enabled(hidden_states.device.type)):
            o = self._decode_step(hidden_states, cache_layer)
            if o is not None:
                return o
        B, T, _ = hidden_states.shape
        K = self.head_dim  # heads: from the tensors (tensor parallelism gives each process a slice of them)
        perm = inv = None
        if token_mask is not None:
            perm, inv = _compaction(token_mask)
            n_real = token_mask.sum(1)
            real = torch.arange(T, device=n_real.device) < n_real[:, None]  # [B, T] after compaction
            # padding may hold anything (NaN, inf): selected away, never multiplied by 0, so that neither the
            # chunked products nor the state (beta * v with beta = 0) can see it
            hidden_states = torch.where(real[..., None], _gather_tokens(hidden_states, perm), 0)
        else:
            n_real = torch.full((B,), T, dtype=torch.long, device=hidden_states.device)
            real = None
        x = hidden_states

        has_state = cache_layer is not None and cache_layer.is_initialized
        width = self.conv_size - 1
        conv_inputs = [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]  # [B, T, C]
        if has_state:
            conv_before = cache_layer.conv_states
            state = cache_layer.recurrent_state
        else:  # C = H * K, or this process's heads under tensor parallelism
            conv_before = [xi.new_zeros(B, xi.shape[-1], width) for xi in conv_inputs]
            state = None

        q, k, v = (
            self._conv(conv, xi, s).reshape(B, T, -1, K)  # [B, T, H, K]
            for conv, xi, s in zip((self.q_conv1d, self.k_conv1d, self.v_conv1d), conv_inputs, conv_before)
        )
        conv_inputs = [xi.transpose(1, 2) for xi in conv_inputs]  # [B, C, T], the cache's channel-major layout
        g, beta = self._gates(x)
        if real is not None:  # padding (compacted to the tail) neither decays nor writes the state
            g = torch.where(real[..., None, None], g, 0)
            beta = torch.where(real[..., None], beta, 0)

        recording = cache_layer is not None and cache_layer.record_past
        if recording:
            state_before = state.clone() if state is not None else q.new_zeros(B, k.shape[2], K, K, dtype=torch.float32)
            cache_layer.record(
                conv_before=[c.clone() for c in conv_before], state_before=state_before,
                conv_inputs=[c.detach() for c in conv_inputs], q=q.detach(), k=k.detach(), v=v.detach(),
                g=g.detach(), beta=beta.detach(),
                mask=token_mask if token_mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device),
            )
        if has_state and T == 1:  # decode: one recurrent step updating the cached state in place
            o, state = recurrent_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state,
                                      use_qk_l2norm_in_kernel=True, inplace=not recording)
            o = o[:, None]
        else:
            o, state = _grouped_chunk_kda(q, k, v, g, beta, state, output_final_state=cache_layer is not None)
        if cache_layer is not None:  # every row ends on a real token unless padded: then up to its last real one
            cache_layer.update(conv_states_after(conv_before, conv_inputs, None if token_mask is None else n_real),
                               state)

        o = self._output(x, o)
        if inv is not None:
            o = torch.where(token_mask[..., None], _gather_tokens(o, inv), 0)
        return o

    def _decode_step(self, x: torch.Tensor, cache_layer: KDALayerState) -> torch.Tensor | None:
        """forward() for one new token per row against the cached states, without padding, rollback record or
        gradient: decode_token on the cache. None when a conv is wrapped or quantised (forward() then calls its
        module)."""
        taps = self.conv_taps()
        if taps is None:
            return None
        o, conv_states, state = self.decode_token(x, taps, cache_layer.conv_states, cache_layer.recurrent_state)
        cache_layer.update(conv_states, state)
        return o

    def conv_taps(self) -> torch.Tensor | None:
        """The q, k, v conv weights as one [3C, kernel] tensor, or None when a conv is wrapped, hooked or quantised
        (its own forward must run)."""
        convs = [plain_weight(conv, nn.Conv1d) for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        return None if any(w is None for w in convs) else torch.cat(convs)[:, 0]

    def decode_token(self, x, taps, conv_before, state, linear=decode_linear):
        """One new token per row: x [B, 1, D], taps [3C, kernel] (conv_taps), conv_before the cached q, k, v conv
        inputs ([B, C, kernel - 1] each), state [B, H, K, V] (updated in place where the recurrence can); every
        projection computed by `linear(module, x)`. Returns (o [B, 1, D], the new conv states, the new state).
        The same computation as forward() in a third of the tensor ops (the q/k/v convs as one multiply-add over
        the concatenated channels, the recurrence as batched in-place products), which is what a decode step costs
        on CPU; also the KDA part of decode_kda_hybrid's compiled layer step."""
        B, _, D = x.shape
        K = self.head_dim
        x2 = x.view(B, D)
        qkv = torch.cat([linear(p, x2) for p in (self.q_proj, self.k_proj, self.v_proj)], -1)  # [B, C]
        # q, k, v channels: H * K, Hkv * K, Hkv * K (this process's heads under tensor parallelism)
        sizes = [c.shape[1] for c in conv_before]
        before = torch.cat(conv_before, 1).to(qkv.dtype)  # [B, C, kernel - 1]
        window = torch.cat((before, qkv.unsqueeze(-1)), -1)  # [B, C, kernel]
        conv_states = list(window[..., 1:].clone().split(sizes, 1))  # the last (kernel - 1) inputs
        qkv = F.silu((window * taps).sum(-1)).view(B, -1, K)  # [B, H + 2 Hkv, K]: q, k, v heads
        g, beta = self._gates(x, linear)  # [B, 1, Hkv, K], [B, 1, Hkv]
        H, Hkv = sizes[0] // K, sizes[2] // K
        qk = l2norm(qkv[:, :H + Hkv])  # q and k in one pass: what use_qk_l2norm_in_kernel does to each
        o, state = recurrent_step(qk[:, :H], qk[:, H:], qkv[:, H + Hkv:], g[:, 0], beta[:, 0], state)
        return self._output(x, o[:, None], linear), conv_states, state  # o [B, H, V] -> [B, 1, D]

    def _gates(self, x, linear=decode_linear):
        B, T, _ = x.shape
        f = linear(self.f_b_proj, linear(self.f_a_proj, x))
        g = kda_gate(f.view(B, T, -1, self.head_dim), self.A_log, self.dt_bias, self.gate_lower_bound)
        return g, torch.sigmoid(linear(self.b_proj, x).float())  # log decay [B, T, H, K], beta [B, T, H]

    def _output(self, x, o, linear=decode_linear):
        B, T, _ = x.shape
        gate = linear(self.g_proj, x) if self.full_rank_gate else linear(self.g_b_proj, linear(self.g_a_proj, x))
        gate = gate.view(B, T, -1, self.head_dim)
        return linear(self.o_proj, self.o_norm(o, gate).reshape(B, T, -1))  # [B, T, H*V] -> [B, T, D]

    def _forward_packed(self, hidden_states, cu_seqlens):
        B, T, D = hidden_states.shape
        K = self.head_dim
        x = hidden_states.reshape(1, B * T, D)  # documents never cross rows, so rows pack end to end
        q, k, v = (
            self._packed_conv(conv, proj(x).transpose(1, 2), cu_seqlens).transpose(1, 2).reshape(1, B * T, -1, K)
            for proj, conv in ((self.q_proj, self.q_conv1d), (self.k_proj, self.k_conv1d), (self.v_proj, self.v_conv1d))
        )
        g, beta = self._gates(x)
        o, _ = _grouped_chunk_kda(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        return self._output(x, o).view(B, T, D)


# ------------------------------------------------------------------------------------------------------
# Full attention: MLA (Kimi Linear, NoPE) and GQA (RoPE)
# ------------------------------------------------------------------------------------------------------


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """query [B, H, Tq, D], key/value [B, H_kv, Tk, D] -> ([B, Tq, H, Dv], weights)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def continuation_attention(query, key, value, scaling):
    """T new queries over Tk = past + T keys without a [T, Tk] mask: every cached key is visible, the new keys
    causally (lower-right alignment). query [B, H, T, D], key/value [B, H, Tk, D] -> [B, T, H, D].

    With a cache, transformers' masks are [B, 1, T, Tk] booleans, and PyTorch's fused CPU attention turns them
    into a float copy: 2.5 GiB per MLA layer for a 4096-token chunk at 128K context. On CPU, the fused kernel
    runs twice instead (cached keys unmasked, new keys causal) and the halves merge by log-sum-exp: 128K-token
    chunked prefill of the 6.5M model peaks at 1.4 GiB instead of 4.2 GiB, and 1.5x faster at 4096 x 128K."""
    T, Tk = query.shape[2], key.shape[2]
    past = Tk - T
    if query.device.type == "cpu":
        sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o_past, lse_past = sdpa(query, key[:, :, :past], value[:, :, :past], 0.0, False, scale=scaling)
        o_new, lse_new = sdpa(query, key[:, :, past:], value[:, :, past:], 0.0, True, scale=scaling)
        lse = torch.logaddexp(lse_past, lse_new)  # [B, H, T]
        out = o_past.float() * (lse_past - lse).exp()[..., None] + o_new.float() * (lse_new - lse).exp()[..., None]
        out = out.to(query.dtype)
    else:  # CUDA: a lower-right causal bias dispatches to the fused kernels without materialising a mask
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(T, Tk), scale=scaling)
    return out.transpose(1, 2)


PACKED_ATTENTION_MAX_DOCS = 256  # more documents per batch: one block-diagonal-masked call beats a loop of tiny ones


def packed_attention(query, key, value, cu_seqlens: torch.Tensor, scaling: float, dropout: float = 0.0):
    """Causal attention inside each packed document, one fused SDPA call per document, no mask: the work is the
    sum of the documents' L^2 instead of the (B * T)^2 of a block-diagonal mask (4-8x less for 512-token rows packed
    four to a batch), and no [B * T, B * T] mask is built. query [B, H, T, D], key/value [B, H_kv, T, D], documents at
    the offsets `cu_seqlens` of the flattened B * T tokens -> [B, T, H, Dv]."""
    B, H, T, _ = query.shape
    groups = H // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    def flat(x):  # [B, H, T, D] -> [1, H, B * T, D]: documents never cross rows, so rows pack end to end
        return x.transpose(0, 1).reshape(1, H, B * T, x.shape[-1])

    q, k, v = flat(query), flat(key), flat(value)
    bounds = cu_seqlens.tolist()
    out = torch.cat([
        F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=dropout, is_causal=True,
                                       scale=scaling)
        for s, e in zip(bounds[:-1], bounds[1:])
    ], dim=2)
    return out.reshape(H, B, T, -1).permute(1, 2, 0, 3)


def _attention_interface(config) -> Callable:
    impl = config._attn_implementation or "eager"
    return eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]



def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor | None:
    """The tokens of x [B, T, D] holding a NaN or inf, [B, T] bool; None when there is none (eager: one pass and
    one host read). Compiled, the mask itself, always: no host read in the graph, and the guarded path costs a few
    [B, T] ops."""
    if x.is_meta:  # shapes only: no values to be non-finite
        return None
    compiling = torch.compiler.is_compiling()
    # eager: one reduction and one host read decide (a sum of finite values that overflows only costs the exact
    # route); the per-token mask is formed only when something is off
    if not compiling and math.isfinite(float((x.detach() if x.requires_grad else x).sum(dtype=torch.float32))):
        return None
    bad = ~torch.isfinite(x).all(-1)
    if compiling:
        return bad
    return bad if bool(bad.any()) else None


def _queries_seeing(bad: torch.Tensor, attention_mask, path: str, cu_seqlens) -> torch.Tensor:
    """[B, T] bool: the new queries that attend to one of the new tokens `bad` [B, T] under this forward's mask
    (None: causal among the new tokens; bool or additive [B | 1, . , T, past + T], transformers' convention), or
    inside their document for "packed"."""
    if path == "packed":
        flat, seen = bad.flatten(), torch.zeros(bad.numel(), dtype=torch.bool, device=bad.device)
        bounds = cu_seqlens.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            seen[s:e] = flat[s:e].cumsum(0) > 0
        return seen.view_as(bad)
    if not isinstance(attention_mask, torch.Tensor):
        return bad.cumsum(1) > 0
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
        attention_mask.dtype).min
    T = bad.shape[1]
    return (visible[..., -T:] & bad[:, None, None, :]).any(-1).any(1)


class _CausalThroughNonFinite:
    """forward of the full-attention layers around their `_attend`: a NaN or inf in one token's hidden state reaches
    no query that does not attend to that token, as in attention computed one query at a time. In one batched
    product it would: the masked score of a NaN key is NaN + mask = NaN, and softmax weight 0 times a NaN value is
    NaN, so every earlier query of the forward went NaN. Such tokens enter as zeros; afterwards the queries that see
    one (the mask decides, the cached past included) are NaN, and the cache holds NaN at their positions, so that
    later queries that see them are NaN as well."""

    def forward(self, hidden_states, attention_mask=None, cache_layer: KVLayerState | None = None,
                cu_seqlens: torch.Tensor | None = None, path: str = "masked", output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, T, D] -> (output [B, T, D], attention weights [B, H, T, past + T] or None); the
        arguments of `_attend`."""
        call = dict(attention_mask=attention_mask, cache_layer=cache_layer, cu_seqlens=cu_seqlens, path=path,
                    output_attentions=output_attentions, **kwargs)
        bad = _nonfinite_rows(hidden_states)
        if bad is None:
            return self._attend(hidden_states, **call)
        out, weights = self._attend(torch.where(bad[..., None], 0, hidden_states), **call)
        if cache_layer is not None:
            cache_layer.mark_nonfinite(bad)
        seen = _queries_seeing(bad, attention_mask, path, cu_seqlens)
        nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
        out = torch.where(seen[..., None], nan, out)
        if weights is not None:
            weights = torch.where(seen[:, None, :, None], nan.to(weights.dtype), weights)
        return out, weights


class KDAHybridMLAttention(_CausalThroughNonFinite, nn.Module):
    """Multi-head latent attention without positional encoding (Kimi Linear, docs/architecture.md §3). The cache holds
    the normalised latent and the shared key part, not per-head keys and values.

    KDAHybridModel.forward picks one path per forward for every MLA layer (AttentionLayerInputs.path, decided
    there and nowhere else). Each path computes the attention of "masked", the reference: transformers' attention
    interface over the expanded keys and values with transformers' causal mask.

    condition (KDAHybridModel._attention_inputs)    path            test proving it equal to "masked"
    ---------------------------------------------   -------------   ---------------------------------------------
    packed documents (position_ids restart in a     "packed"        test_packed_attention_per_document_equals_
    row), sdpa, <= PACKED_ATTENTION_MAX_DOCS docs   (one fused      block_diagonal_mask
                                                    SDPA per doc)
    cache holds tokens, T <= ABSORB_MAX_QUERY, no   "latent"        test_mla_paths_equal_the_masked_reference,
    weights asked under eager (mask None: no        (kv_b_proj      test_prefill_in_chunks_equals_one_prefill
    padding, causal among the new tokens)           folded in q)    [chunk7-latent]
    cache holds tokens, T > ABSORB_MAX_QUERY, sdpa, "continuation"  test_mla_paths_equal_the_masked_reference,
    no padding anywhere, no attention dropout       (two SDPA,      test_prefill_in_chunks_equals_one_prefill
                                                    no mask)        [chunk24-continuation]
    anything else: no cache, padding, 4-D masks,    "masked"        the reference (eager and sdpa agree:
    eager, dropout, more documents                                  test_mla_paths_equal_the_masked_reference)

    "latent" reads kv_b_proj's weight directly, so it runs only on a plain nn.Linear weight; a wrapped kv_b_proj
    (unmerged LoRA, an offload hook, a quantised Linear) takes "continuation" (no mask) or "masked" instead, through
    the module (test_ecosystem.py: decode == full forward under LoRA, offload and quantisation).
    """

    DECODE_LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "g_proj", "o_proj")  # kv_b_proj:
    # its weight is read directly (absorbed into the queries) when plain

    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.is_causal = True
        self.scaling = self.qk_head_dim**-0.5
        D, Hq = config.hidden_size, self.num_heads
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(D, Hq * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = KDAHybridRMSNorm(self.q_lora_rank, eps=MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(self.q_lora_rank, Hq * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias)
        self.kv_a_layernorm = KDAHybridRMSNorm(self.kv_lora_rank, eps=MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, Hq * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.output_gate = config.mla_use_output_gate  # a plain flag: hasattr on a Module costs an exception
        if self.output_gate:  # K3: o_proj(attention * sigmoid(g_proj(x)))
            self.g_proj = nn.Linear(D, Hq * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(Hq * self.v_head_dim, D, bias=config.attention_bias)

    def _out(self, hidden_states, out, linear=decode_linear):
        """The attention output [B, T, H * v] -> [B, T, D]: o_proj, after K3's sigmoid output gate if any."""
        if self.output_gate:
            out = out * torch.sigmoid(linear(self.g_proj, hidden_states))
        return linear(self.o_proj, out)

    def project(self, hidden_states, position_embeddings=None, linear=decode_linear):
        """hidden_states [B, T, D] -> (q [B, H, T, nope + rope], what the cache appends: the normed latent
        [B, 1, T, r] and the shared key part [B, 1, T, rope]); no positions (NoPE). `linear(module, x)` computes
        each projection."""
        B, T, _ = hidden_states.shape
        if self.q_lora_rank is None:
            q = linear(self.q_proj, hidden_states)
        else:
            q = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, hidden_states)))
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, T, Dqk]; H: this process's heads
        latent, k_rot = linear(self.kv_a_proj_with_mqa, hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], -1)
        return q, self.kv_a_layernorm(latent).unsqueeze(1), k_rot.unsqueeze(1)

    def attend_cached(self, hidden_states, q, latent, k_rot, linear=decode_linear):
        """The output [B, T, D] of queries q (project) over every cached token (latent, k_rot: the cache after
        this step's update), no mask: one decode token per row, nothing padded (the "latent" path without a
        mask). Reads kv_b_proj's weight directly: callers make sure it is plain."""
        return self._out(hidden_states, self._absorbed(q, latent, k_rot, None, self.kv_b_proj.weight), linear)

    def _attend(self, hidden_states, attention_mask=None, cache_layer: KVLayerState | None = None,
                cu_seqlens: torch.Tensor | None = None, path: str = "masked", output_attentions: bool = False,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, T, D] -> (output [B, T, D], attention weights [B, H, T, past + T] or None). `path` and
        the inputs it needs come from AttentionLayerInputs (the table above); weights only from the "masked" path
        under eager attention."""
        if path not in ATTENTION_PATHS:
            raise ValueError(f"MLA attention path must be one of {ATTENTION_PATHS}, got {path!r}")
        B, T, _ = hidden_states.shape
        q, latent, k_rot = self.project(hidden_states)  # [B, H, T, Dqk], [B, 1, T, r], [B, 1, T, rope]
        if cache_layer is not None:
            latent, k_rot = cache_layer.update(latent, k_rot)
        Tk = latent.shape[2]
        if path == "latent":
            w = plain_weight(self.kv_b_proj, nn.Linear)
            if w is not None:
                return self._out(hidden_states, self._absorbed(q, latent, k_rot, attention_mask, w)), None
            # a wrapped kv_b_proj (LoRA, offload hook, quantised): expand the latent through the module instead; no
            # mask means no padding and every cached key visible, which continuation attention computes
            path = "continuation" if attention_mask is None else "masked"
        kv = self.kv_b_proj(latent.squeeze(1)).view(B, Tk, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # [B, H, Tk, .]
        k = torch.cat((k_nope, k_rot.expand(-1, q.shape[1], -1, -1)), dim=-1)
        pad = self.qk_head_dim - self.v_head_dim
        if pad > 0 and (path != "masked" or self.config._attn_implementation == "sdpa"):
            # PyTorch's fused (flash) SDPA needs equal q/k and v head dims; otherwise it falls back to the math
            # path that materialises T x T scores: 7.5x slower at T=4096 on CPU. Zero-padding v costs less.
            v = F.pad(v, (0, pad))
        dropout = self.config.attention_dropout if self.training else 0.0
        weights = None
        if path == "packed":  # packed documents, no cache
            out = packed_attention(q, k, v, cu_seqlens, self.scaling, dropout)
        elif path == "continuation":  # a cache and no padding: every cached key visible, the new keys causally
            out = continuation_attention(q, k, v, self.scaling)
        else:
            out, weights = _attention_interface(self.config)(
                self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs,
            )
        out = self._out(hidden_states, out[..., : self.v_head_dim].reshape(B, T, -1))
        return out, weights if output_attentions else None

    def _absorbed(self, q, latent, k_rot, attention_mask, weight):
        """Decode against the cached latent without expanding it: kv_b_proj's key half is folded into the
        query and its value half applied after attention. Per step this costs H * Tk * (r + rope) instead of
        Tk * r * H * (nope + v) for re-expanding every cached token (128x less at 4K context for Kimi-48B).
        q [B, H, T, nope + rope], latent [B, 1, Tk, r], k_rot [B, 1, Tk, rope]; weight: kv_b_proj's plain
        [H * (nope + v), r] weight (H: the heads this process holds)."""
        B, Hq, T, _ = q.shape
        Tk = latent.shape[2]
        w = weight.view(Hq, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_k, w_v = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]  # [H, nope, r], [H, v, r]
        q = q * self.scaling  # on the H * T query rows rather than the H * T * Tk scores
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_lat = torch.matmul(q_nope, w_k)  # [B, H, T, r]
        # heads folded into the query rows: one [H*T, r] x [r, Tk] product per sequence, where broadcasting the
        # single latent over H heads would make matmul copy the whole cache once per head (3x slower at 64K)
        lat, rot = latent[:, 0], k_rot[:, 0]  # [B, Tk, r], [B, Tk, rope]
        q_lat, q_rope = q_lat.reshape(B, Hq * T, -1), q_rope.reshape(B, Hq * T, -1)
        if Tk >= LATENT_KEYS_FIRST:  # [Tk, r] x [r, H*T]: BLAS streams the cold cache faster this way round
            scores = torch.baddbmm(rot @ q_rope.transpose(-1, -2), lat, q_lat.transpose(-1, -2)).transpose(-1, -2)
        else:
            scores = torch.baddbmm(q_rope @ rot.transpose(-1, -2), q_lat, lat.transpose(-1, -2))
        scores = scores.view(B, Hq, T, Tk)  # [B, H, T, Tk]
        if attention_mask is None:
            if T > 1:  # causal among the new tokens, everything cached is visible
                causal = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
                scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        elif attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out_lat = (probs.reshape(B, Hq * T, Tk) @ lat).view(B, Hq, T, -1)  # [B, H, T, r]
        out = torch.matmul(out_lat, w_v.transpose(1, 2))  # [B, H, T, v]
        return out.transpose(1, 2).reshape(B, T, -1)  # [B, T, H * v]


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KDAHybridRotaryEmbedding(nn.Module):
    """RoPE of the GQA layers. Frequencies come from transformers' ROPE_INIT_FUNCTIONS for the config's
    `rope_parameters` (default, linear, llama3, yarn), so a converted Llama 3 or Qwen model rotates exactly as its
    source; `attention_scaling` (yarn's magnitude correction, 1 otherwise) multiplies cos and sin as there.
    `inv_freq` is a non-persistent buffer (no checkpoint carries it): a model that transformers materialises from the
    meta device gets it back from `_init_weights`, which calls `compute_inv_freq` as this constructor does."""

    def __init__(self, config: KDAHybridConfig):
        super().__init__()
        inv_freq, self.attention_scaling = self.compute_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):  # inv_freq stays fp32 (and exact) through .to(dtype) / .half()
        return _apply_keeping_fp32(self, lambda: super(KDAHybridRotaryEmbedding, self)._apply(fn, recurse),
                                   ("inv_freq",))

    @staticmethod
    def compute_inv_freq(config: KDAHybridConfig, device=None) -> tuple[torch.Tensor, float]:
        params = config.rope_parameters or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            arange = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float()
            return 1.0 / (config.rope_theta ** (arange / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
        return inv_freq.float(), float(scaling)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.float().to(x.device)  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


class KDAHybridAttention(_CausalThroughNonFinite, nn.Module):
    """Grouped-query attention with RoPE (the option for small and Llama-derived models): optional q/k/v and o
    biases (Qwen2: q/k/v only), optional per-head RMSNorm of queries and keys before RoPE (Qwen3), a head_dim
    that need not be hidden_size / heads."""

    DECODE_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        D = config.hidden_size
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=config.attention_out_bias)
        if config.attention_qk_norm:
            self.q_norm = KDAHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = KDAHybridRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, hidden_states, position_embeddings, linear=decode_linear):
        """hidden_states [B, T, D] -> (q [B, H, T, D] and what the cache appends: k and v [B, H_kv, T, D]), RoPE
        (cos, sin: position_embeddings) applied to q and k. `linear(module, x)` computes each projection."""
        B, T, _ = hidden_states.shape
        q = linear(self.q_proj, hidden_states).view(B, T, -1, self.head_dim)  # [B, T, H, D]
        k = linear(self.k_proj, hidden_states).view(B, T, -1, self.head_dim)  # [B, T, H_kv, D]
        v = linear(self.v_proj, hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend_cached(self, hidden_states, q, k, v, linear=decode_linear):
        """The output [B, 1, D] of one query per row (project) over every cached key (k, v [B, H_kv, Tk, D]: the
        cache after this step's update), no mask (nothing padded). Each KV head's query heads are the rows of one
        product (head h reads KV head h // groups, as repeat_kv expands them), so the cache is never repeated."""
        B, H, T, D = q.shape
        kv_heads = k.shape[1]
        q = q.reshape(B, kv_heads, H // kv_heads * T, D)  # T = 1: [B, H_kv, groups, D]
        probs = F.softmax(torch.matmul(q, k.transpose(2, 3)) * self.scaling, dim=-1, dtype=torch.float32)
        out = torch.matmul(probs.to(v.dtype), v)  # [B, H_kv, groups, D]
        return linear(self.o_proj, out.reshape(B, T, H * D))

    def _attend(self, hidden_states, attention_mask=None, cache_layer: KVLayerState | None = None,
                position_embeddings=None, cu_seqlens: torch.Tensor | None = None, path: str = "masked",
                output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [B, T, D] -> (output [B, T, D], attention weights [B, H, T, past + T] or None). `path`:
        "masked" (transformers' attention interface with `attention_mask`) or "packed" (one fused SDPA per document
        of `cu_seqlens`, test_packed_attention_per_document_equals_block_diagonal_mask proves them equal)."""
        if path not in ("masked", "packed"):
            raise ValueError(f"GQA attention takes path 'masked' or 'packed', got {path!r}")
        B, T, _ = hidden_states.shape
        q, k, v = self.project(hidden_states, position_embeddings)
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)
        dropout = self.config.attention_dropout if self.training else 0.0
        weights = None
        if path == "packed":  # packed documents, no cache
            out = packed_attention(q, k, v, cu_seqlens, self.scaling, dropout)
        else:
            out, weights = _attention_interface(self.config)(
                self, q, k, v, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs,
            )
        return decode_linear(self.o_proj, out.reshape(B, T, -1)), weights if output_attentions else None


# ------------------------------------------------------------------------------------------------------
# MLP and MoE
# ------------------------------------------------------------------------------------------------------


def glu_activation(config: KDAHybridConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """act(gate, up) of every MLP and expert: SwiGLU silu(g) * u, or K3's SiTU-GLU
    b * tanh(g / b) * sigmoid(g) * c * tanh(u / c) in fp32 (b = activation_situ_beta, default 1; c =
    activation_situ_linear_beta, None: u uncapped)."""
    if config.hidden_act != "situ":
        return _swiglu
    beta = 1.0 if config.activation_situ_beta is None else float(config.activation_situ_beta)
    linear_beta = config.activation_situ_linear_beta
    return _situ_glu(beta, None if linear_beta is None else float(linear_beta))


@functools.cache
def _situ_glu(beta: float, linear_beta: float | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One function per (b, c): every layer of a model shares it (a compiled decode step guards on it)."""

    def situ(gate, up):
        g, u = gate.float(), up.float()
        capped = torch.tanh(u / linear_beta) * linear_beta if linear_beta is not None else u
        return (torch.tanh(g / beta) * beta * torch.sigmoid(g) * capped).to(gate.dtype)

    return situ


def _swiglu(gate, up):
    return F.silu(gate) * up


class KDAHybridMLP(nn.Module):
    DECODE_LINEARS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable = _swiglu):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x, linear=decode_linear):
        """x [..., D] -> [..., D]; `linear(module, x)` computes each projection (decode_kda_hybrid's compiled layer
        step passes its own)."""
        return linear(self.down_proj, self.act(linear(self.gate_proj, x), linear(self.up_proj, x)))


class MXFP4Linear(nn.Module):
    """A bias-free Linear whose weight is stored as MXFP4 (K3's routed experts as released): `weight_packed` [out,
    in / 2] and `weight_scale` [out, in / 32], uint8 buffers, computed from as stored (`mxfp4_linear`: on CUDA a
    fused kernel; on CPU each call expands the weight in the input's dtype, so only the experts a batch uses are
    ever expanded). Not trainable (as stored); differentiable in the input. `backend` ("auto", "torch", "triton"):
    mxfp4_linear's choice, per module (a benchmark sets "torch" to time the expanding path on CUDA)."""

    backend = "auto"

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.full((out_features, in_features // MXFP4_GROUP), 127,
                                                        dtype=torch.uint8))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # refused before anything is copied
        packed, scale = state_dict.get(prefix + "weight_packed"), state_dict.get(prefix + "weight_scale")
        if packed is not None and scale is not None:
            check_mxfp4(packed, scale, prefix.rstrip("."))
            if packed.shape != self.weight_packed.shape:
                raise ValueError(f"{prefix}weight_packed: expected {tuple(self.weight_packed.shape)} for in="
                                 f"{self.in_features}, out={self.out_features}, got {tuple(packed.shape)}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.weight_packed, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp4_linear(x, self.weight_packed, self.weight_scale, self.backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"


class KDAHybridExpert(nn.Module):
    """One routed expert, named as in the Kimi-Linear checkpoint: w1 gate, w3 up, w2 down (MXFP4Linear when the
    experts are stored as MXFP4)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: Callable = _swiglu, mxfp4: bool = False):
        super().__init__()
        linear = MXFP4Linear if mxfp4 else functools.partial(nn.Linear, bias=False)
        self.w1 = linear(hidden_size, intermediate_size)
        self.w2 = linear(intermediate_size, hidden_size)
        self.w3 = linear(hidden_size, intermediate_size)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x), self.w3(x)))


class KDAHybridRouter(nn.Module):
    """Sigmoid top-k router with a score-correction bias (DeepSeek-V3 'noaux_tc', docs/architecture.md §4), in fp32."""

    def __init__(self, config: KDAHybridConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weights_from_biased_scores = config.router_weights_from_biased_scores
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.num_experts, dtype=torch.float32), requires_grad=False
        )

    def _apply(self, fn, recurse=True):
        return _apply_keeping_fp32(self, lambda: super(KDAHybridRouter, self)._apply(fn, recurse),
                                   ("weight", "e_score_correction_bias"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert indices [N, k], routing weights [N, k] fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [N, E]
        biased = scores + self.e_score_correction_bias.float()
        idx = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        # Kimi's Hub code gathers from the biased scores; vLLM and transformers from the unbiased ones
        weights = (biased if self.weights_from_biased_scores else scores).gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return idx, weights * self.routed_scaling_factor


class KDAHybridMoE(nn.Module):
    def __init__(self, config: KDAHybridConfig):
        super().__init__()
        self.num_experts = config.num_experts
        act = glu_activation(config)
        D, latent = config.hidden_size, config.routed_expert_hidden_size
        self.gate = KDAHybridRouter(config)
        if latent is not None:  # K3 latent MoE: the router sees x, the experts a projection of it
            self.routed_expert_down_proj = nn.Linear(D, latent, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KDAHybridRMSNorm(latent, eps=config.rms_norm_eps)
            self.routed_expert_up_proj = nn.Linear(latent, D, bias=False)
        self.latent = latent is not None
        self.experts = nn.ModuleList(
            KDAHybridExpert(latent or D, config.moe_intermediate_size, act, config.expert_quantization == "mxfp4")
            for _ in range(config.num_experts)
        )
        self.shared_experts = (
            KDAHybridMLP(D, config.moe_intermediate_size * config.n_shared_experts, act)
            if config.n_shared_experts else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [N, D]
        idx, weights = self.gate(x)
        if self.latent:  # K3: the experts work in the latent width; their weighted sum is taken in fp32
            z = self.routed_expert_down_proj(x)
            out = self._routed(z, idx, weights, torch.zeros_like(z, dtype=torch.float32)).to(z.dtype)
            if hasattr(self, "routed_expert_norm"):
                out = self.routed_expert_norm(out)
            return self._add_shared(self.routed_expert_up_proj(out).view(shape), hidden_states)
        return self._add_shared(self._routed(x, idx, weights, torch.zeros_like(x)).view(shape), hidden_states)

    def _routed(self, x, idx, weights, out):
        """out += sum over each token's chosen experts e of weight_e * expert_e(x), in out's dtype."""
        if x.is_meta:  # shapes only (torch.device("meta")): which expert a token goes to depends on values
            return out
        flat = idx.flatten()
        order = flat.argsort(stable=True)  # token slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of_slot = order // idx.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            tokens = token_of_slot[start : start + n]
            y = self.experts[e](x[tokens]) * weights.flatten()[slots, None].to(out.dtype)
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        return out

    def _add_shared(self, out, hidden_states):
        return out if self.shared_experts is None else out + self.shared_experts(hidden_states)
