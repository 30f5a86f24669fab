"""Where the processed data lives under one data directory (see docs/data.md).

    <data_dir>/kb/                                  passage store (t5r data kb)
    <data_dir>/examples/{task}-{split}.jsonl        Example.to_json() rows (t5r data tasks)
    <data_dir>/examples/{task}-{split}.stats.json   conversion counts
    <data_dir>/negatives/{source}/{task}-{split}.jsonl  {"id", "negatives"} rows; source = bm25,
                                                    or e.g. ance-1 for model-mined episodes
"""

from __future__ import annotations

import os


def kb_dir(data_dir: str) -> str:
    return os.path.join(data_dir, "kb")


def examples_path(data_dir: str, task: str, split: str) -> str:
    return os.path.join(data_dir, "examples", f"{task}-{split}.jsonl")


def stats_path(data_dir: str, task: str, split: str) -> str:
    return os.path.join(data_dir, "examples", f"{task}-{split}.stats.json")


def negatives_dir(data_dir: str, source: str = "bm25") -> str:
    return os.path.join(data_dir, "negatives", source)


def negatives_path(negatives_dir_: str, task: str, split: str = "train") -> str:
    return os.path.join(negatives_dir_, f"{task}-{split}.jsonl")
