"""`t5r export` of WordPiece (BERT, MiniLM's vocabulary) and query-side models: the TF tokenizer gives the
Python tokenizer's ids, and the SavedModel, loaded by plain TensorFlow in a fresh process, gives the
top-10 of `t5r eval`.

Models: a one-layer BERT with all-MiniLM-L6-v2's WordPiece vocabulary over the demo tasks (prefixed:
`FEVER [unused1] ...`), and a query-side model over it (its own network for queries, the base's
index for passages), both written as `t5r train` writes them with initialised weights
(`tests/tiny_model.py`); what is compared does not depend on training.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from t5_retrieval import cli
from t5_retrieval.checkpoint import write_base_record
from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING, MENTION_WINDOW, QueryInput, query_tokens
from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary
from t5_retrieval.export import preprocess
from t5_retrieval.export.wordpiece_tf import WordPieceTokenizer
from t5_retrieval.inference import QuerySideEncoder, load_encoder
from t5_retrieval.models.pretrained import minilm_l6_dir
from tests.test_export import TRICKY, _run_client, assert_names_no_path_of_this_machine, eval_runs
from tests.tiny_model import TASKS, build_tiny_run, write_model_dir

K = 10
TIE = 1e-4  # scores this close may rank in either order
# Text BERT's basic tokenisation treats specially: accents (NFD, then marks dropped when
# lower-casing), Greek final sigma and dotted I (full lower-casing), ligatures and full-width forms
# (kept: lower-casing is not NFKC), CJK ideographs (split one by one), control and format
# characters (dropped; a NUL too), Unicode spaces, punctuation of every script, emoji and astral
# letters, words past 100 characters (one [UNK]), a T5 sentinel (one [unusedN]) and empty text.
AWKWARD = ["Héllo Wörld! naïve café résumé ÅNGSTRÖM", "ΣΑΣ ΟΔΟΣ σοφός ΌΣΟΣ", "İstanbul ǅ ǈ ß ﬁne Ⅻ ① ＦＵＬＬ",
           "北京大学是東京 中文English混合", "a\u00a0b\u2003c\u200bd\x00e\ufffd \u00adsoft\u00adhyphen",
           "can't-stop...?! don’t “quote” — dash ¿qué? «guillemets»", "tab\tnew\nline\r\u2028para\u2029sep",
           "\u0301lone accent", "🙂 emoji 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "x" * 100, "x" * 101, "é" * 60, "é" * 101, "word" * 30,
           "a<extra_id_1>b", "FEVER <extra_id_1> claim", "", "   ", "\x00", "[SEP] [CLS] [UNK]"]


@pytest.fixture(scope="module")
def minilm_vocabulary() -> WordPieceVocabulary:
    return WordPieceVocabulary.from_path(minilm_l6_dir())


@pytest.mark.parametrize("lower_case", [True, False], ids=["uncased", "cased"])
def test_tf_wordpiece_gives_the_python_tokenizers_ids_on_awkward_text(minilm_vocabulary, lower_case):
    vocab = WordPieceVocabulary(minilm_vocabulary.vocab_file, lower_case=lower_case)
    got = WordPieceTokenizer(vocab).tokenize(tf.constant(AWKWARD)).to_list()
    want = vocab.encode_batch(AWKWARD)
    for text, g, w in zip(AWKWARD, got, want):
        assert g == w, f"{text!r}: TF {[vocab.tokens[i] for i in g]} vs Python {[vocab.tokens[i] for i in w]}"


def test_query_preprocessing_with_bert_conventions_is_query_tokens(minilm_vocabulary):
    """[CLS] prefix query [SEP] at each row's own task length and truncation, [SEP] between KILT segments."""
    from t5_retrieval.data.tokenizers.conventions import conventions_of

    vocab = minilm_vocabulary
    context = "the quick brown fox jumps over the lazy dog and runs far away " * 3
    texts = [*TRICKY, f"{context} [START_ENT] Paris Hilton [END_ENT] {context}", f"a [START_ENT] {context} [END_ENT] b",
             f"Ünïcödé {context} [START_ENT] 東京 [SEP] x [END_ENT] y</s>z", *AWKWARD[:9]]
    rows = [(prefix, length, truncation) for prefix in ("AIDA", None) for length in (24, 40)
            for truncation in (MENTION_WINDOW, KEEP_BEGINNING)]
    batch = [(text, *row) for row in rows for text in texts]
    width = 40
    got = preprocess.tokenize_queries(
        WordPieceTokenizer(vocab), tf.constant(preprocess.prefix_strings([p for _, p, _, _ in batch])),
        preprocess.normalize_queries([t for t, *_ in batch]), tf.constant([n for _, _, n, _ in batch]),
        tf.constant([c == MENTION_WINDOW for *_, c in batch]), width, conventions_of(vocab)).numpy()
    for i, (text, prefix, length, truncation) in enumerate(batch):
        want = np.zeros(width, np.int32)
        want[:length] = query_tokens(vocab, [text], QueryInput(prefix, length, truncation))[0]
        np.testing.assert_array_equal(got[i], want, err_msg=f"{prefix} {length} {truncation}: {text[:60]!r}")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The BERT and the query-side model over it, each exported, `t5r eval`uated and asked by one client."""
    root = tmp_path_factory.mktemp("export_wp")
    run = build_tiny_run(str(root), models=((0, ("QUERY_LEN = {'demo_fever': 24, 'demo_trex': 16}",)),), bert=True)
    base_dir, index_dir, kb_dir = run.model_dirs[0], run.index_dirs[0], layout.kb_dir(run.data_dir)
    query_side_dir = str(root / "query_side")
    write_model_dir(query_side_dir, run.data_dir, run.vocabulary, seed=7, bert=True)
    write_base_record(query_side_dir, base_dir, run.encoders[0].fingerprint)
    models = {"bert": base_dir, "query_side": query_side_dir}
    exports, evals = {}, {}
    for name, model_dir in models.items():
        exports[name] = str(root / "serving" / name / "1")
        assert cli.main(["export", "--checkpoint_dir", model_dir, "--index_dir", index_dir, "--kb_dir", kb_dir,
                         "--output_dir", exports[name]]) == 0
        evals[name] = eval_runs(model_dir, index_dir, run.data_dir, str(root / "eval" / name))
    dev = {f"demo_{t}": read_examples(layout.examples_path(run.data_dir, t, "dev")) for t in TASKS}
    queries = [e.query for examples in dev.values() for e in examples]
    tasks = [task for task, examples in dev.items() for _ in examples]
    tricky = [*TRICKY, *(text for text in AWKWARD if text.strip(" \x00"))]
    requests = [{"savedmodel": exports[name], "signature": "search", "query": queries, "task": tasks, "k": K}
                for name in models]
    requests += [{"savedmodel": exports[name], "signature": "encode", "query": tricky, "task": ["demo_fever"] * len(tricky)}
                 for name in models]
    requests.append({"savedmodel": exports["query_side"], "signature": "search", "query": queries, "task": tasks,
                     "k": K, "session": True})
    responses = _run_client(exports["bert"], requests, str(root))
    return {"root": str(root), "models": models, "exports": exports, "evals": evals, "dev": dev, "tricky": tricky,
            "search": dict(zip(models, responses[:2])), "encode": dict(zip(models, responses[2:4])),
            "session": responses[4]}


@pytest.mark.parametrize("name", ["bert", "query_side"])
def test_savedmodel_top10_is_t5r_evals(exported, name):
    got = exported["search"][name]
    assert "error" not in got, got
    examples = [e for examples in exported["dev"].values() for e in examples]
    tasks = [task for task, examples in exported["dev"].items() for _ in examples]
    assert np.shape(got["passage_ids"]) == (len(examples), K)
    for i, (example, task) in enumerate(zip(examples, tasks)):
        ranked = exported["evals"][name][task][example.id]  # every passage (t5r eval searches 100 deep)
        want_scores, score_of = [score for _, score in ranked[:K]], dict(ranked)
        np.testing.assert_allclose(got["scores"][i], want_scores, atol=TIE, err_msg=f"{name} {task}: scores")
        # The same ranking: each passage at rank r has, by t5r eval's own score, rank r's score. With
        # distinct scores this is id-for-id equality; initialised weights score some passages within
        # 1e-5 of each other, and such ties may come in either order (as between two Python runs).
        for rank, pid in enumerate(got["passage_ids"][i]):
            assert abs(score_of[pid] - want_scores[rank]) <= TIE, \
                f"{name} {task} {example.query!r} rank {rank}: {pid} vs t5r eval's {ranked[:K]}"
    assert np.all(np.diff(np.asarray(got["scores"]), axis=1) <= 1e-6), "scores must come ranked"


def test_query_side_export_embeds_queries_with_its_own_network_and_searches_its_bases_index(exported):
    encoder = load_encoder(exported["models"]["query_side"])
    assert isinstance(encoder, QuerySideEncoder)
    tricky = exported["tricky"]
    got = np.asarray(exported["encode"]["query_side"]["embeddings"])
    np.testing.assert_allclose(got, encoder.encode_queries(tricky, "demo_fever"), rtol=1e-4, atol=1e-5,
                               err_msg="the SavedModel must embed queries with the query-side network")
    base = np.asarray(exported["encode"]["bert"]["embeddings"])
    np.testing.assert_allclose(base, encoder.passage_encoder.encode_queries(tricky, "demo_fever"), rtol=1e-4, atol=1e-5,
                               err_msg="the base's export must embed queries as the base does (awkward text included)")
    assert np.abs(got - base).max() > 1e-3, "the query-side export must not embed with its base's network"
    assert exported["search"]["query_side"]["passage_ids"] != exported["search"]["bert"]["passage_ids"]
    assert exported["session"]["passage_ids"] == exported["search"]["query_side"]["passage_ids"], \
        "TF1 Session loader (TF Serving's way) vs tf.saved_model.load"
    with open(os.path.join(exported["exports"]["query_side"], "assets", "t5r_export.json")) as f:
        record = json.load(f)
    assert record["fingerprint"] == encoder.fingerprint != record["query_network"]["fingerprint"], record
    assert record["query_network"] == {"fingerprint": encoder.query_encoder.fingerprint, "query_side": True}
    assert record["tokenizer"] == {"kind": "wordpiece", "lower_case": True,
                                   "files": ["vocab.txt", "tokenizer_config.json"]}, record["tokenizer"]
    assert record["tasks"]["demo_fever"] == encoder.tasks.spec("demo_fever").to_record(), record["tasks"]


def test_wordpiece_and_query_side_exports_record_no_path_of_this_machine(exported):
    for savedmodel in exported["exports"].values():
        assert_names_no_path_of_this_machine(savedmodel, exported["root"], minilm_l6_dir())
        with open(os.path.join(savedmodel, "assets", "model_config.json")) as f:
            assert json.load(f)["features"]["vocabulary"] == "assets/vocab.txt"
