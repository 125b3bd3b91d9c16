"""KDAHybridCache on its own: operations that fail change nothing, a cache refuses a model, batch or prompt it
does not belong to, and every public member of transformers' Cache works or raises NotImplementedError."""

import copy
import dataclasses
import inspect

import pytest
import torch
from transformers.cache_utils import Cache

import kda_hybrid.fingerprint_kda_hybrid as fingerprint
from kda_hybrid import KDAHybridCache
from kda_hybrid.cache_layers_kda_hybrid import KDAHybridCacheLayer, KDALayerState, KVLayerState

from . import helpers
from .helpers import VOCAB, assert_same_generation, generate_with_logits, prompt

FULL, KDA = "full_attention", "linear_attention"
# Attention first: a crop that fails in a KDA layer used to have cropped layer 0 already
LAYER_TYPES = [FULL, KDA, KDA, FULL]
ATTN_IDX, KDA_IDX = 0, 1
# Same kernels on the same shapes are bit-identical; differently batched or chunked runs of the same tokens
# differ by fp32 rounding over a few 64-wide reductions (~1e-6 on these logits)
CLOSE = dict(rtol=1e-5, atol=1e-5)


def tiny_config(**over):
    """helpers.tiny_config in this module's layer order (`over` may replace it)."""
    return helpers.tiny_config(**{"layer_types": LAYER_TYPES, **over})


def tiny_model(seed=0, **over):
    """helpers.tiny_model in this module's layer order, default-initialised norms."""
    return helpers.tiny_model(seed=seed, random_norms=False, **{"layer_types": LAYER_TYPES, **over})


@pytest.fixture(scope="module")
def model():
    return tiny_model()


IDS = prompt(B=2, T=12)
NEXT = prompt(B=2, T=1, seed=9)


@torch.no_grad()
def filled(model, record=True) -> KDAHybridCache:
    """11 tokens in 3 forwards; with `record`, the last 5 (two forwards) are recorded for crop."""
    cache = KDAHybridCache(model.config)
    model(IDS[:, :6], cache=cache)
    if record:
        cache.activate_past_recording()
    model(IDS[:, 6:8], cache=cache)
    model(IDS[:, 8:11], cache=cache)
    return cache


def snapshot(cache: KDAHybridCache):
    """Everything the cache holds, copied: per layer its live tensors, lengths and rollback records; the token
    count and the fingerprint."""
    layers = []
    for layer in cache.layers:
        if isinstance(layer, KVLayerState):
            layers.append(("kv", layer.length, [t.clone() for t in layer.tensors()]))
        else:
            segments = [[getattr(seg, f.name) for f in dataclasses.fields(seg)] for seg in layer.segments]
            layers.append(("kda", layer.record_past, [t.clone() for t in layer.tensors()],
                           copy.deepcopy(segments)))
    return dict(seen=cache.get_seq_length(), layers=layers, fingerprint=copy.deepcopy(cache.fingerprint.value),
                known=cache.fingerprint.known, records=copy.deepcopy(cache.fingerprint.records))


def assert_same(a, b, where="cache"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@torch.no_grad()
def next_logits(model, cache, ids=NEXT):
    return model(ids, cache=cache).logits


# --------------------------------------------------------------------------------------------------
# Failed operations change nothing
# --------------------------------------------------------------------------------------------------

FAILURES = [
    # crop
    pytest.param(False, "crop", (-1,), RuntimeError, "activate_past_recording", id="crop-not-recording"),
    pytest.param(True, "crop", (-6,), RuntimeError, "only the last 5", id="crop-past-recorded"),
    pytest.param(True, "crop", (-12,), ValueError, "holding 11", id="crop-past-seen"),
    pytest.param(True, "crop", (2,), ValueError, "negative", id="crop-positive"),
    pytest.param(True, "crop", (-1.0,), TypeError, "must be an int", id="crop-float"),
    pytest.param(True, "crop", (True,), TypeError, "must be an int", id="crop-bool"),
    pytest.param(True, "crop", ("-1",), TypeError, "must be an int", id="crop-str"),
    pytest.param(True, "crop", (torch.tensor(-1.0),), TypeError, "must be an int", id="crop-float-tensor"),
    # reorder_cache
    pytest.param(True, "reorder_cache", (torch.tensor([0]),), ValueError, "one index per cached row",
                 id="reorder-short"),
    pytest.param(True, "reorder_cache", (torch.tensor([1, 0, 1]),), ValueError, "one index per cached row",
                 id="reorder-long"),
    pytest.param(True, "reorder_cache", (torch.tensor([1.0, 0.0]),), TypeError, "integer", id="reorder-float"),
    pytest.param(True, "reorder_cache", (torch.tensor([True, False]),), TypeError, "integer", id="reorder-bool"),
    pytest.param(True, "reorder_cache", (torch.tensor([0, 2]),), ValueError, r"lie in \[0, 2\)",
                 id="reorder-out-of-range"),
    pytest.param(True, "reorder_cache", (torch.tensor([-1, 0]),), ValueError, r"lie in \[0, 2\)",
                 id="reorder-negative"),
    pytest.param(True, "reorder_cache", (torch.tensor([[1, 0]]),), ValueError, "1-D", id="reorder-2d"),
    pytest.param(True, "reorder_cache", ([1, 0],), TypeError, "tensor", id="reorder-list"),
    # batch_select_indices
    pytest.param(True, "batch_select_indices", (torch.tensor([1.0]),), TypeError, "integer", id="select-float"),
    pytest.param(True, "batch_select_indices", (torch.tensor([2]),), ValueError, "lie in", id="select-out-of-range"),
    pytest.param(True, "batch_select_indices", (torch.tensor([], dtype=torch.long),), ValueError, "non-empty",
                 id="select-empty"),
    pytest.param(True, "batch_select_indices", (torch.tensor([[0]]),), ValueError, "1-D", id="select-2d"),
    # batch_repeat_interleave
    pytest.param(True, "batch_repeat_interleave", (0,), ValueError, ">= 1", id="repeat-zero"),
    pytest.param(True, "batch_repeat_interleave", (-2,), ValueError, ">= 1", id="repeat-negative"),
    pytest.param(True, "batch_repeat_interleave", (2.0,), TypeError, "must be an int", id="repeat-float"),
    pytest.param(True, "batch_repeat_interleave", (True,), TypeError, "must be an int", id="repeat-bool"),
    # early_initialization
    pytest.param(True, "early_initialization", (3,), ValueError, "holds 2 sequences", id="early-init-other-batch"),
    pytest.param(True, "early_initialization", (0,), ValueError, ">= 1", id="early-init-zero"),
    pytest.param(True, "early_initialization", (2, 1, 99), ValueError, "head_dim must be 16",
                 id="early-init-head-dim"),
]


@pytest.mark.parametrize("record,op,args,exc,match", FAILURES)
def test_failed_operation_changes_nothing(model, record, op, args, exc, match):
    cache = filled(model, record)
    untouched = copy.deepcopy(cache)
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        getattr(cache, op)(*args)
    assert_same(snapshot(cache), before)
    # same kernels, same shapes, same states: the next step is bit-identical to the untouched cache's
    assert torch.equal(next_logits(model, cache), next_logits(model, untouched))
    assert cache.get_seq_length() == untouched.get_seq_length() == 12


def test_crop_within_the_records_after_a_failed_one(model):
    """The failed crop of issue 14 (past what was recorded) used to crop the attention layers already."""
    cache = filled(model)
    with pytest.raises(RuntimeError):
        cache.crop(-6)
    cache.crop(-4)  # 4 of the 5 recorded tokens: into the first recorded forward
    with torch.no_grad():
        ref = model(IDS[:, :7], use_cache=True).cache
    for layer in cache.layers:
        if isinstance(layer, KVLayerState):
            assert layer.length == 7
    torch.testing.assert_close(next_logits(model, cache), next_logits(model, ref), **CLOSE)


def test_select_then_crop_rolls_back_the_selected_rows(model):
    """batch_select_indices keeps the rollback records (of the kept rows) instead of dropping them."""
    cache = filled(model)
    cache.batch_select_indices(torch.tensor([1]))
    cache.crop(-3)
    with torch.no_grad():
        ref = model(IDS[1:2, :8], use_cache=True).cache
    torch.testing.assert_close(next_logits(model, cache, NEXT[1:]), next_logits(model, ref, NEXT[1:]), **CLOSE)


# --------------------------------------------------------------------------------------------------
# A cache refuses a model, a batch or a prompt it does not belong to
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("over,match", [
    pytest.param(dict(layer_types=[KDA, KDA, KDA, FULL]), "layer_types", id="layer-pattern"),
    pytest.param(dict(num_hidden_layers=5, layer_types=LAYER_TYPES + [KDA]), "5 layers", id="layer-count"),
    pytest.param(dict(linear_head_dim=8), "linear_head_dim: cache 16, model 8", id="kda-head-dim"),
    pytest.param(dict(linear_num_heads=4), "linear_num_heads: cache 2, model 4", id="kda-heads"),
    pytest.param(dict(linear_conv_kernel_size=3), "linear_conv_kernel_size", id="conv-kernel"),
    pytest.param(dict(kv_lora_rank=8), "kv_lora_rank: cache 16, model 8", id="mla-latent"),
    pytest.param(dict(attention_type="gqa"), "attention_type: cache 'mla', model 'gqa'", id="mla-vs-gqa"),
])
def test_cache_of_another_model_is_a_clear_error(model, over, match):
    cache = filled(model)
    before = snapshot(cache)
    other = tiny_model(**over)
    with pytest.raises(ValueError, match=match):
        with torch.no_grad():
            other(NEXT, cache=cache)
    assert_same(snapshot(cache), before)


def test_gqa_head_shapes_are_compared():
    cache = KDAHybridCache(tiny_config(attention_type="gqa"))
    with pytest.raises(ValueError, match="num_key_value_heads: cache 2, model 4"):
        cache.check_compatible(tiny_config(attention_type="gqa", num_key_value_heads=4))
    with pytest.raises(ValueError, match="head_dim: cache 16, model 8"):
        cache.check_compatible(tiny_config(attention_type="gqa", head_dim=8))
    cache.check_compatible(tiny_config(attention_type="gqa", num_attention_heads=8, num_key_value_heads=2,
                                       head_dim=16))  # query heads are not cached


def test_other_batch_size_is_a_clear_error(model):
    cache = filled(model)
    before = snapshot(cache)
    for B in (1, 3):
        with pytest.raises(ValueError, match=f"holds 2 sequences but the input has batch size {B}"):
            next_logits(model, cache, prompt(B=B, T=1))
    assert_same(snapshot(cache), before)


def test_reset_cache_takes_another_batch_size(model):
    cache = filled(model)
    cache.reset()
    ids = prompt(B=3, T=5, seed=4)
    with torch.no_grad():
        got = model(ids, cache=cache).logits
        want = model(ids).logits
    torch.testing.assert_close(got, want, **CLOSE)
    assert cache.batch_size == 3 and cache.get_seq_length() == 5


def test_generate_refuses_a_cache_of_another_prompt(model):
    turn1 = prompt(B=1, T=8)
    out1 = model.generate(turn1, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    cache = out1.cache
    L = cache.get_seq_length()
    assert L == out1.sequences.shape[1] - 1  # the last generated token is not fed yet
    before = snapshot(cache)
    with pytest.raises(ValueError, match=f"are not the {L} tokens this cache holds"):
        model.generate(prompt(B=1, T=14, seed=7), cache=cache, max_new_tokens=2)
    one_token_off = torch.cat([out1.sequences, prompt(B=1, T=3, seed=5)], 1)
    one_token_off[0, L - 1] = (one_token_off[0, L - 1] + 1) % VOCAB
    with pytest.raises(ValueError, match=r"rows \[0\] differ"):
        model.generate(one_token_off, cache=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="at least one new token"):
        model.generate(out1.sequences[:, :L], cache=cache, max_new_tokens=2)
    assert_same(snapshot(cache), before)
    # the right continuation still works and equals a fresh run
    ids2 = torch.cat([out1.sequences, prompt(B=1, T=3, seed=5)], 1)
    resumed = generate_with_logits(model, ids2, cache=cache, max_new_tokens=4, do_sample=False)
    assert_same_generation(resumed, generate_with_logits(model, ids2, max_new_tokens=4, do_sample=False), **CLOSE)


def test_second_turn_of_a_left_padded_batch_equals_a_fresh_run(model):
    """The fingerprint covers the pads the cache consumed: the next turn passes them again, as generate()
    returned them."""
    ids1 = prompt(B=2, T=7, seed=3)
    ids1[0, :2] = 0
    mask1 = torch.ones_like(ids1)
    mask1[0, :2] = 0
    out1 = model.generate(ids1, attention_mask=mask1, max_new_tokens=4, do_sample=False,
                          return_dict_in_generate=True)
    ids2 = torch.cat([out1.sequences, prompt(B=2, T=3, seed=6)], 1)
    mask2 = torch.cat([mask1, torch.ones(2, ids2.shape[1] - mask1.shape[1], dtype=mask1.dtype)], 1)
    resumed = generate_with_logits(model, ids2, attention_mask=mask2, cache=out1.cache, max_new_tokens=5,
                                   do_sample=False)
    fresh = generate_with_logits(model, ids2, attention_mask=mask2, max_new_tokens=5, do_sample=False)
    assert_same_generation(resumed, fresh, **CLOSE)


def test_cache_filled_from_embeddings_is_not_checked(model):
    """inputs_embeds carry no token ids: the cache cannot know its tokens and lets generate() continue."""
    ids = prompt(B=1, T=8)
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(ids), cache=cache)
    full = torch.cat([ids, prompt(B=1, T=2, seed=8)], 1)
    resumed = generate_with_logits(model, full, cache=cache, max_new_tokens=3, do_sample=False)
    fresh = generate_with_logits(model, full, max_new_tokens=3, do_sample=False)
    assert_same_generation(resumed, fresh, **CLOSE)
    # and the other way round: a cache of token ids continued by generate(inputs_embeds=...) of the whole prompt
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    new = generate_with_logits(model, inputs_embeds=model.get_input_embeddings()(full), cache=cache,
                               max_new_tokens=3, do_sample=False)
    assert new.sequences.shape == (1, 3)  # from inputs_embeds generate returns the new tokens only
    assert_same_generation(new, fresh, **CLOSE)


def test_fingerprint_follows_crop_exactly(model):
    """After a crop that ends inside a recorded forward, the fingerprint is that of the kept tokens: the same
    integers as a cache that only ever saw them."""
    ids = prompt(B=2, T=14)
    cache = KDAHybridCache(model.config)
    fresh = KDAHybridCache(model.config)
    with torch.no_grad():
        model(ids[:, :6], cache=cache)
        cache.activate_past_recording()
        for a, b in ((6, 8), (8, 10), (10, 14)):
            model(ids[:, a:b], cache=cache)
        cache.crop(-5)
        for a, b in ((0, 4), (4, 5), (5, 9)):  # other chunking: the hash is of the tokens, not of the calls
            model(ids[:, a:b], cache=fresh)
    assert torch.equal(cache.fingerprint.value, fresh.fingerprint.value)
    cache.check_generation_inputs(ids[:, :10], next_sequence_length=1, is_first_iteration=True)
    wrong = ids[:, :10].clone()
    wrong[1, 8] = (wrong[1, 8] + 1) % VOCAB
    with pytest.raises(ValueError, match=r"rows \[1\] differ"):
        cache.check_generation_inputs(wrong, next_sequence_length=1, is_first_iteration=True)


def test_fingerprint_hash_equals_python_integers(monkeypatch):
    """The vectorised int64 hash against the polynomial computed token by token with Python's exact integers,
    for one call, chunked calls, decode steps, and across the internal chunk boundary."""
    ids = torch.randint(0, 163840, (3, 130), generator=torch.Generator().manual_seed(0))  # Kimi's vocab size
    want = torch.tensor([[_python_hash(row.tolist(), b, p) for b, p in zip(fingerprint._HASH_BASES,
                                                                         fingerprint._HASH_MODULI)] for row in ids])
    zero = torch.zeros(3, 2, dtype=torch.int64)
    assert torch.equal(fingerprint.extend_fingerprint(zero, ids), want)
    for step in (1, 7):
        h = zero
        for i in range(0, ids.shape[1], step):
            h = fingerprint.extend_fingerprint(h, ids[:, i : i + step])
        assert torch.equal(h, want), step
    monkeypatch.setattr(fingerprint, "_HASH_CHUNK", 32)
    assert torch.equal(fingerprint.extend_fingerprint(zero, ids), want)
    assert not torch.equal(fingerprint.extend_fingerprint(zero, ids.flip(1)), want)  # order matters


def _python_hash(tokens, base, p):
    h = 0
    for t in tokens:
        h = (h * base + t + 1) % p
    return h


def test_fingerprint_is_fixed_size_and_reported(model):
    reports = []
    for T in (8, 40):
        with torch.no_grad():
            reports.append(model(prompt(B=2, T=T), use_cache=True).cache.memory_report())
    a, b = reports
    assert a["token_fingerprint_bytes"] == b["token_fingerprint_bytes"] == 2 * 16
    assert a["kda_state_bytes"] == b["kda_state_bytes"] > 0
    assert a["total_bytes"] == a["kda_state_bytes"] + a["attention_kv_bytes"]


# --------------------------------------------------------------------------------------------------
# The layer protocol and every public member of transformers' Cache
# --------------------------------------------------------------------------------------------------


def test_layers_implement_the_declared_protocol(model):
    cache = filled(model)
    assert all(isinstance(layer, KDAHybridCacheLayer) for layer in cache.layers)
    abstract = KDAHybridCacheLayer.__abstractmethods__
    assert {"tensors", "map_tensors", "check_crop", "crop", "reset", "release", "early_initialization"} <= abstract
    for cls in (KDALayerState, KVLayerState):
        assert not cls.__abstractmethods__, cls

    class Incomplete(KDAHybridCacheLayer):
        def tensors(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def _shapes(x):
    return None if x is None else tuple(x.shape)


@torch.no_grad()
def _ref_logits(model, ids, next_ids=NEXT):
    return model(next_ids, cache=model(ids, use_cache=True).cache).logits


# name -> (call, check(model, cache, result, before_snapshot, reference_next_logits)); None: NotImplementedError
def _unchanged(model, cache, result, before, ref):
    assert_same(snapshot(cache), before)
    assert torch.equal(next_logits(model, cache), ref)


API = {
    "activate_past_recording": (lambda c: c.activate_past_recording(), _unchanged),  # already recording
    # transformers 5.25 passes how many steps a linear cache may roll back; a KDA layer records forwards whole
    "get_recurrent_states_to_keep": (lambda c: (c.activate_past_recording(recurrent_states_to_keep=3),
                                                c.get_recurrent_states_to_keep(), c.get_recurrent_states_to_keep(1)),
                                     lambda m, c, r, b, ref: r == (None, 0, 0)
                                     and torch.testing.assert_close(next_logits(m, c), ref, **CLOSE) is None),
    "increase_count": None,
    "batch_repeat_interleave": (
        lambda c: c.batch_repeat_interleave(2),
        lambda m, c, r, b, ref: torch.testing.assert_close(
            next_logits(m, c, NEXT.repeat_interleave(2, 0)), ref.repeat_interleave(2, 0), **CLOSE)),
    "batch_select_indices": (
        lambda c: c.batch_select_indices(torch.tensor([1])),
        lambda m, c, r, b, ref: torch.testing.assert_close(next_logits(m, c, NEXT[1:]), ref[1:], **CLOSE)),
    "batch_size": (lambda c: c.batch_size, lambda m, c, r, b, ref: r == 2),
    "crop": (
        lambda c: c.crop(-2),
        lambda m, c, r, b, ref: torch.testing.assert_close(next_logits(m, c), _ref_logits(m, IDS[:, :9]), **CLOSE)),
    # transformers' own call shape: (batch, heads, head_dim, dtype, device) of the keys; layers holding tokens
    # stay as they are
    "early_initialization": (lambda c: c.early_initialization(2, 1, 16, torch.float32, "cpu"), _unchanged),
    "get_conv_state": (lambda c: c.get_conv_state(KDA_IDX, 2), lambda m, c, r, b, ref: _shapes(r) == (2, 32, 3)),
    "get_mask_sizes": (lambda c: c.get_mask_sizes(3, 0), lambda m, c, r, b, ref: r == (14, 0)),
    "get_max_length": (lambda c: c.get_max_length(), lambda m, c, r, b, ref: r == -1),
    "get_query_offset": (lambda c: c.get_query_offset(), lambda m, c, r, b, ref: r == 11),
    "get_recurrent_state": (lambda c: c.get_recurrent_state(KDA_IDX),
                            lambda m, c, r, b, ref: _shapes(r) == (2, 2, 16, 16) and r.dtype == torch.float32),
    "get_seq_length": (lambda c: c.get_seq_length(), lambda m, c, r, b, ref: r == 11),
    "has_previous_state": (lambda c: c.has_previous_state(KDA_IDX), lambda m, c, r, b, ref: r is True),
    "is_compileable": (lambda c: c.is_compileable, lambda m, c, r, b, ref: r is False),
    "is_croppable": (lambda c: c.is_croppable, lambda m, c, r, b, ref: r is True),
    "is_dummy": (lambda c: c.is_dummy, lambda m, c, r, b, ref: r == [False] * 4),
    "is_initialized": (lambda c: c.is_initialized, lambda m, c, r, b, ref: r is True),
    "is_linear": (lambda c: c.is_linear, lambda m, c, r, b, ref: r == [False, True, True, False]),
    "is_recording_past": (lambda c: c.is_recording_past(KDA_IDX), lambda m, c, r, b, ref: r is True),
    "is_sliding": (lambda c: c.is_sliding, lambda m, c, r, b, ref: r == [False] * 4),
    "offload": (lambda c: [c.offload(i) for i in range(len(c))], _unchanged),  # forward brings them back
    "prefetch": (lambda c: c.prefetch(0), _unchanged),
    "reorder_cache": (
        lambda c: c.reorder_cache(torch.tensor([1, 0])),
        # rows swapped: the same arithmetic at other batch positions, so fp32 tolerance, not bit equality
        lambda m, c, r, b, ref: torch.testing.assert_close(next_logits(m, c, NEXT.flip(0)), ref.flip(0),
                                                           **CLOSE) is None),
    "reset": (
        lambda c: c.reset(),
        lambda m, c, r, b, ref: c.get_seq_length() == 0
        and torch.testing.assert_close(next_logits(m, c), m(NEXT).logits, **CLOSE) is None),
    "update": None,
    "update_conv_state": None,
    "update_indexer": None,
    "update_recurrent_state": None,
    "__len__": (lambda c: len(c), lambda m, c, r, b, ref: r == 4),
    "__repr__": (lambda c: repr(c), lambda m, c, r, b, ref: r.startswith("KDAHybridCache(tokens=11,")),
}
NOT_IMPLEMENTED_ARGS = {
    "update": lambda c: c.update(torch.zeros(2, 1, 1, 16), torch.zeros(2, 1, 1, 4), ATTN_IDX),
    "update_conv_state": lambda c: c.update_conv_state(torch.zeros(2, 32, 3), KDA_IDX),
    "update_indexer": lambda c: c.update_indexer(torch.zeros(2, 1, 8), ATTN_IDX),
    "increase_count": lambda c: c.increase_count(KDA_IDX, 0),
    "update_recurrent_state": lambda c: c.update_recurrent_state(torch.zeros(2, 2, 16, 16), KDA_IDX),
}


def test_every_public_member_of_cache_is_classified():
    """A member transformers adds to Cache must be looked at here: it either works on KDAHybridCache (a check
    in API) or raises NotImplementedError (None in API)."""
    public = {name for name, _ in inspect.getmembers(Cache) if not name.startswith("_")}
    assert public <= API.keys(), f"unclassified Cache members: {sorted(public - API.keys())}"


@pytest.mark.parametrize("name", sorted(API))
def test_cache_member_works_or_is_not_implemented(model, name):
    cache = filled(model)
    before = snapshot(cache)
    if API[name] is None:
        with pytest.raises(NotImplementedError) as err:
            NOT_IMPLEMENTED_ARGS[name](cache)
        assert len(str(err.value)) > 40  # says why
        assert_same(snapshot(cache), before)
        return
    call, check = API[name]
    ref = next_logits(model, copy.deepcopy(cache))
    result = call(cache)  # anything but a clean result fails the test (no AttributeError / TypeError inside)
    assert check(model, cache, result, before, ref) in (True, None), (name, result)


def test_offloaded_then_prefetched_layers_give_the_same_next_step(model):
    cache = filled(model)
    ref = next_logits(model, copy.deepcopy(cache))
    for i in range(len(cache)):
        cache.offload(i)
    assert all(layer.offloaded_from is not None for layer in cache.layers)
    for i in range(len(cache)):
        cache.prefetch(i)
    assert all(layer.offloaded_from is None for layer in cache.layers)
    assert torch.equal(next_logits(model, cache), ref)
    # and a crop after the round trip still replays the records
    cache.offload(KDA_IDX)
    cache.crop(-3)
    torch.testing.assert_close(next_logits(model, cache), _ref_logits(model, IDS[:, :9]), **CLOSE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves tensors off an accelerator")
def test_offload_moves_tensors_to_cpu_and_back():
    cache = KDAHybridCache(tiny_config())
    cache.early_initialization(2, dtype=torch.float32, device="cuda")
    cache.offload(KDA_IDX)
    assert all(t.device.type == "cpu" for t in cache.layers[KDA_IDX].tensors())
    assert all(t.is_cuda for t in cache.layers[ATTN_IDX].tensors())
    cache.prefetch(0)  # the first offloaded layer from 0 on
    assert all(t.is_cuda for t in cache.layers[KDA_IDX].tensors())


def test_early_initialization_equals_lazy(model):
    cache = KDAHybridCache(model.config)
    cache.early_initialization(2, dtype=torch.float32, device="cpu")
    assert cache.get_seq_length() == 0 and all(layer.batch_size == 2 for layer in cache.layers)
    with torch.no_grad():
        got = model(IDS[:, :6], cache=cache).logits
        want = model(IDS[:, :6], use_cache=True)
    torch.testing.assert_close(got, want.logits, **CLOSE)
    torch.testing.assert_close(next_logits(model, cache), next_logits(model, want.cache), **CLOSE)


def test_layer_index_and_state_index_are_checked(model):
    cache = filled(model)
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 4\)"):
        cache.get_seq_length(4)
    with pytest.raises(ValueError, match="full-attention layer"):
        cache.get_conv_state(ATTN_IDX)
    with pytest.raises(ValueError, match="state_idx must be 0 .q., 1 .k. or 2 .v."):
        cache.get_conv_state(KDA_IDX, 3)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        cache.offload(0.0)


# --------------------------------------------------------------------------------------------------
# Rollback, batch operations and the memory report through a model
# --------------------------------------------------------------------------------------------------


def kda_states(cache):
    return [(layer.conv_states, layer.recurrent_state) for layer in cache.layers if isinstance(layer, KDALayerState)]


def test_crop_rolls_back_states_exactly():
    model = helpers.tiny_model("mla")
    ids = prompt(B=2, T=14)
    with torch.no_grad():
        ref = model(ids[:, :9], use_cache=True).cache
        cache = KDAHybridCache(model.config)
        model(ids[:, :6], cache=cache)
        cache.activate_past_recording()
        model(ids[:, 6:8], cache=cache)  # several forwards since the last crop ...
        model(ids[:, 8:10], cache=cache)
        model(ids[:, 10:14], cache=cache)
        cache.crop(-5)  # ... and the crop spans three of them
    assert cache.get_seq_length() == 9
    for (c1, s1), (c2, s2) in zip(kda_states(cache), kda_states(ref)):
        torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
        for a, b in zip(c1, c2):  # equal up to the rounding of differently batched projections
            torch.testing.assert_close(a, b)
    for l1, l2 in zip(cache.layers, ref.layers):
        if isinstance(l1, KVLayerState):
            torch.testing.assert_close(l1.keys, l2.keys)
    with torch.no_grad():  # and decoding continues from there as from the reference
        torch.testing.assert_close(model(ids[:, 9:10], cache=cache).logits, model(ids[:, 9:10], cache=ref).logits)


def test_recording_stops_when_generate_clears_the_layer_flags():
    """transformers' deferred stop check (generate on mps) ends recording by setting each cache layer's
    record_past = False: the cache then keeps no more token records either (they grew by a copy of the ids per
    forward), reports itself as not croppable, and its fingerprint still follows the tokens."""
    model = helpers.tiny_model("mla")
    ids = prompt(B=2, T=12)
    cache, ref = KDAHybridCache(model.config), KDAHybridCache(model.config)
    with torch.no_grad():
        cache.activate_past_recording()
        model(ids[:, :6], cache=cache)
        assert cache.is_croppable and len(cache.fingerprint.records) == 1
        for layer in cache.layers:
            layer.record_past = False
        for t in range(6, 12):
            model(ids[:, t : t + 1], cache=cache)
        model(ids, cache=ref)
    assert not cache.is_croppable and cache.fingerprint.records == []
    assert torch.equal(cache.fingerprint.value, ref.fingerprint.value)


def test_crop_without_recording_is_a_clear_error():
    model = helpers.tiny_model()
    cache = KDAHybridCache(model.config)
    with torch.no_grad():
        model(prompt(), cache=cache)
    assert not cache.is_croppable
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_batch_select_repeat_reorder_reset():
    model = helpers.tiny_model("gqa")
    ids = prompt(B=3)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        single = model(ids[1:2], use_cache=True).cache
    cache.batch_select_indices(torch.tensor([1]))
    for (c1, s1), (c2, s2) in zip(kda_states(cache), kda_states(single)):
        torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
        for a, b in zip(c1, c2):  # a batch of 3 against a batch of 1: equal up to fp32 rounding
            torch.testing.assert_close(a, b)
    cache.batch_repeat_interleave(2)
    assert cache.batch_size == 2
    cache.reorder_cache(torch.tensor([1, 0]))
    assert cache.batch_size == 2
    cache.reset()
    assert cache.get_seq_length() == 0 and all(s.abs().sum() == 0 for _, s in kda_states(cache))


def test_memory_report_kda_constant_attention_linear():
    model = helpers.tiny_model("mla")
    cfg = model.config
    reports = []
    for T in (8, 32):
        with torch.no_grad():
            reports.append(model(prompt(B=1, T=T), use_cache=True).cache.memory_report())
    a, b = reports
    assert a["kda_state_bytes"] == b["kda_state_bytes"] > 0  # fixed size
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 * len(cfg.full_attention_layers)  # latent + k_rot
    assert a["kv_bytes_per_token_per_sequence"] == b["kv_bytes_per_token_per_sequence"] == per_token
    assert b["attention_kv_bytes"] - a["attention_kv_bytes"] == 24 * per_token
