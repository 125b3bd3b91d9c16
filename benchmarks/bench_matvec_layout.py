"""The read rate of a one-token matrix-vector product over a weight far from the caches, in the usual layout (W
[out, in], rows of `in` floats: `F.linear(x, W)`) and column-major (the storage of W.T contiguous, what
`prepare_cpu_decode()` leaves), for the matrix shapes of the models here; with --compiled also the usual layout
through the compiled kernel of `prepare_cpu_decode(compiled=True)` (layers_kda_hybrid.compiled_matvec). 1 thread
(--threads); each figure is the best of --repeats passes over enough copies of the matrix to exceed the caches.

    python benchmarks/bench_matvec_layout.py
    python benchmarks/bench_matvec_layout.py --compiled
    python benchmarks/bench_matvec_layout.py --shapes 576x576 1728x576 1536x576 3072x576   # fused q|k|v, gate|up
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.layers_kda_hybrid import compiled_matvec

SHAPES = [(49152, 576), (12288, 2304), (16384, 4096), (1536, 576), (576, 576), (576, 1536), (2048, 256)]
CACHE_BYTES = 512 * 2**20  # more than any last-level cache here


def rate(weights: list[torch.Tensor], x: torch.Tensor, repeats: int, fn=F.linear) -> float:
    """Bytes/s of fn(x, w) (F.linear by default) over every w, best of `repeats` passes."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the allocator and BLAS (and compiles)
        start = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, time.perf_counter() - start)
    return sum(w.numel() * 4 for w in weights) / best


def main():
    parser = benchmark_parser(__doc__, repeats=5)
    parser.add_argument("--shapes", nargs="+", metavar="OUTxIN", help="matrix shapes (default: the models' own)")
    parser.add_argument("--compiled", action="store_true", help="also the compiled kernel on the usual layout")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes] if args.shapes else SHAPES
    except ValueError:
        parser.error(f"--shapes takes OUTxIN pairs such as 576x1536, got {args.shapes}")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        parser.error(f"--shapes takes OUTxIN pairs of positive sizes, got {args.shapes}")
    report = Report(args)
    kernel = compiled_matvec() if args.compiled else None
    extra = " compiled kernel GB/s | compiled / usual |" if kernel else ""
    report.print("| out x in | MB | usual layout GB/s | column-major GB/s | column-major / usual |" + extra)
    report.print("|---|---|---|---|---|" + "---|---|" * bool(kernel))
    rows = []
    for out, inp in shapes:
        copies = max(1, CACHE_BYTES // (out * inp * 4))
        usual = [torch.randn(out, inp) for _ in range(copies)]
        column = [w.t().contiguous().t() for w in usual]
        x = torch.randn(1, 1, inp)
        a, b = rate(usual, x, args.repeats), rate(column, x, args.repeats)
        row = f"| {out} x {inp} | {out * inp * 4 / 1e6:.2f} | {a / 1e9:.1f} | {b / 1e9:.1f} | {b / a:.2f} |"
        rows.append(dict(out=out, inp=inp, usual=a, column_major=b))
        if kernel:
            c = rate(usual, x.reshape(-1), args.repeats, kernel)
            row += f" {c / 1e9:.1f} | {c / a:.2f} |"
            rows[-1]["compiled"] = c
        report.print(row)
        del usual, column
    report.write({"rows": rows})


if __name__ == "__main__":
    main()
