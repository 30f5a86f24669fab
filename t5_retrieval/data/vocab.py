"""`t5r vocab train`: a sentencepiece model trained on the KB when no pretrained T5 vocabulary exists.

T5 conventions, so that `seqio.SentencePieceVocabulary(path, extra_ids=100)` and the model agree:
pad = 0, eos = 1, unk = 2, no bos; the 100 `<extra_id_*>` sentinels are added by seqio on top.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import sentencepiece as spm

from t5_retrieval.data.kb import PassageStore, passage_text


# Query prefixes and task-type markers must be spelled with known pieces (a KB may lack capitals).
_PREFIX_WORDS = "NQ TQA HOPO WOW TREX FEVER ZSRE AIDA QA FC SF EL DIAL Title: Text:"


def _sentences(kb_dir: str, max_sentences: int) -> Iterator[str]:
    for _ in range(100):
        yield _PREFIX_WORDS
    for i, passage in enumerate(PassageStore.open(kb_dir)):
        if i >= max_sentences:
            return
        yield passage_text(passage)


def train_vocabulary(kb_dir: str, out_prefix: str, vocab_size: int = 8000, max_sentences: int = 1_000_000) -> str:
    """Trains a unigram model on up to max_sentences passages; returns the `.model` path."""
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_sentences(kb_dir, max_sentences), model_prefix=out_prefix, vocab_size=vocab_size,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2)
    return f"{out_prefix}.model"
