"""A model's tasks answer to their registered name and to their dataset, with one error for both."""

import pytest

from t5_retrieval.data import task_names
from t5_retrieval.data.task_names import UnknownTaskError

TASKS = {"demo_fever": {"dataset": "fever", "prefix": "fever", "index": 0},
         "demo_nq": {"dataset": "nq", "prefix": "nq", "index": 1}}


def test_registered_name_and_dataset_both_resolve_to_the_registered_name():
    assert task_names.resolve(TASKS, "demo_fever") == "demo_fever"
    assert task_names.resolve(TASKS, "fever") == "demo_fever"
    assert task_names.dataset_of(TASKS, "demo_nq") == task_names.dataset_of(TASKS, "nq") == "nq"
    assert task_names.datasets(TASKS) == ["fever", "nq"]


def test_unknown_name_lists_both_forms_of_every_task():
    with pytest.raises(UnknownTaskError) as caught:
        task_names.resolve(TASKS, "wow")
    assert str(caught.value) == ("unknown task 'wow'; this model was trained on: "
                                 "demo_fever (dataset fever), demo_nq (dataset nq)"), str(caught.value)
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)


def test_a_dataset_read_by_two_tasks_is_ambiguous():
    tasks = {**TASKS, "demo_fever_noprefix": {"dataset": "fever", "prefix": None}}
    with pytest.raises(UnknownTaskError, match=r"ambiguous.*\['demo_fever', 'demo_fever_noprefix'\]"):
        task_names.resolve(tasks, "fever")
    assert task_names.resolve(tasks, "demo_fever_noprefix") == "demo_fever_noprefix"
