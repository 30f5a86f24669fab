"""GDMTL: query generation from the positive passage as a second objective on the same T5."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from t5_retrieval import multitask
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.losses import token_cross_entropy
from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.train_step import TrainState, make_train_step, retrieval_and_generation_gradients, summed_gradient

CFG = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
               num_decoder_layers=1, dropout_rate=0.0, tie_word_embeddings=False)
TASKS = ["a", "b"]


def _setup():
    model = DualEncoder(CFG, DualEncoderConfig(query_generation=True))
    data = RandomBatches(per_device_batch=5, local_data_devices=1, task_names=TASKS, vocab_size=64,
                         query_len=6, passage_len=10, num_negatives=2)
    batch = next(data)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"])
    return model, batch, params


def _numpy_generation_loss(model, params, batch) -> float:
    """Token cross-entropy of each query given its positive, from the plain teacher-forced T5 call."""
    total = 0.0
    for name in TASKS:
        queries = np.asarray(batch[name]["query_tokens"])
        passages = np.asarray(batch[name]["passage_tokens"])
        positives = passages[::passages.shape[0] // queries.shape[0]]
        decoder_inputs = np.concatenate([np.zeros_like(queries[:, :1]), queries[:, :-1]], axis=1)
        logits = np.asarray(model.apply({"params": params}, positives, decoder_inputs,
                                        method=lambda m, p, d: m.t5(p, d)), np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = np.take_along_axis(log_probs, queries[..., None], axis=-1)[..., 0]
        mask = queries != 0
        total += -(picked * mask).sum() / mask.sum()
    return total


def test_query_generation_model_has_an_lm_head():
    _, _, params = _setup()
    assert "lm_head" in params["t5"], sorted(params["t5"])


def test_gdmtl_gradients_are_the_retrieval_gradient_and_the_generation_loss_gradient():
    model, batch, params = _setup()
    rng = jax.random.PRNGKey(1)
    grads, losses, metrics = jax.jit(
        lambda p: retrieval_and_generation_gradients(model, 1.0, p, batch, TASKS, rng))(params)
    # Jitted, as training runs them (op-by-op they take a minute on CPU).
    retrieval_grad, retrieval_losses, _ = jax.jit(lambda p: summed_gradient(model, 1.0, p, batch, TASKS, rng))(params)
    np.testing.assert_allclose(float(losses[0]), float(jnp.sum(retrieval_losses)), rtol=1e-5)
    np.testing.assert_allclose(float(losses[1]), _numpy_generation_loss(model, params, batch), rtol=1e-4,
                               err_msg="generation loss != token CE of the teacher-forced query given its positive")
    assert {"generation_loss/a", "generation_loss/b", "retrieval_loss"} <= set(metrics)

    expected_generation_grad = jax.jit(jax.grad(lambda p: _generation_loss(model, p, batch)))(params)
    for path_g, g_ret, g_gen in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(retrieval_grad),
                                    jax.tree.leaves(expected_generation_grad)):
        path, g = path_g
        assert g.shape[0] == 2, f"{jax.tree_util.keystr(path)}: expected a leading objective axis of 2"
        np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g_ret), rtol=1e-4, atol=1e-6,
                                   err_msg=f"{jax.tree_util.keystr(path)}: objective 0 must be the retrieval gradient")
        np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g_gen), rtol=1e-4, atol=1e-6,
                                   err_msg=f"{jax.tree_util.keystr(path)}: objective 1 must be the generation gradient")
    lm_head = np.asarray(grads["t5"]["lm_head"]["kernel"])
    assert np.abs(lm_head[0]).max() == 0 and np.abs(lm_head[1]).max() > 0, "only generation reaches the LM head"


def _generation_loss(model, params, batch):
    """The generation objective written out with the model's own helper (for its gradient)."""
    total = 0.0
    for name in TASKS:
        queries = batch[name]["query_tokens"]
        positives = batch[name]["passage_tokens"][::batch[name]["passage_tokens"].shape[0] // queries.shape[0]]
        logits = model.apply({"params": params}, positives, queries, method=model.query_generation_logits)
        total += token_cross_entropy(logits, queries)
    return total


def test_gdmtl_training_learns_both_objectives_and_the_uncertainty_weights():
    model, batch, params = _setup()
    optimizer = optax.chain(multitask.uncertainty_weighting(num_tasks=2, total_steps=1, learning_rate=0.05), optax.adam(3e-3))
    step = jax.jit(make_train_step(model, optimizer, TASKS, per_task=True,
                                   extra_metrics=multitask.multitask_metrics))
    state = TrainState.create(params, optimizer.init(params), jax.random.PRNGKey(2))
    history = []
    for _ in range(30):
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    first, last = history[0], history[-1]
    assert last["generation_loss"] < 0.8 * first["generation_loss"], (first["generation_loss"], last["generation_loss"])
    assert last["retrieval_loss"] < first["retrieval_loss"], (first["retrieval_loss"], last["retrieval_loss"])
    assert last["uncertainty/sigma/0"] != 1.0 and last["uncertainty/sigma/1"] != 1.0, "sigmas must be learned"


def test_gdmtl_without_a_two_objective_transform_is_refused():
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="query_generation"):
        make_train_step(model, optax.adam(1e-3), TASKS, per_task=False)
