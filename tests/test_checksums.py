"""Artefact checksums: recorded when an artefact is finished, verified when it is opened, the way a
damaged file really looks (a flipped byte, a truncated or a missing file, no record at all)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import flip_byte

from t5_retrieval import artefact_io, checksums, cli
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore, build_kb
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder


def test_a_recorded_artefact_verifies_and_every_kind_of_damage_names_the_file(artefact):
    checksums.verify(artefact, "test artefact", "rebuild it", full=True)
    original = open(os.path.join(artefact, "a.bin"), "rb").read()
    flip_byte(os.path.join(artefact, "a.bin"), 100)
    with pytest.raises(checksums.ChecksumError, match=r"a.bin: fails its sha256 checksum .*; rebuild it"):
        checksums.verify(artefact, "test artefact", "rebuild it")
    with open(os.path.join(artefact, "a.bin"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(checksums.ChecksumError, match=r"a.bin: 10 bytes where 5000 were written \(truncated"):
        checksums.verify(artefact, "test artefact", "rebuild it")
    open(os.path.join(artefact, "a.bin"), "wb").write(original)
    checksums.verify(artefact, "test artefact", "rebuild it")
    os.remove(os.path.join(artefact, "sub", "b.txt"))
    with pytest.raises(checksums.ChecksumError, match=r"sub/b.txt: missing \(listed in .*t5r_checksums.json\)"):
        checksums.verify(artefact, "test artefact", "rebuild it")


def test_the_stamp_skips_rehashing_unchanged_files_but_not_a_rewritten_one(artefact, monkeypatch):
    checksums.verify(artefact, "test artefact", "rebuild it")
    hashed = []
    real = checksums.sha256_file
    monkeypatch.setattr(checksums, "sha256_file", lambda path: hashed.append(path) or real(path))
    checksums.verify(artefact, "test artefact", "rebuild it")
    assert hashed == [], "files unchanged since the last verification are not hashed again"
    path = os.path.join(artefact, "sub", "b.txt")
    with open(path, "w") as f:
        f.write("hellO")  # same size, new content: the stat changes, so it is hashed and caught
    with pytest.raises(checksums.ChecksumError, match="b.txt: fails its sha256"):
        checksums.verify(artefact, "test artefact", "rebuild it")
    with pytest.raises(checksums.ChecksumError, match="b.txt: fails its sha256"):
        checksums.verify_all(artefact)


def test_a_full_disk_does_not_fail_a_verification_that_cannot_write_its_stamp(artefact, monkeypatch):
    """The stamp is a cache: on a full disk (simulated: none can be made here) verifying still passes."""

    def full(path, doc):
        raise artefact_io.disk_full(path)

    stamp = os.path.join(artefact, checksums.STAMP_FILE)
    if os.path.exists(stamp):
        os.remove(stamp)  # so that verifying hashes every file and writes a stamp
    written = []
    monkeypatch.setattr(checksums, "_write_json", lambda path, doc: written.append(path) or full(path, doc))
    checksums.verify(artefact, "test artefact", "rebuild it")
    assert written == [stamp] and not os.path.exists(stamp)


def test_an_artefact_without_a_record_is_refused_and_the_hinted_command_accepts_it(artefact, capsys):
    os.remove(os.path.join(artefact, checksums.CHECKSUMS_FILE))
    with pytest.raises(checksums.ChecksumError, match="has no t5r_checksums.json") as raised:
        checksums.verify(artefact, "test artefact", "rebuild it")
    hint = str(raised.value).rpartition(": ")[2]
    assert hint == f"t5r checksum --accept {artefact}"
    assert cli.main(hint.split()[1:]) == 0
    checksums.verify(artefact, "test artefact", "rebuild it")
    assert cli.main(["checksum", artefact]) == 0
    assert "2 files" in capsys.readouterr().out


def test_t5r_checksum_reports_a_damaged_file_as_one_line(artefact, capsys):
    flip_byte(os.path.join(artefact, "a.bin"))
    assert cli.main(["checksum", artefact]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"t5r checksum: error: {os.path.join(artefact, 'a.bin')}: fails its sha256"), err
    assert len(err.splitlines()) == 1


def kilt_pages(path) -> str:
    pages = [{"wikipedia_id": str(i), "wikipedia_title": f"T{i}", "text": [f"T{i}", f"page {i} says {i} things."]}
             for i in range(20)]
    path.write_text("".join(json.dumps(p) + "\n" for p in pages))
    return str(path)


def test_a_damaged_passage_store_is_refused_when_opened_naming_the_file(tmp_path):
    source = kilt_pages(tmp_path / "pages.jsonl")
    build_kb(source, str(tmp_path / "data" / "kb"))
    store = PassageStore.open(tmp_path / "data" / "kb")
    assert len(store) == 20
    flip_byte(str(tmp_path / "data" / "kb" / "passages-00000.jsonl"), 30)
    with pytest.raises(checksums.ChecksumError, match=r"passages-00000.jsonl: fails its sha256") as raised:
        PassageStore.open(tmp_path / "data" / "kb")
    # The hint rebuilds exactly this store.
    command = str(raised.value).rpartition("rebuild it: ")[2]
    assert command == (f"t5r data kb --source={source} --data_dir={tmp_path / 'data'} --words_per_passage=100 "
                       "--overwrite"), command
    assert cli.main(command.split()[1:]) == 0
    assert len(PassageStore.open(tmp_path / "data" / "kb")) == 20
    os.remove(tmp_path / "data" / "kb" / "passages-00000.offsets.npy")
    with pytest.raises(checksums.ChecksumError, match=r"passages-00000.offsets.npy: missing"):
        PassageStore.open(tmp_path / "data" / "kb")


def test_flipped_bytes_in_an_embedding_shard_stop_t5r_index(tmp_path, capsys):
    passages = [Passage(f"p{i}", f"w{i}", f"T{i}", f"text number {i}") for i in range(12)]
    out = str(tmp_path / "emb")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=8), passages, [p.id for p in passages], out,
                                     shard_size=5, progress=False)
    assert sorted(f for f in os.listdir(out) if f.endswith(checksums.SIDECAR_SUFFIX)) == [
        f"shard-0000{i}-of-00003.npy{checksums.SIDECAR_SUFFIX}" for i in range(3)]
    np.testing.assert_array_equal(embedding_store.load_matrix(out).shape, (12, 8))
    shard = os.path.join(out, "shard-00001-of-00003.npy")
    flip_byte(shard, -3)
    flip_byte(shard, -7)
    assert cli.main(["index", f"--embeddings_dir={out}", f"--output_dir={tmp_path / 'index'}"]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: fails its sha256 checksum" in err, err
    assert not os.path.exists(tmp_path / "index" / "index.json")


@pytest.mark.parametrize("backend", ["scann", "exact"])
def test_a_flipped_bit_in_an_index_asset_is_refused_at_load_and_the_hint_rebuilds_it(tmp_path, backend, capsys):
    from t5_retrieval.retrieval.index import load_index

    passages = [Passage(f"p{i}", f"w{i}", f"T{i}", f"text number {i} of many") for i in range(40)]
    emb, out = str(tmp_path / "emb"), str(tmp_path / "index")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=16), passages, [p.id for p in passages], emb,
                                     progress=False)
    assert cli.main(["index", f"--embeddings_dir={emb}", f"--output_dir={out}", f"--backend={backend}"]) == 0
    queries = HashedBagOfWordsEncoder(dim=16).encode_passages(passages[:3])
    before = load_index(out).search(queries, 5)
    # The largest asset holds the vectors (ScaNN's dataset.npy, the exact backend's embeddings.npy).
    asset = max((os.path.join(root, f) for root, _, files in os.walk(out) for f in files), key=os.path.getsize)
    flip_byte(asset, -2)
    with pytest.raises(checksums.ChecksumError, match=f"{asset}: fails its sha256") as raised:
        load_index(out)
    command = str(raised.value).rpartition("rebuild it: ")[2]
    assert command == f"t5r index --embeddings_dir={emb} --output_dir={out} --backend={backend}", command
    assert cli.main(command.split()[1:]) == 0
    after = load_index(out).search(queries, 5)
    for a, b in zip(before[0], after[0]):
        np.testing.assert_array_equal(a, b)
