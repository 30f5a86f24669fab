"""`t5r export`: the SavedModel, loaded by plain TensorFlow in a fresh process, searches like the Python path."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples
from tests.tiny_model import TASKS, build_tiny_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(REPO, "tests", "export", "query_savedmodel.py")
K = 5
TOWERS = ("DualEncoderConfig.query_towers = 2",)
SEPARATE = ("DualEncoderConfig.separate_query_encoder = True",)
OWN_LENGTHS = ("QUERY_LEN = {'demo_fever': 16, 'demo_trex': 12}",)  # each task at its own length
# Edge cases of the query normalisation: Unicode whitespace (RE2's \s would miss it), [SEP] and a
# literal </s> (EOS between segments), a query longer than the trained length (truncation keeps EOS).
TRICKY = ["  Paris\u00a0is\u2003the\ncapital [SEP] country ", "x</s>", "[SEP][SEP] y", "word " * 40]


def _queries(data_dir: str, dataset: str) -> list[str]:
    return [e.query for e in read_examples(layout.examples_path(data_dir, dataset, "dev"))]


def _run_client(savedmodel: str, requests: list[dict], tmp_dir: str) -> list[dict]:
    path = os.path.join(tmp_dir, "requests.json")
    with open(path, "w") as f:
        json.dump(requests, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours on the path
    proc = subprocess.run([sys.executable, CLIENT, savedmodel, path], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tmp_dir)
    assert proc.returncode == 0, f"client failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def eval_runs(model_dir: str, index_dir: str, data_dir: str, out: str) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """`t5r eval` on the dev queries: per TREC run (named by the model's task name), query id -> its
    ranked (passage id, score)."""
    assert cli.main(["eval", "--checkpoint_dir", model_dir, "--index_dir", index_dir, "--data_dir", data_dir,
                     "--split", "dev", "--output_dir", out]) == 0
    runs: dict[str, dict[str, list[tuple[str, float]]]] = {}
    predictions = os.path.join(out, "predictions")
    for name in sorted(os.listdir(predictions)):
        if name.endswith(".trec"):
            ranked = runs.setdefault(name[:-len(".trec")], {})
            with open(os.path.join(predictions, name)) as f:
                for line in f:
                    qid, _, pid, _, score, _ = line.split()
                    ranked.setdefault(qid, []).append((pid, float(score)))
    return runs


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One tiny run, one export of model 0 (its tasks at lengths of their own), one client process.

    Model 1 (another seed, per-task query towers) and its index serve the mismatch and towers tests,
    model 2 (one separate query encoder) the separate-tower test."""
    root = tmp_path_factory.mktemp("export")
    run = build_tiny_run(str(root), models=((0, OWN_LENGTHS), (1, TOWERS), (2, SEPARATE)))
    savedmodel = str(root / "serving" / "t5r" / "1")
    kb_dir = layout.kb_dir(run.data_dir)
    assert cli.main(["export", "--checkpoint_dir", run.model_dirs[0], "--index_dir", run.index_dirs[0],
                     "--kb_dir", kb_dir, "--output_dir", savedmodel]) == 0
    tasks = [f"demo_{t}" for t in TASKS]
    fever, trex = _queries(run.data_dir, "fever"), _queries(run.data_dir, "trex")
    mixed = fever + trex + TRICKY
    mixed_tasks = [tasks[0]] * len(fever) + [tasks[1]] * (len(trex) + len(TRICKY))
    requests = [{"signature": "search", "query": mixed, "task": mixed_tasks, "k": K},
                {"signature": "encode", "query": mixed, "task": mixed_tasks},
                {"signature": "search", "query": fever[:2], "task": [tasks[0], "nope"], "k": K},
                {"signature": "search", "query": [fever[0], " \t "], "task": tasks, "k": K},
                # Same batch shape as the first request: no new XlaCallModule compilation.
                {"signature": "search", "query": mixed, "task": mixed_tasks, "k": 10_000},
                {"signature": "search", "query": mixed, "task": mixed_tasks, "k": K, "session": True},
                # The same tasks named by their datasets (fever, trex), as the Python path accepts them.
                {"signature": "search", "query": mixed, "k": K,
                 "task": [t.removeprefix("demo_") for t in mixed_tasks]}]
    responses = _run_client(savedmodel, requests, str(root))
    names = ("search", "encode", "unknown_task", "empty_query", "big_k", "session", "by_dataset")
    return run, savedmodel, dict(zip(names, responses)), \
        (mixed, mixed_tasks)


@pytest.fixture(scope="module")
def python_path(exported):
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.retrieval.index import load_index

    run = exported[0]
    return run.encoders[0], load_index(run.index_dirs[0]), PassageStore.open(layout.kb_dir(run.data_dir))


def test_savedmodel_search_returns_the_python_search_paths_top_k(exported, python_path):
    from t5_retrieval.retrieval.search import dense_searcher

    _, _, responses, (queries, tasks) = exported
    encoder, index, store = python_path
    got = responses["search"]
    assert np.shape(got["passage_ids"]) == (len(queries), K), np.shape(got["passage_ids"])
    for i, (query, task) in enumerate(zip(queries, tasks)):
        ((pids, scores),) = dense_searcher(encoder, index, task).search([query], K)
        assert got["passage_ids"][i] == pids, f"query {i} ({task}: {query!r}): {got['passage_ids'][i]} vs {pids}"
        np.testing.assert_allclose(got["scores"][i], scores, rtol=1e-4, atol=1e-4, err_msg=f"query {i}")
        assert got["page_ids"][i] == [store.page_of(p) for p in pids], f"query {i}: page ids"
        assert got["titles"][i] == [store.get(p).title for p in pids], f"query {i}: titles"


def test_graph_mode_session_loader_answers_like_the_eager_loader(exported):
    _, _, responses, _ = exported
    eager, session = responses["search"], responses["session"]
    for name in ("passage_ids", "page_ids", "titles"):
        assert session[name] == eager[name], f"{name}: TF1 Session.run differs from tf.saved_model.load"
    np.testing.assert_allclose(session["scores"], eager["scores"], rtol=1e-6, atol=1e-6)


def test_savedmodel_takes_a_task_by_its_dataset_as_by_its_registered_name(exported):
    _, _, responses, _ = exported
    assert "error" not in responses["by_dataset"], responses["by_dataset"]
    assert responses["by_dataset"]["passage_ids"] == responses["search"]["passage_ids"]
    np.testing.assert_allclose(responses["by_dataset"]["scores"], responses["search"]["scores"], rtol=1e-6, atol=1e-6)


def test_savedmodel_encode_matches_the_python_encoder(exported, python_path):
    _, _, responses, (queries, tasks) = exported
    encoder = python_path[0]
    expected = np.concatenate([encoder.encode_queries([q], t) for q, t in zip(queries, tasks)])
    got = np.asarray(responses["encode"]["embeddings"])
    assert got.shape == expected.shape == (len(queries), encoder.dim)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg="jax2tf encoder vs the Flax model")


def test_unknown_task_empty_query_and_large_k_are_handled_in_the_graph(exported):
    _, _, responses, _ = exported
    error = responses["unknown_task"].get("error", "")
    assert "unknown task(s)" in error and "nope" in error and "demo_fever" in error, responses["unknown_task"]
    assert "empty query at position(s)" in responses["empty_query"].get("error", ""), responses["empty_query"]
    big = responses["big_k"]
    assert "error" not in big and np.shape(big["passage_ids"]) == (len(exported[3][0]), python_k_limit(exported)), \
        big.keys()


def python_k_limit(exported) -> int:
    run = exported[0]
    with open(os.path.join(run.index_dirs[0], "index.json")) as f:
        return json.load(f)["num_passages"]


def test_export_records_fingerprint_task_specs_index_manifest_and_vocabulary(exported, python_path):
    import sentencepiece as spm

    from t5_retrieval.export import portable

    run, savedmodel, _, _ = exported
    encoder = python_path[0]
    assets = os.path.join(savedmodel, "assets")
    with open(os.path.join(assets, "t5r_export.json")) as f:
        record = json.load(f)
    with open(os.path.join(run.index_dirs[0], "index.json")) as f:
        manifest = json.load(f)
    assert record["fingerprint"] == encoder.fingerprint == manifest["fingerprint"]
    assert record["query_network"] == {"fingerprint": encoder.fingerprint, "query_side": False}, record
    # The index manifest, its paths cut to their last component (the embeddings directory's name).
    assert record["index"] == portable.without_paths(manifest) and record["index"]["embeddings_dir"] == "emb_0"
    with open(os.path.join(assets, "index.json")) as f:
        assert json.load(f) == record["index"]
    # Each task as its TaskSpec records it: prefix, dataset, its own query length and truncation.
    assert record["tasks"] == {f"demo_{t}": encoder.tasks.spec(t).to_record() for t in TASKS}, record
    assert [spec["query_len"] for spec in record["tasks"].values()] == [16, 12] and record["query_len"] == 16
    assert record["tokenizer"] == {"kind": "sentencepiece", "extra_ids": 100, "files": ["spiece.model"]}
    # The shipped sentencepiece file tokenises as the model's own copy; it lost only the trainer's paths.
    shipped, original = (spm.SentencePieceProcessor(model_file=path)
                         for path in (os.path.join(assets, "spiece.model"), run.vocabulary))
    texts = [*TRICKY, "Paris is the capital of France."]
    assert shipped.encode(texts) == original.encode(texts)
    assert shipped.vocab_size() == original.vocab_size()


def test_the_export_is_readable_by_others_and_names_no_path_of_this_machine(exported):
    """Directories with the umask's permissions (not mkdtemp's 0700), no verification stamp (inodes and
    mtimes of this disk), and a model_config.json whose vocabulary is the asset the export ships."""
    from t5_retrieval import checksums

    run, savedmodel, _, _ = exported
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(savedmodel):
        assert oct(os.stat(root).st_mode & 0o777) == oct(0o777 & ~umask), f"{root}: mode under umask {umask:o}"
        for name in files:
            assert os.stat(os.path.join(root, name)).st_mode & 0o444 == 0o444 & ~umask, os.path.join(root, name)
        assert checksums.STAMP_FILE not in files, f"{root}: ships a stamp of this filesystem"
    with open(os.path.join(savedmodel, "assets", "model_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(savedmodel, "assets", "t5r_export.json")) as f:
        shipped = json.load(f)["tokenizer"]["files"][0]
    assert config["features"]["vocabulary"] == f"assets/{shipped}", config["features"]
    assert os.path.exists(os.path.join(savedmodel, config["features"]["vocabulary"]))
    paths = [v for v in json.dumps(config).split('"') if os.path.isabs(v)]
    assert not paths, f"assets/model_config.json names paths of this machine: {paths}"
    # The tiny run's directory holds the model, its vocabulary's training files, the embeddings and the index.
    assert_names_no_path_of_this_machine(savedmodel, os.path.dirname(run.data_dir))


def assert_names_no_path_of_this_machine(savedmodel: str, *paths: str) -> None:
    """No file of the SavedModel (graph, variables, assets) holds the repository's, the virtualenv's
    or the given directories' paths."""
    needles = {p.encode() for p in (REPO, sys.prefix, os.path.realpath(sys.prefix), *paths)}
    for directory, _, files in os.walk(savedmodel):
        for name in files:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
            found = [n.decode() for n in needles if n in data]
            assert not found, f"{os.path.join(directory, name)} records {found}"


def test_export_refuses_an_index_built_by_another_model(exported, tmp_path, capsys):
    run = exported[0]
    out = str(tmp_path / "t5r" / "1")
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint_dir", run.model_dirs[0], "--index_dir", run.index_dirs[1],
                     "--kb_dir", layout.kb_dir(run.data_dir), "--output_dir", out]) == 2
    err = capsys.readouterr().err
    with open(os.path.join(run.index_dirs[1], "index.json")) as f:
        other = json.load(f)["fingerprint"]
    assert "model fingerprint" in err and other in err, err
    assert not os.path.exists(out), "a refused export must not leave a SavedModel behind"


def test_export_refuses_an_exact_index_in_one_line(exported, tmp_path, capsys):
    from t5_retrieval.retrieval.index import build_index, load_index

    run = exported[0]
    exact_dir = str(tmp_path / "exact")
    build_index(load_index(run.index_dirs[0]).embeddings_dir, backend="exact").save(exact_dir)
    out = str(tmp_path / "t5r" / "1")
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint_dir", run.model_dirs[0], "--index_dir", exact_dir,
                     "--kb_dir", layout.kb_dir(run.data_dir), "--output_dir", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"t5r export: error: {exact_dir}: an index of backend 'exact'") and "--backend=scann" in err, err
    assert not os.path.exists(out), "a refused export must not leave a SavedModel behind"


def test_query_preprocessing_ops_tokenize_like_the_python_path(exported):
    import seqio
    import tensorflow as tf
    import tensorflow_text as tf_text

    from t5_retrieval.data.text import format_query
    from t5_retrieval.data.tokenizers.query_inputs import QueryInput, query_tokens
    from t5_retrieval.export import preprocess

    run = exported[0]
    vocab = seqio.SentencePieceVocabulary(run.vocabulary, extra_ids=100)
    tokenizer = tf_text.SentencepieceTokenizer(model=vocab.sp_model)
    texts = TRICKY + ["\u3000lead and trail\u2029", "a</s>", "</s>", "plain query"]
    for prefix in ("FEVER", None):
        strings = tf.strings.join([preprocess.prefix_strings([prefix])[0], preprocess.normalize_queries(texts)])
        assert [s.decode() for s in strings.numpy()] == [format_query(t, prefix) for t in texts]
        got = preprocess.tokenize_queries(tokenizer, tf.constant(preprocess.prefix_strings([prefix]) * len(texts)),
                                          preprocess.normalize_queries(texts), tf.fill([len(texts)], 16),
                                          tf.zeros([len(texts)], tf.bool), 16).numpy()
        np.testing.assert_array_equal(got, query_tokens(vocab, texts, QueryInput(prefix, 16)),
                                      err_msg=f"token ids differ (prefix {prefix})")


def test_query_preprocessing_ops_cut_each_task_at_its_length_and_entity_linking_around_its_mention():
    """Rows of one batch with their own tasks' lengths and truncations, against `query_tokens`."""
    import seqio
    import tensorflow as tf
    import tensorflow_text as tf_text

    from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING, MENTION_WINDOW, QueryInput, query_tokens
    from t5_retrieval.export import preprocess

    spm = os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece", "sentencepiece.model")
    vocab = seqio.SentencePieceVocabulary(spm, extra_ids=100)
    tokenizer = tf_text.SentencepieceTokenizer(model=vocab.sp_model)
    context = "the quick brown fox jumps over the lazy dog and runs far away " * 4
    texts = [f"{context} [START_ENT] Paris [END_ENT] {context}",           # centred
             f"[START_ENT] Paris   Hilton [END_ENT] {context}",              # no left context: right gets the rest
             f"{context}{context} [START_ENT] Paris [END_ENT] .",            # little right context
             f"a [START_ENT] {context} [END_ENT] b",                         # the mention alone exceeds the budget
             f"{context} [START_ENT] x [SEP] y [END_ENT] z</s>w",            # separators inside
             f"{context} [END_ENT] no start marker before [START_ENT]",      # markers out of order: the beginning
             "short [START_ENT] one [END_ENT] two",                          # fits whole
             context]                                                        # no markers: the beginning
    rows = [(prefix, length, truncation) for prefix in ("AIDA", None) for length in (30, 61)
            for truncation in (MENTION_WINDOW, KEEP_BEGINNING)]
    width = 64
    batch = [(text, *row) for row in rows for text in texts]
    got = preprocess.tokenize_queries(
        tokenizer, tf.constant(preprocess.prefix_strings([p for _, p, _, _ in batch])),
        preprocess.normalize_queries([t for t, *_ in batch]), tf.constant([n for _, _, n, _ in batch]),
        tf.constant([c == MENTION_WINDOW for *_, c in batch]), width).numpy()
    for i, (text, prefix, length, truncation) in enumerate(batch):
        want = np.zeros(width, np.int32)
        want[:length] = query_tokens(vocab, [text], QueryInput(prefix, length, truncation))[0]
        np.testing.assert_array_equal(got[i], want, err_msg=f"{prefix} {length} {truncation}: {text[:60]!r}")


@pytest.mark.parametrize("mode", ["brute_force", "tree_ah"])
def test_tf_scann_op_loads_our_serialized_index_and_finds_the_same_neighbours(mode, tmp_path):
    import tensorflow as tf

    from t5_retrieval.export.scann_tf import ScannSearcher
    from t5_retrieval.retrieval.index import load_index
    from t5_retrieval.retrieval.scann_index import SCANN_DIR, ScannConfig, ScannIndex, build_searcher

    rng = np.random.default_rng(0)
    matrix, queries = rng.normal(size=(400, 16)).astype(np.float32), rng.normal(size=(7, 16)).astype(np.float32)
    config = ScannConfig(mode=mode, num_leaves=20, num_leaves_to_search=5, reorder_num_neighbors=40).resolved(400)
    ScannIndex(build_searcher(matrix, config), [f"p{i}" for i in range(400)], "fp", 16, config).save(str(tmp_path))
    index = load_index(str(tmp_path))
    rows, scores = index.search(queries, 10)
    pre = -1 if mode == "brute_force" else 40
    tf_rows, tf_scores = ScannSearcher(str(tmp_path / SCANN_DIR)).search(tf.constant(queries), 10, pre)
    np.testing.assert_array_equal(tf_rows.numpy(), np.stack(rows), err_msg=f"{mode}: TF op vs pybind rows")
    np.testing.assert_allclose(tf_scores.numpy(), np.stack(scores), rtol=1e-5, atol=1e-5)


def test_models_with_per_task_query_towers_encode_each_row_with_its_tasks_tower(exported, tmp_path):
    import tensorflow as tf

    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.export.savedmodel import RetrievalModule
    from t5_retrieval.retrieval.index import load_index

    run = exported[0]
    encoder = run.encoders[1]
    assert encoder.model.config.query_towers == 2
    module = RetrievalModule(encoder, load_index(run.index_dirs[1]), run.index_dirs[1],
                             PassageStore.open(layout.kb_dir(run.data_dir)), str(tmp_path))
    queries = ["a river in France", "Paris [SEP] capital of", "a river in France"]
    tasks = ["demo_fever", "demo_trex", "demo_trex"]
    got = module.encode(tf.constant(queries), tf.constant(tasks))["embeddings"].numpy()
    expected = np.concatenate([encoder.encode_queries([q], t) for q, t in zip(queries, tasks)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg="per-row tower selection")
    assert np.abs(got[0] - got[2]).max() > 1e-3, "the same query under two tasks must use two different towers"


def test_a_separate_query_encoder_embeds_queries_in_the_export(exported, tmp_path):
    import tensorflow as tf

    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.text import format_query
    from t5_retrieval.data.tokenizers.tokenize import tokenize
    from t5_retrieval.export.savedmodel import RetrievalModule
    from t5_retrieval.retrieval.index import load_index

    run = exported[0]
    encoder = run.encoders[2]
    assert encoder.model.config.separate_query_encoder
    module = RetrievalModule(encoder, load_index(run.index_dirs[2]), run.index_dirs[2],
                             PassageStore.open(layout.kb_dir(run.data_dir)), str(tmp_path))
    queries, tasks = ["a river in France", "Paris [SEP] capital of"], ["demo_fever", "demo_trex"]
    got = module.encode(tf.constant(queries), tf.constant(tasks))["embeddings"].numpy()
    expected = np.concatenate([encoder.encode_queries([q], t) for q, t in zip(queries, tasks)])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg="queries must use the query tower")
    tokens = tokenize(encoder.vocabulary, [format_query(q, "FEVER") for q in queries[:1]], encoder.features["query_len"])
    passage_side = encoder.encode_tokens(tokens)  # tower None: the passage encoder
    assert np.abs(got[0] - passage_side[0]).max() > 1e-3, "the passage encoder must not embed queries"


def test_the_export_carries_checksums_and_t5r_checksum_finds_a_damaged_copy(exported, tmp_path, capsys):
    import shutil

    savedmodel = exported[1]
    assert cli.main(["checksum", savedmodel]) == 0
    copy = str(tmp_path / "copy")
    shutil.copytree(savedmodel, copy)
    variables = os.path.join(copy, "variables", "variables.data-00000-of-00001")
    with open(variables, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    capsys.readouterr()
    assert cli.main(["checksum", copy]) == 2
    assert f"{variables}: fails its sha256 checksum" in capsys.readouterr().err
