"""`t5r ance`: BM25-negative warm-up, then ANCE episodes of (mine -> train -> index -> evaluate).

The recipe: warm up on BM25 negatives; then each episode mines new hard negatives with the
current model (top-k minus gold), trains from the current weights with a fresh optimiser (so a
fresh multi-task state, in the episodes the config gives a multi-task transform), re-encodes the
KB (unless the passage tower does not train: `passage_index`), and evaluates. Every stage writes
into its own directory under `work_dir` and is marked finished by a `DONE` file written last, so a
rerun skips finished stages; an interrupted training stage resumes from its last checkpoint and an
interrupted encoding from its last shard.

    work_dir/warmup/{model,embeddings,index,eval}
    work_dir/episode_1/{negatives,model,embeddings,index,eval} ...

Gin scopes `warmup/` and `episode/` configure the two kinds of training (learning rate, length,
mixture), e.g. `warmup/make_optimizer.learning_rate = 1e-5`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import gin
import optax

from t5_retrieval.errors import ConfigError
from t5_retrieval.stages import index_and_evaluate, mine_stage, stage
from t5_retrieval.train import portable_bindings, train

log = logging.getLogger(__name__)


@gin.configurable(denylist=["work_dir"])
def ance(work_dir: str,
         data_dir: str = gin.REQUIRED,
         num_episodes: int = 1,
         multitask_episodes: Sequence[int] = (),
         episode_multitask: Callable[..., optax.GradientTransformation] | None = None,
         mine_depth: int = 110,
         answer_checkable: Sequence[str] = (),
         eval_split: str = "dev",
         passage_index: str | None = None) -> dict[str, dict[str, float]]:
    """Runs (or resumes) warm-up and `num_episodes` ANCE episodes; returns the last eval table.

    Args:
      data_dir: prepared data (kb/, examples/, negatives/bm25/) used by every stage.
      multitask_episodes: 1-based episodes that train with `episode_multitask` (a multi-task
        transform factory, `@multitask.<name>`, as runs/demo.gin binds it); the others sum the
        task losses. The reference recipe uses it in the last episode.
      mine_depth: passages retrieved per training query when mining (top-110 minus gold).
      answer_checkable: datasets whose mined negatives also drop answer-holding passages (MT-DPR's
        adversarial confounders; only where an answer string means relevance, e.g. QA).
      passage_index: the index every stage mines and evaluates with when the passage tower does not
        train (query-side fine-tuning over stored passage embeddings, `make_train_iterator.
        passage_embeddings`): its passages are then the same in every episode, so nothing is
        re-encoded. None: each stage encodes the KB with its own model and builds its own index.
    """
    if num_episodes < 0:
        raise ConfigError(f"ance.num_episodes must be >= 0, got {num_episodes}")
    if mine_depth < 1:
        raise ConfigError(f"ance.mine_depth must be >= 1, got {mine_depth}")
    outside = [e for e in multitask_episodes if not 1 <= e <= num_episodes]
    if outside:
        raise ConfigError(f"ance.multitask_episodes: {outside} not among the episodes 1..{num_episodes}")
    stages = ["warmup"] + [f"episode_{e}" for e in range(1, num_episodes + 1)]
    for number, name in enumerate(stages):
        stage_dir = os.path.join(work_dir, name)
        model_dir = os.path.join(stage_dir, "model")
        if number == 0:
            with gin.config_scope("warmup"):
                stage(model_dir, "warm-up training", functools.partial(_train, model_dir))
        else:
            previous = os.path.join(work_dir, stages[number - 1])
            negatives = os.path.join(stage_dir, "negatives")
            mine_stage(negatives, os.path.join(previous, "model"), passage_index or os.path.join(previous, "index"),
                       data_dir, mine_depth, answer_checkable)
            multitask = episode_multitask if number in multitask_episodes else None
            with gin.config_scope("episode"):
                stage(model_dir, f"episode {number} training",
                      functools.partial(_train, model_dir, init_from=os.path.join(previous, "model"),
                                        multitask=multitask, data_overrides={"negatives": negatives}))
        index_and_evaluate(stage_dir, model_dir, data_dir, eval_split, index_dir=passage_index)
    with open(os.path.join(work_dir, stages[-1], "eval", "results.json")) as f:
        return json.load(f)


def _train(model_dir: str, **kwargs: Any) -> dict[str, Any]:
    portable_bindings()  # config.gin records its paths absolute, as `t5r train` does
    state = train(model_dir, **kwargs)
    return {"steps": int(state.step)}
