"""The query side of `inference.DualEncoderInference.encode_queries`, as TensorFlow ops.

A served SavedModel gets raw query strings, so it must turn them into token ids exactly as the
Python path does (`data.query_inputs.query_ids`), each query by its own task's prefix, length and
truncation:

  1. `[SEP]` -> `</s>`; every run of whitespace -> one space; leading/trailing space removed.
     "Whitespace" is Python's (`str.isspace`, what `re`'s `\\s` and `str.strip` use), spelled
     out as an explicit RE2 class: RE2's own `\\s` is ASCII-only.
  2. each `</s>`-separated segment is tokenized and the segments are joined with the vocabulary's
     separator id (`TokenConventions.separator_id`: EOS for T5, the T5 tokenizer's treatment of a
     literal `</s>`; [SEP] for BERT).
  3. "beginning": `"{NAME} <extra_id_1> {query}"` (or the bare query for a no-prefix task)
     tokenized, cut to `length - 1 - len(start ids)` ids. "mention" (entity linking): the prefix,
     then the window of `query_inputs.mention_window` around `[START_ENT] mention [END_ENT]`, the
     prefix, context, markers and mention tokenized as separate segments (a query without both
     markers is cut as "beginning").
  4. the start ids (none for T5, [CLS] for BERT) before, the end id (EOS, [SEP]) after, padded
     with 0 to the longest task's length (padding is masked, so a shorter task's embedding is that
     of its own length).

A tokenizer is anything with `tokenize(string[n]) -> int[n, (ids)]` (no special tokens) that gives
the Python vocabulary's ids: for T5, `tensorflow_text.SentencepieceTokenizer` built from the same
serialized model as the Python vocabulary, `seqio.SentencePieceVocabulary(...).sp_model` (the
`.model` file with seqio's 100 `<extra_id_*>` pieces added, so that `<extra_id_1>` in the prefix
is one token); for BERT, `export.wordpiece_tf.WordPieceTokenizer`.
"""

from __future__ import annotations

import functools
import re

import tensorflow as tf

from t5_retrieval.data.text import END_ENT, KILT_SEP, START_ENT, T5_EOS_TEXT, query_prefix
from t5_retrieval.data.tokenizers.conventions import PAD_ID, T5_CONVENTIONS, TokenConventions


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
    return [f"{query_prefix(name)} " if name else "" for name in prefix_names]


def encode(tokenizer, texts: tf.Tensor, separator_id: int) -> tf.RaggedTensor:
    """int32[batch, (ids)]: `data.tokenize.encode_batch` (no start or end ids) over a string vector."""
    segments = tf.strings.split(texts, sep=T5_EOS_TEXT)                        # [batch, (segments)]
    ids = tf.cast(tokenizer.tokenize(segments.flat_values), tf.int32)          # [segments, (ids)]
    ids = tf.concat([ids, tf.fill([ids.nrows(), 1], separator_id)], axis=1)    # a separator after every segment
    joined = segments.with_flat_values(ids).merge_dims(1, 2)                   # [batch, (ids)]
    return row_slices(joined, tf.zeros_like(joined.row_lengths()), joined.row_lengths() - 1)  # not the last


def select_rows(condition: tf.Tensor, a: tf.RaggedTensor, b: tf.RaggedTensor) -> tf.RaggedTensor:
    """Row r of `a` where `condition[r]`, else row r of `b` (ragged rows of their own lengths)."""
    rows = tf.range(tf.size(condition, out_type=tf.int64))
    return tf.gather(tf.concat([b, a], axis=0), tf.where(condition, rows + tf.size(rows, out_type=tf.int64), rows))


def row_slices(ids: tf.RaggedTensor, begin: tf.Tensor, end: tf.Tensor) -> tf.RaggedTensor:
    """Row r of `ids` cut to `[begin[r], end[r])` (bounds within the row)."""
    positions = tf.ragged.range(begin, end)
    flat = positions.values + tf.repeat(ids.row_starts(), positions.row_lengths())
    # Valid by construction (the lengths are those of `flat`), so without `validate`'s checks: each is
    # an Assert in a cond, slow to trace into the SavedModel's graph and run on every query.
    return tf.RaggedTensor.from_row_lengths(tf.gather(ids.values, flat), positions.row_lengths(), validate=False)


def _mention_parts(texts: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """(has both markers, left context, mention, right context): `query_inputs.split_mention`."""
    start, end = re.escape(START_ENT), re.escape(END_ENT)
    has = tf.strings.regex_full_match(texts, f"(?s).*{start}.*{end}.*")
    left = tf.strings.regex_replace(texts, f"(?s)^(.*?){start}.*$", r"\1")
    mention = tf.strings.regex_replace(texts, f"(?s)^.*?{start}(.*?){end}.*$", r"\1")
    right = tf.strings.regex_replace(texts, f"(?s)^.*?{start}.*?{end}(.*)$", r"\1")
    return has, left, mention, right


def encode_each(tokenizer, texts: list[tf.Tensor], separator_id: int) -> list[tf.RaggedTensor]:
    """`encode` of each of several string vectors of one length, by one call of the tokenizer: its
    ops (for WordPiece, long regular expressions) are built into the graph and run once, not per vector."""
    rows = tf.size(texts[0], out_type=tf.int64)
    ids = encode(tokenizer, tf.concat(texts, axis=0), separator_id)
    return [ids[i * rows:(i + 1) * rows] for i in range(len(texts))]


def _marker_ids(tokenizer, marker: str, separator_id: int) -> tf.Tensor:
    """int32[1, ids] of an entity marker, tokenized eagerly (`init_scope`) even while a function is
    traced: it does not depend on the input, so the graph holds its ids rather than a tokenizer's ops."""
    with tf.init_scope():
        return encode(tokenizer, tf.constant([marker]), separator_id).to_tensor()


def _mention_windows(prefix: tf.RaggedTensor, left: tf.RaggedTensor, mention: tf.RaggedTensor,
                     right: tf.RaggedTensor, markers: tuple[tf.Tensor, tf.Tensor], budgets: tf.Tensor
                     ) -> tf.RaggedTensor:
    """Prefix + `query_inputs.mention_window` of each text (which must hold both markers) in
    `budgets` ids (int64[batch], the prefix included), from the ids of its prefix, left context,
    mention and right context, and the start and end markers' ids (`_marker_ids`)."""
    start_marker, end_marker = (tf.RaggedTensor.from_tensor(tf.tile(m, [prefix.nrows(), 1])) for m in markers)
    marker_lengths = start_marker.row_lengths() + end_marker.row_lengths()
    budget = budgets - prefix.row_lengths()
    mention_kept = tf.minimum(mention.row_lengths(), tf.maximum(budget - marker_lengths, 0))
    rest = tf.maximum(budget - marker_lengths - mention_kept, 0)
    left_kept = tf.minimum(left.row_lengths(), tf.maximum(rest // 2, rest - right.row_lengths()))
    right_kept = tf.minimum(right.row_lengths(), rest - left_kept)
    zeros = tf.zeros_like(left_kept)
    return tf.concat([prefix, row_slices(left, left.row_lengths() - left_kept, left.row_lengths()), start_marker,
                      row_slices(mention, zeros, mention_kept), end_marker, row_slices(right, zeros, right_kept)],
                     axis=1)


def tokenize_queries(tokenizer, prefixes: tf.Tensor, texts: tf.Tensor, lengths: tf.Tensor, mention: tf.Tensor,
                     width: int, conventions: TokenConventions = T5_CONVENTIONS) -> tf.Tensor:
    """int32[batch, width]: `data.query_inputs.query_tokens` of each normalised query `texts[r]` with
    its task's prefix text (`prefix_strings`), length `lengths[r]` (<= width) and truncation
    (`mention[r]`: the mention window), in the vocabulary's `conventions`, padded to `width`."""
    start, separator = list(conventions.start_ids), conventions.separator_id
    budgets = tf.cast(lengths, tf.int64) - 1 - len(start)
    has_markers, left, mentioned, right = _mention_parts(texts)
    whole, prefix_ids, left_ids, mention_ids, right_ids = encode_each(
        tokenizer, [tf.strings.join([prefixes, texts]), prefixes, left, mentioned, right], separator)
    beginning = row_slices(whole, tf.zeros_like(budgets), tf.minimum(whole.row_lengths(), budgets))
    markers = (_marker_ids(tokenizer, START_ENT, separator), _marker_ids(tokenizer, END_ENT, separator))
    windowed = _mention_windows(prefix_ids, left_ids, mention_ids, right_ids, markers, budgets)
    ids = select_rows(tf.logical_and(mention, has_markers), windowed, beginning)
    starts = tf.tile(tf.constant(start, tf.int32, shape=[1, len(start)]), [ids.nrows(), 1])
    ids = tf.concat([starts, ids, tf.fill([ids.nrows(), 1], conventions.end_id)], axis=1)
    return ids.to_tensor(default_value=PAD_ID, shape=[None, width])


__all__ = ["encode", "encode_each", "normalize_queries", "prefix_strings", "row_slices", "select_rows", "tokenize_queries",
           "whitespace_class"]
