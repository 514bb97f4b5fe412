"""Regeneration over several ranks (gloo on the CPU): shares that balance the work; two ranks with one killed
mid-run, resumed by one rank or by two (the CLI under torchrun), the merged file equal byte for byte to a one-rank
run's."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from decoding_helpers import one_thread  # noqa: F401 (autouse fixture)
from dflash_trainer.decoding.batch import BatchDecoder
from dflash_trainer.targets import regen_journal
from dflash_trainer.targets.loader import load_target
from dflash_trainer.targets.regen_ranks import RegenTeam, share
from dflash_trainer.targets.regenerate import regenerate
from regen_helpers import MAX_NEW_TOKENS

SRC = Path(__file__).resolve().parents[1] / "src"
BATCH = 2


def _records() -> list[dict]:
    """Ten records: single prompts of growing length, three multi-turn conversations, ids on some."""
    records: list[dict] = [{"prompt": " ".join(f"w{i + k}" for k in range(1 + i % 4))} for i in range(7)]
    records[2]["id"] = "HumanEval/0"
    records += [
        {
            "id": f"chat-{n}",
            "messages": [
                {"role": "user", "content": f"w{20 + n}"},
                {"role": "assistant", "content": "w1"},
                {"role": "user", "content": f"w{30 + n} w{31 + n}"},
            ],
        }
        for n in range(3)
    ]
    return records


@pytest.fixture
def inputs(tmp_path, tiny_target_dir) -> tuple[Path, Path]:
    """(the records as a chat JSONL file, the output of a one-rank run over them)."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in _records()))
    target = load_target(str(tiny_target_dir), device="cpu")
    regenerate(path, target, tmp_path / "one", max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH, progress=False)
    return path, tmp_path / "one" / regen_journal.OUTPUT_FILE


def test_shares_cover_every_record_once_and_balance_the_work():
    rng = random.Random(0)
    for size in (2, 3, 5, 8):
        # A third multi-turn (2 to 7 replies), characters log-normal.
        work = [(1 + (i % 3 == 0) * rng.randint(1, 6), int(rng.lognormvariate(6, 1))) for i in range(500)]
        shares = [share(work, rank, size) for rank in range(size)]
        assert sorted(i for s in shares for i in s) == list(range(len(work)))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        for replies in {r for r, _ in work}:  # records of each reply count spread evenly, and their characters
            counts = [sum(work[i][0] == replies for i in s) for s in shares]
            assert max(counts) - min(counts) <= 2
            totals = [sum(work[i][1] for i in s if work[i][0] == replies) for s in shares]
            assert max(totals) - min(totals) <= 2 * max(c for r, c in work if r == replies)
    # A file that alternates heavy and light records (a mixture interleaving two sources): dealt by index, every
    # heavy record lands on rank 0; dealt by work, each rank gets half of them.
    alternating = [(4, 3000) if i % 2 == 0 else (1, 100) for i in range(100)]
    heavy = [sum(alternating[i][0] == 4 for i in share(alternating, rank, 2)) for rank in range(2)]
    assert heavy == [25, 25]
    with pytest.raises(ValueError):
        share([(1, 1)], 2, 2)


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dflash_trainer", *args], env=env, capture_output=True, text=True, timeout=600
    )


def _rank(rank: int, world_size: int, store: str, target_dir: str, path: str, out: str, kill_after: int) -> None:
    """One rank of a gloo job: regenerate its share; rank 1 SIGKILLs itself after `kill_after` journal lines (0:
    never)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    if rank == 1 and kill_after:
        original_write = regen_journal.Journal.write
        lines = []

        def write_then_die(self, entry):
            original_write(self, entry)
            lines.append(entry["index"])
            if len(lines) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

        regen_journal.Journal.write = write_then_die
    target = load_target(target_dir, device="cpu")
    team = RegenTeam.of()
    regenerate(path, target, out, max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH, progress=False, team=team)
    team.close()
    dist.destroy_process_group()


def _spawn(tmp_path: Path, name: str, target_dir: Path, path: Path, out: Path, kill_after: int = 0) -> None:
    out.mkdir(exist_ok=True)
    args = (2, str(tmp_path / f"store-{name}"), str(target_dir), str(path), str(out), kill_after)
    mp.spawn(_rank, args=args, nprocs=2, join=True)


@pytest.mark.slow
def test_a_killed_rank_resumes_on_two_ranks_or_one_and_the_merge_equals_one_rank(
    inputs, tiny_target_dir, tmp_path, monkeypatch
):
    """Two ranks (gloo), rank 1 killed (SIGKILL) after two of its records; rank 0 is stopped wherever it is. The
    rerun answers exactly the records no journal holds, and the merged file equals a one-rank run's byte for byte:
    on one rank in this process, and on two through the CLI (torchrun)."""
    path, one = inputs
    killed = tmp_path / "killed"
    with pytest.raises(mp.ProcessExitedException):
        _spawn(tmp_path, "killed", tiny_target_dir, path, killed, kill_after=2)
    assert not (killed / regen_journal.OUTPUT_FILE).exists()
    assert len(regen_journal.journal_path(killed, 1).read_text().splitlines()) == 2
    finished = regen_journal.read_journals(killed, num_records=len(_records()))
    unfinished = sorted(set(range(len(_records()))) - set(finished))
    assert unfinished
    two = tmp_path / "two"
    shutil.copytree(killed, two)

    # One rank reads both ranks' journals.
    prefilled: list[int] = []
    original_prefill = BatchDecoder._prefill

    def counting_prefill(self, rows, requests):
        prefilled.extend(request.key[0] for request in requests if request.key[1] == 0)
        original_prefill(self, rows, requests)

    monkeypatch.setattr(BatchDecoder, "_prefill", counting_prefill)
    target = load_target(str(tiny_target_dir), device="cpu")
    summary = regenerate(path, target, killed, max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH, progress=False)
    assert sorted(prefilled) == unfinished and summary.resumed_records == len(finished)
    assert (killed / regen_journal.OUTPUT_FILE).read_bytes() == one.read_bytes()
    assert not list(killed.glob(regen_journal.JOURNAL_GLOB))

    # Two ranks through the CLI: each resumes its own share.
    settings = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", str(BATCH), "--nproc", "2"]
    run = _cli(["regenerate", "--input", str(path), "--target", str(tiny_target_dir), "--out", str(two), *settings])
    assert run.returncode == 0, run.stdout + run.stderr
    assert (two / regen_journal.OUTPUT_FILE).read_bytes() == one.read_bytes()
    merged = json.loads((two / regen_journal.SETTINGS_FILE).read_text())["summary"]
    reference = json.loads((one.parent / regen_journal.SETTINGS_FILE).read_text())["summary"]
    assert merged["ranks"] == 2 and merged["resumed_records"] == len(finished)
    assert merged["records"] == reference["records"] and merged["dropped"] == reference["dropped"]
    assert not list(two.glob(regen_journal.JOURNAL_GLOB))
    assert "on 2 ranks" in run.stdout and run.stdout.count("regenerated ") == 1  # the first rank reports


def _data_step_rank(rank: int, world_size: int, store: str, overrides: list[str]) -> None:
    """One rank of `train --nproc 2`'s automatic data step (colocated): every rank holds the target."""
    from dflash_trainer.config import load_config
    from dflash_trainer.distributed.world import World
    from dflash_trainer.train.pipeline import ensure_train_data, load_config_target

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    config = load_config(None, overrides)
    target = load_config_target(config, device="cpu")
    world = World(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    ensure_train_data(config, target, world=world)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_recipes_data_step_regenerates_on_every_rank(inputs, tiny_target_dir, tmp_path):
    """Under `train --nproc 2` both ranks answer a share of the prompts, the first merges and tokenises, and the
    regenerated chats equal those of a one-process data step."""
    from dflash_trainer.config import load_config
    from dflash_trainer.train.pipeline import ensure_train_data, load_config_target

    path, _ = inputs

    def overrides(shards: Path) -> list[str]:
        return [
            f"target.name_or_path={tiny_target_dir}",
            "target.device=cpu",
            f"data.train_shards={shards}",
            "data.max_seq_len=64",
            f"prepare.source={path}",
            "prepare.regenerate=true",
            f"prepare.max_new_tokens={MAX_NEW_TOKENS}",
            f"prepare.regenerate_batch_size={BATCH}",
        ]

    config = load_config(None, overrides(tmp_path / "shards-one"))
    ensure_train_data(config, load_config_target(config, device="cpu"))
    args = (2, str(tmp_path / "store"), overrides(tmp_path / "shards-two"))
    mp.spawn(_data_step_rank, args=args, nprocs=2, join=True)
    chats = {name: tmp_path / f"shards-{name}-chat" for name in ("one", "two")}
    assert (chats["two"] / regen_journal.OUTPUT_FILE).read_bytes() == (
        chats["one"] / regen_journal.OUTPUT_FILE
    ).read_bytes()
    summary = json.loads((chats["two"] / regen_journal.SETTINGS_FILE).read_text())["summary"]
    assert summary["ranks"] == 2 and summary["responses"] > 0
    assert (tmp_path / "shards-two" / "manifest.json").is_file()
