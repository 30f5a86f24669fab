"""The built-in SYNTHETIC demo (`t5r data demo`): KILT-shaped tasks, 160 train / 40 dev each, with
KILT's query lengths (TACO's Table 5)."""

from t5_retrieval.tasks.common import PAPER_QUERY_LEN as LEN
from t5_retrieval.tasks.common import Dataset, register_family

register_family("demo", [
    Dataset("fever", "FEVER", "FC", 160, 40, LEN["FC"]),
    Dataset("aidayago2", "AIDA", "EL", 160, 40, LEN["EL"], "mention"),
    Dataset("trex", "TREX", "SF", 160, 40, LEN["SF"]),
    Dataset("structured_zeroshot", "ZSRE", "SF", 160, 40, LEN["SF"]),
    Dataset("nq", "NQ", "QA", 160, 40, LEN["QA"]),
    Dataset("hotpotqa", "HOPO", "QA", 160, 40, LEN["QA"]),
    Dataset("triviaqa", "TQA", "QA", 160, 40, LEN["QA"]),
    Dataset("wow", "WOW", "DIAL", 160, 40, LEN["DIAL"]),
])
