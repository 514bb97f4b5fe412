"""Run plots: PNG curves from a synthetic metrics.jsonl, robust to short files and missing metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dflash_trainer.cli import main
from dflash_trainer.train.plot import (
    PlotError,
    _log_loss_axis,
    _plot_compared,
    _plot_loss,
    _plot_tau,
    _smoothed,
    plot_run,
    plot_runs,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + tail)


def synthetic_run(num_steps: int, num_slots: int = 6) -> list[dict]:
    records = []
    for step in range(1, num_steps + 1):
        progress = step / num_steps
        per_slot = [0.9 * progress * 0.85**slot for slot in range(num_slots)]
        tau = 1 + sum(math.prod(per_slot[: k + 1]) for k in range(num_slots))
        records.append(
            {
                "step": step,
                "time": 1.7e9 + step,
                "wall": float(step),
                "loss": 6.0 * (1 - 0.8 * progress) + 0.1 * math.sin(step),
                "acc_per_slot": per_slot,
                "acc": sum(per_slot) / num_slots,
                "tau": tau,
                "lr": 6e-4 * min(1.0, step / 5) * 0.5 * (1 + math.cos(math.pi * progress)),
            }
        )
        if step % 10 == 0:
            records.append({"step": step, "time": 1.7e9 + step, "wall": float(step), "eval_tau": tau + 0.3})
            records.append({"step": step, "time": 1.7e9 + step, "wall": float(step), "eval_loss": 4.0 - progress})
    return records


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, (path, len(data))


def test_full_run_produces_all_plots(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", synthetic_run(40))
    paths = plot_run(tmp_path)
    assert [path.name for path in paths] == ["loss.png", "accuracy.png", "tau.png", "lr.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert_png(path)


def test_short_partial_file_plots_what_it_has(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "wall": 0.5, "loss": 5.0}], tail='{"step": 2, "lo')
    out_dir = tmp_path / "elsewhere"
    paths = plot_run(tmp_path, out_dir=out_dir)
    assert paths == [out_dir / "loss.png"]
    assert_png(paths[0])


def test_accuracy_without_per_slot_lists_and_no_plottable_metrics(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [{"step": 1, "acc": 0.2}, {"step": 2, "acc": 0.4}])
    assert [path.name for path in plot_run(tmp_path)] == ["accuracy.png"]
    empty_run = tmp_path / "empty"
    empty_run.mkdir()
    write_metrics(empty_run / "metrics.jsonl", [{"step": 1, "tokens_per_s": 10.0}])
    assert plot_run(empty_run) == []


def test_missing_metrics_file_names_the_path(tmp_path):
    with pytest.raises(PlotError, match=r"metrics\.jsonl: no metrics file"):
        plot_run(tmp_path)


@pytest.mark.parametrize("content", ["", '{"step": 1, "lo', "not json at all\n\x00\x01"])
def test_a_torn_or_empty_metrics_file_is_an_error_not_silence(tmp_path, content, capsys):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(PlotError, match="no complete metrics record"):
        plot_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no complete metrics record" in err and "Traceback" not in err


def test_moving_average_matches_a_direct_window_mean():
    values = np.arange(40, dtype=np.float64) ** 1.5
    values[7] = np.nan
    smooth = _smoothed(values)
    window = 2  # ceil(40 * 0.05)
    expected = [np.nanmean(values[max(0, index - window + 1) : index + 1]) for index in range(len(values))]
    np.testing.assert_allclose(smooth, expected)
    assert _smoothed(values[:10]) is None


def test_a_loss_falling_a_decade_or_more_gets_a_log_axis_and_a_flat_one_does_not():
    falling = [{"step": step, "loss": 13.0 * 0.9**step} for step in range(1, 60)]  # 11.7 -> 0.03
    flat = [{"step": step, "loss": 6.0 * (1 - 0.008 * step)} for step in range(1, 60)]  # 5.95 -> 3.2
    assert _plot_loss(falling).axes[0].get_yscale() == "log"
    assert _plot_loss(flat).axes[0].get_yscale() == "linear"
    compared = _plot_compared(
        [("a", flat), ("b", falling)], train_name="loss", eval_name="eval_loss", ylabel="loss", title="Loss"
    )
    assert _log_loss_axis(compared).axes[0].get_yscale() == "log"  # the span of all runs together decides
    reaching_zero = [*falling, {"step": 60, "loss": 0.0}]  # would vanish from a log axis
    assert _plot_loss(reaching_zero).axes[0].get_yscale() == "linear"
    flat_with_low_eval = [*flat, {"step": 59, "eval_loss": 0.1}]  # the evaluation's markers count too
    assert _plot_loss(flat_with_low_eval).axes[0].get_yscale() == "log"


def test_the_tau_plot_shows_argmax_draft_evaluations_beside_the_walks():
    records = [{"step": step, "tau": 1.0 + step / 100} for step in range(1, 50)]
    records += [{"step": 20, "eval_tau": 1.5, "eval_tau_argmax": 1.4}, {"step": 40, "eval_tau": 1.8}]
    labels = [line.get_label() for line in _plot_tau(records).axes[0].get_lines()]
    assert "eval" in labels and "eval, argmax drafts (no walk)" in labels
    plain = [record for record in records if "eval_tau_argmax" not in record]
    assert not any("argmax" in line.get_label() for line in _plot_tau(plain).axes[0].get_lines())


def test_the_tau_plot_draws_each_evaluated_set():
    records = [{"step": step, "tau": 1.0 + step / 100} for step in range(1, 50)]
    records += [{"step": s, "eval_tau": 1.5, "eval_tau/gsm8k": 1.9, "eval_tau/mtbench": 1.2} for s in (20, 40)]
    lines = {line.get_label(): line for line in _plot_tau(records).axes[0].get_lines()}
    assert {"eval", "eval, gsm8k", "eval, mtbench"} <= set(lines)
    assert list(lines["eval, gsm8k"].get_ydata()) == [1.9, 1.9]


def test_several_runs_are_overlaid_in_one_plot_each(tmp_path, capsys):
    baseline, ablation = tmp_path / "runs" / "bf16", tmp_path / "runs" / "fp8"
    for run, scale in ((baseline, 1.0), (ablation, 1.1)):
        run.mkdir(parents=True)
        records = [dict(r, loss=r["loss"] * scale) if "loss" in r else r for r in synthetic_run(40)]
        write_metrics(run / "metrics.jsonl", records)
    out = tmp_path / "compare"

    assert main(["plot", str(baseline), str(ablation), "--out", str(out)]) == 0

    paths = [out / "compare-loss.png", out / "compare-tau.png"]
    assert capsys.readouterr().out.split() == [str(path) for path in paths]
    for path in paths:
        assert_png(path)
    assert not (baseline / "plots").exists()  # the runs' own plot folders are left alone


def write_report(run, datasets: dict[str, tuple[float, float]], num_prompts: int = 80) -> None:
    (run / "eval").mkdir(parents=True)
    entries = [
        {"name": name, "num_prompts": num_prompts, "tau": tau, "tau_per_prompt": per_prompt}
        for name, (tau, per_prompt) in datasets.items()
    ]
    (run / "eval" / "eval.json").write_text(json.dumps({"datasets": entries}))


def test_several_runs_with_evaluations_get_their_held_out_tau_side_by_side(tmp_path, capsys):
    dflash, dflash2 = tmp_path / "dflash-wsd", tmp_path / "dflash2-wsd"
    for run in (dflash, dflash2):
        run.mkdir()
        write_metrics(run / "metrics.jsonl", synthetic_run(20))
    write_report(dflash, {"gsm8k": (3.59, 3.69), "mtbench": (2.32, 2.60)})
    write_report(dflash2, {"gsm8k": (4.25, 4.42), "humaneval": (3.43, 3.54)})
    out = tmp_path / "compare"

    assert main(["plot", str(dflash), str(dflash2), "--out", str(out)]) == 0

    table = (out / "tau.md").read_text().splitlines()
    assert table[0] == "| dataset | prompts | dflash-wsd | dflash2-wsd | dflash2-wsd / dflash-wsd |"
    assert table[2:] == [
        "| gsm8k | 80 | 3.59 (3.69) | 4.25 (4.42) | 1.18x |",
        "| mtbench | 80 | 2.32 (2.60) | - | - |",  # a dataset one run did not evaluate
        "| humaneval | 80 | - | 3.43 (3.54) | - |",
    ]
    printed = capsys.readouterr().out
    assert "| gsm8k | 80 | 3.59 (3.69) | 4.25 (4.42) | 1.18x |" in printed and str(out / "tau.md") in printed


def test_comparing_with_a_run_that_has_no_metrics_names_it(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", synthetic_run(5))
    with pytest.raises(PlotError, match="missing"):
        plot_runs([tmp_path, tmp_path / "missing"], tmp_path / "out")


def test_one_run_plots_into_out_when_given(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", synthetic_run(12))
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "elsewhere")]) == 0
    assert sorted(path.name for path in (tmp_path / "elsewhere").iterdir()) == [
        "accuracy.png",
        "loss.png",
        "lr.png",
        "tau.png",
    ]


def prompt_records(committed: list[int], steps: list[int], prefix: str = "p") -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "committed": c, "steps": s}
        for i, (c, s) in enumerate(zip(committed, steps, strict=True))
    ]


def test_the_ratio_gets_a_paired_bootstrap_interval_over_the_shared_prompts():
    """The interval resamples the prompts both runs evaluated, the same draw for both: a run that commits 6/5 of
    the other's tokens per forward on every prompt has no spread at all, however unequal the prompts; a noisy one
    has an interval around its pooled ratio; too few or no shared prompts give none."""
    from dflash_trainer.eval.compare import MIN_PAIRED, paired_ratio_interval

    rng = np.random.default_rng(1)
    steps = rng.integers(40, 120, size=40).tolist()
    committed = [int(s * t) for s, t in zip(steps, rng.uniform(1.5, 6.0, size=40), strict=True)]
    exact = paired_ratio_interval(
        prompt_records(committed, steps), prompt_records([6 * c for c in committed], [5 * s for s in steps])
    )
    assert exact is not None and exact[0] == pytest.approx(1.2) and exact[1] == pytest.approx(1.2)

    noisy_committed = [int(c * f) for c, f in zip(committed, rng.uniform(0.8, 1.6, size=40), strict=True)]
    first, other = prompt_records(committed, steps), prompt_records(noisy_committed, steps)
    low, high = paired_ratio_interval(first, other)
    point = (sum(noisy_committed) / sum(steps)) / (sum(committed) / sum(steps))
    assert low < point < high and high - low > 0.02
    assert paired_ratio_interval(first, other) == (low, high)  # seeded
    # Shared prompts only: a run with other ids, or too few shared, gets no interval.
    assert paired_ratio_interval(first, prompt_records(noisy_committed, steps, prefix="q")) is None
    assert paired_ratio_interval(first[: MIN_PAIRED - 1], other) is None


def test_the_table_shows_the_interval_where_both_reports_keep_their_prompts(tmp_path):
    from dflash_trainer.eval.compare import comparison_table

    steps = [50 + 3 * i for i in range(20)]
    committed = [2 * s + i for i, s in enumerate(steps)]
    runs = []
    for name, scale in (("dflash", 1), ("dflash2", 2)):
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        records = prompt_records([scale * c for c in committed], steps)
        tau = sum(r["committed"] for r in records) / sum(steps)
        datasets = [{"name": "gsm8k", "num_prompts": 20, "tau": tau, "tau_per_prompt": tau, "prompts": records}]
        datasets.append({"name": "mtbench", "num_prompts": 20, "tau": 3.0, "tau_per_prompt": 3.0})  # no records
        (run / "eval" / "eval.json").write_text(json.dumps({"datasets": datasets}))
        runs.append(str(run))
    table = comparison_table(runs).splitlines()
    assert table[2].endswith("| 2.00x (2.00-2.00) |"), table[2]
    assert table[3].endswith("| 1.00x |"), table[3]
