"""Text normalisation shared by every path that turns KILT records into model inputs.

One place decides how a KILT input becomes a query string and how a passage becomes a passage
string, so that training, mining, evaluation and serving feed the model identical text.
"""

from __future__ import annotations

import re

# KILT marks segment boundaries (e.g. T-REx "subject [SEP] relation") with [SEP]; T5 has no [SEP],
# and the TACO reference feeds its end-of-sequence marker instead.
KILT_SEP = "[SEP]"
T5_EOS_TEXT = "</s>"
EXTRA_ID_1 = "<extra_id_1>"

_WHITESPACE = re.compile(r"\s+")


def normalize_query(text: str) -> str:
    """`[SEP]` -> `</s>`, newlines (dialogue turns) -> spaces, runs of whitespace collapsed."""
    text = text.replace(KILT_SEP, T5_EOS_TEXT)
    return _WHITESPACE.sub(" ", text).strip()


def query_prefix(name: str | None) -> str:
    """The TACO task prefix `"{NAME} <extra_id_1>"`; None or "" means no prefix."""
    return f"{name} {EXTRA_ID_1}" if name else ""


def format_query(text: str, prefix_name: str | None) -> str:
    """The query string the model sees: `"{NAME} <extra_id_1> {normalised query}"`."""
    query = normalize_query(text)
    prefix = query_prefix(prefix_name)
    return f"{prefix} {query}" if prefix else query


def format_passage(title: str, text: str) -> str:
    """The passage string the model sees: `"Title: {title} Text: {text}"` (no prefix)."""
    return f"Title: {_WHITESPACE.sub(' ', title).strip()} Text: {_WHITESPACE.sub(' ', text).strip()}"
