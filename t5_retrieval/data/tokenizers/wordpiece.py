"""BERT's WordPiece vocabulary (`vocab.txt`) as a `seqio.Vocabulary`, tokenising in native code.

Tokenisation as BERT's reference tokenizer (Devlin et al. 2019; Hugging Face's slow `BertTokenizer`),
id for id: basic tokenisation (drop control characters, whitespace to spaces, spaces around CJK
ideographs, optionally lower-case and strip accents, split on whitespace and punctuation), then
greedy longest-match-first WordPiece per word (`##` marks a continuation; a word that cannot be
spelled, or is longer than 100 characters, is one [UNK]). Special tokens ([CLS] text [SEP],
padding 0) are not added here: `token_conventions` tells `t5_retrieval.data.tokenizers.tokenize` which they
are. The T5 sentinel `<extra_id_N>` of the TACO task prefixes becomes BERT's reserved token
`[unusedN]` (one learnable marker instead of seven word pieces).

Where the work runs. Basic tokenisation is whole-string operations of CPython's C core
(`str.translate`, `str.lower`, `unicodedata.normalize`, `re` substitutions with character classes
computed once from the same `unicodedata` predicates BERT's tokenizer uses), so it matches the
Python definition by construction, final sigma and Unicode version included; it leaves words
separated by single spaces. WordPiece runs in Rust (`tokenizers`' WordPiece model behind a
whitespace split), for a whole batch in one call. `tokenizers`' own BERT normaliser is not used:
it lower-cases character by character (no final sigma) and keeps unassigned code points that
BERT drops.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
import unicodedata
from collections.abc import Iterable, Sequence

import numpy as np
import seqio
import tensorflow as tf
import tokenizers

from t5_retrieval import artefact_io
from t5_retrieval.data.records import DataError
from t5_retrieval.data.tokenizers.conventions import PAD_ID, TokenConventions

MAX_CHARS_PER_WORD = 100
CONTINUATION = "##"
# T5's sentinels, as in the task prefix "FEVER <extra_id_1> ...": one reserved BERT token each.
SENTINEL = re.compile(r"<extra_id_(\d+)>")
SENTINEL_START = "<extra_id_"
# CJK Unified Ideographs and their extensions / compatibility blocks, as BERT's tokenizer lists them.
CJK_RANGES = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def _is_dropped(ch: str) -> bool:
    """NUL, U+FFFD and every "C" category (control, format, private use, unassigned) but tab/newline/CR."""
    return ch in "\x00\ufffd" or (ch not in "\t\n\r" and unicodedata.category(ch)[0] == "C")


def _is_punctuation(ch: str) -> bool:
    """Unicode punctuation, plus all non-alphanumeric ASCII (e.g. "^", "$", "`"), as in BERT."""
    return (ch.isascii() and ch.isprintable() and not ch.isalnum() and ch != " ") or unicodedata.category(ch)[0] == "P"


def _ranges(code_points: Iterable[int]) -> str:
    """`code_points` (sorted) as the inside of a regex character class: `a-b` ranges."""
    ranges: list[list[int]] = []
    for cp in code_points:
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)


def _char_class(code_points: list[int]) -> re.Pattern[str]:
    """A compiled pattern matching one character of `code_points`.

    `re` keeps a class's Basic Multilingual Plane part as a bitmap but its astral part as a list of
    ranges it scans in turn, for every character tried; a lookahead keeps that scan for astral
    characters (the dropped class alone has hundreds of astral ranges of unassigned code points).
    """
    bmp = [cp for cp in code_points if cp <= 0xFFFF]
    astral = [cp for cp in code_points if cp > 0xFFFF]
    pattern = f"[{_ranges(bmp)}]" if bmp else "(?!)"
    if astral:
        pattern += f"|(?=[\\U00010000-\\U0010ffff])[{_ranges(astral)}]"
    return re.compile(pattern)


@dataclasses.dataclass(frozen=True)
class _CharClasses:
    """The character sets of basic tokenisation, in the order they are applied."""

    dropped: re.Pattern[str]      # removed
    space: re.Pattern[str]        # -> " ": tab/newline/CR, "Zs", and what `str.split()` splits on besides
    cjk: re.Pattern[str]          # -> " c "
    accents: re.Pattern[str]      # "Mn", removed after NFD when lower-casing
    punctuation: re.Pattern[str]  # -> " p "


CHAR_CLASSES = ("dropped", "space", "cjk", "accents", "punctuation")  # `_CharClasses`' fields, in order


def code_point_sets(astral: bool) -> dict[str, tuple[int, ...]]:
    """The sorted code points of each class of basic tokenisation (CHAR_CLASSES), over all code points
    (`astral`) or over the Basic Multilingual Plane only. The SavedModel export builds its TF regular
    expressions from the same sets (`export/wordpiece_tf.py`)."""
    sets: dict[str, list[int]] = {name: [] for name in CHAR_CLASSES}
    cjk = {cp for a, b in CJK_RANGES for cp in range(a, b + 1)}
    for cp in range((sys.maxunicode if astral else 0xFFFF) + 1):
        ch = chr(cp)
        if _is_dropped(ch):
            sets["dropped"].append(cp)
        elif ch != " " and (ch in "\t\n\r" or ch.isspace() or unicodedata.category(ch) == "Zs"):
            sets["space"].append(cp)
        elif cp in cjk:
            sets["cjk"].append(cp)
        if unicodedata.category(ch) == "Mn":
            sets["accents"].append(cp)
        if _is_punctuation(ch):
            sets["punctuation"].append(cp)
    return {name: tuple(cps) for name, cps in sets.items()}


@functools.cache
def _char_classes(astral: bool) -> _CharClasses:
    """The classes over all code points (`astral`), or over the Basic Multilingual Plane only: a plain
    bitmap class, 3-7x faster to search, for the usual text without astral characters."""
    return _CharClasses(**{name: _char_class(list(cps)) for name, cps in code_point_sets(astral).items()})


def _classes_for(text: str) -> _CharClasses:
    """The Basic Multilingual Plane classes unless `text` holds an astral character."""
    return _char_classes(astral=max(text, default=" ") > "\uffff")


def _normalize_unicode(text: str, lower_case: bool) -> str:
    classes = _classes_for(text)
    text = classes.cjk.sub(r" \g<0> ", classes.space.sub(" ", classes.dropped.sub("", text)))
    if lower_case:
        text = unicodedata.normalize("NFD", text.lower())
        text = _classes_for(text).accents.sub("", text)  # lower-casing could change the planes used
    return _classes_for(text).punctuation.sub(r" \g<0> ", text)


@functools.cache
def _ascii_table(lower_case: bool) -> dict[int, str]:
    """`str.translate` table doing all of basic tokenisation for ASCII text (no character depends on its
    neighbours there), taken from the general path so the two cannot disagree."""
    return {cp: _normalize_unicode(chr(cp), lower_case) for cp in range(128)}


def normalize(text: str, lower_case: bool) -> str:
    """BERT's basic tokenisation as one string: its words and punctuation marks joined by spaces
    (possibly with extra spaces; split on whitespace to get the words)."""
    if text.isascii():
        return text.translate(_ascii_table(lower_case))
    return _normalize_unicode(text, lower_case)


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    """BERT's pre-tokenisation: cleaned, optionally lower-cased and accent-stripped words and punctuation."""
    return normalize(text, lower_case).split()


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
        self.tokens = tokens
        self._ids = {t: i for i, t in enumerate(tokens)}
        for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]"):
            if special not in self._ids:
                raise DataError(f"{vocab_file}: no {special} token; is this a BERT vocab.txt?")
        if self._ids["[PAD]"] != PAD_ID:
            raise DataError(f"{vocab_file}: [PAD] has id {self._ids['[PAD]']}, expected {PAD_ID}")
        self.cls_id, self.sep_id = self._ids["[CLS]"], self._ids["[SEP]"]
        self.token_conventions = TokenConventions(start_ids=(self.cls_id,), end_id=self.sep_id,
                                                  separator_id=self.sep_id)
        self._wordpiece = tokenizers.Tokenizer(tokenizers.models.WordPiece(
            self._ids, unk_token="[UNK]", continuing_subword_prefix=CONTINUATION,
            max_input_chars_per_word=MAX_CHARS_PER_WORD))
        # `normalize` leaves only spaces between words (every other whitespace character is mapped).
        self._wordpiece.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        super().__init__(extra_ids=extra_ids)

    @classmethod
    def from_path(cls, path: str) -> WordPieceVocabulary:
        """A `vocab.txt` or a model directory holding one; lower-casing follows a
        `tokenizer_config.json` next to it (`do_lower_case`, default True: uncased BERT)."""
        vocab_file = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
        config_file = os.path.join(os.path.dirname(vocab_file), "tokenizer_config.json")
        lower_case = True
        if os.path.exists(config_file):
            config = artefact_io.load_json_object(config_file, None, 1 << 20, DataError)
            lower_case = bool(config.get("do_lower_case", True))
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
        return len(self.tokens)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens), WordPiece for the whole batch in one native call."""
        words = [self._words(text) for text in texts]
        return [encoding.ids for encoding in self._wordpiece.encode_batch_fast(words, add_special_tokens=False)]

    def _words(self, text: str) -> str:
        """`text` basic-tokenised; a sentinel becomes the word `[unusedN]`, which WordPiece maps to
        that token (no basic-tokenised word can be it: brackets are always split off)."""
        if SENTINEL_START not in text:
            return normalize(text, self.lower_case)
        parts = SENTINEL.split(text)
        return " ".join(self._sentinel_token(int(part)) if i % 2 else normalize(part, self.lower_case)
                        for i, part in enumerate(parts))

    def _sentinel_token(self, n: int) -> str:
        token = f"[unused{n}]"
        if token not in self._ids:
            raise DataError(f"{self.vocab_file}: no {token} token for the query marker <extra_id_{n}>")
        return token

    def _encode(self, s: str) -> Sequence[int]:
        return self.encode_batch([s])[0]

    def _decode(self, ids: Iterable[int]) -> str:
        specials = {PAD_ID, self.cls_id, self.sep_id}
        text = " ".join(self.tokens[i] for i in ids if i not in specials and 0 <= i < len(self.tokens))
        return text.replace(f" {CONTINUATION}", "")

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        """A scalar string -> int32[n]; a vector of strings -> ragged int32[m, None]."""
        def encode_all(strings):
            rows = self.encode_batch([x.decode("utf-8") for x in np.asarray(strings.numpy()).reshape(-1)])
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
