"""The tokenizer files of an exported directory: `tokenizer.json` (the fast tokenizer transformers and
sentence-transformers load without converting anything) beside the vocabulary and its
`tokenizer_config.json`.

Built with `tokenizers` (a runtime dependency), as transformers' own classes build them:

- WordPiece (BERT): `BertNormalizer` (lower-casing as the vocabulary records), `BertPreTokenizer`,
  WordPiece with `##` continuations, `[CLS] $A [SEP]`. The query markers a model's task prefixes
  use (`[unused1]`) are added as special tokens: BertTokenizer would split `[unused1]` into four
  pieces, while t5r reads it as one token.
- sentencepiece (T5): the model's pieces and scores as a Unigram model, seqio's 100 `<extra_id_*>`
  numbered down from the end of the vocabulary, the model's precompiled normaliser, whitespace
  split + Metaspace (`T5Tokenizer` in transformers 5), `$A </s>`. Reading the `.model` file needs
  protobuf (sentencepiece's `sentencepiece_model_pb2`), installed with TensorFlow.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import decoders, normalizers, pre_tokenizers, processors

from t5_retrieval.data.tokenizers.wordpiece import CONTINUATION, MAX_CHARS_PER_WORD, WordPieceVocabulary

T5_EXTRA_IDS = 100  # seqio's sentinels, `<extra_id_0>` the last id of the vocabulary
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
T5_SPECIALS = ("<pad>", "</s>", "<unk>")
BERT_VOCAB_FILE, T5_VOCAB_FILE = "vocab.txt", "spiece.model"  # the vocabulary as the export ships it


def write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def bert_tokenizer(vocab: WordPieceVocabulary, markers: Sequence[str]) -> tokenizers.Tokenizer:
    """BertTokenizer's pipeline over `vocab`, with `markers` (e.g. `[unused1]`) kept whole."""
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(
        ids, unk_token="[UNK]", continuing_subword_prefix=CONTINUATION, max_input_chars_per_word=MAX_CHARS_PER_WORD))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                      lowercase=vocab.lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab.cls_id), ("[SEP]", vocab.sep_id)])
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION)
    tokenizer.add_special_tokens([t for t in (*BERT_SPECIALS, *markers) if t in ids])
    return tokenizer


def t5_tokenizer(spm_path: str) -> tokenizers.Tokenizer:
    """T5Tokenizer's pipeline over a sentencepiece model, with seqio's sentinels."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # generated protobuf class
    with open(spm_path, "rb") as f:
        proto.ParseFromString(f.read())
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in range(T5_EXTRA_IDS - 1, -1, -1)]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id,
                                                               byte_fallback=proto.trainer_spec.byte_fallback))
    if proto.normalizer_spec.precompiled_charsmap:
        tokenizer.normalizer = normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    eos = next(i for i, (piece, _) in enumerate(vocab) if piece == "</s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", eos)])
    tokenizer.add_special_tokens([*T5_SPECIALS, *(f"<extra_id_{i}>" for i in range(T5_EXTRA_IDS))])
    return tokenizer


def write_bert_tokenizer(directory: str, vocabulary: str, max_length: int, markers: Sequence[str]) -> None:
    """vocab.txt, tokenizer.json and the BertTokenizer settings our WordPiece tokenisation uses."""
    vocab = WordPieceVocabulary.from_path(vocabulary)
    shutil.copyfile(vocab.vocab_file, os.path.join(directory, BERT_VOCAB_FILE))
    bert_tokenizer(vocab, markers).save(os.path.join(directory, "tokenizer.json"))
    write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "BertTokenizer", "do_lower_case": vocab.lower_case, "do_basic_tokenize": True,
        "tokenize_chinese_chars": True, "strip_accents": None, "unk_token": "[UNK]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]", "extra_special_tokens": list(markers),
        "model_max_length": max_length})


def write_t5_tokenizer(directory: str, vocabulary: str, max_length: int) -> None:
    """spiece.model, tokenizer.json and the T5Tokenizer settings (seqio's 100 sentinels)."""
    shutil.copyfile(vocabulary, os.path.join(directory, T5_VOCAB_FILE))
    t5_tokenizer(vocabulary).save(os.path.join(directory, "tokenizer.json"))
    write_json(os.path.join(directory, "tokenizer_config.json"), {
        "tokenizer_class": "T5Tokenizer", "extra_ids": T5_EXTRA_IDS, "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": max_length})
