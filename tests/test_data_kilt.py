"""KILT task files -> examples, BM25 positives and negatives, mixing sizes."""

import json

import pytest

from t5_retrieval.data.kilt.examples import convert_task_file, kilt_file
from t5_retrieval.data.kilt.negatives import mine_bm25_negatives
from t5_retrieval.data.kilt.prepare import _LazyBM25
from t5_retrieval.data.records import DataError, Example, read_examples, read_negatives
from t5_retrieval.data.stores.kb import PassageStore, build_kb
from t5_retrieval.data.tasks.mixing import subbatch_sizes, temperature_rates
from t5_retrieval.data.text import format_query
from t5_retrieval.retrieval.index import build_bm25_index

PAGES = [
    {"wikipedia_id": "1", "wikipedia_title": "Paris", "text": [
        "Paris", "Paris is the capital of France on the Seine.", "Section::::Museums.",
        "The Louvre museum holds the Mona Lisa painting."]},
    {"wikipedia_id": "2", "wikipedia_title": "Berlin", "text": ["Berlin is the capital of Germany."]},
    {"wikipedia_id": "3", "wikipedia_title": "Seine", "text": ["The Seine is a river that flows through Paris."]},
    {"wikipedia_id": "4", "wikipedia_title": "Rome", "text": ["Rome is the capital of Italy."]},
]


@pytest.fixture()
def store(tmp_path):
    src = tmp_path / "pages.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PAGES))
    build_kb(str(src), str(tmp_path / "kb"))
    return PassageStore.open(tmp_path / "kb")


def _write(tmp_path, rows, name="t-train-kilt.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _convert(path, store, **kw):
    return convert_task_file(path, "t", store, _LazyBM25(store).best_passage, **kw)


def test_spans_pick_the_covering_passage_and_page_only_labels_use_bm25(tmp_path, store):
    rows = [
        {"id": "a", "input": "Where is the Mona Lisa?", "output": [
            {"answer": "Louvre", "provenance": [{"wikipedia_id": "1", "start_paragraph_id": 3, "end_paragraph_id": 3}]}]},
        {"id": "b", "input": "Which museum has the Mona Lisa painting?", "output": [
            {"answer": "Louvre", "provenance": [{"wikipedia_id": "1"}]}, {"answer": "the Louvre"}]},
        {"id": "c", "input": "Which capitals lie on rivers?", "output": [
            {"answer": "x", "provenance": [{"wikipedia_id": "1"}, {"wikipedia_id": "3"}, {"wikipedia_id": "1"}]},
            {"answer": "y", "provenance": [{"wikipedia_id": "2"}]}]},
    ]
    examples, stats = _convert(_write(tmp_path, rows), store)
    a, b, c = examples
    assert a.positive_passages == ("1_1",), "span on paragraph 3 must map to the Museums-section passage"
    assert b.positive_passages == ("1_1",), "BM25 must pick the page's passage that mentions the Mona Lisa"
    assert b.answers == ("Louvre", "the Louvre")
    assert c.gold_pages == (("1", "3"), ("2",)), "evidence sets keep distinct pages in order"
    assert stats.positives_from_spans == 1 and stats.kept == 3


def test_min_bleu_drops_only_provenance_with_a_low_score(tmp_path, store):
    rows = [
        {"id": "a", "input": "q1", "output": [{"provenance": [{"wikipedia_id": "2", "bleu_score": 0.3}]}]},
        {"id": "b", "input": "q2", "output": [{"provenance": [{"wikipedia_id": "2", "bleu_score": 0.7}]}]},
        {"id": "c", "input": "q3", "output": [{"provenance": [{"wikipedia_id": "2"}]}]},
        {"id": "d", "input": "q4", "output": [{"answer": "no provenance"}]},
    ]
    examples, stats = _convert(_write(tmp_path, rows), store, min_bleu=0.5)
    assert [e.id for e in examples] == ["b", "c", "d"], "only the example whose provenance all fell below is dropped"
    assert examples[2].gold_pages == () and examples[2].positive_passages == ()
    assert stats.provenance_below_bleu == 1 and stats.no_provenance == 1


def test_downsampling_is_deterministic_for_a_seed(tmp_path, store):
    rows = [{"id": str(i), "input": f"q{i}", "output": [{"provenance": [{"wikipedia_id": "2"}]}]} for i in range(20)]
    path = _write(tmp_path, rows)
    first = [e.id for e in _convert(path, store, max_examples=5, seed=3)[0]]
    again = [e.id for e in _convert(path, store, max_examples=5, seed=3)[0]]
    other = [e.id for e in _convert(path, store, max_examples=5, seed=4)[0]]
    assert len(first) == 5 and first == again and first != other


def test_missing_gold_page_is_counted_and_fatal_when_strict(tmp_path, store):
    rows = [{"id": "a", "input": "q", "output": [{"provenance": [{"wikipedia_id": "999"}, {"wikipedia_id": "2"}]}]}]
    path = _write(tmp_path, rows)
    examples, stats = _convert(path, store)
    assert stats.missing_gold_pages == 1 and examples[0].positive_passages == ("2_0",)
    with pytest.raises(DataError, match=r"t-train-kilt.jsonl:1: gold page\(s\) \['999'\]"):
        _convert(path, store, strict=True)


def test_bad_records_name_file_line_and_field(tmp_path, store):
    with pytest.raises(DataError, match=r":2: field 'input' is empty"):
        _convert(_write(tmp_path, [{"id": "a", "input": "q", "output": []}, {"id": "b", "input": " \n"}]), store)
    with pytest.raises(DataError, match=r":1: output\[0\].provenance\[0\]: missing field 'wikipedia_id'"):
        _convert(_write(tmp_path, [{"id": "a", "input": "q", "output": [{"provenance": [{"title": "x"}]}]}]), store)
    with pytest.raises(DataError, match=r":2: malformed json"):
        _convert(_write(tmp_path, [{"id": "a", "input": "q", "output": []}, "{oops"]), store)


def test_an_example_without_output_is_an_error_naming_file_and_line(tmp_path, store):
    rows = [{"id": "a", "input": "q", "output": [{"provenance": [{"wikipedia_id": "2"}]}]},
            {"id": "b", "input": "q2", "meta": {}}]
    with pytest.raises(DataError, match=r"t-train-kilt.jsonl:2: missing field 'output'"):
        _convert(_write(tmp_path, rows), store)


def test_a_repeated_example_id_is_an_error_naming_both_lines(tmp_path, store):
    rows = [{"id": i, "input": f"q{n}", "output": [{"provenance": [{"wikipedia_id": "2"}]}]}
            for n, i in enumerate(["a", "b", "c", "b"])]
    with pytest.raises(DataError, match=r"t-train-kilt.jsonl:4: example id 'b' is also the id of line 2"):
        _convert(_write(tmp_path, rows), store)


def test_processed_examples_and_negatives_refuse_a_repeated_id(tmp_path):
    example = {"task": "t", "query": "q", "gold_pages": [["2"]]}
    examples = _write(tmp_path, [{"id": "x", **example}, {"id": "y", **example}, {"id": "x", **example}],
                      "t-train.jsonl")
    with pytest.raises(DataError, match=r"t-train.jsonl:3: example id 'x' is also the id of line 1"):
        read_examples(examples)
    negatives = _write(tmp_path, [{"id": "x", "negatives": ["1_0"]}, {"id": "x", "negatives": ["4_0"]}],
                       "negatives.jsonl")
    with pytest.raises(DataError, match=r"negatives.jsonl:2: example id 'x' is also the id of line 1"):
        read_negatives(negatives)


def test_unknown_task_lists_the_known_ones(tmp_path):
    _write(tmp_path, [], "fever-train-kilt.jsonl")
    _write(tmp_path, [], "wow-train-kilt.jsonl")
    with pytest.raises(DataError, match="unknown task 'nq'.*fever, wow"):
        kilt_file(str(tmp_path), "nq", "train")


def test_bm25_negatives_exclude_every_gold_page(tmp_path, store):
    rows = [{"id": "a", "input": "capital of France Paris Seine river", "output": [
        {"provenance": [{"wikipedia_id": "1"}]}, {"provenance": [{"wikipedia_id": "3"}]}]}]
    examples, _ = _convert(_write(tmp_path, rows), store)
    (neg,) = mine_bm25_negatives(examples, build_bm25_index(store), store, top_k=10)
    assert neg.id == "a" and set(neg.negatives) == {"2_0", "4_0"}, f"got {neg.negatives}"
    assert neg.negatives[0] in {"2_0", "4_0"}


def test_bm25_negatives_exclude_the_positive_of_an_example_without_gold_pages(store):
    """A seqio Task of one's own may give a positive passage and no gold pages."""
    example = Example(id="a", task="faq", query="capital of France Paris Seine river", gold_pages=(),
                      positive_passages=("1_0",))
    (neg,) = mine_bm25_negatives([example], build_bm25_index(store), store, top_k=10)
    (unlabelled,) = mine_bm25_negatives([Example(id="a", task="faq", query=example.query, gold_pages=())],
                                        build_bm25_index(store), store, top_k=10)
    assert "1_0" in unlabelled.negatives, "BM25 ranks the positive among the top 10"
    assert neg.negatives == tuple(p for p in unlabelled.negatives if p != "1_0"), neg.negatives


def test_query_text_normalisation_and_prefix():
    assert format_query("Wagner [SEP] field\nof work", "TREX") == "TREX <extra_id_1> Wagner </s> field of work"
    assert format_query("a\nb", None) == "a b"


def test_subbatch_sizes_give_every_task_one_and_split_the_rest_by_largest_remainder():
    rates = temperature_rates([1000, 100, 10])
    # B * r - 1 = [7.52, 3.79, 1.69] (T = 4, B = 16): floors [7, 3, 1]; the 2 left go to remainders .79 and .69.
    assert [round(16 * r - 1, 2) for r in rates] == [7.52, 3.79, 1.69]
    assert subbatch_sizes([1000, 100, 10], per_device_batch=16) == [8, 5, 3]
    assert subbatch_sizes([10, 10, 10], per_device_batch=3) == [1, 1, 1]
    assert sum(subbatch_sizes([7, 70_000, 3, 900], per_device_batch=64)) == 64


def test_subbatch_sizes_reject_a_batch_smaller_than_the_task_count():
    with pytest.raises(ValueError, match="per-device batch 2 is smaller than the number of tasks 3"):
        subbatch_sizes([1, 2, 3], per_device_batch=2)


def test_ids_differing_only_in_surrounding_whitespace_are_one_id_as_for_the_kilt_scorer(tmp_path, store):
    rows = [{"id": i, "input": f"q{n}", "output": [{"provenance": [{"wikipedia_id": "2"}]}]}
            for n, i in enumerate(["fever-dev-1", "fever-dev-2", "fever-dev-2 "])]
    with pytest.raises(DataError, match=r"t-train-kilt.jsonl:3: example id 'fever-dev-2' is also the id of line 2"):
        _convert(_write(tmp_path, rows), store)
    examples, _ = _convert(_write(tmp_path, rows[:1] + [{**rows[2], "id": " fever-dev-3\t"}]), store)
    assert [e.id for e in examples] == ["fever-dev-1", "fever-dev-3"], "stored ids are the stripped ones"


def test_an_empty_task_file_is_an_error_not_zero_examples(tmp_path, store):
    with pytest.raises(DataError, match=r"t-train-kilt.jsonl: no examples \(the file is empty\)"):
        _convert(_write(tmp_path, []), store)
    with pytest.raises(DataError, match=r"t-dev.jsonl: no examples \(the file is empty\)"):
        read_examples(_write(tmp_path, [], "t-dev.jsonl"))

