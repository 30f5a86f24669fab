"""The original pure-Python BERT tokenisation, kept as the oracle for `t5_retrieval.data.tokenizers.wordpiece`.

A line-by-line transcription of Hugging Face's slow `BertTokenizer` (Devlin et al. 2019): basic
tokenisation (drop control characters, whitespace to spaces, spaces around CJK ideographs,
optionally lower-case and strip accents, split on whitespace and punctuation), then greedy
longest-match-first WordPiece per word. Slow (a Python loop per character) but obviously right;
the production tokeniser must produce exactly its ids.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable

from t5_retrieval.data.tokenizers.wordpiece import CONTINUATION, MAX_CHARS_PER_WORD, SENTINEL, WordPieceVocabulary


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


def wordpiece(word: str, ids: dict[str, int], unk_id: int) -> list[int]:
    """Greedy longest-match-first; a word that cannot be spelled, or is too long, is one [UNK]."""
    if len(word) > MAX_CHARS_PER_WORD:
        return [unk_id]
    out, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else CONTINUATION + word[start:end]
            if piece in ids:
                out.append(ids[piece])
                break
            end -= 1
        if end == start:  # no piece matches: the whole word is unknown
            return [unk_id]
        start = end
    return out


def encoder(vocab: WordPieceVocabulary) -> Callable[[str], list[int]]:
    """What `vocab.encode` must compute: each `<extra_id_N>` is `[unusedN]`, the rest WordPiece."""
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    word_ids = functools.lru_cache(maxsize=1 << 16)(lambda word: wordpiece(word, ids, vocab.unk_id))

    def encode(text: str) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(SENTINEL.split(text)):
            if i % 2:  # the number of an `<extra_id_N>` sentinel
                out.append(ids[f"[unused{int(part)}]"])
            else:
                out.extend(t for word in basic_tokenize(part, vocab.lower_case) for t in word_ids(word))
        return out

    return encode
