"""The quality-vs-tokens curve of the SmolLM2 students: from smollm2_report.py's --json, every model that has
training tokens behind it (`tokens_trained`, read from its folder), grouped into series by the part of its name
before the first comma ("stage 1, step 125" and "stage 1, step 2000" are one series), against the teacher (the
first model of the report).

    python examples/smollm2/plot_curve.py docs/records/smollm2/teacher_corpus_metrics.json \\
        --out docs/records/smollm2/quality_vs_tokens.png

Left: held-out NLL per token as a multiple of the teacher's (chats, prose, code; the target 1.15x drawn). Right:
teacher-forced top-1 agreement on the teacher's greedy replies and free-running greedy agreement over the first
tokens (targets 0.80 and 0.30). The x axis is log-scaled tokens. Prints the curve as a table too, and for every
target a series has not met, the tokens it would take at its present rate: the distance to the perfect value (NLL
ratio - 1, 1 - agreement) fitted as a power law of the tokens over the series' last FIT_POINTS points (a straight
line in log-log) and followed out to the target. An estimate from two or three points, not a promise; "no estimate"
where that distance is not shrinking, and "beyond HORIZONx" where the fit would need more than HORIZON times the
series' tokens so far (a nearly flat fit says the present recipe has stalled there, not a token count).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

NLL_KEYS = (("nll_chat", "held-out chats"), ("nll_prose", "prose"), ("nll_code", "code"))
AGREEMENT_KEYS = (("forced_top1", "teacher-forced top-1"), ("agreement", "free-running greedy"))
TARGETS = {"nll": 1.15, "forced_top1": 0.80, "agreement": 0.30}
FIT_POINTS = 3
HORIZON = 100  # estimates further out than this many times the series' last tokens are reported as such


def curve(report: dict) -> tuple[str, dict[str, list[dict]]]:
    """(the teacher's name, series name -> points sorted by tokens); a point holds tokens and the ratios."""
    models = report["models"]
    teacher_name = next(iter(models))
    teacher = models[teacher_name]
    series: dict[str, list[dict]] = {}
    for name, r in models.items():
        if not r.get("tokens_trained"):
            continue
        point = {"name": name, "tokens": r["tokens_trained"]}
        for key, _ in NLL_KEYS:
            if key in r and key in teacher:
                point[key] = r[key] / teacher[key]
        for key, _ in AGREEMENT_KEYS:
            if key in r:
                point[key] = r[key]
        series.setdefault(name.split(",")[0].strip(), []).append(point)
    for points in series.values():
        points.sort(key=lambda p: p["tokens"])
    return teacher_name, series


def table(series: dict[str, list[dict]]) -> str:
    head = ["series", "model", "tokens"] + [f"NLL {label} (x teacher)" for _, label in NLL_KEYS] + \
        [label for _, label in AGREEMENT_KEYS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, points in series.items():
        for p in points:
            cells = [name, p["name"], f"{p['tokens'] / 1e6:.2f}M"]
            cells += [f"{p[k]:.2f}" if k in p else "-" for k, _ in NLL_KEYS]
            cells += [f"{p[k]:.3f}" if k in p else "-" for k, _ in AGREEMENT_KEYS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gap(key: str, value: float) -> float:
    """The distance to a perfect student: NLL ratio - 1, or 1 - agreement."""
    return value - 1 if key.startswith("nll") else 1 - value


def tokens_to_target(points: list[dict], key: str) -> tuple[str, float | None, float | None]:
    """("met", tokens of the first point that meets key's target, None), ("estimate", tokens, exponent) from the
    power-law fit of the last FIT_POINTS points' gap against tokens, ("beyond", HORIZON x the last tokens,
    exponent) where that estimate lies further out, or ("none", None, exponent or None) where there are fewer than
    two points or the gap does not shrink."""
    target = TARGETS["nll" if key.startswith("nll") else key]
    have = [p for p in points if key in p]
    for p in have:
        if _gap(key, p[key]) <= _gap(key, target):
            return "met", p["tokens"], None
    fit = [(math.log(p["tokens"]), math.log(_gap(key, p[key]))) for p in have[-FIT_POINTS:] if _gap(key, p[key]) > 0]
    if len(fit) < 2 or len({x for x, _ in fit}) < 2:
        return "none", None, None
    mx, my = (sum(v) / len(fit) for v in zip(*fit))
    slope = sum((x - mx) * (y - my) for x, y in fit) / sum((x - mx) ** 2 for x, _ in fit)
    if slope >= 0:
        return "none", None, slope
    log_tokens = mx + (math.log(_gap(key, target)) - my) / slope
    horizon = HORIZON * have[-1]["tokens"]
    if log_tokens > math.log(horizon):
        return "beyond", horizon, slope
    return "estimate", math.exp(log_tokens), slope


def estimates(series: dict[str, list[dict]]) -> str:
    lines = []
    for name, points in series.items():
        for key, label in NLL_KEYS + AGREEMENT_KEYS:
            kind, tokens, slope = tokens_to_target(points, key)
            target = f"{TARGETS['nll']:.2f}x" if key.startswith("nll") else f"{TARGETS[key]:.2f}"
            if kind == "met":
                lines.append(f"{name}: {label} reaches {target} at {tokens / 1e6:.2f}M tokens")
            elif kind == "estimate":
                fitted = min(FIT_POINTS, sum(key in p for p in points))
                lines.append(f"{name}: {label} {target} at about {tokens / 1e6:.3g}M tokens at the present rate "
                             f"(distance to perfect ~ tokens^{slope:.2f} over the last {fitted} points)")
            elif kind == "beyond":
                lines.append(f"{name}: {label} {target}: not within {HORIZON}x the tokens so far ({tokens / 1e6:.3g}M) "
                             f"at the present rate (distance to perfect ~ tokens^{slope:.2f}: stalled)")
            elif any(key in p for p in points):
                why = "one point" if slope is None else f"not shrinking (tokens^{slope:+.2f})"
                lines.append(f"{name}: {label} {target}: no estimate ({why})")
    return "\n".join(lines)


def plot(teacher_name: str, series: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ("-", "--", ":", "-.")
    for (name, points), style in zip(series.items(), styles * len(series)):
        x = [p["tokens"] for p in points]
        for key, label in NLL_KEYS:
            if all(key in p for p in points):
                left.plot(x, [p[key] for p in points], style, marker="o", label=f"{name}: {label}")
        for key, label in AGREEMENT_KEYS:
            if all(key in p for p in points):
                right.plot(x, [p[key] for p in points], style, marker="o", label=f"{name}: {label}")
    left.axhline(TARGETS["nll"], color="grey", lw=0.8)
    left.set_ylabel(f"held-out NLL / {teacher_name}'s")
    right.axhline(TARGETS["forced_top1"], color="grey", lw=0.8)
    right.axhline(TARGETS["agreement"], color="grey", lw=0.8, ls="--")
    right.set_ylabel("agreement with the teacher")
    right.set_ylim(0, 1)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct students: quality vs training tokens (grey: targets)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="smollm2_report.py's --json")
    p.add_argument("--out", type=Path, help="the plot (PNG); without it, the table only")
    args = p.parse_args(argv)
    teacher_name, series = curve(json.loads(args.report.read_text()))
    if not series:
        p.error(f"{args.report}: no model with training tokens behind it (tokens_trained)")
    print(table(series))
    print()
    print(estimates(series))
    if args.out is not None:
        plot(teacher_name, series, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
