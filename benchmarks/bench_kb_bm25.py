"""KB build (chunk + sharded write) and BM25 indexing time on the mini-KILT knowledge source.

Reference timed in the same run: just parsing the source jsonl, so the ratios say what chunking,
writing and indexing cost on top of reading the data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from t5_retrieval.data.records import read_jsonl
    from t5_retrieval.data.stores.kb import build_kb
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    p = argparse.ArgumentParser()
    p.add_argument("--source", default=None, help="a KILT knowledge source or passages jsonl, e.g. mini-KILT's "
                   "kb/pages.jsonl; default: the shipped demo slice's kb/passages.jsonl")
    a = p.parse_args()
    start = time.perf_counter()
    if a.source is None:
        import common

        a.source = os.path.join(common.demo_slice(), "kb", "passages.jsonl")
    pages = sum(1 for _ in read_jsonl(a.source))
    read_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        manifest = build_kb(a.source, os.path.join(tmp, "kb"))
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        build_bm25_index_for_kb(os.path.join(tmp, "kb"))
        index_s = time.perf_counter() - start
    result = {"pages": pages, "passages": manifest["num_passages"], "read_s": read_s, "kb_build_s": build_s,
              "bm25_index_s": index_s, "build_vs_read": build_s / read_s, "index_vs_read": index_s / read_s,
              "passages_per_s_build": manifest["num_passages"] / build_s}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "kb_bm25.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"kb_bm25: {manifest['num_passages']} passages, build {build_s:.1f}s ({build_s / read_s:.1f}x read), "
          f"BM25 index {index_s:.1f}s ({index_s / read_s:.1f}x read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
