"""A user's own seqio Task over `kilt_examples_source` whose preprocessor rewrites the query text,
registered in `my_tasks.py` in the working directory, taken through the CLI as docs/tasks.md shows it:
BM25 negatives of the rewritten text, training, eval and mining with `--data_dir` alone, every
per-task file named by one rule; then `t5r data slice`, a moved query-side model resumed, and
`t5r checksum` of an export.

Every `t5r` command runs in-process through `cli.main`, from the user's working directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import gin
import numpy as np
import pytest
from conftest import prepare_small_demo

from t5_retrieval import checksums, cli
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples, read_negatives

MY_TASKS = '''
"""The user's Tasks: KILT fever, its query text rewritten (lower-cased, the claim's subject dropped)."""
import seqio
import tensorflow as tf

from t5_retrieval.tasks import add_retrieval_task, kilt_examples_source


def without_subject(ds):
    def rewrite(ex):
        words = tf.strings.split(tf.strings.lower(ex["query"]))[2:]
        return {**ex, "query": tf.strings.reduce_join(words, separator=" ")}
    return ds.map(rewrite)


add_retrieval_task("my_fever_lc", kilt_examples_source("fever", num_train=8, num_dev=2),
                   preprocessors=[without_subject], query_len=24)
if "my_mix" in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove("my_mix")
seqio.MixtureRegistry.add("my_mix", [("my_fever_lc", 1.0), ("demo_nq", 1.0)])
'''
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin", "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=32",
        "--gin.D_FF=64", "--gin.NUM_LAYERS=1", "--gin.NUM_NEGATIVES=1", "--gin.QUERY_LEN=24",
        "--gin.PASSAGE_LEN=32", "--gin.PER_DEVICE_BATCH=4"]


def rewritten(query: str) -> str:
    """What `without_subject` makes of a query."""
    return " ".join(query.lower().split()[2:])


def t5r(*argv: str) -> int:
    try:
        return cli.main(list(argv))
    finally:
        gin.clear_config()


class Logged(logging.Handler):
    """Every log line of the commands run while it is attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger().removeHandler(self)


def forget_my_tasks() -> None:
    """As in a new process: my_tasks not imported, its Task and Mixture not registered."""
    import sys

    import seqio

    seqio.MixtureRegistry.remove("my_mix")
    seqio.TaskRegistry.remove("my_fever_lc")
    sys.modules.pop("my_tasks", None)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The user's working directory: `data/` (the demo's fever and nq, BM25 negatives of both),
    `data/spm.model` and `my_tasks.py`."""
    from t5_retrieval.data.kilt.prepare import prepare_tasks
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    root = tmp_path_factory.mktemp("own_task")
    data_dir = prepare_small_demo(root, ("fever", "nq"))
    prepare_tasks(str(root / "raw"), data_dir, ["fever", "nq"], ("dev",))
    train_vocabulary(layout.kb_dir(data_dir), os.path.join(data_dir, "spm"), vocab_size=400)
    work = root / "work"
    work.mkdir()
    os.symlink(data_dir, work / "data")
    (work / "my_tasks.py").write_text(MY_TASKS)
    return work


@pytest.fixture(scope="module")
def model(work):
    """`t5r data negatives` for my_fever_lc, then a tiny model `t5r train` trains on my_mix, its
    embeddings and index: the commands of docs/tasks.md, from the working directory."""
    with pytest.MonkeyPatch.context() as patch, Logged() as logged:
        patch.chdir(work)
        assert t5r("data", "negatives", "--data_dir=data", "--tasks=my_fever_lc", "--task_module=my_tasks",
                   "--top_k=5") == 0
        assert t5r("train", "--model_dir=model", *TINY, "--gin.MIXTURE_OR_TASK_MODULE='my_tasks'",
                   "--gin.MIXTURE_OR_TASK_NAME='my_mix'", "--gin.DATA_DIR='data'",
                   "--gin.VOCABULARY='data/spm.model'", "--gin.TRAIN_STEPS=2") == 0
        assert t5r("encode", "--checkpoint_dir=model", "--kb_dir=data/kb", "--output_dir=emb") == 0
        assert t5r("index", "--embeddings_dir=emb", "--output_dir=index") == 0
    return {"train_log": logged.lines}


def test_the_negatives_of_a_rewritten_query_text_are_written_where_training_reads_them(work, model):
    import dataclasses

    from t5_retrieval.data.kilt.negatives import mine_bm25_negatives
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.retrieval.index import build_bm25_index

    bm25 = layout.negatives_dir(str(work / "data"))
    own, shared = (read_negatives(layout.negatives_path(bm25, name)) for name in ("my_fever_lc", "fever"))
    examples = read_examples(layout.examples_path(str(work / "data"), "fever", "train"))
    store = PassageStore.open(str(work / "data" / "kb"))
    expected = {row.id: row.negatives for row in mine_bm25_negatives(
        [dataclasses.replace(e, query=rewritten(e.query)) for e in examples], build_bm25_index(store), store, 5)}
    assert own == expected, "my_fever_lc-train.jsonl holds BM25 negatives of the Task's rewritten text"
    assert own != shared, "the rewritten text has other negatives than the dataset's text as written"
    read = [line for line in model["train_log"] if "hard negatives from" in line]
    assert read == [f"task my_fever_lc: hard negatives from {work}/data/negatives/bm25/my_fever_lc-train.jsonl",
                    f"task demo_nq: hard negatives from {work}/data/negatives/bm25/nq-train.jsonl"], read


def test_an_own_task_reading_its_datasets_negatives_is_warned_with_the_command_that_writes_its_own(
        work, model, monkeypatch, caplog):
    """A negatives directory with the dataset's file alone (what an older t5r wrote for every Task
    of fever): training reads it, and says the text differs and what to run."""
    monkeypatch.chdir(work)
    os.makedirs("older/negatives/bm25")
    for part in ("kb", "examples"):
        os.symlink(os.path.realpath(f"data/{part}"), f"older/{part}")
    for name in ("fever", "nq"):
        shutil.copy(f"data/negatives/bm25/{name}-train.jsonl", "older/negatives/bm25")
    caplog.set_level(logging.INFO)
    assert t5r("train", "--model_dir=older_model", *TINY, "--gin.MIXTURE_OR_TASK_MODULE='my_tasks'",
               "--gin.MIXTURE_OR_TASK_NAME='my_mix'", "--gin.DATA_DIR='older'",
               "--gin.VOCABULARY='data/spm.model'", "--gin.TRAIN_STEPS=1") == 0
    older = f"{work}/older/negatives/bm25"
    assert f"task my_fever_lc: hard negatives from {older}/fever-train.jsonl" in caplog.messages
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "my_fever_lc" in
                  r.getMessage()]
    assert "rewrite the query text" in warning and f"{older}/fever-train.jsonl" in warning, warning
    command = warning.split("`")[1]
    assert command == (f"PYTHONPATH={work} t5r data negatives --data_dir={work}/older --tasks=my_fever_lc "
                       "--task_module=my_tasks"), command
    assert t5r(*command.split()[2:], "--top_k=5") == 0, command
    assert read_negatives(f"{older}/my_fever_lc-train.jsonl") == \
        read_negatives("data/negatives/bm25/my_fever_lc-train.jsonl")


def test_eval_and_mine_of_an_own_task_need_data_dir_alone_and_name_files_by_task(work, model, monkeypatch):
    monkeypatch.chdir(work)
    forget_my_tasks()
    search = ["--checkpoint_dir=model", "--index_dir=index", "--data_dir=data", "--task_module=my_tasks"]
    tables = {}
    for given in ("", "my_fever_lc,demo_nq", "fever,nq", "my_mix"):
        out = f"eval_{given.replace(',', '_') or 'all'}"
        assert t5r("eval", *search, *([f"--tasks={given}"] if given else []), f"--output_dir={out}") == 0, given
        with open(f"{out}/results.json") as f:
            tables[given] = json.load(f)
        assert sorted(os.listdir(f"{out}/predictions")) == ["demo_nq.jsonl", "demo_nq.trec", "my_fever_lc.jsonl",
                                                            "my_fever_lc.trec"], given
    assert sorted(tables[""]) == ["demo_nq", "my_fever_lc"], tables[""]
    assert all(table == tables[""] for table in tables.values()), \
        "results are keyed by the model's task names, whichever names --tasks gives"
    with open("eval_all/predictions/my_fever_lc.jsonl") as f:
        inputs = {row["id"]: row["input"] for row in map(json.loads, f)}
    dev = read_examples(layout.examples_path("data", "fever", "dev"))
    assert inputs == {e.id: rewritten(e.query) for e in dev}, "the Task's text is what was searched"

    # Mined negatives are named as training reads them: the rewritten Task's by its name, demo_nq's
    # by its dataset (its text is the dataset's as written), and a run on them reads both.
    assert t5r("mine", *search, "--source=ance-1") == 0
    mined = sorted(os.listdir("data/negatives/ance-1"))
    assert mined == ["my_fever_lc-train.jsonl", "nq-train.jsonl"], mined
    train = read_examples(layout.examples_path("data", "fever", "train"))
    assert set(read_negatives("data/negatives/ance-1/my_fever_lc-train.jsonl")) == {e.id for e in train}
    with Logged() as logged:
        assert t5r("train", "--model_dir=episode_1", *TINY, "--gin.MIXTURE_OR_TASK_MODULE='my_tasks'",
                   "--gin.MIXTURE_OR_TASK_NAME='my_mix'", "--gin.DATA_DIR='data'",
                   "--gin.VOCABULARY='data/spm.model'", "--gin.NEGATIVES='data/negatives/ance-1'",
                   "--gin.TRAIN_STEPS=1") == 0
    read = [line for line in logged.lines if "hard negatives from" in line]
    assert read == [f"task my_fever_lc: hard negatives from {work}/data/negatives/ance-1/my_fever_lc-train.jsonl",
                    f"task demo_nq: hard negatives from {work}/data/negatives/ance-1/nq-train.jsonl"], read


def test_a_bm25_eval_of_an_own_task_imports_its_module_and_searches_its_query_text(work, monkeypatch):
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.retrieval.bm25_index import build_bm25_index

    monkeypatch.chdir(work)
    forget_my_tasks()
    assert t5r("index", "--backend=bm25", "--kb_dir=data/kb", "--output_dir=bm25") == 0
    assert t5r("eval", "--index_dir=bm25", "--data_dir=data", "--tasks=my_fever_lc,nq", "--task_module=my_tasks",
               "--output_dir=eval_bm25") == 0
    assert sorted(os.listdir("eval_bm25/predictions")) == ["my_fever_lc.jsonl", "my_fever_lc.trec", "nq.jsonl",
                                                           "nq.trec"]
    with open("eval_bm25/predictions/my_fever_lc.jsonl") as f:
        rows = [json.loads(line) for line in f]
    dev = read_examples(layout.examples_path("data", "fever", "dev"))
    assert {row["id"]: row["input"] for row in rows} == {e.id: rewritten(e.query) for e in dev}, \
        "BM25 searches the Task's text"
    _, scores = build_bm25_index(PassageStore.open("data/kb")).search([rewritten(e.query) for e in dev], 5)
    with open("eval_bm25/predictions/my_fever_lc.trec") as f:
        run = [line.split() for line in f]
    got = [[float(score) for qid, _, _, rank, score, _ in run if qid == e.id and int(rank) <= 5] for e in dev]
    np.testing.assert_allclose(got, scores, rtol=1e-6, err_msg="the run's top-5 is BM25's for the rewritten text")


def readme_slice_commands() -> list[str]:
    """README's data stages on the shipped slice (the bash block after "On the real-data slice")."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        section = f.read().split("## Stage by stage", 1)[1].split("On the real-data slice", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_data_slice_unpacks_the_shipped_slice_for_readmes_data_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    commands = readme_slice_commands()
    assert commands[0] == "t5r data slice --out=run", commands
    for line in commands:
        assert t5r(*line.split()[1:]) == 0, line
    with open("run/mini_kilt_slice/stats.json") as f:
        stats = json.load(f)
    for task, counts in stats["tasks"].items():
        for split in ("train", "dev"):
            assert len(read_examples(layout.examples_path("data", task, split))) == counts[split], (task, split)
        assert len(read_negatives(layout.negatives_path(layout.negatives_dir("data"), task))) == counts["train"]
    assert t5r("checksum", "run/mini_kilt_slice") == 0, "the unpacked slice is verified like any artefact"
    capsys.readouterr()
    assert t5r("data", "slice", "--out=run") == 0, "a second unpack verifies and reuses the first"
    printed = capsys.readouterr().out
    assert printed.startswith("run/mini_kilt_slice: the demo slice of mini-KILT") and \
        "next: t5r data kb --source=run/mini_kilt_slice/kb/passages.jsonl --data_dir=data" in printed, printed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_model import build_tiny_run

    return build_tiny_run(str(tmp_path_factory.mktemp("tiny")))


def test_a_moved_query_side_model_resumes_keeping_its_relative_base(tiny, tmp_path, monkeypatch):
    """A query-side model trained over its base's stored passage embeddings, copied with its base
    to another directory and resumed there: its query_side.json keeps naming the base beside it."""
    from t5_retrieval.checkpoint import base_dir_of, read_base_record

    root = os.path.dirname(tiny.model_dirs[0])
    first, moved = tmp_path / "first", tmp_path / "moved"
    first.mkdir()
    shutil.copytree(tiny.model_dirs[0], first / "base")
    emb = os.path.join(root, "emb_0")
    monkeypatch.chdir(first)
    assert t5r("train", "--model_dir=query_side", *TINY, "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']",
               f"--gin.DATA_DIR='{tiny.data_dir}'", f"--gin.VOCABULARY='{tiny.vocabulary}'", "--gin.QUERY_LEN=16",
               "--gin.TRAIN_STEPS=1", f"--gin.make_train_iterator.passage_embeddings='{emb}'",
               "--gin.train.init_from='base'", "--gin.train.checkpoint_every=1") == 0
    assert read_base_record("query_side")["base_checkpoint"] == "../base"
    shutil.copytree(first, moved)
    monkeypatch.chdir(tmp_path)
    assert t5r("train", "--gin_file=moved/query_side/config.gin", "--model_dir=moved/query_side",
               "--gin.train.num_steps=2") == 0
    assert sorted(int(s) for s in os.listdir(moved / "query_side") if s.isdigit())[-1] == 2, "it resumed"
    assert read_base_record(str(moved / "query_side"))["base_checkpoint"] == "../base"
    assert base_dir_of(str(moved / "query_side")) == str(moved / "base")


def test_checksum_verifies_an_export_without_writing_a_stamp_into_it(tiny, tmp_path):
    out = str(tmp_path / "export")
    assert t5r("export-hf", f"--checkpoint_dir={tiny.model_dirs[0]}", f"--output_dir={out}") == 0
    shipped = sorted(checksums.artefact_files(out))
    assert not os.path.exists(os.path.join(out, checksums.STAMP_FILE))
    assert t5r("checksum", out) == 0
    assert not os.path.exists(os.path.join(out, checksums.STAMP_FILE)), \
        "t5r checksum wrote this machine's stamp into an export made to be copied"
    assert sorted(checksums.artefact_files(out)) == shipped
    # Any other artefact keeps its stamp, so its next open hashes only what changed.
    assert t5r("checksum", tiny.index_dirs[0]) == 0
    assert os.path.exists(os.path.join(tiny.index_dirs[0], checksums.STAMP_FILE))
