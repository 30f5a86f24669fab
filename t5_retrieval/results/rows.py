"""The catalogue of rows: name -> (title in the table, function(row_dir, data_dir) that runs it)."""

from __future__ import annotations

from collections.abc import Callable

from t5_retrieval.results.minilm_rows import (
                                              BOTH_TOWERS_STEPS,
                                              COLLAPSED_MEDIAN,
                                              FROZEN_EMBEDDINGS,
                                              NAIVE_TRACKING_TACO,
                                              NEGATIVE_TAU_LAST_EPISODE,
                                              PAPER_MEDIAN,
                                              TACO_BINDINGS,
                                              TACO_LAST_EPISODE,
                                              THREE_EPOCHS,
                                              TRACK_TACO_EMA,
                                              WARMUP_CURVE_EPOCHS,
                                              RecipePairRow,
                                              bm25_row,
                                              confounders_row,
                                              dpr_muf_row,
                                              minilm_zeroshot_row,
                                              recipe_row,
                                              task_specific_row,
                                              trained_row,
)
from t5_retrieval.results.qa_open import query_side_row
from t5_retrieval.results.t5_rows import t5_scratch_row

ROWS: dict[str, tuple[str, Callable[[str, str], None]]] = {
    "bm25": ("BM25", bm25_row),
    "minilm_zeroshot": ("MiniLM-L6 zero-shot", minilm_zeroshot_row),
    "naive_noprefix": ("naive multi-task, no prefix", trained_row("naive_multitask.gin", "mini_kilt_noprefix")),
    "naive_prefix": ("naive multi-task, dataset prefixes", trained_row("no_adaptive.gin", "mini_kilt")),
    "naive_typed": ("naive multi-task, task-type markers (MT-DPR)",
                    trained_row("mt_dpr_task_markers.gin", "mini_kilt_typed")),
    "taco": ("TACO, median over all parameters: 0 on MiniLM, so its weights are an argmax (collapsed)",
             trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS, *COLLAPSED_MEDIAN)),
    "taco_nonzero_median": ("TACO, median over nonzero sensitivities (our variant, not the paper's)",
                            trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS,
                                        "multitask.taco.median_over = 'nonzero'")),
    "taco_typed": ("TACO, task-type markers, median over all parameters (collapsed)",
                   trained_row("task_type_markers.gin", "mini_kilt_typed", *TACO_BINDINGS, *COLLAPSED_MEDIAN)),
    "naive_prefix_frozen_embeddings": ("naive multi-task, dataset prefixes, embedding tables frozen",
                                       trained_row("no_adaptive.gin", "mini_kilt", *FROZEN_EMBEDDINGS)),
    "taco_frozen_embeddings": ("TACO, embedding tables frozen (median over the trained parameters)",
                               trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS, *FROZEN_EMBEDDINGS, *PAPER_MEDIAN)),
    "naive_prefix_frozen_embeddings_both_towers": (
        "naive multi-task, dataset prefixes, embedding tables frozen, both towers trained",
        trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS, *FROZEN_EMBEDDINGS, *PAPER_MEDIAN, *TRACK_TACO_EMA,
                    f"TRAIN_STEPS = {BOTH_TOWERS_STEPS}", both_towers=True)),
    "taco_frozen_embeddings_both_towers": (
        "TACO, embedding tables frozen (median over the trained parameters), both towers trained",
        trained_row("taco.gin", "mini_kilt", *TACO_BINDINGS, *FROZEN_EMBEDDINGS, *PAPER_MEDIAN,
                    f"TRAIN_STEPS = {BOTH_TOWERS_STEPS}", both_towers=True)),
    "pcgrad": ("PCGrad", trained_row("pcgrad.gin", "mini_kilt")),
    "cgd": ("CGD", trained_row("cgd.gin", "mini_kilt")),
    "gradnorm": ("GradNorm", trained_row("gradnorm.gin", "mini_kilt")),
    "mt_dpr_confounders": ("MT-DPR, adversarial confounders", confounders_row()),
    "mt_dpr_confounders_3_epochs": ("MT-DPR, adversarial confounders, 3 epochs",
                                    confounders_row(f"TRAIN_STEPS = {THREE_EPOCHS}")),
    "task_specific": ("task-specific (one model per task)", task_specific_row),
    "taco_recipe": ("TACO's recipe, top-2 mined negatives, median over all parameters (collapsed)",
                    recipe_row(taco_last=True)),
    "naive_recipe": ("the same recipe, top-2 mined negatives, naive in the last episode too",
                     recipe_row(taco_last=False)),
    "taco_recipe_frozen": ("TACO's recipe, embedding tables frozen (median over the trained parameters), "
                           "sampled mined negatives", RecipePairRow(TACO_LAST_EPISODE, task_inputs=False)),
    "naive_recipe_frozen": ("the same recipe (embedding tables frozen, sampled mined negatives), naive in the last "
                            "episode too", RecipePairRow(NAIVE_TRACKING_TACO, task_inputs=False)),
    **{name: row for epochs in WARMUP_CURVE_EPOCHS for name, row in {
        f"taco_recipe_frozen_warmup_{epochs}ep": (
            f"TACO's recipe (frozen tables, sampled mined negatives), {epochs}-epoch warm-up",
            RecipePairRow(TACO_LAST_EPISODE, epochs, task_inputs=False)),
        f"naive_recipe_frozen_warmup_{epochs}ep": (
            f"the same recipe, {epochs}-epoch warm-up, naive in the last episode too",
            RecipePairRow(NAIVE_TRACKING_TACO, epochs, task_inputs=False))}.items()},
    "taco_recipe_frozen_warmup_20ep_negative_tau": (
        "TACO's recipe, 20-epoch warm-up, TACO at tau -2 (discouraging specialisation)",
        RecipePairRow(NEGATIVE_TAU_LAST_EPISODE, 20, task_inputs=False)),
    # The recipe with its default inputs per task (`RecipePairRow.task_inputs`); the rows above keep the
    # inputs they ran with.
    "taco_recipe_frozen_wow_mined_both_pages": (
        "TACO's recipe (frozen tables, sampled mined negatives), WoW warmed up on MiniLM-mined negatives, "
        "HotpotQA on both gold pages", RecipePairRow(TACO_LAST_EPISODE)),
    "naive_recipe_frozen_wow_mined_both_pages": (
        "the same recipe (WoW warmed up on MiniLM-mined negatives, HotpotQA on both gold pages), naive in the last "
        "episode too", RecipePairRow(NAIVE_TRACKING_TACO)),
    "dpr_muf": ("DPR-MUF (fusion of the task-specific models)", dpr_muf_row),
    "query_side": ("query-side fine-tuning on qa_open (thesis)", query_side_row),
    "t5_scratch_naive": ("T5 from scratch, naive multi-task (GDMTL's control)",
                         t5_scratch_row("naive_multitask.gin")),
    "gdmtl": ("GDMTL (T5 from scratch)", t5_scratch_row("gdmtl.gin")),
}
TITLES = {name: title for name, (title, _) in ROWS.items()}

# Each method row's control: the naive multi-task row that differs from it in the method alone (same
# prefixes, frozen parameters, towers and negatives source), or the same method trained shorter.
# `t5r results --seeds` repeats these rows (and their controls) with every seed; every other row is
# deterministic or built on seed 0's models (DPR-MUF fuses the task-specific row's experts).
CONTROLS = {
    "naive_prefix": "naive_noprefix",
    "naive_typed": "naive_noprefix",
    "taco": "naive_prefix",
    "taco_nonzero_median": "naive_prefix",
    "taco_typed": "naive_typed",
    "naive_prefix_frozen_embeddings": "naive_prefix",
    "taco_frozen_embeddings": "naive_prefix_frozen_embeddings",
    "naive_prefix_frozen_embeddings_both_towers": "naive_prefix_frozen_embeddings",
    "taco_frozen_embeddings_both_towers": "naive_prefix_frozen_embeddings_both_towers",
    "pcgrad": "naive_prefix",
    "cgd": "naive_prefix",
    "gradnorm": "naive_prefix",
    "mt_dpr_confounders": "naive_noprefix",
    "mt_dpr_confounders_3_epochs": "mt_dpr_confounders",
    "task_specific": "naive_noprefix",
    "taco_recipe": "naive_recipe",
    "taco_recipe_frozen": "naive_recipe_frozen",
    **{f"taco_recipe_frozen_warmup_{epochs}ep": f"naive_recipe_frozen_warmup_{epochs}ep" for epochs in WARMUP_CURVE_EPOCHS},
    # The temperature ablation: tau -2 against TACO's tau 2 after the same warm-up and episode 1.
    "taco_recipe_frozen_warmup_20ep_negative_tau": "taco_recipe_frozen_warmup_20ep",
    "taco_recipe_frozen_wow_mined_both_pages": "naive_recipe_frozen_wow_mined_both_pages",
    # What the inputs per task change: the same naive recipe with and without them.
    "naive_recipe_frozen_wow_mined_both_pages": "naive_recipe_frozen",
}
SEEDED = ("naive_noprefix", "naive_recipe", "naive_recipe_frozen",
          *(f"naive_recipe_frozen_warmup_{epochs}ep" for epochs in WARMUP_CURVE_EPOCHS), *CONTROLS)
