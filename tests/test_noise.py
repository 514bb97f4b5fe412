"""Feature noise: its distribution, identity cases and the annealing schedule."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trainer.model.noise import add_feature_noise, noise_std_at


@pytest.mark.parametrize("kind", ["uniform", "gaussian"])
def test_noise_has_the_requested_std(kind: str) -> None:
    features = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(0))
    noisy = add_feature_noise(features, kind=kind, std=0.3, generator=torch.Generator().manual_seed(1))
    noise = noisy - features
    assert noisy.shape == features.shape and noisy.dtype == features.dtype
    assert float(noise.std()) == pytest.approx(0.3, rel=0.01)
    assert abs(float(noise.mean())) < 0.003


def test_uniform_noise_is_bounded_by_its_half_width() -> None:
    features = torch.zeros(200_000)
    noise = add_feature_noise(features, kind="uniform", std=0.5, generator=torch.Generator().manual_seed(2))
    half_width = 0.5 * math.sqrt(3.0)
    assert float(noise.abs().max()) <= half_width
    assert float(noise.abs().max()) > 0.99 * half_width  # fills the interval, not a narrower one


def test_gaussian_noise_has_gaussian_tails() -> None:
    noise = add_feature_noise(
        torch.zeros(200_000), kind="gaussian", std=1.0, generator=torch.Generator().manual_seed(3)
    )
    # P(|z| > 3) = 0.27%: about 540 of 200K; a uniform of std 1 has none (bound sqrt(3)).
    assert 400 < int((noise.abs() > 3.0).sum()) < 700


def test_none_and_zero_std_are_identity() -> None:
    features = torch.randn(8, 4)
    assert add_feature_noise(features, kind="none", std=0.5) is features
    assert add_feature_noise(features, kind="uniform", std=0.0) is features


def test_input_is_not_modified_and_generator_reproduces() -> None:
    features = torch.randn(16, 8)
    original = features.clone()
    first = add_feature_noise(features, kind="uniform", std=0.1, generator=torch.Generator().manual_seed(4))
    second = add_feature_noise(features, kind="uniform", std=0.1, generator=torch.Generator().manual_seed(4))
    assert torch.equal(features, original)
    assert torch.equal(first, second)
    assert not torch.equal(first, features)


def test_bfloat16_features_stay_bfloat16() -> None:
    features = torch.zeros(100_000, dtype=torch.bfloat16)
    noisy = add_feature_noise(features, kind="uniform", std=0.2, generator=torch.Generator().manual_seed(5))
    assert noisy.dtype == torch.bfloat16
    assert float(noisy.float().std()) == pytest.approx(0.2, rel=0.02)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kind"):
        add_feature_noise(torch.zeros(3), kind="salt", std=0.1)
    with pytest.raises(ValueError, match="std"):
        add_feature_noise(torch.zeros(3), kind="uniform", std=-0.1)
    with pytest.raises(ValueError, match="floating point"):
        add_feature_noise(torch.zeros(3, dtype=torch.int64), kind="gaussian", std=0.1)


def test_anneal_schedule() -> None:
    assert noise_std_at(0, 100, 0.2, 0.0) == 0.2
    assert noise_std_at(50, 100, 0.2, 0.0) == pytest.approx(0.1)
    assert noise_std_at(25, 100, 0.0, 0.4) == pytest.approx(0.1)
    assert noise_std_at(100, 100, 0.2, 0.05) == 0.05
    assert noise_std_at(250, 100, 0.2, 0.05) == 0.05  # held after the end
    assert noise_std_at(0, 0, 0.2, 0.05) == 0.05  # no schedule
