"""Rank roles, process groups and feature transport between ranks (torch.distributed only)."""
