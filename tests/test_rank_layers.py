"""examples/smollm2/rank_layers.py: restoring a layer of an all-KDA student to the teacher's attention measures what a
hybrid converted with attention at that layer measures, against the teacher's own (transformers Llama) logits; the
student it writes is the conversion with the chosen layer types."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kda_hybrid.conversion import convert

from .helpers import load_script

rl = load_script("examples/smollm2/rank_layers.py", "rank_layers_example")
VOCAB, LAYERS, SEQ = 96, 4, 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rank")
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    teacher.save_pretrained(root / "teacher")
    for name, pattern in (("all-A", "A"), ("all-k", "k"), ("kAkk", "kAkk")):
        convert(root / "teacher", root / name, layer_types=pattern, progress=False)
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(3, VOCAB, size=3 * SEQ).astype(np.uint16).tofile(data / "train.bin")  # no BOS: one document a row
    (data / "meta.json").write_text(json.dumps({"bos_token_id": 1}))
    return root, teacher.eval(), data


def _kl(teacher, model, rows) -> float:
    """KL(teacher || model) per token, from the transformers teacher's logits."""
    total = 0.0
    with torch.no_grad():
        for ids in rows:
            ref = torch.log_softmax(teacher(ids).logits[0], -1)
            lp = torch.log_softmax(model(ids, use_cache=False).logits[0], -1)
            total += float((ref.exp() * (ref - lp)).sum())
    return total / sum(r.shape[1] for r in rows)


def test_restoring_a_layer_measures_the_hybrid_converted_with_attention_there(setup):
    root, teacher, data = setup
    batches = rl.batches(data, 3 * SEQ, SEQ)
    rows = [b["input_ids"] for b in batches]
    all_a, all_k = rl.load(root / "all-A"), rl.load(root / "all-k")
    result = rl.rank(all_a, all_k, batches)
    assert sorted(result["ranking"]) == list(range(LAYERS)) and result["tokens"] == 3 * SEQ
    assert result["all_kda_kl"] == pytest.approx(_kl(teacher, all_k, rows), rel=1e-4)
    assert result["layers"][1]["kl"] == pytest.approx(_kl(teacher, rl.load(root / "kAkk"), rows), rel=1e-4)
    gains = {r["layer"]: r["gain"] for r in result["layers"]}
    assert [gains[i] for i in result["ranking"]] == sorted(gains.values(), reverse=True)
    # the swaps were undone: the student is all-KDA again, and with every layer restored it is the teacher
    assert set(all_k.config.layer_types) == {"linear_attention"}
    assert rl.mean_kl(all_k, batches, [rl.log_probs(all_a, b) for b in batches]) == pytest.approx(
        result["all_kda_kl"], rel=1e-6)
    rl.with_attention(all_k, all_a, range(LAYERS))
    assert _kl(teacher, all_k, rows) < 1e-6


def test_the_written_student_is_the_conversion_with_the_chosen_layers(setup, tmp_path):
    root, _, data = setup
    out = tmp_path / "ranked"
    rl.main(["--teacher", str(root / "all-A"), "--student", str(root / "all-k"), "--data", str(data), "--tokens",
             str(2 * SEQ), "--seq-len", str(SEQ), "--keep", "2", "--json", str(tmp_path / "r.json"),
             "--write-student", str(out)])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["layer_types"].count("A") == 2 and result["kept_layers"] == sorted(result["ranking"][:2])
    convert(root / "teacher", tmp_path / "converted", layer_types=result["layer_types"], progress=False)
    assert json.loads((out / "trained_tokens.json").read_text()) == {"tokens": 0}  # all-k: a conversion
    written, converted = rl.load(out), rl.load(tmp_path / "converted")
    assert written.config.layer_types == converted.config.layer_types
    got, want = written.state_dict(), converted.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_student_that_is_not_all_kda_is_refused(setup, tmp_path):
    root, _, data = setup
    with pytest.raises(SystemExit, match="every layer must be KDA"):
        rl.main(["--teacher", str(root / "all-A"), "--student", str(root / "kAkk"), "--data", str(data)])
    with pytest.raises(SystemExit, match="every layer must be attention"):
        rl.main(["--teacher", str(root / "kAkk"), "--student", str(root / "all-k"), "--data", str(data)])


def test_the_quality_curve_groups_series_and_divides_by_the_teacher(tmp_path):
    """plot_curve.py: every model with training tokens, grouped by the name before its comma, sorted by tokens, its
    NLLs divided by the first model's (the teacher); models with none (the teacher, a conversion) left out."""
    pc = load_script("examples/smollm2/plot_curve.py", "plot_curve")
    models = {"teacher": dict(nll_chat=2.0, nll_prose=1.0, nll_code=4.0, agreement=1.0, forced_top1=1.0),
              "converted": dict(nll_chat=9.0, nll_prose=9.0, nll_code=9.0, agreement=0.0, forced_top1=0.1),
              "stage 2, step 500": dict(nll_chat=2.4, nll_prose=1.3, nll_code=4.4, agreement=0.2, forced_top1=0.7,
                                        tokens_trained=2_000_000),
              "stage 2, step 125": dict(nll_chat=3.0, nll_prose=1.5, nll_code=5.0, agreement=0.1, forced_top1=0.6,
                                        tokens_trained=500_000),
              "stage 1, step 125": dict(nll_prose=2.0, nll_code=6.0, agreement=0.0, forced_top1=0.3,
                                        tokens_trained=250_000)}
    teacher, series = pc.curve({"models": models})
    assert teacher == "teacher" and list(series) == ["stage 2", "stage 1"]
    assert [p["tokens"] for p in series["stage 2"]] == [500_000, 2_000_000]
    assert series["stage 2"][1]["nll_chat"] == pytest.approx(1.2) and series["stage 2"][1]["nll_code"] == 1.1
    assert "nll_chat" not in series["stage 1"][0] and series["stage 1"][0]["forced_top1"] == 0.3
    # stage 2's chat NLL ratio 1.5 -> 1.2 from 0.5M to 2M tokens: its excess 0.5 -> 0.2 is tokens^b with
    # b = ln(0.4) / ln(4), followed out to an excess of 0.15; its code NLL (1.1x) meets 1.15x; stage 1 has one point
    kind, tokens, slope = pc.tokens_to_target(series["stage 2"], "nll_chat")
    b = math.log(0.2 / 0.5) / math.log(4)
    assert kind == "estimate" and slope == pytest.approx(b) and tokens == pytest.approx(2e6 * (0.15 / 0.2) ** (1 / b))
    assert 3.0e6 < tokens < 3.2e6
    assert pc.tokens_to_target(series["stage 2"], "nll_code")[:2] == ("met", 2_000_000)
    assert pc.tokens_to_target(series["stage 1"], "forced_top1") == ("none", None, None)
    worse = [dict(tokens=1e6, agreement=0.2), dict(tokens=2e6, agreement=0.1)]
    assert pc.tokens_to_target(worse, "agreement")[0] == "none"
    flat = [dict(tokens=1e6, agreement=0.11), dict(tokens=2e6, agreement=0.112)]  # shrinking, but hardly
    kind, tokens, slope = pc.tokens_to_target(flat, "agreement")
    assert kind == "beyond" and tokens == pc.HORIZON * 2e6 and -0.01 < slope < 0
    assert "not within 100x the tokens so far (200M)" in pc.estimates({"flat": flat})
    assert "about 3.09M tokens" in pc.estimates(series) and "no estimate (one point)" in pc.estimates(series)
    report = tmp_path / "m.json"
    report.write_text(json.dumps({"models": models}))
    assert pc.main([str(report), "--out", str(tmp_path / "curve.png")]) == 0
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    report.write_text(json.dumps({"models": {"teacher": models["teacher"]}}))
    with pytest.raises(SystemExit):
        pc.main([str(report)])
