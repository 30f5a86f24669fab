"""`t5r results`: the mini-KILT results table, one resumable row at a time (docs/RESULTS.md).

    t5r results --data=/path/to/mini_kilt --work_dir=/runs/results [--rows bm25,minilm_zeroshot,taco]

Every row reads the same prepared data (KB = mini-KILT's `kb/passages.jsonl`, one passage per
paragraph, as the reference numbers use; the six tasks' train/dev examples; BM25 negatives) and
writes `<work_dir>/<row>/eval/results.json` with the KILT table of `t5r eval`. A finished stage is
marked DONE and skipped when the command is run again, so an interrupted run resumes. Every finished
run leaves a small record (`records`: its table, wall time, training and per-query scores) in
`--records_dir`; at the end the page-level R-precision and recall@20 of every recorded row, per task
and their mean, are printed as a Markdown table (and written to `--markdown`). `--rows=` runs nothing
and prints the tables of the records already there:

    t5r results --work_dir=/tmp/tables --records_dir=docs/run_records/mini_kilt --rows=

Rows:
- ``bm25``: BM25 (k1 0.9, b 0.4) over "title text", passages max-pooled to pages.
- ``minilm_zeroshot``: the installed all-MiniLM-L6-v2, no training: mean pooling + L2 norm,
  passages "{title}: {text}" truncated to 256 tokens, exact search (the setting of mini-KILT's
  `minilm_zeroshot_reference_dev.json`); queries at the mini-KILT Tasks' own lengths, entity
  linking in a window around its mention, as every trained row reads them (the reference read all
  at 128 from their start).
- trained rows (``naive_noprefix``, ``naive_prefix``, ``naive_typed``, ``taco``, ``taco_typed``,
  ``pcgrad``, ``cgd``, ``gradnorm``, ``mt_dpr_confounders``, ``task_specific``): the paper's run file
  on mini-KILT, from MiniLM, with the shared settings of TRAIN_BINDINGS. Only the query side trains:
  the passages are the zero-shot row's stored embeddings (`make_train_iterator.passage_embeddings`),
  so every row searches the zero-shot index and the KB is encoded once. On this 2-core CPU that is
  what makes a row take minutes instead of hours; it is a different regime from the papers', which
  train both sides (docs/RESULTS.md says so next to the numbers).
- ``naive_prefix_frozen_embeddings``, ``taco_frozen_embeddings``: naive and TACO with MiniLM's three
  embedding tables frozen (`make_optimizer.frozen`), so every trained parameter gets a dense
  gradient and TACO's global median is not 0.
- ``naive_prefix_frozen_embeddings_both_towers``, ``taco_frozen_embeddings_both_towers``: the same two
  with the shared encoder trained on queries and passages (the papers' regime) for BOTH_TOWERS_STEPS
  steps, the KB re-encoded with each trained model (about 1.5 hours a row on a 2-core CPU). The naive
  row trains with TACO's EMA tracked but never applied (`TRACK_TACO_EMA`), so both rows' final EMAs
  are analysed the same way.
- ``mt_dpr_confounders_3_epochs``: the MT-DPR row trained for 3 epochs instead of 0.7.
- ``taco_recipe``, ``naive_recipe``: TACO's training recipe (`ance`): naive multi-task with prefixes
  warms up on BM25 negatives, then RECIPE_EPISODES ANCE episodes train on negatives mined by the
  current model; TACO combines the task gradients in the last episode, or (the control) naive does.
  Query side only: every stage mines and evaluates with the zero-shot index.
- ``dpr_muf``: DPR-MUF fusion over the task-specific row's experts.
- ``query_side``: the thesis' query-side fine-tuning of MiniLM on the qa_open questions (answer-holding
  passages as positives); also scored by answer recall on the qa_open dev sets (`qa_open_table`).
- ``t5_scratch_naive``, ``gdmtl``: a tiny T5 from scratch (no pretrained T5 offline), both sides
  trained, naive multi-task without and with GDMTL's query-generation objective.

`--seeds 0,1,2` runs every row of `SEEDED` (the method comparisons and their controls) once per
seed (training data order and the initialisation of new parameters; seed k > 0 writes
`<work_dir>/<row>-seed<k>`). The table then gives each cell as mean +- standard deviation over the
recorded seeds, and a second table each method's difference to its control (`rows.CONTROLS`: the
naive multi-task row that differs from it in the method alone) with a paired bootstrap 95% interval
over the dev queries (`significance`), and whether it still excludes 0 after a Bonferroni correction
over all the intervals printed.

After the rows, the task-specialisation analysis (TACO Fig. 1-2) runs for naive multi-task and TACO
(`sensitivity_analysis`) and its table is printed below the results.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract
from t5_retrieval.errors import ConfigError
from t5_retrieval.results.analysis import analysis_table, sensitivity_analysis
from t5_retrieval.results.common import prepare_data
from t5_retrieval.results.overlap import overlap_table, read_overlap, write_overlap
from t5_retrieval.results.qa_open import qa_open_table
from t5_retrieval.results.records import read_records, record_run, seed_dir, write_record
from t5_retrieval.results.rows import CONTROLS, ROWS, SEEDED, TITLES
from t5_retrieval.results.significance import (
    bonferroni_sentence,
    differences_count,
    differences_table,
    inputs_count,
    inputs_table,
)
from t5_retrieval.results.specialisation import specialisation_table
from t5_retrieval.results.tables import markdown_table

log = logging.getLogger(__name__)


def run_rows(work_dir: str, rows: Sequence[str], seeds: Sequence[int] = (0,), data: str | None = None,
             records_dir: str | None = None, compare_with: str | None = None) -> str:
    """Runs (or resumes) `rows` on `data` (the mini-KILT directory, or "slice") under `work_dir`, `seeds`
    for the rows of `SEEDED`, records each finished run in `records_dir` (default
    `<work_dir>/records`), and returns the tables of every recorded row (Markdown); `compare_with`,
    the records of the same rows under other inputs, adds each row's change from those."""
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ConfigError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    records_dir = records_dir or os.path.join(work_dir, "records")
    if rows:
        if data is None:
            raise ConfigError("run_rows: `data` (the mini-KILT directory, or \"slice\") is needed to run rows")
        data_dir = os.path.join(work_dir, "data")
        raw_dir = extract(SHIPPED, work_dir) if data == "slice" else os.path.abspath(data)
        prepare_data(raw_dir, data_dir)
        write_overlap(data_dir, records_dir)
    for name in rows:
        for seed in seeds if name in SEEDED else [0]:
            start = time.time()
            run_dir = seed_dir(work_dir, name, seed)
            ROWS[name][1](run_dir, data_dir, **({"seed": seed} if name in SEEDED else {}))
            path = write_record(record_run(run_dir, data_dir, name, seed), records_dir)
            log.info("results: row %s (seed %d) done in %.0f s, recorded in %s", name, seed, time.time() - start, path)
    sensitivity_analysis(work_dir)
    records = read_records(records_dir)
    previous = read_records(compare_with) if compare_with else {}
    m = differences_count(records, CONTROLS) + inputs_count(records, previous, TITLES)  # every interval printed
    differences = differences_table(records, TITLES, CONTROLS, m)
    overlap = read_overlap(records_dir)
    without = overlap_table(records, TITLES, overlap) if overlap is not None and records else ""
    changes = inputs_table(records, previous, TITLES, m)
    correction = bonferroni_sentence(m) if m else ""
    return "\n".join(t for t in (markdown_table(records), differences, without, changes, correction,
                                 specialisation_table(records), analysis_table(work_dir), qa_open_table(work_dir))
                      if t)
