"""Prompt sources read from pip packages' data files: the evaluation sets and the training prompt sources."""
