"""Meta tensors (shapes only, as transformers' modules take them under `with torch.device("meta")`): the KDA ops and
the model give outputs of the shapes and dtypes a real run gives, and compute nothing; what cannot be known from
shapes alone is a clear error. The ops had read values (a gate check, the non-finite check, cu_seqlens offsets) and
failed with "Tensor.item() cannot be called on meta tensors"."""

import pytest
import torch

from kda_hybrid import KDAHybridCache, KDAHybridForCausalLM, chunk_kda, fused_recurrent_kda

from .helpers import make_inputs, tiny_config


def _meta(xs):
    return [None if x is None else x.to("meta") for x in xs]


def _same_layout(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.is_meta and a.shape == b.shape and a.dtype == b.dtype


CU = torch.tensor([0, 30, 70])
CASES = {
    "chunk": (chunk_kda, {}),
    "chunk-states": (chunk_kda, dict(return_intermediate_states=True, chunk_size=32)),
    "chunk-v-first": (chunk_kda, dict(state_v_first=True)),
    "chunk-varlen": (chunk_kda, dict(cu_seqlens=CU)),
    "chunk-varlen-states-host-offsets": (chunk_kda, dict(cu_seqlens=CU, cu_seqlens_cpu=CU,
                                                         return_intermediate_states=True)),
    "recurrent": (fused_recurrent_kda, {}),
    "recurrent-varlen": (fused_recurrent_kda, dict(cu_seqlens=CU)),
}


@pytest.mark.parametrize("case", CASES)
def test_ops_on_meta_give_a_real_runs_shapes(case):
    op, kw = CASES[case]
    B = 1 if "cu_seqlens" in kw else 2
    q, k, v, g, beta, _ = make_inputs(B, 70, 2, 16, 8)
    h0 = torch.randn(2, 2, 8, 16) if kw.get("state_v_first") else torch.randn(2, 2, 16, 8)
    h0 = h0 if B == 2 or "cu_seqlens" in kw else None
    with torch.no_grad():
        want = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
        meta_kw = {key: (val.to("meta") if key == "cu_seqlens" else val) for key, val in kw.items()}
        got = op(*_meta([q, k, v, g, beta]), initial_state=None if h0 is None else h0.to("meta"),
                 output_final_state=True, **meta_kw)
    _same_layout(got, want)


def test_recurrent_state_pool_on_meta_writes_back_in_place():
    q, k, v, g, beta, _ = _meta(make_inputs(3, 1, 2, 16, 16))
    pool = torch.empty(5, 2, 16, 16, device="meta")
    idx = torch.tensor([4, -1, 0], device="meta")
    o, final = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=True)
    assert final is pool and o.shape == (3, 1, 2, 16) and o.is_meta


def test_intermediate_states_of_a_meta_pack_need_host_offsets():
    """How many chunk states a cu_seqlens pack has depends on its offsets, which meta tensors do not hold."""
    xs = _meta(make_inputs(1, 70, 2, 16, 16)[:5])
    with pytest.raises(ValueError, match="pass cu_seqlens_cpu"), torch.no_grad():
        chunk_kda(*xs, cu_seqlens=CU.to("meta"), return_intermediate_states=True)


@pytest.mark.parametrize("backend", ["torch", "reference", "triton", "auto"])
@pytest.mark.parametrize("op", [chunk_kda, fused_recurrent_kda], ids=["chunk", "recurrent"])
def test_real_inputs_with_meta_offsets_are_refused_naming_the_devices(op, backend):
    """Real tokens with meta cu_seqlens crashed deep inside ('Cannot copy out of meta tensor'), and the triton
    backend's hint pointed at backend='torch', which crashed the same way: one clear error on every backend."""
    xs = make_inputs(1, 70, 2, 16, 16)[:5]
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta but q is on cpu.*q's device \(cpu\) or the CPU"):
        op(*xs, cu_seqlens=CU.to("meta"), output_final_state=True, backend=backend)


@pytest.mark.parametrize("attention,moe", [("mla", False), ("mla", True), ("gqa", True)])
def test_model_under_meta_device_gives_a_real_runs_shapes(attention, moe):
    """Built and run under torch.device("meta"): a 40-token forward with labels and a cache, then a decode step;
    logits, loss and the cache's tensors have the shapes of the same calls on real tensors."""
    config = tiny_config(attention, moe=moe)
    ids = torch.randint(1, 97, (2, 40))
    outputs = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            torch.manual_seed(0)
            model = KDAHybridForCausalLM(config).eval()
            cache = KDAHybridCache(config)
            with torch.no_grad():
                first = model(ids.to(device), labels=ids.to(device), cache=cache, use_cache=True)
                step = model(ids[:, :1].to(device), cache=cache, use_cache=True)
        outputs.append([first.logits, first.loss, step.logits,
                        *[t for layer in cache.layers for t in layer.tensors()]])
    _same_layout(outputs[1], outputs[0])
