"""examples/smollm2/profile_smollm2_decode.py's shared-KV what-if computes what a KDA layer with GQA-shared keys and
values computes: on a fresh conversion (k/v heads repeated from the source's KV heads) it equals the student."""

from __future__ import annotations

import torch

from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.conversion import convert

from ._attention_sources import ids, save_source
from .helpers import load_script

shared_kv = load_script("examples/smollm2/profile_smollm2_decode.py", "profile_smollm2_decode").shared_kv


def _logits_and_step(model, x):
    out = model(x, use_cache=True)
    step = model(out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
    return out.logits, step.logits


def test_shared_kv_what_if_equals_a_fresh_conversion_and_sees_a_changed_head(tmp_path):
    for family in ("llama", "qwen2"):  # qwen2: k/v biases go through the shared projection too
        source, folder = save_source(tmp_path, family)
        student = KDAHybridForCausalLM.from_pretrained(
            convert(folder, tmp_path / f"hybrid-{family}", layer_types="kkkA", progress=False)).eval()
        what_if = shared_kv(student, source.config.num_key_value_heads)
        kda = what_if.model.layers[0].self_attn
        assert kda.k_proj.proj.weight.shape[0] == source.config.num_key_value_heads * student.config.head_dim
        x = ids()
        with torch.no_grad():
            for got, want in zip(_logits_and_step(what_if, x), _logits_and_step(student, x)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # a student whose repeated heads differ is not what the what-if computes: it keeps each group's first
            student.model.layers[0].self_attn.k_proj.weight[student.config.head_dim:].mul_(-1)
            assert not torch.allclose(student(x).logits, what_if(x).logits, rtol=1e-3, atol=1e-3)
