"""`t5r results` on the real mini-KILT: the BM25 row reproduces the data's own BM25 reference."""

import json
import os

import pytest

from conftest import SHARED_DATA
from t5_retrieval import cli
from t5_retrieval.results.analysis import analysis_table
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.qa_open import bm25_answer_recall, qa_open_dir, qa_open_table
from t5_retrieval.results.tables import markdown_table

pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="needs ../shared mini-KILT")


@pytest.fixture(scope="module")
def bm25_run(tmp_path_factory) -> str:
    """`t5r results --rows bm25` on mini-KILT (prepares the data directory too)."""
    work_dir = str(tmp_path_factory.mktemp("results"))
    assert cli.main(["results", "--data", SHARED_DATA, "--work_dir", work_dir, "--rows", "bm25",
                     "--markdown", os.path.join(work_dir, "table.md")]) == 0
    return work_dir


def test_bm25_row_matches_the_reference_and_a_rerun_resumes(bm25_run, capsys):
    work_dir = bm25_run
    with open(os.path.join(work_dir, "bm25", "eval", "results.json")) as f:
        tables = json.load(f)
    with open(os.path.join(SHARED_DATA, "bm25_reference_dev.json")) as f:
        reference = json.load(f)
    for task in TASKS:
        ours, theirs = tables[task]["Rprec"], reference[f"{task}/dev"]["r_prec"]
        assert abs(ours - theirs) <= 0.03, f"{task}: BM25 R-precision {ours:.3f}, reference {theirs:.3f}"
    with open(os.path.join(work_dir, "table.md")) as f:
        table = f.read()
    assert table.splitlines()[2].startswith("| BM25 | "), table
    assert f"{tables['fever']['Rprec']:.3f}" in table.splitlines()[2]

    done = os.path.join(work_dir, "bm25", "eval", "DONE")
    stamp = os.path.getmtime(done)
    capsys.readouterr()
    assert cli.main(["results", "--data", SHARED_DATA, "--work_dir", work_dir, "--rows", "bm25"]) == 0
    assert os.path.getmtime(done) == stamp, "a finished row must not run again"
    assert "| BM25 | " in capsys.readouterr().out


def test_unknown_row_is_refused_with_the_known_ones(tmp_path, capsys):
    assert cli.main(["results", "--data", SHARED_DATA, "--work_dir", str(tmp_path), "--rows", "bm25,nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "minilm_zeroshot" in err, err


def test_table_reads_trained_rows_by_the_models_task_names_and_sums_stage_times(tmp_path):
    work_dir = str(tmp_path)
    tables = {f"mini_kilt_{t}": {"Rprec": 0.1 * (i + 1), "recall@20": 0.5} for i, t in enumerate(TASKS)}
    for stage_dir, seconds in (("taco/model", 100.0), ("taco/eval", 20.5)):
        os.makedirs(os.path.join(work_dir, stage_dir))
        with open(os.path.join(work_dir, stage_dir, "DONE"), "w") as f:
            json.dump({"seconds": seconds}, f)
    with open(os.path.join(work_dir, "taco", "eval", "results.json"), "w") as f:
        json.dump(tables, f)
    row = [line for line in markdown_table(work_dir).splitlines() if line.startswith("| TACO |")]
    assert row == ["| TACO | " + " | ".join(f"{0.1 * (i + 1):.3f} | 0.500" for i in range(len(TASKS)))
                   + " | 0.350 | 0.500 | 120 s |"], row
    assert analysis_table(work_dir) == "", "no analysed model, no analysis table"


def test_bm25_answer_recall_on_qa_open_matches_the_datas_reference(bm25_run):
    data_dir = os.path.join(bm25_run, "data")
    qa_dir = qa_open_dir(data_dir)
    assert os.path.samefile(qa_dir, os.path.join(SHARED_DATA, "qa_open"))
    ours = bm25_answer_recall(data_dir, qa_dir, ("webq", "curatedtrec"))["dev"]
    with open(os.path.join(qa_dir, "bm25_answer_recall_dev.json")) as f:
        reference = json.load(f)
    for task, recall in ours.items():
        theirs = reference[f"{task}/dev"]
        assert recall["n"] == theirs["n"]
        for k in (5, 20, 100):
            assert abs(recall[f"answer_recall@{k}"] - theirs[f"recall{k}"]) <= 0.02, (task, k, recall, theirs)


def test_qa_open_table_puts_bm25_before_and_after_side_by_side(tmp_path):
    from t5_retrieval.query_side import REPORT_FILE
    from t5_retrieval.results.qa_open import QA_OPEN_KS, QA_OPEN_TASKS

    row_dir = tmp_path / "query_side"
    assert qa_open_table(str(tmp_path)) == "", "no query-side row, no table"

    def recall(value: float) -> dict:
        return {t: {"n": 10, **{f"answer_recall@{k}": value + k / 1000 for k in QA_OPEN_KS}} for t in QA_OPEN_TASKS}

    (row_dir / "model").mkdir(parents=True)
    (row_dir / "qa_open_bm25").mkdir()
    (row_dir / "model" / REPORT_FILE).write_text(json.dumps({"dev_before": recall(0.1), "dev_after": recall(0.2)}))
    (row_dir / "qa_open_bm25" / "DONE").write_text(json.dumps({"dev": recall(0.0)}))
    lines = qa_open_table(str(tmp_path)).splitlines()
    titles = [line.split(" | ")[0] for line in lines[2:]]
    assert titles == ["| BM25", "| MiniLM-L6 zero-shot", "| query-side fine-tuned"], titles
    assert lines[4].split(" | ")[1:4] == ["0.205", "0.220", "0.300"], lines[4]
