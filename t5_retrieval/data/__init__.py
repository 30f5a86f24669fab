"""KILT data: knowledge base passages, task examples, negatives, seqio preprocessors and batching."""
