"""mini-KILT: 6 real KILT-style tasks over a 14.8k-page Wikipedia KB (sizes from its stats.json).

Query lengths in WordPiece tokens (its rows fine-tune MiniLM): TACO's Table 5 length times the
task's measured WordPiece/T5 token ratio, or the longest training query (with its prefix) where
every query needs less (docs/data.md, "Query lengths"; `benchmarks/measure_query_lengths.py`).
"""

from t5_retrieval.tasks.common import Dataset, register_family

DATASETS = [
    Dataset("fever", "FEVER", "FC", 1_045, 288, 32),
    Dataset("wow", "WOW", "DIAL", 647, 256, 237),
    Dataset("hotpotqa", "HOPO", "QA", 239, 74, 34),
    Dataset("trex", "TREX", "SF", 493, 184, 22),
    Dataset("entityquestions", "ZSRE", "SF", 3_279, 396, 25),
    Dataset("entity_linking", "AIDA", "EL", 3_021, 843, 109, "mention"),
]
register_family("mini_kilt", DATASETS)
