"""Plan, then stream: validate the whole mapping from headers alone, then read one source shard at a time,
write output shards as they fill, and publish the output folder with one rename at the end."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import FolderSource, Header, MemorySink, MemorySource, ShardWriter, Source, name_list, parse_size
from .configs import (
    KDA_HYBRID,
    SOURCE_FORMATS,
    TARGET_FORMATS,
    TRANSFORMERS,
    detect_format,
    kda_hybrid_config,
    kimi_linear_config,
    read_config,
    source_router_semantics,
    source_to_kimi_dict,
)
from .from_attention import ATTENTION_SOURCES, KDAInit, hybrid_config, is_attention_source
from .layout import ConversionError, Group, Rule, Spec, apply_rule, identity_groups, kimi_inventory, native_groups

logger = logging.getLogger("kda_hybrid.conversion")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Files carried over unchanged: tokenizer (Kimi's is tiktoken-based, with remote code in tokenization_*.py),
# generation defaults, chat template, licence. Weights, indexes, config.json and modeling code are not.
_CARRIED = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "generation_config.json",
            "chat_template*", "*.tiktoken", "tiktoken.model", "tokenizer.model", "vocab.*", "merges.txt",
            "tokenization_*.py", "LICENSE*", "NOTICE*")


@dataclass
class Plan:
    rules: list[Rule]  # in target (layer) order
    inventory: dict[str, Spec]
    out_dtypes: dict[str, torch.dtype]


def make_plan(headers: Mapping[str, Header], groups: list[Group], inventory: dict[str, Spec],
              dtype: torch.dtype | None) -> Plan:
    """Choose a rule per target from the source's headers; fail listing every missing, unknown, misshapen or
    non-float tensor. Reads no tensor data."""
    rules: list[Rule] = []
    missing: list[str] = []
    for alternatives in groups:
        present = [sum(r.source in headers for r in alt) for alt in alternatives]
        complete = [alt for alt, n in zip(alternatives, present) if n == len(alt)]
        if complete:
            rules.extend(complete[0])
        else:  # report the naming the source mostly uses
            best = alternatives[max(range(len(alternatives)), key=present.__getitem__)]
            missing.extend(r.source for r in best if r.source not in headers)
    consumed = {r.source for r in rules}
    unexpected = sorted(set(headers) - consumed)
    bad_shape = [f"{r.source} (expected {list(r.source_shape)}, got {list(headers[r.source].shape)})"
                 for r in rules if tuple(headers[r.source].shape) != r.source_shape]
    bad_dtype = sorted(f"{s} ({headers[s].dtype})" for s in consumed if not headers[s].dtype.is_floating_point)
    problems = [p for p in (name_list("missing tensors", missing), name_list("unexpected tensors", unexpected),
                            name_list("tensors with the wrong shape", bad_shape),
                            name_list("non-float tensors", bad_dtype)) if p]
    if problems:
        raise ConversionError("the checkpoint does not match its config:\n  " + "\n  ".join(problems))

    produced = [t for r in rules for t in r.targets]
    assert sorted(produced) == sorted(inventory), "rules do not produce exactly the inventory"
    order = {name: i for i, name in enumerate(inventory)}
    rules.sort(key=lambda r: order[r.targets[0]])
    out_dtypes = {}
    for r in rules:
        source_dtype = headers[r.source].dtype
        for t in r.targets:
            spec = inventory[t]
            if spec.fp32 or (spec.no_downcast and source_dtype == torch.float32):
                out_dtypes[t] = torch.float32
            else:
                out_dtypes[t] = dtype or source_dtype
    return Plan(rules, inventory, out_dtypes)


def execute(plan: Plan, source: Source, sink, *, progress: bool = False) -> None:
    """Stream `source` through `plan` into `sink`: one source file open at a time, its rules run in target
    (layer) order, each source tensor released once its targets are handed to the sink."""
    by_file: dict[str, list[Rule]] = defaultdict(list)
    for r in plan.rules:
        by_file[source.headers[r.source].file].append(r)
    total = sum(source.nbytes(f) for f in source.files)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting")
    try:
        for file in source.files:
            with source.open(file) as get:
                for rule in by_file[file]:
                    x = get(rule.source)
                    for name, t in zip(rule.targets, apply_rule(rule, x)):
                        expected = plan.inventory[name].shape
                        if tuple(t.shape) != expected:  # a rule bug, not a data problem: fail loudly
                            raise ConversionError(f"{name}: produced shape {list(t.shape)}, expected {list(expected)}")
                        sink.add(name, t.to(plan.out_dtypes[name]))
                    if bar is not None:
                        bar.update(x.numel() * x.element_size())
                    del x
    finally:
        if bar is not None:
            bar.close()


def _groups(source_format: str, kimi: dict, inventory: dict[str, Spec]) -> list[Group]:
    return native_groups(kimi, inventory) if source_format == TRANSFORMERS else identity_groups(inventory)


def _resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or dtype == "keep":
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConversionError(f"dtype: expected one of {sorted(DTYPES)} or 'keep', got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ConversionError(f"dtype: expected one of {sorted(DTYPES)} or 'keep', got {dtype!r}")
    return DTYPES[dtype]


def convert_state_dict(tensors: Mapping[str, torch.Tensor] | list[Mapping[str, torch.Tensor]], config: dict, *,
                       source: str, dtype=None) -> dict[str, torch.Tensor]:
    """Convert in memory: `tensors` (one dict, or a list of dicts = shards) named as `source`
    ("kimi_linear" | "transformers" | "kda_hybrid"), `config` that source's config.json dict. Returns the
    tensors under original Kimi-Linear names, which are also ours. Works on meta tensors (dry runs)."""
    if source not in SOURCE_FORMATS:
        raise ConversionError(f"source: expected one of {SOURCE_FORMATS}, got {source!r}")
    reader = MemorySource([dict(tensors)] if isinstance(tensors, Mapping) else [dict(t) for t in tensors])
    kimi = source_to_kimi_dict(config, source)
    inventory = kimi_inventory(kimi)
    plan = make_plan(reader.headers, _groups(source, kimi, inventory), inventory, _resolve_dtype(dtype))
    sink = MemorySink()
    execute(plan, reader, sink)
    return sink.close()


def convert(src, dst, *, source: str | None = None, target: str = KDA_HYBRID, dtype=None,
            max_shard_size: int | str = "5GB", overwrite: bool = False,
            router_weights_from_biased_scores: bool | None = None, layer_types: str | None = None,
            kda_init: KDAInit | None = None, progress: bool = True) -> Path:
    """Convert the checkpoint folder `src` into a new folder `dst`.

    source: "kimi_linear" (Moonshot's Hub layout), "transformers" (transformers' native kimi_linear, fused or
        saved with original names), "kda_hybrid" (ours), or None to detect it from config.json and the names.
    target: "kda_hybrid" (ours, loads with `from_pretrained` and `trust_remote_code=True`) or "kimi_linear".
    dtype: None/"keep" keeps each tensor's dtype; "bfloat16"/"float16"/"float32" casts. A_log, dt_bias and the
        router bias stay float32 either way.
    router_weights_from_biased_scores: routing semantics written into our config; None picks what the
        source's reference code does (original Hub code: True; transformers: False; ours: as saved).
    layer_types: for a Llama / Mistral / Qwen2 / Qwen3 source (detected from config.json), one letter per layer
        ('k' = KDA, 'A' = keep the attention) or a pattern repeated to the depth, e.g. "kkkA"
        (see `from_attention`); kda_init tunes the new KDA layers' starting values.
    Every source tensor must be consumed and every target tensor produced with the expected shape, else
    ConversionError names them all. Output is written to a temporary sibling folder and renamed at the end,
    so a failure leaves nothing behind. An existing `dst` is refused unless `overwrite`.
    """
    src, dst = Path(src), Path(dst)
    if target not in TARGET_FORMATS:
        raise ConversionError(f"target: expected one of {TARGET_FORMATS}, got {target!r}")
    if source is not None and source not in SOURCE_FORMATS:
        raise ConversionError(f"source: expected one of {SOURCE_FORMATS}, got {source!r}")
    cast = _resolve_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    if not src.is_dir():
        raise ConversionError(f"{src}: not a folder")
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ConversionError(f"{dst}: the output must not be the source folder or inside it")

    raw = read_config(src)
    reader = FolderSource(src)
    if is_attention_source(raw):
        return _convert_attention(src, dst, raw, reader, layer_types=layer_types, target=target, cast=cast,
                                  max_bytes=max_bytes, overwrite=overwrite, kda_init=kda_init or KDAInit(),
                                  progress=progress)
    if layer_types is not None:
        raise ConversionError(f"layer_types (--layer-types) applies to {'/'.join(ATTENTION_SOURCES)} sources; "
                              f"{src} is a {raw.get('model_type')!r} checkpoint, whose layer types are fixed")
    source_format = source or detect_format(raw, reader.headers)
    kimi = source_to_kimi_dict(raw, source_format)
    inventory = kimi_inventory(kimi)
    plan = make_plan(reader.headers, _groups(source_format, kimi, inventory), inventory, cast)
    biased = source_router_semantics(raw, source_format)
    if router_weights_from_biased_scores is not None:
        biased = bool(router_weights_from_biased_scores)
    dtype_name = str(cast or _main_dtype(plan)).removeprefix("torch.")
    logger.info("source format %s, %d tensors -> %s, %d tensors (%s; router weights from %s scores)",
                source_format, len(reader.headers), target, len(inventory), dtype_name,
                "biased" if biased else "unbiased")

    # Build the output config before writing anything: a config problem must not cost a full conversion.
    if target == KDA_HYBRID:
        config = kda_hybrid_config(kimi, router_weights_from_biased_scores=biased, dtype=dtype_name)
        if kimi_inventory(config.to_kimi_linear_dict()) != inventory:
            raise ConversionError("KDAHybridConfig does not reproduce the source architecture (tensor inventories "
                                  "differ); this is a bug in the config conversion")
    else:
        config = kimi_linear_config(kimi, source_config=raw, source_format=source_format, dtype=dtype_name)
        if not biased:
            logger.warning("the original Kimi-Linear remote code gathers router weights from the bias-corrected "
                           "scores; this model was used with unbiased weights (transformers/vLLM). Outputs of the "
                           "original code will differ; transformers' native class matches.")

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the published folder gets the usual permissions
        writer = ShardWriter(tmp, max_bytes)
        execute(plan, reader, writer, progress=progress)
        writer.close()
        if target == KDA_HYBRID:
            _save_kda_hybrid_config(config, tmp)
        else:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _carry_files(src, tmp, same_format=source_format == target)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _convert_attention(src: Path, dst: Path, raw: dict, reader: FolderSource, *, layer_types, target, cast,
                       max_bytes, overwrite, kda_init, progress) -> Path:
    from .from_attention import AttentionConversionError, check_plan, stream

    if target != KDA_HYBRID:
        raise ConversionError(f"target: a {raw['model_type']} source converts to {KDA_HYBRID!r} only, got {target!r}")
    if layer_types is None:
        raise ConversionError(f"{src} is a {raw['model_type']} checkpoint: pass layer_types (--layer-types), one "
                              "letter per layer, 'k' = KDA and 'A' = attention, e.g. kkkA")
    try:
        config = hybrid_config(raw, layer_types)
        check_plan(config, raw, reader.headers)
    except AttentionConversionError as err:
        raise ConversionError(str(err)) from None
    main = cast or reader.headers["model.embed_tokens.weight"].dtype
    config.dtype = str(main).removeprefix("torch.")
    pattern = "".join("k" if t == "linear_attention" else "A" for t in config.layer_types)
    logger.info("source format %s, %d tensors -> %s (%s, layers %s)", raw["model_type"], len(reader.headers),
                KDA_HYBRID, config.dtype, pattern)

    def fill(tmp: Path) -> None:
        writer = ShardWriter(tmp, max_bytes)
        stream(config, raw, reader, _CastingSink(writer, cast), init=kda_init, progress=progress)
        writer.close()
        _save_kda_hybrid_config(config, tmp)
        _carry_files(src, tmp, same_format=False)

    _write_folder(dst, fill, overwrite=overwrite)
    return dst


class _CastingSink:
    """Casts floating tensors to `dtype` (A_log and dt_bias stay float32) on their way to `sink`."""

    def __init__(self, sink, dtype: torch.dtype | None):
        self.sink, self.dtype = sink, dtype

    def add(self, name: str, tensor: torch.Tensor):
        keep = self.dtype is None or name.endswith((".A_log", ".dt_bias"))
        self.sink.add(name, tensor if keep else tensor.to(self.dtype))


def _write_folder(dst: Path, fill, *, overwrite: bool) -> None:
    """Fill a hidden temporary sibling of `dst` with `fill(tmp)`, then publish it (see `_publish`); on any failure
    the temporary folder is removed and `dst` is left as it was."""
    if dst.exists() and not overwrite:
        raise ConversionError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the published folder gets the usual permissions
        fill(tmp)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _main_dtype(plan: Plan) -> torch.dtype:
    counts = Counter(dt for name, dt in plan.out_dtypes.items()
                     if not (plan.inventory[name].fp32 or plan.inventory[name].no_downcast))
    return counts.most_common(1)[0][0] if counts else torch.float32


def _save_kda_hybrid_config(config, folder: Path) -> None:
    """config.json plus the flat model code files, so the folder loads with trust_remote_code=True."""
    if importlib.util.find_spec("kda_hybrid.modeling_kda_hybrid") is None:
        logger.warning("kda_hybrid.modeling_kda_hybrid not found: writing config.json without model code")
        config.save_pretrained(folder)
        return
    from transformers.dynamic_module_utils import get_relative_import_files

    modeling = importlib.import_module("kda_hybrid.modeling_kda_hybrid")
    for file in [modeling.__file__, *get_relative_import_files(modeling.__file__)]:
        shutil.copyfile(file, folder / Path(file).name)
    auto_map = {"AutoConfig": "configuration_kda_hybrid.KDAHybridConfig",
                "AutoModelForCausalLM": "modeling_kda_hybrid.KDAHybridForCausalLM"}
    if hasattr(modeling, "KDAHybridModel"):
        auto_map["AutoModel"] = "modeling_kda_hybrid.KDAHybridModel"
    config.auto_map = auto_map
    config.save_pretrained(folder)


def _carry_files(src: Path, dst: Path, *, same_format: bool) -> None:
    carried = {p for pattern in _CARRIED for p in src.glob(pattern) if p.is_file()}
    if same_format:  # a re-shard or cast keeps the format's own code (e.g. the Hub's modeling_kimi.py)
        carried |= {p for p in src.glob("*.py") if p.is_file()}
    for path in sorted(carried):
        if not (dst / path.name).exists():
            shutil.copyfile(path, dst / path.name)


def _publish(tmp: Path, dst: Path) -> None:
    """Rename the finished folder into place; an existing dst (overwrite) is moved aside first, then removed."""
    if not dst.exists() and not dst.is_symlink():
        tmp.rename(dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
    aside = old / "previous"
    dst.rename(aside)
    try:
        tmp.rename(dst)
    except BaseException:
        aside.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
