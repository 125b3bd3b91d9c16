"""Plan, then stream: validate the whole mapping from headers alone, then read one source shard at a time,
write output shards as they fill into a staging folder, and publish it atomically at the end (publish.py)."""

from __future__ import annotations

import copy
import logging
import shutil
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint_kda_hybrid import CARRIED_MODULES, write_checkpoint_metadata
from .checkpoint import FolderSource, Header, MemorySink, MemorySource, ShardWriter, Source, name_list, parse_size
from .configs import GGUF, KDA_HYBRID, read_config
from .formats import FORMATS, SOURCE_FORMATS, TARGET_FORMATS, CheckpointFormat, detect_format
from .from_attention import ATTENTION_SOURCES, KDAInit, is_attention_source
from .gguf import find_gguf, gguf_config, gguf_source
from .layout import ConversionError, Group, Rule, Spec, apply_rule, kimi_inventory
from .publish import (
    MANIFEST,
    Staging,
    check_destination,
    check_file_destination,
    check_free_space,
    check_paths,
    is_out_of_space,
    recover_folder,
)

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
    quantized = {r.source for r in rules if any(inventory[t].quantized for t in r.targets)}
    bad_dtype = sorted(f"{s} ({headers[s].dtype})" for s in consumed
                       if headers[s].dtype.is_floating_point == (s in quantized) or
                       (s in quantized and headers[s].dtype != torch.uint8))
    problems = [p for p in (name_list("missing tensors", missing), name_list("unexpected tensors", unexpected),
                            name_list("tensors with the wrong shape", bad_shape),
                            name_list("tensors of the wrong dtype (float expected; uint8 for MXFP4 experts)",
                                      bad_dtype)) if p]
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
            if spec.quantized:  # MXFP4 bytes as stored, whatever --dtype says
                out_dtypes[t] = torch.uint8
            elif spec.fp32 or (spec.no_downcast and source_dtype == torch.float32):
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
                    shapes = [plan.inventory[t].shape for t in rule.targets]
                    for name, t in zip(rule.targets, apply_rule(rule, x, shapes)):
                        expected = plan.inventory[name].shape
                        if tuple(t.shape) != expected:  # a rule bug, not a data problem: fail loudly
                            raise ConversionError(f"{name}: produced shape {list(t.shape)}, expected {list(expected)}")
                        if plan.inventory[name].quantized and name.endswith(".weight_scale") and not t.is_meta \
                                and bool((t == 255).any()):
                            raise ConversionError(f"{rule.source}: an MXFP4 scale byte is 255 (NaN in E8M0); the "
                                                  "checkpoint is corrupt (nothing was written)")
                        sink.add(name, t.to(plan.out_dtypes[name]))
                    if bar is not None:
                        bar.update(x.numel() * x.element_size())
                    del x
    finally:
        if bar is not None:
            bar.close()


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
    """Convert in memory: `tensors` (one dict, or a list of dicts = shards) named as `source` (a SOURCE_FORMATS
    name: "kimi_linear" | "transformers" | "kda_hybrid" | "kimi_k3"), `config` that source's config.json dict.
    Returns the tensors under original Kimi-Linear names, which are also ours (a K3 source's vision tensors are
    left out). Works on meta tensors (dry runs)."""
    if source not in SOURCE_FORMATS:
        raise ConversionError(f"source: expected one of {SOURCE_FORMATS}, got {source!r}")
    reader = MemorySource([dict(tensors)] if isinstance(tensors, Mapping) else [dict(t) for t in tensors])
    fmt = FORMATS[source]
    parsed = fmt.parse(config)
    plan = _plan(fmt, parsed, reader.headers, _resolve_dtype(dtype))
    sink = MemorySink()
    execute(plan, reader, sink)
    return sink.close()


def _check_arguments(source, target, overwrite, progress, router_weights_from_biased_scores, shared_kv) -> None:
    if target not in TARGET_FORMATS:
        raise ConversionError(f"target: expected one of {TARGET_FORMATS}, got {target!r}")
    if source is not None and source not in SOURCE_FORMATS:
        raise ConversionError(f"source: expected one of {SOURCE_FORMATS}, got {source!r}")
    for name, flag in (("overwrite", overwrite), ("progress", progress), ("shared_kv", shared_kv)):
        if not isinstance(flag, bool):
            raise ConversionError(f"{name}: expected True or False, got {flag!r}")
    if router_weights_from_biased_scores is not None and not isinstance(router_weights_from_biased_scores, bool):
        raise ConversionError("router_weights_from_biased_scores: expected True, False or None, got "
                              f"{router_weights_from_biased_scores!r}")


def convert(src, dst, *, source: str | None = None, target: str = KDA_HYBRID, dtype=None,
            max_shard_size: int | str = "5GB", overwrite: bool = False,
            router_weights_from_biased_scores: bool | None = None, layer_types: str | None = None,
            kda_init: KDAInit | None = None, shared_kv: bool = False, progress: bool = True, patch=None) -> Path:
    """Convert the checkpoint `src` into a new folder `dst`.

    source: "kimi_linear" (Moonshot's Hub layout), "transformers" (transformers' native kimi_linear, fused or
        saved with original names), "kda_hybrid" (ours), or None to detect it from config.json and the names.
    target: "kda_hybrid" (ours, loads with `from_pretrained` and `trust_remote_code=True`), "kimi_linear" or
        "kimi_k3" (the released K3 text layout: `language_model.` names, A_log padded, convs and o_norm fp32).
    dtype: None/"keep" keeps each tensor's dtype; "bfloat16"/"float16"/"float32" casts. A_log, dt_bias and the
        router bias stay float32 either way.
    router_weights_from_biased_scores: routing semantics written into our config; None picks what the
        source's reference code does (original Hub code: True; transformers: False; ours: as saved).
    src: a checkpoint folder, or a GGUF file (or a folder holding one and no config.json) of the Llama / Mistral /
        Qwen2 / Qwen3 family (gguf.py: read through transformers' GGUF loader, tokenizer and chat template kept).
    layer_types: for a Llama / Mistral / Qwen2 / Qwen3 source (detected from config.json), one letter per layer
        ('k' = KDA, 'A' = keep the attention) or a pattern repeated to the depth, e.g. "kkkA"
        (see `from_attention`); kda_init tunes the new KDA layers' starting values; shared_kv keeps the source's
        key/value heads in the KDA layers (one recurrent state per key/value head). patch (attention sources
        only; delta.py's rebuild): `patch.check_names(shapes)` before anything is read, `patch.apply(name,
        tensor) -> tensor` on every output tensor, `patch.finish(folder)` before the output is published (raise there
        and nothing is written).
    Every source tensor must be consumed and every target tensor produced with the expected shape, else
    ConversionError names them all. Output is staged in a hidden sibling folder and swapped into place at the
    end, so `dst` is at every instant absent, the old output or the complete new one, even if the run is killed
    (docs/conversion.md, "Crash safety"); a rerun cleans up what a killed run left. An existing `dst` is refused
    unless `overwrite`, and even then only an empty folder or an earlier output of this tool is replaced, never
    the source, a folder inside it or a folder containing it.
    """
    src, dst = Path(src), Path(dst)
    _check_arguments(source, target, overwrite, progress, router_weights_from_biased_scores, shared_kv)
    cast, max_bytes = _resolve_dtype(dtype), parse_size(max_shard_size)
    gguf, dst_real = _check_destination(src, dst, target, overwrite)

    attention = dict(layer_types=layer_types, target=target, cast=cast, max_bytes=max_bytes, overwrite=overwrite,
                     kda_init=kda_init or KDAInit(), shared_kv=shared_kv, progress=progress, patch=patch)
    if gguf is not None:
        if source is not None:
            raise ConversionError(f"source: a GGUF file is read as what its metadata says, got source={source!r}")
        return _convert_attention(gguf, dst, dst_real, gguf_config(gguf), lambda: gguf_source(gguf, progress),
                                  **attention)
    raw, reader = read_config(src), FolderSource(src)
    if is_attention_source(raw):
        return _convert_attention(src, dst, dst_real, raw, lambda: (reader, None), **attention)
    _refuse_attention_options(src, raw, patch=patch, layer_types=layer_types, shared_kv=shared_kv)
    fmt = FORMATS[source or detect_format(raw, reader.headers)]
    parsed = fmt.parse(raw)
    biased = fmt.biased_router(raw) if router_weights_from_biased_scores is None else router_weights_from_biased_scores
    if target == GGUF:  # what llama.cpp cannot run, named before the layout is even planned
        parsed, arch = _llama_cpp_config(parsed, biased)
    plan = _plan(fmt, parsed, reader.headers, cast)
    dtype_name = str(cast or _main_dtype(plan)).removeprefix("torch.")
    logger.info("source format %s, %d tensors -> %s, %d tensors (%s; router weights from %s scores)", fmt.name,
                len(reader.headers), target, len(plan.inventory), dtype_name, "biased" if biased else "unbiased")
    if target == GGUF:
        return _convert_to_gguf(src, dst, dst_real, parsed, arch, plan, reader, cast=cast, overwrite=overwrite,
                                progress=progress)
    _convert_to_folder(src, dst, dst_real, fmt, FORMATS[target], raw, parsed, plan, reader, biased=biased,
                       dtype_name=dtype_name, max_bytes=max_bytes, overwrite=overwrite, progress=progress)
    return dst


def _check_destination(src: Path, dst: Path, target: str, overwrite: bool) -> tuple[Path | None, Path]:
    """(the GGUF file `src` names or None for a checkpoint folder, `dst` resolved), once `dst` is known to be a
    destination this conversion may write (never the source, inside it or around it) and what killed runs left
    beside it is cleaned up: before anything is read or written."""
    gguf = find_gguf(src)
    if gguf is None and not src.is_dir():
        raise ConversionError(f"{src}: not a folder or a .gguf file")
    dst_real = check_paths(gguf or src, dst)
    for line in recover_folder(dst_real.parent):  # only ours, only dead runs'
        logger.warning("%s: %s", dst_real.parent, line)
    if target == GGUF:
        check_file_destination(dst, dst_real, suffix=".gguf", magic=b"GGUF", overwrite=overwrite)
    else:
        check_destination(gguf or src, dst, overwrite=overwrite)
    return gguf, dst_real


def _refuse_attention_options(src: Path, raw: dict, *, patch, layer_types, shared_kv) -> None:
    if shared_kv:
        raise ConversionError(f"shared_kv (--shared-kv) applies to {'/'.join(ATTENTION_SOURCES)} sources; {src} is "
                              f"a {raw.get('model_type')!r} checkpoint, whose KDA heads are fixed")
    if patch is not None:
        raise ConversionError("patch applies to Llama-family sources (a delta over a converted teacher)")
    if layer_types is not None:
        raise ConversionError(f"layer_types (--layer-types) applies to {'/'.join(ATTENTION_SOURCES)} sources; "
                              f"{src} is a {raw.get('model_type')!r} checkpoint, whose layer types are fixed")


def _plan(fmt: CheckpointFormat, parsed, headers: Mapping[str, Header], cast) -> Plan:
    """The plan for a checkpoint of layout `fmt` (config `parsed`): its text model's tensors to our inventory."""
    inventory = kimi_inventory(parsed)
    text, _ = fmt.text_headers(headers)
    return make_plan(text, fmt.groups(parsed, inventory, text), inventory, cast)


def _convert_to_folder(src: Path, dst: Path, dst_real: Path, source: CheckpointFormat, target: CheckpointFormat,
                       raw: dict, parsed, plan: Plan, reader: Source, *, biased: bool, dtype_name: str,
                       max_bytes: int, overwrite: bool, progress: bool) -> None:
    """A Kimi Linear or K3 checkpoint (any layout) -> a folder in layout `target`, staged and published."""
    out = target.target
    out.check(target.name, parsed)
    # Build the output config before writing anything: a config problem must not cost a full conversion.
    config = out.config(parsed, raw=raw, same_layout=source is target, biased=biased, dtype=dtype_name)
    if out.export_dtypes is not None:
        out.export_dtypes(plan)
    carried = _files_to_carry(src, same_format=source is target)
    code = _code_files() if out.carries_code else []

    def fill(folder: Path) -> None:
        writer = ShardWriter(folder, max_bytes)
        execute(plan, reader, writer if out.sink is None else out.sink(writer, parsed), progress=progress)
        writer.close()
        out.write_config(config, folder)

    manifest = {"source": src.name, "source_format": source.name, "target": target.name, "dtype": dtype_name}
    skipped = source.text_headers(reader.headers)[1]
    if skipped:  # K3's vision side: not part of the text model, listed so that nothing disappears unrecorded
        manifest["skipped_tensors"] = skipped
        logger.info("skipped %d vision tensors (listed in the conversion record)", len(skipped))
    _stage_and_publish(dst, dst_real, fill, carried, code, _output_bytes(plan), manifest, overwrite=overwrite)


def _stage_and_publish(dst: Path, dst_real: Path, fill, carried: list[Path], code: list[Path], tensor_bytes: int,
                       manifest: dict, *, overwrite: bool) -> None:
    """Check the free space, write the output into a staging folder with `fill(folder)` plus the carried files,
    and publish it (publish.Staging); on any failure the staging folder goes and `dst` is as it was."""

    def write(folder: Path) -> None:
        fill(folder)
        for path in carried:
            if not (folder / path.name).exists():
                shutil.copyfile(path, folder / path.name)

    needed = tensor_bytes + sum(p.stat().st_size for p in [*carried, *code])
    _staged(dst, dst_real, manifest, needed, write, lambda staging: staging.publish(overwrite=overwrite))


def _staged(dst: Path, dst_real: Path, manifest: dict, needed: int, write, publish) -> None:
    """The one staging protocol of every output: free space checked, `write(folder)` into a locked staging folder
    beside DST (its path logged first: what a SIGKILLed run leaves), `publish(staging)`; on any failure the staging
    folder goes and DST is as it was, and a failure to remove it names it."""
    check_free_space(dst_real, needed)
    dst_real.parent.mkdir(parents=True, exist_ok=True)
    staging = Staging(dst_real, manifest)
    logger.info("writing into %s (becomes %s when complete; a killed run leaves it behind, and "
                "`python -m kda_hybrid.conversion --clean %s` removes it)", staging.path, dst_real.name,
                dst_real.parent)
    try:
        write(staging.path)
        publish(staging)
    except BaseException as err:
        try:
            staging.discard()
        except BaseException as cleanup:
            raise ConversionError(f"{dst}: the conversion failed ({type(err).__name__}: {err}) and its staging "
                                  f"folder {staging.path} could not be removed ({type(cleanup).__name__}: "
                                  f"{cleanup}); `python -m kda_hybrid.conversion --clean {dst_real.parent}` removes "
                                  "it once nothing holds it") from err
        _raise_if_out_of_space(err, dst, dst_real, needed)
        raise


def _raise_if_out_of_space(err: BaseException, dst: Path, dst_real: Path, needed: int) -> None:
    """One clear error for a write that ran out of space (after its staging folder was removed)."""
    if isinstance(err, Exception) and is_out_of_space(err):
        free = shutil.disk_usage(dst_real.parent).free
        raise ConversionError(f"{dst}: no space left on the device while writing: the output needs {needed:,} "
                              f"bytes, {free:,} bytes are free now (nothing was written)") from None


def _llama_cpp_config(config, biased: bool):
    """(`config` with the routing semantics this conversion writes, the llama.cpp architecture that runs it),
    checked against what llama.cpp's graphs run."""
    from .to_gguf import check_expressible

    config = copy.copy(config)
    config.router_weights_from_biased_scores = biased
    return config, check_expressible(config)


def _convert_to_gguf(src: Path, dst: Path, dst_real: Path, config, arch: str, plan: Plan, reader: Source, *, cast,
                     overwrite: bool, progress: bool) -> Path:
    """A Kimi Linear or K3 model (any source layout) -> one llama.cpp GGUF file `dst` (to_gguf.py), tokenizer inside:
    checked against what llama.cpp's graph runs and the tokenizer mapped before anything is written, streamed
    into a staging folder and moved into place when complete."""
    from .to_gguf import GGUFSink, metadata, tokenizer_metadata

    kv = metadata(config, arch) + tokenizer_metadata(src, config.vocab_size)
    dtype = cast or _main_dtype(plan)

    def write(folder: Path) -> None:
        sink = GGUFSink(folder / dst_real.name, config, arch, dtype, kv, name=src.name)
        execute(plan, reader, sink, progress=progress)
        sink.close()

    manifest = {"source": src.name, "target": GGUF, "dtype": str(dtype).removeprefix("torch.")}
    _staged(dst, dst_real, manifest, 2 * _output_bytes(plan),  # the streamed data, then the file
            write, lambda staging: staging.publish_file(dst_real.name, overwrite=overwrite))
    return dst


def _convert_attention(src: Path, dst: Path, dst_real: Path, raw: dict, open_source, *, layer_types, target, cast,
                       max_bytes, overwrite, kda_init, shared_kv, progress, patch) -> Path:
    """A Llama / Mistral / Qwen2 / Qwen3 folder or GGUF file -> a KDA hybrid (from_attention.py), staged and
    published as every conversion is. open_source() -> (Source, tokenizer to save or None: the folder's files are
    carried instead), called once the config and the layer types are known to convert."""
    from .from_attention import AttentionConversionError, check_plan, hybrid_config, stream

    if target != KDA_HYBRID:
        raise ConversionError(f"target: a {raw['model_type']} source converts to {KDA_HYBRID!r} only, got {target!r}")
    if layer_types is None:
        raise ConversionError(f"{src} is a {raw['model_type']} checkpoint: pass layer_types (--layer-types), one "
                              "letter per layer, 'k' = KDA and 'A' = attention, e.g. kkkA")
    try:
        config = hybrid_config(raw, layer_types, shared_kv=shared_kv)
    except (AttentionConversionError, ValueError) as err:
        raise ConversionError(str(err)) from None
    reader, tokenizer = open_source()
    try:
        shapes = check_plan(config, raw, reader.headers)
    except (AttentionConversionError, ValueError) as err:
        raise ConversionError(str(err)) from None
    if patch is not None:
        patch.check_names(shapes)
    main = cast or reader.headers["model.embed_tokens.weight"].dtype
    config.dtype = str(main).removeprefix("torch.")
    pattern = "".join("k" if t == "linear_attention" else "A" for t in config.layer_types)
    logger.info("source format %s, %d tensors -> %s (%s, layers %s)", raw["model_type"], len(reader.headers),
                KDA_HYBRID, config.dtype, pattern)
    code = _code_files()

    def fill(folder: Path) -> None:
        writer = ShardWriter(folder, max_bytes)
        sink = _CastingSink(writer if patch is None else _PatchingSink(writer, patch), cast)
        stream(config, raw, reader, sink, init=kda_init, progress=progress)
        if patch is not None:
            patch.finish(folder)
        writer.close()
        write_checkpoint_metadata(config, folder)
        if tokenizer is not None:  # a GGUF's tokenizer and chat template, as transformers reads them
            tokenizer.save_pretrained(folder)

    tensor_bytes = sum(_numel(shape) * 4 for shape in shapes.values()) + 512 * len(shapes) + 2**20  # fp32 bound
    manifest = {"source": src.name, "source_format": raw["model_type"], "target": KDA_HYBRID,
                "dtype": config.dtype, "layer_types": pattern,
                **({"shared_kv": True} if config.linear_num_kv_heads is not None else {})}
    carried = _files_to_carry(src, same_format=False) if src.is_dir() else []
    _stage_and_publish(dst, dst_real, fill, carried, code, tensor_bytes + (2**24 if tokenizer else 0), manifest,
                       overwrite=overwrite)
    return dst


class _PatchingSink:
    """Hands every tensor through `patch.apply` on its way to `sink`."""

    def __init__(self, sink, patch):
        self.sink, self.patch = sink, patch

    def add(self, name: str, tensor: torch.Tensor):
        self.sink.add(name, self.patch.apply(name, tensor))


class _CastingSink:
    """Casts floating tensors to `dtype` (A_log and dt_bias stay float32) on their way to `sink`."""

    def __init__(self, sink, dtype: torch.dtype | None):
        self.sink, self.dtype = sink, dtype

    def add(self, name: str, tensor: torch.Tensor):
        keep = self.dtype is None or name.endswith((".A_log", ".dt_bias"))
        self.sink.add(name, tensor if keep else tensor.to(self.dtype))


def _output_bytes(plan: Plan) -> int:
    """Bytes the output will take: tensor data plus, per tensor, a generous allowance for its safetensors
    header entry and index line (~150 bytes each in practice), plus config files."""
    data = sum(_numel(spec.shape) * plan.out_dtypes[name].itemsize for name, spec in plan.inventory.items())
    return data + 512 * len(plan.inventory) + 2**20


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _main_dtype(plan: Plan) -> torch.dtype:
    counts = Counter(dt for name, dt in plan.out_dtypes.items()
                     if not (plan.inventory[name].fp32 or plan.inventory[name].no_downcast))
    return counts.most_common(1)[0][0] if counts else torch.float32


def _code_files() -> list[Path]:
    """The flat model code files our output carries (for the free-space estimate; write_checkpoint_metadata
    writes them)."""
    package = Path(__file__).resolve().parents[1]
    return [package / name for name in CARRIED_MODULES]


def _files_to_carry(src: Path, *, same_format: bool) -> list[Path]:
    carried = {p for pattern in _CARRIED for p in src.glob(pattern) if p.is_file()}
    if same_format:  # a re-shard or cast keeps the format's own code (e.g. the Hub's modeling_kimi.py)
        carried |= {p for p in src.glob("*.py") if p.is_file()}
    return sorted(p for p in carried if p.name != MANIFEST)
