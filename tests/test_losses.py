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
