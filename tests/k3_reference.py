"""Token-by-token float64 reference ("oracle") of the Kimi K3 text backbone.

Written from the facts sheet ``/work/shared/K3.md`` alone, and on purpose independent of ``kda_hybrid``: nothing
here imports or mirrors the implementation under test. Every formula is computed for one token at a time, the way a
decoder would step, with explicit per-sequence state (KDA conv tails and delta-rule state, MLA key/value cache).
Speed is not a goal: use tiny shapes only.

Sections of K3.md that each piece implements:

- §1 config schema (1-based ``kda_layers`` / ``full_attn_layers``, the K3 switches and their Kimi-Linear defaults);
- §2 checkpoint layout (tensor names and shapes; ``A_log`` as [H], [>= H] with a zero tail, or [1, 1, H, 1]);
- §3 epsilons (RMSNorm ``x / sqrt(mean(x^2) + eps) * w``; MLA LoRA norms 1e-6; KDA L2 norm
  ``x / sqrt(sum(x^2) + 1e-6)``);
- §3.1 KDA, §3.2 NoPE MLA with q-LoRA and output gate, §3.3 SiTU-GLU, §3.4 latent MoE, §3.5 Block Attention
  Residuals, §3.6 MXFP4 dequantisation.

Public API:

- ``dequantize_mxfp4(packed, scale)`` and ``quantize_mxfp4(weight)`` (§3.6);
- ``k3_reference_logits(tensors, config, input_ids)``: float64 logits [B, T, vocab];
- ``k3_tensor_shapes(config, mxfp4=False)``: the name -> shape table the reference expects (§2);
- ``random_k3_tensors(config, seed=0, mxfp4=False)``: a random tensor dict for a (tiny) config;
- ``tiny_k3_config(**overrides)``: the small K3-like ``text_config`` used by the self-check.

Tensor names are the released ones with the ``language_model.`` prefix stripped (``model.layers.{i}...``,
``lm_head.weight``). Run ``OMP_NUM_THREADS=1 python tests/k3_reference.py`` for the self-check.
"""

from __future__ import annotations

import math

import torch

# §3.6: E2M1 codes 0..15 (bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32
E8M0_NAN = 255

MLA_LORA_NORM_EPS = 1e-6  # §3: q_a_layernorm / kv_a_layernorm
KDA_L2_NORM_EPS = 1e-6  # §3: eps on the sum of squares, inside the root
ROUTER_RENORM_EPS = 1e-20  # §3.4 step 2

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------------------
# §3.6 MXFP4
# ----------------------------------------------------------------------------------------------------------------


def _pow2_table() -> torch.Tensor:
    """2**(s - 127) for s = 0..254, exact (math.ldexp), float64."""
    return torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)], dtype=F64)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [out, in/2] (element 2j = low nibble of byte j, 2j+1 = high nibble; E2M1 codes), scale uint8
    [out, in/32] (E8M0: 2**(s-127); 255 -> raise ValueError). Returns float32 [out, in]."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 expects uint8 packed/scale, got {packed.dtype} / {scale.dtype}")
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(f"MXFP4 expects 2-D packed/scale, got {tuple(packed.shape)} / {tuple(scale.shape)}")
    rows, half = packed.shape
    n_in = 2 * half
    if n_in % MXFP4_GROUP or tuple(scale.shape) != (rows, n_in // MXFP4_GROUP):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit packed {tuple(packed.shape)} (group 32)")
    scale = scale.cpu()
    if bool((scale == E8M0_NAN).any()):
        raise ValueError("MXFP4 scale byte 255 is NaN in E8M0 (OCP)")
    p = packed.cpu().to(torch.int64)
    low = p & 0xF  # element 2j
    high = (p >> 4) & 0xF  # element 2j + 1
    codes = torch.stack([low, high], dim=-1).reshape(rows, n_in)
    values = torch.tensor(E2M1_VALUES, dtype=F64)[codes]
    factors = _pow2_table()[scale.to(torch.int64)]  # [rows, in/32]
    values = values * factors.repeat_interleave(MXFP4_GROUP, dim=1)
    return values.to(torch.float32)


def _nearest_e2m1_code(magnitude: torch.Tensor) -> torch.Tensor:
    """Code 0..7 of the E2M1 magnitude nearest to `magnitude` (<= 6); ties go to the even code (even mantissa)."""
    mags = torch.tensor(E2M1_VALUES[:8], dtype=F64)
    dist = (magnitude.unsqueeze(-1) - mags).abs()
    is_best = dist == dist.min(dim=-1, keepdim=True).values
    odd = (torch.arange(8) % 2).to(torch.int64)
    score = (~is_best).to(torch.int64) * 2 + odd  # best-and-even < best-and-odd < not best
    return score.argmin(dim=-1)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse for test data: float [out, in] (in % 32 == 0) -> (packed, scale) such that dequantize gives the
    nearest representable values (pick per-32-group scale 2**e so that max|w| / 2**e <= 6, round each element to
    the nearest E2M1 value). Used by tests to build MXFP4 experts.

    e is the smallest such integer (the finest grid that still holds the group's largest element), clamped to the
    E8M0 range [-127, 127] (values beyond 6 * 2**127 saturate to +-6 * 2**127). All-zero groups get e = -127.
    Rounding ties go to the even code (round-half-to-even on the mantissa bit).
    """
    w = weight.detach().to("cpu", F64)
    if w.dim() != 2 or w.shape[1] % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4 expects [out, in] with in % 32 == 0, got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_mxfp4 got non-finite values")
    rows, n_in = w.shape
    groups = w.reshape(rows, n_in // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1)

    # smallest e with amax / 2**e <= 6: start from ceil(log2(amax / 6)) and fix any float slack exactly
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / 6.0)).to(torch.int64)
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    pow2 = _pow2_table()  # index s = e + 127
    for _ in range(2):
        too_big = (amax / pow2[e + 127] > 6.0) & (e < 127)
        e = e + too_big.to(torch.int64)
        can_shrink = (e > -127) & (amax / pow2[(e - 1).clamp(min=-127) + 127] <= 6.0) & (amax > 0)
        e = e - can_shrink.to(torch.int64)

    scaled = groups / pow2[e + 127].unsqueeze(-1)  # exact: division by a power of two
    code = _nearest_e2m1_code(scaled.abs().clamp(max=6.0))
    code = torch.where((scaled < 0) & (code != 0), code | 8, code)
    code = code.reshape(rows, n_in)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    scale = (e + 127).to(torch.uint8)
    return packed, scale


# ----------------------------------------------------------------------------------------------------------------
# §1 config
# ----------------------------------------------------------------------------------------------------------------


class _Config:
    """The text_config fields the forward needs, with the Kimi-Linear defaults of §1 for absent keys."""

    def __init__(self, c: dict):
        self.hidden = int(c["hidden_size"])
        self.num_layers = int(c["num_hidden_layers"])
        self.vocab = int(c["vocab_size"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", False))

        # layer kinds (1-based lists, §1); no linear_attn_config = every layer full attention
        lac = c.get("linear_attn_config") or None
        self.kinds = []
        if lac is None:
            self.kinds = ["mla"] * self.num_layers
        else:
            kda = {int(i) for i in lac.get("kda_layers") or []}
            full = {int(i) for i in lac.get("full_attn_layers") or []}
            for i in range(1, self.num_layers + 1):
                if (i in kda) == (i in full):
                    raise ValueError(f"layer {i} (1-based) must be in exactly one of kda_layers/full_attn_layers")
                self.kinds.append("kda" if i in kda else "mla")
            self.kda_heads = int(lac["num_heads"])
            self.kda_head_dim = int(lac["head_dim"])
            self.conv_width = int(lac.get("short_conv_kernel_size", 4))
            self.full_rank_gate = bool(lac.get("use_full_rank_gate", False))
            lb = lac.get("gate_lower_bound")
            self.gate_lower_bound = None if lb is None else float(lb)

        # MLA (§3.2)
        self.mla_heads = int(c.get("num_attention_heads") or 0)
        self.q_lora_rank = c.get("q_lora_rank") or None
        self.kv_lora_rank = int(c.get("kv_lora_rank") or 0)
        self.nope = int(c.get("qk_nope_head_dim") or 0)
        self.rope = int(c.get("qk_rope_head_dim") or 0)
        self.v_dim = int(c.get("v_head_dim") or 0)
        self.mla_gate = bool(c.get("mla_use_output_gate", False))
        if "mla" in self.kinds and c.get("mla_use_nope", True) is False:
            raise NotImplementedError("K3.md only describes NoPE MLA (mla_use_nope true)")

        # activation (§3.3)
        self.act = c.get("hidden_act", "silu")
        if self.act not in ("situ", "silu"):
            raise NotImplementedError(f"hidden_act {self.act!r}")
        self.situ_beta = float(c.get("activation_situ_beta") or 1.0)
        lin = c.get("activation_situ_linear_beta")
        self.situ_linear_beta = None if lin is None else float(lin)

        # MLP / MoE (§3.4)
        self.intermediate = int(c.get("intermediate_size") or 0)
        self.first_dense = int(c.get("first_k_dense_replace") or 0)
        self.num_experts = int(c.get("num_experts") or 0)
        self.top_k = int(c.get("num_experts_per_token") or 0)
        self.num_shared = int(c.get("num_shared_experts") or 0)
        self.moe_intermediate = int(c.get("moe_intermediate_size") or 0)
        latent = c.get("routed_expert_hidden_size")
        self.latent = None if latent is None else int(latent)
        self.latent_norm = bool(c.get("latent_moe_use_norm", False))
        self.renormalize = bool(c.get("moe_renormalize", True))
        rsf = c.get("routed_scaling_factor")
        self.routed_scaling = 1.0 if rsf is None else float(rsf)
        if self.num_experts:
            if int(c.get("moe_layer_freq") or 1) != 1:
                raise NotImplementedError("moe_layer_freq != 1 is not described in K3.md")
            if (c.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
                raise NotImplementedError("only the sigmoid router of §3.4 is implemented")
            groups, topk_group = int(c.get("num_expert_group") or 1), int(c.get("topk_group") or 1)
            if groups > 1 and groups > topk_group:
                raise NotImplementedError("grouped top-k (num_expert_group > topk_group > ...) is not in K3.md")
            if not 0 < self.top_k <= self.num_experts:
                raise ValueError(f"num_experts_per_token {self.top_k} vs num_experts {self.num_experts}")

        # AttnRes (§3.5)
        bs = c.get("attn_res_block_size")
        self.attn_res_block = None if bs is None else int(bs)

    def is_moe(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense


# ----------------------------------------------------------------------------------------------------------------
# §2 tensor names and shapes
# ----------------------------------------------------------------------------------------------------------------


def k3_tensor_shapes(config: dict, mxfp4: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every text-backbone tensor for `config` (§2, `language_model.` stripped).

    A_log is listed as [H] (the reference also accepts [>= H] with a zero tail and [1, 1, H, 1]). With mxfp4, the
    routed experts appear as `.weight_packed` [out, in/2] and `.weight_scale` [out, in/32] (both uint8).
    """
    cfg = _Config(config)
    D = cfg.hidden
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab, D)
    if cfg.attn_res_block is not None:
        shapes["model.output_attn_res_norm.weight"] = (D,)
        shapes["model.output_attn_res_proj.weight"] = (1, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (D,)
        if cfg.attn_res_block is not None:
            for which in ("self_attention", "mlp"):
                shapes[p + f"{which}_res_norm.weight"] = (D,)
                shapes[p + f"{which}_res_proj.weight"] = (1, D)
        a = p + "self_attn."
        if cfg.kinds[i] == "kda":
            H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_width
            P = H * K
            for n in "qkv":
                shapes[a + f"{n}_proj.weight"] = (P, D)
            for n in "qkv":
                shapes[a + f"{n}_conv1d.weight"] = (P, 1, W)
            shapes[a + "A_log"] = (H,)
            shapes[a + "dt_bias"] = (P,)
            shapes[a + "f_a_proj.weight"] = (K, D)
            shapes[a + "f_b_proj.weight"] = (P, K)
            shapes[a + "b_proj.weight"] = (H, D)
            if cfg.full_rank_gate:
                shapes[a + "g_proj.weight"] = (P, D)
            else:
                shapes[a + "g_a_proj.weight"] = (K, D)
                shapes[a + "g_b_proj.weight"] = (P, K)
            shapes[a + "o_norm.weight"] = (K,)
            shapes[a + "o_proj.weight"] = (D, P)
        else:
            H = cfg.mla_heads
            if cfg.q_lora_rank:
                r = int(cfg.q_lora_rank)
                shapes[a + "q_a_proj.weight"] = (r, D)
                shapes[a + "q_a_layernorm.weight"] = (r,)
                shapes[a + "q_b_proj.weight"] = (H * (cfg.nope + cfg.rope), r)
            else:
                shapes[a + "q_proj.weight"] = (H * (cfg.nope + cfg.rope), D)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.rope, D)
            shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (H * (cfg.nope + cfg.v_dim), cfg.kv_lora_rank)
            if cfg.mla_gate:
                shapes[a + "g_proj.weight"] = (H * cfg.v_dim, D)
            shapes[a + "o_proj.weight"] = (D, H * cfg.v_dim)
        if cfg.is_moe(i):
            m = p + "block_sparse_moe."
            E, Im = cfg.num_experts, cfg.moe_intermediate
            L = D if cfg.latent is None else cfg.latent
            shapes[m + "gate.weight"] = (E, D)
            shapes[m + "gate.e_score_correction_bias"] = (E,)
            if cfg.latent is not None:
                shapes[m + "routed_expert_down_proj.weight"] = (L, D)
                if cfg.latent_norm:
                    shapes[m + "routed_expert_norm.weight"] = (L,)
                shapes[m + "routed_expert_up_proj.weight"] = (D, L)
            if cfg.num_shared:
                S = cfg.num_shared * Im
                shapes[m + "shared_experts.gate_proj.weight"] = (S, D)
                shapes[m + "shared_experts.up_proj.weight"] = (S, D)
                shapes[m + "shared_experts.down_proj.weight"] = (D, S)
            for e in range(E):
                for w, (rows, cols) in (("w1", (Im, L)), ("w2", (L, Im)), ("w3", (Im, L))):
                    name = m + f"experts.{e}.{w}.weight"
                    if mxfp4:
                        shapes[name + "_packed"] = (rows, cols // 2)
                        shapes[name + "_scale"] = (rows, cols // MXFP4_GROUP)
                    else:
                        shapes[name] = (rows, cols)
        else:
            I = cfg.intermediate  # noqa: E741
            shapes[p + "mlp.gate_proj.weight"] = (I, D)
            shapes[p + "mlp.up_proj.weight"] = (I, D)
            shapes[p + "mlp.down_proj.weight"] = (D, I)
    return shapes


class _Params:
    """Read-only view of the tensor dict: float64 on CPU, MXFP4 pairs dequantised, shapes checked (§2)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.cache: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self.tensors or name + "_packed" in self.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.cache:
            if name in self.tensors:
                x = self.tensors[name].detach().to("cpu", F64)
            elif name + "_packed" in self.tensors:
                x = dequantize_mxfp4(self.tensors[name + "_packed"], self.tensors[name + "_scale"]).to(F64)
            else:
                raise KeyError(f"missing tensor {name!r}")
            self.cache[name] = x
        x = self.cache[name]
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}")
        return x

    def a_log(self, name: str, heads: int) -> torch.Tensor:
        """§2: A_log as [H], [>= H] with a zero tail, or [1, 1, H, 1]; returns the H per-head values."""
        x = self.get(name)
        if x.dim() == 4 and x.shape[0] == x.shape[1] == x.shape[3] == 1:
            x = x.reshape(-1)
        if x.dim() != 1 or x.shape[0] < heads:
            raise ValueError(f"{name}: shape {tuple(self.get(name).shape)} for {heads} heads")
        if bool((x[heads:] != 0).any()):
            raise ValueError(f"{name}: entries past the {heads} heads must be zero (§2, §6)")
        return x[:heads]


# ----------------------------------------------------------------------------------------------------------------
# small formulas (§3)
# ----------------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """§3: x / sqrt(mean(x^2) + eps) * w, over the last dimension."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """§3: KDA q/k L2 norm x / sqrt(sum(x^2) + 1e-6), over the last dimension."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + KDA_L2_NORM_EPS)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def glu_activation(g: torch.Tensor, u: torch.Tensor, cfg: _Config) -> torch.Tensor:
    """§3.3 SiTU-GLU: beta*tanh(g/beta) * sigmoid(g) * lb*tanh(u/lb) (absent lb: u uncapped); or SwiGLU silu(g)*u."""
    if cfg.act == "silu":
        return silu(g) * u
    b = cfg.situ_beta
    capped_u = u if cfg.situ_linear_beta is None else cfg.situ_linear_beta * torch.tanh(u / cfg.situ_linear_beta)
    return b * torch.tanh(g / b) * torch.sigmoid(g) * capped_u


def glu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, cfg: _Config):
    """down(act(gate x, up x)) (§3.3): dense layers, shared experts and routed experts (w1 = gate, w3 = up)."""
    return w_down @ glu_activation(w_gate @ x, w_up @ x, cfg)


# ----------------------------------------------------------------------------------------------------------------
# §3.1 KDA, one token
# ----------------------------------------------------------------------------------------------------------------


class _KDAState:
    """Per sequence and layer: the last W-1 inputs of each conv (zero history) and S [H, K, V]."""

    def __init__(self, cfg: _Config):
        P = cfg.kda_heads * cfg.kda_head_dim
        self.history = {n: [torch.zeros(P, dtype=F64) for _ in range(cfg.conv_width - 1)] for n in "qkv"}
        self.S = torch.zeros(cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim, dtype=F64)


def causal_conv_step(x_t: torch.Tensor, history: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv at one step: out[p] = sum_j weight[p, 0, j] * x[t - (W-1-j)][p]; updates history."""
    window = history + [x_t]  # window[j] = x[t - (W-1-j)]
    out = torch.zeros_like(x_t)
    for j, x_j in enumerate(window):
        out = out + weight[:, 0, j] * x_j
    history[:] = window[1:]
    return out


def kda_decay(z: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """§3.1 step 4, z [H, K]: g = lb * sigmoid(exp(A_log[h]) * z); without lb, -exp(A_log[h]) * softplus(z)."""
    A = torch.exp(a_log).unsqueeze(-1)  # [H, 1]: one value per head, over the K channels
    if lower_bound is None:
        return -A * torch.nn.functional.softplus(z)
    return lower_bound * torch.sigmoid(A * z)


def kda_state_update(S, q, k, v, g, beta):
    """§3.1 step 5 for one head: S_t = (I - beta k k^T) Diag(exp g_t) S_{t-1} + beta k v^T; o_t = S_t^T q_t.

    S [K, V]; q, k, g [K]; v [V]; beta scalar. Diag(exp g) scales the K rows of S.
    """
    K = k.shape[0]
    eye = torch.eye(K, dtype=F64)
    S_new = (eye - beta * torch.outer(k, k)) @ torch.diag(torch.exp(g)) @ S + beta * torch.outer(k, v)
    return S_new, S_new.T @ q


def kda_step(params: _Params, prefix: str, cfg: _Config, x: torch.Tensor, state: _KDAState) -> torch.Tensor:
    """§3.1 for one token; x [D] is the input_layernorm output."""
    H, K, W, D = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_width, cfg.hidden
    P = H * K

    # step 1: projections, causal depthwise conv, SiLU
    qkv = {}
    for n in "qkv":
        proj = params.get(prefix + f"{n}_proj.weight", (P, D)) @ x
        conv_w = params.get(prefix + f"{n}_conv1d.weight", (P, 1, W))
        qkv[n] = silu(causal_conv_step(proj, state.history[n], conv_w))

    # step 2: heads, L2 norm of q and k, scale K^-1/2 on q
    q = l2_norm(qkv["q"].reshape(H, K)) * K**-0.5
    k = l2_norm(qkv["k"].reshape(H, K))
    v = qkv["v"].reshape(H, K)

    # step 3: beta
    beta = torch.sigmoid(params.get(prefix + "b_proj.weight", (H, D)) @ x)

    # step 4: decay
    f_a = params.get(prefix + "f_a_proj.weight")
    f_b = params.get(prefix + "f_b_proj.weight", (P, f_a.shape[0]))
    z = f_b @ (f_a @ x) + params.get(prefix + "dt_bias", (P,))
    g = kda_decay(z.reshape(H, K), params.a_log(prefix + "A_log", H), cfg.gate_lower_bound)

    # step 5: the recurrence, per head
    o = torch.zeros(H, K, dtype=F64)
    for h in range(H):
        state.S[h], o[h] = kda_state_update(state.S[h], q[h], k[h], v[h], g[h], beta[h])

    # step 6: per-head RMSNorm with o_norm, times sigmoid(output gate), o_proj
    o = rms_norm(o, params.get(prefix + "o_norm.weight", (K,)), cfg.eps)
    if cfg.full_rank_gate:
        gate = params.get(prefix + "g_proj.weight", (P, D)) @ x
    else:
        g_a = params.get(prefix + "g_a_proj.weight")
        gate = params.get(prefix + "g_b_proj.weight", (P, g_a.shape[0])) @ (g_a @ x)
    o = o * torch.sigmoid(gate.reshape(H, K))
    return params.get(prefix + "o_proj.weight", (D, P)) @ o.reshape(P)


# ----------------------------------------------------------------------------------------------------------------
# §3.2 MLA (NoPE, q-LoRA, output gate), one token
# ----------------------------------------------------------------------------------------------------------------


class _MLAState:
    """Per sequence and layer: keys [H, nope+rope] and values [H, v] of every past token."""

    def __init__(self):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []


def mla_step(params: _Params, prefix: str, cfg: _Config, x: torch.Tensor, state: _MLAState) -> torch.Tensor:
    """§3.2 for one token; x [D] is the input_layernorm output. No rotation anywhere (NoPE)."""
    H, n, r, dv, c, D = cfg.mla_heads, cfg.nope, cfg.rope, cfg.v_dim, cfg.kv_lora_rank, cfg.hidden

    if cfg.q_lora_rank:
        rq = int(cfg.q_lora_rank)
        cq = params.get(prefix + "q_a_proj.weight", (rq, D)) @ x
        cq = rms_norm(cq, params.get(prefix + "q_a_layernorm.weight", (rq,)), MLA_LORA_NORM_EPS)
        q = params.get(prefix + "q_b_proj.weight", (H * (n + r), rq)) @ cq
    else:
        q = params.get(prefix + "q_proj.weight", (H * (n + r), D)) @ x
    q = q.reshape(H, n + r)  # per head [q_nope | q_pe]

    kv_a = params.get(prefix + "kv_a_proj_with_mqa.weight", (c + r, D)) @ x
    latent, k_pe = kv_a[:c], kv_a[c:]  # [latent | k_pe]; k_pe shared by all heads, never rotated
    latent = rms_norm(latent, params.get(prefix + "kv_a_layernorm.weight", (c,)), MLA_LORA_NORM_EPS)
    kv = (params.get(prefix + "kv_b_proj.weight", (H * (n + dv), c)) @ latent).reshape(H, n + dv)
    k_nope, v = kv[:, :n], kv[:, n:]  # per head: k_nope rows, then v rows
    key = torch.cat([k_nope, k_pe.unsqueeze(0).expand(H, r)], dim=-1)  # [H, n + r]
    state.keys.append(key)
    state.values.append(v)

    # causal softmax over the tokens so far: (q_nope . k_nope + q_pe . k_pe) * (n + r)^-1/2
    scale = (n + r) ** -0.5
    keys = torch.stack(state.keys)  # [t+1, H, n+r]
    values = torch.stack(state.values)  # [t+1, H, v]
    out = torch.zeros(H, dv, dtype=F64)
    for h in range(H):
        scores = (keys[:, h, :] @ q[h]) * scale
        probs = torch.softmax(scores, dim=0)
        out[h] = probs @ values[:, h, :]
    out = out.reshape(H * dv)
    if cfg.mla_gate:
        out = out * torch.sigmoid(params.get(prefix + "g_proj.weight", (H * dv, D)) @ x)
    return params.get(prefix + "o_proj.weight", (D, H * dv)) @ out


# ----------------------------------------------------------------------------------------------------------------
# MLP: dense (§3.3) and latent MoE (§3.4), one token
# ----------------------------------------------------------------------------------------------------------------


def dense_mlp(params: _Params, prefix: str, cfg: _Config, x: torch.Tensor) -> torch.Tensor:
    D, I = cfg.hidden, cfg.intermediate  # noqa: E741
    return glu_mlp(
        x,
        params.get(prefix + "mlp.gate_proj.weight", (I, D)),
        params.get(prefix + "mlp.up_proj.weight", (I, D)),
        params.get(prefix + "mlp.down_proj.weight", (D, I)),
        cfg,
    )


def route(params: _Params, prefix: str, cfg: _Config, x: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """§3.4 steps 1-2: sigmoid scores, top-k of scores + bias, weights from the unbiased scores."""
    E, D = cfg.num_experts, cfg.hidden
    s = torch.sigmoid(params.get(prefix + "gate.weight", (E, D)) @ x)
    bias_name = prefix + "gate.e_score_correction_bias"
    bias = params.get(bias_name, (E,)) if params.has(bias_name) else torch.zeros(E, dtype=F64)
    chosen = torch.topk(s + bias, cfg.top_k).indices.tolist()
    w = s[chosen]
    if cfg.renormalize:
        w = w / (w.sum() + ROUTER_RENORM_EPS)
    return chosen, w * cfg.routed_scaling


def moe(params: _Params, prefix: str, cfg: _Config, x: torch.Tensor) -> torch.Tensor:
    """§3.4; x [D] is the post_attention_layernorm output."""
    D, Im = cfg.hidden, cfg.moe_intermediate
    L = D if cfg.latent is None else cfg.latent
    chosen, weights = route(params, prefix, cfg, x)

    # step 3: the experts see the latent z (or x itself without a latent)
    z = x if cfg.latent is None else params.get(prefix + "routed_expert_down_proj.weight", (L, D)) @ x

    # step 4: weighted sum of the chosen experts
    u = torch.zeros(L, dtype=F64)
    for e, w_e in zip(chosen, weights):
        ep = prefix + f"experts.{e}."
        w1 = params.get(ep + "w1.weight", (Im, L))
        w2 = params.get(ep + "w2.weight", (L, Im))
        w3 = params.get(ep + "w3.weight", (Im, L))
        u = u + w_e * glu_mlp(z, w1, w3, w2, cfg)

    # step 5: norm (after the sum), up-projection, plus the shared experts on the original x
    if cfg.latent is not None:
        if cfg.latent_norm:
            u = rms_norm(u, params.get(prefix + "routed_expert_norm.weight", (L,)), cfg.eps)
        u = params.get(prefix + "routed_expert_up_proj.weight", (D, L)) @ u
    if cfg.num_shared:
        S = cfg.num_shared * Im
        u = u + glu_mlp(
            x,
            params.get(prefix + "shared_experts.gate_proj.weight", (S, D)),
            params.get(prefix + "shared_experts.up_proj.weight", (S, D)),
            params.get(prefix + "shared_experts.down_proj.weight", (D, S)),
            cfg,
        )
    return u


# ----------------------------------------------------------------------------------------------------------------
# §3.5 Block Attention Residuals
# ----------------------------------------------------------------------------------------------------------------


def attn_res_read(sources: list[torch.Tensor], norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float):
    """§3.5: sum_i softmax_i(sum_d q_w[d] n_w[d] V_i[d] / rms(V_i)) V_i, rms(V) = sqrt(mean(V^2) + eps).

    The softmax runs over the sources; the mix is of the raw sources.
    """
    q_w = proj_w.reshape(-1)
    logits = torch.stack([(q_w * norm_w * V / torch.sqrt((V * V).mean() + eps)).sum() for V in sources])
    probs = torch.softmax(logits, dim=0)
    out = torch.zeros_like(sources[0])
    for p_i, V in zip(probs, sources):
        out = out + p_i * V
    return out


# ----------------------------------------------------------------------------------------------------------------
# the model, one token at a time
# ----------------------------------------------------------------------------------------------------------------


def _attention(params, cfg, i, x, state):
    prefix = f"model.layers.{i}.self_attn."
    if cfg.kinds[i] == "kda":
        return kda_step(params, prefix, cfg, x, state)
    return mla_step(params, prefix, cfg, x, state)


def _mlp(params, cfg, i, x):
    if cfg.is_moe(i):
        return moe(params, f"model.layers.{i}.block_sparse_moe.", cfg, x)
    return dense_mlp(params, f"model.layers.{i}.", cfg, x)


def _token_hidden(params: _Params, cfg: _Config, emb: torch.Tensor, states: list) -> torch.Tensor:
    """One token through all layers; returns the pre-`model.norm` hidden state [D]."""
    D, eps = cfg.hidden, cfg.eps

    def norm(i, which, x):
        return rms_norm(x, params.get(f"model.layers.{i}.{which}.weight", (D,)), eps)

    if cfg.attn_res_block is None:  # ordinary pre-norm residual stream
        h = emb
        for i in range(cfg.num_layers):
            h = h + _attention(params, cfg, i, norm(i, "input_layernorm", h), states[i])
            h = h + _mlp(params, cfg, i, norm(i, "post_attention_layernorm", h))
        return h

    def read(name, sources):
        norm_w = params.get(name + "_norm.weight", (D,))
        return attn_res_read(sources, norm_w, params.get(name + "_proj.weight", (1, D)), eps)

    closed = [emb]  # b_0, then every closed block (full sums)
    partial = None  # the current block's partial sum; None while empty
    for i in range(cfg.num_layers):
        if i > 0 and i % cfg.attn_res_block == 0:  # a block's first layer: close the previous block
            closed.append(partial)
            partial = None
        x_a = read(f"model.layers.{i}.self_attention_res", closed + ([] if partial is None else [partial]))
        a = _attention(params, cfg, i, norm(i, "input_layernorm", x_a), states[i])
        partial = a if partial is None else partial + a
        x_m = read(f"model.layers.{i}.mlp_res", closed + [partial])
        m = _mlp(params, cfg, i, norm(i, "post_attention_layernorm", x_m))
        partial = partial + m
    return read("model.output_attn_res", closed + ([] if partial is None else [partial]))


def k3_reference_logits(tensors: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits float64 [B, T, vocab] of the K3 text model for input_ids [B, T] (no padding), computed token by token
    in float64."""
    cfg = _Config(config)
    params = _Params(tensors)
    D, V = cfg.hidden, cfg.vocab
    embed = params.get("model.embed_tokens.weight", (V, D))
    if params.has("lm_head.weight"):
        head = params.get("lm_head.weight", (V, D))
    elif cfg.tie_word_embeddings:
        head = embed
    else:
        raise KeyError("missing tensor 'lm_head.weight' (tie_word_embeddings is false)")
    final_norm = params.get("model.norm.weight", (D,))

    ids = input_ids.detach().cpu()
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
    B, T = ids.shape
    logits = torch.zeros(B, T, V, dtype=F64)
    for b in range(B):
        states = [_KDAState(cfg) if kind == "kda" else _MLAState() for kind in cfg.kinds]
        for t in range(T):
            h = _token_hidden(params, cfg, embed[int(ids[b, t])], states)
            logits[b, t] = head @ rms_norm(h, final_norm, cfg.eps)
    return logits


# ----------------------------------------------------------------------------------------------------------------
# random test data
# ----------------------------------------------------------------------------------------------------------------


def tiny_k3_config(**overrides) -> dict:
    """A small K3-like text_config: hidden 32, 4 layers (layer 4, 1-based, full attention), 2 KDA heads of 8,
    MLA 2 heads (q-LoRA 16, kv-LoRA 8, nope 8, rope 4, v 8), 4 experts top-2, latent 16, 2 shared experts,
    AttnRes blocks of 2, vocab 50. `overrides` replace top-level keys (`linear_attn_config` is merged)."""
    config = {
        "model_type": "kimi_linear",
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "vocab_size": 50,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "num_heads": 2,
            "head_dim": 8,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 16,
        "kv_lora_rank": 8,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 64,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "moe_intermediate_size": 8,
        "routed_expert_hidden_size": 16,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "attn_res_block_size": 2,
    }
    for key, value in overrides.items():
        if key == "linear_attn_config" and value is not None:
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def random_k3_tensors(config: dict, seed: int = 0, mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """A full random float32 tensor dict for `config` (names and shapes of `k3_tensor_shapes`).

    A_log [H] uniform in [0, log 16] (exp(A_log) in [1, 16]); dt_bias N(0, 0.1); norms U(0.9, 1.1); linear weights
    N(0, fan_in^-1/2) (0.18 at width 32), convs N(0, W^-1/2), AttnRes projections N(0, D^-1/2), embedding N(0, 1),
    e_score_correction_bias N(0, 0.1). With mxfp4 the routed experts are drawn the same way, then stored via
    `quantize_mxfp4` as `.weight_packed` / `.weight_scale` (needs the expert widths to be multiples of 32).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

    out: dict[str, torch.Tensor] = {}
    for name, shape in k3_tensor_shapes(config, mxfp4=False).items():
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        if leaf == "A_log":
            x = uniform(shape, 0.0, math.log(16.0))
        elif leaf == "dt_bias":
            x = normal(shape, 0.1)
        elif leaf == "e_score_correction_bias":
            x = normal(shape, 0.1)
        elif leaf.endswith("norm"):
            x = uniform(shape, 0.9, 1.1)
        elif leaf == "embed_tokens":
            x = normal(shape, 1.0)
        elif leaf.endswith("conv1d"):
            x = normal(shape, shape[-1] ** -0.5)
        else:  # [out, in] linear, AttnRes projections [1, D] included
            x = normal(shape, shape[-1] ** -0.5)
        if mxfp4 and ".experts." in name:
            if shape[-1] % MXFP4_GROUP:
                raise ValueError(f"{name}: in={shape[-1]} is not a multiple of 32, cannot store as MXFP4")
            packed, scale = quantize_mxfp4(x)
            out[name + "_packed"], out[name + "_scale"] = packed, scale
        else:
            out[name] = x.to(torch.float32)
    return out


# ----------------------------------------------------------------------------------------------------------------
# self-check: invariants that do not depend on the reference agreeing with itself
# ----------------------------------------------------------------------------------------------------------------


def _formula_checks() -> None:
    """Properties of the single formulas that follow from the math, not from re-deriving the same code."""
    gen = torch.Generator().manual_seed(5)

    # causal conv: an impulse at t=0 comes out at step t through tap W-1-t (tap j multiplies x[t-(W-1-j)])
    P, W = 3, 4
    weight = torch.randn(P, 1, W, generator=gen, dtype=F64)
    history = [torch.zeros(P, dtype=F64) for _ in range(W - 1)]
    impulse = torch.randn(P, generator=gen, dtype=F64)
    for t in range(W + 1):
        y = causal_conv_step(impulse if t == 0 else torch.zeros(P, dtype=F64), history, weight)
        expected = weight[:, 0, W - 1 - t] * impulse if t < W else torch.zeros(P, dtype=F64)
        assert torch.allclose(y, expected, rtol=0, atol=1e-15), t

    # delta rule with beta = 1 and a unit key: afterwards S^T k == v exactly (the write replaces k's value)
    K = 5
    S = torch.randn(K, K, generator=gen, dtype=F64)
    k = l2_norm(torch.randn(K, generator=gen, dtype=F64))
    k = k / k.norm()
    v, q = torch.randn(K, generator=gen, dtype=F64), torch.randn(K, generator=gen, dtype=F64)
    g = -torch.rand(K, generator=gen, dtype=F64)
    S1, o = kda_state_update(S, q, k, v, g, torch.tensor(1.0, dtype=F64))
    assert torch.allclose(S1.T @ k, v, atol=1e-12)
    assert torch.allclose(o, S1.T @ q, atol=0)
    # beta = 0: only the decay acts, and it scales the K rows (key channels) of S
    S0, _ = kda_state_update(S, q, k, v, g, torch.tensor(0.0, dtype=F64))
    assert torch.allclose(S0, torch.exp(g).unsqueeze(-1) * S, atol=1e-14)
    # from an empty state one step gives o = beta (k . q) v
    _, o1 = kda_state_update(torch.zeros(K, K, dtype=F64), q, k, v, g, torch.tensor(0.3, dtype=F64))
    assert torch.allclose(o1, 0.3 * (k @ q) * v, atol=1e-14)

    # decay: the lower-bound gate lies in (lb, 0) and is monotone in z; exp(A_log) sits inside the sigmoid
    z = torch.linspace(-4, 4, 9, dtype=F64).reshape(1, 9)
    a_log = torch.tensor([math.log(3.0)], dtype=F64)
    g_lb = kda_decay(z, a_log, -5.0)
    assert bool((g_lb > -5).all() and (g_lb < 0).all() and (g_lb.diff() < 0).all())
    assert torch.allclose(g_lb, -5.0 * torch.sigmoid(3.0 * z))
    g_kl = kda_decay(z, a_log, None)
    assert torch.allclose(g_kl, -3.0 * torch.log1p(torch.exp(z)))

    # MLA at the first token: softmax over one key -> the output is o_proj(v_0 * gate), whatever q is
    cfg_t = tiny_k3_config()
    tensors = random_k3_tensors(cfg_t, seed=7)
    a = "model.layers.3.self_attn."
    x = torch.randn(32, generator=gen, dtype=F64)
    y0 = mla_step(_Params(tensors), a, _Config(cfg_t), x, _MLAState())
    other_q = dict(tensors, **{a + "q_b_proj.weight": torch.randn(2 * 12, 16, generator=gen)})
    assert torch.allclose(mla_step(_Params(other_q), a, _Config(cfg_t), x, _MLAState()), y0, atol=1e-12)
    pm = _Params(tensors)
    lat = rms_norm(pm.get(a + "kv_a_proj_with_mqa.weight")[:8] @ x, pm.get(a + "kv_a_layernorm.weight"), 1e-6)
    v0 = (pm.get(a + "kv_b_proj.weight") @ lat).reshape(2, 16)[:, 8:].reshape(16)
    gate = torch.sigmoid(pm.get(a + "g_proj.weight") @ x)
    assert torch.allclose(y0, pm.get(a + "o_proj.weight") @ (v0 * gate), atol=1e-12)

    # L2 norm and RMSNorm
    x = torch.randn(2, 7, generator=gen, dtype=F64)
    assert torch.allclose(l2_norm(x), x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose((rms_norm(x, torch.ones(7, dtype=F64), 0.0) ** 2).mean(-1), torch.ones(2, dtype=F64))

    # AttnRes: one source reads back as itself; equal sources too; the mix is of the raw sources (convex)
    V = torch.randn(6, generator=gen, dtype=F64) * 10
    n_w, q_w = torch.rand(6, generator=gen, dtype=F64), torch.randn(1, 6, generator=gen, dtype=F64)
    assert torch.allclose(attn_res_read([V], n_w, q_w, 1e-5), V, atol=0)
    assert torch.allclose(attn_res_read([V, V.clone()], n_w, q_w, 1e-5), V, atol=1e-12)
    # scaling a source does not change its logit (the rms normalises it): zero projection = plain mean
    zero_q = torch.zeros(1, 6, dtype=F64)
    assert torch.allclose(attn_res_read([V, 3 * V], n_w, zero_q, 1e-5), 2 * V, atol=1e-12)
    lg = [(q_w[0] * n_w * U / torch.sqrt((U * U).mean() + 1e-5)).sum() for U in (V, 100 * V)]
    assert abs(float(lg[0] - lg[1])) < 1e-6

    # MoE: all experts the same and renormalised -> routed part = routed_scaling_factor * one expert
    cfg = _Config(tiny_k3_config(num_experts_per_token=4, routed_scaling_factor=1.7, num_shared_experts=0))
    tensors = random_k3_tensors(tiny_k3_config(num_experts_per_token=4, num_shared_experts=0), seed=6)
    m = "model.layers.1.block_sparse_moe."
    for e in range(1, 4):
        for w_name in ("w1", "w2", "w3"):
            tensors[m + f"experts.{e}.{w_name}.weight"] = tensors[m + f"experts.0.{w_name}.weight"]
    params = _Params(tensors)
    x = torch.randn(32, generator=gen, dtype=F64)
    chosen, weights = route(params, m, cfg, x)
    assert sorted(chosen) == [0, 1, 2, 3] and abs(float(weights.sum()) - 1.7) < 1e-12
    z_lat = params.get(m + "routed_expert_down_proj.weight") @ x
    one = glu_mlp(
        z_lat,
        params.get(m + "experts.0.w1.weight"),
        params.get(m + "experts.0.w3.weight"),
        params.get(m + "experts.0.w2.weight"),
        cfg,
    )
    u = rms_norm(1.7 * one, params.get(m + "routed_expert_norm.weight"), cfg.eps)
    assert torch.allclose(moe(params, m, cfg, x), params.get(m + "routed_expert_up_proj.weight") @ u, atol=1e-12)
    # router weights come from the unbiased scores: a huge bias on expert 3 selects it, its weight stays s_3
    cfg2 = _Config(tiny_k3_config(num_experts_per_token=1, moe_renormalize=False))
    tensors[m + "gate.e_score_correction_bias"] = torch.tensor([0.0, 0.0, 0.0, 100.0])
    chosen, weights = route(_Params(tensors), m, cfg2, x)
    s3 = torch.sigmoid(params.get(m + "gate.weight")[3] @ x)
    assert chosen == [3] and torch.allclose(weights, s3.reshape(1), atol=1e-15)

    # SiTU: large betas tend to SwiGLU; the caps bound the factors by beta and linear beta
    cfg_big = _Config(tiny_k3_config(activation_situ_beta=1e8, activation_situ_linear_beta=1e8))
    cfg_silu = _Config(tiny_k3_config(hidden_act="silu"))
    gx, ux = torch.randn(9, generator=gen, dtype=F64) * 3, torch.randn(9, generator=gen, dtype=F64) * 3
    assert torch.allclose(glu_activation(gx, ux, cfg_big), glu_activation(gx, ux, cfg_silu), atol=1e-10)
    cfg_k3 = _Config(tiny_k3_config())
    huge = torch.tensor([1e4], dtype=F64)
    assert torch.allclose(glu_activation(huge, huge, cfg_k3), torch.tensor([4.0 * 25.0], dtype=F64))
    cfg_nolin = _Config(tiny_k3_config(activation_situ_beta=None, activation_situ_linear_beta=None))
    assert torch.allclose(glu_activation(gx, ux, cfg_nolin), torch.tanh(gx) * torch.sigmoid(gx) * ux)


def _attn_res_source_counts() -> None:
    """§3.5 block bookkeeping, counted: how many sources each read sees."""
    counts: list[int] = []
    real_read = globals()["attn_res_read"]

    def counting_read(sources, norm_w, proj_w, eps):
        counts.append(len(sources))
        return real_read(sources, norm_w, proj_w, eps)

    globals()["attn_res_read"] = counting_read
    try:
        cfg = tiny_k3_config()
        k3_reference_logits(random_k3_tensors(cfg, seed=8), cfg, torch.tensor([[1]]))
        # layer 0: attn [b0], mlp [b0, p1]; layer 1: [b0, p1] x2; layer 2 (block 2 opens): attn [b0, b1],
        # mlp [b0, b1, p2]; layer 3: [b0, b1, p2] x2; final [b0, b1, b2]
        assert counts == [1, 2, 2, 2, 2, 3, 3, 3, 3], counts

        # K3's layer pattern and block size with tiny widths: the final read has 9 sources
        k3 = {
            "kda_layers": [i for i in range(1, 94) if i % 4 != 0 and i != 93],
            "full_attn_layers": [i for i in range(4, 93, 4)] + [93],
        }
        cfg = tiny_k3_config(
            num_hidden_layers=93,
            attn_res_block_size=12,
            linear_attn_config=k3,
            hidden_size=8,
            intermediate_size=8,
            moe_intermediate_size=4,
            routed_expert_hidden_size=4,
        )
        cfg["linear_attn_config"].update(num_heads=1, head_dim=4)
        cfg.update(
            num_attention_heads=1, q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4
        )
        counts.clear()
        k3_reference_logits(random_k3_tensors(cfg, seed=9), cfg, torch.tensor([[1]]))
        assert len(counts) == 2 * 93 + 1 and counts[-1] == 9, (len(counts), counts[-1])
        assert counts[0] == 1 and counts[2 * 12] == 2 and counts[2 * 84] == 8 and counts[2 * 84 + 1] == 9
    finally:
        globals()["attn_res_read"] = real_read


def self_check() -> None:  # noqa: C901 - a flat list of checks
    import time

    torch.set_num_threads(1)
    start = time.time()

    def ok(msg):
        print(f"ok  {msg}  ({time.time() - start:.1f}s)")

    config = tiny_k3_config()
    tensors = random_k3_tensors(config, seed=0)
    shapes = k3_tensor_shapes(config)
    assert set(tensors) == set(shapes) and all(tuple(tensors[n].shape) == s for n, s in shapes.items())
    ok(f"random_k3_tensors: {len(tensors)} tensors with the §2 shapes")

    gen = torch.Generator().manual_seed(1)
    T = 6
    ids = torch.randint(0, config["vocab_size"], (2, T), generator=gen)
    logits = k3_reference_logits(tensors, config, ids)
    assert logits.dtype == torch.float64 and logits.shape == (2, T, config["vocab_size"])
    assert bool(torch.isfinite(logits).all())
    assert 0.1 < float(logits.std()) < 100.0, float(logits.std())
    ok(f"logits [2, {T}, 50] float64, finite, std {float(logits.std()):.3f}")

    # (a) causality: changing tokens after position t leaves logits at <= t unchanged (and does change later ones)
    cut = 3
    ids2 = ids.clone()
    ids2[:, cut + 1 :] = (ids2[:, cut + 1 :] + 7) % config["vocab_size"]
    logits2 = k3_reference_logits(tensors, config, ids2)
    assert torch.equal(logits[:, : cut + 1], logits2[:, : cut + 1])
    assert not torch.allclose(logits[:, cut + 1 :], logits2[:, cut + 1 :])
    ok("(a) causality: positions <= 3 identical, later ones differ")

    # (b) batch independence: each row computed alone equals its row in the batch
    for b in range(2):
        alone = k3_reference_logits(tensors, config, ids[b : b + 1])
        assert torch.equal(alone[0], logits[b])
    ok("(b) batch independence")

    # prefix consistency: a shorter prompt gives the same logits on its positions
    assert torch.equal(k3_reference_logits(tensors, config, ids[:, :2]), logits[:, :2])
    ok("prefix consistency (T=2 vs T=6)")

    # (c) MXFP4: known bytes, codes, scales, round trip on the grid, nearest rounding off the grid
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 2] = 0x21, 0x8F, 0x7A
    scale = torch.tensor([[127]], dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scale)
    assert w.dtype == torch.float32 and w.shape == (1, 32)
    assert w[0, :6].tolist() == [0.5, 1.0, -6.0, -0.0, -1.0, 6.0], w[0, :6].tolist()
    assert w[0, 6:].abs().sum() == 0
    assert dequantize_mxfp4(packed, torch.tensor([[128]], dtype=torch.uint8))[0, :2].tolist() == [1.0, 2.0]
    assert dequantize_mxfp4(packed, torch.tensor([[125]], dtype=torch.uint8))[0, :2].tolist() == [0.125, 0.25]
    all_codes = torch.tensor([[c | (c + 1) << 4 for c in range(0, 16, 2)] + [0] * 8], dtype=torch.uint8)
    assert dequantize_mxfp4(all_codes, scale)[0, :16].tolist() == list(E2M1_VALUES)
    # group boundary: the second scale covers elements 32..63 only
    two = dequantize_mxfp4(torch.full((1, 32), 0x22, dtype=torch.uint8), torch.tensor([[127, 129]], dtype=torch.uint8))
    assert two[0, :32].unique().tolist() == [1.0] and two[0, 32:].unique().tolist() == [4.0]
    ok("(c) dequantize: 0x21 -> [0.5, 1.0], 0x8F -> [-6, -0], all 16 codes, scales 2**(s-127), per-32 groups")

    rows, cols = 8, 96
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    codes[1, 32:64] = codes[1, 32:64] & 0b1011  # |code| <= 1.5 where the scale is 2**127 (float32 max ~ 2**128)
    grid_packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    grid_scale = torch.randint(100, 150, (rows, cols // 32), generator=gen).to(torch.uint8)
    grid_scale[0, 0] = 0  # the extreme exponents too
    grid_scale[1, 1] = 254
    w_grid = dequantize_mxfp4(grid_packed, grid_scale)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w_grid)), w_grid)
    p1, s1 = quantize_mxfp4(dequantize_mxfp4(packed, scale))
    assert torch.equal(dequantize_mxfp4(p1, s1), w)
    ok("(c) dequantize(quantize(w)) == w for w on the MXFP4 grid (random codes, scales 0..254)")

    w_off = torch.randn(4, 64, generator=gen, dtype=torch.float64) * 3.0
    w_off[0, :32] = 0.0
    qp, qs = quantize_mxfp4(w_off)
    assert qp.dtype == torch.uint8 and qp.shape == (4, 32) and qs.dtype == torch.uint8 and qs.shape == (4, 2)
    w_q = dequantize_mxfp4(qp, qs).to(F64)
    grid = torch.tensor(E2M1_VALUES, dtype=F64)
    for r in range(4):
        for gi in range(2):
            grp = w_off[r, gi * 32 : (gi + 1) * 32]
            e = int(qs[r, gi]) - 127
            amax = float(grp.abs().max())
            if amax > 0:
                assert amax / 2.0**e <= 6.0 < amax / 2.0 ** (e - 1), (amax, e)
            cand = grid * 2.0**e
            best = (grp.unsqueeze(-1) - cand).abs().min(dim=-1).values
            assert torch.equal((grp - w_q[r, gi * 32 : (gi + 1) * 32]).abs(), best)
    assert w_q[0, :32].abs().sum() == 0
    ties = quantize_mxfp4(torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24]))
    assert dequantize_mxfp4(*ties)[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    ok("(c) quantize off the grid: minimal scale with max/2**e <= 6, nearest E2M1 value, ties to even")

    # (d) scale byte 255 raises
    try:
        dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    except ValueError:
        pass
    else:
        raise AssertionError("scale 255 did not raise")
    ok("(d) scale byte 255 raises ValueError")

    # MXFP4 experts in the model: packed tensors give the logits of their dequantised dense copies
    cfg32 = tiny_k3_config(moe_intermediate_size=32, routed_expert_hidden_size=32)
    packed_tensors = random_k3_tensors(cfg32, seed=2, mxfp4=True)
    assert any(n.endswith(".weight_packed") for n in packed_tensors)
    assert not any(".experts." in n and n.endswith(".weight") for n in packed_tensors)
    dense_tensors = {}
    for name, value in packed_tensors.items():
        if name.endswith("_scale"):
            continue
        if name.endswith("_packed"):
            base = name[: -len("_packed")]
            dense_tensors[base] = dequantize_mxfp4(value, packed_tensors[base + "_scale"])
        else:
            dense_tensors[name] = value
    ids3 = ids[:1, :4]
    from_packed = k3_reference_logits(packed_tensors, cfg32, ids3)
    assert torch.equal(from_packed, k3_reference_logits(dense_tensors, cfg32, ids3))
    ok("MXFP4 experts: packed dict == dequantised dense dict")

    # relabelling the experts (gate rows, bias, expert tensors) leaves the logits unchanged
    perm = [2, 0, 3, 1]
    relabelled = dict(tensors)
    for i in range(config["num_hidden_layers"]):
        m = f"model.layers.{i}.block_sparse_moe."
        if m + "gate.weight" not in tensors:
            continue
        for suffix in ("gate.weight", "gate.e_score_correction_bias"):
            relabelled[m + suffix] = tensors[m + suffix][perm]
        for new, old in enumerate(perm):
            for w_name in ("w1", "w2", "w3"):
                relabelled[m + f"experts.{new}.{w_name}.weight"] = tensors[m + f"experts.{old}.{w_name}.weight"]
    assert torch.allclose(k3_reference_logits(relabelled, config, ids3), logits[:1, :4], rtol=0, atol=1e-12)
    ok("expert relabelling invariance")

    # A_log layouts: [H], [2H] with a zero tail, [1, 1, H, 1] agree; a non-zero tail raises
    padded, nested, bad = dict(tensors), dict(tensors), dict(tensors)
    for i in range(3):
        n = f"model.layers.{i}.self_attn.A_log"
        padded[n] = torch.cat([tensors[n], torch.zeros(2)])
        nested[n] = tensors[n].reshape(1, 1, 2, 1)
        bad[n] = torch.cat([tensors[n], torch.ones(2)])
    assert torch.equal(k3_reference_logits(padded, config, ids3), logits[:1, :4])
    assert torch.equal(k3_reference_logits(nested, config, ids3), logits[:1, :4])
    try:
        k3_reference_logits(bad, config, ids3)
    except ValueError:
        pass
    else:
        raise AssertionError("non-zero A_log tail accepted")
    ok("A_log as [H], [2H] zero tail, [1,1,H,1]; non-zero tail raises")

    # every switch off (Kimi-Linear-like): silu, no lower bound, low-rank gate, no MLA gate, q_proj, no latent,
    # plain residual, tied embeddings, one shared expert, scaling 2.5, no renormalisation
    cfg_off = tiny_k3_config(
        linear_attn_config={"use_full_rank_gate": False, "gate_lower_bound": None},
        hidden_act="silu",
        activation_situ_beta=None,
        activation_situ_linear_beta=None,
        mla_use_output_gate=False,
        q_lora_rank=None,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        attn_res_block_size=None,
        tie_word_embeddings=True,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
        moe_renormalize=False,
    )
    t_off = random_k3_tensors(cfg_off, seed=3)
    assert "lm_head.weight" not in t_off and "model.layers.0.self_attn.g_a_proj.weight" in t_off
    assert "model.layers.3.self_attn.q_proj.weight" in t_off
    assert not any("_res_" in n or "routed_expert" in n for n in t_off)
    lo = k3_reference_logits(t_off, cfg_off, ids[:1])
    lo2 = k3_reference_logits(t_off, cfg_off, ids2[:1])
    assert bool(torch.isfinite(lo).all()) and torch.equal(lo[:, : cut + 1], lo2[:, : cut + 1])
    ok("switches off (silu, softplus gate, g_a/g_b, no MLA gate, q_proj, no latent, plain residual, tied): causal")

    # no MoE at all, and a pure-MLA model without linear_attn_config
    cfg_dense = tiny_k3_config(num_experts=None, linear_attn_config=None)
    t_dense = random_k3_tensors(cfg_dense, seed=4)
    assert not any("block_sparse_moe" in n for n in t_dense) and not any("conv1d" in n for n in t_dense)
    ld = k3_reference_logits(t_dense, cfg_dense, ids[:1, :4])
    assert bool(torch.isfinite(ld).all())
    ok("num_experts null (all dense) + no linear_attn_config (all MLA)")

    _formula_checks()
    _attn_res_source_counts()
    ok("AttnRes bookkeeping: source counts per read (tiny: 4 layers / blocks of 2; K3: 93 layers / 12 -> 9 at the end)")
    ok("formula checks: conv taps, delta-rule write/read, decay on K rows, gate bound, MLA t=0, AttnRes, MoE, SiTU")

    elapsed = time.time() - start
    print(f"ALL OK in {elapsed:.1f}s")


if __name__ == "__main__":
    self_check()
