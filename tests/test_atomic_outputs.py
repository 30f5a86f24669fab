"""Stage outputs are published atomically: a write that fails midway leaves no output that a later
stage would take as complete (it is redone), never a mix of old and new files."""

import json
import os

import pytest

from t5_retrieval.retrieval import evaluate, index, scann_index
from test_retrieval_index import clustered, write


class FailingSearcher:
    """Stands in for a ScaNN searcher whose serialisation dies halfway (disk full, preemption)."""

    def serialize(self, directory, relative_path=True):
        with open(os.path.join(directory, "partial_asset"), "w") as f:
            f.write("half")
        raise OSError("no space left on device")


def test_index_rewrite_that_fails_leaves_no_loadable_index(tmp_path):
    built = scann_index.build_scann_index(write(tmp_path, clustered(40, 8))[0], scann_index.ScannConfig())
    out = str(tmp_path / "index")
    built.save(out)
    assert len(index.load_index(out)) == 40, "the first save should load"
    broken = scann_index.ScannIndex(FailingSearcher(), built.passage_ids, "other-model", built.dim, built.config)
    with pytest.raises(OSError, match="no space"):
        broken.save(out)
    with pytest.raises(index.IndexMismatchError, match="not an index directory"):
        index.load_index(out)  # the old index.json must not vouch for the half-written assets
    built.save(out)  # redoing the stage publishes a complete index again
    assert index.load_index(out).fingerprint == built.fingerprint


def test_eval_results_that_fail_midway_leave_no_results_json(tmp_path, monkeypatch):
    out = str(tmp_path / "eval")
    first = evaluate.EvalResult(tables={"nq": {"R-prec": 0.5, "n": 2}},
                                predictions={"nq": [{"id": "q1", "output": [{"provenance": []}]}]})
    evaluate.write_results(first, out)
    with open(os.path.join(out, "results.json")) as f:
        assert json.load(f) == first.tables

    def disk_full(tables):
        raise OSError("no space left on device")

    monkeypatch.setattr(evaluate, "format_table", disk_full)
    second = evaluate.EvalResult(tables={"nq": {"R-prec": 0.25, "n": 2}},
                                 predictions={"nq": [{"id": "q1", "output": [{"provenance": [{"wikipedia_id": "7"}]}]}]})
    with pytest.raises(OSError):
        evaluate.write_results(second, out)
    assert not os.path.exists(os.path.join(out, "results.json")), \
        "results.json of the old run must not sit next to the new predictions"
    assert not [n for n in os.listdir(out) if ".tmp" in n], "no temporary file may be left as a result"
