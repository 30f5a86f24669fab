"""The helpers for adding your own retrieval Tasks (docs/tasks.md).

The project's own Tasks and Mixtures (`t5_retrieval/data/tasks/shipped.py`) are registered the first
time a name is looked up; importing this module registers them too, as a seqio Tasks module named by
`--gin.MIXTURE_OR_TASK_MODULE` is expected to."""

from t5_retrieval.data.tasks.retrieval_tasks import (  # the public helpers
    add_retrieval_task,
    add_temperature_mixture,
    kilt_examples_source,
    register_shipped,
    run_vocabulary,
)

register_shipped()

__all__ = ["add_retrieval_task", "add_temperature_mixture", "kilt_examples_source", "run_vocabulary"]
