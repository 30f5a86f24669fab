"""Retrieval Tasks as seqio Tasks: the contract and helper, task names, materialised examples and mixing rates."""
