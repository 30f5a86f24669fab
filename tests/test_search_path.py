"""The one search path: `Searcher`, the HTTP service, fusion's experts, `t5r eval` and `t5r mine` all
rank through `search.PassageSearcher`, and a BM25 searcher is the same kind of object as a dense one."""

import numpy as np
import pytest

from t5_retrieval.data.kilt.negatives import bm25_query
from t5_retrieval.data.records import Example, Passage
from t5_retrieval.data.stores import bm25 as bm25_scores
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.fusion import experts, fuse
from t5_retrieval.retrieval import evaluate, index, mine, search, serve
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder
from t5_retrieval.searcher import Searcher

KB = PassageTable([
    Passage("paris_0", "paris", "Paris", "Paris is the capital and largest city of France."),
    Passage("paris_1", "paris", "Paris", "The Eiffel Tower in Paris was built for the 1889 World's Fair."),
    Passage("berlin_0", "berlin", "Berlin", "Berlin is the capital of Germany."),
    Passage("nile_0", "nile", "Nile", "The Nile is a major river in northeastern Africa."),
    Passage("everest_0", "everest", "Mount Everest", "Mount Everest is Earth's highest mountain."),
])
QUERIES = ["capital of France", "highest mountain on Earth", "river in Africa [SEP] Nile"]
TASK = "nq"  # the lexical encoder takes any task name


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    encoder = HashedBagOfWordsEncoder(dim=64)
    directory = str(tmp_path_factory.mktemp("emb"))
    embedding_store.write_embeddings(encoder, KB, KB.ids(), directory, progress=False)
    return encoder, index.build_index(directory, backend="exact")


@pytest.fixture
def searched(monkeypatch):
    """Every batch any caller searches through `PassageSearcher`: (texts' encoded form, rankings)."""
    calls = []
    original = search.PassageSearcher.search_batches

    def recording(self, queries, k):
        for batch, ranked in original(self, queries, k):
            calls.append((list(queries), [r.passage_ids for r in ranked]))
            yield batch, ranked

    monkeypatch.setattr(search.PassageSearcher, "search_batches", recording)
    return calls


def expected_ids(dense, queries, k):
    encoder, idx = dense
    vectors = encoder.encode_queries(queries, TASK)
    rows, _ = idx.search(vectors, k)
    return [[idx.passage_ids[r] for r in row] for row in rows]


def test_searcher_service_experts_eval_and_mine_rank_through_the_one_path(dense, searched):
    encoder, idx = dense
    want = expected_ids(dense, QUERIES, 3)
    examples = [Example(f"q{i}", TASK, q, gold_pages=(("nowhere",),)) for i, q in enumerate(QUERIES)]
    service = serve.SearchService(encoder, idx, KB, [TASK])
    users = {
        "Searcher": lambda: [[h.passage_id for h in hits]
                             for hits in Searcher(encoder, idx, KB).search(QUERIES, 3, task=TASK)],
        "SearchService": lambda: [[h["passage_id"] for h in hits] for hits in service.search(QUERIES, 3, task=TASK)],
        "Expert": lambda: [ids for ids, _ in experts.Expert(experts.ExpertSpec(TASK, "lexical:64", "idx"), encoder, idx,
                                                            TASK).search(QUERIES, 3)[1]],
        "evaluate": lambda: [r.passage_ids for r in evaluate.evaluate(encoder, idx, {TASK: examples}, KB, ks=(1, 3),
                                                                      depth=3).runs[TASK]],
        "mine": lambda: [n.negatives for n in mine.mine_negatives(encoder, idx, examples, KB, k=3)],
    }
    for user, run in users.items():
        searched.clear()
        got = run()
        assert searched, f"{user} searched without going through search.PassageSearcher"
        assert [ids for _, ranked in searched for ids in ranked] == want, f"{user}: another ranking on the one path"
        assert [list(ids) for ids in got] == want, f"{user}: returns other passages than the one path found"


def test_a_bm25_searcher_is_a_dense_searchers_kind_and_ranks_as_bm25(dense):
    encoder, idx = dense
    built = index.build_bm25_index(KB)
    bm25 = search.bm25_searcher(built)
    lexical = search.dense_searcher(encoder, idx, TASK)
    assert type(bm25) is type(lexical) is search.PassageSearcher
    for q, ranked in enumerate(bm25.search(QUERIES, 4)):
        every = bm25_scores.query_scores(built.retriever, bm25_query(QUERIES[q]))  # the markers dropped
        top = np.argsort(-every, kind="stable")[:4]
        assert isinstance(ranked, search.Ranked) and ranked.scores.dtype == np.float32
        assert ranked.passage_ids == [KB.ids()[r] for r in top], f"query {q}: not BM25's ranking"
        np.testing.assert_array_equal(ranked.scores, every[top])
    assert bm25.search(QUERIES, 2)[0].passage_ids[:1] == ["paris_0"], "BM25 finds the capital of France"


def test_fusion_composes_any_two_searchers(dense):
    """The hybrid interpolates the fused ranking with a searcher's; at weight 1 a dense one ranks alone."""
    encoder, idx = dense
    lexical = search.dense_searcher(encoder, idx, TASK)
    bm25 = search.bm25_searcher(index.build_bm25_index(KB))
    for ranked, other in zip(bm25.search(QUERIES, 5), lexical.search(QUERIES, 5)):
        ids, _ = fuse.hybrid(ranked, other, 1.0)
        assert ids == other.passage_ids, "weight 1: the second searcher's ranking"


def test_hits_carry_the_passage_and_pages_keep_each_page_once_where_it_ranks_best():
    ranked = search.Ranked(["paris_1", "berlin_0", "paris_0"], np.asarray([3.0, 2.0, 1.0], np.float32))
    hits = search.hits(ranked, KB)
    assert [(h.passage_id, h.wikipedia_id, h.title, h.score) for h in hits] == \
        [("paris_1", "paris", "Paris", 3.0), ("berlin_0", "berlin", "Berlin", 2.0), ("paris_0", "paris", "Paris", 1.0)]
    assert hits[0].text == KB.get("paris_1").text
    assert search.pages(ranked.passage_ids, KB) == ["paris", "berlin"]
