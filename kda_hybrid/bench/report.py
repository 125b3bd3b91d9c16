"""What every script in benchmarks/ shares: one command line (--threads, --repeats, --out), one output convention,
and the twins they measure against.

    from kda_hybrid.bench.report import Report, benchmark_parser

    args = benchmark_parser(__doc__, repeats=5).parse_args()     # --threads (default 1), --repeats, --out
    report = Report(args)                                        # sets torch's thread count, notes the environment
    report.print("| model | ms |")                               # printed now, and kept for --out
    report.write({"ms": 1.0})                                    # --out: .json, or markdown for any other suffix

The environment a figure needs to be read (or rerun): the exact command line, the date, the git commit of the
checkout, python, torch, transformers and the other versions installed, the torch thread count and the
thread-related variables, the CPU, and the CPUs this process may run on. Printed first, and written first.

Not a module a checkpoint carries: nothing in the modeling code imports it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.abc
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")
_PACKAGES = ("transformers", "triton", "flash-linear-attention", "numpy")


def benchmark_parser(description: str | None, *, repeats: int, threads: int = 1, out: str | Path | None = None,
                     repeats_help: str = "timed repetitions; the figures are their median"):
    """An `argparse.ArgumentParser` with the options every benchmark takes; add the script's own to it.

    --threads: torch threads (default `threads`; 1, as the docs' figures), --repeats (default `repeats`), --out: also
    write the report there (default `out`; None: print only)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    common = p.add_argument_group("common to every benchmark")
    common.add_argument("--threads", type=_positive_int, default=threads, help=f"torch threads (default {threads})")
    common.add_argument("--repeats", type=_positive_int, default=repeats, help=f"{repeats_help} (default {repeats})")
    common.add_argument("--out", type=Path, default=None if out is None else Path(out),
                        help="also write the report to this file: JSON for .json, else markdown; the environment "
                             "(command line, versions, threads, CPU) comes first" +
                             ("" if out is None else f" (default {out})"))
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """HEAD of the checkout this package is imported from, '+dirty' when tracked files differ; None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def environment(threads: int | None = None) -> dict:
    """The facts a benchmark figure is read with; `threads` defaults to torch's current thread count."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)  # reads metadata only: imports nothing
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    env = {
        "command": shlex.join(["python", *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "git_commit": _git_commit(),
        "versions": versions,
        "torch_threads": torch.get_num_threads() if threads is None else threads,
        "thread_variables": {k: os.environ[k] for k in _THREAD_VARIABLES if k in os.environ},
        "cpu": _cpu_name(),
        "cpus_usable": usable,
        "cpus_visible": os.cpu_count(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return env


def environment_lines(env: dict) -> list[str]:
    """`env` as markdown lines (each starting with '# ' so that printed reports stay pasteable as comments)."""
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v is not None)
    variables = " ".join(f"{k}={v}" for k, v in env["thread_variables"].items()) or "none set"
    device = f"; CUDA device: {env['cuda_device']}" if env["cuda_device"] else ""
    return [
        f"# command: {env['command']}",
        f"# date (UTC): {env['date_utc']}; git commit: {env['git_commit'] or 'not a git checkout'}",
        f"# {versions}",
        f"# torch threads: {env['torch_threads']} (thread variables: {variables}); CPU: {env['cpu']}, "
        f"{env['cpus_usable']} of {env['cpus_visible']} CPUs usable{device}",
    ]


class Report:
    """A benchmark's output: printed as it goes, and written with the environment to `args.out` at the end.

    Sets torch's thread count from `args.threads` (so that every script does it the same way, before it times
    anything) and prints the environment lines first."""

    def __init__(self, args: argparse.Namespace):
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        self.out = getattr(args, "out", None)
        if self.out is not None and self.out.is_dir():
            raise ValueError(f"--out must be a file path, got the folder {str(self.out)!r}")
        self.env = environment()
        self.lines: list[str] = []
        for line in environment_lines(self.env):
            print(line, flush=True)

    def print(self, *parts, sep: str = " "):
        """Print a line (as print() does) and keep it for the written report."""
        line = sep.join(str(p) for p in parts)
        print(line, flush=True)
        self.lines.append(line)

    def text(self) -> str:
        return "\n".join(self.lines)

    def write(self, data=None) -> Path | None:
        """Write to `args.out` (nothing without --out): a .json file gets {"environment", "results": `data`,
        "report": the printed lines}; any other suffix the environment lines and then the printed lines."""
        if self.out is None:
            return None
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if self.out.suffix == ".json":
            payload = {"environment": self.env, "results": data, "report": self.lines}
            self.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        else:
            self.out.write_text("\n".join([*environment_lines(self.env), "", *self.lines]) + "\n")
        print(f"wrote {self.out}", flush=True)
        return self.out


__all__ = ["Report", "benchmark_parser", "environment", "environment_lines"]
