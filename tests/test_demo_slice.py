"""The real-data demo slice: rebuilt from mini-KILT it is the committed archive byte for byte; it
unpacks into KILT-format data the pipeline prepares, with every gold page in its KB; and the
demo's first row runs on it and lands in the demo's table with its wall time."""

import os

import pytest
from conftest import mini_kilt

from t5_retrieval.commands import data as data_command
from t5_retrieval.data.kilt import demo_slice as kilt_slice


def test_rebuilding_the_slice_from_mini_kilt_gives_the_committed_bytes(tmp_path):
    rebuilt = tmp_path / "slice.tar.gz"
    assert data_command.slice_main(["--mini_kilt", mini_kilt(), "--out", str(rebuilt)]) == 0
    with open(kilt_slice.SHIPPED, "rb") as f:
        committed = f.read()
    assert rebuilt.read_bytes() == committed, "the slice builder no longer reproduces the committed slice"
    sidecar = ".sha256.json"
    assert open(f"{rebuilt}{sidecar}").read() == open(kilt_slice.SHIPPED + sidecar).read(), \
        "the committed checksum record is not the slice's"
    assert len(committed) <= 3 * 2**20, f"the slice is {len(committed)} bytes; keep it under 3 MiB"


@pytest.fixture(scope="module")
def bm25_demo(tmp_path_factory):
    from t5_retrieval.results.minilm_rows import bm25_row
    from t5_retrieval.results.records import record_run
    from t5_retrieval.results.tables import markdown_table

    out = str(tmp_path_factory.mktemp("demo"))
    raw = kilt_slice.extract(kilt_slice.SHIPPED, out)
    from t5_retrieval.results.common import prepare_data
    data_dir = os.path.join(out, "data")
    prepare_data(raw, data_dir)
    bm25_row(os.path.join(out, "bm25"), data_dir)
    return data_dir, markdown_table({"bm25": [record_run(os.path.join(out, "bm25"), data_dir, "bm25", 0)]})


def test_every_gold_page_of_the_slice_is_in_its_kb(bm25_demo):
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.stores.kb import PassageStore

    data_dir, _ = bm25_demo
    pages = set(PassageStore.open(layout.kb_dir(data_dir)).passages_by_page())
    for task in kilt_slice.TASKS:
        for split in ("train", "dev"):
            examples = read_examples(layout.examples_path(data_dir, task, split))
            assert examples, f"{task}-{split}: no examples"
            missing = {p for e in examples for s in e.gold_pages for p in s} - pages
            assert not missing, f"{task}-{split}: gold pages outside the KB: {sorted(missing)[:3]}"


def test_the_demo_table_shows_the_bm25_row_with_its_wall_time(bm25_demo):
    _, table = bm25_demo
    header, _, *rows = table.splitlines()
    assert header.startswith("| row | fever R-prec | fever R@20 |") and header.endswith("| mean R@20 | wall time |")
    assert len(rows) == 1 and rows[0].startswith("| BM25 | "), table
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    scores = [float(c) for c in cells[1:-1]]
    assert len(scores) == 2 * 7 and all(0.0 <= s <= 1.0 for s in scores), cells
    assert sum(scores) > 0, "BM25 finds gold pages on real data"
    assert cells[-1].endswith(" s"), cells[-1]


def test_the_slice_archive_and_its_unpacked_copy_are_verified_before_use(tmp_path):
    from t5_retrieval import checksums

    archive = str(tmp_path / "slice.tar.gz")
    data = bytearray(open(kilt_slice.SHIPPED, "rb").read())
    open(archive, "wb").write(bytes(data))
    open(archive + checksums.SIDECAR_SUFFIX, "w").write(open(kilt_slice.SHIPPED + checksums.SIDECAR_SUFFIX).read())
    target = kilt_slice.extract(archive, str(tmp_path / "out"))
    assert sorted(os.listdir(target))[:2] == ["entity_linking-dev-kilt.jsonl", "entity_linking-train-kilt.jsonl"]
    assert kilt_slice.extract(archive, str(tmp_path / "out")) == target  # reused, verified
    with open(os.path.join(target, "fever-dev-kilt.jsonl"), "r+b") as f:
        f.write(b"X")
    with pytest.raises(checksums.ChecksumError, match=r"fever-dev-kilt.jsonl: fails its sha256 checksum"):
        kilt_slice.extract(archive, str(tmp_path / "out"))
    data[len(data) // 2] ^= 1
    open(archive, "wb").write(bytes(data))
    with pytest.raises(checksums.ChecksumError, match=r"slice.tar.gz: fails its sha256 checksum"):
        kilt_slice.extract(archive, str(tmp_path / "again"))
    assert not os.path.exists(tmp_path / "again" / kilt_slice.ROOT)


def test_the_bm25_row_writes_a_trec_run_per_task_like_t5r_eval(bm25_demo):
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.results.common import TASKS

    data_dir, _ = bm25_demo
    predictions = os.path.join(os.path.dirname(data_dir), "bm25", "eval", "predictions")
    for task in TASKS:
        with open(os.path.join(predictions, f"{task}.trec")) as f:
            lines = [line.split() for line in f]
        ids = [e.id for e in read_examples(layout.examples_path(data_dir, task, "dev"))]
        assert [qid for qid, *_ in lines[::100]] == ids, f"{task}: 100 ranked passages per dev query, in order"
        first = lines[:100]
        assert [int(rank) for _, _, _, rank, _, _ in first] == list(range(1, 101))
        scores = [float(score) for *_, score, _ in first]
        assert scores == sorted(scores, reverse=True) and {line[1] for line in first} == {"Q0"}
