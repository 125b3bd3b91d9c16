"""kda_hybrid.inference.long_context.prefill: chunked prefill == one forward (logits and every cache state), memory
bounded by the chunk, KDA-only cache bytes exactly constant in context."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kda_hybrid import KDAHybridCache
from kda_hybrid.inference.long_context import prefill

from .helpers import VOCAB, Generation, assert_same_generation, generate_with_logits, prompt, tiny_model

ROOT = Path(__file__).resolve().parent.parent

# Chunk boundaries re-associate fp32 sums (the KDA chunk scan restarts at each forward, attention splits its
# keys): measured max |diff| vs one forward over T=130, chunks 1..200: logits 4e-7, KDA states 5e-6 (values O(1)).
# 10x that; a wrong state or mask moves them by 1e-2 or more.
LOGITS_TOL = dict(rtol=1e-5, atol=4e-6)
STATE_TOL = dict(rtol=1e-5, atol=5e-5)


def assert_caches_close(got: KDAHybridCache, want: KDAHybridCache):
    assert got.get_seq_length() == want.get_seq_length()
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert type(a) is type(b), i
        for x, y in zip(a.tensors(), b.tensors(), strict=True):
            torch.testing.assert_close(x, y, **STATE_TOL, msg=lambda m, i=i: f"layer {i}: {m}")


@pytest.mark.parametrize("attention,chunk", [
    pytest.param("mla", 1, id="mla-chunk1"),  # every token a decode step
    pytest.param("mla", 17, id="mla-chunk17"),  # 17 > the 16-token absorbed-MLA limit: SDPA over the cache
    pytest.param("mla", 45, id="mla-chunk45"),
    pytest.param("mla", 300, id="mla-chunk300"),  # longer than the prompt: one forward
    pytest.param("gqa", 17, id="gqa-chunk17"),
    pytest.param("gqa", 45, id="gqa-chunk45"),
])
def test_prefill_equals_one_forward(attention, chunk):
    """T = 100 is a multiple of none of the chunks."""
    model = tiny_model(attention)
    ids = prompt(B=2, T=100)
    with torch.no_grad():
        want = model(ids, use_cache=True)
    logits, cache = prefill(model, ids, chunk_size=chunk)
    assert logits.shape == (2, VOCAB)
    torch.testing.assert_close(logits, want.logits[:, -1], **LOGITS_TOL)
    assert_caches_close(cache, want.cache)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_prefill_continues_an_existing_cache(attention):
    model = tiny_model(attention)
    ids = prompt(B=2, T=150)
    with torch.no_grad():
        want = model(ids, use_cache=True)
        cache = model(ids[:, :41], use_cache=True).cache
    logits, cache2 = prefill(model, ids[:, 41:], chunk_size=23, cache=cache)
    assert cache2 is cache and cache.get_seq_length() == 150
    torch.testing.assert_close(logits, want.logits[:, -1], **LOGITS_TOL)
    assert_caches_close(cache, want.cache)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_prefill_with_left_padding(attention):
    """A [B, past + T] mask as generate() passes it; row 1 has 37 pads, so its first chunk (20) is all padding."""
    model = tiny_model(attention)
    ids = prompt(B=2, T=90)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=True)
    logits, cache = prefill(model, ids, chunk_size=20, attention_mask=mask)
    torch.testing.assert_close(logits, want.logits[:, -1], **LOGITS_TOL)
    assert_caches_close(cache, want.cache)
    # continuing a padded cache takes the whole mask, past included
    more = prompt(B=2, T=30, seed=5)
    full_mask = torch.cat((mask, torch.ones_like(more)), 1)
    with torch.no_grad():
        want = model(torch.cat((ids, more), 1), attention_mask=full_mask, use_cache=True)
    logits, cache = prefill(model, more, chunk_size=19, cache=cache, attention_mask=full_mask)
    torch.testing.assert_close(logits, want.logits[:, -1], **LOGITS_TOL)
    assert_caches_close(cache, want.cache)


def test_generate_chunked_prefill_mla_matches_one_shot():
    """generate(prefill_chunk_size) with chunks longer than the absorbed-MLA limit (the SDPA continuation path)."""
    model = tiny_model("mla")
    ids = prompt(B=1, T=70)
    greedy = dict(max_new_tokens=8, do_sample=False)
    one = generate_with_logits(model, ids, **greedy)
    assert_same_generation(generate_with_logits(model, ids, prefill_chunk_size=24, **greedy), one, **LOGITS_TOL)
    # and the helper's cache continues into generate(): its logits pick the first token, generate the other 7
    logits, cache = prefill(model, ids, chunk_size=24)
    first = logits.argmax(-1, keepdim=True)
    torch.testing.assert_close(logits, one.logits[:, 0], **LOGITS_TOL)
    out = generate_with_logits(model, torch.cat((ids, first), 1), cache=cache, max_new_tokens=7, do_sample=False)
    assert torch.equal(out.sequences, one.sequences)
    assert_same_generation(out, Generation(one.sequences, one.logits[:, 1:]), **LOGITS_TOL)  # steps 2 .. 8


def test_prefill_rejects_bad_arguments():
    model = tiny_model("mla")
    ids = prompt(B=2, T=10)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill(model, ids, chunk_size=0)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        prefill(model, ids[0])
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, past \+ T\] = \(2, 20\)"):
        prefill(model, ids, cache=cache, attention_mask=torch.ones_like(ids))


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


def test_kda_only_cache_bytes_exactly_constant_in_context():
    model = tiny_model(random_norms=False, num_hidden_layers=3, layer_types=["linear_attention"] * 3)
    H, K, width, n_layers, B = 2, 16, 4 - 1, 3, 2
    expected = n_layers * B * (3 * H * K * width + H * K * K) * 4  # q, k, v conv states + fp32 [H, K, V] state
    sizes = set()
    cache = None
    for n in (1, 1, 63, 200):  # 1 .. 265 tokens, continued chunk by chunk and one token at a time
        _, cache = prefill(model, prompt(B=B, T=n, seed=n), chunk_size=64, cache=cache)
        report = cache.memory_report()
        assert report["attention_kv_bytes"] == 0 and report["kv_bytes_per_token_per_sequence"] == 0
        sizes.add(report["total_bytes"])
    assert sizes == {expected}, (sizes, expected)
    assert cache.get_seq_length() == 265


def test_hybrid_cache_grows_by_exactly_the_attention_kv():
    model = tiny_model("mla")  # 3 KDA + 1 MLA, latent 16 + rope 4 per token
    _, cache = prefill(model, prompt(B=1, T=10), chunk_size=4)
    r10 = cache.memory_report()
    _, cache = prefill(model, prompt(B=1, T=90, seed=2), chunk_size=32, cache=cache)
    r100 = cache.memory_report()
    assert r100["kda_state_bytes"] == r10["kda_state_bytes"]
    assert r100["kv_bytes_per_token_per_sequence"] == (16 + 4) * 4
    assert r100["attention_kv_bytes"] - r10["attention_kv_bytes"] == 90 * (16 + 4) * 4


MEMORY_PROBE = textwrap.dedent("""
    import gc, json, sys, torch
    torch.set_num_threads(1)
    from kda_hybrid import KDAHybridConfig, KDAHybridForCausalLM
    from kda_hybrid.inference.long_context import prefill
    T, chunk = int(sys.argv[1]), int(sys.argv[2])

    def status(key):  # kB -> bytes
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024

    def peak_growth(run):
        gc.collect()
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
        start = status("VmRSS")
        out = run()
        return status("VmHWM") - start, out

    results = {}
    for name, layer_types in json.loads(sys.argv[3]).items():
        cfg = KDAHybridConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=len(layer_types),
                              layer_types=layer_types, linear_num_heads=2, linear_head_dim=64, num_attention_heads=2,
                              kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        torch.manual_seed(0)
        model = KDAHybridForCausalLM(cfg).eval()
        ids = torch.randint(3, 97, (1, T))
        prefill(model, ids[:, : 2 * chunk], chunk_size=chunk)  # warm-up: first-call allocations
        chunked, (_, cache) = peak_growth(lambda: prefill(model, ids, chunk_size=chunk))
        kv = cache.memory_report()["attention_kv_bytes"]
        del cache
        with torch.no_grad():  # control: the whole prompt in one forward
            one_forward, _ = peak_growth(lambda: model(ids, use_cache=True, logits_to_keep=1).logits)
        results[name] = dict(chunked=chunked, one_forward=one_forward, kv=kv)
    print(json.dumps(results))
""")
MODELS = {"hybrid": ["linear_attention"] * 3 + ["full_attention"], "kda_only": ["linear_attention"] * 4}
SHORT, LONG, CHUNK = 2048, 6144, 1024
SLACK = 2 * 2**20  # repeated probes agree within 0.3 MiB


@pytest.fixture(scope="module")
def probe():
    """Peak RSS growth of chunked prefills of SHORT and LONG tokens, one fresh process per length. The peak is
    VmHWM reset to the current RSS just before each prefill (ru_maxrss cannot be reset); glibc's mmap threshold is
    fixed at 64 KiB so that freed tensors leave RSS at once instead of being kept by malloc for reuse (with the
    default, dynamic threshold, equal runs differed by up to 14 MiB)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    results = {}
    for T in (SHORT, LONG):
        out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(T), str(CHUNK), json.dumps(MODELS)],
                             capture_output=True, text=True, cwd=ROOT, timeout=300, check=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)})
        results[T] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def test_chunked_prefill_memory_grows_only_with_the_attention_cache(probe):
    """Prompts of 2K and 6K tokens in chunks of 1024 through a 3 KDA + 1 MLA model (hidden 128). The peak's growth
    from 2K to 6K may only come from context-sized attention tensors: the MLA cache (buffers of up to 2x the tokens,
    plus the old buffer while one grows: 3x) and, while one MLA layer runs, its per-head keys and values
    re-expanded from the latent (kv_b_proj output H*(nope+v), keys H*(nope+rope), values padded to the key width),
    fp32. Measured: 0.7 MiB growth against a 9.5 MiB bound; with transformers' [chunk, context] mask the chunked
    path grew 25 MiB, and the one-forward control grows 60 MiB."""
    small, large = probe[SHORT]["hybrid"], probe[LONG]["hybrid"]
    H, nope, rope, v = 2, 32, 16, 32
    kv_growth = large["kv"] - small["kv"]
    assert kv_growth == (LONG - SHORT) * (32 + 16) * 4
    expansion = (LONG - SHORT) * H * ((nope + v) + (nope + rope) + (nope + rope)) * 4
    bound = 3 * kv_growth + expansion + SLACK
    growth = large["chunked"] - small["chunked"]
    assert growth <= bound, f"chunked prefill grew {growth / 2**20:.1f} MiB from 2K to 6K; bound {bound / 2**20:.1f}"
    control = large["one_forward"] - small["one_forward"]
    assert control > 3 * bound, f"control: one forward grew only {control / 2**20:.1f} MiB (bound {bound / 2**20:.1f})"


def test_kda_only_chunked_prefill_memory_is_flat(probe):
    """The same with 4 KDA layers: nothing grows with context, so 2K -> 6K may differ by the slack only."""
    small, large = probe[SHORT]["kda_only"], probe[LONG]["kda_only"]
    assert small["kv"] == large["kv"] == 0
    growth = large["chunked"] - small["chunked"]
    assert abs(growth) <= SLACK, f"KDA-only chunked prefill grew {growth / 2**20:.1f} MiB from 2K to 6K"
    control = large["one_forward"] - small["one_forward"]
    assert control > 3 * SLACK, f"control: one forward grew only {control / 2**20:.1f} MiB"
