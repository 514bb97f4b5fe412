"""Every user error is one line and exit status 2; a bug keeps its traceback; settings are checked before any work.

Covers the CLI's error contract (cli.py), the command-line forms the README shows, target-name typos, mask tokens
(stop/pad tokens, GGUF filler rows), wrong-target evaluation, prepare faults (tokenizer errors, a full disk), and
the order of the main job (drafter settings checked right after the target loads, before any data work).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.data.prepare import PrepareError, prepare
from dflash_trainer.data.shards import ShardError, ShardWriter, check_shards_tokenizer, tokenizer_fingerprint
from dflash_trainer.errors import CorruptFileError, StorageError, UserError
from dflash_trainer.export import export_drafter
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.targets.loader import (
    MaskTokenError,
    TargetLoadError,
    check_mask_token_id,
    find_spare_mask_token_id,
    load_target,
)
from dflash_trainer.train.pipeline import run_training
from model_helpers import tiny_drafter_config
from train_helpers import MASK_TOKEN, VOCAB, save_tiny_target, write_counting_shards, write_recipe

ROOT = Path(__file__).resolve().parents[1]


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, pattern: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    # Progress bars of the libraries may come first; the error is one line, the last.
    lines = [line for line in err.splitlines() if line.strip()]
    assert sum("error" in line for line in lines) == 1 and re.search(pattern, lines[-1]), err


# ------------------------------------------------------------------------------------------- the command line


def readme_commands() -> list[list[str]]:
    """The arguments of every `dflash-trainer ...` and `torchrun ... -m dflash_trainer ...` command in README.md
    (code blocks and inline code), with the `[key=value ...]` placeholder filled in. Mentions of a bare
    subcommand name in prose (`dflash-trainer export` writes...) and `--help` are left out."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    code = "\n".join(fenced + inline)
    commands = []
    for match in re.finditer(r"(?:dflash-trainer|torchrun)[ \t][^#\n]*", code):
        words = shlex.split(match.group(0).replace("[key=value ...]", "optim.lr=1e-4 train.max_steps=2"))
        if words[0] == "torchrun":
            if "dflash_trainer" not in words:
                continue
            words = words[words.index("dflash_trainer") :]
        args = words[1:]
        if args and "--help" not in args and (len(args) > 1 or args[0] == "train"):
            commands.append(args)
    return commands


def test_the_readme_shows_commands_of_every_subcommand():
    commands = readme_commands()
    assert {words[0] for words in commands} >= {"train", "prepare", "regenerate", "eval", "export", "plot", "bench"}
    assert ["train", "RECIPE", "--nproc", "8", "optim.lr=1e-4", "train.max_steps=2"] in commands


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_command_line_in_the_readme_parses(argv):
    args = cli.parse_args(argv)
    assert args.command == argv[0]


@pytest.mark.parametrize(
    ("argv", "items", "options"),
    [
        (["train", "r.yaml", "--nproc", "8", "a.b=1", "c=2"], ["r.yaml", "a.b=1", "c=2"], {"nproc": 8}),
        (["train", "--nproc", "2", "r", "a=1"], ["r", "a=1"], {"nproc": 2}),
        (
            ["train", "r", "a=1", "--resume", "x", "b=2", "--profile-interval", "5"],
            ["r", "a=1", "b=2"],
            {"resume": "x"},
        ),
        (["bench", "r.yaml", "--steps", "10", "a=1"], ["r.yaml", "a=1"], {"steps": 10}),
        (["bench", "a=1", "--warmup", "4"], ["a=1"], {"warmup": 4}),
    ],
)
def test_options_and_overrides_mix_in_any_order(argv, items, options):
    args = cli.parse_args(argv)
    assert args.items == items
    for key, value in options.items():
        assert getattr(args, key) == value


def test_a_bug_keeps_its_traceback_and_asks_for_a_report(monkeypatch, capsys):
    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "cmd_plot", broken)
    code, err = run_main(["plot", "somewhere"], capsys)
    assert code == 1
    assert "Traceback" in err and "KeyError: 'internal'" in err and "please report it" in err


def test_a_storage_error_escaping_a_writer_is_one_line(monkeypatch, capsys):
    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out")

    monkeypatch.setattr(cli, "cmd_plot", full)
    code, err = run_main(["plot", "somewhere"], capsys)
    assert_one_line_error(code, err, r"^error: cannot write output to /data/out.*no space left on the device")


def test_yaml_syntax_error_is_one_line(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: [1e-3\n")
    code, err = run_main(["train", str(recipe), f"run_dir={tmp_path / 'run'}"], capsys)
    assert_one_line_error(code, err, r"^config error: recipe .*r\.yaml: YAML syntax error at line 3")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("ablation", "pattern"),
    [("bad", r"--ablation 'bad': expected NAME:key=value"), ("x:drafter.nope=1", r"drafter\.nope: unknown key")],
)
def test_a_bad_bench_ablation_is_one_line_before_any_phase_runs(ablation, pattern, capsys):
    code = cli.main(["bench", str(ROOT / "recipes/bench-smollm2.yaml"), "--ablation", ablation])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, pattern)
    assert "bench:" not in captured.out  # refused before the first phase


def test_regenerate_with_a_missing_prompt_file_fails_before_loading_the_target(tmp_path, capsys, monkeypatch):
    from dflash_trainer.train import pipeline

    monkeypatch.setattr(pipeline, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target first"))
    argv = ["regenerate", "--input", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out")]
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, r"none\.jsonl: prompt file not found")


def test_resume_to_a_bad_path_is_refused_and_leaves_no_run_dir(tmp_path, capsys):
    argv = ["train", "smollm2-135m", f"run_dir={tmp_path / 'run'}", "--resume", str(tmp_path / "nope")]
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, r"^error: checkpoint\.resume=.*nope: no such directory")
    assert not (tmp_path / "run").exists()


def test_importing_the_package_makes_offline_the_default_unless_set():
    code = "import dflash_trainer, os; print(os.environ['HF_HUB_OFFLINE'])"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"} | {"PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env | {"HF_HUB_OFFLINE": "0"}, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "0"


# ------------------------------------------------------------------------------------------- targets


def test_a_target_name_typo_is_not_tried_as_a_download(tmp_path, capsys):
    with pytest.raises(TargetLoadError, match=r"not in the Hugging Face hub cache; did you mean 'smollm2-135m'\?"):
        load_target("smollm2-135", device="cpu")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("{}\n")
    code, err = run_main(
        ["prepare", "--input", str(chats), "--target", "smollm2-135", "--out", str(tmp_path / "o")], capsys
    )
    assert_one_line_error(code, err, r"^error: target 'smollm2-135': .*did you mean 'smollm2-135m'")
    assert "internet" not in err


def test_mask_token_equal_to_a_stop_or_pad_token_is_refused(tiny_chat_tokenizer, tiny_qwen3):
    config = tiny_qwen3.config
    for token_id, role in ((2, "stop"), (0, "pad"), (1, "BOS")):
        with pytest.raises(MaskTokenError, match=rf"drafter\.mask_token_id={token_id} is the target's {role} token"):
            check_mask_token_id(token_id, tiny_chat_tokenizer, config, stop_token_ids=[2])
    with pytest.raises(MaskTokenError, match=r"outside the target's vocabulary \[0, 256\)"):
        check_mask_token_id(256, tiny_chat_tokenizer, config, stop_token_ids=[2])
    check_mask_token_id(5, tiny_chat_tokenizer, config, stop_token_ids=[2])


def filler_tokenizer(*, as_added_tokens: bool) -> PreTrainedTokenizerFast:
    """A tokenizer whose vocabulary ends in llama.cpp's `[PADnn]` filler rows (as a GGUF file lists them) and
    whose special tokens are all in use."""
    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c"]
    fillers = [f"[PAD{i}]" for i in range(len(words), 10)]
    vocab = {token: i for i, token in enumerate(words if as_added_tokens else words + fillers)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if as_added_tokens:
        tokenizer.add_tokens(fillers)
    tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    assert len(tokenizer) == 10
    return tokenizer


@pytest.mark.parametrize("as_added_tokens", [False, True], ids=["vocabulary", "added-tokens"])
def test_gguf_filler_rows_count_as_spare_for_the_mask_token(as_added_tokens):
    config = Qwen3Config(vocab_size=10, num_hidden_layers=6)
    assert find_spare_mask_token_id(filler_tokenizer(as_added_tokens=as_added_tokens), config, stop_token_ids=[2]) == 6


def tiny_run(tmp_path: Path, **sections) -> object:
    target = save_tiny_target(tmp_path / "target")
    recipe = write_recipe(tmp_path / "r.yaml", tmp_path / "run", target, tmp_path / "shards", **sections)
    return load_config(recipe)


@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        ({"mask_token_id": VOCAB - 2}, r"drafter\.mask_token_id=126 is the target's stop token '<eos>'"),
        ({"target_layer_ids": [1, 5]}, r"drafter: target_layer_ids \[1, 5\]: taps must lie in 0\.\.4; layer 5"),
        # The default spread over 6 layers repeats one for 4 features (1..L-3 holds 3 layers).
        (
            {"num_target_features": 4},
            r"drafter: target_layer_ids \[1, 2, 2, 3\] repeat a layer: the 6-layer target has 3 layers",
        ),
    ],
)
def test_drafter_settings_are_checked_before_any_data_work(tmp_path, drafter, message):
    config = tiny_run(tmp_path, drafter=drafter, prepare={"source": "gsm8k:train", "limit": 2})
    with pytest.raises(Exception, match=message) as caught:
        run_training(config)
    assert isinstance(caught.value, UserError)
    assert not (tmp_path / "shards-chat").exists() and not (tmp_path / "shards").exists()


def test_shards_of_another_tokenizer_are_refused_naming_both(tmp_path, tiny_chat_tokenizer):
    config = tiny_run(tmp_path)
    with ShardWriter(
        tmp_path / "shards", "other-model", VOCAB, tokenizer_fingerprint=tokenizer_fingerprint(tiny_chat_tokenizer)
    ) as writer:
        writer.add("s", [1, 2, 3], [0, 1, 1])
    with pytest.raises(
        ShardError, match=r"tokenised with 'other-model', whose vocabulary differs from the target 'target'"
    ):
        run_training(config)
    check_shards_tokenizer(tmp_path / "shards", tiny_chat_tokenizer, "anything")  # the same vocabulary passes


def test_eval_of_a_drafter_of_another_target_is_refused_before_decoding(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")  # hidden 64, 6 layers, vocab 128
    export_drafter(DFlashDrafter(tiny_drafter_config(vocab_size=VOCAB, mask_token_id=MASK_TOKEN)), tmp_path / "d")
    argv = ["eval", "--drafter", str(tmp_path / "d"), "--target", str(target), "--datasets", "gsm8k"]
    code, err = run_main([*argv, "--num-prompts", "1"], capsys)
    assert_one_line_error(
        code, err, r"^error: drafter .* does not fit target 'target': hidden size 32 \(drafter\) vs 64"
    )


def test_eval_uses_the_checkpoints_target_cache_dir(tmp_path, monkeypatch):
    from dflash_trainer.train import pipeline

    seen = {}

    def fake_load_target(name, **kwargs):
        seen.update(kwargs, name=name)
        raise TargetLoadError("stop here")

    run = tmp_path / "ckpt"
    run.mkdir()
    (run / "config.yaml").write_text(json.dumps({"target": {"name_or_path": "x.gguf", "cache_dir": "/cache"}}))
    monkeypatch.setattr(pipeline, "load_drafter_any", lambda path: (None, run))
    monkeypatch.setattr(pipeline, "load_target", fake_load_target)
    with pytest.raises(TargetLoadError):
        pipeline.eval_command(
            drafter_path=str(run),
            target=None,
            datasets=["gsm8k"],
            num_prompts=1,
            max_new_tokens=4,
            temperature=0.0,
            out_dir=None,
            dtype="auto",
        )
    assert seen["name"] == "x.gguf" and seen["cache_dir"] == "/cache"


# ------------------------------------------------------------------------------------------- prepare


def write_chats(path: Path, contents: list[str]) -> Path:
    records = [
        {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": c}]} for c in contents
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_a_tokenizer_error_names_the_line_or_is_skipped(tmp_path, tiny_chat_tokenizer, monkeypatch):
    # The encoder fails on one text: the batched encode fails as a whole, each text is then encoded alone, and
    # only the record with that text is reported or skipped.
    real_call = type(tiny_chat_tokenizer).__call__

    def fragile(self, text, *args, **kwargs):
        texts = [text] if isinstance(text, str) else text
        if any("boom" in t for t in texts):
            raise RuntimeError("tokenizer exploded")
        return real_call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tiny_chat_tokenizer), "__call__", fragile)
    chats = write_chats(tmp_path / "chats.jsonl", ["w3 w4 w5", "boom", "w6 w7 w8"])
    with pytest.raises(PrepareError, match=r"chats\.jsonl:2: the tokenizer failed: RuntimeError: tokenizer exploded"):
        prepare([chats], tiny_chat_tokenizer, "tiny", tmp_path / "a")
    summary = prepare([chats], tiny_chat_tokenizer, "tiny", tmp_path / "b", on_error="skip")
    assert summary.samples == 2 and summary.skipped == {"tokenizer_error": 1}
    assert "first tokenizer_error: " in summary.format() and "chats.jsonl:2" in summary.format()


def test_a_full_disk_during_prepare_is_reported_and_cleaned_up(tmp_path, tiny_chat_tokenizer, monkeypatch):
    real_open = Path.open

    class FullFile:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            self.file.close()
            raise OSError(errno.ENOSPC, "No space left on device")  # the flush at close fails too

    def open_full(self, mode="r", *args, **kwargs):
        file = real_open(self, mode, *args, **kwargs)
        return FullFile(file) if self.name.startswith("shard-") else file

    monkeypatch.setattr(Path, "open", open_full)
    (tmp_path / "in").mkdir()
    chats = write_chats(tmp_path / "in" / "chats.jsonl", ["w3 w4"])
    out = tmp_path / "out"
    with pytest.raises(StorageError, match=r"cannot write token shards to .*no space left on the device"):
        prepare([chats], tiny_chat_tokenizer, "tiny", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no output, no temporary directory


def test_prepare_arguments_are_user_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("dflash_trainer.train.pipeline.load_target", lambda *a, **k: _TinyTarget())
    chats = write_chats(tmp_path / "chats.jsonl", ["w3"])
    argv = ["prepare", "--input", str(chats), "--out", str(tmp_path / "o"), "--max-seq-len", "0"]
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, r"^error: --max-seq-len must be >= 1, got 0")


class _TinyTarget:
    name = "tiny"

    @property
    def tokenizer(self):
        return None


def test_prepare_refuses_a_tokenizer_without_chat_template_up_front(tmp_path, tiny_chat_tokenizer):
    tokenizer = tiny_chat_tokenizer.__class__(tokenizer_object=tiny_chat_tokenizer.backend_tokenizer)
    chats = write_chats(tmp_path / "chats.jsonl", ["w3"])
    with pytest.raises(PrepareError, match="has no chat template"):
        prepare([chats], tokenizer, "tiny", tmp_path / "out", on_error="skip")


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["eval", "--drafter", "x", "--max-new-tokens", "0"], r"--max-new-tokens: must be >= 1, got 0"),
        (["eval", "--drafter", "x", "--num-prompts", "-3"], r"--num-prompts: must be >= 1, got -3"),
        (["eval", "--drafter", "x", "--temperature", "-1"], r"--temperature: must be a finite number >= 0"),
        (["regenerate", "--input", "a", "--out", "b", "--batch-size", "0"], r"--batch-size: must be >= 1"),
        (["regenerate", "--input", "a", "--out", "b", "--temperature", "nan"], r"--temperature: must be a finite"),
        (["bench", "--steps", "0"], r"--steps: must be >= 1, got 0"),
        (["bench", "--warmup", "-1"], r"--warmup: must be >= 0, got -1"),
        (["train", "--nproc", "-1"], r"--nproc: must be >= 0, got -1"),
    ],
)
def test_out_of_range_options_are_refused_before_any_work(argv, pattern, capsys):
    assert_one_line_error(cli.main(argv), capsys.readouterr().err, pattern)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_without_cuda_is_one_line_before_any_phase_runs(capsys):
    code = cli.main(["bench", str(ROOT / "recipes/bench-smollm2.yaml")])
    captured = capsys.readouterr()
    assert_one_line_error(code, captured.err, r"bench times GPU training steps .* no CUDA device")
    assert "bench:" not in captured.out


@pytest.mark.parametrize(
    ("device", "pattern"),
    [("gpu", r"target\.device 'gpu': not a device name"), ("cuda:64", r"target\.device 'cuda:64': this machine has")],
)
def test_a_device_this_machine_lacks_is_a_user_error(device, pattern):
    from dflash_trainer.devices import resolve_device

    with pytest.raises(UserError, match=pattern):
        resolve_device(device)


def test_eval_to_a_file_is_refused_before_loading_anything(tmp_path, capsys):
    existing = tmp_path / "report"
    existing.write_text("mine")
    code = cli.main(["eval", "--drafter", str(tmp_path / "no-such-run"), "--out", str(existing)])
    assert_one_line_error(code, capsys.readouterr().err, r"report: exists and is not a directory")
    assert existing.read_text() == "mine"


def test_a_target_whose_weights_do_not_cover_its_config_is_refused(tmp_path):
    """transformers would initialise the missing weights at random and only log a table."""
    target = save_tiny_target(tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] += 1
    config.pop("layer_types", None)
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetLoadError, match=r"weight\(s\) missing in its files for what config\.json describes"):
        load_target(str(target))


def test_a_target_whose_weights_differ_in_shape_from_its_config_is_refused(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] = 96
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetLoadError, match=r"cannot load model or tokenizer"):
        load_target(str(target))


def test_a_misspelt_evaluation_set_is_refused_before_training(tmp_path):
    config = tiny_run(tmp_path, eval={"at_end": True, "datasets": ["gsm8kk"]})
    with pytest.raises(UserError, match=r"unknown prompt set 'gsm8kk'"):
        run_training(config)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------- hardening, round 2


def test_a_plain_ctrl_c_names_the_signal(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt  # what Python raises for a Ctrl-C: no text

    monkeypatch.setattr(cli, "cmd_plot", interrupted)
    code, err = run_main(["plot", "somewhere"], capsys)
    assert code == 130
    assert err.strip() == "interrupted (SIGINT); run the same command again to resume"


def test_a_second_training_into_a_run_dir_in_use_is_refused(tmp_path, capsys, monkeypatch):
    """Two trainings into one run_dir mixed their checkpoints and both exited 0; the second is refused now, by the
    launcher too (before torchrun), and a lock outlives no holder."""
    from dflash_trainer import launch
    from dflash_trainer.distributed.world import World
    from dflash_trainer.train.run_lock import LOCK_NAME, RunDirInUseError, hold_run_dir

    config = tiny_run(tmp_path)
    run_dir = tmp_path / "run"
    with hold_run_dir(run_dir, World()):
        with pytest.raises(RunDirInUseError, match=rf"run_dir {re.escape(str(run_dir))} is in use by another training"):
            run_training(config)
        monkeypatch.setattr(launch, "run_torchrun", lambda *args: pytest.fail("torchrun started"))
        code, err = run_main(["train", str(tmp_path / "r.yaml"), "--nproc", "2", "target.device=cpu"], capsys)
        assert_one_line_error(code, err, rf"^error: run_dir .* is in use by another training \(pid {os.getpid()} on ")
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]
    with hold_run_dir(run_dir, World()):  # released when the holder left
        pass


def test_the_lock_of_a_killed_training_is_not_stale(tmp_path):
    from dflash_trainer.train.run_lock import RunDirInUseError, check_not_in_use

    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from dflash_trainer.distributed.world import World\n"
            "from dflash_trainer.train.run_lock import hold_run_dir\n"
            f"with hold_run_dir({str(run_dir)!r}, World()):\n"
            "    print('held', flush=True); time.sleep(600)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUseError, match=rf"pid {holder.pid} on "):
            check_not_in_use(run_dir)
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs
        holder.wait()
    check_not_in_use(run_dir)  # the kernel dropped the lock with the process


def test_a_refusal_after_start_up_leaves_no_run_dir(tmp_path):
    """The mask token is checked once the target has loaded, after the run directory was taken."""
    config = tiny_run(tmp_path, drafter={"mask_token_id": VOCAB - 2})
    with pytest.raises(MaskTokenError, match=r"stop token"):
        run_training(config)
    assert not (tmp_path / "run").exists()


def test_a_mask_token_that_text_produces_is_refused_with_its_text(tiny_chat_tokenizer, tiny_qwen3):
    with pytest.raises(MaskTokenError, match=r"mask_token_id=20 is the ordinary text token 'w11', which tokenising"):
        check_mask_token_id(20, tiny_chat_tokenizer, tiny_qwen3.config, stop_token_ids=[2])
    check_mask_token_id(5, tiny_chat_tokenizer, tiny_qwen3.config, stop_token_ids=[2])  # `<empty_output>`: special


def corrupt(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # an interrupted copy


def test_a_corrupt_target_weight_file_is_one_line_naming_it(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    corrupt(target / "model.safetensors")
    with pytest.raises(CorruptFileError, match=r"model\.safetensors: a weight file of target .* damaged or incomplete"):
        load_target(str(target), device="cpu")
    chats = write_chats(tmp_path / "chats.jsonl", ["w3"])
    code, err = run_main(
        ["prepare", "--input", str(chats), "--target", str(target), "--out", str(tmp_path / "o")], capsys
    )
    assert_one_line_error(code, err, rf"^error: {re.escape(str(target / 'model.safetensors'))}: a weight file")


def test_a_corrupt_export_is_one_line_naming_it_for_eval_and_init_from(tmp_path, capsys):
    target = save_tiny_target(tmp_path / "target")
    drafter = tiny_drafter_config(
        vocab_size=VOCAB, mask_token_id=MASK_TOKEN, hidden_size=64, head_dim=16, num_target_layers=6
    )
    export_drafter(DFlashDrafter(drafter), tmp_path / "d")
    corrupt(tmp_path / "d" / "model.safetensors")
    argv = ["eval", "--drafter", str(tmp_path / "d"), "--target", str(target), "--datasets", "gsm8k"]
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, r"d/model\.safetensors: the drafter's weight file is damaged or incomplete")
    # As drafter.init_from: refused right after the target loads, before any data work.
    config = tiny_run(tmp_path, drafter={"init_from": str(tmp_path / "d")}, prepare={"source": "gsm8k:train"})
    with pytest.raises(CorruptFileError, match=r"d/model\.safetensors"):
        run_training(config)
    assert not (tmp_path / "shards-chat").exists() and not (tmp_path / "run").exists()


def test_an_empty_evaluation_set_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch):
    from dflash_trainer.train import pipeline

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: pytest.fail("loaded the target first"))
    monkeypatch.setattr(pipeline, "load_drafter_any", lambda *a, **k: pytest.fail("loaded the drafter first"))
    code, err = run_main(["eval", "--drafter", str(tmp_path), "--datasets", str(empty)], capsys)
    assert_one_line_error(code, err, r"empty\.jsonl: holds no prompts \(an empty file\)")
    config = tiny_run(tmp_path, eval={"at_end": True, "datasets": [str(empty)]})
    with pytest.raises(UserError, match=r"empty\.jsonl: holds no prompts"):
        run_training(config)
    assert not (tmp_path / "run").exists()


def test_nproc_runs_its_start_up_checks_before_torchrun(tmp_path, capsys, monkeypatch):
    from dflash_trainer import launch

    monkeypatch.setattr(launch, "run_torchrun", lambda *args: pytest.fail("torchrun started"))
    tiny_run(tmp_path)
    argv = ["train", str(tmp_path / "r.yaml"), "--nproc", "2", "--resume", str(tmp_path / "nope")]
    code, err = run_main(argv, capsys)
    assert_one_line_error(code, err, r"^error: checkpoint\.resume=.*nope: no such directory")
    assert not (tmp_path / "run").exists()


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    from dflash_trainer.devices import check_local_ranks, local_rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(UserError, match=r"--nproc 4: this machine has 2 CUDA device\(s\) and each rank takes one"):
        check_local_ranks("auto", 4)
    check_local_ranks("auto", 2)
    check_local_ranks("cpu", 8)  # CPU ranks (gloo) need no GPU
    with pytest.raises(UserError, match=r"rank with LOCAL_RANK 3: this machine has 2 CUDA device\(s\)"):
        local_rank_device(3)


def test_a_shard_linked_outside_its_directory_is_refused(tmp_path):
    from dflash_trainer.data.shards import load_shards

    shards = tmp_path / "shards"
    with ShardWriter(shards, "tiny", VOCAB) as writer:
        writer.add("s", [1, 2, 3], [0, 1, 1])
    outside = tmp_path / "elsewhere.jsonl"
    (shards / "shard-00000.jsonl").rename(outside)
    (shards / "shard-00000.jsonl").symlink_to(outside)
    with pytest.raises(ShardError, match=r"shard-00000\.jsonl: is a symbolic link to .*elsewhere\.jsonl, outside"):
        load_shards(shards)
    inside = shards / "real.jsonl"
    outside.rename(inside)
    (shards / "shard-00000.jsonl").unlink()
    (shards / "shard-00000.jsonl").symlink_to(inside)
    assert len(load_shards(shards)) == 1  # a link within the directory is fine


def test_the_prompt_tool_exports_name_colon_split_and_refuses_in_one_line(tmp_path, capsys):
    from dflash_trainer.data import prompts

    prompts.main(["gsm8k:test", "--export", str(tmp_path / "test.jsonl")])
    assert len((tmp_path / "test.jsonl").read_text().splitlines()) == 200
    with pytest.raises(SystemExit) as exited:
        prompts.main(["gsm8kk:test", "--export", str(tmp_path / "x.jsonl")])
    assert exited.value.code == 2
    assert_one_line_error(2, capsys.readouterr().err, r"^error: unknown prompt set 'gsm8kk'")


def test_a_gguf_copy_reuses_the_conversion_and_a_known_file_is_not_hashed_again(tmp_path, monkeypatch):
    from dflash_trainer.targets import loader

    conversions, hashed = [], []
    real_hash = loader._sha256_of

    def convert(path: Path, out_dir: Path) -> None:
        conversions.append(path)
        out_dir.mkdir(parents=True)
        (out_dir / loader._CONVERSION_RECORD).write_text("{}")

    monkeypatch.setattr(loader, "_write_conversion", convert)
    monkeypatch.setattr(loader, "_sha256_of", lambda path: hashed.append(path) or real_hash(path))
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    cache = str(tmp_path / "cache")
    converted, _ = loader._model_source(str(first), cache_dir=cache)
    assert loader._model_source(str(first), cache_dir=cache)[0] == converted
    assert hashed == [first]  # the second load found the file by its identity
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(first.read_bytes())
    assert loader._model_source(str(copy), cache_dir=cache)[0] == converted
    assert conversions == [first] and hashed == [first, copy]
    copy.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)  # changed in place: another model
    assert loader._model_source(str(copy), cache_dir=cache)[0] != converted
    assert conversions == [first, copy]


def test_a_target_load_error_that_is_no_input_problem_is_not_called_one(tmp_path, monkeypatch):
    from dflash_trainer.targets import loader

    target = save_tiny_target(tmp_path / "target")

    def raising(error):
        def from_pretrained(*args, **kwargs):
            raise error

        return from_pretrained

    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", raising(torch.OutOfMemoryError("CUDA oom")))
    with pytest.raises(TargetLoadError, match=r"out of memory on cpu while loading it"):
        load_target(str(target), device="cpu")
    monkeypatch.setattr(loader.AutoModelForCausalLM, "from_pretrained", raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug") as caught:
        load_target(str(target), device="cpu")
    assert not isinstance(caught.value, UserError)  # a traceback and a bug report, not "your input"


def test_grad_clip_zero_or_null_is_off(tmp_path):
    from dflash_trainer.config import ConfigError
    from dflash_trainer.train.trainer import Trainer

    assert load_config(None, ["optim.grad_clip=0"]).optim.grad_clip == 0
    assert load_config(None, ["optim.grad_clip=null"]).optim.grad_clip is None
    with pytest.raises(ConfigError, match=r"optim\.grad_clip: must be >= 0 \(0 or null: off\)"):
        load_config(None, ["optim.grad_clip=-1"])
    # Off, the gradient the optimizer sees is the one backward left (its norm is the logged one), not a clipped one.
    norms = {}
    target, shards = save_tiny_target(tmp_path / "target"), write_counting_shards(tmp_path / "shards", num_samples=8)
    for clip in (0, 1e-3):
        recipe = write_recipe(
            tmp_path / f"{clip}.yaml", tmp_path / f"run-{clip}", target, shards, optim={"grad_clip": clip}
        )
        config = load_config(recipe, ["train.max_steps=1"])
        trainer = Trainer(config, log=lambda _: None)
        real_step = trainer.optimizer.step

        def step(*args, trainer=trainer, real_step=real_step, clip=clip, **kwargs):
            grads = [p.grad.flatten() for p in trainer.drafter.parameters() if p.grad is not None]
            norms[clip] = [float(torch.cat(grads).norm())]
            return real_step(*args, **kwargs)

        trainer.optimizer.step = step
        trainer.fit()
        norms[clip].append(float(trainer.last_grad_norm))  # the norm before any clipping
    seen, unclipped = norms[0]
    assert seen == pytest.approx(unclipped, rel=1e-5) and seen > 1e-2
    assert norms[1e-3][0] == pytest.approx(1e-3, rel=1e-3)


def test_a_saved_config_with_an_evaluation_source_still_rebuilds(tmp_path):
    """The held-out-source rule is for new runs: `eval` and `export` rebuild the config of an older run."""
    from dflash_trainer.config import ConfigError
    from dflash_trainer.train.pipeline import run_config_of

    (tmp_path / "config.yaml").write_text("prepare:\n  source: gsm8k\n")
    assert run_config_of(tmp_path).prepare.source == "gsm8k"
    with pytest.raises(ConfigError, match=r"prepare\.source: 'gsm8k' holds the 200 held-out"):
        load_config(tmp_path / "config.yaml")


def test_prepare_of_an_empty_file_says_it_is_empty(tmp_path, tiny_chat_tokenizer):
    empty = tmp_path / "chats.jsonl"
    empty.write_text("")
    with pytest.raises(PrepareError, match=r"chats\.jsonl: no records to prepare \(empty input\)"):
        prepare([empty], tiny_chat_tokenizer, "tiny", tmp_path / "out")


def test_a_diverged_run_is_a_user_error():
    from dflash_trainer.train.trainer import NonFiniteLossError

    assert issubclass(NonFiniteLossError, UserError)
