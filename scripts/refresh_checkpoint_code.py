"""Copy the package's flat remote-code modules into a checkpoint folder (real files, not links).

    python scripts/refresh_checkpoint_code.py checkpoints/kda-hybrid-stdlib

A checkpoint folder must survive `cp -r`, `git archive`, a zip and a Hub upload, so the modules
`trust_remote_code` runs are real copies. tests/test_train.py checks that the shipped checkpoint's copies are
byte-identical to the package and names this command when they are not.
"""

import argparse
import shutil
from pathlib import Path

import kda_hybrid
from kda_hybrid.model_card_kda_hybrid import _carried_modules


def refresh(folder: Path) -> list[str]:
    """Write every carried module into `folder`; returns the names that changed."""
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: expected a checkpoint folder with a config.json")
    package = Path(kda_hybrid.__file__).parent
    changed = []
    for name in _carried_modules():
        src, dst = package / name, folder / name
        if dst.is_symlink() or not dst.is_file() or dst.read_bytes() != src.read_bytes():
            dst.unlink(missing_ok=True)
            shutil.copyfile(src, dst)
            changed.append(name)
    return changed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    for folder in parser.parse_args().folders:
        changed = refresh(folder)
        print(f"{folder}: {len(changed)} module(s) refreshed{': ' + ', '.join(changed) if changed else ''}")
