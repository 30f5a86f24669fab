"""`t5r export-hf`: flags -> `export.hf.export_hf` (a Hugging Face / sentence-transformers directory)."""

from __future__ import annotations

import argparse

from t5_retrieval import logs
from t5_retrieval.export import hf


def main(argv: list[str]) -> int:
    """`t5r export-hf --checkpoint_dir=... --output_dir=... [--step=N]`."""
    parser = argparse.ArgumentParser(prog="t5r export-hf", description=hf.__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", required=True, help="trained model directory (t5r train)")
    parser.add_argument("--output_dir", required=True, help="new Hugging Face directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    args = parser.parse_args(argv)
    logs.setup()
    record = hf.export_hf(args.checkpoint_dir, args.output_dir, args.step)
    print(f"t5r export-hf: wrote {args.output_dir} ({record['family']}, model {record['fingerprint']}, "
          f"tasks {sorted(record['tasks'])})")
    return 0
