"""DFlash2 end to end: what the training side computes for a block equals what the decoding engine does with it.

One tiny target decodes a prompt with a DFlash2 drafter through the engine (`SpeculativeDecoder`: cached drafter
steps, the selector's walk, verification). Then the training path runs on the finished sequence as the trainer runs
it: the target's taps over the whole row (`FeatureCapture`), one block anchored at every engine step's block start
(`block_input_ids`, `block_labels`, `build_masks`, the drafter's training forward over all of them at once), the
base loss ranking the candidates (`dflash_loss(candidates_top_k=K)`) and the selector term with its metrics
(`SelectorObjective.add_term`, teacher-forced predecessors from the labels). Since the output is the target's own
greedy continuation, the labels are exactly the tokens the verifier compared the drafts with, so for every block:

- the drafter's hidden states are the engine's (to float32 rounding);
- the walk on the training hidden states drafts what the engine drafted (and departs from the per-slot argmax);
- the selector metric's leading run of teacher-forced correct choices is the engine's accepted drafts, and
  `selector_tau_prefix` over these blocks is the engine's tau over the same steps.

To have drafts accepted without training, the selector is set by hand to the target's most frequent successor of
each token in its output (a "learnt bigram"), read through a gate whose sign is fixed: the mask token's embedding
gets a large channel 0 and the gate is that channel of the drafter's final hidden state (the mask token never occurs
in the sequence, so the target's output is unchanged by it).
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from transformers import Qwen3ForCausalLM

from decoding_helpers import one_thread, seeded, tiny_qwen3_target  # noqa: F401 (one_thread: autouse fixture)
from dflash_trainer.decoding.plain import target_generate
from dflash_trainer.decoding.speculative import SpeculativeDecoder
from dflash_trainer.model.anchors import block_input_ids, block_labels, block_positions
from dflash_trainer.model.attention import build_masks
from dflash_trainer.model.config import DrafterModelConfig
from dflash_trainer.model.dflash2 import CandidateSelector, DFlash2Drafter, DFlash2ModelConfig, SelectorObjective
from dflash_trainer.model.loss import dflash_loss
from dflash_trainer.targets.capture import FeatureCapture

VOCAB, TOP_K = 64, 16
MASK = VOCAB - 1
NEW_TOKENS = 60


def bigram_drafter(target: Qwen3ForCausalLM, sequence: list[int], block_size: int) -> DFlash2Drafter:
    """A DFlash2 drafter (random convolutions) whose selector prefers, after token p, the token that followed p
    most often in `sequence`; rank = vocabulary, the gate = channel 0 of the hidden state (see the module docstring)."""
    base = DrafterModelConfig.from_target(
        target.config, num_layers=2, block_size=block_size, mask_token_id=MASK, num_target_features=3
    )
    config = DFlash2ModelConfig.extend(
        base, conv_kernel_size=2, conv_group_size=16, selector_rank=VOCAB, selector_top_k=TOP_K
    )
    successors: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for before, after in itertools.pairwise(sequence):
        successors[before][after] += 1

    def build() -> DFlash2Drafter:
        drafter = DFlash2Drafter(config).eval()
        with torch.no_grad():
            for name, parameter in drafter.named_parameters():
                if "conv" in name:  # away from the identity convolutions
                    parameter.add_(0.2 * torch.randn_like(parameter))
            selector = drafter.candidate_selector
            selector.hidden_projection.weight.zero_()
            selector.hidden_projection.weight[:, 0] = 1.0  # every gate entry is h_0 (> 0 on mask slots)
            selector.predecessor_codebook.copy_(torch.eye(VOCAB))
            selector.successor_codebook.zero_()
            for before, counts in successors.items():
                selector.successor_codebook[counts.most_common(1)[0][0], before] = 3.0
        return drafter

    return seeded(build, 1)


@pytest.mark.parametrize("block_size", [4, 16])
def test_training_metric_and_walk_equal_the_engine_block_by_block(block_size, monkeypatch):
    target = tiny_qwen3_target(0, VOCAB)
    gen = torch.Generator().manual_seed(0)
    torch.randint(0, VOCAB - 1, (8,), generator=gen)  # a prompt whose greedy output the bigram selector follows
    prompt = torch.randint(0, VOCAB - 1, (11,), generator=gen).tolist()
    reference = target_generate(target, torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, stop_token_ids=[])
    sequence = prompt + reference.output_ids
    assert MASK not in sequence
    drafter = bigram_drafter(target, sequence, block_size)
    with torch.no_grad():
        target.model.embed_tokens.weight[MASK, 0] = 8.0  # read by the drafter's mask slots only

    # The engine, recording each proposal's block positions, hidden states and drafts.
    proposals: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    hidden_of_call: list[tuple[int, torch.Tensor]] = []
    real_forward, real_walk = DFlash2Drafter.forward, CandidateSelector.walk

    def recording_forward(self, **kwargs):
        hidden = real_forward(self, **kwargs)
        hidden_of_call.append((int(kwargs["block_positions"][0, 0]), hidden[0].clone()))
        return hidden

    def recording_walk(self, hidden, logits, anchor_tokens):
        drafts = real_walk(self, hidden, logits, anchor_tokens)
        start, block_hidden = hidden_of_call[-1]
        proposals.append((start, block_hidden, drafts[0].clone()))
        return drafts

    monkeypatch.setattr(DFlash2Drafter, "forward", recording_forward)
    monkeypatch.setattr(CandidateSelector, "walk", recording_walk)
    result = SpeculativeDecoder(target, drafter, [prompt], max_new_tokens=NEW_TOKENS, stop_token_ids=[]).run()
    monkeypatch.undo()
    result = result.results[0]
    assert result.output_ids == reference.output_ids  # float32: lossless, so the labels are the verifier's tokens

    # Step i's block starts where the tokens committed so far end (the prefill commits the first new token).
    starts = [len(prompt)]
    for accepted in result.accepted_lengths:
        starts.append(starts[-1] + accepted)
    assert [p[0] for p in proposals[: len(result.accepted_lengths)]] == starts[:-1]
    length = len(sequence)
    # Blocks wholly inside the sequence (the last steps' blocks run past max_new_tokens, where the engine cuts).
    steps = [i for i in range(len(result.accepted_lengths)) if starts[i] + block_size <= length]
    engine_drafts = torch.stack([proposals[i][2] for i in steps])  # [N, B-1]
    engine_accepted = [result.accepted_lengths[i] - 1 for i in steps]
    assert max(engine_accepted) >= 2, engine_accepted  # the check covers accepted runs, not only misses

    # The training side, as the trainer runs it: all blocks in one row, one forward.
    ids = torch.tensor([sequence])
    anchors = torch.tensor([[starts[i] for i in steps]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    doc_ids = torch.zeros(1, length, dtype=torch.long)
    loss_mask = torch.zeros(1, length, dtype=torch.bool)
    loss_mask[0, len(prompt) :] = True
    features = FeatureCapture(target, drafter.config.target_layer_ids).capture(ids).features
    block_ids = block_input_ids(input_ids=ids, anchors=anchors, block_size=block_size, mask_token_id=MASK)
    masks = build_masks(
        anchors=anchors,
        anchor_keep=keep,
        doc_ids=doc_ids,
        block_size=block_size,
        variants=drafter.mask_variants,
        backend="sdpa",
    )
    with torch.no_grad():
        hidden = drafter(
            features=features,
            block_embeds=target.model.embed_tokens(block_ids),
            ctx_positions=torch.arange(length)[None],
            block_positions=block_positions(
                position_ids=torch.arange(length)[None], anchors=anchors, block_size=block_size
            ),
            masks=masks,
            backend="sdpa",
        )
    blocks = anchors.shape[1]
    hidden = hidden.view(1, blocks, block_size, -1)
    block_ids = block_ids.view(1, blocks, block_size)
    labels, valid = block_labels(
        input_ids=ids, loss_mask=loss_mask, doc_ids=doc_ids, anchors=anchors, anchor_keep=keep, block_size=block_size
    )
    head = target.lm_head.weight

    # 1. The same hidden states.
    for n, i in enumerate(steps):
        torch.testing.assert_close(hidden[0, n], proposals[i][1], rtol=1e-4, atol=1e-5)
    # 2. The same walk.
    slots = hidden[0, :, 1:]
    logits = slots @ head.T
    train_drafts = drafter.candidate_selector.walk(slots, logits, block_ids[0, :, 0])
    assert torch.equal(train_drafts, engine_drafts)
    assert not torch.equal(engine_drafts, logits.argmax(dim=-1))

    # 3. The metric's accepted prefix is the engine's, block by block and pooled.
    def objective() -> SelectorObjective:
        return SelectorObjective(
            block_size=block_size,
            gamma=7.0,
            chunk_blocks=4,
            weight=1.0,
            warmup_ratio=0.0,
            ramp_ratio=0.0,
            gold_injection=False,
            stop_gradient=False,
            device=torch.device("cpu"),
        )

    def add_term(term: SelectorObjective, part: slice) -> None:
        base = dflash_loss(
            hidden[:, part], head, labels[:, part], valid[:, part], gamma=7.0, chunk_blocks=4, candidates_top_k=TOP_K
        )
        term.add_term(
            base,
            selector=drafter.candidate_selector,
            hidden=hidden[:, part],
            lm_head_weight=head,
            lm_head_bias=None,
            block_ids=block_ids[:, part],
            labels=labels[:, part],
            valid=valid[:, part],
            step=0,
            total_steps=1,
        )

    def logged_prefix_tau(part: slice) -> float:
        # As the trainer reads it: the step's metrics into the window, then the log step's values.
        term = objective()
        add_term(term, part)
        term.end_step(torch.zeros(()))
        return term.log_values(None, 1)["selector_tau_prefix"]

    per_block = [round(logged_prefix_tau(slice(n, n + 1)) - 1) for n in range(blocks)]  # one block: 1 + accepted
    assert per_block == engine_accepted
    engine_tau = sum(result.accepted_lengths[i] for i in steps) / len(steps)
    assert logged_prefix_tau(slice(None)) == pytest.approx(engine_tau)
