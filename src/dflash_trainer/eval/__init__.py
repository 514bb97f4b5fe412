"""Speculative-decoding evaluation: tau, speedup, lossless check and reports (`runner`). The decoding loops
themselves live in `dflash_trainer.decoding`, shared with regeneration."""
