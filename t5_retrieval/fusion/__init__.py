"""Multi-task retrieval by fusing single-task experts (DPR-MUF, Li et al. 2021) and BM25 hybrids."""
