"""KILT task files -> `Example`s: query, gold pages per evidence set, positive passages, answers.

Gold labels are read as the official scorer (`kilt/eval_retrieval.py`) reads them, so that our
metrics are its metrics: an example id is `str(id).strip()` and a page id
`str(wikipedia_id).strip()`; every `output` entry that has a `provenance` key is one evidence set,
even an empty one (it can never be found, but it counts); an example none of whose outputs has
provenance is kept and scores 0. A line without `output` and an example id used twice in a file
(after stripping) are errors naming the file and the line(s): negatives are joined to examples by
id, so a repeated id would train with another example's negatives. An empty file is an error too: it
would evaluate as n=0 and look like a result.

Positives: where a provenance entry gives a paragraph span, the KB passage covering its first
paragraph; where only the page is known (or the span falls outside the KB's text), the gold page's
passage that BM25 ranks highest for the query, as DPR does. Gold pages missing from the KB stay in
`gold_pages` (evaluation must count them as misses) and are counted; `strict=True` makes them fatal.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from t5_retrieval.data.records import DataError, Example, check_id, check_unique_id, json_kind, read_jsonl, require
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.text import normalize_query

# Chooses the best passage of a page for a query: (query, candidate passage ids) -> passage id.
BestPassageFn = Callable[[str, Sequence[str]], str]


@dataclasses.dataclass
class ConversionStats:
    """What happened to every input line; written next to the examples and printed by the CLI."""

    read: int = 0
    kept: int = 0
    no_provenance: int = 0  # kept: evaluated, scoring 0; no training positive
    provenance_below_bleu: int = 0  # skipped: every evidence set fell below `min_bleu`
    missing_gold_pages: int = 0
    examples_with_missing_pages: int = 0
    examples_without_positive: int = 0
    positives_from_spans: int = 0
    positives_from_bm25: int = 0
    downsampled_to: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kilt_file(input_dir: str, task: str, split: str) -> str:
    """`{input_dir}/{task}-{split}-kilt.jsonl`; an unknown task lists the tasks present."""
    path = os.path.join(input_dir, f"{task}-{split}-kilt.jsonl")
    if not os.path.exists(path):
        known = sorted({os.path.basename(p).rsplit(f"-{split}-kilt.jsonl", 1)[0]
                        for p in glob.glob(os.path.join(input_dir, f"*-{split}-kilt.jsonl"))})
        raise DataError(f"unknown task {task!r}: no {path}; tasks with a {split} file in {input_dir}: "
                        f"{', '.join(known) or '(none)'}")
    return path


def _field(where: str, obj: Any, key: str, kind: type, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {key!r} must be {what} (got {json_kind(value)})")
    return value


def convert_task_file(path: str, task: str, store: PassageStore, best_passage: BestPassageFn, *,
                      min_bleu: float | None = None, max_examples: int | None = None, seed: int = 0,
                      strict: bool = False) -> tuple[list[Example], ConversionStats]:
    """Reads one KILT task file into examples (file order; downsampled to `max_examples` with `seed`).

    `min_bleu` (for training files: evaluation must see every gold page) drops provenance entries
    whose `bleu_score` is below it (MT-DPR uses 0.5); entries without a `bleu_score` field are
    kept. An evidence set all of whose entries are dropped is dropped, and an example left with no
    evidence set is skipped and counted. Examples without provenance are kept (see module doc).
    """
    stats = ConversionStats()
    by_page = store.passages_by_page()
    examples: list[Example] = []
    line_of_id: dict[str, int] = {}
    for line_no, row in read_jsonl(path):
        where = f"{path}:{line_no}"
        stats.read += 1
        # The official scorer strips ids: "x" and "x " are one example there, so they are here.
        example_id = check_id(require(row, "id", path, line_no), "id", path, line_no)
        check_unique_id(path, line_no, example_id, line_of_id)
        query = _field(where, row, "input", str, "a string")
        if not normalize_query(query):
            raise DataError(f"{where}: field 'input' is empty (example {example_id!r})")
        outputs = _field(where, row, "output", list, "a list")
        gold_sets: list[tuple[str, ...]] = []
        answers: list[str] = []
        spans: dict[str, tuple[int, int]] = {}
        below_bleu = False
        for i, output in enumerate(outputs):
            if not isinstance(output, dict):
                raise DataError(f"{where}: output[{i}] must be an object")
            answer = output.get("answer")
            if isinstance(answer, str) and answer.strip() and answer not in answers:
                answers.append(answer)
            if "provenance" not in output:
                continue
            provenance = _field(f"{where}: output[{i}]", output, "provenance", list, "a list")
            pages: list[str] = []
            for j, prov in enumerate(provenance):
                field = f"output[{i}].provenance[{j}]"
                page = check_id(_field(f"{where}: {field}", prov, "wikipedia_id", object, "an id"),
                                f"{field}.wikipedia_id", path, line_no)
                bleu = prov.get("bleu_score")
                if bleu is not None and (not isinstance(bleu, (int, float)) or isinstance(bleu, bool)):
                    raise DataError(f"{where}: field '{field}.bleu_score' must be a number (got {json_kind(bleu)})")
                if min_bleu is not None and bleu is not None and float(bleu) < min_bleu:
                    continue
                if page not in pages:
                    pages.append(page)
                start, end = prov.get("start_paragraph_id"), prov.get("end_paragraph_id")
                if isinstance(start, int) and page not in spans:
                    spans[page] = (start, end if isinstance(end, int) else start)
            if provenance and not pages:
                below_bleu = True
            elif tuple(pages) not in gold_sets:
                gold_sets.append(tuple(pages))
        if not gold_sets:
            if below_bleu:
                stats.provenance_below_bleu += 1
                continue
            stats.no_provenance += 1
        ordered_pages = list(dict.fromkeys(p for s in gold_sets for p in s))
        missing = [p for p in ordered_pages if p not in by_page]
        if missing:
            stats.missing_gold_pages += len(missing)
            stats.examples_with_missing_pages += 1
            if strict:
                raise DataError(f"{where}: gold page(s) {missing} of example {example_id!r} are not in the KB "
                                f"at {store.directory}")
        positives: list[str] = []
        for page in ordered_pages:
            candidates = by_page.get(page)
            if not candidates:
                continue
            chosen = _span_passage(store, candidates, spans.get(page))
            if chosen is not None:
                stats.positives_from_spans += 1
            else:
                chosen = candidates[0] if len(candidates) == 1 else best_passage(query, candidates)
                stats.positives_from_bm25 += 1
            if chosen not in positives:
                positives.append(chosen)
        if not positives:
            stats.examples_without_positive += 1
        examples.append(Example(id=example_id, task=task, query=query, gold_pages=tuple(gold_sets),
                                positive_passages=tuple(positives), answers=tuple(answers)))
    if not stats.read:
        raise DataError(f"{path}: no examples (the file is empty); a task file holds one json object per line")
    if max_examples is not None and len(examples) > max_examples:
        keep = np.sort(np.random.default_rng(seed).choice(len(examples), max_examples, replace=False))
        examples = [examples[i] for i in keep]
        stats.downsampled_to = max_examples
    stats.kept = len(examples)
    return examples, stats


def _span_passage(store: PassageStore, candidates: Sequence[str], span: tuple[int, int] | None) -> str | None:
    """The first passage of the page whose paragraph span overlaps the provenance span, if any."""
    if span is None:
        return None
    start, end = span
    for pid in candidates:
        own = store.span_of(pid)
        if own is not None and own[0] <= end and start <= own[1]:
            return pid
    return None
