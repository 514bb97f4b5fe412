"""`drafter.init_layers_from_target`: drafter layers start as exact copies of the named target layers."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.drafter import DFlashDrafter
from dflash_trainer.model.target_init import copy_target_layers, resolve_layer_ids
from dflash_trainer.train.trainer import Trainer
from train_helpers import MASK_TOKEN, save_tiny_target, write_counting_shards, write_recipe


def _drafter_for(model, num_layers: int, **overrides) -> DFlashDrafter:
    config = DrafterModelConfig.from_target(
        model.config, num_layers=num_layers, block_size=4, mask_token_id=0, num_target_features=2, **overrides
    )
    return DFlashDrafter(config)


@pytest.mark.parametrize("target", ["tiny_qwen3", "tiny_llama"])
def test_copied_layers_equal_the_target_layers(target, request):
    model = request.getfixturevalue(target)
    drafter = _drafter_for(model, num_layers=2)
    layers = model.model.layers
    ids = resolve_layer_ids([0, -1], len(layers), 2)
    assert ids == [0, len(layers) - 1]
    copied = copy_target_layers(drafter, layers, ids)
    assert "mlp.down_proj.weight" in copied and "self_attn.q_proj.weight" in copied
    for drafter_layer, target_id in zip(drafter.layers, ids, strict=True):
        source = dict(layers[target_id].named_parameters())
        for name in copied:
            torch.testing.assert_close(dict(drafter_layer.named_parameters())[name], source[name], rtol=0, atol=0)
    # Llama-style targets have no per-head q/k norms: the drafter's stay at their neutral start.
    if target == "tiny_llama":
        assert "self_attn.q_norm.weight" not in copied
        assert torch.equal(
            drafter.layers[0].self_attn.q_norm.weight, torch.ones_like(drafter.layers[0].self_attn.q_norm.weight)
        )
    # What the target has no counterpart for is left alone.
    fresh = _drafter_for(model, num_layers=2)
    assert drafter.fc.weight.shape == fresh.fc.weight.shape


def test_bad_layer_ids_and_sizes_are_refused(tiny_qwen3):
    layers = tiny_qwen3.model.layers
    with pytest.raises(ValueError, match="one target layer per drafter layer"):
        resolve_layer_ids([0], len(layers), 2)
    with pytest.raises(ValueError, match="outside the target's"):
        resolve_layer_ids([0, len(layers)], len(layers), 2)
    narrow = _drafter_for(tiny_qwen3, num_layers=1, intermediate_size=8)
    with pytest.raises(ValueError, match="must keep the target's sizes"):
        copy_target_layers(narrow, layers, [0])
    # A layer that stores a projection otherwise (FP8 weights, fused gate/up) is refused, not half-copied.
    fused = copy.deepcopy(layers[0])
    del fused.mlp.gate_proj
    with pytest.raises(ValueError, match=r"has no mlp\.gate_proj\.weight"):
        copy_target_layers(_drafter_for(tiny_qwen3, num_layers=1), torch.nn.ModuleList([fused]), [0])


def test_trainer_starts_from_the_target_layers_and_config_checks_the_count(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards", num_samples=8)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        target,
        shards,
        drafter={
            "num_layers": 2,
            "block_size": 4,
            "mask_token_id": MASK_TOKEN,
            "num_target_features": 3,
            "init_layers_from_target": [-2, -1],
        },
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    target_layers = trainer.target.model.model.layers
    for drafter_layer, target_layer in zip(trainer.drafter.layers, target_layers[-2:], strict=True):
        torch.testing.assert_close(drafter_layer.mlp.up_proj.weight, target_layer.mlp.up_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(
            drafter_layer.self_attn.k_norm.weight, target_layer.self_attn.k_norm.weight, rtol=0, atol=0
        )
    with pytest.raises(ConfigError, match="one target layer id per drafter layer"):
        load_config(recipe, ["drafter.init_layers_from_target=[-1]"])
