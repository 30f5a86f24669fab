import dataclasses
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


def test_an_old_model_directory_still_loads_and_resolves(tmp_path):
    """A config written before tasks recorded their lengths, truncation and preprocessors."""
    import json
    import shutil

    from t5_retrieval.data.tasks.task_names import TaskSet
    from t5_retrieval.data.tasks.task_spec import upgrade_records

    old = {"query_len": 64, "tasks": {"kilt_fever": {"dataset": "fever", "prefix": "FEVER", "index": 0},
                                      "kilt_wow": {"dataset": "wow", "prefix": "WOW", "index": 1}}}
    assert upgrade_records(old)["kilt_fever"] == {"dataset": "fever", "prefix": "FEVER", "index": 0,
                                                 "query_len": 64, "truncation": "beginning"}
    tasks = TaskSet.from_features(old)
    assert tasks.resolve("fever") == "kilt_fever" and tasks.dataset_of("kilt_wow") == "wow"
    assert tasks.query_input("wow") == QueryInput("WOW", 64)

    from tests.tiny_model import build_tiny_run  # a real directory, its config rewritten to the old form

    run = build_tiny_run(str(tmp_path / "run"))
    model_dir = str(tmp_path / "old_model")
    shutil.copytree(run.model_dirs[0], model_dir)
    path = tmp_path / "old_model" / "model_config.json"
    config = json.loads(path.read_text())
    config["features"]["tasks"] = {name: {k: v for k, v in record.items() if k in ("dataset", "prefix", "index")}
                                   for name, record in config["features"]["tasks"].items()}
    path.write_text(json.dumps(config))
    import os

    from t5_retrieval import cli
    from t5_retrieval.inference import load_encoder

    (step,) = [name for name in os.listdir(model_dir) if name.isdigit()]
    assert cli.main(["checksum", "--accept", os.path.join(model_dir, step)]) == 0  # as an older version's

    encoder = load_encoder(model_dir)
    assert encoder.tasks.resolve("fever") == "demo_fever"
    assert encoder.tasks.query_input("fever").length == config["features"]["query_len"]
    assert encoder.encode_queries(["who wrote it"], "fever").shape == (1, encoder.dim)


def test_the_mixture_lookup_is_given_not_found_in_sys_modules():
    from t5_retrieval.data.tasks.task_names import TaskSet

    asked = []

    def mixtures(name):
        asked.append(name)
        return ["a_fever"] if name == "only_fever" else None

    tasks = TaskSet([TaskSpec("a_fever", "fever", None), TaskSpec("a_nq", "nq", None)], mixtures)
    assert tasks.resolve("only_fever") == "a_fever" and tasks.resolve("nq") == "a_nq"
    assert asked == ["only_fever"], "a task or dataset of the model asks no registry"
    with pytest.raises(KeyError, match="unknown task 'wow'"):
        tasks.resolve("wow")


@pytest.mark.parametrize("record", [
    {"index": 1},                                                     # version 1, the first runs
    {"dataset": "wow", "prefix": "WOW", "index": 1},                  # version 1
    {"dataset": "wow", "prefix": "WOW", "index": 1, "query_len": 64, "truncation": "beginning"},  # version 2
], ids=["v1-bare", "v1", "v2"])
def test_a_record_of_every_version_upgrades_to_what_training_writes_now(record):
    from t5_retrieval.data.tasks.task_spec import TASK_RECORD_VERSION, record_version, upgrade_records

    upgraded = upgrade_records({"query_len": 64, "tasks": {"kilt_wow": record}})["kilt_wow"]
    dataset, prefix = ("wow", "WOW") if "dataset" in record else ("kilt_wow", None)
    assert upgraded == {**TaskSpec("kilt_wow", dataset, prefix, 64).to_record(), "index": 1}
    assert record_version(upgraded) == TASK_RECORD_VERSION
    assert upgrade_records({"query_len": 32, "tasks": {"kilt_wow": upgraded}})["kilt_wow"] == upgraded, \
        "a current record keeps its own length, not the model's"


def test_a_task_registered_from_its_spec_carries_it_with_its_text_preprocessors():
    import seqio

    from t5_retrieval.data.tasks import retrieval_tasks

    def lower(ds):
        return ds

    spec = TaskSpec("spec_test_el", "entity_linking", "EL", 109, MENTION_WINDOW)
    source = retrieval_tasks.kilt_examples_source("entity_linking")
    try:
        task = retrieval_tasks.register_retrieval_task(spec, source, preprocessors=[lower])
        assert retrieval_tasks.describe(task) == TaskSpec(
            "spec_test_el", "entity_linking", "EL", 109, MENTION_WINDOW,
            (f"{__name__}.test_a_task_registered_from_its_spec_carries_it_with_its_text_preprocessors.<locals>.lower",))
        with pytest.raises(ValueError, match="its spec names text preprocessors"):
            retrieval_tasks.register_retrieval_task(
                TaskSpec("spec_test_el", "entity_linking", "EL", 109, text_preprocessors=("m.other",)), source,
                preprocessors=[lower])
        with pytest.raises(ValueError, match="states no query length"):
            retrieval_tasks.register_retrieval_task(TaskSpec("spec_test_el", "entity_linking", "EL"), source)
    finally:
        seqio.TaskRegistry.remove("spec_test_el")


def test_a_family_row_makes_each_variants_spec():
    from t5_retrieval.data.tasks.shipped import Dataset, dataset_task

    row = Dataset(dataset_task("aidayago2", "AIDA", 128, MENTION_WINDOW), "EL", 10, 5)
    assert not set(Dataset._fields) & {f.name for f in dataclasses.fields(TaskSpec)}, \
        "a registration row holds its Tasks' TaskSpec, not copies of its fields"
    assert row.spec("kilt", "") == TaskSpec("kilt_aidayago2", "aidayago2", "AIDA", 128, MENTION_WINDOW)
    assert row.spec("kilt", "_noprefix") == TaskSpec("kilt_aidayago2_noprefix", "aidayago2", None, 128, MENTION_WINDOW)
    assert row.spec("kilt", "_typed") == TaskSpec("kilt_aidayago2_typed", "aidayago2", "EL", 128, MENTION_WINDOW)


def test_the_planners_task_shapes_are_the_mixtures_task_specs_at_the_lengths_training_records():
    """`t5r plan` sizes each task from its TaskSpec (no shape of its own): the spec `describe` gives,
    at the query length the step reads it at (a `QUERY_LEN` mapping's, else the Task's own)."""
    import dataclasses

    from t5_retrieval.data.tasks.retrieval_tasks import describe, registered_task
    from t5_retrieval.plan.steps import TrainSettings, task_shapes

    settings = TrainSettings(mixture=["demo_fever", "demo_aidayago2"], query_len={"demo_fever": 24}, passage_len=32,
                             num_negatives=1, per_device_batch=4, multitask=None, num_steps=1)
    fever, aida = (describe(registered_task(name)) for name in ("demo_fever", "demo_aidayago2"))
    shapes = task_shapes(settings)
    assert [shape.spec for shape in shapes] == [dataclasses.replace(fever, query_len=24), aida], shapes
    assert [(shape.name, shape.query_len, shape.rows) for shape in shapes] == [
        ("demo_fever", 24, 2), ("demo_aidayago2", aida.query_len, 2)], shapes
