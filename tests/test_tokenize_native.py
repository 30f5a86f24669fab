"""Native tokenisation gives exactly the ids of the original Python paths, for both families.

BERT: `WordPieceVocabulary` (C string operations + Rust WordPiece) against the pure-Python
transcription of BERT's tokenizer in `wordpiece_reference`. T5: `tokenize`'s batched sentencepiece
call against seqio's `encode`, string by string. Texts: a deterministic sample of real mini-KILT
passages and queries (every task file; the longest, most accented, CJK and punctuation-heavy ones
picked out) and hand-written edge cases. Run this file as a script to check all of mini-KILT.
"""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import seqio
from conftest import mini_kilt
from wordpiece_reference import encoder

from t5_retrieval.data.text import PASSAGE_TEMPLATES, T5_EOS_TEXT, format_passage, format_query
from t5_retrieval.data.tokenizers.conventions import TokenConventions, conventions_of
from t5_retrieval.data.tokenizers.tokenize import encode_batch, tokenize
from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary

SPM = os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece", "sentencepiece.model")
LENGTHS = (16, 256)  # truncating nearly every text, and the passage length (most texts fit)
EDGE_CASES = [
    "", " ", " \t\n\r\u3000\u2028 ", "\x00\x01\x7f\u200b\ufeff\ufffd", "a\x00b\u00adc",
    "x" * 100, "x" * 101, "é" * 101, "Supercalifragilisticexpialidocious" * 4, "word " * 400,
    "北京大学 is in 北京.", "ΟΔΟΣ ΣΑΣ. ΑΣ.Β",
    "İstanbul ǅemal ß ﬁne Ｆｕｌｌ ²", "Çà et là — «quoted» … ¿qué? ¡sí!", "!!!???...,,,;;;", "a--b__c^^d$$e``f",
    "Who is he? </s> born in </s>", "</s>", "FEVER <extra_id_1> a claim", "<extra_id_0><extra_id_1>x",
    "\U0001F600 emoji \U00010400\U0001D400 \U000E0001tag \U000F0000private", "ａｂｃ　ｄｅｆ。",
]


def _reference_ids(encode: Callable[[str], Sequence[int]], conventions: TokenConventions, text: str) -> list[int]:
    """The pre-native path: each `</s>`-separated segment encoded on its own, joined by the separator id."""
    ids: list[int] = []
    for j, segment in enumerate(text.split(T5_EOS_TEXT)):
        ids += ([conventions.separator_id] if j else []) + [int(t) for t in encode(segment)]
    return ids


def _mismatches(vocab, reference: Callable[[str], Sequence[int]], texts: list[str], length: int) -> list[str]:
    """Texts whose fixed-length rows differ from [start ids] reference ids (truncated) end-id, padding 0."""
    conventions = conventions_of(vocab)
    want = np.zeros((len(texts), length), np.int32)
    for i, text in enumerate(texts):
        ids = _reference_ids(reference, conventions, text)[: length - len(conventions.start_ids) - 1]
        row = [*conventions.start_ids, *ids, conventions.end_id]
        want[i, : len(row)] = row
    got = tokenize(vocab, texts, length)
    return [text for text, g, w in zip(texts, got, want) if not np.array_equal(g, w)]


# -- mini-KILT texts ----------------------------------------------------------------------------
def _accents(text: str) -> int:
    return sum(1 for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) == "Mn")


def _cjk(text: str) -> int:
    return sum(1 for c in text if unicodedata.name(c, "").startswith("CJK"))


def _punctuation(text: str) -> float:
    return sum(1 for c in text if unicodedata.category(c)[0] in "PS") / max(len(text), 1)


def _non_ascii(text: str) -> int:
    return sum(1 for c in text if not c.isascii())


def _sample(texts: list[str], first: int, picked: int) -> list[str]:
    """The first `first` texts plus, for each trait, the `picked` texts showing it most (ties in file order)."""
    chosen = dict.fromkeys(texts[:first])
    for trait in (len, _accents, _cjk, _punctuation, _non_ascii):
        ranked = sorted(range(len(texts)), key=lambda i: -trait(texts[i]))
        chosen.update(dict.fromkeys(texts[i] for i in ranked[:picked] if trait(texts[i])))
    return list(chosen)


def mini_kilt_passages() -> list[str]:
    """Every KB passage, in both passage templates alternately (as T5 and MiniLM see them)."""
    with open(mini_kilt("kb", "passages.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [format_passage(r["title"], r["text"], PASSAGE_TEMPLATES[i % 2]) for i, r in enumerate(records)]


def mini_kilt_queries() -> dict[str, list[str]]:
    """Per task file, its formatted queries (dev files with the TACO prefix, train files without)."""
    out = {}
    for name in sorted(os.listdir(mini_kilt())):
        if name.endswith("-kilt.jsonl"):
            prefix = name.split("-")[0].upper() if "-dev-" in name else None
            with open(mini_kilt(name), encoding="utf-8") as f:
                out[name] = [format_query(json.loads(line)["input"], prefix) for line in f]
    return out


@pytest.fixture(scope="module")
def mini_kilt_sample() -> list[str]:
    texts = _sample(mini_kilt_passages(), first=100, picked=20)
    for queries in mini_kilt_queries().values():
        texts += _sample(queries, first=10, picked=3)
    return texts


@pytest.fixture(scope="module")
def minilm() -> WordPieceVocabulary:
    from t5_retrieval.models.pretrained import minilm_l6_dir

    return WordPieceVocabulary.from_path(minilm_l6_dir())


# -- tests --------------------------------------------------------------------------------------
def test_sample_covers_every_task_file_and_the_hard_cases(mini_kilt_sample):
    assert len(mini_kilt_sample) >= 300
    assert any(_cjk(t) for t in mini_kilt_sample), "expected CJK text in the sample"
    assert any(_accents(t) > 5 for t in mini_kilt_sample), "expected accented text in the sample"
    assert any(T5_EOS_TEXT in t for t in mini_kilt_sample), "expected a T-REx query with </s>"
    assert any("<extra_id_1>" in t for t in mini_kilt_sample), "expected prefixed queries"


@pytest.mark.parametrize("length", LENGTHS)
def test_wordpiece_ids_equal_the_python_reference_on_mini_kilt(minilm, mini_kilt_sample, length):
    bad = _mismatches(minilm, encoder(minilm), mini_kilt_sample, length)
    assert not bad, f"{len(bad)} of {len(mini_kilt_sample)} texts differ from the Python reference, e.g. {bad[:3]}"


@pytest.mark.parametrize("length", LENGTHS)
def test_wordpiece_ids_equal_the_python_reference_on_edge_cases(minilm, length):
    bad = _mismatches(minilm, encoder(minilm), EDGE_CASES, length)
    assert not bad, f"edge cases differing from the Python reference: {bad}"


def test_cased_wordpiece_keeps_case_and_accents_like_the_reference(minilm, tmp_path):
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(minilm.tokens + ["Café", "ΟΔΟΣ"]) + "\n", encoding="utf-8")
    cased = WordPieceVocabulary(str(vocab_file), lower_case=False)
    texts = EDGE_CASES + ["Café CAFÉ café", "ΟΔΟΣ"]
    bad = _mismatches(cased, encoder(cased), texts, 64)
    assert not bad, f"cased texts differing from the Python reference: {bad}"


@pytest.mark.slow
def test_every_character_is_treated_like_the_reference_in_context(minilm):
    """Each code point of the Basic Multilingual Plane (and every 31st astral one) inside a word and
    after a capital sigma (final-sigma lower-casing looks at its neighbours)."""
    code_points = [cp for cp in range(0x10000) if not 0xD800 <= cp <= 0xDFFF] + list(range(0x10000, 0x110000, 31))
    texts = [f"a{chr(cp)}b Σ{chr(cp)}" for cp in code_points]
    reference = encoder(minilm)
    bad = [text for text, got in zip(texts, minilm.encode_batch(texts)) if got != reference(text)]
    assert not bad, f"{len(bad)} characters treated unlike the reference, e.g. {[hex(ord(t[1])) for t in bad[:10]]}"


def test_over_long_words_are_one_unknown_counted_in_characters_not_bytes(minilm):
    assert list(minilm.encode("é" * 100)) != [minilm.unk_id], "100 two-byte characters are not over-long"
    assert list(minilm.encode("é" * 101)) == [minilm.unk_id]


@pytest.mark.parametrize("length", LENGTHS)
def test_batched_sentencepiece_equals_seqio_string_by_string(mini_kilt_sample, length):
    vocab = seqio.SentencePieceVocabulary(SPM, extra_ids=100)
    texts = mini_kilt_sample + EDGE_CASES
    bad = _mismatches(vocab, vocab.encode, texts, length)
    assert not bad, f"{len(bad)} texts differ between the batched and the per-string sentencepiece path: {bad[:3]}"


def main() -> int:
    """Identity over ALL mini-KILT passages and queries (outside the test suite: ~10 minutes):
    `PYTHONPATH=. python tests/test_tokenize_native.py [T5 sentencepiece model; default seqio's test model]`."""
    from t5_retrieval.models.pretrained import minilm_l6_dir

    texts = mini_kilt_passages() + [q for queries in mini_kilt_queries().values() for q in queries]
    bert = WordPieceVocabulary.from_path(minilm_l6_dir())
    t5 = seqio.SentencePieceVocabulary(sys.argv[1] if len(sys.argv) > 1 else SPM, extra_ids=100)
    for name, vocab, reference in (("wordpiece", bert, encoder(bert)), ("sentencepiece", t5, t5.encode)):
        conventions = conventions_of(vocab)
        whole = sum(got != _reference_ids(reference, conventions, text)
                    for text, got in zip(texts, encode_batch(vocab, texts)))
        print(f"{name} untruncated ids: {whole} mismatches over {len(texts)} texts", flush=True)
        for length in LENGTHS:
            bad = _mismatches(vocab, reference, texts, length)
            print(f"{name} length {length}: {len(bad)} mismatches over {len(texts)} texts", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
