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

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING

TASK_TYPES = ("QA", "FC", "SF", "EL", "DIAL")
# TACO's maximum query lengths (its Table 5, T5 tokens) by task type.
PAPER_QUERY_LEN = {"QA": 32, "SF": 32, "FC": 64, "EL": 128, "DIAL": 256}
LEN = PAPER_QUERY_LEN


def dataset_task(dataset: str, prefix: str, query_len: int, truncation: str = KEEP_BEGINNING) -> TaskSpec:
    """The spec a dataset's Tasks share, named by the dataset: its examples files, its TACO prefix
    name, its queries' length in token ids (special tokens included) and how a longer one is cut
    ("mention" for entity linking, query_inputs.py). `Dataset.spec` names each variant's Task."""
    return TaskSpec(dataset, dataset, prefix, query_len, truncation)


class Dataset(NamedTuple):
    """One dataset of a family: its Tasks' spec (`dataset_task`), and what registering them adds:
    the task type (the `_typed` variant's prefix) and the declared split sizes (the Mixtures' rates)."""

    task: TaskSpec
    task_type: str   # one of TASK_TYPES
    num_train: int
    num_dev: int

    def spec(self, family: str, variant: str) -> TaskSpec:
        """The spec of this dataset's Task `{family}_{dataset}{variant}`: its prefix the variant's
        (the dataset's, none, or its task type), its query length and truncation the dataset's."""
        return dataclasses.replace(self.task, name=f"{family}_{self.task.dataset}{variant}",
                                   prefix=VARIANTS[variant](self))


# Each query-prefix variant: its Tasks' name suffix -> the prefix it gives a dataset's queries.
VARIANTS: dict[str, Callable[[Dataset], str | None]] = {
    "": lambda d: d.task.prefix, "_noprefix": lambda d: None, "_typed": lambda d: d.task_type}

# The 8 KILT datasets of TACO. Sizes: KILT train/dev files (Petroni et al. 2021, Table 1). Query
# lengths: TACO's Table 5, in T5 tokens (the family is trained with T5, as in the paper).
KILT = [
    Dataset(dataset_task("fever", "FEVER", LEN["FC"]), "FC", 104_966, 10_444),
    Dataset(dataset_task("aidayago2", "AIDA", LEN["EL"], "mention"), "EL", 18_395, 4_784),
    Dataset(dataset_task("trex", "TREX", LEN["SF"]), "SF", 2_284_168, 5_000),
    Dataset(dataset_task("structured_zeroshot", "ZSRE", LEN["SF"]), "SF", 147_909, 3_724),
    Dataset(dataset_task("nq", "NQ", LEN["QA"]), "QA", 87_372, 2_837),
    Dataset(dataset_task("hotpotqa", "HOPO", LEN["QA"]), "QA", 88_869, 5_600),
    Dataset(dataset_task("triviaqa", "TQA", LEN["QA"]), "QA", 61_844, 5_359),
    Dataset(dataset_task("wow", "WOW", LEN["DIAL"]), "DIAL", 63_734, 3_054),
]

# mini-KILT: 6 real KILT-style tasks over a 14.8k-page Wikipedia KB (sizes from its stats.json).
# Query lengths in WordPiece tokens (its rows fine-tune MiniLM): TACO's Table 5 length times the
# task's measured WordPiece/T5 token ratio, or the longest training query (with its prefix) where
# every query needs less (docs/data.md, "Query lengths"; `benchmarks/measure_query_lengths.py`).
MINI_KILT = [
    Dataset(dataset_task("fever", "FEVER", 32), "FC", 1_045, 288),
    Dataset(dataset_task("wow", "WOW", 237), "DIAL", 647, 256),
    Dataset(dataset_task("hotpotqa", "HOPO", 34), "QA", 239, 74),
    Dataset(dataset_task("trex", "TREX", 22), "SF", 493, 184),
    Dataset(dataset_task("entityquestions", "ZSRE", 25), "SF", 3_279, 396),
    Dataset(dataset_task("entity_linking", "AIDA", 109, "mention"), "EL", 3_021, 843),
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
                     for name in [f"{family}{variant}", *(f"{family}{variant}_without_{d.task.dataset}" for d in rows)])
