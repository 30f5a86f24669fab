"""`t5r encode`: embed the KB with a checkpoint into resumable float shards (see `data.embedding_store`).

Multi-host: run the same command on every host after `jax.distributed.initialize()`; each process
writes its own contiguous range of shards (`jax.process_index()` of `jax.process_count()`), and
`t5r index` starts once all shards exist. Rerunning after an interruption skips finished shards.

`t5r encode --kb_dir=... --output_dir=... (--checkpoint_dir=... | --lexical_baseline_dim=N)`
Shard size, batch size and dtype are gin parameters of `embedding_store.encode_settings`.
"""

from __future__ import annotations

import argparse

from t5_retrieval.data.stores import embedding_store


def _process() -> tuple[int, int]:
    import jax  # Only asked when encoding, and cheap once the model stack is loaded.

    return jax.process_index(), jax.process_count()


def main(argv: list[str]) -> int:
    from t5_retrieval.artefact_io import writable_output_dir
    from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
    from t5_retrieval.commands.inputs import add_encoder_flags, encoder_from_flags
    from t5_retrieval.commands.outputs import EMBEDDINGS, check_output_dir
    from t5_retrieval.data.stores.kb import PassageStore

    parser = argparse.ArgumentParser(prog="t5r encode", description=__doc__.splitlines()[0])
    add_encoder_flags(parser)
    parser.add_argument("--kb_dir", required=True, help="passage store (t5r data kb)")
    parser.add_argument("--output_dir", required=True, help="embeddings directory (resumed if it exists)")
    parser.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r encode", own_kinds=(EMBEDDINGS,))
    with writable_output_dir(args.output_dir, "--output_dir"):
        store = PassageStore.open(args.kb_dir)
        encoder = encoder_from_flags(args)
        process_index, process_count = _process()
        report = embedding_store.write_embeddings(
            encoder, store, store.ids(), args.output_dir, process_index=process_index,
            process_count=process_count, progress=not args.no_progress,
            # The step restored, which is older than --step's absent default when the newest is unreadable.
            meta={"kb_dir": args.kb_dir, "checkpoint_dir": args.checkpoint_dir, "step": encoder.step,
                  "lexical_baseline_dim": args.lexical_baseline_dim},
            **embedding_store.encode_settings())
    state = "complete" if report.complete else "waiting for other processes' shards"
    print(f"t5r encode: process {process_index}/{process_count}: wrote {len(report.shards_written)} shards, "
          f"skipped {len(report.shards_skipped)} already on disk; {state}: {args.output_dir}")
    return 0
