"""The built-in SYNTHETIC demo (`t5r data demo`): KILT-shaped tasks, 160 train / 40 dev each."""

from t5_retrieval.tasks.common import Dataset, register_family

register_family("demo", [
    Dataset("fever", "FEVER", "FC", 160, 40),
    Dataset("aidayago2", "AIDA", "EL", 160, 40),
    Dataset("trex", "TREX", "SF", 160, 40),
    Dataset("structured_zeroshot", "ZSRE", "SF", 160, 40),
    Dataset("nq", "NQ", "QA", 160, 40),
    Dataset("hotpotqa", "HOPO", "QA", 160, 40),
    Dataset("triviaqa", "TQA", "QA", 160, 40),
    Dataset("wow", "WOW", "DIAL", 160, 40),
])
