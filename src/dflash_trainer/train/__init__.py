"""Training: the trainer loop, optimiser and schedule, checkpoint/resume, and observability.

Observability modules (no training logic in them):
- `metrics`: JSONL + TensorBoard sinks, the one-line console summary, progress bar with ETA, throughput/MFU and
  peak-memory helpers.
- `profiler`: per-stage wall-time profiler (`DFLASH_PROFILE_INTERVAL`) and an optional torch.profiler window.
- `plot`: PNG curves from a run's `metrics.jsonl` (`dflash-trainer plot RUN_DIR`).
"""
