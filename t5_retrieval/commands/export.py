"""`t5r export`: a model checkpoint + its ScaNN index + the KB -> one TF SavedModel for serving.

    t5r export --checkpoint_dir=run/model --index_dir=run/index --kb_dir=data/kb --output_dir=serving/t5r/1

The output directory must not exist; TF Serving expects numbered versions under the model's base
path (`serving/t5r/1`, `serving/t5r/2`, ...). See docs/export.md for serving and querying it.
"""

from __future__ import annotations

import argparse

from t5_retrieval import logs
from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.commands.outputs import check_output_dir
from t5_retrieval.errors import UserError


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint_dir", required=True, help="trained model directory (t5r train)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--kb_dir", required=True, help="passage store the index was built from")
    parser.add_argument("--output_dir", required=True, help="new SavedModel directory, e.g. <base>/1")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r export")
    logs.setup()

    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.export.savedmodel import export_savedmodel
    from t5_retrieval.inference import DualEncoderInference, load_encoder

    store = PassageStore.open(args.kb_dir)
    encoder = load_encoder(args.checkpoint_dir, step=args.step)
    if not isinstance(encoder, DualEncoderInference):
        raise UserError(f"{args.checkpoint_dir}: a query-side model (queries and passages go through different "
                        "networks); a SavedModel holds one network, so it cannot be exported")
    record = export_savedmodel(encoder, args.index_dir, store, args.output_dir)
    print(f"t5r export: wrote {args.output_dir} (model {record['fingerprint']}, "
          f"{record['index']['num_passages']} passages, tasks {sorted(record['tasks'])})")
    return 0
