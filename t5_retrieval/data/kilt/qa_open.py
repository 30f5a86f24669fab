"""Answer-only open-domain QA files (mini-KILT `qa_open/`): questions whose relevance is "contains an answer".

Records are KILT-shaped (`id`, `input`, `output[].answer`) with no provenance; `meta.match` says how
an answer is found in a passage: "string" (the data's own convention: lower-case, accents
stripped, every punctuation character to a space, articles dropped, then a contiguous token-sequence
match over "title text") or "regex" (CuratedTREC: case-insensitive regular expression search over the
passage text). The relevance of a passage is decided by `data.answers.AnswerMatcher`, never by
stored passage ids, so the labels hold for any chunking of the KB.
"""

from __future__ import annotations

import dataclasses

from t5_retrieval.data.kilt.answers import AnswerMatcher
from t5_retrieval.data.kilt.examples import kilt_file
from t5_retrieval.data.records import DataError, Example, check_unique_id, read_jsonl, require
from t5_retrieval.data.text import normalize_query

MATCH_KINDS = ("string", "regex")


@dataclasses.dataclass(frozen=True)
class QATask:
    """One answer-only task split: examples (with `answers`, no gold pages) and how answers match."""

    name: str
    examples: list[Example]
    regex: bool

    def matcher(self, example: Example) -> AnswerMatcher:
        return AnswerMatcher(example.answers, self.regex)


def read_qa_task(input_dir: str, task: str, split: str) -> QATask:
    """Reads `{input_dir}/{task}-{split}-kilt.jsonl`; every line must have answers and one match kind."""
    path = kilt_file(input_dir, task, split)
    examples: list[Example] = []
    kinds: set[str] = set()
    line_of_id: dict[str, int] = {}
    for line_no, row in read_jsonl(path):
        example_id = str(require(row, "id", path, line_no)).strip()  # stripped, as the KILT scorer does
        check_unique_id(path, line_no, example_id, line_of_id)
        query = require(row, "input", path, line_no)
        if not isinstance(query, str) or not normalize_query(query):
            raise DataError(f"{path}:{line_no}: field 'input' is empty or not a string (example {example_id!r})")
        answers = tuple(dict.fromkeys(str(o["answer"]) for o in require(row, "output", path, line_no)
                                      if isinstance(o, dict) and str(o.get("answer", "")).strip()))
        if not answers:
            raise DataError(f"{path}:{line_no}: example {example_id!r} has no output[].answer")
        kind = (row.get("meta") or {}).get("match", "string")
        if kind not in MATCH_KINDS:
            raise DataError(f"{path}:{line_no}: meta.match is {kind!r}, expected one of {MATCH_KINDS}")
        kinds.add(kind)
        examples.append(Example(id=example_id, task=task, query=query, gold_pages=(), answers=answers))
    if not examples:
        raise DataError(f"{path}: no examples")
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes answer match kinds {sorted(kinds)}; one kind per task file")
    return QATask(task, examples, regex=kinds == {"regex"})
