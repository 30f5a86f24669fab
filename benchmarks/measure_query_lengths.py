"""The mini-KILT query lengths of `t5_retrieval/data/tasks/shipped.py` and `results/t5_rows.py`, measured.

For every task's train file, the token counts of its queries as the dataset-prefixed Task formats
them (special tokens included), with MiniLM's WordPiece, a T5-sized (32,000-piece) sentencepiece
model trained on the KB as a proxy for T5's (no pretrained T5 vocabulary is installed), and the
3,996-piece one the T5 rows use. A tokenizer's length for a task is TACO's Table 5 length converted
to it (times the task's token ratio to the T5 proxy), or the longest training query when every
query fits in less: no query is cut that the paper's budget would keep whole. Prints the Markdown
table of docs/data.md ("Query lengths") and the entity markers' token counts.

    .venv/bin/python benchmarks/measure_query_lengths.py --mini_kilt /path/to/mini_kilt --work_dir /tmp/lengths
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

from t5_retrieval.data import layout
from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_tasks
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.tasks.shipped import MINI_KILT as DATASETS
from t5_retrieval.data.tasks.shipped import PAPER_QUERY_LEN
from t5_retrieval.data.text import END_ENT, START_ENT, format_query
from t5_retrieval.data.tokenizers.conventions import conventions_of
from t5_retrieval.data.tokenizers.tokenize import encode_batch, load_vocabulary
from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
from t5_retrieval.models.pretrained import minilm_l6_dir
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.t5_rows import T5_VOCAB_SIZE

T5_SIZE = 32_000


def covering_95(counts: np.ndarray) -> int:
    """The smallest length that at least 95% of the counts fit in (reported beside the choice)."""
    return int(np.sort(counts)[math.ceil(0.95 * len(counts)) - 1])


def task_length(counts: np.ndarray, cap: float) -> int:
    """The paper's budget in this tokenizer, or less when even the longest query needs less."""
    return int(min(counts.max(), round(cap)))


def token_counts(vocab, texts: list[str]) -> np.ndarray:
    special = len(conventions_of(vocab).start_ids) + 1
    return np.array([len(ids) + special for ids in encode_batch(vocab, texts)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mini_kilt", required=True)
    parser.add_argument("--work_dir", required=True)
    args = parser.parse_args()
    data_dir = os.path.join(args.work_dir, "data")
    if not os.path.exists(layout.kb_dir(data_dir)):
        prepare_kb(os.path.join(args.mini_kilt, "kb", "passages.jsonl"), data_dir)
        prepare_tasks(args.mini_kilt, data_dir, TASKS, ("train",))
    vocabs = {"WordPiece": load_vocabulary(minilm_l6_dir())}
    for name, size in (("T5 proxy (32k)", T5_SIZE), ("T5 rows (4k)", T5_VOCAB_SIZE)):
        prefix = os.path.join(args.work_dir, f"spm{size}")
        vocabs[name] = load_vocabulary(prefix + ".model" if os.path.exists(prefix + ".model") else
                                       train_vocabulary(layout.kb_dir(data_dir), prefix, size))
    print("| task | Table 5 | " + " | ".join(f"{v} p50 / p95 / max | ratio | cap | length" for v in vocabs) + " |")
    print("|---|---|" + "---|---|---|---|" * len(vocabs))
    for d in DATASETS:
        paper = PAPER_QUERY_LEN[d.task_type]
        path = layout.examples_path(data_dir, d.task.dataset, "train")
        texts = [format_query(e.query, d.task.prefix) for e in read_examples(path)]
        counts = {name: token_counts(vocab, texts) for name, vocab in vocabs.items()}
        cells = []
        for n in counts.values():
            ratio = n.sum() / counts["T5 proxy (32k)"].sum()
            length = task_length(n, paper * ratio)
            cells.append(f"{int(np.median(n))} / {covering_95(n)} / {n.max()} | {ratio:.2f} | {paper * ratio:.0f} | {length}")
        print(f"| {d.task.dataset} | {paper} | " + " | ".join(cells) + " |")
    for name, vocab in vocabs.items():
        print(f"{name}: {START_ENT} and {END_ENT} are {[len(ids) for ids in encode_batch(vocab, [START_ENT, END_ENT])]} tokens")


if __name__ == "__main__":
    main()
