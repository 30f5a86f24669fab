import functools

import pytest

from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.tokenizers.query_inputs import MENTION_WINDOW, QueryInput


def test_spec_round_trips_through_its_record():
    spec = TaskSpec("demo_el", "entity_linking", "EL", 109, MENTION_WINDOW, ("m.lower",))
    assert TaskSpec.from_record(spec.name, spec.to_record()) == spec
    assert spec.query_input() == QueryInput("EL", 109, MENTION_WINDOW)
    bare = TaskSpec("fever", "fever", None)
    assert TaskSpec.from_record("fever", bare.to_record()) == bare
    with pytest.raises(ValueError, match="states no query length"):
        bare.query_input()
    assert bare.query_input(64) == QueryInput(None, 64)


def test_describe_reads_the_spec_not_the_preprocessors(tmp_path):
    import seqio

    from t5_retrieval.data.tasks import retrieval_tasks

    def lower(ds):
        return ds

    def upper(ds, output_features=None):
        return ds

    source = retrieval_tasks.kilt_examples_source("fever")
    task = retrieval_tasks.add_retrieval_task(
        "spec_test_fever", source, preprocessors=[lower, functools.partial(upper), seqio.CacheDatasetPlaceholder()],
        prefix="FEVER", query_len=40)
    spec = retrieval_tasks.describe(task)
    assert spec == TaskSpec("spec_test_fever", "fever", "FEVER", 40, "beginning",
                            (f"{__name__}.test_describe_reads_the_spec_not_the_preprocessors.<locals>.lower",
                             f"{__name__}.test_describe_reads_the_spec_not_the_preprocessors.<locals>.upper"))
    task._preprocessors = list(reversed(task.preprocessors))  # what describe() says is stated, not inferred
    assert retrieval_tasks.describe(task) == spec
    seqio.TaskRegistry.remove("spec_test_fever")
