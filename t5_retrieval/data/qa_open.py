"""Answer-only open-domain QA files (mini-KILT `qa_open/`): questions whose relevance is "contains an answer".

Records are KILT-shaped (`id`, `input`, `output[].answer`) with no provenance; `meta.match` says how
an answer is found in a passage: "string" (the data's own convention: lower-case, accents
stripped, every punctuation character to a space, articles dropped, then a contiguous token-sequence
match over "title text") or "regex" (CuratedTREC: case-insensitive regular expression search over the passage text). The
relevance of a passage is decided by `AnswerMatcher`, never by stored passage ids, so the labels
hold for any chunking of the KB.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata

from t5_retrieval.data.kilt import kilt_file
from t5_retrieval.data.records import DataError, Example, read_jsonl, require
from t5_retrieval.data.text import normalize_query
from t5_retrieval.retrieval import metrics
from t5_retrieval.retrieval.passages import PassageLookup

MATCH_KINDS = ("string", "regex")
_ARTICLES = frozenset(("a", "an", "the"))


def answer_tokens(text: str) -> list[str]:
    """Normalised word tokens for answer matching (Unicode punctuation such as en dashes splits too)."""
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(" " if unicodedata.category(c).startswith("P") else c
                   for c in text if not unicodedata.combining(c))
    return [t for t in text.split() if t not in _ARTICLES]


@dataclasses.dataclass(frozen=True)
class AnswerMatcher:
    """Whether a passage text holds one of a question's answers (DPR convention or regex)."""

    answers: tuple[str, ...]
    regex: bool = False

    def __post_init__(self) -> None:
        if self.regex:
            object.__setattr__(self, "_patterns", [re.compile(a, re.IGNORECASE) for a in self.answers])
        else:
            object.__setattr__(self, "_needles", [t for t in map(answer_tokens, self.answers) if t])

    def __call__(self, text: str, tokens: list[str] | None = None) -> bool:
        """`tokens`: `answer_tokens(text)` if the caller has them (it is most of a match's cost)."""
        if self.regex:
            return any(p.search(text) for p in self._patterns)  # type: ignore[attr-defined]
        tokens = answer_tokens(text) if tokens is None else tokens
        return metrics.answer_in_tokens(tokens, self._needles)  # type: ignore[attr-defined]


class AnswerTexts:
    """What answers are matched against, per passage id: "title text" and its answer tokens, each
    computed once (a question set's top-k lists overlap heavily, and rounds repeat them)."""

    def __init__(self, passages: PassageLookup):
        self.passages = passages
        self._texts: dict[str, tuple[str, list[str]]] = {}

    def __getitem__(self, pid: str) -> tuple[str, list[str]]:
        if pid not in self._texts:
            passage = self.passages.get(pid)
            text = f"{passage.title} {passage.text}"
            self._texts[pid] = (text, answer_tokens(text))
        return self._texts[pid]

    def holds_answer(self, matcher: AnswerMatcher, pid: str) -> bool:
        return matcher(*self[pid])


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
    for line_no, row in read_jsonl(path):
        example_id = str(require(row, "id", path, line_no))
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
