"""`dflash-trainer train` with no recipe: the GPU recipe where a CUDA device is present, the CPU one elsewhere,
and the first line of output says which."""

import pytest
import torch

from dflash_trainer import cli, launch


@pytest.mark.parametrize(
    ("cuda", "recipe", "first_words"),
    [
        (True, "smollm2-135m-gpu-general", "no recipe given and a CUDA device is present"),
        (False, "smollm2-135m", "no recipe given and no CUDA device"),
    ],
)
def test_train_without_a_recipe_follows_the_device(monkeypatch, capsys, cuda, recipe, first_words):
    started = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    commands = []
    monkeypatch.setattr(
        launch, "train_rank", lambda config, command=None: started.append(config) or commands.append(command) or 0
    )
    assert cli.main(["train", "train.epochs=2"]) == 0
    (config,) = started
    assert commands == ["dflash-trainer train train.epochs=2"]  # what the export's model card shows
    assert config.run_dir == f"runs/{recipe}"
    assert config.train.epochs == 2  # overrides still apply to the chosen recipe
    assert capsys.readouterr().out.splitlines()[0].startswith(first_words)


def test_a_named_recipe_is_never_replaced(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "train_rank", lambda config, command=None: started.append(config) or 0)
    assert cli.main(["train", "smollm2-135m"]) == 0
    assert started[0].run_dir == "runs/smollm2-135m"
    assert "no recipe given" not in capsys.readouterr().out
