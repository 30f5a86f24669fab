"""Inputs refused in one line (`t5r <command>: error: ...`, exit status 2), each run as the user runs it:

- a null, boolean, number, list or object where a KB or task file has an id or a query, and an id
  holding a tab or a line break: `<file>:<line>: field 'id' must be a non-empty string (got null)`,
  never a page named "None" or a query scored as the text "None";
- an output directory that is, or is inside, an artefact of another kind (an index, a passage store,
  embeddings, a model directory): `t5r eval --output_dir=<index>` would leave the index unloadable;
- a second `t5r train` on a model directory another run is training, while a lock left by a killed
  run is taken over;
- `t5r checksum --accept` on an artefact a killed run left pending, unless `--reason` says why.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import prepare_small_demo
from process_harness import REPO, jax_env

from t5_retrieval import checksums, cli
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.retrieval.index import load_index

LEXICAL = ["--lexical_baseline_dim=32"]
TIMEOUT_S = 300


def run(argv: list[str], capsys) -> tuple[int, str]:
    """`t5r <argv>` in-process: (exit status, its one error line, or all of stderr when not one)."""
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("t5r ")]
    assert "Traceback" not in err, err
    return status, lines[0] if len(lines) == 1 else err


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A small prepared data dir (KB, fever train examples) with lexical embeddings and an exact index."""
    root = tmp_path_factory.mktemp("refusals")
    data = prepare_small_demo(root, ["fever"])
    emb, index = str(root / "emb"), str(root / "index")
    assert cli.main(["encode", *LEXICAL, f"--kb_dir={data}/kb", f"--output_dir={emb}", "--no_progress"]) == 0
    assert cli.main(["index", f"--embeddings_dir={emb}", f"--output_dir={index}", "--backend=exact"]) == 0
    return {"root": str(root), "raw": str(root / "raw"), "data": data, "kb": os.path.join(data, "kb"), "emb": emb,
            "index": index}


def write_jsonl(path: str, rows: list) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return path


PASSAGE = {"id": "p1", "wikipedia_id": "w1", "title": "T", "text": "some words here"}


# --- ids and queries ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,got", [
    ("id", None, "got null"), ("wikipedia_id", None, "got null"), ("id", ["p"], "got a list"),
    ("id", True, "got true"), ("id", 1.5, "got a number 1.5"), ("id", {"a": 1}, "got an object"),
    ("title", None, "got null"), ("text", 3, "got a number 3"),
])
def test_kb_passages_with_a_null_or_non_string_id_are_refused_with_file_and_line(tmp_path, capsys, field, value, got):
    source = write_jsonl(str(tmp_path / "kb" / "passages.jsonl"), [PASSAGE, {**PASSAGE, "id": "p2", field: value}])
    status, line = run(["data", "kb", f"--source={source}", f"--data_dir={tmp_path / 'data'}"], capsys)
    assert status == 2, line
    must = "must be a string" if field in ("title", "text") else "must be a non-empty string"
    assert f"t5r data kb: error: {source}:2: field '{field}' {must} ({got})" in line, line
    assert not os.path.exists(tmp_path / "data" / "kb"), "no store is left behind"


@pytest.mark.parametrize("value", ["p\t2", "p\n2", "p\r2"])
def test_a_tab_or_line_break_inside_an_id_is_refused_with_file_and_line(tmp_path, capsys, value):
    source = write_jsonl(str(tmp_path / "passages.jsonl"), [PASSAGE, {**PASSAGE, "id": value}])
    status, line = run(["data", "kb", f"--source={source}", f"--data_dir={tmp_path / 'data'}"], capsys)
    assert status == 2 and f"{source}:2: field 'id' is {json.dumps(value)}, which holds a tab or a line break" in line, line


def test_kilt_pages_with_a_null_page_id_are_refused_and_an_existing_kb_is_kept(prepared, tmp_path, capsys):
    """`--overwrite` with a bad source leaves the store that was there: nothing already written is lost."""
    data = str(tmp_path / "data")
    shutil.copytree(prepared["kb"], os.path.join(data, "kb"))
    good = [json.loads(line) for line in open(os.path.join(prepared["raw"], "kb", "pages.jsonl"), encoding="utf-8")]
    source = write_jsonl(str(tmp_path / "pages.jsonl"), [good[0], {**good[1], "wikipedia_id": None}])
    status, line = run(["data", "kb", f"--source={source}", f"--data_dir={data}", "--overwrite"], capsys)
    assert status == 2 and f"{source}:2: field 'wikipedia_id' must be a non-empty string (got null)" in line, line
    assert "None" not in PassageStore.open(os.path.join(data, "kb")).passages_by_page(), "the old store opens as it was"
    assert len(PassageStore.open(os.path.join(data, "kb"))) == len(PassageStore.open(prepared["kb"]))


def kilt_row(raw: str) -> dict:
    with open(os.path.join(raw, "fever-train-kilt.jsonl"), encoding="utf-8") as f:
        return json.loads(f.readline())


@pytest.mark.parametrize("field,value,message", [
    ("input", None, "field 'input' must be a string (got null)"),
    ("input", 7, "field 'input' must be a string (got a number 7)"),
    ("input", ["a question"], "field 'input' must be a string (got a list)"),
    ("id", None, "field 'id' must be a non-empty string (got null)"),
    ("id", "a\tb", "field 'id' is \"a\\tb\", which holds a tab or a line break"),
])
def test_task_file_with_a_null_or_non_string_query_or_id_is_refused(prepared, tmp_path, capsys, field, value, message):
    row = kilt_row(prepared["raw"])
    source = write_jsonl(str(tmp_path / "in" / "fever-train-kilt.jsonl"), [row, {**row, "id": "x2", field: value}])
    data = str(tmp_path / "data")
    shutil.copytree(prepared["kb"], os.path.join(data, "kb"))
    status, line = run(["data", "tasks", f"--input_dir={tmp_path / 'in'}", f"--data_dir={data}", "--tasks=fever",
                        "--splits=train"], capsys)
    assert status == 2 and f"t5r data tasks: error: {source}:2: {message}" in line, line
    assert not os.path.exists(os.path.join(data, "examples", "fever-train.jsonl"))


def test_a_null_provenance_page_is_refused_not_read_as_a_page_named_none(prepared, tmp_path, capsys):
    row = kilt_row(prepared["raw"])
    bad = {**row, "id": "x2", "output": [{"answer": "SUPPORTS", "provenance": [{"wikipedia_id": None}]}]}
    source = write_jsonl(str(tmp_path / "in" / "fever-train-kilt.jsonl"), [row, bad])
    data = str(tmp_path / "data")
    shutil.copytree(prepared["kb"], os.path.join(data, "kb"))
    status, line = run(["data", "tasks", f"--input_dir={tmp_path / 'in'}", f"--data_dir={data}", "--tasks=fever",
                        "--splits=train"], capsys)
    assert status == 2, line
    assert f"{source}:2: field 'output[0].provenance[0].wikipedia_id' must be a non-empty string (got null)" in line


def data_dir_with_examples(prepared, tmp_path, rows: list) -> tuple[str, str]:
    """A data dir with the prepared KB and a fever-train examples file of `rows`."""
    data = str(tmp_path / "data")
    os.makedirs(data)
    os.symlink(prepared["kb"], os.path.join(data, "kb"))
    return data, write_jsonl(os.path.join(data, "examples", "fever-train.jsonl"), rows)


def examples_rows(prepared) -> list[dict]:
    with open(os.path.join(prepared["data"], "examples", "fever-train.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("field,value,message", [
    ("query", None, "field 'query' must be a string (got null)"),
    ("query", ["q"], "field 'query' must be a string (got a list)"),
    ("id", None, "field 'id' must be a non-empty string (got null)"),
    ("gold_pages", [[None]], "field 'gold_pages[0][0]' must be a non-empty string (got null)"),
])
def test_eval_refuses_an_examples_file_with_a_null_query_or_id(prepared, tmp_path, capsys, field, value, message):
    rows = examples_rows(prepared)
    data, path = data_dir_with_examples(prepared, tmp_path, [rows[0], {**rows[1], field: value}, *rows[2:]])
    out = str(tmp_path / "eval")
    status, line = run(["eval", *LEXICAL, f"--index_dir={prepared['index']}", f"--data_dir={data}", "--split=train",
                        f"--output_dir={out}"], capsys)
    assert status == 2 and f"t5r eval: error: {path}:2: {message}" in line, line
    assert not os.path.exists(out), "a refused eval leaves no output directory"


def test_query_side_refuses_a_null_answer_of_an_answer_only_file(prepared, tmp_path, capsys):
    qa = write_jsonl(str(tmp_path / "qa" / "nq_open-train-kilt.jsonl"), [
        {"id": "q1", "input": "who?", "output": [{"answer": "someone"}]},
        {"id": "q2", "input": "what?", "output": [{"answer": None}]}])
    os.makedirs(tmp_path / "empty")
    status, line = run(["query-side", f"--checkpoint_dir={tmp_path / 'empty'}", f"--index_dir={prepared['index']}",
                        f"--embeddings_dir={prepared['emb']}", f"--kb_dir={prepared['kb']}",
                        f"--qa_dir={tmp_path / 'qa'}", "--task=nq_open", "--as_task=fever",
                        f"--output_dir={tmp_path / 'qs'}"], capsys)
    assert status == 2 and f"{qa}:2: field 'output[0].answer' must be a string (got null)" in line, line


# --- an output directory inside an artefact ----------------------------------------------------------


def test_eval_into_an_index_directory_is_refused_and_the_index_still_loads(prepared, capsys):
    index = prepared["index"]
    before = sorted(os.listdir(index))
    status, line = run(["eval", *LEXICAL, f"--index_dir={index}", f"--data_dir={prepared['data']}", "--split=train",
                        f"--output_dir={index}"], capsys)
    assert status == 2, line
    assert line.startswith(f"t5r eval: error: --output_dir={index}: is an index ({index}/index.json shows it)"), line
    assert sorted(os.listdir(index)) == before
    checksums.verify_all(index)
    assert len(load_index(index)) == len(PassageStore.open(prepared["kb"]))


@pytest.mark.parametrize("command,flags,inside", [
    ("eval", lambda p: [*LEXICAL, f"--index_dir={p['index']}", f"--data_dir={p['data']}", "--split=train"], "index"),
    ("encode", lambda p: [*LEXICAL, f"--kb_dir={p['kb']}", "--no_progress"], "index"),
    ("index", lambda p: [f"--embeddings_dir={p['emb']}"], "kb"),
    ("export-hf", lambda p: [f"--checkpoint_dir={p['root']}"], "emb"),
    ("export", lambda p: [f"--checkpoint_dir={p['root']}", f"--index_dir={p['index']}", f"--kb_dir={p['kb']}"], "kb"),
    ("train", lambda p: ["--gin_file=models/t5_tiny.gin"], "index"),
])
def test_an_output_directory_inside_another_artefact_is_refused(prepared, capsys, command, flags, inside):
    parent = prepared[inside]
    out = os.path.join(parent, "out")
    flag = "--model_dir" if command == "train" else "--output_dir"
    before = sorted(os.listdir(parent))
    status, line = run([command, *flags(prepared), f"{flag}={out}"], capsys)
    assert status == 2, line
    assert line.startswith(f"t5r {command}: error: {flag}={out}: is inside the "), line
    assert parent in line and "choose a directory outside it" in line, line
    assert sorted(os.listdir(parent)) == before, "nothing was written into the artefact"


@pytest.mark.parametrize("command,flags,target", [
    ("encode", lambda p: [*LEXICAL, f"--kb_dir={p['kb']}", "--no_progress"], "kb"),
    ("index", lambda p: [f"--embeddings_dir={p['emb']}"], "emb"),
    ("train", lambda p: ["--gin_file=models/t5_tiny.gin"], "index"),
])
def test_an_output_directory_that_is_another_kind_of_artefact_is_refused(prepared, capsys, command, flags, target):
    path = prepared[target]
    flag = "--model_dir" if command == "train" else "--output_dir"
    before = sorted(os.listdir(path))
    status, line = run([command, *flags(prepared), f"{flag}={path}"], capsys)
    assert status == 2 and f"t5r {command}: error: {flag}={path}: is a" in line, line
    assert sorted(os.listdir(path)) == before


def test_mine_into_a_data_dir_inside_an_artefact_is_refused(prepared, tmp_path, capsys):
    data = os.path.join(prepared["emb"], "data")  # a data dir someone put inside the embeddings directory
    status, line = run(["mine", *LEXICAL, f"--index_dir={prepared['index']}", f"--data_dir={data}", "--source=a1"],
                       capsys)
    assert status == 2 and f"is inside the embeddings directory {prepared['emb']}" in line, line
    assert not os.path.exists(data)


def test_a_command_still_rewrites_or_resumes_its_own_kind(prepared, tmp_path, capsys):
    """Own kinds stay writable: an index rebuilt in place, one a killed `t5r index` left unfinished,
    and an embeddings directory resumed."""
    index = str(tmp_path / "index")
    shutil.copytree(prepared["index"], index)
    assert cli.main(["index", f"--embeddings_dir={prepared['emb']}", f"--output_dir={index}", "--backend=exact"]) == 0
    os.remove(os.path.join(index, "index.json"))
    checksums.begin(index)  # what `t5r index` leaves when it is killed while writing
    assert cli.main(["index", f"--embeddings_dir={prepared['emb']}", f"--output_dir={index}", "--backend=exact"]) == 0
    assert len(load_index(index)) == len(PassageStore.open(prepared["kb"]))
    emb = str(tmp_path / "emb")
    shutil.copytree(prepared["emb"], emb)
    assert cli.main(["encode", *LEXICAL, f"--kb_dir={prepared['kb']}", f"--output_dir={emb}", "--no_progress"]) == 0


def test_the_markers_are_the_writers_own_file_names():
    from t5_retrieval import checkpoint
    from t5_retrieval.commands import outputs
    from t5_retrieval.data.stores import embedding_store, kb
    from t5_retrieval.export import hf, savedmodel
    from t5_retrieval.fusion import muf
    from t5_retrieval.retrieval import stored_index

    assert outputs.INDEX_JSON == stored_index.INDEX_JSON
    assert outputs.MANIFEST == kb.MANIFEST == embedding_store.MANIFEST
    assert (outputs.PAGE_MAP, outputs.IDS_FILE) == (kb.PAGE_MAP, embedding_store.IDS_FILE)
    assert (outputs.MODEL_CONFIG, outputs.QUERY_SIDE) == (checkpoint.CONFIG_FILE, checkpoint.QUERY_SIDE_FILE)
    assert (outputs.EXPORT_JSON, outputs.RETRIEVAL_JSON) == (savedmodel.EXPORT_JSON, hf.RETRIEVAL_JSON)
    assert outputs.ENSEMBLE_JSON == muf.ENSEMBLE_JSON


# --- the model directory's lock -----------------------------------------------------------------------

TINY = ["--gin_file=models/t5_tiny.gin"] + [f"--gin.{b}" for b in (
    "VOCAB_SIZE=64", "D_MODEL=16", "D_FF=32", "NUM_LAYERS=1", "NUM_HEADS=2", "D_KV=8", "train.batches=@RandomBatches",
    "RandomBatches.vocab_size=64", "RandomBatches.num_negatives=1", "train.per_device_batch=4", "train.log_every=1")]


def start_train(model_dir: str, steps: int, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "t5_retrieval.cli", "train", f"--model_dir={model_dir}", *TINY,
                                 f"--gin.train.num_steps={steps}", f"--gin.train.checkpoint_every={steps}"],
                                cwd=REPO, env=jax_env(1), stdout=log, stderr=subprocess.STDOUT)


def wait_for_lock_holder(proc: subprocess.Popen, lock: str, log_path: str) -> dict:
    """The lock file's record once the run has written it (before it writes anything else)."""
    config = os.path.join(os.path.dirname(lock), "model_config.json")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if os.path.exists(lock) and open(lock).read().strip():
            return json.loads(open(lock).read())
        assert not os.path.exists(config), "t5r train wrote the model directory without taking its lock"
        assert proc.poll() is None, f"t5r train ended (exit {proc.returncode}):\n" + open(log_path).read()[-3000:]
        time.sleep(0.05)
    raise AssertionError("t5r train never took its lock")


def test_a_second_train_on_a_model_dir_is_refused_and_a_killed_runs_lock_taken_over(tmp_path, capsys, caplog,
                                                                                     clean_gin):
    model_dir, log_path = str(tmp_path / "model"), str(tmp_path / "first.log")
    lock = os.path.join(model_dir, "t5r_train.lock")
    first = start_train(model_dir, 100_000, log_path)
    try:
        holder = wait_for_lock_holder(first, lock, log_path)
        assert holder["pid"] == first.pid, holder
        status, line = run(["train", f"--model_dir={model_dir}", *TINY, "--gin.train.num_steps=2"], capsys)
        assert status == 2, line
        assert line.startswith(f"t5r train: error: {model_dir}: another run is writing this model directory "
                               f"(pid {first.pid} on host "), line
        assert f"kill {first.pid}" in line, line
        assert first.poll() is None, "the first run goes on"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert json.loads(open(lock).read())["pid"] == first.pid, "a killed run's entry stays: the next run sees it"
    caplog.set_level(logging.INFO, logger="t5_retrieval.train")
    assert cli.main(["train", f"--model_dir={model_dir}", *TINY, "--gin.train.num_steps=2",
                     "--gin.train.checkpoint_every=2"]) == 0, capsys.readouterr().err[-3000:]
    assert f"taking over the lock of a run that ended without releasing it (pid {first.pid}" in caplog.text
    assert os.path.isdir(os.path.join(model_dir, "2")), os.listdir(model_dir)
    assert open(lock).read() == "", "a run that ends clears its entry"


def test_a_multi_process_job_on_a_locked_model_dir_stops_in_every_process_without_hanging(tmp_path):
    """Process 0 takes the lock and tells the others: both exit 2 (no process waits in a collective)."""
    from process_harness import job_flags
    from process_harness import start as start_process

    from t5_retrieval.artefact_io import directory_lock

    model_dir = str(tmp_path / "model")
    os.makedirs(model_dir)
    command = ["train", f"--model_dir={model_dir}", *TINY, "--gin.train.num_steps=2"]
    logs = [str(tmp_path / f"process_{i}.log") for i in range(2)]
    with directory_lock(os.path.join(model_dir, "t5r_train.lock"), "model directory"):  # another run holds it
        procs = [start_process(flags, command, log, 1) for flags, log in zip(job_flags(2), logs)]
        try:
            for proc in procs:
                proc.wait(timeout=TIMEOUT_S)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    texts = [open(log).read() for log in logs]
    assert [proc.returncode for proc in procs] == [2, 2], texts
    assert f"another run is writing this model directory (pid {os.getpid()} on host " in texts[0], texts[0][-2000:]
    assert "process 0 of this job found the model directory in use by another run" in texts[1], texts[1][-2000:]
    assert sorted(os.listdir(model_dir)) == ["t5r_train.lock"], "neither process wrote the model directory"


# --- accepting a pending artefact ---------------------------------------------------------------------


def test_checksum_accept_refuses_a_pending_index_unless_given_a_reason(prepared, tmp_path, capsys):
    index = str(tmp_path / "index")
    shutil.copytree(prepared["index"], index)
    os.remove(os.path.join(index, "index.json"))
    checksums.begin(index)  # what a `t5r index` killed while writing leaves
    status, line = run(["checksum", "--accept", index], capsys)
    assert status == 2, line
    assert f"{index}: t5r_checksums.pending says a t5r run was writing this artefact and stopped" in line, line
    assert f"t5r checksum --accept --reason='<what you checked>' {index}" in line, line
    assert not os.path.exists(os.path.join(index, "t5r_checksums.json")), "nothing was accepted"
    status, line = run(["checksum", "--accept", "--reason=", index], capsys)
    assert status == 2 and "--reason=''" in line, line
    assert cli.main(["checksum", "--accept", "--reason=<what you checked>", index]) == 0, "the command it gives works"
    record = json.load(open(os.path.join(index, "t5r_checksums.json")))
    assert record["accepted"]["reason"] == "<what you checked>" and record["accepted"]["was_pending"] is True
    assert not os.path.exists(os.path.join(index, "t5r_checksums.pending"))
    assert cli.main(["checksum", index]) == 0, "the accepted record verifies"
