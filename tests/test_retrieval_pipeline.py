"""Evaluation and mining over a tiny real KB, and the encode -> index -> eval -> mine CLIs end to end."""

import json
import os

import gin
import numpy as np
import pytest
from conftest import mini_kilt

from t5_retrieval import cli
from t5_retrieval.commands import encode as encode_command
from t5_retrieval.commands import evaluate as eval_command
from t5_retrieval.commands import index as index_command
from t5_retrieval.commands import mine as mine_command
from t5_retrieval.data import layout
from t5_retrieval.data.kilt import answers
from t5_retrieval.data.records import Example, Passage, read_jsonl, read_negatives
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore, write_passage_store
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.data.tasks.examples import dataset_examples
from t5_retrieval.retrieval import evaluate, metrics, mine, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

KB = [
    Passage("paris_0", "paris", "Paris", "Paris is the capital and largest city of France on the Seine."),
    Passage("paris_1", "paris", "Paris", "The Eiffel Tower was built for the 1889 World's Fair."),
    Passage("berlin_0", "berlin", "Berlin", "Berlin is the capital of Germany and its largest city."),
    Passage("tokyo_0", "tokyo", "Tokyo", "Tokyo is the capital of Japan, on the Pacific coast of Honshu."),
    Passage("everest_0", "everest", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    Passage("nile_0", "nile", "Nile", "The Nile is a major river in northeastern Africa flowing into the Mediterranean."),
    Passage("seine_0", "seine", "Seine", "The Seine is a river in northern France that flows through Paris."),
]
EXAMPLES = {
    "qa": [
        Example("q1", "qa", "What is the capital of Germany?", (("berlin",),), ("berlin_0",), ("Berlin",)),
        Example("q2", "qa", "highest mountain above sea level", (("everest",),), ("everest_0",), ("Mount Everest",)),
        Example("q3", "qa", "river flowing through Paris France", (("seine", "paris"),), ("seine_0",), ("Seine",)),
    ],
    "fever": [Example("f1", "fever", "The Nile flows into the Mediterranean.", (("nile",),), ("nile_0",), ("SUPPORTS",))],
}


@pytest.fixture(autouse=True)
def clean_gin():
    """CLI mains parse gin bindings into the global config; no test may leak them to the next."""
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    encoder = HashedBagOfWordsEncoder(dim=512)
    directory = str(tmp_path_factory.mktemp("emb"))
    embedding_store.write_embeddings(encoder, KB, [p.id for p in KB], directory, shard_size=3, progress=False)
    return encoder, scann_index.build_scann_index(directory, scann_index.ScannConfig(mode="brute_force")), PassageTable(KB)


def exact_pages(encoder, query: str, k: int) -> list[str]:
    scores = encoder.encode_passages(KB) @ encoder.encode_queries([query], "qa")[0]
    return metrics.dedup_keep_first(KB[i].wikipedia_id for i in np.argsort(-scores, kind="stable")[:k])


def test_evaluation_matches_kilt_scores_of_the_exact_ranking(tiny):
    encoder, idx, table = tiny
    result = evaluate.evaluate(encoder, idx, EXAMPLES, table, ks=(1, 2, 5), depth=7)
    per_query = [metrics.kilt_scores(e.gold_pages, exact_pages(encoder, e.query, 7), (1, 2, 5)) for e in EXAMPLES["qa"]]
    expected = metrics.mean_scores(per_query)
    for key, value in expected.items():
        assert result.tables["qa"][key] == pytest.approx(value), f"qa {key}: expected {value}"
    assert result.tables["qa"]["Rprec"] == pytest.approx(1.0), result.tables["qa"]
    assert result.tables["qa"]["n"] == 3 and result.tables["qa"]["n_answers"] == 3
    assert result.tables["qa"]["answer_recall@2"] == pytest.approx(1.0)
    assert "answer_recall@2" not in result.tables["fever"], "FEVER labels are not answer strings"
    assert result.tables["fever"]["passage_Rprec"] == 1.0


def test_predictions_are_official_kilt_rows_with_deduplicated_pages(tiny, tmp_path):
    encoder, idx, table = tiny
    result = evaluate.evaluate(encoder, idx, EXAMPLES, table, ks=(1, 5), depth=7)
    evaluate.write_results(result, str(tmp_path))
    rows = [row for _, row in read_jsonl(tmp_path / "predictions" / "qa.jsonl")]
    assert [r["id"] for r in rows] == ["q1", "q2", "q3"]
    pages = [p["wikipedia_id"] for p in rows[2]["output"][0]["provenance"]]
    assert len(rows[2]["output"]) == 1 and pages == exact_pages(encoder, EXAMPLES["qa"][2].query, 7)
    assert len(pages) == len(set(pages)) == 6, "7 passages on 6 pages, one entry per page"
    assert json.loads((tmp_path / "results.json").read_text())["qa"]["Rprec"] == pytest.approx(1.0)
    text = (tmp_path / "results.txt").read_text()
    assert text.splitlines()[0].split()[:3] == ["task", "n", "Rprec"] and "fever" in text


def test_mined_negatives_are_ranked_top_k_without_gold_pages(tiny):
    encoder, idx, table = tiny
    mined = mine.mine_negatives(encoder, idx, EXAMPLES["qa"], table, k=7)
    assert [n.id for n in mined] == ["q1", "q2", "q3"]
    for example, negatives in zip(EXAMPLES["qa"], mined):
        gold = {p for s in example.gold_pages for p in s}
        ranked = [pid for pid, _ in [(idx.passage_ids[r], 0) for r in idx.search(
            encoder.encode_queries([example.query], "qa"), 7)[0][0]]]
        assert list(negatives.negatives) == [p for p in ranked if table.page_of(p) not in gold], example.id
    assert not {"paris_0", "paris_1", "seine_0"} & set(mined[2].negatives)


def test_answer_bearing_passages_can_be_excluded_from_negatives(tiny):
    encoder, idx, table = tiny
    example = Example("q", "qa", "capital city", (("tokyo",),), (), ("capital",))
    (plain,) = mine.mine_negatives(encoder, idx, [example], table, k=7)
    (checked,) = mine.mine_negatives(encoder, idx, [example], table, k=7, exclude_answers=True)
    assert "berlin_0" in plain.negatives and "berlin_0" not in checked.negatives
    assert all(not answers.has_answer(table.get(p).text, ["capital"]) for p in checked.negatives)


def _mini_kilt_data(tmp_path, n_queries: int) -> str:
    """A data dir in the project layout: the real mini-KILT KB and a slice of real FEVER dev queries."""
    data_dir = str(tmp_path / "data")
    rows = (row for _, row in read_jsonl(mini_kilt("kb", "passages.jsonl")))
    write_passage_store(((Passage(r["id"], r["wikipedia_id"], r["title"], r["text"]), None) for r in rows),
                        layout.kb_dir(data_dir))
    os.makedirs(os.path.dirname(layout.examples_path(data_dir, "fever", "dev")))
    with open(layout.examples_path(data_dir, "fever", "dev"), "w") as f:
        for i, (_, row) in enumerate(read_jsonl(mini_kilt("fever-dev-kilt.jsonl"))):
            if i == n_queries:
                break
            gold = tuple(tuple(dict.fromkeys(p["wikipedia_id"] for p in o["provenance"])) for o in row["output"])
            f.write(json.dumps(Example(row["id"], "fever", row["input"], gold).to_json()) + "\n")
    return data_dir


@pytest.mark.slow
def test_cli_pipeline_on_real_mini_kilt(tmp_path, capsys):
    data_dir = _mini_kilt_data(tmp_path, n_queries=100)
    kb_dir, emb, idx_dir, out = layout.kb_dir(data_dir), str(tmp_path / "emb"), str(tmp_path / "idx"), str(tmp_path / "ev")
    model = ["--lexical_baseline_dim", "4096"]
    assert encode_command.main([*model, "--kb_dir", kb_dir, "--output_dir", emb, "--no_progress",
                        "--gin.encode_settings.shard_size=4000"]) == 0
    assert embedding_store.read_manifest(emb).num_shards == 4
    assert index_command.main(["--embeddings_dir", emb, "--output_dir", idx_dir]) == 0
    assert eval_command.main([*model, "--index_dir", idx_dir, "--data_dir", data_dir, "--output_dir", out]) == 0
    table = json.loads(open(os.path.join(out, "results.json")).read())["fever"]
    # A hashed bag of words is a weak lexical model (0.42 on all of fever dev; BM25 reaches 0.685).
    assert table["n"] == 100 and 0.3 <= table["Rprec"] <= 0.8, table
    assert table["recall@20"] >= table["recall@5"] >= table["Rprec"] - 1e-9, table
    assert mine_command.main([*model, "--index_dir", idx_dir, "--data_dir", data_dir, "--split", "dev", "--source", "t"]) == 0
    negatives = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "t"), "fever", "dev"))
    store = PassageStore.open(kb_dir)
    first = dataset_examples(data_dir, "dev", ["fever"])["fever"][0]
    assert 0 < len(negatives[first.id]) <= 110
    assert not {store.page_of(p) for p in negatives[first.id]} & set(first.gold_pages[0])
    capsys.readouterr()
    # Another model's queries against this index are refused, naming both fingerprints.
    assert cli.main(["eval", "--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--data_dir", data_dir,
                     "--output_dir", out]) == 2
    assert "hashed-bow-v2-dim4096" in capsys.readouterr().err
