"""The query side of `inference.DualEncoderInference.encode_queries`, as TensorFlow ops.

A served SavedModel gets raw query strings, so it must turn them into token ids exactly as the
Python path does (`data.text.format_query`, then `data.tokenize.tokenize`):

  1. `[SEP]` -> `</s>`; every run of whitespace -> one space; leading/trailing space removed.
     "Whitespace" is Python's (`str.isspace`, what `re`'s `\\s` and `str.strip` use), spelled
     out as an explicit RE2 class: RE2's own `\\s` is ASCII-only.
  2. the task prefix: `"{NAME} <extra_id_1> {query}"` (or the bare query for a no-prefix task).
  3. each `</s>`-separated segment is tokenized by sentencepiece and the segments are joined with
     the EOS id (the T5 tokenizer's treatment of a literal `</s>`).
  4. truncated to `length - 1` ids, EOS appended, padded with 0 to `length`.

The tokenizer must be built from the same serialized sentencepiece model as the Python
vocabulary: `seqio.SentencePieceVocabulary(...).sp_model`, i.e. the `.model` file with seqio's
100 `<extra_id_*>` pieces added, so that `<extra_id_1>` in the prefix is one token.
"""

from __future__ import annotations

import functools
import re

import tensorflow as tf

from t5_retrieval.data.text import EXTRA_ID_1, KILT_SEP, T5_EOS_TEXT
from t5_retrieval.data.tokenizers.conventions import EOS_ID, PAD_ID


@functools.cache
def whitespace_class() -> str:
    """An RE2 character class matching exactly the characters Python's `str.isspace` accepts."""
    chars = [c for c in range(0x110000) if chr(c).isspace()]
    return "[" + "".join(f"\\x{{{c:x}}}" for c in chars) + "]"


def normalize_queries(texts: tf.Tensor) -> tf.Tensor:
    """`data.text.normalize_query` over a string tensor."""
    texts = tf.strings.regex_replace(texts, re.escape(KILT_SEP), T5_EOS_TEXT)
    texts = tf.strings.regex_replace(texts, whitespace_class() + "+", " ")
    return tf.strings.regex_replace(texts, "^ | $", "")


def prefix_strings(prefix_names: list[str | None]) -> list[str]:
    """Per task, the text placed before the query ("" for a task trained without a prefix)."""
    return [f"{name} {EXTRA_ID_1} " if name else "" for name in prefix_names]


def tokenize_fixed(tokenizer, texts: tf.Tensor, length: int) -> tf.Tensor:
    """int32[batch, length]: `data.tokenize.tokenize` over formatted query strings."""
    if length < 2:
        raise ValueError(f"sequence length must be >= 2 (a token and EOS), got {length}")
    segments = tf.strings.split(texts, sep=T5_EOS_TEXT)                        # [batch, (segments)]
    ids = tf.cast(tokenizer.tokenize(segments.flat_values), tf.int32)          # [segments, (ids)]
    # EOS after every segment: the separators' EOS ids, plus the final EOS of the Python path.
    eos = tf.fill([ids.nrows(), 1], EOS_ID)
    ids = segments.with_flat_values(tf.concat([ids, eos], axis=1)).merge_dims(1, 2)  # [batch, (ids)]
    # Too long: keep length - 1 ids and end with EOS (the Python path truncates before appending it).
    dense = ids[:, :length].to_tensor(default_value=PAD_ID, shape=[None, length])
    last = tf.where(ids.row_lengths() > length, EOS_ID, dense[:, -1])
    return tf.concat([dense[:, :-1], last[:, None]], axis=1)


__all__ = ["normalize_queries", "prefix_strings", "tokenize_fixed", "whitespace_class"]
