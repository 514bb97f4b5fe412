"""The GPU benchmark scripts (benchmarks/*.sh) parse, and `gpu_session.sh main`'s background job runs: the main job,
then the export's batch-1 evaluations only after a training that succeeded, its exit status the training's. These
scripts run on machines reached by short commands, where a job that never starts shows only as missing results."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_the_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def _main_job_block() -> str:
    """The lines of gpu_session.sh's `main` stage that build and start the main job's background command."""
    lines = (ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
    start = lines.index('    latency=""')
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith('(exit \\$rc)"'))
    return "\n".join(lines[start : end + 1])


@pytest.mark.parametrize(
    ("train_rc", "latency", "evals"),
    [(0, 1, ["eval-b1"]), (3, 1, []), (0, 0, [])],
    ids=["trained", "training-failed", "latency-off"],
)
def test_the_main_job_command_runs_and_reports_the_training_status(tmp_path, train_rc, latency, evals):
    fake_python = tmp_path / "bin" / "python3"
    fake_python.parent.mkdir()
    # The trainer's last line names the export (train/pipeline.py); an evaluation just says what it was asked.
    fake_python.write_text(
        "#!/bin/sh\n"
        'case "$*" in *" train "*) echo "TRAIN $*"; echo "exported drafter (vLLM / SGLang format): runs/a b/export"; '
        f'exit {train_rc};; *) echo "EVAL $*";; esac\n'
    )
    fake_python.chmod(0o755)
    harness = f"""
set -u
RES={tmp_path} REPO={tmp_path} SITE=/nowhere PROMPTS=/nowhere.jsonl.gz first="" LATENCY_EVAL={latency}
SOURCE="prepare.source=$PROMPTS prepare.shares={{}}"
export PATH={fake_python.parent}:$PATH
bg() {{ local name=$1; shift; bash -c "{{ $*; }} > $RES/$name.log 2>&1; echo \\$? > $RES/$name.rc"; }}
{_main_job_block()}
"""
    subprocess.run(["bash", "-c", harness], check=True, cwd=tmp_path)
    assert (tmp_path / "main.rc").read_text().strip() == str(train_rc)
    assert (tmp_path / "main.end").is_file()
    log = (tmp_path / "main.log").read_text().splitlines()
    # The exported prompts hold the recipe's category shares already: the job must not apply them again.
    assert [line for line in log if line.startswith("TRAIN")] == [
        "TRAIN -m dflash_trainer train prepare.source=/nowhere.jsonl.gz prepare.shares={}"
    ]
    runs = [line for line in log if line.startswith("EVAL")]
    assert [line.split("--out ")[1].split()[0].rsplit("/", 1)[1] for line in runs] == evals
    for line in runs:  # the export's path whole, one prompt at a time, the drafter compiled as eval's default has it
        assert "--drafter runs/a b/export --num-prompts 24" in line and "--batch-size 1" in line
        assert "compile-drafter" not in line
