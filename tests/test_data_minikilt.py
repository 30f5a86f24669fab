"""Real data: the commands run on mini-KILT, and our BM25 matches its reference R-precision."""

import json

from conftest import mini_kilt

from t5_retrieval.data import layout
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_tasks
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.retrieval import search
from t5_retrieval.retrieval.index import build_bm25_index

TASKS = ["fever", "wow", "hotpotqa", "trex", "entityquestions", "entity_linking"]


def r_precision(gold_sets, predicted_pages):
    """KILT page-level R-precision of one query (max over evidence sets)."""
    return max(len(set(predicted_pages[: len(set(s))]) & set(s)) / len(set(s)) for s in gold_sets)


def test_bm25_dev_r_precision_matches_the_mini_kilt_reference(tmp_path):
    data_dir = str(tmp_path)
    # The reference indexes mini-KILT's one-passage-per-paragraph file, so we build the KB from it.
    prepare_kb(mini_kilt("kb", "passages.jsonl"), data_dir)
    store = PassageStore.open(layout.kb_dir(data_dir))
    searcher = search.bm25_searcher(build_bm25_index(store))
    prepare_tasks(mini_kilt(), data_dir, TASKS, ("dev",), strict=True)
    with open(mini_kilt("bm25_reference_dev.json")) as f:
        reference = json.load(f)
    ours = {}
    for task in TASKS:
        examples = read_examples(layout.examples_path(data_dir, task, "dev"))
        assert len(examples) == reference[f"{task}/dev"]["n"]
        found = searcher.search([e.query for e in examples], 200)  # pages of the top 200 passages
        scores = [r_precision(e.gold_pages, search.pages(r.passage_ids, store)[:5]) for e, r in zip(examples, found)]
        ours[task] = sum(scores) / len(scores)
    off = {t: (round(ours[t], 3), reference[f"{t}/dev"]["r_prec"]) for t in TASKS
           if abs(ours[t] - reference[f"{t}/dev"]["r_prec"]) > 0.03}
    assert not off, f"BM25 R-precision (ours, reference) differs by more than 0.03: {off}"
