"""A KILT-style dataset family -> seqio Tasks in three query-prefix variants, and their Mixtures.

Variants (TACO ablations): `{family}_{dataset}` with the dataset prefix ("FEVER <extra_id_1> ..."),
`..._noprefix`, and `..._typed` with one of 5 task-type markers (QA, FC, SF, EL, DIAL). Each variant
is a Mixture of all datasets (`{family}{variant}`) and, for MT-DPR's leave-one-out zero-shot runs,
of all but one (`{family}{variant}_without_{dataset}`). The three variants of a dataset read its
queries at the same length, cut the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from t5_retrieval.data.tasks.retrieval_tasks import (
    TASK_TYPES,
    add_temperature_mixture,
    kilt_examples_source,
    register_retrieval_task,
)
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING

# TACO's maximum query lengths (its Table 5, T5 tokens) by task type.
PAPER_QUERY_LEN = {"QA": 32, "SF": 32, "FC": 64, "EL": 128, "DIAL": 256}
# Each query-prefix variant: its Tasks' name suffix -> the prefix it gives a dataset's queries.
VARIANTS: dict[str, Callable[[Dataset], str | None]] = {
    "": lambda d: d.prefix, "_noprefix": lambda d: None, "_typed": lambda d: d.task_type}


class Dataset(NamedTuple):
    """One dataset of a family: the row its three Tasks' specs are made from (`spec`)."""

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


def register_family(family: str, datasets: Sequence[Dataset]) -> None:
    """Registers each dataset's Task in every variant (`Dataset.spec`) over its KILT examples, and
    the variants' Mixtures."""
    for d in datasets:
        assert d.task_type in TASK_TYPES, d
    for variant in VARIANTS:
        names = []
        for d in datasets:
            spec = d.spec(family, variant)
            register_retrieval_task(spec, kilt_examples_source(d.dataset, d.num_train, d.num_dev))
            names.append(spec.name)
        add_temperature_mixture(f"{family}{variant}", names)
        for d, held_out in zip(datasets, names):
            add_temperature_mixture(f"{family}{variant}_without_{d.dataset}", [n for n in names if n != held_out])
