"""PNG curves of a run from its `metrics.jsonl`: loss, per-slot accuracy, E[tau], learning rate.

Used at the end of training (`metrics.plot_at_end`) and by `dflash-trainer plot RUN_DIR`; `dflash-trainer plot RUN_DIR
RUN_DIR ...` overlays the loss and acceptance-length curves of several runs instead (`plot_runs`: one colour per
run, labelled by its directory as given), to compare an ablation with its baseline. Draws with
matplotlib's object API (no pyplot; PNGs render on the Agg canvas): no display needed and no global figure
state.
Plots whose metrics are missing are skipped, so a short or partial run still gets what it has; a metrics file
with no readable record at all (empty, torn, not JSONL) is a `PlotError` saying so, never a silent "nothing"
(and `dflash-trainer plot` refuses a run whose records hold nothing to draw).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from dflash_trainer.errors import UserError
from dflash_trainer.train.metrics import METRICS_FILE

PLOTS_DIR = "plots"
# Smooth the noisy per-step training curves only when there are enough points for a trend to be visible.
SMOOTH_MIN_POINTS = 20
SMOOTH_WINDOW_FRACTION = 0.05
LOG_AXIS_MIN_SPAN = 10.0  # loss curves spanning this factor or more get a log axis

Record = dict[str, object]


class PlotError(UserError):
    """The run directory has no metrics file, or no record in it can be drawn."""


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw the run's curves into `out_dir` (default `run_dir/plots`); return the PNG paths written."""
    run_dir = Path(run_dir)
    records = run_records(run_dir)
    figures = [(name, draw(records)) for name, draw in _PLOTS]
    return _save(figures, Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR)


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Overlay the loss and acceptance-length curves of `run_dirs` into `out_dir` (`compare-loss.png`,
    `compare-tau.png`); return the PNG paths written."""
    runs = [(str(run_dir), run_records(Path(run_dir))) for run_dir in run_dirs]
    figures = [
        (
            "compare-loss",
            _log_loss_axis(_plot_compared(runs, train_name="loss", eval_name="eval_loss", ylabel="loss", title="Loss")),
        ),
        (
            "compare-tau",
            _plot_compared(
                runs,
                train_name="tau",
                eval_name="eval_tau",
                ylabel="tokens per target forward",
                title="Acceptance length: train E[tau] (lines), eval tau (markers)",
            ),
        ),
    ]
    return _save(figures, Path(out_dir))


def run_records(run_dir: Path) -> list[Record]:
    """The metrics records of a run directory; a `PlotError` when it has none."""
    path = run_dir / METRICS_FILE
    records = read_metrics(path)
    if not records:
        raise PlotError(f"{path}: no complete metrics record to plot (the file is empty, torn or not JSONL)")
    return records


def _save(figures: list[tuple[str, Figure | None]], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, figure in figures:
        if figure is None:
            continue
        png = out_dir / f"{name}.png"
        figure.savefig(png, dpi=110)
        written.append(png)
    return written


def read_metrics(path: Path) -> list[Record]:
    """Records of a metrics file in order. A torn last line (run killed mid-write) is skipped silently; other
    unreadable lines are skipped with a warning naming the line."""
    if not path.exists():
        raise PlotError(f"{path}: no metrics file (is this a run directory?)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records: list[Record] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if line_number != len(lines):
                warnings.warn(f"{path}:{line_number}: unreadable metrics record skipped", stacklevel=2)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            warnings.warn(f"{path}:{line_number}: record without an integer `step` skipped", stacklevel=2)
    return records


def _scalar_series(records: list[Record], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of the records that carry `name` as a number."""
    pairs = [
        (record["step"], float(record[name]))
        for record in records
        if isinstance(record.get(name), (int, float)) and not isinstance(record.get(name), bool)
    ]
    if not pairs:
        return np.empty(0), np.empty(0)
    steps, values = zip(*pairs, strict=True)
    return np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)


def _per_slot_series(records: list[Record], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps [S] and values [S, slots] of the records carrying `name` as a list; shorter lists padded with NaN."""
    rows = [(record["step"], record[name]) for record in records if isinstance(record.get(name), list)]
    rows = [(step, values) for step, values in rows if values]
    if not rows:
        return np.empty(0), np.empty((0, 0))
    num_slots = max(len(values) for _, values in rows)
    table = np.full((len(rows), num_slots), np.nan)  # [S, slots]
    for row, (_, values) in enumerate(rows):
        table[row, : len(values)] = values
    return np.asarray([step for step, _ in rows], dtype=np.float64), table


def _smoothed(values: np.ndarray) -> np.ndarray | None:
    """Trailing moving average (NaN-aware) for long noisy curves, None for short ones."""
    if len(values) < SMOOTH_MIN_POINTS:
        return None
    window = max(2, math.ceil(len(values) * SMOOTH_WINDOW_FRACTION))
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _plot_train_and_eval(
    records: list[Record], *, train_name: str, eval_name: str, ylabel: str, title: str
) -> Figure | None:
    train_steps, train_values = _scalar_series(records, train_name)
    eval_steps, eval_values = _scalar_series(records, eval_name)
    if len(train_steps) == 0 and len(eval_steps) == 0:
        return None
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    if len(train_steps):
        smooth = _smoothed(train_values)
        axes.plot(train_steps, train_values, color="tab:blue", alpha=0.35 if smooth is not None else 1.0, label="train")
        if smooth is not None:
            axes.plot(train_steps, smooth, color="tab:blue", label="train (moving average)")
    if len(eval_steps):
        axes.plot(eval_steps, eval_values, color="tab:red", marker="o", label="eval")
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def _plot_compared(
    runs: list[tuple[str, list[Record]]], *, train_name: str, eval_name: str, ylabel: str, title: str
) -> Figure | None:
    """One colour per run: its training curve (moving average over the faint raw one when long) and its
    evaluations as markers."""
    series = [
        (label, _scalar_series(records, train_name), _scalar_series(records, eval_name)) for label, records in runs
    ]
    if not any(len(train[0]) or len(evaluated[0]) for _, train, evaluated in series):
        return None
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.add_subplot()
    for index, (label, (train_steps, train_values), (eval_steps, eval_values)) in enumerate(series):
        color = f"C{index % 10}"
        if len(train_steps):
            smooth = _smoothed(train_values)
            if smooth is not None:
                axes.plot(train_steps, train_values, color=color, alpha=0.2)
            axes.plot(train_steps, train_values if smooth is None else smooth, color=color, label=label)
        if len(eval_steps):
            axes.plot(
                eval_steps,
                eval_values,
                color=color,
                marker="o",
                linestyle="--",
                label=f"{label} (eval)" if len(train_steps) else label,
            )
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    return figure


def _plot_loss(records: list[Record]) -> Figure | None:
    return _log_loss_axis(
        _plot_train_and_eval(records, train_name="loss", eval_name="eval_loss", ylabel="loss", title="Loss")
    )


def _log_loss_axis(figure: Figure | None) -> Figure | None:
    """A loss that falls by a decade or more (13 at the first step, 0.15 at the end is usual) on a log axis: on a
    linear one the first hundred steps take the whole height and the end, where runs differ, is a flat line."""
    if figure is None:
        return None
    axes = figure.axes[0]
    values = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in axes.get_lines()])
    values = values[np.isfinite(values)]
    # A value at or below 0 (a loss that can reach it) would vanish from a log axis: linear then.
    if len(values) and values.min() > 0 and values.max() >= LOG_AXIS_MIN_SPAN * values.min():
        axes.set_yscale("log")
    return figure


def _plot_tau(records: list[Record]) -> Figure | None:
    figure = _plot_train_and_eval(
        records,
        train_name="tau",
        eval_name="eval_tau",
        ylabel="tokens per target forward",
        title="Acceptance length: train E[tau], eval tau",
    )
    if figure is None:
        return None
    axes = figure.axes[0]
    argmax_steps, argmax_values = _scalar_series(records, "eval_tau_argmax")
    if len(argmax_steps):  # DFlash2 with eval.argmax_drafts: what the walk adds
        axes.plot(argmax_steps, argmax_values, color="tab:orange", marker="s", label="eval, argmax drafts (no walk)")
    # The periodic evaluation's sets one by one (`eval_tau/<set>`), thin dotted lines under the pooled markers.
    for name in sorted({name for record in records for name in record if name.startswith("eval_tau/")}):
        steps, values = _scalar_series(records, name)
        axes.plot(
            steps, values, linestyle=":", marker=".", linewidth=1, label=f"eval, {name.removeprefix('eval_tau/')}"
        )
    axes.legend()
    return figure


def _plot_accuracy(records: list[Record]) -> Figure | None:
    """Left: accuracy of every slot over steps (colour = slot) and the mean. Right: latest per-slot accuracy."""
    slot_steps, per_slot = _per_slot_series(records, "acc_per_slot")  # [S], [S, slots]
    mean_steps, mean_values = _scalar_series(records, "acc")
    if len(mean_steps) == 0 and len(slot_steps):
        mean_steps, mean_values = slot_steps, np.nanmean(per_slot, axis=1)
    if len(mean_steps) == 0:
        return None
    has_slots = len(slot_steps) > 0
    figure = Figure(figsize=(13, 4.5) if has_slots else (8, 4.5), layout="constrained")
    over_time = figure.add_subplot(1, 2, 1) if has_slots else figure.add_subplot()
    if has_slots:
        num_slots = per_slot.shape[1]
        colormap = ScalarMappable(norm=Normalize(vmin=1, vmax=max(num_slots, 2)), cmap="viridis")
        for slot_index in range(num_slots):
            over_time.plot(slot_steps, per_slot[:, slot_index], color=colormap.to_rgba(slot_index + 1), linewidth=1)
        figure.colorbar(colormap, ax=over_time, label="block slot")
    over_time.plot(mean_steps, mean_values, color="black", linestyle="--", linewidth=2, label="mean over slots")
    over_time.set_xlabel("step")
    over_time.set_ylabel("accuracy")
    over_time.set_ylim(0, 1)
    over_time.set_title("Accuracy per slot")
    over_time.grid(alpha=0.3)
    over_time.legend()
    if has_slots:
        latest = figure.add_subplot(1, 2, 2)
        slots = np.arange(1, per_slot.shape[1] + 1)
        latest.bar(slots, per_slot[-1], color=colormap.to_rgba(slots))
        latest.set_xlabel("block slot")
        latest.set_ylabel("accuracy")
        latest.set_ylim(0, 1)
        latest.set_xticks(slots)
        latest.set_title(f"Per-slot accuracy at step {int(slot_steps[-1])}")
        latest.grid(alpha=0.3, axis="y")
    return figure


def _plot_lr(records: list[Record]) -> Figure | None:
    steps, values = _scalar_series(records, "lr")
    if len(steps) == 0:
        return None
    figure = Figure(figsize=(8, 2.2), layout="constrained")
    axes = figure.add_subplot()
    axes.plot(steps, values, color="tab:green")
    axes.set_xlabel("step")
    axes.set_ylabel("lr")
    axes.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axes.grid(alpha=0.3)
    return figure


_PLOTS: tuple[tuple[str, Callable[[list[Record]], Figure | None]], ...] = (
    ("loss", _plot_loss),
    ("accuracy", _plot_accuracy),
    ("tau", _plot_tau),
    ("lr", _plot_lr),
)
