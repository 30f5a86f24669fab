"""The project's Task families, as data: KILT, mini-KILT and the demo, each dataset one row.

`retrieval_tasks.register_shipped` registers them the first time a Task or Mixture name is looked
up (`retrieval_tasks.resolve`, `registered_task`), so no caller imports anything for its side effect.

Each row makes its Tasks in three query-prefix variants (TACO ablations): `{family}_{dataset}` with
the dataset prefix ("FEVER <extra_id_1> ..."), `..._noprefix`, and `..._typed` with one of 5
task-type markers (QA, FC, SF, EL, DIAL). Each variant is a Mixture of all datasets
(`{family}{variant}`) and, for MT-DPR's leave-one-out zero-shot runs, of all but one
(`{family}{variant}_without_{dataset}`). The three variants of a dataset read its queries at the
same length, cut the same way. A new dataset is one row; a new family is its table and its entry in
`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING

TASK_TYPES = ("QA", "FC", "SF", "EL", "DIAL")
# TACO's maximum query lengths (its Table 5, T5 tokens) by task type.
PAPER_QUERY_LEN = {"QA": 32, "SF": 32, "FC": 64, "EL": 128, "DIAL": 256}
LEN = PAPER_QUERY_LEN


class Dataset(NamedTuple):
    """One dataset of a family: its Tasks' `TaskSpec` fields (`spec`), and what registering them adds:
    the task type (the `_typed` variant's prefix) and the declared split sizes (the Mixtures' rates)."""

    dataset: str     # file stem of the processed examples
    prefix: str      # TACO prefix name
    task_type: str   # one of TASK_TYPES
    num_train: int
    num_dev: int
    query_len: int   # token ids per query, special tokens included
    truncation: str = KEEP_BEGINNING  # "mention" for entity linking (query_inputs.py)

    def spec(self, family: str, variant: str) -> TaskSpec:
        """The spec of this dataset's Task `{family}_{dataset}{variant}`: its prefix the variant's
        (the dataset's, none, or its task type), its query length and truncation the dataset's."""
        return TaskSpec(f"{family}_{self.dataset}{variant}", self.dataset, VARIANTS[variant](self), self.query_len,
                        self.truncation)


# Each query-prefix variant: its Tasks' name suffix -> the prefix it gives a dataset's queries.
VARIANTS: dict[str, Callable[[Dataset], str | None]] = {
    "": lambda d: d.prefix, "_noprefix": lambda d: None, "_typed": lambda d: d.task_type}

# The 8 KILT datasets of TACO. Sizes: KILT train/dev files (Petroni et al. 2021, Table 1). Query
# lengths: TACO's Table 5, in T5 tokens (the family is trained with T5, as in the paper).
KILT = [
    Dataset("fever", "FEVER", "FC", 104_966, 10_444, LEN["FC"]),
    Dataset("aidayago2", "AIDA", "EL", 18_395, 4_784, LEN["EL"], "mention"),
    Dataset("trex", "TREX", "SF", 2_284_168, 5_000, LEN["SF"]),
    Dataset("structured_zeroshot", "ZSRE", "SF", 147_909, 3_724, LEN["SF"]),
    Dataset("nq", "NQ", "QA", 87_372, 2_837, LEN["QA"]),
    Dataset("hotpotqa", "HOPO", "QA", 88_869, 5_600, LEN["QA"]),
    Dataset("triviaqa", "TQA", "QA", 61_844, 5_359, LEN["QA"]),
    Dataset("wow", "WOW", "DIAL", 63_734, 3_054, LEN["DIAL"]),
]

# mini-KILT: 6 real KILT-style tasks over a 14.8k-page Wikipedia KB (sizes from its stats.json).
# Query lengths in WordPiece tokens (its rows fine-tune MiniLM): TACO's Table 5 length times the
# task's measured WordPiece/T5 token ratio, or the longest training query (with its prefix) where
# every query needs less (docs/data.md, "Query lengths"; `benchmarks/measure_query_lengths.py`).
MINI_KILT = [
    Dataset("fever", "FEVER", "FC", 1_045, 288, 32),
    Dataset("wow", "WOW", "DIAL", 647, 256, 237),
    Dataset("hotpotqa", "HOPO", "QA", 239, 74, 34),
    Dataset("trex", "TREX", "SF", 493, 184, 22),
    Dataset("entityquestions", "ZSRE", "SF", 3_279, 396, 25),
    Dataset("entity_linking", "AIDA", "EL", 3_021, 843, 109, "mention"),
]

# The built-in SYNTHETIC demo (`t5r data demo`): KILT-shaped tasks, 160 train / 40 dev each, with
# KILT's query lengths (TACO's Table 5).
DEMO = [d._replace(num_train=160, num_dev=40) for d in KILT]

FAMILIES: dict[str, list[Dataset]] = {"kilt": KILT, "mini_kilt": MINI_KILT, "demo": DEMO}


def task_names() -> frozenset[str]:
    """The name of every Task the families make, computed without seqio."""
    return frozenset(d.spec(family, variant).name for family, rows in FAMILIES.items() for d in rows
                     for variant in VARIANTS)


def mixture_names() -> frozenset[str]:
    """The name of every Mixture the families make, computed without seqio."""
    return frozenset(name for family, rows in FAMILIES.items() for variant in VARIANTS
                     for name in [f"{family}{variant}", *(f"{family}{variant}_without_{d.dataset}" for d in rows)])
