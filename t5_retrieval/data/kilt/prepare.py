"""The data stages as functions over one data directory (layout in `layout.py`, docs/data.md).

`t5r data kb|tasks|negatives` are thin flag parsers over these; tests and `make demo` call them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import gin

from t5_retrieval.data import layout
from t5_retrieval.data.kilt.examples import ConversionStats, convert_task_file, kilt_file
from t5_retrieval.data.kilt.negatives import TextIndex, bm25_query, mine_bm25_negatives
from t5_retrieval.data.records import Example, read_examples, write_jsonl_atomic, write_negatives
from t5_retrieval.data.stores import bm25
from t5_retrieval.data.stores.kb import PassageStore, build_kb
from t5_retrieval.errors import ConfigError


@gin.configurable
def prepare_kb(source: str, data_dir: str, words_per_passage: int = 100, passages_per_shard: int = 1_000_000,
               overwrite: bool = False) -> dict[str, Any]:
    return build_kb(source, layout.kb_dir(data_dir), words_per_passage=words_per_passage,
                    passages_per_shard=passages_per_shard, overwrite=overwrite)


class _LazyBM25:
    """Indexes the KB for BM25 only if some example needs a page-only positive on a multi-passage page
    (with `bm25.index_passages`, as `retrieval.bm25_index.build_bm25_index` does, so both score alike)."""

    def __init__(self, store: PassageStore):
        self.store = store
        self._retriever: Any = None  # a bm25s retriever

    @property
    def retriever(self) -> Any:
        if self._retriever is None:
            self._retriever = bm25.index_passages(self.store)
        return self._retriever

    def best_passage(self, query: str, candidates: Sequence[str]) -> str:
        positions = [self.store.index_of(pid) for pid in candidates]
        scores = bm25.score_subset(self.retriever, bm25_query(query), positions)
        return candidates[int(scores.argmax())]  # argmax keeps the first passage on ties


@gin.configurable
def prepare_tasks(input_dir: str, data_dir: str, tasks: Sequence[str], splits: Sequence[str] = ("train", "dev"),
                  min_bleu: float | None = None, max_train_examples: int | None = None, seed: int = 0,
                  strict: bool = False, bm25: _LazyBM25 | None = None) -> dict[str, ConversionStats]:
    """KILT files `{input_dir}/{task}-{split}-kilt.jsonl` -> `{data_dir}/examples/{task}-{split}.jsonl`.

    Downsampling (`max_train_examples`) and `min_bleu` apply to the train split only: other splits
    are evaluated, and must keep every gold label the official KILT scorer counts.
    """
    store = PassageStore.open(layout.kb_dir(data_dir))
    bm25 = bm25 or _LazyBM25(store)
    paths = {(t, s): kilt_file(input_dir, t, s) for t in tasks for s in splits}  # fail early on unknown names
    os.makedirs(os.path.join(data_dir, "examples"), exist_ok=True)
    out = {}
    for (task, split), path in paths.items():
        examples, stats = convert_task_file(
            path, task, store, bm25.best_passage, min_bleu=min_bleu if split == "train" else None, strict=strict,
            seed=seed, max_examples=max_train_examples if split == "train" else None)
        with open(layout.stats_path(data_dir, task, split), "w", encoding="utf-8") as f:
            json.dump(stats.to_json(), f, indent=1)
        write_jsonl_atomic(layout.examples_path(data_dir, task, split), (e.to_json() for e in examples))
        out[f"{task}-{split}"] = stats
    return out


def prepare_missing(kb_source: str, input_dir: str, data_dir: str, tasks: Sequence[str],
                    bm25_index: Callable[[str], TextIndex]) -> None:
    """The KB (from `kb_source`), the examples and the BM25 negatives of `tasks`, each built only
    when its output is missing, so an interrupted preparation resumes. `bm25_index(kb_dir)`: the
    BM25 index the negatives are mined with (`retrieval.index.build_bm25_index_for_kb`)."""
    if not os.path.exists(os.path.join(layout.kb_dir(data_dir), "manifest.json")):
        prepare_kb(kb_source, data_dir)
    if not all(os.path.exists(layout.examples_path(data_dir, t, "dev")) for t in tasks):
        prepare_tasks(input_dir, data_dir, tasks)
    if not all(os.path.exists(layout.negatives_path(layout.negatives_dir(data_dir), t)) for t in tasks):
        prepare_negatives(data_dir, tasks, index=bm25_index(layout.kb_dir(data_dir)))


@gin.configurable
def prepare_negatives(data_dir: str, tasks: Sequence[str], splits: Sequence[str] = ("train",), top_k: int = 100, *,
                      index: TextIndex, read: Callable[[str, str], Sequence[Example]] | None = None) -> dict[str, int]:
    """BM25 negatives for each task/split -> `{data_dir}/negatives/bm25/{task}-{split}.jsonl`.

    `index`: BM25 over the KB of `data_dir` (`retrieval.index.build_bm25_index_for_kb(layout.kb_dir(data_dir))`,
    or a loaded `t5r index --backend=bm25`); refused if its passages are not that KB's.
    `read(task, split)`: the examples to mine for; default the processed KILT file
    `{data_dir}/examples/{task}-{split}.jsonl` (`t5r data negatives` also reads seqio Tasks)."""
    if top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {top_k}")
    store = PassageStore.open(layout.kb_dir(data_dir))
    index.check(passage_ids=store.ids())  # IndexMismatchError naming the index: built from another KB
    directory = layout.negatives_dir(data_dir, "bm25")
    os.makedirs(directory, exist_ok=True)
    counts = {}
    for task in tasks:
        for split in splits:
            examples = read(task, split) if read else read_examples(layout.examples_path(data_dir, task, split))
            counts[f"{task}-{split}"] = write_negatives(layout.negatives_path(directory, task, split),
                                                        mine_bm25_negatives(examples, index, store, top_k))
    return counts
