"""The rows built on all-MiniLM-L6-v2: BM25 beside it, zero-shot, the trained multi-task rows over its
frozen passage embeddings, the task-specific experts and their DPR-MUF fusion.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from t5_retrieval.results.common import TASKS, configured, dataset_name, dataset_table, train_model


def bm25_row(row_dir: str, data_dir: str) -> None:
    """BM25's top-100 passages per dev query, scored as `t5r eval` scores a `t5r index --backend=bm25`."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.retrieval.evaluate import evaluate, write_results
    from t5_retrieval.retrieval.index import build_bm25_index
    from t5_retrieval.stages import stage

    def run() -> dict[str, Any]:
        store = PassageStore.open(layout.kb_dir(data_dir))
        index = build_bm25_index(store, layout.kb_dir(data_dir))
        examples = {task: read_examples(layout.examples_path(data_dir, task, "dev")) for task in TASKS}
        result = evaluate(None, index, examples, store, depth=100)
        write_results(result, os.path.join(row_dir, "eval"))
        return {"tables": result.tables}

    stage(os.path.join(row_dir, "eval"), "bm25 evaluate", run)


def minilm_zeroshot_row(row_dir: str, data_dir: str) -> None:
    """The pretrained MiniLM written as a t5r model directory, then encode -> exact index -> eval."""
    from t5_retrieval.stages import index_and_evaluate, stage

    model_dir = os.path.join(row_dir, "model")
    stage(model_dir, "minilm model directory", lambda: write_minilm_model_dir(model_dir))
    index_and_evaluate(row_dir, model_dir, data_dir)


def write_minilm_model_dir(model_dir: str) -> dict[str, Any]:
    """A model directory holding all-MiniLM-L6-v2 as `t5r train --init_from` would start from it."""
    import gin
    import jax

    import t5_retrieval.train  # noqa: F401  (registers train.*, which models/minilm_l6.gin binds)
    from t5_retrieval import checkpoint, gin_utils, sharding
    from t5_retrieval.models.build import build_model, init_params, initial_params, model_config
    from t5_retrieval.models.pretrained import minilm_l6_dir

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/minilm_l6.gin"], [])
        config = model_config()
    finally:
        gin.clear_config()
    tasks = zero_shot_tasks()
    config["features"] = {"vocabulary": minilm_l6_dir(), "query_len": max(t["query_len"] for t in tasks.values()),
                          "passage_len": 256, "passage_template": "{title}: {text}", "tasks": tasks}
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(0), sharding.make_mesh(), sharding.logical_axis_rules())
    params = initial_params(minilm_l6_dir(), params, config)
    checkpoint.write_config(model_dir, config)
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": params}, {})
    return {"init_from": minilm_l6_dir()}


def zero_shot_tasks() -> dict[str, dict[str, Any]]:
    """The six tasks as the zero-shot model reads them: no prefix, and each at the query length and
    truncation of its mini-KILT Task, so that this row and every trained row read the same inputs."""
    from t5_retrieval.data.tasks.shipped import MINI_KILT

    rows = {d.task.dataset: d for d in MINI_KILT}
    return {t: {**dataclasses.replace(rows[t].spec("mini_kilt", "_noprefix"), name=t).to_record(), "index": i}
            for i, t in enumerate(TASKS)}


# Every trained row fine-tunes MiniLM's query side over the zero-shot row's passage embeddings (the
# passage encoder stays MiniLM, so every row searches the zero-shot index): on this CPU a step then
# costs the queries' forward/backward only, and the KB is encoded once for all rows.
TRAIN_BINDINGS = (
    "LEARNING_RATE = 2e-5",
    "PER_DEVICE_BATCH = 32",
    "NUM_NEGATIVES = 2",
    "TRAIN_STEPS = 200",
    "train.checkpoint_every = 50",
    "train.log_every = 20",
    "make_train_iterator.passage_template = '{title}: {text}'",
)


# Both towers trained: a step also encodes 96 passages of 256 tokens forward and backward (21-33 s a
# step on the 2-core CPU, against 1.4 s for a query-side step), so 120 steps (0.44 epoch) keep one
# run under an hour there, KB re-encoding included (measured: 3,464 s naive, 3,567 s TACO).
BOTH_TOWERS_STEPS = 120

# An epoch here is one pass over mini-KILT's 8,724 training queries at TRAIN_BINDINGS' 32 queries a
# step (TRAIN_BINDINGS' 200 steps are 0.7 of one).
MINI_KILT_TRAIN_QUERIES = 8724


def epochs_in_steps(epochs: float) -> int:
    """Training steps of `epochs` passes over mini-KILT's training queries at 32 a step."""
    return round(epochs * MINI_KILT_TRAIN_QUERIES / 32)


THREE_EPOCHS = epochs_in_steps(3)  # 818

# The EMA horizon 1 / (1 - beta) scaled to the run: the paper's 0.999 (1,000 steps) would keep the
# zero-initialised EMA at a quarter of its signal after 300 steps, so the weights stay near uniform.
TACO_BINDINGS = ("multitask.taco.beta = 0.99",)

# MiniLM's embedding tables get sparse gradients (a batch touches few of the 30,522 word rows, 64 of
# the 512 positions, one token type), so over all parameters TACO's global median of sensitivities
# is 0. Frozen, every parameter that trains gets a dense gradient and the median is defined.
FROZEN_EMBEDDINGS = ("make_optimizer.frozen = ['bert/embeddings/(word|position|token_type)/embedding']",)

# Which median each TACO row divides by, stated in its bindings (models/bert_base.gin's default is
# the median over nonzero values): the paper's median over all (trained) parameters, and the same
# where it is 0 and the weights are an argmax (the run is let through on purpose, as recorded).
PAPER_MEDIAN = ("multitask.taco.median_over = 'all'",)
COLLAPSED_MEDIAN = (*PAPER_MEDIAN, "multitask.taco.allow_zero_median = True")


def trained_row(run_file: str, mixture: str, *bindings: str, both_towers: bool = False) -> Callable[..., None]:
    """A row trained with `runs/<run_file>` on `mixture`, from MiniLM (the zero-shot row in `base_dir`,
    by default the row's sibling `minilm_zeroshot`); `seed` sets the training data order and the
    initialisation of parameters MiniLM does not have.

    By default only the query side trains, over the zero-shot row's stored passage embeddings, and the
    row searches the zero-shot index. `both_towers`: the shared encoder trains on queries and passages
    (the papers' regime), and the KB is re-encoded with the trained model for the row's own index."""

    def row(row_dir: str, data_dir: str, seed: int = 0, base_dir: str | None = None) -> None:
        from t5_retrieval.stages import index_and_evaluate, stage

        base_dir = base_dir or os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
        minilm_zeroshot_row(base_dir, data_dir)  # the base model and its index (done once, then skipped)
        model_dir = os.path.join(row_dir, "model")
        gin_bindings = [f"DATA_DIR = '{data_dir}'", f"MIXTURE_OR_TASK_NAME = '{mixture}'", *TRAIN_BINDINGS,
                        f"train.init_from = '{os.path.join(base_dir, 'model')}'", f"train.seed = {seed}"]
        if both_towers:  # ~25 s a step on a 2-core CPU: checkpoint every 4 minutes, not every 20
            gin_bindings.append("train.checkpoint_every = 10")
        else:
            gin_bindings.append(f"make_train_iterator.passage_embeddings = '{os.path.join(base_dir, 'embeddings')}'")
        gin_bindings += bindings
        stage(model_dir, f"train {run_file}",
              lambda: train_model(model_dir, ["models/minilm_l6.gin", f"runs/{run_file}"], gin_bindings))
        index_and_evaluate(row_dir, model_dir, data_dir,
                           index_dir=None if both_towers else os.path.join(base_dir, "index"))

    return row


# MT-DPR's confounders drop negatives that contain an answer only where an answer string means
# relevance: QA and slot filling (not FEVER's labels, WoW's replies or entity titles).
ANSWER_CHECKABLE = ("hotpotqa", "trex", "entityquestions")


def zero_shot_negatives_dir(base_dir: str) -> str:
    """Where `zero_shot_negatives` writes the zero-shot row's (in `base_dir`) mined negatives."""
    return os.path.join(base_dir, "confounder_negatives")


def zero_shot_negatives(base_dir: str, data_dir: str) -> str:
    """The directory of the negatives MiniLM (the zero-shot row in `base_dir`) mines for every training
    query: its top-110 minus gold pages and, for ANSWER_CHECKABLE tasks, minus answer-holding passages.
    Mined once (a stage) into the zero-shot row and shared by every row, seed and variant that reads it."""
    from t5_retrieval.stages import mine_stage

    negatives_dir = zero_shot_negatives_dir(base_dir)
    mine_stage(negatives_dir, os.path.join(base_dir, "model"), os.path.join(base_dir, "index"), data_dir, 110,
               ANSWER_CHECKABLE)
    return negatives_dir


def confounders_row(*bindings: str) -> Callable[..., None]:
    """MT-DPR's adversarial confounders: negatives mined by MiniLM (`zero_shot_negatives`), then naive
    multi-task without prefix (plus `bindings`)."""

    def row(row_dir: str, data_dir: str, seed: int = 0) -> None:
        base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
        minilm_zeroshot_row(base_dir, data_dir)
        negatives_dir = zero_shot_negatives(base_dir, data_dir)
        trained_row("mt_dpr.gin", "mini_kilt_noprefix", f"NEGATIVES = '{negatives_dir}'", *bindings)(
            row_dir, data_dir, seed)

    return row


TASK_SPECIFIC_STEPS = 100  # per model: >= 1 epoch of every dataset's 32-query batches; 6 models cost 3x a row


def task_specific_row(row_dir: str, data_dir: str, seed: int = 0) -> None:
    """One model per dataset (naive, no prefix, TASK_SPECIFIC_STEPS steps of its own queries), each
    scored on its own dataset; the row's table joins the six."""
    from t5_retrieval.stages import stage

    base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
    for task in TASKS:
        single_task = dataset_name(["mini_kilt_noprefix"], task)  # the Mixture's Task that reads it
        trained_row("single_task.gin", single_task, f"TRAIN_STEPS = {TASK_SPECIFIC_STEPS}")(
            os.path.join(row_dir, task), data_dir, seed, base_dir)
    stage(os.path.join(row_dir, "eval"), "join task-specific tables", lambda: join_tables(row_dir))


def join_tables(row_dir: str) -> dict[str, Any]:
    from t5_retrieval.data.records import write_json_atomic

    tables = {}
    for task in TASKS:
        with open(os.path.join(row_dir, task, "eval", "results.json")) as f:
            tables[task] = dataset_table(json.load(f), task)
    write_json_atomic(os.path.join(row_dir, "eval", "results.json"), tables)
    return {"tables": tables}


def dpr_muf_row(row_dir: str, data_dir: str) -> None:
    """DPR-MUF (`t5r fuse --gin_file=runs/dpr_muf.gin`) over the task-specific row's six experts,
    which share the zero-shot index (their passage side is MiniLM's); the row reports the fused
    ("muf") ranking, `<row>/fusion` also holds the uniform sum and each expert alone."""
    from t5_retrieval.fusion.fuse import fuse_experts
    from t5_retrieval.stages import stage

    experts_dir = os.path.join(os.path.dirname(row_dir), "task_specific")
    task_specific_row(experts_dir, data_dir)
    index_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot", "index")
    fusion_dir = os.path.join(row_dir, "fusion")

    def fuse() -> dict[str, Any]:
        experts = [f"{t},{os.path.join(experts_dir, t, 'model')},{index_dir}" for t in TASKS]
        configured(["runs/dpr_muf.gin"], [], lambda: fuse_experts(experts, data_dir, fusion_dir))
        shutil.copytree(os.path.join(fusion_dir, "muf"), os.path.join(row_dir, "eval"), dirs_exist_ok=True)
        return {"gin": ["runs/dpr_muf.gin"], "experts": experts}

    stage(fusion_dir, "DPR-MUF fusion", fuse)


# TACO's recipe at this machine's scale: a warm-up on BM25 negatives, then RECIPE_EPISODES ANCE
# episodes on negatives mined by the current model, each RECIPE_STEPS long like the warm-up, at half
# the warm-up's learning rate (the paper: 1e-5, then 5e-6).
RECIPE_EPISODES = 2
RECIPE_STEPS = 200
RECIPE_EPISODE_LEARNING_RATE = 1e-5


def publish_last_episode(row_dir: str, ance_dir: str) -> None:
    """A recipe row's table is its last ANCE episode's: copied to `<row_dir>/eval`, as a stage."""
    from t5_retrieval.stages import stage

    last = os.path.join(ance_dir, f"episode_{RECIPE_EPISODES}", "eval")

    def publish() -> dict[str, Any]:
        shutil.copytree(last, os.path.join(row_dir, "eval"), dirs_exist_ok=True)
        return {"from": last}

    stage(os.path.join(row_dir, "eval"), "the last episode's table", publish)


def recipe_bindings(data_dir: str, base_dir: str, seed: int, num_episodes: int) -> list[str]:
    """The gin bindings every stage of a recipe row shares (query side over MiniLM's index)."""
    return [f"DATA_DIR = '{data_dir}'", "MIXTURE_OR_TASK_NAME = 'mini_kilt'", *TRAIN_BINDINGS,
            f"TRAIN_STEPS = {RECIPE_STEPS}", f"train.init_from = '{os.path.join(base_dir, 'model')}'",
            f"train.seed = {seed}",
            f"make_train_iterator.passage_embeddings = '{os.path.join(base_dir, 'embeddings')}'",
            f"episode/make_optimizer.learning_rate = {RECIPE_EPISODE_LEARNING_RATE}",
            f"ance.data_dir = '{data_dir}'", f"ance.num_episodes = {num_episodes}",
            f"ance.passage_index = '{os.path.join(base_dir, 'index')}'"]


TACO_LAST_EPISODE = (f"ance.multitask_episodes = [{RECIPE_EPISODES}]", "ance.episode_multitask = @multitask.taco",
                     "multitask.taco.tau = 2.0", "multitask.taco.median = 'approx'",
                     "multitask.taco.burn_in_fraction = 0.1", *TACO_BINDINGS)

# The recipe as the TACO paper describes it, where this machine allows: the warm-up without dataset
# prefixes (the episodes add them, as the authors' scripts do), every stage with MiniLM's embedding
# tables frozen (so TACO's median over all trained parameters is not 0, and the naive control trains
# the same parameters), and each episode's 2 hard negatives per query drawn uniformly from its whole
# mined list (top-110 minus gold pages; the paper's "we sample two hard negatives"; the authors' KILT
# scripts take the top 2 instead, as `recipe_row` does), seeded by the row's seed.
RECIPE_FROZEN = (*FROZEN_EMBEDDINGS, *PAPER_MEDIAN, "warmup/make_train_iterator.mixture_or_task_names = 'mini_kilt_noprefix'",
                 "episode/make_train_iterator.hard_negatives = 'sampled'")

# A naive control that keeps TACO's EMA without applying it: TACO whose burn-in lasts the whole run
# returns the plain sum of the task gradients (at the naive scale: the same float32 adds as
# `naive_sum`), so the control trains as naive does and its specialisation is measured with TACO's
# own EMA (same beta, steps and parameters). Used by the recipe's last episode and the both-tower pair.
TRACK_TACO_EMA = ("multitask.taco.burn_in_fraction = 1.0", "multitask.taco.keep_naive_scale = True")
NAIVE_TRACKING_TACO = (*TACO_LAST_EPISODE, *TRACK_TACO_EMA)

# The paper's temperature ablation: TACO whose softmax over tasks favours each parameter's least
# sensitive tasks (tau -2 against 2), which discourages specialisation instead of promoting it.
NEGATIVE_TAU_LAST_EPISODE = (*TACO_LAST_EPISODE, "multitask.taco.tau = -2.0")

# The recipe's inputs per task, for the two tasks that stayed below zero-shot (docs/data.md, "Per-task
# training inputs"): WoW trained on the zero-shot model's mined negatives instead of BM25's in the
# naive row gained 0.073 R-precision, so its warm-up trains on their top 2 (`zero_shot_negatives`,
# the MT-DPR confounders row's; the episodes mine their own as before);
# HotpotQA's questions have two gold pages and training on the first alone pushes the second down, so
# every stage trains each question once per gold page. The other tasks read what they read before.
def wow_mined_warmup(negatives_dir: str) -> str:
    """The binding that warms WoW up on the negatives in `negatives_dir` (the other tasks on BM25's)."""
    return f"warmup/make_train_iterator.task_negatives = {{'wow': '{negatives_dir}'}}"


HOTPOTQA_BOTH_GOLD_PAGES = "make_train_iterator.positive_passages = {'hotpotqa': 'each'}"


# Warm-up lengths, in epochs, of the curve that asks when TACO starts to differ from naive (the paper
# warms up for 20; `taco_recipe_frozen` for 0.7).
WARMUP_CURVE_EPOCHS = (1, 3, 10, 20)


@dataclasses.dataclass(frozen=True)
class RecipePairRow:
    """TACO's recipe (`RECIPE_FROZEN`): the warm-up and the episodes before the last are the same for
    TACO and its naive control, so the rows of one warm-up share them (`<work>/recipe_frozen_shared`,
    or `recipe_frozen_warmup_<E>ep_shared` for a warm-up of `warmup_epochs` epochs instead of
    RECIPE_STEPS steps, linked into each row's `ance/`) and differ in the last episode alone, which
    `last_episode` configures: TACO (`TACO_LAST_EPISODE`), the sum with TACO's EMA tracked
    (`NAIVE_TRACKING_TACO`), or TACO at a negative temperature (`NEGATIVE_TAU_LAST_EPISODE`).
    `task_inputs`: the recipe's inputs per task in every stage (`wow_mined_warmup`,
    `HOTPOTQA_BOTH_GOLD_PAGES`; shared stages under `recipe_frozen_task_inputs..._shared`), the
    default since three seeds measured them (naive +0.009 mean R-precision over the same recipe
    without them, HotpotQA above zero-shot); False for the rows that ran before, whose records keep
    the inputs they ran with, and for the warm-up curve, whose points share one set of inputs."""

    last_episode: Sequence[str]
    warmup_epochs: int | None = None
    task_inputs: bool = True

    @property
    def shared_name(self) -> str:
        return ("recipe_frozen" + ("_task_inputs" if self.task_inputs else "")
                + ("" if self.warmup_epochs is None else f"_warmup_{self.warmup_epochs}ep") + "_shared")

    def bindings(self, data_dir: str, base_dir: str, seed: int, num_episodes: int) -> list[str]:
        """The gin bindings of a run of `num_episodes` episodes (the shared stages: RECIPE_EPISODES - 1;
        the row's own last episode: RECIPE_EPISODES, with `last_episode`)."""
        warmup = [] if self.warmup_epochs is None else [f"warmup/train.num_steps = {epochs_in_steps(self.warmup_epochs)}"]
        inputs = [wow_mined_warmup(zero_shot_negatives_dir(base_dir)), HOTPOTQA_BOTH_GOLD_PAGES] if self.task_inputs else []
        last = list(self.last_episode) if num_episodes == RECIPE_EPISODES else []
        return [*recipe_bindings(data_dir, base_dir, seed, num_episodes), *RECIPE_FROZEN, *warmup, *inputs, *last]

    def __call__(self, row_dir: str, data_dir: str, seed: int = 0) -> None:
        from t5_retrieval.ance import ance
        from t5_retrieval.results.records import seed_dir

        work_dir = os.path.dirname(row_dir)
        base_dir = os.path.join(work_dir, "minilm_zeroshot")
        minilm_zeroshot_row(base_dir, data_dir)
        if self.task_inputs:
            zero_shot_negatives(base_dir, data_dir)
        shared = seed_dir(work_dir, self.shared_name, seed)
        configured(["models/minilm_l6.gin", "runs/no_adaptive.gin"],
                   self.bindings(data_dir, base_dir, seed, RECIPE_EPISODES - 1), lambda: ance(shared))
        ance_dir = os.path.join(row_dir, "ance")
        os.makedirs(ance_dir, exist_ok=True)
        for name in ["warmup", *[f"episode_{e}" for e in range(1, RECIPE_EPISODES)]]:
            link = os.path.join(ance_dir, name)
            if not os.path.lexists(link):
                os.symlink(os.path.relpath(os.path.join(shared, name), ance_dir), link)
        configured(["models/minilm_l6.gin", "runs/no_adaptive.gin"],
                   self.bindings(data_dir, base_dir, seed, RECIPE_EPISODES), lambda: ance(ance_dir))
        publish_last_episode(row_dir, ance_dir)


def recipe_row(taco_last: bool) -> Callable[..., None]:
    """TACO's training recipe (`ance`): naive multi-task with dataset prefixes warms up on BM25
    negatives from MiniLM; each episode mines the top-110 minus gold with the current model and trains
    from it; the last episode combines the task gradients with TACO (`taco_last`) or sums them (the
    control). Query side only, as the other rows: every stage mines and evaluates with the zero-shot
    index (its passages never change), so nothing is re-encoded. The row's table is the last episode's."""

    def row(row_dir: str, data_dir: str, seed: int = 0) -> None:
        from t5_retrieval.ance import ance

        base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
        minilm_zeroshot_row(base_dir, data_dir)
        ance_dir = os.path.join(row_dir, "ance")
        bindings = recipe_bindings(data_dir, base_dir, seed, RECIPE_EPISODES)
        if taco_last:  # as recorded: over all parameters, embedding tables trained, so the median was 0
            bindings += [*TACO_LAST_EPISODE, *COLLAPSED_MEDIAN]
        configured(["models/minilm_l6.gin", "runs/no_adaptive.gin"], bindings, lambda: ance(ance_dir))
        publish_last_episode(row_dir, ance_dir)

    return row
