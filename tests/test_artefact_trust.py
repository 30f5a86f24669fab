"""A model directory, an index, a KB and an embeddings directory are data someone handed over, as an
attacker or a careless operator leaves them: nothing recorded in them changes what Python imports,
every file is verified before it is parsed, and only regular files inside the artefact are read,
bounded. Each case is the real command on a tampered copy of the tiny run: exit status 2 and one
line naming the file (or, where a file is only a cache, the command works)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import gin
import pytest

from t5_retrieval import checksums, cli
from tests.tiny_model import build_tiny_run

DEEP = "[" * 100_000 + "]" * 100_000  # what Python's json module parses only to a RecursionError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_run(str(tmp_path_factory.mktemp("trust")))


def t5r(argv: list[str], capsys) -> tuple[int, list[str]]:
    """`t5r <argv>` in this process: its exit status and the lines it wrote to stderr."""
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    finally:
        gin.clear_config()
    return rc, capsys.readouterr().err.strip().splitlines()


def refused(argv: list[str], capsys, *names: str) -> str:
    """Runs `t5r <argv>`, which must exit 2 with one line naming each of `names`; returns the line."""
    rc, err = t5r(argv, capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert all(name in err[0] for name in names), (names, err[0])
    return err[0]


def eval_argv(tiny, out: str, model_dir: str | None = None, index_dir: str | None = None,
              data_dir: str | None = None) -> list[str]:
    return ["eval", f"--checkpoint_dir={model_dir or tiny.model_dirs[0]}", f"--index_dir={index_dir or tiny.index_dirs[0]}",
            f"--data_dir={data_dir or tiny.data_dir}", "--tasks=demo_fever", "--split=dev", f"--output_dir={out}"]


def serve_argv(tiny, index_dir: str | None = None, kb_dir: str | None = None) -> list[str]:
    """`t5r serve`, which opens the model, the index and the KB before it listens (so it exits here)."""
    return ["serve", f"--checkpoint_dir={tiny.model_dirs[0]}", f"--index_dir={index_dir or tiny.index_dirs[0]}",
            f"--kb_dir={kb_dir or os.path.join(tiny.data_dir, 'kb')}", "--port=0"]


def copy(source: str, target) -> str:
    shutil.copytree(source, str(target), symlinks=True)
    return str(target)


def step_dir(model_dir: str) -> str:
    (step,) = [name for name in os.listdir(model_dir) if name.isdigit()]
    return os.path.join(model_dir, step)


def accept(directory: str) -> None:
    """What a user who has checked a changed artefact runs: `t5r checksum --accept`."""
    assert cli.main(["checksum", "--accept", directory]) == 0


def edit_json(path: str, change) -> None:
    with open(path) as f:
        doc = json.load(f)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


# ----------------------------------------------------------------------------------------------
# 1. Nothing recorded in a model directory changes what Python imports


def test_a_config_gin_recording_only_a_directory_puts_nothing_on_the_python_path(tiny, tmp_path, capsys, clean_gin):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    code = tmp_path / "code"
    code.mkdir()
    (code / "t5r_trust_probe.py").write_text("raise SystemExit('imported from a model directory')\n")
    with open(os.path.join(model_dir, "config.gin"), "a") as f:
        f.write(f"make_train_iterator.task_module_path = ['{code}']\n")
    accept(step_dir(model_dir))  # the user vouches for the file: the line still names no module to run
    path = list(sys.path)
    rc, err = t5r(eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir), capsys)
    assert rc == 0, err
    assert sys.path == path, f"t5r eval changed sys.path: {sorted(set(sys.path) - set(path))}"
    assert importlib.util.find_spec("t5r_trust_probe") is None, "a module of the recorded directory is importable"


SHADOW = '''
import os
open(os.environ["T5R_TRUST_MARKER"], "w").write(__file__)
SHADOWED = True
'''


def test_a_task_module_named_like_an_installed_package_runs_from_its_file_without_replacing_it(
        tiny, tmp_path, capsys, clean_gin, monkeypatch):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    code = tmp_path / "code"
    code.mkdir()
    (code / "toml.py").write_text(SHADOW)
    marker = tmp_path / "marker"
    monkeypatch.setenv("T5R_TRUST_MARKER", str(marker))
    monkeypatch.delitem(sys.modules, "toml", raising=False)  # as in a new process: `toml` not imported yet
    with open(os.path.join(model_dir, "config.gin"), "a") as f:
        f.write(f"make_train_iterator.task_module = 'toml'\nmake_train_iterator.task_module_path = ['{code}']\n")
    accept(step_dir(model_dir))
    argv = eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir)
    line = refused(argv, capsys, "toml", str(code), "--task_module=toml")
    assert line.endswith("if you trust them, pass --task_module=toml"), line
    assert not marker.exists()

    rc, err = t5r([*argv, "--task_module=toml"], capsys)
    assert rc == 0, err
    assert marker.read_text() == str(code / "toml.py"), "the module the user named runs from its own file"
    installed = importlib.import_module("toml")
    assert not hasattr(installed, "SHADOWED") and os.path.dirname(os.path.dirname(installed.__file__)) != str(code), \
        f"`import toml` now finds {installed.__file__}, not the installed package"


def test_model_config_json_is_covered_by_the_step_record_and_its_values_are_checked(tiny, tmp_path, capsys, clean_gin):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    config = os.path.join(model_dir, "model_config.json")
    edit_json(config, lambda c: c["t5"].update(num_heads=0))  # one flipped bit: 4 -> 0
    argv = eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir)
    line = refused(argv, capsys, config, "it differs from the one this checkpoint was trained with")
    assert line.endswith(f"t5r checksum --accept {step_dir(model_dir)}"), line
    accept(step_dir(model_dir))  # accepted as it is: still not a model this version builds
    refused(argv, capsys, f"{config}: field 't5.num_heads' is 0, expected a positive integer")
    with open(os.path.join(tiny.model_dirs[0], "model_config.json")) as f:
        good = json.load(f)["t5"]
    for field, value in (("dtype", "int7"), ("d_model", "32"), ("dropout_rate", None)):
        edit_json(config, lambda c, f=field, v=value: c.update(t5={**good, f: v}))
        accept(step_dir(model_dir))
        refused(argv, capsys, f"{config}: field 't5.{field}' is {json.dumps(value)}, expected")
    edit_json(config, lambda c: (c.update(t5=good), c["features"]["tasks"]["demo_fever"].update(truncation="middle")))
    accept(step_dir(model_dir))
    refused(argv, capsys, f"{config}: field 'features.tasks.demo_fever.truncation' is \"middle\", expected one of")


def test_an_edited_task_prefix_is_a_checksum_error_not_an_index_of_another_model(tiny, tmp_path, capsys, clean_gin):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    config = os.path.join(model_dir, "model_config.json")
    edit_json(config, lambda c: c["features"]["tasks"]["demo_fever"].update(prefix="EDITED"))
    line = refused(eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir), capsys, config)
    assert "re-encode" not in line, line


def test_a_step_record_without_model_config_json_names_the_command_that_records_it(tiny, tmp_path, capsys,
                                                                                    clean_gin):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    record = os.path.join(step_dir(model_dir), checksums.CHECKSUMS_FILE)
    edit_json(record, lambda doc: doc.get("model_files", {}).pop("model_config.json", None))  # an older version's
    argv = eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir)
    line = refused(argv, capsys, os.path.join(model_dir, "model_config.json"), "not covered by")
    hint = line.rpartition("as it is now: ")[2]
    assert hint == f"t5r checksum --accept {step_dir(model_dir)}", line
    assert cli.main(hint.split()[1:]) == 0
    assert t5r(argv, capsys)[0] == 0


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_vocabulary_outside_the_model_directory_is_never_read_nor_exported(tiny, tmp_path, capsys, clean_gin,
                                                                             where):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "model")
    secret = tmp_path / "secret.model"  # a readable file outside, that would even tokenize
    shutil.copyfile(tiny.vocabulary, secret)
    if where == "relative":
        recorded = "../secret.model"
    else:
        recorded = str(secret)
        shutil.rmtree(os.path.join(model_dir, "vocabulary"))  # no copy inside: only the outside file
    edit_json(os.path.join(model_dir, "model_config.json"),
              lambda c: c["features"].update(vocabulary=recorded))
    accept(step_dir(model_dir))
    out = tmp_path / "hf"
    refused(["export-hf", f"--checkpoint_dir={model_dir}", f"--output_dir={out}"], capsys, str(secret) if
            where == "absolute" else "features.vocabulary", "outside the model directory")
    assert not out.exists(), "nothing was exported"


# ----------------------------------------------------------------------------------------------
# 2. Every file an artefact lists is verified before it is parsed; JSON depth and sizes are bounded


def test_a_flipped_bit_in_an_index_passage_ids_file_is_one_line_not_a_decode_traceback(tiny, tmp_path, capsys,
                                                                                       clean_gin):
    index_dir = copy(tiny.index_dirs[0], tmp_path / "index")
    ids = os.path.join(index_dir, "passage_ids.txt")
    with open(ids, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x80]))  # a high bit: no longer UTF-8
    refused(eval_argv(tiny, str(tmp_path / "eval"), index_dir=index_dir), capsys, ids, "fails its sha256 checksum")
    refused(serve_argv(tiny, index_dir=index_dir), capsys, ids, "fails its sha256 checksum")


def test_a_kb_manifest_that_is_a_list_is_one_line(tiny, tmp_path, capsys, clean_gin):
    data_dir = copy(tiny.data_dir, tmp_path / "data")
    manifest = os.path.join(data_dir, "kb", "manifest.json")
    with open(manifest, "w") as f:
        f.write("[]")
    argv = eval_argv(tiny, str(tmp_path / "eval"), data_dir=data_dir)
    refused(argv, capsys, manifest, "were written")
    refused(serve_argv(tiny, kb_dir=os.path.join(data_dir, "kb")), capsys, manifest, "were written")
    accept(os.path.join(data_dir, "kb"))
    refused(argv, capsys, f"{manifest}: a JSON array, expected an object")
    refused(serve_argv(tiny, kb_dir=os.path.join(data_dir, "kb")), capsys, f"{manifest}: a JSON array, expected an object")


NESTED = {  # (artefact, file): accepted after the change, so that the file itself is parsed
    "index record": ("index", checksums.CHECKSUMS_FILE, False),
    "index.json": ("index", "index.json", True),
    "KB record": ("kb", checksums.CHECKSUMS_FILE, False),
    "KB manifest": ("kb", "manifest.json", True),
    "step record": ("step", checksums.CHECKSUMS_FILE, False),
}


@pytest.mark.parametrize("case", sorted(NESTED))
def test_deeply_nested_json_in_a_record_or_manifest_is_one_line(tiny, tmp_path, capsys, clean_gin, case):
    artefact, name, accepted = NESTED[case]
    index_dir, data_dir, model_dir = (copy(tiny.index_dirs[0], tmp_path / "index"), copy(tiny.data_dir, tmp_path / "data"),
                                      copy(tiny.model_dirs[0], tmp_path / "model"))
    directory = {"index": index_dir, "kb": os.path.join(data_dir, "kb"), "step": step_dir(model_dir)}[artefact]
    with open(os.path.join(directory, name), "w") as f:
        f.write(DEEP)
    if accepted:
        accept(directory)
    argv = eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir, index_dir=index_dir, data_dir=data_dir)
    refused(argv, capsys, os.path.join(directory, name), "nested deeper than 64 levels")


def test_a_query_side_record_nested_too_deep_is_one_line(tiny, tmp_path, capsys, clean_gin):
    model_dir = copy(tiny.model_dirs[0], tmp_path / "query_side")
    record = os.path.join(model_dir, "query_side.json")
    with open(record, "w") as f:
        f.write(DEEP)
    refused(eval_argv(tiny, str(tmp_path / "eval"), model_dir=model_dir), capsys, record, "nested deeper")


def test_a_stamp_nested_too_deep_is_ignored_and_every_file_hashed(tiny, tmp_path, capsys, clean_gin):
    index_dir = copy(tiny.index_dirs[0], tmp_path / "index")
    with open(os.path.join(index_dir, checksums.STAMP_FILE), "w") as f:
        f.write(DEEP)
    rc, err = t5r(eval_argv(tiny, str(tmp_path / "eval"), index_dir=index_dir), capsys)
    assert rc == 0, err
    with open(os.path.join(index_dir, checksums.STAMP_FILE)) as f:
        assert isinstance(json.load(f), dict), "the stamp is written again after the files were hashed"


# `t5r index` on each of the cases' embeddings directories, in one process (its imports paid once)
# that may use 2 GiB, each case with its own stderr and 60 s: a file that never ends, or a FIFO
# nobody writes, would otherwise take the machine's memory or hang the test. Prints
# {case: [exit status, or "hung", and stderr]} as its last line.
BOUNDED_INDEX = """
import json, os, resource, signal, sys, tempfile, traceback
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from t5_retrieval import cli

class Hung(BaseException):  # not an Exception: the command's own error handling cannot take it for an error
    pass

def hang_up(*_):
    raise Hung()

signal.signal(signal.SIGALRM, hang_up)
results = {}
for case, embeddings_dir, out in json.loads(sys.argv[1]):
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+") as err:
        os.dup2(err.fileno(), 2)
        signal.alarm(60)
        try:
            code = cli.main(["index", f"--embeddings_dir={embeddings_dir}", f"--output_dir={out}", "--backend=exact"])
        except Hung:
            code = "hung"
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            signal.alarm(0)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        results[case] = [code, err.read()]
print(json.dumps(results))
"""


def endless(kind: str, path: str, tmp_path) -> str:
    """Puts at `path` what never ends: a link to /dev/zero, a FIFO, a link to a copy outside."""
    outside = str(tmp_path / "outside_copy")
    if kind == "copy outside":
        shutil.copyfile(path, outside)
    os.remove(path)
    if kind == "/dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        os.symlink(outside, path)  # the same bytes, but not the artefact's own file
    return path


FILES = {  # what t5r index opens in an embeddings directory, and whether the command must refuse it
    "record": (checksums.CHECKSUMS_FILE, True),
    "shard sidecar": ("shard-00000-of-00001.npy.sha256.json", True),
    "manifest": ("manifest.json", True),
    "shard": ("shard-00000-of-00001.npy", True),
    "stamp": (checksums.STAMP_FILE, False),  # a cache: without it every file is hashed
}


KINDS = ("/dev/zero", "FIFO")


@pytest.fixture(scope="module")
def index_runs(tiny, tmp_path_factory) -> dict[str, tuple[str, int | str, list[str]]]:
    """Each case's tampered copy of the tiny run's embeddings and `t5r index` on it (BOUNDED_INDEX):
    {case: (the tampered path, exit status or "hung", stderr lines)}. The cases: every file of FILES
    as each of KINDS, and the shard as a link to an identical copy outside."""
    root = tmp_path_factory.mktemp("endless")
    cases = {f"{kind} {case}": (kind, FILES[case][0]) for kind in KINDS for case in FILES}
    cases["copy outside"] = ("copy outside", "shard-00000-of-00001.npy")
    paths, argv = {}, []
    for i, (name, (kind, file_name)) in enumerate(sorted(cases.items())):
        where = root / str(i)
        where.mkdir()
        emb_dir = copy(os.path.join(os.path.dirname(tiny.data_dir), "emb_0"), where / "emb")
        assert os.path.exists(os.path.join(emb_dir, file_name)), sorted(os.listdir(emb_dir))
        paths[name] = endless(kind, os.path.join(emb_dir, file_name), where)
        argv.append([name, emb_dir, str(where / "index")])
    try:
        done = subprocess.run([sys.executable, "-c", BOUNDED_INDEX, json.dumps(argv)], capture_output=True, text=True,
                              timeout=60 * len(argv) + 300)
    except subprocess.TimeoutExpired:
        pytest.fail("t5r index hung reading a file of an embeddings directory")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return {name: (paths[name], code, err.strip().splitlines()) for name, (code, err) in results.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(FILES))
def test_a_file_that_never_ends_is_refused_or_skipped_not_read(index_runs, case, kind):
    path, code, err = index_runs[f"{kind} {case}"]
    assert code != "hung", f"t5r index hung reading {path}"
    if not FILES[case][1]:
        assert code == 0, err[-20:]
        return
    assert code == 2 and len(err) == 1, err[-20:]
    assert err[0].startswith(f"t5r index: error: {path}: ") and (
        "outside" in err[0] or "not a regular file" in err[0]), err[0]


def test_a_shard_linked_to_an_identical_copy_outside_the_directory_is_refused(index_runs):
    path, code, err = index_runs["copy outside"]
    assert code == 2 and len(err) == 1, err[-20:]
    assert err[0].startswith(f"t5r index: error: {path}: a symbolic link to ") and "outside" in err[0], err[0]
