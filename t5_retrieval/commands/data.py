"""`t5r data ...` and `t5r vocab train`: flag parsing over the stage functions in `data.prepare` & co."""

from __future__ import annotations

import argparse
import json
import os

from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.errors import UserError


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def _report(obj) -> None:
    print(json.dumps(obj, indent=1, default=lambda o: o.to_json() if hasattr(o, "to_json") else str(o)))


def kb_main(argv: list[str]) -> int:
    from t5_retrieval.data.kilt.prepare import prepare_kb

    p = argparse.ArgumentParser("t5r data kb", description="Knowledge source -> passage store <data_dir>/kb.")
    p.add_argument("--source", required=True,
                   help="KILT knowledge source jsonl (pages), a passages jsonl, or DPR psgs_w100.tsv")
    p.add_argument("--data_dir", required=True, help="data directory; the passage store is written to <data_dir>/kb")
    p.add_argument("--words_per_passage", type=int, default=100,
                   help="words per passage when whole pages are chunked (ignored for a passages jsonl or tsv)")
    p.add_argument("--passages_per_shard", type=int, default=1_000_000,
                   help="passages per kb/passages-NNNNN.jsonl shard")
    p.add_argument("--overwrite", action="store_true", help="replace an existing <data_dir>/kb")
    a = parse_args(p, argv)
    manifest = prepare_kb(a.source, a.data_dir, words_per_passage=a.words_per_passage,
                          passages_per_shard=a.passages_per_shard, overwrite=a.overwrite)
    print(f"kb: {manifest['num_passages']} passages from {manifest['num_pages']} pages "
          f"in {len(manifest['shards'])} shard(s)")
    return 0


def tasks_main(argv: list[str]) -> int:
    from t5_retrieval.data.kilt.prepare import prepare_tasks

    p = argparse.ArgumentParser("t5r data tasks", description="KILT task files -> <data_dir>/examples.")
    p.add_argument("--input_dir", required=True, help="directory with {task}-{split}-kilt.jsonl files")
    p.add_argument("--data_dir", required=True,
                   help="data directory holding kb/ (t5r data kb); examples are written to <data_dir>/examples")
    p.add_argument("--tasks", type=_csv, required=True, help="comma-separated task names (file stems)")
    p.add_argument("--splits", type=_csv, default=["train", "dev"], help="comma-separated splits to convert")
    p.add_argument("--min_bleu", type=float, default=None, help="drop train provenance with bleu_score below this")
    p.add_argument("--max_train_examples", type=int, default=None, help="downsample train to N examples")
    p.add_argument("--seed", type=int, default=0, help="seed of the --max_train_examples downsampling")
    p.add_argument("--strict", action="store_true", help="fail when a gold page is missing from the KB")
    a = parse_args(p, argv)
    stats = prepare_tasks(a.input_dir, a.data_dir, a.tasks, a.splits, min_bleu=a.min_bleu,
                          max_train_examples=a.max_train_examples, seed=a.seed, strict=a.strict)
    _report(stats)
    return 0


def negatives_main(argv: list[str]) -> int:
    from t5_retrieval import gin_utils
    from t5_retrieval.data import layout
    from t5_retrieval.data.kilt.prepare import prepare_negatives
    from t5_retrieval.data.tasks import retrieval_tasks
    from t5_retrieval.data.tasks.examples import split_examples
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    p = argparse.ArgumentParser("t5r data negatives", description="BM25 hard negatives -> <data_dir>/negatives/bm25.")
    p.add_argument("--data_dir", required=True,
                   help="data directory holding kb/ and examples/; negatives go to <data_dir>/negatives/bm25")
    p.add_argument("--tasks", type=_csv, required=True,
                   help="comma-separated datasets with examples files (t5r data tasks), written to {dataset}-{split}.jsonl, "
                        "or registered seqio Tasks (their query text after their preprocessors), written to "
                        "{task}-{split}.jsonl for a Task whose preprocessors rewrite it, else to its dataset's file")
    p.add_argument("--splits", type=_csv, default=["train"], help="comma-separated splits to mine negatives for")
    p.add_argument("--top_k", type=int, default=100,
                   help="BM25 passages retrieved per query; those of its gold pages are dropped, the rest kept")
    p.add_argument("--task_module", action="append", default=[], metavar="NAME",
                   help="import this module that registers your seqio Tasks (repeatable), as "
                        "--gin.MIXTURE_OR_TASK_MODULE does")
    a = parse_args(p, argv, reads=TASK_MODULE)
    gin_utils.import_modules(a.task_module)
    retrieval_tasks.set_data_dir(a.data_dir)  # a Task over `kilt_examples_source` reads this directory
    sources: dict[str, tuple[str, str]] = {}  # file name -> (dataset, Task) whose negatives it holds
    for name in a.tasks:
        spec = retrieval_tasks.file_or_task(name)
        sources.setdefault(spec.negatives_name, (spec.dataset, spec.name))
    _report(prepare_negatives(a.data_dir, list(sources), a.splits, top_k=a.top_k,
                              index=build_bm25_index_for_kb(layout.kb_dir(a.data_dir)),
                              read=lambda name, split: split_examples(a.data_dir, *sources[name], split)))
    return 0


def demo_main(argv: list[str]) -> int:
    from t5_retrieval.data.kilt.synthetic import write_demo

    p = argparse.ArgumentParser("t5r data demo", description="Write the SYNTHETIC KILT-format demo data.")
    p.add_argument("--out", required=True,
                   help="directory to write: kb/pages.jsonl and {task}-{split}-kilt.jsonl files")
    p.add_argument("--num_pages", type=int, default=300, help="invented pages in the knowledge source")
    p.add_argument("--train_per_task", type=int, default=160, help="train examples per task")
    p.add_argument("--dev_per_task", type=int, default=40, help="dev examples per task")
    p.add_argument("--seed", type=int, default=0, help="seed of the generator")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    a = parse_args(p, argv)
    _report(write_demo(a.out, num_pages=a.num_pages, train_per_task=a.train_per_task,
                       dev_per_task=a.dev_per_task, seed=a.seed, overwrite=a.overwrite))
    return 0


def download_main(argv: list[str]) -> int:
    from t5_retrieval.data.kilt.download import KILT_BASE_URL, download_kilt

    p = argparse.ArgumentParser("t5r data download-kilt", description="Download official KILT files (resumable).")
    p.add_argument("--out", required=True, help="directory to download into (SHA256SUMS is kept there)")
    p.add_argument("--files", type=_csv, default=[],
                   help="file names, e.g. fever-train-kilt.jsonl,fever-dev-kilt.jsonl")
    p.add_argument("--knowledge_source", action="store_true", help="also fetch kilt_knowledgesource.json")
    p.add_argument("--base_url", default=KILT_BASE_URL, help="URL the file names are appended to")
    a = parse_args(p, argv)
    names = list(a.files) + (["kilt_knowledgesource.json"] if a.knowledge_source else [])
    if not names:
        raise UserError("nothing to download: pass --files and/or --knowledge_source")
    _report(download_kilt(names, a.out, base_url=a.base_url))
    return 0


def slice_main(argv: list[str]) -> int:
    from t5_retrieval.data.kilt import demo_slice as kilt_slice

    p = argparse.ArgumentParser(
        "t5r data slice", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Unpack the shipped real-data demo slice of mini-KILT (KILT-format task files and kb/passages.jsonl) "
                    "to <out>/mini_kilt_slice, or, with --mini_kilt, rebuild the slice's archive.\n\n"
                    + kilt_slice.__doc__)
    p.add_argument("--out", required=True,
                   help="the directory to unpack the slice under; with --mini_kilt, the .tar.gz to write")
    p.add_argument("--mini_kilt", default=None, help="rebuild the archive from this mini-KILT directory (train/dev "
                                                      "files and kb/)")
    a = p.parse_args(argv)
    if a.mini_kilt is None:
        target = kilt_slice.extract(kilt_slice.SHIPPED, a.out)
        with open(os.path.join(target, "stats.json"), encoding="utf-8") as f:
            stats = json.load(f)
        print(f"{target}: the demo slice of mini-KILT, tasks {', '.join(stats['tasks'])} over {stats['kb_pages']} "
              f"pages; next: t5r data kb --source={os.path.join(target, 'kb', 'passages.jsonl')} --data_dir=data, "
              f"then t5r data tasks --input_dir={target} --data_dir=data --tasks={','.join(stats['tasks'])}")
        return 0
    files = kilt_slice.build_slice(a.mini_kilt)
    kilt_slice.write_archive(files, a.out)
    stats = json.loads(files["stats.json"])
    print(f"{a.out}: {os.path.getsize(a.out) / 2**20:.2f} MiB, {stats['kb_pages']} KB pages "
          f"({stats['gold_pages']} gold), tasks {stats['tasks']}")
    return 0


def vocab_main(argv: list[str]) -> int:
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary

    p = argparse.ArgumentParser("t5r vocab train", description="Train a T5-convention sentencepiece model on a KB.")
    p.add_argument("--kb", required=True, help="passage store directory (<data_dir>/kb)")
    p.add_argument("--out", required=True, help="model path prefix; writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab_size", type=int, default=8000, help="pieces in the vocabulary (a soft limit: fewer on a small KB)")
    p.add_argument("--max_sentences", type=int, default=1_000_000,
                   help="train on at most this many passages, the store's first")
    a = parse_args(p, argv)
    path = train_vocabulary(a.kb, a.out, vocab_size=a.vocab_size, max_sentences=a.max_sentences)
    print(f"vocabulary: {path}")
    return 0
