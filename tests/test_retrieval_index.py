"""ScaNN index: exactness of brute force, recall of tree+AH, save/load, mismatch refusal, CLI."""

import json
import subprocess
import sys

import gin
import numpy as np
import pytest

from t5_retrieval.commands import index as index_command
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.retrieval import index, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder


class MatrixEncoder:
    """A real (lookup-table) encoder: passage i embeds to row i of a fixed matrix."""

    def __init__(self, matrix: np.ndarray, fingerprint: str = "matrix-v1"):
        self.matrix = matrix.astype(np.float32)
        self.fingerprint = fingerprint
        self.dim = matrix.shape[1]

    def encode_queries(self, texts, task):
        return np.stack([self.matrix[int(t)] for t in texts])

    def encode_passages(self, passages):
        return self.matrix[[int(p.id[1:]) for p in passages]]


def clustered(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(max(4, n // 200), dim))
    x = centers[rng.integers(0, len(centers), n)] + 0.5 * rng.normal(size=(n, dim))
    return x.astype(np.float32)


def write(tmp_path, matrix: np.ndarray, fingerprint: str = "matrix-v1") -> tuple[str, list[Passage]]:
    passages = [Passage(f"p{i}", f"w{i // 3}", f"T{i // 3}", "text") for i in range(len(matrix))]
    out = str(tmp_path / "emb")
    embedding_store.write_embeddings(MatrixEncoder(matrix, fingerprint), passages, [p.id for p in passages], out,
                                shard_size=max(1, len(matrix) // 3), progress=False,
                                meta={"checkpoint_dir": "ckpt", "step": 7})
    return out, passages


def exact_top_k(matrix: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(queries @ matrix.T), axis=1, kind="stable")[:, :k]


def test_tiny_sets_fall_back_to_exact_brute_force(tmp_path):
    matrix = clustered(40, 8)
    built = scann_index.build_scann_index(write(tmp_path, matrix)[0], scann_index.ScannConfig())
    assert built.config.mode == "brute_force", "40 points are too few to partition"
    queries = clustered(5, 8, seed=1)
    rows, scores = built.search(queries, k=7)
    expected = exact_top_k(matrix, queries, 7)
    for q in range(5):
        np.testing.assert_array_equal(rows[q], expected[q], err_msg=f"query {q}: brute force must be exact")
        np.testing.assert_allclose(scores[q], (queries[q] @ matrix.T)[expected[q]], rtol=1e-5)


def test_k_beyond_the_index_size_returns_every_passage_once(tmp_path):
    matrix = clustered(6, 4)
    built = scann_index.build_scann_index(write(tmp_path, matrix)[0], scann_index.ScannConfig(mode="brute_force"))
    rows, _ = built.search(clustered(2, 4, seed=3), k=50)
    assert all(sorted(r.tolist()) == list(range(6)) for r in rows), rows


def test_tree_ah_builds_of_the_same_embeddings_are_the_same_index(tmp_path):
    """From ScaNN's default random k-means centres, builds of these embeddings differed (rows, and
    recall@10 over 50 queries anywhere in 0.916-0.96 over 60 builds; one CI run read 0.88), within
    one process too. From k-means++ centres every build is the same index: here, one per number of
    training threads and one made by `t5r index` in another process. (Its recall against exact
    search is tests/test_index_contract.py's.)"""
    matrix = clustered(6000, 32)
    embeddings_dir = write(tmp_path, matrix)[0]
    cli_dir = str(tmp_path / "cli_idx")
    subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "index", f"--embeddings_dir={embeddings_dir}",
                    f"--output_dir={cli_dir}", "--gin.ScannConfig.mode='tree_ah'"], check=True, capture_output=True)
    builds = {f"{threads} training threads": scann_index.build_scann_index(
        embeddings_dir, scann_index.ScannConfig(mode="tree_ah", training_threads=threads)) for threads in (0, 1, 2)}
    builds["t5r index"] = index.load_index(cli_dir)
    assert all(b.config.mode == "tree_ah" and b.config.num_leaves == 77 for b in builds.values())
    queries = clustered(200, 32, seed=2)
    results = {name: built.search(queries, k=10) for name, built in builds.items()}
    rows, scores = results.pop("0 training threads")
    for name, (other_rows, other_scores) in results.items():
        for q in range(len(queries)):
            np.testing.assert_array_equal(other_rows[q], rows[q], err_msg=f"{name}, query {q}")
            np.testing.assert_array_equal(other_scores[q], scores[q], err_msg=f"{name}, query {q}")


def test_saved_index_loads_back_with_identical_results(tmp_path):
    matrix = clustered(300, 8)
    built = scann_index.build_scann_index(write(tmp_path, matrix)[0], scann_index.ScannConfig(mode="brute_force"))
    built.save(str(tmp_path / "idx"))
    loaded = index.load_index(str(tmp_path / "idx"))
    assert loaded.passage_ids == built.passage_ids and loaded.fingerprint == "matrix-v1" and loaded.dim == 8
    assert loaded.meta == {"checkpoint_dir": "ckpt", "step": 7}, "the embeddings' provenance travels with the index"
    queries = clustered(4, 8, seed=5)
    for a, b in zip(built.search(queries, 5)[0], loaded.search(queries, 5)[0]):
        np.testing.assert_array_equal(a, b)


def test_index_refuses_another_model_or_another_kb(tmp_path):
    matrix = clustered(30, 8)
    emb_dir, passages = write(tmp_path, matrix)
    built = scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode="brute_force"))
    built.check(MatrixEncoder(matrix), [p.id for p in passages])  # The matching pair passes.
    with pytest.raises(index.IndexMismatchError, match="model fingerprint 'matrix-v1'.*'hashed-bow-v2-dim8'"):
        built.check(HashedBagOfWordsEncoder(dim=8))
    with pytest.raises(index.IndexMismatchError, match="first difference at row 29"):
        built.check(passage_ids=[p.id for p in passages[:-1]] + ["other"])
    with pytest.raises(index.IndexMismatchError, match="30 indexed vs 29 in the KB"):
        built.check(passage_ids=[p.id for p in passages[:-1]])


def test_incomplete_embeddings_and_missing_index_are_clear_errors(tmp_path):
    emb_dir, _ = write(tmp_path, clustered(30, 8))
    manifest = embedding_store.read_manifest(emb_dir)
    (tmp_path / "emb" / manifest.shard_name(1)).unlink()
    with pytest.raises(embedding_store.EmbeddingsError, match="1 of 3 shards missing"):
        index.build_index(emb_dir)
    with pytest.raises(index.IndexMismatchError, match="not an index directory"):
        index.load_index(str(tmp_path))


def test_cli_builds_an_index_with_gin_overrides(tmp_path):
    emb_dir, _ = write(tmp_path, clustered(30, 8))
    out = tmp_path / "cli_idx"
    try:
        code = index_command.main(["--embeddings_dir", emb_dir, "--output_dir", str(out),
                           "--gin.ScannConfig.reorder_num_neighbors=50"])
    finally:
        gin.clear_config()
    assert code == 0
    meta = json.loads((out / "index.json").read_text())
    assert meta["scann"]["mode"] == "brute_force" and meta["scann"]["reorder_num_neighbors"] == 50, meta
    from t5_retrieval import cli
    assert cli.main(["index", "--embeddings_dir", str(tmp_path), "--output_dir", str(out)]) == 2, "no manifest -> exit 2"


def test_reordering_copy_dtype_trades_index_size_for_recall(tmp_path):
    """float32 > int8 > no reordering copy in bytes on disk; each keeps most of exact search's top 10."""
    matrix = clustered(6000, 32)
    emb_dir, _ = write(tmp_path, matrix)
    queries = clustered(50, 32, seed=2)
    expected = exact_top_k(matrix, queries, 10)
    sizes, recalls = {}, {}
    for dtype in ("float32", "int8", "none"):
        out = tmp_path / f"idx_{dtype}"
        try:  # The flags docs/retrieval.md gives for the 16 GB layout at full KILT.
            assert index_command.main(["--embeddings_dir", emb_dir, "--output_dir", str(out),
                               "--gin.ScannConfig.mode='tree_ah'", f"--gin.ScannConfig.reorder_dtype='{dtype}'",
                               "--gin.ScannConfig.dimensions_per_block=1"]) == 0
        finally:
            gin.clear_config()
        loaded = index.load_index(str(out))
        assert loaded.config.reorder_dtype == dtype and loaded.config.reorders == (dtype != "none")
        sizes[dtype] = sum(f.stat().st_size for f in (out / scann_index.SCANN_DIR).iterdir())
        rows, _ = loaded.search(queries, k=10)
        recalls[dtype] = np.mean([len(set(r.tolist()) & set(e.tolist())) / 10 for r, e in zip(rows, expected)])
    assert sizes["float32"] > sizes["int8"] > sizes["none"], sizes
    assert min(recalls.values()) >= 0.8, recalls
    with pytest.raises(ValueError, match="reorder_dtype must be one of float32, bfloat16, int8, none, got 'fp16'"):
        scann_index.ScannConfig(reorder_dtype="fp16").resolved(100)
