"""Training over stored passage embeddings (`make_train_iterator.passage_embeddings`): the passage
side is the base model's frozen KB embeddings, only queries are encoded and trained, and the result
is a query-side model that searches the base's index."""

import os

import flax.linen as nn
import gin
import jax
import numpy as np
import pytest
from tiny_model import TASKS, _bindings, build_tiny_run

from t5_retrieval import gin_utils
from t5_retrieval.data import layout
from t5_retrieval.data.batching.batches import make_train_iterator, passage_table
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.data.records import DataError
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.inference import QuerySideEncoder, load_encoder
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.retrieval.index import load_index
from t5_retrieval.stages import index_and_evaluate
from t5_retrieval.train import train
from t5_retrieval.train_step import per_task_gradients, summed_gradient, task_loss_fn

STEP_TASKS = ["a", "b"]


def _with_embedded_passages(model, params, batch):
    """The batch with each sub-batch's passages replaced by the model's embeddings of them."""
    return {t: {"query_tokens": sub["query_tokens"], "task_ids": sub["task_ids"],
                "passage_embeddings": model.apply({"params": params}, sub["passage_tokens"])}
            for t, sub in batch.items()}


@pytest.mark.parametrize("per_task", [False, True])
def test_stored_passage_embeddings_give_the_stop_gradient_loss_and_gradient(per_task):
    model = DualEncoder(T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                                 num_decoder_layers=1, dropout_rate=0.0))
    batch = next(RandomBatches(per_device_batch=4, local_data_devices=1, task_names=STEP_TASKS, vocab_size=64,
                               query_len=6, passage_len=8, num_negatives=1))
    params = nn.unbox(model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"])
    stored = _with_embedded_passages(model, params, batch)
    rng = jax.random.PRNGKey(1)
    # Jitted as in training (and because op-by-op dispatch of a backward pass takes a minute on CPU).
    if per_task:
        expected = jax.jit(lambda w, b: per_task_gradients(task_loss_fn(model, 1.0, stop_passage_gradient=True), w,
                                                           b, STEP_TASKS, rng))(params, batch)
        got = jax.jit(lambda w, b: per_task_gradients(task_loss_fn(model, 1.0), w, b, STEP_TASKS, rng))(params, stored)
    else:
        expected = jax.jit(lambda w, b: summed_gradient(model, 1.0, w, b, STEP_TASKS, rng,
                                                        stop_passage_gradient=True))(params, batch)
        got = jax.jit(lambda w, b: summed_gradient(model, 1.0, w, b, STEP_TASKS, rng))(params, stored)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), rtol=1e-5, err_msg="task losses")
    # Equal in exact arithmetic; the two graphs are fused differently, so float32 rounding in the
    # backward pass differs by up to a few 1e-5 relative.
    for g, e in zip(jax.tree.leaves(got[0]), jax.tree.leaves(expected[0])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6)
    assert sum(float(np.abs(np.asarray(g)).sum()) for g in jax.tree.leaves(got[0])) > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("frozen"))
    return root, build_tiny_run(root, models=((0, ()), (1, ())))


def _gin(run, extra: list[str]) -> None:
    gin.clear_config()
    gin_utils.parse_gin(["models/t5_tiny.gin", "runs/base.gin"], [*_bindings(run.data_dir, run.vocabulary), *extra])


def test_the_iterator_hands_out_the_stored_embeddings_of_the_passages_it_would_tokenize(tiny, clean_gin):
    root, run = tiny
    _gin(run, [])
    with_tokens = next(make_train_iterator(per_device_batch=4))
    with_stored = next(make_train_iterator(per_device_batch=4, passage_embeddings=os.path.join(root, "emb_0")))
    encoder = run.encoders[0]
    for task, sub in with_tokens.items():
        assert "passage_tokens" not in with_stored[task]
        np.testing.assert_array_equal(with_stored[task]["query_tokens"], sub["query_tokens"])
        np.testing.assert_allclose(with_stored[task]["passage_embeddings"], encoder.encode_tokens(sub["passage_tokens"]),
                                   rtol=1e-5, atol=1e-6, err_msg=f"{task}: rows must follow the passages' store order")


def test_embeddings_of_another_kb_are_refused_naming_the_directory(tiny, tmp_path):
    root, run = tiny
    store = PassageStore.open(layout.kb_dir(run.data_dir))
    partial = str(tmp_path / "partial")
    ids = store.ids()[:5]
    embedding_store.write_embeddings(run.encoders[0], [store.get(p) for p in ids], ids, partial, progress=False)
    with pytest.raises(DataError, match="partial.*not those of the KB"):
        passage_table(partial, store)


def test_training_over_stored_passages_gives_a_query_side_model_of_the_base(tiny, clean_gin):
    root, run = tiny
    base_dir, other_dir, emb_dir = run.model_dirs[0], run.model_dirs[1], os.path.join(root, "emb_0")
    bindings = ["TRAIN_STEPS = 3", "LEARNING_RATE = 1e-2", "train.log_every = 1", "train.per_device_batch = 4",
                f"make_train_iterator.passage_embeddings = '{emb_dir}'"]

    _gin(run, [*bindings, f"train.init_from = '{other_dir}'"])
    with pytest.raises(ValueError, match="fingerprint"):
        train(os.path.join(root, "mismatched"))

    model_dir = os.path.join(root, "trained")
    _gin(run, [*bindings, f"train.init_from = '{base_dir}'"])
    train(model_dir)
    gin.clear_config()
    trained = load_encoder(model_dir)
    assert isinstance(trained, QuerySideEncoder)
    store = PassageStore.open(layout.kb_dir(run.data_dir))
    load_index(run.index_dirs[0]).check(trained, store.ids())  # the base's index accepts it
    with pytest.raises(Exception, match="fingerprint"):
        load_index(run.index_dirs[1]).check(trained, store.ids())
    passages = [store.get(pid) for pid in store.ids()[:4]]
    np.testing.assert_array_equal(trained.encode_passages(passages), run.encoders[0].encode_passages(passages))
    queries = ["who wrote it", "is it true"]
    task = f"demo_{TASKS[0]}"
    assert not np.allclose(trained.encode_queries(queries, task), run.encoders[0].encode_queries(queries, task),
                           atol=1e-4), "training must change the query encoder"

    stage_dir = os.path.join(root, "scored")
    index_and_evaluate(stage_dir, model_dir, run.data_dir, index_dir=run.index_dirs[0])
    assert sorted(os.listdir(stage_dir)) == ["eval"], "nothing is encoded when the base's index is given"
    assert os.path.exists(os.path.join(stage_dir, "eval", "results.json"))


def test_fusion_experts_read_the_stored_embeddings_behind_their_index(tiny, tmp_path):
    from t5_retrieval.fusion.experts import (
        ExpertSpec,
        PassageVectors,
        StoredPassageVectors,
        load_expert,
        passage_vectors,
    )

    root, run = tiny
    store = PassageStore.open(layout.kb_dir(run.data_dir))
    expert = load_expert(ExpertSpec("trex", run.model_dirs[0], run.index_dirs[0]), store.ids())
    stored = passage_vectors(expert, store)
    assert isinstance(stored, StoredPassageVectors), "the index records the embeddings it was built from"
    ids = store.ids()[3:9]
    np.testing.assert_allclose(stored.get(ids), PassageVectors(expert.encoder, store).get(ids), rtol=1e-5, atol=1e-6)

    moved = load_index(run.index_dirs[0])
    moved.embeddings_dir = str(tmp_path / "gone")
    expert.index = moved
    assert isinstance(passage_vectors(expert, store), PassageVectors), "without them, the encoder embeds on demand"
