"""A task's query as the model reads it: its prefix, its length, and how it is cut to that length.

Every path that turns query text into token ids goes through `query_ids`: the seqio Task's
tokenisation preprocessor (`retrieval_tasks.tokenize_queries`, so training), and `inference`
(`t5r eval`, `mine`, `serve`, `Searcher`, query-side fine-tuning). The SavedModel export repeats it
in TensorFlow ops (`export/preprocess.py`), checked id for id against it. A Task states its
`QueryInput`; a model directory records it per task (`features.tasks.<task>.query_len` and
`.truncation`) and inference reads it from there (`TaskSet.query_input`).

Truncation:

- "beginning": the first tokens are kept: `[start ids] prefix query... end id`, the formatted
  string tokenised as a whole (as `tokenize.tokenize` does).
- "mention" (entity linking): a window centred on `[START_ENT] mention [END_ENT]` is kept after the
  prefix, as BLINK's bi-encoder reads a mention in its context. The mention and both markers are
  never cut (a mention longer than the whole budget loses its end, never a marker); the rest of
  the budget is split between the left context (its end) and the right context (its beginning),
  half each, and a side too short for its half gives what it leaves to the other
  (`mention_window`). The query is tokenised in segments (prefix, left context, markers, mention,
  right context): WordPiece splits at the markers' brackets anyway, so the ids are the whole
  string's when nothing is cut. A query without both markers is cut as "beginning".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from t5_retrieval.data.text import END_ENT, START_ENT, format_query, normalize_query, query_prefix
from t5_retrieval.data.tokenizers.conventions import conventions_of
from t5_retrieval.data.tokenizers.tokenize import Vocabulary, encode_batch

KEEP_BEGINNING = "beginning"
MENTION_WINDOW = "mention"
TRUNCATIONS = (KEEP_BEGINNING, MENTION_WINDOW)


@dataclasses.dataclass(frozen=True)
class QueryInput:
    """How one task's query text becomes model input."""

    prefix: str | None          # the TACO query prefix name ("FEVER"), None for none
    length: int                 # token ids per query, start and end ids included
    truncation: str = KEEP_BEGINNING

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"query truncation {self.truncation!r}: expected one of {TRUNCATIONS}")


def mention_window(left: int, markers: int, mention: int, right: int, budget: int) -> tuple[int, int, int]:
    """(left context tokens kept, mention tokens kept, right context tokens kept) of a query whose left
    context, two markers together, mention and right context have these token counts, for a window
    of at most `budget` tokens that holds both markers."""
    if budget < markers:
        raise ValueError(f"a window of {budget} tokens cannot hold the entity markers ({markers} tokens); "
                         "give the task a longer query length")
    mention_kept = min(mention, budget - markers)
    rest = budget - markers - mention_kept
    left_kept = min(left, max(rest // 2, rest - right))
    return left_kept, mention_kept, min(right, rest - left_kept)


def split_mention(text: str) -> tuple[str, str, str] | None:
    """(left context, mention, right context) around the first `[START_ENT]` and the `[END_ENT]`
    after it; None when the text lacks either."""
    start = text.find(START_ENT)
    end = text.find(END_ENT, start + len(START_ENT)) if start >= 0 else -1
    if end < 0:
        return None
    return text[:start].strip(), text[start + len(START_ENT):end].strip(), text[end + len(END_ENT):].strip()


def query_ids(vocab: Vocabulary, texts: Sequence[str], query: QueryInput) -> list[list[int]]:
    """Each text's start ids, prefix and (cut) query: at most `query.length - 1` ids, the end id is
    the caller's to append (seqio's `append_eos_after_trim`, or `query_tokens`). One native
    tokeniser call for the whole batch."""
    start = list(conventions_of(vocab).start_ids)
    budget = query.length - len(start) - 1
    if budget < 1:
        raise ValueError(f"query length must be >= {len(start) + 2} (special tokens and one text token), "
                         f"got {query.length}")
    parts = [split_mention(normalize_query(t)) if query.truncation == MENTION_WINDOW else None for t in texts]
    strings = [query_prefix(query.prefix), START_ENT, END_ENT]
    for text, part in zip(texts, parts):
        strings += list(part) if part else [format_query(text, query.prefix)]
    encoded = encode_batch(vocab, strings)
    prefix, start_marker, end_marker = encoded[:3]
    pieces = iter(encoded[3:])
    out = []
    for part in parts:
        if part is None:
            out.append(start + next(pieces)[:budget])
            continue
        left, mention, right = next(pieces), next(pieces), next(pieces)
        kept = mention_window(len(left), len(start_marker) + len(end_marker), len(mention), len(right),
                              budget - len(prefix))
        out.append([*start, *prefix, *left[len(left) - kept[0]:], *start_marker, *mention[:kept[1]], *end_marker,
                    *right[:kept[2]]])
    return out


def query_tokens(vocab: Vocabulary, texts: Sequence[str], query: QueryInput) -> np.ndarray:
    """int32[len(texts), query.length]: `query_ids`, the end id, then padding (0)."""
    end = conventions_of(vocab).end_id
    out = np.zeros((len(texts), query.length), np.int32)
    for row, ids in zip(out, query_ids(vocab, texts, query)):
        row[: len(ids) + 1] = [*ids, end]
    return out
