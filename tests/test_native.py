"""Our model against transformers' native `KimiLinearForCausalLM` (an independent implementation) on the same
random weights: logits and greedy generations. The native model runs in a subprocess with fla blocked."""

import pytest
import torch

from kda_hybrid import KDAHybridForCausalLM

from ._native import run_native, save_checkpoint
from .helpers import assert_close_rel, generate_with_logits, prompt, tiny_model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logits_and_greedy_match_native(tmp_path, moe):
    model = tiny_model("mla", moe, num_hidden_layers=5, q_lora_rank=12 if moe else None)
    assert model.config.router_weights_from_biased_scores is False  # the native port's (unbiased) routing
    save_checkpoint(tmp_path, model.state_dict(), model.config.to_kimi_linear_dict(), shards=2)
    ids = prompt(B=2, T=70)  # crosses the 64-token chunk boundary
    [native] = run_native([tmp_path], ids, max_new_tokens=10)
    with torch.no_grad():
        ours = model(ids).logits
    generated = generate_with_logits(model, ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert_close_rel(ours, native["logits"], rel=1e-4, name="logits")
    assert torch.equal(generated.new, native["tokens"])
    assert_close_rel(generated.logits, native["step_logits"], rel=1e-4, name="logits of the generated tokens")


def test_biased_routing_differs_from_native():
    """The flag matters: the original Hub routing gives other logits than the native (unbiased) one."""
    model = tiny_model("mla", True)
    biased = KDAHybridForCausalLM(model.config.__class__(**{**model.config.to_dict(),
                                                            "router_weights_from_biased_scores": True})).eval()
    biased.load_state_dict(model.state_dict())
    ids = prompt(T=12)
    with torch.no_grad():
        assert not torch.allclose(biased(ids).logits, model(ids).logits, atol=1e-6)
