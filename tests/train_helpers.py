"""Builders for end-to-end training tests: a tiny random target saved as a HF directory, learnable shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

from decoding_helpers import TINY_TARGET_DIMS
from dflash_trainer.data.shards import ShardWriter
from dflash_trainer.train import checkpoint as ckpt

VOCAB = 128
MASK_TOKEN = VOCAB - 1


def save_tiny_target(out_dir: Path, *, hybrid: bool = False, seed: int = 0) -> Path:
    """A random 6-layer target with a word-level tokenizer, saved like a Hub checkpoint."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, **TINY_TARGET_DIMS)
    if hybrid:
        config = Qwen3_5TextConfig(
            **common,
            layer_types=["linear_attention", "full_attention"] * 3,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    with torch.no_grad():
        # Real LM heads produce logits of several units; the 0.02-std init gives near-uniform ones.
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(out_dir)
    vocab = {f"w{i}": i for i in range(VOCAB - 3)} | {"<pad>": VOCAB - 3, "<eos>": VOCAB - 2, "<mask>": MASK_TOKEN}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A template that renders any chat as words of the vocabulary, so prompt sets can be evaluated.
    template = (
        "{% for m in messages %}w1 {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}w2{% endif %}"
    )
    # `<mask>` is a special token: an ordinary word would be refused as the mask token (text produces it).
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        additional_special_tokens=["<mask>"],
        chat_template=template,
    ).save_pretrained(out_dir)
    return out_dir


def write_counting_shards(out_dir: Path, *, num_samples: int = 48, seed: int = 0) -> Path:
    """Prompts of random words, then a response cycling through four words from a random phase: a pattern the
    drafter can learn from the anchor token within a few dozen steps."""
    gen = torch.Generator().manual_seed(seed)
    with ShardWriter(out_dir, tokenizer_name="tiny", vocab_size=VOCAB, samples_per_shard=16) as writer:
        for i in range(num_samples):
            prompt_len = int(torch.randint(3, 8, (1,), generator=gen))
            response_len = int(torch.randint(16, 40, (1,), generator=gen))
            prompt = torch.randint(0, VOCAB - 3, (prompt_len,), generator=gen).tolist()
            phase = int(torch.randint(0, 4, (1,), generator=gen))
            response = [10 + (phase + k) % 4 for k in range(response_len)]
            writer.add(f"sample-{i}", prompt + response, [0] * prompt_len + [1] * response_len)
    return out_dir


def write_recipe(path: Path, run_dir: Path, target_dir: Path, shards: Path, **sections) -> Path:
    recipe = {
        "run_dir": str(run_dir),
        "target": {"name_or_path": str(target_dir), "device": "cpu"},
        "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": MASK_TOKEN, "num_target_features": 3},
        "data": {"train_shards": str(shards), "token_budget": 256, "max_seq_len": 64, "max_anchors": 8},
        "optim": {"lr": 3e-3, "warmup_ratio": 0.1},
        "train": {"epochs": 20},
        "checkpoint": {"every_steps": 1000},
        "metrics": {"log_every": 1, "tensorboard": False, "progress_bar": False, "plot_at_end": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            recipe.setdefault(section, {}).update(values)
        else:
            recipe[section] = values
    path.write_text(yaml.safe_dump(recipe))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The drafter weights of a run's latest checkpoint."""
    return load_file(str(ckpt.latest_checkpoint(run_dir) / "drafter.safetensors"))


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
