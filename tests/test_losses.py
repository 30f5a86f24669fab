"""The in-batch softmax loss: label layout and value against a direct NumPy computation."""

import jax
import jax.numpy as jnp
import numpy as np

from t5_retrieval.losses import in_batch_softmax_loss, positive_columns, positive_rows


def test_loss_labels_point_at_own_positive():
    # 3 queries, 2 hard negatives each: rows [p0 n n p1 n n p2 n n]
    np.testing.assert_array_equal(positive_columns(3, 3), [0, 3, 6])


def test_positive_rows_are_the_rows_the_labels_point_at():
    tokens = jnp.arange(9 * 2).reshape(9, 2)  # 3 queries x (1 positive + 2 negatives), 2 tokens each
    np.testing.assert_array_equal(positive_rows(tokens, 3), tokens[positive_columns(3, 3)])
    np.testing.assert_array_equal(positive_rows(tokens, 3)[:, 0], [0, 6, 12])


def test_loss_is_cross_entropy_over_the_whole_task_batch():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(4, 8)).astype(np.float32)
    p = rng.normal(size=(12, 8)).astype(np.float32)  # 4 queries x (1 pos + 2 negs)
    loss, metrics = in_batch_softmax_loss(jnp.asarray(q), jnp.asarray(p), logit_scale=2.0)
    logits = 2.0 * q @ p.T
    top = logits.max(1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits - top).sum(1, keepdims=True)) - top
    expected = -np.mean([log_probs[i, 3 * i] for i in range(4)])
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), np.mean(logits.argmax(1) == np.arange(4) * 3))


def test_loss_is_minimised_when_each_query_matches_only_its_positive():
    q = jnp.eye(3) * 10
    p = jnp.zeros((6, 3)).at[0::2].set(jnp.eye(3) * 10)  # positives align, negatives are zero vectors
    loss, metrics = in_batch_softmax_loss(q, p)
    assert float(loss) < 1e-6 and float(metrics["accuracy"]) == 1.0


def test_passages_must_be_a_multiple_of_queries():
    try:
        in_batch_softmax_loss(jnp.ones((3, 2)), jnp.ones((7, 2)))
    except ValueError as e:
        assert "multiple of queries" in str(e)
    else:
        raise AssertionError("expected a ValueError for 7 passages and 3 queries")


def test_gradient_reaches_negatives_of_other_queries():
    q = jnp.ones((2, 4))
    p = jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    grad = jax.grad(lambda p: in_batch_softmax_loss(q, p)[0])(p)
    assert np.all(np.abs(np.asarray(grad)).sum(1) > 0), "every passage row (incl. other queries' negatives) gets gradient"


def test_rows_of_one_question_leave_each_others_positive_out_of_their_softmax():
    """A question trained once per gold page has a row per page; with `query_groups` each row's softmax
    is the NumPy cross-entropy over the batch without the other rows' positives of its question (and
    keeps their hard negatives); the masked positives get no gradient from those rows."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, 8)).astype(np.float32)
    p = rng.normal(size=(12, 8)).astype(np.float32)  # 4 rows x (1 pos + 2 negs)
    groups = np.array([7, 3, 7, 5], np.int32)  # rows 0 and 2: one question, two gold pages
    loss, metrics = in_batch_softmax_loss(jnp.asarray(q), jnp.asarray(p), 2.0, jnp.asarray(groups))
    logits = 2.0 * q @ p.T
    left_out = {0: [6], 2: [0]}  # row 0 loses row 2's positive (column 6), row 2 loses row 0's
    per_row = []
    for i in range(4):
        keep = [c for c in range(12) if c not in left_out.get(i, [])]
        per_row.append(np.log(np.exp(logits[i, keep]).sum()) - logits[i, 3 * i])
    np.testing.assert_allclose(float(loss), np.mean(per_row), rtol=1e-5)
    unmasked, _ = in_batch_softmax_loss(jnp.asarray(q), jnp.asarray(p), 2.0)
    assert float(loss) < float(unmasked), "leaving a negative out lowers the loss"
    only_row_0 = jnp.asarray(q).at[1:].set(0.0)  # rows 1-3 score every passage 0: no gradient from them

    def grad_of_row_2s_positive(groups):
        return np.asarray(jax.grad(lambda p: in_batch_softmax_loss(only_row_0, p, 2.0, groups)[0])(jnp.asarray(p))[6])

    assert np.all(grad_of_row_2s_positive(jnp.asarray(groups)) == 0), "row 0 must not push its question's other page away"
    assert np.any(grad_of_row_2s_positive(None) != 0), "without groups it is an ordinary in-batch negative"
    np.testing.assert_allclose(float(metrics["accuracy"]),
                               np.mean([np.argmax(np.where(np.isin(np.arange(12), left_out.get(i, [])), -np.inf,
                                                           logits[i])) == 3 * i for i in range(4)]))


def test_the_training_step_passes_each_rows_question_to_the_loss():
    """Both ways the step computes task losses (the summed loss and the per-task scan) read the
    sub-batch's "query_groups": their loss is the masked loss of the same embeddings."""
    import flax.linen as nn

    from t5_retrieval.data.batching.random_batches import RandomBatches
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config
    from t5_retrieval.train_step import per_task_gradients, summed_gradient, task_loss_fn

    model = DualEncoder(T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                                 num_decoder_layers=1, dropout_rate=0.0))
    sub = next(RandomBatches(per_device_batch=4, local_data_devices=1, task_names=["a"], vocab_size=64,
                             query_len=6, passage_len=8, num_negatives=1))["a"]
    params = nn.unbox(model.init(jax.random.PRNGKey(0), sub["query_tokens"])["params"])
    passages = model.apply({"params": params}, sub["passage_tokens"])
    groups = jnp.asarray([4, 9, 4, 2], jnp.int32)
    batch = {"a": {"query_tokens": sub["query_tokens"], "task_ids": sub["task_ids"], "passage_embeddings": passages,
                   "query_groups": groups}}
    queries = model.apply({"params": params}, sub["query_tokens"])
    masked, _ = in_batch_softmax_loss(queries, passages, 1.0, groups)
    unmasked, _ = in_batch_softmax_loss(queries, passages, 1.0)
    assert abs(float(masked) - float(unmasked)) > 1e-4
    rng = jax.random.PRNGKey(1)
    summed = jax.jit(lambda w, b: summed_gradient(model, 1.0, w, b, ["a"], rng))(params, batch)[1]
    per_task = jax.jit(lambda w, b: per_task_gradients(task_loss_fn(model, 1.0), w, b, ["a"], rng))(params, batch)[1]
    np.testing.assert_allclose(np.asarray(summed), [float(masked)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(per_task), [float(masked)], rtol=1e-5)
