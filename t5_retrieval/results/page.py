"""A results page whose tables are printed from run records: `t5r results --page docs/RESULTS.md`.

A table on the page sits between two markers that name what it is and which records it comes from,
as paths relative to the page:

    <!-- records: main run_records/mini_kilt_task_lengths -->
    ...the table...
    <!-- /records -->

Kinds: `main` (the per-task table), `differences` (each method against its control), `overlap` (the
means without the dev queries that are training queries) and `change` (each row against the same
rows under other inputs: `change NEW OLD`). Refreshing rewrites every marked table from its records,
so adding a record and refreshing is all a new run needs; the prose around the tables is the
author's. A page equal to its refresh shows exactly what its records print (tests hold it so).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from t5_retrieval.data.records import DataError, write_text_atomic
from t5_retrieval.results.overlap import overlap_table, read_overlap
from t5_retrieval.results.records import read_records
from t5_retrieval.results.rows import CONTROLS, TITLES
from t5_retrieval.results.significance import differences_table, inputs_table
from t5_retrieval.results.tables import markdown_table

# A marker is a whole line, so one quoted in the prose (`<!-- records: ... -->`) is left alone.
MARKED = re.compile(r"^(?P<start><!-- records: (?P<spec>[^>\n]*?) -->\n)(?P<table>.*?)^(?P<end><!-- /records -->)$", re.S | re.M)


def _overlap(records_dir: str) -> str:
    overlap = read_overlap(records_dir)
    if overlap is None:
        raise DataError(f"{records_dir}: no dev/train overlap file; `t5r results` writes it when it runs rows there")
    return overlap_table(read_records(records_dir), TITLES, overlap)


KINDS: dict[str, tuple[int, Callable[..., str]]] = {  # kind -> (how many records directories, its table)
    "main": (1, lambda d: markdown_table(read_records(d))),
    "differences": (1, lambda d: differences_table(read_records(d), TITLES, CONTROLS)),
    "overlap": (1, _overlap),
    "change": (2, lambda new, old: inputs_table(read_records(new), read_records(old), TITLES)),
}


def marked_table(spec: str, page_dir: str, where: str) -> str:
    """The table a marker's `spec` ("KIND DIR [DIR]", directories relative to the page) names."""
    kind, *dirs = spec.split()
    if kind not in KINDS:
        raise DataError(f"{where}: unknown table kind {kind!r}; known: {', '.join(KINDS)}")
    if len(dirs) != KINDS[kind][0]:
        wanted = "one records directory" if KINDS[kind][0] == 1 else f"{KINDS[kind][0]} records directories"
        raise DataError(f"{where}: a {kind!r} table names {wanted} (relative to the page), got {dirs}")
    paths = [os.path.join(page_dir, d) for d in dirs]
    for path in paths:
        if not os.path.isdir(path):
            raise DataError(f"{where}: no records directory {path}")
    return KINDS[kind][1](*paths)


def refreshed(page: str, page_path: str) -> str:
    """`page` (the text of `page_path`) with every marked table printed again from its records."""
    page_dir = os.path.dirname(os.path.abspath(page_path))

    def table(match: re.Match) -> str:
        line = page.count("\n", 0, match.start()) + 1
        return match["start"] + marked_table(match["spec"], page_dir, f"{page_path}:{line}") + match["end"]

    return MARKED.sub(table, page)


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
