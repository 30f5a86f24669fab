"""The built-in demo data: deterministic, KILT-shaped, lexically learnable; vocabulary training."""

import filecmp
import json
import os

import seqio

from t5_retrieval.data import layout
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_tasks
from t5_retrieval.data.kilt.synthetic import TASKS, write_demo
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
from t5_retrieval.retrieval import search
from t5_retrieval.retrieval.index import build_bm25_index


def test_demo_is_deterministic_and_labelled_synthetic(tmp_path):
    write_demo(str(tmp_path / "a"), num_pages=40, train_per_task=5, dev_per_task=2)
    write_demo(str(tmp_path / "b"), num_pages=40, train_per_task=5, dev_per_task=2)
    for name in ["kb/pages.jsonl"] + [f"{t}-train-kilt.jsonl" for t in TASKS]:
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False), f"{name} differs"
    assert "SYNTHETIC" in (tmp_path / "a" / "README.md").read_text()
    el = json.loads((tmp_path / "a" / "aidayago2-train-kilt.jsonl").read_text().splitlines()[0])
    assert "[START_ENT]" in el["input"] and "[END_ENT]" in el["input"]
    trex = json.loads((tmp_path / "a" / "trex-train-kilt.jsonl").read_text().splitlines()[0])
    assert " [SEP] " in trex["input"]


def test_demo_queries_share_words_with_their_gold_page(tmp_path):
    """Learnability proxy: lexical matching alone finds the gold page far above chance (1/300)."""
    write_demo(str(tmp_path / "raw"))
    prepare_kb(str(tmp_path / "raw" / "kb" / "pages.jsonl"), str(tmp_path))
    prepare_tasks(str(tmp_path / "raw"), str(tmp_path), TASKS, ("dev",))
    store = PassageStore.open(layout.kb_dir(str(tmp_path)))
    searcher = search.bm25_searcher(build_bm25_index(store))
    for task in TASKS:
        examples = read_examples(layout.examples_path(str(tmp_path), task, "dev"))
        found = searcher.search([e.query for e in examples], 50)
        hits = sum(bool(set(search.pages(r.passage_ids, store)[:5]) & set(e.gold_pages[0])) for e, r in zip(examples, found))
        assert hits / len(examples) > 0.5, f"{task}: only {hits}/{len(examples)} dev queries find a gold page in top 5"


def test_trained_vocabulary_follows_t5_conventions(tmp_path):
    write_demo(str(tmp_path / "raw"), num_pages=60, train_per_task=1, dev_per_task=1)
    prepare_kb(str(tmp_path / "raw" / "kb" / "pages.jsonl"), str(tmp_path))
    path = train_vocabulary(layout.kb_dir(str(tmp_path)), str(tmp_path / "spm"), vocab_size=400)
    vocab = seqio.SentencePieceVocabulary(path, extra_ids=100)
    assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    ids = vocab.encode("FEVER <extra_id_1> Title: x")
    assert vocab.unk_id not in ids, f"prefix words must be spelled with known pieces, got {ids}"
    assert vocab.vocab_size - 2 in ids, "<extra_id_1> must be one sentinel id"
    assert os.path.exists(str(tmp_path / "spm.vocab"))
