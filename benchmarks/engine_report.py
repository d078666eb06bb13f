"""Reports of `benchmarks/engine_gpu.py`: the comparison of "fastest" and the per-phase pairs
with the best single backend, and the figure.

Rows are the benchmark's JSON rows: `contender`, `batch`, `seconds` (the best run),
`tokens_per_s`, and for anyattn rows `backend` (a name, "fastest" or "DECODE,PREFILL"), `mode`,
`workload` ("batch" or "mixed"; rows of older runs have none: "batch") and `all_seconds`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

__all__ = ["RATIO_TARGET", "comparison", "comparison_table", "is_single", "plot"]

RATIO_TARGET = 1.03


def is_single(backend: str) -> bool:
    """One backend for every step (not "fastest", not a pair)."""
    return backend != "fastest" and "," not in backend


def _spread(row: dict) -> float:
    times = row.get("all_seconds") or [row["seconds"]]
    return (max(times) - min(times)) / 2


def _key(row: dict) -> tuple[str, int, str]:
    return row.get("workload", "batch"), row["batch"], row["mode"]


def comparison(rows: Sequence[dict]) -> list[dict]:
    """For each anyattn row that is "fastest" or a pair: the best single backend of the same
    workload, batch and mode, its time ratio (> 1: slower) and the verdict: "met" within 3%,
    "met (within spread)" when the gap is within both rows' spreads (half the range of their
    repeats), else "MISSED"; for pairs also whether they beat every single backend."""
    anyattn = [r for r in rows if "backend" in r]
    out = []
    for row in anyattn:
        if is_single(row["backend"]):
            continue
        key = _key(row)
        singles = [r for r in anyattn if is_single(r["backend"]) and _key(r) == key]
        if not singles:
            continue
        best = min(singles, key=lambda r: r["seconds"])
        ratio = row["seconds"] / best["seconds"]
        if ratio <= RATIO_TARGET:
            verdict = "met"
        elif row["seconds"] - best["seconds"] <= _spread(row) + _spread(best):
            verdict = "met (within spread)"
        else:
            verdict = "MISSED"
        out.append({
            "workload": key[0], "batch": key[1], "mode": key[2], "contender": row["contender"],
            "runs": row.get("runs", ""), "tokens_per_s": row["tokens_per_s"],
            "best_single": best["contender"], "best_tokens_per_s": best["tokens_per_s"],
            "time_ratio": ratio, "verdict": verdict,
            "beats_every_single": row["seconds"] < best["seconds"],
        })  # fmt: skip
    return out


def comparison_table(compared: Sequence[dict]) -> str:
    """`comparison` as a markdown table."""
    lines = [
        "| workload | batch | mode | contender | runs | tokens/s | best single | its tokens/s | "
        "time / best | verdict (<= 1.03) | beats every single |",
        "|" + "---|" * 11,
    ]
    for c in compared:
        cells = [
            c["workload"], c["batch"], c["mode"], c["contender"], c["runs"] or "-",
            f"{c['tokens_per_s']:.0f}", c["best_single"], f"{c['best_tokens_per_s']:.0f}",
            f"{c['time_ratio']:.3f}", c["verdict"], "yes" if c["beats_every_single"] else "no",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(x).replace("|", "/") for x in cells) + " |")
    return "\n".join(lines)


def _label(row: dict) -> str:
    runs = row.get("runs")
    return (
        f"{row['contender']} ({runs})"
        if runs and row.get("backend") == "fastest"
        else row["contender"]
    )


def plot(results: dict, path: Path) -> bool:
    """Tokens/s against batch size per contender (batch workload) and, when run, tokens/s per
    contender on the mixed workload; date, device, versions and command below. False when
    matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    batch = [r for r in results["rows"] if r.get("workload", "batch") == "batch"]
    mixed = [r for r in results["rows"] if r.get("workload") == "mixed"]
    panels = int(bool(batch)) + int(bool(mixed)) or 1
    figure, axes = plt.subplots(1, panels, figsize=(8 * panels, 5.5), squeeze=False)
    axes = list(axes[0])
    if batch:
        ax = axes.pop(0)
        for contender in sorted({r["contender"] for r in batch}):
            mine = sorted(
                (r for r in batch if r["contender"] == contender), key=lambda r: r["batch"]
            )
            ax.plot([r["batch"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o",
                    label=_label(mine[0]))  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests submitted at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{results['model']}, {results['dtype']}, {results['device_name']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if mixed:
        ax = axes.pop(0)
        mixed = sorted(mixed, key=lambda r: r["tokens_per_s"])
        ax.barh([_label(r) for r in mixed], [r["tokens_per_s"] for r in mixed])
        for y, r in enumerate(mixed):
            steps = r.get("steps", {})
            ax.text(r["tokens_per_s"], y, f" {r['tokens_per_s']:.0f} (steps d/m/p "
                    f"{steps.get('decode')}/{steps.get('mixed')}/{steps.get('prefill')})",
                    va="center", fontsize=7)  # fmt: skip
        ax.set_xlim(0, 1.4 * mixed[-1]["tokens_per_s"])  # room for the labels
        ax.set_xlabel("output tokens/s")
        ax.set_title(
            f"{results['device_name']}, mixed workload:\n{results.get('mixed_workload', '')}",
            fontsize=8,
        )
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(True, axis="x", alpha=0.3)
    versions = ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items())
    footer = f"{results.get('date', '')}, {results['device_name']}; {versions}\n"
    footer += textwrap.fill(results.get("command", ""), width=110 * panels)
    figure.text(0.01, 0.005, footer, fontsize=7, va="bottom")
    figure.tight_layout(rect=(0, 0.02 * (footer.count("\n") + 2), 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
