"""The bootstrap intervals of the results page: one Bonferroni count for the page, decisions that do
not depend on the bootstrap's seed, and chunked resampling that draws the same resamples."""

import numpy as np
import pytest

from t5_retrieval.results import page
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.page import refreshed
from t5_retrieval.results.records import RunRecord, write_record
from t5_retrieval.results.significance import ALPHA, paired_bootstrap, resampled_means


def record(row: str, seed: int, shift: float, queries: int = 30) -> RunRecord:
    """A run scoring `queries` dev queries per task, R-precision a fixed pattern plus `shift`."""
    scores = np.clip(np.linspace(0.2, 0.8, queries) + shift, 0, 1)
    per_query = {t: {"Rprec": scores, "recall@20": np.clip(scores + 0.1, 0, 1)} for t in TASKS}
    table = {t: {k: float(v.mean()) for k, v in per_query[t].items()} for t in TASKS}
    return RunRecord(row, seed, 1.0, table, {t: [f"q{i}" for i in range(queries)] for t in TASKS}, per_query, {})


def test_the_bonferroni_count_covers_every_interval_the_page_prints(tmp_path, monkeypatch):
    new, old = tmp_path / "new", tmp_path / "old"
    for directory, pcgrad_shift in ((new, 0.05), (old, 0.0)):
        write_record(record("naive_prefix", 0, 0.0), str(directory))
        write_record(record("pcgrad", 0, pcgrad_shift), str(directory))
    corrected_for = []
    for name in ("differences_table", "inputs_table"):
        table = getattr(page, name)
        monkeypatch.setattr(page, name, lambda *args, m, table=table: corrected_for.append(m) or table(*args, m=m))
    text = ("<!-- records: bonferroni -->\n<!-- /records -->\n"
            "<!-- records: differences new -->\n<!-- /records -->\n"
            "<!-- records: change new old -->\n<!-- /records -->\n")
    printed = refreshed(text, str(tmp_path / "page.md"))
    # differences: pcgrad - naive_prefix on two metrics; change: both rows under both inputs.
    m = 2 + 2
    assert f"m = {m} bootstrap intervals" in printed and f"1 - 0.05/{m} " in printed, printed
    assert corrected_for == [m, m], f"each table corrects for the page's {m} intervals, not its own: {corrected_for}"
    assert printed.count("excludes 0 after the Bonferroni correction") == 2, printed


def edge_case() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-query differences shifted so that the 95% interval's lower end is 0 at a reference seed."""
    rng = np.random.default_rng(5)
    diff = {t: rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], 150) * 0.5 for t in ("a", "b")}
    zero = {t: np.zeros(150) for t in diff}
    low = paired_bootstrap(diff, zero, 5_000, seed=1000).low
    return {t: d - low for t, d in diff.items()}, zero


def test_an_interval_with_an_end_at_0_is_marked_on_the_edge_under_every_bootstrap_seed():
    method, zero = edge_case()
    found = [paired_bootstrap(method, zero, 5_000, seed=seed) for seed in range(20)]
    assert {d.low > 0 for d in found} == {False, True}, "the raw decision flips with the seed: the case is on the edge"
    assert {d.significant for d in found} == {False}, [str(d) for d in found]
    assert {d.edge for d in found} == {True}, [str(d) for d in found]
    assert all(str(d).endswith(" ≈0") for d in found)

    clear = {t: d + 0.05 for t, d in method.items()}
    assert {(d.significant, d.edge) for d in (paired_bootstrap(clear, zero, 5_000, seed=s) for s in range(20))} \
        == {(True, False)}, "an interval well away from 0 excludes it under every seed"


def test_chunked_resampling_draws_the_same_resamples_as_one_chunk():
    rng = np.random.default_rng(2)
    diffs = {"a": rng.normal(size=(40, 3)), "b": rng.normal(size=(7, 3))}
    whole = resampled_means(diffs, 5_000, seed=3, chunk=5_000)
    np.testing.assert_allclose(resampled_means(diffs, 5_000, seed=3, chunk=7), whole, rtol=0, atol=1e-12)
    one_column = resampled_means({t: d[:, 1:2] for t, d in diffs.items()}, 5_000, seed=3, chunk=300)
    np.testing.assert_allclose(one_column[:, 0], whole[:, 1], rtol=0, atol=1e-12,
                               err_msg="a comparison's resamples do not depend on the others in its table")
    assert not np.allclose(resampled_means(diffs, 5_000, seed=4), whole), "another seed draws other resamples"
    expected_alpha_percentile = np.percentile(whole[:, 0], 100 * ALPHA / 2)
    assert paired_bootstrap({t: d[:, 0] for t, d in diffs.items()}, {t: np.zeros(len(d)) for t, d in diffs.items()},
                            5_000, seed=3).low == pytest.approx(expected_alpha_percentile, abs=1e-12)


def test_each_task_gets_its_best_recipe_row_against_zero_shot_and_bm25(tmp_path):
    """The best row is chosen per task on its seed-mean R-precision; its interval to a baseline is
    the paired bootstrap of that task's queries alone; the page counts two intervals per task."""
    from t5_retrieval.results.best import best_row, best_table

    def shifted(row: str, seed: int, by_task: dict[str, float]) -> RunRecord:
        base = record(row, seed, 0.0)
        per_query = {t: {k: np.clip(v + by_task.get(t, 0.0), 0, 1) for k, v in base.per_query[t].items()} for t in TASKS}
        table = {t: {k: float(v.mean()) for k, v in per_query[t].items()} for t in TASKS}
        return RunRecord(row, seed, 1.0, table, base.query_ids, per_query, {})

    records = {"minilm_zeroshot": [record("minilm_zeroshot", 0, 0.0)], "bm25": [record("bm25", 0, -0.1)],
               "taco_recipe_frozen": [shifted("taco_recipe_frozen", s, {"wow": 0.1, "fever": 0.02}) for s in (0, 1)],
               "naive_recipe_frozen": [shifted("naive_recipe_frozen", 0, {"fever": 0.05})],
               "naive_prefix": [shifted("naive_prefix", 0, {t: 0.3 for t in TASKS})]}  # not a recipe row
    assert best_row(records, "wow") == "taco_recipe_frozen" and best_row(records, "fever") == "naive_recipe_frozen"
    table = best_table(records, {}, m=12)
    wow = next(line for line in table.splitlines() if line.startswith("| wow |"))
    expected = paired_bootstrap({"wow": records["taco_recipe_frozen"][0].per_query["wow"]["Rprec"]},  # seeds agree on wow
                                {"wow": records["minilm_zeroshot"][0].per_query["wow"]["Rprec"]})
    assert f"| {expected} |" in wow and "| 2 |" in wow, (wow, expected)
    for run in (run for runs in records.values() for run in runs):
        write_record(run, str(tmp_path / "r"))
    printed = refreshed("<!-- records: bonferroni -->\n<!-- /records -->\n<!-- records: best r -->\n<!-- /records -->\n",
                        str(tmp_path / "page.md"))
    assert f"m = {2 * len(TASKS)} bootstrap intervals" in printed and printed.count("| entity_linking |") == 1, printed
