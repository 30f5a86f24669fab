"""Query towers for both model families: one separate query encoder for all tasks (DPR's two towers)
takes the queries, passages the main encoder, and both gradient paths of the train step agree; a
Hugging Face init gives every query tower the pretrained weights."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.losses import in_batch_softmax_loss
from t5_retrieval.models.bert import BertConfig
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder, BertDualEncoderConfig
from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.train_step import per_task_gradients, summed_gradient, task_loss_fn

TASKS = ["a", "b"]
MODELS = {
    "t5": lambda: DualEncoder(T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                                       num_decoder_layers=1, dropout_rate=0.0),
                              DualEncoderConfig(separate_query_encoder=True)),
    "bert": lambda: BertDualEncoder(BertConfig(vocab_size=64, hidden_size=16, num_heads=2, intermediate_size=32,
                                               num_layers=1, max_position_embeddings=16, dropout_rate=0.0),
                                    BertDualEncoderConfig(separate_query_encoder=True)),
}


def _grad_norm(tree) -> float:
    return sum(float(np.abs(np.asarray(x)).sum()) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("family", sorted(MODELS))
def test_queries_train_the_query_encoder_and_passages_the_main_one(family):
    model = MODELS[family]()
    main, query = ("t5", "query_t5_0") if family == "t5" else ("bert", "query_bert_0")
    data = RandomBatches(per_device_batch=4, local_data_devices=1, task_names=TASKS, vocab_size=64,
                         query_len=6, passage_len=8, num_negatives=1)
    batch = next(data)
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    assert set(params) == {main, query}, f"expected one main and one query encoder, got {sorted(params)}"
    tokens = batch["a"]["query_tokens"]
    q = model.apply({"params": params}, tokens, tower=0)
    p = model.apply({"params": params}, tokens)
    assert not np.allclose(np.asarray(q), np.asarray(p)), "the query encoder must have its own weights"

    rng = jax.random.PRNGKey(1)
    stacked, _, _ = jax.jit(lambda w: per_task_gradients(task_loss_fn(model, 1.0), w, batch, TASKS, rng))(params)
    summed, _, _ = jax.jit(lambda w: summed_gradient(model, 1.0, w, batch, TASKS, rng))(params)
    for k in range(len(TASKS)):
        task_grad = jax.tree.map(lambda g, k=k: g[k], stacked[query])
        assert _grad_norm(task_grad) > 0, f"task {k} must train the query encoder"
    for g_k, g in zip(jax.tree.leaves(stacked), jax.tree.leaves(summed)):
        np.testing.assert_allclose(np.asarray(g_k).sum(0), np.asarray(g), rtol=1e-4, atol=1e-6,
                                   err_msg="summed path must route queries through the query encoder too")


@pytest.mark.parametrize("family", ["t5", "bert"])
def test_hf_init_gives_every_query_tower_the_pretrained_weights(family, tmp_path):
    import json

    from t5_retrieval.models.build import initial_params

    if family == "t5":
        from test_t5_hf_numerics import save_random_hf_t5

        from t5_retrieval.models.hf_import import t5_config_from_hf
        save_random_hf_t5(str(tmp_path), "v1_1")
        with open(tmp_path / "config.json") as f:
            model = DualEncoder(t5_config_from_hf(json.load(f)), DualEncoderConfig(query_towers=2))
    else:
        from test_bert_hf_numerics import save_random_hf_bert

        from t5_retrieval.models.hf_bert_import import bert_config_from_hf, read_hf_config
        save_random_hf_bert(str(tmp_path))
        model = BertDualEncoder(bert_config_from_hf(read_hf_config(str(tmp_path))),
                                BertDualEncoderConfig(query_towers=2))
    like = nn.unbox(model.init(jax.random.PRNGKey(0), np.ones((1, 4), np.int32))["params"])
    params = initial_params(str(tmp_path), like, {family: dataclasses.asdict(getattr(model, f"{family}_config"))})
    for tower in (f"query_{family}_0", f"query_{family}_1"):
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params[family])[0],
                                jax.tree.leaves(params[tower])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                          err_msg=f"{tower}{jax.tree_util.keystr(path)} must start from the HF weights")
    changed = [not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(like[family]), jax.tree.leaves(params[family]))]
    assert all(changed), "every parameter of the main encoder must come from the checkpoint"


@pytest.mark.parametrize("per_task", [False, True])
def test_stop_passage_gradient_leaves_the_passage_encoder_untrained(per_task):
    """The thesis' stop-gradient loss: with two towers, only the query tower gets a gradient; with
    one shared encoder, the gradient is the one through the query embeddings alone."""
    model = MODELS["t5"]()
    data = RandomBatches(per_device_batch=4, local_data_devices=1, task_names=TASKS, vocab_size=64,
                         query_len=6, passage_len=8, num_negatives=1)
    batch = next(data)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"])
    rng = jax.random.PRNGKey(1)
    # Jitted as in training (op-by-op dispatch of a backward pass takes a minute on CPU).
    if per_task:
        grads, _, _ = jax.jit(lambda w: per_task_gradients(task_loss_fn(model, 1.0, stop_passage_gradient=True), w,
                                                           batch, TASKS, rng))(params)
    else:
        grads, _, _ = jax.jit(lambda w: summed_gradient(model, 1.0, w, batch, TASKS, rng,
                                                        stop_passage_gradient=True))(params)
    assert _grad_norm(grads["t5"]) == 0, "no gradient may reach the passage encoder"
    assert _grad_norm(grads["query_t5_0"]) > 0, "the query encoder must still learn"

    shared = DualEncoder(model.t5_config, DualEncoderConfig())
    shared_params = nn.unbox(shared.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"])
    full, _, _ = jax.jit(lambda w: summed_gradient(shared, 1.0, w, batch, TASKS, rng))(shared_params)
    stopped, _, _ = jax.jit(lambda w: summed_gradient(shared, 1.0, w, batch, TASKS, rng,
                                                      stop_passage_gradient=True))(shared_params)

    def query_side_loss(w):  # passages embedded with the current weights, held constant
        passage_emb = {t: jax.lax.stop_gradient(shared.apply({"params": shared_params}, batch[t]["passage_tokens"]))
                       for t in TASKS}
        return sum(in_batch_softmax_loss(shared.apply({"params": w}, batch[t]["query_tokens"]), passage_emb[t], 1.0)[0]
                   for t in TASKS)

    expected = jax.jit(jax.grad(query_side_loss))(shared_params)
    for g, e in zip(jax.tree.leaves(stopped), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-6,
                                   err_msg="stop-gradient must keep only the query path's gradient")
    assert any(not np.allclose(np.asarray(a), np.asarray(b), atol=1e-6)
               for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(stopped))), "the passage path must be cut"
