"""HotpotQA: does training toward the first gold page only cost the second (recall@20)?

Two task-specific HotpotQA models from MiniLM, trained as `t5r results`' task-specific row trains its
HotpotQA model (query side over the zero-shot embeddings, 100 steps, seed 0), differing only in which
positives training reads: `first`, each question once with its first gold page's passage (what every
trained row reads by default), and `both`, once per gold page with that page's passage
(`make_train_iterator.positive_passages = {'hotpotqa': 'each'}`, the same BM25 negatives; a
question's two rows do not take each other's positive as a negative). Then, per dev question, the
ranks of its first and second gold page under zero-shot, `first` and `both`, and paired bootstrap
intervals. docs/RESULTS.md reports its output (output.txt).

    python docs/run_records/hotpotqa_gold_pages/experiment.py <work_dir of t5r results> <out_dir>

`<work_dir>` must hold a finished `minilm_zeroshot` row and the prepared `data/`. output.txt is this
script's output (run on 2026-11-29 with a copy of the work directory of the committed records).
"""

import glob
import json
import os
import sys

import numpy as np

from t5_retrieval.data.records import read_examples
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.results.common import dataset_name
from t5_retrieval.results.minilm_rows import TASK_SPECIFIC_STEPS, trained_row
from t5_retrieval.results.significance import paired_bootstrap
from t5_retrieval.retrieval import metrics

EACH_GOLD_PAGE = "make_train_iterator.positive_passages = {'hotpotqa': 'each'}"


def hotpotqa_predictions(row_dir: str) -> dict[str, list[str]]:
    (path,) = [p for p in glob.glob(os.path.join(row_dir, "eval", "predictions", "*.jsonl")) if "hotpotqa" in p]
    with open(path) as f:
        return {str(j["id"]): [p["wikipedia_id"] for p in j["output"][0]["provenance"]] for j in map(json.loads, f)}


def main(work_dir: str, out: str) -> None:
    source, base = os.path.join(work_dir, "data"), os.path.join(work_dir, "minilm_zeroshot")
    task = dataset_name(["mini_kilt_noprefix"], "hotpotqa")
    for name, positives in (("first", ()), ("both", (EACH_GOLD_PAGE,))):
        trained_row("single_task.gin", task, f"TRAIN_STEPS = {TASK_SPECIFIC_STEPS}", *positives)(
            os.path.join(out, name, "row"), source, 0, base)
    store = PassageStore.open(os.path.join(source, "kb"))
    dev = read_examples(os.path.join(source, "examples", "hotpotqa-dev.jsonl"))
    runs = {"zero-shot": base, "first gold page only": os.path.join(out, "first", "row"),
            "both gold pages": os.path.join(out, "both", "row")}
    scores = {}
    for name, row_dir in runs.items():
        ranked = hotpotqa_predictions(row_dir)
        first_rank, second_rank, per_query = [], [], []
        for e in dev:
            first = store.page_of(e.positive_passages[0])
            (second,) = [p for p in e.gold_pages[0] if p != first]
            pages = ranked[e.id]
            first_rank.append(pages.index(first) + 1 if first in pages else len(pages) + 1)
            second_rank.append(pages.index(second) + 1 if second in pages else len(pages) + 1)
            per_query.append(metrics.kilt_scores(e.gold_pages, pages, ks=(20,)))
        scores[name] = {m: np.array([s[m] for s in per_query]) for m in ("Rprec", "recall@20")}
        a, b = np.array(first_rank), np.array(second_rank)
        print(f"{name}: R-prec {scores[name]['Rprec'].mean():.3f}, R@20 {scores[name]['recall@20'].mean():.3f}; "
              f"first gold page in the top 20 {np.mean(a <= 20):.3f} (median rank {np.median(a):.0f}), "
              f"second {np.mean(b <= 20):.3f} (median rank {np.median(b):.0f})")
    for a, b in (("first gold page only", "zero-shot"), ("both gold pages", "zero-shot"),
                 ("both gold pages", "first gold page only")):
        for m in ("Rprec", "recall@20"):
            print(f"{a} - {b}, {m}: {paired_bootstrap({'h': scores[a][m]}, {'h': scores[b][m]}, 10_000)}")
    print(f"{len(dev)} dev questions")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
