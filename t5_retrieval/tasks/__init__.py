"""The registered retrieval Tasks and Mixtures (importing this registers them) and the helpers for
adding your own (docs/data.md, "Your own Tasks")."""

from t5_retrieval.data.tasks.retrieval_tasks import (  # the public helpers
    add_retrieval_task,
    add_temperature_mixture,
    kilt_examples_source,
    run_vocabulary,
)
from t5_retrieval.tasks import demo, kilt, mini_kilt  # noqa: F401  (registration side effects)

__all__ = ["add_retrieval_task", "add_temperature_mixture", "kilt_examples_source", "run_vocabulary"]
