"""Model-mined hard negatives (ANCE): the current model's top-k passages minus every gold page.

The output is the shared negatives format (`records.write_negatives`, best first), the same as the
BM25 negatives, so the next training episode reads them without knowing their source. With
`exclude_answers`, passages that contain an answer string are dropped too: MT-DPR's
"adversarial confounders" for answer-checkable QA, where such a passage may well be relevant.
"""

from __future__ import annotations

from collections.abc import Sequence

import gin

from t5_retrieval.data.kilt import answers
from t5_retrieval.data.records import Example, Negatives
from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.retrieval.encoder import Encoder
from t5_retrieval.retrieval.index import Index
from t5_retrieval.retrieval.search import searcher_for


@gin.configurable(denylist=["encoder", "index", "examples", "passages"])
def mine_negatives(
    encoder: Encoder | None,
    index: Index,
    examples: Sequence[Example],
    passages: PassageLookup,
    k: int = 110,
    exclude_answers: bool = False,
    batch_size: int = 128,
) -> list[Negatives]:
    """For each example (all of one task): top-k passages, in rank order, off every gold page.

    Positive passages are excluded as well (they are on gold pages whenever the data is consistent,
    but a positive must never come back as a negative). `encoder` None searches a BM25 index with the
    query texts.
    """
    by_task: dict[str, list[int]] = {}
    for i, example in enumerate(examples):
        by_task.setdefault(example.task, []).append(i)
    out: list[Negatives | None] = [None] * len(examples)
    for task, positions in by_task.items():
        found = searcher_for(encoder, index, task, batch_size).search([examples[i].query for i in positions], k)
        for i, (pids, _) in zip(positions, found):
            example = examples[i]
            gold_pages = {p for s in example.gold_pages for p in s}
            positives = set(example.positive_passages)
            negatives = [pid for pid in pids if pid not in positives and passages.page_of(pid) not in gold_pages]
            if exclude_answers and example.answers:
                negatives = [pid for pid in negatives if not answers.has_answer(passages.get(pid).text, example.answers)]
            out[i] = Negatives(example.id, tuple(negatives))
    return [n for n in out if n is not None]
