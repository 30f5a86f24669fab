"""The 8 KILT datasets of TACO. Sizes: KILT train/dev files (Petroni et al. 2021, Table 1)."""

from t5_retrieval.tasks.common import Dataset, register_family

register_family("kilt", [
    Dataset("fever", "FEVER", "FC", 104_966, 10_444),
    Dataset("aidayago2", "AIDA", "EL", 18_395, 4_784),
    Dataset("trex", "TREX", "SF", 2_284_168, 5_000),
    Dataset("structured_zeroshot", "ZSRE", "SF", 147_909, 3_724),
    Dataset("nq", "NQ", "QA", 87_372, 2_837),
    Dataset("hotpotqa", "HOPO", "QA", 88_869, 5_600),
    Dataset("triviaqa", "TQA", "QA", 61_844, 5_359),
    Dataset("wow", "WOW", "DIAL", 63_734, 3_054),
])
