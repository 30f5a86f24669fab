"""The 8 KILT datasets of TACO. Sizes: KILT train/dev files (Petroni et al. 2021, Table 1). Query
lengths: TACO's Table 5, in T5 tokens (the family is trained with T5, as in the paper)."""

from t5_retrieval.tasks.common import PAPER_QUERY_LEN as LEN
from t5_retrieval.tasks.common import Dataset, register_family

register_family("kilt", [
    Dataset("fever", "FEVER", "FC", 104_966, 10_444, LEN["FC"]),
    Dataset("aidayago2", "AIDA", "EL", 18_395, 4_784, LEN["EL"], "mention"),
    Dataset("trex", "TREX", "SF", 2_284_168, 5_000, LEN["SF"]),
    Dataset("structured_zeroshot", "ZSRE", "SF", 147_909, 3_724, LEN["SF"]),
    Dataset("nq", "NQ", "QA", 87_372, 2_837, LEN["QA"]),
    Dataset("hotpotqa", "HOPO", "QA", 88_869, 5_600, LEN["QA"]),
    Dataset("triviaqa", "TQA", "QA", 61_844, 5_359, LEN["QA"]),
    Dataset("wow", "WOW", "DIAL", 63_734, 3_054, LEN["DIAL"]),
])
