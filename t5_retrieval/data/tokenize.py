"""Token ids for queries and passages in T5 conventions: pad 0, EOS 1 appended, truncated keeping EOS.

A literal `</s>` in the text (KILT's `[SEP]` after normalisation) becomes the EOS id, as the T5
tokenizer of the TACO reference does; sentencepiece alone would spell it out as characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from t5_retrieval.data.text import T5_EOS_TEXT

PAD_ID = 0
EOS_ID = 1


class Vocabulary(Protocol):
    """What the batching needs from a vocabulary (seqio.SentencePieceVocabulary satisfies it)."""

    def encode(self, s: str) -> Sequence[int]: ...


def encode_with_eos_markers(vocab: Vocabulary, text: str) -> list[int]:
    ids: list[int] = []
    for i, segment in enumerate(text.split(T5_EOS_TEXT)):
        if i:
            ids.append(EOS_ID)
        ids.extend(int(t) for t in vocab.encode(segment))
    return ids


def to_fixed_length(ids: Sequence[int], length: int) -> np.ndarray:
    """Truncates to length - 1, appends EOS, pads with 0: int32[length]."""
    out = np.zeros(length, np.int32)
    ids = list(ids[: length - 1]) + [EOS_ID]
    out[: len(ids)] = ids
    return out


def tokenize(vocab: Vocabulary, texts: Sequence[str], length: int) -> np.ndarray:
    """int32[len(texts), length] token ids, each row ending with EOS then padding."""
    if length < 2:
        raise ValueError(f"sequence length must be >= 2 (a token and EOS), got {length}")
    out = np.zeros((len(texts), length), np.int32)
    for i, text in enumerate(texts):
        out[i] = to_fixed_length(encode_with_eos_markers(vocab, text), length)
    return out
