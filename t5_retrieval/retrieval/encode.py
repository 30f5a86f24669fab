"""`t5r encode`: embed the KB with a checkpoint into resumable float shards (see `embeddings`).

Multi-host: run the same command on every host after `jax.distributed.initialize()`; each process
writes its own contiguous range of shards (`jax.process_index()` of `jax.process_count()`), and
`t5r index` starts once all shards exist. Rerunning after an interruption skips finished shards.

`t5r encode --kb_dir=... --output_dir=... (--checkpoint_dir=... | --lexical_baseline_dim=N)`
Shard size, batch size and dtype are gin parameters of `encode_settings`.
"""

from __future__ import annotations

import argparse
import sys

import gin

from t5_retrieval.retrieval import embeddings


@gin.configurable
def encode_settings(shard_size: int = 50_000, batch_size: int = 1024, dtype: str = "float32") -> dict:
    """Keyword arguments for `embeddings.write_embeddings`: rows per shard file, passages per encoder
    call and stored dtype (float32 or float16). One gin-configurable place, shared by `t5r encode`
    and the ANCE orchestrator. The encoder sorts each call's passages by length and cuts its device
    batches to their longest row, so larger calls waste less padding (mini-KILT: 62% of the
    full-width cost at 256 passages per call, 52% at 1024)."""
    return {"shard_size": shard_size, "batch_size": batch_size, "dtype": dtype}


def _process() -> tuple[int, int]:
    import jax  # Only asked when encoding, and cheap once the model stack is loaded.

    return jax.process_index(), jax.process_count()


def main(argv: list[str]) -> int:
    from t5_retrieval import gin_utils
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.records import DataError
    from t5_retrieval.retrieval.encoder import add_encoder_flags, encoder_from_flags

    parser = argparse.ArgumentParser(prog="t5r encode", description=__doc__.splitlines()[0])
    add_encoder_flags(parser)
    parser.add_argument("--kb_dir", required=True, help="passage store (t5r data kb)")
    parser.add_argument("--output_dir", required=True, help="embeddings directory (resumed if it exists)")
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    args = gin_utils.parse_args(parser, argv)
    try:
        store = PassageStore.open(args.kb_dir)
        encoder = encoder_from_flags(args)
        process_index, process_count = _process()
        report = embeddings.write_embeddings(
            encoder, store, store.ids(), args.output_dir, process_index=process_index,
            process_count=process_count, progress=not args.no_progress,
            meta={"kb_dir": args.kb_dir, "checkpoint_dir": args.checkpoint_dir, "step": args.step,
                  "lexical_baseline_dim": args.lexical_baseline_dim},
            **encode_settings())
    except (DataError, embeddings.EmbeddingsError) as e:
        print(f"t5r encode: error: {e}", file=sys.stderr)
        return 2
    state = "complete" if report.complete else "waiting for other processes' shards"
    print(f"t5r encode: process {process_index}/{process_count}: wrote {len(report.shards_written)} shards, "
          f"skipped {len(report.shards_skipped)} already on disk; {state}: {args.output_dir}")
    return 0
