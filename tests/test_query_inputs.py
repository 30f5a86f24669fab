"""Queries as the model reads them: each task at its own length, entity linking in a window centred
on its mention, and the same token ids in training (the seqio Task) and at inference (the model
directory's recorded lengths), checked on the shipped real-data slice of mini-KILT."""

import os

import jax
import numpy as np
import pytest
import seqio

from t5_retrieval import sharding
from t5_retrieval.data import layout
from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.materialize import materialize
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.text import END_ENT, START_ENT, format_query, normalize_query
from t5_retrieval.data.tokenizers.query_inputs import (
    KEEP_BEGINNING,
    MENTION_WINDOW,
    QueryInput,
    mention_window,
    query_ids,
    query_tokens,
    split_mention,
)
from t5_retrieval.data.tokenizers.tokenize import encode_batch, load_vocabulary, tokenize
from t5_retrieval.models.pretrained import minilm_l6_dir
from t5_retrieval.results.common import TASKS

T5_ROWS_EL_LEN = 158  # results/t5_rows.T5_QUERY_LENS["entity_linking"]


@pytest.fixture(scope="module")
def wordpiece():
    return load_vocabulary(minilm_l6_dir())


@pytest.fixture(scope="module")
def slice_data(tmp_path_factory):
    """The shipped demo slice, prepared as `make demo` prepares it (KB, examples, BM25 negatives)."""
    from t5_retrieval.results.common import prepare_data

    root = str(tmp_path_factory.mktemp("slice"))
    data_dir = os.path.join(root, "data")
    prepare_data(extract(SHIPPED, root), data_dir)
    return data_dir


@pytest.fixture(scope="module")
def sentencepiece(slice_data):
    """A T5-convention sentencepiece model trained on the slice's KB (`t5r vocab train`)."""
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    return train_vocabulary(layout.kb_dir(slice_data), os.path.join(slice_data, "spm"), vocab_size=2000)


def _words(vocab, n: int) -> list[str]:
    """`n` distinct lower-case words that WordPiece keeps whole (one token each)."""
    words = [t for t in vocab.tokens[2000:] if t.isascii() and t.isalpha() and len(t) > 2][:n]
    assert [len(ids) for ids in encode_batch(vocab, words)] == [1] * n
    return words


def _find(ids: list[int], part: list[int]) -> int:
    """Where `part` starts in `ids`, or -1."""
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part), -1)


def test_a_mention_at_token_150_of_a_300_token_input_is_inside_the_window(wordpiece):
    words = _words(wordpiece, 286)
    left, mention, right = words[:149], words[149], words[150:]
    text = " ".join([*left, START_ENT, mention, END_ENT, *right])
    whole = tokenize(wordpiece, [text], 1000)[0]
    start_marker, end_marker = encode_batch(wordpiece, [START_ENT, END_ENT])
    assert np.count_nonzero(whole) == 300 and _find(list(whole), start_marker) == 150, "precondition: token 150 of 300"

    ids = list(query_tokens(wordpiece, [text], QueryInput(None, 109, MENTION_WINDOW))[0])
    at = _find(ids, [*start_marker, *encode_batch(wordpiece, [mention])[0], *end_marker])
    assert at > 0, "the mention and both markers must be in the window"
    kept_left, kept_right = at - 1, 109 - 1 - (at + 13)  # between [CLS] and the mention, then up to [SEP]
    assert ids[1:at] == encode_batch(wordpiece, [" ".join(left[-kept_left:])])[0], "the end of the left context"
    assert ids[at + 13:-1] == encode_batch(wordpiece, [" ".join(right[:kept_right])])[0], "the start of the right"
    assert abs(kept_left - kept_right) <= 1, f"centred: {kept_left} tokens before, {kept_right} after"
    beginning = list(query_tokens(wordpiece, [text], QueryInput(None, 109, KEEP_BEGINNING))[0])
    assert _find(beginning, start_marker) < 0, "cut at its end, the same input loses the mention"


def test_the_window_never_exceeds_the_budget_always_holds_the_mention_and_fills_what_it_can():
    markers = 4
    for budget in range(markers, 24):
        for left in range(12):
            for mention in range(6):
                for right in range(12):
                    kept = mention_window(left, markers, mention, right, budget)
                    case = f"left {left}, mention {mention}, right {right}, budget {budget}: kept {kept}"
                    assert markers + sum(kept) <= budget, case
                    assert 0 <= kept[0] <= left and 0 <= kept[2] <= right, case
                    assert kept[1] == min(mention, budget - markers), case
                    assert markers + sum(kept) == min(budget, markers + left + mention + right), case
                    half = (budget - markers - kept[1]) // 2
                    if left >= half + 1 and right >= half + 1:
                        assert abs(kept[0] - kept[2]) <= 1, f"both sides long: centred; {case}"
    with pytest.raises(ValueError, match="cannot hold the entity markers"):
        mention_window(5, markers, 1, 5, markers - 1)


@pytest.mark.parametrize("length", [24, 40, 64, 109, 160])
def test_every_window_of_real_queries_fits_its_length_and_holds_both_markers(wordpiece, slice_data, length):
    texts = [e.query for split in ("train", "dev")
             for e in read_examples(layout.examples_path(slice_data, "entity_linking", split))]
    start_marker, end_marker = encode_batch(wordpiece, [START_ENT, END_ENT])
    for prefix in (None, "AIDA"):
        rows = query_ids(wordpiece, texts, QueryInput(prefix, length, MENTION_WINDOW))
        for text, ids in zip(texts, rows):
            assert len(ids) <= length - 1, f"{len(ids)} ids + [SEP] exceed {length}: {text[:80]}"
            start = _find(ids, start_marker)
            assert 0 < start < _find(ids, end_marker), f"length {length}: markers missing from {text[:80]}"
            if prefix:
                assert ids[1:4] == encode_batch(wordpiece, ["AIDA <extra_id_1>"])[0], "the prefix is never cut"


def test_a_query_that_fits_is_tokenised_as_a_whole_and_one_without_markers_is_cut_at_its_end(wordpiece, slice_data):
    texts = [e.query for e in read_examples(layout.examples_path(slice_data, "entity_linking", "dev"))]
    short = [t for t in texts if len(encode_batch(wordpiece, [normalize_query(t)])[0]) <= 60]
    assert short, "precondition: some entity-linking queries fit in 64 tokens"
    np.testing.assert_array_equal(query_tokens(wordpiece, short, QueryInput("AIDA", 64, MENTION_WINDOW)),
                                  tokenize(wordpiece, [format_query(t, "AIDA") for t in short], 64),
                                  err_msg="WordPiece splits at the markers' brackets: segments = the whole string")
    plain = "a query with no mention " * 10
    assert split_mention(plain) is None and split_mention(f"{END_ENT} x {START_ENT}") is None
    np.testing.assert_array_equal(query_tokens(wordpiece, [plain], QueryInput(None, 16, MENTION_WINDOW)),
                                  tokenize(wordpiece, [plain], 16))


def _bert_inference(features, vocab):
    """A real (tiny, untrained) BERT dual encoder behind the inference class, with its token ids spied on."""
    from t5_retrieval.inference import DualEncoderInference
    from t5_retrieval.models.bert import BertConfig
    from t5_retrieval.models.bert_dual_encoder import BertDualEncoder, BertDualEncoderConfig

    model = BertDualEncoder(BertConfig(hidden_size=16, num_heads=2, intermediate_size=32, num_layers=1),
                            BertDualEncoderConfig())
    params = model.init(jax.random.PRNGKey(0), np.ones((1, 4), np.int32))["params"]
    encoder = DualEncoderInference(model, params, {"features": features}, "fp", sharding.make_mesh(), vocabulary=vocab)
    seen = []
    encode_tokens = encoder.encode_tokens
    encoder.encode_tokens = lambda tokens, tower=None: seen.append(tokens) or encode_tokens(tokens, tower)
    return encoder, seen


@pytest.mark.parametrize("vocabulary", ["wordpiece", "sentencepiece"])
def test_training_and_inference_give_the_same_token_ids_for_every_task(vocabulary, slice_data, request):
    from t5_retrieval.data.batching.batches import make_train_iterator

    path = minilm_l6_dir() if vocabulary == "wordpiece" else request.getfixturevalue("sentencepiece")
    lengths = None if vocabulary == "wordpiece" else {"entity_linking": T5_ROWS_EL_LEN}
    it = make_train_iterator("mini_kilt", slice_data, None, path, lengths, 32, 1, per_device_batch=12, cache_dir="")
    vocab = load_vocabulary(path)
    encoder, seen = _bert_inference(it.features, vocab)
    cut = set()
    for name, spec in it.features["tasks"].items():
        task = seqio.get_mixture_or_task(name)
        examples = materialize(task, "train", None, spec["query_len"])  # the Task's ids, before batching
        text_of = {e.id: e.query for e in read_examples(layout.examples_path(slice_data, spec["dataset"], "train"))}
        encoder.encode_queries([text_of[i] for i in examples.ids], spec["dataset"])
        trained = np.zeros_like(seen[-1])
        for row, ids in zip(trained, examples.queries):
            row[:len(ids)] = ids
        assert seen[-1].shape[1] == spec["query_len"], f"{name}: inference reads another length"
        np.testing.assert_array_equal(seen[-1], trained, err_msg=f"{name}: training and inference token ids differ")
        if (trained[:, -1] != 0).any():
            cut.add(spec["dataset"])
    assert {"wow", "entity_linking"} <= cut, f"precondition: long queries were cut (in {cut})"
    assert it.features["tasks"]["mini_kilt_entity_linking"]["truncation"] == MENTION_WINDOW
    sub = next(it)
    assert {name: sub[name]["query_tokens"].shape[1] for name in sub} == \
        {name: spec["query_len"] for name, spec in it.features["tasks"].items()}, "each sub-batch at its task's length"


@pytest.mark.parametrize("vocabulary", ["wordpiece", "sentencepiece"])
def test_every_entity_linking_query_of_the_demo_slice_contains_its_mention_after_tokenisation(
        vocabulary, slice_data, request):
    path = minilm_l6_dir() if vocabulary == "wordpiece" else request.getfixturevalue("sentencepiece")
    vocab = load_vocabulary(path)
    retrieval_tasks.set_data_dir(slice_data)
    retrieval_tasks.use_vocabulary(path)
    task = seqio.get_mixture_or_task("mini_kilt_entity_linking")
    length = None if vocabulary == "wordpiece" else T5_ROWS_EL_LEN
    budget = length or retrieval_tasks.describe(task).query_len
    for split in ("train", "dev"):
        examples = materialize(task, split, None, length)
        text_of = {e.id: e.query for e in read_examples(layout.examples_path(slice_data, "entity_linking", split))}
        for example_id, ids in zip(examples.ids, examples.queries):
            _, mention, _ = split_mention(normalize_query(text_of[example_id]))
            marked = [*encode_batch(vocab, [START_ENT, mention, END_ENT])]
            assert _find(list(ids), [i for part in marked for i in part]) > 0, \
                f"{split} {example_id}: the mention {mention!r} is not in its tokenised query"
            assert len(ids) <= budget, f"{split} {example_id}: {len(ids)} ids, more than {budget}"


def test_the_zero_shot_row_reads_every_task_at_the_trained_rows_length_and_truncation():
    from t5_retrieval.results.minilm_rows import TRAIN_BINDINGS, zero_shot_tasks

    zero_shot = zero_shot_tasks()
    assert list(zero_shot) == list(TASKS)
    for variant in ("", "_noprefix", "_typed"):
        for dataset, spec in zero_shot.items():
            info = retrieval_tasks.describe(seqio.get_mixture_or_task(f"mini_kilt_{dataset}{variant}"))
            assert (spec["query_len"], spec["truncation"]) == (info.query_len, info.truncation), dataset
    assert zero_shot["entity_linking"]["truncation"] == MENTION_WINDOW
    assert not any(b.startswith("QUERY_LEN") for b in TRAIN_BINDINGS), "trained rows read the Tasks' own lengths"


def test_the_task_cache_key_changes_with_the_query_length_and_the_truncation(slice_data):
    from t5_retrieval.data.tasks.materialize import fingerprint

    keys = {}
    try:
        for length, truncation in ((109, MENTION_WINDOW), (109, KEEP_BEGINNING), (64, MENTION_WINDOW)):
            task = retrieval_tasks.add_retrieval_task("test_cache_key_el", retrieval_tasks.kilt_examples_source(
                "entity_linking"), query_len=length, truncation=truncation)
            keys[length, truncation] = fingerprint(task, "train")
        keys["read at 32"] = fingerprint(task, "train", 32)
    finally:
        seqio.TaskRegistry.remove("test_cache_key_el")
    assert len(set(keys.values())) == len(keys), keys


def test_a_model_trained_before_per_task_lengths_reads_every_task_at_its_one_length_cut_at_the_end():
    from t5_retrieval.models.build import upgraded_config

    old = {"query_len": 64, "passage_len": 256,
           "tasks": {"mini_kilt_entity_linking": {"dataset": "entity_linking", "prefix": "AIDA", "index": 0}}}
    assert TaskSet.from_features(old).query_input("mini_kilt_entity_linking") == QueryInput("AIDA", 64, KEEP_BEGINNING)
    now = {"features": {"tasks": {"mini_kilt_entity_linking": {"query_len": 109, "truncation": MENTION_WINDOW}}}}
    upgraded = upgraded_config({"features": old}, now)["features"]["tasks"]["mini_kilt_entity_linking"]
    assert (upgraded["query_len"], upgraded["truncation"]) == (64, KEEP_BEGINNING), \
        "resuming an old run compares the inputs it was trained on"
