"""Numerical faults: a step with a non-finite loss or gradient changes nothing but the counters,
and a streak of them stops the run with a clear error.

A batch is poisoned by a token id outside the vocabulary: `jnp.take` fills out-of-range rows
with NaN, so the loss and every gradient become NaN as they would after a real overflow.
"""

import json
import os

import jax
import numpy as np
import pytest

from t5_retrieval import checkpoint, gin_utils, multitask
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.optim import make_optimizer
from t5_retrieval.train import NonFiniteError, train
from t5_retrieval.train_step import TrainState, make_train_step

VOCAB = 64
CFG = T5Config(vocab_size=VOCAB, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
               num_decoder_layers=1, dropout_rate=0.0)
TASKS = ["a", "b"]


def poison(batch: dict) -> dict:
    """The same batch with one query token out of the vocabulary (NaN embedding)."""
    batch = {t: dict(b) for t, b in batch.items()}
    first = next(iter(batch))
    tokens = batch[first]["query_tokens"].copy()
    tokens[0, 0] = VOCAB
    batch[first]["query_tokens"] = tokens
    return batch


def assert_trees_equal(a, b, what: str) -> None:
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                      err_msg=f"{what} changed at {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("per_task", [False, True], ids=["naive_sum", "taco"])
def test_nonfinite_step_leaves_params_and_optimizer_state_unchanged(per_task):
    model = DualEncoder(CFG)
    data = RandomBatches(per_device_batch=4, local_data_devices=1, task_names=TASKS, vocab_size=VOCAB,
                         query_len=6, passage_len=10, num_negatives=1)
    batches = [next(data) for _ in range(3)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["a"]["query_tokens"])["params"]
    optimizer = make_optimizer(total_steps=10, num_tasks=len(TASKS), learning_rate=1e-2,
                               multitask=multitask.taco if per_task else None)
    state = TrainState.create(params, optimizer.init(params), jax.random.PRNGKey(1))
    step = jax.jit(make_train_step(model, optimizer, TASKS, per_task=per_task, max_nonfinite_in_a_row=3))

    state, metrics = step(state, batches[0])
    assert int(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"])), "a clean batch must train"
    before = jax.device_get(state)
    state, metrics = step(state, poison(batches[1]))
    assert not np.isfinite(float(metrics["loss"])), "the poisoned batch should give a non-finite loss"
    assert_trees_equal(before.params, state.params, "params after a non-finite step")
    assert_trees_equal(before.opt_state, state.opt_state, "optimiser state after a non-finite step")
    assert (int(state.step), int(state.skipped_steps), int(state.nonfinite_in_a_row)) == (2, 1, 1), (
        "expected step 2 with 1 skipped step and a streak of 1, got "
        f"{(int(state.step), int(state.skipped_steps), int(state.nonfinite_in_a_row))}")
    assert int(metrics["skipped"]) == 1 and int(metrics["skipped_steps"]) == 1

    state, metrics = step(state, batches[2])
    assert int(metrics["skipped"]) == 0 and int(state.nonfinite_in_a_row) == 0, "a finite step ends the streak"
    assert int(state.skipped_steps) == 1, "the total of skipped steps is kept"
    changed = any(not np.array_equal(np.asarray(x), np.asarray(y))
                  for x, y in zip(jax.tree.leaves(before.params), jax.tree.leaves(state.params)))
    assert changed, "training must continue after a skipped step"
    for (path, x) in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        assert np.all(np.isfinite(np.asarray(x))), f"non-finite parameter at {jax.tree_util.keystr(path)}"


class PoisonedFrom(RandomBatches):
    """RandomBatches whose batches from step `POISON_FROM` on are poisoned."""

    POISON_FROM = 4

    def __next__(self) -> dict:
        poisoned = self.step >= self.POISON_FROM
        batch = super().__next__()
        return poison(batch) if poisoned else batch


def test_a_streak_of_nonfinite_steps_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, clean_gin):
    gin_utils.parse_gin(["models/t5_tiny.gin"], [
        f"VOCAB_SIZE = {VOCAB}", "D_MODEL = 16", "D_FF = 32", "NUM_LAYERS = 1", "NUM_HEADS = 2", "D_KV = 8",
        "DROPOUT = 0.0", "RandomBatches.vocab_size = 64", "RandomBatches.num_negatives = 1",
        "train.per_device_batch = 4", "train.log_every = 2", "train.checkpoint_every = 2",
        "train.num_steps = 20", "train.max_nonfinite_in_a_row = 3"])
    model_dir = str(tmp_path / "model")
    with pytest.raises(NonFiniteError, match=r"3 consecutive training steps had a non-finite loss.*"
                                             r"max_nonfinite_in_a_row = 3.*latest checkpoint is step 6"):
        train(model_dir, batches=PoisonedFrom)
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [2, 4, 6], f"expected logs at steps 2, 4, 6 before stopping: {rows}"
    assert rows[-1]["skipped_steps"] == 2 and rows[-1]["nonfinite_in_a_row"] == 2, rows[-1]
    # Steps 5 and 6 were skipped, 7 hit the limit and froze the state; step 8 noticed it and did not save.
    assert list(checkpoint.manager(model_dir).all_steps()) == [2, 4, 6], "no checkpoint may hold a frozen state"
