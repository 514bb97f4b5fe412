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
from dflash_trainer.errors import StorageError, UserError
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
from train_helpers import MASK_TOKEN, VOCAB, save_tiny_target, write_recipe

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
