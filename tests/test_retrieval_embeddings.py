"""Embedding shards: layout, multi-process split, resume without recomputation, refusal of mixing."""

import json
import os

import numpy as np
import pytest

from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.retrieval.encoder import Encoder, HashedBagOfWordsEncoder


def make_passages(n: int) -> list[Passage]:
    words = ["alpha", "beta", "gamma", "delta", "river", "mountain", "city", "song", "war", "king"]
    return [Passage(f"p{i}", f"page{i // 2}", f"Title {i // 2}", " ".join(words[(i * j) % 10] for j in range(1, 8)))
            for i in range(n)]


class CountingEncoder:
    """Wraps a real encoder and records how many passages it was asked to embed."""

    def __init__(self, inner: Encoder):
        self.inner = inner
        self.encoded = 0

    fingerprint = property(lambda self: self.inner.fingerprint)
    dim = property(lambda self: self.inner.dim)

    def encode_queries(self, texts, task):
        return self.inner.encode_queries(texts, task)

    def encode_passages(self, passages):
        self.encoded += len(passages)
        return self.inner.encode_passages(passages)


def test_hashed_encoder_implements_the_protocol_deterministically():
    enc = HashedBagOfWordsEncoder(dim=32)
    assert isinstance(enc, Encoder)
    a = enc.encode_passages(make_passages(3))
    b = HashedBagOfWordsEncoder(dim=32).encode_passages(make_passages(3))
    np.testing.assert_array_equal(a, b, err_msg="hashing must not depend on the process")
    assert a.dtype == np.float32 and a.shape == (3, 32)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, rtol=1e-5)


def test_shards_and_manifest_hold_every_passage_in_order(tmp_path):
    passages = make_passages(23)
    enc = HashedBagOfWordsEncoder(dim=16)
    report = embedding_store.write_embeddings(enc, passages, [p.id for p in passages], str(tmp_path),
                                         shard_size=5, batch_size=3, progress=False)
    assert report.complete and report.shards_written == (0, 1, 2, 3, 4)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["num_shards"] == 5 and manifest["dim"] == 16 and manifest["fingerprint"] == enc.fingerprint
    assert embedding_store.read_ids(str(tmp_path)) == [p.id for p in passages]
    assert "shard-00004-of-00005.npy" in os.listdir(tmp_path)
    np.testing.assert_allclose(embedding_store.load_matrix(str(tmp_path)), enc.encode_passages(passages), rtol=1e-6)


def test_processes_write_disjoint_contiguous_shard_ranges_covering_all():
    for num_shards, count in [(10, 3), (2, 4), (7, 7)]:
        ranges = [embedding_store.process_shards(num_shards, p, count) for p in range(count)]
        flat = [s for r in ranges for s in r]
        assert flat == list(range(num_shards)), f"{num_shards} shards over {count} processes: {ranges}"


def test_two_processes_together_complete_the_embeddings(tmp_path):
    passages = make_passages(17)
    ids = [p.id for p in passages]
    enc = HashedBagOfWordsEncoder(dim=8)
    first = embedding_store.write_embeddings(enc, passages, ids, str(tmp_path), shard_size=4, process_index=0,
                                        process_count=2, progress=False)
    assert not first.complete, "process 0 alone must leave process 1's shards missing"
    with pytest.raises(embedding_store.EmbeddingsError, match="shards missing"):
        embedding_store.load_matrix(str(tmp_path))
    second = embedding_store.write_embeddings(enc, passages, ids, str(tmp_path), shard_size=4, process_index=1,
                                         process_count=2, progress=False)
    assert set(first.shards_written) | set(second.shards_written) == set(range(5)) and second.complete
    np.testing.assert_allclose(embedding_store.load_matrix(str(tmp_path)), enc.encode_passages(passages), rtol=1e-6)


def test_resume_recomputes_only_missing_shards(tmp_path):
    passages = make_passages(20)
    ids = [p.id for p in passages]
    enc = CountingEncoder(HashedBagOfWordsEncoder(dim=8))
    embedding_store.write_embeddings(enc, passages, ids, str(tmp_path), shard_size=6, progress=False)
    manifest = embedding_store.read_manifest(str(tmp_path))
    os.remove(tmp_path / manifest.shard_name(1))  # As if interrupted while writing shard 1.
    enc.encoded = 0
    report = embedding_store.write_embeddings(enc, passages, ids, str(tmp_path), shard_size=6, progress=False)
    assert report.shards_written == (1,) and report.shards_skipped == (0, 2, 3)
    assert enc.encoded == 6, f"expected only shard 1's 6 passages re-encoded, got {enc.encoded}"
    assert report.complete


def test_existing_run_with_another_model_or_kb_is_refused(tmp_path):
    passages = make_passages(6)
    ids = [p.id for p in passages]
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages, ids, str(tmp_path), shard_size=4,
                                progress=False)
    with pytest.raises(embedding_store.EmbeddingsError, match="field 'fingerprint'"):
        embedding_store.write_embeddings(_OtherModel(), passages, ids,
                                    str(tmp_path), shard_size=4, progress=False)
    with pytest.raises(embedding_store.EmbeddingsError, match="field 'ids_sha256'"):
        embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages[::-1], ids[::-1], str(tmp_path),
                                    shard_size=4, progress=False)


class _OtherModel(HashedBagOfWordsEncoder):
    def __init__(self):
        super().__init__(dim=8)

    @property
    def fingerprint(self) -> str:
        return "another-model"


def test_kb_rows_that_disagree_with_the_ids_list_are_reported(tmp_path):
    passages = make_passages(4)
    ids = ["p0", "p1", "pX", "p3"]
    with pytest.raises(embedding_store.EmbeddingsError, match="KB row 2: passage id 'p2'"):
        embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages, ids, str(tmp_path), progress=False)


def test_float16_shards_load_as_float32(tmp_path):
    passages = make_passages(5)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages, [p.id for p in passages], str(tmp_path),
                                dtype="float16", progress=False)
    matrix = embedding_store.load_matrix(str(tmp_path))
    assert matrix.dtype == np.float32
    np.testing.assert_allclose(matrix, HashedBagOfWordsEncoder(dim=8).encode_passages(passages), atol=1e-3)


def test_a_truncated_shard_is_reported_as_truncated_not_missing(tmp_path):
    passages = make_passages(10)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=16), passages, [p.id for p in passages],
                                     str(tmp_path), shard_size=5, progress=False)
    shard = tmp_path / "shard-00001-of-00002.npy"
    shard.write_bytes(shard.read_bytes()[:-40])
    with pytest.raises(embedding_store.EmbeddingsError, match=r"shard-00001-of-00002.npy: truncated"):
        embedding_store.load_matrix(str(tmp_path))
    shard.unlink()
    with pytest.raises(embedding_store.EmbeddingsError, match=r"1 of 2 shards missing \(shard-00001-of-00002.npy\)"):
        embedding_store.load_matrix(str(tmp_path))
