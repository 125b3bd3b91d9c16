"""Checkpoint conversion: the real 48B inventory (meta tensors, no memory), tiny random checkpoints in every
source layout against transformers' native model (an independent oracle), bit-exact round trips, and
corrupted inputs that must fail with nothing written, and the destination's safety: never the source or files
this tool did not write, old-or-new output under SIGKILL at any point, full disks and bad flags."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kda_hybrid import KDAHybridForCausalLM
from kda_hybrid.conversion import ConversionError, convert, convert_state_dict, kimi_inventory
from kda_hybrid.conversion.__main__ import main as cli_main

from ._native import run_native, save_checkpoint
from .helpers import (
    assert_bit_exact,
    assert_close_rel,
    generate_with_logits,
    random_state_dict,
    read_folder,
    tiny_kimi_config,
)

# Every tensor name, shape and dtype of the real Kimi-Linear-48B-A3B checkpoint (20,493 rows, gzip: 62 KB).
FIXTURE = Path(__file__).parent / "fixtures" / "kimi_linear_48b_a3b_tensors.tsv.gz"

# Kimi-Linear-48B-A3B's config.json, the fields that decide tensor names and shapes (docs/architecture.md §5).
REAL_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 27) if i % 4],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "use_grouped_topk": True, "num_expert_group": 1,
    "topk_group": 1, "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "bos_token_id": 163584,
    "eos_token_id": 163586, "pad_token_id": 163839,
}


# q_lora, tied embeddings, no shared expert, two dense layers, MLA first and last
VARIANT = tiny_kimi_config(q_lora_rank=10, tie_word_embeddings=True, num_shared_experts=0, first_k_dense_replace=2,
                           linear_attn_config={"kda_layers": [2, 3, 4], "full_attn_layers": [1, 5], "head_dim": 4,
                                               "num_heads": 2, "short_conv_kernel_size": 3})


FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")


def to_native_names(state, cfg):
    """Original names -> transformers' fused in-memory names (the inverse of the converter's native rules),
    written independently of the converter: per KDA layer one conv1d, forget_gate.*; per MoE layer mlp.*
    with experts stacked as gate_up_proj [E, 2I, D] (w1 then w3) and down_proj [E, D, I]."""
    out = {}
    experts: dict[str, dict] = {}
    for name, t in state.items():
        parts = name.split(".")
        if name.endswith("_conv1d.weight"):
            prefix = name.rsplit(".", 2)[0] + "."
            if name.endswith("q_conv1d.weight"):
                out[prefix + "conv1d.weight"] = torch.cat([state[prefix + f"{x}_conv1d.weight"] for x in "qkv"])
        elif name.endswith(tuple("self_attn." + leaf for leaf in FORGET_GATE)):
            out[name.replace("self_attn.", "self_attn.forget_gate.")] = t
        elif ".experts." in name:
            layer, e, w = ".".join(parts[:3]), int(parts[5]), parts[6]
            experts.setdefault(layer, {})[(e, w)] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    E = cfg["num_experts"]
    for layer, ws in experts.items():
        out[layer + ".mlp.experts.gate_up_proj"] = torch.stack([torch.cat([ws[e, "w1"], ws[e, "w3"]])
                                                                for e in range(E)])
        out[layer + ".mlp.experts.down_proj"] = torch.stack([ws[e, "w2"] for e in range(E)])
    return out


def leftovers(parent: Path):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file of a folder tree with its bytes: equal snapshots mean nothing was touched."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------
# (a) The real 48B checkpoint's inventory, as meta tensors
# ---------------------------------------------------------------------------------------------------------
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp32?": torch.float32}  # "fp32?": treat as fp32


@pytest.fixture(scope="module")
def real_meta():
    rows = [line.rstrip("\n").split("\t") for line in gzip.decompress(FIXTURE.read_bytes()).decode().splitlines()]
    return {name: torch.empty(json.loads(shape), dtype=_DTYPES[dt], device="meta") for name, shape, dt in rows}


def test_real_inventory_matches_fixture(real_meta):
    inventory = kimi_inventory(REAL_CONFIG)
    assert len(real_meta) == len(inventory) == 20493
    assert list(inventory) == list(real_meta)  # same names, same (layer) order
    for name, t in real_meta.items():
        assert inventory[name].shape == tuple(t.shape), name
        assert inventory[name].fp32 == (t.dtype == torch.float32), name
    assert sum(t.numel() for t in real_meta.values()) / 1e9 == pytest.approx(49.1, abs=0.05)


def test_real_hub_config_converts():
    """The Hub config.json, with its remote-code and unused keys, gives our config for the same tensors."""
    from kda_hybrid.conversion.configs import kda_hybrid_config
    from kda_hybrid.conversion.formats import detect_format

    hub = {**REAL_CONFIG, "head_dim": 72, "rope_theta": 10000.0, "model_max_length": 1048576,
           "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16", "transformers_version": "4.56.2",
           "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                        "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"}}
    assert detect_format(hub, ["model.layers.0.self_attn.q_conv1d.weight"]) == "kimi_linear"
    config = kda_hybrid_config(hub, router_weights_from_biased_scores=True, dtype="bfloat16")
    assert config.model_type == "kda_hybrid" and config.attention_type == "mla"
    assert config.num_experts == 256 and config.num_experts_per_tok == 8 and config.first_k_dense_replace == 1
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (163584, 163586, 163839)
    assert kimi_inventory(config.to_kimi_linear_dict()) == kimi_inventory(REAL_CONFIG)


def test_real_dry_run_round_trip(real_meta):
    ours = convert_state_dict(real_meta, REAL_CONFIG, source="kimi_linear")
    assert all(t.device.type == "meta" for t in ours.values())
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in real_meta.items()}
    back = convert_state_dict(ours, REAL_CONFIG, source="kimi_linear")  # ours -> original is the same naming
    assert {n: (t.shape, t.dtype) for n, t in back.items()} == {n: (t.shape, t.dtype) for n, t in real_meta.items()}


def test_real_dry_run_from_native_fused_names(real_meta):
    native = to_native_names(real_meta, REAL_CONFIG)
    assert len(native) == 20493 - 26 * 3 * 256 + 26 * 2 - 20 * 2  # experts fused, q/k/v conv fused
    ours = convert_state_dict(native, REAL_CONFIG, source="transformers")
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in real_meta.items()}


def test_real_dry_run_cast(real_meta):
    ours = convert_state_dict(real_meta, REAL_CONFIG, source="kimi_linear", dtype="float16")
    kept = {n for n in ours if n.endswith(("A_log", "dt_bias", "e_score_correction_bias"))}
    assert len(kept) == 20 * 2 + 26
    assert all(ours[n].dtype == (torch.float32 if n in kept else torch.float16) for n in ours)


# ---------------------------------------------------------------------------------------------------------
# (c) Round trips on disk are bit-exact; every source layout gives the same tensors
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [tiny_kimi_config(), VARIANT], ids=["tiny", "qlora-tied-noshared"])
def test_round_trip_bit_exact(tmp_path, cfg):
    state = random_state_dict(cfg, dtype=torch.bfloat16)
    src = save_checkpoint(tmp_path / "kimi", state, cfg, shards=3)
    (src / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    (src / "generation_config.json").write_text('{"bos_token_id": 1}')
    (src / "modeling_kimi.py").write_text("# the Hub's remote code: not carried into our format\n")

    ours = convert(src, tmp_path / "ours", source="kimi_linear", max_shard_size="4KB", progress=False)
    files = {p.name for p in ours.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer_config.json", "generation_config.json"} <= files
    assert "modeling_kimi.py" not in files
    shards = sorted(ours.glob("model-*.safetensors"))
    assert len(shards) > 3 and all(_tensor_bytes(p) <= 4000 or _n_tensors(p) == 1 for p in shards)
    index = json.loads((ours / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == {p.name for p in shards}
    config = json.loads((ours / "config.json").read_text())
    assert config["model_type"] == "kda_hybrid" and config["router_weights_from_biased_scores"] is True
    assert config["dtype"] == "bfloat16"
    assert_bit_exact(read_folder(ours), state)

    back = convert(ours, tmp_path / "back", target="kimi_linear", progress=False)  # source detected: ours
    assert_bit_exact(read_folder(back), state)
    kimi_back = json.loads((back / "config.json").read_text())
    assert kimi_back["model_type"] == "kimi_linear" and kimi_back["linear_attn_config"] == cfg["linear_attn_config"]
    assert kimi_inventory(kimi_back) == kimi_inventory(cfg)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "routed_scaling_factor", "num_experts_per_token",
                "moe_renormalize", "rms_norm_eps", "tie_word_embeddings"):
        assert kimi_back[key] == cfg[key], key
    assert (back / "tokenizer_config.json").read_text() == '{"bos_token": "<s>"}'


def _n_tensors(path):
    with safe_open(path, "pt") as f:
        return len(list(f.keys()))


def _tensor_bytes(path):
    return sum(t.numel() * t.element_size() for t in read_folder_file(path).values())


def read_folder_file(path):
    with safe_open(path, "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def test_native_fused_and_bin_sources(tmp_path):
    cfg = tiny_kimi_config()
    state = random_state_dict(cfg)
    native_cfg = {**cfg, "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"],
                  "mlp_layer_types": ["dense"] + ["sparse"] * 4}
    src = save_checkpoint(tmp_path / "native", to_native_names(state, cfg), native_cfg, shards=4)
    out = convert(src, tmp_path / "from-native", progress=False)  # detected: transformers
    assert json.loads((out / "config.json").read_text())["router_weights_from_biased_scores"] is False
    assert_bit_exact(read_folder(out), state)

    bin_src = tmp_path / "bin"
    bin_src.mkdir()
    (bin_src / "config.json").write_text(json.dumps(cfg))
    torch.save(state, bin_src / "pytorch_model.bin")
    out = convert(bin_src, tmp_path / "from-bin", dtype="bfloat16", progress=False)
    converted = read_folder(out)
    assert converted["model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert converted["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32  # never rounded down
    assert converted["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(converted["model.norm.weight"], state["model.norm.weight"].bfloat16(), rtol=0, atol=0)


def test_native_saved_with_original_names(tmp_path):
    """transformers' default `save_pretrained` (save_original_format=True) reverses its renames, but also
    renames the dense MLP of layer 0 to `block_sparse_moe.{gate,up,down}_proj` (seen with 5.24), which the
    original checkpoint never had. The converter accepts that spelling from a transformers source."""
    cfg = tiny_kimi_config()
    state = random_state_dict(cfg)
    saved = {n.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): t for n, t in state.items()}
    native_cfg = {**cfg, "layer_types": ["linear_attention"] * 3 + ["full_attention", "linear_attention"]}
    src = save_checkpoint(tmp_path / "native", saved, native_cfg, shards=2)
    assert_bit_exact(read_folder(convert(src, tmp_path / "out", progress=False)), state)
    with pytest.raises(ConversionError, match="unexpected tensors: model.layers.0.block_sparse_moe.down_proj"):
        convert(src, tmp_path / "strict", source="kimi_linear", progress=False)


def test_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """One source file open at a time, and output buffered up to max_shard_size only."""
    from kda_hybrid.conversion import checkpoint

    cfg = tiny_kimi_config(vocab_size=64)
    src = save_checkpoint(tmp_path / "src", random_state_dict(cfg), cfg, shards=5)
    open_files, widest, buffered = [], [0], [0]
    original_open, original_add = checkpoint.FolderSource.open, checkpoint.ShardWriter.add

    def tracking_open(self, file):
        cm = original_open(self, file)

        class Tracked:
            def __enter__(inner):
                open_files.append(file)
                widest[0] = max(widest[0], len(open_files))
                return cm.__enter__()

            def __exit__(inner, *exc):
                open_files.remove(file)
                return cm.__exit__(*exc)

        return Tracked()

    def tracking_add(self, name, tensor):
        original_add(self, name, tensor)
        if len(self._buffer) > 1:
            buffered[0] = max(buffered[0], self._buffer_bytes)

    monkeypatch.setattr(checkpoint.FolderSource, "open", tracking_open)
    monkeypatch.setattr(checkpoint.ShardWriter, "add", tracking_add)
    convert(src, tmp_path / "out", max_shard_size="6KB", progress=False)
    assert widest[0] == 1 and 0 < buffered[0] <= 6000


@pytest.mark.slow
def test_peak_memory_is_about_one_shard(tmp_path):
    """Peak RSS of the conversion stays far below the model size (8 source shards of ~20 MB, 20 MB output
    shards). Measured in a subprocess, after resetting the kernel's high-water mark past the imports."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset and read the RSS high-water mark")
    cfg = tiny_kimi_config(vocab_size=26000, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
                           num_experts=16, num_hidden_layers=5)
    state = random_state_dict(cfg)
    model_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    src = save_checkpoint(tmp_path / "src", state, cfg, shards=8)
    del state
    script = (
        "import re, sys, torch\n"
        "from kda_hybrid.conversion import convert\n"
        "status = lambda key: int(re.search(key + r':\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # reset VmHWM to the current RSS\n"
        "base = status('VmRSS')\n"
        "convert(sys.argv[1], sys.argv[2], max_shard_size='20MB', progress=False)\n"
        "print((status('VmHWM') - base) / 1024)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown = float(proc.stdout.split()[-1])
    assert model_mb > 150 and grown < 0.5 * model_mb, f"peak RSS grew {grown:.0f} MB for a {model_mb:.0f} MB model"


def test_cli(tmp_path, capsys):
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "kimi", random_state_dict(cfg), cfg, shards=2)
    dst = tmp_path / "out"
    assert cli_main([str(src), str(dst), "--from", "kimi_linear", "--unbiased-router", "--dtype", "bfloat16",
                     "--no-progress"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["router_weights_from_biased_scores"] is False and config["dtype"] == "bfloat16"
    assert cli_main([str(src), str(dst), "--no-progress"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert cli_main([str(src), str(dst), "--no-progress", "--overwrite", "--biased-router"]) == 0
    assert json.loads((dst / "config.json").read_text())["router_weights_from_biased_scores"] is True
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------
# (d) Corrupted inputs fail cleanly, naming the tensors, with nothing written
# ---------------------------------------------------------------------------------------------------------
def _corrupt_missing(state):
    del state["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    return "missing tensors: model.layers.1.block_sparse_moe.experts.3.w2.weight"


def _corrupt_shape(state):
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(5, 12)
    return "model.layers.3.self_attn.kv_b_proj.weight (expected [28, 12], got [5, 12])"


def _corrupt_unknown(state):
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    return "unexpected tensors: model.layers.0.self_attn.rotary_emb.inv_freq"


@pytest.mark.parametrize("corrupt", [_corrupt_missing, _corrupt_shape, _corrupt_unknown],
                         ids=["missing", "wrong-shape", "unknown-key"])
def test_bad_tensors_fail_cleanly(tmp_path, corrupt):
    cfg = tiny_kimi_config()
    state = random_state_dict(cfg)
    expected = corrupt(state)
    src = save_checkpoint(tmp_path / "src", state, cfg, shards=2)
    with pytest.raises(ConversionError) as err:
        convert(src, tmp_path / "out", progress=False)
    assert expected in str(err.value)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_truncated_shard_and_index_mismatch(tmp_path):
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "src", random_state_dict(cfg), cfg, shards=3)
    shard = src / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="model-00002-of-00003.safetensors: cannot read"):
        convert(src, tmp_path / "out", progress=False)
    shard.write_bytes(data)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="listed in the index but not in that shard: model.norm.weight"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_failure_mid_stream_keeps_existing_output(tmp_path, monkeypatch):
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "src", random_state_dict(cfg), cfg, shards=2)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("previous output")
    with pytest.raises(ConversionError, match="already exists"):
        convert(src, dst, progress=False)
    with pytest.raises(ConversionError, match="only replaces an empty folder or one this tool wrote"):
        convert(src, dst, overwrite=True, progress=False)  # not ours: never deleted
    assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"]

    previous = convert(src, tmp_path / "previous", dtype="bfloat16", progress=False)
    before = snapshot(previous)
    from kda_hybrid.conversion import checkpoint

    calls = []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) == 40:
            raise OSError("disk full")
        original_add(self, name, tensor)

    original_add = checkpoint.ShardWriter.add
    monkeypatch.setattr(checkpoint.ShardWriter, "add", failing_add)
    with pytest.raises(OSError, match="disk full"):
        convert(src, previous, overwrite=True, max_shard_size="2KB", progress=False)
    assert snapshot(previous) == before and leftovers(tmp_path) == []


def test_pickled_bin_is_refused(tmp_path):
    cfg = tiny_kimi_config()
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    torch.save({"model.norm.weight": torch.ones(32), "payload": Path("/etc/passwd")}, src / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="pytorch_model.bin: cannot read"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_gqa_model_has_no_kimi_equivalent(tmp_path):
    from kda_hybrid.configuration_kda_hybrid import KDAHybridConfig

    src = tmp_path / "gqa"
    KDAHybridConfig(attention_type="gqa", num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                    linear_num_heads=2, linear_head_dim=8).save_pretrained(src)
    save_checkpoint(src / "weights", {"model.norm.weight": torch.ones(16)}, {})
    (src / "weights" / "model.safetensors").rename(src / "model.safetensors")
    with pytest.raises(ConversionError, match="gqa"):
        convert(src, tmp_path / "out", target="kimi_linear", progress=False)
    assert not (tmp_path / "out").exists()


def test_config_errors(tmp_path):
    cfg = tiny_kimi_config(linear_attn_config={"kda_layers": [1, 2], "full_attn_layers": [4], "head_dim": 8,
                                               "num_heads": 3, "short_conv_kernel_size": 4})
    with pytest.raises(ConversionError, match=r"1-based layers \[3, 5\] are in neither"):
        kimi_inventory(cfg)
    native = {**tiny_kimi_config(), "mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse"]}
    with pytest.raises(ConversionError, match="mlp_layer_types"):
        convert_state_dict({}, native, source="transformers")


# ---------------------------------------------------------------------------------------------------------
# (b) Against transformers' native KimiLinearForCausalLM on the same weights
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [tiny_kimi_config(), VARIANT], ids=["tiny", "qlora-tied-noshared"])
def test_model_parameters_match_inventory(cfg):
    """Our model's own state dict is exactly the inventory the converter validates against."""
    from kda_hybrid.configuration_kda_hybrid import KDAHybridConfig

    with torch.device("meta"):
        model = KDAHybridForCausalLM(KDAHybridConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    state = model.state_dict()
    if cfg["tie_word_embeddings"]:  # one tensor under two names; save_pretrained writes it once
        assert model.lm_head.weight is model.model.embed_tokens.weight
        del state["lm_head.weight"]
    inventory = kimi_inventory(cfg)
    assert sorted(state) == sorted(inventory)
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: s.shape for n, s in inventory.items()}


def test_logits_and_generation_match_native(tmp_path):
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "kimi", random_state_dict(cfg, seed=1), cfg, shards=3)
    input_ids = torch.randint(3, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(0))
    # ours -> original, loaded by transformers from the original names: the same function again
    back = convert(convert(src, tmp_path / "ours", progress=False), tmp_path / "back", target="kimi_linear",
                   progress=False)
    ref, ref_back = run_native([src, back], input_ids, max_new_tokens=8, save_native_to=[tmp_path / "native", None])
    torch.testing.assert_close(ref_back["logits"], ref["logits"], rtol=0, atol=0)
    native_dir = tmp_path / "native"
    weight_map = json.loads((native_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2 and "model.layers.1.mlp.experts.gate_up_proj" in weight_map

    outputs = {
        "kimi-unbiased": convert(src, tmp_path / "a", source="kimi_linear", router_weights_from_biased_scores=False,
                                 progress=False),
        "transformers": convert(native_dir, tmp_path / "b", progress=False),  # detected; unbiased by default
    }
    scale = ref["logits"].abs().max()
    for label, folder in outputs.items():
        model = KDAHybridForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids).logits.float()
            assert_close_rel(logits, ref["logits"], rel=1e-4, name=label)
        generated = generate_with_logits(model, input_ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                         pad_token_id=0)
        assert torch.equal(generated.new, ref["tokens"]), label
        assert_close_rel(generated.logits, ref["step_logits"], rel=1e-4, name=f"{label}: generated logits")

    # The default for an original checkpoint is the Hub code's biased routing: with a non-zero router bias
    # it must give different logits from transformers' (unbiased) model, or the flag does nothing.
    biased = convert(src, tmp_path / "c", progress=False)
    model = KDAHybridForCausalLM.from_pretrained(biased, dtype=torch.float32).eval()
    assert model.config.router_weights_from_biased_scores is True
    with torch.no_grad():
        assert (model(input_ids).logits - ref["logits"]).abs().max() > 1e-3 * scale


@pytest.mark.slow
def test_output_loads_with_trust_remote_code(tmp_path):
    cfg = tiny_kimi_config()
    src = save_checkpoint(tmp_path / "kimi", random_state_dict(cfg), cfg)
    out = convert(src, tmp_path / "ours", progress=False)
    assert {"configuration_kda_hybrid.py", "modeling_kda_hybrid.py"} <= {p.name for p in out.iterdir()}
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        "print(m(torch.tensor([[3, 4, 5]])).logits.shape)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.Size([1, 3, 96])" in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# (e) The destination: never the source or unrelated files; atomic under SIGKILL; full disks
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    cfg = tiny_kimi_config()
    return save_checkpoint(tmp_path_factory.mktemp("src") / "kimi", random_state_dict(cfg), cfg, shards=2)


def test_overwrite_never_removes_the_source_or_what_contains_it(tmp_path):
    cfg = tiny_kimi_config()
    models = tmp_path / "models"
    src = save_checkpoint(models / "kimi", random_state_dict(cfg), cfg, shards=2)
    (models / "notes.txt").write_text("unrelated")
    (tmp_path / "link-to-models").symlink_to(models)
    (tmp_path / "link-to-src").symlink_to(src)
    before = snapshot(tmp_path)
    cases = [(models, "must not contain the source"), (tmp_path, "must not contain the source"),
             (tmp_path / "link-to-models", "must not contain the source"), (src, "must not be the source"),
             (tmp_path / "link-to-src", "must not be the source"), (src / "sub", "or inside it"),
             (tmp_path / "link-to-src" / "sub", "or inside it")]
    for dst, match in cases:
        with pytest.raises(ConversionError, match=match):
            convert(src, dst, overwrite=True, progress=False)
        assert cli_main([str(src), str(dst), "--overwrite", "--no-progress"]) == 1
    assert snapshot(tmp_path) == before and not (src / "sub").exists()


def test_overwrite_replaces_only_own_outputs_and_empty_folders(tmp_path, tiny_src, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = convert(tiny_src, empty, overwrite=True, progress=False)  # an empty folder may be replaced
    manifest = json.loads((out / "kda_hybrid_conversion.json").read_text())
    assert manifest["complete"] is True and set(manifest["files"]) == {p.name for p in out.iterdir()} - {
        "kda_hybrid_conversion.json"}
    first = snapshot(out)
    convert(tiny_src, out, overwrite=True, dtype="bfloat16", progress=False)  # ours: replaced
    assert snapshot(out) != first and leftovers(tmp_path) == []

    (out / "my_notes.md").write_text("written by the user")  # ours plus a foreign file: refused, kept
    kept = snapshot(out)
    with pytest.raises(ConversionError, match=r"1 entries this tool did not write \(my_notes.md\)"):
        convert(tiny_src, out, overwrite=True, progress=False)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"not ours")
    for dst in (out, foreign):
        assert cli_main([str(tiny_src), str(dst), "--overwrite", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "did not write (my_notes.md)" in err and "only replaces an empty folder or one this tool wrote" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ConversionError, match="is not a folder"):
        convert(tiny_src, a_file, overwrite=True, progress=False)
    assert snapshot(out) == kept and (foreign / "model.safetensors").read_bytes() == b"not ours"
    assert a_file.read_text() == "x" and leftovers(tmp_path) == []


def test_rerun_removes_dead_runs_staging_but_not_live_ones(tmp_path, tiny_src):
    import fcntl

    dst = tmp_path / "out"
    dead = tmp_path / ".out.kdaconv-0123456789ab.partial"  # what a SIGKILLed run leaves: unlocked
    dead.mkdir()
    (dead / "kda_hybrid_conversion.json").write_text(json.dumps({"tool": "kda_hybrid.conversion",
                                                                  "complete": False}))
    (dead / "part-00000.safetensors.tmp").write_bytes(b"\0" * 100)
    empty_dead = tmp_path / ".out.kdaconv-aaaaaaaaaaaa.partial"  # killed between mkdir and the manifest
    empty_dead.mkdir()
    live = tmp_path / ".out.kdaconv-ba9876543210.partial"  # another run still writing: locked
    live.mkdir()
    (live / "kda_hybrid_conversion.json").write_text(dead.joinpath("kda_hybrid_conversion.json").read_text())
    not_ours = tmp_path / ".out.kdaconv-cccccccccccc.partial"  # our name, but not our content
    not_ours.mkdir()
    (not_ours / "data.bin").write_bytes(b"x")
    other = tmp_path / ".other.kdaconv-0123456789ab.partial"  # another destination's dead run: garbage too
    other.mkdir()
    (other / "kda_hybrid_conversion.json").write_text(dead.joinpath("kda_hybrid_conversion.json").read_text())
    (other / "model.safetensors").write_bytes(b"\0" * 2000)
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        convert(tiny_src, dst, progress=False)
    finally:
        os.close(fd)
    assert leftovers(tmp_path) == sorted(p.name for p in (live, not_ours))
    assert read_folder(dst).keys() == kimi_inventory(tiny_kimi_config()).keys()


def _dead_staging(folder: Path, dst_name: str, size: int = 1000, tag: str = "0123456789ab") -> Path:
    path = folder / f".{dst_name}.kdaconv-{tag}.partial"
    path.mkdir()
    (path / "kda_hybrid_conversion.json").write_text(json.dumps({"tool": "kda_hybrid.conversion",
                                                                  "complete": False}))
    (path / "part-00000.safetensors.tmp").write_bytes(b"\0" * size)
    return path


def test_clean_removes_what_killed_runs_left_and_says_so(tmp_path, capsys):
    """--clean DIR: every dead run's staging folder in DIR goes (named, with its size), a live run's and a folder
    this tool did not write stay; with nothing to do it says so; it converts nothing and takes no SRC/DST."""
    import fcntl

    _dead_staging(tmp_path, "a", 270_000)
    _dead_staging(tmp_path, "b", 10)
    live = _dead_staging(tmp_path, "c", tag="ba9876543210")
    foreign = tmp_path / ".d.kdaconv-cccccccccccc.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert cli_main(["--clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert "removed .a.kdaconv-0123456789ab.partial (263.7 KiB), left by a killed run" in out, out
        assert "removed .b.kdaconv-0123456789ab.partial" in out
        assert leftovers(tmp_path) == sorted([live.name, foreign.name])
        assert cli_main(["--clean", str(tmp_path)]) == 0
        assert "no staging folder of a killed run" in capsys.readouterr().out
    finally:
        os.close(fd)
    assert cli_main(["--clean", str(tmp_path)]) == 0  # its run has ended (the lock is gone): now a leftover
    assert "removed .c.kdaconv-ba9876543210.partial" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--clean", str(tmp_path), "src", "dst"])
    assert exit_.value.code == 2 and "takes no SRC or DST" in capsys.readouterr().err
    assert cli_main(["--clean", str(tmp_path / "absent")]) == 1 and "not a folder" in capsys.readouterr().err


def test_help_says_where_a_killed_run_leaves_its_staging_folder(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ".<DST name>.kdaconv-<random>.partial" in text and "--clean DIR" in text and "SIGKILL" in text


def test_clean_walks_the_folders_under_dir_and_dry_run_only_lists(tmp_path, capsys):
    """--clean DIR finds dead runs' staging folders in DIR and every folder below it (not inside a staging folder,
    not through symlinks); --dry-run lists them, with the live and foreign ones it leaves alone, and changes
    nothing; --dry-run alone is a usage error."""
    import fcntl

    nested = tmp_path / "runs" / "2026" / "deep"
    nested.mkdir(parents=True)
    top = _dead_staging(tmp_path, "top", 5000)
    deep = _dead_staging(nested, "model", 270_000)
    inner = _dead_staging(deep, "inside")  # inside a staging folder: part of it, not a run of its own
    live = _dead_staging(tmp_path / "runs", "busy", tag="ba9876543210")
    foreign = tmp_path / "runs" / ".x.kdaconv-cccccccccccc.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    outside = _dead_staging(elsewhere, "outside")
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(tmp_path)
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert cli_main(["--clean", str(tmp_path), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert snapshot(tmp_path) == before and outside.exists(), "a dry run changed something"
        assert f"{tmp_path}: would remove {top.name} (4.9 KiB), left by a killed run" in out, out
        assert f"{nested}: would remove {deep.name} (264.8 KiB), left by a killed run" in out, out  # inner's too
        assert f"{live.name} (1.0 KiB): a running conversion's, left alone" in out, out
        assert f"{foreign.name}: not written by this tool" in out, out
        assert inner.name not in out and outside.name not in out, out
        assert cli_main(["--clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert f"{nested}: removed {deep.name}" in out and f"{tmp_path}: removed {top.name}" in out, out
        assert not top.exists() and not deep.exists() and live.exists() and foreign.exists() and outside.exists()
    finally:
        os.close(fd)
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--dry-run", "src", "dst"])
    assert exit_.value.code == 2 and "--dry-run goes with --clean" in capsys.readouterr().err


def test_a_run_names_its_staging_folder_and_a_failed_cleanup_says_where_it_is(tmp_path, tiny_src, monkeypatch,
                                                                             caplog):
    """The first thing a run logs is its staging folder (what a SIGKILLed run leaves); a failure whose cleanup
    fails too is one error naming the folder left behind and the command that removes it."""
    import logging

    from kda_hybrid.conversion import publish

    with caplog.at_level(logging.INFO, logger="kda_hybrid.conversion"):
        convert(tiny_src, tmp_path / "ok", progress=False)
    staged = [r.getMessage() for r in caplog.records if "writing into" in r.getMessage()]
    assert len(staged) == 1 and f"{tmp_path}/.ok.kdaconv-" in staged[0] and "--clean" in staged[0], staged

    def broken_publish(self, **kwargs):
        raise OSError(5, "Input/output error")

    def stuck_discard(self):
        raise PermissionError(13, "Permission denied", str(self.path))

    monkeypatch.setattr(publish.Staging, "publish", broken_publish)
    monkeypatch.setattr(publish.Staging, "discard", stuck_discard)
    with pytest.raises(ConversionError) as err:
        convert(tiny_src, tmp_path / "out", progress=False)
    (left,) = [tmp_path / name for name in leftovers(tmp_path)]
    message = str(err.value)
    assert "Input/output error" in message and str(left) in message, message
    assert f"python -m kda_hybrid.conversion --clean {tmp_path}" in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_a_cli_run_removes_its_staging_folder(tmp_path, tiny_src, monkeypatch, signame):
    """SIGTERM (kill, a scheduler's stop) and SIGHUP (the terminal closed) end a CLI run as Ctrl-C does: the
    staging folder is removed and DST never appears; the exit status is 128 + the signal."""
    import signal

    from kda_hybrid.conversion import publish

    sig = getattr(signal, signame)

    def terminated(self, **kwargs):
        os.kill(os.getpid(), sig)
        raise AssertionError(f"{signame} was not delivered")

    monkeypatch.setattr(publish.Staging, "publish", terminated)
    before = signal.getsignal(sig)
    with pytest.raises(SystemExit) as exit_:
        cli_main([str(tiny_src), str(tmp_path / "out"), "--no-progress"])
    assert exit_.value.code == 128 + sig
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()
    assert signal.getsignal(sig) is before


def _digest(folder: Path):
    return snapshot(folder) if folder.exists() else None


def _kill_points(run, n_random: int, seed: int, thorough: bool) -> list[int]:
    """Profiler event indices at which to SIGKILL `run()`: just before and just after every rename and
    removal of the publish and cleanup code and the staging folder's creation (`thorough`: every file-system
    call of the last 60), plus `n_random` uniform ones (most land in the streaming)."""
    import random

    events: list[str] = []

    def count(frame, event, arg):
        if event == "call":
            events.append(frame.f_code.co_name)
        elif event == "c_call":
            events.append(getattr(arg, "__name__", ""))

    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(None)
    renames = {"_rename2", "rename"}  # kill just before and just after each
    steps = renames | {"_remove", "rmdir", "mkdir", "_write_manifest"}  # kill just before each
    risky = steps | {"replace", "unlink", "_fsync", "save_file", "copyfile", "publish", "recover", "write_text"}
    publish = events.index("publish")
    points = {i + d for i, name in enumerate(events) if name in steps and (i > publish or name == "mkdir")
              for d in ((0, 1) if name in renames else (0,))}
    if thorough:
        points |= {i for i, name in enumerate(events) if name in risky}
    rng = random.Random(seed)
    return sorted(points | {rng.randrange(len(events)) for _ in range(n_random)})


def _run_killed_at(run, kill_at: int, *, fallback: bool) -> bool:
    """Fork; the child runs `run()` and SIGKILLs itself at profiler event `kill_at`. True if it was killed."""
    import signal

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            if fallback:
                from kda_hybrid.conversion import publish

                publish._RENAMEAT2 = None  # the two-rename protocol, as on systems without renameat2
            n = [0]

            def die(frame, event, arg):
                if event in ("call", "c_call"):
                    if n[0] == kill_at:
                        os.kill(os.getpid(), signal.SIGKILL)
                    n[0] += 1

            sys.setprofile(die)
            run()
            sys.setprofile(None)
            os._exit(0)
        except BaseException:
            os._exit(3)
    for _ in range(1200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        import time

        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError(f"conversion child killed at event {kill_at} hung")
    assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3), f"child failed at event {kill_at}"
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _assert_killed_runs_recover(tmp_path, src, *, overwrite, fallback, n_random, seed, thorough=False,
                                tensors: int | None = None):
    """`tensors`: how many the converted folder holds (default: the tiny Kimi Linear inventory's)."""
    from kda_hybrid.conversion.checkpoint import FolderSource

    tensors = len(kimi_inventory(tiny_kimi_config())) if tensors is None else tensors

    src_before = snapshot(src)
    new_ref = _digest(convert(src, tmp_path / "new-ref", max_shard_size="20KB", progress=False))
    old = None
    if overwrite:
        old = _digest(convert(src, tmp_path / "old-ref", dtype="bfloat16", progress=False))
        assert old != new_ref

    def fresh_scenario():
        dst = tmp_path / "work" / "out"
        if dst.parent.exists():
            import shutil

            shutil.rmtree(dst.parent)
        dst.parent.mkdir()
        if overwrite:
            convert(src, dst, dtype="bfloat16", progress=False)
        return dst

    def run():
        convert(src, tmp_path / "work" / "out", overwrite=overwrite, max_shard_size="20KB", progress=False)

    fresh_scenario()
    from kda_hybrid.conversion import publish

    renameat2 = publish._RENAMEAT2
    if fallback:  # the points are counted in the mode the children run in
        publish._RENAMEAT2 = None
    try:
        points = _kill_points(run, n_random, seed, thorough)
    finally:
        publish._RENAMEAT2 = renameat2
    for kill_at in points:
        dst = fresh_scenario()
        assert _run_killed_at(run, kill_at, fallback=fallback), f"event {kill_at}: the run ended before the kill"
        state = _digest(dst)
        if fallback and overwrite and state is None:  # killed between the two renames: old one aside
            from kda_hybrid.conversion.publish import recover

            assert any(".old" in line for line in leftovers(dst.parent))
            assert recover(dst) and (state := _digest(dst)) == old, f"event {kill_at}: old output not restored"
        allowed = [new_ref, old] if overwrite else [new_ref, None]
        assert state in allowed, f"killed at event {kill_at}: destination half-written"
        try:
            run()  # the rerun: cleans up, then converts (or refuses an existing dst without --overwrite)
        except ConversionError as err:
            assert not overwrite and state == new_ref and "already exists" in str(err)
        assert _digest(dst) == new_ref and leftovers(dst.parent) == [], f"event {kill_at}: rerun left {dst.parent}"
        assert len(FolderSource(dst).headers) == tensors  # loadable, every tensor
    assert snapshot(src) == src_before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to SIGKILL conversions cheaply")
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
def test_sigkill_at_any_point_leaves_old_or_new_output(tmp_path, tiny_src, overwrite, fallback):
    """A run SIGKILLed anywhere (every file-system step of the publish, plus random points in the streaming),
    then rerun: the destination was the old output or the complete new one, the rerun leaves no staging folder,
    the source is never touched."""
    _assert_killed_runs_recover(tmp_path, tiny_src, overwrite=overwrite, fallback=fallback, n_random=2, seed=0)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to SIGKILL conversions cheaply")
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-renames"])
@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_every_file_system_step(tmp_path, tiny_src, overwrite, fallback, seed):
    _assert_killed_runs_recover(tmp_path, tiny_src, overwrite=overwrite, fallback=fallback, n_random=10, seed=seed,
                                thorough=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_from_outside_at_random_times(tmp_path, seed):
    """Real subprocesses of the CLI killed after a random delay (no profiler), several seeds, plain and
    --overwrite, each kill checked to land while the run is still going; each time the destination is the old or
    the new output, and a rerun cleans up."""
    import random
    import shutil
    import signal
    import time

    rng = random.Random(seed)
    cfg = tiny_kimi_config(vocab_size=4000, hidden_size=64, intermediate_size=96, moe_intermediate_size=32)
    src = save_checkpoint(tmp_path / "kimi", random_state_dict(cfg), cfg, shards=4)
    src_before = snapshot(src)
    new_ref = _digest(convert(src, tmp_path / "new-ref", max_shard_size="50KB", progress=False))
    old_ref = _digest(convert(src, tmp_path / "old-ref", dtype="bfloat16", progress=False))
    cmd = [sys.executable, "-m", "kda_hybrid.conversion", str(src), "", "--no-progress", "--max-shard-size", "50KB"]
    started = time.monotonic()
    proc = subprocess.run(cmd[:4] + [str(tmp_path / "timing")] + cmd[5:], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    duration = time.monotonic() - started
    for i, overwrite in enumerate([False, True, False, True]):
        dst = tmp_path / f"run{i}" / "out"
        dst.parent.mkdir()
        args = cmd[:4] + [str(dst)] + cmd[5:] + (["--overwrite"] if overwrite else [])
        fraction = rng.uniform(0.3, 1.0)
        for _ in range(8):  # a run that ended before its kill is retried with an earlier one: every kill is mid-run
            if overwrite:
                convert(src, dst, dtype="bfloat16", progress=False, overwrite=True)
            elif dst.exists():
                shutil.rmtree(dst)
            child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(fraction * duration)
            # os.kill, not Popen.send_signal, which skips a child it finds ended: the exit status then says
            # whether the kill or the end of the run came first (a child between the two is still unreaped)
            os.kill(child.pid, signal.SIGKILL)
            returncode = child.wait()
            if returncode == -signal.SIGKILL:
                break
            assert returncode == 0, f"run {i}: the conversion failed on its own ({returncode})"
            fraction /= 2
        else:
            raise AssertionError(f"run {i}: every conversion ended before its kill ({duration:.2f} s runs)")
        assert _digest(dst) in ([new_ref, old_ref] if overwrite else [new_ref, None])
        if _digest(dst) != new_ref or overwrite:
            convert(src, dst, overwrite=overwrite, max_shard_size="50KB", progress=False)
        else:
            with pytest.raises(ConversionError, match="already exists"):  # refuses, but cleans up first
                convert(src, dst, max_shard_size="50KB", progress=False)
        assert _digest(dst) == new_ref and leftovers(dst.parent) == []
    assert snapshot(src) == src_before


def test_full_disk_is_one_clear_error_with_nothing_written(tmp_path, tiny_src, monkeypatch, capsys):
    import errno
    import shutil
    from collections import namedtuple

    from kda_hybrid.conversion import checkpoint

    dst = tmp_path / "out"
    usage = namedtuple("usage", "total used free")
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    tensor_bytes = sum(t.numel() * t.element_size() for t in read_folder(tiny_src).values())
    with pytest.raises(ConversionError, match=r"out: not enough free space: the output needs ([\d,]+) bytes") as err:
        convert(tiny_src, dst, progress=False)
    assert int(err.value.args[0].split("needs ")[1].split(" bytes")[0].replace(",", "")) > tensor_bytes
    assert "1,000 bytes (1,000 B) free" in str(err.value)
    assert cli_main([str(tiny_src), str(dst), "--no-progress"]) == 1
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: ") and "not enough free space" in message and "\n" not in message
    assert not dst.exists() and leftovers(tmp_path) == []
    with pytest.raises(ConversionError, match="not enough free space"):  # a parent that does not exist yet
        convert(tiny_src, tmp_path / "new" / "parent" / "out", progress=False)
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(shutil, "disk_usage", real_usage)

    # The disk fills up while writing (another process took the space): the OS error and safetensors' own
    # exception both become the same one line, and nothing is left behind.
    from safetensors import SafetensorError

    for failure in (OSError(errno.ENOSPC, "No space left on device"),
                    SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                    'message: "No space left on device" })')):
        def full(*args, failure=failure, **kwargs):
            raise failure

        monkeypatch.setattr(checkpoint, "_save_file", full)
        with pytest.raises(ConversionError, match=r"out: no space left on the device while writing: the output "
                                                  r"needs [\d,]+ bytes"):
            convert(tiny_src, dst, max_shard_size="20KB", progress=False)
        assert not dst.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--from", "gguf"], "argument --from: invalid choice: 'gguf'"),
    (["--to", "transformers"], "argument --to: invalid choice: 'transformers'"),
    (["--max-shard-size", "lots"], "argument --max-shard-size: expected e.g. '5GB'"),
    (["--max-shard-size", "0"], "argument --max-shard-size: expected a positive size, got '0'"),
    (["--biased-router", "--unbiased-router"], "not allowed with argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
], ids=["dtype", "from", "to", "shard-size", "shard-size-zero", "router-both", "unknown"])
def test_cli_bad_flags_fail_before_anything_is_written(tmp_path, tiny_src, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli_main([str(tiny_src), str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m kda_hybrid.conversion") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_bad_inputs_fail_before_anything_is_written(tmp_path, tiny_src, capsys):
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    for src, dst, message in [(tmp_path / "missing", tmp_path / "o1", "missing: not a folder"),
                              (no_config, tmp_path / "o2", "no-config: no config.json"),
                              (tiny_src, tmp_path / "sub" / "o3", None)]:
        code = cli_main([str(src), str(dst), "--no-progress", "--dtype", "float16"])
        err = capsys.readouterr().err
        if message is None:
            assert code == 0 and (dst / "config.json").is_file()
        else:
            assert code == 1 and err.startswith("error: ") and message in err and not dst.exists()
    with pytest.raises(SystemExit):
        cli_main([str(tiny_src), "", "--no-progress"])
    assert "DST must be a folder path" in capsys.readouterr().err
    for kwargs, name in [(dict(overwrite="yes"), "overwrite"), (dict(max_shard_size=True), "max shard size"),
                         (dict(router_weights_from_biased_scores=1), "router_weights_from_biased_scores"),
                         (dict(dtype="int8"), "dtype"), (dict(source="onnx"), "source"), (dict(target="x"), "target")]:
        with pytest.raises(ConversionError, match=name):
            convert(tiny_src, tmp_path / "o4", progress=False, **kwargs)
    assert not (tmp_path / "o4").exists() and leftovers(tmp_path) == []
