"""`make demo`: real retrieval on a slice of mini-KILT shipped with the code, in minutes on a CPU.

    t5r demo                       # the shipped real-data slice (default)
    t5r demo --data=DIR            # any KILT-format directory of the six mini-KILT tasks
    t5r demo --data=synthetic      # SYNTHETIC data, tiny T5 from scratch (smoke run)

Real data: BM25, all-MiniLM-L6-v2 zero-shot, then naive multi-task and TACO fine-tuning from
MiniLM (TACO with its median over nonzero sensitivities, which MiniLM's mostly untouched embedding
table needs: docs/taco.md; the `t5r results` rows of the same names, with DEMO_STEPS steps: the query side trains over
the zero-shot row's passage embeddings), each evaluated with the KILT metrics on the dev queries; one table with each
row's wall time. Synthetic: data -> vocabulary -> warm-up -> one ANCE episode with TACO -> eval.
Every step is skipped when its output exists, so an interrupted demo resumes where it stopped.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable

from t5_retrieval import gin_utils

# The trained rows' step budget: ~2 epochs of the slice's 1,745 training queries at 32 per step,
# which keeps the demo within 10 minutes on 2 CPU cores (`t5r results` trains 200 steps).
DEMO_STEPS = 100
SUMMARY_COLUMNS = ("n", "Rprec", "recall@5", "recall@20")


def real_data_demo(data: str, out: str) -> str:
    """Runs (or resumes) the REAL_ROWS on `data` ("slice" or a KILT-format directory); returns the table."""
    from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract
    from t5_retrieval.models.pretrained import minilm_l6_dir
    from t5_retrieval.results.common import prepare_data
    from t5_retrieval.results.records import record_run
    from t5_retrieval.results.tables import markdown_table

    minilm_l6_dir()  # the MiniLM rows need the installed weights: say so before BM25, not after it
    rows = demo_rows()
    raw_dir = extract(SHIPPED, out) if data == "slice" else os.path.abspath(data)
    data_dir = os.path.join(out, "data")
    prepare_data(raw_dir, data_dir)
    for name, row in rows.items():
        row(os.path.join(out, name), data_dir)
    return markdown_table({name: [record_run(os.path.join(out, name), data_dir, name, 0)] for name in rows})


def demo_rows(steps: int = DEMO_STEPS) -> dict[str, Callable[[str, str], None]]:
    """The demo's rows, named as `t5r results` names them: each `row(row_dir, data_dir)` runs (or
    resumes) into `row_dir`; the trained rows train `steps` steps (the zero-shot row's directory is
    their sibling `minilm_zeroshot`)."""
    from t5_retrieval.results.minilm_rows import TACO_BINDINGS, bm25_row, minilm_zeroshot_row, trained_row

    train_steps = f"TRAIN_STEPS = {steps}"
    return {"bm25": bm25_row, "minilm_zeroshot": minilm_zeroshot_row,
            "naive_noprefix": trained_row("naive_multitask.gin", "mini_kilt_noprefix", train_steps),
            # runs/taco.gin on MiniLM takes the median over nonzero sensitivities (models/bert_base.gin)
            "taco_nonzero_median": trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS,
                                               "multitask.taco.median_over = 'nonzero'", train_steps)}


def summary(tables: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The headline KILT columns per task, plus their unweighted mean over tasks."""
    rows = {task: {c: row[c] for c in SUMMARY_COLUMNS} for task, row in tables.items()}
    rows["mean"] = {c: sum(r[c] for r in rows.values()) / len(rows) for c in SUMMARY_COLUMNS}
    return rows


def _tasks_in(raw_dir: str) -> list[str]:
    suffix = "-train-kilt.jsonl"
    return sorted(os.path.basename(p)[:-len(suffix)] for p in glob.glob(os.path.join(raw_dir, f"*{suffix}")))


def prepare_synthetic(out: str) -> tuple[str, str]:
    """Writes the synthetic data, its data directory and vocabulary; returns (data_dir, vocabulary path)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.kilt.prepare import prepare_missing
    from t5_retrieval.data.kilt.synthetic import write_demo
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    raw_dir = os.path.join(out, "raw")
    if not os.path.exists(os.path.join(raw_dir, "kb", "pages.jsonl")):
        write_demo(raw_dir)
    data_dir = os.path.join(out, "data")
    prepare_missing(os.path.join(raw_dir, "kb", "pages.jsonl"), raw_dir, data_dir, _tasks_in(raw_dir),
                    build_bm25_index_for_kb)
    vocab_prefix = os.path.join(data_dir, "spm")
    if not os.path.exists(vocab_prefix + ".model"):
        train_vocabulary(layout.kb_dir(data_dir), vocab_prefix, vocab_size=4096 - 100)
    return data_dir, vocab_prefix + ".model"


def synthetic_demo(out: str) -> str:
    """The whole TACO recipe at toy scale (runs/demo.gin): warm-up, one ANCE episode, eval; returns the report."""
    from t5_retrieval.ance import ance
    from t5_retrieval.retrieval.evaluate import format_table

    data_dir, vocabulary = prepare_synthetic(out)
    gin_utils.parse_gin(["runs/demo.gin"], [f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'",
                                            "MIXTURE_OR_TASK_NAME = 'demo'", "WARMUP_MIXTURE = 'demo_noprefix'"])
    work_dir = os.path.join(out, "ance")
    tables = ance(work_dir)
    with open(os.path.join(work_dir, "warmup", "eval", "results.json")) as f:
        warmup = summary(json.load(f))["mean"]
    return ("\nDev set, page-level KILT metrics after BM25 warm-up + 1 ANCE episode with TACO (SYNTHETIC demo data):\n"
            + format_table(summary(tables))
            + f"(after warm-up only: mean Rprec {warmup['Rprec']:.4f}, recall@20 {warmup['recall@20']:.4f})\n"
            f"(all metrics: {out}/ance/episode_1/eval/results.txt; every stage's output under {out}/ance)\n")
