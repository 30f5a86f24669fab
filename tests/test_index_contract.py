"""Every index backend through the same checks, as optax's contrib tests run every optimiser through
one common test: built from a real embedding store, searched, saved and loaded, checked against a
model and a KB, damaged; then ScaNN measured against the exact backend, the oracle.

BM25 runs every check that does not need embeddings: it is built from a KB's texts (not an
embedding store: `t5r index --backend=bm25 --kb_dir`, tests/test_bm25.py), searched with query texts,
has no model (dim 0, no encoder passes `check`) and its oracle is its own full score vector."""

import ast
import json
import os

import gin
import numpy as np
import pytest
from test_retrieval_index import MatrixEncoder, clustered, write

from t5_retrieval import checksums, cli
from t5_retrieval.commands import index as index_command
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import bm25
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.retrieval import bm25_index, exact_index, index, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

BACKENDS = ("scann", "exact")  # built from embeddings, searched with embeddings
ALL_BACKENDS = (*BACKENDS, "bm25")
IDS_FILE = "passage_ids.txt"


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(params=ALL_BACKENDS)
def any_backend(request) -> str:
    return request.param


WORDS = [f"w{i}" for i in range(12)]


def text_kb(n: int, seed: int = 0) -> PassageTable:
    """n passages of 3-8 words from a 12-word vocabulary (repeats give BM25 equal scores to order)."""
    rng = np.random.default_rng(seed)
    return PassageTable(Passage(f"p{i}", f"w{i // 3}", f"T{i // 3}", " ".join(rng.choice(WORDS, rng.integers(3, 9))))
                        for i in range(n))


def text_queries(n: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, 2)) for _ in range(n)]


def build(tmp_path, backend: str, n: int, dim: int = 4):
    """An index of `backend` over n passages (embeddings of `dim`, or a text KB for bm25)."""
    if backend == "bm25":
        return bm25_index.build_bm25_index(text_kb(n), "kb")
    return index.build_index(write(tmp_path, clustered(n, dim))[0], backend=backend)


def queries_for(backend: str, n: int, dim: int = 4, seed: int = 3):
    """n queries in the backend's form: embeddings of `dim`, or texts."""
    return text_queries(n, seed) if backend == "bm25" else clustered(n, dim, seed=seed)


def oracle_top_k(matrix: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Rows of the k highest float64 dot products, equal scores in row order."""
    return np.argsort(-(queries.astype(np.float64) @ matrix.T.astype(np.float64)), axis=1, kind="stable")[:, :k]


def test_a_built_index_is_an_index_that_records_what_it_was_built_from(tmp_path, backend):
    matrix = clustered(40, 8)
    emb_dir, passages = write(tmp_path, matrix)
    built = index.build_index(emb_dir, backend=backend)
    assert isinstance(built, index.Index) and built.backend == backend
    assert len(built) == 40 and built.dim == 8 and built.fingerprint == "matrix-v1"
    assert built.passage_ids == [p.id for p in passages]
    assert built.meta == {"checkpoint_dir": "ckpt", "step": 7}
    assert built.embeddings_dir == os.path.abspath(emb_dir)


def test_search_returns_the_true_top_k_best_first(tmp_path, backend):
    matrix, queries = clustered(40, 8), clustered(5, 8, seed=1)
    built = index.build_index(write(tmp_path, matrix)[0], backend=backend)
    rows, scores = built.search(queries, 7)
    expected = oracle_top_k(matrix, queries, 7)
    assert len(rows) == len(scores) == 5
    for q in range(5):
        assert rows[q].dtype == np.int64 and scores[q].dtype == np.float32, (rows[q].dtype, scores[q].dtype)
        np.testing.assert_array_equal(rows[q], expected[q], err_msg=f"{backend}, query {q}: not the exact top 7")
        np.testing.assert_allclose(scores[q], queries[q] @ matrix[expected[q]].T, rtol=1e-5, atol=1e-5)
        assert np.all(np.diff(scores[q]) <= 0), f"{backend}, query {q}: scores not best first: {scores[q]}"


def test_bm25_is_an_index_that_records_its_kb_and_parameters():
    kb = text_kb(40)
    built = bm25_index.build_bm25_index(kb, "data/kb")
    assert isinstance(built, index.Index) and built.backend == "bm25"
    assert len(built) == 40 and built.dim == 0 and built.fingerprint == "bm25-k1=0.9-b=0.4"
    assert built.passage_ids == kb.ids() and built.meta == {"kb_dir": "data/kb"} and built.embeddings_dir == ""


def test_bm25_search_returns_the_top_k_of_its_scores_best_first_ties_by_row():
    built = bm25_index.build_bm25_index(text_kb(40))
    queries = text_queries(6)
    rows, scores = built.search(queries, 7)
    assert len(rows) == len(scores) == 6
    for q, query in enumerate(queries):
        every = bm25.query_scores(built.retriever, query)
        expected = np.argsort(-every, kind="stable")[:7]  # equal scores in row order
        assert rows[q].dtype == np.int64 and scores[q].dtype == np.float32, (rows[q].dtype, scores[q].dtype)
        np.testing.assert_array_equal(rows[q], expected, err_msg=f"query {q} ({query!r}): not the top 7 by row order")
        np.testing.assert_array_equal(scores[q], every[expected])


def test_k_beyond_the_index_size_returns_every_passage_once(tmp_path, any_backend):
    built = build(tmp_path, any_backend, 6)
    rows, scores = built.search(queries_for(any_backend, 2), 50)
    assert [sorted(r.tolist()) for r in rows] == [list(range(6))] * 2, rows
    assert [len(s) for s in scores] == [6, 6]


def test_an_empty_batch_finds_nothing_and_bad_arguments_are_refused(tmp_path, any_backend):
    built = build(tmp_path, any_backend, 10)
    assert built.search(queries_for(any_backend, 0), 3) == ([], [])
    with pytest.raises(ValueError, match="k must be >= 1"):
        built.search(queries_for(any_backend, 1), 0)
    wrong, message = (clustered(1, 4), "searches query texts") if any_backend == "bm25" else \
        (clustered(1, 5), r"shape \[n, 4\]")
    with pytest.raises(ValueError, match=message):
        built.search(wrong, 3)


def test_a_saved_index_loads_back_as_its_backend_with_identical_results(tmp_path, any_backend):
    built, queries = build(tmp_path, any_backend, 300, dim=8), queries_for(any_backend, 6, dim=8, seed=5)
    built.save(str(tmp_path / "idx"))
    loaded = index.load_index(str(tmp_path / "idx"))
    assert type(loaded) is type(built) and loaded.backend == any_backend
    assert (loaded.passage_ids, loaded.fingerprint, loaded.dim, loaded.meta, loaded.embeddings_dir) == \
        (built.passage_ids, built.fingerprint, built.dim, built.meta, built.embeddings_dir)
    for a, b in zip(built.search(queries, 9), loaded.search(queries, 9)):
        for q, (x, y) in enumerate(zip(a, b)):
            np.testing.assert_array_equal(x, y, err_msg=f"{any_backend}, query {q}: loaded index answers differently")


def test_check_refuses_another_model_and_another_kb(tmp_path, backend):
    matrix = clustered(30, 8)
    emb_dir, passages = write(tmp_path, matrix)
    built = index.build_index(emb_dir, backend=backend)
    built.check(MatrixEncoder(matrix), [p.id for p in passages])  # the matching pair passes
    with pytest.raises(index.IndexMismatchError, match="model fingerprint 'matrix-v1'.*'hashed-bow-v2-dim8'"):
        built.check(HashedBagOfWordsEncoder(dim=8))
    with pytest.raises(index.IndexMismatchError, match="index dim 8 != query encoder dim 4"):
        built.check(MatrixEncoder(matrix[:, :4]))
    with pytest.raises(index.IndexMismatchError, match="first difference at row 29"):
        built.check(passage_ids=[p.id for p in passages[:-1]] + ["other"])
    with pytest.raises(index.IndexMismatchError, match="30 indexed vs 29 in the KB"):
        built.check(passage_ids=[p.id for p in passages[:-1]])


def test_bm25_check_refuses_any_query_encoder_and_another_kb():
    kb = text_kb(30)
    built = bm25_index.build_bm25_index(kb, "kb")
    built.check(passage_ids=kb.ids())  # its own KB passes
    with pytest.raises(index.IndexMismatchError, match="kb: a BM25 index searches query text and takes no model"):
        built.check(HashedBagOfWordsEncoder(dim=8))
    with pytest.raises(index.IndexMismatchError, match="first difference at row 29"):
        built.check(passage_ids=kb.ids()[:-1] + ["other"])


def test_index_json_records_the_backend_and_the_shared_fields(tmp_path, any_backend):
    built = build(tmp_path, any_backend, 12)
    built.save(str(tmp_path / "idx"))
    record = json.loads((tmp_path / "idx" / "index.json").read_text())
    shared = {"format", "backend", "fingerprint", "dim", "num_passages", "ids_sha256", "meta", "embeddings_dir"}
    assert set(record) == shared | {any_backend}, sorted(record)
    assert (record["format"], record["backend"], record["num_passages"], record["dim"]) == \
        ("t5r-index-v2", any_backend, 12, 0 if any_backend == "bm25" else 4), record
    assert (tmp_path / "idx" / IDS_FILE).read_text().splitlines() == built.passage_ids


def _rewrite(path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


DAMAGES = {
    "no index.json": (lambda d: (d / "index.json").unlink(), "not an index directory"),
    "truncated index.json": (lambda d: (d / "index.json").write_text('{"format": '), "index.json: not valid JSON"),
    "a list": (lambda d: (d / "index.json").write_text("[]"), "index.json: a JSON array, expected an object"),
    "another format": (lambda d: _rewrite(d / "index.json", lambda r: r.update(format="faiss-v1")),
                       "field 'format' is 'faiss-v1', expected 't5r-index-v2'"),
    "an unknown backend": (lambda d: _rewrite(d / "index.json", lambda r: r.update(backend="faiss")),
                           "field 'backend' is 'faiss'; this t5r reads scann, exact, bm25$"),
    "a missing field": (lambda d: _rewrite(d / "index.json", lambda r: r.pop("fingerprint")),
                        "no field 'fingerprint'"),
    "no passage ids": (lambda d: (d / IDS_FILE).unlink(), f"{IDS_FILE}: missing"),
    "other passage ids": (lambda d: (d / IDS_FILE).write_text("p0\np1\n"), "does not match index.json's ids_sha256"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_missing_or_damaged_index_directory_is_a_clear_error(tmp_path, any_backend, damage):
    build(tmp_path, any_backend, 12).save(str(tmp_path / "idx"))
    apply, message = DAMAGES[damage]
    apply(tmp_path / "idx")
    if damage != "no index.json":  # every file is verified before it is read: the changed one fails its checksum
        with pytest.raises(checksums.ChecksumError, match="index.json|passage_ids.txt"):
            index.load_index(str(tmp_path / "idx"))
        checksums.record(str(tmp_path / "idx"))  # accepted as it is (`t5r checksum --accept`): still refused
    with pytest.raises(index.IndexMismatchError, match=message):
        index.load_index(str(tmp_path / "idx"))


def test_damaged_backend_assets_are_a_clear_error(tmp_path, any_backend):
    out = tmp_path / "idx"
    build(tmp_path, any_backend, 50, dim=8).save(str(out))
    assets = [p for p in out.rglob("*") if p.is_file() and p.name not in ("index.json", IDS_FILE)]
    largest = max(assets, key=lambda p: p.stat().st_size)
    size = largest.stat().st_size
    largest.write_bytes(largest.read_bytes()[:40])
    with pytest.raises(checksums.ChecksumError, match=f"{largest}: 40 bytes where {size} were written"):
        index.load_index(str(out))
    checksums.record(str(out))  # accepted as it is (`t5r checksum --accept`): the backend still notices
    with pytest.raises(index.IndexMismatchError, match="damaged"):
        index.load_index(str(out))


def test_a_save_that_fails_midway_leaves_no_loadable_index(tmp_path, any_backend, monkeypatch):
    built = build(tmp_path, any_backend, 20)
    out = str(tmp_path / "idx")
    built.save(out)

    def dies_halfway(self, directory):
        with open(os.path.join(directory, "partial_asset"), "w") as f:
            f.write("half")
        raise OSError("preempted")

    with monkeypatch.context() as patch:
        patch.setattr(type(built), "_write_assets", dies_halfway)
        with pytest.raises(OSError, match="preempted"):
            built.save(out)
    with pytest.raises(index.IndexMismatchError, match="not an index directory"):
        index.load_index(out)  # the old index.json must not vouch for the half-written assets
    built.save(out)
    assert len(index.load_index(out)) == 20


def test_saving_one_backend_over_another_loads_the_new_one(tmp_path):
    out = str(tmp_path / "idx")
    for backend in (*ALL_BACKENDS, *ALL_BACKENDS[::-1]):
        build(tmp_path, backend, 20).save(out)
        assert index.load_index(out).backend == backend


@pytest.mark.parametrize("how", ["flag", "gin"])
def test_t5r_index_builds_the_backend_chosen_by_flag_or_gin(tmp_path, backend, how):
    emb_dir, _ = write(tmp_path, clustered(20, 4))
    out = tmp_path / "idx"
    choice = [f"--backend={backend}"] if how == "flag" else [f"--gin.build_index.backend='{backend}'"]
    try:
        assert index_command.main(["--embeddings_dir", emb_dir, "--output_dir", str(out), *choice]) == 0
    finally:
        gin.clear_config()
    assert json.loads((out / "index.json").read_text())["backend"] == backend
    assert index.load_index(str(out)).backend == backend


def test_t5r_index_refuses_an_unknown_backend_in_one_line(tmp_path, capsys):
    emb_dir, _ = write(tmp_path, clustered(20, 4))
    try:
        code = cli.main(["index", "--embeddings_dir", emb_dir, "--output_dir", str(tmp_path / "idx"),
                         "--gin.build_index.backend='faiss'"])
    finally:
        gin.clear_config()
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == ("t5r index: error: index backend 'faiss' (--backend or gin "
                                         "build_index.backend): choose one of scann, exact"), err


def test_a_directory_written_before_backends_existed_loads_as_scann(tmp_path):
    matrix, queries = clustered(30, 8), clustered(3, 8, seed=4)
    built = index.build_index(write(tmp_path, matrix)[0], backend="scann")
    built.save(str(tmp_path / "idx"))

    def as_v1(record):  # what t5r wrote before backends: no backend field, its own format name
        record.pop("backend")
        record["format"] = "t5r-scann-index-v1"

    _rewrite(tmp_path / "idx" / "index.json", as_v1)
    os.remove(tmp_path / "idx" / checksums.CHECKSUMS_FILE)  # nor did it record checksums
    with pytest.raises(checksums.ChecksumError, match="t5r checksum --accept"):
        index.load_index(str(tmp_path / "idx"))
    checksums.record(str(tmp_path / "idx"))
    loaded = index.load_index(str(tmp_path / "idx"))
    assert isinstance(loaded, scann_index.ScannIndex) and loaded.config == built.config
    for a, b in zip(built.search(queries, 5)[0], loaded.search(queries, 5)[0]):
        np.testing.assert_array_equal(a, b)


def test_exact_search_breaks_ties_by_row_whatever_the_tiling(tmp_path):
    """Small integer embeddings have exactly equal scores; the lower row must come first."""
    rng = np.random.default_rng(0)
    matrix = rng.integers(-1, 2, size=(500, 3)).astype(np.float32)  # 27 distinct rows: every score is tied
    queries = rng.integers(-1, 2, size=(40, 3)).astype(np.float32)
    expected = oracle_top_k(matrix, queries, 25)
    built = index.build_index(write(tmp_path, matrix)[0], backend="exact")
    rows, _ = built.search(queries, 25)
    np.testing.assert_array_equal(np.stack(rows), expected, err_msg="ties must be broken by row id")
    for tile in (1, 30, 64, 499):  # blocks of at least k rows, merged across block boundaries
        tiled, _ = exact_index.exact_top_k(matrix, queries, 25, tile=tile)
        np.testing.assert_array_equal(tiled, expected, err_msg=f"tile {tile}: ties must not depend on the tiling")


# recall@10 of ScaNN's top 10 against the exact backend's, 200 queries over 6,000 x 32 clustered
# points, measured on 10 draws of the data: brute force 1.000 on every one; tree + AH + reorder
# (default ScannConfig: 77 leaves, 8 searched) 0.916-0.978, mean 0.955; 0.9595 on this test's data,
# on every build. As documented in docs/retrieval.md.
RECALL_TOLERANCE = {"brute_force": 0.0, "tree_ah": 0.1}


@pytest.mark.parametrize("mode", ["brute_force", "tree_ah"])
def test_scann_agrees_with_the_exact_oracle_on_recall_at_10(tmp_path, mode):
    matrix, queries = clustered(6000, 32), clustered(200, 32, seed=2)
    emb_dir, _ = write(tmp_path, matrix)
    oracle = index.build_index(emb_dir, backend="exact")
    scann = scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode=mode))
    assert scann.config.mode == mode
    truth, _ = oracle.search(queries, 10)
    found, _ = scann.search(queries, 10)
    recall = np.mean([len(set(f.tolist()) & set(t.tolist())) / 10 for f, t in zip(found, truth)])
    assert recall >= 1.0 - RECALL_TOLERANCE[mode], \
        f"ScaNN {mode}: recall@10 against exact search {recall:.3f}, expected >= {1 - RECALL_TOLERANCE[mode]:.2f}"


def _modules_importing(prefix: str) -> set[str]:
    """Library files (relative paths) with an import of `prefix` or of a module under it."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "t5_retrieval")
    found = set()
    for directory, _, files in os.walk(root):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n == prefix or n.startswith(prefix + ".") for n in names):
                    found.add(os.path.relpath(path, os.path.dirname(root)))
    return found


def test_callers_see_the_protocol_and_only_the_scann_backend_imports_scann():
    assert _modules_importing("scann") == {"t5_retrieval/retrieval/scann_index.py", "t5_retrieval/export/scann_tf.py"}
    # The dispatch, and the export, whose SavedModel embeds ScaNN's own searcher.
    assert _modules_importing("t5_retrieval.retrieval.scann_index") == {
        "t5_retrieval/retrieval/index.py", "t5_retrieval/export/savedmodel.py"}
    assert _modules_importing("t5_retrieval.retrieval.exact_index") == {"t5_retrieval/retrieval/index.py"}
    assert _modules_importing("t5_retrieval.retrieval.bm25_index") == {"t5_retrieval/retrieval/index.py"}
    assert _modules_importing("bm25s") == {"t5_retrieval/data/stores/bm25.py"}
