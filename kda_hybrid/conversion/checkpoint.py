"""Reading source shards lazily and writing output shards as they fill.

Sources expose tensor headers (name, shape, dtype, file) without reading data, then open one file at a time.
Safetensors are memory-mapped by `safe_open`; a `.bin` file is only ever read with
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .layout import ConversionError

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFETENSORS_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"
WEIGHT_FILE_RE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.index\.json$")


@dataclass(frozen=True)
class Header:
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str


class Source:
    """Tensors grouped in files; `headers` never reads tensor data."""

    files: list[str]
    headers: dict[str, Header]

    @contextmanager
    def open(self, file: str) -> Iterator[Callable[[str], torch.Tensor]]:
        raise NotImplementedError

    def nbytes(self, file: str) -> int:
        return sum(h.dtype.itemsize * _numel(h.shape) for h in self.headers.values() if h.file == file)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class MemorySource(Source):
    """In-memory shards (dicts of tensors, meta tensors included): dry runs and tests."""

    def __init__(self, shards: list[dict[str, torch.Tensor]]):
        self._shards = {f"shard-{i}": shard for i, shard in enumerate(shards)}
        self.files = list(self._shards)
        self.headers = {}
        for file, shard in self._shards.items():
            for name, t in shard.items():
                if name in self.headers:
                    raise ConversionError(f"tensor {name} appears in two shards")
                self.headers[name] = Header(tuple(t.shape), t.dtype, file)

    @contextmanager
    def open(self, file):
        yield self._shards[file].__getitem__


class FolderSource(Source):
    """A checkpoint folder: `model.safetensors[.index.json]` or, failing that, `pytorch_model.bin[.index.json]`."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index_names: dict[str, str] | None = None
        for index_file, single in ((SAFETENSORS_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
            if (self.folder / index_file).is_file():
                try:
                    weight_map = json.loads((self.folder / index_file).read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ConversionError(f"{self.folder / index_file}: not a valid index ({err!r})") from None
                index_names = dict(weight_map)
                self.files = list(dict.fromkeys(weight_map.values()))
                break
            if (self.folder / single).is_file():
                self.files = [single]
                break
        else:
            raise ConversionError(f"{self.folder}: no model.safetensors[.index.json] or pytorch_model.bin[.index.json]")
        missing = [f for f in self.files if not (self.folder / f).is_file()]
        if missing:
            raise ConversionError(f"{self.folder}: the index lists shards that do not exist: {missing}")

        self.headers = {}
        for file in self.files:
            for name, header in self._read_headers(file).items():
                if name in self.headers:
                    raise ConversionError(f"tensor {name} is stored twice ({self.headers[name].file}, {file})")
                self.headers[name] = header
        if index_names is not None:
            misplaced = sorted(n for n, f in index_names.items() if n not in self.headers or self.headers[n].file != f)
            unindexed = sorted(set(self.headers) - set(index_names))
            if misplaced or unindexed:
                raise ConversionError(
                    "the index does not match the shards: "
                    + "; ".join(p for p in (name_list("listed in the index but not in that shard", misplaced),
                                            name_list("in a shard but not in the index", unindexed)) if p))

    def _path(self, file: str) -> Path:
        return self.folder / file

    def _read_headers(self, file: str) -> dict[str, Header]:
        path = self._path(file)
        try:
            if file.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt") as f:
                    out = {}
                    for name in f.keys():
                        sl = f.get_slice(name)
                        dtype = _ST_DTYPES.get(sl.get_dtype())
                        if dtype is None:
                            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                        out[name] = Header(tuple(sl.get_shape()), dtype, file)
                    return out
            state = self._load_bin(path)
            return {name: Header(tuple(t.shape), t.dtype, file) for name, t in state.items()}
        except ConversionError:
            raise
        except Exception as err:  # a truncated or corrupted file: safetensors / torch raise their own types
            raise ConversionError(f"{path}: cannot read ({type(err).__name__}: {err})") from None

    @staticmethod
    def _load_bin(path: Path) -> dict[str, torch.Tensor]:
        # weights_only: tensors and plain containers only, never arbitrary pickled code; mmap: lazy pages.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ConversionError(f"{path}: not a flat state dict of tensors")
        return state

    @contextmanager
    def open(self, file):
        path = self._path(file)
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                yield f.get_tensor
        else:
            state = self._load_bin(path)
            yield state.__getitem__
            del state


def name_list(what: str, names: list[str], limit: int = 30) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return f"{len(names)} {what}: {shown}"


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------
def parse_size(size: int | str) -> int:
    """'5GB' -> 5 * 10**9, '500MiB' -> 500 * 2**20, positive ints pass through (transformers' convention)."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ConversionError(f"max shard size: expected e.g. '5GB', '500MiB' or a byte count, got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", size, flags=re.IGNORECASE)
        if not match:
            raise ConversionError(f"max shard size: expected e.g. '5GB', '500MiB' or a byte count, got {size!r}")
        number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
        value = int(number * (1024 if binary else 1000) ** " KMGT".index(unit or " "))
    if value <= 0:
        raise ConversionError(f"max shard size: expected a positive size, got {size!r}")
    return value


class MemorySink:
    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor):
        self.tensors[name] = tensor

    def close(self):
        return self.tensors


def _save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata=metadata)


class ShardWriter:
    """Buffers tensors and writes a safetensors shard each time `max_bytes` would be exceeded.

    Shards get their final `model-0000i-of-0000n` names at `close()`, when n is known; a checkpoint that fits
    one shard is written as `model.safetensors` without an index, as `save_pretrained` does.
    """

    def __init__(self, folder: Path, max_bytes: int, metadata: dict[str, str] | None = None):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0
        self.total_params = 0

    def add(self, name: str, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += nbytes
        self.total_bytes += nbytes
        self.total_params += tensor.numel()

    def _flush(self):
        part = f"part-{len(self._shards):05d}.safetensors.tmp"
        _save_file(self._buffer, str(self.folder / part), metadata=self.metadata)
        self._shards.append((part, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> dict[str, str]:
        if self._buffer or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, (part, names) in enumerate(self._shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / part, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {"metadata": {"total_size": self.total_bytes, "total_parameters": self.total_params},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map
