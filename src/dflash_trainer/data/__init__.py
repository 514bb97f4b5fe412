"""Training data: token shards on disk, their validation, and the token-budget batch sampler."""
