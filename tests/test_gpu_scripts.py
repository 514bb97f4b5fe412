"""The GPU benchmark scripts (benchmarks/*.sh) parse, and `gpu_session.sh main`'s background job runs: the main job,
then the export's batch-1 evaluations only after a training that succeeded, its exit status the training's. These
scripts run on machines reached by short commands, where a job that never starts shows only as missing results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def _function(name: str) -> str:
    """A shell function of gpu_session.sh, whole."""
    lines = (ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
    start = lines.index(f"{name}() {{")
    return "\n".join(lines[start : lines.index("}", start) + 1])


def test_the_answers_pack_only_when_complete_and_unpack_as_the_answers_stage_does(tmp_path):
    chat = tmp_path / "repo" / "data" / "mix-chat"
    chat.mkdir(parents=True)
    (chat / "regen.partial.jsonl").write_text('{"index": 0}\n')  # still answering: nothing to pack
    pack = f"set -u\nREPO={tmp_path / 'repo'}\n{_function('pack_answers')}\npack_answers {tmp_path}"
    assert subprocess.run(["bash", "-c", pack], capture_output=True).returncode == 1
    assert not list(tmp_path.glob("answers.part*"))
    (chat / "regen.partial.jsonl").unlink()
    (chat / "regen-00000.jsonl").write_text('{"index": 0, "messages": []}\n')
    (chat / "regen.json").write_text('{"complete": false}\n')  # merged, not yet marked done
    assert subprocess.run(["bash", "-c", pack], capture_output=True).returncode == 1
    (chat / "regen.json").write_text('{"complete": true}\n')
    subprocess.run(["bash", "-c", pack], check=True)
    # The `answers` stage: the parts concatenated, extracted into a tree.
    parts = sorted(tmp_path.glob("answers.part*"))
    (tmp_path / "answers.tar.gz").write_bytes(b"".join(part.read_bytes() for part in parts))
    subprocess.run(
        ["python3", "-m", "tarfile", "-e", str(tmp_path / "answers.tar.gz"), str(tmp_path / "new")], check=True
    )
    for name in ("regen-00000.jsonl", "regen.json"):
        assert (tmp_path / "new" / "data" / "mix-chat" / name).read_text() == (chat / name).read_text()


def _alongside_block() -> str:
    """The lines of gpu_session.sh's `main` stage that start the ALONGSIDE job."""
    lines = (ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
    start = lines.index('    elif [ -n "${ALONGSIDE:-}" ]; then') + 1
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith('echo "started:'))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("main_trained", [True, False], ids=["main-trains", "main-failed-first"])
def test_the_alongside_job_starts_once_the_main_job_trains_on_its_data(tmp_path, main_trained):
    repo, repo2 = tmp_path / "repo", tmp_path / "repo2"
    (repo / "data" / "shards").mkdir(parents=True)
    (repo / "data" / "shards" / "shard-0").write_text("tokens")
    repo2.mkdir()
    # An earlier run's metrics, older than this main job's start stamp, must not start the job.
    (repo / "runs" / "old").mkdir(parents=True)
    (repo / "runs" / "old" / "metrics.jsonl").write_text('{"step": 9}\n')
    (tmp_path / "main.start").write_text("0\n")
    os.utime(repo / "runs" / "old" / "metrics.jsonl", (1, 1))
    os.utime(tmp_path / "main.start", (2, 2))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "TRAIN $*"; ls data/shards\n')
    (bin_dir / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 0.05\n")  # the job's 10 s poll, shortened
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    harness = f"""
set -u
RES={tmp_path} REPO={repo} REPO2={repo2} SITE=/nowhere SOURCE="prepare.source=/p.jsonl.gz prepare.shares={{}}"
MAIN_OVERRIDES="eval.num_prompts=80" ALONGSIDE="drafter.fp8=true"
export PATH={bin_dir}:$PATH
bg() {{ local name=$1; shift; bash -c "{{ $*; }} > $RES/$name.log 2>&1; echo \\$? > $RES/$name.rc"; }}
{_alongside_block()}
"""
    job = subprocess.Popen(["bash", "-c", harness], cwd=tmp_path)
    time.sleep(0.5)
    assert job.poll() is None  # still waiting: no metrics of this main job yet
    if main_trained:
        (repo / "runs" / "new").mkdir()
        (repo / "runs" / "new" / "metrics.jsonl").write_text('{"step": 1}\n')
    else:
        (tmp_path / "main.rc").write_text("1\n")
    assert job.wait(timeout=30) == 0
    log = (tmp_path / "candidate.log").read_text().splitlines()
    if main_trained:  # on the main job's data (copied), with the main job's overrides and its own after them
        assert (tmp_path / "candidate.rc").read_text().strip() == "0"
        assert log == [
            "TRAIN -m dflash_trainer train prepare.source=/p.jsonl.gz prepare.shares={} eval.num_prompts=80 "
            "drafter.fp8=true",
            "shard-0",
        ]
    else:  # the main job ended without a step: nothing to train on, and the job says so by its status
        assert (tmp_path / "candidate.rc").read_text().strip() == "3" and log == []


@pytest.mark.slow
def test_the_disaggregation_benchmark_runs_its_cpu_setting(tmp_path):
    """benchmarks/disagg_bench.py's `tiny` setting on two CPU ranks (gloo), 1 target + 1 drafter, then its table:
    the script calls the trainer's internals (roles, workers), which it must keep up with (it once did not)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    bench = ROOT / "benchmarks" / "disagg_bench.py"
    data, results = tmp_path / "data", tmp_path / "results"
    common = ["--settings", "tiny", "--data-dir", str(data), "--result-dir", str(results)]
    subprocess.run([sys.executable, str(bench), "prepare", *common], env=env, check=True, timeout=120)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run(
        [*torchrun, str(bench), "run", "--layout", "disagg", *common],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout
    (result,) = [json.loads(path.read_text()) for path in results.glob("disagg-tiny.json")]
    assert result["steps"] > 0 and result["tokens_per_s"] > 0
