"""Answer matching: does a passage hold one of a question's answers? The one place that decides.

Two normalisations, each the convention of the data it scores:

* `dpr_answer_tokens` (DPR's `has_answer`): lower-cased, accents stripped, ASCII punctuation to
  spaces. Used for KILT answer-in-passage recall@k (`t5r eval`) and MT-DPR's answer-checked
  confounders (`t5r mine` with `exclude_answers`), over the passage text.
* `qa_open_answer_tokens` (the answer-only QA files, `data/kilt/qa_open.py`): additionally every Unicode
  punctuation character splits and the articles a/an/the are dropped. Matched over "title text"
  by `AnswerMatcher`, or by regular expression for CuratedTREC.

Either way an answer is found when its token sequence occurs contiguously in the passage's tokens.
Answer-in-passage recall@k is then "the first passage holding an answer is within the top k"
(`recall_at_ks`), for every k at once.
"""

from __future__ import annotations

import dataclasses
import re
import string
import unicodedata
from collections.abc import Iterable, Sequence

from t5_retrieval.data.stores.passages import PassageLookup

_PUNCT_TO_SPACE = str.maketrans({c: " " for c in string.punctuation})
_ARTICLES = frozenset(("a", "an", "the"))


def dpr_answer_tokens(text: str) -> list[str]:
    """Lower-cased, accent-stripped, punctuation-free word tokens (DPR's has_answer normalisation)."""
    if not text.isascii():
        text = "".join(c for c in unicodedata.normalize("NFD", text) if not unicodedata.combining(c))
    return text.lower().translate(_PUNCT_TO_SPACE).split()


def qa_open_answer_tokens(text: str) -> list[str]:
    """Normalised word tokens of the answer-only QA files (Unicode punctuation such as en dashes
    splits too; articles are dropped)."""
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(" " if unicodedata.category(c).startswith("P") else c
                   for c in text if not unicodedata.combining(c))
    return [t for t in text.split() if t not in _ARTICLES]


def answer_in_tokens(tokens: Sequence[str], answers_tokens: Iterable[Sequence[str]]) -> bool:
    """True when some (normalised) answer occurs as a contiguous run of the (normalised) tokens."""
    for needle in answers_tokens:
        n = len(needle)
        if n and any(tokens[i:i + n] == needle for i in range(len(tokens) - n + 1) if tokens[i] == needle[0]):
            return True
    return False


def has_answer(text: str, answers: Iterable[str]) -> bool:
    """True when some answer's token sequence occurs contiguously in the text's tokens (DPR convention)."""
    return answer_in_tokens(dpr_answer_tokens(text), [dpr_answer_tokens(a) for a in answers])


def first_answer_rank(passage_tokens: Iterable[Sequence[str]], answers: Iterable[str]) -> int | None:
    """1-based rank of the first passage (given as `dpr_answer_tokens`) holding an answer, or None."""
    needles = [list(t) for t in (dpr_answer_tokens(a) for a in answers) if t]
    for rank, tokens in enumerate(passage_tokens, start=1):
        if answer_in_tokens(tokens, needles):
            return rank
    return None


def recall_at_ks(first_rank: int | None, ks: Sequence[int]) -> dict[str, float]:
    """One question's answer-in-passage recall@k for every k, from the rank of its first hit."""
    return {f"answer_recall@{k}": float(first_rank is not None and first_rank <= k) for k in ks}


@dataclasses.dataclass(frozen=True)
class AnswerMatcher:
    """Whether a passage text holds one of a question's answers (qa_open tokens, or regex)."""

    answers: tuple[str, ...]
    regex: bool = False

    def __post_init__(self) -> None:
        if self.regex:
            object.__setattr__(self, "_patterns", [re.compile(a, re.IGNORECASE) for a in self.answers])
        else:
            object.__setattr__(self, "_needles", [t for t in map(qa_open_answer_tokens, self.answers) if t])

    def __call__(self, text: str, tokens: list[str] | None = None) -> bool:
        """`tokens`: `qa_open_answer_tokens(text)` if the caller has them (most of a match's cost)."""
        if self.regex:
            return any(p.search(text) for p in self._patterns)  # type: ignore[attr-defined]
        tokens = qa_open_answer_tokens(text) if tokens is None else tokens
        return answer_in_tokens(tokens, self._needles)  # type: ignore[attr-defined]


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
            self._texts[pid] = (text, qa_open_answer_tokens(text))
        return self._texts[pid]

    def holds_answer(self, matcher: AnswerMatcher, pid: str) -> bool:
        return matcher(*self[pid])

    def first_answer_rank(self, matcher: AnswerMatcher, ranking: Sequence[str]) -> int | None:
        """1-based rank of the first passage id in `ranking` that holds an answer, or None."""
        return next((rank for rank, pid in enumerate(ranking, 1) if self.holds_answer(matcher, pid)), None)
