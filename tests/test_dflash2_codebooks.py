"""DFlash2's `embedding` codebooks (model/dflash2/selector.py; their loss and gradients against the dense float64
reference are in test_dflash2.py): the walk from the maps against the walk from the stored codebooks, and exports
in the published free layout that draft what the trained drafter drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.config import ConfigError, load_config
from dflash_trainer.export import export_drafter, import_drafter, load_training_drafter
from dflash_trainer.model.dflash2 import CandidateSelector, DFlash2Drafter, DFlash2ModelConfig
from dflash_trainer.model.dflash2.selector import token_features
from dflash_trainer.model.drafter import build_drafter
from model_helpers import tiny_drafter_config
from test_dflash2 import DFLASH2_SIZES, loop_walk, reference_codebooks

MAPS = ("candidate_selector.predecessor_map", "candidate_selector.successor_map")


def embedding_selector(width=12, vocab=30, *, rank=6, top_k=8, dtype=torch.float64, seed=0):
    """An `embedding` selector of strong random weights, bound to a random embedding of rows of mixed scales."""
    torch.manual_seed(seed)
    selector = CandidateSelector(width, vocab, rank=rank, top_k=top_k, codebooks="embedding").to(dtype)
    with torch.no_grad():
        for parameter in selector.parameters():
            parameter.normal_(std=0.5)
    embedding = torch.randn(vocab, width, dtype=dtype) * torch.rand(vocab, 1, dtype=dtype).add(0.1)
    selector.bind_token_embedding(embedding)
    return selector, embedding


def test_token_features_are_unit_rms_rows():
    embedding = torch.randn(7, 16, dtype=torch.float64) * 5
    torch.testing.assert_close(token_features(embedding).pow(2).mean(-1), torch.ones(7, dtype=torch.float64))
    assert token_features(embedding.bfloat16()).dtype == torch.float32


def test_the_walk_from_the_maps_equals_the_walk_from_the_stored_codebooks():
    selector, embedding = embedding_selector(16, 40, rank=8, top_k=5)
    with torch.no_grad():  # the maps move after binding (as in training): the stored codebooks are stale now
        selector.successor_map.mul_(-1.5)
    hidden = torch.randn(4, 7, 16, dtype=torch.float64)
    logits = torch.randn(4, 7, 40, dtype=torch.float64)
    anchor = torch.tensor([0, 5, 9, 39])
    from_maps = selector.walk(hidden, logits, anchor)
    free = CandidateSelector(16, 40, rank=8, top_k=5).double()  # the engines' view: codebooks of the live maps
    with torch.no_grad():
        free.hidden_projection.weight.copy_(selector.hidden_projection.weight)
        before, after = reference_codebooks(selector, embedding)
        free.predecessor_codebook.copy_(before)
        free.successor_codebook.copy_(after)
    assert torch.equal(from_maps, loop_walk(free, hidden, logits, anchor))
    # The state dict refreshes the stored codebooks from the maps; a selector loaded without the embedding walks
    # with them.
    loaded = CandidateSelector(16, 40, rank=8, top_k=5, codebooks="embedding").double()
    loaded.load_state_dict(selector.state_dict())
    assert loaded.token_embedding is None
    assert torch.equal(loaded.walk(hidden, logits, anchor), from_maps)
    assert torch.equal(from_maps, loop_walk(loaded, hidden, logits, anchor))
    assert not torch.equal(from_maps, logits.argmax(dim=-1))  # the transitions matter here


def test_a_new_embedding_selector_walks_the_unary_argmax_and_state_dicts_follow_the_maps():
    selector = CandidateSelector(16, 40, rank=8, top_k=5, codebooks="embedding").double()
    embedding = torch.randn(40, 16, dtype=torch.float64)
    selector.bind_token_embedding(embedding)
    hidden, logits = torch.randn(3, 6, 16, dtype=torch.float64), torch.randn(3, 6, 40, dtype=torch.float64)
    assert torch.equal(selector.walk(hidden, logits, torch.tensor([1, 2, 3])), logits.argmax(dim=-1))
    # About the free codebooks' initial scale (rows of std 0.02).
    assert 0.01 < selector.codebooks()[0].std().item() < 0.04
    with torch.no_grad():
        selector.successor_map.normal_()
    state = selector.state_dict()
    expected = reference_codebooks(selector, embedding)
    torch.testing.assert_close(state["predecessor_codebook"], expected[0])
    torch.testing.assert_close(state["successor_codebook"], expected[1])


def test_the_selector_refuses_a_wrong_embedding_and_training_without_one():
    selector = CandidateSelector(16, 40, rank=8, top_k=5, codebooks="embedding")
    with pytest.raises(RuntimeError, match="bind_token_embedding"):
        selector.codebooks()
    with pytest.raises(ValueError, match=r"\[40, 16\]"):
        selector.bind_token_embedding(torch.zeros(40, 8))
    with pytest.raises(ValueError, match="free parameters"):
        CandidateSelector(16, 40, rank=8, top_k=5).bind_token_embedding(torch.zeros(40, 16))
    with pytest.raises(ValueError, match="codebooks"):
        CandidateSelector(16, 40, rank=8, top_k=5, codebooks="tied")


def test_the_export_holds_the_codebooks_in_the_published_layout_and_drafts_the_same(tmp_path):
    config = DFlash2ModelConfig.extend(
        tiny_drafter_config(block_size=5), **DFLASH2_SIZES, selector_codebooks="embedding"
    )
    torch.manual_seed(3)
    drafter = build_drafter(config).eval()
    assert isinstance(drafter, DFlash2Drafter)
    selector = drafter.candidate_selector
    rank, width = config.selector_rank, config.hidden_size
    assert selector.predecessor_map.shape == selector.successor_map.shape == (rank, width)
    assert not any(name.endswith("codebook") for name, _ in drafter.named_parameters())
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    embedding = torch.randn(config.vocab_size, width)
    selector.bind_token_embedding(embedding)

    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not set(MAPS) & set(weights)
    assert weights["candidate_selector.predecessor_codebook"].shape == (config.vocab_size, rank)
    data = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "selector_codebooks" not in json.dumps(data["dflash_config"])  # not a key the engines read
    loaded = import_drafter(tmp_path / "out")
    assert loaded.config.selector_codebooks == "free"
    expected = reference_codebooks(selector, embedding)
    torch.testing.assert_close(loaded.candidate_selector.predecessor_codebook, expected[0])
    torch.testing.assert_close(loaded.candidate_selector.successor_codebook, expected[1])

    hidden = torch.randn(3, config.block_size - 1, width)
    logits = hidden @ torch.randn(config.vocab_size, width).T
    anchor = torch.tensor([4, 7, 1])
    with torch.no_grad():
        assert torch.equal(loaded.draft_tokens(hidden, logits, anchor), drafter.draft_tokens(hidden, logits, anchor))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["placement.sharding=fsdp2"], "fsdp2"),
        (["drafter.init_from=/some/export"], "init_from"),
    ],
)
def test_embedding_codebooks_refuse_what_they_cannot_do(overrides, message):
    base = ["drafter.algorithm=dflash2", "drafter.dflash2.selector_codebooks=embedding"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, base + overrides)
    # A DFlash run ignores the dflash2 keys.
    load_config(None, ["drafter.algorithm=dflash", "drafter.dflash2.selector_codebooks=embedding", *overrides])


def test_a_training_checkpoint_of_embedding_codebooks_walks_without_the_target(tmp_path):
    """What `eval` and `export` of a training checkpoint get: the drafter without its embedding bound walks with the
    codebooks stored at the checkpoint, which are those of the maps it was saved with."""
    from dflash_trainer.train.trainer import Trainer
    from train_helpers import save_tiny_target, write_counting_shards, write_recipe

    target = save_tiny_target(tmp_path / "target")
    shards = write_counting_shards(tmp_path / "shards")
    drafter_keys = {
        "algorithm": "dflash2",
        "dflash2": {"conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8, "selector_codebooks": "embedding"},
        "num_layers": 1,
        "block_size": 4,
    }
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", target, shards, drafter=drafter_keys, train={"max_steps": 6}
    )
    trainer = Trainer(load_config(recipe), log=lambda _: None)
    summary = trainer.fit()
    selector = trainer.drafter.candidate_selector
    assert selector.successor_map.abs().sum() > 0  # the maps learned (the successor map starts at zero)
    loaded = load_training_drafter(summary.last_checkpoint, dtype=torch.float32)
    assert loaded.config.selector_codebooks == "embedding" and loaded.candidate_selector.token_embedding is None
    stored = loaded.candidate_selector
    expected = reference_codebooks(selector, trainer.embed.weight.detach().float())
    torch.testing.assert_close(stored.predecessor_codebook, expected[0])
    torch.testing.assert_close(stored.successor_codebook, expected[1])
    width, vocab = loaded.config.hidden_size, loaded.config.vocab_size
    hidden = torch.randn(5, 3, width)
    logits = hidden @ torch.randn(vocab, width).T
    anchor = torch.randint(0, vocab, (5,))
    with torch.no_grad():
        live = trainer.drafter.draft_tokens(hidden, logits, anchor)
        assert torch.equal(loaded.draft_tokens(hidden, logits, anchor), live)
        # The transition scores themselves (after a few steps they are too small to move the walk off the argmax).
        candidates = torch.topk(logits, loaded.config.selector_top_k, dim=-1).indices
        previous = torch.cat([anchor[:, None, None].expand(-1, 1, candidates.shape[-1]), candidates[:, :-1]], dim=1)
        scores = loaded.candidate_selector.transition_scores(hidden, previous, candidates)
        assert scores.abs().max() > 0
        torch.testing.assert_close(scores, selector.transition_scores(hidden, previous, candidates))
