"""`RetrievalTask`: the seqio Task `add_retrieval_task` registers, carrying its `TaskSpec`.

Its own module because it subclasses `seqio.Task`: importing it imports seqio (and TensorFlow),
which only building or reading a registered Task needs.
"""

from __future__ import annotations

from typing import Any

import seqio

from t5_retrieval.data.tasks.task_spec import TaskSpec


class RetrievalTask(seqio.Task):
    """A seqio Task whose name, dataset, query prefix, length, truncation and text preprocessors are
    its `spec`, stated when it is registered rather than recovered from its preprocessors."""

    def __init__(self, name: str, *args: Any, spec: TaskSpec, **kwargs: Any) -> None:
        if spec.name != name:
            raise ValueError(f"seqio Task {name!r} registered with the spec of task {spec.name!r}")
        super().__init__(name, *args, **kwargs)
        self.spec = spec
