"""Rewrite a checkpoint folder's metadata from the package: the flat remote-code modules (real files, not links),
config.json's auto_map (every Auto class) and the generated model card, with the writer save_pretrained and the
converter use (kda_hybrid.checkpoint_kda_hybrid.write_checkpoint_metadata).

    python scripts/refresh_checkpoint_code.py checkpoints/kda-hybrid-stdlib

A checkpoint folder must survive `cp -r`, `git archive`, a zip and a Hub upload, so the modules
`trust_remote_code` runs are real copies. tests/test_checkpoints.py checks that the shipped checkpoints' copies
are byte-identical to the package and names this command when they are not. A module the folder holds that the
package no longer carries (one renamed since) is reported, and removed with --prune.
"""

import argparse
import re
from pathlib import Path

from kda_hybrid import KDAHybridConfig
from kda_hybrid.checkpoint_kda_hybrid import CARRIED_MODULES, write_checkpoint_metadata

# modules this package wrote into checkpoints at some revision: only these are ever pruned
_OURS = re.compile(r"^(\w+_kda_hybrid|kda_\w+)\.py$")


def refresh(folder: Path, prune: bool = False) -> tuple[list[str], list[str]]:
    """Write the metadata into `folder`; returns (modules that changed, stale modules of ours left or pruned)."""
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: expected a checkpoint folder with a config.json")
    config = KDAHybridConfig.from_pretrained(folder)
    changed = write_checkpoint_metadata(config, folder)
    stale = sorted(p.name for p in folder.glob("*.py") if _OURS.match(p.name) and p.name not in CARRIED_MODULES)
    if prune:
        for name in stale:
            (folder / name).unlink()
    return changed, stale


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--prune", action="store_true", help="remove modules of ours the package no longer carries")
    args = parser.parse_args()
    for folder in args.folders:
        changed, stale = refresh(folder, args.prune)
        print(f"{folder}: {len(changed)} module(s) refreshed{': ' + ', '.join(changed) if changed else ''}")
        if stale:
            print(f"{folder}: {'removed' if args.prune else 'not carried any more (--prune removes)'}: "
                  f"{', '.join(stale)}")
