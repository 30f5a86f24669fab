"""What verifying artefacts costs: hashing a passage store, its embeddings and its index, against
loading them, and the projection to the full KILT knowledge source.

Each artefact is timed three ways in the same run, round-robin: loading it with verification off
(the reference), a full verification (every byte hashed: the first open after a copy, and what
`t5r checksum` does), and a verification against the stamp (the stat of each file, what every later
open costs). Embedding shards have no stamp: they are hashed whenever they are read, by an index
build or a training run over stored embeddings, which read every byte anyway. The full-KILT
projection scales the measured hashing rate to its sizes: 36M passages (at this store's bytes per
passage), their 768-dim float32 embeddings, and an index of the same size.

    .venv/bin/python benchmarks/bench_checksums.py --kb <data>/kb --embeddings <row>/embeddings --index <row>/index

Without arguments it builds a store, 384-dim embeddings (MiniLM's size, from the lexical encoder) and
an exact index over the shipped demo slice.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common

FULL_KILT_PASSAGES = 36_000_000
FULL_KILT_DIM = 768


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


@contextlib.contextmanager
def verification_off():
    """The loaders with `checksums.verify` and `verify_file` doing nothing: the reference load time."""
    from t5_retrieval import checksums

    saved = checksums.verify, checksums.verify_file
    checksums.verify = checksums.verify_file = lambda *a, **k: None
    try:
        yield
    finally:
        checksums.verify, checksums.verify_file = saved


def demo_artefacts(tmp: str) -> tuple[str, str, str]:
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import PassageStore, build_kb
    from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder
    from t5_retrieval.retrieval.index import build_index

    kb, emb, index = (os.path.join(tmp, name) for name in ("kb", "emb", "index"))
    build_kb(os.path.join(common.demo_slice(), "kb", "passages.jsonl"), kb)
    store = PassageStore.open(kb)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=384), store, store.ids(), emb, progress=False)
    build_index(emb, backend="exact").save(index)
    return kb, emb, index


def main() -> int:
    from t5_retrieval import checksums
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.retrieval.index import load_index

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kb")
    parser.add_argument("--embeddings")
    parser.add_argument("--index")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        kb, emb, index = (args.kb, args.embeddings, args.index) if args.kb else demo_artefacts(tmp)

        def load_store():
            store = PassageStore.open(kb)
            store.ids()
            store.passages_by_page()

        def verify_shards():
            for _ in embedding_store.iter_shards(emb):
                pass

        artefacts = {
            "passage store": (kb, load_store, lambda full: checksums.verify(kb, "passage store", "", full=full)),
            "embeddings": (emb, lambda: embedding_store.load_matrix(emb), lambda full: verify_shards()),
            "index": (index, lambda: load_index(index), lambda full: checksums.verify(index, "index", "", full=full)),
        }
        result, parts = {"artefacts": {}}, []
        for name, (path, load, verify) in artefacts.items():
            def reference(load=load):
                with verification_off():
                    load()

            candidates = {"load": reference, "full": lambda v=verify: v(True)}
            if name != "embeddings":  # shards are hashed whenever they are read: no stamp to check
                candidates["stamped"] = lambda v=verify: v(False)
            times = common.interleaved_times(candidates, args.repeats)
            median = {k: statistics.median(v) for k, v in times.items()}
            size = directory_bytes(path)
            result["artefacts"][name] = {"bytes": size, **{f"{k}_s": v for k, v in median.items()},
                                         "full_vs_load": median["full"] / median["load"],
                                         "hash_mb_per_s": size / 2**20 / median["full"]}
            stamped = f", stamped {1000 * median['stamped']:.1f} ms" if "stamped" in median else ", hashed at every load"
            parts.append(f"{name} {size / 2**20:.0f} MiB: load {median['load']:.3f} s, full verify "
                         f"{median['full']:.3f} s ({median['full'] / median['load']:.1f}x load){stamped}")
        store = PassageStore.open(kb)
        rate = statistics.median(a["hash_mb_per_s"] for a in result["artefacts"].values()) * 2**20
        full_kilt = {"passage store": result["artefacts"]["passage store"]["bytes"] / len(store) * FULL_KILT_PASSAGES,
                     "embeddings": FULL_KILT_PASSAGES * FULL_KILT_DIM * 4,
                     "index": FULL_KILT_PASSAGES * FULL_KILT_DIM * 4}
        result["full_kilt_projection_s"] = {name: size / rate for name, size in full_kilt.items()}
        total = sum(result["full_kilt_projection_s"].values())
        summary = "; ".join(parts) + (f"; full KILT (36M passages, 768-dim): a full verification of all three "
                                      f"~{total / 60:.0f} min at {rate / 2**30:.2f} GiB/s")
        common.write_results("checksums", {**result, **common.machine_info(passages=len(store))}, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
