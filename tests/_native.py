"""transformers' native `KimiLinearForCausalLM` as an independent oracle, run in a subprocess with fla blocked.

Why a subprocess: with flash-linear-attention installed, importing transformers' kimi_linear binds fla's
Triton kernels (`use_kernel_func_from_hub_with_fallback` imports `fla` at decoration time) and they crash on
CPU tensors. A meta-path finder that refuses `fla` makes that import fail, so the native model binds its
PyTorch fallbacks; doing it in a fresh interpreter keeps fla usable in the test process itself.

    from tests._native import run_native
    [out] = run_native([model_dir], input_ids, max_new_tokens=8)   # out["logits"], out["tokens"], ...

`model_dir` holds a config.json (original Kimi-Linear style or transformers' own) and safetensors named
either way: transformers converts original names on load. Loading is strict: any missing, unexpected or
misshapen tensor fails the run instead of leaving randomly initialised weights behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kda_hybrid.bench.native import block_fla  # importing kda_hybrid binds no fla and no native kimi_linear


def run_native(model_dirs, input_ids, *, max_new_tokens: int = 0, save_native_to=None,
               max_shard_size: str = "20KB", timeout: float = 600) -> list[dict]:
    """For each folder: fp32 logits of `input_ids` ([B, T] LongTensor) and, if `max_new_tokens`, the greedy
    continuation (`generate`, cache on): "tokens" [B, n] and "step_logits" [B, n, V], the raw logits that chose
    them. One subprocess for all folders (importing transformers is most of
    the cost). `save_native_to` (list of folders or None, parallel to `model_dirs`): also save each model
    with transformers' own fused names (`save_original_format=False`), in shards of `max_shard_size`."""
    from safetensors.torch import load_file, save_file

    model_dirs = [str(d) for d in model_dirs]
    save_native_to = [None] * len(model_dirs) if save_native_to is None else [s and str(s) for s in save_native_to]
    with tempfile.TemporaryDirectory(prefix="native-") as work:
        work = Path(work)
        save_file({"input_ids": input_ids.contiguous()}, work / "inputs.safetensors")
        jobs = [{"model": d, "out": str(work / f"out{i}.safetensors"), "save_native_to": s}
                for i, (d, s) in enumerate(zip(model_dirs, save_native_to))]
        spec = {"inputs": str(work / "inputs.safetensors"), "max_new_tokens": max_new_tokens,
                "max_shard_size": max_shard_size, "jobs": jobs}
        (work / "job.json").write_text(json.dumps(spec))
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([sys.executable, __file__, str(work / "job.json")], capture_output=True, text=True,
                              timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"native kimi_linear subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return [dict(load_file(job["out"])) for job in jobs]


def save_checkpoint(folder, state_dict: dict, config: dict, *, shards: int = 1) -> Path:
    """Write `config` as config.json and `state_dict` as `shards` safetensors files (+ index when > 1), split
    in order so consecutive tensors (a layer) tend to share a shard. The layout `run_native` and the
    converter read."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    names = list(state_dict)
    if shards == 1:
        save_file({n: state_dict[n].contiguous() for n in names}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        return folder
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per:(i + 1) * per]
        save_file({n: state_dict[n].contiguous() for n in part}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    size = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2))
    return folder


def _main(job_file: str) -> None:
    block_fla()
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as native

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    for fn in (native.chunk_kimi_delta_attention, native.recurrent_kimi_delta_attention):
        assert "fla" not in getattr(fn, "__module__", ""), "fla kernels are bound; the block did not work"
    spec = json.loads(Path(job_file).read_text())
    input_ids = load_file(spec["inputs"])["input_ids"]
    for job in spec["jobs"]:
        model, info = KimiLinearForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                            output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
            {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {})
        if problems:
            raise SystemExit(f"{job['model']}: native load is not clean: {problems}")
        model.eval()
        with torch.no_grad():
            out = {"logits": model(input_ids).logits.float().contiguous()}
            if spec["max_new_tokens"]:
                gen = model.generate(input_ids, max_new_tokens=spec["max_new_tokens"], do_sample=False,
                                     min_new_tokens=spec["max_new_tokens"], pad_token_id=0,
                                     return_dict_in_generate=True, output_logits=True)
                out["tokens"] = gen.sequences[:, input_ids.shape[1]:].contiguous()
                out["step_logits"] = torch.stack(gen.logits, 1).float().contiguous()
        save_file(out, job["out"])
        if job["save_native_to"]:
            model.save_pretrained(job["save_native_to"], save_original_format=False,
                                  max_shard_size=spec["max_shard_size"])


if __name__ == "__main__":
    _main(sys.argv[1])
