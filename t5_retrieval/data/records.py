"""The records every stage exchanges (passages, examples, negatives) and their jsonl I/O.

Kept in one small module so that the data pipeline, training, mining and evaluation agree on one
shape, and so that a malformed line is always reported the same way: file, line and field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from t5_retrieval.artefact_io import open_replaced_on_success
from t5_retrieval.data.text import normalize_query
from t5_retrieval.errors import UserError


class DataError(UserError, ValueError):
    """Bad input data; the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class Passage:
    """A ~100-word chunk of one knowledge-base page."""

    id: str
    wikipedia_id: str
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Example:
    """One KILT query with its relevance labels.

    `gold_pages` holds one tuple of distinct page ids per evidence set (KILT `output` entry with a
    `provenance` key; an empty tuple for an empty list); R-precision and recall@k are defined over
    these sets, and an example with none scores 0 (as in the official scorer). `positive_passages` are the
    passages used as training positives (from provenance spans, or the gold page's best BM25
    passage when only the page is known).
    """

    id: str
    task: str
    query: str
    gold_pages: tuple[tuple[str, ...], ...]
    positive_passages: tuple[str, ...] = ()
    answers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any], path: str | os.PathLike[str] = "<examples>", line_no: int = 0) -> Example:
        """The example of one examples-file row; DataError naming `path:line_no` and the field for a
        missing field or a value of another type (a null query is refused, never read as "None")."""
        gold = require(row, "gold_pages", path, line_no)
        if not isinstance(gold, list):
            raise DataError(f"{path}:{line_no}: field 'gold_pages' must be a list of lists of page ids "
                            f"(got {json_kind(gold)})")
        return cls(
            id=id_field(row, "id", path, line_no), task=text_field(row, "task", path, line_no),
            query=text_field(row, "query", path, line_no),
            gold_pages=tuple(id_list(s, f"gold_pages[{i}]", path, line_no) for i, s in enumerate(gold)),
            positive_passages=id_list(row.get("positive_passages", []), "positive_passages", path, line_no),
            answers=text_list(row.get("answers", []), "answers", path, line_no),
        )


@dataclasses.dataclass(frozen=True)
class Negatives:
    """Hard negatives for one example, best (hardest) first; BM25 and model-mined share this form."""

    id: str
    negatives: tuple[str, ...]


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yields (line number, object) for each non-empty line; a bad line raises DataError with file:line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                "KILT files are UTF-8 json lines") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{line_no}: malformed json ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{line_no}: expected a json object, got {type(obj).__name__}")
            yield line_no, obj


def require(obj: dict[str, Any], field: str, path: str | os.PathLike[str], line_no: int) -> Any:
    """Returns obj[field] or raises DataError naming file:line and the missing field."""
    if field not in obj:
        raise DataError(f"{path}:{line_no}: missing field {field!r}")
    return obj[field]


# Input rules for ids and text (docs/data.md). An id becomes a line of page_map.tsv and
# passage_ids.txt, a column of a TREC run and a key joining negatives to examples: a JSON null or a
# list must never turn into the text "None" or "[...]", and a tab or line break would split a line.
_BREAKS = ("\t", "\n", "\r")


def json_kind(value: Any) -> str:
    """How a JSON value is named in an error: null, true, a number 3, a list, an object, an empty string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"a number {json.dumps(value)[:40]}"
    if isinstance(value, str):
        return "an empty string" if not value.strip() else f"the string {json.dumps(value)[:60]}"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def check_id(value: Any, field: str, path: str | os.PathLike[str], line_no: int) -> str:
    """An id as the KILT scorer compares ids, `str(value).strip()`, for a string or an integer (KILT
    files write some ids as numbers); DataError naming file:line and field for null, a boolean, a
    float, a list, an object, an empty id, or one holding a tab or a line break."""
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        key = str(value).strip()
        if not key:
            raise DataError(f"{path}:{line_no}: field {field!r} is empty; an id must be a non-empty string")
        if any(c in key for c in _BREAKS):
            raise DataError(f"{path}:{line_no}: field {field!r} is {json.dumps(key)[:80]}, which holds a tab or a "
                            "line break; ids are written one per line into tab-separated files, so none may hold one")
        return key
    raise DataError(f"{path}:{line_no}: field {field!r} must be a non-empty string (got {json_kind(value)})")


def id_field(obj: dict[str, Any], field: str, path: str | os.PathLike[str], line_no: int) -> str:
    """`check_id` of obj[field], which must be present."""
    return check_id(require(obj, field, path, line_no), field, path, line_no)


def check_text(value: Any, field: str, path: str | os.PathLike[str], line_no: int) -> str:
    """A text field: a string (maybe empty), never a null or number read as its spelling."""
    if not isinstance(value, str):
        raise DataError(f"{path}:{line_no}: field {field!r} must be a string (got {json_kind(value)})")
    return value


def text_field(obj: dict[str, Any], field: str, path: str | os.PathLike[str], line_no: int) -> str:
    """`check_text` of obj[field], which must be present."""
    return check_text(require(obj, field, path, line_no), field, path, line_no)


def id_list(value: Any, field: str, path: str | os.PathLike[str], line_no: int) -> tuple[str, ...]:
    """A JSON list of ids (`check_id` each)."""
    if not isinstance(value, list):
        raise DataError(f"{path}:{line_no}: field {field!r} must be a list of ids (got {json_kind(value)})")
    return tuple(check_id(v, f"{field}[{i}]", path, line_no) for i, v in enumerate(value))


def text_list(value: Any, field: str, path: str | os.PathLike[str], line_no: int) -> tuple[str, ...]:
    """A JSON list of strings (`check_text` each)."""
    if not isinstance(value, list):
        raise DataError(f"{path}:{line_no}: field {field!r} must be a list of strings (got {json_kind(value)})")
    return tuple(check_text(v, f"{field}[{i}]", path, line_no) for i, v in enumerate(value))


def write_jsonl_atomic(path: str | os.PathLike[str], rows: Iterable[dict[str, Any]]) -> int:
    """Writes rows to path via a temporary file and a rename, so a crash never leaves a half file."""
    count = 0
    with open_replaced_on_success(path) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Writes text like `write_jsonl_atomic`: whole or not at all."""
    with open_replaced_on_success(path) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, sort_keys: bool = False) -> None:
    """One JSON document, written like `write_jsonl_atomic`: whole or not at all."""
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=sort_keys))


def check_unique_id(path: str | os.PathLike[str], line_no: int, example_id: str, line_of_id: dict[str, int]) -> None:
    """Records and negatives are joined by example id: a repeated id would pair the wrong ones."""
    if example_id in line_of_id:
        raise DataError(f"{path}:{line_no}: example id {example_id!r} is also the id of line "
                        f"{line_of_id[example_id]}; ids must be unique within a file")
    line_of_id[example_id] = line_no


def read_examples(path: str | os.PathLike[str]) -> list[Example]:
    examples: list[Example] = []
    line_of_id: dict[str, int] = {}
    for line_no, row in read_jsonl(path):
        example = Example.from_json(row, path, line_no)
        if not normalize_query(example.query):  # as `t5r data tasks` refuses it; no encoder could embed it
            raise DataError(f"{path}:{line_no}: field 'query' is empty (example {example.id!r})")
        check_unique_id(path, line_no, example.id, line_of_id)
        examples.append(example)
    if not examples:
        stats = str(path).removesuffix(".jsonl") + ".stats.json"
        raise DataError(f"{path}: no examples" + (f"; `t5r data tasks` kept none of its input ({stats} says why)"
                                                  if os.path.exists(stats) else " (the file is empty)"))
    return examples


def write_negatives(path: str | os.PathLike[str], rows: Iterable[Negatives]) -> int:
    return write_jsonl_atomic(path, ({"id": r.id, "negatives": list(r.negatives)} for r in rows))


def read_negatives(path: str | os.PathLike[str]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    line_of_id: dict[str, int] = {}
    for line_no, row in read_jsonl(path):
        negatives = id_list(require(row, "negatives", path, line_no), "negatives", path, line_no)
        example_id = id_field(row, "id", path, line_no)
        check_unique_id(path, line_no, example_id, line_of_id)
        out[example_id] = negatives
    return out
