"""The run records committed behind docs/RESULTS.md read, name their rows and agree with themselves."""

import os
import shutil

import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.page import MARKED, refreshed
from t5_retrieval.results.records import METRICS, read_records
from t5_retrieval.results.rows import CONTROLS, ROWS, SEEDED
from t5_retrieval.results.tables import markdown_table

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")
RECORDS_NAME = os.path.join("run_records", "mini_kilt")
RECORDS = os.path.join(DOCS, RECORDS_NAME)  # queries at 64 tokens, cut from the right
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


def test_results_page_shows_the_tables_its_records_print():
    """Every marked table of docs/RESULTS.md (main, differences, dev/train overlap, the change with
    the inputs; both record sets) is what its records print, line for line."""
    page_path = os.path.join(DOCS, "RESULTS.md")
    with open(page_path, encoding="utf-8") as f:
        page = f.read()
    specs = [m["spec"] for m in MARKED.finditer(page)]
    for kind in ("main", "differences", "overlap", "change", "rows"):
        assert any(spec.startswith(kind) for spec in specs), f"docs/RESULTS.md shows no {kind!r} table: {specs}"
    assert any(RECORDS_NAME in spec.split()[1:] for spec in specs), "the old inputs' records are shown too"
    assert refreshed(page, page_path) == page, \
        "docs/RESULTS.md shows other numbers or rows than its records and the row catalogue: " \
        "t5r results --work_dir=/tmp/t --rows= --page=docs/RESULTS.md"


def test_results_page_lists_a_row_added_to_the_catalogue(monkeypatch):
    """The page's list of `--rows` names is the catalogue's: a new row leaves the page stale until refreshed."""
    page_path = os.path.join(DOCS, "RESULTS.md")
    with open(page_path, encoding="utf-8") as f:
        page = f.read()
    monkeypatch.setitem(ROWS, "a_new_row", ("a new row", lambda row_dir, data_dir: None))
    new = refreshed(page, page_path)
    assert new != page, "a row added to the catalogue must make docs/RESULTS.md stale"
    assert "`gdmtl`, `a_new_row`." in new, "the refreshed list names the new row last, as the catalogue orders it"


def test_t5r_results_page_prints_a_marked_table_again_and_names_a_bad_marker(tmp_path, capsys):
    records = tmp_path / "records"
    shutil.copytree(RECORDS, records)
    page = tmp_path / "page.md"
    intro = "a table starts after a line <!-- records: main records -->\nand ends at <!-- /records -->\n"  # quoted, not markers
    page.write_text(f"{intro}<!-- records: main records -->\nstale\n<!-- /records -->\nprose\n", encoding="utf-8")
    assert cli.main(["results", f"--work_dir={tmp_path / 'w'}", "--rows=", f"--page={page}"]) == 0
    want = markdown_table(read_records(str(records)))
    assert page.read_text(encoding="utf-8") == f"{intro}<!-- records: main records -->\n{want}<!-- /records -->\nprose\n"
    assert "1 table(s) printed again" in capsys.readouterr().out
    before = page.read_text(encoding="utf-8")
    for spec, needle in (("mean records", "unknown table kind 'mean'"), ("main nowhere", "no records directory"),
                         ("change records", "names 2 records directories")):
        page.write_text(before.replace("main records", spec), encoding="utf-8")
        assert cli.main(["results", f"--work_dir={tmp_path / 'w'}", "--rows=", f"--page={page}"]) == 2
        err = capsys.readouterr().err
        assert f"{page}:3: " in err and needle in err, err
        assert page.read_text(encoding="utf-8") == before.replace("main records", spec), "a failed refresh writes nothing"
