"""The paths the transformers ecosystem takes with a model, each checked against the plain model or the model's own
uncached computation: peft LoRA (unmerged), accelerate offload (from_pretrained device_map, cpu_offload,
disk_offload), quantisation (torch.ao dynamic int8, torchao int8 weight-only), torch.compile, tensor-parallel plans,
and the sequence / token classification heads (docs/ecosystem.md)."""

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from kda_hybrid.layers_kda_hybrid import plain_weight

from .helpers import (
    GENERATE_TOL,
    Generation,
    assert_same_generation,
    generate_with_logits,
    k3_model,
    prompt,
    tiny_model,
)

# MLA dense and MoE (the absorbed decode path and the router), GQA dense (no absorption, RoPE)
ARCHS = [
    pytest.param("mla", False, id="mla-dense"),
    pytest.param("mla", True, id="mla-moe"),
    pytest.param("gqa", False, id="gqa-dense"),
]
CONVS = ["q_conv1d", "k_conv1d", "v_conv1d"]


def generate_both_ways(model, ids, n=6):
    """Greedy generate with and without the cache, and one full forward over the generated sequence.
    Returns (cached, uncached: helpers.Generation, full-forward logits at the generated positions)."""
    kw = dict(max_new_tokens=n, do_sample=False)
    cached = generate_with_logits(model, ids, **kw)
    uncached = generate_with_logits(model, ids, use_cache=False, **kw)
    with torch.no_grad():
        full = model(input_ids=cached.sequences).logits[:, ids.shape[1] - 1 : -1]
    return cached, uncached, full


def assert_decode_is_full_forward(model, ids, n=6):
    """Cached greedy decode == uncached greedy decode (tokens and every step's logits), and every cached step's
    logits == the full forward's. fp32 on CPU: the cached and full paths order their sums differently (recurrent
    vs chunked KDA, latent vs expanded MLA), about 1e-6 relative at these sizes; 1e-4 is the tolerance of
    test_model's own cached-decode checks (helpers.GENERATE_TOL)."""
    cached, uncached, full = generate_both_ways(model, ids, n)
    assert_same_generation(uncached, cached, **GENERATE_TOL)
    torch.testing.assert_close(cached.logits, full, **GENERATE_TOL)
    return full


# --------------------------------------------------------------------------------------------------
# Which weights the fast paths may read directly
# --------------------------------------------------------------------------------------------------


def test_plain_weight_only_for_unwrapped_modules():
    linear, conv = nn.Linear(4, 6, bias=False), nn.Conv1d(6, 6, 3, groups=6, bias=False)
    assert plain_weight(linear, nn.Linear) is linear.weight and plain_weight(conv, nn.Conv1d) is conv.weight
    hooked = copy.deepcopy(linear)
    hooked.register_forward_pre_hook(lambda module, args: None)
    assert plain_weight(hooked, nn.Linear) is None
    with torch.device("meta"):
        assert plain_weight(nn.Linear(4, 6), nn.Linear) is None  # offloaded: the weight lives elsewhere

    class Subclass(nn.Linear):
        pass

    assert plain_weight(Subclass(4, 6), nn.Linear) is None  # a subclass may change forward
    quantised = torch.ao.quantization.quantize_dynamic(nn.Sequential(linear), {nn.Linear}, dtype=torch.qint8)[0]
    assert plain_weight(quantised, nn.Linear) is None


# --------------------------------------------------------------------------------------------------
# peft LoRA, unmerged
# --------------------------------------------------------------------------------------------------


def lora_model(attention, moe, convs=False):
    """All linear layers adapted (kv_b_proj included), random non-zero B so every adapter changes the output.
    peft LoRA on a grouped conv needs the rank divisible by the groups: the depthwise convs (groups = channels =
    32) take rank 32."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model(attention, moe)
    targets = "all-linear" if not convs else ["q_proj", "k_proj", "v_proj", "o_proj", "kv_b_proj", *CONVS]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                        rank_pattern={name: 32 for name in CONVS} if convs else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, get_peft_model(copy.deepcopy(model), config).eval()


@pytest.mark.parametrize("attention,moe", ARCHS)
def test_lora_unmerged_decode_equals_full_forward(attention, moe):
    """The adapter on kv_b_proj is applied in every decode step, not only in the prompt forward (the absorbed
    MLA path used to read the base weight and drop it: decode logits were off by 0.04-0.24)."""
    base, peft_model = lora_model(attention, moe)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert "o_proj" in wrapped and (attention != "mla" or "kv_b_proj" in wrapped)
    ids = prompt(B=2, T=9)
    full = assert_decode_is_full_forward(peft_model, ids)
    with torch.no_grad():  # the adapters matter: the check above could fail
        seq = peft_model.generate(ids, max_new_tokens=6, do_sample=False)
        assert (base(seq).logits[:, 8:-1] - full).abs().max() > 1e-2


def test_lora_on_the_short_convs_decode_and_packed():
    """LoRA on the depthwise q/k/v convs too: decode, and packed documents (whose convs must not reach across a
    document start) go through the adapted conv's own forward."""
    _, peft_model = lora_model("mla", False, convs=True)
    assert all(hasattr(getattr(peft_model.base_model.model.model.layers[0].self_attn, c), "lora_A") for c in CONVS)
    assert_decode_is_full_forward(peft_model, prompt(B=2, T=12))
    x = prompt(B=1, T=20, seed=3)
    position_ids = torch.cat([torch.arange(11), torch.arange(9)])[None]  # two documents, 11 + 9 tokens
    with torch.no_grad():
        packed = peft_model(input_ids=x, position_ids=position_ids).logits
        apart = torch.cat([peft_model(input_ids=x[:, :11]).logits, peft_model(input_ids=x[:, 11:]).logits], 1)
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=x, position_ids=position_ids).logits
    torch.testing.assert_close(packed, apart, rtol=1e-4, atol=1e-5)  # chunked KDA per document vs packed
    assert (packed - plain).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------
# accelerate offload
# --------------------------------------------------------------------------------------------------


def _from_pretrained(path, **kw):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw).eval()


def assert_same_outputs(model, reference, ids):
    """Offloading moves weights, it computes nothing differently except one route: an offloaded KDA conv runs its
    own forward (F.conv1d), a resident one the multiply-add path, which sums the taps in another order. So logits
    agree to fp32 rounding (measured 2e-6 at most), in the forward and in every cached decode step, and greedy
    tokens exactly; the offloaded model's own cached and uncached decodes agree as in
    assert_decode_is_full_forward. test_disk_offload_differs_from_resident_only_by_the_conv_route shows that
    the conv route is the whole difference."""
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    ref_cached, _, _ = generate_both_ways(reference, ids)
    cached, uncached, full = generate_both_ways(model, ids)
    assert_same_generation(cached, ref_cached, rtol=1e-5, atol=1e-5, msg="offloaded vs in memory")
    assert_same_generation(uncached, cached, **GENERATE_TOL, msg="uncached vs cached")
    torch.testing.assert_close(cached.logits, full, **GENERATE_TOL)


def _disk_offloaded(model, tmp_path):
    """(in-memory, disk-offloaded) loads of `model` saved to tmp_path: device_map="auto" with 200 KB of CPU
    memory sends the decoder layers to disk (offload_folder). The in-memory one is a from_pretrained materialised
    from meta, as transformers' own offload tests compare."""
    model.save_pretrained(tmp_path / "model")
    reference = _from_pretrained(tmp_path / "model")
    offloaded = _from_pretrained(tmp_path / "model", device_map="auto", max_memory={"cpu": "200KB"},
                                 offload_folder=tmp_path / "offload")
    assert "disk" in set(offloaded.hf_device_map.values())
    return reference, offloaded


OFFLOADED = [*ARCHS, pytest.param("k3", None, id="k3")]


def _offload_model(attention, moe):
    return k3_model() if attention == "k3" else tiny_model(attention, moe)


@pytest.mark.parametrize("attention,moe", OFFLOADED)
def test_from_pretrained_disk_offload_equals_in_memory(attention, moe, tmp_path):
    reference, model = _disk_offloaded(_offload_model(attention, moe), tmp_path)
    assert_same_outputs(model, reference, prompt(B=2, T=9))


@pytest.mark.parametrize("attention,moe", [OFFLOADED[1], OFFLOADED[-1]])
def test_disk_offload_differs_from_resident_only_by_the_conv_route(attention, moe, tmp_path):
    """Forcing the resident model's KDA convs through their own forward too (a no-op forward pre-hook makes
    plain_weight refuse the multiply-add path) makes the disk-offloaded model bit for bit equal to it: nothing
    else about offloading changes a value. Without the hooks the two differ (the route changes rounding)."""
    reference, model = _disk_offloaded(_offload_model(attention, moe), tmp_path)
    ids = prompt(B=2, T=9)
    with torch.no_grad():
        offloaded = model(input_ids=ids).logits
        assert not torch.equal(offloaded, reference(input_ids=ids).logits)  # the control: the routes differ
        for layer in reference.model.layers:
            for name in CONVS:
                conv = getattr(layer.self_attn, name, None)
                if conv is not None:
                    conv.register_forward_pre_hook(lambda module, args: None)
        assert torch.equal(offloaded, reference(input_ids=ids).logits)


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "resident"])
def test_accelerate_offload_utilities(how, tmp_path):
    """cpu_offload / disk_offload: every parameter on meta, brought in by accelerate's hooks only inside its
    module's forward (the fp32-kept A_log / dt_bias / router weights included), so the fast paths compute
    through the modules. "resident": hooks that only align devices (dispatch without offload) leave the weights
    in place, and MLA decode keeps its absorbed path."""
    import accelerate
    from accelerate.hooks import attach_align_device_hook

    reference = tiny_model("mla", True)
    model = copy.deepcopy(reference)
    if how == "cpu_offload":
        accelerate.cpu_offload(model, execution_device="cpu")
    elif how == "disk_offload":
        accelerate.disk_offload(model, tmp_path / "offload", execution_device="cpu")
    else:
        attach_align_device_hook(model, execution_device="cpu")
    attn, kv_b = model.model.layers[0].self_attn, model.model.layers[3].self_attn.kv_b_proj
    assert kv_b._hf_hook is not None
    if how == "resident":
        assert plain_weight(kv_b, nn.Linear) is kv_b.weight
    else:
        assert attn.A_log.device.type == "meta" and attn.q_conv1d.weight.device.type == "meta"
        assert kv_b.weight.device.type == "meta" and plain_weight(kv_b, nn.Linear) is None
    assert_same_outputs(model, reference, prompt(B=2, T=9))


# --------------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention,moe", ARCHS)
def test_dynamic_int8_generates_with_the_cache(attention, moe):
    """torch.ao dynamic int8 Linears: the cached decode runs through the quantised modules.

    Dynamic quantisation picks each activation's int8 scale from the whole input tensor, so a one-token decode
    step and the full forward over the sequence round activations on different grids: cached and uncached
    generation are not the same computation (a built-in LlamaForCausalLM quantised the same way differs between
    the two as well). What must hold: the cached decode is as close to the float model as the quantised full
    forward is (within twice its error), and it is not the float model (the quantised Linears were used)."""
    float_model = tiny_model(attention, moe)
    model = torch.ao.quantization.quantize_dynamic(copy.deepcopy(float_model), {nn.Linear}, dtype=torch.qint8)
    ids = prompt(B=2, T=9)
    cached, _, full = generate_both_ways(model, ids)
    decode = cached.logits
    with torch.no_grad():
        float_full = float_model(cached.sequences).logits[:, ids.shape[1] - 1 : -1]
    quantisation_error = (full - float_full).abs().max()
    assert quantisation_error > 1e-3  # the quantised Linears run in the full forward
    assert (decode - float_full).abs().max() <= 2 * quantisation_error
    assert (decode - float_full).abs().max() > 1e-3  # and in the decode steps


@pytest.mark.parametrize("attention,moe", ARCHS)
def test_torchao_int8_weight_only_decode_equals_full_forward(attention, moe):
    """Weight-only int8 (torchao): activations stay fp32, so cached and uncached generation are the same function
    of the quantised weights and must agree as the float model's do."""
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    float_model = tiny_model(attention, moe)
    model = copy.deepcopy(float_model)
    quantize_(model, Int8WeightOnlyConfig())
    assert isinstance(model.model.layers[3].self_attn.o_proj.weight, torchao.utils.TorchAOBaseTensor)
    ids = prompt(B=2, T=9)
    full = assert_decode_is_full_forward(model, ids)
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert (float_model(seq).logits[:, 8:-1] - full).abs().max() > 1e-4  # the int8 weights were used


# --------------------------------------------------------------------------------------------------
# torch.compile (inductor, CPU)
# --------------------------------------------------------------------------------------------------


def _fresh_dynamo():
    torch._dynamo.reset()


@pytest.mark.slow  # inductor compiles the forward and backward graphs: about a minute on CPU
def test_compiled_forward_and_training_step_match_eager():
    """torch.compile(model) with the default backend: the forward (chunked KDA, MLA) and one training step (loss,
    gradients, an SGD update) equal eager (SGD, not AdamW: Adam's first step g / (|g| + eps) turns the rounding of
    gradients near eps into whole-lr differences). Inductor fuses and reorders fp32 elementwise work and reductions:
    the results move by fp32 rounding (about 1e-6 relative here), amplified through the layers and the chunked
    KDA products; 1e-4 relative bounds that with room, far below any real difference (wrong masks or decay are
    off by > 1e-2)."""
    _fresh_dynamo()
    eager = tiny_model("mla", False).train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    ids, labels = prompt(B=2, T=40, seed=6), prompt(B=2, T=40, seed=7)
    losses, grads = [], []
    for m, fwd in ((eager, eager), (model, compiled)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        out = fwd(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        optimizer.step()
        losses.append((out.logits.detach(), out.loss.detach()))
    torch.testing.assert_close(losses[1][0], losses[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses[1][1], losses[0][1], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # two inductor compiles of the one-token step (static, then dynamic cache length)
@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_compiled_decode_step_matches_eager(attention):
    """The one-token decode step compiles to one graph without breaks (the dense models; torch._dynamo.explain)
    and decodes the eager model's greedy tokens, logits within fp32 rounding of the fused kernels."""
    from kda_hybrid import KDAHybridCache

    _fresh_dynamo()
    model = tiny_model(attention, False)
    ids = prompt(B=2, T=12, seed=8)
    with torch.no_grad():
        cache = KDAHybridCache(model.config)
        model(input_ids=ids, cache=cache)
        explained = torch._dynamo.explain(model)(input_ids=ids[:, -1:], cache=copy.deepcopy(cache))
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons

        def decode(forward, n=10):
            step_cache, tok, logits = copy.deepcopy(cache), ids[:, -1:], []
            for _ in range(n):
                out = forward(input_ids=tok, cache=step_cache)
                logits.append(out.logits)
                tok = out.logits[:, -1:].argmax(-1)
            return torch.cat(logits, 1)

        _fresh_dynamo()
        eager, compiled = decode(model), decode(torch.compile(model))
    assert torch.equal(eager.argmax(-1), compiled.argmax(-1))
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_generate_compile_config_is_refused_with_a_warning_not_ignored():
    """transformers compiles generate()'s decode step only for caches that declare is_compileable (fixed-shape
    StaticCache-like buffers). KDAHybridCache's attention KV grows with the sequence (docs/ecosystem.md): a
    compile_config is then skipped by transformers with its warning, and generation is unchanged."""
    from transformers import CompileConfig
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    from kda_hybrid import KDAHybridCache

    model = tiny_model("mla", False)
    ids = prompt(B=1, T=6)
    plain = model.generate(ids, max_new_tokens=4, do_sample=False)
    config = copy.deepcopy(model.generation_config)
    config.compile_config = CompileConfig()
    config.compile_config._compile_all_devices = True  # let transformers consider compiling on CPU too
    assert not model._valid_auto_compile_criteria({"cache": KDAHybridCache(model.config)}, config)
    logger = logging.get_logger("transformers.generation.utils")
    logger.warning_once.cache_clear()
    with CaptureLogger(logger) as captured:
        out = model.generate(ids, generation_config=config, max_new_tokens=4, do_sample=False)
    assert "unable to meet the criteria for compilation" in captured.out
    assert torch.equal(out, plain)

# --------------------------------------------------------------------------------------------------
# Tensor parallelism: transformers' own engine (from_pretrained(tp_plan="auto")) on 2 gloo processes
# --------------------------------------------------------------------------------------------------


def _distributed_worker(folder, mode):
    """Run by each of the torchrun processes: load with tp_plan="auto" (mode "tp") or split the layers in two
    pipeline stages (mode "pp"), record which parameters are sharded, save this process's logits and greedy
    tokens."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard
    from transformers.distributed import DistributedConfig

    kw = dict(tp_plan="auto") if mode == "tp" else dict(distributed_config=DistributedConfig(pp_size=2))
    model = _from_pretrained(folder, **kw)
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and any(isinstance(s, Shard) for s in p.placements):
            shards[name] = (tuple(p.shape), tuple(p.to_local().shape))
    inputs = torch.load(f"{folder}/inputs.pt")
    with torch.no_grad():
        logits = model(input_ids=inputs["ids"]).logits
        out = model.generate(inputs["ids"], max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    stage = [type(layer).__name__ for layer in model.model.layers]
    torch.save({"logits": logits, "tokens": out.sequences, "step_logits": torch.stack(out.logits, 1),
                "shards": shards, "world": world, "stage": stage}, f"{folder}/rank{rank}.pt")


def run_two_processes(model, tmp_path, ids, mode="tp"):
    import os
    import subprocess
    import sys

    folder = tmp_path / "model"
    model.save_pretrained(folder)
    torch.save({"ids": ids}, folder / "inputs.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    # as a module of the tests package (its relative imports need one), from the repository root on PYTHONPATH
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.test_ecosystem", str(folder), mode]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)]


TP_SHARDED = (  # one parameter of every planned kind: (name, dim that splits in two)
    ("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.self_attn.q_conv1d.weight", 0),
    ("model.layers.0.self_attn.A_log", 2), ("model.layers.0.self_attn.dt_bias", 0),
    ("model.layers.0.self_attn.f_b_proj.weight", 0), ("model.layers.0.self_attn.g_b_proj.weight", 0),
    ("model.layers.0.self_attn.b_proj.weight", 0), ("model.layers.0.self_attn.o_proj.weight", 1),
    ("model.layers.0.mlp.gate_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1),
    ("model.layers.3.self_attn.q_b_proj.weight", 0), ("model.layers.3.self_attn.kv_b_proj.weight", 0),
    ("model.layers.3.self_attn.o_proj.weight", 1),
    ("model.layers.1.block_sparse_moe.experts.0.w1.weight", 0),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", 1),
    ("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight", 0), ("lm_head.weight", 0),
)


@pytest.mark.parametrize("attention,moe,over", [  # two torchrun processes: about 15 s each
    pytest.param("mla", True, {"q_lora_rank": 12}, id="mla-qlora-moe"),
    pytest.param("gqa", False, {}, id="gqa-dense", marks=pytest.mark.slow),
])
def test_tensor_parallel_two_processes_equal_one(attention, moe, over, tmp_path):
    """KDA heads, MLA heads (q_lora: q_b_proj) or GQA heads (2 key/value heads, one per process), the dense MLP,
    routed and shared experts and lm_head split over two gloo processes on CPU: logits equal the one-process model
    (the sums are split in two partial sums and all-reduced, fp32 rounding: 1e-5), greedy tokens with the cache
    (absorbed MLA decode on the local heads) exactly."""
    model = tiny_model(attention, moe, **over)
    ids = prompt(B=2, T=11)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    generated = generate_with_logits(model, ids, max_new_tokens=6, do_sample=False)
    results = run_two_processes(model, tmp_path, ids)
    names = dict(model.named_parameters())
    sharded = [(name, dim) for name, dim in TP_SHARDED if name in names]
    sharded += [(f"model.layers.3.self_attn.{p}_proj.weight", 0) for p in "qkv" if attention == "gqa"]
    assert len(sharded) >= 12
    for name, dim in sharded:  # each process holds its part (the odd vocabulary of lm_head splits 49 + 48)
        (full, local0), (_, local1) = results[0]["shards"][name], results[1]["shards"][name]
        assert 0 < local0[dim] < full[dim] and local0[dim] + local1[dim] == full[dim], name
    for r in results:
        assert r["world"] == 2
        torch.testing.assert_close(r["logits"], reference, rtol=1e-5, atol=1e-5)
        assert_same_generation(Generation(r["tokens"], r["step_logits"]), generated, rtol=1e-5, atol=1e-5)



@pytest.mark.slow  # two torchrun processes
def test_pipeline_parallel_two_stages_equal_one(tmp_path):
    """transformers' pipeline parallelism (DistributedConfig(pp_size=2)) splits the decoder layers in two stages (the
    first holds two KDA layers, the second a KDA and the MLA layer); logits and cached greedy tokens equal the
    one-process model."""
    model = tiny_model("mla", True, q_lora_rank=12)
    ids = prompt(B=2, T=11)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    generated = generate_with_logits(model, ids, max_new_tokens=6, do_sample=False)
    results = run_two_processes(model, tmp_path, ids, mode="pp")
    identity = "PipelineIdentityLayer"
    assert [name == identity for name in results[0]["stage"]] == [False, False, True, True]
    assert [name == identity for name in results[1]["stage"]] == [True, True, False, False]
    for r in results:
        torch.testing.assert_close(r["logits"], reference, rtol=1e-5, atol=1e-6)
        assert_same_generation(Generation(r["tokens"], r["step_logits"]), generated, rtol=1e-5, atol=1e-6)

# --------------------------------------------------------------------------------------------------
# Sequence and token classification heads, through the Auto classes from a saved folder
# --------------------------------------------------------------------------------------------------


def _load_auto(auto, folder, **kw):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True, **kw)


@pytest.mark.parametrize("auto,labels_shape", [
    ("AutoModelForSequenceClassification", "rows"), ("AutoModelForTokenClassification", "tokens"),
])
def test_classification_heads_from_a_saved_causal_lm(auto, labels_shape, tmp_path):
    """A causal LM checkpoint loads into either head through its Auto class (auto_map, remote code): the decoder
    weights carried over, a fresh `score`; labels give a loss; one AdamW step lowers it."""
    lm = tiny_model("mla", True)
    lm.save_pretrained(tmp_path)
    model = _load_auto(auto, tmp_path, num_labels=3).train()
    assert type(model).__name__ == auto.replace("AutoModelFor", "KDAHybridFor")
    kv_b = "model.layers.3.self_attn.kv_b_proj.weight"
    torch.testing.assert_close(model.state_dict()[kv_b], lm.state_dict()[kv_b])
    ids = prompt(B=4, T=10, seed=2)
    gen = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 3, (4,) if labels_shape == "rows" else (4, 10), generator=gen)
    if labels_shape == "tokens":
        model.dropout.p = 0.0  # the same function before and after the step
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = model(input_ids=ids, labels=labels, use_cache=False)
    assert out.logits.shape == ((4, 3) if labels_shape == "rows" else (4, 10, 3))
    expected = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 3), labels.reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    optimizer.step()
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels, use_cache=False).loss < out.loss


def test_sequence_classification_reads_the_last_real_token(tmp_path):
    """Right padding (pad_token_id 0 after the text) and left padding (before it, with the attention mask) both
    score the row's last real token: the same logits as the row alone."""
    from kda_hybrid import KDAHybridForSequenceClassification

    torch.manual_seed(0)
    KDAHybridForSequenceClassification(tiny_model("mla").config).save_pretrained(tmp_path)
    model = _load_auto("AutoModelForSequenceClassification", tmp_path).eval()
    assert model.config.pad_token_id == 0
    short, long = prompt(B=1, T=6, seed=4), prompt(B=1, T=9, seed=5)
    pad = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=short).logits, model(input_ids=long).logits])
        right = model(input_ids=torch.cat([torch.cat([short, pad], 1), long]),
                      attention_mask=torch.cat([torch.cat([torch.ones_like(short), pad], 1), torch.ones_like(long)]))
        left = model(input_ids=torch.cat([torch.cat([pad, short], 1), long]),
                     attention_mask=torch.cat([torch.cat([pad, torch.ones_like(short)], 1), torch.ones_like(long)]))
    torch.testing.assert_close(right.logits, alone, rtol=1e-5, atol=1e-5)  # padded rows: chunked KDA, other shapes
    torch.testing.assert_close(left.logits, alone, rtol=1e-5, atol=1e-5)



def test_classification_heads_load_as_remote_code_in_a_fresh_process(tmp_path):
    """In a process that never imported kda_hybrid, the Auto classes find the heads through the saved auto_map and
    the folder's own modules (trust_remote_code), as a Hub user gets them."""
    import subprocess
    import sys

    tiny_model("gqa").save_pretrained(tmp_path)
    code = (
        "import sys, torch, transformers\n"
        "for auto in ('AutoModelForSequenceClassification', 'AutoModelForTokenClassification'):\n"
        "    m = getattr(transformers, auto).from_pretrained(sys.argv[1], trust_remote_code=True, num_labels=2)\n"
        "    assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])\n"
        "    labels = torch.tensor([0, 1]) if 'Sequence' in auto else torch.ones(2, 4, dtype=torch.long)\n"
        "    loss = m(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels).loss\n"
        "    assert torch.isfinite(loss), loss\n"
        "    print(type(m).__name__)\n"
        "assert 'kda_hybrid' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["KDAHybridForSequenceClassification", "KDAHybridForTokenClassification"]

if __name__ == "__main__":  # the torchrun worker of the tensor- and pipeline-parallel tests
    import sys

    _distributed_worker(sys.argv[1], sys.argv[2])
