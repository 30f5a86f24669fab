"""The catalogue of rows: name -> (title in the table, function(row_dir, data_dir) that runs it)."""

from __future__ import annotations

from collections.abc import Callable

from t5_retrieval.results.minilm_rows import (FROZEN_EMBEDDINGS, TACO_BINDINGS, bm25_row, confounders_row,
                                              dpr_muf_row, minilm_zeroshot_row, task_specific_row, trained_row)
from t5_retrieval.results.qa_open import query_side_row
from t5_retrieval.results.t5_rows import t5_scratch_row


ROWS: dict[str, tuple[str, Callable[[str, str], None]]] = {
    "bm25": ("BM25", bm25_row),
    "minilm_zeroshot": ("MiniLM-L6 zero-shot", minilm_zeroshot_row),
    "naive_noprefix": ("naive multi-task, no prefix", trained_row("naive_multitask.gin", "mini_kilt_noprefix")),
    "naive_prefix": ("naive multi-task, dataset prefixes", trained_row("no_adaptive.gin", "mini_kilt")),
    "naive_typed": ("naive multi-task, task-type markers (MT-DPR)",
                    trained_row("mt_dpr_task_markers.gin", "mini_kilt_typed")),
    "taco": ("TACO", trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS)),
    "taco_nonzero_median": ("TACO, median over nonzero sensitivities (our variant, not the paper's)",
                            trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS,
                                        "multitask.taco.median_over = 'nonzero'")),
    "taco_typed": ("TACO, task-type markers", trained_row("task_type_markers.gin", "mini_kilt_typed", *TACO_BINDINGS)),
    "naive_prefix_frozen_embeddings": ("naive multi-task, dataset prefixes, embedding tables frozen",
                                       trained_row("no_adaptive.gin", "mini_kilt", *FROZEN_EMBEDDINGS)),
    "taco_frozen_embeddings": ("TACO, embedding tables frozen",
                               trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS, *FROZEN_EMBEDDINGS)),
    "pcgrad": ("PCGrad", trained_row("pcgrad.gin", "mini_kilt")),
    "cgd": ("CGD", trained_row("cgd.gin", "mini_kilt")),
    "gradnorm": ("GradNorm", trained_row("gradnorm.gin", "mini_kilt")),
    "mt_dpr_confounders": ("MT-DPR, adversarial confounders", confounders_row),
    "task_specific": ("task-specific (one model per task)", task_specific_row),
    "dpr_muf": ("DPR-MUF (fusion of the task-specific models)", dpr_muf_row),
    "query_side": ("query-side fine-tuning on qa_open (thesis)", query_side_row),
    "t5_scratch_naive": ("T5 from scratch, naive multi-task (GDMTL's control)",
                         t5_scratch_row("naive_multitask.gin")),
    "gdmtl": ("GDMTL (T5 from scratch)", t5_scratch_row("gdmtl.gin")),
}

# Rows whose function takes `seed` (training data order, initialisation of new parameters): the
# method comparisons that `t5r results --seeds` repeats. The others are deterministic or are built on
# seed 0's models (DPR-MUF fuses the task-specific row's experts).
SEEDED = ("naive_noprefix", "naive_prefix", "naive_typed", "taco", "taco_nonzero_median", "taco_typed",
          "naive_prefix_frozen_embeddings", "taco_frozen_embeddings", "pcgrad", "cgd", "gradnorm",
          "mt_dpr_confounders", "task_specific")

# The baselines every method's difference is measured against: naive multi-task without and with the
# prefixes, and with the embedding tables frozen (the baseline of the frozen TACO row).
BASELINES = ("naive_noprefix", "naive_prefix", "naive_prefix_frozen_embeddings")
