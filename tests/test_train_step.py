"""The two gradient paths of the train step agree: per-task (stacked) gradients sum to the naive one,
and grouping tasks into one `lax.scan` changes the program size, not the gradients."""

import functools

import jax
import numpy as np
import pytest

from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.train_step import per_task_gradients, query_shape_groups, summed_gradient, task_groups, task_loss_fn

CFG = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
               num_decoder_layers=1, dropout_rate=0.0)
TASKS = ["a", "b", "c"]


def test_per_task_gradients_sum_to_the_gradient_of_the_summed_loss():
    model = DualEncoder(CFG)
    data = RandomBatches(per_device_batch=7, local_data_devices=1, task_names=TASKS, vocab_size=64,
                         query_len=6, passage_len=10, num_negatives=2)
    batch = next(data)
    assert [batch[t]["query_tokens"].shape[0] for t in TASKS] == [3, 2, 2], "uneven sub-batches on purpose"
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    rng = jax.random.PRNGKey(1)
    stacked, losses, _ = jax.jit(lambda p: per_task_gradients(task_loss_fn(model, 1.0), p, batch, TASKS, rng))(params)
    summed, summed_losses, metrics = jax.jit(lambda p: summed_gradient(model, 1.0, p, batch, TASKS, rng))(params)
    np.testing.assert_allclose(np.asarray(losses), np.asarray(summed_losses), rtol=1e-5,
                               err_msg="per-task losses differ between the two paths")
    assert set(metrics) >= {"loss/a", "accuracy/c"}
    for (path, g_k), g in zip(jax.tree_util.tree_flatten_with_path(stacked)[0], jax.tree.leaves(summed)):
        assert g_k.shape == (3, *g.shape), f"{jax.tree_util.keystr(path)}: expected a leading task axis of 3"
        np.testing.assert_allclose(np.asarray(g_k).sum(0), np.asarray(g), rtol=1e-4, atol=1e-6,
                                   err_msg=f"{jax.tree_util.keystr(path)}: sum of task gradients != naive gradient")


def test_task_specific_query_towers_get_gradient_only_from_their_task():
    from t5_retrieval.models.dual_encoder import DualEncoderConfig

    model = DualEncoder(CFG, DualEncoderConfig(query_towers=3))
    data = RandomBatches(per_device_batch=6, local_data_devices=1, task_names=TASKS, vocab_size=64,
                         query_len=6, passage_len=10, num_negatives=1)
    batch = next(data)
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    assert {"t5", "query_t5_0", "query_t5_1", "query_t5_2"} <= set(params), sorted(params)
    rng = jax.random.PRNGKey(1)
    stacked, _, _ = jax.jit(lambda p: per_task_gradients(task_loss_fn(model, 1.0), p, batch, TASKS, rng))(params)
    summed, _, _ = jax.jit(lambda p: summed_gradient(model, 1.0, p, batch, TASKS, rng))(params)
    for k in range(3):
        for j in range(3):
            norm = sum(float(np.abs(np.asarray(x[j])).sum()) for x in jax.tree.leaves(stacked[f"query_t5_{k}"]))
            assert (norm > 0) == (j == k), f"task {j}'s loss should reach query tower {k} only if j == k"
    for g_k, g in zip(jax.tree.leaves(stacked), jax.tree.leaves(summed)):
        np.testing.assert_allclose(np.asarray(g_k).sum(0), np.asarray(g), rtol=1e-4, atol=1e-6)


def _tiny_batch(tasks, per_device_batch):
    data = RandomBatches(per_device_batch=per_device_batch, local_data_devices=1, task_names=tasks, vocab_size=64,
                         query_len=6, passage_len=10, num_negatives=1)
    return next(data)


def test_task_groups_join_tasks_with_equal_sub_batches_and_towers():
    from t5_retrieval.models.dual_encoder import DualEncoderConfig

    uneven = _tiny_batch(["a", "b", "c", "d"], 7)  # sizes 2, 2, 2, 1
    assert task_groups(DualEncoder(CFG), uneven, ["a", "b", "c", "d"]) == [[0, 1, 2], [3]]
    towers = DualEncoder(CFG, DualEncoderConfig(query_towers=4))
    assert task_groups(towers, uneven, ["a", "b", "c", "d"]) == [[0], [1], [2], [3]], "own towers: no sharing"


def test_grouping_tasks_gives_the_same_gradients_losses_and_metrics_in_task_order():
    model = DualEncoder(CFG)
    batch = _tiny_batch(TASKS, 6)
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    rng = jax.random.PRNGKey(1)
    loss_fn = task_loss_fn(model, 1.0)
    alone = jax.jit(lambda p: per_task_gradients(loss_fn, p, batch, TASKS, rng))(params)
    # One scan over all tasks (what task_groups gives here), and an out-of-order grouping.
    for groups in ([[0, 1, 2]], [[2, 0], [1]]):
        grouped = jax.jit(functools.partial(per_task_gradients, loss_fn, batch=batch, task_names=TASKS, rng=rng,
                                            groups=groups))(params)
        np.testing.assert_allclose(np.asarray(grouped[1]), np.asarray(alone[1]), rtol=1e-6, err_msg=str(groups))
        assert set(grouped[2]) == set(alone[2])
        for key in alone[2]:
            np.testing.assert_allclose(np.asarray(grouped[2][key]), np.asarray(alone[2][key]), rtol=1e-6,
                                       err_msg=f"{groups}: metric {key}")
        for g, a in zip(jax.tree.leaves(grouped[0]), jax.tree.leaves(alone[0])):
            np.testing.assert_allclose(np.asarray(g), np.asarray(a), rtol=1e-5, atol=1e-7, err_msg=str(groups))


def test_one_group_compiles_one_backward_pass_whatever_the_number_of_tasks():
    model = DualEncoder(CFG)
    loss_fn = task_loss_fn(model, 1.0)

    def matmuls(num_tasks: int, grouped: bool) -> int:
        names = [f"t{k}" for k in range(num_tasks)]
        batch = _tiny_batch(names, 2 * num_tasks)
        params = model.init(jax.random.PRNGKey(0), batch["t0"]["query_tokens"])["params"]
        groups = task_groups(model, batch, names) if grouped else None
        step = jax.jit(lambda p: per_task_gradients(loss_fn, p, batch, names, jax.random.PRNGKey(1), groups))
        return step.lower(params).as_text().count("dot_general")

    assert matmuls(6, grouped=True) == matmuls(2, grouped=True)
    assert matmuls(6, grouped=False) == 3 * matmuls(2, grouped=False), "the count should see each task's copy"


def test_groups_must_cover_every_task_once():
    model = DualEncoder(CFG)
    batch = _tiny_batch(TASKS, 6)
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    with pytest.raises(ValueError, match="each of the 3 task indices once"):
        per_task_gradients(task_loss_fn(model, 1.0), params, batch, TASKS, jax.random.PRNGKey(1), [[0, 1], [1]])


def _with_query_width(batch, task: str, width: int):
    """`batch` with `task`'s queries padded with 0 to `width` tokens (padding is masked)."""
    queries = batch[task]["query_tokens"]
    padded = np.zeros((queries.shape[0], width), queries.dtype)
    padded[:, :queries.shape[1]] = queries
    return {**batch, task: {**batch[task], "query_tokens": padded}}


def test_tasks_at_their_own_query_lengths_train_as_if_every_query_had_one_length():
    model = DualEncoder(CFG)
    batch = _tiny_batch(TASKS, 6)  # every task's queries are 6 tokens
    own_lengths = _with_query_width(_with_query_width(batch, "a", 9), "c", 12)  # 9, 6, 12
    one_length = {t: _with_query_width(batch, t, 12)[t] for t in TASKS}
    assert query_shape_groups(own_lengths, TASKS) == [["a"], ["b"], ["c"]]
    assert query_shape_groups(one_length, TASKS) == [TASKS], "one model call for the queries of one length"
    params = model.init(jax.random.PRNGKey(0), batch["a"]["query_tokens"])["params"]
    rng = jax.random.PRNGKey(1)
    loss_fn = task_loss_fn(model, 1.0)
    for name, step in (("naive", lambda p, b: summed_gradient(model, 1.0, p, b, TASKS, rng)),
                       ("per-task", lambda p, b: per_task_gradients(loss_fn, p, b, TASKS, rng))):
        want, got = jax.jit(step)(params, one_length), jax.jit(step)(params, own_lengths)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5,
                                   err_msg=f"{name}: task losses depend on how far queries are padded")
        for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}: gradients depend on how far queries are padded")
    assert task_groups(model, own_lengths, TASKS) == [[0], [1], [2]], "one scan body per query shape"


def test_gathering_the_parameters_once_is_refused_for_the_naive_step():
    """Only per-task steps gather each layer's weights once per task pass; the naive step's one pass
    has nothing to save, so `train.gather_params_once` without a multi-task transform is a mistake."""
    import optax

    from t5_retrieval.errors import ConfigError
    from t5_retrieval.train_step import GatheredPasses, make_train_step

    with pytest.raises(ConfigError, match="per-task steps"):
        make_train_step(DualEncoder(CFG), optax.sgd(1.0), ["a", "b"], per_task=False,
                        gathered_passes=GatheredPasses({}, lambda p: p))
