"""Stage outputs are published atomically: a write that fails midway leaves no output that a later
stage would take as complete (it is redone), never a mix of old and new files."""

import json
import os

import numpy as np
import pytest
from etils import epath
from test_retrieval_index import clustered, write

from t5_retrieval import artefact_io, checkpoint, checksums
from t5_retrieval.data.kilt import demo_slice, synthetic
from t5_retrieval.data.records import Passage, write_jsonl_atomic
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import write_passage_store
from t5_retrieval.data.tasks import materialize
from t5_retrieval.results import page, records
from t5_retrieval.results.common import TASKS
from t5_retrieval.retrieval import evaluate, exact_index, index, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder


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
                                 predictions={"nq": [{"id": "q1",
                                                      "output": [{"provenance": [{"wikipedia_id": "7"}]}]}]})
    with pytest.raises(OSError):
        evaluate.write_results(second, out)
    assert not os.path.exists(os.path.join(out, "results.json")), \
        "results.json of the old run must not sit next to the new predictions"
    assert not [n for n in os.listdir(out) if ".tmp" in n], "no temporary file may be left as a result"


# Each writer that publishes by a rename, as a function that prepares its inputs under `root` and
# returns the write itself.
def _jsonl(root):
    return lambda: write_jsonl_atomic(root / "rows.jsonl", [{"id": "1"}])


def _passage_store(root):
    passages = [(Passage(str(i), f"page{i}", f"Title {i}", f"passage {i}"), None) for i in range(3)]
    return lambda: write_passage_store(passages, str(root / "kb"))


def _embedding_shard(root):
    passages = [Passage(str(i), f"page{i}", f"Title {i}", f"passage {i}") for i in range(3)]

    def write():
        embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages, [p.id for p in passages],
                                         str(root), shard_size=2, progress=False)

    write()
    for name in os.listdir(root):  # the next run writes this shard again
        if name.startswith("shard-00001"):
            os.remove(root / name)
    return write


def _exact_index(root):
    built = exact_index.ExactIndex(np.eye(3, 4, dtype=np.float32), ["a", "b", "c"], "fingerprint")
    return lambda: built.save(str(root))


def _task_cache(root):
    examples = materialize.TaskExamples(["q1"], [np.array([5, 1], np.int32)], ["p1"], None, [("page1",)])
    return lambda: materialize._save(examples, str(root / "train.npz"))


def _artefact_checksums(root):
    (root / "file.txt").write_text("artefact")
    return lambda: checksums.record(str(root))


def _checkpoint_checksums(root):
    (root / "array").write_bytes(b"weights")
    return lambda: checkpoint.write_checksums(epath.Path(root))


def _run_record(root):
    scores = {t: {k: np.zeros(1) for k, _ in records.METRICS} for t in TASKS}
    table = {t: {k: 0.0 for k, _ in records.METRICS} for t in TASKS}
    record = records.RunRecord("bm25", 0, 1.0, table, {t: ["q"] for t in TASKS}, scores, {})
    return lambda: records.write_record(record, str(root))


def _results_page(root):
    records_dir = _run_record(root / "records")
    (root / "records").mkdir()
    records_dir()
    (root / "page.md").write_text("<!-- records: main records -->\nold\n<!-- /records -->\n", encoding="utf-8")
    return lambda: page.refresh_page(str(root / "page.md"))


def _demo_archive(root):
    return lambda: demo_slice.write_archive({"kb/pages.jsonl": b"{}\n"}, str(root / "slice.tar.gz"))


def _unpacked_demo_slice(root):
    (root / "archive").mkdir()
    archive = str(root / "archive" / "slice.tar.gz")
    demo_slice.write_archive({"kb/pages.jsonl": b"{}\n"}, archive)
    return lambda: demo_slice.extract(archive, str(root))


def _synthetic_benchmark(root):
    return lambda: synthetic.write_demo(str(root / "demo"), num_pages=2, train_per_task=1, dev_per_task=1)


WRITERS = [_jsonl, _passage_store, _embedding_shard, _exact_index, _task_cache, _artefact_checksums,
           _checkpoint_checksums, _run_record, _results_page, _demo_archive, _unpacked_demo_slice, _synthetic_benchmark]


class Killed(BaseException):
    """The writer's process dies here: no handler of its own runs (BaseException passes them all)."""


def _killed_at_first_rename(src, dst):
    raise Killed(os.fspath(src))


@pytest.mark.parametrize("prepare", WRITERS, ids=lambda w: w.__name__.lstrip("_"))
def test_the_cleaner_removes_the_temporary_of_a_writer_killed_before_its_rename(prepare, tmp_path, monkeypatch):
    write = prepare(tmp_path)
    before = _tree(tmp_path)
    with monkeypatch.context() as killed:
        killed.setattr(os, "replace", _killed_at_first_rename)
        killed.setattr(artefact_io, "_remove", lambda path: None)  # a dead process cleans up nothing
        with pytest.raises(Killed) as rename:
            write()
    temporary = rename.value.args[0]
    assert os.path.exists(temporary)
    monkeypatch.setattr(artefact_io, "_alive", lambda pid: False)  # the writer's pid no longer runs
    for directory in sorted({str(tmp_path)} | {p for p in _tree(tmp_path) if os.path.isdir(p)}):
        if os.path.isdir(directory):  # each run cleans the directory it writes in
            artefact_io.remove_stale_temporaries(directory)
    # The pending marker is no temporary: it stays to say that the artefact's writer was killed.
    left = sorted(p for p in _tree(tmp_path) - before if os.path.basename(p) != checksums.PENDING_FILE)
    assert not left, f"left by the killed writer and not removed by the cleaner: {left}"


def _tree(root) -> set[str]:
    return {os.path.join(d, name) for d, dirs, files in os.walk(root) for name in dirs + files}
