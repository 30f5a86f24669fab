"""`t5r export-hf`: flags -> `export.hf.export_hf` (a Hugging Face / sentence-transformers directory)."""

from __future__ import annotations

import argparse

from t5_retrieval import logs
from t5_retrieval.commands.outputs import check_output_dir
from t5_retrieval.export import hf


def main(argv: list[str]) -> int:
    """`t5r export-hf --checkpoint_dir=... --output_dir=... [--step=N]`."""
    parser = argparse.ArgumentParser(prog="t5r export-hf", description=hf.__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", required=True,
                        help="model directory (t5r train, t5r query-side, t5r results; query-side ones too)")
    parser.add_argument("--output_dir", required=True, help="new Hugging Face directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse_args(argv)
    check_output_dir(args.output_dir, "--output_dir", "t5r export-hf")
    logs.setup()
    record = hf.export_hf(args.checkpoint_dir, args.output_dir, args.step)
    layout = ("queries: query_encoder/, passages: passage_encoder/" if record["query_encoder"] != "." else
              "one network")
    st = "SentenceTransformer(dir, trust_remote_code=True)" if record["sentence_transformers"] else "no"
    print(f"t5r export-hf: wrote {args.output_dir} ({record['family']}, {layout}, sentence-transformers: {st}, "
          f"model {record['fingerprint']}, tasks {sorted(record['tasks'])})")
    return 0
