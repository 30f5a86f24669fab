"""A model directory, an index and an embedding store each stand alone: copied elsewhere, with the
place they were written from (a venv holding the vocabulary, say) gone, every stage works on them.
And a model directory is data: loading one imports no code unless the user names it."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from t5_retrieval import checkpoint, cli
from t5_retrieval.data import layout
from t5_retrieval.data.tokenizers.tokenize import vocabulary_digest
from tests.tiny_model import build_tiny_run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model (vocabulary at `<root>/data/spm.model`), its KB embeddings and index, and a
    query-side model over it, all under one root."""
    from t5_retrieval.checkpoint import write_base_record

    root = str(tmp_path_factory.mktemp("written"))
    run = build_tiny_run(root)
    query_side = os.path.join(root, "query_side")
    shutil.copytree(run.model_dirs[0], query_side)
    write_base_record(query_side, run.model_dirs[0], run.encoders[0].fingerprint)
    return run


@pytest.fixture
def moved(tiny, tmp_path):
    """The tiny run's root copied to another directory while the original is gone (as a recreated
    venv, or another machine); the original comes back after the test."""
    root = os.path.dirname(tiny.data_dir)
    copy = str(tmp_path / "copy")
    shutil.copytree(root, copy, symlinks=True)
    away = f"{root}.away"
    os.rename(root, away)
    try:
        yield copy
    finally:
        os.rename(away, root)


def eval_argv(root: str, model: str, out: str, *extra: str) -> list[str]:
    return ["eval", f"--checkpoint_dir={root}/{model}", f"--index_dir={root}/index_0", f"--data_dir={root}/data",
            "--tasks=demo_fever", "--split=dev", f"--output_dir={out}", *extra]


def test_a_copied_model_index_and_embeddings_work_with_their_original_place_gone(tiny, moved, tmp_path):
    from t5_retrieval.data.batching.batches import passage_table
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.index import load_index
    from t5_retrieval.retrieval.serve import SearchService

    assert not os.path.exists(tiny.vocabulary), "precondition: the vocabulary the model was written with is gone"
    encoder = load_encoder(f"{moved}/model_0")
    assert encoder.fingerprint == tiny.encoders[0].fingerprint, "a moved model keeps its fingerprint (and indexes)"
    assert load_encoder(f"{moved}/query_side").fingerprint == tiny.encoders[0].fingerprint, \
        "a query-side model moved with its base finds it"
    assert cli.main(["encode", f"--checkpoint_dir={moved}/model_0", f"--kb_dir={moved}/data/kb",
                     f"--output_dir={tmp_path}/emb"]) == 0
    assert cli.main(["index", f"--embeddings_dir={moved}/emb_0", f"--output_dir={tmp_path}/index"]) == 0
    for model in ("model_0", "query_side"):
        assert cli.main(eval_argv(moved, model, f"{tmp_path}/eval_{model}")) == 0
        assert "demo_fever" in json.load(open(f"{tmp_path}/eval_{model}/results.json"))

    # The search service (what `t5r serve` runs) over the moved model and index.
    store = PassageStore.open(layout.kb_dir(f"{moved}/data"))
    service = SearchService(encoder, load_index(f"{moved}/index_0"), store, ["demo_fever"])
    assert len(service.search(["who wrote it"], 3, task="demo_fever")[0]) == 3

    # Training over the copied embeddings is the same model as over the originals: their identity
    # is their writer and content, not their directory.
    shutil.copytree(f"{moved}/emb_0", f"{tmp_path}/emb_copy")
    assert passage_table(f"{moved}/emb_0", store)[1] == passage_table(f"{tmp_path}/emb_copy", store)[1]


def test_a_query_side_model_reached_through_a_symbolic_link_finds_its_base(tiny, tmp_path):
    """As a results row links a stage it shares with another row: `<row>/ance/episode_1 -> ../../shared/...`
    puts the model's path text one level off from where its base really is."""
    from t5_retrieval.checkpoint import base_dir_of
    from t5_retrieval.inference import load_encoder

    root = os.path.dirname(tiny.data_dir)
    row = tmp_path / "row" / "ance"
    row.mkdir(parents=True)
    (row / "model").symlink_to(os.path.join(root, "query_side"))  # its base is outside what the link names
    assert base_dir_of(str(row / "model")) == os.path.realpath(tiny.model_dirs[0])
    assert load_encoder(str(row / "model")).fingerprint == tiny.encoders[0].fingerprint


def v1_model_dir(tiny, model_dir: str, vocabulary: str) -> str:
    """A copy of the tiny model as an older version wrote it: no `version`, the vocabulary by the
    absolute path it was read from, no copy inside; its checksums recorded as they are
    (`t5r checksum --accept`, what a user does for an older directory they trust)."""
    shutil.copytree(tiny.model_dirs[0], model_dir)
    stored = checkpoint.read_config(model_dir)
    v1 = {key: value for key, value in stored.items() if key != "version"}
    v1["features"] = {**stored["features"], "vocabulary": vocabulary}
    with open(os.path.join(model_dir, checkpoint.CONFIG_FILE), "w") as f:
        json.dump(v1, f)
    shutil.rmtree(os.path.join(model_dir, checkpoint.VOCABULARY_DIR))
    (step,) = [name for name in os.listdir(model_dir) if name.isdigit()]
    assert cli.main(["checksum", "--accept", os.path.join(model_dir, step)]) == 0
    return model_dir


def test_an_older_model_directory_reads_its_vocabulary_from_inside_only_and_is_upgraded_when_written(tiny, tmp_path):
    import subprocess

    from t5_retrieval.inference import load_encoder

    venv = tmp_path / "venv"
    venv.mkdir()
    vocabulary = str(venv / "spm.model")
    shutil.copyfile(tiny.vocabulary, vocabulary)
    model_dir = v1_model_dir(tiny, str(tmp_path / "v1"), vocabulary)
    # The absolute path exists, but a model directory reads no file outside it: the error copies it in.
    with pytest.raises(checkpoint.CheckpointError, match=f"{vocabulary} .*is outside the model directory") as refused:
        load_encoder(model_dir)
    command = str(refused.value).rpartition("copy it in: ")[2]
    assert command.startswith("mkdir -p ") and subprocess.run(command, shell=True).returncode == 0, command
    fingerprint = load_encoder(model_dir).fingerprint
    checkpoint.write_config(model_dir, checkpoint.read_config(model_dir))  # as a resumed run: upgraded on disk
    upgraded = checkpoint.read_config(model_dir, verified=False)  # rewritten: the next checkpoint records it
    assert upgraded["version"] == checkpoint.CONFIG_VERSION
    assert upgraded["features"]["vocabulary"] == "vocabulary/spiece.model"
    assert vocabulary_digest(os.path.join(model_dir, "vocabulary", "spiece.model")) == vocabulary_digest(vocabulary)

    # Another older directory whose venv is gone: the error says where a copy goes, and with it, it loads.
    gone = v1_model_dir(tiny, str(tmp_path / "v1_gone"), vocabulary)
    os.remove(vocabulary)
    with pytest.raises(checkpoint.CheckpointError, match=f"{vocabulary} .*does not exist; copy that vocabulary "
                                                         f".* to {gone}/vocabulary/spiece.model"):
        load_encoder(gone)
    os.makedirs(f"{gone}/vocabulary")
    shutil.copyfile(tiny.vocabulary, f"{gone}/vocabulary/spiece.model")
    assert load_encoder(gone).fingerprint == fingerprint, "the same model: its indexes still match"


def test_a_model_config_names_the_sub_field_that_differs_and_not_where_its_inputs_lived(tiny, tmp_path):
    elsewhere = str(tmp_path / "venv" / "spm.model")
    os.makedirs(os.path.dirname(elsewhere))
    shutil.copyfile(tiny.vocabulary, elsewhere)
    features = {"vocabulary": tiny.vocabulary, "query_len": 8, "passage_len": 8, "tasks": {},
                "passage_embeddings": {"fingerprint": "f" * 16, "digest": "d" * 16}}
    model_dir = str(tmp_path / "model")
    checkpoint.write_config(model_dir, {"family": "t5", "features": features})
    # The same vocabulary and embeddings read from elsewhere: the same model.
    checkpoint.write_config(model_dir, {"family": "t5", "features": {**features, "vocabulary": elsewhere}})
    changed = {**features, "passage_embeddings": {"fingerprint": "f" * 16, "digest": "e" * 16}}
    with pytest.raises(checkpoint.CheckpointError, match=r"differs from this run's in features\.passage_embeddings"
                                                         r"\.digest; "):
        checkpoint.write_config(model_dir, {"family": "t5", "features": changed})


# ----------------------------------------------------------------------------------------------
# A Task module a model's config.gin names runs only when the user names it

MARKER_MODULE = '''
import os
open(os.environ["T5R_TEST_MARKER"], "w").write("imported")
'''


@pytest.fixture
def injected(tiny, tmp_path, monkeypatch):
    """A copy of the tiny model whose config.gin records a Task module (from a directory it also
    records) that writes a marker file when imported."""
    model_dir = str(tmp_path / "model_0")
    shutil.copytree(tiny.model_dirs[0], model_dir)
    module_dir = tmp_path / "code"
    module_dir.mkdir()
    (module_dir / "t5r_marker_tasks.py").write_text(MARKER_MODULE)
    with open(os.path.join(model_dir, "config.gin"), "a") as f:
        f.write(f"make_train_iterator.task_module = 't5r_marker_tasks'\n"
                f"make_train_iterator.task_module_path = ['{module_dir}']\n")
    marker = tmp_path / "marker"
    monkeypatch.setenv("T5R_TEST_MARKER", str(marker))
    yield model_dir, marker
    import sys
    sys.modules.pop("t5r_marker_tasks", None)


def test_eval_and_serve_import_no_task_module_a_model_records_unless_the_flag_names_it(injected, tiny, capsys,
                                                                                      clean_gin):
    model_dir, marker = injected
    root = os.path.dirname(tiny.data_dir)
    argv = ["eval", f"--checkpoint_dir={model_dir}", f"--index_dir={tiny.index_dirs[0]}",
            f"--data_dir={tiny.data_dir}", "--tasks=demo_fever", "--split=dev", f"--output_dir={root}/eval_injected"]
    serve = ["serve", f"--checkpoint_dir={model_dir}", f"--index_dir={tiny.index_dirs[0]}",
             f"--kb_dir={tiny.data_dir}/kb", "--port=0"]
    # The appended lines fail config.gin's checksum first; a user who trusts them records them.
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.gin" in err[0] and "t5r checksum --accept" in err[0], err
    assert not marker.exists(), "t5r eval imported a module from an altered config.gin"
    (step,) = [name for name in os.listdir(model_dir) if name.isdigit()]
    assert cli.main(["checksum", "--accept", os.path.join(model_dir, step)]) == 0
    capsys.readouterr()
    for command in (argv, serve):
        assert cli.main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "t5r_marker_tasks" in err[0] and err[0].endswith(
            "if you trust them, pass --task_module=t5r_marker_tasks"), err
        assert not marker.exists(), f"t5r {command[0]} imported a module the model directory names"
    assert cli.main([*argv, "--task_module=t5r_marker_tasks"]) == 0
    assert marker.read_text() == "imported"


# ----------------------------------------------------------------------------------------------
# config.gin of an in-process run (the demo's rows) records its paths absolute


def test_an_in_process_run_records_absolute_paths_and_restarts_from_another_directory(tiny, tmp_path, monkeypatch,
                                                                                      clean_gin):
    from t5_retrieval import gin_utils
    from t5_retrieval.results.common import train_model
    from tests.tiny_model import _bindings

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    os.symlink(tiny.data_dir, work / "data")
    monkeypatch.chdir(work)
    bindings = [*_bindings("data", "data/spm.model"), "train.init_from = 'base'"]
    shutil.copytree(tiny.model_dirs[0], work / "base")
    train_model("model", ["models/t5_tiny.gin", "runs/base.gin"], bindings)
    config = str(work / "model" / "config.gin")
    recorded = {name: gin_utils.operative_values(config, configurable, name)
                for configurable, name in (("make_train_iterator", "data_dir"), ("make_train_iterator", "vocabulary"),
                                           ("train", "init_from"))}
    assert recorded == {"data_dir": [str(work / "data")], "vocabulary": [str(work / "data" / "spm.model")],
                        "init_from": [str(work / "base")]}, recorded
    monkeypatch.chdir(elsewhere)
    assert cli.main(["train", f"--gin_file={config}", f"--model_dir={work / 'model'}"]) == 0
    # A copy of the model directory resumes too: its stored config is the same model wherever it lies.
    shutil.copytree(work / "model", elsewhere / "copy")
    assert cli.main(["train", f"--gin_file={elsewhere / 'copy' / 'config.gin'}", "--model_dir=copy"]) == 0
