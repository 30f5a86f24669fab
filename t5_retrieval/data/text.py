"""Text normalisation shared by every path that turns KILT records into model inputs.

One place decides how a KILT input becomes a query string and how a passage becomes a passage
string, so that training, mining, evaluation and serving feed the model identical text.
"""

from __future__ import annotations

import re

from t5_retrieval.errors import ConfigError

# KILT marks segment boundaries (e.g. T-REx "subject [SEP] relation") with [SEP]; T5 has no [SEP],
# and the TACO reference feeds its end-of-sequence marker instead.
KILT_SEP = "[SEP]"
T5_EOS_TEXT = "</s>"
EXTRA_ID_1 = "<extra_id_1>"
# KILT's entity-linking inputs mark the mention to link: "... [START_ENT] mention [END_ENT] ...".
START_ENT = "[START_ENT]"
END_ENT = "[END_ENT]"

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


# How a passage becomes model text. T5/TACO: "Title: {title} Text: {text}"; sentence-transformers
# models such as all-MiniLM-L6-v2 were trained on "{title}: {text}". Recorded with a checkpoint's
# features (`passage_template`), so every stage formats passages as training did.
PASSAGE_TEMPLATE = "Title: {title} Text: {text}"
PASSAGE_TEMPLATES = (PASSAGE_TEMPLATE, "{title}: {text}")


def format_passage(title: str, text: str, template: str = PASSAGE_TEMPLATE) -> str:
    """The passage string the model sees (no prefix), whitespace runs collapsed."""
    if template not in PASSAGE_TEMPLATES:
        raise ConfigError(f"passage template {template!r}: expected one of {PASSAGE_TEMPLATES}")
    return template.format(title=_WHITESPACE.sub(' ', title).strip(), text=_WHITESPACE.sub(' ', text).strip())
