"""Where the output goes: checking the destination, staging the new output next to it, publishing it so that
DST is at every instant absent (first run), the old output or the complete new one, and cleaning up what a
killed run left. The protocol is described in docs/conversion.md ("Crash safety").

Staging folders are siblings of DST named `.<DST name>.kdaconv-<random>.partial`; each holds a manifest file
from the moment it exists and is flock()ed by its run for the run's lifetime. The kernel drops the lock when
the process dies however it dies (SIGKILL included), so a later run removes exactly the staging folders of
dead runs: an unlocked folder with that name and our manifest (or empty) is a leftover, a locked one belongs to
a live run and is left alone. Locks sit on the folder's inode, so they follow it through renames.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
from pathlib import Path

from ..checkpoint_kda_hybrid import format_bytes
from .layout import ConversionError

# Written into every output (and every staging folder from its first instant): marks a folder this tool owns.
MANIFEST = "kda_hybrid_conversion.json"
TOOL = "kda_hybrid.conversion"
_TAG = ".kdaconv-"
_PARTIAL, _OLD = ".partial", ".old"

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h
_AT_FDCWD = -100


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def _rename2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(a, b, flags); False if this system or file system cannot do it (then the caller falls back)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# ---------------------------------------------------------------------------------------------------------
# The destination
# ---------------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict | None:
    """The folder's manifest if this tool wrote it, else None."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == TOOL else None


def check_paths(src: Path, dst: Path) -> Path:
    """DST with symlinks resolved; refuses the source itself, a folder inside it and a folder containing it."""
    src_real, dst_real = Path(os.path.realpath(src)), Path(os.path.realpath(dst))
    if dst_real == src_real or src_real in dst_real.parents:
        raise ConversionError(f"{dst}: the output must not be the source folder or inside it ({src_real})")
    if dst_real in src_real.parents:
        raise ConversionError(f"{dst}: the output must not contain the source folder ({src_real})")
    return dst_real


def check_destination(src: Path, dst: Path, *, overwrite: bool) -> Path:
    """`check_paths`, then: an existing DST only with `overwrite`, and only if it is empty or an output of this
    tool whose manifest lists every entry in it. Returns DST with symlinks resolved."""
    dst_real = check_paths(src, dst)
    if not os.path.lexists(dst_real):
        return dst_real
    if not overwrite:
        raise ConversionError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    _check_replaceable(dst_real, shown=dst)
    return dst_real


def check_file_destination(dst: Path, dst_real: Path, *, suffix: str, magic: bytes, overwrite: bool) -> None:
    """A one-file output (a GGUF file): DST must end in `suffix`; an existing DST only with `overwrite`, and only a
    regular file that starts with `magic` (a file of that format), never a folder or another file."""
    if dst_real.suffix != suffix:
        raise ConversionError(f"{dst}: the output is one file; give a path ending in {suffix}")
    if not os.path.lexists(dst_real):
        return
    if not overwrite:
        raise ConversionError(f"{dst} already exists; pass overwrite=True (--overwrite) to replace it")
    if dst_real.is_symlink() or not dst_real.is_file():
        raise ConversionError(f"{dst}: exists and is not a regular file; --overwrite only replaces a {suffix} file")
    with open(dst_real, "rb") as f:
        if f.read(len(magic)) != magic:
            raise ConversionError(f"{dst}: exists and is not a {suffix} file (it does not start with {magic!r}); "
                                  "--overwrite only replaces one")


def _check_replaceable(dst: Path, shown: Path) -> None:
    if not dst.is_dir():
        raise ConversionError(f"{shown}: exists and is not a folder; --overwrite only replaces a folder")
    entries = sorted(p.name for p in dst.iterdir())
    if not entries:
        return
    manifest = read_manifest(dst)
    if manifest is None or manifest.get("complete") is not True:
        raise ConversionError(f"{shown}: --overwrite only replaces an empty folder or one this tool wrote (with a "
                              f"complete {MANIFEST}); this one has none. Remove it yourself or choose another "
                              "destination")
    foreign = sorted(set(entries) - set(manifest.get("files", [])) - {MANIFEST})
    if foreign:
        listed = ", ".join(foreign[:10]) + (f", ... ({len(foreign) - 10} more)" if len(foreign) > 10 else "")
        raise ConversionError(f"{shown}: holds {len(foreign)} entries this tool did not write ({listed}); "
                              "--overwrite would delete them. Move them out or choose another destination")


def check_free_space(dst: Path, needed: int) -> None:
    """Fail before writing when the file system that will hold DST has less than `needed` bytes free."""
    where = dst.parent
    while not where.exists() and where != where.parent:  # DST's parent may not exist yet: ask its file system
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed:
        raise ConversionError(f"{dst}: not enough free space: the output needs {needed:,} bytes "
                              f"({format_bytes(needed)}), "
                              f"{where} has {free:,} bytes ({format_bytes(free)}) free")


def is_out_of_space(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors raises its own SafetensorError carrying the OS message
    return any(text in str(err) for text in ("No space left on device", "Disk quota exceeded"))


# ---------------------------------------------------------------------------------------------------------
# Locks
# ---------------------------------------------------------------------------------------------------------
def _lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on the folder `path`, or None if another process holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _same_inode(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


_STAGING_NAME = re.compile(r"\.(?P<dst>.+)" + re.escape(_TAG) + r"[0-9a-f]{12}\.(?:partial|old)")


def recover_folder(parent: Path, *, dry_run: bool = False) -> list[str]:
    """recover() for every destination in `parent` that has staging folders: what killed runs left there, whatever
    their destination (a dead run's staging folder is garbage for any later run: its lock proves the run gone)."""
    if not parent.is_dir():
        return []
    names = sorted({m.group("dst") for p in parent.iterdir() if (m := _STAGING_NAME.fullmatch(p.name))})
    return [line for name in names for line in recover(parent / name, dry_run=dry_run)]


def recover_tree(root: Path, *, dry_run: bool = False) -> list[tuple[Path, str]]:
    """recover_folder() in `root` and every folder under it (symlinks not followed, staging folders not entered):
    (folder, what was done or, with `dry_run`, what would be done and what is left alone) for each staging
    folder found."""
    done: list[tuple[Path, str]] = []
    for folder, subfolders, _ in os.walk(root, followlinks=False):
        staged = [d for d in subfolders if _STAGING_NAME.fullmatch(d)]
        subfolders[:] = sorted(set(subfolders) - set(staged))
        if staged:
            done += [(Path(folder), line) for line in recover_folder(Path(folder), dry_run=dry_run)]
    return done


def _size(path: Path) -> int:
    return sum(p.stat(follow_symlinks=False).st_size for p in path.rglob("*") if not p.is_symlink() and p.is_file())


def _ours(path: Path, dst: Path) -> str | None:
    """'partial' or 'old' if `path` is named exactly like one of this tool's staging folders for `dst`."""
    match = re.fullmatch(re.escape("." + dst.name + _TAG) + r"[0-9a-f]{12}\.(partial|old)", path.name)
    return match.group(1) if match else None


def recover(dst: Path, *, dry_run: bool = False) -> list[str]:
    """Clean up after killed runs for `dst`; returns what was done (for the log).

    An unlocked `.old` folder with a complete manifest while DST is absent is the old output of a run killed
    between the two renames of the fallback publish: it is renamed back to DST. Every other unlocked staging
    folder of DST (ours by name and manifest, or empty) is removed. Locked ones belong to live runs. With
    `dry_run` nothing changes: the lines say what would be done, and name the folders left alone too."""
    done: list[str] = []
    parent = dst.parent
    if not parent.is_dir():
        return done
    candidates = sorted((p for p in parent.iterdir() if _ours(p, dst)), key=lambda p: p.name)
    for path in candidates:
        if path.is_symlink() or not path.is_dir():
            continue
        try:
            fd = _lock(path)
        except FileNotFoundError:  # removed meanwhile by another run's cleanup
            continue
        if fd is None:  # a live run
            if dry_run:
                done.append(f"{path.name} ({format_bytes(_size(path))}): a running conversion's, left alone")
            continue
        try:
            if not _same_inode(fd, path):
                continue
            manifest = read_manifest(path)
            if manifest is None and not {q.name for q in path.iterdir()} <= {MANIFEST, MANIFEST + ".tmp"}:
                if dry_run:
                    done.append(f"{path.name}: not written by this tool (no {MANIFEST}), left alone")
                continue  # not recognisably ours: never delete it
            if (_ours(path, dst) == "old" and manifest is not None and manifest.get("complete") is True
                    and not os.path.lexists(dst)):
                if dry_run:
                    done.append(f"would restore the previous output {dst.name} from {path.name}")
                    continue
                if not _rename2(path, dst, _RENAME_NOREPLACE):
                    os.rename(path, dst)
                done.append(f"restored the previous output from {path.name}")
                continue
            size = _size(path)
            if dry_run:
                done.append(f"would remove {path.name} ({format_bytes(size)}), left by a killed run")
                continue
            _remove(path)
            done.append(f"removed {path.name} ({format_bytes(size)}), left by a killed run")
        finally:
            os.close(fd)
    return done


# ---------------------------------------------------------------------------------------------------------
# Staging and publishing
# ---------------------------------------------------------------------------------------------------------
class Staging:
    """A locked staging folder next to `dst`. Use `publish()` at the end; `discard()` on failure."""

    def __init__(self, dst: Path, manifest: dict):
        self.dst = dst
        self.manifest = {"tool": TOOL, "complete": False, **manifest}
        while True:
            path = dst.parent / f".{dst.name}{_TAG}{secrets.token_hex(6)}{_PARTIAL}"
            path.mkdir(mode=0o755)
            fd = _lock(path)
            if fd is not None and _same_inode(fd, path):
                break
            if fd is not None:  # another run's cleanup removed it between mkdir and lock: take another name
                os.close(fd)
        self.path, self._fd = path, fd
        self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path / MANIFEST)

    def publish(self, *, overwrite: bool) -> None:
        """Mark the staged output complete, make it durable, and swap it into place."""
        self.manifest["complete"] = True
        self.manifest["files"] = sorted(p.name for p in self.path.iterdir() if p.name != MANIFEST)
        self._write_manifest()
        for p in self.path.iterdir():
            _fsync(p)
        _fsync(self.path)
        dst = self.dst
        if not os.path.lexists(dst):
            if not _rename2(self.path, dst, _RENAME_NOREPLACE):
                os.rename(self.path, dst)  # fails on a non-empty folder that appeared meanwhile
        else:
            if not overwrite:
                raise ConversionError(f"{dst} appeared while converting; pass overwrite=True to replace it")
            _check_replaceable(dst, shown=dst)  # still empty or an output of ours?
            old_fd = _lock(dst)  # held while the old output sits under a staging name
            if old_fd is None:
                raise ConversionError(f"{dst}: another conversion is replacing it right now")
            try:
                if _rename2(self.path, dst, _RENAME_EXCHANGE):
                    # one atomic step: DST is the new output, the old one is at our staging path
                    _remove(self.path)
                else:
                    # two renames; a run killed between them leaves DST absent and the complete old output in
                    # `aside`, which the next run's recover() renames back
                    aside = dst.parent / (self.path.name[: -len(_PARTIAL)] + _OLD)
                    os.rename(dst, aside)
                    try:
                        os.rename(self.path, dst)
                    except BaseException:
                        os.rename(aside, dst)
                        raise
                    _remove(aside)
            finally:
                os.close(old_fd)
        _fsync(dst.parent)
        os.close(self._fd)
        self._fd = None

    def publish_file(self, name: str, *, overwrite: bool) -> None:
        """Move the staged file `name` to DST (a one-file output), durably: at every instant DST is absent, the old
        file or the complete new one; then the staging folder goes."""
        staged = self.path / name
        _fsync(staged)
        if overwrite:
            os.replace(staged, self.dst)  # atomic over an old file
        elif not _rename2(staged, self.dst, _RENAME_NOREPLACE):
            try:
                os.link(staged, self.dst)  # fails if DST appeared meanwhile, as RENAME_NOREPLACE does
            except FileExistsError:
                raise ConversionError(f"{self.dst} appeared while converting; pass overwrite=True to replace "
                                      "it") from None
            staged.unlink()
        _fsync(self.dst.parent)
        self.discard()

    def discard(self) -> None:
        _remove(self.path)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def swap_in(staged: Path, dst: Path) -> Path | None:
    """Put the complete folder `staged` (a sibling of DST) at DST, durably: its files and itself fsynced, then one
    atomic exchange with an existing DST where the system can (else two renames). Returns where the old DST now is
    (for the caller to remove), or None when there was none. For outputs without this tool's staging protocol (the
    caller checked that DST may be replaced)."""
    for p in staged.iterdir():
        _fsync(p)
    _fsync(staged)
    old = None
    if not os.path.lexists(dst):
        if not _rename2(staged, dst, _RENAME_NOREPLACE):
            os.rename(staged, dst)
    elif _rename2(staged, dst, _RENAME_EXCHANGE):
        old = staged
    else:
        old = staged.parent / (staged.name + _OLD)
        os.rename(dst, old)
        os.rename(staged, dst)
    _fsync(dst.parent)
    return old


def _remove(path: Path) -> None:
    """Delete one of our folders, its manifest last, so that a deletion killed halfway leaves a folder the
    next run still recognises as ours."""
    if not path.is_dir():
        return
    for p in path.iterdir():
        if p.name == MANIFEST:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)
    path.rmdir()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
