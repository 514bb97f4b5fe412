"""DFlash2 (z-lab / Inco AI, 2026-08): the DFlash block drafter plus a convolution inside the block and a path
selector over its candidates. `drafter.algorithm: dflash2`; everything not named here is DFlash's (DESIGN §2).

The forward, as the engines run it (vLLM `DFlash2Qwen3ForCausalLM` + `DFlash2Speculator`, SGLang's DFlash worker,
llama.cpp, z-lab's reference `DFlash2DraftModel`; all agree):

1. Drafter pass, unchanged from DFlash: context = RMSNorm(fc(taps)); block [x_a, MASK x (B-1)] at positions
   a..a+B-1; per layer, queries from the block, keys/values from [context ; block]; non-causal inside the block.
2. Convolution (`conv.py`): in every layer, around the attention and around the MLP, a grouped dynamic causal
   convolution of two taps over the block's slots (slot i mixes slots i and i-1; no tap across a block boundary).
   Its kernel is a learned per-channel base plus a per-slot correction predicted from the sublayer's normed input
   and shared by each group of 16 channels; one projection of that input gives the kernels of both sides (the
   input convolved before the sublayer, the output after it). The context is never convolved.
3. Candidates: the final norm and the target's LM head give each slot's logits; the selector keeps the top 16.
4. Selector (`selector.py`): score(p -> c) = logit(c) + <A[p] * (P h_i), C[c]> for a candidate c of slot i and the
   token p chosen at slot i-1; rank 256. The walk starts at the verified anchor (slot 0's token) and takes at each
   slot the best-scoring candidate from the previous choice: one chain of B-1 drafts, verified as DFlash's.
5. Block 8 in the published checkpoints (7 drafts per step); any block size works.

Not published, so our reading: the training objective (`loss.py`: DFlash's loss + a teacher-forced K-way CE of
the selector, with speculators' gold-token injection and SpecForge's warmup/ramp and stop-gradient as options)
and the initialisation (identity convolutions, zero successor codebook, as SpecForge: a new DFlash2 drafter drafts
exactly what a DFlash drafter of the same weights drafts). We train the codebooks as the free [V, r] tensors the
checkpoints hold (as speculators does). The published parameter counts hint otherwise: 16.5M for the convolutions
of a 5-layer Qwen3-4B drafter is exactly ours (10 x (2*2*2560 + 4*160*2560)), but 2.0M for the selector is 3 x 2560 x
256, not the 78M of two free [151936, 256] codebooks: the codebooks were probably rank-256 maps of the 2560-wide
token embeddings, materialised for the checkpoint. That reading is `drafter.dflash2.selector_codebooks: embedding`
(`selector.py`); the free codebooks stay the default until it is measured against them.

Modules: `config.py` (architecture keys), `conv.py`, `selector.py`, `drafter.py` (layer and drafter),
`loss.py` (the selector term and its metrics), `objective.py` (what the trainer calls), `export.py` (the z-lab
checkpoint keys). The trainer, data, masks, anchors, placements, decoding and evaluation are DFlash's and call
the drafter through `DFlashDrafter`'s interface (`forward`, `draft_tokens`).

The next block drafters are one package of this shape each, beside this one: DSpark (its anchor slot sampled, so
slot k predicts x_{a+k+1} and every slot is supervised, plus a low-rank Markov bias on the logits from the
previous token) would bring its label layout and its head; DSpine (adjacent positions' target states injected
into the block) would subclass the layer's key/value inputs as `DFlash2Layer` subclasses its sublayers. Each adds
a config subclass (chosen by `model.drafter.build_drafter`), a loss term (an objective like `objective.py`), and
its export keys.
"""

from .config import ARCHITECTURE, DFlash2ModelConfig
from .conv import GroupedDynamicCausalConv
from .drafter import DFlash2Drafter, DFlash2Layer
from .loss import SelectorMetrics, selector_loss, selector_weight_at
from .objective import SelectorObjective
from .selector import CandidateSelector

__all__ = [
    "ARCHITECTURE",
    "CandidateSelector",
    "DFlash2Drafter",
    "DFlash2Layer",
    "DFlash2ModelConfig",
    "GroupedDynamicCausalConv",
    "SelectorMetrics",
    "SelectorObjective",
    "selector_loss",
    "selector_weight_at",
]
