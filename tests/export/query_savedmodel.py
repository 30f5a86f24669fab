"""Queries an exported t5r SavedModel the way a serving process would: plain TensorFlow only.

    python query_savedmodel.py SAVEDMODEL_DIR REQUESTS_JSON

REQUESTS_JSON is a list of {"signature": "search"|"encode", "query": [...], "task": [...], "k": int,
"session": bool, "savedmodel": another SavedModel directory to ask instead}; prints one JSON list
with, per request, the signature's outputs as lists, or {"error": message}. Requests with
"session": true are answered twice, like a model server does it: TF1 `saved_model.loader.load`
into a graph-mode Session (the C++ loader TF Serving uses works the same way: the graph, its init
op for the tables, the signature's tensor names), then `Session.run`.
No t5_retrieval import: only TensorFlow plus the custom-op libraries a model server must load
(tensorflow_text's sentencepiece, WordPiece and normalisation ops, ScaNN's ops).
"""

import json
import sys

import numpy as np
import tensorflow as tf
import tensorflow_text  # noqa: F401  (registers the sentencepiece, WordPiece and regex_split kernels)
from scann.scann_ops.py import scann_ops  # noqa: F401  (loads ScaNN's TF op library)


def _tolist(value):
    value = value.numpy() if hasattr(value, "numpy") else value
    if value.dtype.kind in "SO":  # UTF-8 bytes (titles, ids): numpy's astype(str) would decode them as ASCII
        return np.vectorize(lambda b: b.decode("utf-8") if isinstance(b, bytes) else str(b), otypes=[object])(
            value).tolist()
    return value.tolist()


def run_in_session(savedmodel_dir: str, request: dict) -> dict:
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], savedmodel_dir)
        signature = meta.signature_def[request["signature"]]
        feeds = {signature.inputs[name].name: value for name, value in request.items() if name in signature.inputs}
        fetches = {name: info.name for name, info in signature.outputs.items()}
        first, second = sess.run(fetches, feeds), sess.run(fetches, feeds)
    assert all((first[n] == second[n]).all() for n in fetches), "a second Session.run answered differently"
    return {name: _tolist(value) for name, value in first.items()}


def main(savedmodel_dir: str, requests_path: str) -> None:
    models = {}
    with open(requests_path) as f:
        requests = json.load(f)
    out = []
    for request in requests:
        directory = request.get("savedmodel", savedmodel_dir)
        if request.get("session"):
            out.append(run_in_session(directory, request))
            continue
        if directory not in models:
            models[directory] = tf.saved_model.load(directory)
        fn = models[directory].signatures[request["signature"]]
        kwargs = {"query": tf.constant(request["query"], tf.string), "task": tf.constant(request["task"], tf.string)}
        if "k" in request:
            kwargs["k"] = tf.constant(request["k"], tf.int32)
        try:
            result = fn(**kwargs)
        except tf.errors.InvalidArgumentError as e:
            out.append({"error": e.message})
            continue
        out.append({name: _tolist(value) for name, value in result.items()})
    assert not any(m.startswith("t5_retrieval") for m in sys.modules), "the client must not need t5_retrieval"
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
