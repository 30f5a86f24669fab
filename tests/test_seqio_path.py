"""The seqio data path as a t5x user takes it: their own Tasks (own source, a preprocessor that
rewrites the query) and a Mixture with their own 3:1 rates, registered in their own module and
trained by `t5r train` with t5x's launch names; the batches, a resume, the operative config and the
Task cache checked."""

from __future__ import annotations

import importlib
import json
import linecache
import os
import shutil
import sys

import gin
import pytest

from t5_retrieval.errors import UserError

from t5_retrieval import cli, gin_utils
from t5_retrieval.commands import gin_flags
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples, read_negatives

USER_MODULE = '''
"""A user's Tasks: their own jsonl rows, their own field names, a query rewrite."""
import functools
import json

import seqio
import tensorflow as tf

from t5_retrieval.tasks import add_retrieval_task

ROWS = {rows!r}


def user_rows(split, shuffle_files, seed=None, *, name):
    with open(f"{{ROWS}}/{{name}}-{{split}}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return tf.data.Dataset.from_tensor_slices({{
        "qid": [r["qid"] for r in rows], "question": [r["question"] for r in rows],
        "answer_passage": [r["answer_passage"] for r in rows],
        "hard": tf.ragged.constant([r["hard"] for r in rows], dtype=tf.string, ragged_rank=1),
        "gold": tf.ragged.constant([r["gold"] for r in rows], dtype=tf.string, ragged_rank=1)}})


def to_retrieval_features(ds):
    return ds.map(lambda ex: {{"id": ex["qid"], "query": ex["question"], "positive": ex["answer_passage"],
                              "negatives": ex["hard"], "gold_pages": ex["gold"]}})


def rewrite_query(ds):
    return ds.map(lambda ex: {{**ex, "query": tf.strings.join(["{word}", ex["query"]], separator=" ")}})


for name in ("user_fever", "user_nq"):
    add_retrieval_task(name, seqio.FunctionDataSource(functools.partial(user_rows, name=name),
                                                      splits=("train", "validation")),
                       preprocessors=[to_retrieval_features, rewrite_query])
if "user_mix" in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove("user_mix")
seqio.MixtureRegistry.add("user_mix", [("user_fever", 3.0), ("user_nq", 1.0)])
'''
MODULE_NAME = "my_retrieval_tasks"
STEPS, CHECKPOINT_EVERY, BATCH = 4, 2, 8


@pytest.fixture(scope="module")
def user_setup(tmp_path_factory):
    """Demo data (KB, examples, BM25 negatives), a vocabulary, and the user's rows written from the
    demo's fever and nq examples in the user's own format."""
    from t5_retrieval.data.kilt.synthetic import write_demo
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    root = tmp_path_factory.mktemp("seqio_path")
    raw, data_dir, rows, module_dir = (str(root / d) for d in ("raw", "data", "rows", "module"))
    write_demo(raw, num_pages=40, train_per_task=12, dev_per_task=4)
    prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data_dir)
    prepare_tasks(raw, data_dir, ["fever", "nq"], ("train", "dev"))
    prepare_negatives(data_dir, ["fever", "nq"], top_k=4)
    vocabulary = train_vocabulary(layout.kb_dir(data_dir), os.path.join(data_dir, "spm"), vocab_size=400)
    os.makedirs(rows)
    for dataset in ("fever", "nq"):
        negatives = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "bm25"), dataset, "train"))
        for split, theirs in (("train", "train"), ("validation", "dev")):
            with open(os.path.join(rows, f"user_{dataset}-{split}.jsonl"), "w") as f:
                for e in read_examples(layout.examples_path(data_dir, dataset, theirs)):
                    f.write(json.dumps({"qid": e.id, "question": e.query, "answer_passage": e.positive_passages[0],
                                        "hard": list(negatives.get(e.id, ())),
                                        "gold": sorted({p for s in e.gold_pages for p in s})}) + "\n")
    os.makedirs(module_dir)
    return {"root": str(root), "data_dir": data_dir, "vocabulary": vocabulary, "rows": rows, "module_dir": module_dir}


def write_user_module(setup: dict, word: str) -> None:
    with open(os.path.join(setup["module_dir"], f"{MODULE_NAME}.py"), "w") as f:
        f.write(USER_MODULE.format(rows=setup["rows"], word=word))
    importlib.invalidate_caches()
    linecache.checkcache()  # TF's autograph reads a lambda's source through linecache
    if MODULE_NAME in sys.modules:
        importlib.reload(sys.modules[MODULE_NAME])


def train_argv(setup: dict, model_dir: str, *extra: str) -> list[str]:
    return ["train", "--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.MIXTURE_OR_TASK_MODULE='{MODULE_NAME}'",
            "--gin.MIXTURE_OR_TASK_NAME='user_mix'", f"--gin.TRAIN_STEPS={STEPS}",
            f"--gin.DATA_DIR='{setup['data_dir']}'", f"--gin.VOCABULARY='{setup['vocabulary']}'",
            "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=32", "--gin.D_FF=64", "--gin.NUM_LAYERS=1",
            "--gin.NUM_NEGATIVES=1", "--gin.QUERY_LEN=24", "--gin.PASSAGE_LEN=32", f"--gin.PER_DEVICE_BATCH={BATCH}",
            f"--gin.train.checkpoint_every={CHECKPOINT_EVERY}", "--gin.train.log_every=1", *extra]


def t5r(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    finally:
        gin.clear_config()


def losses(model_dir: str) -> dict[int, float]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def iterator_from(config_gin: str):
    from t5_retrieval.data.batching.batches import make_train_iterator

    gin.clear_config()
    try:
        gin_utils.parse_gin([config_gin], [])
        return make_train_iterator(per_device_batch=BATCH)
    finally:
        gin.clear_config()


def decoded_queries(it, batch, vocabulary) -> dict[str, list[str]]:
    from t5_retrieval.data.tokenizers.tokenize import load_vocabulary

    vocab = load_vocabulary(vocabulary)
    return {task: [vocab.decode([int(t) for t in row if t > 1]) for row in sub["query_tokens"]]
            for task, sub in batch.items()}


def test_a_user_mixture_trains_through_t5r_with_its_rates_rewrite_resume_and_config(user_setup, monkeypatch):
    from t5_retrieval import checkpoint

    monkeypatch.syspath_prepend(user_setup["module_dir"])
    write_user_module(user_setup, "REWRITTEN")
    model_dir = os.path.join(user_setup["root"], "model")
    assert t5r(train_argv(user_setup, model_dir)) == 0

    tasks = checkpoint.read_config(model_dir)["features"]["tasks"]
    read_as = {"query_len": 24, "truncation": "beginning"}  # --gin.QUERY_LEN=24 for every task
    assert tasks == {"user_fever": {"dataset": "user_fever", "prefix": None, "index": 0, **read_as},
                     "user_nq": {"dataset": "user_nq", "prefix": None, "index": 1, **read_as}}, \
        "the Mixture's Tasks, in the order the user declared them"
    config_gin = os.path.join(model_dir, "config.gin")
    assert "user_mix" in open(config_gin).read() and MODULE_NAME in open(config_gin).read()

    # The batches the run trained on: 3:1 sub-batches, every query rewritten by the user's preprocessor.
    it = iterator_from(config_gin)
    assert it.task_names == ["user_fever", "user_nq"] and it.subbatch_sizes == [6, 2]
    batch = next(it)
    queries = decoded_queries(it, batch, user_setup["vocabulary"])
    assert [len(q) for q in queries.values()] == [6, 2]
    assert all(q.startswith("REWRITTEN") for qs in queries.values() for q in qs), queries

    # A run killed after its step-2 checkpoint resumes to the same losses.
    first = losses(model_dir)
    assert sorted(first) == list(range(1, STEPS + 1))
    shutil.rmtree(os.path.join(model_dir, str(STEPS)))
    assert t5r(train_argv(user_setup, model_dir)) == 0
    assert losses(model_dir) == first, "resuming from step 2 must give the same steps 3 and 4"

    # Evaluation reads the user Tasks' validation split through seqio (no KILT examples file), with
    # the rewrite, and scores exactly as the same queries and gold pages written as KILT files.
    data_dir = user_setup["data_dir"]
    embeddings, index = os.path.join(user_setup["root"], "emb"), os.path.join(user_setup["root"], "index")
    assert t5r(["encode", f"--checkpoint_dir={model_dir}", f"--kb_dir={data_dir}/kb", f"--output_dir={embeddings}"]) == 0
    assert t5r(["index", f"--embeddings_dir={embeddings}", f"--output_dir={index}"]) == 0
    evaluate = ["eval", f"--checkpoint_dir={model_dir}", f"--index_dir={index}", f"--data_dir={data_dir}",
                "--split=validation", "--tasks=user_mix", f"--gin.MIXTURE_OR_TASK_MODULE='{MODULE_NAME}'"]
    assert t5r([*evaluate, f"--output_dir={user_setup['root']}/eval_seqio"]) == 0
    for dataset in ("fever", "nq"):
        with open(layout.examples_path(data_dir, f"user_{dataset}", "validation"), "w") as f:
            for e in read_examples(layout.examples_path(data_dir, dataset, "dev")):
                row = {"id": e.id, "task": f"user_{dataset}", "query": f"REWRITTEN {e.query}",
                       "gold_pages": [[p] for p in sorted({p for s in e.gold_pages for p in s})],
                       "positive_passages": list(e.positive_passages[:1])}
                f.write(json.dumps(row) + "\n")
    assert t5r([*evaluate, f"--output_dir={user_setup['root']}/eval_files"]) == 0
    for dataset in ("fever", "nq"):
        os.remove(layout.examples_path(data_dir, f"user_{dataset}", "validation"))
    scores = [json.load(open(f"{user_setup['root']}/{d}/results.json")) for d in ("eval_seqio", "eval_files")]
    assert set(scores[0]) >= {"user_fever", "user_nq"}, scores[0]
    assert scores[0] == scores[1]

    # The operative config alone runs the same training again.
    again = os.path.join(user_setup["root"], "from_config")
    assert t5r(["train", f"--gin_file={config_gin}", f"--model_dir={again}"]) == 0
    assert losses(again) == first


def test_a_changed_preprocessor_makes_a_new_cache_and_new_batches(user_setup, monkeypatch):
    from t5_retrieval.data.tasks import retrieval_tasks
    from t5_retrieval.data.tasks.materialize import cache_path

    monkeypatch.syspath_prepend(user_setup["module_dir"])
    cache_dir = os.path.join(user_setup["data_dir"], "cache", "tasks")
    retrieval_tasks.use_vocabulary(user_setup["vocabulary"])

    def cached_file(word: str) -> str:
        write_user_module(user_setup, word)
        gin_utils.import_modules(MODULE_NAME)
        task = retrieval_tasks.resolve("user_fever")[0][0]
        return cache_path(task, "train", cache_dir, 24)

    one, same, other = cached_file("ONE"), cached_file("ONE"), cached_file("OTHER")
    assert one == same, "the same Task code must find the same cache"
    assert one != other, "a changed preprocessor must not read the old cache"
    task = retrieval_tasks.resolve("user_fever")[0][0]
    assert cache_path(task, "train", cache_dir, 32) != other, "queries read at another length are another cache"

    from t5_retrieval.data.batching.batches import make_train_iterator

    it = make_train_iterator("user_fever", user_setup["data_dir"], None, user_setup["vocabulary"], 24, 32, 1,
                             per_device_batch=4)
    assert os.path.exists(other), "the changed Task was materialised into its own cache file"
    decoded = decoded_queries(it, next(it), user_setup["vocabulary"])["user_fever"]
    assert all(q.startswith("OTHER") for q in decoded), decoded


def test_a_user_task_whose_query_is_not_tokenised_is_refused_naming_it(user_setup, tmp_path):
    import seqio

    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.data.records import DataError

    def rows(split, shuffle_files, seed=None):
        import tensorflow as tf
        return tf.data.Dataset.from_tensor_slices({"id": ["a"], "text": ["q"], "positive": ["x"]})

    seqio.TaskRegistry.add("user_untokenised", seqio.FunctionDataSource(rows, splits=("train",)),
                           output_features={})
    try:
        with pytest.raises(DataError, match="'user_untokenised' has no \"query\" output feature"):
            make_train_iterator("user_untokenised", user_setup["data_dir"], None, user_setup["vocabulary"], 24, 32, 1,
                                per_device_batch=4, cache_dir="")
    finally:
        seqio.TaskRegistry.remove("user_untokenised")


def test_a_command_line_binding_the_run_never_reads_is_an_error(user_setup, monkeypatch, capsys):
    monkeypatch.syspath_prepend(user_setup["module_dir"])
    write_user_module(user_setup, "REWRITTEN")
    model_dir = os.path.join(user_setup["root"], "unread")
    assert t5r(train_argv(user_setup, model_dir, "--gin.multitask.pcgrad.seed=3")) == 2
    err = capsys.readouterr().err
    assert "--gin.multitask.pcgrad.seed: this run never uses multitask.pcgrad" in err, err
    assert not os.path.exists(os.path.join(model_dir, "1")), "refused before the first step"
    assert t5r(train_argv(user_setup, model_dir, "--gin.MIXTURE_OR_TASK_NAME='user_mixx'")) == 2
    assert "unknown seqio Task or Mixture 'user_mixx' (did you mean user_mix" in capsys.readouterr().err


def test_a_seqio_mixture_names_the_model_tasks_it_holds_in_every_command(user_setup, monkeypatch, capsys):
    import argparse

    from t5_retrieval.data.tasks.task_names import UnknownTaskError, expand

    monkeypatch.syspath_prepend(user_setup["module_dir"])
    write_user_module(user_setup, "REWRITTEN")
    sys.modules.pop(MODULE_NAME, None)
    # t5x's flag on a command that reads no gin file of Tasks (eval, mine, serve): the module is imported.
    gin_flags.parse_args(argparse.ArgumentParser(), [f"--gin.MIXTURE_OR_TASK_MODULE='{MODULE_NAME}'"])
    gin.clear_config()
    assert MODULE_NAME in sys.modules
    with pytest.raises(UserError, match="MIXTURE_OR_TASK_MODULE 'no_such_tasks': cannot import it"):
        gin_flags.parse_args(argparse.ArgumentParser(prog="t5r eval"), ["--gin.MIXTURE_OR_TASK_MODULE='no_such_tasks'"])
    gin.clear_config()

    model = {"user_fever": {"dataset": "user_fever", "prefix": None, "index": 0},
             "user_nq": {"dataset": "user_nq", "prefix": None, "index": 1}}
    assert expand(model, ["user_mix"]) == ["user_fever", "user_nq"]
    assert expand(model, ["user_nq", "user_mix"]) == ["user_nq", "user_fever"], "each task once"
    with pytest.raises(UnknownTaskError, match="Mixture 'user_mix' holds \\['user_nq'\\], which this model was not"):
        expand({"user_fever": model["user_fever"]}, ["user_mix"])


def test_mixture_rates_are_the_mixtures_own_numbers_functions_and_temperatures():
    import functools

    import seqio

    from t5_retrieval.data.tasks.mixing import sizes_from_rates
    from t5_retrieval.data.tasks.retrieval_tasks import resolve

    names = ["rates_t2", "rates_nested"]
    try:
        seqio.MixtureRegistry.add(names[0], ["mini_kilt_fever", "mini_kilt_hotpotqa"],
                                  default_rate=functools.partial(seqio.mixing_rate_num_examples, temperature=2.0))
        seqio.MixtureRegistry.add(names[1], [("mini_kilt_wow", 1.0), (names[0], 2.0)])
        got = resolve(names[0])
        assert [t.name for t, _ in got] == ["mini_kilt_fever", "mini_kilt_hotpotqa"]
        assert [r for _, r in got] == pytest.approx([1_045 ** 0.5, 239 ** 0.5]), "declared sizes at T = 2"
        assert sizes_from_rates([r for _, r in got], 16) == [11, 5]
        nested = resolve(names[1])
        assert [t.name for t, _ in nested] == ["mini_kilt_wow", "mini_kilt_fever", "mini_kilt_hotpotqa"], \
            "a sub-Mixture's Tasks in place, in declared order"
        share = 2.0 / (1_045 ** 0.5 + 239 ** 0.5)
        assert [r for _, r in nested] == pytest.approx([1.0, 1_045 ** 0.5 * share, 239 ** 0.5 * share])
    finally:
        for name in names:
            if name in seqio.MixtureRegistry.names():
                seqio.MixtureRegistry.remove(name)


def test_the_documented_user_module_registers_its_task_and_mixture():
    import seqio

    from t5_retrieval.data.tasks.retrieval_tasks import describe, resolve

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "data.md")) as f:
        section = f.read().split("### Your own Tasks and Mixtures", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(code, "docs/data.md:my_tasks.py", "exec"), {"__name__": "my_tasks"})
        got = resolve("my_mix")
        assert [(t.name, r) for t, r in got] == [("my_faq", 3.0), ("kilt_nq", 1.0)]
        assert describe(got[0][0]).dataset == "my_faq" and describe(got[1][0]).prefix == "NQ"
    finally:
        for registry, name in ((seqio.MixtureRegistry, "my_mix"), (seqio.TaskRegistry, "my_faq")):
            if name in registry.names():
                registry.remove(name)
