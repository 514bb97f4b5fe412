"""Held-out tau of several runs side by side, as `dflash-trainer plot RUN RUN ...` prints it beside the overlaid curves.

Contract: each argument is a run directory (its end-of-run evaluation `RUN/eval/eval.json`), a directory holding an
`eval.json` (an `eval --out` directory), or an `eval.json` itself. The table has one row per dataset, in the order
the reports first name them, and per run its pooled tau with the per-prompt mean in brackets; every run after the
first also gets the ratio of its pooled tau to the first run's, the comparison an ablation is read by (FP8 against
bf16, DFlash2 against DFlash). A run without a report, or whose report lacks a dataset, shows "-" there: a
comparison never fails for one missing evaluation. Reports are compared as they are: whether the runs evaluated the
same prompts (`eval.num_prompts`, the datasets) is for the reader to see in the prompts column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .runner import REPORT_FILE


def read_report(path: str | Path) -> dict[str, Any]:
    """The evaluation report at `path` (a run directory, a directory with `eval.json`, or the file); {} if none."""
    path = Path(path)
    for candidate in (path / "eval" / REPORT_FILE, path / REPORT_FILE, path):
        if candidate.is_file():
            try:
                report = json.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return {}
            return report if isinstance(report, dict) else {}
    return {}


def comparison_table(paths: list[str]) -> str | None:
    """The markdown table described in the module docstring, or None when no path holds a report."""
    reports = [read_report(path) for path in paths]
    if not any(reports):
        return None
    by_run = [{data["name"]: data for data in report.get("datasets", []) if "name" in data} for report in reports]
    names = list(dict.fromkeys(name for datasets in by_run for name in datasets))
    labels = _labels(paths)
    header = ["dataset", "prompts", *labels, *(f"{label} / {labels[0]}" for label in labels[1:])]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        rows = [datasets.get(name) for datasets in by_run]
        prompts = "/".join(sorted({str(row["num_prompts"]) for row in rows if row and "num_prompts" in row}))
        cells = [f"{row['tau']:.2f} ({row['tau_per_prompt']:.2f})" if row else "-" for row in rows]
        first = rows[0]
        ratios = [
            f"{row['tau'] / first['tau']:.2f}x" if row and first and first["tau"] > 0 else "-" for row in rows[1:]
        ]
        lines.append("| " + " | ".join([name, prompts or "-", *cells, *ratios]) + " |")
    return "\n".join(lines)


def _labels(paths: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [_run_name(Path(path)) for path in paths]
    return names if len(set(names)) == len(names) else [str(path) for path in paths]


def _run_name(path: Path) -> str:
    if path.name == REPORT_FILE:
        path = path.parent
    return path.parent.name if path.name == "eval" else path.name
