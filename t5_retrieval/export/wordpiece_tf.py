"""BERT's WordPiece tokenisation as TensorFlow ops: `data.tokenizers.wordpiece.WordPieceVocabulary`
inside the SavedModel, id for id.

    tokenizer = WordPieceTokenizer(vocabulary)
    ids = tokenizer.tokenize(tf.constant(["FEVER <extra_id_1> Héllo, 世界"]))  # int32[1, (ids)]

The steps are the Python tokenizer's, in its order:

1. T5's sentinels `<extra_id_N>` are cut out (`tensorflow_text.regex_split`, keeping them); each
   becomes the word `[unusedN]`, BERT's reserved token, and the text between them is tokenised alone.
2. Basic tokenisation with RE2 character classes written out from the very code point sets the
   Python tokenizer compiles (`wordpiece.code_point_sets`: Python's `unicodedata`, so the same
   Unicode version): dropped characters removed, whitespace to spaces, spaces around CJK
   ideographs; when the vocabulary lower-cases, `tf.strings.lower` (ICU's full lower-casing of the
   whole string, final sigma and dotted I included, as `str.lower`), NFD (`tensorflow_text.normalize_utf8`)
   and the nonspacing marks removed; spaces around punctuation.
3. Words split on spaces; a word of more than `MAX_CHARS_PER_WORD` characters is one [UNK]; every
   other word goes through `tensorflow_text.FastWordpieceTokenizer` (greedy longest match first,
   `##` continuations, a word it cannot spell is one [UNK]), built from the vocabulary's token list
   and held in the graph as a constant (no asset file, no path).

Where ICU and Python's `unicodedata` are of different Unicode versions, characters that only one
of them knows may lower-case or decompose differently; `tests/test_export_wordpiece.py` compares
the ids with the Python tokenizer's on accents, CJK, Greek, ligatures, full-width forms, control
and format characters, emoji, long words and empty strings.
"""

from __future__ import annotations

import functools

import tensorflow as tf
import tensorflow_text as tf_text

from t5_retrieval.data.tokenizers.wordpiece import (
    CONTINUATION,
    MAX_CHARS_PER_WORD,
    SENTINEL,
    WordPieceVocabulary,
    code_point_sets,
)
from t5_retrieval.export.preprocess import select_rows

# The Python tokenizer's sentinel pattern (`wordpiece.SENTINEL`), in RE2's syntax (the same here).
SENTINEL_RE2 = SENTINEL.pattern
SURROGATES = range(0xD800, 0xE000)  # not characters of UTF-8 text: RE2 takes no class with them


def re2_class(code_points: tuple[int, ...]) -> str:
    """An RE2 character class matching one of the sorted `code_points` (surrogates left out)."""
    ranges: list[list[int]] = []
    for cp in code_points:
        if cp in SURROGATES:
            continue
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "[" + "".join(f"\\x{{{a:x}}}" + (f"-\\x{{{b:x}}}" if b > a else "") for a, b in ranges) + "]"


@functools.cache
def re2_classes() -> dict[str, str]:
    """Each class of basic tokenisation (`wordpiece.CHAR_CLASSES`) over all code points, as RE2."""
    return {name: re2_class(cps) for name, cps in code_point_sets(astral=True).items()}


class WordPieceTokenizer(tf.Module):
    """`WordPieceVocabulary.encode_batch` (no special tokens) over a string vector."""

    def __init__(self, vocabulary: WordPieceVocabulary):
        super().__init__()
        self._lower_case = vocabulary.lower_case
        self._classes = re2_classes()
        self._unk_id = vocabulary.unk_id
        # Bytes are not the limit (a word of MAX_CHARS_PER_WORD characters may have 4 bytes each):
        # the character limit is applied in `tokenize`, as the Python tokenizer counts it.
        self._wordpiece = tf_text.FastWordpieceTokenizer(
            vocabulary.tokens, suffix_indicator=CONTINUATION, max_bytes_per_word=4 * MAX_CHARS_PER_WORD,
            token_out_type=tf.int32, unknown_token=vocabulary.tokens[self._unk_id], no_pretokenization=True)

    def normalize(self, texts: tf.Tensor) -> tf.Tensor:
        """`wordpiece.normalize` over a string tensor: its words joined by (runs of) spaces."""
        classes = self._classes
        texts = tf.strings.regex_replace(texts, classes["dropped"], "")
        texts = tf.strings.regex_replace(texts, classes["space"], " ")
        texts = tf.strings.regex_replace(texts, classes["cjk"], r" \0 ")
        if self._lower_case:
            texts = tf_text.normalize_utf8(tf.strings.lower(texts, encoding="utf-8"), "NFD")
            texts = tf.strings.regex_replace(texts, classes["accents"], "")
        return tf.strings.regex_replace(texts, classes["punctuation"], r" \0 ")

    def words(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """string[n] -> string[n, (words)]: each text's basic-tokenised words, a sentinel as `[unusedN]`."""
        # regex_split ends a text at a NUL; U+FFFD, dropped by `normalize` as NUL is, stands in for it.
        texts = tf.strings.regex_replace(texts, "\\x00", "\ufffd")
        pieces = tf_text.regex_split(texts, SENTINEL_RE2, SENTINEL_RE2)            # [n, (pieces)]
        flat = pieces.flat_values
        sentinel = tf.strings.regex_full_match(flat, SENTINEL_RE2)
        flat = tf.where(sentinel, tf.strings.regex_replace(flat, SENTINEL_RE2, r"[unused\1]"), self.normalize(flat))
        return pieces.with_flat_values(tf.strings.split(flat)).merge_dims(1, 2)

    def tokenize(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """int32[n, (ids)]: each text's token ids, without [CLS] and [SEP]."""
        words = self.words(texts)
        ids = self._wordpiece.tokenize(words.flat_values)                          # [words, (ids)]
        too_long = tf.strings.length(words.flat_values, unit="UTF8_CHAR") > MAX_CHARS_PER_WORD
        unk = tf.RaggedTensor.from_row_lengths(tf.fill(tf.shape(too_long), self._unk_id),
                                               tf.ones_like(too_long, tf.int64))
        ids = select_rows(too_long, unk, ids)
        return words.with_flat_values(ids).merge_dims(1, 2)


__all__ = ["WordPieceTokenizer", "re2_class", "re2_classes"]
