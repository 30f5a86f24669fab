"""The recipe's inputs per task: the rows that name them warm WoW up on the negatives the zero-shot
model mined and train HotpotQA once per gold page; the rows recorded before keep their inputs."""

import gin
import pytest

import t5_retrieval.ance  # noqa: F401  (registers ance.*, which the recipe binds)
from t5_retrieval import gin_utils
from t5_retrieval.results.minilm_rows import RECIPE_EPISODES, zero_shot_negatives_dir
from t5_retrieval.results.rows import CONTROLS, ROWS, SEEDED

NEW = ("taco_recipe_frozen_wow_mined_both_pages", "naive_recipe_frozen_wow_mined_both_pages")
OLD = ("taco_recipe_frozen", "naive_recipe_frozen")


def _parsed(name: str, num_episodes: int) -> None:
    gin.clear_config()
    gin_utils.parse_gin(["models/minilm_l6.gin", "runs/no_adaptive.gin"],
                        ROWS[name][1].bindings("/data", "/work/minilm_zeroshot", 0, num_episodes))


def _value(parameter: str):
    try:
        return gin.query_parameter(parameter)
    except ValueError:  # not bound
        return None


@pytest.mark.parametrize("num_episodes", [RECIPE_EPISODES - 1, RECIPE_EPISODES])  # the shared stages, the row's own
def test_the_recipe_rows_warm_wow_up_on_zero_shot_mined_negatives_and_train_hotpotqa_on_each_gold_page(
        clean_gin, num_episodes):
    mined = zero_shot_negatives_dir("/work/minilm_zeroshot")  # where the MT-DPR confounders row mines them
    for name in NEW:
        _parsed(name, num_episodes)
        assert _value("warmup/make_train_iterator.task_negatives") == {"wow": mined}, name
        assert _value("episode/make_train_iterator.task_negatives") is None, f"{name}: episodes mine their own"
        assert _value("make_train_iterator.positive_passages") == {"hotpotqa": "each"}, name
    for name in OLD:
        _parsed(name, num_episodes)
        assert _value("warmup/make_train_iterator.task_negatives") is None, f"{name}'s records ran on BM25's"
        assert _value("make_train_iterator.positive_passages") is None, f"{name}'s records read the first gold page"


def test_the_recipe_rows_with_task_inputs_share_stages_with_each_other_only_and_are_seeded():
    new, old = (ROWS[n][1] for n in NEW), (ROWS[n][1] for n in OLD)
    assert len({r.shared_name for r in new}) == 1 and len({r.shared_name for r in old}) == 1
    assert ROWS[NEW[0]][1].shared_name != ROWS[OLD[0]][1].shared_name
    assert CONTROLS[NEW[0]] == NEW[1] and CONTROLS[NEW[1]] == OLD[1], "TACO against naive; naive against the old naive"
    assert set(NEW) <= set(SEEDED)
