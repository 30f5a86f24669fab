"""One error style for every `t5r` command: `t5r <command>: error: <path>[:<line>]: <what to do>`, exit
status 2, no traceback unless `--debug`; checked before long work where it can be; a crashed run's
temporary files are removed by the next run; a full disk is named as such, with the path."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from t5_retrieval import artefact_io, cli, errors
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import write_passage_store
from t5_retrieval.retrieval import index, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

KB = [Passage(str(i), f"page{i}", f"Title {i}", f"passage number {i} about topic {i % 3}") for i in range(12)]
EXAMPLE = {"id": "q1", "task": "nq", "query": "topic 1", "gold_pages": [["page1"]], "answers": ["x"],
           "positive_passages": ["1"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A data dir (kb/, examples/) with a lexical-baseline index over its KB."""
    root = tmp_path_factory.mktemp("errors")
    data_dir, emb_dir, idx_dir = str(root / "data"), str(root / "emb"), str(root / "idx")
    write_passage_store(((p, None) for p in KB), os.path.join(data_dir, "kb"))
    os.makedirs(os.path.join(data_dir, "examples"))
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=32), KB, [p.id for p in KB], emb_dir, progress=False)
    scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode="brute_force")).save(idx_dir)
    return {"data": data_dir, "emb": emb_dir, "index": idx_dir, "root": root}


def eval_args(dirs, output_dir: str, data_dir: str | None = None) -> list[str]:
    return ["eval", "--lexical_baseline_dim", "32", "--index_dir", dirs["index"], "--data_dir", data_dir or dirs["data"],
            "--tasks", "nq", "--output_dir", output_dir]


def run_t5r(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t5_retrieval.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_non_utf8_input_names_file_and_line_in_one_line_without_traceback(dirs, tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.symlink(os.path.join(dirs["data"], "kb"), data_dir / "kb")
    (data_dir / "examples").mkdir()
    path = data_dir / "examples" / "nq-dev.jsonl"
    path.write_bytes(json.dumps(EXAMPLE).encode() + b"\n" + b'{"id": "q2", "task": "nq", "query": "caf\xe9"}\n')
    proc = run_t5r(eval_args(dirs, str(tmp_path / "out"), str(data_dir)))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"t5r eval: error: {path}:2: not UTF-8 (byte 0xe9 at column 41); "
                                                "KILT files are UTF-8 json lines"], proc.stderr
    debug = run_t5r(["--debug", *eval_args(dirs, str(tmp_path / "out"), str(data_dir))])
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "DataError" in debug.stderr


def test_an_unwritable_output_dir_is_refused_before_any_retrieval(dirs, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli.main(eval_args(dirs, str(blocker / "out"))) == 2  # no nq-dev.jsonl either: the output comes first
    err = capsys.readouterr().err
    assert err.startswith(f"t5r eval: error: {blocker / 'out'}: --output_dir is not writable"), err


def test_a_truncated_kb_shard_names_the_shard(dirs, tmp_path, capsys):
    import shutil

    kb = tmp_path / "kb"
    shutil.copytree(os.path.join(dirs["data"], "kb"), kb)
    shard = next(p for p in kb.iterdir() if p.name.endswith(".jsonl"))
    shard.write_bytes(shard.read_bytes()[:-30])
    code = cli.main(["encode", "--lexical_baseline_dim", "32", "--kb_dir", str(kb), "--output_dir",
                     str(tmp_path / "emb"), "--no_progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"t5r encode: error: {shard}:"), err
    assert "rebuild" in err or "malformed json" in err, err


@pytest.mark.parametrize("damage", ["index.json", "scann"])
def test_a_damaged_index_names_what_is_damaged(dirs, tmp_path, capsys, damage):
    import shutil

    idx = tmp_path / "idx"
    shutil.copytree(dirs["index"], idx)
    if damage == "index.json":
        size = (idx / "index.json").stat().st_size
        (idx / "index.json").write_text('{"format": ')  # verified before it is parsed
        expected = f"{idx / 'index.json'}: 11 bytes where {size} were written (truncated or overwritten)"
    else:
        asset = max((p for p in (idx / "scann").iterdir() if p.suffix == ".npy"), key=lambda p: p.stat().st_size)
        size = asset.stat().st_size
        asset.write_bytes(asset.read_bytes()[:40])
        expected = f"{asset}: 40 bytes where {size} were written (truncated or overwritten)"
    args = eval_args(dirs, str(tmp_path / "out"))
    args[args.index("--index_dir") + 1] = str(idx)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"t5r eval: error: {expected}"), err


def test_a_full_disk_while_encoding_names_the_shard_and_keeps_finished_ones(tmp_path, monkeypatch, capsys):
    """ENOSPC cannot be produced here without a small filesystem; numpy's write is made to fail as it does."""
    real_save, calls = np.save, []

    def save(path, array):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\x93NUMPY partial")
            raise OSError(f"{array.nbytes} requested and 16 written")
        real_save(path, array)

    monkeypatch.setattr(np, "save", save)
    out = tmp_path / "emb"
    with pytest.raises(errors.UserError) as info:
        embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=32), KB, [p.id for p in KB], str(out),
                                         shard_size=4, progress=False)
    message = str(info.value)
    assert message.startswith(f"{out / 'shard-00001-of-00003.npy'}: no space left on the device"), message
    assert "rerun" in message
    assert sorted(os.listdir(out)) == ["manifest.json", "passage_ids.txt", "shard-00000-of-00003.npy",
                                       "shard-00000-of-00003.npy.sha256.json", "t5r_checksums.json",
                                       "t5r_verified.json"], \
        "the finished shard (and its checksum) stays; the partial one and its temporary file are gone"
    assert cli.user_message(OSError(errno.ENOSPC, "No space left on device", str(out / "x"))).startswith(
        f"{out / 'x'}: no space left on the device")


def test_the_next_encode_removes_a_crashed_runs_temporary_shards(tmp_path):
    out = tmp_path / "emb"
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=32), KB, [p.id for p in KB], str(out),
                                     shard_size=4, progress=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = artefact_io.temp_path("x").split(".tmp-")[1].rsplit("-", 1)[0]
    stale = out / f"shard-00001-of-00003.npy.tmp-{host}-{dead}.npy"
    legacy = out / f"shard-00002-of-00003.npy.tmp-{dead}.npy"
    other_host = out / f"shard-00002-of-00003.npy.tmp-otherhost-{dead}.npy"
    live = out / f"shard-00001-of-00003.npy.tmp-{host}-{os.getpid()}.npy"
    for path in (stale, legacy, other_host, live):
        path.write_bytes(b"partial")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=32), KB, [p.id for p in KB], str(out),
                                     shard_size=4, progress=False)
    assert not stale.exists() and not legacy.exists(), "a finished process's temporaries on this host are removed"
    assert other_host.exists() and live.exists(), "another host's or a running process's are kept"


def test_a_busy_port_is_refused_before_the_model_loads(dirs, capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code = cli.main(["serve", "--checkpoint_dir", "/nonexistent/model", "--index_dir", dirs["index"],
                         "--kb_dir", os.path.join(dirs["data"], "kb"), "--tasks", "nq", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"t5r serve: error: --port {port}: cannot listen on 127.0.0.1:{port}"), err


def test_encode_manifest_records_the_step_actually_restored(tmp_path):
    from tiny_model import build_tiny_run

    tiny = build_tiny_run(str(tmp_path))
    out = tmp_path / "emb_cli"
    from t5_retrieval.data import layout
    assert cli.main(["encode", "--checkpoint_dir", tiny.model_dirs[0], "--kb_dir", layout.kb_dir(tiny.data_dir),
                     "--output_dir", str(out), "--no_progress"]) == 0
    assert embedding_store.read_manifest(str(out)).meta["step"] == 0, "the tiny model's checkpoint is step 0"


def test_a_full_disk_while_checkpointing_names_the_checkpoint(tmp_path, monkeypatch):
    """tensorstore's words for a full disk vary ("Event loop is closed", short writes); the free space decides."""
    import shutil

    import jax.numpy as jnp

    from t5_retrieval import checkpoint

    mngr = checkpoint.manager(str(tmp_path / "model"), writer=True)
    checkpoint.save(mngr, 1, {"params": {"w": jnp.ones(3)}}, {})

    def failing_save(*args, **kwargs):
        raise RuntimeError("Event loop is closed")

    monkeypatch.setattr(mngr, "save", failing_save)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(errors.UserError, match=f"^{tmp_path / 'model' / '2'}: no space left on the device"):
        checkpoint.save(mngr, 2, {"params": {"w": jnp.ones(3)}}, {})
    monkeypatch.undo()
    assert mngr.all_steps() == [1], "the earlier checkpoint is kept"


def test_train_refuses_an_unwritable_model_dir_before_building_anything(tmp_path, capsys, clean_gin):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = cli.main(["train", "--model_dir", str(blocker / "model"), "--gin_file=models/t5_tiny.gin",
                     "--gin.train.batches=@RandomBatches", "--gin.train.num_steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"t5r train: error: {blocker / 'model'}: --model_dir is not writable"), err


def test_the_next_runs_remove_a_crashed_kb_build_and_partial_index_assets(dirs, tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    crashed_kb = tmp_path / f"kb.tmp-{dead}"
    crashed_kb.mkdir()
    (crashed_kb / "shard-00000.jsonl").write_text("{}\n")
    write_passage_store(((p, None) for p in KB), str(tmp_path / "kb"))
    assert not crashed_kb.exists(), "a crashed build's directory is removed by the next build"

    out = tmp_path / "idx"
    (out / "scann").mkdir(parents=True)
    (out / "scann" / "stale_asset.npy").write_bytes(b"half written")  # no index.json: a crashed save
    assert cli.main(["index", "--embeddings_dir", dirs["emb"], "--output_dir", str(out),
                     "--gin.ScannConfig.mode='brute_force'"]) == 0
    assert not (out / "scann" / "stale_asset.npy").exists()
    assert len(index.load_index(str(out))) == len(KB)


def test_a_missing_source_and_an_existing_output_are_one_line_errors(tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert cli.main(["data", "kb", "--source", str(missing), "--data_dir", str(tmp_path / "d")]) == 2
    assert capsys.readouterr().err.strip() == f"t5r data kb: error: {missing}: No such file or directory"
    write_passage_store(((p, None) for p in KB), str(tmp_path / "d" / "kb"))
    source = tmp_path / "passages.jsonl"
    source.write_text("".join(json.dumps({"id": p.id, "wikipedia_id": p.wikipedia_id, "title": p.title,
                                          "text": p.text}) + "\n" for p in KB))
    assert cli.main(["data", "kb", "--source", str(source), "--data_dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"t5r data kb: error: {tmp_path / 'd' / 'kb'} already exists") and "\n" == err[-1], err


def test_a_model_flag_conflict_exits_2_in_the_error_style(dirs, tmp_path, capsys):
    assert cli.main(["encode", "--kb_dir", os.path.join(dirs["data"], "kb"), "--output_dir", str(tmp_path / "e")]) == 2
    assert capsys.readouterr().err.strip() == \
        "t5r encode: error: give exactly one of --checkpoint_dir and --lexical_baseline_dim"


@pytest.mark.parametrize("damage", ["offsets gone", "store truncated"])
def test_serve_refuses_a_damaged_passage_store_before_listening(dirs, tmp_path, capsys, damage):
    import shutil

    kb = tmp_path / "kb"
    shutil.copytree(os.path.join(dirs["data"], "kb"), kb)
    if damage == "offsets gone":
        (damaged := kb / "passages-00000.offsets.npy").unlink()
        expected = f"{damaged}: missing (listed in {kb / 't5r_checksums.json'})"
    else:
        damaged = kb / "passages-00000.jsonl"
        size = damaged.stat().st_size
        damaged.write_bytes(damaged.read_bytes()[:size // 2])
        expected = f"{damaged}: {size // 2} bytes where {size} were written (truncated or overwritten)"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = cli.main(["serve", "--lexical_baseline_dim", "32", "--index_dir", dirs["index"], "--kb_dir", str(kb),
                     "--tasks", "nq", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"t5r serve: error: {expected}"), err
