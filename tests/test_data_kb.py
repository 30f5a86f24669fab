"""Passage store: chunking, sharded streamed writes, the reader contract, bad input."""

import json
import os

import pytest

from t5_retrieval.data.records import DataError, Passage
from t5_retrieval.data.stores.kb import PassageStore, build_kb, chunk_page, passage_text, write_passage_store


def _words(prefix, n):
    return " ".join(f"{prefix}{i}" for i in range(n))


def test_chunks_stay_within_sections_and_record_paragraph_spans():
    paragraphs = ["Alpha", _words("a", 60), _words("b", 90), "Section::::History.", _words("c", 30)]
    chunks = chunk_page("7", "Alpha", paragraphs, words_per_passage=100)
    texts = [p.text for p, _ in chunks]
    assert len(chunks) == 3, f"expected 150 words -> 2 chunks plus 1 for the section, got {texts}"
    assert [span for _, span in chunks] == [(1, 2), (2, 2), (4, 4)]
    assert all(len(t.split()) <= 100 for t in texts)
    assert "Section" not in " ".join(texts) and not texts[0].startswith("Alpha "), "title/header leaked into text"
    assert texts[2] == _words("c", 30), "a new section must start a new passage"
    assert [p.id for p, _ in chunks] == ["7_0", "7_1", "7_2"]


def test_store_round_trip_over_several_shards(tmp_path):
    src = tmp_path / "pages.jsonl"
    with open(src, "w") as f:
        for i in range(5):
            f.write(json.dumps({"wikipedia_id": f"p{i}", "wikipedia_title": f"T{i}",
                                "text": [_words(f"w{i}_", 150)]}) + "\n")
    manifest = build_kb(str(src), str(tmp_path / "kb"), passages_per_shard=3)
    store = PassageStore.open(tmp_path / "kb")
    assert manifest["num_passages"] == len(store) == 10 and store.num_pages == 5
    assert len(manifest["shards"]) == 4
    ids = store.ids()
    assert ids == [p.id for p in store] == [f"p{i}_{k}" for i in range(5) for k in range(2)]
    assert store.page_of("p3_1") == "p3"
    got = store.get("p3_1")
    assert got == Passage("p3_1", "p3", "T3", _words("w3_", 150).split(" ", 75)[-1])
    assert store.span_of("p3_1") == (0, 0)
    assert passage_text(got).startswith("Title: T3 Text: w3_75")
    with pytest.raises(KeyError, match="nope"):
        store.get("nope")


def test_dpr_tsv_layout_uses_title_as_page(tmp_path):
    src = tmp_path / "psgs_w100.tsv"
    src.write_text('id\ttext\ttitle\n1\t"Aaron is a prophet."\tAaron\n2\tHe spoke.\tAaron\n3\tBee text\tBee\n')
    build_kb(str(src), str(tmp_path / "kb"))
    store = PassageStore.open(tmp_path / "kb")
    assert store.ids() == ["1", "2", "3"] and store.num_pages == 2
    assert store.get("1").text == "Aaron is a prophet." and store.page_of("2") == "Aaron"
    assert store.span_of("1") is None


def test_a_missing_store_directory_is_named_as_missing_with_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as missing:
        PassageStore.open("data/kb")
    assert str(missing.value) == f"data/kb: no such directory (in the working directory {tmp_path})"


def test_unfinished_store_is_rejected(tmp_path):
    (tmp_path / "kb").mkdir()
    (tmp_path / "kb" / "passages-00000.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="no manifest.json"):
        PassageStore.open(tmp_path / "kb")


def test_interrupted_write_leaves_no_store(tmp_path):
    def passages():
        yield Passage("a", "p", "t", "x"), None
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        write_passage_store(passages(), str(tmp_path / "kb"))
    assert not os.path.exists(tmp_path / "kb"), "a crashed build must not leave the final directory"


def test_malformed_line_and_missing_field_name_file_and_line(tmp_path):
    src = tmp_path / "pages.jsonl"
    src.write_text('{"wikipedia_id": "1", "wikipedia_title": "A", "text": ["x"]}\n{broken\n')
    with pytest.raises(DataError, match=r"pages.jsonl:2: malformed json"):
        build_kb(str(src), str(tmp_path / "kb"))
    src.write_text('{"wikipedia_id": "1", "wikipedia_title": "A", "text": ["x"]}\n{"wikipedia_id": "2", "text": ["y"]}\n')
    with pytest.raises(DataError, match=r"pages.jsonl:2: missing field 'wikipedia_title'"):
        build_kb(str(src), str(tmp_path / "kb"))


def test_duplicate_passage_ids_are_an_error(tmp_path):
    rows = [(Passage("a", "p", "t", "x"), None), (Passage("a", "q", "t", "y"), None)]
    with pytest.raises(DataError, match="duplicate passage id 'a'"):
        write_passage_store(rows, str(tmp_path / "kb"))


def test_a_page_repeated_in_the_knowledge_source_names_both_lines(tmp_path):
    src = tmp_path / "pages.jsonl"
    rows = [{"wikipedia_id": w, "wikipedia_title": t, "text": [f"{t} text."]} for w, t in [("1", "A"), ("2", "B"), ("1", "C")]]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"pages.jsonl:3: page \(wikipedia_id\) '1' is also on line 1"):
        build_kb(str(src), str(tmp_path / "kb"))
    assert not (tmp_path / "kb").exists()


def test_a_passage_id_repeated_in_a_passages_file_or_dpr_tsv_names_both_lines(tmp_path):
    src = tmp_path / "passages.jsonl"
    rows = [{"id": i, "wikipedia_id": "p", "title": "T", "text": "x"} for i in ("a", "b", "c", "b")]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"passages.jsonl:4: passage id 'b' is also on line 2"):
        build_kb(str(src), str(tmp_path / "kb"))
    tsv = tmp_path / "psgs.tsv"
    tsv.write_text("id\ttext\ttitle\n1\tx\tT\n2\ty\tT\n1\tz\tT\n")
    with pytest.raises(DataError, match=r"psgs.tsv:4: passage id '1' is also on line 2"):
        build_kb(str(tsv), str(tmp_path / "kb"))


def test_a_knowledge_source_without_text_is_an_error_naming_it(tmp_path):
    src = tmp_path / "pages.jsonl"
    src.write_text(json.dumps({"wikipedia_id": "1", "wikipedia_title": "A", "text": ["A"]}) + "\n")
    with pytest.raises(DataError, match=r"pages.jsonl: no passages"):
        build_kb(str(src), str(tmp_path / "kb"))
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(DataError, match=r"empty.tsv: no passages"):
        build_kb(str(tmp_path / "empty.tsv"), str(tmp_path / "kb"))


def test_page_and_passage_ids_are_stripped_as_the_kilt_scorer_strips_them(tmp_path):
    src = tmp_path / "pages.jsonl"
    rows = [{"wikipedia_id": w, "wikipedia_title": t, "text": [f"{t} text."]} for w, t in [(" 1", "A"), ("1 ", "B")]]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"pages.jsonl:2: page \(wikipedia_id\) '1' is also on line 1"):
        build_kb(str(src), str(tmp_path / "kb"))
    passages = tmp_path / "passages.jsonl"
    passages.write_text(json.dumps({"id": " a\t", "wikipedia_id": "demo00002 ", "title": "T", "text": "x"}) + "\n")
    build_kb(str(passages), str(tmp_path / "kb"))
    store = PassageStore.open(tmp_path / "kb")
    assert store.ids() == ["a"] and store.page_of("a") == "demo00002", (store.ids(), store.num_pages)
    tsv = tmp_path / "psgs.tsv"
    tsv.write_text("id\ttext\ttitle\n 7 \tx\tT\n")
    build_kb(str(tsv), str(tmp_path / "kb_tsv"))
    assert PassageStore.open(tmp_path / "kb_tsv").ids() == ["7"]


@pytest.mark.parametrize("name, content, field", [
    ("pages.jsonl", {"wikipedia_id": "  ", "wikipedia_title": "A", "text": ["A text."]}, "wikipedia_id"),
    ("passages.jsonl", {"id": "", "wikipedia_id": "p", "title": "T", "text": "x"}, "id"),
    ("passages.jsonl", {"id": "a", "wikipedia_id": " ", "title": "T", "text": "x"}, "wikipedia_id"),
    ("psgs.tsv", "id\ttext\ttitle\n1\tx\tT\n \ty\tT\n", "id"),
])
def test_an_empty_page_or_passage_id_is_refused_naming_file_line_and_field(tmp_path, name, content, field):
    src = tmp_path / name
    src.write_text(content if isinstance(content, str) else json.dumps(content) + "\n")
    line = 3 if name.endswith(".tsv") else 1
    with pytest.raises(DataError, match=rf"{name}:{line}: field '{field}' is empty"):
        build_kb(str(src), str(tmp_path / "kb"))
    assert not (tmp_path / "kb").exists()
