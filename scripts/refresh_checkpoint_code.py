"""Rewrite a checkpoint folder's metadata from the package: the flat remote-code modules, config.json's auto_map
(every Auto class) and the generated model card, with the writer save_pretrained and the converter use
(kda_hybrid.checkpoint_kda_hybrid.write_checkpoint_metadata).

    python scripts/refresh_checkpoint_code.py checkpoints/kda-hybrid-stdlib           # modules as real files
    python scripts/refresh_checkpoint_code.py --link checkpoints/*                    # the repository's own folders

The folders shipped in this repository (checkpoints/) hold their modules as relative links into kda_hybrid/ (--link),
so the code exists once and cannot drift; transformers copies what a link points at when it loads the folder, and
save_pretrained, the converter and a Hub push write real files. A folder made for elsewhere keeps real copies (the
default): it must survive `cp -r`, a zip and an upload on its own. A module the folder holds that the package no
longer carries (one renamed since) is reported, and removed with --prune.
"""

import argparse
import os
import re
from pathlib import Path

from kda_hybrid import KDAHybridConfig
from kda_hybrid.checkpoint_kda_hybrid import CARRIED_MODULES, write_checkpoint_metadata

# modules this package wrote into checkpoints at some revision: only these are ever pruned
_OURS = re.compile(r"^(\w+_kda_hybrid|kda_\w+)\.py$")


PACKAGE = Path(__file__).resolve().parents[1] / "kda_hybrid"


def refresh(folder: Path, prune: bool = False, link: bool = False) -> tuple[list[str], list[str]]:
    """Write the metadata into `folder` (with `link`, the modules as relative links into the package); returns
    (modules that changed, stale modules of ours left or pruned)."""
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: expected a checkpoint folder with a config.json")
    config = KDAHybridConfig.from_pretrained(folder)
    links = {m: os.readlink(folder / m) for m in CARRIED_MODULES if (folder / m).is_symlink()}
    for name in links:  # the writer compares contents and writes real files: it must not write through a link
        (folder / name).unlink()
    changed = write_checkpoint_metadata(config, folder)
    if link:
        changed = []
        for name in CARRIED_MODULES:
            target = os.path.relpath(PACKAGE / name, folder.resolve())
            if links.get(name) != target:
                changed.append(name)
            (folder / name).unlink(missing_ok=True)
            (folder / name).symlink_to(target)
    stale = sorted(p.name for p in folder.glob("*.py") if _OURS.match(p.name) and p.name not in CARRIED_MODULES)
    if prune:
        for name in stale:
            (folder / name).unlink()
    return changed, stale


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--prune", action="store_true", help="remove modules of ours the package no longer carries")
    parser.add_argument("--link", action="store_true",
                        help="the modules as relative links into this checkout's kda_hybrid/ (the shipped folders)")
    args = parser.parse_args()
    for folder in args.folders:
        changed, stale = refresh(folder, args.prune, args.link)
        print(f"{folder}: {len(changed)} module(s) refreshed{': ' + ', '.join(changed) if changed else ''}")
        if stale:
            print(f"{folder}: {'removed' if args.prune else 'not carried any more (--prune removes)'}: "
                  f"{', '.join(stale)}")
