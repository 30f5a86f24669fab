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
from typing import Any

from t5_retrieval.data.kilt.answers import AnswerMatcher
from t5_retrieval.data.kilt.examples import kilt_file
from t5_retrieval.data.records import (
    DataError,
    Example,
    check_text,
    check_unique_id,
    id_field,
    json_kind,
    read_jsonl,
    require,
    text_field,
)
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
        example_id = id_field(row, "id", path, line_no)  # stripped, as the KILT scorer does
        check_unique_id(path, line_no, example_id, line_of_id)
        query = text_field(row, "input", path, line_no)
        if not normalize_query(query):
            raise DataError(f"{path}:{line_no}: field 'input' is empty (example {example_id!r})")
        answers = _answers(require(row, "output", path, line_no), path, line_no)
        if not answers:
            raise DataError(f"{path}:{line_no}: example {example_id!r} has no output[].answer")
        meta = row.get("meta") or {}
        if not isinstance(meta, dict):
            raise DataError(f"{path}:{line_no}: field 'meta' must be an object (got {json_kind(meta)})")
        kind = meta.get("match", "string")
        if kind not in MATCH_KINDS:
            raise DataError(f"{path}:{line_no}: meta.match is {kind!r}, expected one of {MATCH_KINDS}")
        kinds.add(kind)
        examples.append(Example(id=example_id, task=task, query=query, gold_pages=(), answers=answers))
    if not examples:
        raise DataError(f"{path}: no examples")
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes answer match kinds {sorted(kinds)}; one kind per task file")
    return QATask(task, examples, regex=kinds == {"regex"})


def _answers(outputs: Any, path: str, line_no: int) -> tuple[str, ...]:
    """The distinct non-blank `output[].answer` strings. An answer is this file's label, so one that is
    not a string (null, a number) is an error rather than the text "None"."""
    if not isinstance(outputs, list):
        raise DataError(f"{path}:{line_no}: field 'output' must be a list (got {json_kind(outputs)})")
    found: list[str] = []
    for i, output in enumerate(outputs):
        if isinstance(output, dict) and "answer" in output:
            answer = check_text(output["answer"], f"output[{i}].answer", path, line_no)
            if answer.strip() and answer not in found:
                found.append(answer)
    return tuple(found)
