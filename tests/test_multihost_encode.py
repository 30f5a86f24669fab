"""Multi-host KB encoding for real: `t5r encode` as two processes on 127.0.0.1 joined by
`jax.distributed` (gloo CPU collectives, 1 forced CPU device each), started through `launch/run.py`
like every launch. Each process writes its own contiguous range of shards; together they equal a
single-process encode, the manifest is complete and indexable, and a rerun after losing one of
process 1's shards recomputes that shard only.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from process_harness import job_flags, run_processes
from tiny_model import build_tiny_run

SHARD_SIZE = 7  # the tiny KB's 80 passages -> 12 shards, the last one partial


def shards_written(log: str, process: int) -> list[int]:
    """Shard numbers that `write_embeddings` logged as written by `process`, in order."""
    return [int(n) for n in re.findall(rf"process {process}: wrote shard-(\d+)-of-\d+\.npy", log)]


def shard_files(directory: str) -> dict[str, tuple[int, int]]:
    """(inode, mtime ns) of every shard file: a rewritten shard gets a new inode (temp file + rename)."""
    return {name: (os.stat(os.path.join(directory, name)).st_ino, os.stat(os.path.join(directory, name)).st_mtime_ns)
            for name in os.listdir(directory) if name.startswith("shard-")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from t5_retrieval.data import layout
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import PassageStore

    root = tmp_path_factory.mktemp("multihost_encode")
    tiny = build_tiny_run(str(root))  # a model dir, its KB and a single-process encode of that KB
    kb_dir, emb_dir, log_dir = layout.kb_dir(tiny.data_dir), str(root / "emb_two_processes"), str(root / "logs")
    os.makedirs(log_dir)
    command = ["encode", "--checkpoint_dir", tiny.model_dirs[0], "--kb_dir", kb_dir, "--output_dir", emb_dir,
               "--no_progress", f"--gin.encode_settings.shard_size={SHARD_SIZE}"]
    first = run_processes(command, job_flags(2), devices_per_process=1, log_dir=log_dir)
    first_matrix = embedding_store.load_matrix(emb_dir)
    manifest = embedding_store.read_manifest(emb_dir)
    lost = embedding_store.process_shards(manifest.num_shards, 1, 2)[1]  # not process 1's first: rows before it are skipped
    before = shard_files(emb_dir)
    os.remove(os.path.join(emb_dir, manifest.shard_name(lost)))
    resumed = run_processes(command, job_flags(2), devices_per_process=1, log_dir=log_dir)
    return dict(tiny=tiny, store=PassageStore.open(kb_dir), emb_dir=emb_dir, reference_dir=os.path.join(root, "emb_0"),
                first=first, first_matrix=first_matrix, manifest=manifest, lost=lost, before=before, resumed=resumed,
                index_dir=str(root / "index_two_processes"))


def test_each_process_writes_only_its_own_contiguous_range_of_shards(runs):
    from t5_retrieval.data.stores import embedding_store

    num_shards = runs["manifest"].num_shards
    assert num_shards == -(-len(runs["store"].ids()) // SHARD_SIZE) and num_shards >= 4, runs["manifest"]
    for i, log in enumerate(runs["first"]):
        mine = list(embedding_store.process_shards(num_shards, i, 2))
        assert f"t5r encode: process {i}/2: wrote {len(mine)} shards" in log, \
            f"process {i} should know itself as {i} of 2 from jax.distributed and write {len(mine)} shards:\n{log[-2000:]}"
        assert shards_written(log, i) == mine, \
            f"process {i} should write exactly shards {mine}, wrote {shards_written(log, i)}:\n{log[-2000:]}"
        assert not shards_written(log, 1 - i), f"process {i}'s log reports the other process's shards"


def test_two_process_embeddings_equal_a_single_process_encode(runs):
    from t5_retrieval.data.stores import embedding_store

    reference = embedding_store.load_matrix(runs["reference_dir"])
    assert embedding_store.read_ids(runs["emb_dir"]) == embedding_store.read_ids(runs["reference_dir"]) == runs["store"].ids()
    np.testing.assert_allclose(runs["first_matrix"], reference, rtol=0, atol=1e-5,
                               err_msg="2 processes x 1 device vs 1 process: embeddings differ")


def test_manifest_is_complete_and_the_index_builder_accepts_it(runs):
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.retrieval import index, scann_index

    manifest = embedding_store.check_complete(runs["emb_dir"])
    reference = embedding_store.read_manifest(runs["reference_dir"])
    assert (manifest.num_passages, manifest.shard_size, manifest.fingerprint, manifest.dim, manifest.ids_sha256) == \
        (len(runs["store"].ids()), SHARD_SIZE, reference.fingerprint, reference.dim, reference.ids_sha256), manifest
    assert any("; complete:" in log for log in runs["first"]), "the process that finished last should report complete"
    scann_index.build_scann_index(runs["emb_dir"], scann_index.ScannConfig(mode="brute_force")).save(runs["index_dir"])
    built = index.load_index(runs["index_dir"])
    built.check(runs["tiny"].encoders[0], runs["store"].ids())  # same model fingerprint, same KB rows
    matrix = embedding_store.load_matrix(runs["emb_dir"])
    queries = matrix[::9]
    rows, scores = built.search(queries, k=3)
    exact = queries @ matrix.T
    for q, (r, s) in enumerate(zip(rows, scores)):
        np.testing.assert_allclose(s, np.sort(exact[q])[::-1][:3], rtol=1e-5, atol=1e-5,
                                   err_msg=f"query {q}: the exact index's top-3 scores differ from numpy's")
        np.testing.assert_allclose(exact[q, r], s, rtol=1e-5, atol=1e-5)


def test_rerun_after_losing_one_shard_of_process_1_recomputes_only_that_shard(runs):
    from t5_retrieval.data.stores import embedding_store

    manifest, lost = runs["manifest"], runs["lost"]
    zero, one = runs["resumed"]
    assert "t5r encode: process 0/2: wrote 0 shards" in zero and not shards_written(zero, 0), zero[-2000:]
    assert shards_written(one, 1) == [lost], f"process 1 should rewrite only shard {lost}:\n{one[-2000:]}"
    after = shard_files(runs["emb_dir"])
    assert sorted(after) == sorted(runs["before"]), "the rerun should leave the same set of shard files"
    for name, stat in runs["before"].items():
        if name.startswith(manifest.shard_name(lost)):  # the shard and its checksum record
            assert after[name] != stat
        else:
            assert after[name] == stat, f"{name} was rewritten, but only {manifest.shard_name(lost)} was missing"
    np.testing.assert_allclose(embedding_store.load_matrix(runs["emb_dir"]), runs["first_matrix"], rtol=0, atol=1e-5,
                               err_msg="the recomputed shard differs from the first run's")
