"""`t5r results` on the real mini-KILT: the BM25 row reproduces the data's own BM25 reference."""

import json
import os

import pytest

from conftest import SHARED_DATA
from t5_retrieval import cli
from t5_retrieval.results import TASKS, analysis_table, markdown_table

pytestmark = pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="needs ../shared mini-KILT")


def test_bm25_row_matches_the_reference_and_a_rerun_resumes(tmp_path, capsys):
    work_dir = str(tmp_path / "results")
    assert cli.main(["results", "--data", SHARED_DATA, "--work_dir", work_dir, "--rows", "bm25",
                     "--markdown", str(tmp_path / "table.md")]) == 0
    with open(os.path.join(work_dir, "bm25", "eval", "results.json")) as f:
        tables = json.load(f)
    with open(os.path.join(SHARED_DATA, "bm25_reference_dev.json")) as f:
        reference = json.load(f)
    for task in TASKS:
        ours, theirs = tables[task]["Rprec"], reference[f"{task}/dev"]["r_prec"]
        assert abs(ours - theirs) <= 0.03, f"{task}: BM25 R-precision {ours:.3f}, reference {theirs:.3f}"
    table = (tmp_path / "table.md").read_text()
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
