"""dflash-trainer: online training of DFlash speculative-decoding drafters against a frozen target LLM."""

__version__ = "0.1.0"
