"""What the retrieval commands share: which encoder (`--checkpoint_dir` or the lexical baseline),
and for searching commands which KB, examples and index, opened and checked against each other."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.encoder import Encoder, HashedBagOfWordsEncoder
from t5_retrieval.retrieval.evaluate import load_task_examples
from t5_retrieval.retrieval.index import Index


def add_encoder_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every retrieval CLI uses to choose its query/passage encoder."""
    parser.add_argument("--checkpoint_dir", help="model directory (t5r train, t5r query-side, or a results row)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--lexical_baseline_dim", type=int, default=None,
                        help="use the hashed bag-of-words baseline of this dim instead of a checkpoint")


def encoder_from_flags(args: argparse.Namespace) -> Encoder:
    if (args.checkpoint_dir is None) == (args.lexical_baseline_dim is None):
        raise SystemExit("give exactly one of --checkpoint_dir and --lexical_baseline_dim")
    if args.lexical_baseline_dim is not None:
        return HashedBagOfWordsEncoder(args.lexical_baseline_dim)
    try:
        return load_encoder(args.checkpoint_dir, step=args.step)
    except ValueError as e:  # e.g. --step given for a query-side model
        raise SystemExit(str(e)) from None


@dataclasses.dataclass
class SearchInputs:
    """What `t5r eval` and `t5r mine` both start from, checked against each other."""

    store: Any  # data.kb.PassageStore
    examples: dict[str, list[Any]]
    index: Index
    encoder: Encoder


def add_search_flags(parser: argparse.ArgumentParser, default_split: str) -> None:
    """Flags shared by the CLIs that search an index with a query encoder over task examples."""
    add_encoder_flags(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--data_dir", required=True, help="processed data (examples/, kb/, negatives/)")
    parser.add_argument("--kb_dir", default=None, help="passage store (default: <data_dir>/kb)")
    parser.add_argument("--tasks", default="", help="comma-separated tasks (default: all found)")
    parser.add_argument("--split", default=default_split)


def load_search_inputs(args: argparse.Namespace) -> SearchInputs:
    """Opens the KB, examples, index and encoder of `add_search_flags`; refuses a mismatched index.

    Raises DataError or IndexMismatchError naming the file or field at fault.
    """
    from t5_retrieval.data import layout
    from t5_retrieval.data.kb import PassageStore

    store = PassageStore.open(args.kb_dir or layout.kb_dir(args.data_dir))
    examples = load_task_examples(args.data_dir, args.split, [t for t in args.tasks.split(",") if t])
    index = Index.load(args.index_dir)
    encoder = encoder_from_flags(args)
    index.check(encoder, store.ids())
    return SearchInputs(store, examples, index, encoder)
