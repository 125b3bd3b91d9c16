"""KDA hybrid causal LM (the Kimi Linear architecture) for transformers: decoder, base model, causal LM.

Layers (layers_kda_hybrid.py, docs/architecture.md §2-§4): KDA delta-rule linear attention in most layers, full
attention (NoPE MLA, or GQA with RoPE) every few layers, dense SwiGLU or DeepSeek-V3-style MoE MLPs. Parameter
names follow the original Kimi-Linear checkpoint so that conversion is renaming only.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import can_return_tuple, logging

from .cache_kda_hybrid import KDAHybridCache
from .checkpoint_kda_hybrid import write_checkpoint_metadata, write_model_card
from .configuration_kda_hybrid import KDAHybridConfig
from .decode_kda_hybrid import compile_step, fusable, layer_decode
from .kda_torch import inverse_softplus
from .layers_kda_hybrid import (
    ABSORB_MAX_QUERY,
    PACKED_ATTENTION_MAX_DOCS,
    AttentionLayerInputs,
    KDAHybridAttention,
    KDAHybridDeltaAttention,
    KDAHybridGatedRMSNorm,
    KDAHybridMLAttention,
    KDAHybridMLP,
    KDAHybridMoE,
    KDAHybridRMSNorm,
    KDAHybridRotaryEmbedding,
    KDAHybridRouter,
    KDALayerInputs,
    compiled_matvec,
    decode_linear,
    glu_activation,
    packed_cu_seqlens,
)

logger = logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------------------
# Decoder
# ------------------------------------------------------------------------------------------------------


class KDAHybridDecoderLayer(GradientCheckpointingLayer):
    """One layer: attention (KDA or full) and an MLP (dense or MoE, fixed at construction), each on the RMS-normed
    residual stream and added back to it."""

    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = KDAHybridDeltaAttention(config, layer_idx)
        elif config.attention_type == "mla":
            self.self_attn = KDAHybridMLAttention(config, layer_idx)
        else:
            self.self_attn = KDAHybridAttention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:  # the checkpoint's names: block_sparse_moe (MoE) or mlp (dense)
            self.block_sparse_moe = KDAHybridMoE(config)
        else:
            self.mlp = KDAHybridMLP(config.hidden_size, config.intermediate_size, glu_activation(config))
        self.input_layernorm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def feed_forward(self) -> nn.Module:
        """This layer's MLP: the MoE block or the dense MLP (looked up, so a replaced submodule is the one used)."""
        return self._modules["block_sparse_moe" if self.is_moe else "mlp"]

    def forward(self, hidden_states, layer_inputs: KDALayerInputs | AttentionLayerInputs = None, cache=None,
                **kwargs):
        """hidden_states [B, T, D] -> (hidden_states [B, T, D], attention weights or None). `layer_inputs`: this
        layer kind's inputs, built once per forward by KDAHybridModel.forward."""
        if self.__dict__.get("_compiled_decode"):  # prepare_cpu_decode(compiled=True) opted this layer in
            out = layer_decode(self, hidden_states, layer_inputs, cache)
            if out is not None:
                return out, None
        residual = hidden_states
        hidden_states, weights = self._attention(self.input_layernorm(hidden_states), layer_inputs, cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.feed_forward(hidden_states), weights

    def _attention(self, hidden_states, layer_inputs, cache):
        """This layer's attention (KDA or full) of its normed input -> (output, attention weights or None)."""
        cache_layer = cache.layers[self.self_attn.layer_idx] if cache is not None else None
        weights = None
        if self.layer_type == "linear_attention":
            hidden_states = self.self_attn(hidden_states, token_mask=layer_inputs.token_mask, cache_layer=cache_layer,
                                           cu_seqlens=layer_inputs.cu_seqlens)
        else:
            hidden_states, weights = self.self_attn(
                hidden_states, attention_mask=layer_inputs.mask, cache_layer=cache_layer,
                position_embeddings=layer_inputs.position_embeddings, cu_seqlens=layer_inputs.cu_seqlens,
                path=layer_inputs.path, output_attentions=layer_inputs.output_attentions,
            )
        return hidden_states, weights


class KDAHybridBlockResidualDecoderLayer(KDAHybridDecoderLayer):
    """A layer under K3's Block Attention Residuals: attention and MLP each read their input from the blocks (a
    learnt softmax over the closed blocks and the open block's partial sum, `attn_res_read`) instead of the
    running sum, and add their outputs to the open block."""

    def __init__(self, config: KDAHybridConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attention_res_norm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attention_res_proj = AttnResQuery(config.hidden_size)
        self.mlp_res_norm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp_res_proj = AttnResQuery(config.hidden_size)

    def forward(self, hidden_states, blocks=None, layer_inputs: KDALayerInputs | AttentionLayerInputs = None,
                cache=None, **kwargs):
        """`blocks` [n, B, T, D] are the closed blocks (the embeddings first) and hidden_states the current block's
        partial sum (None when this layer opens the block); returns the partial sum with this layer's attention and
        MLP outputs added, and the attention weights or None."""
        partial = hidden_states
        x = attn_res_read(self.self_attention_res_norm, self.self_attention_res_proj, blocks, partial)
        a, weights = self._attention(self.input_layernorm(x), layer_inputs, cache)
        partial = a if partial is None else partial + a
        x = attn_res_read(self.mlp_res_norm, self.mlp_res_proj, blocks, partial)
        return partial + self.feed_forward(self.post_attention_layernorm(x)), weights


class AttnResQuery(nn.Linear):
    """The query q [1, D] of one Block Attention Residuals read. `_init_weights` starts it at zero, so every read
    begins as the mean of its sources (construction draws what an nn.Linear draws: seeded models stay the same)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=False)


def attn_res_read(norm: KDAHybridRMSNorm, proj: nn.Linear, blocks: torch.Tensor, partial: torch.Tensor | None):
    """Block Attention Residuals read (K3): per token, a softmax over the sources V_i (the closed blocks, then the
    partial block when it is not empty) of q . (n * V_i / rms(V_i)), mixing the raw sources; in fp32.
    blocks [n, B, T, D], partial [B, T, D] or None -> [B, T, D]."""
    sources = blocks if partial is None else torch.cat((blocks, partial[None]))
    logits = proj(norm(sources)).float()  # [S, B, T, 1]
    weights = torch.softmax(logits, dim=0)
    return (weights * sources.float()).sum(0).to(sources.dtype)


class _SumStream:
    """The residual stream as one running sum, what each layer is called with and adds to."""

    def __init__(self, embeds: torch.Tensor):
        self.hidden = embeds

    def open_layer(self, i: int) -> None:
        """Before layer i."""

    def layer_args(self) -> tuple:
        return (self.hidden,)

    def summed(self) -> torch.Tensor:
        """The residual stream's value (output_hidden_states)."""
        return self.hidden

    def output(self, model) -> torch.Tensor:
        return self.hidden


class _BlockStream(_SumStream):
    """Block Attention Residuals (K3): the closed blocks [n, B, T, D] (the embeddings are block 0) and the open
    block's partial sum `hidden` (None right after a block closes); every `block_size` layers a block closes."""

    def __init__(self, embeds: torch.Tensor, block_size: int):
        super().__init__(None)
        self.blocks, self.block_size = embeds[None], block_size

    def open_layer(self, i: int) -> None:
        if i > 0 and i % self.block_size == 0:  # a block closes: the next layer opens one
            self.blocks, self.hidden = torch.cat((self.blocks, self.hidden[None])), None

    def layer_args(self) -> tuple:  # positional, so that reentrant gradient checkpointing propagates through blocks
        return (self.hidden, self.blocks)

    def summed(self) -> torch.Tensor:  # every output summed so far: the residual stream's equivalent
        return self.blocks.sum(0) + self.hidden

    def output(self, model) -> torch.Tensor:  # the final read over every block, before the norm
        return attn_res_read(model.output_attn_res_norm, model.output_attn_res_proj, self.blocks, self.hidden)


# Weights below this take the column-major layout even with prepare_cpu_decode(compiled=True): a compiled call costs
# about 20 us before it reads anything, more than BLAS loses on a small matrix (bench_matvec_layout.py --compiled)
COMPILED_MATVEC_MIN_BYTES = 2**20


def _column_major(w: torch.Tensor) -> bool:
    """Whether a [out, in] weight (out > 1) is laid out column-major, as prepare_cpu_decode() leaves it."""
    return w.dim() == 2 and w.shape[0] > 1 and w.stride() == (1, w.shape[0])


def _lay_column_major(w: nn.Parameter) -> None:
    """The same values, column-major (the storage of W.T, contiguous), in place of the parameter's data."""
    w.data = w.data.t().contiguous().t()


def _plain_cpu_linear(module: nn.Module) -> bool:
    """An `nn.Linear` whose weight is a plain floating-point CPU matrix (not quantised, wrapped, meta or elsewhere)."""
    w = getattr(module, "weight", None) if isinstance(module, nn.Linear) else None
    return type(w) is nn.Parameter and type(w.data) is torch.Tensor and w.device.type == "cpu" \
        and w.layout == torch.strided and w.is_floating_point() and w.dim() == 2


def lay_out_for_cpu_decode(linears) -> int:
    """prepare_cpu_decode()'s layout for any `nn.Linear`s (a transformers model's too, so that a benchmark can give
    its baseline the same help): each plain floating-point CPU weight whose output is at least as wide as its input,
    column-major, once (a tied weight is one tensor); quantised, wrapped or non-CPU weights are left alone. Returns
    how many weights it laid out; values and modules stay the same."""
    done = 0
    with torch.no_grad():
        for module in linears:
            if _plain_cpu_linear(module) and module.out_features >= module.in_features \
                    and not _column_major(module.weight):
                _lay_column_major(module.weight)
                done += 1
    return done


def _row_major(w: nn.Parameter) -> None:
    """Undo _lay_column_major (an earlier prepare_cpu_decode call): the usual layout, which compiled kernels read."""
    if _column_major(w):
        w.data = w.data.contiguous()


class KDAHybridPreTrainedModel(PreTrainedModel):
    config_class = KDAHybridConfig
    config: KDAHybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDAHybridDecoderLayer", "KDAHybridBlockResidualDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True
    _is_stateful = False  # crop() rolls KDA states back exactly, so assisted decoding is allowed
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "e_score_correction_bias", "gate.weight"]

    def save_pretrained(self, save_directory, is_main_process=True, **kwargs):
        # auto_map for every Auto class, the code files and the model card, as the converter writes them; first, so
        # that the config.json transformers writes carries the whole auto_map (a card the user wrote is kept)
        if is_main_process:
            write_checkpoint_metadata(self.config, save_directory, save_config=False, code=self.is_remote_code())
        # weights laid out by prepare_cpu_decode(): transformers' shared-tensor check views each tensor flat, which
        # a transposed tied weight refuses; saved in the usual layout, then laid out again
        relaid = [w for w in self.parameters() if _column_major(w)]
        with torch.no_grad():
            for w in relaid:
                w.data = w.data.contiguous()
            try:
                super().save_pretrained(save_directory, is_main_process=is_main_process, **kwargs)
            finally:
                for w in relaid:
                    _lay_column_major(w)

    def prepare_cpu_decode(self, compiled: bool = False) -> int:
        """Make one-token decode on the CPU read the weights faster; values unchanged up to the order of sums, and
        nothing else needs to know: modules, parameters, state_dict keys and tied weights stay the same objects,
        `save_pretrained` writes the same files, prefill (matrix-matrix) is not slower. Call it after
        `from_pretrained` (and after a `.to(...)`); loading gives the usual model again. Quantised or wrapped
        weights (tensor subclasses, meta, other devices) are left as they are. Returns how many weights it changed.

        compiled=False: every plain `nn.Linear` weight on the CPU whose output is at least as wide as its input is
        laid out column-major (the same [out, in] tensor, transposed strides): a one-token product then streams the
        weight as `x @ W.T` over contiguous rows of W.T, which CPU BLAS reads about 2x faster than the short rows of
        W (`python benchmarks/bench_matvec_layout.py`: 11.9 vs 22.8 GB/s for a 49152 x 576 head); narrowing
        matrices (an MLP's down projection) read faster as they are and stay.

        compiled=True: every decoder layer with a dense MLP whose modules are all plain (KDA, MLA or GQA attention;
        not K3's Block Attention Residuals layers)
        decodes one token through torch.compile'd graphs (decode_kda_hybrid: a KDA layer is one graph, an attention
        layer two around its cache update), its weights in the usual layout, read by the graphs' row reductions at
        16-25 GB/s here; a call they do not compute exactly (a batch, a mask, gradients, a hook or wrapper added
        later, ...) takes the layer's eager step. Of the other Linears, every plain CPU one of at least
        COMPILED_MATVEC_MIN_BYTES that a layer routes through `decode_linear` (its class's DECODE_LINEARS: MoE
        layers' projections and shared experts, the LM head; not routed experts) computes one token through one
        compiled row reduction (`layers_kda_hybrid.decode_linear`; `python benchmarks/bench_matvec_layout.py
        --compiled`); smaller ones get the layout above. Decode on the 179M SmolLM2 shape: 75.9 ms eager, 31.5
        compiled at 256 tokens (llama.cpp 29.6), 79.0 / 39.8 at 4K (1 thread;
        benchmarks/results/cpu_engines_compiled_steps.md). Everything is compiled here, once per process (inductor
        caches it on disk for the next; 4-15 s on the benchmark's models), so that the first generate() pays
        nothing; it needs what torch.compile needs on the CPU (a C++ compiler). If compiling fails,
        a warning says why and the eager steps and the layout above apply."""
        linears = [module for module in self.modules() if _plain_cpu_linear(module)]
        routed = {id(getattr(m, name)) for m in self.modules() for name in getattr(type(m), "DECODE_LINEARS", ())
                  if isinstance(getattr(m, name, None), nn.Linear)}  # the ones whose forwards call decode_linear
        done = 0
        with torch.no_grad():
            if compiled:  # the linears of layers that decode through one compiled step: read there, usual layout
                stepped = {id(m) for layer in self._compile_layer_steps() for m in layer.modules()
                           if isinstance(m, nn.Linear)}
                done += sum(id(m) in stepped for m in linears)
                linears = [m for m in linears if id(m) not in stepped]
            fast = [m for m in linears if id(m) in routed and m.weight.numel() * m.weight.element_size()
                    >= COMPILED_MATVEC_MIN_BYTES]
            if compiled and fast:
                try:
                    for shape, dtype in {(tuple(m.weight.shape), m.weight.dtype) for m in fast}:  # compile now
                        compiled_matvec()(torch.zeros(shape[1], dtype=dtype), torch.zeros(shape, dtype=dtype))
                except Exception as err:  # no C++ compiler, an unsupported platform, ...
                    warnings.warn(f"prepare_cpu_decode(compiled=True): torch.compile failed ({type(err).__name__}: "
                                  f"{err}); laying the weights out column-major instead", stacklevel=2)
                    fast = []
                for module in fast:
                    _row_major(module.weight)  # laid out by an earlier call: the kernel reads rows
                    module._decode_matvec = True
                    done += 1
                linears = [m for m in linears if m not in fast]
            done += lay_out_for_cpu_decode(linears)
        return done

    def _compile_layer_steps(self) -> list[nn.Module]:
        """prepare_cpu_decode(compiled=True)'s second part: every decoder layer with a dense MLP, all of its
        modules plain and on the CPU, decodes through decode_kda_hybrid's compiled steps, compiled here on a dummy
        token and state (the model's cache is not touched), once per kind and shape of layer (layers alike share
        the graphs). If compiling fails, a warning says why and the layers keep their eager step. Returns the
        layers opted in."""
        layers = [m for m in self.modules() if type(m) is KDAHybridDecoderLayer and fusable(m)]
        for layer in layers:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    _row_major(m.weight)
        kinds = {(type(layer.self_attn), tuple((n, p.shape, p.dtype) for n, p in layer.named_parameters())): layer
                 for layer in layers}
        try:
            for layer in kinds.values():
                compile_step(layer)
        except Exception as err:  # no C++ compiler, an unsupported platform, a graph break, ...
            warnings.warn(f"prepare_cpu_decode(compiled=True): compiling the layer steps failed "
                          f"({type(err).__name__}: {err}); those layers keep their eager step", stacklevel=3)
            return []
        for layer in layers:
            layer._compiled_decode = True
        return layers

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' resize, refused before any change when the new vocabulary would leave out one of the
        config's special token ids: KDAHybridConfig refuses a token id outside the vocabulary (transformers' own
        configs only warn), so the resized model would save a checkpoint that no longer loads."""
        size = new_num_tokens
        if size is None:
            size = self.get_input_embeddings().weight.shape[0]
        if isinstance(pad_to_multiple_of, int) and not isinstance(pad_to_multiple_of, bool) and pad_to_multiple_of > 0:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        if isinstance(size, int):
            outside = []
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                value = getattr(self.config, name, None)
                tokens = value if isinstance(value, (list, tuple)) else [value]
                if any(isinstance(t, int) and t >= size for t in tokens):
                    outside.append(f"{name}={value}")
            if outside:
                raise ValueError(
                    f"resize_token_embeddings to {size} tokens would leave {', '.join(outside)} outside the "
                    "vocabulary, and a config with a special token outside it does not load: set it to None or to an "
                    f"id below {size} first (model.config.<name> = ...), or keep a larger vocabulary")
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def _upload_modified_files(self, working_dir, repo_id, *args, **kwargs):
        write_model_card(self.config, working_dir, model_id=repo_id)  # replaces push_to_hub's placeholder card
        return super()._upload_modified_files(working_dir, repo_id, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, AttnResQuery):
            module.weight.zero_()  # AttnRes queries start at zero: every read begins as the mean of its sources
        elif isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            # depthwise short conv: default PyTorch init (uniform in +-1/sqrt(kernel)), as fla does
            bound = 1.0 / math.sqrt(module.weight.shape[-1])
            module.weight.uniform_(-bound, bound)
        elif isinstance(module, (KDAHybridRMSNorm, KDAHybridGatedRMSNorm)):
            module.weight.fill_(1.0)
        elif isinstance(module, KDAHybridRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, KDAHybridDeltaAttention):
            # decay rates exp(A_log) in [1, 16] and dt in [1e-3, 1e-1] (Mamba2 / fla initialisation)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            module.dt_bias.copy_(inverse_softplus(dt))
        elif isinstance(module, KDAHybridRotaryEmbedding):
            # a non-persistent buffer: from_pretrained (and every meta-device path) allocates it empty and only
            # this call fills it; without it RoPE reads uninitialised memory
            module.inv_freq.copy_(module.compute_inv_freq(self.config)[0])


class KDAHybridModel(KDAHybridPreTrainedModel):
    """The decoder stack: embeddings, KDA and full-attention decoder layers, final norm.

    Outputs follow transformers' conventions, from the call's keyword or else the config (`output_hidden_states`,
    `output_attentions`, `return_dict`):
    - `hidden_states`: num_hidden_layers + 1 tensors [B, T, D]: the embeddings, the output of every layer, the last
      one after the final norm (it is `last_hidden_state`). They are the tensors of the graph: `retain_grad()`
      works on them.
    - `attentions`: one entry per layer: the attention weights [B, H, T, past + T] of every full-attention layer
      under `attn_implementation="eager"`, None for the KDA layers (they have no attention matrix). Under sdpa
      (and the other fused kernels) no weights exist: every entry is None and a warning says so, as transformers'
      built-in models warn.
    - `return_dict=False`: `output.to_tuple()` (the same values in the same order, None fields left out).

    Masks: `attention_mask` is [B, past + T] (1 = real token, 0 = padding; the same convention as `generate()`;
    [B, T] is the same thing while the cache is empty) or 4-D [B | 1, 1 | H, T, past + T] (bool, True = attend,
    or additive float, 0 = attend). KDA layers read a 4-D mask's padding from its diagonal (a token is real if it
    may attend to itself) and refuse one that is not causal over the real tokens (e.g. block-diagonal packing:
    pass `position_ids` instead). None means no padding, cached tokens included. Padding reaches no real token
    and no cached state, whatever its values (NaN and inf included).

    `position_ids` [B | 1, T] that restart inside a row (DataCollatorWithFlattening) are packed documents, taken
    only without an attention_mask and without a cache; rows that merely start past 0 are one document each.
    """

    def __init__(self, config: KDAHybridConfig):
        config.validate()  # a field changed since the config was built is refused here, not ignored or failed later
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        block_residuals = config.attn_res_block_size is not None
        layer = KDAHybridBlockResidualDecoderLayer if block_residuals else KDAHybridDecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        if block_residuals:  # the final read over every block, before the norm
            self.output_attn_res_norm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = AttnResQuery(config.hidden_size)
        self.norm = KDAHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = KDAHybridRotaryEmbedding(config) if config.attention_type == "gqa" else None
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDAHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        past_key_values: KDAHybridCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if past_key_values is not None:
            warnings.warn("`past_key_values` is deprecated; pass `cache=`", FutureWarning, stacklevel=2)
            if cache is None:
                cache = past_key_values
        B, T = _check_tokens(input_ids, inputs_embeds, self.config.hidden_size)
        if cache is not None and not isinstance(cache, KDAHybridCache):
            raise TypeError(_foreign_cache_message(cache))
        asked_for_cache = bool(use_cache) or cache is not None
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if asked_for_cache:  # as transformers' built-in models do; the checkpointed layers could not fill it
                logger.warning_once("use_cache=True is incompatible with gradient checkpointing: no cache is used")
            use_cache, cache, asked_for_cache = False, None, False
        past = cache.get_seq_length() if cache is not None else 0
        _check_attention_mask(attention_mask, B, T, past, self.config.num_attention_heads)
        position_ids = _check_position_ids(position_ids, B, T)
        output_hidden_states = _config_default(output_hidden_states, self.config, "output_hidden_states")
        output_attentions = _config_default(output_attentions, self.config, "output_attentions")
        # Packed documents: position_ids restarting inside a row, no attention_mask (DataCollatorWithFlattening).
        # KDA states and convs restart at every document and attention stays inside it. A packed batch has no
        # single state to continue from or to continue later, so it takes no cache: asking for one is an error.
        cu_seqlens = None
        if position_ids is not None and attention_mask is None:
            cu_seqlens = packed_cu_seqlens(position_ids.expand(B, T))
            if cu_seqlens is not None:
                if asked_for_cache:
                    raise ValueError(
                        "position_ids restart inside a row (packed documents) and a cache was asked for (use_cache="
                        "True or cache=): a packed batch has no single state to cache. Pass use_cache=False, or one "
                        "document per row (with an attention_mask for padding)")
                use_cache = False
        if use_cache and cache is None:
            cache = KDAHybridCache(self.config)
        if cache is not None:  # compatible with this model and batch (else a clear error), offloaded layers back
            cache.prepare_for_forward(self.config, B, input_ids)

        inputs_embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device).unsqueeze(0)
        token_mask, padded = _padding(attention_mask, B, T, past)
        layer_inputs = {
            "linear_attention": KDALayerInputs(token_mask=token_mask, cu_seqlens=cu_seqlens),
            "full_attention": self._attention_inputs(inputs_embeds, attention_mask, cache, position_ids, past,
                                                     cu_seqlens, padded, output_attentions),
        }

        all_hidden = (inputs_embeds,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        if self.config.attn_res_block_size is None:
            stream = _SumStream(inputs_embeds)
        else:
            if token_mask is not None:
                inputs_embeds = torch.where(token_mask[..., None], inputs_embeds, 0)
            stream = _BlockStream(inputs_embeds, self.config.attn_res_block_size)
        # the layer kind from the config, not from the layer: pipeline parallelism swaps the layers another stage runs
        # for identity layers, which return the hidden states alone
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types)):
            stream.open_layer(i)
            if token_mask is not None and stream.hidden is not None:
                # padding enters no layer with its values (NaN, inf): selected, not multiplied
                stream.hidden = torch.where(token_mask[..., None], stream.hidden, 0)
            out = layer(*stream.layer_args(), layer_inputs=layer_inputs[kind], cache=cache)
            stream.hidden, weights = out if isinstance(out, tuple) else (out, None)
            if output_hidden_states:
                all_hidden += (stream.summed(),)
            if output_attentions and kind == "full_attention":  # one entry per attention layer, as transformers'
                all_attentions += (weights,)                       # hybrids (kimi_linear, qwen3_next) record them
        hidden_states = stream.output(self)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:  # the last entry is the normed output, as in transformers' models
            all_hidden = all_hidden[:-1] + (hidden_states,)
        if cache is not None:
            cache.advance(T)
        # a cache given with use_cache=False was still filled: returned, as transformers' built-in models return it
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache,
                                       hidden_states=all_hidden, attentions=all_attentions)

    def _attention_inputs(self, inputs_embeds, attention_mask, cache, position_ids, past, cu_seqlens, padded,
                          output_attentions) -> AttentionLayerInputs | None:
        """The inputs of every full-attention layer of this forward, path included (the table in
        KDAHybridMLAttention's docstring)."""
        cfg = self.config
        if not cfg.full_attention_layers:
            return None
        impl = cfg._attn_implementation
        T = inputs_embeds.shape[1]
        if output_attentions and impl != "eager":
            logger.warning_once(f"attn_implementation={impl!r} computes no attention weights: `attentions` holds None "
                                "for every layer; load the model with attn_implementation='eager' to get them")
        rope = self.rotary_emb(inputs_embeds, position_ids) if self.rotary_emb is not None else None
        inputs = dict(position_embeddings=rope, output_attentions=output_attentions)
        if cu_seqlens is not None and impl == "sdpa" and len(cu_seqlens) - 1 <= PACKED_ATTENTION_MAX_DOCS:
            return AttentionLayerInputs(path="packed", cu_seqlens=cu_seqlens, **inputs)
        mla = cfg.attention_type == "mla"
        dropout = self.training and cfg.attention_dropout > 0
        # MLA over a cache with no padding anywhere under sdpa needs no [T, past + T] mask (at 128K context one
        # costs GiBs): latent decode and continuation attention are causal by construction
        unmasked = mla and past > 0 and impl == "sdpa" and not padded and not dropout
        mask = None if unmasked else create_causal_mask(
            config=cfg, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids,
        )
        if mla and past > 0 and T <= ABSORB_MAX_QUERY and not (output_attentions and impl == "eager"):
            path = "latent"
        elif unmasked:
            path = "continuation"
        else:
            path = "masked"
        return AttentionLayerInputs(path=path, mask=mask, **inputs)


def _foreign_cache_message(cache) -> str:
    return (f"cache must be a KDAHybridCache, got {type(cache).__name__}: transformers' caches hold no KDA conv or "
            "recurrent states. Build one with KDAHybridCache(model.config), or leave cache unset (generate() and "
            "use_cache=True build it)")


def _config_default(value, config, name):
    return getattr(config, name, False) if value is None else value


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_tokens(input_ids, inputs_embeds, hidden_size) -> tuple[int, int]:
    """Validate input_ids [B, T] (integer) or inputs_embeds [B, T, hidden_size] (float); returns (B, T)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
                or input_ids.dtype == torch.bool:
            got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"input_ids must be an integer tensor [B, T] of token ids, got {got}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {_shape(input_ids)}")
        B, T = input_ids.shape
        name, shape = "input_ids", _shape(input_ids)
    else:
        if not isinstance(inputs_embeds, torch.Tensor) or not inputs_embeds.is_floating_point():
            got = inputs_embeds.dtype if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
            raise TypeError(f"inputs_embeds must be a floating-point tensor [B, T, hidden_size], got {got}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
            raise ValueError(f"inputs_embeds must be [B, T, hidden_size={hidden_size}], got shape "
                             f"{_shape(inputs_embeds)}")
        B, T, _ = inputs_embeds.shape
        name, shape = "inputs_embeds", _shape(inputs_embeds)
    if B == 0 or T == 0:
        raise ValueError(f"{name} must hold at least one sequence of at least one token, got shape {shape}")
    return B, T


def _check_attention_mask(mask, B, T, past, num_heads):
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() == 2:
        if mask.is_complex():
            raise TypeError(f"attention_mask must be bool, integer or float (1 = real token), got {mask.dtype}")
        if tuple(mask.shape) != (B, past + T):
            hint = (f" (past = {past} tokens already in the cache: the mask covers them too, so that cached "
                    "padding stays masked)" if past else "")
            raise ValueError(f"attention_mask must be [B, past + T] = {(B, past + T)}{hint}, got {_shape(mask)}")
    elif mask.dim() == 4:
        if not (mask.dtype == torch.bool or mask.is_floating_point()):
            raise TypeError(f"a 4-D attention_mask must be bool (True = attend) or additive float (0 = attend), got "
                            f"{mask.dtype}")
        if mask.shape[0] not in (1, B) or mask.shape[1] not in (1, num_heads) or tuple(mask.shape[2:]) != (T, past + T):
            raise ValueError(f"a 4-D attention_mask must be [B | 1, 1 | heads, T, past + T] = [{B} | 1, 1 | "
                             f"{num_heads}, {T}, {past + T}], got {_shape(mask)}")
    else:
        raise ValueError(f"attention_mask must be 2-D [B, past + T] or 4-D [B, 1, T, past + T], got shape "
                         f"{_shape(mask)}")


def _check_position_ids(position_ids, B, T):
    if position_ids is None:
        return None
    if not isinstance(position_ids, torch.Tensor) or position_ids.is_floating_point() or position_ids.is_complex() \
            or position_ids.dtype == torch.bool:
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise TypeError(f"position_ids must be an integer tensor [B, T], got {got}")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, B) or position_ids.shape[1] != T:
        raise ValueError(f"position_ids must be [B, T] = {(B, T)} (or [1, T]), got shape {_shape(position_ids)}")
    return position_ids


def _padding(mask, B, T, past) -> tuple[torch.Tensor | None, bool]:
    """(token_mask [B, T] bool of this forward's real tokens, or None when all are real; whether any position the
    attention layers see, cached ones included, may be padding). The mask was checked by _check_attention_mask."""
    if mask is None:
        return None, False
    if mask.dim() == 2:
        real = mask[:, -T:].bool()
        return (None if bool(real.all()) else real), not bool(mask.bool().all())
    real = _real_tokens_from_4d_mask(mask, B, T, past)
    return (None if bool(real.all()) else real), True


def _real_tokens_from_4d_mask(mask: torch.Tensor, B: int, T: int, past: int) -> torch.Tensor:
    """The new tokens a 4-D mask treats as real, [B, T] bool: those that may attend to themselves (transformers'
    causal masks with padding mask a padded query's own key, left or right padding). KDA layers can follow padding
    only: a mask that is not causal over the real tokens (block-diagonal packing, a sliding window, different
    patterns per head) is refused."""
    if mask.dtype == torch.bool:
        allowed = mask
    else:  # additive: masked where the value leaves no softmax weight, exp(value) == 0 in fp32 (below -104:
        allowed = mask.float().exp() > 0  # -inf, the dtype's minimum, -1e9, BERT's -1e4); 0 and mild biases attend
    allowed = allowed.expand(B, -1, -1, -1)
    per_row = allowed.any(1)  # [B, T, past + T]
    if not torch.equal(per_row, allowed.all(1)):
        raise ValueError("a 4-D attention_mask whose pattern differs between heads cannot be applied to KDA layers; "
                         "pass a 2-D [B, past + T] padding mask")
    t = torch.arange(T, device=mask.device)
    real = per_row[:, t, past + t]  # [B, T] the diagonal
    cached_real = (per_row[:, :, :past] & real[..., None]).any(1)  # [B, past] cached keys some real token sees
    key_real = torch.cat((cached_real, real), dim=1)  # [B, past + T]
    causal = torch.arange(past + T, device=mask.device) <= (past + t)[:, None]  # [T, past + T]
    expected = causal & key_real[:, None, :]
    if bool(((per_row != expected) & real[..., None]).any()):
        raise ValueError("this 4-D attention_mask is not a causal mask with padding (each real token attending to "
                         "every real token up to itself): KDA layers cannot follow it. Pass a 2-D [B, past + T] "
                         "padding mask, or position_ids for packed documents")
    return real


class KDAHybridForCausalLM(KDAHybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # the base model's plan is in KDAHybridConfig
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    DECODE_LINEARS = ("lm_head",)

    def __init__(self, config: KDAHybridConfig):
        super().__init__(config)
        self.model = KDAHybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() builds a DynamicCache for ordinary models; this model needs its hybrid cache."""
        user_cache = model_kwargs.get("cache")
        if user_cache is not None and not isinstance(user_cache, KDAHybridCache):
            raise TypeError(_foreign_cache_message(user_cache))
        if user_cache is not None and generation_config.use_cache is False:
            # transformers would run the whole sequence at every step and the model would add each run to the cache
            # on top of the last: wrong tokens from the second on, and a cache holding sum(lengths) tokens
            raise ValueError(
                "generate() got a cache and use_cache=False: without use_cache every step feeds the whole sequence "
                "again, and a given cache would take it on top of what it holds. Leave use_cache at True to continue "
                "from the cache, or pass no cache")
        if user_cache is None and generation_config.use_cache is not False and \
                generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                             "KDA hybrid models use their own KDAHybridCache (leave cache_implementation unset, or "
                             "'dynamic'); for offloading, call cache.offload(layer_idx) on a KDAHybridCache")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if user_cache is None and model_kwargs.get("cache") is not None:
            cache = KDAHybridCache(self.config)
            if generation_config.is_assistant:
                cache.activate_past_recording()
            model_kwargs["cache"] = cache

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None, attention_mask=None,
                                      inputs_embeds=None, is_first_iteration=False, **kwargs):
        """generate()'s one look at the whole input_ids beside a user's cache: they must start with its tokens."""
        if isinstance(cache, KDAHybridCache) and inputs_embeds is None:
            cache.check_generation_inputs(input_ids, next_sequence_length, is_first_iteration)
        return super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, cache=cache, attention_mask=attention_mask,
            inputs_embeds=inputs_embeds, is_first_iteration=is_first_iteration, **kwargs)

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def init_continuous_batching(self, *args, **kwargs):
        """Continuous batching (generate_batch, generate(cache_implementation="paged")) keeps a paged KV cache of
        attention layers only; transformers would fail on the first KDA layer type ("Invalid layer type")."""
        raise NotImplementedError(
            "continuous batching (generate_batch, init_continuous_batching, cache_implementation='paged') is not "
            "supported: its paged cache holds attention keys and values only, and KDA layers carry a recurrent state "
            "per sequence. Use generate() on a padded batch")

    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True):
        """inputs_embeds restarting from a cache must be the full sequence (transformers' rule, which keeps the last
        length - past embeddings as the new tokens): fewer is an error here, naming the shapes, instead of an empty
        input deep inside ("inputs_embeds must hold at least one sequence ... (2, 0, 64)")."""
        cache = model_kwargs.get("cache")
        past = cache.get_seq_length() if isinstance(cache, KDAHybridCache) else 0
        embeds = model_kwargs.get("inputs_embeds")
        if past and is_first_iteration and embeds is not None and embeds.shape[1] <= past:
            raise ValueError(
                f"generate() got inputs_embeds of shape {tuple(embeds.shape)} with a cache holding {past} tokens: "
                f"when restarting from a cache, inputs_embeds hold the whole sequence, the {past} cached tokens "
                f"followed by at least one new one ([B, {past} + new, hidden]), or pass a new cache")
        return super()._prefill(input_ids, generation_config, model_kwargs, is_first_iteration)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: KDAHybridCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: KDAHybridCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Outputs, masks and position_ids as KDAHybridModel's docstring says; `labels` give the shifted LM loss."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            output_attentions=output_attentions, past_key_values=past_key_values, return_dict=True,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = decode_linear(self.lm_head, hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# ------------------------------------------------------------------------------------------------------
# Classification heads
# ------------------------------------------------------------------------------------------------------


class KDAHybridForSequenceClassification(GenericForSequenceClassification, KDAHybridPreTrainedModel):
    """The decoder + a linear `score` head read at each row's last non-padding token (transformers' generic head:
    the rightmost token that is not `pad_token_id`, so left and right padding both work; a batch of more than
    one row needs `pad_token_id`)."""

    def __init__(self, config: KDAHybridConfig):
        # the generic head builds its body with AutoModel.from_config, which a remote-code config cannot reach
        # without trust_remote_code: build this package's decoder directly
        KDAHybridPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = KDAHybridModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()


class KDAHybridForTokenClassification(GenericForTokenClassification, KDAHybridPreTrainedModel):
    """The decoder + dropout + a linear `score` head on every token (transformers' generic head; dropout
    `config.classifier_dropout`, default 0.1)."""

    def __init__(self, config: KDAHybridConfig):
        KDAHybridPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = KDAHybridModel(config)
        dropout = getattr(config, "classifier_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()


__all__ = [
    "KDAHybridPreTrainedModel",
    "KDAHybridModel",
    "KDAHybridForCausalLM",
    "KDAHybridForSequenceClassification",
    "KDAHybridForTokenClassification",
]
