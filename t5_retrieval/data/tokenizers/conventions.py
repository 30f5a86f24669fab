"""The special tokens a model expects around a text, apart from any vocabulary.

Both vocabularies (sentencepiece for T5, WordPiece for BERT) and the tokeniser that applies them
read these; keeping them here is what lets `wordpiece` and `tokenize` not import each other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PAD_ID = 0
EOS_ID = 1


@dataclasses.dataclass(frozen=True)
class TokenConventions:
    """The special tokens a model expects around and inside a text (padding is always 0)."""

    start_ids: tuple[int, ...] = ()  # before the text: () for T5, ([CLS],) for BERT
    end_id: int = EOS_ID  # after the (truncated) text: EOS for T5, [SEP] for BERT
    separator_id: int = EOS_ID  # what a literal `</s>` inside the text becomes


T5_CONVENTIONS = TokenConventions()


def conventions_of(vocab: Any) -> TokenConventions:
    return getattr(vocab, "token_conventions", T5_CONVENTIONS)


