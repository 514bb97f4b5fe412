"""Speculative-decoding evaluation: the decoding loop (`speculative`) and tau, speedup, lossless check and
reports (`runner`). Import from the submodules; this package imports nothing so the loop stays light."""
