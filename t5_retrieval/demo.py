"""`make demo`: data -> vocabulary -> warm-up -> TACO episode -> encode -> index -> eval table.

    python -m t5_retrieval.demo --data=demo --out=demo_out            # built-in SYNTHETIC data
    python -m t5_retrieval.demo --data=../shared/data/mini_kilt --out=mk_out   # real mini-KILT

Each step is skipped when its output exists, so an interrupted demo resumes where it stopped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from t5_retrieval import gin_utils, logs

FAMILIES = {"demo": "demo", "mini_kilt": "mini_kilt"}
SUMMARY_COLUMNS = ("n", "Rprec", "recall@5", "recall@20")


def summary(tables: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The headline KILT columns per task, plus their unweighted mean over tasks."""
    rows = {task: {c: row[c] for c in SUMMARY_COLUMNS} for task, row in tables.items()}
    rows["mean"] = {c: sum(r[c] for r in rows.values()) / len(rows) for c in SUMMARY_COLUMNS}
    return rows


def _tasks_in(raw_dir: str) -> list[str]:
    suffix = "-train-kilt.jsonl"
    return sorted(os.path.basename(p)[:-len(suffix)] for p in glob.glob(os.path.join(raw_dir, f"*{suffix}")))


def prepare(data: str, out: str) -> tuple[str, str, str]:
    """Builds the data directory and vocabulary; returns (data_dir, vocabulary path, task family)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.demo import write_demo
    from t5_retrieval.data.prepare import prepare_missing
    from t5_retrieval.data.vocab import train_vocabulary

    if data == "demo":
        raw_dir = os.path.join(out, "raw")
        if not os.path.exists(os.path.join(raw_dir, "kb", "pages.jsonl")):
            write_demo(raw_dir)
        family = "demo"
    else:
        raw_dir = os.path.abspath(data)
        family = os.path.basename(os.path.normpath(raw_dir))
        if family not in FAMILIES:
            raise SystemExit(f"--data: expected 'demo' or a directory named one of {sorted(FAMILIES)}, got {data!r}")
    data_dir = os.path.join(out, "data")
    tasks = _tasks_in(raw_dir)
    prepare_missing(os.path.join(raw_dir, "kb", "pages.jsonl"), raw_dir, data_dir, tasks)
    vocab_prefix = os.path.join(data_dir, "spm")
    if not os.path.exists(vocab_prefix + ".model"):
        train_vocabulary(layout.kb_dir(data_dir), vocab_prefix, vocab_size=4096 - 100)
    return data_dir, vocab_prefix + ".model", FAMILIES[family]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="demo", help="'demo' (synthetic) or a KILT-format directory")
    parser.add_argument("--out", default="demo_out")
    args = parser.parse_args(argv)
    logs.setup()
    start = time.time()
    data_dir, vocabulary, family = prepare(args.data, args.out)

    from t5_retrieval.ance import ance
    from t5_retrieval.retrieval.evaluate import format_table

    gin_utils.parse_gin(["runs/demo.gin"], [f"DATA_DIR = '{data_dir}'", f"VOCABULARY = '{vocabulary}'",
                                            f"MIXTURE = '{family}'", f"WARMUP_MIXTURE = '{family}_noprefix'"])
    work_dir = os.path.join(args.out, "ance")
    tables = ance(work_dir)
    with open(os.path.join(work_dir, "warmup", "eval", "results.json")) as f:
        warmup = summary(json.load(f))["mean"]
    source = "SYNTHETIC demo data" if args.data == "demo" else args.data
    print(f"\nDev set, page-level KILT metrics after BM25 warm-up + 1 ANCE episode with TACO ({source}):")
    print(format_table(summary(tables)), end="")
    print(f"(after warm-up only: mean Rprec {warmup['Rprec']:.4f}, recall@20 {warmup['recall@20']:.4f})")
    print(f"(all metrics: {args.out}/ance/episode_1/eval/results.txt; every stage's output under "
          f"{args.out}/ance; total {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
