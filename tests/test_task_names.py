"""A model's tasks answer to their registered name and to their dataset, with one error for both."""

import pytest

from t5_retrieval.data.tasks.task_names import TaskSet, UnknownTaskError
from t5_retrieval.data.tasks.task_spec import TaskSpec

RECORDS = {"demo_fever": {"dataset": "fever", "prefix": "fever", "index": 0},
           "demo_nq": {"dataset": "nq", "prefix": "nq", "index": 1}}
TASKS = TaskSet.from_records(RECORDS)
NONE = TaskSet(())


def test_registered_name_and_dataset_both_resolve_to_the_registered_name():
    assert TASKS.resolve("demo_fever") == "demo_fever"
    assert TASKS.resolve("fever") == "demo_fever"
    assert TASKS.dataset_of("demo_nq") == TASKS.dataset_of("nq") == "nq"
    assert TASKS.datasets() == ["fever", "nq"]


def test_unknown_name_lists_both_forms_of_every_task():
    with pytest.raises(UnknownTaskError) as caught:
        TASKS.resolve("wow")
    assert str(caught.value) == ("unknown task 'wow'; this model was trained on: "
                                 "demo_fever (dataset fever), demo_nq (dataset nq)"), str(caught.value)
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)


def test_a_dataset_read_by_two_tasks_is_ambiguous():
    tasks = TaskSet.from_records({**RECORDS, "demo_fever_noprefix": {"dataset": "fever", "prefix": None}})
    with pytest.raises(UnknownTaskError, match=r"ambiguous.*\['demo_fever', 'demo_fever_noprefix'\]"):
        tasks.resolve("fever")
    assert tasks.resolve("demo_fever_noprefix") == "demo_fever_noprefix"


MIXTURES = {"only_fever": ["demo_fever"], "fever_and_nq": ["demo_fever", "demo_nq"],
            "fever_and_trex": ["demo_fever", "demo_trex"]}


@pytest.fixture
def mixtures():
    """seqio Mixtures of the project's demo Tasks, removed afterwards."""
    from t5_retrieval.data.tasks.retrieval_tasks import registries

    seqio = registries()
    for name, members in MIXTURES.items():
        if name in seqio.MixtureRegistry.names():
            seqio.MixtureRegistry.remove(name)
        seqio.MixtureRegistry.add(name, [(m, 1.0) for m in members])
    yield MIXTURES
    for name in MIXTURES:
        seqio.MixtureRegistry.remove(name)


def test_a_mixture_stands_for_the_model_tasks_it_holds(mixtures):
    assert TASKS.expand(["fever_and_nq"]) == ["demo_fever", "demo_nq"]
    assert TASKS.expand(["nq", "fever_and_nq"]) == ["nq", "demo_fever", "demo_nq"], \
        "a name the model knows is kept as given; the Mixture adds its Tasks"
    assert TASKS.resolve("only_fever") == "demo_fever", "a Mixture of one Task names that task"
    assert TASKS.dataset_of("only_fever") == "fever"
    with pytest.raises(UnknownTaskError, match=r"Mixture 'fever_and_nq' holds several .*\['demo_fever', 'demo_nq'\]"
                                               r".*name one of them"):
        TASKS.resolve("fever_and_nq")


def test_a_mixture_of_tasks_the_model_was_not_trained_on_names_them(mixtures):
    expected = (r"seqio Mixture 'fever_and_nq' holds \['demo_nq'\], which this model was not trained on; "
                r"it was trained on: demo_fever \(dataset fever\)$")
    model = TaskSet.from_records({"demo_fever": RECORDS["demo_fever"]})
    with pytest.raises(UnknownTaskError, match=expected):
        model.expand(["fever_and_nq"])
    with pytest.raises(UnknownTaskError, match=expected):
        model.resolve("fever_and_nq")


def test_a_model_without_tasks_takes_every_name_as_its_own_task_and_dataset(mixtures):
    assert NONE.resolve("only_fever") == "only_fever" and NONE.dataset_of("fever") == "fever"
    assert NONE.expand(["fever_and_nq", "x"]) == ["fever_and_nq", "x"]


def test_aliases_are_the_names_that_resolve_without_the_registry():
    tasks = TaskSet.from_records({**RECORDS, "demo_fever_noprefix": {"dataset": "fever", "prefix": None}})
    aliases = tasks.aliases()
    assert aliases == {"demo_fever": "demo_fever", "demo_nq": "demo_nq", "demo_fever_noprefix": "demo_fever_noprefix",
                       "nq": "demo_nq"}, "fever is read by two tasks: not an alias"
    assert all(tasks.resolve(name) == task for name, task in aliases.items())


def test_registered_tasks_reads_datasets_from_the_registry_and_expands_mixtures(mixtures):
    registered = TaskSet.registered(["mini_kilt_trex_noprefix", "fever_and_nq", "wow"])
    assert {name: (registered.spec(name).dataset, registered.spec(name).prefix) for name in registered} == {
        "mini_kilt_trex_noprefix": ("trex", None), "demo_fever": ("fever", "FEVER"), "demo_nq": ("nq", "NQ"),
        "wow": ("wow", None)}, "a name registered as nothing is a dataset"
    assert registered.spec("wow") == TaskSpec("wow", "wow", None)


def test_the_registry_module_does_not_import_the_resolver():
    from test_layers import imported_modules

    from t5_retrieval.data.tasks import retrieval_tasks

    imports = [module for _, module in imported_modules(retrieval_tasks.__file__)]
    assert not [m for m in imports if m.startswith("t5_retrieval.data.tasks.task_names")], \
        "retrieval_tasks -> task_names -> retrieval_tasks would be an import cycle: only the resolver imports the other"


FRESH_PROCESS_LOOKUPS = """
import sys
from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.tasks.shipped import MINI_KILT
from t5_retrieval.results.common import dataset_name

model = TaskSet(d.spec("mini_kilt", "") for d in MINI_KILT)
print(",".join(model.expand(["mini_kilt_trex", "mini_kilt_without_wow"])))
print(",".join(t.name for t, _ in retrieval_tasks.resolve("mini_kilt_noprefix")))
print(dataset_name(["mini_kilt_typed"], "wow"))
print(retrieval_tasks.registered_task("kilt_nq") is not None)
print("t5_retrieval.tasks" in sys.modules)
"""


def test_the_projects_mixtures_resolve_in_a_process_that_imported_no_task_module():
    """Every lookup of a name registers the project's Tasks and Mixtures first: no caller imports a module
    for its side effect (`Searcher.search`, `dataset_name` and the planner used to find no Mixture)."""
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS_LOOKUPS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "mini_kilt_trex,mini_kilt_fever,mini_kilt_hotpotqa,mini_kilt_entityquestions,mini_kilt_entity_linking",
        "mini_kilt_fever_noprefix,mini_kilt_wow_noprefix,mini_kilt_hotpotqa_noprefix,mini_kilt_trex_noprefix,"
        "mini_kilt_entityquestions_noprefix,mini_kilt_entity_linking_noprefix",
        "mini_kilt_wow_typed", "True", "False"], out.stdout


def test_a_users_task_of_a_shipped_name_is_not_replaced_by_the_shipped_one():
    from t5_retrieval.data.tasks import retrieval_tasks

    registered = retrieval_tasks.registered_task("demo_fever")
    assert retrieval_tasks.describe(registered).prefix == "FEVER"
    retrieval_tasks.add_retrieval_task("demo_fever", retrieval_tasks.kilt_examples_source("fever"), prefix="MINE")
    try:
        retrieval_tasks.register_shipped.cache_clear()
        retrieval_tasks.register_shipped()
        assert retrieval_tasks.describe(retrieval_tasks.registered_task("demo_fever")).prefix == "MINE"
    finally:
        retrieval_tasks.register_retrieval_task(registered.spec, registered.source)


def test_one_function_assembles_a_models_task_examples(tmp_path):
    """`t5r eval`, `t5r mine`, the stages and fusion read a model's examples through `task_examples`:
    keyed by the model's name of each task, whichever form names it; every task lacking the split named."""
    import json

    from t5_retrieval.data import layout
    from t5_retrieval.data.records import DataError, Example
    from t5_retrieval.data.tasks.examples import dataset_examples, task_examples

    data_dir = str(tmp_path)
    path = layout.examples_path(data_dir, "fever", "dev")
    (tmp_path / "examples").mkdir()
    with open(path, "w") as f:
        f.write(json.dumps(Example("f1", "fever", "is it so", (("p",),)).to_json()) + "\n")
    model = TaskSet.from_records({"kilt_fever": {"dataset": "fever", "prefix": "FEVER"},
                                  "my_nq": {"dataset": "nq", "prefix": "NQ"}})
    by_dataset = task_examples(model, data_dir, "dev", ["fever"])
    assert list(by_dataset) == ["kilt_fever"] and by_dataset["kilt_fever"][0].task == "kilt_fever"
    assert by_dataset == task_examples(model, data_dir, "dev", ["kilt_fever"])
    with pytest.raises(DataError, match=r"^no dev examples for the model's task my_nq \(dataset nq\): no .*nq-dev"
                                        r"\.jsonl and no registered seqio Task 'my_nq' \(no MIXTURE_OR_TASK_MODULE "
                                        r"imported registers it\)$"):
        task_examples(model, data_dir, "dev")  # no command to suggest: the caller gave none
    assert list(task_examples(NONE, data_dir, "dev")) == ["fever"] == list(dataset_examples(data_dir, "dev")), \
        "a model without tasks reads every examples file, keyed by dataset"


# ---------------------------------------------------------------------------------------------
# Every caller resolves names through this module: each form works, with the same messages.


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny T5 model directory over the demo Tasks demo_fever and demo_trex, its KB embeddings and index."""
    from tests.tiny_model import build_tiny_run

    return build_tiny_run(str(tmp_path_factory.mktemp("names")))


def test_searcher_service_and_experts_take_each_form_of_a_task_name(tiny_run, mixtures):
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.fusion.experts import ExpertSpec, load_expert
    from t5_retrieval.retrieval.serve import SearchService
    from t5_retrieval.searcher import Searcher

    searcher = Searcher.open(tiny_run.model_dirs[0], tiny_run.index_dirs[0], layout.kb_dir(tiny_run.data_dir))
    queries = [e.query for e in read_examples(layout.examples_path(tiny_run.data_dir, "fever", "dev"))]
    by_name = searcher.search(queries, task="demo_fever", k=3)
    assert searcher.search(queries, task="demo_trex", k=3) != by_name, "another task's prefix scores differently"
    assert searcher.search(queries, task="fever", k=3) == by_name, "a dataset names the task reading it"
    assert searcher.search(queries, task="only_fever", k=3) == by_name, "a Mixture of one Task names it"
    with pytest.raises(UnknownTaskError, match=r"^unknown task 'wow'; this model was trained on: "
                                               r"demo_fever \(dataset fever\), demo_trex \(dataset trex\)$"):
        searcher.search(queries, task="wow")
    with pytest.raises(UnknownTaskError, match=r"Mixture 'fever_and_trex' holds several"):
        searcher.search(queries, task="fever_and_trex")

    service = SearchService(searcher.encoder, searcher.index, searcher.store, ["fever_and_trex"])
    assert service.tasks == ("demo_fever", "demo_trex"), "a Mixture serves each of its Tasks"
    assert SearchService(searcher.encoder, searcher.index, searcher.store, ["trex", "demo_fever"]).tasks == \
        ("demo_trex", "demo_fever")
    assert service.parse({"task": "only_fever", "query": "who"})[0] == "demo_fever"
    with pytest.raises(UnknownTaskError, match=r"^unknown task 'wow'; this model was trained on: "):
        SearchService(searcher.encoder, searcher.index, searcher.store, ["fever", "wow"])

    expert = load_expert(ExpertSpec("only_fever", tiny_run.model_dirs[0], tiny_run.index_dirs[0]), searcher.store.ids())
    assert expert.query_task == "demo_fever"


def test_t5r_eval_takes_each_form_of_a_task_name(tiny_run, mixtures, tmp_path, capsys):
    import json

    from t5_retrieval import cli

    base = ["eval", f"--checkpoint_dir={tiny_run.model_dirs[0]}", f"--index_dir={tiny_run.index_dirs[0]}",
            f"--data_dir={tiny_run.data_dir}"]
    tables = {}
    for form in ("fever,trex", "demo_fever,demo_trex", "fever_and_trex"):
        assert cli.main([*base, f"--tasks={form}", f"--output_dir={tmp_path / form}"]) == 0, form
        with open(tmp_path / form / "results.json") as f:
            tables[form] = json.load(f)
    by_name = tables["demo_fever,demo_trex"]
    assert tables["fever,trex"] == by_name, \
        "tables are keyed by the model's task names, whichever form names them (columns included)"
    assert not [key for key in by_name["demo_fever"] if "answer" in key], \
        "FEVER's answers are labels: no answer recall, whatever the task is called"
    assert [key for key in by_name["demo_trex"] if "answer" in key], "T-REx answers are strings to find"
    assert tables["fever_and_trex"] == by_name, "a Mixture stands for its Tasks"
    capsys.readouterr()
    assert cli.main([*base, "--tasks=wow", f"--output_dir={tmp_path / 'wow'}"]) == 2
    assert "unknown task 'wow'; this model was trained on: demo_fever (dataset fever), demo_trex (dataset trex)" in \
        capsys.readouterr().err


def test_results_find_a_dataset_among_a_tables_task_names():
    from t5_retrieval.results.common import dataset_name

    assert dataset_name(["mini_kilt_fever_noprefix", "mini_kilt_trex_noprefix"], "fever") == "mini_kilt_fever_noprefix"
    assert dataset_name(["fever", "trex"], "trex") == "trex", "BM25's tables are keyed by dataset"
    assert dataset_name(["mini_kilt_typed"], "wow") == "mini_kilt_wow_typed", "a Mixture's Task reading it"
    with pytest.raises(KeyError, match=r"^unknown task 'wow'; this model was trained on: mini_kilt_fever "):
        dataset_name(["mini_kilt_fever"], "wow")


def test_every_encoder_provides_what_the_protocol_declares(tiny_run):
    from t5_retrieval.inference import QuerySideEncoder
    from t5_retrieval.retrieval.encoder import Encoder, HashedBagOfWordsEncoder

    lexical, trained = HashedBagOfWordsEncoder(8), tiny_run.encoders[0]
    side = QuerySideEncoder(trained, trained)
    assert all(isinstance(encoder, Encoder) for encoder in (lexical, trained, side))
    assert (lexical.features, lexical.task_names, lexical.step) == ({}, [], None)
    assert trained.task_names == ["demo_fever", "demo_trex"] == sorted(trained.features["tasks"])
    assert trained.step == 0, "the checkpoint step restored"
    assert (side.features, side.task_names, side.step) == (trained.features, trained.task_names, trained.step)


def test_the_training_order_is_the_recorded_step_positions_not_the_records_order():
    reordered = TaskSet.from_records({"demo_nq": RECORDS["demo_nq"], "demo_fever": RECORDS["demo_fever"]})
    assert list(reordered) == ["demo_nq", "demo_fever"] and reordered.training_order() == ["demo_fever", "demo_nq"]
    unrecorded = TaskSet.from_records({**RECORDS, "demo_wow": {"dataset": "wow", "prefix": None}})
    assert unrecorded.training_order() is None, "a model written before towers were tracked has no order"
