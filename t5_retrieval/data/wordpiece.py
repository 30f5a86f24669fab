"""BERT's WordPiece vocabulary (`vocab.txt`) as a `seqio.Vocabulary`, in plain Python.

Tokenisation as BERT's reference tokenizer (Devlin et al. 2019; Hugging Face `BertTokenizer`):
basic tokenisation (drop control characters, whitespace to spaces, spaces around CJK ideographs,
optionally lower-case and strip accents, split on whitespace and punctuation), then greedy
longest-match-first WordPiece per word (`##` marks a continuation; a word that cannot be spelled,
or is longer than 100 characters, is one [UNK]). Special tokens ([CLS] text [SEP], padding 0) are
not added here: `token_conventions` tells `t5_retrieval.data.tokenize` which they are. The T5
sentinel `<extra_id_N>` of the TACO task prefixes becomes BERT's reserved token `[unusedN]` (one
learnable marker instead of seven word pieces).
"""

from __future__ import annotations

import functools
import json
import os
import re
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import seqio
import tensorflow as tf

from t5_retrieval.data.tokenize import PAD_ID, TokenConventions

MAX_CHARS_PER_WORD = 100
CONTINUATION = "##"
# T5's sentinels, as in the task prefix "FEVER <extra_id_1> ...": one reserved BERT token each.
SENTINEL = re.compile(r"<extra_id_(\d+)>")


def _is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch).startswith("C")


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or unicodedata.category(ch) == "Zs"


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    # All non-alphanumeric ASCII counts as punctuation (e.g. "^", "$", "`"), as in BERT.
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """BERT's pre-tokenisation: cleaned, optionally lower-cased and accent-stripped words and punctuation."""
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            chars.append(" ")
        elif _is_cjk(cp):
            chars.append(f" {ch} ")
        else:
            chars.append(ch)
    text = "".join(chars)
    if lower_case:
        text = "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")
    words = []
    for word in text.split():
        current = ""
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    words.append(current)
                words.append(ch)
                current = ""
            else:
                current += ch
        if current:
            words.append(current)
    return words


class WordPieceVocabulary(seqio.Vocabulary):
    """A BERT `vocab.txt` (one token per line, id = line number, [PAD] = 0).

    `eos_id` is [SEP], so seqio's `append_eos` ends a sequence the BERT way; `token_conventions`
    gives the batcher `[CLS] text [SEP]`.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True, extra_ids: int = 0):
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.rstrip("\n") for line in f]
        self.vocab_file = os.path.abspath(vocab_file)
        self.lower_case = lower_case
        self._tokens = tokens
        self._ids = {t: i for i, t in enumerate(tokens)}
        for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]"):
            if special not in self._ids:
                raise ValueError(f"{vocab_file}: no {special} token; is this a BERT vocab.txt?")
        if self._ids["[PAD]"] != PAD_ID:
            raise ValueError(f"{vocab_file}: [PAD] has id {self._ids['[PAD]']}, expected {PAD_ID}")
        self.cls_id, self.sep_id = self._ids["[CLS]"], self._ids["[SEP]"]
        self.token_conventions = TokenConventions(start_ids=(self.cls_id,), end_id=self.sep_id,
                                                  separator_id=self.sep_id)
        self._word_ids = functools.lru_cache(maxsize=1 << 16)(self._wordpiece)
        super().__init__(extra_ids=extra_ids)

    @classmethod
    def from_path(cls, path: str) -> "WordPieceVocabulary":
        """A `vocab.txt` or a model directory holding one; lower-casing follows a
        `tokenizer_config.json` next to it (`do_lower_case`, default True: uncased BERT)."""
        vocab_file = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
        config_file = os.path.join(os.path.dirname(vocab_file), "tokenizer_config.json")
        lower_case = True
        if os.path.exists(config_file):
            with open(config_file) as f:
                lower_case = bool(json.load(f).get("do_lower_case", True))
        return cls(vocab_file, lower_case=lower_case)

    # -- seqio.Vocabulary ----------------------------------------------------------------------
    @property
    def eos_id(self) -> int:
        return self.sep_id

    @property
    def unk_id(self) -> int:
        return self._ids["[UNK]"]

    @property
    def _base_vocab_size(self) -> int:
        return len(self._tokens)

    def _wordpiece(self, word: str) -> tuple[int, ...]:
        if len(word) > MAX_CHARS_PER_WORD:
            return (self.unk_id,)
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else CONTINUATION + word[start:end]
                if piece in self._ids:
                    ids.append(self._ids[piece])
                    break
                end -= 1
            if end == start:  # no piece matches: the whole word is unknown
                return (self.unk_id,)
            start = end
        return tuple(ids)

    def _encode(self, s: str) -> Sequence[int]:
        ids: list[int] = []
        for i, part in enumerate(SENTINEL.split(s)):
            if i % 2:  # the number of an `<extra_id_N>` sentinel
                ids.append(self._sentinel_id(int(part)))
            else:
                ids.extend(t for word in basic_tokenize(part, self.lower_case) for t in self._word_ids(word))
        return ids

    def _sentinel_id(self, n: int) -> int:
        token = f"[unused{n}]"
        if token not in self._ids:
            raise ValueError(f"{self.vocab_file}: no {token} token for the query marker <extra_id_{n}>")
        return self._ids[token]

    def _decode(self, ids: Iterable[int]) -> str:
        specials = {PAD_ID, self.cls_id, self.sep_id}
        text = " ".join(self._tokens[i] for i in ids if i not in specials and 0 <= i < len(self._tokens))
        return text.replace(f" {CONTINUATION}", "")

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        """A scalar string -> int32[n]; a vector of strings -> ragged int32[m, None]."""
        def encode_all(strings):
            rows = [self._encode(x.decode("utf-8")) for x in np.asarray(strings.numpy()).reshape(-1)]
            return ([i for row in rows for i in row], [len(row) for row in rows])

        flat, lengths = tf.py_function(encode_all, [s], [tf.int32, tf.int64])
        flat.set_shape([None])
        if s.shape.rank == 0:
            return flat
        return tf.RaggedTensor.from_row_lengths(flat, lengths)

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        """int32[..., n] -> string[...]."""
        def decode_all(rows):
            rows = rows.numpy()
            flat = rows.reshape(-1, rows.shape[-1])
            return np.array([self._decode(row.tolist()).encode("utf-8") for row in flat], dtype=object)

        out = tf.py_function(decode_all, [ids], tf.string)
        return tf.reshape(out, tf.shape(ids)[:-1])

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, WordPieceVocabulary) and self.vocab_file == other.vocab_file
                and self.lower_case == other.lower_case and self.extra_ids == other.extra_ids)

    def __hash__(self) -> int:
        return hash((self.vocab_file, self.lower_case, self.extra_ids))
