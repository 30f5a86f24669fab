"""mini-KILT: 6 real KILT-style tasks over a 14.8k-page Wikipedia KB (sizes from its stats.json)."""

from t5_retrieval.tasks.common import Dataset, register_family

register_family("mini_kilt", [
    Dataset("fever", "FEVER", "FC", 1_045, 288),
    Dataset("wow", "WOW", "DIAL", 647, 256),
    Dataset("hotpotqa", "HOPO", "QA", 239, 74),
    Dataset("trex", "TREX", "SF", 493, 184),
    Dataset("entityquestions", "ZSRE", "SF", 3_279, 396),
    Dataset("entity_linking", "AIDA", "EL", 3_021, 843),
])
