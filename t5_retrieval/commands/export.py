"""`t5r export`: a model checkpoint + its ScaNN index + the KB -> one TF SavedModel for serving.

    t5r export --checkpoint_dir=run/model --index_dir=run/index --kb_dir=data/kb --output_dir=serving/t5r/1

Every model `t5r train` writes: T5 or BERT (MiniLM), and query-side models (their query encoder;
`--index_dir` is then the base model's index, built from the passage embeddings it trained over).
The output directory must not exist; TF Serving expects numbered versions under the model's base
path (`serving/t5r/1`, `serving/t5r/2`, ...). See docs/export.md for serving and querying it.
"""

from __future__ import annotations

import argparse

from t5_retrieval import logs
from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.commands.outputs import check_output_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", required=True, help="model directory (t5r train, t5r query-side, or a results row)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--index_dir", required=True,
                        help="output of `t5r index` for this model (a query-side model: its base model's)")
    parser.add_argument("--kb_dir", required=True, help="passage store the index was built from")
    parser.add_argument("--output_dir", required=True, help="new SavedModel directory, e.g. <base>/1")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r export")
    logs.setup()

    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.export.savedmodel import export_savedmodel
    from t5_retrieval.inference import load_encoder

    store = PassageStore.open(args.kb_dir)
    encoder = load_encoder(args.checkpoint_dir, step=args.step)
    record = export_savedmodel(encoder, args.index_dir, store, args.output_dir)
    kind = " (query-side: its query encoder)" if record["query_network"]["query_side"] else ""
    print(f"t5r export: wrote {args.output_dir} (model {record['fingerprint']}{kind}, "
          f"{record['index']['num_passages']} passages, tasks {sorted(record['tasks'])})")
    return 0
