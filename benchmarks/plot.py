"""Draws a results table (results/<name>.json) as grouped horizontal bars, one group per case.

    python benchmarks/plot.py benchmarks/results/decoder_layer_h200.json
    python benchmarks/plot.py benchmarks/results/decode_e2e_h200_layer.json --series-from-case
    python benchmarks/plot.py benchmarks/results/mla_decode_h200.json --metric speedup_vs_absorbed,paged_vs_contiguous

Series are either several columns of each row (``--metric a,b``: the default is every column
that is a fraction of the byte floor or roofline, else every ``speedup_vs_*`` column), or,
with ``--series-from-case``, the last word of each case name (``... fp16 xla`` and ``...
fp16 fused`` become two bars of the group ``... fp16``; one metric). Ratios get a dashed line
at 1. The picture goes to results/plots/<name>.png (``--out`` elsewhere); the tables in git
are the JSON and Markdown, the pictures are drawn from them.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def default_metrics(columns: list[str]) -> list[str]:
    """The columns a table is judged by: fractions of its floor, else its speedups."""
    fractions = [c for c in columns if c == "roofline_fraction" or c.endswith("floor_fraction")]
    return fractions or [c for c in columns if c.startswith("speedup_vs_")]


def _split_case(case: str) -> tuple[str, str]:
    """'llama3-8b b1 ctx4096 fp16 one_launch' -> ('llama3-8b b1 ctx4096 fp16', 'one_launch'):
    the last word, by spaces where the name has any, else by underscores."""
    head, _, last = case.rpartition(" " if " " in case else "_")
    return (head, last) if head else (case, "")


def series_table(rows: list[dict], metrics: list[str], series_from_case: bool):
    """(group labels, {series name: [value or NaN per group]}) in the table's row order."""
    groups: list[str] = []
    values: dict[str, dict[str, float]] = {}
    for row in rows:
        if series_from_case:
            group, name = _split_case(str(row["case"]))
            picked = {name: row.get(metrics[0])}
        else:
            group, picked = str(row["case"]), {m: row.get(m) for m in metrics}
        if group not in groups:
            groups.append(group)
        for name, v in picked.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values.setdefault(name, {})[group] = float(v)
    return groups, {name: [per.get(g, math.nan) for g in groups] for name, per in values.items()}


def load_table(path: Path) -> dict:
    table = json.loads(path.read_text())
    if not isinstance(table, dict) or not table.get("rows"):
        raise ValueError(f"{path}: not a results table (a JSON object with 'rows')")
    return table


def plot(path: Path, metrics: list[str] | None = None, *, series_from_case: bool = False,
         out: Path | None = None) -> Path:
    """Draws the table at ``path``; returns the picture's path. ValueError for a metric the
    table does not have (naming the columns it has)."""
    table = load_table(path)
    rows = table["rows"]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    metrics = metrics or default_metrics(columns)
    if not metrics:
        raise ValueError(f"{path.name}: no fraction or speedup column; pass --metric (columns: {columns})")
    unknown = [m for m in metrics if m not in columns]
    if unknown:
        raise ValueError(f"{path.name}: no column {unknown} (columns: {columns})")
    if series_from_case and len(metrics) != 1:
        raise ValueError(f"--series-from-case draws one metric, got {metrics}")
    groups, series = series_table(rows, metrics, series_from_case)
    if not series:
        raise ValueError(f"{path.name}: {metrics} hold no numbers")

    import matplotlib  # noqa: PLC0415  (an optional dependency: the 'bench' extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    n = len(series)
    height = 0.8 / n
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.28 * len(groups) * max(1, n * 0.6)))
    for i, (name, vals) in enumerate(series.items()):
        ys = [g + (i - (n - 1) / 2) * height for g in range(len(groups))]
        ax.barh(ys, vals, height=height, label=name)
    ax.set_yticks(range(len(groups)), groups, fontsize=8)
    ax.invert_yaxis()  # the table's first row on top
    if all(m.endswith("fraction") or "_vs_" in m for m in metrics):  # ratios: mark 1
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel(metrics[0] if series_from_case or n == 1 else ", ".join(metrics), fontsize=8)
    ax.set_title(f"{path.stem}: {table.get('device', '?')}, {table.get('date', '?')}", fontsize=10)
    if n > 1:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = out or path.parent / "plots" / f"{path.stem}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tables", nargs="+", type=Path, help="results/<name>.json files")
    ap.add_argument("--metric", help="comma-separated columns to draw (default: the floor fractions, else speedups)")
    ap.add_argument("--series-from-case", action="store_true",
                    help="the last word of each case name is the series (one metric)")
    ap.add_argument("--out", type=Path, help="the picture's path (one table only)")
    args = ap.parse_args(argv)
    if args.out and len(args.tables) > 1:
        ap.error("--out takes one table")
    metrics = args.metric.split(",") if args.metric else None
    try:
        for path in args.tables:
            print(plot(path, metrics, series_from_case=args.series_from_case, out=args.out))
    except (ValueError, OSError, json.JSONDecodeError) as e:
        print(f"plot: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
