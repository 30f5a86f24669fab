"""The view of the knowledge base that retrieval needs: passages in id order and id lookups.

`t5_retrieval.data.stores.kb.PassageStore` satisfies `PassageLookup`; `PassageTable` is the same thing
over any list of `Passage` records, for tests and for callers that already hold the passages.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from t5_retrieval.data.records import DataError, Passage


@runtime_checkable
class PassageLookup(Protocol):
    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Passage]: ...

    def ids(self) -> Sequence[str]: ...

    def get(self, pid: str) -> Passage: ...

    def page_of(self, pid: str) -> str: ...


class PassageTable:
    """An in-memory `PassageLookup` over passages given in id order."""

    def __init__(self, passages: Iterable[Passage]):
        self._passages = list(passages)
        self._by_id = {p.id: p for p in self._passages}
        if len(self._by_id) != len(self._passages):
            raise DataError("PassageTable: passage ids must be unique")

    def __len__(self) -> int:
        return len(self._passages)

    def __iter__(self) -> Iterator[Passage]:
        return iter(self._passages)

    def __getitem__(self, index: int) -> Passage:
        return self._passages[index]

    def ids(self) -> list[str]:
        return [p.id for p in self._passages]

    def get(self, pid: str) -> Passage:
        try:
            return self._by_id[pid]
        except KeyError:
            raise KeyError(f"unknown passage id {pid!r}") from None

    def page_of(self, pid: str) -> str:
        return self.get(pid).wikipedia_id


def ids_digest(ids: Iterable[str]) -> str:
    """sha256 over the ordered passage ids: equal digests mean the same KB rows in the same order."""
    h = hashlib.sha256()
    for pid in ids:
        h.update(pid.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()
