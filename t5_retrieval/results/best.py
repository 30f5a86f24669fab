"""The best recipe row per task against MiniLM zero-shot and BM25.

For each task, the recipe row (TACO's ANCE recipe or its naive control, any inputs or warm-up) with
the highest R-precision averaged over its seeds, next to the zero-shot and BM25 rows, with the
paired bootstrap interval of its difference to each (`significance`: queries resampled within the
task alone). Picking the best of several rows on the same dev queries favours it, so the intervals
are optimistic for the winner: a row that is best by less than its interval's width may not be the
best on other data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, RunRecord
from t5_retrieval.results.significance import ALPHA, bonferroni_alpha, check_same_queries, intervals, seed_mean
from t5_retrieval.results.tables import cell

R_PRECISION = METRICS[0][0]
BASELINES = {"minilm_zeroshot": "zero-shot", "bm25": "BM25"}  # row -> its name in the table


def recipe_rows(records: Mapping[str, Sequence[RunRecord]]) -> list[str]:
    """The recorded rows that run the ANCE recipe (warm-up, then mined-negative episodes): the
    catalogue names each of them `*recipe*`."""
    return sorted(row for row, runs in records.items() if "recipe" in row and runs)


def _compared(records: Mapping[str, Sequence[RunRecord]]) -> bool:
    return bool(recipe_rows(records)) and all(records.get(b) for b in BASELINES)


def best_count(records: Mapping[str, Sequence[RunRecord]]) -> int:
    """How many intervals `best_table` prints: each task's best row against each baseline."""
    return len(TASKS) * len(BASELINES) if _compared(records) else 0


def best_row(records: Mapping[str, Sequence[RunRecord]], task: str) -> str:
    """The recipe row with the highest seed-mean R-precision on `task` (ties: the first by name)."""
    def score(row: str) -> float:
        runs = records[row]
        return sum(run.table[task][R_PRECISION] for run in runs) / len(runs)
    return max(recipe_rows(records), key=score)


def best_table(records: Mapping[str, Sequence[RunRecord]], titles: Mapping[str, str], m: int) -> str:
    """Markdown: per task, its best recipe row, that row's R-precision (mean ± sd over seeds), the
    baselines', and the row minus each baseline with its 95% interval (`*`: excludes 0) and whether
    it still excludes 0 at the Bonferroni level over the page's `m` intervals."""
    if not _compared(records):
        return ""
    header = ("| task | best recipe row | seeds | its R-prec | zero-shot R-prec | BM25 R-prec | "
              "minus zero-shot, 95% interval | minus BM25, 95% interval | excludes 0 after the Bonferroni correction |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    means = {row: seed_mean(records[row]) for row in (*recipe_rows(records), *BASELINES)}  # once per row, not per task
    for task in TASKS:
        row = best_row(records, task)
        runs = records[row]
        found = []
        for baseline in BASELINES:
            check_same_queries(runs[0], records[baseline][0])
            diff = means[row][task][R_PRECISION] - means[baseline][task][R_PRECISION]
            found.append(intervals({task: diff.reshape(-1, 1)}, [ALPHA, bonferroni_alpha(m)])[0])
        scores = [cell([run.table[task][R_PRECISION] for run in rs]) for rs in (runs, *(records[b] for b in BASELINES))]
        decisions = ", ".join(f"{name} {corrected.decision}" for name, (_, corrected) in zip(BASELINES.values(), found))
        lines.append(f"| {task} | {titles.get(row, row)} | {len(runs)} | {' | '.join(scores)} | "
                     f"{found[0][0]} | {found[1][0]} | {decisions} |")
    return "\n".join(lines) + "\n"
