"""The learning-rate schedules (train/optim.py): the cosine's and WSD's shapes step by step, the warmup they share,
and the trainer's scheduler following `optim.schedule` through a checkpoint resume (a function of the step alone)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflash_trainer.config import ConfigError, OptimConfig
from dflash_trainer.train.optim import build_scheduler, lr_factor


def test_the_cosine_warms_up_then_falls_to_its_floor():
    factors = [lr_factor(s, total_steps=100, warmup_steps=10, min_ratio=0.1) for s in range(100)]
    assert factors[:3] == [0.1, 0.2, 0.3] and factors[9] == 1.0
    assert factors[10] == 1.0 and all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert factors[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(100, total_steps=100, warmup_steps=10, min_ratio=0.1) == pytest.approx(0.1)


def test_wsd_holds_the_peak_then_decays_linearly_over_its_last_steps():
    def wsd(step: int) -> float:
        return lr_factor(step, total_steps=100, warmup_steps=10, min_ratio=0.0, schedule="wsd", decay_steps=20)

    assert [wsd(s) for s in range(10)] == [(s + 1) / 10 for s in range(10)]  # the same warmup as the cosine
    assert all(wsd(s) == 1.0 for s in range(10, 80))  # the peak until the decay starts at step 80
    assert [wsd(s) for s in (80, 84, 89, 94, 99)] == pytest.approx([0.95, 0.75, 0.5, 0.25, 0.0])
    # The cosine at the same step is well below the peak: WSD spends more of the steps at it.
    assert lr_factor(60, total_steps=100, warmup_steps=10, min_ratio=0.0) < 0.5 < wsd(60)


def test_the_scheduler_follows_the_config_and_resumes_on_the_same_curve():
    config = OptimConfig(lr=1e-3, warmup_ratio=0.1, schedule="wsd", decay_ratio=0.25)
    config.validate()

    def run(steps: int, state: tuple[dict, dict] | None = None) -> tuple[list[float], tuple[dict, dict]]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.lr)
        scheduler = build_scheduler(optimizer, config, total_steps=40)
        if state is not None:  # as a checkpoint restores them: the optimizer (its groups' lr), then the scheduler
            optimizer.load_state_dict(state[0])
            scheduler.load_state_dict(state[1])
        lrs = []
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return lrs, (optimizer.state_dict(), scheduler.state_dict())

    whole, _ = run(40)
    assert whole[4:30] == [1e-3] * 26 and whole[30] == pytest.approx(0.9e-3) and whole[39] == pytest.approx(0.0)
    first, state = run(17)
    rest, _ = run(23, state)
    assert first + rest == pytest.approx(whole)


@pytest.mark.parametrize("bad", [{"schedule": "linear"}, {"decay_ratio": 0.0}, {"decay_ratio": 1.5}])
def test_a_bad_schedule_is_refused_by_name(bad):
    from dflash_trainer.config import load_config

    with pytest.raises(ConfigError, match="optim"):
        load_config("recipes/smollm2-135m.yaml", [f"optim.{key}={value}" for key, value in bad.items()])
