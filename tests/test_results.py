"""`t5r results` on the real mini-KILT: the BM25 row reproduces the data's own BM25 reference."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from conftest import mini_kilt

from t5_retrieval import cli
from t5_retrieval.results.analysis import analysis_table
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.qa_open import bm25_answer_recall, qa_open_dir, qa_open_table
from t5_retrieval.results.records import RunRecord, read_record, read_records, record_run, seed_dir, write_record
from t5_retrieval.results.rows import TITLES
from t5_retrieval.results.significance import differences_table, paired_bootstrap, seed_differences
from t5_retrieval.results.tables import markdown_table


@pytest.fixture(scope="module")
def bm25_run(tmp_path_factory) -> str:
    """`t5r results --rows bm25` on mini-KILT (prepares the data directory too)."""
    work_dir = str(tmp_path_factory.mktemp("results"))
    assert cli.main(["results", "--data", mini_kilt(), "--work_dir", work_dir, "--rows", "bm25",
                     "--markdown", os.path.join(work_dir, "table.md")]) == 0
    return work_dir


def test_bm25_row_matches_the_reference_and_a_rerun_resumes(bm25_run, capsys):
    work_dir = bm25_run
    with open(os.path.join(work_dir, "bm25", "eval", "results.json")) as f:
        tables = json.load(f)
    with open(mini_kilt("bm25_reference_dev.json")) as f:
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
    assert cli.main(["results", "--data", mini_kilt(), "--work_dir", work_dir, "--rows", "bm25"]) == 0
    assert os.path.getmtime(done) == stamp, "a finished row must not run again"
    assert "| BM25 | " in capsys.readouterr().out


def test_unknown_row_is_refused_with_the_known_ones(tmp_path, capsys):
    assert cli.main(["results", "--data", mini_kilt(), "--work_dir", str(tmp_path), "--rows", "bm25,nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "minilm_zeroshot" in err, err


def test_a_trained_rows_record_reads_the_models_task_names_and_sums_stage_times(bm25_run, tmp_path):
    """A run whose model names its tasks `mini_kilt_<task>` (as the trained rows' models do)."""
    work_dir, data_dir = bm25_run, os.path.join(bm25_run, "data")
    run_dir = tmp_path / "taco"
    (run_dir / "eval" / "predictions").mkdir(parents=True)
    (run_dir / "model").mkdir()
    with open(os.path.join(work_dir, "bm25", "eval", "results.json")) as f:
        tables = json.load(f)
    (run_dir / "eval" / "results.json").write_text(json.dumps({f"mini_kilt_{t}": tables[t] for t in TASKS}))
    for task in TASKS:
        shutil.copy(os.path.join(work_dir, "bm25", "eval", "predictions", f"{task}.jsonl"),
                    run_dir / "eval" / "predictions" / f"mini_kilt_{task}.jsonl")
    (run_dir / "eval" / "DONE").write_text(json.dumps({"seconds": 20.5}))
    (run_dir / "model" / "DONE").write_text(json.dumps({"seconds": 100.0, "steps": 200, "bindings": ["x = 1"]}))
    record = record_run(str(run_dir), data_dir, "taco", 0)
    assert record.seconds == 120.5 and record.training == {"model": {"steps": 200, "bindings": ["x = 1"]}}
    assert record.table == {t: {"Rprec": tables[t]["Rprec"], "recall@20": tables[t]["recall@20"]} for t in TASKS}
    title = TITLES["taco"]
    row = [line for line in markdown_table({"taco": [record]}).splitlines() if line.startswith(f"| {title} |")]
    assert row == [f"| {title} | " + " | ".join(f"{tables[t]['Rprec']:.3f} | {tables[t]['recall@20']:.3f}" for t in TASKS)
                   + f" | {record.mean('Rprec'):.3f} | {record.mean('recall@20'):.3f} | 120 s |"], row
    assert analysis_table(work_dir) == "", "no analysed model, no analysis table"


def test_the_training_state_analysis_uses_the_tau_each_run_trained_with(tmp_path):
    """A state saved with its hyperparameters gives its own tau; one written before (taco_state.npz)
    takes the `taco.tau` of the model's config.gin beside it."""
    from t5_retrieval.multitask.analysis import STATE_FILE, TACO_STATE_FILE, save_state_npz
    from t5_retrieval.results.analysis import sensitivity_analysis

    ema = {"w": np.abs(np.random.default_rng(0).normal(size=(2, 50))).astype(np.float32)}
    new, old = tmp_path / "taco_nonzero_median" / "model", tmp_path / "taco" / "model"
    save_state_npz(ema, ["nq", "fever"], str(new / STATE_FILE), {"tau": 0.5, "beta": 0.99})
    old.mkdir(parents=True)
    np.savez(old / TACO_STATE_FILE, w=ema["w"], task_names=np.array(["nq", "fever"]))
    (old / "config.gin").write_text("# Parameters for taco:\ntaco.beta = 0.99\ntaco.tau = 0.75\n")
    sensitivity_analysis(str(tmp_path))
    for row, tau in (("taco_nonzero_median", 0.5), ("taco", 0.75)):
        with open(tmp_path / "analysis" / f"{row}_training" / "analysis.json") as f:
            assert json.load(f)["tau"] == tau, row
    assert analysis_table(str(tmp_path)).count("its training EMA") == 2


def test_bm25_answer_recall_on_qa_open_matches_the_datas_reference(bm25_run):
    data_dir = os.path.join(bm25_run, "data")
    qa_dir = qa_open_dir(data_dir)
    assert os.path.samefile(qa_dir, mini_kilt("qa_open"))
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


def degraded_copy(run_dir: str, out_dir: str, task: str) -> None:
    """A copy of a run's KILT predictions with `task`'s rankings reversed (its gold pages fall to the end)."""
    src = os.path.join(run_dir, "eval", "predictions")
    os.makedirs(os.path.join(out_dir, "eval", "predictions"))
    for name in os.listdir(src):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(src, name)) as f:
            rows = [json.loads(line) for line in f]
        if name == f"{task}.jsonl":
            for row in rows:
                row["output"][0]["provenance"].reverse()
        with open(os.path.join(out_dir, "eval", "predictions", name), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(run_dir, "eval", "results.json")) as f:
        tables = json.load(f)
    with open(os.path.join(out_dir, "eval", "results.json"), "w") as f:
        json.dump(tables, f)


def test_per_query_scores_average_to_the_eval_table_and_seeds_give_intervals(bm25_run):
    work_dir, data_dir = bm25_run, os.path.join(bm25_run, "data")
    bm25 = record_run(os.path.join(work_dir, "bm25"), data_dir, "bm25", 0)
    with open(os.path.join(work_dir, "bm25", "eval", "results.json")) as f:
        tables = json.load(f)
    for task in TASKS:
        assert len(bm25.per_query[task]["Rprec"]) == len(bm25.query_ids[task]) == tables[task]["n"]
        for key in ("Rprec", "recall@20"):
            assert bm25.per_query[task][key].mean() == pytest.approx(tables[task][key], abs=1e-12), (task, key)

    # Two seeds of a "method" that ranks fever backwards: fever's R-precision collapses, a significant drop.
    worse = []
    for seed in (0, 1):
        degraded_copy(os.path.join(work_dir, "bm25"), seed_dir(work_dir, "worse", seed), "fever")
        worse.append(record_run(seed_dir(work_dir, "worse", seed), data_dir, "worse", seed))
    table = differences_table({"bm25": [bm25], "worse": worse}, {"bm25": "BM25", "worse": "fever reversed"},
                              {"worse": "bm25", "missing": "bm25"}, m=2)
    lines = table.splitlines()
    assert lines[0] == ("| row | seeds | minus | seeds | mean R-prec | mean R@20 | mean R-prec, seed by seed | "
                        "excludes 0 after the Bonferroni correction |"), table
    assert len(lines) == 3, "one line per pair whose both sides are recorded"
    cells = lines[2].split(" | ")
    assert cells[:4] == ["| fever reversed", "2", "BM25", "1"], table
    drop = worse[1].per_query["fever"]["Rprec"].mean() - bm25.per_query["fever"]["Rprec"].mean()
    assert drop < -0.3 and cells[4].startswith(f"{drop / len(TASKS):+.3f} [") and cells[4].endswith(" *"), table
    assert cells[5].startswith("-") and cells[5].endswith(" *"), table
    # Seed by seed: only seed 0 ran on both sides, so one paired difference.
    assert cells[6] == f"{worse[0].mean('Rprec') - bm25.mean('Rprec'):+.3f}", table
    assert cells[7] == "R-prec yes, R@20 yes |", "a collapse stays a difference after the correction"


def test_a_difference_at_95_percent_can_fail_the_bonferroni_level():
    """A shift of about 2.3 standard errors excludes 0 at 95% but not at 1 - 0.05/26."""
    rng = np.random.default_rng(1)
    base = {t: rng.normal(0.5, 0.3, 400) for t in TASKS}
    shift = 2.3 * 0.3 / np.sqrt(400 * len(TASKS))
    method = {t: base[t] + shift + rng.normal(0, 0.3, 400) for t in TASKS}
    assert paired_bootstrap(method, base).significant
    assert not paired_bootstrap(method, base, 10_000, alpha=0.05 / 26).significant


def test_seed_by_seed_differences_pair_equal_seeds():
    method = [synthetic_record("pcgrad", s, r) for s, r in ((0, 0.30), (1, 0.20), (2, 0.50))]
    control = [synthetic_record("naive_prefix", s, r) for s, r in ((0, 0.25), (2, 0.55))]
    assert seed_differences(method, control, "Rprec") == pytest.approx([0.05, -0.05])
    assert seed_differences(method, [], "Rprec") == []


def test_records_round_trip_byte_for_byte_and_tables_print_from_records_alone(bm25_run, tmp_path, capsys):
    work_dir, data_dir = bm25_run, os.path.join(bm25_run, "data")
    written = os.path.join(work_dir, "records", "bm25-seed0.json.gz")
    assert os.path.exists(written), "t5r results records every finished run"
    record = read_record(written)
    again = write_record(record, str(tmp_path / "copy"))
    with open(written, "rb") as a, open(again, "rb") as b:
        assert a.read() == b.read(), "the same run gives the same record bytes"
    fresh = record_run(os.path.join(work_dir, "bm25"), data_dir, "bm25", 0)
    assert fresh.query_ids == record.query_ids and fresh.table == record.table
    for task in TASKS:
        np.testing.assert_array_equal(fresh.per_query[task]["Rprec"], record.per_query[task]["Rprec"])

    # Only the records: no data, no work directory of runs.
    capsys.readouterr()
    assert cli.main(["results", "--work_dir", str(tmp_path / "w"), "--records_dir", str(tmp_path / "copy"),
                     "--rows="]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("| BM25 | " + f"{record.table['fever']['Rprec']:.3f}"), out
    assert not os.path.exists(tmp_path / "w" / "data")


def test_bad_records_are_named(bm25_run, tmp_path):
    record = read_record(os.path.join(bm25_run, "records", "bm25-seed0.json.gz"))
    broken = tmp_path / "bm25-seed1.json.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="bm25-seed1.json.gz: not a run record"):
        read_records(str(tmp_path))
    other = dataclasses.replace(record, row="pcgrad", query_ids={**record.query_ids, "fever": record.query_ids["fever"][1:]})
    with pytest.raises(ValueError, match="pcgrad-seed0.json.gz and bm25-seed0.json.gz score different fever dev queries"):
        differences_table({"bm25": [record], "pcgrad": [other]}, {"bm25": "BM25", "pcgrad": "PCGrad"},
                          {"pcgrad": "bm25"}, m=2)


def test_running_rows_needs_data(tmp_path, capsys):
    assert cli.main(["results", "--work_dir", str(tmp_path), "--rows", "bm25"]) == 2
    assert "--data is needed to run rows" in capsys.readouterr().err


def test_paired_bootstrap_interval_matches_the_normal_approximation():
    rng = np.random.default_rng(3)
    baseline = {"a": rng.random(400), "b": rng.random(900)}
    shift = {"a": 0.02, "b": -0.01}
    method = {t: baseline[t] + shift[t] + rng.normal(0, 0.3, baseline[t].size) for t in baseline}
    diff = paired_bootstrap(method, baseline)
    observed = np.mean([np.mean(method[t] - baseline[t]) for t in baseline])
    assert diff.mean == pytest.approx(observed)
    se = np.sqrt(sum(np.var(method[t] - baseline[t]) / baseline[t].size for t in baseline)) / 2
    assert diff.high - diff.low == pytest.approx(2 * 1.96 * se, rel=0.15), (diff, se)
    assert diff.low < observed < diff.high and not diff.significant, "a 0.005 mean shift is inside this noise"
    same = paired_bootstrap(baseline, baseline)
    assert (same.mean, same.low, same.high, same.significant) == (0.0, 0.0, 0.0, False)


def test_seeds_are_validated(tmp_path, capsys):
    assert cli.main(["results", "--data", mini_kilt(), "--work_dir", str(tmp_path), "--seeds", "0,x"]) == 2
    assert "--seeds must be comma-separated integers, got '0,x'" in capsys.readouterr().err


def synthetic_record(row: str, seed: int, rprec: float) -> RunRecord:
    """A record with the same R-precision on every task (one query each) and recall@20 0.5."""
    return RunRecord(row, seed, 10.0 * (seed + 1), {t: {"Rprec": rprec, "recall@20": 0.5} for t in TASKS},
                     {t: ["q"] for t in TASKS}, {t: {"Rprec": np.array([rprec]), "recall@20": np.array([0.5])}
                                                 for t in TASKS}, {})


def test_table_shows_mean_and_std_over_a_rows_seeds():
    records = {"pcgrad": [synthetic_record("pcgrad", s, r) for s, r in ((0, 0.2), (1, 0.4), (2, 0.3))],
               "bm25": [synthetic_record("bm25", 0, 0.25)]}
    lines = markdown_table(records).splitlines()
    assert lines[0].endswith("| mean R@20 | seeds | wall time |"), lines[0]
    assert len(lines[1].split("---")) - 1 == len(lines[0].split("|")) - 2, "one separator per column"
    assert lines[2] == "| BM25 | " + " | ".join("0.250 | 0.500" for _ in range(len(TASKS) + 1)) + " | 1 | 10 s |"
    assert lines[3] == "| PCGrad | " + " | ".join("0.300 ± 0.100 | 0.500 ± 0.000" for _ in range(len(TASKS) + 1)) \
        + " | 3 | 20 s |", lines[3]


def test_the_dev_queries_that_are_training_queries_are_counted_and_left_out_of_a_second_mean(bm25_run):
    from t5_retrieval.results.overlap import dev_train_overlap, mean_without, overlap_table

    work_dir, data_dir = bm25_run, os.path.join(bm25_run, "data")
    bm25 = record_run(os.path.join(work_dir, "bm25"), data_dir, "bm25", 0)
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples

    overlap = dev_train_overlap(data_dir)
    for task in TASKS:  # the slice, like mini-KILT, repeats a few training queries in dev
        train = {e.query for e in read_examples(layout.examples_path(data_dir, task, "train"))}
        assert overlap[task] == [e.id for e in read_examples(layout.examples_path(data_dir, task, "dev"))
                                 if e.query in train], task
    assert len(overlap["fever"]) == 5, overlap
    dropped = {"fever": bm25.query_ids["fever"][:10]}
    fever = bm25.per_query["fever"]["Rprec"]
    expected = (fever[10:].mean() + sum(bm25.per_query[t]["Rprec"].mean() for t in TASKS if t != "fever")) / len(TASKS)
    assert mean_without(bm25, dropped, "Rprec") == pytest.approx(expected)
    lines = overlap_table({"bm25": [bm25]}, {"bm25": "BM25"}, dropped).splitlines()
    assert lines[0] == "Dev queries that are also training queries: 10 (fever 10)."
    assert lines[-1] == f"| BM25 | {bm25.mean('Rprec'):.3f} | {expected:.3f} | " \
                        f"{bm25.mean('recall@20'):.3f} | {mean_without(bm25, dropped, 'recall@20'):.3f} |"


def test_the_inputs_table_pairs_each_row_under_old_and_new_inputs_on_the_same_queries():
    from t5_retrieval.results.significance import inputs_table

    old = {"taco": [synthetic_record("taco", 0, 0.30)]}
    new = {"taco": [synthetic_record("taco", 0, 0.50), synthetic_record("taco", 1, 0.70)], "bm25": []}
    lines = inputs_table(new, old, {"taco": "TACO", "bm25": "BM25"}, m=1).splitlines()
    assert len(lines) == 4, "header, rule, then an old and a new line for each row under both inputs"
    assert lines[2].startswith("| TACO | old | 1 | ") and lines[2].endswith(" | 0.300 |  |  |"), lines[2]
    assert lines[3].startswith("| TACO | new | 2 | ") and " | 0.600 | +0.300 [" in lines[3], lines[3]
