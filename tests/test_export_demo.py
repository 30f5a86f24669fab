"""`t5r export` of the demo's own trained models: the SavedModel of `t5r demo`'s naive and TACO rows
(MiniLM query sides over the zero-shot row's passage embeddings), loaded by plain TensorFlow in a
fresh process, gives the top-10 of `t5r eval` for every dev query of every task.

The rows are the demo's (`demo.demo_rows`: its gin files, mixtures and bindings) on the shipped
slice, made cheaper in two ways only: the trained rows train STEPS steps instead of DEMO_STEPS, and
the slice is cut to TRAIN and DEV queries per task over a KB of their gold pages plus EXTRA_PAGES
other pages (all-MiniLM-L6-v2 encodes it once for both rows). What is compared does not depend on
how far training went: only that the trained query networks differ from MiniLM and from each other.
"""

import json
import os

import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.data import layout
from t5_retrieval.data.kilt import demo_slice
from t5_retrieval.data.records import read_examples
from t5_retrieval.demo import demo_rows
from t5_retrieval.results.common import TASKS, dataset_name, prepare_data
from tests.test_export import _run_client, assert_names_no_path_of_this_machine, eval_runs

K = 10
STEPS = 2
TRAIN, DEV, EXTRA_PAGES = 8, 2, 20
ROWS = ("naive_noprefix", "taco_nonzero_median")
TIE = 1e-5  # a trained MiniLM separates its top-10 by more than this; closer scores may swap


def _cut_slice(raw_dir: str, out_dir: str) -> str:
    """The slice's first TRAIN training and DEV dev queries per task, and a KB of their gold pages plus
    the KB's first EXTRA_PAGES pages: a KILT-format directory as `demo_slice.extract` gives."""
    os.makedirs(os.path.join(out_dir, "kb"))
    pages: set[str] = set()
    for task in TASKS:
        for split, n in (("train", TRAIN), ("dev", DEV)):
            name = f"{task}-{split}-kilt.jsonl"
            with open(os.path.join(raw_dir, name)) as f:
                lines = [line for _, line in zip(range(n), f)]
            for line in lines:
                pages |= {p["wikipedia_id"] for o in json.loads(line)["output"] for p in o.get("provenance", [])}
            with open(os.path.join(out_dir, name), "w") as f:
                f.writelines(lines)
    others: list[str] = []
    with open(os.path.join(raw_dir, "kb", "passages.jsonl")) as f, \
            open(os.path.join(out_dir, "kb", "passages.jsonl"), "w") as out:
        for line in f:
            page = json.loads(line)["wikipedia_id"]
            if page not in pages and page not in others and len(others) < EXTRA_PAGES:
                others.append(page)
            if page in pages or page in others:
                out.write(line)
    return out_dir


@pytest.fixture(scope="module")
def demo_exports(tmp_path_factory):
    """The demo's naive and TACO rows trained on the cut slice, each exported, `t5r eval`uated, and
    asked for the top-10 of every dev query by one client process."""
    root = tmp_path_factory.mktemp("export_demo")
    raw = _cut_slice(demo_slice.extract(demo_slice.SHIPPED, str(root)), str(root / "cut"))
    data_dir = str(root / "data")
    prepare_data(raw, data_dir)
    rows = demo_rows(steps=STEPS)
    base_index = str(root / "minilm_zeroshot" / "index")
    exports, evals, requests = {}, {}, []
    dev = {task: read_examples(layout.examples_path(data_dir, task, "dev")) for task in TASKS}
    for name in ROWS:
        rows[name](str(root / name), data_dir)
        model_dir = str(root / name / "model")
        exports[name] = str(root / "serving" / name / "1")
        assert cli.main(["export", "--checkpoint_dir", model_dir, "--index_dir", base_index,
                         "--kb_dir", layout.kb_dir(data_dir), "--output_dir", exports[name]]) == 0
        evals[name] = eval_runs(model_dir, base_index, data_dir, str(root / "eval" / name))
        requests.append({"savedmodel": exports[name], "signature": "search", "k": K,
                         "query": [e.query for examples in dev.values() for e in examples],
                         "task": [task for task, examples in dev.items() for _ in examples]})
    responses = _run_client(exports[ROWS[0]], requests, str(root))
    return {"root": str(root), "exports": exports, "evals": evals, "dev": dev, "search": dict(zip(ROWS, responses))}


def _run_of(runs: dict[str, dict], dataset: str) -> dict[str, list[tuple[str, float]]]:
    """The model's TREC run of `dataset` (files are named by the model's task name for it)."""
    return runs[dataset_name(runs, dataset)]


@pytest.mark.parametrize("name", ROWS)
def test_the_demo_models_savedmodel_top10_is_t5r_evals(demo_exports, name):
    got = demo_exports["search"][name]
    assert "error" not in got, got
    examples = [(task, e) for task, examples in demo_exports["dev"].items() for e in examples]
    assert np.shape(got["passage_ids"]) == (len(examples), K) and len(examples) == DEV * len(TASKS)
    exact = 0
    for i, (task, example) in enumerate(examples):
        ranked = _run_of(demo_exports["evals"][name], task)[example.id]
        want_ids, want_scores, score_of = [p for p, _ in ranked[:K]], [s for _, s in ranked[:K]], dict(ranked)
        np.testing.assert_allclose(got["scores"][i], want_scores, atol=1e-4, err_msg=f"{name} {task}: scores")
        for rank, pid in enumerate(got["passage_ids"][i]):
            assert abs(score_of[pid] - want_scores[rank]) <= TIE, \
                f"{name} {task} {example.query!r} rank {rank}: {pid} vs t5r eval's {ranked[:K]}"
        exact += got["passage_ids"][i] == want_ids
    assert exact >= len(examples) - 1, f"{name}: only {exact} of {len(examples)} top-10s equal t5r eval's id for id"


def test_the_two_demo_rows_export_different_query_networks(demo_exports):
    naive, taco = (demo_exports["search"][name]["scores"] for name in ROWS)
    assert np.abs(np.asarray(naive) - np.asarray(taco)).max() > 1e-4, "naive and TACO exported the same network"
    for savedmodel in demo_exports["exports"].values():
        with open(os.path.join(savedmodel, "assets", "t5r_export.json")) as f:
            assert json.load(f)["query_network"]["query_side"] is True
        assert_names_no_path_of_this_machine(savedmodel, demo_exports["root"])
