"""Hand-built KILT gold files read and scored as the official scorer (`kilt/eval_retrieval.py`) does.

Every expected number below is worked out by hand from the scorer's rules (ids stripped; one
evidence set per output with a `provenance` key, even an empty one; a query without provenance
scores 0 and counts; guesses deduplicated keeping the first), then compared with what the
evaluation path produces: KILT file -> `convert_task_file` -> `RankingScorer` over passage rankings.
"""

import json

import pytest

from t5_retrieval.data.kilt.examples import convert_task_file
from t5_retrieval.data.kilt.prepare import _LazyBM25, prepare_tasks
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.stores.kb import PassageStore, build_kb
from t5_retrieval.retrieval.evaluate import RankingScorer

# One single-paragraph page per id, so page "X" has the one passage "X_0".
PAGE_IDS = ["1", "2", "3", "4", "5", "7", "9", "11", "33", "44", "88"]


@pytest.fixture()
def store(tmp_path):
    src = tmp_path / "pages.jsonl"
    src.write_text("".join(json.dumps({"wikipedia_id": p, "wikipedia_title": f"Page {p}",
                                       "text": [f"Page {p} is about topic number {p}."]}) + "\n" for p in PAGE_IDS))
    build_kb(str(src), str(tmp_path / "kb"))
    return PassageStore.open(tmp_path / "kb")


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prov(*ids):
    return {"provenance": [{"wikipedia_id": i} for i in ids]}


GOLD = [
    # Ids with whitespace and an int id: the scorer compares str(id).strip().
    {"id": "a", "input": "query a", "output": [_prov(" 2 "), _prov(3, "1\n")]},
    # An empty provenance list is an evidence set that can never be found, but it counts.
    {"id": "b", "input": "query b", "output": [{"answer": "x", "provenance": []}, _prov("4")]},
    # No provenance at all: still a query, scoring 0.
    {"id": "c", "input": "query c", "output": [{"answer": "only an answer"}]},
    # The scorer's own test case (kilt/tests/test_eval_retrieval.py).
    {"id": "d", "input": "query d", "output": [_prov("1", "2"), _prov("5"), _prov("7", "9", "11")]},
]
# Passage rankings, best first; pages repeat only where a passage id repeats (deduplicated, first kept).
RANKINGS = {
    "a": ["1_0", "3_0", "1_0", "4_0", "2_0"],  # pages 1 3 4 2
    "b": ["4_0", "2_0", "4_0"],  # pages 4 2
    "c": ["2_0"],
    "d": [f"{p}_0" for p in ["2", "5", "7", "33", "1", "9", "44", "88"]],
}
# Per query, by hand (slots: True = a completed evidence set, False = a non-gold page):
#  a: sets {2}, {1,3}; pages 1 3 4 2 -> slots T F T (1 starts {1,3}, 3 completes it); R-prec
#     max(0/1 [1], 2/2 [1,3]) = 1; P@1 1, P@5 2/5, R@2 1/2, R@5 2/2, success@5 1.
#  b: sets {}, {4}; pages 4 2 -> slots T F; R-prec max(0, 1/1) = 1; P@1 1, P@5 1/5, R@2 1/2,
#     R@5 1/2 (the empty set is never found), success@5 1.
#  c: no set: every metric 0.
#  d: R-prec 0.5, P@1 1, P@5 0.4, R@2 1/3 (slots T F ...), R@5 2/3, success@5 1.
EXPECTED_PER_QUERY = {
    "a": {"Rprec": 1.0, "precision@1": 1.0, "precision@5": 2 / 5, "recall@2": 1 / 2, "recall@5": 1.0,
          "success_rate@5": 1.0},
    "b": {"Rprec": 1.0, "precision@1": 1.0, "precision@5": 1 / 5, "recall@2": 1 / 2, "recall@5": 1 / 2,
          "success_rate@5": 1.0},
    "c": {"Rprec": 0.0, "precision@1": 0.0, "precision@5": 0.0, "recall@2": 0.0, "recall@5": 0.0,
          "success_rate@5": 0.0},
    "d": {"Rprec": 0.5, "precision@1": 1.0, "precision@5": 0.4, "recall@2": 1 / 3, "recall@5": 2 / 3,
          "success_rate@5": 1.0},
}


def _score(tmp_path, store, ids):
    gold = [r for r in GOLD if r["id"] in ids]
    examples, _ = convert_task_file(_write(tmp_path / "t-dev-kilt.jsonl", gold), "t", store,
                                    _LazyBM25(store).best_passage)
    scorer = RankingScorer(store, ks=(1, 2, 5))
    scorer.add_task("t", examples, [RANKINGS[e.id] for e in examples])
    return scorer.tables["t"], scorer.predictions["t"]


@pytest.mark.parametrize("query", sorted(EXPECTED_PER_QUERY))
def test_each_hand_built_query_scores_what_the_official_rules_give(tmp_path, store, query):
    table, _ = _score(tmp_path, store, {query})
    assert table["n"] == 1, f"query {query} must be evaluated, got n={table['n']}"
    for key, value in EXPECTED_PER_QUERY[query].items():
        assert table[key] == pytest.approx(value), f"query {query}, {key}: expected {value}, got {table[key]}"


def test_file_means_count_every_query_including_the_one_without_provenance(tmp_path, store):
    table, predictions = _score(tmp_path, store, set(EXPECTED_PER_QUERY))
    assert table["n"] == 4 and [row["id"] for row in predictions] == ["a", "b", "c", "d"]
    # Rprec (1 + 1 + 0 + 0.5) / 4; recall@5 (1 + 1/2 + 0 + 2/3) / 4 = 13/24; recall@2 (1/2 + 1/2 + 0 + 1/3) / 4.
    expected = {"Rprec": 0.625, "precision@1": 0.75, "precision@5": 0.25, "recall@2": 1 / 3,
                "recall@5": 13 / 24, "success_rate@5": 0.75}
    for key, value in expected.items():
        assert table[key] == pytest.approx(value), f"{key}: expected {value}, got {table[key]}"


def test_gold_sets_are_stripped_ids_with_the_empty_set_kept(tmp_path, store):
    examples, stats = convert_task_file(_write(tmp_path / "t-dev-kilt.jsonl", GOLD), "t", store,
                                        _LazyBM25(store).best_passage)
    gold = {e.id: e.gold_pages for e in examples}
    assert gold == {"a": (("2",), ("3", "1")), "b": ((), ("4",)), "c": (),
                    "d": (("1", "2"), ("5",), ("7", "9", "11"))}, gold
    assert stats.no_provenance == 1 and stats.kept == 4 and stats.missing_gold_pages == 0


def test_min_bleu_filters_the_train_split_but_never_the_evaluated_one(tmp_path, store):
    raw, data_dir = tmp_path / "raw", tmp_path / "data"
    raw.mkdir()
    data_dir.mkdir()
    (data_dir / "kb").symlink_to(tmp_path / "kb")
    low = {"id": "q", "input": "query", "output": [{"provenance": [{"wikipedia_id": "2", "bleu_score": 0.1}]}]}
    for split in ("train", "dev"):
        _write(raw / f"t-{split}-kilt.jsonl", [low])
    stats = prepare_tasks(str(raw), str(data_dir), ["t"], min_bleu=0.5)
    assert stats["t-train"].provenance_below_bleu == 1 and stats["t-train"].kept == 0
    (dev,) = read_examples(data_dir / "examples" / "t-dev.jsonl")
    assert dev.gold_pages == (("2",),), "dev gold labels must be those the official scorer reads"
