"""KILT retrieval metrics, as defined by the official scorer (`kilt/eval_retrieval.py`).

Plain functions over (gold evidence sets, ranked ids), independent of models, indexes and files,
so that every number this project reports can be checked against the KILT definitions by reading
one page. The definitions:

* Gold evidence sets are read from KILT files by `data.kilt` (ids stripped, one set per output
  with a `provenance` key, an empty list being a set that can never be found). A query with no
  evidence set at all is still a query: it scores 0 on every metric, and counts in every mean.
* Guesses are deduplicated keeping the first occurrence (`dedup_keep_first`), best first.
* **R-precision**: for each evidence set with R distinct ids, |top-R guesses in the set| / R;
  the max over evidence sets.
* **rank slots**: walking the guesses best first, a guess in no evidence set takes one slot
  (`False`); a guess in an evidence set moves that set's slot to the guess's position, and the
  slot becomes `True` when the set's last id is found. Identical evidence sets count once.
* **precision@k** = |True slots in the first k| / k; **recall@k** (k > 1) = |True slots in the
  first k| / number of distinct evidence sets; **success@k** (k > 1) = any True slot in the first k.

Passage-level R-precision (Maillard et al., 2021) is the same R-precision over passage ids, with
the gold passages as one evidence set. Answer-in-passage recall@k (DPR; Sciavolino 2022), whether
any of the top-k passage texts contains a normalised answer string, is in `data.answers`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

Id = TypeVar("Id", bound=Hashable)

# A slot in the rank: True (a completed evidence set), False (a non-gold guess) or
# ("partial", set_index) for an evidence set that has been started but not completed.
Slot = bool | tuple[str, int]


def dedup_keep_first(ids: Iterable[Id]) -> list[Id]:
    """Removes repeated ids keeping the first (best) occurrence, as KILT does for pages."""
    seen: set[Id] = set()
    out = []
    for i in ids:
        if i not in seen:
            seen.add(i)
            out.append(i)
    return out


def r_precision(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id]) -> float:
    """Max over evidence sets of |top-R guesses in the set| / R (0 for an empty set, and with no set)."""
    guesses = dedup_keep_first(guesses)
    best = 0.0
    for gold in gold_sets:
        gold = set(gold)
        if gold:
            best = max(best, sum(g in gold for g in guesses[:len(gold)]) / len(gold))
    return best


def rank_slots(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id]) -> tuple[list[Slot], int]:
    """The KILT rank: one slot per non-gold guess and one per evidence set (see module doc).

    Returns (slots, number of distinct evidence sets).
    """
    distinct: list[frozenset[Id]] = []
    for gold in gold_sets:
        gold = frozenset(gold)
        if gold not in distinct:
            distinct.append(gold)
    remaining = [set(s) for s in distinct]
    slots: list[Slot] = []
    for guess in dedup_keep_first(guesses):
        found = False
        for index, missing in enumerate(remaining):
            if guess not in missing:
                continue
            found = True
            partial = ("partial", index)
            if partial in slots:
                slots.remove(partial)
            missing.discard(guess)
            slots.append(True if not missing else partial)
        if not found:
            slots.append(False)
    return slots, len(distinct)


def _check_k(k: int, minimum: int) -> None:
    if k < minimum:
        raise ValueError(f"k must be >= {minimum}, got {k}")


def _precision(slots: list[Slot], num_sets: int, k: int) -> float:
    return slots[:k].count(True) / k if num_sets else 0.0


def _recall(slots: list[Slot], num_sets: int, k: int) -> float:
    return slots[:k].count(True) / num_sets if num_sets else 0.0


def _success(slots: list[Slot], num_sets: int, k: int) -> float:
    return float(True in slots[:k]) if num_sets else 0.0


def precision_at_k(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id], k: int) -> float:
    _check_k(k, 1)
    return _precision(*rank_slots(gold_sets, guesses), k)


def recall_at_k(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id], k: int) -> float:
    _check_k(k, 2)
    return _recall(*rank_slots(gold_sets, guesses), k)


def success_at_k(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id], k: int) -> float:
    _check_k(k, 2)
    return _success(*rank_slots(gold_sets, guesses), k)


def kilt_scores(gold_sets: Sequence[Iterable[Id]], guesses: Sequence[Id], ks: Sequence[int]) -> dict[str, float]:
    """All page-level KILT metrics for one query, with the official key names.

    precision@k for every k >= 1; recall@k and success_rate@k for k > 1 (as the official scorer).
    The rank slots are computed once and shared by every k.
    """
    gold_sets = [tuple(s) for s in gold_sets]
    slots, num_sets = rank_slots(gold_sets, guesses)
    out = {"Rprec": r_precision(gold_sets, guesses)}
    for k in sorted(set(ks)):
        _check_k(k, 1)
        out[f"precision@{k}"] = _precision(slots, num_sets, k)
        if k > 1:
            out[f"recall@{k}"] = _recall(slots, num_sets, k)
            out[f"success_rate@{k}"] = _success(slots, num_sets, k)
    return out


def mean_scores(per_query: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Averages per-query metric dicts key by key (the official scorer's average over queries)."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for scores in per_query:
        for key, value in scores.items():
            totals[key] = totals.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {key: totals[key] / counts[key] for key in totals}


def passage_r_precision(gold_passages: Iterable[Id], ranked_passages: Sequence[Id]) -> float:
    """Passage-level R-precision (Maillard et al.): the gold passages form one evidence set."""
    return r_precision([tuple(gold_passages)], ranked_passages)
