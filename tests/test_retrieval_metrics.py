"""KILT metrics against the official scorer's own test case and hand-worked edge cases."""

import pytest

from t5_retrieval.retrieval import metrics

# kilt/tests/test_eval_retrieval.py: gold evidence sets and the guessed page ranking.
KILT_GOLD = [("1", "2"), ("5",), ("7", "9", "11")]
KILT_GUESS = ["2", "5", "7", "33", "1", "9", "44", "88"]


def test_official_kilt_test_case_numbers_are_reproduced():
    scores = metrics.kilt_scores(KILT_GOLD, KILT_GUESS, ks=[1, 5])
    expected = {"Rprec": 0.5, "precision@1": 1.0, "precision@5": 0.4, "recall@5": 2 / 3, "success_rate@5": 1.0}
    for key, value in expected.items():
        assert scores[key] == pytest.approx(value), f"{key}: expected {value}, got {scores[key]}"
    assert "recall@1" not in scores and "success_rate@1" not in scores, "recall/success are only defined for k > 1"


def test_plain_functions_agree_with_kilt_scores():
    assert metrics.r_precision(KILT_GOLD, KILT_GUESS) == 0.5
    assert metrics.precision_at_k(KILT_GOLD, KILT_GUESS, 5) == pytest.approx(0.4)
    assert metrics.recall_at_k(KILT_GOLD, KILT_GUESS, 5) == pytest.approx(2 / 3)
    assert metrics.success_at_k(KILT_GOLD, KILT_GUESS, 5) == 1.0


def test_rank_slots_place_each_evidence_set_at_its_last_found_page():
    slots, num_sets = metrics.rank_slots(KILT_GOLD, KILT_GUESS)
    # 2 starts {1,2}; 5 completes {5}; 7 starts {7,9,11}; 33 miss; 1 completes {1,2} (its slot moves
    # here); 9 moves the partial {7,9,11}; 44, 88 miss.
    assert slots == [True, False, True, ("partial", 2), False, False], slots
    assert num_sets == 3


def test_recall_counts_a_set_only_when_all_its_pages_are_in_the_first_k_slots():
    gold = [("a", "b")]
    assert metrics.recall_at_k(gold, ["a", "x", "y", "b"], 2) == 0.0, "the set completes in slot 3, after x and y"
    assert metrics.recall_at_k(gold, ["a", "x", "b"], 2) == 1.0, "a's slot moves to b: the set is slot 2"
    assert metrics.recall_at_k(gold, ["a", "b", "x"], 2) == 1.0, "the set completes in slot 1"
    # Partial sets do not take a slot of their own once completed: "a" then "b" collapse into one.
    assert metrics.precision_at_k(gold, ["a", "b", "x"], 2) == 0.5


def test_duplicate_guesses_are_removed_keeping_the_first():
    gold = [("p",)]
    assert metrics.r_precision(gold, ["q", "q", "p"]) == 0.0, "R=1 looks at the first distinct guess only"
    assert metrics.recall_at_k(gold, ["q", "q", "p"], 2) == 1.0, "after dedup p is in slot 2"
    assert metrics.dedup_keep_first(["b", "a", "b", "c", "a"]) == ["b", "a", "c"]


def test_identical_evidence_sets_count_once():
    gold = [("a",), ("a",), ("b", "c")]
    assert metrics.recall_at_k(gold, ["a", "z"], 2) == 0.5, "two distinct sets, one completed"


def test_r_precision_takes_the_best_evidence_set():
    gold = [("a", "b"), ("c",)]
    assert metrics.r_precision(gold, ["c", "a"]) == 1.0
    assert metrics.r_precision(gold, ["a", "z"]) == 0.5


def test_no_guesses_score_zero_everywhere():
    scores = metrics.kilt_scores([("a",)], [], ks=[1, 5])
    assert all(v == 0.0 for v in scores.values()), scores


def test_invalid_k_is_refused():
    with pytest.raises(ValueError, match="k must be >= 2"):
        metrics.recall_at_k(KILT_GOLD, KILT_GUESS, 1)


def test_a_query_without_evidence_sets_scores_zero_as_in_the_official_scorer():
    assert metrics.r_precision([], ["a"]) == 0.0
    scores = metrics.kilt_scores([], ["a", "b"], ks=[1, 5])
    assert scores == {"Rprec": 0.0, "precision@1": 0.0, "precision@5": 0.0, "recall@5": 0.0,
                      "success_rate@5": 0.0}, scores


def test_an_empty_evidence_set_is_never_found_but_counts_in_recall():
    gold = [(), ("a",)]
    assert metrics.recall_at_k(gold, ["a", "b"], 2) == 0.5, "one of two distinct evidence sets found"
    assert metrics.r_precision(gold, ["a"]) == 1.0, "R-precision takes the best set"


def test_mean_scores_average_over_queries():
    per_query = [metrics.kilt_scores([("a",)], ["a"], [1]), metrics.kilt_scores([("a",)], ["b"], [1])]
    assert metrics.mean_scores(per_query) == {"Rprec": 0.5, "precision@1": 0.5}


def test_passage_r_precision_uses_gold_passages_as_one_set():
    assert metrics.passage_r_precision(["p1", "p2"], ["p2", "p9", "p1"]) == 0.5
