"""`TaskSpec`: everything about a retrieval task besides its examples, as one frozen value.

A registered `RetrievalTask` carries it, training records it with the model (`to_record`), and
every reader of a model's tasks rebuilds it (`from_record`), so no setting is read back out of a
preprocessor list or an untyped dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING, QueryInput

# The keys a task's record holds, besides its name (the key it is recorded under) and `index`
# (its position in the training step, which is the model's, not the task's).
RECORD_KEYS = ("dataset", "prefix", "query_len", "truncation", "text_preprocessors")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task's name, the dataset its example files are named by, and how the model reads its queries."""

    name: str
    dataset: str          # file stem of its examples / negatives files; the task's name if not a KILT source
    prefix: str | None    # the query prefix name, or None
    query_len: int | None = None      # token ids per query (None: a plain seqio Task states none)
    truncation: str = KEEP_BEGINNING  # how a long query is cut (`query_inputs.TRUNCATIONS`)
    # The preprocessors that rewrite its query text before tokenisation: a model trained on it read
    # their output, not the text a user types.
    text_preprocessors: tuple[str, ...] = ()

    @property
    def negatives_name(self) -> str:
        """The name of its negatives files (`<negatives dir>/{negatives_name}-{split}.jsonl`). Negatives
        belong to the query text they were mined for: a task that reads its dataset's examples as
        written shares its dataset's file with every other such task (kilt_fever, demo_fever_noprefix
        and `t5r data negatives --tasks=fever` all name `fever-train.jsonl`); a task whose
        preprocessors rewrite the text has a file of its own name (docs/data.md, "File names")."""
        return self.name if self.text_preprocessors else self.dataset

    def query_input(self) -> QueryInput:
        """How the model reads this task's queries."""
        if self.query_len is None:
            raise ValueError(f"task {self.name!r} states no query length")
        return QueryInput(self.prefix, self.query_len, self.truncation)

    def to_record(self) -> dict[str, Any]:
        """The JSON a model records for this task under its name (`from_record` reads it back)."""
        record: dict[str, Any] = {"dataset": self.dataset, "prefix": self.prefix}
        if self.query_len is not None:
            record["query_len"] = self.query_len
        record["truncation"] = self.truncation
        if self.text_preprocessors:
            record["text_preprocessors"] = list(self.text_preprocessors)
        return record

    @classmethod
    def from_record(cls, name: str, record: Mapping[str, Any]) -> TaskSpec:
        """The spec a model recorded as `record` under `name`, in this version's form (`upgrade_records`
        brings an older model's to it)."""
        return cls(name, str(record["dataset"]), record["prefix"],
                   None if record.get("query_len") is None else int(record["query_len"]),
                   str(record["truncation"]), tuple(record.get("text_preprocessors", ())))


# The form of a task's record. Version 1: what training wrote before tasks had their own query
# lengths (`{"dataset", "prefix", "index"}`; the first runs not even those). Version 2: `to_record`'s,
# which training has written since model configs were versioned (`checkpoint.CONFIG_VERSION` 2).
# A record states no version of its own: a field in each would change every new model's config, and
# with it the model's fingerprint (`inference.fingerprint_of` hashes the config). Nor can the
# config's version stand for it: version-2 configs of models trained on synthetic batches
# (`RandomBatches`, before it recorded specs) hold version-1 records. A record's form tells its version.
TASK_RECORD_VERSION = 2
# What every version-2 record a model holds has: training records each task's length.
_VERSION_2_KEYS = frozenset({"dataset", "prefix", "query_len", "truncation"})


def record_version(record: Mapping[str, Any]) -> int:
    """The version of a task's record, told by its form."""
    return 2 if _VERSION_2_KEYS <= record.keys() else 1


def _from_version_1(name: str, record: Mapping[str, Any], features: Mapping[str, Any]) -> dict[str, Any]:
    """A task recorded before tasks had their own query lengths reads the model's one `query_len`,
    cut at its end (`KEEP_BEGINNING`); one recorded without a dataset or a prefix reads its own
    name's examples, unprefixed."""
    shared = {"query_len": features["query_len"]} if "query_len" in features else {}
    return {"dataset": name, "prefix": None, "truncation": KEEP_BEGINNING, **shared, **record}


# Version v -> the step that brings a record of version v to version v + 1.
_UPGRADES = {1: _from_version_1}


def upgrade_records(features: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A model's recorded tasks (`features["tasks"]`) in the current version's form
    (TASK_RECORD_VERSION): the one place older model directories' task records are read; every
    reader of a model's tasks (`TaskSet`) and a resumed run (`build.upgraded_config`) go through it."""
    out = {}
    for name, record in (features.get("tasks") or {}).items():
        upgraded = dict(record)
        for version in range(record_version(record), TASK_RECORD_VERSION):
            upgraded = _UPGRADES[version](name, upgraded, features)
        out[name] = upgraded
    return out
