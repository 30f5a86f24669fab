"""A results page whose tables are printed from run records: `t5r results --page docs/RESULTS.md`.

A table on the page sits between two markers that name what it is and which records it comes from,
as paths relative to the page:

    <!-- records: main run_records/mini_kilt_task_lengths -->
    ...the table...
    <!-- /records -->

Kinds: `main` (the per-task table), `differences` (each method against its control), `overlap` (the
means without the dev queries that are training queries), `change` (each row against the same
rows under other inputs: `change NEW OLD`), `specialisation` (each multi-task run's medians and
Fig. 2 numbers, `specialisation`), `curve` (TACO against naive after each warm-up of the frozen
recipe, with both sides' specialisation), `best` (each task's best recipe row against zero-shot and
BM25), `bonferroni` (no directory: one sentence giving the number m of intervals the page's tables
print, which every table's Bonferroni column is corrected for) and `rows` (no directory: the names
`t5r results --rows` takes, from the row catalogue `t5_retrieval/results/rows.py`). Refreshing
rewrites every marked table from its records, so adding a record and refreshing is all a new run
needs; the prose around the tables is the author's. A page equal to its refresh shows exactly what
its records print (tests hold it so).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import textwrap
from collections.abc import Callable

from t5_retrieval.data.records import DataError, write_text_atomic
from t5_retrieval.results.best import best_count, best_table
from t5_retrieval.results.curve import curve_count, curve_table
from t5_retrieval.results.overlap import overlap_table, read_overlap
from t5_retrieval.results.records import read_records
from t5_retrieval.results.rows import CONTROLS, ROWS, TITLES
from t5_retrieval.results.significance import (
    bonferroni_sentence,
    differences_count,
    differences_table,
    inputs_count,
    inputs_table,
)
from t5_retrieval.results.specialisation import specialisation_table
from t5_retrieval.results.tables import markdown_table

# A marker is a whole line, so one quoted in the prose (`<!-- records: ... -->`) is left alone.
MARKED = re.compile(r"^(?P<start><!-- records: (?P<spec>[^>\n]*?) -->\n)(?P<table>.*?)^(?P<end><!-- /records -->)$", re.S | re.M)


@functools.cache
def _records(records_dir: str) -> dict:
    """A directory's records, read once per refresh (`refreshed` clears this)."""
    return read_records(records_dir)


def _overlap(m: int, records_dir: str) -> str:
    overlap = read_overlap(records_dir)
    if overlap is None:
        raise DataError(f"{records_dir}: no dev/train overlap file; `t5r results` writes it when it runs rows there")
    return overlap_table(_records(records_dir), TITLES, overlap)


def row_names() -> str:
    """The catalogue's row names as one paragraph, in the catalogue's order."""
    names = ", ".join(f"`{name}`" for name in ROWS)
    return textwrap.fill(f"Rows for `--rows`: {names}.", width=110, break_long_words=False,
                         break_on_hyphens=False) + "\n"


@dataclasses.dataclass(frozen=True)
class Kind:
    """A table kind: how many records directories it names, its table given the page's interval
    count m, and how many intervals it prints."""

    directories: int
    table: Callable[..., str]
    intervals: Callable[..., int] = lambda *dirs: 0


KINDS: dict[str, Kind] = {
    "main": Kind(1, lambda m, d: markdown_table(_records(d))),
    "differences": Kind(1, lambda m, d: differences_table(_records(d), TITLES, CONTROLS, m=m),
                        lambda d: differences_count(_records(d), CONTROLS)),
    "overlap": Kind(1, _overlap),
    "change": Kind(2, lambda m, new, old: inputs_table(_records(new), _records(old), TITLES, m=m),
                   lambda new, old: inputs_count(_records(new), _records(old), TITLES)),
    "bonferroni": Kind(0, lambda m: bonferroni_sentence(m)),
    "specialisation": Kind(1, lambda m, d: specialisation_table(_records(d))),
    "curve": Kind(1, lambda m, d: curve_table(_records(d), m), lambda d: curve_count(_records(d))),
    "rows": Kind(0, lambda m: row_names()),
    "best": Kind(1, lambda m, d: best_table(_records(d), TITLES, m), lambda d: best_count(_records(d))),
}


def _paths(spec: str, page_dir: str, where: str) -> tuple[Kind, list[str]]:
    """The kind a marker's `spec` ("KIND [DIR...]", directories relative to the page) names, and its directories."""
    kind, *dirs = spec.split()
    if kind not in KINDS:
        raise DataError(f"{where}: unknown table kind {kind!r}; known: {', '.join(KINDS)}")
    wanted = KINDS[kind].directories
    if len(dirs) != wanted:
        named = {0: "no records directory", 1: "one records directory"}.get(wanted, f"{wanted} records directories")
        raise DataError(f"{where}: a {kind!r} table names {named} (relative to the page), got {dirs}")
    paths = [os.path.join(page_dir, d) for d in dirs]
    for path in paths:
        if not os.path.isdir(path):
            raise DataError(f"{where}: no records directory {path}")
    return KINDS[kind], paths


def marked_table(spec: str, page_dir: str, where: str, m: int) -> str:
    """The table a marker's `spec` names, its Bonferroni column corrected for `m` intervals."""
    kind, paths = _paths(spec, page_dir, where)
    return kind.table(m, *paths)


def refreshed(page: str, page_path: str) -> str:
    """`page` (the text of `page_path`) with every marked table printed again from its records; the
    Bonferroni correction counts every interval of every table on the page."""
    page_dir = os.path.dirname(os.path.abspath(page_path))
    _records.cache_clear()
    markers = [(match, f"{page_path}:{page.count(chr(10), 0, match.start()) + 1}") for match in MARKED.finditer(page)]
    m = 0
    for match, where in markers:
        kind, paths = _paths(match["spec"], page_dir, where)
        m += kind.intervals(*paths)
    tables = iter(match["start"] + marked_table(match["spec"], page_dir, where, m) + match["end"]
                  for match, where in markers)
    new = MARKED.sub(lambda match: next(tables), page)
    _records.cache_clear()
    return new


def refresh_page(page_path: str) -> int:
    """Rewrites `page_path`'s marked tables from their records; returns how many there are."""
    with open(page_path, encoding="utf-8") as f:
        page = f.read()
    count = len(MARKED.findall(page))
    if not count:
        raise DataError(f"{page_path}: no `<!-- records: KIND DIR -->` markers; nothing to print")
    new = refreshed(page, page_path)
    write_text_atomic(page_path, new)
    return count
