"""`t5r results`: the mini-KILT results table, one resumable row at a time (docs/RESULTS.md).

    t5r results --data=../shared/data/mini_kilt --work_dir=/runs/results [--rows bm25,minilm_zeroshot,taco]

Every row reads the same prepared data (KB = mini-KILT's `kb/passages.jsonl`, one passage per
paragraph, as the reference numbers use; the six tasks' train/dev examples; BM25 negatives) and
writes `<work_dir>/<row>/eval/results.json` with the KILT table of `t5r eval`. A finished stage is
marked DONE and skipped when the command is run again, so an interrupted run resumes. At the end
the page-level R-precision and recall@20 of every finished row, per task and their mean, are
printed as a Markdown table (and written to `--markdown`).

Rows:
- ``bm25``: BM25 (k1 0.9, b 0.4) over "title text", passages max-pooled to pages.
- ``minilm_zeroshot``: the installed all-MiniLM-L6-v2, no training: mean pooling + L2 norm,
  passages "{title}: {text}" truncated to 256 tokens, queries to 128, exact search (the setting of
  mini-KILT's `minilm_zeroshot_reference_dev.json`).
- trained rows (``naive_noprefix``, ``naive_prefix``, ``naive_typed``, ``taco``, ``taco_typed``,
  ``pcgrad``, ``cgd``, ``gradnorm``, ``mt_dpr_confounders``, ``task_specific``): the paper's run file
  on mini-KILT, from MiniLM, with the shared settings of TRAIN_BINDINGS. Only the query side trains:
  the passages are the zero-shot row's stored embeddings (`make_train_iterator.passage_embeddings`),
  so every row searches the zero-shot index and the KB is encoded once. On this 2-core CPU that is
  what makes a row take minutes instead of hours; it is a different regime from the papers', which
  train both sides (docs/RESULTS.md says so next to the numbers).
- ``dpr_muf``: DPR-MUF fusion over the task-specific row's experts.
- ``query_side``: the thesis' query-side fine-tuning of MiniLM on the qa_open questions (answer-holding
  passages as positives); also scored by answer recall on the qa_open dev sets (`qa_open_table`).
- ``t5_scratch_naive``, ``gdmtl``: a tiny T5 from scratch (no pretrained T5 offline), both sides
  trained, naive multi-task without and with GDMTL's query-generation objective.

After the rows, the task-specialisation analysis (TACO Fig. 1-2) runs for naive multi-task and TACO
(`sensitivity_analysis`) and its table is printed below the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from t5_retrieval import logs
from t5_retrieval.stages import DONE

log = logging.getLogger(__name__)
TASKS = ("fever", "wow", "hotpotqa", "trex", "entityquestions", "entity_linking")
COLUMNS = (("Rprec", "R-prec"), ("recall@20", "R@20"))


def prepare_data(raw_dir: str, data_dir: str) -> None:
    """KB from the paragraph passages, examples of every task, BM25 negatives (each step resumable)."""
    from t5_retrieval.data.prepare import prepare_missing

    prepare_missing(os.path.join(raw_dir, "kb", "passages.jsonl"), raw_dir, data_dir, TASKS)


def bm25_row(row_dir: str, data_dir: str) -> None:
    """BM25's top-100 passages per dev query, scored like `t5r eval`."""
    from t5_retrieval.stages import stage
    from t5_retrieval.data import layout
    from t5_retrieval.data.bm25 import BM25Index
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.negatives import bm25_query
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.retrieval.evaluate import RankingScorer, write_results

    def run() -> dict[str, Any]:
        store = PassageStore.open(layout.kb_dir(data_dir))
        index = BM25Index(store)
        scorer = RankingScorer(store)
        for task in TASKS:
            examples = read_examples(layout.examples_path(data_dir, task, "dev"))
            rankings = [[index.ids[i] for i in index.search(bm25_query(e.query), 100)[0]] for e in examples]
            scorer.add_task(task, examples, rankings)
        result = scorer.result()
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

    from t5_retrieval import checkpoint, gin_utils, sharding
    from t5_retrieval.models.pretrained import minilm_l6_dir
    from t5_retrieval.train import build_model, init_params, initial_params, model_config

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/minilm_l6.gin"], [])
        config = model_config()
    finally:
        gin.clear_config()
    config["features"] = {"vocabulary": minilm_l6_dir(), "query_len": 128, "passage_len": 256,
                          "passage_template": "{title}: {text}",
                          "tasks": {t: {"dataset": t, "prefix": None, "index": i} for i, t in enumerate(TASKS)}}
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(0), sharding.make_mesh(), sharding.logical_axis_rules())
    params = initial_params(minilm_l6_dir(), params)
    checkpoint.write_config(model_dir, config)
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": params}, {})
    return {"init_from": minilm_l6_dir()}


# Every trained row fine-tunes MiniLM's query side over the zero-shot row's passage embeddings (the
# passage encoder stays MiniLM, so every row searches the zero-shot index): on this CPU a step then
# costs the queries' forward/backward only, and the KB is encoded once for all rows.
TRAIN_BINDINGS = (
    "LEARNING_RATE = 2e-5",
    "PER_DEVICE_BATCH = 32",
    "QUERY_LEN = 64",
    "NUM_NEGATIVES = 2",
    "NUM_STEPS = 200",
    "train.checkpoint_every = 50",
    "train.log_every = 20",
    "make_train_iterator.passage_template = '{title}: {text}'",
)

# The EMA horizon 1 / (1 - beta) scaled to the run: the paper's 0.999 (1,000 steps) would keep the
# zero-initialised EMA at a quarter of its signal after 300 steps, so the weights stay near uniform.
TACO_BINDINGS = ("multitask.taco.beta = 0.99",)


def trained_row(run_file: str, mixture: str, *bindings: str) -> Callable[..., None]:
    """A row trained with `runs/<run_file>` on `mixture`, from MiniLM, over its frozen passage embeddings
    (those of the zero-shot row in `base_dir`, by default the row's sibling `minilm_zeroshot`)."""

    def row(row_dir: str, data_dir: str, base_dir: str | None = None) -> None:
        from t5_retrieval.stages import index_and_evaluate, stage

        base_dir = base_dir or os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
        minilm_zeroshot_row(base_dir, data_dir)  # the base model and its index (done once, then skipped)
        model_dir = os.path.join(row_dir, "model")
        gin_bindings = [f"DATA_DIR = '{data_dir}'", f"MIXTURE = '{mixture}'", *TRAIN_BINDINGS,
                        f"train.init_from = '{os.path.join(base_dir, 'model')}'",
                        f"make_train_iterator.passage_embeddings = '{os.path.join(base_dir, 'embeddings')}'",
                        *bindings]
        stage(model_dir, f"train {run_file}",
              lambda: train_model(model_dir, ["models/minilm_l6.gin", f"runs/{run_file}"], gin_bindings))
        index_and_evaluate(row_dir, model_dir, data_dir, index_dir=os.path.join(base_dir, "index"))

    return row


# MT-DPR's confounders drop negatives that contain an answer only where an answer string means
# relevance: QA and slot filling (not FEVER's labels, WoW's replies or entity titles).
ANSWER_CHECKABLE = ("hotpotqa", "trex", "entityquestions")


def confounders_row(row_dir: str, data_dir: str) -> None:
    """MT-DPR's adversarial confounders: negatives mined by MiniLM (its top-110 minus gold pages and,
    for ANSWER_CHECKABLE tasks, minus answer-holding passages), then naive multi-task without prefix."""
    from t5_retrieval.stages import mine_stage

    base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
    minilm_zeroshot_row(base_dir, data_dir)
    negatives_dir = os.path.join(row_dir, "negatives")
    mine_stage(negatives_dir, os.path.join(base_dir, "model"), os.path.join(base_dir, "index"), data_dir, 110,
               ANSWER_CHECKABLE)
    trained_row("mt_dpr.gin", "mini_kilt_noprefix", f"NEGATIVES = '{negatives_dir}'")(row_dir, data_dir)


TASK_SPECIFIC_STEPS = 100  # per model: >= 1 epoch of every dataset's 32-query batches; 6 models cost 3x a row


def task_specific_row(row_dir: str, data_dir: str) -> None:
    """One model per dataset (naive, no prefix, TASK_SPECIFIC_STEPS steps of its own queries), each
    scored on its own dataset; the row's table joins the six."""
    from t5_retrieval.stages import stage

    base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
    for task in TASKS:
        trained_row("single_task.gin", f"mini_kilt_{task}_noprefix", f"NUM_STEPS = {TASK_SPECIFIC_STEPS}")(
            os.path.join(row_dir, task), data_dir, base_dir)
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
    from t5_retrieval.stages import stage

    experts_dir = os.path.join(os.path.dirname(row_dir), "task_specific")
    task_specific_row(experts_dir, data_dir)
    index_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot", "index")
    fusion_dir = os.path.join(row_dir, "fusion")

    def fuse() -> dict[str, Any]:
        argv = ["fuse", "--gin_file=runs/dpr_muf.gin", "--data_dir", data_dir, "--output_dir", fusion_dir,
                *(f"--expert={t},{os.path.join(experts_dir, t, 'model')},{index_dir}" for t in TASKS)]
        info = run_cli(argv)
        os.makedirs(os.path.join(row_dir, "eval"), exist_ok=True)
        shutil.copy(os.path.join(fusion_dir, "muf", "results.json"), os.path.join(row_dir, "eval", "results.json"))
        return info

    stage(fusion_dir, "DPR-MUF fusion", fuse)


QA_OPEN_TASKS = ("nq_open", "triviaqa_open", "webq", "curatedtrec")
QA_OPEN_KS = (5, 20, 100)
# runs/query_side.gin's 2 rounds, with 1 pass over the questions per round instead of 3: ~840 steps
# of 16 questions, about what a trained row's 200 x 32 queries cost here.
QUERY_SIDE_BINDINGS = ("--gin.QuerySideConfig.epochs_per_round=1",)


def query_side_row(row_dir: str, data_dir: str) -> None:
    """The thesis' query-side fine-tuning (`t5r query-side --gin_file=runs/query_side.gin`): MiniLM's
    query side adapted to the four qa_open question sets over the zero-shot index, positives = the
    passages of its top-100 that hold an answer. Scored on the mini-KILT dev sets like every row, and
    on the qa_open dev sets by answer-in-passage recall, next to BM25's (`qa_open_table`)."""
    from t5_retrieval.data import layout
    from t5_retrieval.stages import index_and_evaluate, stage

    base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
    minilm_zeroshot_row(base_dir, data_dir)
    model_dir, qa_dir = os.path.join(row_dir, "model"), qa_open_dir(data_dir)
    argv = ["query-side", "--gin_file=runs/query_side.gin", "--checkpoint_dir", os.path.join(base_dir, "model"),
            "--index_dir", os.path.join(base_dir, "index"), "--embeddings_dir", os.path.join(base_dir, "embeddings"),
            "--kb_dir", layout.kb_dir(data_dir), "--qa_dir", qa_dir, "--task", ",".join(QA_OPEN_TASKS),
            "--as_task", "hotpotqa", "--output_dir", model_dir, *QUERY_SIDE_BINDINGS]
    stage(model_dir, "query-side fine-tuning on qa_open", lambda: run_cli(argv))
    # Scored on the six datasets: the new qa_open tasks have no KILT dev files (see qa_open_table).
    index_and_evaluate(row_dir, model_dir, data_dir, index_dir=os.path.join(base_dir, "index"), datasets=TASKS)
    stage(os.path.join(row_dir, "qa_open_bm25"), "BM25 answer recall on qa_open",
          lambda: bm25_answer_recall(data_dir, qa_dir))


def qa_open_dir(data_dir: str) -> str:
    """The qa_open questions beside the mini-KILT files the prepared KB was read from."""
    from t5_retrieval.data import layout

    with open(os.path.join(layout.kb_dir(data_dir), "manifest.json")) as f:
        source = json.load(f)["source"]
    qa_dir = os.path.join(os.path.dirname(os.path.dirname(source)), "qa_open")
    if not os.path.isdir(qa_dir):
        raise FileNotFoundError(f"{qa_dir}: no qa_open directory beside the KB source {source}")
    return qa_dir


def bm25_answer_recall(data_dir: str, qa_dir: str, tasks: tuple[str, ...] = QA_OPEN_TASKS) -> dict[str, Any]:
    """BM25's answer-in-passage recall@QA_OPEN_KS on each task's dev questions (as the data's reference)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.bm25 import BM25Index
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.qa_open import AnswerTexts, read_qa_task
    from t5_retrieval.query_side import ranking_answer_recall

    store = PassageStore.open(layout.kb_dir(data_dir))
    index, texts = BM25Index(store), AnswerTexts(store)
    recall = {}
    for name in tasks:
        task = read_qa_task(qa_dir, name, "dev")
        rankings = [[index.ids[i] for i in index.search(e.query, max(QA_OPEN_KS))[0]] for e in task.examples]
        recall[name] = ranking_answer_recall(texts, task, rankings, QA_OPEN_KS)
    return {"dev": recall}


def run_cli(argv: list[str]) -> dict[str, Any]:
    """`t5r <argv>` in-process; raises if it fails. Returns the command for the stage record."""
    import gin

    from t5_retrieval import cli

    try:
        if cli.main(argv) != 0:
            raise RuntimeError(f"t5r {argv[0]} failed: t5r {' '.join(argv)}")
    finally:
        gin.clear_config()
    return {"command": "t5r " + " ".join(argv)}


def qa_open_table(work_dir: str) -> str:
    """Answer-in-passage recall@5/20/100 on the qa_open dev sets: BM25, MiniLM zero-shot, query-side."""
    from t5_retrieval.query_side import REPORT_FILE

    row_dir = os.path.join(work_dir, "query_side")
    report_path, bm25_path = os.path.join(row_dir, "model", REPORT_FILE), os.path.join(row_dir, "qa_open_bm25", DONE)
    if not (os.path.exists(report_path) and os.path.exists(bm25_path)):
        return ""
    with open(report_path) as f:
        report = json.load(f)
    with open(bm25_path) as f:
        bm25 = json.load(f)["dev"]
    header = "| retriever | " + " | ".join(f"{t} R@{k}" for t in QA_OPEN_TASKS for k in QA_OPEN_KS) + " |"
    lines = [header, "|" + "---|" * (1 + len(QA_OPEN_TASKS) * len(QA_OPEN_KS))]
    for title, recall in (("BM25", bm25), ("MiniLM-L6 zero-shot", report["dev_before"]),
                          ("query-side fine-tuned", report["dev_after"])):
        cells = [f"{recall[t][f'answer_recall@{k}']:.3f}" for t in QA_OPEN_TASKS for k in QA_OPEN_KS]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# No pretrained T5 can be had offline, so the T5 rows start from scratch: t5_tiny shapes (2 layers,
# d_model 64) over a 4k sentencepiece vocabulary trained on the KB. Both sides train (ST5-EncDec
# shares one T5), so each row encodes the KB with its own model. They measure GDMTL against the same
# T5 trained without its generative objective, not against the pretrained MiniLM rows.
T5_SCRATCH_BINDINGS = (
    "VOCAB_SIZE = 4096",
    "DROPOUT = 0.0",
    "LEARNING_RATE = 2e-3",
    "PER_DEVICE_BATCH = 48",
    "QUERY_LEN = 64",
    "PASSAGE_LEN = 128",
    "NUM_NEGATIVES = 1",
    "NUM_STEPS = 1000",
    "train.checkpoint_every = 250",
    "train.log_every = 50",
    "make_train_iterator.passage_template = '{title}: {text}'",
)
T5_VOCAB_SIZE = 4096 - 100  # T5Config.vocab_size counts the 100 sentinel ids on top of the pieces


def t5_scratch_row(run_file: str) -> Callable[..., None]:
    """A T5 row trained with `runs/<run_file>` from scratch on mini-KILT without prefixes."""

    def row(row_dir: str, data_dir: str) -> None:
        from t5_retrieval.stages import index_and_evaluate, stage

        vocab_dir = os.path.join(os.path.dirname(row_dir), "t5_vocabulary")
        stage(vocab_dir, "T5 vocabulary", lambda: train_t5_vocabulary(data_dir, vocab_dir))
        model_dir = os.path.join(row_dir, "model")
        gin_bindings = [f"DATA_DIR = '{data_dir}'", "MIXTURE = 'mini_kilt_noprefix'", *T5_SCRATCH_BINDINGS,
                        f"VOCABULARY = '{os.path.join(vocab_dir, 'spm.model')}'"]
        stage(model_dir, f"train {run_file} (T5 from scratch)",
              lambda: train_model(model_dir, ["models/t5_tiny.gin", f"runs/{run_file}"], gin_bindings))
        index_and_evaluate(row_dir, model_dir, data_dir)

    return row


def train_t5_vocabulary(data_dir: str, vocab_dir: str) -> dict[str, Any]:
    from t5_retrieval.data import layout
    from t5_retrieval.data.vocab import train_vocabulary

    return {"model": train_vocabulary(layout.kb_dir(data_dir), os.path.join(vocab_dir, "spm"), T5_VOCAB_SIZE)}


def train_model(model_dir: str, gin_files: list[str], bindings: list[str]) -> dict[str, Any]:
    """`t5r train --gin_file=<gin files> --gin.<bindings>` in-process."""
    import gin

    from t5_retrieval import gin_utils
    from t5_retrieval.train import train

    gin.clear_config()
    try:
        gin_utils.parse_gin(gin_files, bindings)
        state = train(model_dir)
    finally:
        gin.clear_config()
    return {"steps": int(state.step), "gin_files": gin_files, "bindings": bindings}


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


PROBE_ROWS = ("naive_noprefix", "naive_prefix", "taco")  # the specialisation analysis compares these
TACO_ROWS = ("taco", "taco_nonzero_median")  # and the weights these used in training (their final EMA)
PROBE_BATCHES, PROBE_BETA, PROBE_SEED = 50, 0.98, 1  # EMA at 1 - 0.98^50 = 64% of its signal


def sensitivity_analysis(work_dir: str) -> None:
    """TACO paper Fig. 1-2 for the finished rows of PROBE_ROWS: each trained model's task
    sensitivities probed on the same 50 training batches (`multitask.probe`), plus the final EMA
    of the TACO_ROWS runs (the weights they trained with); figures and analysis.json in `<work_dir>/analysis/<name>`."""
    from t5_retrieval.multitask.analysis import load_state_npz, write_analysis
    from t5_retrieval.stages import is_done, stage
    from t5_retrieval.train import TACO_STATE_FILE

    for name in PROBE_ROWS:
        model_dir = os.path.join(work_dir, name, "model")
        if is_done(model_dir):
            out = os.path.join(work_dir, "analysis", name)
            stage(out, f"sensitivity probe {name}", lambda: probe_model(model_dir, out))
    for name in TACO_ROWS:
        taco_state = os.path.join(work_dir, name, "model", TACO_STATE_FILE)
        if os.path.exists(taco_state):
            out = os.path.join(work_dir, "analysis", f"{name}_training")
            stage(out, f"{name} training state analysis",
                  lambda: analysis_numbers(write_analysis(*load_state_npz(taco_state), tau=2.0, out_dir=out)))


def probe_model(model_dir: str, out_dir: str) -> dict[str, Any]:
    """Probes a row's trained model on batches of its own training data (seed PROBE_SEED)."""
    import gin

    from t5_retrieval import gin_utils, sharding
    from t5_retrieval.data.batches import make_train_iterator
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.multitask.analysis import save_state_npz, write_analysis
    from t5_retrieval.multitask.probe import probe_sensitivities
    from t5_retrieval.stages import DONE

    with open(os.path.join(model_dir, DONE)) as f:
        trained = json.load(f)
    gin.clear_config()
    try:
        gin_utils.parse_gin(trained["gin_files"], trained["bindings"])
        batches = make_train_iterator(per_device_batch=gin.query_parameter("%PER_DEVICE_BATCH"), seed=PROBE_SEED)
    finally:
        gin.clear_config()
    encoder = load_encoder(model_dir)
    ema = probe_sensitivities(encoder.model, encoder.params, batches, batches.task_names, PROBE_BATCHES, PROBE_BETA,
                              encoder.config["dual_encoder"]["logit_scale"], sharding.make_mesh())
    save_state_npz(ema, batches.task_names, os.path.join(out_dir, "probe_state.npz"))
    return analysis_numbers(write_analysis(ema, batches.task_names, tau=2.0, out_dir=out_dir))


def analysis_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("task_specific_fraction", "not_activated_fraction", "mean_entropy", "max_entropy")}


def analysis_table(work_dir: str) -> str:
    """One line per analysed model: specialised / not-activated share and mean task entropy."""
    lines = []
    analysed = [(n, n, f"probe, {PROBE_BATCHES} batches, beta {PROBE_BETA}") for n in PROBE_ROWS]
    analysed += [(f"{n}_training", n, "its training EMA") for n in TACO_ROWS]
    for name, row, source in analysed:
        path = os.path.join(work_dir, "analysis", name, DONE)
        if os.path.exists(path):
            with open(path) as f:
                a = json.load(f)
            title = ROWS[row][0]
            lines.append(f"| {title} | {source} | {100 * a['task_specific_fraction']:.2f}% | "
                         f"{100 * a['not_activated_fraction']:.2f}% | {a['mean_entropy']:.3f} ({a['max_entropy']:.3f}) |")
    if not lines:
        return ""
    return "\n".join(["| model | sensitivities | task specific (entropy < 0.3) | not activated | mean entropy (max) |",
                      "|---|---|---|---|---|", *lines]) + "\n"


def markdown_table(work_dir: str) -> str:
    """Page-level R-precision / recall@20 per task and their unweighted mean, one line per finished row."""
    header = "| row | " + " | ".join(f"{t} {c}" for t in (*TASKS, "mean") for _, c in COLUMNS) + " | wall time |"
    lines = [header, "|" + "---|" * (2 + 2 * (len(TASKS) + 1))]
    for name, (title, _) in ROWS.items():
        path = os.path.join(work_dir, name, "eval", "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            tables = json.load(f)
        values = {t: [dataset_table(tables, t)[k] for k, _ in COLUMNS] for t in TASKS}
        values["mean"] = [sum(values[t][i] for t in TASKS) / len(TASKS) for i in range(len(COLUMNS))]
        cells = [f"{v:.3f}" for t in (*TASKS, "mean") for v in values[t]]
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {row_seconds(os.path.join(work_dir, name)):.0f} s |")
    return "\n".join(lines) + "\n"


def dataset_table(tables: dict[str, Any], dataset: str) -> dict[str, Any]:
    """A dataset's entry of a `t5r eval` table, keyed by the model's name for it (the dataset itself,
    or the registered `mini_kilt_{dataset}` task in any prefix variant)."""
    for name in (dataset, *(f"mini_kilt_{dataset}{v}" for v in ("", "_noprefix", "_typed"))):
        if name in tables:
            return tables[name]
    raise KeyError(f"no table for {dataset} among {sorted(tables)}")


def row_seconds(row_dir: str) -> float:
    """Wall time of a row: the sum of its stages' recorded durations."""
    total = 0.0
    for root, _, files in os.walk(row_dir):
        if DONE in files:
            with open(os.path.join(root, DONE)) as f:
                total += float(json.load(f).get("seconds", 0.0))
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r results", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the mini-KILT directory (../shared/data/mini_kilt)")
    parser.add_argument("--work_dir", required=True, help="where every row writes (resumed if it exists)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"t5r results: error: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    logs.setup()
    data_dir = os.path.join(args.work_dir, "data")
    prepare_data(os.path.abspath(args.data), data_dir)
    for name in rows:
        start = time.time()
        ROWS[name][1](os.path.join(args.work_dir, name), data_dir)
        log.info("results: row %s done in %.0f s", name, time.time() - start)
    sensitivity_analysis(args.work_dir)
    table = "\n".join(t for t in (markdown_table(args.work_dir), analysis_table(args.work_dir),
                                   qa_open_table(args.work_dir)) if t)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table, end="")
    return 0
