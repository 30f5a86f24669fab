"""`t5r vocab train`: a sentencepiece model trained on the KB when no pretrained T5 vocabulary exists.

T5 conventions, so that `seqio.SentencePieceVocabulary(path, extra_ids=100)` and the model agree:
pad = 0, eos = 1, unk = 2, no bos; the 100 `<extra_id_*>` sentinels are added by seqio on top.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import sentencepiece as spm

from t5_retrieval.artefact_io import check_writable_dir
from t5_retrieval.data.stores.kb import PassageStore, passage_text
from t5_retrieval.errors import ConfigError

# Query prefixes and task-type markers must be spelled with known pieces (a KB may lack capitals).
_PREFIX_WORDS = "NQ TQA HOPO WOW TREX FEVER ZSRE AIDA QA FC SF EL DIAL Title: Text:"


def _sentences(store: PassageStore, max_sentences: int, failures: list[Exception]) -> Iterator[str]:
    """The training sentences; an error reading the store is kept in `failures` (sentencepiece turns
    whatever its iterator raises into a RuntimeError of its own)."""
    for _ in range(100):
        yield _PREFIX_WORDS
    try:
        for i, passage in enumerate(store):
            if i >= max_sentences:
                return
            yield passage_text(passage)
    except Exception as e:
        failures.append(e)
        raise


def train_vocabulary(kb_dir: str, out_prefix: str, vocab_size: int = 8000, max_sentences: int = 1_000_000) -> str:
    """Trains a unigram model on up to max_sentences passages; returns the `.model` path."""
    store = PassageStore.open(kb_dir)  # a wrong directory is named here, before sentencepiece starts
    # Named here: sentencepiece reports an unwritable output only after training, in its own words.
    check_writable_dir(os.path.dirname(os.path.abspath(out_prefix)), "--out")
    failures: list[Exception] = []
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(store, max_sentences, failures), model_prefix=out_prefix,
            vocab_size=vocab_size, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
            character_coverage=1.0, hard_vocab_limit=False, minloglevel=2)
    except RuntimeError as e:
        if failures:
            raise failures[0] from None
        raise ConfigError(f"vocab_size={vocab_size}: sentencepiece cannot train this vocabulary on {kb_dir} "
                          f"({e})") from None
    return f"{out_prefix}.model"
