"""python -m kda_hybrid.conversion [--from FORMAT] [--to FORMAT] SRC DST, or --clean DIR [--dry-run] (killed runs'
leftovers)"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from .checkpoint import parse_size
from .configs import KDA_HYBRID
from .convert import DTYPES, convert
from .formats import SOURCE_FORMATS, TARGET_FORMATS
from .layout import ConversionError
from .publish import recover_tree

STAGING_HELP = (
    "A run writes into a hidden staging folder next to DST, .<DST name>.kdaconv-<random>.partial (its first log "
    "line names it), and renames it to DST only when complete, so DST is never half written. Interrupted (Ctrl-C, "
    "SIGTERM, SIGHUP) or failing, a run removes its staging folder (and its error names the folder if it could "
    "not); killed outright (SIGKILL, an OOM kill, power loss) it cannot, and the folder stays, as large as what was "
    "written so far. Every later run removes such leftovers of dead runs beside its DST, whatever their "
    "destination; --clean DIR removes those in DIR and in every folder under it without converting, and --clean "
    "DIR --dry-run lists them (and the folders it would leave alone) without removing anything. Folders of runs "
    "still running (they hold a lock) and folders this tool did not write are never touched.")


def _shard_size(text: str) -> int:
    try:
        return parse_size(text)
    except ConversionError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("max shard size: ")) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kda_hybrid.conversion",
        description="Convert a Kimi Linear checkpoint folder (sharded safetensors + config.json) between Moonshot's "
                    "original layout, transformers' native kimi_linear and kda_hybrid, or turn a Llama, Mistral, "
                    "Qwen2 or Qwen3 checkpoint into a KDA hybrid (--layer-types), or write a Kimi Linear / K3 "
                    "model as one GGUF file for llama.cpp (--to gguf, DST ending in .gguf). Streams one shard at a "
                    "time.",
        epilog=STAGING_HELP,
    )
    parser.add_argument("src", nargs="?", help="source checkpoint folder, or a Llama-family .gguf file")
    parser.add_argument("dst", nargs="?", help="output folder, or .gguf file with --to gguf (must not exist unless "
                                               "--overwrite)")
    parser.add_argument("--clean", metavar="DIR", default=None,
                        help="remove the staging folders that killed runs left in DIR or under it (see below), "
                             "then exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --clean: list what it would remove (and what it leaves alone), remove nothing")
    parser.add_argument("--from", dest="source", choices=SOURCE_FORMATS, default=None,
                        help="source layout; default: detected from config.json and the tensor names")
    parser.add_argument("--to", dest="target", choices=TARGET_FORMATS, default=KDA_HYBRID,
                        help="output layout (default: %(default)s)")
    parser.add_argument("--dtype", choices=["keep", *DTYPES], default="keep",
                        help="cast floating tensors (A_log, dt_bias, router bias stay float32); default: keep")
    parser.add_argument("--max-shard-size", type=_shard_size, default="5GB",
                        help="largest output shard, e.g. 5GB, 500MiB (default: 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing DST if it is empty or an earlier output of this tool")
    router = parser.add_mutually_exclusive_group()
    router.add_argument("--biased-router", dest="biased", action="store_true", default=None,
                        help="router weights from the bias-corrected scores (Moonshot's Hub code; default for "
                             "--from kimi_linear)")
    router.add_argument("--unbiased-router", dest="biased", action="store_false",
                        help="router weights from the raw sigmoid scores (transformers, vLLM; default for "
                             "--from transformers)")
    parser.add_argument("--layer-types", default=None, metavar="PATTERN",
                        help="for a Llama/Mistral/Qwen2/Qwen3 source: one letter per layer, k = KDA (initialised "
                             "from the layer's attention), A = keep the attention; a shorter pattern repeats "
                             "(e.g. kkkA)")
    parser.add_argument("--shared-kv", action="store_true",
                        help="with --layer-types: the KDA layers keep the source's key/value heads (one recurrent "
                             "state per key/value head, read by its query heads: fewer weights, a smaller state) "
                             "instead of one per query head")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # bad flags: usage + error, exit status 2, before anything is touched
    if args.clean is not None:
        if args.src is not None or args.dst is not None:
            parser.error("--clean DIR takes no SRC or DST (it converts nothing)")
        return _clean(args.clean, dry_run=args.dry_run)
    if args.dry_run:
        parser.error("--dry-run goes with --clean DIR (a conversion has no dry run)")
    for name in ("src", "dst"):
        if getattr(args, name) is None:
            parser.error(f"{name.upper()} is required (or --clean DIR)")
        if not getattr(args, name).strip():
            parser.error(f"{name.upper()} must be a folder path, got an empty string")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    # SIGTERM (kill, a job scheduler's stop) and SIGHUP (the terminal closed) as an exception, so that the staging
    # folder is removed as on Ctrl-C
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers only there
    previous = {sig: signal.signal(sig, _terminate) for sig in _STOP_SIGNALS} if main_thread else {}
    try:
        out = convert(args.src, args.dst, source=args.source, target=args.target, dtype=args.dtype,
                      max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                      router_weights_from_biased_scores=args.biased, layer_types=args.layer_types,
                      shared_kv=args.shared_kv,
                      progress=not args.no_progress)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # permissions, a read-only file system, ...: one line, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"wrote {out}")
    return 0


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def _clean(folder: str, *, dry_run: bool) -> int:
    path = Path(folder)
    if not path.is_dir():
        print(f"error: --clean {folder}: not a folder", file=sys.stderr)
        return 1
    try:
        done = recover_tree(path, dry_run=dry_run)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for where, line in done:
        print(f"{where}: {line}")
    if not done:
        print(f"{path}: no staging folder of a killed run here or below")
    return 0


if __name__ == "__main__":
    sys.exit(main())
