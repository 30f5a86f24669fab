"""The run records committed behind docs/RESULTS.md read, name their rows and agree with themselves."""

import os

import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, read_records
from t5_retrieval.results.rows import CONTROLS, ROWS, SEEDED, TITLES
from t5_retrieval.results.overlap import overlap_table, read_overlap
from t5_retrieval.results.significance import differences_table, inputs_table
from t5_retrieval.results.tables import markdown_table

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")
RECORDS = os.path.join(DOCS, "run_records", "mini_kilt")  # queries at 64 tokens, cut from the right
TASK_LENGTHS = os.path.join(DOCS, "run_records", "mini_kilt_task_lengths")  # each task's length and cut
BOTH = pytest.mark.parametrize("directory", [RECORDS, TASK_LENGTHS], ids=["64_tokens", "task_lengths"])


@BOTH
def test_committed_records_are_consistent(directory):
    records = read_records(directory)
    assert "minilm_zeroshot" in records, sorted(records)
    reference = records["minilm_zeroshot"][0]
    for row, runs in records.items():
        assert row in ROWS, f"{row}: a record of no row in the catalogue"
        for run in runs:
            assert os.path.exists(os.path.join(directory, run.file_name)), f"{run.file_name} holds another run"
            assert run.seed == 0 or row in SEEDED, f"{run.file_name}: seeds > 0 only for seeded rows"
            for task in TASKS:
                assert run.query_ids[task] == reference.query_ids[task], f"{run.file_name}: other {task} queries"
                for key, _ in METRICS:
                    mean = np.mean(run.per_query[task][key])
                    assert abs(mean - run.table[task][key]) < 1e-9, (run.file_name, task, key)


def test_every_method_has_a_seeded_control_in_the_catalogue():
    for row, control in CONTROLS.items():
        assert row in ROWS and control in ROWS and control in SEEDED and row != control, (row, control)


def test_the_tables_print_from_the_records_as_the_records_readme_shows(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(os.path.join(os.path.dirname(__file__), os.pardir))
    work_dir = tmp_path / "tables"
    assert cli.main(["results", f"--work_dir={work_dir}", "--records_dir=docs/run_records/mini_kilt", "--rows="]) == 0
    lines = capsys.readouterr().out.splitlines()
    zero_shot = read_records(RECORDS)["minilm_zeroshot"][0]
    assert f"| MiniLM-L6 zero-shot | {zero_shot.table['fever']['Rprec']:.3f} | " in "\n".join(lines), lines
    assert not work_dir.exists(), "printing the tables writes nothing"


@BOTH
def test_results_page_shows_the_tables_the_records_print(directory):
    """docs/RESULTS.md's tables, differences, and the dev/train overlap table are the committed
    records' tables, line for line."""
    records = read_records(directory)
    with open(os.path.join(DOCS, "RESULTS.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    tables = [markdown_table(records), differences_table(records, TITLES, CONTROLS),
              overlap_table(records, TITLES, read_overlap(directory))]
    for table in tables:
        for line in table.splitlines():
            assert line in page, f"docs/RESULTS.md lacks, or shows other numbers than, this line of the records: {line}"


def test_results_page_shows_each_rows_change_with_the_inputs():
    with open(os.path.join(DOCS, "RESULTS.md"), encoding="utf-8") as f:
        page = f.read().splitlines()
    for line in inputs_table(read_records(TASK_LENGTHS), read_records(RECORDS), TITLES).splitlines():
        assert line in page, f"docs/RESULTS.md lacks, or shows other numbers than, this line of the records: {line}"
