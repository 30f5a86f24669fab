"""The seqio data path as a t5x user takes it: their own Tasks (own source, a preprocessor that
rewrites the query) and a Mixture with their own 3:1 rates, registered in their own module and
trained by `t5r train` with t5x's launch names; the batches, a resume, the operative config and the
Task cache checked."""

from __future__ import annotations

import importlib
import json
import linecache
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys

import gin
import pytest

from t5_retrieval import cli, gin_utils
from t5_retrieval.commands import gin_flags
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples, read_negatives
from t5_retrieval.errors import UserError

USER_MODULE = '''
"""A user's Tasks: their own jsonl rows, their own field names, a query rewrite."""
import functools
import json

import seqio
import tensorflow as tf

from t5_retrieval.tasks import add_retrieval_task, run_vocabulary

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


def without_negatives(ds):
    return ds.map(lambda ex: {{k: v for k, v in ex.items() if k != "negatives"}})


def add_plain_task(name, rows, *preprocessors):
    """A Task of seqio's own making: its preprocessors, then seqio's tokenize and end id."""
    if name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name, seqio.FunctionDataSource(functools.partial(user_rows, name=rows), splits=("train", "validation")),
        preprocessors=[to_retrieval_features, *preprocessors, seqio.preprocessors.tokenize,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={{"query": seqio.Feature(run_vocabulary(), add_eos=True)}})


for name in ("user_fever", "user_nq"):
    add_retrieval_task(name, seqio.FunctionDataSource(functools.partial(user_rows, name=name),
                                                      splits=("train", "validation")),
                       preprocessors=[to_retrieval_features, rewrite_query])
add_plain_task("plain_fever", "user_fever", rewrite_query)
add_plain_task("plain_nq", "user_nq", rewrite_query)
add_plain_task("bare_nq", "user_nq", without_negatives)
for mixture, rates in (("user_mix", [("user_fever", 3.0), ("user_nq", 1.0)]),
                       ("plain_mix", [("plain_fever", 1.0), ("plain_nq", 1.0)])):
    if mixture in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(mixture)
    seqio.MixtureRegistry.add(mixture, rates)
'''
MODULE_NAME = "my_retrieval_tasks"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, CHECKPOINT_EVERY, BATCH = 4, 2, 8


@pytest.fixture(scope="module")
def user_setup(tmp_path_factory):
    """Demo data (KB, examples, BM25 negatives), a vocabulary, and the user's rows written from the
    demo's fever and nq examples in the user's own format."""
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import write_demo
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    root = tmp_path_factory.mktemp("seqio_path")
    raw, data_dir, rows, module_dir = (str(root / d) for d in ("raw", "data", "rows", "module"))
    write_demo(raw, num_pages=40, train_per_task=12, dev_per_task=4)
    prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data_dir)
    prepare_tasks(raw, data_dir, ["fever", "nq"], ("train", "dev"))
    prepare_negatives(data_dir, ["fever", "nq"], top_k=4, index=build_bm25_index_for_kb(layout.kb_dir(data_dir)))
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


def train_argv(setup: dict, model_dir: str, *extra: str, module: str = MODULE_NAME) -> list[str]:
    return ["train", "--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
            f"--gin.MODEL_DIR='{model_dir}'", f"--gin.MIXTURE_OR_TASK_MODULE='{module}'",
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
    read_as = {"query_len": 24, "truncation": "beginning",  # --gin.QUERY_LEN=24 for every task
               "text_preprocessors": [f"{MODULE_NAME}.to_retrieval_features", f"{MODULE_NAME}.rewrite_query"]}
    assert tasks == {"user_fever": {"dataset": "user_fever", "prefix": None, "index": 0, **read_as},
                     "user_nq": {"dataset": "user_nq", "prefix": None, "index": 1, **read_as}}, \
        "the Mixture's Tasks, in the order the user declared them, and what rewrote their query text"
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
    # the rewrite. KILT files of the raw queries (what `t5r data tasks` writes) are scored with the
    # Task's rewritten text too, the model's input in training, and so exactly as through seqio.
    data_dir = user_setup["data_dir"]
    embeddings, index = os.path.join(user_setup["root"], "emb"), os.path.join(user_setup["root"], "index")
    assert t5r(["encode", f"--checkpoint_dir={model_dir}", f"--kb_dir={data_dir}/kb", f"--output_dir={embeddings}"]) == 0
    assert t5r(["index", f"--embeddings_dir={embeddings}", f"--output_dir={index}"]) == 0
    evaluate = ["eval", f"--checkpoint_dir={model_dir}", f"--index_dir={index}", f"--data_dir={data_dir}",
                "--split=validation", "--tasks=user_mix", f"--gin.MIXTURE_OR_TASK_MODULE='{MODULE_NAME}'"]
    assert t5r([*evaluate, f"--output_dir={user_setup['root']}/eval_seqio"]) == 0
    write_raw_kilt_files(data_dir, {"user_fever": "fever", "user_nq": "nq"}, "validation")
    try:
        assert t5r([*evaluate, f"--output_dir={user_setup['root']}/eval_files"]) == 0
    finally:
        remove_kilt_files(data_dir, ["user_fever", "user_nq"], "validation")
    scores = [json.load(open(f"{user_setup['root']}/{d}/results.json")) for d in ("eval_seqio", "eval_files")]
    assert set(scores[0]) >= {"user_fever", "user_nq"}, scores[0]
    assert scores[0] == scores[1]
    for task in ("user_fever", "user_nq"):
        assert all(q.startswith("REWRITTEN ") for q in embedded_queries(f"{user_setup['root']}/eval_files", task))

    # The operative config alone runs the same training again.
    again = os.path.join(user_setup["root"], "from_config")
    assert t5r(["train", f"--gin_file={config_gin}", f"--model_dir={again}"]) == 0
    assert losses(again) == first


def write_raw_kilt_files(data_dir: str, datasets: dict[str, str], split: str, source_split: str = "dev") -> None:
    """KILT examples files for user Tasks as `t5r data tasks` would write them from the demo's
    `source_split` files: the raw query text, each gold page its own evidence set."""
    for task, dataset in datasets.items():
        with open(layout.examples_path(data_dir, task, split), "w") as f:
            for e in read_examples(layout.examples_path(data_dir, dataset, source_split)):
                row = {"id": e.id, "task": task, "query": e.query,
                       "gold_pages": [[p] for p in sorted({p for s in e.gold_pages for p in s})],
                       "positive_passages": list(e.positive_passages[:1])}
                f.write(json.dumps(row) + "\n")


def remove_kilt_files(data_dir: str, tasks: list[str], split: str) -> None:
    for task in tasks:
        os.remove(layout.examples_path(data_dir, task, split))


def embedded_queries(eval_dir: str, task: str) -> list[str]:
    """The query text `t5r eval` embedded for `task` (its KILT predictions' "input")."""
    with open(os.path.join(eval_dir, "predictions", f"{task}.jsonl")) as f:
        return [row["input"] for row in map(json.loads, f)]


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
    assert not os.path.exists(model_dir), "refused before the first step, leaving no model directory"
    assert t5r(train_argv(user_setup, model_dir, "--gin.MIXTURE_OR_TASK_NAME='user_mixx'")) == 2
    assert "unknown seqio Task or Mixture 'user_mixx' (did you mean user_mix" in capsys.readouterr().err


def test_a_seqio_mixture_names_the_model_tasks_it_holds_in_every_command(user_setup, monkeypatch, capsys):
    import argparse

    from t5_retrieval.data.tasks.task_names import TaskSet, UnknownTaskError

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
    assert TaskSet.from_records(model).expand(["user_mix"]) == ["user_fever", "user_nq"]
    assert TaskSet.from_records(model).expand(["user_nq", "user_mix"]) == ["user_nq", "user_fever"], "each task once"
    with pytest.raises(UnknownTaskError, match="Mixture 'user_mix' holds \\['user_nq'\\], which this model was not"):
        TaskSet.from_records({"user_fever": model["user_fever"]}).expand(["user_mix"])


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


def test_the_documented_user_modules_register_their_tasks_and_mixture():
    """docs/tasks.md's two modules, run as written: my_tasks.py (a rewriting Task over KILT fever and a
    Mixture) and my_faq.py (a Task over a function source)."""
    import seqio

    from t5_retrieval.data.tasks.retrieval_tasks import describe, resolve

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "tasks.md")) as f:
        blocks = re.findall(r"```python\n(# (\w+)\.py\n.*?)```", f.read(), flags=re.S)
    assert [name for _, name in blocks] == ["my_tasks", "my_faq"], "docs/tasks.md shows my_tasks.py, then my_faq.py"
    registered = ((seqio.MixtureRegistry, "my_mix"), (seqio.TaskRegistry, "my_fever_lc"), (seqio.TaskRegistry, "my_faq"))
    for registry, name in registered:  # as in a new process: another module may have registered its own
        if name in registry.names():
            registry.remove(name)
    try:
        for code, name in blocks:
            exec(compile(code, f"docs/tasks.md:{name}.py", "exec"), {"__name__": name})
        got = resolve("my_mix")
        assert [(t.name, r) for t, r in got] == [("my_fever_lc", 3.0), ("mini_kilt_trex", 1.0)]
        fever = describe(got[0][0])
        assert (fever.dataset, fever.prefix, fever.query_len) == ("fever", "FEVER", 32)
        assert fever.negatives_name == "my_fever_lc", "a Task rewriting its text has a negatives file of its own"
        faq = describe(seqio.TaskRegistry.get("my_faq"))
        assert (faq.dataset, faq.negatives_name, faq.prefix) == ("my_faq", "my_faq", None)
    finally:
        for registry, name in registered:
            if name in registry.names():
                registry.remove(name)


# ----------------------------------------------------------------------------------------------
# A Task of seqio's own making (`seqio.TaskRegistry.add`, seqio's tokenize) evaluates as it trained


@pytest.fixture(scope="module")
def plain_model(user_setup):
    """A model `t5r train` trained on two plain seqio Tasks whose preprocessor rewrites the query,
    with its KB embeddings and index."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(user_setup["module_dir"])
        write_user_module(user_setup, "REWRITTEN")
        root, data_dir = user_setup["root"], user_setup["data_dir"]
        model_dir, emb, index = (os.path.join(root, f"plain_{name}") for name in ("model", "emb", "index"))
        assert t5r(train_argv(user_setup, model_dir, "--gin.MIXTURE_OR_TASK_NAME='plain_mix'",
                              f"--gin.TRAIN_STEPS={CHECKPOINT_EVERY}")) == 0
        assert t5r(["encode", f"--checkpoint_dir={model_dir}", f"--kb_dir={data_dir}/kb", f"--output_dir={emb}"]) == 0
        assert t5r(["index", f"--embeddings_dir={emb}", f"--output_dir={index}"]) == 0
    return {"model_dir": model_dir, "index": index, "data_dir": data_dir, "root": root}


def forget_user_module() -> None:
    """As in a new process: the user's module not imported, its Tasks and Mixtures not registered."""
    import seqio

    for registry, names in ((seqio.MixtureRegistry, ("user_mix", "plain_mix")),
                            (seqio.TaskRegistry, ("user_fever", "user_nq", "plain_fever", "plain_nq", "bare_nq"))):
        for name in names:
            if name in registry.names():
                registry.remove(name)
    sys.modules.pop(MODULE_NAME, None)


def search_argv(command: str, model: dict, *extra: str) -> list[str]:
    """`command` over the model, trusting the Task module its config.gin records (`--task_module`)."""
    return [command, f"--checkpoint_dir={model['model_dir']}", f"--index_dir={model['index']}",
            f"--data_dir={model['data_dir']}", f"--task_module={MODULE_NAME}", *extra]


def test_a_plain_seqio_task_is_evaluated_mined_and_searched_as_it_trained(plain_model, user_setup, monkeypatch,
                                                                          caplog):
    from t5_retrieval import checkpoint
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.index import load_index
    from t5_retrieval.retrieval.serve import SearchService
    from t5_retrieval.searcher import Searcher

    monkeypatch.syspath_prepend(user_setup["module_dir"])
    tasks = checkpoint.read_config(plain_model["model_dir"])["features"]["tasks"]
    assert tasks["plain_fever"]["text_preprocessors"] == [f"{MODULE_NAME}.to_retrieval_features",
                                                          f"{MODULE_NAME}.rewrite_query"], tasks
    root, data_dir = plain_model["root"], plain_model["data_dir"]

    # t5r eval imports the module the model's config.gin records (named by --task_module), and embeds
    # each Task's own text:
    # "query" as seqio's tokenize receives it, after the rewrite.
    forget_user_module()
    assert t5r(search_argv("eval", plain_model, "--split=validation", f"--output_dir={root}/plain_eval")) == 0
    seqio_scores = json.load(open(f"{root}/plain_eval/results.json"))
    assert sorted(seqio_scores) == ["plain_fever", "plain_nq"], seqio_scores
    dev = {e.id: e.query for e in read_examples(layout.examples_path(data_dir, "nq", "dev"))}
    assert {q for q in embedded_queries(f"{root}/plain_eval", "plain_nq")} == {f"REWRITTEN {q}" for q in dev.values()}

    # KILT files of the raw text (`t5r data tasks`, the old workaround) are scored with the Task's text.
    write_raw_kilt_files(data_dir, {"plain_fever": "fever", "plain_nq": "nq"}, "validation")
    try:
        assert t5r(search_argv("eval", plain_model, "--split=validation", f"--output_dir={root}/plain_files")) == 0
    finally:
        remove_kilt_files(data_dir, ["plain_fever", "plain_nq"], "validation")
    assert json.load(open(f"{root}/plain_files/results.json")) == seqio_scores
    assert all(q.startswith("REWRITTEN ") for q in embedded_queries(f"{root}/plain_files", "plain_fever"))

    # t5r mine, by default every task of the model on its train split, through the Tasks.
    forget_user_module()
    assert t5r(search_argv("mine", plain_model, "--source=plain")) == 0
    for task, dataset in (("plain_fever", "fever"), ("plain_nq", "nq")):
        mined = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "plain"), task, "train"))
        assert set(mined) == {e.id for e in read_examples(layout.examples_path(data_dir, dataset, "train"))}

    # Searcher and the search service embed the text they are given: they say, by task and
    # preprocessor, that the model read it rewritten.
    encoder = load_encoder(plain_model["model_dir"])
    store, index = PassageStore.open(f"{data_dir}/kb"), load_index(plain_model["index"])
    caplog.clear()
    Searcher(encoder, index, store).search(["who founded the city"], task="plain_nq", k=2)
    SearchService(encoder, index, store, ["plain_fever"])
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for task, reader in (("plain_nq", "Searcher.search embeds the text it is given"),
                         ("plain_fever", "the search service embeds the text")):
        assert any(m.startswith(f"task {task}: the model trained on its query text as its seqio Task's "
                                f"preprocessors ({MODULE_NAME}.to_retrieval_features, {MODULE_NAME}.rewrite_query)")
                   and reader in m for m in warned), warned


def suggested_commands(message: str) -> list[list[str]]:
    """The commands an error message suggests (in backquotes), as argv for `cli.main`."""
    commands = [shlex.split(c) for c in re.findall(r"`(t5r [^`]*)`", message)]
    assert commands, f"no command suggested: {message}"
    return commands


def run_suggested(commands: list[list[str]]) -> None:
    for argv in commands:
        assert argv[0] == "t5r", argv
        assert t5r(argv[1:]) == 0, f"the suggested command failed: {shlex.join(argv)}"


def test_a_model_task_without_examples_is_an_error_and_each_suggested_command_works(plain_model, user_setup,
                                                                                   monkeypatch, capsys):
    monkeypatch.syspath_prepend(user_setup["module_dir"])
    root, data_dir = plain_model["root"], plain_model["data_dir"]
    forget_user_module()
    # Neither task has a dev split: both named, with the command that scores them on the split they have.
    assert t5r(search_argv("eval", plain_model, "--split=dev", f"--output_dir={root}/dev_eval")) == 2
    err = capsys.readouterr().err
    for task in ("plain_fever", "plain_nq"):
        assert (f"{task}: no {layout.examples_path(data_dir, task, 'dev')}, and its seqio Task has the splits "
                "train, validation") in err, err
    commands = suggested_commands(err)
    assert [c[-2:] for c in commands] == [["--tasks=plain_fever,plain_nq", "--split=validation"]], commands
    run_suggested(commands)

    # One task with dev examples (a KILT file), the other without: no table of one task and rc 0,
    # but an error naming the other, with the commands for each.
    write_raw_kilt_files(data_dir, {"plain_fever": "fever"}, "dev")
    try:
        for command in ("eval", "mine"):
            out = f"--output_dir={root}/dev_{command}" if command == "eval" else "--source=dev_mined"
            assert t5r(search_argv(command, plain_model, "--split=dev", out)) == 2
            err = capsys.readouterr().err
            assert "no dev examples for the model's task plain_nq: " in err and "plain_fever:" not in err, err
            commands = suggested_commands(err)
            assert [c[-2:] for c in commands] == [["--tasks=plain_nq", "--split=validation"],
                                                  [out, "--tasks=plain_fever"]], commands
            run_suggested(commands)
    finally:
        remove_kilt_files(data_dir, ["plain_fever"], "dev")

    # A model whose Task module cannot be imported says which, and where it is recorded.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != user_setup["module_dir"]])
    forget_user_module()
    assert t5r(search_argv("eval", plain_model, "--split=validation", f"--output_dir={root}/no_module")) == 2
    config = os.path.join(plain_model["model_dir"], "config.gin")
    assert f"MIXTURE_OR_TASK_MODULE '{MODULE_NAME}' (the Task module {config} records): cannot import it" in \
        capsys.readouterr().err


def test_a_task_without_negatives_names_the_command_that_writes_them(user_setup, monkeypatch, tmp_path):
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.data.records import DataError

    monkeypatch.syspath_prepend(user_setup["module_dir"])
    write_user_module(user_setup, "REWRITTEN")
    # The demo's fever examples in a data directory without negatives, and a user Task without a
    # "negatives" feature: each error names the `t5r data negatives` command that works for it.
    data_dir = str(tmp_path / "data")
    os.makedirs(data_dir)
    for part in ("kb", "examples"):
        os.symlink(os.path.join(user_setup["data_dir"], part), os.path.join(data_dir, part))
    for task in ("demo_fever", "bare_nq"):
        def iterator(task: str = task):
            return make_train_iterator(task, data_dir, None, user_setup["vocabulary"], 24, 32, 1, per_device_batch=4,
                                       cache_dir="", task_module=MODULE_NAME)

        with pytest.raises(DataError) as refused:
            iterator()
        commands = suggested_commands(str(refused.value))
        assert commands[0][:3] == ["t5r", "data", "negatives"], commands
        run_suggested(commands)
        assert next(iterator())[task]["passage_tokens"].shape == (4 * 2, 32)


def test_config_gin_restarts_from_any_directory_and_a_failed_start_leaves_no_model_directory(
        user_setup, tmp_path, monkeypatch, caplog):
    """Relative DATA_DIR and VOCABULARY, the Task module in the working directory: config.gin records
    them absolute, and `t5r train --gin_file=<model>/config.gin` elsewhere trains the same steps."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    os.symlink(user_setup["data_dir"], work / "data")
    (work / "cwd_tasks.py").write_text(USER_MODULE.format(rows=user_setup["rows"], word="HERE"))
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the module's directory is added for this test only
    setup = {**user_setup, "data_dir": "data", "vocabulary": "data/spm.model"}
    caplog.set_level(logging.INFO)
    gin.clear_config()  # as in a new process: no configurable called before (the fixture's BM25) is recorded
    assert t5r(train_argv(setup, "model", "--gin.TRAIN_STEPS=2", module="cwd_tasks")) == 0
    assert ("sub-batch per device and step (of 8; mixing rate): user_fever 6 (3), user_nq 2 (1)"
            in caplog.text), "each task's sub-batch size is logged"

    config = str(work / "model" / "config.gin")
    recorded = {name: gin_utils.operative_values(config, "make_train_iterator", name)
                for name in ("data_dir", "vocabulary", "task_module", "task_module_path")}
    assert recorded == {"data_dir": [str(work / "data")], "vocabulary": [str(work / "data" / "spm.model")],
                        "task_module": ["cwd_tasks"], "task_module_path": [[str(work)]]}, recorded
    again = str(tmp_path / "again")
    env = {**os.environ, "PYTHONPATH": REPO}
    restart = subprocess.run([os.path.join(os.path.dirname(sys.executable), "t5r"), "train", f"--gin_file={config}",
                              f"--model_dir={again}"], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=1200)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert losses(again) == losses(str(work / "model"))

    # A start that fails (no negatives for bare_nq) leaves no model directory; one that existed stays.
    for model_dir, existed in (("failed", False), ("kept", True)):
        if existed:
            os.makedirs(model_dir)
        assert t5r(train_argv(setup, model_dir, "--gin.MIXTURE_OR_TASK_NAME='bare_nq'", module="cwd_tasks")) == 2
        assert os.path.exists(model_dir) == existed
