"""A checksum record vouches for exactly the files it lists and is checked both ways; a malformed
record is one line naming the field; the stamp sees an in-place restore; `--verify=full` hashes what
the stamp would skip; `t5r encode` repairs a shard that fails its record; an interrupted write says so."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
from conftest import flip_byte

from t5_retrieval import checksums, cli
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore, write_passage_store
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder
from t5_retrieval.retrieval.index import build_index, load_index

KB = [Passage(str(i), f"page{i}", f"Title {i}", f"passage number {i} about topic {i % 3}") for i in range(12)]
EXAMPLE = {"id": "q1", "task": "nq", "query": "topic 1", "gold_pages": [["page1"]], "answers": ["x"],
           "positive_passages": ["1"]}


def one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"t5r {command}: error: "), err
    return err


def edit_record(directory: str, change) -> None:
    path = os.path.join(directory, checksums.CHECKSUMS_FILE)
    with open(path) as f:
        doc = json.load(f)
    with open(path, "w") as f:
        json.dump(change(doc), f)


def test_a_file_left_out_of_the_record_or_added_later_is_refused_not_skipped(artefact, capsys):
    edit_record(artefact, lambda doc: {**doc, "files": {"a.bin": doc["files"]["a.bin"]}})
    with pytest.raises(checksums.ChecksumError, match=r"sub/b.txt: not listed in .*t5r_checksums.json"):
        checksums.verify(artefact, "test artefact", "rebuild it")
    assert cli.main(["checksum", artefact]) == 2
    err = one_error_line(capsys, "checksum")
    # The hint is a command that works: accepting the directory as it is makes it verify again.
    assert err.endswith(f"t5r checksum --accept {artefact}"), err
    assert cli.main(["checksum", "--accept", artefact]) == 0
    open(os.path.join(artefact, f"{checksums.STAMP_FILE}.tmp-999"), "w").write("{")  # a killed stamp write
    checksums.verify(artefact, "test artefact", "rebuild it")
    open(os.path.join(artefact, "extra.bin"), "wb").write(b"planted")
    with pytest.raises(checksums.ChecksumError, match=r"extra.bin: not listed in"):
        checksums.verify(artefact, "test artefact", "rebuild it")


MALFORMED = {
    "a list": lambda doc: [doc],
    "files a list": lambda doc: {**doc, "files": list(doc["files"])},
    "files empty": lambda doc: {**doc, "files": {}},
    "no files": lambda doc: {"algorithm": "sha256"},
    "an entry without sha256": lambda doc: {**doc, "files": {**doc["files"], "a.bin": {"size": 5000}}},
    "a name outside the artefact": lambda doc: {**doc, "files": {**doc["files"], "../x": doc["files"]["a.bin"]}},
}


@pytest.mark.parametrize("shape", sorted(MALFORMED))
def test_a_malformed_record_is_one_line_naming_the_field_and_vouches_for_nothing(artefact, shape, capsys):
    edit_record(artefact, MALFORMED[shape])
    with pytest.raises(checksums.ChecksumError, match=r"t5r_checksums.json.*; rebuild it; or, if you have checked"):
        checksums.verify(artefact, "test artefact", "rebuild it")
    assert cli.main(["checksum", artefact]) == 2
    err = one_error_line(capsys, "checksum")
    assert "has no t5r_checksums.json" not in err, f"the record is there, only malformed: {err}"
    assert cli.main(["checksum", "--accept", artefact]) == 0, "the hinted command repairs it"
    assert cli.main(["checksum", artefact]) == 0


def test_a_malformed_stamp_is_ignored_and_the_files_hashed(artefact, monkeypatch):
    with open(os.path.join(artefact, checksums.STAMP_FILE), "w") as f:
        json.dump([["a.bin", 5000]], f)
    hashed = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda path: hashed.append(path) or real(path))
    checksums.verify(artefact, "test artefact", "rebuild it")
    assert sorted(os.path.basename(p) for p in hashed) == ["a.bin", "b.txt"]


def test_a_rotten_file_restored_in_place_with_cp_a_is_hashed_again(artefact, tmp_path):
    path = os.path.join(artefact, "a.bin")
    checksums.verify(artefact, "test artefact", "rebuild it")  # the stamp now vouches for a.bin's stat
    backup = str(tmp_path / "backup.bin")
    shutil.copy2(path, backup)
    flip_byte(backup, 10)  # the backup rotted: same size, same mtime once restored below
    before = os.stat(path)
    os.utime(backup, ns=(before.st_atime_ns, before.st_mtime_ns))
    time.sleep(0.02)  # file timestamps tick coarsely: let the restore's ctime differ from the write's
    shutil.copy2(backup, path)  # what `cp -a backup/x x` does: same inode, size and mtime
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(checksums.ChecksumError, match="a.bin: fails its sha256"):
        checksums.verify(artefact, "test artefact", "rebuild it")


def forge_stamp_over_rot(directory: str, name: str) -> str:
    """Flips a byte of `name` and writes the stamp as if that file's hash had matched since: a bit that
    rotted in place, which no stat shows."""
    path = os.path.join(directory, name)
    flip_byte(path, 5)
    with open(os.path.join(directory, checksums.STAMP_FILE)) as f:
        stamp = json.load(f)
    st = os.stat(path)
    stamp[name] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, stamp[name][-1]]
    with open(os.path.join(directory, checksums.STAMP_FILE), "w") as f:
        json.dump(stamp, f)
    return path


@pytest.fixture
def search_dirs(tmp_path) -> dict[str, str]:
    """A data dir (kb/, examples/) and an exact lexical-baseline index over its KB."""
    data, emb, index = str(tmp_path / "data"), str(tmp_path / "emb"), str(tmp_path / "index")
    write_passage_store(((p, None) for p in KB), os.path.join(data, "kb"))
    os.makedirs(os.path.join(data, "examples"))
    with open(os.path.join(data, "examples", "nq-dev.jsonl"), "w") as f:
        f.write(json.dumps(EXAMPLE) + "\n")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=32), KB, [p.id for p in KB], emb, progress=False)
    assert cli.main(["index", f"--embeddings_dir={emb}", f"--output_dir={index}", "--backend=exact"]) == 0
    return {"data": data, "kb": os.path.join(data, "kb"), "emb": emb, "index": index, "root": str(tmp_path)}


def test_verify_full_makes_eval_and_serve_hash_what_the_stamp_vouches_for(search_dirs, capsys):
    PassageStore.open(search_dirs["kb"])  # leaves the stamp
    rotten = forge_stamp_over_rot(search_dirs["kb"], "passages-00000.jsonl")
    capsys.readouterr()
    eval_args = ["eval", "--lexical_baseline_dim=32", f"--index_dir={search_dirs['index']}",
                 f"--data_dir={search_dirs['data']}", "--tasks=nq", f"--output_dir={search_dirs['root']}/out"]
    assert cli.main([*eval_args, "--verify=full"]) == 2
    assert f"{rotten}: fails its sha256 checksum" in one_error_line(capsys, "eval")
    assert cli.main(["serve", "--lexical_baseline_dim=32", f"--index_dir={search_dirs['index']}",
                     f"--kb_dir={search_dirs['kb']}", "--tasks=nq", "--port=0", "--verify=full"]) == 2
    assert f"{rotten}: fails its sha256 checksum" in one_error_line(capsys, "serve")


def test_verify_full_makes_index_hash_the_embeddings_manifest(search_dirs, capsys):
    embedding_store.check_complete(search_dirs["emb"])  # leaves the stamp
    rotten = forge_stamp_over_rot(search_dirs["emb"], embedding_store.IDS_FILE)
    assert cli.main(["index", f"--embeddings_dir={search_dirs['emb']}", f"--output_dir={search_dirs['root']}/i2",
                     "--backend=exact", "--verify=full"]) == 2
    assert f"{rotten}: fails its sha256 checksum" in one_error_line(capsys, "index")


def test_a_shard_without_its_sidecar_or_with_a_malformed_one_is_refused_in_one_line(search_dirs, capsys):
    shard = os.path.join(search_dirs["emb"], "shard-00000-of-00001.npy")
    with open(shard + checksums.SIDECAR_SUFFIX, "w") as f:
        json.dump([{"size": 1}], f)
    assert cli.main(["index", f"--embeddings_dir={search_dirs['emb']}", f"--output_dir={search_dirs['root']}/i2",
                     "--backend=exact"]) == 2
    assert f"{shard}{checksums.SIDECAR_SUFFIX}: not a checksum record" in one_error_line(capsys, "index")
    os.remove(shard + checksums.SIDECAR_SUFFIX)
    assert cli.main(["checksum", search_dirs["emb"]]) == 2
    assert f"{shard}: not listed in" in one_error_line(capsys, "checksum")


def test_rerunning_encode_rewrites_a_damaged_shard_and_one_without_its_sidecar(tmp_path):
    out, encoder, ids = str(tmp_path / "emb"), HashedBagOfWordsEncoder(dim=8), [p.id for p in KB]
    embedding_store.write_embeddings(encoder, KB, ids, out, shard_size=5, progress=False)
    expected = embedding_store.load_matrix(out)
    flip_byte(os.path.join(out, "shard-00001-of-00003.npy"), -3)
    os.remove(os.path.join(out, "shard-00002-of-00003.npy" + checksums.SIDECAR_SUFFIX))
    report = embedding_store.write_embeddings(encoder, KB, ids, out, shard_size=5, progress=False)
    assert report.shards_written == (1, 2) and report.shards_skipped == (0,), report
    np.testing.assert_array_equal(embedding_store.load_matrix(out), expected)
    assert cli.main(["checksum", out]) == 0


def test_an_index_write_stopped_before_its_record_says_so_and_names_the_rebuild(tmp_path, monkeypatch):
    emb, out = str(tmp_path / "emb"), str(tmp_path / "index")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), KB, [p.id for p in KB], emb, progress=False)
    index = build_index(emb, backend="exact")
    index.save(out)

    def killed(directory: str, names=None):
        raise KeyboardInterrupt  # the process dies between index.json and its record

    monkeypatch.setattr(checksums, "record", killed)
    with pytest.raises(KeyboardInterrupt):
        index.save(out)  # a rebuild over the finished index: its old record must not vouch for the new files
    monkeypatch.undo()
    with pytest.raises(checksums.ChecksumError) as raised:
        load_index(out)
    message = str(raised.value)
    assert "stopped before recording its checksums" in message and "older t5-retrieval" not in message, message
    command = message.rpartition("rebuild it: ")[2]
    assert command == f"t5r index --embeddings_dir={emb} --output_dir={out} --backend=exact", message
    assert cli.main(command.split()[1:]) == 0
    assert len(load_index(out)) == len(KB)
