"""`t5r mine`: hard negatives for every training query with the current model (ANCE).

`t5r mine --index_dir=... --data_dir=... --source=ance-1 (--checkpoint_dir=... | --lexical_baseline_dim=N)`
writes `<data_dir>/negatives/<source>/{name}-{split}.jsonl`, named as training reads them: by the
task's dataset when it reads the dataset's examples as written, by its own name when its
preprocessors rewrite the query text (`TaskSpec.negatives_name`; docs/data.md, "File names").
A BM25 index (`t5r index --backend=bm25`) takes no model: it ranks the query texts.
"""

from __future__ import annotations

import argparse

from t5_retrieval.commands.inputs import add_search_flags, load_search_inputs
from t5_retrieval.retrieval.mine import mine_negatives


def main(argv: list[str]) -> int:
    """`t5r mine`: hard negatives for every training query with the current model."""
    from t5_retrieval.artefact_io import writable_output_dir
    from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
    from t5_retrieval.commands.outputs import check_output_dir
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import write_negatives

    parser = argparse.ArgumentParser(prog="t5r mine", description=__doc__.splitlines()[0])
    add_search_flags(parser, default_split="train")
    parser.add_argument("--source", required=True, help="negatives name, e.g. ance-1 (bm25 is the data stage's)")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    out_dir = layout.negatives_dir(args.data_dir, args.source)
    check_output_dir(out_dir, "--data_dir/negatives/--source", "t5r mine")
    with writable_output_dir(out_dir, "--data_dir/negatives/--source"):
        inputs = load_search_inputs(args)
        written: dict[str, str] = {}
        for task, task_examples in inputs.examples.items():
            path = layout.negatives_path(out_dir, inputs.specs[task].negatives_name, args.split)
            if path in written:  # two tasks reading one dataset's text as written share its file
                print(f"t5r mine: {task}: shares {path} with {written[path]}, mined as {written[path]}")
                continue
            count = write_negatives(path, mine_negatives(inputs.encoder, inputs.index, task_examples, inputs.store))
            written[path] = task
            print(f"t5r mine: {task}: {count} queries -> {path}")
    return 0
