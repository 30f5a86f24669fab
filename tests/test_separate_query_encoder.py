"""One separate query encoder for all tasks (DPR's two towers), for both model families: queries go
through it, passages through the main encoder, and both gradient paths of the train step agree."""

import jax
import numpy as np
import pytest

from t5_retrieval.data.random_batches import RandomBatches
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
        assert _grad_norm(jax.tree.map(lambda g, k=k: g[k], stacked[query])) > 0, f"task {k} must train the query encoder"
    for g_k, g in zip(jax.tree.leaves(stacked), jax.tree.leaves(summed)):
        np.testing.assert_allclose(np.asarray(g_k).sum(0), np.asarray(g), rtol=1e-4, atol=1e-6,
                                   err_msg="summed path must route queries through the query encoder too")
