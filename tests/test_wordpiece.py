"""WordPiece vocabulary and BERT token conventions: [CLS] text [SEP], padding 0, truncation keeping
[SEP]; the same ids as transformers' tokenizer on real mini-KILT queries; seqio Tasks agree."""

import json
import os

import numpy as np
import pytest
import seqio
from conftest import mini_kilt

from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.text import format_query
from t5_retrieval.data.tokenizers.tokenize import encode_text, load_vocabulary, tokenize
from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary, basic_tokenize

TOKENS = ["[PAD]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "the", "cafe", "un", "##aff", "##able", "##s", ",",
          "!", "who", "is", "?", "a", "b"]
PAD, UNK, CLS, SEP = 0, 2, 3, 4


@pytest.fixture
def vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(TOKENS) + "\n")
    return WordPieceVocabulary(str(path))


def ids(*tokens: str) -> list[int]:
    return [TOKENS.index(t) for t in tokens]


def test_basic_tokenisation_lowercases_strips_accents_and_splits_punctuation():
    assert basic_tokenize("Café, UNAFFABLE!\tWho?", lower_case=True) == ["cafe", ",", "unaffable", "!", "who", "?"]
    assert basic_tokenize("Café,x", lower_case=False) == ["Café", ",", "x"]
    assert basic_tokenize("a\x00b 北京", lower_case=True) == ["ab", "北", "京"], "control chars dropped, CJK split"


def test_greedy_longest_match_first_and_unknown_words(vocab):
    assert list(vocab.encode("the unaffables")) == ids("the", "un", "##aff", "##able", "##s")
    assert list(vocab.encode("unx zzz")) == [UNK, UNK], "a word with an unspellable piece is one [UNK]"
    assert list(vocab.encode("a" * 101)) == [UNK], "words over 100 characters are [UNK]"
    assert vocab.decode(vocab.encode("Who is the unaffable cafe?")) == "who is the unaffable cafe ?"


def test_task_prefix_sentinel_becomes_one_reserved_token(vocab):
    assert list(vocab.encode("a <extra_id_1> who?")) == ids("a", "[unused1]", "who", "?")
    with pytest.raises(ValueError, match=r"no \[unused7\] token"):
        vocab.encode("<extra_id_7>")


def test_bert_conventions_cls_text_sep_then_padding_and_truncation_keeps_sep(vocab):
    rows = tokenize(vocab, ["who is the cafe?", "the " * 20], 8)
    np.testing.assert_array_equal(rows[0], [CLS, *ids("who", "is", "the", "cafe", "?"), SEP, PAD],
                                  err_msg="expected [CLS] text [SEP] then padding 0")
    np.testing.assert_array_equal(rows[1], [CLS, *ids(*["the"] * 6), SEP],
                                  err_msg="truncation must keep [CLS] first and [SEP] last")
    np.testing.assert_array_equal(encode_text(vocab, "a </s> b", 6), [CLS, *ids("a"), SEP, *ids("b"), SEP, PAD],
                                  err_msg="a literal </s> (KILT's [SEP]) must become the [SEP] id")
    with pytest.raises(ValueError, match=">= 3"):
        tokenize(vocab, ["a"], 2)


def test_vocabulary_kind_follows_the_recorded_path(vocab, tmp_path):
    loaded = load_vocabulary(vocab.vocab_file)
    assert isinstance(loaded, WordPieceVocabulary) and loaded == vocab
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))
    by_dir = load_vocabulary(str(tmp_path))
    assert isinstance(by_dir, WordPieceVocabulary) and not by_dir.lower_case, "directory + cased tokenizer config"
    spm = os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece", "sentencepiece.model")
    assert isinstance(load_vocabulary(spm), seqio.SentencePieceVocabulary)


def test_seqio_task_with_wordpiece_tokenizes_queries_like_the_batcher(vocab, tmp_path):
    examples = tmp_path / "data" / "examples"
    examples.mkdir(parents=True)
    queries = ["Who is the cafe?", "the unaffables [SEP] a b", "a " * 30]
    with open(examples / "wp-train.jsonl", "w") as f:
        for i, q in enumerate(queries):
            f.write(json.dumps({"id": str(i), "task": "wp", "query": q, "gold_pages": [], "positive_passages": []}) + "\n")
    retrieval_tasks.set_data_dir(str(tmp_path / "data"))
    retrieval_tasks.add_retrieval_task("test_wordpiece_task", retrieval_tasks.kilt_examples_source("wp"),
                                       vocabulary=vocab)
    try:
        ds = seqio.get_mixture_or_task("test_wordpiece_task").get_dataset({"query": 10}, split="train", shuffle=False)
        got = [ex["query"] for ex in ds.as_numpy_iterator()]
    finally:
        seqio.TaskRegistry.remove("test_wordpiece_task")
    want = tokenize(vocab, [format_query(q, None) for q in queries], 10)
    assert len(got) == len(queries)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w[: len(g)], err_msg="seqio Task and batcher disagree on a query")
    assert SEP in got[1][:-1], "[SEP] inside a KILT query must stay [SEP]"


def _mini_kilt_queries(per_task: int) -> list[str]:
    texts = []
    for name in sorted(os.listdir(mini_kilt())):
        if name.endswith("-dev-kilt.jsonl"):
            with open(mini_kilt(name)) as f:
                texts += [json.loads(line)["input"] for _, line in zip(range(per_task), f)]
    return texts


def test_minilm_vocabulary_matches_transformers_on_mini_kilt_queries():
    from transformers import AutoTokenizer

    from t5_retrieval.models.pretrained import minilm_l6_dir

    model_dir = minilm_l6_dir()
    reference = AutoTokenizer.from_pretrained(model_dir)
    ours = load_vocabulary(model_dir)
    texts = [format_query(t, None) for t in _mini_kilt_queries(per_task=8)]  # [SEP] -> </s>
    assert len(texts) >= 40
    got = tokenize(ours, texts, 64)
    for text, row in zip(texts, got):
        want = reference(text.replace("</s>", "[SEP]"), max_length=64, truncation=True, padding="max_length")
        np.testing.assert_array_equal(row, want["input_ids"], err_msg=f"token ids differ on {text!r}")


def test_tensorflow_encode_and_decode_agree_with_python(vocab):
    import tensorflow as tf

    texts = ["Who is the cafe?", "the unaffables"]
    ragged = vocab.encode_tf(tf.constant(texts))
    assert ragged.to_list() == [list(vocab.encode(t)) for t in texts]
    assert vocab.encode_tf(tf.constant(texts[1])).numpy().tolist() == list(vocab.encode(texts[1]))
    row = tf.constant([[CLS, *ids("who", "is"), SEP, PAD]])
    assert vocab.decode_tf(row).numpy().tolist() == [b"who is"], "decoding drops [CLS], [SEP] and padding"
    assert vocab.decode_tf(row[0]).numpy() == b"who is", "one sequence decodes to one string"
