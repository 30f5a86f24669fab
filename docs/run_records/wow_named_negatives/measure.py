"""WoW's training negatives: how often is a top-2 negative a page whose title the dialogue names
(the title, lower-cased, a substring of the lower-cased query text), for BM25's list and for the
list the zero-shot MiniLM mines (its top-110 minus gold pages, as `t5r results` mines it for the
MT-DPR confounders row and the recipe rows' WoW warm-up)? docs/data.md reports its output (output.txt).

    python docs/run_records/wow_named_negatives/measure.py <data_dir> <minilm model_dir> <its index_dir>

`<data_dir>` is the prepared `data/` of a `t5r results` work directory; the model and index are its
`minilm_zeroshot` row's (`model/`, `index/`). Nothing is written.

output.txt ran on 2026-11-29 over a mini-KILT work directory's data and zero-shot index, with a model
directory written by `results.minilm_rows.write_minilm_model_dir` (the same all-MiniLM-L6-v2 weights
as that zero-shot row, whose own copy predated the current checksum records).
"""

import sys

from t5_retrieval.data import layout
from t5_retrieval.data.records import read_negatives
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tasks.examples import task_examples
from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.index import load_index
from t5_retrieval.retrieval.mine import mine_negatives


def main(data_dir: str, model_dir: str, index_dir: str) -> None:
    store = PassageStore.open(layout.kb_dir(data_dir))
    encoder = load_encoder(model_dir)
    examples = task_examples(encoder.tasks, data_dir, "train", ["wow"])["wow"]
    mined = {n.id: n.negatives for n in mine_negatives(encoder, load_index(index_dir), examples, store, k=110)}
    bm25 = read_negatives(layout.negatives_path(layout.negatives_dir(data_dir, "bm25"), "wow", "train"))

    def named(query: str, pid: str) -> bool:
        title = store.get(pid).title.strip().lower()
        return bool(title) and title in query.lower()

    for name, lists in (("BM25", bm25), ("MiniLM-mined", mined)):
        top2 = [(e.query, pid) for e in examples for pid in lists[e.id][:2]]
        share = sum(named(q, p) for q, p in top2) / len(top2)
        print(f"{name}: {len(top2)} top-2 negatives of {len(examples)} WoW training dialogues; "
              f"a page the dialogue names: {share:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
