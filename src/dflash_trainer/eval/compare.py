"""Held-out tau of several runs side by side, as `dflash-trainer plot RUN RUN ...` prints it beside the overlaid curves.

Contract: each argument is a run directory (its end-of-run evaluation `RUN/eval/eval.json`), a directory holding an
`eval.json` (an `eval --out` directory), or an `eval.json` itself. The table has one row per dataset, in the order
the reports first name them, and per run its pooled tau with the per-prompt mean in brackets; every run after the
first also gets the ratio of its pooled tau to the first run's, the comparison an ablation is read by (FP8 against
bf16, DFlash2 against DFlash). A run without a report, or whose report lacks a dataset, shows "-" there: a
comparison never fails for one missing evaluation. Reports are compared as they are: whether the runs evaluated the
same prompts (`eval.num_prompts`, the datasets) is for the reader to see in the prompts column.

Where both reports keep per-prompt records (`prompts`: id, committed tokens, target forwards) for at least
`MIN_PAIRED` of the same prompt ids, the ratio gets a 95 % interval from a paired bootstrap: the shared prompts are
drawn with replacement `RESAMPLES` times (the same draw for both runs, so prompt difficulty cancels) and the pooled
ratio sum(committed) / sum(forwards) of the draw is taken each time; the interval is its 2.5th to 97.5th
percentile. It measures how much the ratio depends on which prompts were drawn, not the training's seed-to-seed
spread, which needs runs with other seeds. Seeded, so a table is reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .runner import REPORT_FILE

MIN_PAIRED = 10  # fewer shared prompts: no interval (a bootstrap of a handful says little)
RESAMPLES = 4000


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
        ratios = [_ratio_cell(first, row) for row in rows[1:]]
        lines.append("| " + " | ".join([name, prompts or "-", *cells, *ratios]) + " |")
    return "\n".join(lines)


def _ratio_cell(first: dict | None, row: dict | None) -> str:
    if not (row and first and first["tau"] > 0):
        return "-"
    cell = f"{row['tau'] / first['tau']:.2f}x"
    interval = paired_ratio_interval(first.get("prompts") or [], row.get("prompts") or [])
    return cell if interval is None else f"{cell} ({interval[0]:.2f}-{interval[1]:.2f})"


def paired_ratio_interval(
    first: list[dict[str, Any]], other: list[dict[str, Any]], *, resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, float] | None:
    """The 95 % paired-bootstrap interval of `other`'s pooled tau over `first`'s on the prompts both evaluated
    (module docstring); None with fewer than `MIN_PAIRED` shared prompts or a draw without forwards."""
    by_id = {record["id"]: record for record in first}
    pairs = [(by_id[record["id"]], record) for record in other if record["id"] in by_id]
    if len(pairs) < MIN_PAIRED:
        return None
    # [2, P] committed tokens and forwards of each run, prompt by prompt.
    base = np.array([[a["committed"], a["steps"]] for a, _ in pairs], dtype=np.float64).T
    test = np.array([[b["committed"], b["steps"]] for _, b in pairs], dtype=np.float64).T
    draws = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))  # [N, P]
    base_sums, test_sums = base[:, draws].sum(axis=2), test[:, draws].sum(axis=2)  # [2, N]
    if (base_sums[1] == 0).any() or (test_sums[1] == 0).any() or (base_sums[0] == 0).any():
        return None
    ratios = (test_sums[0] / test_sums[1]) / (base_sums[0] / base_sums[1])
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def _labels(paths: list[str]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [_run_name(Path(path)) for path in paths]
    return names if len(set(names)) == len(names) else [str(path) for path in paths]


def _run_name(path: Path) -> str:
    if path.name == REPORT_FILE:
        path = path.parent
    return path.parent.name if path.name == "eval" else path.name
