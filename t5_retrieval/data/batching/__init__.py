"""Training batches: one sub-batch per task per step (real data), and synthetic token batches for tests."""
