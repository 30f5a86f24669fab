"""Queries an exported t5r SavedModel the way a serving process would: plain TensorFlow only.

    python query_savedmodel.py SAVEDMODEL_DIR REQUESTS_JSON

REQUESTS_JSON is a list of {"signature": "search"|"encode", "query": [...], "task": [...], "k": int};
prints one JSON list with, per request, the signature's outputs as lists, or {"error": message}.
No t5_retrieval import: only TensorFlow plus the custom-op libraries a model server must load
(tensorflow_text's sentencepiece ops, ScaNN's ops).
"""

import json
import sys

import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the SentencepieceOp kernels)
from scann.scann_ops.py import scann_ops  # noqa: F401  (loads ScaNN's TF op library)


def main(savedmodel_dir: str, requests_path: str) -> None:
    model = tf.saved_model.load(savedmodel_dir)
    with open(requests_path) as f:
        requests = json.load(f)
    out = []
    for request in requests:
        fn = model.signatures[request["signature"]]
        kwargs = {"query": tf.constant(request["query"], tf.string), "task": tf.constant(request["task"], tf.string)}
        if "k" in request:
            kwargs["k"] = tf.constant(request["k"], tf.int32)
        try:
            result = fn(**kwargs)
        except tf.errors.InvalidArgumentError as e:
            out.append({"error": e.message})
            continue
        out.append({name: (value.numpy().astype(str) if value.dtype == tf.string else value.numpy()).tolist()
                    for name, value in result.items()})
    assert not any(m.startswith("t5_retrieval") for m in sys.modules), "the client must not need t5_retrieval"
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
