"""Answer matching (data.answers): the DPR normalisation used by KILT answer recall and confounders."""

from t5_retrieval.data.kilt import answers


def test_has_answer_matches_normalised_token_sequences():
    assert answers.has_answer("The Eiffel Tower is in Paris, France.", ["paris"])
    assert answers.has_answer("Born in São Paulo.", ["Sao Paulo"]), "accents are stripped"
    assert not answers.has_answer("Parisian cafes", ["Paris"]), "matches whole tokens only"
    assert not answers.has_answer("anything", ["", "!!"]), "empty answers never match"
    texts = ["nothing here", "still nothing", "the answer is 42"]
    rank = answers.first_answer_rank(map(answers.dpr_answer_tokens, texts), ["42"])
    assert answers.recall_at_ks(rank, [2, 3]) == {"answer_recall@2": 0.0, "answer_recall@3": 1.0}


def test_first_answer_rank_gives_answer_recall_at_every_k():
    tokens = [answers.dpr_answer_tokens(t) for t in ["no", "Café au lait", "the answer is 42"]]
    assert answers.first_answer_rank(tokens, ["cafe"]) == 2
    assert answers.first_answer_rank(tokens, ["answer is 42", "x"]) == 3
    assert answers.first_answer_rank(tokens, ["missing"]) is None
