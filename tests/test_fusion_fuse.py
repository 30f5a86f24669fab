"""Fusion rules on hand cases, and `t5r fuse` end to end over two tiny lexical experts on the demo data."""

import json
import os

import gin
import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_tasks
from t5_retrieval.data.kilt.synthetic import write_demo
from t5_retrieval.data.records import read_jsonl
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tasks.examples import dataset_examples
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.fusion import experts, fuse, muf
from t5_retrieval.retrieval import evaluate, index, scann_index, search
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

TASKS = ("nq", "trex")


@pytest.fixture(autouse=True)
def clean_gin():
    yield
    gin.clear_config()


def test_fusion_gives_missing_passages_the_list_minimum():
    a = (["a", "b", "c"], [3.0, 2.0, 1.0])
    b = (["b", "d"], [10.0, 4.0])
    ids, scores = fuse.fuse_lists([a, b], [0.5, 2.0])
    # a: .5*3 + 2*4 (min of b) ; b: .5*2 + 2*10 ; c: .5*1 + 2*4 ; d: .5*1 (min of a) + 2*4
    assert ids == ["b", "a", "c", "d"], "ties (c, d) keep the order of first appearance"
    np.testing.assert_allclose(scores, [21.0, 9.5, 8.5, 8.5])
    ids, scores = fuse.fuse_lists([a, ([], [])], [1.0, 5.0])
    assert ids == ["a", "b", "c"] and scores.tolist() == [3.0, 2.0, 1.0], "an empty list adds nothing"


def test_hybrid_interpolates_dense_and_bm25_over_the_union():
    dense = (["p1", "p2"], [0.9, 0.5])
    sparse = (["p3", "p1"], [12.0, 8.0])
    ids, scores = fuse.hybrid(dense, sparse, 0.25)
    # p1: .75*.9 + .25*8 ; p2: .75*.5 + .25*8 (min) ; p3: .75*.5 (min) + .25*12
    assert ids == ["p3", "p1", "p2"]
    np.testing.assert_allclose(scores, [3.375, 2.675, 2.375])
    ids, _ = fuse.hybrid(dense, sparse, 0.0)
    assert ids == ["p1", "p2", "p3"], "weight 0 is the dense ranking (BM25-only passages last)"
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        fuse.hybrid(dense, sparse, 1.5)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Demo data for two tasks and two lexical experts of different dims, each with its own index."""
    root = tmp_path_factory.mktemp("fuse")
    raw, data_dir = str(root / "raw"), str(root / "data")
    write_demo(raw, num_pages=60, train_per_task=48, dev_per_task=16)
    prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data_dir)
    prepare_tasks(raw, data_dir, TASKS, ("train", "dev"))
    store = PassageStore.open(layout.kb_dir(data_dir))
    specs = {}
    for task, dim in zip(TASKS, (128, 512)):
        emb, idx = str(root / f"emb-{task}"), str(root / f"idx-{task}")
        embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim), store, store.ids(), emb, shard_size=500,
                                    progress=False)
        scann_index.build_scann_index(emb, scann_index.ScannConfig(mode="brute_force")).save(idx)
        specs[task] = f"{task},lexical:{dim},{idx}"
    return data_dir, store, specs


SMALL = ["--gin.EnsembleConfig.num_epochs=3", "--gin.EnsembleConfig.hidden_dim=16", "--gin.EnsembleConfig.top_l=8",
         "--gin.FuseConfig.depth=20", "--gin.FuseConfig.ks=(1, 5, 20)"]


def test_fuse_cli_writes_tables_predictions_and_ensembles(demo, tmp_path, capsys):
    data_dir, _, specs = demo
    out = str(tmp_path / "out")
    code = cli.main(["fuse", "--data_dir", data_dir, "--output_dir", out, "--expert", specs["nq"],
                     "--expert", specs["trex"], *SMALL, "--gin.FuseConfig.hybrid_weight=0.05"])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    for method in ("muf", "uniform", "own_expert", "hybrid"):
        tables = json.loads(open(os.path.join(out, method, "results.json")).read())
        assert set(tables) == set(TASKS), f"{method}: one row per eval task, got {sorted(tables)}"
        for task, table in tables.items():
            assert table["n"] == 16 and 0.0 <= table["Rprec"] <= 1.0, (method, task, table)
            assert table["recall@20"] >= table["recall@5"] - 1e-9, (method, task, table)
        assert f"== {method}" in printed
        rows = [row for _, row in read_jsonl(os.path.join(out, method, "predictions", "nq.jsonl"))]
        pages = [p["wikipedia_id"] for p in rows[0]["output"][0]["provenance"]]
        assert len(rows) == 16 and pages and len(pages) == len(set(pages)), "KILT rows with deduplicated pages"
    # Lexical matching finds the demo's gold pages: the fused ranking must be far above chance (1/60).
    muf_tables = json.loads(open(os.path.join(out, "muf", "results.json")).read())
    assert all(muf_tables[t]["recall@20"] > 0.3 for t in TASKS), muf_tables
    confidence = json.loads(open(os.path.join(out, "confidence.json")).read())
    assert set(confidence) == set(TASKS) and all(0.0 <= c <= 1.0 for v in confidence.values() for c in v.values())
    loaded = muf.Ensemble.load(os.path.join(out, "ensembles", "trex"))
    assert loaded.fingerprint == "hashed-bow-v2-dim512" and loaded.dim == 512
    assert loaded.temperature == loaded.info["calibration"]["temperature"], "the calibrated temperature is saved"


def test_own_expert_scores_equal_t5r_eval_of_that_expert(demo):
    data_dir, store, specs = demo
    dev = dataset_examples(data_dir, "dev", TASKS)
    train = dataset_examples(data_dir, "train", ["nq"])
    expert = experts.load_expert(experts.ExpertSpec.parse(specs["nq"]), store.ids())
    config = fuse.FuseConfig(depth=20, ks=(1, 5, 20))
    result = fuse.fuse_and_evaluate([expert], train, dev, store,
                                    muf.EnsembleConfig(num_epochs=2, hidden_dim=8, top_l=8), config)
    alone = evaluate.evaluate(expert.encoder, expert.index, {"nq": dev["nq"]}, store, ks=(1, 5, 20), depth=20)
    assert result.results["own_expert"].tables["nq"] == alone.tables["nq"], "same ranking -> same KILT numbers"
    assert "trex" not in result.results["own_expert"].tables, "no trex expert, no own-expert row"
    # One expert: fusion only rescales its scores by a positive confidence, so the ranking is unchanged.
    assert result.results["muf"].predictions["nq"] == alone.predictions["nq"]


def test_bm25_hybrid_at_weight_one_is_the_bm25_ranking(demo):
    data_dir, store, specs = demo
    dev = dataset_examples(data_dir, "dev", ["trex"])
    train = dataset_examples(data_dir, "train", ["trex"])
    expert = experts.load_expert(experts.ExpertSpec.parse(specs["trex"]), store.ids())
    bm25 = index.build_bm25_index(store)
    config = fuse.FuseConfig(depth=20, ks=(1, 5, 20), hybrid_weight=1.0)
    result = fuse.fuse_and_evaluate([expert], train, dev, store,
                                    muf.EnsembleConfig(num_epochs=1, hidden_dim=8, top_l=8), config,
                                    hybrid_with=search.bm25_searcher(bm25))
    from t5_retrieval.data.kilt.negatives import bm25_query
    from t5_retrieval.retrieval import metrics
    for example, row in zip(dev["trex"], result.results["hybrid"].predictions["trex"]):
        (top,), (scores,) = bm25.search([bm25_query(example.query)], 20)
        # Passages scoring the list minimum tie with every dense-only passage; above it, BM25 rules.
        expected = metrics.dedup_keep_first(store.page_of(bm25.passage_ids[i]) for i in top[scores > scores.min()])
        got = [p["wikipedia_id"] for p in row["output"][0]["provenance"]]
        # (Equal BM25 scores may be ordered differently: compare the pages above the minimum as a set.)
        assert expected and set(got[:len(expected)]) == set(expected), f"{example.id}: weight 1 ranks by BM25 alone"


def test_mismatched_expert_index_and_unknown_task_are_clear_errors(demo, tmp_path, capsys):
    data_dir, _, specs = demo
    nq_index = specs["nq"].split(",")[2]
    args = ["fuse", "--data_dir", data_dir, "--output_dir", str(tmp_path / "o"), *SMALL]
    assert cli.main([*args, "--expert", f"nq,lexical:64,{nq_index}"]) == 2
    err = capsys.readouterr().err
    assert nq_index in err and "hashed-bow-v2-dim128" in err, f"the error must name the index and its model: {err}"
    assert cli.main([*args, "--expert", specs["nq"], "--tasks", "nq,nosuch"]) == 2
    assert "nosuch-dev.jsonl" in capsys.readouterr().err, "an unknown task names the missing examples file"
    assert cli.main([*args, "--expert", "nq,lexical:128"]) == 2
    assert "TASK,CHECKPOINT_DIR,INDEX_DIR" in capsys.readouterr().err
    assert cli.main([*args, "--expert", specs["nq"], "--expert", specs["nq"]]) == 2
    assert "one expert per task" in capsys.readouterr().err


def test_run_files_bind_the_paper_settings():
    from t5_retrieval import gin_utils

    gin_utils.parse_gin(["runs/dpr_muf_bm25.gin"], [])
    ensemble, config = muf.EnsembleConfig(), fuse.FuseConfig()
    assert (ensemble.num_members, ensemble.top_l, ensemble.temperature) == (5, 20, 1e-3), ensemble
    assert config.depth == 100 and config.hybrid_weight == pytest.approx(0.476), config
    gin.clear_config()
    gin_utils.parse_gin(["runs/dpr_muf.gin"], [])
    assert fuse.FuseConfig().hybrid_weight is None, "the DPR-MUF row has no BM25 hybrid"


class RecordedTasksEncoder(HashedBagOfWordsEncoder):
    """A real encoder that also records its training tasks, the way checkpoints do (features.tasks)."""

    def __init__(self, tasks):
        super().__init__(dim=16)
        self.features = {"tasks": tasks}
        self.tasks = TaskSet.from_features(self.features)


def test_expert_queries_use_the_task_name_the_model_was_trained_with():
    def model_task_name(encoder, name):
        return encoder.tasks.resolve(name)

    assert model_task_name(HashedBagOfWordsEncoder(16), "nq") == "nq", "lexical: any name"
    assert model_task_name(RecordedTasksEncoder({"kilt_nq": {"dataset": "nq"}}), "nq") == "kilt_nq"
    two = RecordedTasksEncoder({"kilt_nq": {"dataset": "nq"}, "kilt_fever": {"dataset": "fever"}})
    assert model_task_name(two, "nq") == "kilt_nq", "the task that reads nq's examples"
    assert model_task_name(two, "kilt_fever") == "kilt_fever", "a registered name is its own"
    with pytest.raises(ValueError, match=r"unknown task 'nq'.*kilt_fever \(dataset fever\), kilt_trex"):
        model_task_name(RecordedTasksEncoder({"kilt_fever": {"dataset": "fever"}, "kilt_trex": {"dataset": "trex"}}),
                        "nq")
