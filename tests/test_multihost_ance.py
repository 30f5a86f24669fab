"""Multi-process ANCE for real: `t5r ance` as two processes on 127.0.0.1 joined by `jax.distributed`
(gloo CPU collectives, 1 forced CPU device each), started through `launch/run.py`.

Both processes train (each its data shard) and encode the KB (each its range of embedding shards);
process 0 alone builds the index, mines and evaluates while process 1 waits. What the job writes
for every stage equals what one process computes from the same trained models: the embeddings, the
mined negatives and the eval tables.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
from process_harness import job_flags, run_processes
from test_ance import TASKS, ance_data

SHARD_SIZE = 16  # the KB's passages -> at least 4 shards, half of them per process


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost_ance")
    data_dir, vocabulary = ance_data(str(root))
    bindings = [
        f"DATA_DIR='{data_dir}'", f"VOCABULARY='{vocabulary}'", "MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']",
        "WARMUP_MIXTURE=['demo_fever_noprefix', 'demo_trex_noprefix']", "VOCAB_SIZE=512", "D_MODEL=32",
        "D_FF=64", "PER_DEVICE_BATCH=4", "QUERY_LEN=24", "PASSAGE_LEN=48", "warmup/train.num_epochs=None",
        "warmup/train.num_steps=4", "episode/train.num_epochs=None", "episode/train.num_steps=4",
        "train.log_every=1", "ance.mine_depth=12", f"encode_settings.shard_size={SHARD_SIZE}",
    ]
    work_dir, log_dir = str(root / "work"), str(root / "logs")
    os.makedirs(log_dir)
    command = ["ance", "--work_dir", work_dir, "--gin_file=runs/demo.gin", *[f"--gin.{b}" for b in bindings]]
    logs = run_processes(command, job_flags(2), devices_per_process=1, log_dir=log_dir)
    return dict(log_dir=log_dir, data_dir=data_dir, work_dir=work_dir, logs=logs, command=command)


def test_both_processes_encode_their_own_shards_of_the_kb(job):
    from t5_retrieval.data.stores import embedding_store

    for stage in ("warmup", "episode_1"):
        emb_dir = os.path.join(job["work_dir"], stage, "embeddings")
        manifest = embedding_store.check_complete(emb_dir)
        assert manifest.shard_size == SHARD_SIZE and manifest.num_shards >= 4, manifest
        assert os.path.exists(os.path.join(emb_dir, "DONE")), f"{emb_dir}: not marked done"
    for i, log in enumerate(job["logs"]):
        mine = [manifest.shard_name(s) for s in embedding_store.process_shards(manifest.num_shards, i, 2)]
        written = re.findall(rf"process {i}: wrote (shard-\d+-of-\d+\.npy)", log)
        assert written == mine * 2, f"process {i} should write {mine} in each of 2 stages, wrote {written}"


def test_only_process_0_indexes_mines_and_evaluates(job):
    zero, one = job["logs"]
    for name in ("index", "evaluate", "mine"):
        assert f"{name} ..." in zero, f"process 0 should run stage {name!r}:\n{zero[-2000:]}"
        assert f"{name} ..." not in one and f"{name}: process 0 runs it; waiting" in one, \
            f"process 1 should wait while process 0 runs {name!r}:\n{one[-2000:]}"
    tables = [re.findall(r"\n(\S+\s+\d+\s+[0-9.]+.*)", log) for log in job["logs"]]
    assert tables[0] and tables[0] == tables[1], "both processes should print the last stage's eval table"


def test_every_stage_equals_one_process_computing_it_from_the_same_models(job, tmp_path):
    """Re-runs encode, index, mine and eval in this one process from the job's trained models."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_negatives
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.stages import index_and_evaluate, mine_stage

    work_dir, data_dir = job["work_dir"], job["data_dir"]
    for stage in ("warmup", "episode_1"):
        model_dir = os.path.join(work_dir, stage, "model")
        single = str(tmp_path / stage)
        index_and_evaluate(single, model_dir, data_dir)
        np.testing.assert_allclose(embedding_store.load_matrix(os.path.join(work_dir, stage, "embeddings")),
                                   embedding_store.load_matrix(os.path.join(single, "embeddings")), rtol=0, atol=1e-6,
                                   err_msg=f"{stage}: two processes' embeddings differ from one process's")
        with open(os.path.join(work_dir, stage, "eval", "results.json")) as f:
            multi_tables = json.load(f)
        with open(os.path.join(single, "eval", "results.json")) as f:
            assert json.load(f) == multi_tables, f"{stage}: eval tables differ from one process's"
    negatives = str(tmp_path / "negatives")
    warmup = os.path.join(work_dir, "warmup")
    mine_stage(negatives, os.path.join(warmup, "model"), os.path.join(warmup, "index"), data_dir, depth=12)
    for dataset in TASKS:
        expected = read_negatives(layout.negatives_path(negatives, dataset))
        got = read_negatives(layout.negatives_path(os.path.join(work_dir, "episode_1", "negatives"), dataset))
        assert got == expected, f"{dataset}: process 0's mined negatives differ from one process's"


def test_a_rerun_on_both_processes_runs_only_the_stage_that_is_missing(job):
    from t5_retrieval.stages import is_done

    work_dir = job["work_dir"]
    stages = [os.path.join(work_dir, s) for s in
              ("warmup/model", "warmup/embeddings", "warmup/index", "warmup/eval", "episode_1/negatives",
               "episode_1/model", "episode_1/embeddings", "episode_1/index", "episode_1/eval")]
    assert all(is_done(s) for s in stages), [s for s in stages if not is_done(s)]
    results = os.path.join(work_dir, "episode_1", "eval", "results.json")
    with open(results) as f:
        before = json.load(f)
    shutil.rmtree(os.path.dirname(results))
    zero, one = run_processes(job["command"], job_flags(2), devices_per_process=1, log_dir=job["log_dir"])
    for log in (zero, one):
        assert log.count("already done") == len(stages) - 1, f"every other stage should be skipped:\n{log[-2000:]}"
    assert "evaluate ..." in zero and "evaluate: process 0 runs it; waiting" in one
    with open(results) as f:
        assert json.load(f) == before, "the re-run evaluation differs from the first"
