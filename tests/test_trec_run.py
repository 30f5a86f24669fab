"""The TREC run `t5r eval` writes beside the KILT predictions: its format, and scores that no metric reads."""

import pytest

from t5_retrieval.data.records import Example, Passage
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.retrieval.evaluate import Ranking, RankingScorer, trec_run, write_results

PASSAGES = PassageTable([Passage(f"p{i}_{j}", f"p{i}", f"Page {i}", f"text {i} {j} answer{i}") for i in range(4)
                         for j in range(2)])
EXAMPLES = [Example("q1", "nq", "first", (("p1",),), ("p1_0",), ("answer1",)),
            Example("q2", "nq", "second", (("p3",),), ("p3_1",), ("answer3",))]
RANKINGS = [["p1_1", "p1_0", "p2_0"], ["p0_0", "p3_1", "p3_0"]]
SCORES = [[3.5, 2.25, -1.0], [0.5, 0.25, 0.125]]


def test_scores_change_no_metric_and_are_kept_for_the_run():
    with_scores, without = RankingScorer(PASSAGES, (1, 2)), RankingScorer(PASSAGES, (1, 2))
    with_scores.add_task("nq", EXAMPLES, RANKINGS, SCORES)
    without.add_task("nq", EXAMPLES, RANKINGS)
    assert with_scores.result().tables == without.result().tables
    assert without.result().runs == {}, "rankings without scores make no run"
    assert with_scores.result().runs["nq"][1] == Ranking("q2", ("p0_0", "p3_1", "p3_0"), (0.5, 0.25, 0.125))
    with pytest.raises(ValueError, match="scores do not match"):
        RankingScorer(PASSAGES).add_task("nq", EXAMPLES, RANKINGS, [SCORES[0], SCORES[1][:2]])


def test_run_lines_rank_passages_from_one_with_their_scores(tmp_path):
    scorer = RankingScorer(PASSAGES, (1, 2))
    scorer.add_task("nq", EXAMPLES, RANKINGS, SCORES)
    write_results(scorer.result(), str(tmp_path))
    assert (tmp_path / "predictions" / "nq.trec").read_text() == (
        "q1 Q0 p1_1 1 3.5 t5r\nq1 Q0 p1_0 2 2.25 t5r\nq1 Q0 p2_0 3 -1 t5r\n"
        "q2 Q0 p0_0 1 0.5 t5r\nq2 Q0 p3_1 2 0.25 t5r\nq2 Q0 p3_0 3 0.125 t5r\n")
    with pytest.raises(ValueError, match="whitespace"):
        trec_run([Ranking("a query", ("p0_0",), (1.0,))])
