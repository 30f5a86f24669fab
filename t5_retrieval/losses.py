"""In-batch contrastive loss with hard negatives, one task at a time (and GDMTL's token loss).

Passages of a task's batch are laid out [pos_0, neg_0_1..neg_0_N, pos_1, ...]: query i's positive sits
at row i * (1 + N) and every other row (other queries' positives and all hard negatives) is a negative,
except the positives of other rows of the same question (a question trained once per gold page).
Called on the *global* (sharded) arrays inside the jitted step, the logits span every device's
passages, so in-batch negatives cross devices and the compiler places the all-gather; gradients are
exact with no local-slice or world-size corrections.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def positive_columns(num_queries: int, passages_per_query: int) -> jax.Array:
    """Column of each query's own positive in the [queries, passages] logit matrix."""
    return jnp.arange(num_queries, dtype=jnp.int32) * passages_per_query


def positive_rows(passages: jax.Array, num_queries: int) -> jax.Array:
    """[Q * (1 + N), ...] passage rows in the layout above -> [Q, ...]: each query's own positive."""
    return passages[::passages.shape[0] // num_queries]


def same_question_positives(query_groups: jax.Array, passages_per_query: int) -> jax.Array:
    """bool [Q, Q * (1 + N)]: True at the positive of every *other* row of the same question
    (`query_groups` [Q] numbers each row's question): a question trained once per gold page has one
    row per page, and each row's positive is a gold passage for the others too. The rows' hard
    negatives (mined for the question, outside its gold pages) stay negatives for all of them."""
    same = (query_groups[:, None] == query_groups[None, :]) & ~jnp.eye(query_groups.shape[0], dtype=bool)
    at_positive = jnp.zeros((*same.shape, passages_per_query), bool).at[:, :, 0].set(same)
    return at_positive.reshape(same.shape[0], -1)


def in_batch_softmax_loss(query_embeddings: jax.Array, passage_embeddings: jax.Array,
                          logit_scale: float = 1.0, query_groups: jax.typing.ArrayLike | None = None
                          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy of each query against all passages of the batch.

    Args:
      query_embeddings: [Q, D].
      passage_embeddings: [Q * (1 + N), D] in the layout above.
      logit_scale: multiplier on the dot products (1.0 = raw dot product, as in TACO).
      query_groups: optional int [Q], the question each row is; rows of one question leave each
        other's positives out of their softmax (`same_question_positives`).
    Returns:
      (loss, metrics) with metrics holding the in-batch top-1 accuracy.
    """
    num_queries = query_embeddings.shape[0]
    if passage_embeddings.shape[0] % num_queries:
        raise ValueError(f"passages ({passage_embeddings.shape[0]}) must be a multiple of queries ({num_queries})")
    passages_per_query = passage_embeddings.shape[0] // num_queries
    logits = jnp.einsum("qd,pd->qp", query_embeddings.astype(jnp.float32),
                        passage_embeddings.astype(jnp.float32)) * logit_scale
    if query_groups is not None:
        logits = jnp.where(same_question_positives(jnp.asarray(query_groups), passages_per_query), -jnp.inf, logits)
    labels = positive_columns(num_queries, passages_per_query)
    label_logits = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
    loss = jnp.mean(jax.nn.logsumexp(logits, axis=1) - label_logits)
    accuracy = jnp.mean((jnp.argmax(logits, axis=1) == labels).astype(jnp.float32))
    return loss, {"accuracy": accuracy}


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy over non-padding target tokens (id 0 = padding): [b, t, V], [b, t] -> []."""
    mask = (targets != 0).astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    per_token = jax.nn.logsumexp(logits, axis=-1) - target_logits
    return jnp.sum(per_token * mask) / jnp.maximum(jnp.sum(mask), 1.0)
