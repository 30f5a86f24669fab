"""KILT files: reading task files into examples, BM25 negatives, the data-directory stages,
downloads, the demo slice and the synthetic KILT-format data."""
