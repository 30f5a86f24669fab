"""Token ids for queries and passages: fixed length, padding id 0, special tokens set by the vocabulary.

T5 (the default): text, then EOS (1), truncated keeping EOS. BERT: `[CLS] text [SEP]`, truncated
keeping both. A vocabulary states its conventions with a `token_conventions` attribute
(`TokenConventions`); one without it (seqio.SentencePieceVocabulary) follows T5's.

A literal `</s>` in the text (KILT's `[SEP]` after normalisation) becomes the separator id: EOS for
T5, as the T5 tokenizer of the TACO reference does (sentencepiece alone would spell it out as
characters), and `[SEP]` for BERT.

A batch of texts is tokenised in one native call: sentencepiece's C++ batch encoder for T5,
`WordPieceVocabulary.encode_batch` (Rust WordPiece) for BERT.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any, Protocol, cast

import numpy as np

from t5_retrieval.data.text import T5_EOS_TEXT
from t5_retrieval.data.tokenizers.conventions import T5_CONVENTIONS, TokenConventions, conventions_of
from t5_retrieval.errors import ConfigError


class Vocabulary(Protocol):
    """What the batching needs from a vocabulary: a seqio.SentencePieceVocabulary (its C++
    sentencepiece processor is `tokenizer`) or a WordPieceVocabulary (`encode_batch`)."""

    def encode(self, s: str) -> Sequence[int]: ...


def _encode_strings(vocab: Vocabulary, strings: list[str]) -> list[list[int]]:
    """Token ids of each string in one native call: WordPiece's batch encoder, or sentencepiece's
    C++ batch encoder (the processor seqio's `encode` calls string by string). The batch encoder
    starts a thread pool per call, which costs ~3x the encoding of one passage: one string is
    encoded directly."""
    if hasattr(vocab, "encode_batch"):
        return vocab.encode_batch(strings)
    processor = cast(Any, vocab).tokenizer  # a SentencePieceVocabulary's
    if len(strings) == 1:
        return [processor.EncodeAsIds(strings[0])]
    return processor.encode(strings, out_type=int)


def encode_batch(vocab: Vocabulary, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text without start/end tokens; each literal `</s>` becomes the separator id."""
    separator = conventions_of(vocab).separator_id
    segments = [text.split(T5_EOS_TEXT) for text in texts]
    encoded = iter(_encode_strings(vocab, [segment for parts in segments for segment in parts]))
    out = []
    for parts in segments:
        ids = next(encoded)
        for _ in parts[1:]:
            ids = [*ids, separator, *next(encoded)]
        out.append(ids)
    return out


def encode_with_eos_markers(vocab: Vocabulary, text: str) -> list[int]:
    """Token ids of `text` without start/end tokens; each literal `</s>` becomes the separator id."""
    return encode_batch(vocab, [text])[0]


def to_fixed_length(ids: Sequence[int], length: int, conventions: TokenConventions = T5_CONVENTIONS
                    ) -> np.ndarray:
    """start ids + ids truncated to fit + end id, padded with 0: int32[length]."""
    out = np.zeros(length, np.int32)
    start = list(conventions.start_ids)
    ids = start + list(ids[: length - len(start) - 1]) + [conventions.end_id]
    out[: len(ids)] = ids
    return out


def encode_text(vocab: Vocabulary, text: str, length: int) -> np.ndarray:
    """One text -> int32[length] in the vocabulary's conventions."""
    return to_fixed_length(encode_with_eos_markers(vocab, text), length, conventions_of(vocab))


def tokenize(vocab: Vocabulary, texts: Sequence[str], length: int) -> np.ndarray:
    """int32[len(texts), length] token ids, each row [start ids] text end-id then padding; the whole
    batch is tokenised in one native call."""
    conventions = conventions_of(vocab)
    start, end = list(conventions.start_ids), conventions.end_id
    shortest = len(start) + 2
    if length < shortest:
        raise ConfigError(f"sequence length must be >= {shortest} (special tokens and one text token), got {length}")
    keep = length - len(start) - 1
    out = np.zeros((len(texts), length), np.int32)
    for i, ids in enumerate(encode_batch(vocab, texts)):
        row = [*start, *ids[:keep], end]
        out[i, : len(row)] = row
    return out


def is_wordpiece_path(path: str) -> bool:
    """A BERT `vocab.txt` (or a model directory holding one), rather than a sentencepiece model."""
    return path.endswith(".txt") or (os.path.isdir(path) and os.path.exists(os.path.join(path, "vocab.txt")))


def load_vocabulary(path: str) -> Any:
    """The vocabulary a recorded path names: a WordPiece `vocab.txt` (or its directory), else a
    sentencepiece model with T5's 100 extra ids."""
    if is_wordpiece_path(path):
        from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary

        return WordPieceVocabulary.from_path(path)
    import seqio

    return seqio.SentencePieceVocabulary(path, extra_ids=100)


def vocabulary_files(path: str) -> list[str]:
    """The files `load_vocabulary(path)` reads: a sentencepiece model, or a WordPiece `vocab.txt`
    with the `tokenizer_config.json` beside it when there is one (its lower-casing)."""
    if not is_wordpiece_path(path):
        return [path]
    vocab_file = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
    config_file = os.path.join(os.path.dirname(vocab_file), "tokenizer_config.json")
    return [vocab_file, *([config_file] if os.path.exists(config_file) else [])]


def vocabulary_digest(path: str) -> str:
    """A digest of the content `load_vocabulary(path)` reads (16 hex digits of sha256).

    A model's weights mean something only with the token ids it was trained on, and a path can come
    to hold another vocabulary: the digest, recorded at training time, lets loading refuse it.
    """
    digest = hashlib.sha256()
    if is_wordpiece_path(path):
        from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary

        vocab = WordPieceVocabulary.from_path(path)
        digest.update(f"wordpiece lower_case={vocab.lower_case}\n".encode())
        path = vocab.vocab_file
    with open(path, "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()[:16]
