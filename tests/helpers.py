"""What the test modules share, defined once: tiny model configs and builders, prompts, generations compared by
tokens and logits, KDA op inputs, the relative-error check and op gradients. Test modules import from here (and
from _native, _fake_hub, _tokenizer), never from one another."""

import copy
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM, chunk_kda
from kda_hybrid.conversion import kimi_inventory

# --------------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------------

VOCAB = 97

# test_train's shape, also passed to examples/train.py as --config-json: 4 layers = 3 KDA + 1 MLA (1-based layer
# 4), every projection kind present, a few thousand parameters per layer
TRAIN_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "linear_num_heads": 2,
               "linear_head_dim": 16, "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
               "qk_rope_head_dim": 4, "v_head_dim": 8}

FIXTURES = Path(__file__).parent / "fixtures"
K3_CONFIG = json.loads((FIXTURES / "kimi_k3_config.json").read_text())


def k3_text_config(**over):
    """The released K3 text_config at a tiny size: 6 layers (1-based 4 and 6 MLA), D 64, 2 KDA heads of 16, MLA 2
    heads with q-LoRA 16, 4 experts top-2 in a latent of 32, 2 shared experts, AttnRes blocks of 2 layers."""
    text = copy.deepcopy(K3_CONFIG["text_config"])
    text.pop("quantization_config")
    text.update(hidden_size=64, intermediate_size=96, num_hidden_layers=6, vocab_size=VOCAB, num_attention_heads=2,
                num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
                routed_expert_hidden_size=32, attn_res_block_size=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text["linear_attn_config"] = dict(text["linear_attn_config"], kda_layers=[1, 2, 3, 5], full_attn_layers=[4, 6],
                                      num_heads=2, head_dim=16)
    text.update(over)
    return text


def k3_model(seed=0, dtype=torch.float32, **over):
    """A tiny K3 model with every parameter non-trivial (norms, router bias and AttnRes queries random)."""
    torch.manual_seed(seed)
    model = KDAHybridForCausalLM(KDAHybridConfig(**k3_text_config(**over))).eval()
    randomise_defaults(model)
    return model.to(dtype)


def k3_mxfp4_model(seed=0, **over):
    """k3_model with its routed experts as MXFP4 bytes (random weights, scaled 0.3, quantised by the reference)."""
    from kda_hybrid.kimi_config_kda_hybrid import k3_quantization_config
    from kda_hybrid.layers_kda_hybrid import MXFP4Linear

    from . import k3_reference as ref

    model = k3_model(seed, quantization_config=k3_quantization_config(), **over)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MXFP4Linear):
                m.weight_packed, m.weight_scale = ref.quantize_mxfp4(
                    torch.randn(m.out_features, m.in_features, generator=gen) * 0.3)
    return model


def randomise_defaults(model):
    """Give the parameters that start at a constant (norm weights, router correction biases, AttnRes queries)
    random values, so that a test sees them: a dropped or mis-mapped one changes outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
            elif name.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)


def tiny_config(attention="mla", moe=False, **over):
    """4 layers (KDA, KDA, KDA, attention), D = 64, 2 KDA heads of 16, MLA latent 16 + rope 4 or GQA 4/2 heads;
    with `moe`, 4 experts top-2 after one dense layer. `over` replaces any config key."""
    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_size=4,
        attention_type=attention, num_attention_heads=4, num_key_value_heads=2,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_experts=4 if moe else None, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.5,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )
    cfg.update(over)
    return KDAHybridConfig(**cfg)


def tiny_model(attention="mla", moe=False, seed=0, *, attn_implementation=None, random_norms=True, **over):
    """KDAHybridForCausalLM(tiny_config(attention, moe, **over)) in eval mode, initialised from `seed`; with
    `random_norms` (default) non-default norm weights and router biases, so that every parameter matters."""
    config = tiny_config(attention, moe, **over)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = KDAHybridForCausalLM(config).eval()
    if random_norms:
        randomise_defaults(model)
    return model


def prompt(B=2, T=9, seed=1):
    """[B, T] token ids in 1..VOCAB-1 (no pad token), the same for the same seed."""
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def tiny_kimi_config(**overrides):
    """A Kimi-Linear config.json dict: 5 layers (MLA at 1-based 4), dense first layer, 4 experts top-2, odd-ish
    sizes."""
    cfg = {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 96,
        "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 5, "num_attention_heads": 2,
        "num_key_value_heads": 2, "kv_lora_rank": 12, "q_lora_rank": None, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 6, "mla_use_nope": True,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "head_dim": 8, "num_heads": 3,
                               "short_conv_kernel_size": 4},
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 12,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def random_state_dict(cfg, *, seed=0, dtype=torch.float32):
    """Random weights with realistic scales (unit activations, decays in the trained range, a router bias
    large enough that biased and unbiased routing weights differ)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in kimi_inventory(cfg).items():
        shape = spec.shape
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-4.0, -1.0, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            t = torch.rand(shape, generator=gen) * 0.5
        elif len(shape) == 1:  # norms
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("conv1d.weight"):
            t = 0.5 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        out[name] = t.to(torch.float32 if spec.fp32 else dtype)
    return out


# --------------------------------------------------------------------------------------------------
# Generations compared by tokens and logits
# --------------------------------------------------------------------------------------------------

# fp32 logits of two routes to the same tokens (cached vs uncached, batched vs alone, chunked vs whole prefill):
# the routes order their sums differently, about 1e-6 at these sizes; test_model's cached-decode tolerance
GENERATE_TOL = dict(rtol=1e-4, atol=1e-4)


@dataclass
class Generation:
    """What one generate() call gave: `sequences` as generate returns them (prompt included, except for a call
    from inputs_embeds), `logits` [rows, steps, V] the raw (unprocessed) logits of every step, stacked, and the
    whole `output` of generate (its cache, attentions, ...)."""

    sequences: torch.Tensor
    logits: torch.Tensor
    output: object = None

    @property
    def cache(self):
        return self.output.cache

    @property
    def new(self) -> torch.Tensor:
        """The generated tokens [rows, steps]: the last `steps` of each sequence (left padding and the prompt's
        length drop out)."""
        return self.sequences[:, self.sequences.shape[1] - self.logits.shape[1]:]

    def row(self, i: int) -> "Generation":
        """Row i alone, as a batch of one."""
        return Generation(self.sequences[i:i + 1], self.logits[i:i + 1])


def generate_with_logits(model, *args, **kwargs) -> Generation:
    """model.generate(*args, **kwargs) with return_dict_in_generate and output_logits: the tokens and the raw
    logits that chose them (one entry per generated token, assisted and prompt-lookup decoding included; per
    running beam under beam search)."""
    with torch.no_grad():
        out = model.generate(*args, return_dict_in_generate=True, output_logits=True, **kwargs)
    return Generation(out.sequences, torch.stack(out.logits, 1), out)


def assert_close_where_finite(actual, expected, msg="", **tol):
    """Non-finite at the same entries (-inf from a logits processor, NaN) and assert_close everywhere else."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), f"{msg}: non-finite at other entries"
    torch.testing.assert_close(actual[finite], expected[finite], msg=lambda m: f"{msg}: {m}", **tol)


def assert_same_generation(got: Generation, want: Generation, msg="generation", **tol):
    """Two routes to a greedy generation agree: the same generated tokens AND, step by step, the logits that chose
    them within `tol` (GENERATE_TOL unless given). Equal tokens alone are weak: a tiny model's argmax can hide a
    real divergence of the logits."""
    tol = tol or GENERATE_TOL
    assert got.new.shape == want.new.shape, f"{msg}: generated {tuple(got.new.shape)} vs {tuple(want.new.shape)}"
    assert torch.equal(got.new, want.new), f"{msg}: tokens differ\n{got.new}\n{want.new}"
    assert got.logits.shape == want.logits.shape, msg
    assert_close_where_finite(got.logits, want.logits, msg=f"{msg}: logits", **tol)


# --------------------------------------------------------------------------------------------------
# KDA ops: inputs, output comparison, gradients
# --------------------------------------------------------------------------------------------------


def make_inputs(B, T, H, K, V, *, gate=1.0, seed=0, dtype=torch.float32, init_state=False, requires_grad=False):
    """q, k, v [B, T, H, K|V], g [B, T, H, K], beta [B, T, H] and an initial state [B, H, K, V] (or None)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    # unit-norm keys, as the model feeds them: the delta rule is only contractive for beta * |k|^2 <= 2
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    # log-sigmoid gates as the model produces them, scaled: gate=20 reaches about -20 per token
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) * gate
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen) if init_state else None
    xs = [x.to(dtype) for x in (q, k, v, g, beta)]
    if requires_grad:
        xs = [x.requires_grad_() for x in xs]
        if h0 is not None:
            h0.requires_grad_()
    return (*xs, h0)


def max_err(a, b):
    """max |a - b| in fp32, as a float."""
    return (a.float() - b.float()).abs().max().item()


def assert_close_rel(actual, expected, rel=1e-5, name="output"):
    """max |actual - expected| <= rel * max |expected| (error relative to the output scale)."""
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual.float() - expected.float()).abs().max()
    assert err <= rel * scale, f"{name}: max abs error {err:.3e} > {rel:.0e} * scale {scale:.3e}"


def assert_all_close(got, ref, names, rel=2e-5):
    """Pairwise assert_close_rel of two equally long lists (outputs, states, gradients), each `got` finite."""
    assert len(got) == len(ref) == len(names)
    for name, a, b in zip(names, got, ref):
        assert torch.isfinite(a).all(), name
        assert_close_rel(a, b, rel=rel, name=name)


def assert_same_nonfinite_then_close(got, ref, rel=1e-5, name="output"):
    """`got` non-finite exactly where `ref` is (ref: a computation whose causality holds by construction, such as
    the token-by-token recurrence), and within assert_close_rel of it everywhere else."""
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), finite), (
        f"{name}: non-finite at {(~torch.isfinite(got)).sum()} entries, the reference at {(~finite).sum()}")
    assert finite.any(), f"{name}: nothing finite left to compare"
    assert_close_rel(torch.where(finite, got, 0), torch.where(finite, ref, 0), rel=rel, name=name)


GRAD_NAMES = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]  # chunk_grads' order


def assert_matches_reference(backend, q, k, v, g, beta, h0):
    """chunk_kda on `backend` (with an initial state, its final state, qk l2norm in the kernel): finite, and output
    and final state within assert_close_rel of the token-by-token reference."""
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = chunk_kda(q, k, v, g, beta, backend=backend, **kw)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, backend="reference", **kw)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert_close_rel(o, o_ref)
    assert_close_rel(s, s_ref)


def op_grads(fn, leaves, do, ds=None):
    """Clear the leaves' gradients, run fn() -> (o, s) and backpropagate (o * do).sum() + (s * ds).sum() (the
    state term only when `ds` is given). Returns (o, s, grads) detached, grads[i] the gradient of leaves[i]: None
    for a leaf that is None; a leaf that is not None but gets no gradient fails the test."""
    for x in leaves:
        if x is not None:
            x.grad = None
    o, s = fn()
    loss = (o * do).sum()
    if ds is not None:
        assert s is not None, "a state gradient ds was given but fn() returned no final state"
        loss = loss + (s * ds).sum()
    loss.backward()
    grads = []
    for i, x in enumerate(leaves):
        assert x is None or x.grad is not None, f"leaf {i} got no gradient"
        grads.append(None if x is None else x.grad.clone())
    return o.detach(), (None if s is None else s.detach()), grads


def chunk_grads(backend, args, do, ds=None, **kw):
    """op_grads of chunk_kda(q, k, v, g, beta, initial_state=h0, backend=backend, **kw) for args = (q, k, v, g,
    beta, h0); returns the six gradients (None where h0 is None)."""
    q, k, v, g, beta, h0 = args
    return op_grads(lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, backend=backend, **kw), args, do, ds)[2]


# --------------------------------------------------------------------------------------------------
# Checkpoint folders
# --------------------------------------------------------------------------------------------------

def read_folder(folder):
    """All tensors of a checkpoint folder (any shard layout)."""
    from safetensors import safe_open

    folder = Path(folder)
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def assert_bit_exact(actual: dict, expected: dict):
    """The same names, and per name the same dtype, shape and bytes."""
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        assert actual[name].dtype == t.dtype, name
        assert actual[name].shape == t.shape, name
        assert torch.equal(actual[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str):
    """A script of the repository (examples/..., benchmarks/...) as a module, by its path: the scripts are not a
    package and nothing edits sys.path. Registered in sys.modules under `name` (a dataclass looks its module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
